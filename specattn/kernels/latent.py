"""Triton tile loads of latent (MLA) rows, plain or FP8.

- ``load_latent``: a latent row ``[2 * D_HALF + D_PE]`` as two halves and its rope part (the
  Triton backend's MLA kernel reads keys and queries this way);
- FP8 pools (``specattn.kv_layouts``): ``fp8_offsets`` (byte addresses of a token in layout
  ``FMT``: 1 = ``fp8_ds_mla``, inline fp32 scales; 2 = ``fp8_ds_v4``, page-blocked ue8m0),
  ``fp8_load`` (dequantized columns), ``fp8_attend_tile`` (``tiles.attend_tile`` over them);
- ``latent_tile``: one key tile of a latent pool in whatever layout it has (``FMT == 0``: plain
  rows, V = the first ``D_MAIN`` columns), ``fp8_args`` for its constexprs and
  ``head_tile_sizes`` for kernels that tile query heads x latent keys (``dsa``, ``dsv4``).

The e4m3 codes are decoded arithmetically (no ``tl.float8e4nv`` bitcast), so the same code
runs on a GPU and under ``TRITON_INTERPRET=1``; fp32 scales and bf16 RoPE values are assembled
from their little-endian bytes and bitcast.
"""

from __future__ import annotations

import triton
import triton.language as tl

import torch

from ..util import next_pow2
from .tiles import attend_tile, softmax_update


