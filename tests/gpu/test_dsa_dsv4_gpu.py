"""``dsa`` and ``dsv4`` on a CUDA GPU at DeepSeek shapes vs ``torch_ref_sparse`` / ``torch_ref``;
CUDA graph capture and padded replay. Marked ``gpu`` (skipped without CUDA).

Shapes: DSA = V3.2 at TP8 (16 MLA heads, rank 512 + rope 64, 64 index heads of 128,
``index_topk`` 2048, prefixes below, at and above 2048); DSv4 = V4-Flash's MTP layer (64
heads of 512, one KV head, window 128, fp32 sink), lengths around the window edge. Each row
also runs on its FP8 pool (``fp8=True``: dsa ``fp8_ds_mla`` 656 bytes/token at page 64, dsv4
``fp8_ds_v4`` 584 bytes/token page-blocked at 128/64), filled through ``write_kv`` and
compared with the reference on the dequantized pool.
"""

from __future__ import annotations

import random

import pytest
import torch

from specattn import metadata
from specattn.backends.torch_ref import reference_decode
from specattn.backends.torch_ref_sparse import (dsa_decode_selection, index_scores,
                                                reference_dsa_decode, reference_dsa_extend,
                                                reference_window_decode,
                                                reference_window_extend)
from specattn.data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from specattn.errors import InvalidInputError

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
H_DSA, R, ROPE, NH, DI, ITOPK = 16, 512, 64, 64, 128, 2048
H_V4, D_V4, WINDOW = 64, 512, 128


def _close(out, ref, dtype):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


# FP8 KV: V3.2's 656-byte layout for dsa, V4's 584-byte page-blocked layout for dsv4.
FP8 = {"dsa": "fp8_ds_mla", "dsv4": "fp8_ds_v4"}


def _runner(kind, dtype, page, num_slots, max_reqs, max_ctx, fp8=False):
    kv_dtype = FP8[kind] if fp8 else "auto"
    if fp8:
        num_slots = -(-num_slots // page) * page  # whole pages (V4's layout is page-blocked)
    if kind == "dsa":
        r = DraftRunner.mla(H_DSA, R, ROPE, num_layers=1, num_slots=num_slots,
                            max_reqs=max_reqs, max_context_len=max_ctx, page_size=page,
                            dtype=dtype, device=DEV, kv_cache_dtype=kv_dtype)
    else:
        r = DraftRunner.mla(H_V4, D_V4, 0, num_layers=1, num_slots=num_slots,
                            max_reqs=max_reqs, max_context_len=max_ctx, page_size=page,
                            dtype=dtype, device=DEV, kv_cache_dtype=kv_dtype)
    if fp8:  # quantized through write_kv, as an engine fills the pool
        width = r.kv_lora_rank + r.qk_rope_head_dim
        r.write_kv(0, torch.arange(r.num_slots, device=DEV),
                   torch.randn(r.num_slots, width, device=DEV), None)
    else:
        r.kv_buffer[0].normal_()
    return r


def _index_pool(r, dtype):
    from specattn.backends.dsa import make_index_k_buffer

    pool = make_index_k_buffer(r, DI)
    pool[0].copy_(_index_keys(r.num_slots, dtype))
    return pool


def _index_keys(n, dtype):
    k = torch.randn(n, DI, device=DEV)
    k[:, 0] = 1.0  # with _index_inputs' head-0 entry: distinct scores (no ReLU ties at 0)
    return k.to(dtype)


def _index_inputs(rows, dtype):
    q = torch.randn(rows, NH, DI, device=DEV) * 0.1
    q[:, 0, 0] = 12.0
    return dict(index_q=q.to(dtype), index_weights=torch.rand(rows, NH, device=DEV) + 0.1,
                index_k=_index_keys(rows, dtype))


def make_decode(kind, dtype, topk, steps, page, seq_lens, tree_mode, fp8=False):
    bs = len(seq_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=DEV)
    extra = metadata.max_draft_extend_len(topk, steps, page)
    num_slots = sum(seq_lens) + bs * extra + 16
    r = _runner(kind, dtype, page, num_slots, bs + 4, max(seq_lens) + extra + page, fp8)
    num_slots = r.num_slots
    rpi = torch.randperm(bs + 4, device=DEV)[:bs]
    perm = torch.randperm(num_slots, device=DEV).to(torch.int32)
    used = 0
    for b, L in enumerate(seq_lens):
        r.req_to_token[rpi[b], :L] = perm[used:used + L]
        used += L
    n_new = int(metadata.draft_extend_lens(seq, topk, steps, page).sum())
    loc = metadata.assign_draft_cache_locs(r.req_to_token, rpi, seq,
                                           perm[used:used + n_new].long(), topk, steps, page)
    parents = torch.zeros(steps, bs, topk, dtype=torch.int64, device=DEV) \
        if tree_mode == "path" else None
    return r, DraftBatch(rpi, seq, loc, parents)


def make_extend(kind, dtype, page, seq_lens, ext_lens, fp8=False):
    bs = len(seq_lens)
    num_slots = sum(seq_lens) + 16
    r = _runner(kind, dtype, page, num_slots, bs + 2, max(seq_lens) + page, fp8)
    num_slots = r.num_slots
    rpi = torch.randperm(bs + 2, device=DEV)[:bs]
    perm = torch.randperm(num_slots, device=DEV).to(torch.int32)
    used, new = 0, []
    for b, (L, E) in enumerate(zip(seq_lens, ext_lens)):
        r.req_to_token[rpi[b], :L] = perm[used:used + L]
        new.append(perm[used + L - E:used + L].long())
        used += L
    return r, DraftExtendBatch(rpi, torch.tensor(seq_lens, device=DEV),
                               torch.tensor(ext_lens, device=DEV), torch.cat(new))


def _qk(r, rows, dtype):
    width = r.kv_lora_rank + r.qk_rope_head_dim
    return (torch.randn(rows, r.num_heads, width, device=DEV).to(dtype),
            torch.randn(rows, width, device=DEV).to(dtype))


# --- dsa ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("topk,page,tree_mode,fp8", [
    (1, 64, "lane", False), (4, 64, "path", False), (4, 1, "lane", False),
    (1, 1, "path", False), (1, 64, "lane", True), (4, 64, "path", True)])
