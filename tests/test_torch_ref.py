"""torch_ref against a float64 brute force written independently here: slots gathered by hand
from req_to_token, explicit loops over lanes, heads and tokens, its own copy of the pool.

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``); this file keeps the ones specific to torch_ref: the
reference itself against an oracle that does not share its code."""

from __future__ import annotations

import math

import pytest
import torch

from specattn import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from specattn.allocator import PagedKVAllocator
from specattn.backends.torch_ref import (
    TorchRefDecode,
    TorchRefExtend,
    reference_decode,
    reference_extend,
)

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}
MODELS = {
    "mha": dict(mla=False, q_heads=2, kv_heads=2, head_dim=16),
    "gqa": dict(mla=False, q_heads=4, kv_heads=2, head_dim=16, v_head_dim=8),
    "mla": dict(mla=True, heads=4, rank=32, rope=8),
}


def _runner(model: str, dtype, page_size: int, num_layers: int = 2) -> DraftRunner:
    cfg = MODELS[model]
    kw = dict(num_layers=num_layers, num_slots=1024, max_reqs=8, max_context_len=256,
              page_size=page_size, dtype=dtype)
    if cfg["mla"]:
        return DraftRunner.mla(cfg["heads"], cfg["rank"], cfg["rope"], **kw)
    return DraftRunner.mha(cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"],
                           cfg.get("v_head_dim"), **kw)


def _pools(runner):
    return [runner.kv_buffer] if runner.use_mla_backend else [runner.k_buffer,
                                                              runner.v_buffer]


def _fill_pools(runner, alloc):
    """Random KV in the slots of live requests, NaN everywhere else: reading a wrong slot
    poisons the output."""
    live = torch.zeros(runner.num_slots, dtype=torch.bool)
    for req in alloc.active_requests:
        live[runner.req_to_token[req, :alloc.seq_len(req)].long()] = True
    for pool in _pools(runner):
        for buf in pool:
            buf.copy_(torch.randn(buf.shape).to(buf.dtype))
            buf[~live] = float("nan")


def _qkv(runner, rows):
    dt = runner.dtype
    if runner.use_mla_backend:
        w = runner.kv_lora_rank + runner.qk_rope_head_dim
        return (torch.randn(rows, runner.num_heads, w).to(dt), torch.randn(rows, w).to(dt),
                None)
    return (torch.randn(rows, runner.num_q_heads, runner.head_dim).to(dt),
            torch.randn(rows, runner.num_kv_heads, runner.head_dim).to(dt),
            torch.randn(rows, runner.num_kv_heads, runner.v_head_dim).to(dt))


# --- brute force ---------------------------------------------------------------------------


class BruteForce:
    """float64 copy of the pool plus explicit-loop attention."""

    def __init__(self, runner):
        self.r = runner
        self.pools = [[buf.double().clone() for buf in pool] for pool in _pools(runner)]

    def write(self, layer_id, slots, k, v):
        for n, s in enumerate(slots):
            if self.r.use_mla_backend:
                self.pools[0][layer_id][s] = k[n].double()
            else:
                self.pools[0][layer_id][s] = k[n].double()
                self.pools[1][layer_id][s] = v[n].double()

    def attend(self, layer, q, slots):
        """q: [H, D] (one token); slots: a Python list. Returns [H, D_v] float64."""
        r = self.r
        out = []
        for h in range(q.shape[0]):
            scores, values = [], []
            for s in slots:
                if r.use_mla_backend:
                    key = self.pools[0][layer.layer_id][s]
                    val = key[:r.kv_lora_rank]
                else:
                    kvh = h // (r.num_q_heads // r.num_kv_heads)
                    key = self.pools[0][layer.layer_id][s, kvh]
                    val = self.pools[1][layer.layer_id][s, kvh]
                x = layer.scaling * float(torch.dot(q[h].double(), key))
                if layer.logit_cap > 0:
                    x = layer.logit_cap * math.tanh(x / layer.logit_cap)
                scores.append(x)
                values.append(val)
            m = max(scores)
            w = torch.tensor([math.exp(x - m) for x in scores], dtype=torch.float64)
            out.append((w[:, None] * torch.stack(values)).sum(0) / w.sum())
        return torch.stack(out)


def _ancestor_slots(loc, parents, b, j, step):
    """Slots of lane j's tree path at `step`, following parents by hand."""
    chain, lane = [], j
    for t in range(step, -1, -1):
        chain.append(int(loc[b, lane, t]))
        if t > 0:
            lane = int(parents[t, b, lane])
    return chain[::-1]


