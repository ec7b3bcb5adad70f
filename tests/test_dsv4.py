"""``dsv4`` (DeepSeek V4 draft attention) on the Triton CPU interpreter vs ``torch_ref_sparse``.

Tiny shapes: 4 heads of 32 (the real 64 x 512 run is in tests/gpu), windows shrunk to a few
keys through the ``window`` parameter so every edge (window larger than, equal to and smaller
than the key sequence, history-only windows) is reached. Outputs are poisoned before calls.
The reference itself is checked against ``torch_ref`` (no window, no sink) and against the
sink written as an extra zero-valued key.
"""

from __future__ import annotations

import pytest
import torch

from helpers import (DEV, decode_sizes, place_decode_round, place_extend_round,
                     randomize_pools, require_triton_interpret)
from helpers import close as _close
from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.backends.torch_ref_sparse import (reference_window_decode,
                                                reference_window_extend, sink_attend)
from specattn.data import AttentionLayer, DraftRunner
from specattn.errors import BackendUnavailableError, InvalidInputError

require_triton_interpret()

from specattn.backends.dsv4 import DSV4CudaDecode, DSV4CudaExtend, SinkAttentionLayer  # noqa

H, D = 4, 32


def make_runner(model, dtype, *, page, num_slots, max_reqs, max_ctx):
    if model == "mla":
        runner = DraftRunner.mla(H, D, 0, num_layers=2, num_slots=num_slots,
                                 max_reqs=max_reqs, max_context_len=max_ctx, page_size=page,
                                 dtype=dtype, device=DEV)
    else:
        runner = DraftRunner.mha(H, 1, D, num_layers=2, num_slots=num_slots,
                                 max_reqs=max_reqs, max_context_len=max_ctx, page_size=page,
                                 dtype=dtype, device=DEV)
    return randomize_pools(runner)


def make_decode(model, dtype, *, topk, steps, page, seq_lens, tree_mode="lane"):
    num_slots, max_ctx = decode_sizes(seq_lens, topk, steps, page)
    runner = make_runner(model, dtype, page=page, num_slots=num_slots,
                         max_reqs=len(seq_lens) + 2, max_ctx=max_ctx)
    return runner, place_decode_round(runner, seq_lens, topk, steps, page, tree_mode)


def new_qkv(runner, rows, dtype):
    q = torch.randn(rows, H, D, device=DEV).to(dtype)
    if runner.use_mla_backend:
        return q, torch.randn(rows, D, device=DEV).to(dtype), None
    k = torch.randn(rows, 1, D, device=DEV).to(dtype)
    return q, k, k  # keys equal values


def make_sink(kind):
    if kind == "none":
        return None
    if kind == "-inf":
        return torch.full((H,), float("-inf"), device=DEV)
    return torch.randn(H, device=DEV) * 2


def run_round(runner, batch, backend, dtype, layer, tree_mode, window, sink, reference=None):
    bs, topk, steps = batch.out_cache_loc.shape
    backend.init_forward_metadata(batch)
    for step in range(steps):
        if tree_mode == "path" and step > 0:
            batch.parents[step] = torch.randint(0, topk, (bs, topk), device=DEV)
        q, k, v = new_qkv(runner, bs * topk, dtype)
        out = backend.forward(step, layer, q, k, v, attn_sink=sink)
        ref = reference_window_decode(runner, layer, q, batch, step, tree_mode, window=window,
                                      attn_sink=sink) if reference is None else \
            reference(runner, layer, q, batch, step, tree_mode)
        assert out.shape == (bs * topk, H, D)
        _close(out, ref, dtype)


DECODE_CASES = [
    # model, dtype, topk, page, tree, seq_lens, window, sink
    ("mla", torch.bfloat16, 1, 1, "lane", [3, 20], 8, "rand"),      # L < W, L > W
    ("mla", torch.float16, 2, 1, "path", [5, 6], 8, "rand"),        # L + i + 1 crosses W
    ("mla", torch.float32, 3, 16, "lane", [2, 30], 2, "rand"),      # history-only windows
    ("mla", torch.float32, 2, 16, "path", [19, 1], 128, "none"),   # W > everything
    ("mha", torch.bfloat16, 2, 1, "lane", [8, 13], 8, "-inf"),      # L = W
    ("mha", torch.float32, 1, 16, "path", [40, 9], 5, "rand"),
]


@pytest.mark.parametrize("model,dtype,topk,page,tree_mode,seq_lens,window,sink", DECODE_CASES)
def test_decode_matches_reference(model, dtype, topk, page, tree_mode, seq_lens, window, sink):
    runner, batch = make_decode(model, dtype, topk=topk, steps=3, page=page, seq_lens=seq_lens,
                                tree_mode=tree_mode)
    backend = DSV4CudaDecode(runner, topk, 3, tree_mode=tree_mode, window=window)
    layer = AttentionLayer(layer_id=1, scaling=D ** -0.5)
    run_round(runner, batch, backend, dtype, layer, tree_mode, window, make_sink(sink))