def test_dsa_decode(topk, page, tree_mode, fp8):
    from specattn.backends.dsa import DSADecode

    dtype, steps = torch.bfloat16, 3
    lens = [700, 2048, 2049, 5000]
    r, batch = make_decode("dsa", dtype, topk, steps, page, lens, tree_mode, fp8)
    pool = _index_pool(r, dtype)
    backend = DSADecode(r, topk, steps, tree_mode=tree_mode, index_k_buffer=pool)
    layer = AttentionLayer(0, 192 ** -0.5)
    backend.init_forward_metadata(batch)
    rows = len(lens) * topk
    for step in range(steps):
        if tree_mode == "path" and step:
            batch.parents[step] = torch.randint(0, topk, batch.parents[step].shape, device=DEV)
        q, k = _qk(r, rows, dtype)
        idx = _index_inputs(rows, dtype)
        out = backend.forward(step, layer, q, k, None, **idx)
        ref = reference_dsa_decode(r, layer, q, batch, step, tree_mode, index_topk=ITOPK,
                                   index_pool=pool[0], index_q=idx["index_q"],
                                   index_weights=idx["index_weights"])
        _close(out, ref, dtype)


def test_dsa_dense_equals_mla():
    from specattn.backends.dsa import DSADecode

    dtype = torch.bfloat16
    r, batch = make_decode("dsa", dtype, 2, 2, 64, [1, 300, 2048], "lane")
    backend = DSADecode(r, 2, 2)  # no index pool: every prefix fits
    layer = AttentionLayer(0, 192 ** -0.5)
    backend.init_forward_metadata(batch)
    for step in range(2):
        q, k = _qk(r, 6, dtype)
        _close(backend.forward(step, layer, q, k, None),
               reference_decode(r, layer, q, batch, step), dtype)


