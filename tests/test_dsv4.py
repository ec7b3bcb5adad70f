"""``dsv4`` (DeepSeek V4 draft attention) on the Triton CPU interpreter vs ``torch_ref_sparse``.

Tiny shapes: 4 heads of 32 (the real 64 x 512 run is in tests/gpu), windows shrunk to a few
keys through the ``window`` parameter so every edge (window larger than, equal to and smaller
than the key sequence, history-only windows) is reached. Outputs are poisoned before calls.
The reference itself is checked against ``torch_ref`` (no window, no sink) and against the
sink written as an extra zero-valued key.

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``), which runs dsv4 with a window wider than any
sequence and no sink; this file keeps the ones specific to dsv4: windows and their edges,
sinks, windows under the graph protocol, the FP8 ``fp8_ds_v4`` page-blocked byte layout,
errors and the declaration.
"""

from __future__ import annotations

import struct

import pytest
import torch

from helpers import (DEV, decode_sizes, place_decode_round, place_extend_round,
                     randomize_pools, require_triton_interpret)
from helpers import close as _close
from specattn.backends.torch_ref import reference_decode
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
    with pytest.raises(BackendUnavailableError, match=r"supports dtypes .*, got float64"):
        DSV4CudaDecode(runner, 1, 2)


# --- FP8 KV ("fp8_ds_v4": V4's 584-byte page-blocked layout, specattn.kv_layouts) ----------------

D8 = 128  # 64 e4m3 values (one ue8m0 block) + the 64 bf16 RoPE values: the smallest V4 row


def _bf16_bytes(x: float) -> list:
    bits = struct.unpack("<I", struct.pack("<f", x))[0] >> 16  # exact for the values used
    return [bits & 0xFF, bits >> 8]


