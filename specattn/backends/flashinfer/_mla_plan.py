"""FlashInfer's MLA split schedule of a CUDA-graph wrapper, written on the device.

Shapes: a CUDA-graph MLA pass of ``B`` sequences (fixed at capture), planned once by
FlashInfer's public ``plan`` (its ``plan_info``: 18 values, the grid ``(cluster, clusters)``
and the int32 offsets of the schedule's arrays in the wrapper's int workspace).
``mla_schedule_for`` returns where and how the slot-list launch (``kernels.prefix_slots``,
``schedule=``) writes each round's schedule there (``kernels.mla_schedule``: what it
computes, and where it differs from FlashInfer's planner), or ``None`` where it cannot.

Why: FlashInfer's MLA planner is host code that reads the round's lengths, so an engine runs
it before every graph replay: 75-150 us of host time at batch 1 to 8 on the H200's host, most
of a round whose GPU work is 30-60 us. The lengths are already on the device, in the
slot-list launch that writes the CSR, which writes the schedule too.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from ...kernels.mla_schedule import MAX_WORKS as _MAX_WORKS
from ...util import next_pow2, triton_runs

__all__ = ["MLAPlanLayout", "MLASchedule", "mla_schedule_for", "plan_layout"]

_CTA_TILE_Q = 64  # FlashInfer's MLA query rows per CTA


class MLAPlanLayout(NamedTuple):
    """A capture's ``plan_info`` (FlashInfer 0.7.4's 18 values): the grid
    ``(cluster, clusters)`` and the int32 element offsets of the schedule's arrays in the int
    workspace, in ``plan_info``'s order."""

    cluster: int
    clusters: int
    offsets: tuple  # q_indptr .. work_indptr: 14 element offsets


# Entries of each array in ``plan_info``'s order: per work item, or per CTA (``None``).
_ENTRIES = (_MAX_WORKS, _MAX_WORKS, _MAX_WORKS, None, None, None, None, None, _MAX_WORKS,
            _MAX_WORKS, _MAX_WORKS, _MAX_WORKS, _MAX_WORKS, _MAX_WORKS)


def plan_layout(plan_info: Any) -> Optional[MLAPlanLayout]:
    """The layout of a FlashInfer MLA ``plan_info``, or ``None`` where it is not 0.7.4's:
    18 values, a cluster of 1 or 2 CTAs, 16-byte aligned offsets in allocation order, each
    array followed by room for its entries (``_MAX_WORKS`` per work-item array, one per CTA
    for the merge arrays), so that no write of the device schedule reaches another array."""
    try:
        values = [int(v) for v in plan_info]
    except (TypeError, ValueError):
        return None
    if len(values) != 18 or values[0] not in (1, 2) or values[1] < 1:
        return None
    offsets = values[2:16]
    ctas = values[0] * values[1]
    ends = offsets[1:] + [offsets[-1] + 4 * _MAX_WORKS]
    if any(o < 0 or o % 16 or end - o < 4 * (n or ctas)
           for o, end, n in zip(offsets, ends, _ENTRIES)):
        return None
    return MLAPlanLayout(values[0], values[1], tuple(o // 4 for o in offsets))


class MLASchedule(NamedTuple):
    """Where and how a launch writes an MLA wrapper's schedule: ``work`` (its int workspace as
    int32) and ``mask`` (as bytes; unused), the capture's grid and ``layout.offsets``, the
    query heads, causality, the requests (``bs``) and the query rows of every request where
    the launch does not write them (``qrows``: a decode's ``K``; 0 for an extend's)."""

    work: torch.Tensor
    mask: torch.Tensor
    layout: MLAPlanLayout
    heads: int
    causal: bool
    bs: int
    qrows: int = 0

    def ints(self) -> tuple:
        """The slot-list kernel's ``s0 .. s17`` and ``qrows``."""
        lay = self.layout
        return (self.heads, lay.clusters, lay.cluster * lay.clusters, *lay.offsets, 0,
                self.qrows)

    def consts(self) -> dict:
        """The slot-list kernel's schedule constexprs this schedule sets (the others:
        ``prefix_slots.NO_SCHEDULE``'s)."""
        lay = self.layout
        ctas = lay.cluster * lay.clusters
        return dict(SCHED=2, CLUSTER=lay.cluster, CAUSAL=bool(self.causal),
                    SCHED_B=next_pow2(self.bs), SCHED_N=next_pow2(max(lay.clusters + 1, ctas)),
                    SCHED_M=lay.cluster * _CTA_TILE_Q)

    def key(self) -> tuple:
        """The schedule's identity for a kept launch (its workspace by address)."""
        return (self.work.data_ptr(), *self.layout, self.heads, self.causal, self.bs,
                self.qrows)


def mla_schedule_for(backend: Any, num_heads: int) -> Optional[MLASchedule]:
    """The device schedule of a planned MLA backend's captured plan, or ``None`` where Triton
    does not run on its device or its ``plan_info`` is not laid out as 0.7.4's."""
    layout = plan_layout(backend._plan_info)
    if layout is None or not triton_runs(backend.device):
        return None
    ws = backend._int_workspace_buffer
    return MLASchedule(ws[:ws.numel() // 4 * 4].view(torch.int32), ws.view(torch.uint8), layout,
                       num_heads, bool(backend._causal), backend._kv_len_arr_buf.shape[0])
