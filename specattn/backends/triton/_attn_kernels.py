"""Triton kernels: shared-prefix split-KV attention (decode and extend) and the LSE merge.

Algorithm (one kernel family serves draft decode, per-branch decode and draft extend):

- A *group* is a set of query rows that share one request's prefix: the ``K`` lanes of a
  request (shared-prefix decode), a single lane (``per-branch`` decode, the upstream design)
  or the ``E_b`` new tokens of a request (extend). Per KV head, the group's rows are
  ``n_q * G`` query rows (``G = H_q / H_kv``; MLA: ``G = H``, one latent head), row
  ``m -> (m // G, kv_head * G + m % G)``, tiled ``BLOCK_M`` at a time so QK and PV run on
  tensor cores (``tl.dot``).
- Stage 1, grid ``(row_blocks, groups * H_kv, NUM_SPLITS + 1)``: programs ``split <
  NUM_SPLITS`` walk one slice of the prefix ``R_b[0 : prefix_len]`` (split length computed on
  the device by the metadata kernel, so the grid is fixed: graph-safe); each prefix tile is
  loaded once for every row of the group. Program ``split == NUM_SPLITS`` walks the *tail*:
  decode: each lane's ``step + 1`` history slots (lane mode: the metadata table; path mode:
  the ancestor chain followed through ``parents`` at run time), masked to the key's own lane;
  extend: the new tokens ``R_b[prefix_len + u]``, causal (``u <= t``). Each program writes a
  normalised partial output and its natural-log LSE (``-inf`` when it saw no key).
  Row blocks are grid axis 0, so programs sharing a prefix slice run together and a
  re-read hits L2.
- Stage 2, grid ``(rows, H_q)``: merges the ``NUM_SPLITS + 1`` partials by natural-log LSE.

Limits: token-level gathers through ``req_to_token`` (any page size, no page-table fast
path); ``BLOCK_M, BLOCK_N, BLOCK_D >= 16`` (``tl.dot``); fp32 partials.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Meta row layout written by the metadata kernels: [rpi, prefix_len, split_len, q_start, n_q].
META_W = tl.constexpr(5)

MODE_LANE = tl.constexpr(0)
MODE_PATH = tl.constexpr(1)
MODE_EXTEND = tl.constexpr(2)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, qpe, slot, key_ok, vis, Kb, Vb, kvh,
                 stride_ks, stride_kh, stride_vs, stride_vh, sm_scale, logit_cap,
                 D_MAIN: tl.constexpr, D_PE: tl.constexpr, D_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
                 V_IS_K: tl.constexpr, USE_CAP: tl.constexpr, DOT_PREC: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """One key tile: slot [BLOCK_N] (int64), key_ok [BLOCK_N], vis [BLOCK_M, BLOCK_N].

    DOT_F32 (interpreter only): the CPU interpreter's bf16 ``tl.dot`` is wrong (triton 3.9),
    so operands are upcast to fp32 there; on a GPU the dots take the storage dtype."""
    LOG2E: tl.constexpr = 1.4426950408889634
    offs_d = tl.arange(0, BLOCK_D)
    k_base = Kb + slot[:, None] * stride_ks + kvh * stride_kh
    k = tl.load(k_base + offs_d[None, :], mask=key_ok[:, None] & (offs_d < D_MAIN)[None, :],
                other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if D_PE > 0:
        offs_pe = tl.arange(0, BLOCK_DPE)
        kpe = tl.load(k_base + D_MAIN + offs_pe[None, :],
                      mask=key_ok[:, None] & (offs_pe < D_PE)[None, :], other=0.0)
        if DOT_F32:
            kpe = kpe.to(tl.float32)
        s += tl.dot(qpe, tl.trans(kpe), input_precision=DOT_PREC)
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
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_IS_K:
        v = k
    else:
        offs_dv = tl.arange(0, BLOCK_DV)
        v = tl.load(Vb + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :],
                    mask=key_ok[:, None] & (offs_dv < D_V)[None, :], other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _partial_attn_kernel(
        Q, Kb, Vb, MidO, MidLse, ReqToToken, Meta, Hist, Parents,
        step, sm_scale, logit_cap,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
        stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
        stride_r2t, stride_par_s, stride_par_b,
        TOPK, NUM_STEPS, LANES_PER_GROUP, NUM_SPLITS,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr, D_MAIN: tl.constexpr, D_PE: tl.constexpr,
        D_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr,
        BLOCK_DV: tl.constexpr, V_IS_K: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, USE_CAP: tl.constexpr, DOT_PREC: tl.constexpr,
        DOT_F32: tl.constexpr):
    """Stage 1 (see the module doc).

    Q: [rows, H_q, D_MAIN + D_PE]; Kb/Vb: pools [slots, H_kv, D] (MLA: one latent pool,
    V = its first D_V columns); MidO: [rows, H_q, NUM_SPLITS + 1, D_V] fp32;
    MidLse: [rows, H_q, NUM_SPLITS + 1] fp32; Meta: [B, 5] int32; Hist: [lanes, NUM_STEPS]
    int32 (decode); Parents: [NUM_STEPS, B, TOPK] (path mode).
    """
    rb = tl.program_id(0)
    gh = tl.program_id(1)
    split = tl.program_id(2)
    gi = gh // NUM_KV_HEADS
    kvh = gh % NUM_KV_HEADS
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
    n_rows = n_q * GROUP
    row_lo = rb * BLOCK_M
    live = row_lo < n_rows  # row blocks past a short extend request do nothing

    offs_m = row_lo + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_rows
    q_local = offs_m // GROUP  # lane (decode) or new-token index (extend) within the group
    head = kvh * GROUP + offs_m % GROUP
    q_row = (q_start + q_local).to(tl.int64)
    q_base = Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_base + offs_d[None, :], mask=row_ok[:, None] & (offs_d < D_MAIN)[None, :],
                other=0.0)
    if D_PE > 0:
        offs_pe = tl.arange(0, BLOCK_DPE)
        qpe = tl.load(q_base + D_MAIN + offs_pe[None, :],
                      mask=row_ok[:, None] & (offs_pe < D_PE)[None, :], other=0.0)
    else:
        qpe = q
    if DOT_F32:
        q = q.to(tl.float32)
        qpe = qpe.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    r2t_row = ReqToToken + rpi * stride_r2t

    if split < NUM_SPLITS:
        start = split * split_len
        end = tl.minimum(prefix_len, start + split_len)
        end = tl.where(live, end, start)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            key_ok = pos < end
            slot = tl.load(r2t_row + pos, mask=key_ok, other=0).to(tl.int64)
            vis = key_ok[None, :] & row_ok[:, None]
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpe, slot, key_ok, vis, Kb, Vb, kvh, stride_ks, stride_kh,
                stride_vs, stride_vh, sm_scale, logit_cap, D_MAIN, D_PE, D_V, BLOCK_D,
                BLOCK_DPE, BLOCK_DV, V_IS_K, USE_CAP, DOT_PREC, DOT_F32)
    else:
        # Only the keys of this row block's lanes / tokens.
        local_hi = tl.minimum(n_q, (row_lo + BLOCK_M + GROUP - 1) // GROUP)
        if MODE == MODE_EXTEND:
            hl = 1
            n_lo = 0
        else:
            hl = step + 1
            n_lo = (row_lo // GROUP) * hl
        n_hi = tl.where(live, local_hi * hl, n_lo)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            idx = n0 + offs_n
            key_ok = idx < n_hi
            if MODE == MODE_EXTEND:
                slot = tl.load(r2t_row + prefix_len + idx, mask=key_ok, other=0)
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
                slot = tl.load(Hist + z * NUM_STEPS + t, mask=key_ok, other=0)
                vis = key_lane[None, :] == q_local[:, None]
            slot = slot.to(tl.int64)
            vis = vis & key_ok[None, :] & row_ok[:, None]
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpe, slot, key_ok, vis, Kb, Vb, kvh, stride_ks, stride_kh,
                stride_vs, stride_vh, sm_scale, logit_cap, D_MAIN, D_PE, D_V, BLOCK_D,
                BLOCK_DPE, BLOCK_DV, V_IS_K, USE_CAP, DOT_PREC, DOT_F32)

    LN2: tl.constexpr = 0.6931471805599453
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    offs_dv = tl.arange(0, BLOCK_DV)
    mo = MidO + q_row[:, None] * stride_mo_t + head[:, None] * stride_mo_h + split * stride_mo_s
    tl.store(mo + offs_dv[None, :], o, mask=row_ok[:, None] & (offs_dv < D_V)[None, :])
    tl.store(MidLse + q_row * stride_ml_t + head * stride_ml_h + split, lse, mask=row_ok)


@triton.jit
def _merge_kernel(MidO, MidLse, Out, stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t,
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
