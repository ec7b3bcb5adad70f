"""Triton ``tl.dot`` kernels: shared-prefix split-KV attention (decode and extend), the KV write.

A *group* is the query rows sharing one request's prefix: a request's ``K`` lanes (shared
decode), one lane (``per-branch``) or a request's ``E_b`` new tokens (extend); per KV head
its ``n_q * G`` rows (``G = H_q / H_kv``; MLA: ``G = H``) map ``m -> (m // G, kv_head * G +
m % G)`` and are tiled ``BLOCK_M`` at a time so QK and PV run on tensor cores. Prefix splits walk
slices of ``R_b[0 : prefix_len]`` (lengths from the metadata kernels: a fixed grid), each
key tile loaded once for the group; the tail is each lane's ``step + 1`` history slots
(decode; ``path`` mode through ``parents``) or the new tokens (extend, causal). Each program
writes a normalised fp32 partial and its natural-log LSE (``-inf``: no key) for
``specattn.kernels.merge.merge_partials``. Keys are gathered through ``req_to_token`` (any
page size); ``BLOCK_M, BLOCK_N, BLOCK_D >= 16``.

FP8 pools: the tiles widen the codes to the query tile's dtype (``tiles.widen``). ``Q_F16``
(FP8 pools under a bf16 model): the query tile is prescaled fp16 (``tiles.query_operand``,
the factor folded into ``sm_scale``), so the dots are fp16 with fp32 accumulation: codes ->
fp16 is one exact conversion, where widening to bf16 goes through fp32 intermediates in every
tile. The partials stay fp32 and the output the query's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...kernels.fp8_codes import quantize_block
from ...kernels.latent import load_latent
from ...kernels.pdl import launch_dependents, wait_for_primary
from ...kernels.tiles import (Q_F16_SCALE, attend_kv, attend_tile, finite, in_pool, load_kv,
                              load_q, lse, nonfinite_rows, poison_rows, query_operand,
                              softmax_update, widen)

# Meta row layout written by the metadata kernels: [rpi, prefix_len, split_len, q_start, n_q].
META_W = tl.constexpr(5)
# MODE: 0 lane-mode decode, 1 path-mode decode, 2 extend.
MODE_PATH = tl.constexpr(1)
MODE_EXTEND = tl.constexpr(2)


@triton.jit
def _partial_attn_kernel(
        Q, Kb, Vb, Kin, Vin, MidO, MidLse, ReqToToken, Meta, Hist, Parents, KScale, VScale,
        WKScale, WVScale, step, sm_scale, logit_cap, q_prescale,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
        stride_kin_t, stride_kin_h, stride_vin_t, stride_vin_h,
        stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
        stride_r2t, stride_par_s, stride_par_b, num_slots,
        TOPK, NUM_STEPS, LANES_PER_GROUP, NUM_SPLITS,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
        D_MAIN: tl.constexpr, D_PE: tl.constexpr,
        D_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr,
        BLOCK_DV: tl.constexpr, V_IS_K: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, USE_CAP: tl.constexpr, SCALED: tl.constexpr,
        DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr = False,
        Q_F16: tl.constexpr = False, NEW_KV: tl.constexpr = False,
        BLOCK_KW: tl.constexpr = 16, V_CVT: tl.constexpr = False, FP8: tl.constexpr = False,
        K_QUANT: tl.constexpr = 0, V_QUANT: tl.constexpr = 0, E5M2: tl.constexpr = False,
        SATURATE: tl.constexpr = True, SIGNED_NAN: tl.constexpr = True):
    """Grid ``(row_blocks, groups * H_kv, NUM_SPLITS + 1)``; program ``split == NUM_SPLITS``
    walks the tail (fusing it into the last split measured ~10% slower on the H200).

    Q: [rows, H_q, D_MAIN + D_PE]; Kb/Vb: pools [slots, H_kv, D] (MLA: one latent pool,
    V = its first D_V columns), this call's KV already stored, or with NEW_KV (decode and
    extend, pools of the call's dtype) stored by the tail programs: each stores its row
    block's lanes' (extend: new tokens') keys and values, Kin / Vin [rows, H_kv, D]
    (``BLOCK_KW``: the key row's width, a power of two), at ``Hist[row, step]`` and reads
    them from Kin / Vin, not back from the pool (another program of the launch may not have
    stored them yet; the prefix splits never read them). NEW_KV with FP8 (FP8 pools): the
    tail program stores torch's codes of the keys and values its tail reads
    (``fp8_codes.quantize_block`` with ``WKScale`` / ``WVScale``, ``K_QUANT`` / ``V_QUANT``
    and the conversion variant, as ``_write_kv_kernel``: decode, its own lanes'; extend,
    every new token up to its block's last) and reads them back from the pool after a
    barrier. MidO:
    [rows, H_q, NUM_SPLITS + 1, D_V] fp32; MidLse: [rows, H_q, NUM_SPLITS + 1] fp32; Meta:
    [B, 5] int32; Hist: [lanes, NUM_STEPS] int32 (decode; extend: [tokens, 1], the new
    tokens' slots);
    Parents: [NUM_STEPS, B, TOPK] (path mode). SCALED (FP8 pools): Kb/Vb hold codes, a
    key is ``code * KScale[0]``, a value ``code * VScale[0]``: the key scale folds into the
    softmax scale, the value scale into the normalised output. Q_F16 (SCALED, bf16 Q): q and
    qpe are ``q * q_prescale`` (``2^-8``) in fp16 and ``sm_scale`` is times ``2^8``; every
    tile, prefix and tail, widens its codes to fp16 and P.V takes an fp16 P (see the module
    doc); V_CVT (``tiles.cvt_args``): the value tiles widen by inline PTX. PDL (a
    programmatic dependent launch after ``_write_kv_kernel``): only the tail reads the KV
    that launch writes, so only the tail program waits for it; every program lets the merge
    launch after its key loop.
    """
    rb = tl.program_id(0)
    gh = tl.program_id(1)
    split = tl.program_id(2)
    gi = gh // NUM_KV_HEADS
    kvh = gh % NUM_KV_HEADS
    b, q_start, n_q, rpi, prefix_len, split_len = _group_of(gi, Meta, TOPK, LANES_PER_GROUP,
                                                            MODE)
    n_rows = n_q * GROUP
    row_lo = rb * BLOCK_M
    live = row_lo < n_rows  # row blocks past a short extend request do nothing

    offs_m = row_lo + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_rows
    q_local = offs_m // GROUP  # lane (decode) or new-token index (extend) within the group
    head = kvh * GROUP + offs_m % GROUP
    q_row = (q_start + q_local).to(tl.int64)
    q, qpe = load_q(Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh, row_ok,
                    D_MAIN, D_PE, BLOCK_D, BLOCK_DPE, DOT_F32, Q_F16, q_prescale)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    r2t_row = ReqToToken + rpi * stride_r2t
    if SCALED:
        sm_scale = sm_scale * tl.load(KScale)
    if Q_F16:
        sm_scale = sm_scale * Q_F16_SCALE

    if split < NUM_SPLITS:
        start, end = _split_bounds(split, split_len, prefix_len, live)
        for n0 in range(start, end, BLOCK_N):
            slot, key_ok, vis = _prefix_keys(r2t_row, n0 + offs_n, end, row_ok, num_slots)
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, qpe, Kb + slot * stride_ks + kvh * stride_kh,
                Vb + slot * stride_vs + kvh * stride_vh, key_ok, vis, sm_scale, logit_cap,
                D_MAIN, D_PE, D_V, BLOCK_D, BLOCK_DPE, BLOCK_DV, V_IS_K, USE_CAP, DOT_PREC,
                DOT_F32, V_CVT)
    else:
        if PDL and not NEW_KV:
            wait_for_primary()  # this call's KV, stored by the launch before
        n_lo, n_hi, hl = _tail_range(row_lo, n_q, live, True, step, GROUP, BLOCK_M, MODE)
        if NEW_KV:
            # The row block's own lanes (decode: ``n_lo // hl``) or new tokens (extend, whose
            # tail starts at token 0 in every block): a token whose rows straddle two blocks
            # is stored by both, the same bytes. An FP8 extend's tail reads every new token
            # up to the block's last back from the pool: the block stores them all.
            if FP8 and MODE == MODE_EXTEND:
                for l0 in range(0, n_hi // hl, BLOCK_M):
                    _store_new_kv(l0, n_hi // hl, q_start, kvh, Kin, Vin, Kb, Vb, Hist, step,
                                  WKScale, WVScale, stride_kin_t, stride_kin_h, stride_vin_t,
                                  stride_vin_h, stride_ks, stride_kh, stride_vs, stride_vh,
                                  NUM_STEPS, num_slots, D_MAIN + D_PE, BLOCK_KW, D_V, BLOCK_DV,
                                  V_IS_K, BLOCK_M, FP8, K_QUANT, V_QUANT, E5M2, SATURATE,
                                  SIGNED_NAN)
            else:
                _store_new_kv(row_lo // GROUP, n_hi // hl, q_start, kvh, Kin, Vin, Kb, Vb, Hist,
                              step, WKScale, WVScale, stride_kin_t, stride_kin_h, stride_vin_t,
                              stride_vin_h, stride_ks, stride_kh, stride_vs, stride_vh,
                              NUM_STEPS, num_slots, D_MAIN + D_PE, BLOCK_KW, D_V, BLOCK_DV,
                              V_IS_K, BLOCK_M, FP8, K_QUANT, V_QUANT, E5M2, SATURATE,
                              SIGNED_NAN)
            if FP8:
                tl.debug_barrier()  # the codes stored, visible to the block's loads below
        for n0 in range(n_lo, n_hi, BLOCK_N):
            idx, key_ok, slot, vis = _tail_keys(n0 + offs_n, n_hi, row_ok, hl, q_local, q_start,
                                                b, step, r2t_row, prefix_len, Hist, Parents,
                                                stride_par_s, stride_par_b, TOPK, NUM_STEPS,
                                                num_slots, MODE)
            k_rows = Kb + slot * stride_ks + kvh * stride_kh
            v_rows = Vb + slot * stride_vs + kvh * stride_vh
            if NEW_KV and not FP8:  # a lane's last key is its new one: read from Kin / Vin
                new, src = _new_keys(idx, key_ok, hl, q_start, MODE)
                k_rows = tl.where(new, Kin + src * stride_kin_t + kvh * stride_kin_h, k_rows)
                v_rows = tl.where(new, Vin + src * stride_vin_t + kvh * stride_vin_h, v_rows)
            k, kpe, v = load_kv(k_rows, v_rows, key_ok, D_MAIN, D_PE, D_V, BLOCK_D, BLOCK_DPE,
                                BLOCK_DV, V_IS_K)
            if MODE == MODE_EXTEND:
                # Causal new tokens: P.V reads the values with non-finite ones zeroed (else
                # 0 * NaN reaches earlier rows) and the rows that see such a key become NaN
                # (decode tails do not: ``TritonDecode.known_limits``).
                v = widen(v, q.dtype, V_CVT)  # FP8 codes: widened before any arithmetic on them
                bad = nonfinite_rows(v)
                acc, m_i, l_i = attend_kv(acc, m_i, l_i, q, qpe, k, kpe, finite(v), vis,
                                          sm_scale, logit_cap, D_PE, False, USE_CAP, DOT_PREC,
                                          DOT_F32, V_CVT)
                acc = poison_rows(vis, bad, acc)
            else:
                acc, m_i, l_i = attend_kv(acc, m_i, l_i, q, qpe, k, kpe, v, vis, sm_scale,
                                          logit_cap, D_PE, V_IS_K, USE_CAP, DOT_PREC, DOT_F32,
                                          V_CVT)
    if PDL:
        launch_dependents()

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SCALED:
        o = o * tl.load(VScale)
    offs_dv = tl.arange(0, BLOCK_DV)
    o_mask = row_ok[:, None] & (offs_dv < D_V)[None, :]
    mo = MidO + q_row[:, None] * stride_mo_t + head[:, None] * stride_mo_h
    ml = MidLse + q_row * stride_ml_t + head * stride_ml_h
    tl.store(mo + split * stride_mo_s + offs_dv[None, :], o, mask=o_mask)
    tl.store(ml + split, lse(m_i, l_i), mask=row_ok)


@triton.jit
def _split_bounds(split, split_len, prefix_len, live):
    """Prefix positions ``[start, end)`` of prefix split ``split`` (empty when not ``live``)."""
    start = split * split_len
    end = tl.minimum(prefix_len, start + split_len)
    return start, tl.where(live, end, start)


@triton.jit
def _prefix_keys(r2t_row, pos, end, row_ok, num_slots):
    """Prefix positions ``pos [BLOCK_N]`` -> ``(slot int64, key_ok [BLOCK_N], vis
    [BLOCK_M, BLOCK_N])`` through the request's ``req_to_token`` row (clamped into the
    pool)."""
    key_ok = pos < end
    slot = in_pool(tl.load(r2t_row + pos, mask=key_ok, other=0).to(tl.int64), num_slots)
    return slot, key_ok, key_ok[None, :] & row_ok[:, None]


@triton.jit
def _new_keys(idx, key_ok, hl, q_start, MODE: tl.constexpr):
    """Tail key ``idx [BLOCK_N]`` -> ``(new, src)``: whether it is written by this call
    (decode: a lane's current step, the last of its ``hl`` slots; extend: every new token) and
    its row in the call's k / v (int64)."""
    if MODE == MODE_EXTEND:
        new = key_ok
        src = q_start + idx
    else:
        new = key_ok & (idx % hl == hl - 1)
        src = q_start + idx // hl
    return new, src.to(tl.int64)


@triton.jit
def _store_new_kv(l0, l_hi, q_start, kvh, Kin, Vin, Kb, Vb, Hist, step, WKScale, WVScale,
                  stride_kin_t, stride_kin_h, stride_vin_t, stride_vin_h, stride_ks, stride_kh,
                  stride_vs, stride_vh, NUM_STEPS, num_slots, KW: tl.constexpr,
                  BLOCK_KW: tl.constexpr, D_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                  V_IS_K: tl.constexpr, BLOCK_M: tl.constexpr, FP8: tl.constexpr,
                  K_QUANT: tl.constexpr, V_QUANT: tl.constexpr, E5M2: tl.constexpr,
                  SATURATE: tl.constexpr, SIGNED_NAN: tl.constexpr):
    """Store KV head ``kvh``'s new keys and values of the group's lanes (extend: new tokens)
    ``[l0, min(l0 + BLOCK_M, l_hi))`` (``_store_new_keys``)."""
    lanes = l0 + tl.arange(0, BLOCK_M)
    src = (q_start + lanes).to(tl.int64)
    ok = lanes < l_hi
    _store_new_keys(ok, src, Kin + kvh * stride_kin_h, Kb + kvh * stride_kh, Hist, step,
                    stride_kin_t, stride_ks, NUM_STEPS, num_slots, KW, BLOCK_KW, WKScale, FP8,
                    K_QUANT, E5M2, SATURATE, SIGNED_NAN)
    if not V_IS_K:
        _store_new_keys(ok, src, Vin + kvh * stride_vin_h, Vb + kvh * stride_vh, Hist, step,
                        stride_vin_t, stride_vs, NUM_STEPS, num_slots, D_V, BLOCK_DV, WVScale,
                        FP8, V_QUANT, E5M2, SATURATE, SIGNED_NAN)


@triton.jit
def _store_new_keys(new, src, Kin, KV, Hist, step, stride_kin_t, stride_kvs, NUM_STEPS,
                    num_slots, KW: tl.constexpr, BLOCK_KW: tl.constexpr, Scale=None,
                    FP8: tl.constexpr = False, QUANT: tl.constexpr = 0,
                    E5M2: tl.constexpr = False, SATURATE: tl.constexpr = True,
                    SIGNED_NAN: tl.constexpr = True):
    """Store the new rows ``new [BLOCK_N]`` (rows ``src`` of Kin: latent rows, or one KV
    head's keys or values) at their slots ``Hist[src, step]`` (``KW`` = the row width); a
    slot outside the pool is not written. FP8: as torch's codes (``_copy_rows``)."""
    dst = tl.load(Hist + src * NUM_STEPS + step, mask=new, other=0).to(tl.int64)
    new = new & (dst >= 0) & (dst < num_slots)
    _copy_rows(Kin + src * stride_kin_t, KV + dst * stride_kvs, new, KW, BLOCK_KW, Scale, FP8,
               QUANT, E5M2, SATURATE, SIGNED_NAN)


@triton.jit
def _copy_rows(src_rows, dst_rows, ok, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, Scale=None,
               FP8: tl.constexpr = False, QUANT: tl.constexpr = 0, E5M2: tl.constexpr = False,
               SATURATE: tl.constexpr = True, SIGNED_NAN: tl.constexpr = True):
    """Copy ``WIDTH`` elements of each row ``src_rows[i] -> dst_rows[i]`` where ``ok[i]``
    (``BLOCK_W >= WIDTH``, a power of two). FP8 (an FP8 pool): stores the codes
    ``fp8_codes.quantize_block`` gives (``Scale``, ``QUANT`` and the variant)."""
    offs = tl.arange(0, BLOCK_W)
    m = ok[:, None] & (offs < WIDTH)[None, :]
    x = tl.load(src_rows[:, None] + offs[None, :], mask=m, other=0.0)
    if FP8:
        x = quantize_block(x, Scale, QUANT, E5M2, SATURATE, SIGNED_NAN).to(
            dst_rows.dtype.element_ty, bitcast=True)
    tl.store(dst_rows[:, None] + offs[None, :], x.to(dst_rows.dtype.element_ty), mask=m)


@triton.jit
def _group_of(gi, Meta, TOPK, LANES_PER_GROUP, MODE: tl.constexpr):
    """Group ``gi`` -> ``(b, q_start, n_q, rpi, prefix_len, split_len)`` from ``Meta``."""
    if MODE == MODE_EXTEND:
        b = gi
        q_start = tl.load(Meta + b * META_W + 3)
        n_q = tl.load(Meta + b * META_W + 4)
    else:
        b = (gi * LANES_PER_GROUP) // TOPK
        q_start = gi * LANES_PER_GROUP
        n_q = LANES_PER_GROUP
    rpi = tl.load(Meta + b * META_W).to(tl.int64)
    prefix_len = tl.load(Meta + b * META_W + 1)
    split_len = tl.load(Meta + b * META_W + 2)
    return b, q_start, n_q, rpi, prefix_len, split_len


@triton.jit
def _tail_range(row_lo, n_q, live, is_tail, step, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                MODE: tl.constexpr):
    """Key index range ``[n_lo, n_hi)`` of the tail (history / new tokens) that the row
    block ``[row_lo, row_lo + BLOCK_M)`` can see, and ``hl`` (keys per lane); empty unless
    ``is_tail``."""
    local_hi = tl.minimum(n_q, (row_lo + BLOCK_M + GROUP - 1) // GROUP)
    if MODE == MODE_EXTEND:
        hl = 1
        n_lo = 0
    else:
        hl = step + 1
        n_lo = (row_lo // GROUP) * hl
    n_hi = tl.where(live & is_tail, local_hi * hl, n_lo)
    return n_lo, n_hi, hl


@triton.jit
def _tail_keys(idx, n_hi, row_ok, hl, q_local, q_start, b, step, r2t_row, prefix_len, Hist,
               Parents, stride_par_s, stride_par_b, TOPK, NUM_STEPS, num_slots,
               MODE: tl.constexpr):
    """Tail keys ``idx [BLOCK_N]`` (those ``< n_hi`` exist) -> ``(idx, key_ok, slot int64
    [BLOCK_N], vis [BLOCK_M, BLOCK_N])`` for the rows ``row_ok``.

    decode: key ``idx`` is lane ``idx // hl``'s history slot ``t = idx % hl`` (path mode: of
    its ancestor at depth ``t``, followed through ``parents``), visible to that lane's rows;
    extend: new token ``idx``, visible to rows ``t >= idx`` (causal)."""
    key_ok = idx < n_hi
    if MODE == MODE_EXTEND:
        slot = in_pool(tl.load(r2t_row + prefix_len + idx, mask=key_ok, other=0).to(tl.int64),
                       num_slots)
        vis = idx[None, :] <= q_local[:, None]
    else:
        key_lane = idx // hl
        t = idx % hl
        z = q_start + key_lane
        if MODE == MODE_PATH:
            # Ancestor of lane z at depth t: a_step = j, a_{u-1} = parents[u, b, a_u].
            a = z % TOPK
            for uu in range(0, step):
                u = step - uu
                par = tl.load(Parents + u * stride_par_s + b * stride_par_b + a,
                              mask=key_ok, other=0)
                a = tl.where(t < u, par.to(tl.int32), a)
            z = b * TOPK + a
        # Hist was clamped into the pool by the metadata kernel (no per-load cost here).
        slot = tl.load(Hist + z * NUM_STEPS + t, mask=key_ok, other=0)
        vis = key_lane[None, :] == q_local[:, None]
    return idx, key_ok, slot.to(tl.int64), vis & key_ok[None, :] & row_ok[:, None]


@triton.jit
def _mla_tile(acc_a, acc_b, m_i, l_i, qa, qb, qpe, rows, key_ok, vis, sm_scale, logit_cap,
              D_HALF: tl.constexpr, D_PE: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_DPE: tl.constexpr, USE_CAP: tl.constexpr, DOT_PREC: tl.constexpr,
              DOT_F32: tl.constexpr, CAUSAL: tl.constexpr = False):
    """One MLA key tile, ``rows [BLOCK_N]``: pointers to each key's latent row (pool or new
    k), loaded as two halves ``ka``, ``kb`` and the rope part; ``S = qa.ka + qb.kb +
    qpe.kpe``, ``acc_a += P.ka``, ``acc_b += P.kb``. ``CAUSAL`` (extend tails): P.V reads the
    tile with non-finite values zeroed and the rows that see such a key become NaN, so a bad
    key reaches exactly the rows that attend to it (``0 * NaN`` is NaN in P.V). FP8 codes are
    widened exactly to the query tile's dtype (``tiles.widen``; fp16 under ``Q_F16``), for S
    and P.V, and P is cast to it."""
    ca, cb, cpe = load_latent(rows[:, None], key_ok, 0, D_HALF, D_HALF, D_PE, BLOCK_H,
                              BLOCK_DPE)
    ka, kb = widen(ca, qa.dtype), widen(cb, qa.dtype)
    s = tl.dot(qa, tl.trans(ka), input_precision=DOT_PREC)
    s = tl.dot(qb, tl.trans(kb), s, input_precision=DOT_PREC)
    s = tl.dot(qpe, tl.trans(widen(cpe, qa.dtype)), s, input_precision=DOT_PREC)
    p, alpha, m_new, l_i = softmax_update(s, vis, m_i, l_i, sm_scale, logit_cap, USE_CAP)
    va, vb = ka, kb
    if CAUSAL:
        bad = nonfinite_rows(ka) | nonfinite_rows(kb)
        va, vb = finite(ka), finite(kb)
    p = p.to(ka.dtype)
    acc_a = tl.dot(p, va, acc_a * alpha[:, None], input_precision=DOT_PREC)
    acc_b = tl.dot(p, vb, acc_b * alpha[:, None], input_precision=DOT_PREC)
    if CAUSAL:
        acc_a, acc_b = poison_rows(vis, bad, acc_a), poison_rows(vis, bad, acc_b)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _mla_partial_kernel(
        Q, KV, Kin, MidO, MidLse, ReqToToken, Meta, Hist, Parents, KScale,
        step, sm_scale, logit_cap, q_prescale,
        stride_qt, stride_qh, stride_kvs, stride_kin_t,
        stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
        stride_r2t, stride_par_s, stride_par_b, num_slots,
        TOPK, NUM_STEPS, LANES_PER_GROUP, NUM_SPLITS,
        GROUP: tl.constexpr, MODE: tl.constexpr, D_HALF: tl.constexpr, D_PE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, USE_CAP: tl.constexpr, BLOCK_KW: tl.constexpr,
        SCALED: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
        PDL: tl.constexpr = False, Q_F16: tl.constexpr = False):
    """Grid ``(row_blocks, groups, NUM_SPLITS)``.

    Q: [rows, H, 2 * D_HALF + D_PE] (absorbed); KV: latent pool [slots, 2 * D_HALF + D_PE]
    (V = its first 2 * D_HALF columns); Kin: this call's latent rows [rows, 2 * D_HALF +
    D_PE]; MidO: [rows, H, >= NUM_SPLITS, 2 * D_HALF] fp32; MidLse: [rows, H, >= NUM_SPLITS]
    fp32. All ``K * H`` rows of a group are one tile (``BLOCK_M`` = 64 fits ``K = 4, H =
    16``: the wgmma height), q stays on chip, each key tile is loaded once for S and P.V.
    Split 0 stores Kin at ``Hist[row, step]``; the tail reads those keys from Kin. SCALED
    (FP8 pools): the caller stored this call's codes, the tail reads them from the pool, and
    a latent row is ``code * KScale[0]`` (folded into the softmax scale and the output).
    Q_F16 (SCALED, bf16 Q): qa, qb and qpe are ``q * q_prescale`` (``2^-8``) in fp16 and
    ``sm_scale`` is times ``2^8``; the tiles' dots are fp16 (see the module doc).
    PDL: every program lets the merge launch after its key loop. The kernel itself is an
    ordinary launch: its every load (Q, Kin, Meta) may come from the launch before it.
    """
    rb = tl.program_id(0)
    gi = tl.program_id(1)
    split = tl.program_id(2)
    b, q_start, n_q, rpi, prefix_len, split_len = _group_of(gi, Meta, TOPK, LANES_PER_GROUP,
                                                            MODE)
    n_rows = n_q * GROUP
    row_lo = rb * BLOCK_M
    live = row_lo < n_rows

    offs_m = row_lo + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_rows
    q_local = offs_m // GROUP
    head = offs_m % GROUP
    q_row = (q_start + q_local).to(tl.int64)
    q_base = Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh
    offs_h = tl.arange(0, BLOCK_H)
    hmask = row_ok[:, None] & (offs_h < D_HALF)[None, :]
    qa, qb, qpe = load_latent(q_base, row_ok, 0, D_HALF, D_HALF, D_PE, BLOCK_H, BLOCK_DPE)
    qa = query_operand(qa, Q_F16, DOT_F32, q_prescale)
    qb = query_operand(qb, Q_F16, DOT_F32, q_prescale)
    qpe = query_operand(qpe, Q_F16, DOT_F32, q_prescale)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    r2t_row = ReqToToken + rpi * stride_r2t
    if SCALED:
        kv_scale = tl.load(KScale)
        sm_scale = sm_scale * kv_scale
    if Q_F16:
        sm_scale = sm_scale * Q_F16_SCALE

    if not SCALED:
        if split == 0:
            n_lo, n_hi, hl = _tail_range(row_lo, n_q, live, True, step, GROUP, BLOCK_M, MODE)
            for n0 in range(n_lo, n_hi, BLOCK_N):
                new, src = _new_keys(n0 + offs_n, n0 + offs_n < n_hi, hl, q_start, MODE)
                _store_new_keys(new, src, Kin, KV, Hist, step, stride_kin_t, stride_kvs,
                                NUM_STEPS, num_slots, 2 * D_HALF + D_PE, BLOCK_KW)
    start, end = _split_bounds(split, split_len, prefix_len, live)
    for n0 in range(start, end, BLOCK_N):
        slot, key_ok, vis = _prefix_keys(r2t_row, n0 + offs_n, end, row_ok, num_slots)
        acc_a, acc_b, m_i, l_i = _mla_tile(
            acc_a, acc_b, m_i, l_i, qa, qb, qpe, KV + slot * stride_kvs, key_ok, vis,
            sm_scale, logit_cap, D_HALF, D_PE, BLOCK_H, BLOCK_DPE, USE_CAP, DOT_PREC, DOT_F32)
    n_lo, n_hi, hl = _tail_range(row_lo, n_q, live, split == NUM_SPLITS - 1, step, GROUP,
                                 BLOCK_M, MODE)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        idx, key_ok, slot, vis = _tail_keys(n0 + offs_n, n_hi, row_ok, hl, q_local, q_start, b,
                                            step, r2t_row, prefix_len, Hist, Parents,
                                            stride_par_s, stride_par_b, TOPK, NUM_STEPS,
                                            num_slots, MODE)
        rows = KV + slot * stride_kvs
        if not SCALED:
            new, src = _new_keys(idx, key_ok, hl, q_start, MODE)
            rows = tl.where(new, Kin + src * stride_kin_t, rows)
        acc_a, acc_b, m_i, l_i = _mla_tile(
            acc_a, acc_b, m_i, l_i, qa, qb, qpe, rows, key_ok, vis, sm_scale, logit_cap,
            D_HALF, D_PE, BLOCK_H, BLOCK_DPE, USE_CAP, DOT_PREC, DOT_F32, MODE == MODE_EXTEND)
    if PDL:
        launch_dependents()

    seen = l_i > 0.0
    inv = 1.0 / tl.where(seen, l_i, 1.0)
    if SCALED:
        inv = inv * kv_scale
    mo = MidO + q_row[:, None] * stride_mo_t + head[:, None] * stride_mo_h + split * stride_mo_s
    tl.store(mo + offs_h[None, :], acc_a * inv[:, None], mask=hmask)
    tl.store(mo + D_HALF + offs_h[None, :], acc_b * inv[:, None], mask=hmask)
    tl.store(MidLse + q_row * stride_ml_t + head * stride_ml_h + split, lse(m_i, l_i),
             mask=row_ok)
