"""The Gluon MLA decode kernel on ``worklist``'s balanced work list (plan ``gluon-wl``), with
``_gluon_mla_kernel``'s tile loop; launched by ``gluon_mla``. Every program starts at a
request start, so it walks one segment of one request (one ``if``, no loop over segments:
its scalars stay in registers)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._attn_kernels import META_W
from ._gluon_mla_kernel import (
    BLOCK_M, D_MAIN, KV_WRITE_LAYOUT, _acc_layout, _alloc_fp8_ring, _alloc_q_and_ring,
    _store_new_keys, _store_result, _ws_attend)
from ...kernels.pdl import launch_dependents


@gluon.jit
def _gluon_mla_wl_kernel(
        Q, KV, Kin, MidO, MidLse, Out, ReqToToken, Meta, Work, Hist, Parents, KScale, WScale,
        step, sm_scale, logit_cap, q_prescale,
        stride_qt, stride_qh, stride_kvs, stride_kin_t, stride_mo_g, stride_ml_g,
        stride_ot, stride_oh, stride_r2t, stride_par_s, stride_par_b, num_slots, TOPK,
        NUM_STEPS, batch, num_programs,
        H: gl.constexpr, MODE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        USE_CAP: gl.constexpr, FP8: gl.constexpr, Q_F16: gl.constexpr = False,
        PDL: gl.constexpr = False,
        STORE_FP8: gl.constexpr = False, W_QUANT: gl.constexpr = 0, E5M2: gl.constexpr = False,
        SATURATE: gl.constexpr = True, SIGNED_NAN: gl.constexpr = True):
    """Grid ``(row_tiles, P)``, 8 warps and a producer warpgroup (``_ws_attend``). ``Work``:
    ``worklist``'s table; MidO ``[slots, rows, 512]`` (fp32 or the query's dtype) / MidLse
    ``[slots, rows]`` fp32 (slot ``p + b``, request-relative rows ``lane * H + head``); the
    other tensors, ``FP8`` and ``Q_F16`` as in ``_gluon_mla_kernel``; ``PDL`` /
    ``STORE_FP8`` as there (the merge: the segment merge; the programs whose segment holds
    tail tiles store the codes)."""
    dtype: gl.constexpr = gl.float16 if Q_F16 else Q.dtype.element_ty
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    rt = gl.program_id(0)
    p = gl.program_id(1)
    chunk = gl.load(Work)
    u_begin = p * chunk
    u_end = u_begin + chunk
    starts = Work + 1 + num_programs  # U[0..B]
    b = gl.load(Work + 1 + p)
    u_b = gl.load(starts + b)

    n_rows = TOPK * H
    row_lo = rt * BLOCK_M
    hl = step + 1
    lane_lo = row_lo // H
    lane_hi = gl.minimum(TOPK, (row_lo + BLOCK_M + H - 1) // H)
    n_lo = lane_lo * hl
    tail_keys = (lane_hi - lane_lo) * hl

    # Q and the ring the 8 warps read; FP8: a staging tile, the ring of codes
    # (``_gluon_mla_kernel``).
    q_smem, qpe_smem, k_st, kpe_st = _alloc_q_and_ring(dtype, BLOCK_N, 1 if FP8 else NUM_STAGES)
    if FP8:
        k_ring, kpe_ring = _alloc_fp8_ring(KV.dtype.element_ty, BLOCK_N, NUM_STAGES)
    else:
        k_ring, kpe_ring = k_st, kpe_st  # not read

    # Programs start at request starts (``worklist``): one segment, or none past the last.
    if (b < batch) & (u_b < u_end):
        u_next = gl.load(starts + b + 1)
        rpi = gl.load(Meta + b * META_W).to(gl.int64)
        prefix_len = gl.load(Meta + b * META_W + 1)
        q_start = b * TOPK
        r2t_row = ReqToToken + rpi * stride_r2t
        # This segment's tiles [t_lo, t_hi) of the request (prefix tiles, then tail tiles);
        # units past this step's tail (reserved for later steps) hold nothing.
        n_pref = gl.cdiv(prefix_len, BLOCK_N)
        t_lo = gl.maximum(u_begin - u_b, 0)
        t_hi = gl.minimum(gl.minimum(u_end, u_next) - u_b,
                          n_pref + gl.cdiv(tail_keys, BLOCK_N))
        end = gl.minimum(prefix_len, t_hi * BLOCK_N)
        n_hi = gl.where(t_hi > n_pref,
                        n_lo + gl.minimum(tail_keys, (t_hi - n_pref) * BLOCK_N), n_lo)
        first = u_b >= u_begin
        if not FP8:  # FP8: the tail's programs (STORE_FP8) or torch store them
            if first:
                _store_new_keys(Kin, KV, Hist, stride_kin_t, stride_kvs, q_start, lane_lo,
                                lane_hi, step, NUM_STEPS, num_slots, KV_WRITE_LAYOUT)
        if STORE_FP8:
            if t_hi > n_pref:
                _store_new_keys(Kin, KV, Hist, stride_kin_t, stride_kvs, q_start, lane_lo,
                                lane_hi, step, NUM_STEPS, num_slots, KV_WRITE_LAYOUT, WScale,
                                True, W_QUANT, E5M2, SATURATE, SIGNED_NAN)
                gl.thread_barrier()  # visible to this program's tail copies
        acc, m_i, l_i = _ws_attend(
            Q, KV, Kin, q_smem, qpe_smem, k_st, kpe_st, k_ring, kpe_ring, KScale, stride_qt,
            stride_qh, stride_kvs, stride_kin_t, r2t_row, q_start, row_lo, n_rows, q_prescale,
            n_pref, 0, end, n_lo, n_hi, hl, b, step, Hist, Parents, stride_par_s, stride_par_b,
            TOPK, NUM_STEPS, num_slots, t_lo, t_hi, sm_scale, logit_cap, H, Q_F16, BLOCK_N,
            NUM_STAGES, USE_CAP, MODE, FP8)

        # The request's only segment writes Out; the others a partial in slot p + b, whose
        # rows are request-relative: the base moves back by the request's first row.
        if first & (u_next <= u_end):
            _store_result(acc, l_i, m_i, Out, MidO, MidLse, stride_ot, stride_oh, 0, 0, 0,
                          0, 0, q_start, row_lo, n_rows, 0, 0, H, True, False, row_layout)
        else:
            slot = (p + b).to(gl.int64)
            _store_result(acc, l_i, m_i, Out,
                          MidO + slot * stride_mo_g - q_start * (H * D_MAIN),
                          MidLse + slot * stride_ml_g - q_start * H,
                          stride_ot, stride_oh, H * D_MAIN, D_MAIN, 0, H, 1, q_start,
                          row_lo, n_rows, 0, 0, H, False, True, row_layout)
    if PDL:
        launch_dependents()
