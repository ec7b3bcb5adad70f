"""The CuTe-DSL MLA draft-decode kernel for sm90 (plan ``cute``: ``MlaDecodeKernel``), run
only through ``cute_mla``. Shared memory of one CTA (256 threads; about 226 KB):

- ``sQ``: the 64 query rows, ``[64, 576]`` in 128-byte swizzle atoms (wgmma's K-major form);
- the key ring: ``STAGES`` tiles ``[64, 576]``, same form. After the loop it holds this
  CTA's normalised fp32 partial ``[64, 512]`` (row pitch ``O_PITCH``), which the other CTAs
  of the cluster read through distributed shared memory;
- ``sP``: the tile's probabilities ``[64, 64]`` (wgmma's A operand for ``P.V``);
- ``sStat``: per row the tile's rescale factor for O (from warpgroup 0 to 1) and, after the
  loop, the softmax sum; ``sLse``: per row the partial's natural-log LSE.
"""

from __future__ import annotations

import functools

try:
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as hopper
    from cutlass import Boolean, Float32, Int32, Int64
    from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum
except ImportError:
    # Without CuTe-DSL the module still imports (every specattn module does) and nothing here
    # runs (``plans.cute_import_reason``); the stand-in covers the decorators.
    import types

    cute = types.SimpleNamespace(jit=lambda fn: fn, kernel=lambda fn: fn)

ROWS = 64  # query rows per CTA: the wgmma height of one warpgroup
KEYS = 64  # keys per tile
D_MAIN = 512  # kv_lora_rank
WIDTH = 576  # latent + rope
PIECES = WIDTH // 8  # 16-byte pieces per row
META_W = 5  # int32 words per request in the metadata table (``_attn_kernels.META_W``)
THREADS = 256  # two consumer warpgroups
V_HALF = D_MAIN // 2  # output columns per warpgroup
# fp32 partial row pitch: the column pairs (8-byte stores) of the 4 rows a half-warp
# stores land on distinct banks.
O_PITCH = D_MAIN + 8
MAX_SLACK = 8.0  # base-2 growth of a row maximum absorbed without rescaling O
MERGE_BATCH = 8  # rows per thread whose partials the on-chip merge loads at once
SMALL_KEYS = 16  # a tail of at most this many keys is one wgmma N 16 / k-block tile
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
TILE_BYTES = ROWS * WIDTH * 2


def smem_bytes(stages: int) -> int:
    """Dynamic shared memory of one CTA (allocations in order, 1024-byte aligned)."""
    return TILE_BYTES * (1 + stages) + ROWS * KEYS * 2 + ROWS * 4 * 4 + ROWS * 4 + 1024


def _swizzled(dtype, rows: int, cols: int, stages: int = 0):
    """Row-major ``[rows, cols]`` (``x stages``) in 128-byte swizzle atoms."""
    atom = warpgroup.make_smem_layout_atom(
        hopper.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    shape = (rows, cols, stages) if stages else (rows, cols)
    return cute.tile_to_shape(atom, shape, order=(0, 1, 2) if stages else (0, 1))


@cute.jit
def _acc_rows(acc: cute.Layout) -> cute.Layout:
    """A one-warpgroup wgmma accumulator's per-thread layout ``((2, 2, N / 8), 1, 1)`` as
    ``(rows, columns)``: ``((2, 1), (2, N / 8, 1))``; a thread's rows are r and r + 8, and
    the 4 threads of a quad share each row."""
    flat = cute.make_layout(acc.shape)
    return cute.composition(acc, cute.make_layout(
        ((flat.shape[0][1], flat.shape[1]), (flat.shape[0][0], flat.shape[0][2], flat.shape[2])),
        stride=((flat.stride[0][1], flat.stride[1]),
                (flat.stride[0][0], flat.stride[0][2], flat.stride[2]))))


@cute.jit
def _quad_reduce(x, op):
    """``op`` over the 4 threads of a quad (lanes differing in their two low bits)."""
    for offset in cutlass.range_constexpr(2):
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1 << offset))
    return x


@cute.jit
def _wgmma(tiled_mma, acc, frag_a, frag_b, zero_init: cutlass.Constexpr[bool],
           k_blocks: cutlass.Constexpr = None):
    """``acc (+)= A B`` over every k block (or the first ``k_blocks``; one wgmma group), then
    wait for the chain."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    n_k = cute.size(frag_a.shape[2]) if cutlass.const_expr(k_blocks is None) else k_blocks
    for k in cutlass.range_constexpr(n_k):
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


@cute.jit
def _row_sum_and_inverse(sStat: cute.Tensor, m):
    """Row ``m``'s softmax sum (``sStat[m, 2]``, warpgroup 0's, plus ``sStat[m, 3]``,
    warpgroup 1's: 0) and its inverse (0 for a row that saw no key)."""
    total = sStat[m, 2] + sStat[m, 3]
    inv = Float32(0.0)
    if total > 0.0:
        inv = 1.0 / total
    return total, inv


@cute.jit
def _partial_lse(row_max, total):
    """A partial's natural-log LSE from its base-2 running maximum and its sum (-inf for a
    row that saw no key)."""
    lse = -Float32.inf
    if total > 0.0:
        lse = (row_max + cute.math.log2(total)) * LN2
    return lse


