"""The Gluon MLA decode kernel (Hopper: wgmma, cp.async). Imported only through
``gluon_mla.kernel_module()``, after the Triton version and Gluon's Hopper ops were checked;
``gluon_mla`` documents the algorithm.

``FP8`` (a constexpr): the pool holds FP8 codes (e4m3 / e5m2) and a key is ``code *
KScale[0]``. The codes of a key tile are gathered by ``cp.async`` into a ring of FP8 tiles
(``_alloc_fp8_ring``), widened exactly to the query's dtype into one staging tile that the
wgmmas read (``_widen_tile``), and the ring stage is refilled as soon as it is widened, so
two tiles are in flight during a tile's MMAs, by a producer warpgroup of its own while the
kernel's 8 warps compute on the tile before (``_ws_attend``: warp-specialised, mbarriers
hand the staging tile over). The key scale folds into
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
KV_WRITE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))
# Both kernels are warp-specialised: a producer warpgroup (4 warps, PRODUCER_REGS registers;
# the 8 computing warps get the rest: 240) copies the key tiles, 16 bytes a copy: bf16/fp16
# rows in COPY4_LAYOUT (COPY_LAYOUT over 4 warps), FP8 codes in FP8_LAYOUT (16 codes, 4 rows
# x 128 codes per warp instruction; the rope part in COPY4_LAYOUT, whose rows are
# distributed alike), widened FP8_COLS latent columns at a time.
COPY4_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
FP8_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
FP8_COLS = gl.constexpr(256)
PRODUCER_REGS = gl.constexpr(96)
# Half-width partials (``gluon-wl``) are stored from this layout, 16 bytes a thread along a
# row: stored from O_LAYOUT (4 bytes a thread, 16 a row per quad) they made the step 7-17%
# slower than fp32 ones, through it 3-9% faster (docs/kernels.md).
HALF_STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))


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
                    NUM_STAGES: gl.constexpr):
    """``_issue_tile`` for an FP8 pool, by the producer warpgroup: the codes of key tile
    ``t`` into ring stage ``t % NUM_STAGES`` (``slots`` in ``FP8_LAYOUT``'s rows), every key
    from the pool (this call's too); keys past the end are zero-filled."""
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, FP8_LAYOUT))
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
    offs_d = gl.arange(0, D_MAIN, layout=gl.SliceLayout(0, FP8_LAYOUT))
    async_copy.async_copy_global_to_shared(k_ring.index(stage),
                                           rows[:, None] + offs_d[None, :], mask=ok[:, None])
    pe_rows = gl.convert_layout(rows, gl.SliceLayout(1, COPY4_LAYOUT))
    pe_ok = gl.convert_layout(ok, gl.SliceLayout(1, COPY4_LAYOUT))
    offs_pe = gl.arange(0, D_PE, layout=gl.SliceLayout(0, COPY4_LAYOUT))
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
    fp16 (``Q_F16``: bf16 queries over FP8 pools), through registers; the caller's fence
    makes the stores visible to the wgmmas."""
    offs_qm = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, COPY_LAYOUT))
    q_ok = offs_qm < n_rows
    q_rows = Q + (q_start + offs_qm // H).to(gl.int64) * stride_qt + (offs_qm % H) * stride_qh
    offs_c = gl.arange(0, D_MAIN, layout=gl.SliceLayout(0, COPY_LAYOUT))
    x = gl.load(q_rows[:, None] + offs_c[None, :], mask=q_ok[:, None], other=0.0)
    q_smem.store((x.to(gl.float32) * q_prescale).to(gl.float16))
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
    ``l_i``: one split writes ``Out``, several write partials ``MidO`` (fp32, or the
    query's dtype through ``HALF_STORE_LAYOUT``) and (``WRITE_LSE``) the natural-log LSE
    from ``m_i`` / ``l_i`` (both in ``row_layout``)."""
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
        if MidO.dtype.element_ty == gl.float32:
            ptr = MidO + o_row[:, None] * stride_mo_t + o_head[:, None] * stride_mo_h + \
                split * stride_mo_s + offs_oc[None, :]
            gl.store(ptr, o, mask=o_ok[:, None])
        else:  # half-width partials, through HALF_STORE_LAYOUT
            st: gl.constexpr = HALF_STORE_LAYOUT
            o_h = gl.convert_layout(o.to(MidO.dtype.element_ty), st)
            h_om = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st))
            h_oc = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, st))
            h_row = (q_start + h_om // H).to(gl.int64)
            ptr = MidO + h_row[:, None] * stride_mo_t + (h_om % H)[:, None] * stride_mo_h + \
                split * stride_mo_s + h_oc[None, :]
            gl.store(ptr, o_h, mask=(h_om < n_rows)[:, None])
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
                stride_par_b, TOPK, NUM_STEPS, num_slots, t_lo, t_hi, MODE: gl.constexpr,
                BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The FP8 kernels' producer warpgroup: the codes of key tiles ``[t_lo, t_hi)`` by
    ``cp.async`` into the ring (``NUM_STAGES`` tiles ahead), each widened into the staging
    tile once the consumers are done with the last one (``empty``), handed over (``full``).
    A tile past ``t_hi`` is not copied, its copy group left empty (``wait_group`` counts
    groups)."""
    for i in gl.static_range(NUM_STAGES):
        if t_lo + i < t_hi:
            _issue_tile_fp8(t_lo + i, _prefix_slots(t_lo + i, r2t_row, n_pref, start, end,
                                                    BLOCK_N, FP8_LAYOUT),
                            k_ring, kpe_ring, KV, stride_kvs, n_pref, start, end, n_lo, n_hi,
                            hl, q_start, b, step, Hist, Parents, stride_par_s, stride_par_b,
                            TOPK, NUM_STEPS, num_slots, MODE, BLOCK_N, NUM_STAGES)
        async_copy.commit_group()
    slots = _prefix_slots(t_lo + NUM_STAGES, r2t_row, n_pref, start, end, BLOCK_N,
                          FP8_LAYOUT)
    for t in range(t_lo, t_hi):
        stage = t % NUM_STAGES
        async_copy.wait_group(NUM_STAGES - 1)
        gl.thread_barrier()
        mbarrier.wait(empty.index(0), ((t - t_lo) & 1) ^ 1)
        k_s = k_st.index(0)
        kpe_s = kpe_st.index(0)
        if t >= n_pref:  # history keys: their non-finite values zeroed (_finite_tail)
            _widen_tile(k_ring.index(stage), k_s, True, FP8_COLS, FP8_LAYOUT)
            _widen_tile(kpe_ring.index(stage), kpe_s, True, D_PE, COPY4_LAYOUT)
        else:
            _widen_tile(k_ring.index(stage), k_s, False, FP8_COLS, FP8_LAYOUT)
            _widen_tile(kpe_ring.index(stage), kpe_s, False, D_PE, COPY4_LAYOUT)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(full.index(0), count=1)
        if t + NUM_STAGES < t_hi:
            _issue_tile_fp8(t + NUM_STAGES, slots, k_ring, kpe_ring, KV, stride_kvs, n_pref,
                            start, end, n_lo, n_hi, hl, q_start, b, step, Hist, Parents,
                            stride_par_s, stride_par_b, TOPK, NUM_STEPS, num_slots, MODE,
                            BLOCK_N, NUM_STAGES)
            slots = _prefix_slots(t + NUM_STAGES + 1, r2t_row, n_pref, start, end, BLOCK_N,
                                  FP8_LAYOUT)
        async_copy.commit_group()
    async_copy.wait_group(0)


@gluon.jit
def _ws_copy(KV, Kin, stride_kvs, stride_kin_t, r2t_row, k_smem, kpe_smem, full, empty, n_pref,
             start, end, n_lo, n_hi, hl, q_start, b, step, Hist, Parents, stride_par_s,
             stride_par_b, TOPK, NUM_STEPS, num_slots, t_lo, t_hi, MODE: gl.constexpr,
             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The bf16/fp16 kernels' producer warpgroup: key tiles ``[t_lo, t_hi)`` by ``cp.async``
    straight into the ring the consumers read (a tail tile's non-finite values zeroed,
    ``_finite_tail``), each stage handed over once its tile has landed (``full``) and
    refilled once the consumers are done with it (``empty``): tile ``t`` is handed over
    before the producer waits to refill tile ``t - 1``'s stage. A tile past ``t_hi`` is not
    copied, its copy group left empty (``wait_group`` counts groups)."""
    for i in gl.static_range(NUM_STAGES):
        if t_lo + i < t_hi:
            _issue_tile(t_lo + i, _prefix_slots(t_lo + i, r2t_row, n_pref, start, end,
                                                BLOCK_N, COPY4_LAYOUT),
                        k_smem, kpe_smem, KV, Kin, stride_kvs, stride_kin_t, n_pref, start,
                        end, n_lo, n_hi, hl, q_start, b, step, Hist, Parents, stride_par_s,
                        stride_par_b, TOPK, NUM_STEPS, num_slots, MODE, BLOCK_N, NUM_STAGES,
                        COPY4_LAYOUT)
        async_copy.commit_group()
    slots = _prefix_slots(t_lo + NUM_STAGES, r2t_row, n_pref, start, end, BLOCK_N,
                          COPY4_LAYOUT)
    for t in range(t_lo, t_hi):
        n = t - t_lo
        # Tile t has landed (the tiles issued after it may be in flight: all but the first
        # iteration's last refill was one tile ago).
        if n == 0:
            async_copy.wait_group(NUM_STAGES - 1)
        else:
            async_copy.wait_group(NUM_STAGES - 2)
        _finite_tail(k_smem.index(t % NUM_STAGES), t, n_pref, COPY4_LAYOUT, 128)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(full.index(t % NUM_STAGES), count=1)
        if n > 0:  # refill tile t - 1's stage with tile t - 1 + NUM_STAGES
            u = t - 1
            if u + NUM_STAGES < t_hi:
                mbarrier.wait(empty.index(u % NUM_STAGES), ((u - t_lo) // NUM_STAGES) & 1)
                _issue_tile(u + NUM_STAGES, slots, k_smem, kpe_smem, KV, Kin, stride_kvs,
                            stride_kin_t, n_pref, start, end, n_lo, n_hi, hl, q_start, b,
                            step, Hist, Parents, stride_par_s, stride_par_b, TOPK, NUM_STEPS,
                            num_slots, MODE, BLOCK_N, NUM_STAGES, COPY4_LAYOUT)
                slots = _prefix_slots(u + NUM_STAGES + 1, r2t_row, n_pref, start, end,
                                      BLOCK_N, COPY4_LAYOUT)
            async_copy.commit_group()
    async_copy.wait_group(0)


@gluon.jit
def _ws_producer(KV, Kin, stride_kvs, stride_kin_t, r2t_row, k_ring, kpe_ring, k_st, kpe_st,
                 full, empty, n_pref, start, end, n_lo, n_hi, hl, q_start, b, step, Hist,
                 Parents, stride_par_s, stride_par_b, TOPK, NUM_STEPS, num_slots, t_lo, t_hi,
                 MODE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                 FP8: gl.constexpr):
    """The producer warpgroup of either pool: ``_ws_produce`` (FP8 codes, widened into the
    staging tile) or ``_ws_copy`` (bf16/fp16, straight into the ring)."""
    if FP8:
        _ws_produce(KV, stride_kvs, r2t_row, k_ring, kpe_ring, k_st, kpe_st, full, empty,
                    n_pref, start, end, n_lo, n_hi, hl, q_start, b, step, Hist, Parents,
                    stride_par_s, stride_par_b, TOPK, NUM_STEPS, num_slots, t_lo, t_hi, MODE,
                    BLOCK_N, NUM_STAGES)
    else:
        _ws_copy(KV, Kin, stride_kvs, stride_kin_t, r2t_row, k_st, kpe_st, full, empty,
                 n_pref, start, end, n_lo, n_hi, hl, q_start, b, step, Hist, Parents,
                 stride_par_s, stride_par_b, TOPK, NUM_STEPS, num_slots, t_lo, t_hi, MODE,
                 BLOCK_N, NUM_STAGES)


@gluon.jit
def _ws_consume(Q, q_smem, qpe_smem, k_st, kpe_st, full, empty, KScale, stride_qt, stride_qh,
                q_start, row_lo, n_rows, q_prescale, n_pref, start, end, n_lo, n_hi, hl, t_lo,
                t_hi, sm_scale, logit_cap, H: gl.constexpr, Q_F16: gl.constexpr,
                BLOCK_N: gl.constexpr, USE_CAP: gl.constexpr, MODE: gl.constexpr,
                NB: gl.constexpr, FP8: gl.constexpr):
    """The consumer warpgroups (the kernel's 8 warps): the query rows, then per key tile of
    ``[t_lo, t_hi)`` S, the online softmax and P.V on the tile the producer handed over in
    buffer ``t % NB`` of ``k_st`` / ``kpe_st`` (``full``), released after (``empty``).
    Returns ``(acc, m_i, l_i)``; ``FP8``: the key scale applied."""
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)
    _start_q(Q, q_smem, qpe_smem, stride_qt, stride_qh, q_start, row_lo, n_rows, q_prescale,
             H, Q_F16)
    if not Q_F16:
        async_copy.commit_group()
        async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    if FP8:
        k_scale = gl.load(KScale)
        qk_scale = sm_scale * LOG2E * (Q_F16_SCALE if Q_F16 else 1.0) * k_scale
    else:
        qk_scale = sm_scale * LOG2E
    row_lane = (row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))) // H
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, D_MAIN], gl.float32, O_LAYOUT)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    for t in range(t_lo, t_hi):
        buf = t % NB
        mbarrier.wait(full.index(buf), ((t - t_lo) // NB) & 1)
        acc, m_i, l_i = _attend_tile(t, acc, m_i, l_i, q_smem, qpe_smem, k_st.index(buf),
                                     kpe_st.index(buf), s_zero, row_lane, n_pref, start, end,
                                     n_lo, n_hi, hl, qk_scale, logit_cap, BLOCK_N, USE_CAP,
                                     P_LAYOUT, MODE == MODE_EXTEND)
        gl.thread_barrier()
        mbarrier.arrive(empty.index(buf), count=1)
    if FP8:
        acc = acc * k_scale  # the value scale: the latent is the value
    return acc, m_i, l_i


@gluon.jit
def _ws_attend(Q, KV, Kin, q_smem, qpe_smem, k_st, kpe_st, k_ring, kpe_ring, KScale, stride_qt,
               stride_qh, stride_kvs, stride_kin_t, r2t_row, q_start, row_lo, n_rows,
               q_prescale, n_pref, start, end, n_lo, n_hi, hl, b, step, Hist, Parents,
               stride_par_s, stride_par_b, TOPK, NUM_STEPS, num_slots, t_lo, t_hi, sm_scale,
               logit_cap, H: gl.constexpr, Q_F16: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr, USE_CAP: gl.constexpr, MODE: gl.constexpr,
               FP8: gl.constexpr):
    """Key tiles ``[t_lo, t_hi)`` warp-specialised (shared memory as the caller allocated
    it): a producer warpgroup copies them (``_ws_copy``: into the ring ``k_st`` /
    ``kpe_st`` the 8 warps read; ``FP8``: ``_ws_produce``, codes into ``k_ring`` /
    ``kpe_ring``, widened into the one staging tile ``k_st`` / ``kpe_st``) while the
    kernel's 8 warps compute (``_ws_consume``). Returns ``(acc, m_i, l_i)`` there."""
    NB: gl.constexpr = 1 if FP8 else NUM_STAGES
    full = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NB):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return gl.warp_specialize([
        (_ws_consume, (Q, q_smem, qpe_smem, k_st, kpe_st, full, empty, KScale, stride_qt,
                       stride_qh, q_start, row_lo, n_rows, q_prescale, n_pref, start, end, n_lo,
                       n_hi, hl, t_lo, t_hi, sm_scale, logit_cap, H, Q_F16, BLOCK_N, USE_CAP,
                       MODE, NB, FP8)),
        (_ws_producer, (KV, Kin, stride_kvs, stride_kin_t, r2t_row, k_ring, kpe_ring, k_st,
                        kpe_st, full, empty, n_pref, start, end, n_lo, n_hi, hl, q_start, b,
                        step, Hist, Parents, stride_par_s, stride_par_b, TOPK, NUM_STEPS,
                        num_slots, t_lo, t_hi, MODE, BLOCK_N, NUM_STAGES, FP8)),
    ], [4], [PRODUCER_REGS])


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
    """Grid ``(row_tiles, B, NUM_SPLITS)``, 8 warps and a producer warpgroup. See
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
    the pool after a barrier; without it torch stored them before the kernel. The kernel is
    warp-specialised (``_ws_attend``): a producer warpgroup copies (over FP8 pools, and
    widens) each key tile while the 8 warps compute on the one before."""
    dtype: gl.constexpr = gl.float16 if Q_F16 else Q.dtype.element_ty
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)

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

    # Q, and the ring the 8 warps read; FP8: one staging tile they read, and the ring of
    # codes the producer widens into it.
    q_smem, qpe_smem, k_st, kpe_st = _alloc_q_and_ring(dtype, BLOCK_N, 1 if FP8 else NUM_STAGES)
    if FP8:
        k_ring, kpe_ring = _alloc_fp8_ring(KV.dtype.element_ty, BLOCK_N, NUM_STAGES)
    else:
        k_ring, kpe_ring = k_st, kpe_st  # not read
    acc, m_i, l_i = _ws_attend(
        Q, KV, Kin, q_smem, qpe_smem, k_st, kpe_st, k_ring, kpe_ring, KScale, stride_qt,
        stride_qh, stride_kvs, stride_kin_t, r2t_row, q_start, row_lo, n_rows, q_prescale,
        n_pref, start, end, n_lo, n_hi, hl, b, step, Hist, Parents, stride_par_s,
        stride_par_b, TOPK, NUM_STEPS, num_slots, 0, total, sm_scale, logit_cap, H, Q_F16,
        BLOCK_N, NUM_STAGES, USE_CAP, MODE, FP8)

    # Epilogue: normalise; one split writes Out, several write partials + LSE.
    _store_result(acc, l_i, m_i, Out, MidO, MidLse, stride_ot, stride_oh, stride_mo_t,
                  stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, q_start, row_lo,
                  n_rows, split, 0, H, DIRECT_OUT, True, gl.SliceLayout(1, s_layout))
    if PDL:
        launch_dependents()
