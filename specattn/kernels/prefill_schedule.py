"""FlashInfer's FA2 prefill split schedule of a CUDA-graph round, as a Triton device function.

Shapes: a round of ``bs`` requests, request ``b`` with ``q_b`` query rows (``q_b * group``
packed rows, ``group`` query heads per KV head) and ``n_b`` keys (pages of one token); the
schedule goes into FlashInfer's int workspace (``Work``, int32 elements; ``Mask``, the same
bytes) at the offsets of the capture's ``plan_info``: per work item ``request_indices``,
``qo_tile_indices``, ``kv_tile_indices`` and ``block_valid_mask`` (over the padded grid),
``o_indptr [bs + 1]``, ``merge_indptr [rows + 1]``, the key chunk and the round's query rows.

What it computes is ``PrefillSplitQOKVIndptr`` of FlashInfer 0.7.4 in graph mode
(``include/flashinfer/attention/scheduler.cuh``): the query tile is the capture's
(``cta_tile_q``, fixed for the graph); the key chunk is the least of ``min_chunk ..
max(n)`` whose work items, ``sum_b ceil(packed_b / cta_tile_q) * ceil(max(n_b, 1) /
chunk)``, are at most ``max_split`` (a binary search, as FlashInfer's); each request's work
items are its query tiles by its chunks, tile-major, after the previous requests'; its rows'
partial outputs are ``chunks`` consecutive rows from ``o_indptr[b]``. With ``SPLIT`` false
(the plan's ``disable_split_kv``) every request is one chunk and the chunk is stored as
FlashInfer stores ``INT64_MAX`` into its int32 slot (-1).

Why on the device: the lengths are already there (the slot-list launch that calls this
writes them), and FlashInfer's host planner costs an engine host time before every replay.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["Fa2Schedule", "fa2_schedule"]


@triton.jit
def _round_lengths(first, bs, raw, Lens, stride_lens, Ext, stride_ext, fill, qrows,
                   QO: tl.constexpr, BLOCK_B: tl.constexpr):
    """``(q, n)`` of requests ``first .. first + BLOCK_B`` (int64; zero past ``bs``):
    padding requests ``>= raw`` have ``fill`` keys and no rows (QO) or ``qrows``."""
    i = first + tl.arange(0, BLOCK_B)
    real = i < raw
    n = tl.load(Lens + i * stride_lens, mask=real, other=0).to(tl.int64)
    n = tl.where(real, n, tl.where(i < bs, fill, 0).to(tl.int64))
    if QO:
        q = tl.load(Ext + i * stride_ext, mask=real, other=0).to(tl.int64)
    else:
        q = tl.where(i < bs, qrows, 0).to(tl.int64)
    return q, n


@triton.jit
def fa2_schedule(b, bs, raw, Lens, stride_lens, Ext, stride_ext, fill, qrows, Work, Mask,
                 o_request, o_qo_tile, o_kv_tile, o_merge, o_o_indptr, o_chunk, o_rows,
                 o_mask, padded, rows_cap, cta_tile_q, group, min_chunk, max_split,
                 QO: tl.constexpr, SPLIT: tl.constexpr, BLOCK_B: tl.constexpr,
                 BLOCK_W: tl.constexpr):
    """Request ``b``'s work items, ``o_indptr[b + 1]`` and merge rows; request 0 also the
    round's values (chunk, rows, ``o_indptr[0]``, ``merge_indptr[0]``, the mask). ``o_*``:
    int32 element offsets into ``Work``, ``o_mask`` a byte offset into ``Mask``."""
    zero = (b * 0).to(tl.int64)
    # The binary search's bound: the longest key list (at least 1).
    longest = zero + 1
    for first in range(0, bs, BLOCK_B):
        _, n = _round_lengths(first, bs, raw, Lens, stride_lens, Ext, stride_ext, fill,
                              qrows, QO, BLOCK_B)
        longest = tl.maximum(longest, tl.max(n, 0))
    chunk = zero + min_chunk
    if SPLIT:
        high = longest
        for _halving in range(0, 64):  # a bisection of int64 ranges ends within 64 halvings
            if chunk < high:
                mid = (chunk + high) // 2
                items = zero
                for first in range(0, bs, BLOCK_B):
                    q, n = _round_lengths(first, bs, raw, Lens, stride_lens, Ext, stride_ext,
                                          fill, qrows, QO, BLOCK_B)
                    tiles = (q * group + cta_tile_q - 1) // cta_tile_q
                    items += tl.sum(tiles * ((tl.maximum(n, 1) + mid - 1) // mid), 0)
                over = items > max_split
                chunk = tl.where(over, mid + 1, chunk)
                high = tl.where(over, high, mid)
    # Request b's place: the work items, partial rows and query rows before it, and the totals.
    items_before = zero
    parts_before = zero
    rows_before = zero
    items_total = zero
    rows_total = zero
    my_q = zero
    my_chunks = zero
    for first in range(0, bs, BLOCK_B):
        q, n = _round_lengths(first, bs, raw, Lens, stride_lens, Ext, stride_ext, fill, qrows,
                              QO, BLOCK_B)
        i = first + tl.arange(0, BLOCK_B)
        if SPLIT:
            chunks = tl.where(i < bs, (tl.maximum(n, 1) + chunk - 1) // chunk, 0)
        else:
            chunks = tl.where(i < bs, 1, 0).to(tl.int64)
        items = (q * group + cta_tile_q - 1) // cta_tile_q * chunks
        before = i < b
        items_before += tl.sum(tl.where(before, items, 0), 0)
        parts_before += tl.sum(tl.where(before, q * chunks, 0), 0)
        rows_before += tl.sum(tl.where(before, q, 0), 0)
        items_total += tl.sum(items, 0)
        rows_total += tl.sum(q, 0)
        my_q += tl.sum(tl.where(i == b, q, 0), 0)
        my_chunks += tl.sum(tl.where(i == b, chunks, 0), 0)

    w = tl.arange(0, BLOCK_W)
    my_items = (my_q * group + cta_tile_q - 1) // cta_tile_q * my_chunks
    for j_item in range(0, my_items, BLOCK_W):
        k = j_item + w
        at = items_before + k
        ok = (k < my_items) & (at < padded)
        tl.store(Work + o_request + at, (b + k * 0).to(tl.int32), mask=ok)
        tl.store(Work + o_qo_tile + at, (k // my_chunks).to(tl.int32), mask=ok)
        tl.store(Work + o_kv_tile + at, (k % my_chunks).to(tl.int32), mask=ok)
    tl.store(Work + o_o_indptr + b + 1, (parts_before + my_q * my_chunks).to(tl.int32))
    if SPLIT:
        for j_row in range(0, my_q, BLOCK_W):
            r = j_row + w
            at = rows_before + r + 1
            tl.store(Work + o_merge + at, (parts_before + (r + 1) * my_chunks).to(tl.int32),
                     mask=(r < my_q) & (at <= rows_cap))
    if b == 0:
        tl.store(Work + o_o_indptr, 0)
        tl.store(Work + o_rows, rows_total.to(tl.int32))
        if SPLIT:
            tl.store(Work + o_chunk, chunk.to(tl.int32))
            tl.store(Work + o_merge, 0)
        else:
            tl.store(Work + o_chunk, -1)
        for j_block in range(0, padded, BLOCK_W):
            k = j_block + w
            tl.store(Mask + o_mask + k, (k < items_total).to(tl.uint8), mask=k < padded)


class Fa2Schedule(NamedTuple):
    """Where and how a launch writes the schedule: ``work`` (the int workspace as int32) and
    ``mask`` (as uint8), the element offsets of ``request_indices``, ``qo_tile_indices``,
    ``kv_tile_indices``, ``merge_indptr``, ``o_indptr``, the chunk and the rows, the byte
    offset of ``block_valid_mask`` (``offsets``), the capture's padded grid, its query rows
    (``rows_cap``: the most ``merge_indptr`` holds) and query tile, the query heads per KV
    head, the least chunk, the work-item budget, the query rows of every request where the
    launch does not write them (``qrows``: a decode's ``K``) and ``split`` (false: the plan's
    ``disable_split_kv``)."""

    work: torch.Tensor
    mask: torch.Tensor
    offsets: tuple
    padded: int
    rows_cap: int
    cta_tile_q: int
    group: int
    min_chunk: int
    max_split: int
    qrows: int
    split: bool

    def ints(self) -> tuple:
        """The slot-list kernel's ``s0 .. s17`` and ``qrows``."""
        return (*self.offsets, self.padded, self.rows_cap, self.cta_tile_q, self.group,
                self.min_chunk, self.max_split, 0, 0, 0, 0, self.qrows)

    def consts(self) -> dict:
        """The slot-list kernel's schedule constexprs this schedule sets (the others:
        ``prefix_slots.NO_SCHEDULE``'s)."""
        return dict(SCHED=1, SPLIT=self.split)

    def key(self) -> tuple:
        """The schedule's identity for a kept launch (its tensors by address)."""
        return (self.work.data_ptr(), self.mask.data_ptr(), *self.offsets, *self[3:])