@cute.jit
def _head_row(base: cute.Pointer, q_start, row, heads: cutlass.Constexpr[int], s_t, s_h):
    """Query row ``row`` of the request whose lanes start at ``q_start`` (lane
    ``row // heads``, head ``row % heads``) in a ``[B*K, H, ...]`` tensor at ``base``."""
    return base + (Int64(q_start + row // heads) * s_t + (row % heads) * s_h)


@cute.jit
def _ld_cluster_f32(ptr) -> Float32:
    """One fp32 from another CTA's shared memory (``ptr`` from ``map_dsmem_ptr``)."""
    return cute.arch.inline_ptx("ld.shared::cluster.f32 {$w0}, [{$r0}];",
                                write_only_types=[Float32],
                                read_only_args=[Int32(ptr.toint())])


@cute.jit
def _ld_cluster_v4(ptr):
    """Four fp32 (16 bytes) from another CTA's shared memory."""
    return cute.arch.inline_ptx(
        "ld.shared::cluster.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Float32, Float32, Float32, Float32],
        read_only_args=[Int32(ptr.toint())])


class MlaDecodeKernel:
    """One compiled variant: ``dtype`` (bf16/fp16), ``heads``, ``path`` (tree mode),
    ``use_cap`` (logit cap), ``cluster`` (CTAs per cluster, merged on chip), ``groups``
    (clusters per request row tile; with more than one each writes a merged fp32 partial and
    LSE for ``merge_partials``), ``stages`` (key tiles in the ring).

    One CTA per (prefix split, 64-row tile, request), the splits of a request row tile in
    clusters. Per key tile of 64: warpgroup 1 gathers the next tile (16-byte ``cp.async``
    through ``req_to_token``); warpgroup 0 computes S over the whole tile (wgmma N 64: Q read
    once) and the softmax over whole rows, keeping a row's maximum until a new one exceeds it
    by ``MAX_SLACK`` (then O needs no rescale); both add ``P.V`` into their 256 output
    columns. Interior tiles are not masked and fold the scale into the exponent; P goes out
    by ``stmatrix``; a tail of at most ``SMALL_KEYS`` keys is one N 16 tile. The last split
    walks the lanes' history (the call's keys read from ``k_new``; split 0 stores them),
    first (``_tail_first``). Overlapping ``P.V`` with the next S is not done: ptxas
    serializes the wgmma (C7514), and a third 72 KB stage does not fit beside Q."""

    def __init__(self, dtype, heads: int, path: bool, use_cap: bool, cluster: int,
                 groups: int, stages: int):
        self.dtype = dtype
        self.heads = heads
        self.path = path
        self.use_cap = use_cap
        self.cluster = cluster
        self.groups = groups
        self.splits = cluster * groups
        self.stages = stages

    @cute.jit
    def __call__(self, q: cute.Pointer, kv: cute.Pointer, k_new: cute.Pointer,
                 out: cute.Pointer, mid_o: cute.Pointer, mid_lse: cute.Pointer,
                 r2t: cute.Pointer, meta: cute.Pointer, hist: cute.Pointer,
                 parents: cute.Pointer, batch: Int32, row_tiles: Int32, step: Int32,
                 topk: Int32, num_steps: Int32, num_slots: Int32, s_qt: Int32, s_qh: Int32,
                 s_kv: Int32, s_kin: Int32, s_ot: Int32, s_oh: Int32, s_mot: Int32,
                 s_moh: Int32, s_mop: Int32, s_mlt: Int32, s_mlh: Int32, s_r2t: Int32,
                 s_par_s: Int32, s_par_b: Int32, scale_log2: Float32, cap: Float32, stream):
        self.kernel(q, kv, k_new, out, mid_o, mid_lse, r2t, meta, hist, parents, step, topk,
                    num_steps, num_slots, s_qt, s_qh, s_kv, s_kin, s_ot, s_oh, s_mot, s_moh,
                    s_mop, s_mlt, s_mlh, s_r2t, s_par_s, s_par_b, scale_log2, cap).launch(
            grid=(self.splits, row_tiles, batch), block=(THREADS, 1, 1),
            cluster=(self.cluster, 1, 1), smem=smem_bytes(self.stages), stream=stream)

    # -- small pieces -------------------------------------------------------------------

    @cute.jit
    def _tail_first(self, n_pref: Int32, total: Int32, t: Int32):
        """Step ``t`` of ``total`` -> the key tile it walks: the tail tiles first, then the
        prefix, so that the last split's small extra tile is done while its first prefix tile
        lands (steps past the end stay past it)."""
        tt = t
        if t < total:
            tt = t + n_pref
            if tt >= total:
                tt = tt - total
        return tt

    @cute.jit
    def _copy_row(self, dst_row: cute.Tensor, src: cute.Pointer, sub: Int32):
        """This thread's 16-byte pieces (``sub``, ``sub + 4``, ...) of one 576-wide row, from
        global ``src`` (16-byte aligned) into the swizzled shared row ``dst_row``."""
        piece = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
            num_bits_per_copy=128)
        for i in cutlass.range_constexpr(PIECES // 4):
            col = sub + 4 * i
            g = cute.make_ptr(self.dtype, (src + col * 8).toint(), cute.AddressSpace.gmem,
                              assumed_align=16)
            # One atom moves all 8 elements: both tensors are one mode of 8 (a (1, 8)
            # tile would be 8 copies of 16 bytes, one per element).
            cute.copy(piece, cute.make_tensor(g, cute.make_layout(8)),
                      cute.local_tile(dst_row, (1, 8), (0, col))[0, None])

    @cute.jit
    def _zero_row(self, dst_row: cute.Tensor, sub: Int32):
        """Zeros in this thread's pieces of a shared row (a key or query row that is not
        there: no stale or non-finite value reaches an MMA)."""
        for i in cutlass.range_constexpr(PIECES // 4):
            col = sub + 4 * i
            cute.local_tile(dst_row, (1, 8), (0, col)).fill(0.0)

    @cute.jit
    def _finite_row(self, row: cute.Tensor, sub: Int32):
        """Non-finite values of this thread's pieces of a tail key row -> 0 (a history key
        is seen only by its own lane's rows; through ``P.V`` a NaN would reach the others as
        ``0 * NaN``)."""
        for i in cutlass.range_constexpr(PIECES // 4):
            col = sub + 4 * i
            piece = cute.local_tile(row, (1, 8), (0, col))[0, None]
            x = piece.load()
            finite = (x - x) == cute.full_like(x, 0.0)  # False for inf and NaN
            piece.store(cute.where(finite, x, cute.full_like(x, 0.0)))

    @cute.jit
    def _key_source(self, t: Int32, key: Int32, r2t_row: cute.Pointer, hist: cute.Pointer,
                    parents: cute.Pointer, n_pref: Int32, start: Int32, end: Int32,
                    n_lo: Int32, n_hi: Int32, hl: Int32, q_start: Int32, b: Int32,
                    step: Int32, num_steps: Int32, num_slots: Int32, s_par_s: Int32,
                    s_par_b: Int32, total: Int32):
        """Where key ``key`` of tile ``t`` comes from: ``(ok, new, slot, lane)``: a
        ``req_to_token`` entry (prefix tiles), a lane's history slot (``path``: through
        ``parents``) or, for the lane's last key (``new``), row ``lane`` of ``k_new``; ``ok``
        False past the end. Loaded a tile ahead of the copies (``slot`` raw, clamped there),
        so the loads' latency passes behind the MMAs."""
        ok = Boolean(False)
        new = Boolean(False)
        slot = Int32(0)
        src_lane = Int32(0)
        if t < total:
            if t < n_pref:
                pos = start + t * KEYS + key
                ok = pos < end
                if ok:
                    slot = Int32(cute.make_tensor(r2t_row + pos, cute.make_layout(1))[0])
            else:
                idx = n_lo + (t - n_pref) * KEYS + key
                ok = idx < n_hi
                if ok:
                    key_lane = idx // hl
                    depth = idx - key_lane * hl
                    new = depth == hl - 1
                    src_lane = q_start + key_lane
                    if not new:
                        a = key_lane
                        if cutlass.const_expr(self.path):
                            # a_step = lane, a_(u-1) = parents[u, b, a_u]
                            for uu in cutlass.range(step):
                                u = step - uu
                                if depth < u:
                                    off = u * s_par_s + b * s_par_b + a
                                    a = Int32(cute.make_tensor(parents + off,
                                                               cute.make_layout(1))[0])
                        z = q_start + a
                        slot = cute.make_tensor(hist + (z * num_steps + depth),
                                                cute.make_layout(1))[0]
        return ok, new, slot, src_lane

    @cute.jit
    def _issue_row(self, stage: Int32, sK: cute.Tensor, key: Int32, sub: Int32,
                   kv: cute.Pointer, k_new: cute.Pointer, s_kv: Int32, s_kin: Int32,
                   num_slots: Int32, ok: Boolean, new: Boolean, slot: Int32,
                   src_lane: Int32):
        """Start the copy of this thread's quarter (``sub``) of key ``key`` of a tile into
        ring stage ``stage``, from where ``_key_source`` says (a slot clamped into the pool:
        no read outside it); a key past the end becomes zeros."""
        row = cute.local_tile(sK[None, None, stage], (1, WIDTH), (key, 0))
        if ok:
            if new:
                self._copy_row(row, k_new + Int64(src_lane) * s_kin, sub)
            else:
                in_pool = Int64(cutlass.min(cutlass.max(slot, 0), num_slots - 1))
                self._copy_row(row, kv + in_pool * s_kv, sub)
        else:
            self._zero_row(row, sub)

    @cute.jit
    def _store_lse(self, mid_lse: cute.Pointer, q_start: Int32, row, group: Int32,
                   s_mlt: Int32, s_mlh: Int32, lse: Float32):
        """``mid_lse[lane, head, group] = lse`` for query row ``row`` (lane ``row // H``)."""
        dst = _head_row(mid_lse, q_start, row, self.heads, s_mlt, s_mlh) + group
        cute.make_tensor(dst, cute.make_layout(1))[0] = lse

    @cute.jit
    def _store_new_keys(self, kv: cute.Pointer, k_new: cute.Pointer, hist: cute.Pointer,
                        lane_lo: Int32, lane_hi: Int32, q_start: Int32, step: Int32,
                        num_steps: Int32, num_slots: Int32, s_kv: Int32, s_kin: Int32):
        """``kv[hist[z, step]] = k_new[z]`` for the lanes ``z = q_start + [lane_lo,
        lane_hi)``, a 16-byte piece per thread (a slot outside the pool is not written)."""
        tidx, _, _ = cute.arch.thread_idx()
        for e in cutlass.range(tidx, (lane_hi - lane_lo) * PIECES, THREADS):
            lane = lane_lo + e // PIECES
            col = (e - (e // PIECES) * PIECES) * 8
            z = q_start + lane
            dst = cute.make_tensor(hist + (z * num_steps + step), cute.make_layout(1))[0]
            if (dst >= 0) & (dst < num_slots):
                g_in = cute.make_ptr(self.dtype, (k_new + (Int64(z) * s_kin + col)).toint(),
                                     cute.AddressSpace.gmem, assumed_align=16)
                g_out = cute.make_ptr(self.dtype, (kv + (Int64(dst) * s_kv + col)).toint(),
                                      cute.AddressSpace.gmem, assumed_align=16)
                cute.autovec_copy(cute.make_tensor(g_in, cute.make_layout(8)),
                                  cute.make_tensor(g_out, cute.make_layout(8)))

    @cute.jit
    def _scaled_score(self, x: Float32, scale_log2: Float32, cap: Float32):
        """Score ``x`` in base 2, the logit cap applied."""
        if cutlass.const_expr(self.use_cap):
            # cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1)
            y = x * (scale_log2 / LOG2E) / cap
            x = cap * (1.0 - 2.0 / (cute.arch.exp2(y * (2.0 * LOG2E)) + 1.0)) * LOG2E
        else:
            x = x * scale_log2
        return x

    @cute.jit
    def _masked_score(self, x: Float32, kc, row_lane, t: Int32, tail, n_lo: Int32,
                      n_pref: Int32, n_hi: Int32, hl: Int32, start: Int32, end: Int32,
                      scale_log2: Float32, cap: Float32):
        """Score ``x`` of key column ``kc`` of tile ``t`` for a row of lane ``row_lane``, in
        base 2 (logit cap applied), or -inf where the row does not see the key (past the
        prefix slice; in the tail, another lane's history or past it)."""
        x = self._scaled_score(x, scale_log2, cap)
        vis = Boolean(False)
        if tail:
            idx = n_lo + (t - n_pref) * KEYS + kc
            vis = (idx < n_hi) & (idx // hl == row_lane)
        else:
            vis = start + t * KEYS + kc < end
        if not vis:
            x = -Float32.inf
        return x

    @cute.jit
    def _softmax_row(self, s_rows: cute.Tensor, r, n_cols, top, row_max: cute.Tensor,
                     row_sum: cute.Tensor, scale=None):
        """The online softmax of this thread's row ``r`` of a tile whose row maximum is
        ``top`` (with the running one): ``s_rows[r, :]`` becomes P, the running maximum and
        sum move on; returns ``(alpha, moved)``, O's rescale factor and whether it is not 1.
        ``scale``: ``s_rows`` holds raw scores, scaled here (one FFMA with the shift)."""
        # Keep the running maximum while the new one exceeds it by at most MAX_SLACK (base
        # 2): P stays below 2^MAX_SLACK, and O and the row sum need no rescale. Exact: both
        # use the same shift.
        if top <= row_max[r] + MAX_SLACK:
            top = row_max[r]
        # A row that has seen no key keeps -inf; shift by 0 so exp2 gives 0, not NaN.
        use = top
        if top == -Float32.inf:
            use = Float32(0.0)
        alpha = cute.arch.exp2(row_max[r] - use)
        moved = top != row_max[r]
        row_max[r] = top
        part = Float32(0.0)
        for c in cutlass.range_constexpr(n_cols):
            if cutlass.const_expr(scale is None):
                p = cute.arch.exp2(s_rows[r, c] - use)
            else:
                p = cute.arch.exp2(s_rows[r, c] * scale - use)
            s_rows[r, c] = p
            part += p
        row_sum[r] = row_sum[r] * alpha + _quad_reduce(part, lambda x, y: x + y)
        return alpha, moved

    @cute.jit
    def _scores_then_softmax(self, acc_s: cute.Tensor, s_rows: cute.Tensor,
                             c_rows: cute.Tensor, o_rows: cute.Tensor, row_max: cute.Tensor,
                             row_sum: cute.Tensor, sStat: cute.Tensor, lead, t: Int32, tail,
                             row_lo: Int32, mask_args: tuple):
        """Warpgroup 0's scores of tile ``t`` (base 2; masked only where the tile is not
        wholly inside the slice: the visibility test costs about 480 SASS instructions a
        tile) and the online softmax of its rows, their O rescale factors into ``sStat[:, 0]``."""
        n_lo, n_pref, n_hi, hl, start, end, scale_log2, cap = mask_args
        interior = (t < n_pref) & (start + t * KEYS + KEYS <= end)
        if cutlass.const_expr(not self.use_cap):
            if interior:  # raw scores: the scale is folded into the exponent
                self._softmax_rows(s_rows, c_rows, o_rows, row_max, row_sum, sStat, lead,
                                   scale_log2)
            else:
                self._mask_rows(s_rows, c_rows, t, tail, row_lo, mask_args)
                self._softmax_rows(s_rows, c_rows, o_rows, row_max, row_sum, sStat, lead)
        else:
            self._scale_or_mask(acc_s, s_rows, c_rows, interior, t, tail, row_lo, mask_args)
            self._softmax_rows(s_rows, c_rows, o_rows, row_max, row_sum, sStat, lead)

    @cute.jit
    def _scale_or_mask(self, acc_s: cute.Tensor, s_rows: cute.Tensor, c_rows: cute.Tensor,
                       interior, t: Int32, tail, row_lo: Int32, mask_args: tuple):
        """Scores in base 2: scaled only (``interior``) or scaled and masked."""
        scale_log2, cap = mask_args[6], mask_args[7]
        if interior:
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = self._scaled_score(acc_s[i], scale_log2, cap)
        else:
            self._mask_rows(s_rows, c_rows, t, tail, row_lo, mask_args)

    @cute.jit
    def _mask_rows(self, s_rows: cute.Tensor, c_rows: cute.Tensor, t: Int32, tail,
                   row_lo: Int32, mask_args: tuple):
        """Scores in base 2, -inf where a row does not see the key (``_masked_score``)."""
        for r in cutlass.range_constexpr(cute.size(c_rows, mode=[0])):
            row_lane = (row_lo + c_rows[r, 0][0]) // self.heads
            for c in cutlass.range_constexpr(cute.size(c_rows, mode=[1])):
                s_rows[r, c] = self._masked_score(s_rows[r, c], c_rows[r, c][1], row_lane, t,
                                                  tail, *mask_args)

    @cute.jit
    def _softmax_rows(self, s_rows: cute.Tensor, c_rows: cute.Tensor, o_rows: cute.Tensor,
                      row_max: cute.Tensor, row_sum: cute.Tensor, sStat: cute.Tensor, lead,
                      scale=None):
        """The online softmax of this thread's rows of the tile (``scale``: the scores are
        raw, ``_softmax_row``); each row's O rescale factor into ``sStat[:, 0]``."""
        n_cols = cute.size(c_rows, mode=[1])
        for r in cutlass.range_constexpr(cute.size(c_rows, mode=[0])):
            m = c_rows[r, 0][0]
            top = -Float32.inf
            for c in cutlass.range_constexpr(n_cols):
                top = cute.arch.fmax(top, s_rows[r, c])
            if cutlass.const_expr(scale is None):
                top = cute.arch.fmax(row_max[r], _quad_reduce(top, cute.arch.fmax))
            else:
                top = cute.arch.fmax(row_max[r], _quad_reduce(top, cute.arch.fmax) * scale)
            alpha, moved = self._softmax_row(s_rows, r, n_cols, top, row_max, row_sum, scale)
            if lead:
                sStat[m, 0] = alpha
            self._rescale_row(o_rows, r, alpha, moved)

    @cute.jit
    def _tile_p(self, mma_s, thr_s, frag_q: cute.Tensor, tile: cute.Tensor,
                c_rows: cute.Tensor, o_rows: cute.Tensor, row_max: cute.Tensor,
                row_sum: cute.Tensor, sStat: cute.Tensor, lead, t: Int32, tail, row_lo: Int32,
                mask_args: tuple, p_dst):
        """Warpgroup 0 on key tile ``t``: S (wgmma N 64), the scores and softmax
        (``_scores_then_softmax``), and P into ``sP`` by ``stmatrix`` (``p_dst``: the copy
        and its partition of ``sP``)."""
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((ROWS, KEYS)), Float32)
        frag_k = thr_s.make_fragment_B(thr_s.partition_B(tile))
        _wgmma(mma_s, acc_s, frag_q, frag_k, True)
        s_rows = cute.make_tensor(acc_s.iterator, _acc_rows(acc_s.layout))
        self._scores_then_softmax(acc_s, s_rows, c_rows, o_rows, row_max, row_sum, sStat,
                                  lead, t, tail, row_lo, mask_args)
        p_copy, p_smem = p_dst
        p_vals = cute.make_rmem_tensor_like(acc_s, self.dtype)
        p_vals.store(acc_s.load().to(self.dtype))
        cute.copy(p_copy, p_copy.retile(p_vals), p_smem)

    @cute.jit
    def _small_tail_p(self, small: tuple, tile: cute.Tensor, o_rows: cute.Tensor,
                      row_max: cute.Tensor, row_sum: cute.Tensor, sStat: cute.Tensor, lead,
                      t: Int32, row_lo: Int32, mask_args: tuple):
        """Warpgroup 0 on a tail of at most ``SMALL_KEYS`` keys: S over the tile's
        first keys at wgmma N 16, masked, the softmax, and P into ``sP``'s first columns."""
        mma_s16, thr_s16, frag_q16, c_rows16, p_dst16 = small
        acc = cute.make_rmem_tensor(thr_s16.partition_shape_C((ROWS, SMALL_KEYS)), Float32)
        frag_k = thr_s16.make_fragment_B(thr_s16.partition_B(
            cute.local_tile(tile, (SMALL_KEYS, WIDTH), (0, 0))))
        _wgmma(mma_s16, acc, frag_q16, frag_k, True)
        s_rows = cute.make_tensor(acc.iterator, _acc_rows(acc.layout))
        self._mask_rows(s_rows, c_rows16, t, True, row_lo, mask_args)
        self._softmax_rows(s_rows, c_rows16, o_rows, row_max, row_sum, sStat, lead)
        for i in cutlass.range_constexpr(cute.size(acc)):
            p_dst16[i] = acc[i].to(self.dtype)

    @cute.jit
    def _rescale_row(self, o_rows: cute.Tensor, r, alpha, moved):
        """O's row ``r`` (this thread's columns) times ``alpha``, if ``moved`` (its maximum
        moved)."""
        if moved:
            for c in cutlass.range_constexpr(cute.size(o_rows, mode=[1])):
                o_rows[r, c] = o_rows[r, c] * alpha

    @cute.jit
    def _merge_row(self, lses: list, parts: list, row, to_mid: cutlass.Constexpr[bool],
                   out: cute.Pointer, mid_o: cute.Pointer, mid_lse: cute.Pointer,
                   q_start: Int32, group: Int32, chunk: Int32, s_ot: Int32, s_oh: Int32,
                   s_mot: Int32, s_moh: Int32, s_mop: Int32, s_mlt: Int32, s_mlh: Int32):
        """Columns ``[4 chunk, 4 chunk + 4)`` of query row ``row``, merged from the cluster's
        partials (``lses``: their natural-log LSEs, ``parts``: their 4 values each) into
        the output or, ``to_mid``, into this group's partial (and its LSE, by chunk 0)."""
        top = lses[0]
        for c in cutlass.range_constexpr(1, len(lses)):
            top = cute.arch.fmax(top, lses[c])
        if top == -Float32.inf:
            top = Float32(0.0)
        acc = [Float32(0.0)] * 4
        wsum = Float32(0.0)
        for c in cutlass.range_constexpr(len(lses)):
            w = cute.arch.exp2((lses[c] - top) * LOG2E)
            wsum += w
            for j in cutlass.range_constexpr(4):
                acc[j] = acc[j] + w * parts[c][j]
        inv = Float32(0.0)
        if wsum > 0.0:
            inv = 1.0 / wsum
        if cutlass.const_expr(to_mid):
            dst = _head_row(mid_o, q_start, row, self.heads, s_mot, s_moh) + (
                group * s_mop + chunk * 4)
            self._store4(dst, Float32, [acc[j] * inv for j in range(4)], 16)
            if chunk == 0:
                lse = -Float32.inf
                if wsum > 0.0:
                    lse = top + cute.math.log2(wsum) * LN2
                self._store_lse(mid_lse, q_start, row, group, s_mlt, s_mlh, lse)
        else:
            dst = _head_row(out, q_start, row, self.heads, s_ot, s_oh) + chunk * 4
            self._store4(dst, self.dtype, [(acc[j] * inv).to(self.dtype) for j in range(4)], 8)

    @cute.jit
    def _store4(self, dst: cute.Pointer, dtype, values: list, align: cutlass.Constexpr[int]):
        """``values`` (4) to global ``dst``, aligned to ``align`` bytes, as one store."""
        vals = cute.make_rmem_tensor(4, dtype)
        for j in cutlass.range_constexpr(4):
            vals[j] = values[j]
        g = cute.make_ptr(dtype, dst.toint(), cute.AddressSpace.gmem, assumed_align=align)
        cute.autovec_copy(vals, cute.make_tensor(g, cute.make_layout(4)))

    # -- the kernel -----------------------------------------------------------------------

    @cute.kernel
    def kernel(self, q: cute.Pointer, kv: cute.Pointer, k_new: cute.Pointer,
               out: cute.Pointer, mid_o: cute.Pointer, mid_lse: cute.Pointer,
               r2t: cute.Pointer, meta: cute.Pointer, hist: cute.Pointer,
               parents: cute.Pointer, step: Int32, topk: Int32, num_steps: Int32,
               num_slots: Int32, s_qt: Int32, s_qh: Int32, s_kv: Int32, s_kin: Int32,
               s_ot: Int32, s_oh: Int32, s_mot: Int32, s_moh: Int32, s_mop: Int32,
               s_mlt: Int32, s_mlh: Int32, s_r2t: Int32, s_par_s: Int32, s_par_b: Int32,
               scale_log2: Float32, cap: Float32):
        """Grid ``(splits, row tiles, B)``, cluster ``(cluster, 1, 1)``: CTA ``split`` of
        request ``b``'s row tile walks its prefix slice (the last split also the tail); each
        cluster merges its CTAs' partials on chip into the output or, with several groups,
        into partial ``split // cluster`` of ``mid_o`` / ``mid_lse``."""
        dt = self.dtype
        H = self.heads
        tidx, _, _ = cute.arch.thread_idx()
        split, rt, b = cute.arch.block_idx()
        rank = split % self.cluster  # the CTA's rank in its cluster
        group = split // self.cluster
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wtid = tidx % 128
        sub = tidx % 4  # the quarter of a key (or query) row this thread gathers

        m_row = cute.make_tensor(meta + b * META_W, cute.make_layout(META_W))
        rpi = Int64(m_row[0])
        prefix_len = m_row[1]
        split_len = m_row[2]
        q_start = b * topk
        n_rows = topk * H
        row_lo = rt * ROWS
        hl = step + 1
        lane_lo = row_lo // H
        lane_hi = cutlass.min(topk, (row_lo + ROWS + H - 1) // H)
        start = split * split_len
        end = cutlass.min(prefix_len, start + split_len)
        n_pref = (cutlass.max(end - start, 0) + KEYS - 1) // KEYS
        n_lo = lane_lo * hl
        n_hi = n_lo
        if split == self.splits - 1:
            n_hi = lane_hi * hl
        total = n_pref + (n_hi - n_lo + KEYS - 1) // KEYS
        r2t_row = r2t + rpi * s_r2t
        walk = functools.partial(self._tail_first, n_pref, total)

        # Shared memory.
        alloc = SmemAllocator()
        lay_q = _swizzled(dt, ROWS, WIDTH)
        lay_ring = _swizzled(dt, KEYS, WIDTH, self.stages)
        lay_p = _swizzled(dt, ROWS, KEYS)
        sQ = alloc.allocate_tensor(dt, lay_q.outer, 1024, swizzle=lay_q.inner)
        ring = alloc.allocate(TILE_BYTES * self.stages, 1024)
        sK = cute.make_tensor(cute.recast_ptr(ring, lay_ring.inner, dtype=dt), lay_ring.outer)
        sP = alloc.allocate_tensor(dt, lay_p.outer, 1024, swizzle=lay_p.inner)
        sStat = alloc.allocate_tensor(Float32, cute.make_layout((ROWS, 4)), 16)
        sLse = alloc.allocate_tensor(Float32, cute.make_layout(ROWS), 16)

        # Warpgroup 1 alone gathers Q (row m: lane m // H, head m % H, with tile 0's copy
        # group) and the key tiles, a tile ahead: thread wtid copies quarter ``sub`` of keys
        # ``key_a`` and ``key_a + 32``.
        key_a = wtid // 4
        key_b = key_a + 32
        args_a = (key_a, r2t_row, hist, parents, n_pref, start, end, n_lo, n_hi, hl,
                  q_start, b, step, num_steps, num_slots, s_par_s, s_par_b, total)
        args_b = (key_b,) + args_a[1:]
        ok_a, new_a, slot_a, lane_a = Boolean(False), Boolean(False), Int32(0), Int32(0)
        ok_b, new_b, slot_b, lane_b = Boolean(False), Boolean(False), Int32(0), Int32(0)
        if wg == 1:
            for kq in (key_a, key_b):
                q_dst = cute.local_tile(sQ, (1, WIDTH), (kq, 0))
                if row_lo + kq < n_rows:
                    self._copy_row(q_dst, _head_row(q, q_start, row_lo + kq, H, s_qt,
                                                    s_qh), sub)
                else:
                    self._zero_row(q_dst, sub)
            ok_a, new_a, slot_a, lane_a = self._key_source(walk(Int32(0)), *args_a)
            ok_b, new_b, slot_b, lane_b = self._key_source(walk(Int32(0)), *args_b)
            self._issue_row(Int32(0), sK, key_a, sub, kv, k_new, s_kv, s_kin, num_slots,
                            ok_a, new_a, slot_a, lane_a)
            self._issue_row(Int32(0), sK, key_b, sub, kv, k_new, s_kv, s_kin, num_slots,
                            ok_b, new_b, slot_b, lane_b)
            cute.arch.cp_async_commit_group()
            ok_a, new_a, slot_a, lane_a = self._key_source(walk(Int32(1)), *args_a)
            ok_b, new_b, slot_b, lane_b = self._key_source(walk(Int32(1)), *args_b)
        # The CTA holding the request's first keys stores this call's keys into the pool, at
        # hist[lane, step].
        if split == 0:
            self._store_new_keys(kv, k_new, hist, lane_lo, lane_hi, q_start, step, num_steps,
                                 num_slots, s_kv, s_kin)

        # Warpgroup 0: S over the whole tile (wgmma N 64: Q and the tile read from shared
        # memory once) and the softmax over whole rows. Both: output columns [256 wg, +256).
        mma_s = hopper.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K,
                                              Float32, (1, 1, 1), (ROWS, KEYS))
        mma_o = hopper.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.MN,
                                              Float32, (1, 1, 1), (ROWS, V_HALF))
        thr_s = mma_s.get_slice(wtid)
        thr_o = mma_o.get_slice(wtid)
        frag_q = thr_s.make_fragment_A(thr_s.partition_A(sQ))
        frag_p = thr_o.make_fragment_A(thr_o.partition_A(sP))
        acc_o = cute.make_rmem_tensor(thr_o.partition_shape_C((ROWS, V_HALF)), Float32)
        acc_o.fill(0.0)
        o_rows = cute.make_tensor(acc_o.iterator, _acc_rows(acc_o.layout))
        # (row, column) of each of this thread's S elements (its rows are its O rows in
        # either warpgroup), and its P destination (stmatrix: 4 instructions a tile).
        c_s = thr_s.partition_C(cute.make_identity_tensor((ROWS, KEYS)))
        c_rows = cute.make_tensor(c_s.iterator, _acc_rows(c_s.layout))
        p_copy = cute.make_tiled_copy_C(cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dt),
            mma_s).get_slice(wtid)
        p_smem = p_copy.partition_D(sP)
        # A small tail (at most SMALL_KEYS keys): S at wgmma N 16 over the tile's first keys
        # and P.V over its first k block, a quarter of a tile's MMAs and softmax.
        mma_s16 = hopper.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K,
                                                Float32, (1, 1, 1), (ROWS, SMALL_KEYS))
        thr_s16 = mma_s16.get_slice(wtid)
        c_s16 = thr_s16.partition_C(cute.make_identity_tensor((ROWS, SMALL_KEYS)))
        small = (mma_s16, thr_s16, thr_s16.make_fragment_A(thr_s16.partition_A(sQ)),
                 cute.make_tensor(c_s16.iterator, _acc_rows(c_s16.layout)),
                 thr_s16.partition_C(cute.local_tile(sP, (ROWS, SMALL_KEYS), (0, 0))))
        small_tail = n_hi - n_lo <= SMALL_KEYS
        n_my_rows = cute.size(c_rows, mode=[0])
        row_max = cute.make_rmem_tensor(n_my_rows, Float32)
        row_sum = cute.make_rmem_tensor(n_my_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        lead = wtid % 4 == 0  # one thread of a quad writes a row's statistics
        mask_args = (n_lo, n_pref, n_hi, hl, start, end, scale_log2, cap)

        for t in cutlass.range(total):
            stage = t % self.stages
            tile = sK[None, None, stage]
            tt = walk(t)  # the key tile this step walks
            tail = tt >= n_pref
            if wg == 1:  # tile t has landed (this thread's copies), cleaned if a tail
                cute.arch.cp_async_wait_group(0)
                if tail:
                    for kq in (key_a, key_b):
                        self._finite_row(cute.local_tile(tile, (1, WIDTH), (kq, 0)), sub)
                cute.arch.fence_proxy("async.shared", space="cta")
            # Tile t visible to all; both warpgroups done with tile t - 1, sP, sStat.
            cute.arch.barrier()
            if wg == 1:
                nxt = (t + 1) % self.stages
                self._issue_row(nxt, sK, key_a, sub, kv, k_new, s_kv, s_kin, num_slots,
                                ok_a, new_a, slot_a, lane_a)
                self._issue_row(nxt, sK, key_b, sub, kv, k_new, s_kv, s_kin, num_slots,
                                ok_b, new_b, slot_b, lane_b)
                cute.arch.cp_async_commit_group()
                ok_a, new_a, slot_a, lane_a = self._key_source(walk(t + 2), *args_a)
                ok_b, new_b, slot_b, lane_b = self._key_source(walk(t + 2), *args_b)
            else:
                full = (mma_s, thr_s, frag_q, tile, c_rows, o_rows, row_max, row_sum, sStat,
                        lead, tt, tail, row_lo, mask_args)
                if tail & small_tail:
                    self._small_tail_p(small, tile, o_rows, row_max, row_sum, sStat, lead, tt,
                                       row_lo, mask_args)
                else:
                    self._tile_p(*full, (p_copy, p_smem))
                cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier()  # P(t) and the rescale factors visible
            if wg == 1:
                for r in cutlass.range_constexpr(n_my_rows):
                    alpha = sStat[c_rows[r, 0][0], 0]
                    self._rescale_row(o_rows, r, alpha, alpha != Float32(1.0))
            v_t = cute.make_tensor(tile.iterator, cute.select(tile.layout, mode=[1, 0]))
            frag_v = thr_o.make_fragment_B(thr_o.partition_B(
                cute.local_tile(v_t, (V_HALF, KEYS), (wg, 0))))
            if tail & small_tail:
                _wgmma(mma_o, acc_o, frag_p, frag_v, False, k_blocks=1)
            else:
                _wgmma(mma_o, acc_o, frag_p, frag_v, False)

        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        # Row sums: warpgroup 0's into column 2; warpgroup 1 keeps no statistics (its
        # row_sum stays 0) and writes that 0 into column 3.
        for r in cutlass.range_constexpr(n_my_rows):
            if lead:
                sStat[c_rows[r, 0][0], 2 + wg] = row_sum[r]
        cute.arch.barrier()
        # Normalised partial and LSE into this CTA's shared memory (the ring is free).
        sO = cute.make_tensor(cute.recast_ptr(ring, dtype=Float32),
                              cute.make_layout((ROWS, D_MAIN), stride=(O_PITCH, 1)))
        for r in cutlass.range_constexpr(n_my_rows):
            m = c_rows[r, 0][0]
            total_sum, inv = _row_sum_and_inverse(sStat, m)
            for c in cutlass.range_constexpr(cute.size(o_rows, mode=[1])):
                o_rows[r, c] = o_rows[r, c] * inv
            if lead & (wg == 0):
                sLse[m] = _partial_lse(row_max[r], total_sum)
        # Column pairs: 8-byte stores.
        o_copy = cute.make_tiled_copy_C(cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64),
            mma_o).get_slice(wtid)
        cute.copy(o_copy, o_copy.retile(acc_o), o_copy.partition_D(
            cute.local_tile(sO, (ROWS, V_HALF), (0, wg))))
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        # CTA ``rank`` merges rows rank, rank + cluster, ...; a thread takes 4 columns,
        # merged into the output or (several groups) into this group's partial.
        to_mid = self.groups > 1
        C = self.cluster
        chunk = tidx % (D_MAIN // 4)
        half = tidx // (D_MAIN // 4)
        dst = (out, mid_o, mid_lse, q_start, group, chunk, s_ot, s_oh, s_mot, s_moh,
               s_mop, s_mlt, s_mlh)
        n_iter = (ROWS + 2 * C - 1) // (2 * C)
        # Loads of MERGE_BATCH rows' partials issued together: one distributed shared
        # memory round trip per batch instead of one per row.
        for k0 in cutlass.range_constexpr(0, n_iter, MERGE_BATCH):
            ks = range(k0, min(k0 + MERGE_BATCH, n_iter))
            rows = [rank + C * (2 * k + half) for k in ks]
            # Past the tile's last row: load row 0 (in bounds), store nothing.
            at = [cutlass.min(m, ROWS - 1) for m in rows]
            lses = [[_ld_cluster_f32(cute.arch.map_dsmem_ptr(sLse.iterator + a, c))
                     for c in range(C)] for a in at]
            parts = [[_ld_cluster_v4(cute.arch.map_dsmem_ptr(
                sO.iterator + (a * O_PITCH + chunk * 4), c)) for c in range(C)]
                for a in at]
            for i in cutlass.range_constexpr(len(rows)):
                if (rows[i] < ROWS) & (row_lo + rows[i] < n_rows):
                    self._merge_row(lses[i], parts[i], row_lo + rows[i], to_mid, *dst)
        cute.arch.cluster_arrive()  # the others may still read this CTA's partial
        cute.arch.cluster_wait()
