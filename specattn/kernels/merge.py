"""Triton LSE merges of split-KV partial results (natural-log LSEs).

``merge_kernel``: stage 2 of a split-KV launch, grid ``(rows, H, chunks)``: ``Out[t, h] =
sum_s w_s MidO[t, h, s]`` with ``w = softmax(MidLse[t, h, :])``; ``merge_partials`` launches
it. ``merge_parts`` is the loop it and the work list's segment merge run: a program owns a
``BLOCK_D``-wide column chunk of one row and folds ``BLOCK_P`` parts per load into an online
softmax.

``chunk_tail_merge_kernel``: FlashAttention's split draft extend (``merge_chunks_and_tail``),
one program per (token, head) folding the prefix chunks' states and the tail's, the
libraries' empty rows (an infinite LSE, any output) weighted 0. ``fold_state`` is its fold of
one state, and ``history_merge``'s of a split prefix's chunk states.

``merge_tiles`` sizes ``merge_kernel`` (the work list's segment merge has a rule of its own,
``worklist.segment_tiles``). Where the output rows alone occupy every SM, one program per
row loads the parts (``chunks`` 1). Where they do not (one request split over every SM: 4
lanes x 16 heads of 132 parts of 512 latent columns, 17 MB, read by 64 programs), the
columns split into chunks of 32, each program loading its rows' parts at once: on the H200
`mla-b1-32k`, whose segment merge this rule then sized, went from 41.7 to 29.5 us. Chunking
rows that fill the GPU lost 7% at `mla-long` and 6% at `mla-b8-p64` (same run), hence the
rule. A program is one warp where its load is at most ``ONE_WARP_LOAD`` values (a chunk) or
its row at most 128 columns, so that the parts fold without a block barrier: in a sweep of
the merge alone (H100) one warp beat two and four at every shape, and the step of six
serving cases took 0.7-3.2% less (docs/kernels.md).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..util import next_pow2, sm_count
from .pdl import launch_args, wait_for_primary

LOG2E = tl.constexpr(1.4426950408889634)
MERGE_TILE = 8192  # parts x columns one chunk program loads at once at most
MERGE_COLUMNS = 32  # columns a chunk program owns
ONE_WARP_LOAD = 4096  # parts x columns a one-warp program loads at once (128 a thread)


class MergeTiles(NamedTuple):
    """How a merge covers ``rows x d_v`` outputs of ``parts`` partials each."""

    chunks: int  # column chunks per row (the grid's last dimension)
    block_d: int  # columns per program
    block_p: int  # parts per load
    num_warps: int


def merge_tiles(rows: int, d_v: int, parts: int, device: torch.device
                ) -> Optional[MergeTiles]:
    """Column chunks for ``rows`` output rows (tokens x heads) of at most ``parts`` partials
    each, or ``None`` where the rows occupy every SM (or the device has no SM count): the
    caller's one program per row. Chunks of ``MERGE_COLUMNS`` columns (16 where the rows are
    so few that the grid would hold fewer programs than SMs), as many parts per load as
    ``MERGE_TILE`` holds."""
    sms = sm_count(device) or 0
    if rows >= sms:
        return None
    width = next_pow2(d_v, 16)
    block_d = min(MERGE_COLUMNS, width)
    while rows * triton.cdiv(d_v, block_d) < sms and block_d > 16:
        block_d //= 2
    block_p = max(1, min(next_pow2(max(1, parts)), MERGE_TILE // block_d))
    # One warp folds its parts without a barrier; four where a load is larger.
    return MergeTiles(triton.cdiv(d_v, block_d), block_d, block_p,
                      1 if block_p * block_d <= ONE_WARP_LOAD else 4)


@triton.jit
def fold_state(m, den, acc, lse, o):
    """Fold one state per row into a running LSE merge of ``R`` rows, base 2: ``m [R]``
    (running max), ``den [R]`` (sum of weights) and ``acc [R, D]`` (weighted outputs) take
    the states of LSE ``lse [R]`` (``-inf``: no keys) and normalised output ``o [R, D]`` (a
    state of no weight adds nothing, whatever its ``o`` holds). Returns the new ``(m, den,
    acc)``."""
    m_new = tl.maximum(m, lse)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # every state so far empty: no NaN
    w = tl.exp2(lse - shift)
    rescale = tl.exp2(m - shift)
    acc = acc * rescale[:, None] + tl.where(w[:, None] > 0, o * w[:, None], 0.0)
    return m_new, den * rescale + w, acc


@triton.jit
def merge_parts(o_row, lse_row, stride_o_part, stride_lse_part, n_parts, offs_d, d_ok,
                BLOCK_P: tl.constexpr):
    """Fold the ``n_parts`` partials of one row (fp32, bf16 or fp16 outputs, fp32 LSEs;
    summed in fp32): ``o_row`` / ``lse_row`` point at part 0's
    output row and LSE, the parts ``stride_o_part`` / ``stride_lse_part`` apart; returns
    ``(acc [BLOCK_D], den)`` with ``acc / den`` the merged columns ``offs_d`` (``den`` is 0
    when every part is empty: ``-inf`` LSEs)."""
    offs_p = tl.arange(0, BLOCK_P)
    m = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    acc = tl.zeros(offs_d.shape, tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        p = p0 + offs_p
        ok = p < n_parts
        lse = tl.load(lse_row + p.to(tl.int64) * stride_lse_part, mask=ok, other=float("-inf"))
        o = tl.load(o_row + p.to(tl.int64)[:, None] * stride_o_part + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse, 0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(lse - shift)
        rescale = tl.exp(m - shift)
        acc = acc * rescale + tl.sum(o * w[:, None], 0)
        den = den * rescale + tl.sum(w, 0)
        m = m_new
    return acc, den


@triton.jit
def merge_kernel(MidO, MidLse, Out, stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t,
                 stride_ml_h, stride_ot, stride_oh,
                 NUM_PARTS: tl.constexpr, BLOCK_P: tl.constexpr, D_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Grid ``(rows, H, cdiv(D_V, BLOCK_D))`` (``merge_tiles``): columns ``[c * BLOCK_D, (c +
    1) * BLOCK_D)`` of ``Out[t, h] = sum_s w_s MidO[t, h, s]`` with ``w = softmax(MidLse[t,
    h, :])`` (NaN where every part is empty). PDL (a programmatic dependent launch after
    the partials' kernel): waits for its partials before reading them."""
    if PDL:
        wait_for_primary()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D_V
    acc, den = merge_parts(MidO + t * stride_mo_t + h * stride_mo_h,
                           MidLse + t * stride_ml_t + h * stride_ml_h, stride_mo_s, 1,
                           NUM_PARTS, offs_d, d_ok, BLOCK_P)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_d, (acc / den).to(Out.dtype.element_ty),
             mask=d_ok)


