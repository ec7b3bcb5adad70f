"""FlashInfer 0.7.4's FA2 prefill schedule in pure Python: the native planner's arrays, their
int workspace offsets and the 15 values of ``plan_info``.

``fa2_plan``: ``PrefillPlanImpl`` and ``PrefillSplitQOKVIndptr``
(``include/flashinfer/attention/scheduler.cuh``) step by step for pages of ``page`` tokens
and no sliding window: packed query rows (``q_len * group``) in tiles of ``cta_tile_q``
(graph mode: sized for the capture's worst row split, or for ``uniform_q_len``), the key
chunk by a binary search that keeps the work items within ``2 * sms / hkv`` (graph mode always
takes the split path), the work items (request, query tile, key chunk), ``merge_indptr`` per
query row, ``o_indptr`` per request, and in graph mode ``block_valid_mask`` over the padded
grid and the round's query rows (``total_num_rows``). ``SMS`` stands for the GPU's SM count.

``read_schedule``: the arrays as a kernel reads them from an int workspace, for the sizes a
round says (the work items its mask marks valid, the rows its ``total_num_rows`` holds).
"""

from __future__ import annotations

import torch

SMS = 6
INT64_MAX = (1 << 63) - 1


def _cdiv(a, b):
    return -(-a // b)


def cta_tile_q(packed_rows, head_dim):
    """``FA2DetermineCtaTileQ`` for head dims under 256 on sm80+."""
    if packed_rows > 64 and head_dim < 256:
        return 128
    return 64 if packed_rows > 16 else 16


class _Allocator:
    """``AlignedAllocator``: byte offsets, each padded to its alignment."""

    def __init__(self):
        self.used = 0

    def __call__(self, size, align):
        at = self.used + (-self.used) % align
        self.used = at + size
        return at


def fa2_plan(qo, kv, total_rows, hq, hkv, head_dim, *, page=1, graph=True, uniform=0,
             disable_split_kv=False, fixed_split_size=-1, sms=SMS):
    """``(plan_info, arrays, used bytes)`` of one plan. qo, kv: host indptr lists ``[B + 1]``
    (kv in pages); total_rows: the rows the plan is sized for (graph mode: the capture's)."""
    bs = len(qo) - 1
    group = hq // hkv
    packed = [(qo[i + 1] - qo[i]) * group for i in range(bs)]
    kv_len = [kv[i + 1] - kv[i] for i in range(bs)]
    max_split = (2 * sms) // hkv
    min_chunk = max(128 // page, 1)
    if graph:
        if uniform > 0:
            assert all(p == uniform * group for p in packed), "uniform_q_len broken"
            cta = cta_tile_q(uniform * group, head_dim)
            tiles_total = bs * _cdiv(uniform * group, cta)
        else:
            cta = cta_tile_q((total_rows - bs + 1) * group, head_dim)
            tiles_total = _cdiv(total_rows * group, cta) + bs - 1
    else:
        cta = cta_tile_q(sum(packed) // bs, head_dim)
        tiles_total = sum(_cdiv(p, cta) for p in packed)
    split = False
    if disable_split_kv:
        chunk = INT64_MAX
    elif fixed_split_size > 0:
        chunk = fixed_split_size
    else:
        low, high = min_chunk, max([1] + kv_len)
        while low < high:
            mid = (low + high) // 2
            items = sum(_cdiv(p, cta) * _cdiv(max(n, 1), mid) for p, n in zip(packed, kv_len))
            if items > max_split:
                low = mid + 1
            else:
                high = mid
        split, chunk = graph or low < max([1] + kv_len), low
    request, qo_tile, kv_tile, merge, o_indptr = [], [], [], [0], [0]
    for b in range(bs):
        chunks = 1 if disable_split_kv else _cdiv(max(kv_len[b], 1), chunk)
        if fixed_split_size > 0 and not disable_split_kv:
            split = split or chunks > 1
        for t in range(_cdiv(packed[b], cta)):
            for c in range(chunks):
                request.append(b)
                qo_tile.append(t)
                kv_tile.append(c)
        rows = packed[b] // group
        merge += [merge[-1] + chunks * (r + 1) for r in range(rows)]
        o_indptr.append(o_indptr[-1] + rows * chunks)
    padded = max(max_split, tiles_total) if graph else len(request)
    assert len(request) <= padded
    alloc = _Allocator()
    info = dict(padded=padded, total_rows=total_rows, cta=cta, graph=int(graph),
                split=int(split))
    info["request"] = alloc(4 * padded, 16)
    info["qo_tile"] = alloc(4 * padded, 16)
    info["kv_tile"] = alloc(4 * padded, 16)
    info["o_indptr"] = alloc(4 * (bs + 1), 16)
    info["chunk"] = alloc(4, 1)
    info["rows_at"] = alloc(4, 16) if graph else 0
    info["merge"] = alloc(4 * (total_rows + 1), 16) if split else 0
    info["mask"] = alloc(padded, 16) if graph else 0
    plan_info = [padded, total_rows, info["rows_at"], cta, info["request"], info["qo_tile"],
                 info["kv_tile"], info["merge"], info["o_indptr"], info["chunk"], 0, 0,
                 info["mask"], int(graph), int(split)]
    # The chunk as the int32 array stores it (INT64_MAX pages: -1).
    chunk32 = ((chunk * page) & 0xFFFFFFFF) - ((chunk * page) & 0x80000000) * 2
    arrays = dict(request=request, qo_tile=qo_tile, kv_tile=kv_tile, o_indptr=o_indptr,
                  chunk=chunk32, rows=qo[-1], merge=merge if split else None,
                  mask=[int(i < len(request)) for i in range(padded)] if graph else None)
    return plan_info, arrays, alloc.used


def stage(pinned, plan_info, arrays):
    """Write ``arrays`` into the byte buffer ``pinned`` at ``plan_info``'s offsets (what the
    planner writes before its copy to the device)."""
    words = pinned.view(torch.int32)

    def put(offset, values):
        if values:
            words[offset // 4: offset // 4 + len(values)] = torch.tensor(values,
                                                                         dtype=torch.int32)
    put(plan_info[4], arrays["request"])
    put(plan_info[5], arrays["qo_tile"])
    put(plan_info[6], arrays["kv_tile"])
    put(plan_info[8], arrays["o_indptr"])
    put(plan_info[9], [arrays["chunk"]])
    if plan_info[13]:
        put(plan_info[2], [arrays["rows"]])
        pinned[plan_info[12]: plan_info[12] + plan_info[0]] = torch.tensor(
            arrays["mask"], dtype=torch.uint8)
    if plan_info[14]:
        put(plan_info[7], arrays["merge"])


def read_schedule(int_workspace, plan_info, bs, valid=None, rows=None):
    """The arrays of a schedule in ``int_workspace`` (any device), as the kernel reads them:
    in graph mode the work items its mask marks valid (which must lead) and ``merge_indptr``
    up to its ``total_num_rows``; else ``valid`` work items and ``rows`` query rows."""
    ws = int_workspace.cpu()
    words = ws.view(torch.int32)

    def get(offset, n):
        return words[offset // 4: offset // 4 + n].tolist()
    mask = None
    if plan_info[13]:
        mask = ws[plan_info[12]: plan_info[12] + plan_info[0]].tolist()
        valid, rows = sum(mask), get(plan_info[2], 1)[0]
    return dict(request=get(plan_info[4], valid), qo_tile=get(plan_info[5], valid),
                kv_tile=get(plan_info[6], valid), o_indptr=get(plan_info[8], bs + 1),
                chunk=get(plan_info[9], 1)[0], rows=rows,
                merge=get(plan_info[7], rows + 1) if plan_info[14] else None,
                mask=mask)