def test_window_128_edges():
    """The default window: L + i + 1 below, at and above 128 in one batch (steps 0..2)."""
    runner, batch = make_decode("mla", torch.float32, topk=1, steps=3, page=1,
                                seq_lens=[100, 126, 140])
    backend = DSV4CudaDecode(runner, 1, 3)
    assert backend.window == 128
    run_round(runner, batch, backend, torch.float32, AttentionLayer(0, 0.1), "lane", 128,
              make_sink("rand"))


def test_no_window_no_sink_is_plain_attention():
    """Window covering everything + sink -inf = torch_ref's dense decode (an independent
    oracle for the reference and the kernel). MLA with rope 0: value = the whole row."""
    runner, batch = make_decode("mla", torch.float32, topk=2, steps=2, page=1,
                                seq_lens=[11, 4], tree_mode="path")
    backend = DSV4CudaDecode(runner, 2, 2, tree_mode="path", window=1000)
    layer = AttentionLayer(0, 0.2)
    run_round(runner, batch, backend, torch.float32, layer, "path", 1000, make_sink("-inf"),
              reference=lambda r, lay, q, b, s, t: reference_decode(r, lay, q, b, s, t))


def test_sink_is_a_zero_valued_extra_key():
    """The reference's sink equals softmax over the keys plus one key of logit s_h, value 0."""
    q, kv = torch.randn(H, D), torch.randn(7, D)
    sink = torch.randn(H)
    s = q @ kv.T * 0.3
    p = torch.softmax(torch.cat([s, sink[:, None]], 1), 1)
    expected = p[:, :7] @ kv
    torch.testing.assert_close(sink_attend(q, kv, 0.3, attn_sink=sink), expected)


def test_large_sink_shrinks_output():
    runner, batch = make_decode("mla", torch.float32, topk=1, steps=1, page=1, seq_lens=[9])
    backend = DSV4CudaDecode(runner, 1, 1, window=8)
    layer = AttentionLayer(0, 0.2)
    backend.init_forward_metadata(batch)
    q, k, _ = new_qkv(runner, 1, torch.float32)
    plain = backend.forward(0, layer, q, k, None)
    big = backend.forward(0, layer, q, k, None, attn_sink=torch.full((H,), 30.0, device=DEV))
    inf = backend.forward(0, layer, q, k, None,
                          attn_sink=torch.full((H,), float("inf"), device=DEV))
    assert big.abs().max() < 1e-6 * max(1.0, plain.abs().max().item())
    assert torch.equal(inf, torch.zeros_like(inf))
    # A per-head mix: the factor is exp(lse) / (exp(lse) + exp(s)) for each head alone.
    mixed = torch.tensor([float("-inf"), 0.0, 2.0, float("inf")], device=DEV)
    out = backend.forward(0, SinkAttentionLayer(0, 0.2, attn_sink=mixed), q, k, None)
    _close(out, reference_window_decode(runner, layer, q, batch, 0, window=8,
                                        attn_sink=mixed), torch.float32)
    torch.testing.assert_close(out[:, 0], plain[:, 0])
    assert torch.equal(out[:, 3], torch.zeros_like(out[:, 3]))


def make_extend(model, dtype, *, page, seq_lens, ext_lens):
    bs = len(seq_lens)
    num_slots = sum(seq_lens) + 8
    runner = make_runner(model, dtype, page=page, num_slots=num_slots, max_reqs=bs + 2,
                         max_ctx=max(seq_lens) + page)
    return runner, place_extend_round(runner, seq_lens, ext_lens)


EXTEND_CASES = [
    ("mla", torch.bfloat16, 1, [30, 5], [4, 5], 8, "rand"),
    ("mha", torch.float16, 16, [9, 40], [3, 1], 8, "-inf"),
    ("mla", torch.float32, 1, [17, 17], [4, 4], 3, "rand"),
    ("mla", torch.float32, 16, [20, 6], [2, 6], 128, "none"),
]


@pytest.mark.parametrize("model,dtype,page,seq_lens,ext_lens,window,sink", EXTEND_CASES)
def test_extend_matches_reference(model, dtype, page, seq_lens, ext_lens, window, sink):
    runner, batch = make_extend(model, dtype, page=page, seq_lens=seq_lens, ext_lens=ext_lens)
    backend = DSV4CudaExtend(runner, window=window)
    layer = AttentionLayer(layer_id=1, scaling=0.2)
    backend.init_forward_metadata(batch)
    q, k, v = new_qkv(runner, sum(ext_lens), dtype)
    attn_sink = make_sink(sink)
    out = backend.forward(layer, q, k, v, attn_sink=attn_sink)
    _close(out, reference_window_extend(runner, layer, q, batch, window=window,
                                        attn_sink=attn_sink), dtype)