def merge_partials(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor,
                   parts: int, pdl: bool = False) -> None:
    """One ``merge_kernel`` launch: ``out [rows, H, D_v]`` from the first ``parts`` partials of
    ``mid_o [rows, H, >= parts, D_v]`` / ``mid_lse [rows, H, >= parts]`` (fp32, unit last
    stride). ``pdl``: a programmatic dependent launch (sm90+; the launch before it wrote the
    partials)."""
    rows, heads, d_v = out.shape
    width = next_pow2(d_v, 16)  # else a program a row, every part at once
    t = merge_tiles(rows * heads, d_v, parts, out.device) or MergeTiles(
        1, width, next_pow2(parts), 1 if width <= 128 else 4)
    merge_kernel[(rows, heads, t.chunks)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        NUM_PARTS=parts, BLOCK_P=t.block_p, D_V=d_v, BLOCK_D=t.block_d,
        num_warps=t.num_warps, **launch_args(pdl, dependent=True))


@triton.jit
def chunk_tail_merge_kernel(ChunkO, ChunkLse, TailO, TailLse, Out, num_rows,
                            stride_co_t, stride_co_h, stride_cl_t, stride_cl_h,
                            stride_to_t, stride_to_h, stride_tl_t, stride_tl_h,
                            stride_ot, stride_oh, CHUNKS: tl.constexpr, D_V: tl.constexpr,
                            BLOCK_D: tl.constexpr):
    """Grid ``(rows, H)``: ``Out[t, h]`` merges ``CHUNKS`` chunk states at rows ``c * num_rows
    + t`` of ``ChunkO`` / ``ChunkLse`` and the tail state at row ``t`` of ``TailO`` /
    ``TailLse``. A state with an infinite LSE (either sign: the libraries' empty rows) gets
    no weight, whatever its output holds."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) + tl.zeros([1], tl.int32)  # one head: fold_state's rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = (offs_d < D_V)[None, :]
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, BLOCK_D], tl.float32)
    for c in range(CHUNKS + 1):  # the chunks, then the tail
        if c < CHUNKS:
            row = c * num_rows + t
            lse = tl.load(ChunkLse + row * stride_cl_t + h * stride_cl_h)
            o = tl.load(ChunkO + row * stride_co_t + h[:, None] * stride_co_h + offs_d[None, :],
                        mask=d_ok, other=0.0)
        else:
            lse = tl.load(TailLse + t * stride_tl_t + h * stride_tl_h)
            o = tl.load(TailO + t * stride_to_t + h[:, None] * stride_to_h + offs_d[None, :],
                        mask=d_ok, other=0.0)
        lse = tl.where(lse == float("inf"), float("-inf"), lse) * LOG2E
        m, den, acc = fold_state(m, den, acc, lse, o.to(tl.float32))
    tl.store(Out + t * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
             (acc / den[:, None]).to(Out.dtype.element_ty), mask=d_ok)


def merge_chunks_and_tail(chunk_o: torch.Tensor, chunk_lse: torch.Tensor,
                          tail_o: torch.Tensor, tail_lse: torch.Tensor) -> torch.Tensor:
    """One ``chunk_tail_merge_kernel`` launch: FlashAttention's split draft extend.

    chunk_o ``[C * T, H, D_v]`` / chunk_lse ``[C * T, H]`` (natural log, any strides): the
    ``C`` prefix chunks' states, chunk ``c`` at rows ``c * T : (c + 1) * T``; tail_o ``[T, H,
    D_v]`` / tail_lse ``[T, H]``: the tail's (each row sees at least one key there). Returns
    ``[T, H, D_v]`` in ``tail_o``'s dtype."""
    rows, heads, d_v = tail_o.shape
    chunks = chunk_o.shape[0] // max(1, rows)
    out = torch.empty_like(tail_o)
    if rows == 0:
        return out
    chunk_tail_merge_kernel[(rows, heads)](
        chunk_o, chunk_lse, tail_o, tail_lse, out, rows,
        chunk_o.stride(0), chunk_o.stride(1), chunk_lse.stride(0), chunk_lse.stride(1),
        tail_o.stride(0), tail_o.stride(1), tail_lse.stride(0), tail_lse.stride(1),
        out.stride(0), out.stride(1), CHUNKS=chunks, D_V=d_v, BLOCK_D=next_pow2(d_v, 16),
        num_warps=4 if d_v > 128 else 2)
    return out
