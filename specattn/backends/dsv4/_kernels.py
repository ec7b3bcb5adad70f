"""Triton kernel of ``dsv4``: sink-aware sliding-window single-KV-head attention.

Grid ``(rows, cdiv(H, BLOCK_M))``. Row ``r`` has a key sequence of ``prefix_len + HL`` keys:
logical key ``x < prefix_len`` is ``req_to_token[rpi, x]``, key ``x >= prefix_len`` is
``Hist[r, x - prefix_len]`` (decode: the lane's ``HL = step + 1`` history slots; extend:
``HL = 0``, ``prefix_len = p + 1``). The program attends its ``BLOCK_M`` heads to the last
``WINDOW`` keys in one pass (at most ``WINDOW`` keys: no split-K, no merge), then scales the
normalised output by ``1 / (1 + exp(sink_h - lse_h))`` (natural-log LSE).

FP8 pools (``kv_cache_dtype="fp8_ds_v4"``, V4's page-blocked 584-byte layout in
``specattn.kv_layouts``): each key tile is loaded as bytes (e4m3 codes with ue8m0 block exponents,
then the bf16 RoPE tail) and dequantized in registers by the ``dsa`` kernels' ``fp8_load``
(integer/float ops, interpreter-safe); the whole ``D`` vector (e4m3 part and RoPE part) is
both key and value.

Limits: keys equal values (``V_IS_K``), one KV head, ``BLOCK_D >= 16`` (``tl.dot``), fp32
accumulation.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...kernels.latent import fp8_args, head_tile_sizes, latent_tile
from ...kernels.tiles import dot_args, in_pool, load_q
from ...sink_window import window_key_pool


@triton.jit
def _window_kernel(Q, Pool, Out, ReqToToken, Meta, Hist, Sink,
                   sm_scale, logit_cap, HL, WINDOW, page_size, num_slots,
                   stride_qt, stride_qh, stride_ps, stride_ot, stride_oh, stride_r2t,
                   stride_hist, NUM_HEADS,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_SINK: tl.constexpr, USE_CAP: tl.constexpr,
                   DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, FMT: tl.constexpr,
                   D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, TILE: tl.constexpr):
    """Q: [rows, H, D]; Pool: [slots, D] (FMT 0) or uint8 [slots, bytes_per_token] in FP8
    layout FMT; Out: [rows, H, D]; Meta: [rows, 2] int32 (req row, prefix_len); Hist: [rows,
    HL] int32; Sink: [H] fp32."""
    r = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    rpi = tl.load(Meta + r * 2).to(tl.int64)
    prefix_len = tl.load(Meta + r * 2 + 1)
    total = prefix_len + HL
    lo = tl.maximum(total - WINDOW, 0)

    head = hb * BLOCK_M + tl.arange(0, BLOCK_M)
    head_ok = head < NUM_HEADS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q, _ = load_q(Q + r * stride_qt + head[:, None] * stride_qh, head_ok, D, 0, BLOCK_D, 16,
                  DOT_F32 or FMT != 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    r2t_row = ReqToToken + rpi * stride_r2t
    for n0 in range(lo, total, BLOCK_N):
        x = n0 + offs_n
        key_ok = x < total
        in_prefix = x < prefix_len
        s_pre = tl.load(r2t_row + x, mask=key_ok & in_prefix, other=0)
        s_his = tl.load(Hist + r * stride_hist + (x - prefix_len),
                        mask=key_ok & (x >= prefix_len), other=0)
        slot = in_pool(tl.where(in_prefix, s_pre, s_his).to(tl.int64), num_slots)
        vis = key_ok[None, :] & head_ok[:, None]
        acc, m_i, l_i = latent_tile(
            acc, m_i, l_i, q, q, slot, key_ok, vis, Pool, stride_ps, page_size, sm_scale,
            logit_cap, D, 0, BLOCK_D, 16, FMT, D_NOPE, D_ROPE, TILE, USE_CAP, DOT_PREC,
            DOT_F32)

    LN2: tl.constexpr = 0.6931471805599453
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    if HAS_SINK:
        lse = (m_i + tl.log2(l_safe)) * LN2
        sink = tl.load(Sink + head, mask=head_ok, other=float("-inf"))
        # exp(lse) / (exp(lse) + exp(sink)); sink = -inf gives 1, +inf gives 0.
        o = o * (1.0 / (1.0 + tl.exp(sink - lse)))[:, None]
    tl.store(Out + r * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(Out.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])


def window_attention(q: torch.Tensor, runner, layer, meta: torch.Tensor, hist: torch.Tensor,
                     hl: int, window: int, sink: Optional[torch.Tensor]) -> torch.Tensor:
    """Run step (graph-safe: launches only). q: ``[rows, H, D]`` → ``[rows, H, D]``.

    meta: ``[rows, 2]`` int32 (req row, prefix_len); hist: ``[rows, hl]`` int32. An FP8 runner
    (``runner.kv_layout``) passes its uint8 pool and layout constants."""
    pool = window_key_pool(runner, layer.layer_id)
    layout = runner.kv_layout
    rows, heads, dim = q.shape
    out = torch.empty_like(q)
    if rows == 0:
        return out
    block_d, block_m, block_n, warps = head_tile_sizes(dim, heads, layout is not None,
                                                       q.device)
    grid = (rows, triton.cdiv(heads, block_m))
    _window_kernel[grid](
        q, pool, out, runner.req_to_token, meta, hist, sink if sink is not None else q,
        float(layer.scaling), float(layer.logit_cap), hl, window,
        layout.page_size if layout is not None else 1, pool.shape[0],
        q.stride(0), q.stride(1), pool.stride(0), out.stride(0), out.stride(1),
        runner.req_to_token.stride(0), hist.stride(0), heads,
        D=dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SINK=sink is not None, USE_CAP=layer.logit_cap > 0,
        **dot_args(q.dtype, q.device), **fp8_args(layout), num_warps=warps, num_stages=2)
    return out
