"""``dsa`` (DeepSeek V3.2 sparse MLA) on the Triton CPU interpreter vs the references.

Tiny shapes: 4 MLA heads, rank 32 + rope 16, 3 index heads of 16, ``index_topk`` shrunk to a
few tokens so prefixes both fit (dense) and exceed it (sparse). Oracles: ``torch_ref`` (dense
MLA) when every candidate list fits, ``torch_ref_sparse`` otherwise; the selection is
compared as sets (distinct fp32 scores; a swap is only accepted between near-tied scores).

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``), which runs dsa dense and without index inputs; this
file keeps the ones specific to dsa: the indexer and its top-k selection, sparse attention,
index inputs, the FP8 ``fp8_ds_mla`` byte layout, errors and the declaration.
"""

from __future__ import annotations

import struct

import pytest
import torch

from helpers import (DEV, decode_sizes, place_decode_round, place_extend_round,
                     randomize_pools, require_triton_interpret)
from helpers import close as _close
from specattn.backends.torch_ref import attend, reference_decode, reference_extend
from specattn.backends.torch_ref_sparse import (dsa_decode_selection, dsa_extend_selection,
                                                index_scores, reference_dsa_decode,
                                                reference_dsa_extend)
from specattn.data import AttentionLayer, DraftRunner
from specattn.errors import BackendUnavailableError, InvalidInputError

require_triton_interpret()

from specattn.backends.dsa import DSADecode, DSAExtend, make_index_k_buffer  # noqa: E402
from specattn.backends.dsa import _kernels as dsa_kernels  # noqa: E402

H, R, ROPE, NH, DI = 4, 32, 16, 3, 16


def _fill(runner, dtype):
    randomize_pools(runner)
    pool = make_index_k_buffer(runner, DI)
    for p in pool:
        p.copy_(_index_keys(p.shape[0], dtype))
    return pool


def _index_keys(n, dtype):
    """Random index keys whose column 0 is 1: with ``_index_q``'s large head-0 entry there,
    head 0's ReLU rarely clips, so scores are distinct (ReLU-clipped heads would tie at 0)."""
    k = torch.randn(n, DI, device=DEV)
    k[:, 0] = 1.0
    return k.to(dtype)


def _index_q(rows, dtype):
    q = torch.randn(rows, NH, DI, device=DEV)
    q[:, 0, 0] = 12.0
    return q.to(dtype)


def make_decode(dtype, *, topk, steps, page, seq_lens, tree_mode="lane"):
    num_slots, max_ctx = decode_sizes(seq_lens, topk, steps, page)
    runner = DraftRunner.mla(H, R, ROPE, num_layers=2, num_slots=num_slots,
                             max_reqs=len(seq_lens) + 2, max_context_len=max_ctx,
                             page_size=page, dtype=dtype, device=DEV)
    pool = _fill(runner, dtype)
    return runner, pool, place_decode_round(runner, seq_lens, topk, steps, page, tree_mode)


def new_inputs(rows, dtype):
    q = torch.randn(rows, H, R + ROPE, device=DEV).to(dtype)
    k = torch.randn(rows, R + ROPE, device=DEV).to(dtype)
    return q, k, dict(index_q=_index_q(rows, dtype),
                      index_weights=torch.rand(rows, NH, device=DEV) + 0.1,
                      index_k=_index_keys(rows, dtype))


def check_sets(got: torch.Tensor, ref_slots: list, scores: list, tol=1e-4):
    """Per row: ``got`` (slots, -1 padded) equals the reference set, except swaps between
    scores within ``tol`` of the row's k-th score (ties are not ordered)."""
    for r, (want, sc) in enumerate(zip(ref_slots, scores)):
        have = {int(s) for s in got[r] if int(s) >= 0}
        want = {int(s) for s in want}
        assert len(have) == len(want), f"row {r}: {len(have)} selected, expected {len(want)}"
        diff = have ^ want
        if diff:
            kth = min(sc[s] for s in want)
            assert all(abs(sc[s] - kth) <= tol * max(1.0, abs(kth)) for s in diff), (
                f"row {r}: selection differs beyond ties: {sorted(diff)}")