@triton.jit
def load_latent(row, ok, off_a, off_b, D_HALF: tl.constexpr, D_PE: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_DPE: tl.constexpr):
    """Rows ``row [R, 1]`` (pointers; ``ok [R]``) of a latent layout ``[2 * D_HALF + D_PE]``
    as ``(half at off_a, half at off_b, rope)`` in their stored dtype: the MLA kernel's keys
    and its queries (which ``tiles.query_operand`` makes dot operands)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_pe = tl.arange(0, BLOCK_DPE)
    hmask = ok[:, None] & (offs_h < D_HALF)[None, :]
    a = tl.load(row + off_a + offs_h[None, :], mask=hmask, other=0.0)
    b = tl.load(row + off_b + offs_h[None, :], mask=hmask, other=0.0)
    pe = tl.load(row + 2 * D_HALF + offs_pe[None, :],
                 mask=ok[:, None] & (offs_pe < D_PE)[None, :], other=0.0)
    return a, b, pe


@triton.jit
def e4m3_to_f32(b):
    """uint8 e4m3fn codes (as int32) → float32: sign, 4-bit exponent (bias 7), 3-bit mantissa;
    exponent 0 is subnormal (``m * 2^-9``), ``0x7F``/``0xFF`` are NaN."""
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    mag = (tl.where(e > 0, 8.0, 0.0) + m) * tl.exp2((tl.maximum(e, 1) - 10).to(tl.float32))
    val = tl.where((b & 128) != 0, -mag, mag)
    return tl.where((b & 127) == 127, float("nan"), val)


@triton.jit
def fp8_offsets(slot, page_size, FMT: tl.constexpr, D_NOPE: tl.constexpr,
                D_ROPE: tl.constexpr, NUM_TILES: tl.constexpr):
    """Byte offsets ``(nope, scale, rope)`` of tokens ``slot [BLOCK_N]`` (int64) in a pool of
    layout FMT (1 = fp8_ds_mla, inline fp32 scales; 2 = fp8_ds_v4, page-blocked ue8m0)."""
    if FMT == 1:
        nope = slot * (D_NOPE + 4 * NUM_TILES + 2 * D_ROPE)
        scale = nope + D_NOPE
        rope = scale + 4 * NUM_TILES
    else:
        row = D_NOPE + 2 * D_ROPE
        page = slot // page_size
        within = slot - page * page_size
        base = page * page_size * (row + NUM_TILES + 1)
        nope = base + within * row
        scale = base + page_size * row + within * (NUM_TILES + 1)
        rope = nope + D_NOPE
    return nope, scale, rope


@triton.jit
def fp8_load(Pool, nope_off, scale_off, rope_off, key_ok, cols, col_ok,
             FMT: tl.constexpr, D_NOPE: tl.constexpr, TILE: tl.constexpr):
    """Dequantized values ``[BLOCK_N, len(cols)]`` fp32 of vector columns ``cols`` (``< D_NOPE``:
    e4m3 * block scale; above: the bf16 RoPE part); 0 where masked."""
    is_nope = col_ok & (cols < D_NOPE)
    is_rope = col_ok & (cols >= D_NOPE)
    mn = key_ok[:, None] & is_nope[None, :]
    mr = key_ok[:, None] & is_rope[None, :]
    b = tl.load(Pool + nope_off[:, None] + cols[None, :], mask=mn, other=0).to(tl.int32)
    tile = cols // TILE
    if FMT == 1:
        sp = Pool + scale_off[:, None] + 4 * tile[None, :]
        bits = tl.load(sp, mask=mn, other=0).to(tl.uint32)
        bits |= tl.load(sp + 1, mask=mn, other=0).to(tl.uint32) << 8
        bits |= tl.load(sp + 2, mask=mn, other=0).to(tl.uint32) << 16
        bits |= tl.load(sp + 3, mask=mn, other=0).to(tl.uint32) << 24
        scale = bits.to(tl.float32, bitcast=True)
    else:
        e = tl.load(Pool + scale_off[:, None] + tile[None, :], mask=mn, other=127)
        scale = tl.exp2(e.to(tl.float32) - 127.0)
    nope = e4m3_to_f32(b) * scale
    rp = Pool + rope_off[:, None] + 2 * (cols[None, :] - D_NOPE)
    lo = tl.load(rp, mask=mr, other=0).to(tl.uint32)
    hi = tl.load(rp + 1, mask=mr, other=0).to(tl.uint32)
    rope = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)
    return tl.where(is_nope[None, :], nope, tl.where(is_rope[None, :], rope, 0.0))


@triton.jit
def fp8_attend_tile(acc, m_i, l_i, q, qpe, slot, key_ok, vis, Pool, page_size, sm_scale,
                    logit_cap, D_MAIN: tl.constexpr, D_PE: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, FMT: tl.constexpr,
                    D_NOPE: tl.constexpr, D_ROPE: tl.constexpr, TILE: tl.constexpr,
                    USE_CAP: tl.constexpr, DOT_PREC: tl.constexpr):
    """``attend_tile`` over an FP8 pool (fp32 operands; ``q``/``qpe`` already fp32): keys
    are vector columns ``[0, D_MAIN)`` (+ ``[D_MAIN, D_MAIN + D_PE)`` scored by ``qpe``),
    values are columns ``[0, D_MAIN)``."""
    nope_off, scale_off, rope_off = fp8_offsets(slot, page_size, FMT, D_NOPE, D_ROPE,
                                                D_NOPE // TILE)
    offs_d = tl.arange(0, BLOCK_D)
    k = fp8_load(Pool, nope_off, scale_off, rope_off, key_ok, offs_d, offs_d < D_MAIN,
                 FMT, D_NOPE, TILE)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if D_PE > 0:
        offs_pe = tl.arange(0, BLOCK_DPE)
        kpe = fp8_load(Pool, nope_off, scale_off, rope_off, key_ok, D_MAIN + offs_pe,
                       offs_pe < D_PE, FMT, D_NOPE, TILE)
        s += tl.dot(qpe, tl.trans(kpe), input_precision=DOT_PREC)
    p, alpha, m_new, l_i = softmax_update(s, vis, m_i, l_i, sm_scale, logit_cap, USE_CAP)
    acc = acc * alpha[:, None] + tl.dot(p, k, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def latent_tile(acc, m_i, l_i, q, qpe, slot, key_ok, vis, Kv, stride_ks, page_size, sm_scale,
                logit_cap, D_MAIN: tl.constexpr, D_PE: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DPE: tl.constexpr, FMT: tl.constexpr, D_NOPE: tl.constexpr,
                D_ROPE: tl.constexpr, TILE: tl.constexpr, USE_CAP: tl.constexpr,
                DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """One key tile of the latent pool in its layout: plain rows (``FMT == 0``, the triton
    backend's ``attend_tile``, V = the first D_MAIN columns) or an FP8 byte layout."""
    if FMT == 0:
        rows = Kv + slot * stride_ks
        return attend_tile(acc, m_i, l_i, q, qpe, rows, rows, key_ok, vis, sm_scale,
                           logit_cap, D_MAIN, D_PE, D_MAIN, BLOCK_D, BLOCK_DPE, BLOCK_D, True,
                           USE_CAP, DOT_PREC, DOT_F32)
    else:
        return fp8_attend_tile(acc, m_i, l_i, q, qpe, slot, key_ok, vis, Kv, page_size,
                               sm_scale, logit_cap, D_MAIN, D_PE, BLOCK_D, BLOCK_DPE, FMT,
                               D_NOPE, D_ROPE, TILE, USE_CAP, DOT_PREC)


def fp8_args(layout) -> dict:
    """The FP8 constexprs of a pool layout (``kv_layouts.KVLayout`` or None = plain)."""
    if layout is None:
        return dict(FMT=0, D_NOPE=0, D_ROPE=0, TILE=1)
    return dict(FMT=layout.fmt, D_NOPE=layout.d_nope, D_ROPE=layout.d_rope, TILE=layout.tile)


def head_tile_sizes(dim: int, heads: int, fp8: bool,
                    device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_D, BLOCK_M, BLOCK_N, num_warps)`` of a kernel whose programs attend
    ``BLOCK_M`` query heads to ``BLOCK_N``-key tiles of ``dim``-wide latent rows."""
    block_d = next_pow2(dim, 16)
    block_m = min(next_pow2(heads, 16), 16 if block_d >= 256 else 32)
    block_n = 32 if block_d >= 256 else 64
    if fp8 and block_d >= 256 and device.type != "cpu":
        block_n = 16  # fp32 key tiles after dequantization: keep the registers in bounds
    return block_d, block_m, block_n, 4 if block_d <= 128 else 8
