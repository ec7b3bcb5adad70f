"""The Gluon MLA decode kernel on a balanced work list (``worklist``): each program takes its
run of one request's key tiles from the table, with the v3 kernel's tile loop (two
warpgroups split S's columns and O's halves; ``cp.async`` ring). Imported through
``gluon_mla`` like ``_gluon_mla_kernel``.

Run on the H200 (session 8) as a loop over the segments of a run, which could cross
requests: GPU tests, kit, memcheck and soak passed. Since the table starts every run at a
request start, the loop became one ``if``, which takes the kernel's spilled scalars from
112 B of stack to none (sm90 compile); that form has not yet run on a GPU."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait)

from ._attn_kernels import META_W
from ._gluon_mla_kernel import (
    BLOCK_M, D_MAIN, D_PE, LOG2E, _finite_tail, _issue_q, _issue_tile, _prefix_slots,
    _softmax, _store_new_keys, _store_result, _tile_vis)


@gluon.jit
def _gluon_mla_wl_kernel(
        Q, KV, Kin, MidO, MidLse, Out, ReqToToken, Meta, Work, Hist, Parents,
        step, sm_scale, logit_cap,
        stride_qt, stride_qh, stride_kvs, stride_kin_t, stride_mo_g, stride_ml_g,
        stride_ot, stride_oh, stride_r2t, stride_par_s, stride_par_b, num_slots, TOPK,
        NUM_STEPS, batch, num_programs,
        H: gl.constexpr, MODE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        PREFETCH: gl.constexpr, USE_CAP: gl.constexpr, WRITE_NEW: gl.constexpr):
    """Grid ``(row_tiles, P)``, 8 warps. ``Work``: ``worklist``'s table; MidO
    ``[slots, rows, 512]`` / MidLse ``[slots, rows]`` fp32 (slot ``p + b``, request-relative
    rows ``lane * H + head``); the other tensors as in ``_gluon_mla_kernel``."""
    dtype: gl.constexpr = KV.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_MAIN // 2, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    kv_write_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_MAIN], dtype)
    qpe_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_PE], dtype)
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_MAIN], dtype)
    kpe_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_PE], dtype)
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

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D_MAIN], q_sl)
    qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D_PE], qpe_sl)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D_MAIN], k_sl)
    kpe_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D_PE], kpe_sl)

    offs_sm = row_lo + gl.arange(0, BLOCK_M, layout=row_layout)
    row_lane = offs_sm // H
    qk_scale = sm_scale * LOG2E
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

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
        if WRITE_NEW:
            if first:
                _store_new_keys(Kin, KV, Hist, stride_kin_t, stride_kvs, q_start, lane_lo,
                                lane_hi, step, NUM_STEPS, num_slots, kv_write_layout)
        # Every warp is past the previous segment's MMAs before Q and the stages refill.
        gl.thread_barrier()
        _issue_q(Q, q_smem, qpe_smem, stride_qt, stride_qh, q_start, row_lo, n_rows, H,
                 copy_layout)
        for i in gl.static_range(NUM_STAGES - 1):
            _issue_tile(t_lo + i, _prefix_slots(t_lo + i, r2t_row, n_pref, 0, end, BLOCK_N,
                                                copy_layout),
                        k_smem, kpe_smem, KV, Kin, stride_kvs, stride_kin_t, n_pref, 0, end,
                        n_lo, n_hi, hl, q_start, b, step, Hist, Parents, stride_par_s,
                        stride_par_b, TOPK, NUM_STEPS, num_slots, MODE, BLOCK_N, NUM_STAGES,
                        copy_layout)
            async_copy.commit_group()
        slots = _prefix_slots(t_lo + NUM_STAGES - 1, r2t_row, n_pref, 0, end, BLOCK_N,
                              copy_layout)

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
        acc = gl.zeros([BLOCK_M, D_MAIN], gl.float32, o_layout)
        for t in range(t_lo, t_hi):
            # The v3 tile step (``_gluon_mla_kernel``, OVERLAP off).
            gl.thread_barrier()
            if not PREFETCH:
                slots = _prefix_slots(t + NUM_STAGES - 1, r2t_row, n_pref, 0, end, BLOCK_N,
                                      copy_layout)
            _issue_tile(t + NUM_STAGES - 1, slots, k_smem, kpe_smem, KV, Kin, stride_kvs,
                        stride_kin_t, n_pref, 0, end, n_lo, n_hi, hl, q_start, b, step,
                        Hist, Parents, stride_par_s, stride_par_b, TOPK, NUM_STEPS, num_slots,
                        MODE, BLOCK_N, NUM_STAGES, copy_layout)
            async_copy.commit_group()
            if PREFETCH:
                slots = _prefix_slots(t + NUM_STAGES, r2t_row, n_pref, 0, end, BLOCK_N,
                                      copy_layout)
            async_copy.wait_group(NUM_STAGES - 1)
            fence_async_shared()
            gl.thread_barrier()
            stage = t % NUM_STAGES
            k_s = k_smem.index(stage)
            _finite_tail(k_s, t, n_pref, copy_layout)
            s_tok = warpgroup_mma(q_smem, k_s.permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            s_tok = warpgroup_mma(qpe_smem, kpe_smem.index(stage).permute((1, 0)), s_tok,
                                  is_async=True)
            s = warpgroup_mma_wait(0, deps=[s_tok])
            vis = _tile_vis(t, row_lane, n_pref, 0, end, n_lo, n_hi, hl, BLOCK_N, s_layout)
            p_t, alpha, m_i, l_i = _softmax(s, vis, m_i, l_i, qk_scale, logit_cap, USE_CAP)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p_t.to(dtype), p_layout)
            o_tok = warpgroup_mma(p_op, k_s, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[o_tok])
        async_copy.wait_group(0)

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