DECODE_CASES = [
    # dtype, topk, page, tree, seq_lens, index_topk
    (torch.bfloat16, 1, 64, "lane", [5, 40], 8),       # one dense row, one sparse row
    (torch.float16, 2, 1, "path", [30, 23], 8),
    (torch.float32, 3, 64, "lane", [21, 9], 4),
    (torch.float32, 2, 1, "lane", [12, 3], 16),        # every list fits: dense, indexer skipped
    (torch.bfloat16, 4, 1, "path", [6, 33], 5),
]


@pytest.mark.parametrize("dtype,topk,page,tree_mode,seq_lens,index_topk", DECODE_CASES)
def test_decode_matches_reference(dtype, topk, page, tree_mode, seq_lens, index_topk):
    steps = 3
    runner, pool, batch = make_decode(dtype, topk=topk, steps=steps, page=page,
                                      seq_lens=seq_lens, tree_mode=tree_mode)
    backend = DSADecode(runner, topk, steps, tree_mode=tree_mode, index_topk=index_topk,
                        index_k_buffer=pool)
    layer = AttentionLayer(layer_id=1, scaling=(R + ROPE) ** -0.5)
    backend.init_forward_metadata(batch)
    bs = len(seq_lens)
    for step in range(steps):
        if tree_mode == "path" and step:
            batch.parents[step] = torch.randint(0, topk, (bs, topk), device=DEV)
        q, k, idx = new_inputs(bs * topk, dtype)
        out = backend.forward(step, layer, q, k, None, **idx)
        ref = reference_dsa_decode(runner, layer, q, batch, step, tree_mode,
                                   index_topk=index_topk, index_pool=pool[1],
                                   index_q=idx["index_q"], index_weights=idx["index_weights"])
        assert out.shape == (bs * topk, H, R)
        _close(out, ref, dtype)


@pytest.mark.parametrize("tree_mode,page", [("lane", 64), ("path", 1)])
def test_decode_dense_with_index_inputs_equals_torch_ref(tree_mode, page):
    """Prefixes <= index_topk: dsa = dense MLA (torch_ref) even when index inputs are given
    (the kit covers the call without them)."""
    runner, pool, batch = make_decode(torch.float32, topk=2, steps=2, page=page,
                                      seq_lens=[17, 9], tree_mode=tree_mode)
    layer = AttentionLayer(layer_id=0, scaling=0.2)
    backend = DSADecode(runner, 2, 2, tree_mode=tree_mode, index_k_buffer=pool)
    backend.init_forward_metadata(batch)
    for step in range(2):
        if tree_mode == "path" and step:
            batch.parents[step] = torch.randint(0, 2, (2, 2), device=DEV)
        q, k, idx = new_inputs(4, torch.float32)
        out = backend.forward(step, layer, q, k, None, **idx)
        _close(out, reference_decode(runner, layer, q, batch, step, tree_mode), torch.float32)


