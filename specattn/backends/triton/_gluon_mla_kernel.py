"""The Gluon MLA decode kernel (Hopper: wgmma, cp.async). Imported only through
``gluon_mla.kernel_module()``, after the Triton version and Gluon's Hopper ops were checked;
``gluon_mla`` documents the algorithm.

``FP8`` (a constexpr): the pool holds FP8 codes (e4m3 / e5m2) and a key is ``code *
KScale[0]``. The codes of a key tile are gathered by ``cp.async`` into a ring of FP8 tiles
(``_alloc_fp8_ring``), widened exactly to the query's dtype into one staging tile that the
wgmmas read (``_widen_tile``), and the ring stage is refilled as soon as it is widened, so
two tiles are in flight during a tile's MMAs: in the work-list kernel by the same 8 warps
(``_tile_step_fp8``), in the split kernel by a producer warpgroup of its own while the 8
warps compute on the tile before (``_ws_produce`` / ``_ws_consume``: warp-specialised,
mbarriers hand the staging tile over). The key scale folds into
the softmax scale and, the latent being the value too, into the normalised output. The
call's new keys are read back from the pool: the kernel stores their codes first
(``STORE_FP8``: torch's codes, ``fp8_codes``), or torch stored them before it.

``Q_F16`` (FP8 pools under bf16 queries, as the ``tl.dot`` kernels' ``Q_F16``): the query
rows are stored as ``q * q_prescale`` (``2^-8``, a runtime argument) in fp16, the staging
tile and P are fp16 and ``Q_F16_SCALE`` folds into the softmax scale. A code widens to fp16
in one conversion per two codes; to bf16 it took that conversion and one ``F2F`` per code,
a quarter-rate instruction, in every tile.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy, fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

from ...kernels.fp8_codes import quantize_block
from ...kernels.pdl import launch_dependents
from ...kernels.tiles import Q_F16_SCALE
from ._attn_kernels import META_W, MODE_EXTEND, MODE_PATH

D_MAIN = gl.constexpr(512)
D_PE = gl.constexpr(64)
BLOCK_M = gl.constexpr(64)
LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
# Both kernels (``_gluon_mla_kernel``, ``_gluon_mla_wl_kernel``): both warpgroups split
# the columns of S [64, BLOCK_N] (``_acc_layout``) and O [64, 512] (256 each); P goes to the
# P.V wgmma as a register operand of O's layout; copies are 16 bytes, 4 rows x 128 bytes per
# warp instruction.
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(
    version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 512 // 2, 16]))
P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT.value, k_width=2))
COPY_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))
# FP8 codes: 16-byte copies and widenings of 16 codes, 4 rows x 128 codes per warp
# instruction; its rows are distributed as COPY_LAYOUT's (a conversion between their row
# slices moves nothing), so the 64-wide rope part goes through COPY_LAYOUT.
FP8_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0]))
# Latent columns widened at a time: the whole row, 128 codes a thread (1-3% faster than 128
# or 256 columns on the H200, docs/kernels.md).
FP8_COLS = D_MAIN
KV_WRITE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))
# The split kernel over FP8 pools is warp-specialised: its producer warpgroup's layouts (4
# warps), the latent columns it widens at a time, and its registers (the 8 consumer warps
# get the rest: 240).
WS_FP8_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
WS_COPY_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
WS_FP8_COLS = gl.constexpr(256)
WS_PRODUCER_REGS = gl.constexpr(96)


@gluon.constexpr_function
def _acc_layout(cols):
    """A ``[64, cols]`` fp32 wgmma accumulator, each warpgroup computing half the columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                     instr_shape=[16, cols // 2, 16])


@gluon.jit
def _alloc_q_and_ring(dtype: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Shared memory for the 64 query rows (latent, rope) and the key ring
    (``NUM_STAGES`` x ``BLOCK_N`` keys, latent and rope): ``(q, qpe, k, kpe)``."""
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_MAIN], dtype)
    qpe_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_PE], dtype)
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_MAIN], dtype)
    kpe_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_PE], dtype)
    return (gl.allocate_shared_memory(dtype, [BLOCK_M, D_MAIN], q_sl),
            gl.allocate_shared_memory(dtype, [BLOCK_M, D_PE], qpe_sl),
            gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D_MAIN], k_sl),
            gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, D_PE], kpe_sl))


@gluon.jit
def _alloc_fp8_ring(kv_dtype: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Shared memory for the FP8 key ring (``NUM_STAGES`` x ``BLOCK_N`` keys' codes, latent
    and rope; half the bytes of a bf16 ring): ``(k, kpe)``."""
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_MAIN], kv_dtype)
    kpe_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_PE], kv_dtype)
    return (gl.allocate_shared_memory(kv_dtype, [NUM_STAGES, BLOCK_N, D_MAIN], k_sl),
            gl.allocate_shared_memory(kv_dtype, [NUM_STAGES, BLOCK_N, D_PE], kpe_sl))