def _decode_round(runner, lengths, topk, num_steps, tree_mode, layers, gen=None):
    """Run a whole draft round through TorchRefDecode and the brute force; returns the
    per-step, per-layer (torch_ref output, brute-force output) pairs."""
    alloc = PagedKVAllocator(runner)
    reqs = [alloc.new_request() for _ in lengths]
    for req, L in zip(reqs, lengths):
        alloc.extend(req, L)
    _fill_pools(runner, alloc)
    rpi = torch.tensor(reqs)
    seq = alloc.seq_lens(reqs)
    loc = alloc.alloc_draft(rpi, topk, num_steps)
    B, K = len(lengths), topk
    parents = None
    if tree_mode == "path":
        parents = torch.zeros(num_steps, B, K, dtype=torch.int64)
    batch = DraftBatch(rpi, seq, loc, parents)
    backend = TorchRefDecode(runner, topk, num_steps, tree_mode=tree_mode)
    backend.init_forward_metadata(batch)
    bf = BruteForce(runner)  # after alloc_draft: duplicated pages already copied
    results = []
    for step in range(num_steps):
        if parents is not None and step > 0:
            # Filled in place before the step, like serving code after its top-k.
            parents[step] = torch.randint(0, K, (B, K))
        for layer in layers:
            q, k, v = _qkv(runner, B * K)
            o = backend.forward(step, layer, q, k, v)
            bf.write(layer.layer_id, loc[:, :, step].reshape(-1).tolist(), k, v)
            ref = torch.empty(B * K, *o.shape[1:], dtype=torch.float64)
            for b in range(B):
                row = runner.req_to_token[int(rpi[b])]
                prefix = [int(row[x]) for x in range(int(seq[b]))]
                for j in range(K):
                    if tree_mode == "lane":
                        hist = [int(loc[b, j, t]) for t in range(step + 1)]
                    else:
                        hist = _ancestor_slots(loc, parents, b, j, step)
                    ref[b * K + j] = bf.attend(layer, q[b * K + j], prefix + hist)
            results.append((o, ref, (q, step, layer)))
    return backend, batch, results


