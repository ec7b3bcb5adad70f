"""``intel_amx`` (the CPU backend) against ``torch_ref``.

Every case fills the whole KV pool with NaN first, then writes real KV only where the request
prefixes live: a backend that reads a slot it should not (padding, another lane's history, a
draft slot not written yet) returns NaN and fails. The new KV of each step is written by the
backend under test; ``reference_decode`` / ``reference_extend`` then read the same pool.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specattn import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from specattn.allocator import PagedKVAllocator
from specattn.backends.intel_amx import IntelAMXDecode, IntelAMXExtend
from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.errors import InvalidInputError
from specattn.keys import BackendRequest
from specattn.platforms import Platform

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 2e-5}
LAYERS = 2
SCALE = 0.3


def _runner(mla: bool, dtype: torch.dtype, page_size: int, slots: int = 2048,
            max_context_len: int = 256) -> DraftRunner:
    if mla:
        runner = DraftRunner.mla(4, 32, 16, num_layers=LAYERS, num_slots=slots, max_reqs=8,
                                 max_context_len=max_context_len, page_size=page_size,
                                 dtype=dtype)
        pools = runner.kv_buffer
    else:  # GQA: 8 query heads over 2 KV heads, value width != key width
        runner = DraftRunner.mha(8, 2, 32, 24, num_layers=LAYERS, num_slots=slots,
                                 max_reqs=8, max_context_len=max_context_len,
                                 page_size=page_size, dtype=dtype)
        pools = runner.k_buffer + runner.v_buffer
    for pool in pools:
        pool.fill_(float("nan"))
    return runner


def _fill(runner: DraftRunner, slots: torch.Tensor) -> None:
    """Random KV at ``slots`` in every layer."""
    pools = runner.kv_buffer if runner.use_mla_backend else runner.k_buffer + runner.v_buffer
    for pool in pools:
        pool[slots] = torch.randn(slots.shape[0], *pool.shape[1:]).to(pool.dtype)


def _requests(runner: DraftRunner, alloc: PagedKVAllocator, lens: list[int]) -> torch.Tensor:
    reqs = []
    for n in lens:
        req = alloc.new_request()
        _fill(runner, alloc.extend(req, n))
        reqs.append(req)
    return torch.tensor(reqs, dtype=torch.int64)


def _qkv(runner: DraftRunner, rows: int, q_gain: float = 1.0):
    dt = runner.dtype
    if runner.use_mla_backend:
        width = runner.kv_lora_rank + runner.qk_rope_head_dim
        return ((torch.randn(rows, runner.num_heads, width) * q_gain).to(dt),
                torch.randn(rows, width).to(dt), None)
    return ((torch.randn(rows, runner.num_q_heads, runner.head_dim) * q_gain).to(dt),
            torch.randn(rows, runner.num_kv_heads, runner.head_dim).to(dt),
            torch.randn(rows, runner.num_kv_heads, runner.v_head_dim).to(dt))


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not ref.isnan().any(), "the reference read a NaN slot: the test setup is wrong"
    assert not out.isnan().any(), "intel_amx read a slot outside the visible set"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), err


def _decode_round(backend: IntelAMXDecode, runner: DraftRunner, alloc: PagedKVAllocator,
                  reqs: torch.Tensor, logit_cap: float = 0.0) -> None:
    """One draft round through ``backend``, each step and layer checked against the ref."""
    topk, steps, mode = backend.topk, backend.num_steps, backend.tree_mode
    seq_lens = alloc.seq_lens(reqs.tolist())
    loc = alloc.alloc_draft(reqs, topk, steps)
    parents = torch.zeros(steps, len(reqs), topk, dtype=torch.int64) if mode == "path" else None
    batch = DraftBatch(reqs, seq_lens, loc, parents)
    backend.init_forward_metadata(batch)
    for step in range(steps):
        if parents is not None and step > 0:
            parents[step] = torch.randint(0, topk, (len(reqs), topk))  # filled in place
        for lid in range(LAYERS):
            layer = AttentionLayer(lid, SCALE, logit_cap)
            q, k, v = _qkv(runner, len(reqs) * topk)
            out = backend.forward(step, layer, q, k, v)
            _check(out, reference_decode(runner, layer, q, batch, step, mode), runner.dtype)
    alloc.release_draft()


DECODE_CASES = list(itertools.product(
    (False, True),                                     # MLA
    (torch.bfloat16, torch.float16, torch.float32),
    (1, 4),                                            # topk
    (1, 16),                                           # page size
))


@pytest.mark.parametrize("mla,dtype,topk,page_size", DECODE_CASES)
def test_decode_matches_reference(mla, dtype, topk, page_size):
    runner = _runner(mla, dtype, page_size)
    alloc = PagedKVAllocator(runner)
    # Ragged lengths that cross page borders, one empty prefix and one of a single token.
    reqs = _requests(runner, alloc, [37, 0, 1, 70])
    for mode in ("lane", "path"):
        backend = IntelAMXDecode(runner, topk, 3, tree_mode=mode)
        _decode_round(backend, runner, alloc, reqs)


@pytest.mark.parametrize("mla", (False, True))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_decode_logit_cap_uniform(mla, dtype):
    runner = _runner(mla, dtype, 16)
    alloc = PagedKVAllocator(runner)
    reqs = _requests(runner, alloc, [32, 32, 32])
    backend = IntelAMXDecode(runner, 4, 4, tree_mode="path")
    _decode_round(backend, runner, alloc, reqs, logit_cap=1.5)  # small cap: it matters


@pytest.mark.parametrize("cache_prefix", (True, False))
def test_decode_rounds_see_the_new_prefix(cache_prefix):
    """Rounds reuse the backend (and its per-layer buffers): round 2 has the same padded
    shape but request 1 gained tokens after round 1; round 3 re-shapes the buffers."""
    runner = _runner(False, torch.float32, 1)
    alloc = PagedKVAllocator(runner)
    reqs = _requests(runner, alloc, [20, 9])
    backend = IntelAMXDecode(runner, 2, 3, cache_prefix=cache_prefix)
    _decode_round(backend, runner, alloc, reqs)
    _fill(runner, alloc.extend(int(reqs[1]), 3))
    _decode_round(backend, runner, alloc, reqs)
    reqs = torch.cat([reqs, _requests(runner, alloc, [41])])
    _decode_round(backend, runner, alloc, reqs)


@pytest.mark.parametrize("mla", (False, True))
def test_decode_lane_attends_to_its_own_new_kv(mla):
    """A query aligned with its own new key and scaled up sees (almost) only that token: the
    output is that lane's new value, so the KV write happens before the read."""
    runner = _runner(mla, torch.float32, 1)
    alloc = PagedKVAllocator(runner)
    reqs = _requests(runner, alloc, [30, 5])
    keys = runner.kv_buffer[0] if mla else runner.k_buffer[0]
    keys.div_(keys.norm(dim=-1, keepdim=True))  # unit prefix keys: logits <= |q|
    topk = 3
    seq_lens = alloc.seq_lens(reqs.tolist())
    loc = alloc.alloc_draft(reqs, topk, 2)
    backend = IntelAMXDecode(runner, topk, 2)
    backend.init_forward_metadata(DraftBatch(reqs, seq_lens, loc))
    n = len(reqs) * topk
    _, k, v = _qkv(runner, n)
    if mla:
        k = k / k.norm(dim=-1, keepdim=True)
        q = 200.0 * k[:, None, :].expand(-1, runner.num_heads, -1).contiguous()
        expected = k[:, None, :runner.kv_lora_rank].expand(-1, runner.num_heads, -1)
    else:
        k = k / k.norm(dim=-1, keepdim=True)
        group = runner.num_q_heads // runner.num_kv_heads
        q = 200.0 * k.repeat_interleave(group, dim=1)
        expected = v.repeat_interleave(group, dim=1)
    out = backend.forward(0, AttentionLayer(0, 1.0), q, k, v)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)