def test_selection_is_reference_topk():
    """The indexer + top-k picks the reference's sets (fp32, distinct scores), topk > 1."""
    runner, pool, batch = make_decode(torch.float32, topk=3, steps=2, page=1,
                                      seq_lens=[50, 23, 7])
    backend = DSADecode(runner, 3, 2, index_topk=10, index_k_buffer=pool)
    backend.init_forward_metadata(batch)
    layer = AttentionLayer(layer_id=1, scaling=0.2)
    _, _, idx = new_inputs(9, torch.float32)
    got = backend.selected_slots(layer, idx["index_q"], idx["index_weights"])
    ref = dsa_decode_selection(runner, batch, 10, pool[1], idx["index_q"],
                               idx["index_weights"])
    ref_slots, scores = [], []
    for z, pos in enumerate(ref):
        row = runner.req_to_token[int(batch.req_pool_indices[z // 3])]
        n = int(batch.seq_lens[z // 3])
        sc = index_scores(idx["index_q"][z:z + 1], idx["index_weights"][z:z + 1],
                          pool[1][row[:n].long()])[0]
        ref_slots.append(row[pos].tolist())
        scores.append({int(row[x]): float(sc[x]) for x in range(n)})
    assert got.shape == (9, 10)
    assert (got[6:] >= 0).sum(1).tolist() == [7, 7, 7]  # L = 7 < 10: everything, -1 padded
    check_sets(got, ref_slots, scores)


def test_minus_one_entries_contribute_nothing():
    """Hand-built slot lists: -1 padding anywhere gives the output of the valid slots alone,
    and the output depends on exactly the listed rows."""
    runner, _, _ = make_decode(torch.float32, topk=1, steps=1, page=1, seq_lens=[30])
    layer = AttentionLayer(layer_id=0, scaling=0.3)
    kv = runner.kv_buffer[0]
    q = torch.randn(2, H, R + ROPE, device=DEV)
    slots = torch.randperm(kv.shape[0], device=DEV)[:12].to(torch.int32)
    sel = torch.full((2, 40), -1, dtype=torch.int32, device=DEV)
    sel[0, :12] = slots
    sel[1, torch.randperm(40, device=DEV)[:12]] = slots  # scattered among -1 entries
    hist = torch.zeros(2, 1, dtype=torch.int32, device=DEV)
    for splits in (1, 3):
        out = dsa_kernels.sparse_mla(q, kv, layer, sel, hist, 0, R, splits)
        lat = kv[slots.long()].float()
        ref = attend(q, lat[:, None], lat[:, None, :R], 0.3)
        _close(out, ref, torch.float32)
    # Changing a row not in the list changes nothing; changing a listed row changes the output.
    before = dsa_kernels.sparse_mla(q, kv, layer, sel, hist, 0, R, 2)
    other = [s for s in range(kv.shape[0]) if s not in set(slots.tolist())][0]
    kv[other] += 5.0
    assert torch.equal(dsa_kernels.sparse_mla(q, kv, layer, sel, hist, 0, R, 2), before)
    kv[int(slots[3])] += 5.0
    assert not torch.allclose(dsa_kernels.sparse_mla(q, kv, layer, sel, hist, 0, R, 2), before)


def make_extend(dtype, *, page, seq_lens, ext_lens):
    bs = len(seq_lens)
    num_slots = sum(seq_lens) + 8
    runner = DraftRunner.mla(H, R, ROPE, num_layers=2, num_slots=num_slots, max_reqs=bs + 2,
                             max_context_len=max(seq_lens) + page, page_size=page,
                             dtype=dtype, device=DEV)
    pool = _fill(runner, dtype)
    return runner, pool, place_extend_round(runner, seq_lens, ext_lens)


EXTEND_CASES = [
    (torch.bfloat16, 64, [30, 12], [4, 1], 8),
    (torch.float16, 1, [9, 40], [3, 5], 6),
    (torch.float32, 1, [17, 17], [4, 4], 10),          # some tokens fit, later ones do not
    (torch.float32, 64, [6, 20], [2, 6], 32),          # dense
]


@pytest.mark.parametrize("dtype,page,seq_lens,ext_lens,index_topk", EXTEND_CASES)
def test_extend_matches_reference(dtype, page, seq_lens, ext_lens, index_topk):
    runner, pool, batch = make_extend(dtype, page=page, seq_lens=seq_lens, ext_lens=ext_lens)
    backend = DSAExtend(runner, index_topk=index_topk, index_k_buffer=pool)
    layer = AttentionLayer(layer_id=1, scaling=0.2)
    backend.init_forward_metadata(batch)
    q, k, idx = new_inputs(sum(ext_lens), dtype)
    out = backend.forward(layer, q, k, None, **idx)
    ref = reference_dsa_extend(runner, layer, q, batch, index_topk=index_topk,
                               index_pool=pool[1], index_q=idx["index_q"],
                               index_weights=idx["index_weights"])
    _close(out, ref, dtype)
    if max(seq_lens) <= index_topk:
        _close(out, reference_extend(runner, layer, q, batch), dtype)


def test_extend_selection_is_causal_topk():
    runner, pool, batch = make_extend(torch.float32, page=1, seq_lens=[25, 14],
                                      ext_lens=[3, 4])
    backend = DSAExtend(runner, index_topk=6, index_k_buffer=pool)
    backend.init_forward_metadata(batch)
    _, _, idx = new_inputs(7, torch.float32)
    layer = AttentionLayer(layer_id=0, scaling=0.2)
    # forward writes the new tokens' index keys first; do the same before asking.
    pool[0][batch.out_cache_loc] = idx["index_k"]
    got = backend.selected_slots(layer, idx["index_q"], idx["index_weights"])
    ref = dsa_extend_selection(runner, batch, 6, pool[0], idx["index_q"],
                               idx["index_weights"])
    ref_slots, scores, t = [], [], 0
    for b, (L, E) in enumerate([(25, 3), (14, 4)]):
        row = runner.req_to_token[int(batch.req_pool_indices[b])]
        for u in range(E):
            n = L - E + u + 1
            sc = index_scores(idx["index_q"][t:t + 1], idx["index_weights"][t:t + 1],
                              pool[0][row[:n].long()])[0]
            ref_slots.append(row[ref[t]].tolist())
            scores.append({int(row[x]): float(sc[x]) for x in range(n)})
            t += 1
    check_sets(got, ref_slots, scores)


def test_graph_protocol_padded_replay():
    """Fixed buffers (indexer path: max_context_len > index_topk): capture, then replay a
    different round of the same padded size."""
    topk, steps = 2, 2
    runner, pool, batch = make_decode(torch.float32, topk=topk, steps=steps, page=1,
                                      seq_lens=[20, 3, 14], tree_mode="path")
    backend = DSADecode(runner, topk, steps, tree_mode="path", index_topk=6,
                        index_k_buffer=pool)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * topk)
    backend.init_forward_metadata_capture_cuda_graph(batch)
    runner2, _, batch2 = make_decode(torch.float32, topk=topk, steps=steps, page=1,
                                     seq_lens=[2, 16, 9], tree_mode="path")
    r2t = runner2.req_to_token
    runner.req_to_token.zero_()
    runner.req_to_token[:r2t.shape[0], :r2t.shape[1]] = r2t
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
        getattr(batch, name).copy_(getattr(batch2, name))
    backend.init_forward_metadata_replay_cuda_graph(batch, 3)
    layer = AttentionLayer(layer_id=0, scaling=0.25)
    for step in range(steps):
        if step:
            batch.parents[step] = torch.randint(0, topk, (3, topk), device=DEV)
        q, k, idx = new_inputs(3 * topk, torch.float32)
        out = backend.forward(step, layer, q, k, None, **idx)
        ref = reference_dsa_decode(runner, layer, q, batch, step, "path", index_topk=6,
                                   index_pool=pool[0], index_q=idx["index_q"],
                                   index_weights=idx["index_weights"])
        _close(out, ref, torch.float32)


def test_errors():
    runner, pool, batch = make_decode(torch.float32, topk=1, steps=1, page=1, seq_lens=[20])
    layer = AttentionLayer(0, 1.0)
    with pytest.raises(InvalidInputError, match="index_topk"):
        DSADecode(runner, 1, 1, index_topk=0)
    with pytest.raises(InvalidInputError, match="index_k_buffer"):
        DSADecode(runner, 1, 1, index_k_buffer=pool[:1])
    backend = DSADecode(runner, 1, 1, index_topk=8, index_k_buffer=pool)
    q, k, idx = new_inputs(1, torch.float32)
    backend.init_forward_metadata(batch)
    with pytest.raises(InvalidInputError, match="index_q.*index_topk=8"):
        backend.forward(0, layer, q, k, None)  # L = 20 > 8 needs the indexer
    with pytest.raises(InvalidInputError, match="index_weights"):
        backend.forward(0, layer, q, k, None, index_q=idx["index_q"])
    with pytest.raises(InvalidInputError, match="index_q"):
        backend.forward(0, layer, q, k, None, index_q=idx["index_q"][:, :, :8],
                        index_weights=idx["index_weights"])
    with pytest.raises(InvalidInputError, match="index_k"):
        backend.forward(0, layer, q, k, None, index_k=idx["index_k"].half())
    no_pool = DSADecode(runner, 1, 1)
    with pytest.raises(InvalidInputError, match="index-key pool"):
        no_pool.init_forward_metadata(batch) or no_pool.forward(0, layer, q, k, None, **idx)
    mha = DraftRunner.mha(4, 1, 16, num_layers=1, num_slots=8, max_reqs=1, max_context_len=8,
                          dtype=torch.float32, device=DEV)
    with pytest.raises(BackendUnavailableError, match="MLA"):
        DSADecode(mha, 1, 2)


def test_declaration():
    for cls in (DSADecode, DSAExtend):
        assert cls.auto_eligible is False and cls.pending is None
        assert cls.supports_cuda_graph and "H200" in cls.tested_on
        assert cls.deprecated_aliases == ("nsa",)


# --- FP8 KV ("fp8_ds_mla": V3.2's 656-byte layout, specattn.kv_layouts) --------------------------

R8 = 128  # the FP8 layout scales blocks of 128: the smallest rank it holds


def _bf16_bytes(x: float) -> list:
    bits = struct.unpack("<I", struct.pack("<f", x))[0] >> 16  # exact for the values used
    return [bits & 0xFF, bits >> 8]


def test_fp8_ds_mla_pool_width_and_byte_layout():
    """656 bytes per token at V3.2's shape; a hand-built token decodes to the expected values,
    through the layout's reader and through the kernel (one key, so the output is its value);
    write_kv puts the codes, the fp32 scale and the bf16 RoPE values where the format says."""
    big = DraftRunner.mla(2, 512, 64, num_layers=1, num_slots=64, max_reqs=1,
                          max_context_len=64, page_size=64, kv_cache_dtype="fp8_ds_mla")
    assert big.kv_buffer[0].dtype == torch.uint8 and big.kv_buffer[0].shape == (64, 656)
    runner = DraftRunner.mla(H, R8, ROPE, num_layers=1, num_slots=4, max_reqs=1,
                             max_context_len=4, dtype=torch.float32, device=DEV,
                             kv_cache_dtype="fp8_ds_mla")
    lay = runner.kv_layout
    assert lay.bytes_per_token == R8 + 4 + 2 * ROPE
    # e4m3: 0x38 = 1.0, 0xB8 = -1.0, 0x01 = 2^-9 (subnormal), 0x7E = 448, 0x00 = 0.
    codes = [0x38, 0xB8, 0x01, 0x7E] + [0x00] * (R8 - 4)
    scale = list(struct.pack("<f", 0.5))
    rope = sum((_bf16_bytes(v) for v in [1.5, -2.0] + [0.0] * (ROPE - 2)), [])
    token = torch.tensor(codes + scale + rope, dtype=torch.uint8)
    runner.kv_buffer[0][2] = token.to(DEV)
    want = torch.zeros(R8 + ROPE)
    want[:4] = torch.tensor([0.5, -0.5, 2.0 ** -10, 224.0])
    want[R8:R8 + 2] = torch.tensor([1.5, -2.0])
    torch.testing.assert_close(lay.read(runner.kv_buffer[0], torch.tensor([2])).cpu()[0], want,
                               rtol=0, atol=0)
    q = torch.randn(1, H, R8 + ROPE, device=DEV)
    sel = torch.tensor([[2]], dtype=torch.int32, device=DEV)
    hist = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    out = dsa_kernels.sparse_mla(q, runner.kv_buffer[0], AttentionLayer(0, 0.1), sel, hist, 0,
                                 R8, 1, layout=lay)
    torch.testing.assert_close(out.cpu(), want[:R8].expand(1, H, R8), rtol=0, atol=0)
    # Writing: block amax 448 * 0.25 -> scale 0.25 at bytes [R8, R8 + 4), codes, RoPE.
    x = torch.zeros(1, R8 + ROPE)
    x[0, 0], x[0, 1], x[0, R8] = 112.0, -0.25, 3.0
    runner.write_kv(0, torch.tensor([1], device=DEV), x.to(DEV), None)
    row = runner.kv_buffer[0][1].cpu()
    assert struct.unpack("<f", bytes(row[R8:R8 + 4].tolist()))[0] == 0.25
    assert row[0] == 0x7E and row[1] == 0xB8 and row[2] == 0
    assert row[R8 + 4:R8 + 6].tolist() == _bf16_bytes(3.0)


def test_fp8_ds_mla_round_trip():
    """Write then read: the RoPE part is bf16-exact, the rest within e4m3's half-ulp (2^-4
    relative, or 2^-10 of the block scale for subnormals); scales are amax / 448."""
    runner = DraftRunner.mla(H, 2 * R8, ROPE, num_layers=1, num_slots=40, max_reqs=1,
                             max_context_len=4, page_size=64, dtype=torch.bfloat16,
                             device=DEV, kv_cache_dtype="fp8_ds_mla")
    x = torch.randn(40, 2 * R8 + ROPE, device=DEV) * torch.rand(40, 1, device=DEV) * 10
    x[3, :R8] = 0.0  # an all-zero block: scale 0, decodes to 0
    slots = torch.randperm(40, device=DEV)
    runner.write_kv(0, slots, x, None)
    got = runner.kv_layout.read(runner.kv_buffer[0], slots)
    torch.testing.assert_close(got[:, 2 * R8:], x[:, 2 * R8:].bfloat16().float(), rtol=0, atol=0)
    blocks = x[:, :2 * R8].reshape(40, 2, R8)
    scale = blocks.abs().amax(-1, keepdim=True) / 448
    err = (got[:, :2 * R8].reshape(40, 2, R8) - blocks).abs()
    assert (err <= torch.maximum(blocks.abs() * 2 ** -4, scale * 2 ** -10) * 1.0001).all()
    assert torch.equal(got[3, :R8], torch.zeros(R8, device=DEV))


def make_fp8_decode(dtype, *, topk, steps, page, seq_lens, tree_mode="lane"):
    num_slots, max_ctx = decode_sizes(seq_lens, topk, steps, page)
    runner = DraftRunner.mla(H, R8, ROPE, num_layers=2, num_slots=num_slots,
                             max_reqs=len(seq_lens) + 2, max_context_len=max_ctx,
                             page_size=page, dtype=dtype, device=DEV,
                             kv_cache_dtype="fp8_ds_mla")
    for layer_id in range(2):
        runner.write_kv(layer_id, torch.arange(num_slots, device=DEV),
                        torch.randn(num_slots, R8 + ROPE, device=DEV), None)
    pool = make_index_k_buffer(runner, DI)
    for p in pool:
        p.copy_(_index_keys(p.shape[0], dtype))
    return runner, pool, place_decode_round(runner, seq_lens, topk, steps, page, tree_mode)


def _fp8_inputs(rows, dtype):
    q = torch.randn(rows, H, R8 + ROPE, device=DEV).to(dtype)
    k = torch.randn(rows, R8 + ROPE, device=DEV).to(dtype)
    return q, k, dict(index_q=_index_q(rows, dtype),
                      index_weights=torch.rand(rows, NH, device=DEV) + 0.1,
                      index_k=_index_keys(rows, dtype))


FP8_DECODE_CASES = [
    # dtype, topk, page, tree, seq_lens, index_topk
    (torch.bfloat16, 1, 64, "lane", [5, 40], 8),    # one dense row, one sparse row
    (torch.float16, 3, 1, "path", [30, 12], 8),
    (torch.float32, 2, 64, "lane", [12, 3], 16),    # every list fits: dense
]


@pytest.mark.parametrize("dtype,topk,page,tree_mode,seq_lens,index_topk", FP8_DECODE_CASES)
def test_fp8_decode_matches_reference(dtype, topk, page, tree_mode, seq_lens, index_topk):
    """FP8 pool: the kernel (in-kernel dequantization) vs the reference on the dequantized
    pool; the drafts' own keys are quantized by write_kv before either reads them."""
    steps = 2
    runner, pool, batch = make_fp8_decode(dtype, topk=topk, steps=steps, page=page,
                                          seq_lens=seq_lens, tree_mode=tree_mode)
    backend = DSADecode(runner, topk, steps, tree_mode=tree_mode, index_topk=index_topk,
                        index_k_buffer=pool)
    layer = AttentionLayer(layer_id=1, scaling=(R8 + ROPE) ** -0.5)
    backend.init_forward_metadata(batch)
    bs = len(seq_lens)
    for step in range(steps):
        if tree_mode == "path" and step:
            batch.parents[step] = torch.randint(0, topk, (bs, topk), device=DEV)
        q, k, idx = _fp8_inputs(bs * topk, dtype)
        out = torch.full((bs * topk, H, R8), float("nan"), dtype=dtype, device=DEV)
        out.copy_(backend.forward(step, layer, q, k, None, **idx))
        ref = reference_dsa_decode(runner, layer, q, batch, step, tree_mode,
                                   index_topk=index_topk, index_pool=pool[1],
                                   index_q=idx["index_q"], index_weights=idx["index_weights"])
        _close(out, ref, dtype)


def test_fp8_extend_matches_reference():
    seq_lens, ext_lens, index_topk = [30, 12], [4, 2], 8
    bs = len(seq_lens)
    runner = DraftRunner.mla(H, R8, ROPE, num_layers=1, num_slots=sum(seq_lens) + 8,
                             max_reqs=bs + 2, max_context_len=max(seq_lens) + 64, page_size=64,
                             dtype=torch.bfloat16, device=DEV, kv_cache_dtype="fp8_ds_mla")
    runner.write_kv(0, torch.arange(runner.num_slots, device=DEV),
                    torch.randn(runner.num_slots, R8 + ROPE, device=DEV), None)
    pool = make_index_k_buffer(runner, DI)
    pool[0].copy_(_index_keys(runner.num_slots, torch.bfloat16))
    batch = place_extend_round(runner, seq_lens, ext_lens)
    backend = DSAExtend(runner, index_topk=index_topk, index_k_buffer=pool)
    layer = AttentionLayer(layer_id=0, scaling=0.2)
    backend.init_forward_metadata(batch)
    q, k, idx = _fp8_inputs(sum(ext_lens), torch.bfloat16)
    out = backend.forward(layer, q, k, None, **idx)
    _close(out, reference_dsa_extend(runner, layer, q, batch, index_topk=index_topk,
                                     index_pool=pool[0], index_q=idx["index_q"],
                                     index_weights=idx["index_weights"]), torch.bfloat16)


def test_fp8_capability_and_layout_errors():
    """Declared honestly: dsa takes "fp8_ds_mla" and nothing else of the FP8 layouts; other
    rows refuse an FP8 runner; wrong shapes and pools name the argument."""
    from specattn.backends.triton import TritonDecode

    for cls in (DSADecode, DSAExtend):
        assert cls.kv_cache_dtypes == ("auto", "fp8_ds_mla")
        assert "kv auto/fp8_ds_mla" in cls.describe()["capabilities"]
    fp8 = DraftRunner.mla(H, R8, ROPE, num_layers=1, num_slots=8, max_reqs=1,
                          max_context_len=8, dtype=torch.float32, device=DEV,
                          kv_cache_dtype="fp8_ds_mla")
    assert DSADecode(fp8, 1, 2).runner is fp8
    with pytest.raises(BackendUnavailableError, match="kv_cache_dtype"):
        TritonDecode(fp8, 1, 2)
    v4 = DraftRunner.mla(H, R8, 0, num_layers=1, num_slots=8, max_reqs=1, max_context_len=8,
                         dtype=torch.float32, device=DEV, kv_cache_dtype="fp8_ds_v4")
    with pytest.raises(BackendUnavailableError, match="kv_cache_dtype"):
        DSADecode(v4, 1, 2)
    with pytest.raises(InvalidInputError, match="kv_lora_rank"):
        DraftRunner.mla(H, 96, ROPE, num_layers=1, num_slots=8, max_reqs=1, max_context_len=8,
                        kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(InvalidInputError, match="kv_cache_dtype"):
        DraftRunner.wrap_mha(fp8.req_to_token, [torch.zeros(8, 1, R8, device=DEV)],
                             [torch.zeros(8, 1, R8, device=DEV)], H,
                             kv_cache_dtype="fp8_ds_mla")
    # Wrapping: the width is solved from the bytes; a plain pool or a wrong width is refused.
    wrapped = DraftRunner.wrap_mla(fp8.req_to_token, fp8.kv_buffer, H, R8,
                                   kv_cache_dtype="fp8_ds_mla")
    assert wrapped.qk_rope_head_dim == ROPE and wrapped.dtype == torch.bfloat16
    with pytest.raises(InvalidInputError, match="kv_buffer"):
        DraftRunner.wrap_mla(fp8.req_to_token, [fp8.kv_buffer[0][:, :-3]], H, R8,
                             kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(InvalidInputError, match=r"runner\.kv_buffer\[0\]"):
        DraftRunner.wrap_mla(fp8.req_to_token, [fp8.kv_buffer[0].to(torch.int8)], H, R8,
                             kv_cache_dtype="fp8_ds_mla")
