"""Request prefixes as one CSR slot list, built on the device in one launch (Triton).

A library that takes a paged KV cache as CSR (FlashInfer over the token pool seen as pages of
one token) needs ``kv_indices``: the slots ``req_to_token[rows[b], 0 : lens[b]]`` of every
request ``b``, concatenated. Its host planner needs only the lengths, which the caller has on
the host, so the list is written here without a host round trip and without an indptr on the
device: each program sums the lengths before its request for its offset (``B`` is small).
The host gives the grid (the longest prefix) and the total, which bounds every write, so
lengths on the device that disagree with the host's cannot write past the list.

In a CUDA-graph round (``fixed``) the same launch also copies the caller's batch into the
round's fixed buffers, padded to the captured batch size as ``DraftDecodeBackend`` pads
(request row 0, length ``fill``, slot 0), and the padded requests' prefixes are listed too.
With ``csr`` it also writes the list's ``kv_indptr`` and ``kv_lens`` (each program knows its
request's offset and length): the device copies of the host CSR that FlashInfer's plan would
otherwise copy from the host every round; with ``qo`` (an extend round) also the query
indptr of the round's new tokens, and with ``ext_loc`` their slots, copied from the caller's
``out_cache_loc`` into the round's fixed buffer (the copy an extend graph round needs
anyway, in the same launch). With ``schedule`` it also writes FlashInfer's graph schedule
of the round into the wrapper's int workspace (a prefill wrapper's FA2 schedule,
``prefill_schedule``; an MLA wrapper's, ``mla_schedule``): each ``(b, 0)`` program already
holds its request's place in the round.

The same values as ``backends.flashinfer._slots.fill_ragged_slots`` (slots clamped into the
pool, positions into the row), which needs about fifteen launches for it.

A caller that launches it every round keeps the launches (``kept``): one prepared
``KernelLaunch`` per signature of the caller's tensors and grid, launched directly on the
round's tensors instead of through Triton's Python launcher. The grid's tile count is rounded
up to a power of two (the extra programs list nothing), so rounds of other prefix lengths
reuse a kept launch.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import triton
import triton.language as tl

from ..util import next_pow2
from ..graph_calls import MAX_KEPT, signature
from .kernel_launch import KernelLaunch
from .mla_schedule import MAX_WORKS as MLA_MAX_WORKS, mla_schedule
from .prefill_schedule import fa2_schedule

__all__ = ["prefix_slots"]

_BLOCK_T = 512  # prefix positions per program
_BLOCK_B = 64  # lengths summed at a time (fixed: one compiled kernel for every batch size)
# An MLA schedule's chunks of one tile written at a time, and its work-list capacity.
_MLA_CHUNKS = tl.constexpr(256)
_MLA_MAX_WORKS = tl.constexpr(MLA_MAX_WORKS)


# The caller's tensors and the total lead (a kept launch's new arguments); their addresses
# move between rounds: no alignment specialization on them (``kernel_launch``).
@triton.jit(do_not_specialize=["raw", "total", "tokens"],
            do_not_specialize_on_alignment=["Rows", "Lens", "Loc", "Ext"])
def _prefix_slots_kernel(Rows, Lens, Loc, Ext, total, tokens, ReqToToken, Out, FixRows, FixLens,
                         FixLoc, CsrIndptr, CsrLens, QoIndptr, Work, Mask,
                         stride_rows, stride_lens, stride_ext, stride_r2t_row, stride_r2t_pos,
                         stride_loc_b, stride_loc_k, stride_loc_s,
                         raw, num_slots, width, fill, fix_n,
                         s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14,
                         s15, s16, s17, qrows,
                         BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, FIXED: tl.constexpr,
                         LOC_N: tl.constexpr, NUM_STEPS: tl.constexpr,
                         BLOCK_LOC: tl.constexpr, CSR: tl.constexpr, QO: tl.constexpr,
                         EXT_LOC: tl.constexpr, SCHED: tl.constexpr, SPLIT: tl.constexpr,
                         CLUSTER: tl.constexpr, CAUSAL: tl.constexpr, SCHED_B: tl.constexpr,
                         SCHED_N: tl.constexpr, SCHED_M: tl.constexpr):
    """Grid ``(bs, tiles)``: program ``(b, i)`` lists positions ``[i * BLOCK_T, (i + 1) *
    BLOCK_T)`` of request ``b``'s prefix. Requests ``b >= raw`` are padding. CSR: program
    ``(b, 0)`` writes ``CsrIndptr[b]`` and ``CsrLens[b]``, the last request ``CsrIndptr[bs]``;
    QO: likewise ``QoIndptr`` of the query rows ``Ext`` (an extend's new tokens); EXT_LOC (with
    QO): program ``(b, i)`` also copies request ``b``'s new tokens' slots at those positions
    from ``Loc [tokens]`` into ``FixLoc [fix_n]``, at most ``tokens`` in all, and the last
    program writes slot 0 (the padding's) into ``FixLoc[tokens : fix_n]``. SCHED: program ``(b,
    0)`` writes request ``b``'s part of FlashInfer's graph schedule of the round into
    ``Work`` / ``Mask`` (query rows ``Ext`` with QO, else ``qrows`` each): 1, the FA2
    prefill schedule (``prefill_schedule.fa2_schedule``), 2, the MLA one
    (``mla_schedule.mla_schedule``); ``s0 .. s17``: the schedule's integers, in its writer's
    order (``Fa2Schedule`` / ``MLASchedule.ints``)."""
    b = tl.program_id(0)
    tile = tl.program_id(1)
    real = b < raw
    src = tl.minimum(b, raw - 1)  # padding loads a real request, then drops it
    start = (b * 0).to(tl.int64)  # the lengths of requests 0 .. b - 1, BLOCK_B at a time
    rows_before = (b * 0).to(tl.int64)  # QO: their new tokens (padding has none)
    for first in range(0, b, BLOCK_B):
        offs_b = first + tl.arange(0, BLOCK_B)
        lens = tl.load(Lens + offs_b * stride_lens, mask=offs_b < raw, other=0).to(tl.int64)
        lens = tl.where(offs_b < raw, lens, fill)
        start += tl.sum(tl.where(offs_b < b, lens, 0), 0)
        if QO:
            ext = tl.load(Ext + offs_b * stride_ext, mask=(offs_b < b) & (offs_b < raw),
                          other=0).to(tl.int64)
            rows_before += tl.sum(ext, 0)
    n = tl.where(real, tl.load(Lens + src * stride_lens).to(tl.int64), fill)
    row = tl.where(real, tl.load(Rows + src * stride_rows).to(tl.int64), 0)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = (t < n) & (start + t < total)
    pos = tl.minimum(t, width - 1)
    slot = tl.load(ReqToToken + row * stride_r2t_row + pos * stride_r2t_pos, mask=ok,
                   other=0).to(tl.int64)
    slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    tl.store(Out + start + t, slot.to(tl.int32), mask=ok)
    if CSR:
        if tile == 0:
            tl.store(CsrIndptr + b, start.to(tl.int32))
            tl.store(CsrLens + b, n.to(tl.int32))
            if b == tl.num_programs(0) - 1:
                tl.store(CsrIndptr + b + 1, (start + n).to(tl.int32))
    if QO:
        if tile == 0:
            tl.store(QoIndptr + b, rows_before.to(tl.int32))
            if b == tl.num_programs(0) - 1:
                mine = tl.where(real, tl.load(Ext + src * stride_ext).to(tl.int64), 0)
                tl.store(QoIndptr + b + 1, (rows_before + mine).to(tl.int32))
        if EXT_LOC:
            mine = tl.where(real, tl.load(Ext + src * stride_ext).to(tl.int64), 0)
            at = rows_before + t
            new = (t < mine) & (at < tokens)
            loc = tl.load(Loc + at * stride_loc_b, mask=new, other=0).to(tl.int64)
            tl.store(FixLoc + at, loc, mask=new)
            if (b == tl.num_programs(0) - 1) & (tile == 0):  # a replay of fewer tokens
                for p0 in range(tokens, fix_n, BLOCK_T):
                    pad = p0 + tl.arange(0, BLOCK_T)
                    tl.store(FixLoc + pad, tl.zeros([BLOCK_T], tl.int64), mask=pad < fix_n)
    if SCHED == 1:
        if tile == 0:
            fa2_schedule(b, tl.num_programs(0), raw, Lens, stride_lens, Ext, stride_ext, fill,
                         qrows, Work, Mask, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11,
                         s12, s13, QO, SPLIT, BLOCK_B, BLOCK_T)
    if SCHED == 2:
        if tile == 0:
            mla_schedule(b, tl.num_programs(0), raw, Lens, stride_lens, Ext, stride_ext, fill,
                         qrows, start, Work, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11,
                         s12, s13, s14, s15, s16, CLUSTER, CAUSAL, QO, SCHED_B,
                         _MLA_CHUNKS, SCHED_N, SCHED_M, _MLA_MAX_WORKS)
    if FIXED:
        if tile == 0:
            tl.store(FixRows + b, row)
            tl.store(FixLens + b, n)
            e = tl.arange(0, BLOCK_LOC)
            e_ok = e < LOC_N
            lane = e // NUM_STEPS
            step = e % NUM_STEPS
            loc = tl.load(Loc + src * stride_loc_b + lane * stride_loc_k + step * stride_loc_s,
                          mask=e_ok, other=0).to(tl.int64)
            tl.store(FixLoc + b * LOC_N + e, tl.where(real, loc, 0), mask=e_ok)


# The schedule constexprs of a launch that writes none.
NO_SCHEDULE = (("SCHED", 0), ("SPLIT", False), ("CLUSTER", 1), ("CAUSAL", False),
               ("SCHED_B", 1), ("SCHED_N", 1), ("SCHED_M", 1))


class Schedule(Protocol):
    """What a launch needs of a schedule to write: the int workspace as int32 (``work``) and
    as bytes (``mask``), ``ints()`` (19: ``s0 .. s17`` and ``qrows``), ``consts()`` (the
    ``NO_SCHEDULE`` names it sets) and ``key()`` (its identity for a kept launch)."""

    work: torch.Tensor
    mask: torch.Tensor

    def ints(self) -> tuple: ...

    def consts(self) -> dict: ...

    def key(self) -> tuple: ...


def prefix_slots(out: torch.Tensor, total: int, longest: int, req_to_token: torch.Tensor,
                 rows: torch.Tensor, lens: torch.Tensor, num_slots: int, *,
                 bs: Optional[int] = None, fill: int = 1,
                 fixed: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                 loc: Optional[torch.Tensor] = None,
                 csr: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 qo: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 ext_loc: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 schedule: Optional["Schedule"] = None,
                 kept: Optional[dict] = None, kept_key: Optional[tuple] = None
                 ) -> None:
    """Write the prefix slot list of ``bs`` requests into ``out[:total]`` (no view is
    returned: a view costs host time, and a replay makes this call every round).

    rows, lens: ``[raw]`` int (any strides): ``req_pool_indices`` and ``seq_lens`` of the
    caller's requests. ``bs`` (default ``raw``): requests in the list, ``raw .. bs - 1``
    padding (row 0, length ``fill``). ``total`` and ``longest``: the sum and the largest of
    the ``bs`` lengths, from the host. req_to_token: ``[max_reqs, width]`` int; ``out``:
    ``[>= total]`` int32; slots clamped into ``[0, num_slots)``.

    fixed: ``(rows [bs], lens [bs], loc [bs, K, S])`` int64 contiguous buffers that get the
    padded batch (CUDA-graph rounds), ``loc``: the caller's ``out_cache_loc [raw, K, S]``.
    csr: ``(kv_indptr [bs + 1], kv_lens [bs])`` int32 buffers that get the list's CSR.
    qo: ``(ext [raw] int, any stride; qo_indptr [bs + 1] int32)``: an extend's new tokens per
    request and the buffer that gets their indptr (padding requests have none).
    ext_loc (with ``qo``): ``(out_cache_loc [T] int, any stride; fixed [>= T] int64)``: the
    new tokens' slots, copied into ``fixed`` (an extend graph round's buffer), whose rows
    past ``T`` get slot 0 (a replay of fewer tokens than its capture: the captured KV write
    covers ``fixed``).
    schedule: where FlashInfer's graph schedule of the round goes and how (``Fa2Schedule``:
    a prefill wrapper's; ``MLASchedule``: an MLA wrapper's), written by the same launch.
    kept: the caller's dict of kept launches (``KernelLaunch`` by signature and grid), for
    callers that launch it every round. kept_key: the caller's key for every argument but
    ``total`` and ``longest`` (a kept graph call's, whose tensors' signatures and addresses
    it already checked), used in place of computing their signatures.
    """
    raw = rows.shape[0]
    bs = raw if bs is None else bs
    if bs == 0 or (fixed is None and csr is None and total <= 0):
        return
    tiles = next_pow2(-(-longest // _BLOCK_T))
    src_loc = out if fixed is None else loc
    tokens = 0
    if ext_loc is not None:
        src_loc, tokens = ext_loc[0], ext_loc[0].shape[0]
    ext = out if qo is None else qo[0]
    key = None
    if kept is not None:
        key = (kept_key, tiles) if kept_key is not None else (
            signature(rows), signature(lens), signature(src_loc), bs, tiles, fill,
            num_slots, signature(out), out.data_ptr(), signature(req_to_token),
            req_to_token.data_ptr(),
            None if fixed is None else tuple((signature(t), t.data_ptr()) for t in fixed),
            None if csr is None else tuple((signature(t), t.data_ptr()) for t in csr),
            None if qo is None else (signature(qo[0]), signature(qo[1]), qo[1].data_ptr()),
            None if ext_loc is None else (ext_loc[1].data_ptr(), ext_loc[1].shape),
            None if schedule is None else schedule.key())
        launch = kept.get(key)
        if launch is not None:
            launch(rows, lens, src_loc, ext, total, tokens)
            return
    launch = _launch(out, req_to_token, rows, lens, src_loc, ext, num_slots, bs, tiles, fill,
                     fixed, csr, None if qo is None else qo[1],
                     None if ext_loc is None else ext_loc[1], schedule)
    launch(rows, lens, src_loc, ext, total, tokens)
    if key is not None:
        if len(kept) >= MAX_KEPT:
            kept.clear()
        kept[key] = launch


def _launch(out, req_to_token, rows, lens, src_loc, ext, num_slots, bs, tiles, fill,
            fixed, csr, qo_indptr, ext_fixed=None, schedule=None) -> KernelLaunch:
    """The launch over grid ``(bs, tiles)``, called with ``(rows, lens, loc, ext, total,
    tokens)``."""
    if fixed is None:
        fix_rows = fix_lens = fix_loc = out
        loc_strides, steps, loc_n = (0, 0, 0), 1, 1
        if ext_fixed is not None:  # an extend's new-token slots, [T] -> the fixed buffer
            fix_loc, loc_strides = ext_fixed, (src_loc.stride(0), 0, 0)
    else:
        fix_rows, fix_lens, fix_loc = fixed
        steps = src_loc.shape[2]
        loc_n = src_loc.shape[1] * steps
        loc_strides = src_loc.stride()
    csr_indptr, csr_lens = (out, out) if csr is None else csr
    if schedule is None:
        buffers, ints, sched = (out, out), (0,) * 19, dict(NO_SCHEDULE)
    else:
        buffers, ints = (schedule.work, schedule.mask), schedule.ints()
        sched = dict(NO_SCHEDULE, **schedule.consts())
    tail = (req_to_token, out, fix_rows, fix_lens, fix_loc, csr_indptr, csr_lens,
            out if qo_indptr is None else qo_indptr, *buffers, rows.stride(0),
            lens.stride(0), ext.stride(0),
            req_to_token.stride(0), req_to_token.stride(1), *loc_strides, rows.shape[0],
            num_slots, req_to_token.shape[1], fill,
            0 if ext_fixed is None else ext_fixed.shape[0], *ints)
    consts = dict(BLOCK_B=_BLOCK_B, BLOCK_T=_BLOCK_T, FIXED=fixed is not None, LOC_N=loc_n,
                  NUM_STEPS=steps, BLOCK_LOC=next_pow2(loc_n), CSR=csr is not None,
                  QO=qo_indptr is not None, EXT_LOC=ext_fixed is not None, **sched,
                  num_warps=4)
    return KernelLaunch(_prefix_slots_kernel, (bs, tiles), tail, consts)
