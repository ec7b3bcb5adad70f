"""Triton kernels of ``dsa``: the lightning indexer and split-K sparse MLA over slot lists.

Indexer, grid ``(groups, cdiv(key_width, BLOCK_N))``. A group is one request's query rows
(decode: its ``K`` lanes; extend: its ``E_b`` new tokens), all scoring the same request's
positions. The program loads one tile of ``BLOCK_N`` index keys ``k_idx[R_b[x]]`` once and
scores it for every row of the group (that is what ``topk > 1`` lanes share: the key reads;
the scores themselves are per row, since every lane has its own index query)::

    Scores[row, x] = sum_h w[row, h] * relu(q_idx[row, h] . k_idx[R_b[x]])   (x < vis[row])

and ``-inf`` past the row's visible length. Top-k is ``torch.topk`` on the scores.

Sparse MLA, grid ``(rows, head_blocks, NUM_SPLITS + 1)``: split ``s < NUM_SPLITS`` walks one
slice of the row's slot list ``Sel[row, :]`` (``-1`` = nothing), split ``NUM_SPLITS`` walks
the row's draft history (decode; extend has none). MLA scores ``q . [c | k_pe]``, value ``c``
(``kernels.latent.latent_tile``); each split writes a normalised partial and its
natural-log LSE, which ``kernels.merge.merge_kernel`` combines.

FP8 pools (``kv_cache_dtype="fp8_ds_mla"``, ``specattn.kv_layouts``): the sparse-MLA kernel
loads each key's bytes (e4m3 codes, fp32 block scales, bf16 RoPE) and dequantizes them in
registers with integer/float ops (``kernels.latent.fp8_load``; no fp8 bitcast, so the
interpreter runs it too), then runs the same online softmax on fp32 operands. The indexer
keeps its own bf16/fp16/fp32 index-key pool (upstream's 132-byte FP8 index-K cache is not
built).

Limits: ``BLOCK_* >= 16`` (``tl.dot``); fp32 partials.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...kernels.latent import fp8_args, head_tile_sizes, latent_tile
from ...kernels.merge import merge_partials
from ...kernels.tiles import dot_args, in_pool, load_q
from ...util import next_pow2

MAX_SPLITS = 8


@triton.jit
def _index_score_kernel(IdxQ, IdxW, IdxPool, Scores, ReqToToken, RowMeta, GroupMeta,
                        stride_qt, stride_qh, stride_wt, stride_ps, stride_st, stride_r2t,
                        key_width, num_slots, NUM_IDX_HEADS, IDX_DIM,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """IdxQ: [rows, nh, d]; IdxW: [rows, nh]; IdxPool: [slots, d]; Scores: [rows, width]
    fp32; RowMeta: [rows, 2] int32 (req row, visible length); GroupMeta: [groups, 4] int32
    (req row, first row, rows, key length)."""
    g = tl.program_id(0)
    nb = tl.program_id(1)
    rpi = tl.load(GroupMeta + g * 4).to(tl.int64)
    row0 = tl.load(GroupMeta + g * 4 + 1)
    n_rows = tl.load(GroupMeta + g * 4 + 2)
    key_len = tl.load(GroupMeta + g * 4 + 3)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    in_width = offs_n < key_width
    key_ok = offs_n < key_len
    slot = in_pool(tl.load(ReqToToken + rpi * stride_r2t + offs_n, mask=key_ok,
                           other=0).to(tl.int64), num_slots)
    k = tl.load(IdxPool + slot[:, None] * stride_ps + offs_d[None, :],
                mask=key_ok[:, None] & (offs_d < IDX_DIM)[None, :], other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
    h_ok = offs_h < NUM_IDX_HEADS
    for i in range(0, n_rows):
        row = (row0 + i).to(tl.int64)
        vis = tl.load(RowMeta + row * 2 + 1)
        q = tl.load(IdxQ + row * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None] & (offs_d < IDX_DIM)[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        w = tl.load(IdxW + row * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        s = tl.maximum(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), 0.0)
        score = tl.sum(s * w[:, None], 0)
        score = tl.where(offs_n < vis, score, float("-inf"))
        tl.store(Scores + row * stride_st + offs_n, score, mask=in_width)


@triton.jit
def _sparse_mla_kernel(Q, Kv, MidO, MidLse, Sel, Hist,
                       sm_scale, logit_cap, sel_width, split_len, HL, page_size, num_slots,
                       stride_qt, stride_qh, stride_ks, stride_sel, stride_hist,
                       stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
                       NUM_HEADS, NUM_SPLITS,
                       D_MAIN: tl.constexpr, D_PE: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       USE_CAP: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
                       FMT: tl.constexpr, D_NOPE: tl.constexpr, D_ROPE: tl.constexpr,
                       TILE: tl.constexpr):
    """Q: [rows, H, D_MAIN + D_PE]; Kv: latent pool [slots, D_MAIN + D_PE] (FMT 0), or uint8
    [slots, bytes_per_token] in FP8 layout FMT (1 fp8_ds_mla, 2 fp8_ds_v4); Sel: [rows,
    sel_width] int32 slots (-1 = none); Hist: [rows, HL] int32; MidO: [rows, H, parts,
    D_MAIN] fp32; MidLse: [rows, H, parts] fp32."""
    r = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    head = hb * BLOCK_M + tl.arange(0, BLOCK_M)
    head_ok = head < NUM_HEADS
    q, qpe = load_q(Q + r * stride_qt + head[:, None] * stride_qh, head_ok, D_MAIN, D_PE,
                    BLOCK_D, BLOCK_DPE, DOT_F32 or FMT != 0)
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if split < NUM_SPLITS:
        start = split * split_len
        end = tl.minimum(sel_width, start + split_len)
        for n0 in range(start, end, BLOCK_N):
            e = n0 + offs_n
            in_list = e < end
            slot = tl.load(Sel + r * stride_sel + e, mask=in_list, other=-1)
            key_ok = in_list & (slot >= 0)
            vis = key_ok[None, :] & head_ok[:, None]
            slot = in_pool(slot.to(tl.int64), num_slots)
            acc, m_i, l_i = latent_tile(
                acc, m_i, l_i, q, qpe, slot, key_ok, vis, Kv, stride_ks, page_size, sm_scale,
                logit_cap, D_MAIN, D_PE, BLOCK_D, BLOCK_DPE, FMT, D_NOPE, D_ROPE, TILE,
                USE_CAP, DOT_PREC, DOT_F32)
    else:
        for n0 in range(0, HL, BLOCK_N):
            e = n0 + offs_n
            key_ok = e < HL
            slot = in_pool(tl.load(Hist + r * stride_hist + e, mask=key_ok, other=0).to(tl.int64),
                           num_slots)
            vis = key_ok[None, :] & head_ok[:, None]
            acc, m_i, l_i = latent_tile(
                acc, m_i, l_i, q, qpe, slot, key_ok, vis, Kv, stride_ks, page_size, sm_scale,
                logit_cap, D_MAIN, D_PE, BLOCK_D, BLOCK_DPE, FMT, D_NOPE, D_ROPE, TILE,
                USE_CAP, DOT_PREC, DOT_F32)
    LN2: tl.constexpr = 0.6931471805599453
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    mo = MidO + r * stride_mo_t + head[:, None] * stride_mo_h + split * stride_mo_s
    tl.store(mo + offs_d[None, :], o, mask=head_ok[:, None] & (offs_d < D_MAIN)[None, :])
    tl.store(MidLse + r * stride_ml_t + head * stride_ml_h + split, lse, mask=head_ok)


# --- launchers (run step: tensors only, graph-safe) -----------------------------------------


def index_scores(index_q: torch.Tensor, index_weights: torch.Tensor, index_pool: torch.Tensor,
                 req_to_token: torch.Tensor, row_meta: torch.Tensor, group_meta: torch.Tensor,
                 scores: torch.Tensor) -> torch.Tensor:
    """Fill ``scores [rows, width]`` (fp32) for the ``rows = index_q.shape[0]`` rows.

    index_q: ``[rows, nh, d]``; index_weights: ``[rows, nh]``; index_pool: ``[slots, d]``;
    row_meta: ``[rows, 2]``; group_meta: ``[groups, 4]`` int32 (module doc)."""
    rows, nh, d = index_q.shape
    width = scores.shape[1]
    block_n = 64 if index_q.device.type != "cpu" else 32
    grid = (group_meta.shape[0], triton.cdiv(width, block_n))
    _index_score_kernel[grid](
        index_q, index_weights, index_pool, scores, req_to_token, row_meta, group_meta,
        index_q.stride(0), index_q.stride(1), index_weights.stride(0), index_pool.stride(0),
        scores.stride(0), req_to_token.stride(0), width, index_pool.shape[0], nh, d,
        BLOCK_H=next_pow2(nh, 16), BLOCK_D=next_pow2(d, 16), BLOCK_N=block_n,
        **dot_args(index_q.dtype, index_q.device), num_warps=4)
    return scores


def choose_num_splits(sel_width: int, device: torch.device) -> int:
    """Slices of the slot list: about 256 entries each on a GPU (16 on the interpreter)."""
    per = 16 if device.type == "cpu" else 256
    return max(1, min(MAX_SPLITS, triton.cdiv(sel_width, per)))


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, layer, sel: torch.Tensor, hist: torch.Tensor,
               hl: int, kv_lora_rank: int, num_splits: int,
               mid: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               layout=None) -> torch.Tensor:
    """Sparse MLA + merge. q: ``[rows, H, R + rope]`` → ``[rows, H, R]`` in ``q.dtype``.

    kv: the latent pool ``[slots, R + rope]``, or with ``layout`` (``kv_layouts.KVLayout``) its
    uint8 FP8 pool ``[slots, bytes_per_token]`` (dequantized in the kernel). sel: ``[rows, W]``
    int32 slots (``-1`` = none); hist: ``[rows, hl]`` int32; mid: flat fp32 scratch ``(o,
    lse)`` to reuse (fixed CUDA-graph buffers), else allocated."""
    rows, heads, width = q.shape
    rope = width - kv_lora_rank
    parts = num_splits + 1
    n_o, n_l = rows * heads * parts * kv_lora_rank, rows * heads * parts
    if mid is None or mid[0].numel() < n_o or mid[1].numel() < n_l:
        mid = (torch.empty(n_o, dtype=torch.float32, device=q.device),
               torch.empty(n_l, dtype=torch.float32, device=q.device))
    mid_o = mid[0][:n_o].view(rows, heads, parts, kv_lora_rank)
    mid_lse = mid[1][:n_l].view(rows, heads, parts)
    out = torch.empty(rows, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    block_d, block_m, block_n, warps = head_tile_sizes(kv_lora_rank, heads, layout is not None,
                                                       q.device)
    sel_width = sel.shape[1]
    split_len = triton.cdiv(triton.cdiv(max(1, sel_width), num_splits), block_n) * block_n
    grid = (rows, triton.cdiv(heads, block_m), parts)
    _sparse_mla_kernel[grid](
        q, kv, mid_o, mid_lse, sel, hist, float(layer.scaling), float(layer.logit_cap),
        sel_width, split_len, hl, layout.page_size if layout is not None else 1, kv.shape[0],
        q.stride(0), q.stride(1), kv.stride(0), sel.stride(0),
        hist.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), heads, num_splits,
        D_MAIN=kv_lora_rank, D_PE=rope, BLOCK_D=block_d, BLOCK_DPE=next_pow2(rope, 16),
        BLOCK_M=block_m, BLOCK_N=block_n, USE_CAP=layer.logit_cap > 0,
        **dot_args(q.dtype, q.device), **fp8_args(layout),
        num_warps=warps, num_stages=2)
    merge_partials(mid_o, mid_lse, out, parts)
    return out
