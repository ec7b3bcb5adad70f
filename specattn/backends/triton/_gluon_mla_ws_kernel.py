"""The warp-specialized ("seesaw") Gluon MLA decode kernel. Experimental and opt-in
(``KernelConfig.gluon_ws``, label ``ws``). It passes the GPU tests on the H200 (Triton 3.6,
session 8) but is no faster than ``_gluon_mla_kernel``: 68.3 us at mla-long with 32-key tiles
in 4 stages, 98.6 with 64-key tiles in 2 (ptxas spills the loop's scalars there), against
67.9 for the default.

Imported only through ``gluon_mla._kernels()``, like ``_gluon_mla_kernel``, whose helpers it
shares. What changes is how the tile work is split: by key tile instead of by output column.

- Two consumer warpgroups, each with its own ``gl.warp_specialize`` partition. Even key tiles
  belong to warpgroup 0 and odd ones to warpgroup 1. A warpgroup gathers its own tiles
  (``cp.async``, half the stages each), computes the whole ``[64, BLOCK_N]`` S of each one
  with one wgmma chain (N ``BLOCK_N``, no cross-warpgroup reduction) and its softmax.
- Each warpgroup owns one 256-wide half of the ``[64, 512]`` output. For every pair of tiles
  ``(a, b)``, warpgroup 0 hands P(a), its running max and its rescale factor to warpgroup 1
  through shared memory, and warpgroup 1 hands back P(b) the same way. Each accumulates both
  tiles into its half. The running max passes a -> b -> a, so every P of a pair shares one
  reference.
- mbarriers order everything: ``full[s]`` (stage ``s`` landed, from its owner),
  ``empty[s]`` (the other warpgroup is done reading it), ``ready[0/1]`` (a P and its
  statistics are written), ``sums`` (the row sums at the end). There is a single P buffer,
  and the handshake makes the two warpgroups take it in turn. One P buffer is what lets Q, two
  64-key stages and P fit in sm90's 227 KB (``tools/gluon_ws_probe.py``).
- Each warpgroup keeps the row sum of its own tiles, rescaled by every factor of both. At the
  end the two sums are added.

Tails, the new-key store, logit caps, partials and the direct output behave as in
``_gluon_mla_kernel``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy, fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from ._gluon_mla_kernel import (BLOCK_M, LOG2E, _alloc_q_and_ring, _finite_tail, _issue_q,
                                _issue_tile, _prefix_slots, _softmax, _split_range,
                                _store_new_keys, _store_result, _tile_vis)

D_HALF = gl.constexpr(256)
# Rows of the statistics buffer: max(a), rescale(a), max(b), rescale(b), sum(0), sum(1).
ST_MA = gl.constexpr(0)
ST_MB = gl.constexpr(2)
ST_L0 = gl.constexpr(4)


@gluon.jit
def _publish(stats, row_m: gl.constexpr, m, alpha, p_smem, p, bar):
    """Hand this warpgroup's tile to the other: its running max ``m``, rescale ``alpha`` and
    ``P`` (shared memory, fenced for the other's wgmma), then arrive on ``bar``."""
    stats.index(row_m).store(m)
    stats.index(row_m + 1).store(alpha)
    p_smem.store(p)
    fence_async_shared()
    mbarrier.arrive(bar)


@gluon.jit
def _receive(stats, row_m: gl.constexpr, bar, phase, l_i, acc, full_bar, full_phase,
             row_layout: gl.constexpr):
    """Take the other warpgroup's tile (``_publish``): wait for it, rescale the row sums and
    the accumulator by its factor and wait until its keys are in shared memory. Returns
    ``(its max, l_i, acc)``."""
    mbarrier.wait(bar, phase)
    alpha = stats.index(row_m + 1).load(row_layout)
    m = stats.index(row_m).load(row_layout)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    mbarrier.wait(full_bar, full_phase)
    return m, l_i * alpha, acc


@gluon.jit
def _ws_consumer(ROLE: gl.constexpr, KV, Kin, MidO, MidLse, Out, ReqToToken, Meta, Hist, Parents,
                 step, sm_scale, logit_cap, stride_kvs, stride_kin_t, stride_mo_t,
                 stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, stride_ot, stride_oh,
                 stride_r2t, stride_par_s, stride_par_b, num_slots, TOPK, NUM_STEPS,
                 NUM_SPLITS, q_smem, qpe_smem, k_smem, kpe_smem, p_smem, stats, full, empty,
                 ready, sums, H: gl.constexpr, MODE: gl.constexpr, BLOCK_N: gl.constexpr,
                 NUM_STAGES: gl.constexpr, PREFETCH: gl.constexpr, USE_CAP: gl.constexpr,
                 DIRECT_OUT: gl.constexpr):
    """Warpgroup ``ROLE``'s side of the seesaw (module docstring)."""
    dtype: gl.constexpr = KV.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    OWN_STAGES: gl.constexpr = NUM_STAGES // 2
    OTHER: gl.constexpr = 1 - ROLE

    (b, split, q_start, row_lo, hl, lane_lo, lane_hi, start, end, n_pref, n_lo, n_hi, total,
     r2t_row) = _split_range(Meta, ReqToToken, stride_r2t, step, TOPK, NUM_SPLITS, H, BLOCK_N)

    # This warpgroup's first tiles: ROLE, ROLE + 2, ... (stages ROLE, ROLE + 2, ...).
    for j in gl.static_range(OWN_STAGES):
        t0 = ROLE + 2 * j
        _issue_tile(t0, _prefix_slots(t0, r2t_row, n_pref, start, end, BLOCK_N, copy_layout),
                    k_smem, kpe_smem, KV, Kin, stride_kvs, stride_kin_t, n_pref, start, end,
                    n_lo, n_hi, hl, q_start, b, step, Hist, Parents, stride_par_s,
                    stride_par_b, TOPK, NUM_STEPS, num_slots, MODE, BLOCK_N, NUM_STAGES,
                    copy_layout)
        async_copy.commit_group()
    slots = _prefix_slots(ROLE + NUM_STAGES, r2t_row, n_pref, start, end, BLOCK_N,
                          copy_layout)

    row_lane = (row_lo + gl.arange(0, BLOCK_M, layout=row_s)) // H
    qk_scale = sm_scale * LOG2E
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, D_HALF], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    for i in range(gl.cdiv(total, 2)):
        t_own = 2 * i + ROLE
        t_oth = 2 * i + OTHER
        s_own = t_own % NUM_STAGES
        s_oth = t_oth % NUM_STAGES
        k_own = k_smem.index(s_own)
        k_oth = k_smem.index(s_oth)

        # Own tile landed: make it visible to both warpgroups' wgmma, then announce it.
        async_copy.wait_group(OWN_STAGES - 1)
        fence_async_shared()
        gl.thread_barrier()
        # 128 columns at a time: a whole [64, 512] tile would not fit beside acc.
        _finite_tail(k_own, t_own, n_pref, copy_layout, 128)
        mbarrier.arrive(full.index(s_own))
        s_tok = warpgroup_mma(q_smem, k_own.permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        s_tok = warpgroup_mma(qpe_smem, kpe_smem.index(s_own).permute((1, 0)), s_tok,
                              is_async=True)
        vis = _tile_vis(t_own, row_lane, n_pref, start, end, n_lo, n_hi, hl, BLOCK_N,
                        s_layout)
        if ROLE == 0:
            # a: the running max is the last pair's b max (m_i).
            s = warpgroup_mma_wait(0, deps=[s_tok])
            p, alpha, m_i, l_i = _softmax(s, vis, m_i, l_i, qk_scale, logit_cap, USE_CAP)
            _publish(stats, ST_MA, m_i, alpha, p_smem, p.to(dtype), ready.index(0))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            o_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                                  k_own.slice(0, D_HALF, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[o_tok])
            # b: its P shares b's max; rescale by b's factor, then add P(b).V(b).
            m_i, l_i, acc = _receive(stats, ST_MB, ready.index(1), i & 1, l_i, acc,
                                     full.index(s_oth), (t_oth // NUM_STAGES) & 1, row_s)
            o_tok = warpgroup_mma(p_smem, k_oth.slice(0, D_HALF, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(empty.index(s_oth))
        else:
            # a first (its P is ready before b's softmax can start: b's max builds on a's).
            m_a, l_i, acc = _receive(stats, ST_MA, ready.index(0), i & 1, l_i, acc,
                                     full.index(s_oth), (t_oth // NUM_STAGES) & 1, row_s)
            o_tok = warpgroup_mma(p_smem, k_oth.slice(D_HALF, D_HALF, dim=1), acc,
                                  is_async=True)
            # S(b) was issued first, so it retires first; b's softmax overlaps P(a).V(a).
            s = warpgroup_mma_wait(1, deps=[s_tok])
            p, alpha, m_i, l_i = _softmax(s, vis, m_a, l_i, qk_scale, logit_cap, USE_CAP)
            acc = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(empty.index(s_oth))
            # P(a) has been read: the buffer takes P(b).
            _publish(stats, ST_MB, m_i, alpha, p_smem, p.to(dtype), ready.index(1))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            o_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                                  k_own.slice(D_HALF, D_HALF, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[o_tok])

        # Refill the own stage once the other warpgroup has read it.
        mbarrier.wait(empty.index(s_own), (t_own // NUM_STAGES) & 1)
        if not PREFETCH:
            slots = _prefix_slots(t_own + NUM_STAGES, r2t_row, n_pref, start, end, BLOCK_N,
                                  copy_layout)
        _issue_tile(t_own + NUM_STAGES, slots, k_smem, kpe_smem, KV, Kin, stride_kvs,
                    stride_kin_t, n_pref, start, end, n_lo, n_hi, hl, q_start, b, step, Hist,
                    Parents, stride_par_s, stride_par_b, TOPK, NUM_STEPS, num_slots, MODE,
                    BLOCK_N, NUM_STAGES, copy_layout)
        async_copy.commit_group()
        if PREFETCH:
            slots = _prefix_slots(t_own + NUM_STAGES + 2, r2t_row, n_pref, start, end,
                                  BLOCK_N, copy_layout)
    async_copy.wait_group(0)

    # Row sums of both warpgroups (both already at the final max).
    stats.index(ST_L0 + ROLE).store(l_i)
    mbarrier.arrive(sums.index(ROLE))
    mbarrier.wait(sums.index(OTHER), 0)
    l_i = l_i + stats.index(ST_L0 + OTHER).load(row_s)

    _store_result(acc, l_i, m_i, Out, MidO, MidLse, stride_ot, stride_oh, stride_mo_t,
                  stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, q_start, row_lo, TOPK * H,
                  split, ROLE * D_HALF, H, DIRECT_OUT, ROLE == 0, row_s)


@gluon.jit
def _gluon_mla_ws_kernel(
        Q, KV, Kin, MidO, MidLse, Out, ReqToToken, Meta, Hist, Parents,
        step, sm_scale, logit_cap,
        stride_qt, stride_qh, stride_kvs, stride_kin_t,
        stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, stride_ot, stride_oh,
        stride_r2t, stride_par_s, stride_par_b, num_slots, TOPK, NUM_STEPS, NUM_SPLITS,
        H: gl.constexpr, MODE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        PREFETCH: gl.constexpr, USE_CAP: gl.constexpr, DIRECT_OUT: gl.constexpr,
        WRITE_NEW: gl.constexpr):
    """Grid ``(row_tiles, B, NUM_SPLITS)``, ``num_warps=4`` (warpgroup 0; warpgroup 1 is the
    worker partition). The arguments are those of ``_gluon_mla_kernel._gluon_mla_kernel``."""
    dtype: gl.constexpr = KV.dtype.element_ty
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    kv_write_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    st_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # per row of [6, 64]

    (b, split, q_start, row_lo, hl, lane_lo, lane_hi, start, end, n_pref, n_lo, n_hi, total,
     r2t_row) = _split_range(Meta, ReqToToken, stride_r2t, step, TOPK, NUM_SPLITS, H, BLOCK_N)
    if WRITE_NEW:
        if split == 0:
            _store_new_keys(Kin, KV, Hist, stride_kin_t, stride_kvs, q_start, lane_lo,
                            lane_hi, step, NUM_STEPS, num_slots, kv_write_layout)

    q_smem, qpe_smem, k_smem, kpe_smem = _alloc_q_and_ring(dtype, BLOCK_N, NUM_STAGES)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], p_sl)
    stats = gl.allocate_shared_memory(gl.float32, [6, BLOCK_M], st_sl)
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    sums = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for r in gl.static_range(2):
        mbarrier.init(ready.index(r), count=1)
        mbarrier.init(sums.index(r), count=1)

    # Q, complete before the partitions start.
    _issue_q(Q, q_smem, qpe_smem, stride_qt, stride_qh, q_start, row_lo, TOPK * H, H,
             copy_layout)
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()

    # The two partitions get the same arguments but ROLE (a tuple built here keeps constexprs).
    gl.warp_specialize(
        [(_ws_consumer, (0, KV, Kin, MidO, MidLse, Out, ReqToToken, Meta, Hist, Parents, step,
                         sm_scale, logit_cap, stride_kvs, stride_kin_t, stride_mo_t,
                         stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, stride_ot,
                         stride_oh, stride_r2t, stride_par_s, stride_par_b, num_slots, TOPK,
                         NUM_STEPS, NUM_SPLITS, q_smem, qpe_smem, k_smem, kpe_smem, p_smem,
                         stats, full, empty, ready, sums, H, MODE, BLOCK_N, NUM_STAGES,
                         PREFETCH, USE_CAP, DIRECT_OUT)),
         (_ws_consumer, (1, KV, Kin, MidO, MidLse, Out, ReqToToken, Meta, Hist, Parents, step,
                         sm_scale, logit_cap, stride_kvs, stride_kin_t, stride_mo_t,
                         stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, stride_ot,
                         stride_oh, stride_r2t, stride_par_s, stride_par_b, num_slots, TOPK,
                         NUM_STEPS, NUM_SPLITS, q_smem, qpe_smem, k_smem, kpe_smem, p_smem,
                         stats, full, empty, ready, sums, H, MODE, BLOCK_N, NUM_STAGES,
                         PREFETCH, USE_CAP, DIRECT_OUT))],
        [4], [256])
