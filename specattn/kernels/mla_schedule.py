"""FlashInfer's MLA split schedule of a CUDA-graph round, as a Triton device function.

Shapes: a round of ``bs`` requests, request ``b`` with ``q_b`` query rows (``q_b * heads``
packed rows) and ``n_b`` keys from ``kv0_b`` in the round's slot list; the schedule goes into
the MLA wrapper's int workspace (``Work``, int32 elements) at the offsets of the capture's
``plan_info``, as FlashInfer 0.7.4's ``MLAPlan`` (``include/flashinfer/attention/
scheduler.cuh``) lays it out: per work item ``q_indptr``, ``kv_indptr``, ``partial_indptr``,
``q_len``, ``kv_len``, ``q_start``, ``kv_start``, ``kv_end``; per cluster ``work_indptr
[clusters + 1]``; per CTA the merge ranges (``merge_packed_offset_start/end``,
``merge_partial_packed_offset_start/end``, ``merge_partial_stride``, zero past the last).

What it computes, as FlashInfer's planner does: a request's packed query rows in tiles of
``cluster * 64`` rows, the last tile first; a tile's keys (a causal tile's up to its last row,
FlashInfer's ``packed_causal_kv_end``) cut into chunks of the round's ``kv_len_limit`` (the
keys per cluster, rounded up as FlashInfer rounds it); a split tile's chunks write consecutive
partial rows and get ``max(keys * cluster // limit, 1)`` merge CTAs, in tile order. Two
choices differ and are FlashInfer's to make freely, since its kernel reads only the work
lists: the cluster of a chunk (FlashInfer pops the least loaded cluster from a heap; here the
full chunks go round-robin first, then each tile's last, shorter chunk round-robin onto the
clusters after them, which is as balanced: every full chunk is ``limit`` keys), and the
cluster size, which is the capture's (the graph replays the capture's grid, whose ``gridDim.x
* 64`` the kernel takes as the tile; FlashInfer's own replan picks it again from the round's
mean query rows and a round that crossed 64 rows would replay a grid of the other size).

Why on the device: the slot-list launch that calls it (``prefix_slots``) has the round's
lengths, and FlashInfer's MLA planner is host code an engine runs before every replay.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["MAX_WORKS", "mla_schedule"]

MAX_WORKS = 16384  # FlashInfer's work-list capacity (max_total_num_works)


@triton.jit
def _tile_keys(q_len, kv_len, tile, tiles, TILE: tl.constexpr, heads, CAUSAL: tl.constexpr):
    """Keys a query tile sees: all, or (causal) up to its last packed row (FlashInfer's
    ``packed_causal_kv_end``)."""
    keys = kv_len
    if CAUSAL:
        seen = kv_len - q_len + ((tile + 1) * TILE + heads - 1) // heads
        seen = tl.maximum(tl.minimum(seen, kv_len), 0)
        keys = tl.where(tile + 1 == tiles, kv_len, seen)
    return keys


@triton.jit
def _merge_ctas(keys, rows, limit, CLUSTER: tl.constexpr):
    """``(rows per merge CTA, merge CTAs)`` of a split tile: FlashInfer's ``max(keys *
    cluster // limit, 1)`` groups of its rows, rounded up."""
    groups = tl.maximum(keys * CLUSTER // limit, 1)
    row_chunk = tl.maximum((rows + groups - 1) // groups, 1)
    return row_chunk, (rows + row_chunk - 1) // row_chunk


@triton.jit
def mla_schedule(b, bs, raw, Lens, stride_lens, Ext, stride_ext, fill, qrows, kv0, Work,
                 heads, clusters, ctas, o_q_indptr, o_kv_indptr, o_partial, o_m_start, o_m_end,
                 o_mp_start, o_mp_end, o_m_stride, o_q_len, o_kv_len, o_q_start, o_kv_start,
                 o_kv_end, o_work_indptr,
                 CLUSTER: tl.constexpr, CAUSAL: tl.constexpr, QO: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_M: tl.constexpr, MAX_WORKS: tl.constexpr):
    """Request ``b``'s work items and merge CTAs (``BLOCK_B >= bs``: every program sums the
    round at once); request 0 also the clusters' ``work_indptr`` and the unused merge CTAs'
    zeros. Request ``r``: ``Ext[r]`` query rows (QO; else ``qrows``) and ``Lens[r]`` keys
    from ``kv0`` on (padding ``r >= raw``: ``fill`` keys, and no rows with QO)."""
    TILE: tl.constexpr = CLUSTER * 64
    kv0 = kv0.to(tl.int32)
    r = tl.arange(0, BLOCK_B)
    live = r < bs
    real = r < raw
    kv_len = tl.load(Lens + r * stride_lens, mask=real, other=0).to(tl.int32)
    kv_len = tl.where(real, kv_len, tl.where(live, fill, 0))
    if QO:
        q_len = tl.load(Ext + r * stride_ext, mask=real, other=0).to(tl.int32)
    else:
        q_len = tl.where(live, qrows, 0)
    qo0 = tl.cumsum(q_len, 0) - q_len
    tiles = (q_len * heads + TILE - 1) // TILE
    max_tiles = tl.max(tiles, 0)

    # The round's keys, over every tile (the last tile of a sequence first: p = 0).
    total = tl.zeros([BLOCK_B], dtype=tl.int64)
    for p in range(0, max_tiles):
        tile = tiles - 1 - p
        keys = _tile_keys(q_len, kv_len, tile, tiles, TILE, heads, CAUSAL)
        total += tl.where(p < tiles, keys, 0).to(tl.int64)
    per_cluster = tl.maximum((tl.sum(total) + clusters - 1) // clusters, 1)
    limit = tl.where(per_cluster <= 8, 32, tl.where(per_cluster <= 16, 64, tl.where(
        per_cluster <= 32, 128, tl.where(per_cluster <= 64, 192,
                                         (per_cluster + 255) // 256 * 256)))).to(tl.int32)

    # Per sequence: full chunks, partial rows and merge CTAs of its tiles.
    fulls = tl.zeros([BLOCK_B], dtype=tl.int32)
    parts = tl.zeros([BLOCK_B], dtype=tl.int32)
    merges = tl.zeros([BLOCK_B], dtype=tl.int32)
    for p in range(0, max_tiles):
        tile = tiles - 1 - p
        keys = _tile_keys(q_len, kv_len, tile, tiles, TILE, heads, CAUSAL)
        n = tl.maximum((keys + limit - 1) // limit, 1)
        rows = tl.minimum(TILE, q_len * heads - tile * TILE)
        split = (p < tiles) & (keys > limit)
        _, ctas_of_tile = _merge_ctas(keys, rows, limit, CLUSTER)
        fulls += tl.where(p < tiles, n - 1, 0)
        parts += tl.where(split, n * rows, 0)
        merges += tl.where(split, ctas_of_tile, 0)
    num_fulls = tl.sum(fulls)
    num_works = num_fulls + tl.sum(tiles)
    per, extra = num_works // clusters, num_works % clusters

    if b == 0:
        c = tl.arange(0, BLOCK_N)
        tl.store(Work + o_work_indptr + c, c * per + tl.minimum(c, extra), mask=c <= clusters)
        m = tl.arange(0, BLOCK_N)
        unused = (m >= tl.sum(merges)) & (m < ctas)
        zero = tl.zeros([BLOCK_N], dtype=tl.int32)
        tl.store(Work + o_m_start + m, zero, mask=unused)
        tl.store(Work + o_m_end + m, zero, mask=unused)
        tl.store(Work + o_mp_start + m, zero, mask=unused)
        tl.store(Work + o_mp_end + m, zero, mask=unused)
        tl.store(Work + o_m_stride + m, zero, mask=unused)

    mine = r == b
    full_at = tl.sum(tl.where(mine, tl.cumsum(fulls, 0) - fulls, 0))
    tail_at = num_fulls + tl.sum(tl.where(mine, tl.cumsum(tiles, 0) - tiles, 0))
    part_at = tl.sum(tl.where(mine, tl.cumsum(parts, 0) - parts, 0))
    merge_at = tl.sum(tl.where(mine, tl.cumsum(merges, 0) - merges, 0))
    q0 = tl.sum(tl.where(mine, qo0, 0))
    ql = tl.sum(tl.where(mine, q_len, 0))
    kl = tl.sum(tl.where(mine, kv_len, 0))
    my_tiles = (ql * heads + TILE - 1) // TILE
    j = tl.arange(0, BLOCK_C)
    mj = tl.arange(0, BLOCK_M)
    for p in range(0, my_tiles):
        tile = my_tiles - 1 - p
        keys = _tile_keys(ql, kl, tile, my_tiles, TILE, heads, CAUSAL)
        n = tl.maximum((keys + limit - 1) // limit, 1)
        rows = tl.minimum(TILE, ql * heads - tile * TILE)
        split = keys > limit
        for j0 in range(0, n, BLOCK_C):
            k = j0 + j
            ok = k < n
            order = tl.where(k == n - 1, tail_at, full_at + k)
            cluster = order % clusters
            w = cluster * per + tl.minimum(cluster, extra) + order // clusters
            ok = ok & (w < MAX_WORKS)
            start = k * limit
            tl.store(Work + o_q_indptr + w, q0 + tl.zeros_like(k), mask=ok)
            tl.store(Work + o_kv_indptr + w, kv0 + tl.zeros_like(k), mask=ok)
            tl.store(Work + o_partial + w, tl.where(split, part_at + k * rows, -1), mask=ok)
            tl.store(Work + o_q_len + w, ql + tl.zeros_like(k), mask=ok)
            tl.store(Work + o_kv_len + w, kl + tl.zeros_like(k), mask=ok)
            tl.store(Work + o_q_start + w, tile * TILE + tl.zeros_like(k), mask=ok)
            tl.store(Work + o_kv_start + w, start, mask=ok)
            tl.store(Work + o_kv_end + w, tl.minimum(start + limit, keys), mask=ok)
        if split:
            row_chunk, ctas_of_tile = _merge_ctas(keys, rows, limit, CLUSTER)
            first = mj * row_chunk
            ok = (first < rows) & (merge_at + mj < ctas)
            at = merge_at + mj
            packed = q0 * heads + tile * TILE
            tl.store(Work + o_m_start + at, packed + first, mask=ok)
            tl.store(Work + o_m_end + at, packed + tl.minimum(first + row_chunk, rows), mask=ok)
            tl.store(Work + o_mp_start + at, part_at + first, mask=ok)
            tl.store(Work + o_mp_end + at, part_at + n * rows + tl.zeros_like(mj), mask=ok)
            tl.store(Work + o_m_stride + at, rows + tl.zeros_like(mj), mask=ok)
            merge_at += ctas_of_tile
            part_at += n * rows
        full_at += n - 1
        tail_at += 1
