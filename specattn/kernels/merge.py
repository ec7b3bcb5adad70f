"""Triton LSE merges of split-KV partial results (natural-log LSEs).

- ``merge_kernel``: stage 2 of a split-KV launch, grid ``(rows, H)``: ``Out[t, h] = sum_s w_s
  MidO[t, h, s]`` with ``w = softmax(MidLse[t, h, :])``; ``merge_partials`` launches it;
- ``merge_rows``: the same for a block of rows inside a stage-1 program (fused merge), with
  ``arrived_last``, the arrival counter that elects the program that merges.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..util import next_pow2


@triton.jit
def merge_kernel(MidO, MidLse, Out, stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t,
                 stride_ml_h, stride_ot, stride_oh,
                 NUM_PARTS: tl.constexpr, BLOCK_P: tl.constexpr, D_V: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
    """Stage 2: Out[t, h] = sum_s w_s MidO[t, h, s] with w = softmax(MidLse[t, h, :])."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_dv = tl.arange(0, BLOCK_DV)
    p_ok = offs_p < NUM_PARTS
    lse = tl.load(MidLse + t * stride_ml_t + h * stride_ml_h + offs_p, mask=p_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    parts = tl.load(MidO + t * stride_mo_t + h * stride_mo_h + offs_p[:, None] * stride_mo_s
                    + offs_dv[None, :], mask=p_ok[:, None] & (offs_dv < D_V)[None, :],
                    other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_dv, o.to(Out.dtype.element_ty),
             mask=offs_dv < D_V)


def merge_partials(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor,
                   parts: int) -> None:
    """One ``merge_kernel`` launch: ``out [rows, H, D_v]`` from the first ``parts`` partials of
    ``mid_o [rows, H, >= parts, D_v]`` / ``mid_lse [rows, H, >= parts]`` (fp32, unit last
    stride)."""
    rows, heads, d_v = out.shape
    merge_kernel[(rows, heads)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        NUM_PARTS=parts, BLOCK_P=next_pow2(parts), D_V=d_v, BLOCK_DV=next_pow2(d_v, 16),
        num_warps=4 if d_v >= 256 else 2)


@triton.jit
def arrived_last(counter, num_parts):
    """Called by every program of a tile once its partial is stored: True for the last of
    the ``num_parts`` to arrive, which re-arms ``counter`` (int32, 0) for the next launch."""
    # All threads' partial stores precede the program's single (release) increment; the last
    # arriver's increment (acquire) orders its reads of the others' partials after them.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    last = arrived == num_parts - 1
    if last:
        tl.store(counter, 0)
    return last


@triton.jit
def merge_rows(mo, ml, stride_mo_s, num_parts, row_ok, out, offs_c, c_ok,
               BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """``out[r, c] = sum_p w_p mo[r, p, c]``, ``w = softmax_p(ml[r, p])`` (natural log) for
    the columns ``offs_c [BLOCK_C]`` (``c_ok``) of rows ``row_ok [BLOCK_M]``. mo / out:
    [BLOCK_M, 1] row pointers; ml: [BLOCK_M] LSE row pointers. Loads bypass L1 (``.cg``):
    the partials were written by other programs."""
    offs_p = tl.arange(0, BLOCK_P)
    lse = tl.load(ml[:, None] + offs_p[None, :],
                  mask=row_ok[:, None] & (offs_p < num_parts)[None, :],
                  other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m[:, None])
    den = tl.sum(w, 1)
    mask = row_ok[:, None] & c_ok[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    for p in range(0, num_parts):
        w_p = tl.sum(tl.where(offs_p[None, :] == p, w, 0.0), 1)
        part = tl.load(mo + p * stride_mo_s + offs_c[None, :], mask=mask, other=0.0,
                       cache_modifier=".cg")
        acc += part * w_p[:, None]
    o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(out + offs_c[None, :], o.to(out.dtype.element_ty), mask=mask)