def _check(o, ref, dtype):
    assert o.dtype == dtype
    assert torch.isfinite(o).all()
    tol = TOL[dtype]
    torch.testing.assert_close(o.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("tree_mode", ["lane", "path"])
@pytest.mark.parametrize("model", list(MODELS))
def test_decode_matches_brute_force(model, tree_mode, topk, page_size, dtype):
    torch.manual_seed(hash((model, tree_mode, topk, page_size, str(dtype))) % 2 ** 31)
    runner = _runner(model, dtype, page_size)
    lengths = [5, 21, 3] if topk == 1 else [5, 19]
    layers = [AttentionLayer(1, 0.3)]
    _, _, results = _decode_round(runner, lengths, topk, 3, tree_mode, layers)
    for o, ref, _ in results:
        _check(o, ref, dtype)


@pytest.mark.parametrize("model", ["gqa", "mla"])
def test_decode_fp32_uniform_two_layers(model):
    torch.manual_seed(7)
    runner = _runner(model, torch.float32, 16)
    layers = [AttentionLayer(0, 0.25), AttentionLayer(1, 0.5)]
    _, _, results = _decode_round(runner, [18, 18], 2, 3, "path", layers)
    for o, ref, _ in results:
        _check(o, ref, torch.float32)


@pytest.mark.parametrize("model", ["gqa", "mla"])
def test_decode_logit_cap(model):
    torch.manual_seed(11)
    runner = _runner(model, torch.float32, 1)
    capped = AttentionLayer(0, 1.0, logit_cap=2.0)
    backend, batch, results = _decode_round(runner, [9, 14], 2, 2, "lane", [capped])
    for o, ref, (q, step, _) in results:
        _check(o, ref, torch.float32)
        # The cap must matter at this scale: the uncapped answer is different.
        plain = reference_decode(runner, AttentionLayer(0, 1.0), q, batch, step, "lane")
        assert (plain - o).abs().max() > 1e-2


def test_path_differs_from_lane_when_parents_cross():
    """Same pool and queries: path mode follows parents, lane mode does not."""
    torch.manual_seed(5)
    runner = _runner("gqa", torch.float32, 1)
    layer = AttentionLayer(0, 0.5)
    backend, batch, results = _decode_round(runner, [6, 10], 3, 3, "path", [layer])
    batch.parents[1:] = torch.tensor([1, 2, 0]).expand(2, 2, 3)  # never its own lane
    q, step, _ = results[-1][2]
    path = reference_decode(runner, layer, q, batch, 2, "path")
    lane = reference_decode(runner, layer, q, batch, 2, "lane")
    assert (path - lane).abs().max() > 1e-3


def test_path_explicit_tree_single_request():
    """A hand-built tree: with parents[t][j] = (j + 1) % K the step-2 path of lane 0 is
    lane 1's step-1 slot, then lane 2's step-0 slot."""
    torch.manual_seed(9)
    runner = _runner("mha", torch.float32, 1, num_layers=1)
    alloc = PagedKVAllocator(runner)
    req = alloc.new_request()
    alloc.extend(req, 4)
    _fill_pools(runner, alloc)
    rpi, seq = torch.tensor([req]), alloc.seq_lens([req])
    loc = alloc.alloc_draft(rpi, 3, 3)
    for pool in _pools(runner):
        pool[0][loc.reshape(-1).long()] = torch.randn(9, *pool[0].shape[1:])
    parents = torch.tensor([[0, 1, 2], [1, 2, 0], [1, 2, 0]])[:, None, :]
    batch = DraftBatch(rpi, seq, loc, parents)
    layer = AttentionLayer(0, 0.5)
    q, _, _ = _qkv(runner, 3)
    o = reference_decode(runner, layer, q, batch, 2, "path")
    bf = BruteForce(runner)
    prefix = runner.req_to_token[req, :4].tolist()
    expected_paths = [
        [int(loc[0, 2, 0]), int(loc[0, 1, 1]), int(loc[0, 0, 2])],  # 0 <- 1 <- 2
        [int(loc[0, 0, 0]), int(loc[0, 2, 1]), int(loc[0, 1, 2])],  # 1 <- 2 <- 0
        [int(loc[0, 1, 0]), int(loc[0, 0, 1]), int(loc[0, 2, 2])],  # 2 <- 0 <- 1
    ]
    for j, path in enumerate(expected_paths):
        torch.testing.assert_close(o[j].double(), bf.attend(layer, q[j], prefix + path),
                                   atol=1e-5, rtol=1e-5)


# --- extend --------------------------------------------------------------------------------


def _extend_setup(runner, prefix_lens, ext_lens):
    alloc = PagedKVAllocator(runner)
    reqs = [alloc.new_request() for _ in prefix_lens]
    for req, L in zip(reqs, prefix_lens):
        alloc.extend(req, L)
    _fill_pools(runner, alloc)
    # The caller puts the new tokens' slots into req_to_token before the extend.
    new = torch.cat([alloc.extend(req, E) for req, E in zip(reqs, ext_lens)])
    batch = DraftExtendBatch(torch.tensor(reqs), alloc.seq_lens(reqs),
                             torch.tensor(ext_lens), new)
    return alloc, batch


def _extend_brute(bf, runner, layer, q, batch, counted_twice=False):
    out, start = [], 0
    for b in range(batch.batch_size):
        row = runner.req_to_token[int(batch.req_pool_indices[b])]
        L, E = int(batch.seq_lens[b]), int(batch.extend_lens[b])
        for t in range(E):
            if counted_twice:
                # Old upstream Triton mistake: the prefix list covered all of L' and the
                # new tokens 0..t were attended again from the separate k/v.
                slots = [int(row[x]) for x in range(L)] + [int(row[L - E + u])
                                                           for u in range(t + 1)]
            else:
                slots = [int(row[x]) for x in range(L - E + t + 1)]
            out.append(bf.attend(layer, q[start + t], slots))
        start += E
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("model", list(MODELS))
def test_extend_matches_brute_force(model, page_size, dtype):
    torch.manual_seed(hash((model, page_size, str(dtype))) % 2 ** 31)
    runner = _runner(model, dtype, page_size)
    alloc, batch = _extend_setup(runner, [7, 0, 30], [3, 1, 4])
    backend = TorchRefExtend(runner)
    backend.init_forward_metadata(batch)
    bf = BruteForce(runner)
    for layer in (AttentionLayer(0, 0.4), AttentionLayer(1, 0.2, logit_cap=3.0)):
        q, k, v = _qkv(runner, 8)
        o = backend.forward(layer, q, k, v)
        bf.write(layer.layer_id, batch.out_cache_loc.tolist(), k, v)
        _check(o, _extend_brute(bf, runner, layer, q, batch), dtype)


def test_extend_catches_new_tokens_counted_twice():
    torch.manual_seed(4)
    runner = _runner("gqa", torch.float32, 1)
    alloc, batch = _extend_setup(runner, [5, 12], [3, 2])
    backend = TorchRefExtend(runner)
    backend.init_forward_metadata(batch)
    layer = AttentionLayer(0, 0.5)
    q, k, v = _qkv(runner, 5)
    o = backend.forward(layer, q, k, v)
    bf = BruteForce(runner)
    bf.write(0, batch.out_cache_loc.tolist(), k, v)
    right = _extend_brute(bf, runner, layer, q, batch)
    wrong = _extend_brute(bf, runner, layer, q, batch, counted_twice=True)
    torch.testing.assert_close(o.double(), right, atol=1e-5, rtol=1e-5)
    assert (o.double() - wrong).abs().max() > 1e-2
    # reference_extend alone (no write) agrees with the backend.
    torch.testing.assert_close(reference_extend(runner, layer, q, batch), o)