@gluon.jit
def _tail_rows(idx, ok, hl, q_start, b, step, Hist, Parents, stride_par_s, stride_par_b,
               TOPK, NUM_STEPS, num_slots, MODE: gl.constexpr, NEW_IN_POOL: gl.constexpr = False):
    """Tail key ``idx`` (lane ``idx // hl``'s history slot ``idx % hl``; extend: ``hl`` 1,
    new token ``idx``) -> ``(slot int64, new)``: its pool slot, and whether it is this call's
    key (read from ``k``: the last slot of each lane). Path mode: the ancestor at that depth.
    ``NEW_IN_POOL`` (FP8 pools, the call's codes stored before the tail reads them): the
    slot of this call's key too, ``Hist[lane, step]``."""
    key_lane = idx // hl
    depth = idx % hl
    new = ok & (depth == hl - 1)
    a = key_lane
    if MODE == MODE_PATH:
        # a_step = j, a_{u-1} = parents[u, b, a_u]
        for uu in range(0, step):
            u = step - uu
            par = gl.load(Parents + u * stride_par_s + b * stride_par_b + a,
                          mask=ok & (depth < u), other=0)
            a = gl.where(depth < u, par.to(gl.int32), a)
    z = q_start + a
    if NEW_IN_POOL:
        slot = gl.load(Hist + z * NUM_STEPS + depth, mask=ok, other=0)
    else:
        slot = gl.load(Hist + z * NUM_STEPS + depth, mask=ok & (depth < hl - 1), other=0)
    return _in_pool(slot.to(gl.int64), num_slots), new


@gluon.jit
def _in_pool(slot, num_slots):
    """A gathered slot clamped into ``[0, num_slots)``: no read outside the pool."""
    return gl.minimum(gl.maximum(slot, 0), num_slots - 1)


@gluon.jit
def _prefix_slots(t, r2t_row, n_pref, start, end, BLOCK_N: gl.constexpr,
                  copy_layout: gl.constexpr):
    """Key tile ``t``'s raw ``req_to_token`` entries (zeros for a tail tile and past the
    end). Only ``_issue_tile`` reads them: loaded a tile ahead, the load's latency passes
    behind the MMAs instead of stalling the copies."""
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
    pos = start + t * BLOCK_N + offs_n
    return gl.load(r2t_row + pos, mask=(pos < end) & (t < n_pref), other=0)


@gluon.jit
def _issue_tile(t, slots, k_smem, kpe_smem, KV, Kin, stride_kvs, stride_kin_t, n_pref,
                start, end, n_lo, n_hi, hl, q_start, b, step, Hist, Parents, stride_par_s,
                stride_par_b, TOPK, NUM_STEPS, num_slots, MODE: gl.constexpr,
                BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, copy_layout: gl.constexpr):
    """Start the ``cp.async`` gather of key tile ``t`` (prefix tiles, rows ``slots`` from
    ``_prefix_slots``; then tail tiles) into stage ``t % NUM_STAGES``; keys past the end are
    zero-filled (masked copies)."""
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_layout))
    if t < n_pref:
        ok = start + t * BLOCK_N + offs_n < end
        rows = KV + _in_pool(slots.to(gl.int64), num_slots) * stride_kvs
    else:
        idx = n_lo + (t - n_pref) * BLOCK_N + offs_n
        ok = idx < n_hi
        slot, new = _tail_rows(idx, ok, hl, q_start, b, step, Hist, Parents, stride_par_s,
                               stride_par_b, TOPK, NUM_STEPS, num_slots, MODE)
        src = (q_start + idx // hl).to(gl.int64)
        rows = gl.where(new, Kin + src * stride_kin_t, KV + slot * stride_kvs)
    stage = t % NUM_STAGES
    offs_d = gl.arange(0, D_MAIN, layout=gl.SliceLayout(0, copy_layout))
    offs_pe = gl.arange(0, D_PE, layout=gl.SliceLayout(0, copy_layout))
    async_copy.async_copy_global_to_shared(k_smem.index(stage),
                                           rows[:, None] + offs_d[None, :], mask=ok[:, None])
    async_copy.async_copy_global_to_shared(kpe_smem.index(stage),
                                           rows[:, None] + D_MAIN + offs_pe[None, :],
                                           mask=ok[:, None])


@gluon.jit
def _finite_tail(k_tile, t, n_pref, layout: gl.constexpr, COLS: gl.constexpr = D_MAIN):
    """Tail tiles hold history keys that only their lane's rows see: a non-finite value there
    must not reach a sibling lane through P.V (``0 * NaN`` is NaN), so it is zeroed in shared
    memory before any MMA reads the tile (the lane that does see it scores garbage either
    way). Prefix tiles, seen by every row, are left as they are. ``COLS`` columns pass
    through registers at a time (fewer where an accumulator already holds most of them)."""
    if t >= n_pref:
        for c in gl.static_range(D_MAIN // COLS):
            part = k_tile.slice(c * COLS, COLS, dim=1)
            x = part.load(layout)
            part.store(gl.where((x - x) == 0, x, gl.zeros_like(x)))
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _issue_tile_fp8(t, slots, k_ring, kpe_ring, KV, stride_kvs, n_pref, start, end, n_lo,
                    n_hi, hl, q_start, b, step, Hist, Parents, stride_par_s, stride_par_b,
                    TOPK, NUM_STEPS, num_slots, MODE: gl.constexpr, BLOCK_N: gl.constexpr,
                    NUM_STAGES: gl.constexpr, l8: gl.constexpr = FP8_LAYOUT,
                    lc: gl.constexpr = COPY_LAYOUT):
    """``_issue_tile`` for an FP8 pool: the codes of key tile ``t`` into ring stage ``t %
    NUM_STAGES`` (``slots`` in ``l8``'s rows), every key from the pool (this call's too);
    keys past the end are zero-filled. ``l8`` / ``lc``: the codes' and the rope part's copy
    layouts (8 warps; the split kernel's FP8 producer's: 4)."""
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, l8))
    if t < n_pref:
        ok = start + t * BLOCK_N + offs_n < end
        slot = _in_pool(slots.to(gl.int64), num_slots)
    else:
        idx = n_lo + (t - n_pref) * BLOCK_N + offs_n
        ok = idx < n_hi
        slot, new = _tail_rows(idx, ok, hl, q_start, b, step, Hist, Parents, stride_par_s,
                               stride_par_b, TOPK, NUM_STEPS, num_slots, MODE, True)
    rows = KV + slot * stride_kvs
    stage = t % NUM_STAGES
    offs_d = gl.arange(0, D_MAIN, layout=gl.SliceLayout(0, l8))
    async_copy.async_copy_global_to_shared(k_ring.index(stage),
                                           rows[:, None] + offs_d[None, :], mask=ok[:, None])
    pe_rows = gl.convert_layout(rows, gl.SliceLayout(1, lc))
    pe_ok = gl.convert_layout(ok, gl.SliceLayout(1, lc))
    offs_pe = gl.arange(0, D_PE, layout=gl.SliceLayout(0, lc))
    async_copy.async_copy_global_to_shared(kpe_ring.index(stage),
                                           pe_rows[:, None] + D_MAIN + offs_pe[None, :],
                                           mask=pe_ok[:, None])


