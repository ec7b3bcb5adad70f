"""FlashInfer's FA2 prefill schedule of a CUDA-graph wrapper, written on the device.

Shapes: a graph prefill wrapper of ``bs`` sequences (fixed at capture), planned once by
FlashInfer's public ``plan`` (its ``plan_info``: 15 values, the graph's grid and the int32
offsets of the schedule in the wrapper's int workspace). ``device_schedule`` returns where
and how the slot-list launch (``kernels.prefix_slots``, ``schedule=``) writes each round's
schedule there (``kernels.prefill_schedule``), or ``None`` where it cannot.

Why: FlashInfer plans a prefill on the host (``PrefillPlan``), so an engine calls its planner
and copies its schedule to the device before every replay; the lengths it reads are already
on the device (the slot-list launch writes the CSR), so that launch writes the schedule too
and the round's host work loses the planner call.

The grid (``padded_batch_size``), the query tile and the split path are fixed at capture in
graph mode (FlashInfer sizes them for the captured rows, or ``uniform_q_len``), so the
capture's ``plan_info`` serves every replay; ``device_schedule`` declines a plan whose values
are not laid out as 0.7.4's ``PrefillPlanImpl`` lays them out for these sizes, another
FlashInfer release (``PLANNER_VERSIONS``), another backend than fa2, a fixed split size (its split path changes with the lengths), pages of
more than one token, and a device where Triton does not run.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Optional

import torch

from ...util import sm_count, triton_runs

if TYPE_CHECKING:
    from ...kernels.prefill_schedule import Fa2Schedule

__all__ = ["device_schedule", "fa2_offsets"]

_BLOCKS_PER_SM = 2  # PrefillPlanImpl: num_blocks_per_sm
# FlashInfer releases whose FA2 planner this is: its key-chunk search and work-item budget do
# not show in ``plan_info``, so another release keeps its own planner.
PLANNER_VERSIONS = frozenset({"0.7.4"})


def _align(at: int, size: int, align: int) -> tuple[int, int]:
    """``AlignedAllocator.aligned_alloc_offset``: ``(offset, next free byte)``."""
    at += (-at) % align
    return at, at + size


def fa2_offsets(padded: int, bs: int, rows_cap: int, split: bool) -> tuple:
    """The byte offsets ``PrefillPlanImpl`` gives a graph plan's int arrays, in ``plan_info``
    order: ``(total_num_rows, request, qo_tile, kv_tile, merge, o_indptr, chunk, mask)``
    (``merge`` 0 without the split path), and the bytes used."""
    request, end = _align(0, 4 * padded, 16)
    qo_tile, end = _align(end, 4 * padded, 16)
    kv_tile, end = _align(end, 4 * padded, 16)
    o_indptr, end = _align(end, 4 * (bs + 1), 16)
    chunk, end = _align(end, 4, 1)
    rows, end = _align(end, 4, 16)
    merge = 0
    if split:
        merge, end = _align(end, 4 * (rows_cap + 1), 16)
    mask, end = _align(end, padded, 16)
    return (rows, request, qo_tile, kv_tile, merge, o_indptr, chunk, mask), end


def device_schedule(wrapper: Any, plan_info: Any, bs: int, heads: tuple, *, uniform: int,
                    disable_split_kv: bool, fixed_split_size: int) -> Optional["Fa2Schedule"]:
    """The device schedule of ``wrapper``'s captured plan, or ``None`` (the host planner
    serves). heads: ``(num_qo_heads, num_kv_heads, head_dim, page_size)``; uniform: the
    plan's ``uniform_q_len`` (0: none), also the rows of every request where the launch does
    not write the query indptr (a decode's prefix pass)."""
    hq, hkv, _, page = heads
    try:
        info = [int(v) for v in plan_info]
    except (TypeError, ValueError):
        return None
    workspace = wrapper._int_workspace_buffer
    sms = sm_count(workspace.device)
    version = getattr(sys.modules.get("flashinfer"), "__version__", None)
    if len(info) != 15 or wrapper._backend != "fa2" or page != 1 or fixed_split_size > 0 \
            or version not in PLANNER_VERSIONS or not sms or not triton_runs(workspace.device):
        return None
    padded, rows_cap, cta, graph, split = info[0], info[1], info[3], info[13], info[14]
    if not graph or bool(split) == bool(disable_split_kv) or padded < 1 or cta < 1:
        return None
    offsets, used = fa2_offsets(padded, bs, rows_cap, bool(split))
    got = (info[2], *info[4:10], info[12])
    if got != offsets or used > workspace.numel():
        return None
    from ...kernels.prefill_schedule import Fa2Schedule  # Triton: once a graph pass plans

    words = tuple(o // 4 for o in offsets[:7])
    # Kernel order: request, qo_tile, kv_tile, merge, o_indptr, chunk, rows (int32), mask.
    return Fa2Schedule(workspace[:workspace.numel() // 4 * 4].view(torch.int32),
                       workspace.view(torch.uint8),
                       (*words[1:7], words[0], offsets[7]), padded, rows_cap, cta, hq // hkv,
                       max(128 // page, 1), _BLOCKS_PER_SM * sms // hkv, uniform,
                       bool(split))
