"""Triton LSE merges of split-KV partial results (natural-log LSEs).

``merge_kernel``: stage 2 of a split-KV launch, grid ``(rows, H)``: ``Out[t, h] = sum_s w_s
MidO[t, h, s]`` with ``w = softmax(MidLse[t, h, :])``; ``merge_partials`` launches it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..util import next_pow2
from .pdl import launch_args, wait_for_primary


@triton.jit
def merge_kernel(MidO, MidLse, Out, stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t,
                 stride_ml_h, stride_ot, stride_oh,
                 NUM_PARTS: tl.constexpr, BLOCK_P: tl.constexpr, D_V: tl.constexpr,
                 BLOCK_DV: tl.constexpr, PDL: tl.constexpr = False):
    """Stage 2: Out[t, h] = sum_s w_s MidO[t, h, s] with w = softmax(MidLse[t, h, :]).
    PDL (a programmatic dependent launch after the partials' kernel): waits for its partials
    before reading them."""
    if PDL:
        wait_for_primary()
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
                   parts: int, pdl: bool = False) -> None:
    """One ``merge_kernel`` launch: ``out [rows, H, D_v]`` from the first ``parts`` partials of
    ``mid_o [rows, H, >= parts, D_v]`` / ``mid_lse [rows, H, >= parts]`` (fp32, unit last
    stride). ``pdl``: a programmatic dependent launch (sm90+; the launch before it wrote the
    partials)."""
    rows, heads, d_v = out.shape
    merge_kernel[(rows, heads)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        NUM_PARTS=parts, BLOCK_P=next_pow2(parts), D_V=d_v, BLOCK_DV=next_pow2(d_v, 16),
        num_warps=4 if d_v >= 256 else 2, **launch_args(pdl, dependent=True))