def test_decode_path_mode_hand_made_tree():
    """Path mode against ancestor chains written out by hand (not via metadata)."""
    runner = _runner(False, torch.float32, 1)
    alloc = PagedKVAllocator(runner)
    reqs = _requests(runner, alloc, [12])
    seq_lens = alloc.seq_lens(reqs.tolist())
    loc = alloc.alloc_draft(reqs, 3, 3)
    # Step 1: lanes 0, 1, 2 descend from step-0 lanes 2, 0, 1; step 2: from 1, 2, 2.
    parents = torch.tensor([[[0, 0, 0]], [[2, 0, 1]], [[1, 2, 2]]])
    backend = IntelAMXDecode(runner, 3, 3, tree_mode="path")
    backend.init_forward_metadata(DraftBatch(reqs, seq_lens, loc, parents))
    layer = AttentionLayer(0, SCALE)
    for step in range(3):
        q, k, v = _qkv(runner, 3)
        out = backend.forward(step, layer, q, k, v)
    c = loc[0]  # c[lane, step]
    chains = [[c[0, 0], c[1, 1], c[0, 2]],   # lane 0 <- lane 1 <- lane 0
              [c[1, 0], c[2, 1], c[1, 2]],   # lane 1 <- lane 2 <- lane 1
              [c[1, 0], c[2, 1], c[2, 2]]]   # lane 2 <- lane 2 <- lane 1
    prefix = runner.req_to_token[int(reqs[0]), :12].long()
    group = runner.num_q_heads // runner.num_kv_heads
    for j, chain in enumerate(chains):
        slots = torch.cat([prefix, torch.stack(chain).long()])
        keys = runner.k_buffer[0][slots].repeat_interleave(group, dim=1)
        vals = runner.v_buffer[0][slots].repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[j], keys) * SCALE, dim=-1)
        torch.testing.assert_close(out[j], torch.einsum("hn,nhd->hd", p, vals),
                                   atol=2e-5, rtol=2e-5)


