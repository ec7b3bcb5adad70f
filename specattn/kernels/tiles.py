"""Triton building blocks of every specattn attention kernel: one key tile of an online
softmax, from loading the tile to updating the running state.

State of a block of ``BLOCK_M`` query rows: ``acc [BLOCK_M, BLOCK_DV]`` (unnormalised output,
fp32), ``m_i [BLOCK_M]`` (running max of the scores, base 2) and ``l_i [BLOCK_M]`` (running
sum). ``lse(m_i, l_i)`` turns a finished state into its natural-log LSE (``-inf`` for rows that
saw no key), the currency of the split-KV merges (``merge.py``, ``history_merge.py``).

- ``load_q``: a block of query rows (and their rope part);
- ``attend_tile``: load one key tile through per-key row pointers and fold it in;
- ``load_kv`` / ``attend_kv``: the same in two halves, for callers that edit the loaded tile
  (the Triton backend's tail swaps in this call's new keys);
- ``softmax_update``: the online-softmax step on raw scores (scale, soft cap, mask);
- ``widen``: FP8 codes as a dot operand of a wider dtype, exactly and cheaply (``cvt_args``:
  where inline PTX may do it);
- ``query_operand``: a query tile as a dot operand, fp16 (``F16``) or fp32 (``F32``);
- ``dot_args``: the launch-time precision constexprs of these tiles.

The tiles widen K and V to the query tile's dtype and cast P to it, so that dtype is the
dots' dtype. FP8 pools under a bf16 model (the ``F16`` query, ``Q_F16`` in the kernels): the
query tile is fp16, prescaled by ``2^-8`` (``Q_F16_SCALE``, folded into the softmax scale),
so that every code widens to fp16 in one exact conversion and P.V takes an fp16 P; widening
to bf16 adds fp32 intermediates and their instructions to every tile (``widen``).

Latent (MLA) and FP8 tiles: ``latent.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..util import device_capability, device_index

# FP8 pools under a bf16 model: the query tile is ``q / Q_F16_SCALE`` in fp16 and the softmax
# scale ``sm_scale * Q_F16_SCALE``. A power of two: exact both ways; fp16 then holds |q| up
# to 2^8 * 65504 ~ 2^24 (bf16's range is wider, its 8-bit mantissa narrower), and values
# from 2^-9 up keep every bit of their bf16 mantissa. The kernels take the prescale
# ``Q_F16_PRESCALE`` as a runtime argument: with a constant factor the compiler moves the
# multiplication past the conversion to fp16 (``fptrunc(fmul(fpext(q), 2^-8))`` becomes an
# fp16 multiply, exact but for overflow), and queries past fp16's range become infinities.
Q_F16_SCALE = tl.constexpr(256.0)
Q_F16_PRESCALE = 1.0 / 256.0


def dot_args(dtype: torch.dtype, device: torch.device) -> dict:
    """The ``DOT_PREC`` / ``DOT_F32`` constexprs of a launch: exact fp32 dots for fp32 inputs
    and on the CPU interpreter (whose low-precision ``tl.dot`` is wrong, triton 3.9, so
    operands are upcast there), tf32 otherwise."""
    interp = device.type == "cpu"  # the Triton CPU interpreter
    return dict(DOT_PREC="ieee" if dtype == torch.float32 or interp else "tf32",
                DOT_F32=interp)


@triton.jit
def widen(x, DTYPE: tl.constexpr, CVT: tl.constexpr = False):
    """``x`` (any shape) as ``DTYPE``: FP8 codes exactly, through fp16; other dtypes by
    ``.to``.

    Every e4m3 and e5m2 code is an fp16 value (e4m3's smallest subnormal, 2^-9, is a normal
    fp16; e5m2 is the top byte of an fp16), so codes -> fp16 is one hardware conversion for
    two codes (``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2``): the ``tl.dot`` kernels take FP8 tiles
    as fp16 (``query_operand``'s fp16 query under a bf16 model). Any other ``DTYPE`` (the
    interpreter's fp32 dots) follows from the fp16 value, exactly.

    ``CVT`` (CUDA sm89+, ``cvt_args``; fp16 ``DTYPE``): the same conversion as inline PTX,
    which the compiler cannot move: the codes widen where they were loaded, and what moves
    into the dot's operand layout is fp16. For a P.V tile that matters: its operand runs
    down the keys, which for bytes is one shared-memory load per code, for fp16 the
    transposing ``ldmatrix`` (``docs/kernels.md``)."""
    if x.dtype == DTYPE:
        y = x
    elif CVT and x.dtype.is_fp8() and DTYPE == tl.float16:
        y = _cvt_f16(x)
    elif x.dtype.is_fp8():
        y = x.to(tl.float16).to(DTYPE)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def _cvt_f16(x):
    """FP8 codes ``x`` -> fp16 by ``cvt.rn.f16x2``, four codes (one 32-bit register) per
    call: the first two into the first output register, low byte first."""
    if x.dtype == tl.float8e5:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 c<2>; mov.b32 {c0, c1}, $2; cvt.rn.f16x2.e5m2x2 $0, c0; "
            "cvt.rn.f16x2.e5m2x2 $1, c1; }", "=r,=r,r", [x], dtype=tl.float16,
            is_pure=False, pack=4)
    else:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 c<2>; mov.b32 {c0, c1}, $2; cvt.rn.f16x2.e4m3x2 $0, c0; "
            "cvt.rn.f16x2.e4m3x2 $1, c1; }", "=r,=r,r", [x], dtype=tl.float16,
            is_pure=False, pack=4)
    return y


def cvt_args(device: torch.device) -> bool:
    """Whether the FP8 tiles of a launch on ``device`` may widen by inline PTX (``widen``'s
    ``CVT``): CUDA (not ROCm) with compute capability 8.9 or newer (the first with the
    FP8 conversions), never on the interpreter."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return device_capability(device_index(device)) >= (8, 9)


@triton.jit
def query_operand(q, F16: tl.constexpr, F32: tl.constexpr, prescale=1.0):
    """A loaded query tile as the dots' operand: with ``F16``, ``q * prescale`` rounded to
    fp16 (``prescale``: the kernel's runtime ``Q_F16_PRESCALE``; the caller multiplies its
    softmax scale by ``Q_F16_SCALE``); then fp32 when ``F32`` (the interpreter:
    ``attend_tile``), so the interpreter sees the fp16 query's values."""
    if F16:
        q = (q.to(tl.float32) * prescale).to(tl.float16)
    if F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def load_q(rows, row_ok, D_MAIN: tl.constexpr, D_PE: tl.constexpr, BLOCK_D: tl.constexpr,
           BLOCK_DPE: tl.constexpr, F32: tl.constexpr, F16: tl.constexpr = False,
           prescale=1.0):
    """Query rows ``rows [BLOCK_M, 1]`` (pointers; ``row_ok [BLOCK_M]``) as ``(q [BLOCK_M,
    BLOCK_D], qpe [BLOCK_M, BLOCK_DPE])``: columns ``[0, D_MAIN)`` and ``[D_MAIN, D_MAIN +
    D_PE)`` (``qpe = q`` when ``D_PE == 0``), 0 where masked, as ``query_operand`` (``F16``:
    times ``prescale`` in fp16; ``F32``: fp32)."""
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(rows + offs_d[None, :], mask=row_ok[:, None] & (offs_d < D_MAIN)[None, :],
                other=0.0)
    if D_PE > 0:
        offs_pe = tl.arange(0, BLOCK_DPE)
        qpe = tl.load(rows + D_MAIN + offs_pe[None, :],
                      mask=row_ok[:, None] & (offs_pe < D_PE)[None, :], other=0.0)
    else:
        qpe = q
    return query_operand(q, F16, F32, prescale), query_operand(qpe, F16, F32, prescale)


@triton.jit
def attend_tile(acc, m_i, l_i, q, qpe, k_rows, v_rows, key_ok, vis, sm_scale, logit_cap,
                D_MAIN: tl.constexpr, D_PE: tl.constexpr, D_V: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
                V_IS_K: tl.constexpr, USE_CAP: tl.constexpr, DOT_PREC: tl.constexpr,
                DOT_F32: tl.constexpr, V_CVT: tl.constexpr = False):
    """One key tile: k_rows / v_rows [BLOCK_N] (pointers to each key's K / V row of this KV
    head), key_ok [BLOCK_N], vis [BLOCK_M, BLOCK_N].

    DOT_F32 (interpreter only): the CPU interpreter's bf16 ``tl.dot`` is wrong (triton 3.9),
    so operands are upcast to fp32 there (``load_q`` gives an fp32 ``q``, the tiles follow
    it); on a GPU the dots take the storage dtype."""
    k, kpe, v = load_kv(k_rows, v_rows, key_ok, D_MAIN, D_PE, D_V, BLOCK_D, BLOCK_DPE,
                        BLOCK_DV, V_IS_K)
    return attend_kv(acc, m_i, l_i, q, qpe, k, kpe, v, vis, sm_scale, logit_cap, D_PE,
                     V_IS_K, USE_CAP, DOT_PREC, DOT_F32, V_CVT)


@triton.jit
def load_kv(k_rows, v_rows, ok, D_MAIN: tl.constexpr, D_PE: tl.constexpr, D_V: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
            V_IS_K: tl.constexpr):
    """K [BLOCK_N, BLOCK_D], its rope part [BLOCK_N, BLOCK_DPE] (D_PE > 0) and V
    [BLOCK_N, BLOCK_DV] (V_IS_K: K itself) of the rows ``ok`` (others 0)."""
    offs_d = tl.arange(0, BLOCK_D)
    k = tl.load(k_rows[:, None] + offs_d[None, :],
                mask=ok[:, None] & (offs_d < D_MAIN)[None, :], other=0.0)
    kpe = k
    if D_PE > 0:
        offs_pe = tl.arange(0, BLOCK_DPE)
        kpe = tl.load(k_rows[:, None] + D_MAIN + offs_pe[None, :],
                      mask=ok[:, None] & (offs_pe < D_PE)[None, :], other=0.0)
    v = k
    if not V_IS_K:
        offs_dv = tl.arange(0, BLOCK_DV)
        v = tl.load(v_rows[:, None] + offs_dv[None, :],
                    mask=ok[:, None] & (offs_dv < D_V)[None, :], other=0.0)
    return k, kpe, v


@triton.jit
def in_pool(slot, num_slots):
    """A gathered slot clamped into ``[0, num_slots)``: no kernel reads outside the pool,
    whatever ``req_to_token`` or ``out_cache_loc`` hold (value checks that refuse such
    entries run on the CPU and in debug mode: ``validation``)."""
    return tl.minimum(tl.maximum(slot, 0), num_slots - 1)


@triton.jit
def finite(x):
    """``x`` with NaN / inf replaced by 0. For the values of tiles whose keys not every row
    sees (history tails, causal new tokens): a masked key gets probability 0, but ``0 * NaN``
    is NaN in ``P.V`` (``poison_rows`` gives the rows that do see it their NaN back)."""
    return tl.where((x - x) == 0, x, tl.zeros_like(x))


@triton.jit
def nonfinite_rows(x):
    """``[R]`` bool: which rows of the tile ``x [R, C]`` hold a NaN or an infinity."""
    return tl.max(((x - x) != 0).to(tl.int32), 1) > 0


@triton.jit
def poison_rows(vis, bad, acc):
    """``acc [M, C]`` with NaN in the rows that see (``vis [M, N]``) a key marked ``bad [N]``:
    with ``finite`` values in P.V, the rows that attend a non-finite key still get NaN, as
    exact attention gives them, and no other row does."""
    hit = tl.max((vis & bad[None, :]).to(tl.int32), 1) > 0
    return tl.where(hit[:, None], float("nan"), acc)


@triton.jit
def attend_kv(acc, m_i, l_i, q, qpe, k, kpe, v, vis, sm_scale, logit_cap, D_PE: tl.constexpr,
              V_IS_K: tl.constexpr, USE_CAP: tl.constexpr, DOT_PREC: tl.constexpr,
              DOT_F32: tl.constexpr, V_CVT: tl.constexpr = False):
    """The online-softmax update of ``attend_tile`` on loaded tiles (``load_kv``). K / V
    tiles of another dtype than ``q`` (FP8 codes) are widened to it, exactly (``widen``), and
    P is cast to it: ``q``'s dtype is the dots' (fp16 for the ``F16`` query). ``V_CVT``:
    V's codes widen by inline PTX (``widen``'s ``CVT``; K's keep the compiler's conversion,
    which ran faster for the QK operand)."""
    s = tl.dot(q, tl.trans(widen(k, q.dtype)), input_precision=DOT_PREC)
    if D_PE > 0:
        s += tl.dot(qpe, tl.trans(widen(kpe, q.dtype)), input_precision=DOT_PREC)
    p, alpha, m_new, l_i = softmax_update(s, vis, m_i, l_i, sm_scale, logit_cap, USE_CAP)
    if V_IS_K:
        v = k
    v = widen(v, q.dtype, V_CVT and not V_IS_K)  # V_IS_K: the codes K widened already
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def softmax_update(s, vis, m_i, l_i, sm_scale, logit_cap, USE_CAP: tl.constexpr):
    """Online-softmax step on raw scores ``s [BLOCK_M, BLOCK_N]``: returns ``(p, alpha,
    m_new, l_new)`` in base 2 (``p`` unnormalised, ``alpha`` rescales the old state)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    s = s * sm_scale
    if USE_CAP:
        # cap * tanh(s / cap), tanh via the sigmoid (portable to the interpreter).
        s = logit_cap * (2.0 * tl.sigmoid(2.0 * s / logit_cap) - 1.0)
    s = tl.where(vis, s * LOG2E, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen no key yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def lse(m_i, l_i):
    """Natural-log LSE from the base-2 running max and sum; ``-inf`` for rows with no key."""
    LN2: tl.constexpr = 0.6931471805599453
    seen = l_i > 0.0
    return tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
