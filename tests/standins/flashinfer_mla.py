"""FlashInfer 0.7.4's MLA schedule in pure Python: the native planner's layout and a run that
executes a schedule the way its kernel reads one.

``mla_plan``: ``MLAPlan`` (``include/flashinfer/attention/scheduler.cuh``) step by step, a
cluster of 1 or 2 CTAs of 64 packed query rows (``q_len * heads``) by the mean, query tiles
of a sequence last first, their keys (causal: up to the tile's last row) cut into chunks of
``kv_len_limit`` and given to the least loaded cluster (a heap), the split tiles' partial rows
and merge CTAs; the arrays at the int workspace offsets of 0.7.4's ``AlignedAllocator``, and
the 18 values of ``plan_info``. ``SMS`` stands for the GPU's SM count (small: a schedule of
a few clusters).

``run_schedule``: what the kernel does with a schedule it is given: each cluster's work items
(their rows ``q_start .. + 64 * cluster`` of the sequence's packed rows, their keys
``kv_start .. kv_end``), written to the output or to partial rows, then every CTA's merge
range. Nothing else is read, so a schedule that misses or repeats keys, or whose grid is not
the plan's, gives another output.
"""

from __future__ import annotations

import heapq
import math

import torch

SMS = 6
MAX_WORKS = 16384
_TILE = 64

# The int32 arrays in allocation order, and how many entries each holds (``ctas``: one per SM).
ARRAYS = ("q_indptr", "kv_indptr", "partial_indptr", "merge_packed_offset_start",
          "merge_packed_offset_end", "merge_partial_packed_offset_start",
          "merge_partial_packed_offset_end", "merge_partial_stride", "q_len", "kv_len",
          "q_start", "kv_start", "kv_end", "work_indptr")
_PER_CTA = {"merge_packed_offset_start", "merge_packed_offset_end",
            "merge_partial_packed_offset_start", "merge_partial_packed_offset_end",
            "merge_partial_stride"}