def test_dsa_selection_sets():
    from specattn.backends.dsa import DSADecode

    dtype = torch.float32
    r, batch = make_decode("dsa", dtype, 2, 2, 64, [3000, 2100], "lane")
    pool = _index_pool(r, dtype)
    backend = DSADecode(r, 2, 2, index_k_buffer=pool)
    backend.init_forward_metadata(batch)
    idx = _index_inputs(4, dtype)
    got = backend.selected_slots(AttentionLayer(0, 0.1), idx["index_q"], idx["index_weights"])
    ref = dsa_decode_selection(r, batch, ITOPK, pool[0], idx["index_q"], idx["index_weights"])
    for z in range(4):
        row = r.req_to_token[int(batch.req_pool_indices[z // 2])]
        n = int(batch.seq_lens[z // 2])
        have = set(got[z][got[z] >= 0].tolist())
        want = set(row[ref[z]].tolist())
        if have != want:
            sc = index_scores(idx["index_q"][z:z + 1], idx["index_weights"][z:z + 1],
                              pool[0][row[:n].long()])[0]
            by_slot = dict(zip(row[:n].tolist(), sc.tolist()))
            kth = min(by_slot[s] for s in want)
            assert all(abs(by_slot[s] - kth) <= 1e-4 * abs(kth) for s in have ^ want)


@pytest.mark.parametrize("fp8", [False, True])
def test_dsa_extend(fp8):
    from specattn.backends.dsa import DSAExtend

    dtype = torch.bfloat16
    r, batch = make_extend("dsa", dtype, 64, [4000, 2050, 900], [4, 3, 1], fp8)
    pool = _index_pool(r, dtype)
    backend = DSAExtend(r, index_k_buffer=pool)
    layer = AttentionLayer(0, 192 ** -0.5)
    backend.init_forward_metadata(batch)
    q, k = _qk(r, 8, dtype)
    idx = _index_inputs(8, dtype)
    out = backend.forward(layer, q, k, None, **idx)
    _close(out, reference_dsa_extend(r, layer, q, batch, index_topk=ITOPK, index_pool=pool[0],
                                     index_q=idx["index_q"],
                                     index_weights=idx["index_weights"]), dtype)


def test_dsa_long_prefix_needs_index_inputs():
    from specattn.backends.dsa import DSADecode

    r, batch = make_decode("dsa", torch.bfloat16, 1, 2, 64, [3000], "lane")
    backend = DSADecode(r, 1, 2, index_k_buffer=_index_pool(r, torch.bfloat16))
    backend.init_forward_metadata(batch)
    q, k = _qk(r, 1, torch.bfloat16)
    with pytest.raises(InvalidInputError, match="index_topk=2048"):
        backend.forward(0, AttentionLayer(0, 0.1), q, k, None)


# --- dsv4 --------------------------------------------------------------------------------------

@pytest.mark.parametrize("topk,page,tree_mode,fp8", [
    (1, 256, "lane", False), (3, 1, "path", False), (1, 128, "lane", True),
    (3, 64, "path", True)])
def test_dsv4_decode(topk, page, tree_mode, fp8):
    from specattn.backends.dsv4 import DSV4CudaDecode

    dtype, steps = torch.bfloat16, 3
    lens = [50, 126, 127, 128, 1000]
    r, batch = make_decode("dsv4", dtype, topk, steps, page, lens, tree_mode, fp8)
    backend = DSV4CudaDecode(r, topk, steps, tree_mode=tree_mode)
    layer = AttentionLayer(0, D_V4 ** -0.5)
    sink = torch.randn(H_V4, device=DEV)
    backend.init_forward_metadata(batch)
    rows = len(lens) * topk
    for step in range(steps):
        if tree_mode == "path" and step:
            batch.parents[step] = torch.randint(0, topk, batch.parents[step].shape, device=DEV)
        q, k = _qk(r, rows, dtype)
        out = backend.forward(step, layer, q, k, None, attn_sink=sink)
        _close(out, reference_window_decode(r, layer, q, batch, step, tree_mode,
                                            window=WINDOW, attn_sink=sink), dtype)


@pytest.mark.parametrize("page,fp8", [(256, False), (128, True)])
def test_dsv4_extend(page, fp8):
    from specattn.backends.dsv4 import DSV4CudaExtend

    dtype = torch.bfloat16
    r, batch = make_extend("dsv4", dtype, page, [60, 130, 900], [4, 3, 2], fp8)
    backend = DSV4CudaExtend(r)
    layer = AttentionLayer(0, D_V4 ** -0.5)
    sink = torch.randn(H_V4, device=DEV)
    backend.init_forward_metadata(batch)
    q, k = _qk(r, 9, dtype)
    out = backend.forward(layer, q, k, None, attn_sink=sink)
    _close(out, reference_window_extend(r, layer, q, batch, window=WINDOW, attn_sink=sink),
           dtype)


# --- CUDA graphs -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,fp8", [("dsa", False), ("dsv4", False), ("dsa", True),
                                      ("dsv4", True)])
def test_cuda_graph_capture_replay_padded(kind, fp8):
    """Capture every step at bs=4; replay a round of 3 real requests padded to 4 with new
    lengths / rows / slots / parents; real lanes match the reference. FP8: write_kv's
    quantization is captured too."""
    dtype, K, S, max_bs, real = torch.bfloat16, 2, 3, 4, 3
    long = 2600 if kind == "dsa" else 400
    r, batch = make_decode(kind, dtype, K, S, 1, [long] * max_bs, "path", fp8)
    if kind == "dsa":
        from specattn.backends.dsa import DSADecode

        pool = _index_pool(r, dtype)
        backend = DSADecode(r, K, S, tree_mode="path", index_k_buffer=pool)
    else:
        from specattn.backends.dsv4 import DSV4CudaDecode

        backend = DSV4CudaDecode(r, K, S, tree_mode="path")
    backend.init_cuda_graph_state(max_bs, max_bs * K)
    layer = AttentionLayer(0, 0.05)
    rows = max_bs * K
    inputs = []
    for _ in range(S):
        q, k = _qk(r, rows, dtype)
        extra = _index_inputs(rows, dtype) if kind == "dsa" else {
            "attn_sink": torch.randn(r.num_heads, device=DEV)}
        inputs.append((q, k, extra))
    outs = [None] * S
    backend.init_forward_metadata_capture_cuda_graph(batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in range(S):
            q, k, extra = inputs[step]
            backend.forward(step, layer, q, k, None, **extra)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in range(S):
            q, k, extra = inputs[step]
            outs[step] = backend.forward(step, layer, q, k, None, **extra)
    lens = [random.randint(1, long - 10) for _ in range(real)]
    r2, b2 = make_decode(kind, dtype, K, S, 1, lens, "path")
    r.req_to_token.zero_()
    r.req_to_token[:r2.max_reqs, :r2.max_context_len] = r2.req_to_token
    batch.seq_lens.fill_(backend.get_cuda_graph_seq_len_fill_value())
    batch.seq_lens[:real] = b2.seq_lens
    batch.req_pool_indices.zero_()
    batch.req_pool_indices[:real] = b2.req_pool_indices
    batch.out_cache_loc.fill_(r.num_slots - 1)
    batch.out_cache_loc[:real] = b2.out_cache_loc
    backend.init_forward_metadata_replay_cuda_graph(batch, max_bs)
    batch.parents.copy_(torch.randint(0, K, batch.parents.shape, device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    sub = DraftBatch(batch.req_pool_indices[:real], batch.seq_lens[:real],
                     batch.out_cache_loc[:real], batch.parents[:, :real])
    n = real * K
    for step in range(S):
        q, _, extra = inputs[step]
        if kind == "dsa":
            ref = reference_dsa_decode(r, layer, q[:n], sub, step, "path", index_topk=ITOPK,
                                       index_pool=pool[0], index_q=extra["index_q"][:n],
                                       index_weights=extra["index_weights"][:n])
        else:
            ref = reference_window_decode(r, layer, q[:n], sub, step, "path", window=WINDOW,
                                          attn_sink=extra["attn_sink"])
        _close(outs[step][:n], ref, dtype)