@gluon.jit
def _widen_tile(src, dst, FINITE: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr):
    """``dst = src`` (FP8 codes widened to ``dst``'s dtype: exact for e4m3 and e5m2 into
    bf16 and fp16), ``COLS`` columns at a time through registers. ``FINITE``: the tile holds
    history keys (``_finite_tail``), whose non-finite values become 0."""
    for c in gl.static_range(src.shape[1] // COLS):
        x = src.slice(c * COLS, COLS, dim=1).load(layout).to(dst.dtype)
        if FINITE:
            x = gl.where((x - x) == 0, x, gl.zeros_like(x))
        dst.slice(c * COLS, COLS, dim=1).store(x)


@gluon.jit
def _tile_step_fp8(t, slots, acc, m_i, l_i, q_smem, qpe_smem, k_ring, kpe_ring, k_s, kpe_s,
                   s_zero, row_lane, r2t_row, KV, stride_kvs, n_pref, start, end, n_lo, n_hi,
                   hl, q_start, b, step, Hist, Parents, stride_par_s, stride_par_b, TOPK,
                   NUM_STEPS, num_slots, qk_scale, logit_cap, MODE: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, USE_CAP: gl.constexpr,
                   p_layout: gl.constexpr):
    """``_tile_step`` over an FP8 ring: wait for tile ``t``'s codes, widen them into the
    staging tile ``k_s`` / ``kpe_s``, refill their ring stage with tile ``t + NUM_STAGES``
    (``NUM_STAGES`` tiles in flight during the MMAs), then ``S``, the online softmax and
    ``P.V`` on the staging tile. ``qk_scale`` includes the key scale. Returns ``(acc, m_i,
    l_i, slots)``; ``slots``: the next issue's ``req_to_token`` entries."""
    # Tile t's codes have landed (each thread's copies), and every warp is done with the
    # staging tile (tile t - 1's MMAs waited).
    async_copy.wait_group(NUM_STAGES - 1)
    gl.thread_barrier()
    stage = t % NUM_STAGES
    # Two branches, the finite check compiled into the tail's only: as a runtime operand of
    # one widening it was computed and selected on every code of every tile.
    if t >= n_pref:
        _widen_tile(k_ring.index(stage), k_s, True, FP8_COLS, FP8_LAYOUT)
        _widen_tile(kpe_ring.index(stage), kpe_s, True, D_PE, COPY_LAYOUT)
    else:
        _widen_tile(k_ring.index(stage), k_s, False, FP8_COLS, FP8_LAYOUT)
        _widen_tile(kpe_ring.index(stage), kpe_s, False, D_PE, COPY_LAYOUT)
    # The staging tile (and Q) visible to the wgmmas; every warp is done with the stage.
    fence_async_shared()
    gl.thread_barrier()
    _issue_tile_fp8(t + NUM_STAGES, slots, k_ring, kpe_ring, KV, stride_kvs, n_pref, start,
                    end, n_lo, n_hi, hl, q_start, b, step, Hist, Parents, stride_par_s,
                    stride_par_b, TOPK, NUM_STEPS, num_slots, MODE, BLOCK_N, NUM_STAGES)
    async_copy.commit_group()
    slots = _prefix_slots(t + NUM_STAGES + 1, r2t_row, n_pref, start, end, BLOCK_N,
                          FP8_LAYOUT)
    acc, m_i, l_i = _attend_tile(t, acc, m_i, l_i, q_smem, qpe_smem, k_s, kpe_s, s_zero,
                                 row_lane, n_pref, start, end, n_lo, n_hi, hl, qk_scale,
                                 logit_cap, BLOCK_N, USE_CAP, p_layout, MODE == MODE_EXTEND)
    return acc, m_i, l_i, slots


@gluon.jit
def _attend_tile(t, acc, m_i, l_i, q_smem, qpe_smem, k_s, kpe_s, s_zero, row_lane, n_pref,
                 start, end, n_lo, n_hi, hl, qk_scale, logit_cap, BLOCK_N: gl.constexpr,
                 USE_CAP: gl.constexpr, p_layout: gl.constexpr, CAUSAL: gl.constexpr = False):
    """Key tile ``t`` in shared memory (``k_s [BLOCK_N, D_MAIN]``, ``kpe_s [BLOCK_N, D_PE]``,
    visible to the wgmmas): ``S = Q.K^T + Qpe.Kpe^T``, the online softmax, ``acc += P.K``
    (``CAUSAL``: ``_tile_vis``'s extend tail). Returns ``(acc, m_i, l_i)``."""
    dtype: gl.constexpr = k_s.dtype
    o_layout: gl.constexpr = acc.type.layout
    s_layout: gl.constexpr = s_zero.type.layout
    s_tok = warpgroup_mma(q_smem, k_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_tok = warpgroup_mma(qpe_smem, kpe_s.permute((1, 0)), s_tok, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    vis = _tile_vis(t, row_lane, n_pref, start, end, n_lo, n_hi, hl, BLOCK_N, s_layout, CAUSAL)
    p, alpha, m_i, l_i = _softmax(s, vis, m_i, l_i, qk_scale, logit_cap, USE_CAP)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    o_tok = warpgroup_mma(p_op, k_s, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[o_tok])
    return acc, m_i, l_i


@gluon.jit
def _tile_vis(t, row_lane, n_pref, start, end, n_lo, n_hi, hl, BLOCK_N: gl.constexpr,
              s_layout: gl.constexpr, CAUSAL: gl.constexpr = False):
    """``[BLOCK_M, BLOCK_N]`` bool: which rows see which keys of tile ``t`` (prefix: every
    row; tail: the rows of the key's lane; ``CAUSAL`` (extend, ``hl`` 1): the rows of the
    key's new token and of the tokens after it)."""
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if t < n_pref:
        ok = start + t * BLOCK_N + offs_n < end
        key_lane = offs_n * 0 - 1
    else:
        idx = n_lo + (t - n_pref) * BLOCK_N + offs_n
        ok = idx < n_hi
        key_lane = idx // hl
    if CAUSAL:
        return ok[None, :] & (key_lane[None, :] <= row_lane[:, None])
    return ok[None, :] & ((key_lane[None, :] < 0) | (key_lane[None, :] == row_lane[:, None]))


@gluon.jit
def _softmax(s, vis, m_i, l_i, qk_scale, logit_cap, USE_CAP: gl.constexpr):
    """Online softmax on raw scores ``s``: ``(p, alpha, m_new, l_new)``, base 2."""
    if USE_CAP:
        # cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1)
        y = s * (qk_scale / LOG2E) / logit_cap
        s = logit_cap * (1.0 - 2.0 / (gl.exp2(y * (2.0 * LOG2E)) + 1.0)) * LOG2E
    else:
        s = s * qk_scale
    s = gl.where(vis, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # Rows that have seen no key keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _store_new_keys(Kin, KV, Hist, stride_kin_t, stride_kvs, q_start, lane_lo, lane_hi, step,
                    NUM_STEPS, num_slots, layout: gl.constexpr, WScale=None,
                    STORE_FP8: gl.constexpr = False, W_QUANT: gl.constexpr = 0,
                    E5M2: gl.constexpr = False, SATURATE: gl.constexpr = True,
                    SIGNED_NAN: gl.constexpr = True):
    """``KV[Hist[z, step]] = Kin[z]`` for the lanes ``z = q_start + [lane_lo, lane_hi)`` (a
    slot outside the pool is not written). ``STORE_FP8``: torch's codes of ``Kin[z]``
    (``fp8_codes.quantize_block`` with ``WScale``, ``W_QUANT`` and the variant)."""
    offs_l = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
    offs_c = gl.arange(0, 1024, layout=gl.SliceLayout(0, layout))
    c_ok = offs_c < D_MAIN + D_PE
    for l0 in range(lane_lo, lane_hi, 8):
        lane = l0 + offs_l
        ok = lane < lane_hi
        z = (q_start + lane).to(gl.int64)
        dst = gl.load(Hist + z * NUM_STEPS + step, mask=ok, other=0).to(gl.int64)
        ok = ok & (dst >= 0) & (dst < num_slots)
        m = ok[:, None] & c_ok[None, :]
        x = gl.load(Kin + z[:, None] * stride_kin_t + offs_c[None, :], mask=m, other=0.0)
        if STORE_FP8:
            x = quantize_block(x, WScale, W_QUANT, E5M2, SATURATE, SIGNED_NAN).to(
                KV.dtype.element_ty, bitcast=True)
        gl.store(KV + dst[:, None] * stride_kvs + offs_c[None, :], x, mask=m)


@gluon.jit
def _tile_step(t, slots, acc, m_i, l_i, q_smem, qpe_smem, k_smem, kpe_smem, s_zero, row_lane,
               r2t_row, KV, Kin, stride_kvs, stride_kin_t, n_pref, start, end, n_lo, n_hi, hl,
               q_start, b, step, Hist, Parents, stride_par_s, stride_par_b, TOPK, NUM_STEPS,
               num_slots, qk_scale, logit_cap, MODE: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr, USE_CAP: gl.constexpr, copy_layout: gl.constexpr,
               p_layout: gl.constexpr):
    """One key tile ``t``: refill the stage the previous tile used with tile
    ``t + NUM_STAGES - 1``, wait for tile ``t``, then ``S``, the online softmax and ``P.V``.
    Returns ``(acc, m_i, l_i, slots)``; ``slots``: the next issue's ``req_to_token``
    entries."""
    # Every warp is done with stage t - 1: refill it with tile t + NUM_STAGES - 1.
    gl.thread_barrier()
    _issue_tile(t + NUM_STAGES - 1, slots, k_smem, kpe_smem, KV, Kin, stride_kvs,
                stride_kin_t, n_pref, start, end, n_lo, n_hi, hl, q_start, b, step, Hist,
                Parents, stride_par_s, stride_par_b, TOPK, NUM_STEPS, num_slots, MODE,
                BLOCK_N, NUM_STAGES, copy_layout)
    async_copy.commit_group()
    # First read at the next issue, a tile's MMAs later.
    slots = _prefix_slots(t + NUM_STAGES, r2t_row, n_pref, start, end, BLOCK_N, copy_layout)
    async_copy.wait_group(NUM_STAGES - 1)
    fence_async_shared()
    gl.thread_barrier()
    stage = t % NUM_STAGES
    k_s = k_smem.index(stage)
    _finite_tail(k_s, t, n_pref, copy_layout)
    acc, m_i, l_i = _attend_tile(t, acc, m_i, l_i, q_smem, qpe_smem, k_s,
                                 kpe_smem.index(stage), s_zero, row_lane, n_pref, start, end,
                                 n_lo, n_hi, hl, qk_scale, logit_cap, BLOCK_N, USE_CAP,
                                 p_layout, MODE == MODE_EXTEND)
    return acc, m_i, l_i, slots


@gluon.jit
def _issue_q(Q, q_smem, qpe_smem, stride_qt, stride_qh, q_start, row_lo, n_rows,
             H: gl.constexpr, copy_layout: gl.constexpr):
    """Start the ``cp.async`` of the 64 query rows (row m: lane m // H, head m % H; latent and
    rope parts) into shared memory."""
    offs_qm = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout))
    q_ok = offs_qm < n_rows
    q_rows = Q + (q_start + offs_qm // H).to(gl.int64) * stride_qt + (offs_qm % H) * stride_qh
    offs_d = gl.arange(0, D_MAIN, layout=gl.SliceLayout(0, copy_layout))
    offs_pe = gl.arange(0, D_PE, layout=gl.SliceLayout(0, copy_layout))
    async_copy.async_copy_global_to_shared(q_smem, q_rows[:, None] + offs_d[None, :],
                                           mask=q_ok[:, None])
    async_copy.async_copy_global_to_shared(qpe_smem, q_rows[:, None] + D_MAIN + offs_pe[None, :],
                                           mask=q_ok[:, None])


@gluon.jit
def _load_q_f16(Q, q_smem, qpe_smem, stride_qt, stride_qh, q_start, row_lo, n_rows, q_prescale,
                H: gl.constexpr):
    """The 64 query rows as ``_issue_q`` places them, each value ``q * q_prescale`` rounded to
    fp16 (``Q_F16``: bf16 queries over FP8 pools), ``FP8_COLS`` latent columns at a time
    through registers. The first tile's fence makes the stores visible to the wgmmas."""
    offs_qm = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, COPY_LAYOUT))
    q_ok = offs_qm < n_rows
    q_rows = Q + (q_start + offs_qm // H).to(gl.int64) * stride_qt + (offs_qm % H) * stride_qh
    offs_c = gl.arange(0, FP8_COLS, layout=gl.SliceLayout(0, COPY_LAYOUT))
    for c in gl.static_range(D_MAIN // FP8_COLS):
        x = gl.load(q_rows[:, None] + c * FP8_COLS + offs_c[None, :], mask=q_ok[:, None],
                    other=0.0)
        q_smem.slice(c * FP8_COLS, FP8_COLS, dim=1).store(
            (x.to(gl.float32) * q_prescale).to(gl.float16))
    offs_pe = gl.arange(0, D_PE, layout=gl.SliceLayout(0, COPY_LAYOUT))
    x = gl.load(q_rows[:, None] + D_MAIN + offs_pe[None, :], mask=q_ok[:, None], other=0.0)
    qpe_smem.store((x.to(gl.float32) * q_prescale).to(gl.float16))


@gluon.jit
def _start_q(Q, q_smem, qpe_smem, stride_qt, stride_qh, q_start, row_lo, n_rows, q_prescale,
             H: gl.constexpr, Q_F16: gl.constexpr):
    """The query rows into shared memory: by ``cp.async`` in the next copy group, or with
    ``Q_F16`` prescaled to fp16 through registers (``_load_q_f16``)."""
    if Q_F16:
        _load_q_f16(Q, q_smem, qpe_smem, stride_qt, stride_qh, q_start, row_lo, n_rows,
                    q_prescale, H)
    else:
        _issue_q(Q, q_smem, qpe_smem, stride_qt, stride_qh, q_start, row_lo, n_rows, H,
                 COPY_LAYOUT)


@gluon.jit
def _store_result(acc, l_i, m_i, Out, MidO, MidLse, stride_ot, stride_oh, stride_mo_t,
                  stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, q_start, row_lo, n_rows,
                  split, col0, H: gl.constexpr, DIRECT_OUT: gl.constexpr,
                  WRITE_LSE: gl.constexpr, row_layout: gl.constexpr):
    """Normalise ``acc`` (the output columns ``[col0, col0 + acc.shape[1])``) by the row sums
    ``l_i``: one split writes ``Out``, several write fp32 partials ``MidO`` and (``WRITE_LSE``)
    the natural-log LSE from ``m_i`` / ``l_i`` (both in ``row_layout``)."""
    o_layout: gl.constexpr = acc.type.layout
    offs_om = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_oc = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, o_layout))
    o_ok = offs_om < n_rows
    o_row = (q_start + offs_om // H).to(gl.int64)
    o_head = offs_om % H
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
    if DIRECT_OUT:
        ptr = Out + o_row[:, None] * stride_ot + o_head[:, None] * stride_oh + offs_oc[None, :]
        gl.store(ptr, o.to(Out.dtype.element_ty), mask=o_ok[:, None])
    else:
        ptr = MidO + o_row[:, None] * stride_mo_t + o_head[:, None] * stride_mo_h + \
            split * stride_mo_s + offs_oc[None, :]
        gl.store(ptr, o, mask=o_ok[:, None])
        if WRITE_LSE:
            offs_sm = row_lo + gl.arange(0, BLOCK_M, layout=row_layout)
            seen = l_i > 0.0
            lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2,
                           float("-inf"))
            s_row = (q_start + offs_sm // H).to(gl.int64)
            gl.store(MidLse + s_row * stride_ml_t + (offs_sm % H) * stride_ml_h + split,
                     lse, mask=offs_sm < n_rows)


@gluon.jit
def _ws_produce(KV, stride_kvs, r2t_row, k_ring, kpe_ring, k_st, kpe_st, full, empty, n_pref,
                start, end, n_lo, n_hi, hl, q_start, b, step, Hist, Parents, stride_par_s,
                stride_par_b, TOPK, NUM_STEPS, num_slots, total, MODE: gl.constexpr,
                BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The FP8 split kernel's producer warpgroup: the codes of each key tile by ``cp.async``
    into the ring (``NUM_STAGES`` tiles ahead), widened into the staging tile once the
    consumers are done with the last one (``empty``), handed over (``full``)."""
    for i in gl.static_range(NUM_STAGES):
        _issue_tile_fp8(i, _prefix_slots(i, r2t_row, n_pref, start, end, BLOCK_N,
                                         WS_FP8_LAYOUT),
                        k_ring, kpe_ring, KV, stride_kvs, n_pref, start, end, n_lo, n_hi, hl,
                        q_start, b, step, Hist, Parents, stride_par_s, stride_par_b, TOPK,
                        NUM_STEPS, num_slots, MODE, BLOCK_N, NUM_STAGES, WS_FP8_LAYOUT,
                        WS_COPY_LAYOUT)
        async_copy.commit_group()
    slots = _prefix_slots(NUM_STAGES, r2t_row, n_pref, start, end, BLOCK_N, WS_FP8_LAYOUT)
    for t in range(total):
        stage = t % NUM_STAGES
        async_copy.wait_group(NUM_STAGES - 1)
        gl.thread_barrier()
        mbarrier.wait(empty.index(0), (t & 1) ^ 1)
        if t >= n_pref:  # history keys: their non-finite values zeroed (_finite_tail)
            _widen_tile(k_ring.index(stage), k_st, True, WS_FP8_COLS, WS_FP8_LAYOUT)
            _widen_tile(kpe_ring.index(stage), kpe_st, True, D_PE, WS_COPY_LAYOUT)
        else:
            _widen_tile(k_ring.index(stage), k_st, False, WS_FP8_COLS, WS_FP8_LAYOUT)
            _widen_tile(kpe_ring.index(stage), kpe_st, False, D_PE, WS_COPY_LAYOUT)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(full.index(0), count=1)
        _issue_tile_fp8(t + NUM_STAGES, slots, k_ring, kpe_ring, KV, stride_kvs, n_pref,
                        start, end, n_lo, n_hi, hl, q_start, b, step, Hist, Parents,
                        stride_par_s, stride_par_b, TOPK, NUM_STEPS, num_slots, MODE, BLOCK_N,
                        NUM_STAGES, WS_FP8_LAYOUT, WS_COPY_LAYOUT)
        async_copy.commit_group()
        slots = _prefix_slots(t + NUM_STAGES + 1, r2t_row, n_pref, start, end, BLOCK_N,
                              WS_FP8_LAYOUT)
    async_copy.wait_group(0)


@gluon.jit
def _ws_consume(Q, q_smem, qpe_smem, k_st, kpe_st, full, empty, Out, MidO, MidLse, KScale,
                stride_qt, stride_qh, stride_ot, stride_oh, stride_mo_t, stride_mo_h,
                stride_mo_s, stride_ml_t, stride_ml_h, q_start, row_lo, n_rows, q_prescale,
                n_pref, start, end, n_lo, n_hi, hl, split, total, sm_scale, logit_cap,
                H: gl.constexpr, Q_F16: gl.constexpr, BLOCK_N: gl.constexpr,
                USE_CAP: gl.constexpr, DIRECT_OUT: gl.constexpr, MODE: gl.constexpr):
    """The FP8 split kernel's consumer warpgroups: the query rows, then per key tile S, the
    online softmax and P.V on the staging tile the producer filled (``full``), released
    after (``empty``); the result as the kernel stores it."""
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)
    _start_q(Q, q_smem, qpe_smem, stride_qt, stride_qh, q_start, row_lo, n_rows, q_prescale,
             H, Q_F16)
    if not Q_F16:
        async_copy.commit_group()
        async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    k_scale = gl.load(KScale)
    qk_scale = sm_scale * LOG2E * (Q_F16_SCALE if Q_F16 else 1.0) * k_scale
    row_lane = (row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))) // H
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, D_MAIN], gl.float32, O_LAYOUT)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    for t in range(total):
        mbarrier.wait(full.index(0), t & 1)
        acc, m_i, l_i = _attend_tile(t, acc, m_i, l_i, q_smem, qpe_smem, k_st, kpe_st, s_zero,
                                     row_lane, n_pref, start, end, n_lo, n_hi, hl, qk_scale,
                                     logit_cap, BLOCK_N, USE_CAP, P_LAYOUT,
                                     MODE == MODE_EXTEND)
        gl.thread_barrier()
        mbarrier.arrive(empty.index(0), count=1)
    acc = acc * k_scale  # the value scale: the latent is the value
    _store_result(acc, l_i, m_i, Out, MidO, MidLse, stride_ot, stride_oh, stride_mo_t,
                  stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, q_start, row_lo,
                  n_rows, split, 0, H, DIRECT_OUT, True, gl.SliceLayout(1, s_layout))


@gluon.jit
def _gluon_mla_kernel(
        Q, KV, Kin, MidO, MidLse, Out, ReqToToken, Meta, Hist, Parents, KScale, WScale,
        step, sm_scale, logit_cap, q_prescale,
        stride_qt, stride_qh, stride_kvs, stride_kin_t,
        stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, stride_ot, stride_oh,
        stride_r2t, stride_par_s, stride_par_b, num_slots, TOPK, NUM_STEPS, NUM_SPLITS,
        H: gl.constexpr, MODE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        USE_CAP: gl.constexpr, DIRECT_OUT: gl.constexpr, FP8: gl.constexpr,
        Q_F16: gl.constexpr = False, PDL: gl.constexpr = False,
        STORE_FP8: gl.constexpr = False, W_QUANT: gl.constexpr = 0, E5M2: gl.constexpr = False,
        SATURATE: gl.constexpr = True, SIGNED_NAN: gl.constexpr = True):
    """Grid ``(row_tiles, B, NUM_SPLITS)``, 8 warps (``FP8``: and a producer warpgroup). See
    ``gluon_mla`` for the algorithm and the tensors (Q ``[B*K, H, 576]``, KV ``[slots,
    576]``, Kin ``[B*K, 576]``, MidO ``[B*K, H, parts, 512]``, MidLse ``[B*K, H, parts]``,
    Out ``[B*K, H, 512]``; extend,
    ``MODE_EXTEND``: ``T`` new tokens for ``B*K``, request ``b``'s ``Meta[b, 4]`` from row
    ``Meta[b, 3]``, Hist ``[T, 1]`` their slots, the tail causal). ``FP8``:
    KV holds codes, a key is ``code * KScale[0]`` (module doc); Kin is not read. ``Q_F16``
    (FP8, bf16 Q): the wgmmas are fp16 on ``q * q_prescale`` (module doc). ``PDL``: the
    merge (a programmatic dependent launch) may start once every program has stored its
    result. ``STORE_FP8`` (FP8): the tail program of each row tile stores torch's codes of
    the keys its tail reads (``_store_new_keys``: decode, its lanes'; extend, every new
    token up to the tile's last; other tiles store the same bytes) and reads them back from
    the pool after a barrier; without it torch stored them before the kernel. Over FP8 pools
    the kernel is warp-specialised: a producer warpgroup copies and widens each key tile
    (``_ws_produce``) while the 8 warps compute on the one before (``_ws_consume``)."""
    dtype: gl.constexpr = gl.float16 if Q_F16 else Q.dtype.element_ty
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)
    copy_layout: gl.constexpr = COPY_LAYOUT

    rt = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    rpi = gl.load(Meta + b * META_W).to(gl.int64)
    prefix_len = gl.load(Meta + b * META_W + 1)
    split_len = gl.load(Meta + b * META_W + 2)
    if MODE == MODE_EXTEND:  # lanes are the request's new tokens, one tail key each
        q_start = gl.load(Meta + b * META_W + 3)
        n_q = gl.load(Meta + b * META_W + 4)
        hl = 1
    else:
        q_start = b * TOPK
        n_q = TOPK
        hl = step + 1
    n_rows = n_q * H
    row_lo = rt * BLOCK_M
    live = row_lo < n_rows  # row tiles past a short extend request do nothing
    r2t_row = ReqToToken + rpi * stride_r2t

    # Lanes of this row tile (their tail keys, and the new keys split 0 stores).
    lane_lo = row_lo // H
    lane_hi = gl.minimum(n_q, (row_lo + BLOCK_M + H - 1) // H)
    if not FP8:  # FP8: the tail program (STORE_FP8) or torch stores them
        if split == 0:
            _store_new_keys(Kin, KV, Hist, stride_kin_t, stride_kvs, q_start, lane_lo,
                            lane_hi, step, NUM_STEPS, num_slots, KV_WRITE_LAYOUT)
    if STORE_FP8:
        if (split == NUM_SPLITS - 1) & live:
            _store_new_keys(Kin, KV, Hist, stride_kin_t, stride_kvs, q_start,
                            0 if MODE == MODE_EXTEND else lane_lo, lane_hi, step, NUM_STEPS,
                            num_slots, KV_WRITE_LAYOUT, WScale, True, W_QUANT, E5M2, SATURATE,
                            SIGNED_NAN)
            gl.thread_barrier()  # the codes stored, visible to this program's tail copies

    start = split * split_len
    end = gl.where(live, gl.minimum(prefix_len, start + split_len), start)
    n_pref = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    # The tail: the lanes' own history, or (extend) every new token up to the tile's last.
    if MODE == MODE_EXTEND:
        n_lo = lane_lo * 0
    else:
        n_lo = lane_lo * hl
    n_hi = gl.where((split == NUM_SPLITS - 1) & live, lane_hi * hl, n_lo)
    total = n_pref + gl.cdiv(n_hi - n_lo, BLOCK_N)

    if FP8:  # warp-specialised: _ws_produce widens, _ws_consume computes and stores
        q_smem, qpe_smem, k_st, kpe_st = _alloc_q_and_ring(dtype, BLOCK_N, 1)
        k_ring, kpe_ring = _alloc_fp8_ring(KV.dtype.element_ty, BLOCK_N, NUM_STAGES)
        full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(full.index(0), count=1)
        mbarrier.init(empty.index(0), count=1)
        gl.warp_specialize([
            (_ws_consume, (Q, q_smem, qpe_smem, k_st.index(0), kpe_st.index(0), full, empty,
                           Out, MidO, MidLse, KScale, stride_qt, stride_qh, stride_ot,
                           stride_oh, stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t,
                           stride_ml_h, q_start, row_lo, n_rows, q_prescale, n_pref, start,
                           end, n_lo, n_hi, hl, split, total, sm_scale, logit_cap, H, Q_F16,
                           BLOCK_N, USE_CAP, DIRECT_OUT, MODE)),
            (_ws_produce, (KV, stride_kvs, r2t_row, k_ring, kpe_ring, k_st.index(0),
                           kpe_st.index(0), full, empty, n_pref, start, end, n_lo, n_hi, hl,
                           q_start, b, step, Hist, Parents, stride_par_s, stride_par_b, TOPK,
                           NUM_STEPS, num_slots, total, MODE, BLOCK_N, NUM_STAGES)),
        ], [4], [WS_PRODUCER_REGS])
    else:
        q_smem, qpe_smem, k_smem, kpe_smem = _alloc_q_and_ring(dtype, BLOCK_N, NUM_STAGES)
        # Q rows (row m: lane m // H, head m % H), in the first copy group.
        _issue_q(Q, q_smem, qpe_smem, stride_qt, stride_qh, q_start, row_lo, n_rows, H,
                 copy_layout)
        for i in gl.static_range(NUM_STAGES - 1):
            _issue_tile(i, _prefix_slots(i, r2t_row, n_pref, start, end, BLOCK_N,
                                         copy_layout),
                        k_smem, kpe_smem, KV, Kin, stride_kvs, stride_kin_t, n_pref, start,
                        end, n_lo, n_hi, hl, q_start, b, step, Hist, Parents, stride_par_s,
                        stride_par_b, TOPK, NUM_STEPS, num_slots, MODE, BLOCK_N, NUM_STAGES,
                        copy_layout)
            async_copy.commit_group()
        # The slots of the next tile to copy.
        slots = _prefix_slots(NUM_STAGES - 1, r2t_row, n_pref, start, end, BLOCK_N,
                              copy_layout)

    if not FP8:
        offs_sm = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        row_lane = offs_sm // H
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, D_MAIN], gl.float32, O_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        for t in range(total):
            acc, m_i, l_i, slots = _tile_step(
                t, slots, acc, m_i, l_i, q_smem, qpe_smem, k_smem, kpe_smem, s_zero,
                row_lane, r2t_row, KV, Kin, stride_kvs, stride_kin_t, n_pref, start, end,
                n_lo, n_hi, hl, q_start, b, step, Hist, Parents, stride_par_s, stride_par_b,
                TOPK, NUM_STEPS, num_slots, sm_scale * LOG2E, logit_cap, MODE, BLOCK_N,
                NUM_STAGES, USE_CAP, copy_layout, P_LAYOUT)
        async_copy.wait_group(0)
        # Epilogue: normalise; one split writes Out, several write partials + LSE.
        _store_result(acc, l_i, m_i, Out, MidO, MidLse, stride_ot, stride_oh, stride_mo_t,
                      stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, q_start, row_lo,
                      n_rows, split, 0, H, DIRECT_OUT, True, gl.SliceLayout(1, s_layout))
    if PDL:
        launch_dependents()