def make_fp8_runner(dtype, *, page, num_slots, max_reqs, max_ctx, dim=D8):
    num_slots = -(-num_slots // page) * page  # whole pages (the layout is page-blocked)
    runner = DraftRunner.mla(H, dim, 0, num_layers=2, num_slots=num_slots, max_reqs=max_reqs,
                             max_context_len=max_ctx, page_size=page, dtype=dtype, device=DEV,
                             kv_cache_dtype="fp8_ds_v4")
    for layer_id in range(2):
        runner.write_kv(layer_id, torch.arange(num_slots, device=DEV),
                        torch.randn(num_slots, dim, device=DEV), None)
    return runner


def test_fp8_ds_v4_pool_width_and_page_blocked_bytes():
    """584 bytes per token at V4's shape; in a page of P tokens the P data rows (e4m3, then
    bf16 RoPE) come first, then the P scale rows (ue8m0 exponents, pad byte). A hand-built
    page decodes to the expected values through the reader and through the kernel."""
    from specattn.backends.dsv4._kernels import window_attention

    big = DraftRunner.mla(2, 512, 0, num_layers=1, num_slots=256, max_reqs=1,
                          max_context_len=8, page_size=128, kv_cache_dtype="fp8_ds_v4")
    lay = big.kv_layout
    assert big.kv_buffer[0].shape == (256, 584) and big.kv_buffer[0].dtype == torch.uint8
    assert (lay.d_nope, lay.d_rope, lay.tile) == (448, 64, 64)
    # Token 130 = page 1, row 2: data at 128*584 + 2*576, scales at 128*584 + 128*576 + 2*8.
    x = torch.zeros(1, 512)
    x[0, 64 * 3] = 448.0 * 8  # block 3: amax 3584 -> scale 8 -> ue8m0 byte 130
    x[0, 448] = 1.5
    big.write_kv(0, torch.tensor([130]), x, None)
    flat = big.kv_buffer[0].view(-1)
    data, scales = 128 * 584 + 2 * 576, 128 * 584 + 128 * 576 + 2 * 8
    assert flat[data + 64 * 3] == 0x7E  # 448 * 8 / 8 = 448
    assert flat[data + 448:data + 450].tolist() == _bf16_bytes(1.5)
    assert flat[scales + 3] == 127 + 3 and flat[scales + 7] == 0  # pad byte untouched
    # All-zero blocks get the floor scale 1e-4 rounded up: 2^-13.
    assert flat[scales:scales + 3].tolist() == [127 - 13] * 3
    # Nothing else written: 1 code + 2 RoPE bytes + 7 exponents.
    assert int((flat != 0).sum()) == 1 + 2 + 7

    runner = DraftRunner.mla(H, D8, 0, num_layers=1, num_slots=4, max_reqs=1,
                             max_context_len=4, page_size=2, dtype=torch.float32, device=DEV,
                             kv_cache_dtype="fp8_ds_v4")
    lay = runner.kv_layout
    assert lay.bytes_per_token == 64 + 128 + 2
    page = [0] * (2 * lay.bytes_per_token)
    # Token 3 = page 1, row 1: data row at 192, scale row at 2*192 + 2.
    row = [0x38, 0xB8, 0x01, 0x7E] + [0] * 60 + sum((_bf16_bytes(v) for v in [-3.0, 0.25]
                                                      + [0.0] * 62), [])
    page[192:384] = row
    page[386] = 127 - 2  # scale 2^-2
    runner.kv_buffer[0][2:4] = torch.tensor(page, dtype=torch.uint8).view(2, -1).to(DEV)
    want = torch.zeros(D8)
    want[:4] = torch.tensor([0.25, -0.25, 2.0 ** -11, 112.0])
    want[64:66] = torch.tensor([-3.0, 0.25])
    torch.testing.assert_close(lay.read(runner.kv_buffer[0], torch.tensor([3])).cpu()[0], want,
                               rtol=0, atol=0)
    runner.req_to_token[0, 0] = 3
    q = torch.randn(1, H, D8, device=DEV)
    meta = torch.tensor([[0, 1]], dtype=torch.int32, device=DEV)
    out = window_attention(q, runner, AttentionLayer(0, 0.1), meta, meta, 0, 8, None)
    torch.testing.assert_close(out.cpu(), want.expand(1, H, D8), rtol=0, atol=0)


def test_fp8_ds_v4_round_trip():
    """Write then read: ue8m0 scales are powers of two >= amax / 448 (floored), RoPE is
    bf16-exact, the e4m3 part within half an ulp (2^-4 relative, 2^-10 of the scale for
    subnormals)."""
    runner = make_fp8_runner(torch.bfloat16, page=16, num_slots=48, max_reqs=1, max_ctx=4,
                             dim=256)
    x = torch.randn(48, 256, device=DEV) * torch.rand(48, 1, device=DEV) * 10
    slots = torch.randperm(48, device=DEV)
    runner.write_kv(0, slots, x, None)
    lay = runner.kv_layout
    got = lay.read(runner.kv_buffer[0], slots)
    torch.testing.assert_close(got[:, 192:], x[:, 192:].bfloat16().float(), rtol=0, atol=0)
    _, scale_off, _ = lay.offsets(slots)
    e = runner.kv_buffer[0].view(-1)[scale_off[:, None] + torch.arange(3, device=DEV)]
    scale = torch.exp2(e.float() - 127)[..., None]
    blocks = x[:, :192].reshape(48, 3, 64)
    amax = blocks.abs().amax(-1, keepdim=True)
    assert (scale >= amax / 448).all()
    # A power of two below twice its argument, amax / 448 floored at 1e-4 (FlashMLA's margin:
    # a nearly-zero block, about 5% of runs here, gets the floor).
    assert (scale < 2 * (amax / 448).clamp_min(1e-4)).all()
    err = (got[:, :192].reshape(48, 3, 64) - blocks).abs()
    assert (err <= torch.maximum(blocks.abs() * 2 ** -4, scale * 2 ** -10) * 1.0001).all()


FP8_DECODE_CASES = [
    # dtype, topk, page, tree, seq_lens, window, sink
    (torch.bfloat16, 1, 16, "lane", [3, 20], 8, "rand"),    # L < W, L > W
    (torch.float32, 2, 1, "path", [5, 6], 8, "rand"),       # L + i + 1 crosses W
    (torch.float16, 3, 16, "lane", [2, 30], 2, "none"),     # history-only windows
]


@pytest.mark.parametrize("dtype,topk,page,tree_mode,seq_lens,window,sink", FP8_DECODE_CASES)
def test_fp8_decode_matches_reference(dtype, topk, page, tree_mode, seq_lens, window, sink):
    """FP8 pool: in-kernel dequantization vs the reference on the dequantized pool (the
    drafts' keys are quantized by write_kv before either reads them)."""
    steps = 3
    num_slots, max_ctx = decode_sizes(seq_lens, topk, steps, page)
    runner = make_fp8_runner(dtype, page=page, num_slots=num_slots,
                             max_reqs=len(seq_lens) + 2, max_ctx=max_ctx)
    batch = place_decode_round(runner, seq_lens, topk, steps, page, tree_mode)
    backend = DSV4CudaDecode(runner, topk, steps, tree_mode=tree_mode, window=window)
    layer = AttentionLayer(layer_id=1, scaling=D8 ** -0.5)
    attn_sink = make_sink(sink)
    backend.init_forward_metadata(batch)
    bs = len(seq_lens)
    for step in range(steps):
        if tree_mode == "path" and step:
            batch.parents[step] = torch.randint(0, topk, (bs, topk), device=DEV)
        q = torch.randn(bs * topk, H, D8, device=DEV).to(dtype)
        k = torch.randn(bs * topk, D8, device=DEV).to(dtype)
        out = torch.full_like(q, float("nan"))
        out.copy_(backend.forward(step, layer, q, k, None, attn_sink=attn_sink))
        _close(out, reference_window_decode(runner, layer, q, batch, step, tree_mode,
                                            window=window, attn_sink=attn_sink), dtype)


@pytest.mark.parametrize("dtype,page,seq_lens,ext_lens,window", [
    (torch.bfloat16, 16, [30, 5], [4, 5], 8),
    (torch.float32, 1, [17, 17], [4, 4], 3),
])
def test_fp8_extend_matches_reference(dtype, page, seq_lens, ext_lens, window):
    runner = make_fp8_runner(dtype, page=page, num_slots=sum(seq_lens) + 8,
                             max_reqs=len(seq_lens) + 2, max_ctx=max(seq_lens) + page)
    batch = place_extend_round(runner, seq_lens, ext_lens)
    backend = DSV4CudaExtend(runner, window=window)
    layer = AttentionLayer(layer_id=0, scaling=0.2)
    attn_sink = make_sink("rand")
    backend.init_forward_metadata(batch)
    q = torch.randn(sum(ext_lens), H, D8, device=DEV).to(dtype)
    k = torch.randn(sum(ext_lens), D8, device=DEV).to(dtype)
    out = backend.forward(layer, q, k, None, attn_sink=attn_sink)
    _close(out, reference_window_extend(runner, layer, q, batch, window=window,
                                        attn_sink=attn_sink), dtype)


def test_fp8_capability_and_layout_errors():
    """dsv4 declares "fp8_ds_v4" only; a V3.2-layout runner is refused naming kv_cache_dtype;
    shapes the layout cannot hold and partial pages name the argument."""
    from specattn.backends.dsa import DSADecode

    for cls in (DSV4CudaDecode, DSV4CudaExtend):
        assert cls.kv_cache_dtypes == ("auto", "fp8_ds_v4")
    v4 = make_fp8_runner(torch.float32, page=4, num_slots=8, max_reqs=1, max_ctx=8)
    assert DSV4CudaDecode(v4, 2, 2).runner is v4
    with pytest.raises(BackendUnavailableError, match="kv_cache_dtype"):
        DSADecode(v4, 1, 2)
    v32 = DraftRunner.mla(H, D8, 0, num_layers=1, num_slots=8, max_reqs=1, max_context_len=8,
                          dtype=torch.float32, device=DEV, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(BackendUnavailableError, match="kv_cache_dtype"):
        DSV4CudaExtend(v32)
    with pytest.raises(InvalidInputError, match="kv_lora_rank"):
        DraftRunner.mla(H, 100, 0, num_layers=1, num_slots=8, max_reqs=1, max_context_len=8,
                        kv_cache_dtype="fp8_ds_v4")
    with pytest.raises(InvalidInputError, match=r"runner\.kv_buffer\[0\].*page_size=4"):
        DraftRunner.mla(H, D8, 0, num_layers=1, num_slots=6, max_reqs=1, max_context_len=8,
                        page_size=4, kv_cache_dtype="fp8_ds_v4")
    wrapped = DraftRunner.wrap_mla(v4.req_to_token, v4.kv_buffer, H, D8, page_size=4,
                                   kv_cache_dtype="fp8_ds_v4", dtype=torch.float16)
    assert wrapped.qk_rope_head_dim == 0 and wrapped.dtype == torch.float16