def _extend_case(mla: bool, dtype: torch.dtype, page_size: int, prefix: list[int],
                 ext: list[int], logit_cap: float = 0.0) -> None:
    runner = _runner(mla, dtype, page_size)
    alloc = PagedKVAllocator(runner)
    reqs = _requests(runner, alloc, prefix)
    # The new tokens' slots: allocated (still NaN), written by the backend's forward.
    new = torch.cat([alloc.extend(r, e) for r, e in zip(reqs.tolist(), ext)])
    batch = DraftExtendBatch(reqs, alloc.seq_lens(reqs.tolist()),
                             torch.tensor(ext, dtype=torch.int64), new)
    backend = IntelAMXExtend(runner)
    backend.init_forward_metadata(batch)
    for lid in range(LAYERS):
        layer = AttentionLayer(lid, SCALE, logit_cap)
        q, k, v = _qkv(runner, sum(ext))
        out = backend.forward(layer, q, k, v)
        _check(out, reference_extend(runner, layer, q, batch), dtype)


@pytest.mark.parametrize("mla", (False, True))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_extend_ragged_matches_reference(mla, dtype):
    _extend_case(mla, dtype, 16, [40, 3, 17, 0], [4, 1, 6, 2])


@pytest.mark.parametrize("mla", (False, True))
def test_extend_uniform_logit_cap(mla):
    _extend_case(mla, torch.float32, 1, [25, 25], [3, 3], logit_cap=1.5)


def test_extend_new_tokens_counted_once():
    """Each new token is one key: a query must not see later new tokens (causal) and must
    see its own token once. The output of query t changes when token t+1's value changes
    only if it (wrongly) sees it."""
    runner = _runner(False, torch.float32, 1)
    alloc = PagedKVAllocator(runner)
    reqs = _requests(runner, alloc, [10])
    new = alloc.extend(int(reqs[0]), 3)
    batch = DraftExtendBatch(reqs, alloc.seq_lens(reqs.tolist()),
                             torch.tensor([3]), new)
    backend = IntelAMXExtend(runner)
    q, k, v = _qkv(runner, 3)
    layer = AttentionLayer(0, SCALE)
    backend.init_forward_metadata(batch)
    first = backend.forward(layer, q, k, v)
    v2 = v.clone()
    v2[2] += 10.0
    second = backend.forward(layer, q, k, v2)
    torch.testing.assert_close(first[:2], second[:2], atol=0, rtol=0)
    assert (first[2] - second[2]).abs().max() > 1e-3
    _check(second, reference_extend(runner, layer, q, batch), torch.float32)


def test_forward_before_metadata_and_bad_shapes_raise():
    runner = _runner(False, torch.bfloat16, 1)
    backend = IntelAMXDecode(runner, 2, 3)
    q, k, v = _qkv(runner, 4)
    with pytest.raises(InvalidInputError, match="init_forward_metadata"):
        backend.forward(0, AttentionLayer(0, SCALE), q, k, v)
    alloc = PagedKVAllocator(runner)
    reqs = _requests(runner, alloc, [5, 6])
    seq_lens = alloc.seq_lens(reqs.tolist())
    backend.init_forward_metadata(DraftBatch(reqs, seq_lens, alloc.alloc_draft(reqs, 2, 3)))
    with pytest.raises(InvalidInputError, match="q"):
        backend.forward(0, AttentionLayer(0, SCALE), q[:3], k, v)
    with pytest.raises(InvalidInputError, match="step"):
        backend.forward(3, AttentionLayer(0, SCALE), q, k, v)
    extend = IntelAMXExtend(runner)
    with pytest.raises(InvalidInputError, match="init_forward_metadata"):
        extend.forward(AttentionLayer(0, SCALE), q, k, v)


def test_declaration_and_runtime_note():
    request = BackendRequest(kind="decode", mla=True, topk=8, num_steps=5, page_size=64,
                             tree_mode="path", dtype=torch.float16)
    assert IntelAMXDecode.validate(request, Platform("cpu")) == []
    assert IntelAMXDecode.validate(request, Platform("cuda", (9, 0)))
    assert "AMX tiles" in IntelAMXDecode.runtime_note(Platform("cpu", cpu_has_amx=True))
    assert "no AMX" in IntelAMXExtend.runtime_note(Platform("cpu", cpu_has_amx=False))