def test_extend_no_window_is_torch_ref():
    """Catches counting the new tokens twice: torch_ref's extend is the independent oracle."""
    runner, batch = make_extend("mla", torch.float32, page=1, seq_lens=[12, 7], ext_lens=[3, 7])
    backend = DSV4CudaExtend(runner, window=64)
    layer = AttentionLayer(0, 0.3)
    backend.init_forward_metadata(batch)
    q, k, _ = new_qkv(runner, 10, torch.float32)
    _close(backend.forward(layer, q, k, None), reference_extend(runner, layer, q, batch),
           torch.float32)


def test_graph_protocol_padded_replay():
    """Fixed buffers: capture with one batch, replay with other lengths, rows and slots."""
    topk, steps, window = 2, 2, 6
    runner, batch = make_decode("mla", torch.float32, topk=topk, steps=steps, page=1,
                                seq_lens=[20, 3, 7], tree_mode="path")
    backend = DSV4CudaDecode(runner, topk, steps, tree_mode="path", window=window)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * topk)
    backend.init_forward_metadata_capture_cuda_graph(batch)
    layer = AttentionLayer(0, 0.3)
    runner2, batch2 = make_decode("mla", torch.float32, topk=topk, steps=steps, page=1,
                                  seq_lens=[2, 11, 5], tree_mode="path")
    r2t = runner2.req_to_token  # a smaller round: fits in the first runner's tables and pool
    runner.req_to_token.zero_()
    runner.req_to_token[:r2t.shape[0], :r2t.shape[1]] = r2t
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
        getattr(batch, name).copy_(getattr(batch2, name))
    backend.init_forward_metadata_replay_cuda_graph(batch, 3)
    sink = make_sink("rand")
    for step in range(steps):
        if step:
            batch.parents[step] = torch.randint(0, topk, (3, topk), device=DEV)
        q, k, _ = new_qkv(runner, 3 * topk, torch.float32)
        out = backend.forward(step, layer, q, k, None, attn_sink=sink)
        _close(out, reference_window_decode(runner, layer, q, batch, step, "path",
                                            window=window, attn_sink=sink), torch.float32)


def test_errors():
    runner, batch = make_decode("mla", torch.float32, topk=1, steps=1, page=1, seq_lens=[4])
    with pytest.raises(InvalidInputError, match="window"):
        DSV4CudaDecode(runner, 1, 1, window=0)
    backend = DSV4CudaDecode(runner, 1, 1)
    q, k, _ = new_qkv(runner, 1, torch.float32)
    layer = AttentionLayer(0, 1.0)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(0, layer, q, k, None)
    backend.init_forward_metadata(batch)
    with pytest.raises(InvalidInputError, match="attn_sink"):
        backend.forward(0, layer, q, k, None, attn_sink=torch.zeros(H + 1, device=DEV))
    with pytest.raises(InvalidInputError, match="attn_sink"):
        backend.forward(0, layer, q, k, None, attn_sink=torch.zeros(H, dtype=torch.float16))
    with pytest.raises(InvalidInputError):
        backend.init_forward_metadata_replay_cuda_graph(batch, 1)
    rope = DraftRunner.mla(H, D, 16, num_layers=1, num_slots=8, max_reqs=1,
                           max_context_len=8, dtype=torch.float32, device=DEV)
    with pytest.raises(InvalidInputError, match="qk_rope_head_dim"):
        DSV4CudaExtend(rope)
    gqa = DraftRunner.mha(H, 2, D, num_layers=1, num_slots=8, max_reqs=1, max_context_len=8,
                          dtype=torch.float32, device=DEV)
    with pytest.raises(InvalidInputError, match="num_kv_heads"):
        DSV4CudaDecode(gqa, 1, 2)
    assert DSV4CudaDecode(runner, 4, 2).window == 128  # topk > 1 is served


def test_declaration():
    assert DSV4CudaDecode.auto_eligible is False and DSV4CudaExtend.auto_eligible is False
    assert DSV4CudaDecode.pending is None
    assert "H200" in DSV4CudaDecode.tested_on
    runner = make_runner("mla", torch.bfloat16, page=1, num_slots=4, max_reqs=1, max_ctx=4)
    runner.dtype = torch.float64  # not served: the capability check names the dtype
    with pytest.raises((BackendUnavailableError, InvalidInputError)):
        DSV4CudaDecode(runner, 1, 2)