def _cdiv(a, b):
    return -(-a // b)


def tile_keys(q_len, kv_len, tile, tiles, cluster_tile, heads, causal):
    """``packed_causal_kv_end``: the keys a query tile sees."""
    if not causal or tile + 1 == tiles:
        return kv_len
    return max(min(kv_len - q_len + _cdiv((tile + 1) * cluster_tile, heads), kv_len), 0)


def kv_len_limit(total, clusters):
    x = max(_cdiv(total, clusters), 1)
    for bound, limit in ((8, 32), (16, 64), (32, 128), (64, 192)):
        if x <= bound:
            return limit
    return _cdiv(x, 256) * 256


def offsets(sms=SMS):
    """Byte offsets of ``ARRAYS`` in the int workspace, and the bytes allocated."""
    at, out = 0, {}
    for name in ARRAYS:
        out[name] = at
        at += _cdiv(4 * (sms if name in _PER_CTA else MAX_WORKS), 16) * 16
    return out, at


def mla_plan(qo, kv, lens, heads, causal, sms=SMS):
    """``(plan_info [18], {array: list of int})`` of a batch (host lists)."""
    bs = len(lens)
    q_lens = [qo[i + 1] - qo[i] for i in range(bs)]
    cluster = 2 if sum(q * heads for q in q_lens) // bs > 64 else 1
    clusters, tile = sms // cluster, cluster * _TILE
    items = []  # (sequence, tile, keys), in the planner's order
    for i in range(bs):
        tiles = _cdiv(q_lens[i] * heads, tile)
        for t in range(tiles - 1, -1, -1):
            items.append((i, t, tile_keys(q_lens[i], lens[i], t, tiles, tile, heads, causal)))
    limit = kv_len_limit(sum(k for *_, k in items), clusters)
    heap = [(0.0, c) for c in range(clusters)]
    works = [[] for _ in range(clusters)]
    merges = {n: [0] * sms for n in ARRAYS if n in _PER_CTA}
    merge_at = partial_nnz = 0
    for i, t, keys in items:
        rows = min(tile, q_lens[i] * heads - t * tile)
        split = keys > limit
        if split:
            chunk = _cdiv(rows, max(keys * cluster // limit, 1))
            for first in range(0, rows, chunk):
                base = qo[i] * heads + t * tile
                merges["merge_packed_offset_start"][merge_at] = base + first
                merges["merge_packed_offset_end"][merge_at] = base + min(first + chunk, rows)
                merges["merge_partial_packed_offset_start"][merge_at] = partial_nnz + first
                merges["merge_partial_packed_offset_end"][merge_at] = \
                    partial_nnz + _cdiv(keys, limit) * rows
                merges["merge_partial_stride"][merge_at] = rows
                merge_at += 1
        start, left = 0, keys
        while True:
            cost, c = heapq.heappop(heap)
            n = min(left, limit)
            heapq.heappush(heap, (cost + 2 * tile + n, c))
            works[c].append((qo[i], kv[i], partial_nnz if split else -1, q_lens[i], lens[i],
                             t * tile, start, start + n))
            if split:
                partial_nnz += rows
            start, left = start + n, left - n
            if left <= 0:
                break
    assert merge_at <= sms
    flat = [w for ws in works for w in ws]
    arrays = {name: [w[j] for w in flat] for j, name in enumerate(
        ("q_indptr", "kv_indptr", "partial_indptr", "q_len", "kv_len", "q_start", "kv_start",
         "kv_end"))}
    arrays.update(merges)
    arrays["work_indptr"] = [0]
    for ws in works:
        arrays["work_indptr"].append(arrays["work_indptr"][-1] + len(ws))
    at, _ = offsets(sms)
    plan_info = [cluster, clusters] + [at[n] for n in ARRAYS] + [0, 0]
    return plan_info, arrays


def stage(pinned, arrays, sms=SMS):
    """Write ``arrays`` into the pinned int workspace image; returns the staged bytes."""
    at, used = offsets(sms)
    ints = pinned.view(torch.int32)
    for name, values in arrays.items():
        if values:
            ints[at[name] // 4:at[name] // 4 + len(values)] = torch.tensor(values,
                                                                           dtype=torch.int32)
    return used


def read_schedule(int_workspace, plan_info, sms):
    """The arrays a kernel reads from the int workspace (``work_indptr`` sizes the rest)."""
    ints = int_workspace.view(torch.int32)
    clusters = plan_info[1]
    at = dict(zip(ARRAYS, plan_info[2:16]))

    def read(name, n):
        return ints[at[name] // 4:at[name] // 4 + n].tolist()

    work_indptr = read("work_indptr", clusters + 1)
    works = work_indptr[-1]
    out = {name: read(name, sms if name in _PER_CTA else works) for name in ARRAYS
           if name != "work_indptr"}
    out["work_indptr"] = work_indptr
    return out


def run_schedule(plan_info, s, indices, q, kv, value_dim, heads, causal, scale, sms):
    """``(o [rows, heads, value_dim] in q's dtype, lse base 2 [rows, heads])`` of the
    schedule ``s`` (``read_schedule``) on q ``[rows, heads, D]`` and the pool ``kv [slots,
    D]`` (values: its first ``value_dim`` columns)."""
    cluster, clusters = plan_info[0], plan_info[1]
    tile = cluster * _TILE
    rows_total = q.shape[0]
    out = torch.zeros(rows_total * heads, value_dim, dtype=torch.float64)
    lse = torch.full((rows_total * heads,), -math.inf, dtype=torch.float64)
    partial_o, partial_lse = {}, {}
    qf = q.double().reshape(rows_total * heads, -1)
    for c in range(clusters):
        for w in range(s["work_indptr"][c], s["work_indptr"][c + 1]):
            q0, kv0, part, q_len, kv_len = (s[n][w] for n in (
                "q_indptr", "kv_indptr", "partial_indptr", "q_len", "kv_len"))
            q_start, k0, k1 = s["q_start"][w], s["kv_start"][w], s["kv_end"][w]
            packed = torch.arange(q_start, min(q_start + tile, q_len * heads))
            slots = indices[kv0 + k0:kv0 + k1].long()
            scores = qf[q0 * heads + packed] @ kv[slots].double().T * scale
            if causal:
                pos = torch.arange(k0, k1)[None, :]
                seen = kv_len - q_len + packed[:, None] // heads + 1
                scores = scores.masked_fill(pos >= seen, -math.inf)
            m = scores.max(-1, keepdim=True).values if k1 > k0 else \
                torch.full((packed.numel(), 1), -math.inf, dtype=torch.float64)
            safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            p = torch.exp(scores - safe)
            total = p.sum(-1)
            o = (p @ kv[slots].double()[:, :value_dim]) / total.clamp_min(1e-300)[:, None]
            state = torch.where(total > 0, (safe[:, 0] + torch.log(total)) / math.log(2),
                                torch.full_like(total, -math.inf))
            if part == -1:
                out[q0 * heads + packed] = o
                lse[q0 * heads + packed] = state
            else:
                for r, row in enumerate((packed - q_start).tolist()):
                    partial_o[part + row], partial_lse[part + row] = o[r], state[r]
    for cta in range(cluster * clusters):
        start, end = s["merge_packed_offset_start"][cta], s["merge_packed_offset_end"][cta]
        p0, p1 = (s["merge_partial_packed_offset_start"][cta],
                  s["merge_partial_packed_offset_end"][cta])
        stride = s["merge_partial_stride"][cta]
        for local in range(end - start):
            parts = list(range(p0 + local, p1, stride))
            states = torch.stack([partial_lse[i] for i in parts]) * math.log(2)
            weights = torch.softmax(states, 0) if torch.isfinite(states).any() else \
                torch.zeros_like(states)
            out[start + local] = sum(wt * partial_o[i] for wt, i in zip(weights, parts))
            lse[start + local] = torch.logsumexp(states, 0) / math.log(2)
    return (out.reshape(rows_total, heads, value_dim).to(q.dtype),
            lse.reshape(rows_total, heads).float())
