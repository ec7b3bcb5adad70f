"""The FlashAttention glue's round tables in one Triton launch (imported where Triton runs).

A draft round's tables (``_decode._Buffers``) or an extend batch's (``_extend._Buffers``) are
written by one kernel launch, with the values the torch fill (``_fill`` of either glue, used
where Triton does not run) writes, bit for bit. With the graph's fixed buffers given
(``fixed``), the same launch copies the caller's batch into them, padded to the captured
size (request row 0, ``seq_lens`` 1, slot 0), so a CUDA-graph metadata call is one launch.

The launches are ``KernelLaunch``es: kept by the glue per signature of the caller's index
tensors (``specattn.graph_calls``), and run again on new tensors of that signature with
Triton's compiled kernel launched directly (``specattn.kernels.kernel_launch``). The caller's
index tensors are read through their strides and declared ``do_not_specialize_on_alignment``
so that their addresses may move between launches.

Every read stays inside its tensor whatever the values (request rows clamped into
``req_to_token``; positions into its row and slots into the pool, as the torch fill does),
so an invalid batch on a device, where graph calls do not check values, reads no memory out
of bounds. The buffers are the glue's own, contiguous.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...kernels.kernel_launch import KernelLaunch
from ...util import ceil_div, next_pow2

__all__ = ["decode_tables", "extend_tables"]

_CALLER_DECODE = ("ReqPoolIdx", "SeqLens", "OutLoc")
_CALLER_EXTEND = ("ReqPoolIdx", "SeqLens", "ExtLens", "OutLoc")
MAX_BLOCK_X = 1024  # table columns per program and loop trip
MAX_COLUMN_PROGRAMS = 16  # programs per table row (or per request's K lanes): grid axis 1


@triton.jit
def _page_ids(Row, p, pages, r2t_width, num_slots, PAGE: tl.constexpr):
    """Page ids ``R[p * P] // P`` (slots clamped into the pool) where ``p < pages``, else 0:
    ``metadata.prefix_page_table``'s entries, int32."""
    valid = p < pages
    pos = tl.minimum(p.to(tl.int64) * PAGE, r2t_width - 1)
    slot = tl.load(Row + pos, mask=valid, other=0).to(tl.int64)
    slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    return tl.where(valid, slot // PAGE, 0).to(tl.int32)


@triton.jit(do_not_specialize_on_alignment=_CALLER_DECODE)
def _decode_tables_kernel(ReqPoolIdx, SeqLens, OutLoc, ReqToToken, Table, Used, Hist,
                          LaneLen, FixRpi, FixSeq, FixLoc, stride_rpi, stride_seq,
                          stride_loc_b, stride_loc_k, stride_loc_s, stride_r2t, r2t_width,
                          max_reqs, num_slots, raw_bs, table_width, stride_table, stride_used,
                          TOPK: tl.constexpr, NUM_STEPS: tl.constexpr, BLOCK_S: tl.constexpr,
                          PAGE: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr,
                          CHUNK_SPAN: tl.constexpr, TWO_PASS: tl.constexpr,
                          FIXED: tl.constexpr, BLOCK_X: tl.constexpr):
    """Grid ``(B * K, X)``: lane ``z = b * K + j``, column program ``x``. Requests
    ``b >= raw_bs`` are padding (request row 0, ``seq_lens`` 1, slot 0).

    Program ``x == 0`` of a lane writes the lane's entries (``FIXED``: its slots into
    ``FixLoc``, and for ``j == 0`` the request into ``FixRpi`` / ``FixSeq``, int64).
    ``TWO_PASS``: ``Hist [>=B*K, S]`` = the lane's slots (int32), ``Used [>=B*C]`` = keys of
    each prefix chunk ``clamp(L - c * CHUNK_SPAN, 0, CHUNK_SPAN)`` (lane 0); ``Table``
    (``[>=B, table_width]``) row ``b`` = the prefix's page ids, its column blocks shared by
    the ``K * X`` programs of the request. One pass: ``LaneLen [>=B*K]`` = ``L`` (int64),
    ``Used [S, stride_used]`` column ``z`` = ``L + t + 1``, ``Table`` row ``z`` =
    ``[R[0 : L] | the lane's S slots | 0...]`` (slots, int32), its column blocks shared by
    the lane's ``X`` programs."""
    z = tl.program_id(0)
    x = tl.program_id(1)
    nx = tl.num_programs(1)
    b = z // TOPK
    j = z % TOPK
    real = b < raw_bs
    src = tl.minimum(b, raw_bs - 1)  # padding reads a real request, then drops it
    seq = tl.where(real, tl.load(SeqLens + src * stride_seq).to(tl.int64), 1)
    rpi = tl.where(real, tl.load(ReqPoolIdx + src * stride_rpi).to(tl.int64), 0)
    row = ReqToToken + tl.minimum(tl.maximum(rpi, 0), max_reqs - 1) * stride_r2t
    lane_loc = OutLoc + src.to(tl.int64) * stride_loc_b + j * stride_loc_k
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_STEPS
    offs_x = tl.arange(0, BLOCK_X)
    if x == 0:
        loc = tl.load(lane_loc + offs_s * stride_loc_s, mask=s_ok, other=0)
        loc = tl.where(real, loc, 0)
        if FIXED:
            tl.store(FixLoc + z.to(tl.int64) * NUM_STEPS + offs_s, loc.to(tl.int64), mask=s_ok)
            if j == 0:
                tl.store(FixRpi + b, rpi)
                tl.store(FixSeq + b, seq)
        if TWO_PASS:
            tl.store(Hist + z.to(tl.int64) * NUM_STEPS + offs_s, loc.to(tl.int32), mask=s_ok)
            if j == 0:
                c = tl.arange(0, BLOCK_C)
                used = tl.minimum(tl.maximum(seq - c * CHUNK_SPAN, 0), CHUNK_SPAN)
                tl.store(Used + b * CHUNKS + c, used.to(tl.int32), mask=c < CHUNKS)
        else:
            tl.store(LaneLen + z, seq)
            tl.store(Used + offs_s * stride_used + z, (seq + offs_s + 1).to(tl.int32),
                     mask=s_ok)
    if TWO_PASS:
        pages = (seq + PAGE - 1) // PAGE
        out = Table + b.to(tl.int64) * stride_table
        for x0 in range((j * nx + x) * BLOCK_X, table_width, TOPK * nx * BLOCK_X):
            p = x0 + offs_x
            tl.store(out + p, _page_ids(row, p, pages, r2t_width, num_slots, PAGE),
                     mask=p < table_width)
    else:
        out = Table + z.to(tl.int64) * stride_table
        for x0 in range(x * BLOCK_X, table_width, nx * BLOCK_X):
            col = x0 + offs_x
            in_prefix = col < seq
            slot = tl.load(row + tl.minimum(col, r2t_width - 1), mask=in_prefix,
                           other=0).to(tl.int64)
            slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1).to(tl.int32)
            t = col - seq
            in_hist = (t >= 0) & (t < NUM_STEPS)
            new = tl.load(lane_loc + t * stride_loc_s, mask=in_hist, other=0)
            new = tl.where(in_hist & real, new, 0).to(tl.int32)
            val = tl.where(in_prefix, slot, new)
            tl.store(out + col, val, mask=col < table_width)


@triton.jit(do_not_specialize_on_alignment=_CALLER_EXTEND)
def _extend_tables_kernel(ReqPoolIdx, SeqLens, ExtLens, OutLoc, ReqToToken, Table, Seq, Cu,
                          FixLoc, CTable, CUsed, CCu, stride_rpi, stride_seq, stride_ext,
                          stride_loc, stride_r2t, r2t_width, max_reqs, num_slots, bs,
                          num_tokens, fix_n, table_width, stride_table, stride_ctable,
                          PAGE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_X: tl.constexpr,
                          BLOCK_T: tl.constexpr, FIXED: tl.constexpr, CHUNKS: tl.constexpr,
                          CHUNK_PAGES: tl.constexpr):
    """Grid ``(B, X)``: request ``b``, column program ``x``. Program ``x == 0`` writes
    ``Cu[b + 1] = E[0] + ... + E[b]`` (``Cu[0] = 0``) and ``Seq[b]``, int32; ``Table`` row
    ``b`` gets page ids, its column blocks shared by the ``X`` programs. ``FIXED``: the
    ``num_tokens`` new tokens' slots into ``FixLoc [fix_n]`` (int64), then slot 0 (the
    padding's: the captured KV write covers ``fix_n`` rows), in blocks shared by all
    programs.

    ``CHUNKS == 1``: ``Seq[b] = L'``, ``Table`` row ``b`` = the page ids of ``R[0 : L']``.
    ``CHUNKS > 1`` (a split extend): the tail starts at ``s = ((L' - E) // P) * P``, the page
    of the first new token: ``Seq[b] = L' - s``, ``Table`` row ``b`` = the page ids from
    ``s``'s page on (``table_width`` columns); chunk ``c`` (``CHUNK_PAGES`` pages) of the
    prefix ``R[0 : s]`` is row ``c * B + b`` of ``CTable`` (its page ids), ``CUsed[c * B +
    b] = clamp(s - c * CHUNK_PAGES * P, 0, CHUNK_PAGES * P)`` keys and ``CCu[c * B + b + 1]
    = c * num_tokens + Cu[b + 1]`` (``CCu[0] = 0``)."""
    b = tl.program_id(0)
    x = tl.program_id(1)
    nx = tl.num_programs(1)
    seq = tl.load(SeqLens + b * stride_seq).to(tl.int64)
    start = seq * 0  # the tail's first key
    if CHUNKS > 1:
        start = ((seq - tl.load(ExtLens + b * stride_ext).to(tl.int64)) // PAGE) * PAGE
    if x == 0:
        offs_b = tl.arange(0, BLOCK_B)
        ext = tl.load(ExtLens + offs_b * stride_ext, mask=offs_b <= b, other=0).to(tl.int64)
        cu = tl.sum(ext, 0).to(tl.int32)
        tl.store(Cu + b + 1, cu)
        tl.store(Seq + b, (seq - start).to(tl.int32))
        if b == 0:
            tl.store(Cu, 0)
        if CHUNKS > 1:
            span = CHUNK_PAGES * PAGE
            for c in range(CHUNKS):
                used = tl.minimum(tl.maximum(start - c * span, 0), span)
                tl.store(CUsed + c * bs + b, used.to(tl.int32))
                tl.store(CCu + c * bs + b + 1, c * num_tokens + cu)
            if b == 0:
                tl.store(CCu, 0)
    rpi = tl.load(ReqPoolIdx + b * stride_rpi).to(tl.int64)
    row = ReqToToken + tl.minimum(tl.maximum(rpi, 0), max_reqs - 1) * stride_r2t
    pages = (seq + PAGE - 1) // PAGE
    first = start // PAGE
    out = Table + b.to(tl.int64) * stride_table
    offs_x = tl.arange(0, BLOCK_X)
    for x0 in range(x * BLOCK_X, table_width, nx * BLOCK_X):
        p = x0 + offs_x
        tl.store(out + p, _page_ids(row, first + p, pages, r2t_width, num_slots, PAGE),
                 mask=p < table_width)
    if CHUNKS > 1:  # the prefix's pages, CHUNK_PAGES to a row of CTable
        for x0 in range(x * BLOCK_X, CHUNKS * CHUNK_PAGES, nx * BLOCK_X):
            p = x0 + offs_x
            dest = CTable + ((p // CHUNK_PAGES) * bs + b).to(tl.int64) * stride_ctable + \
                p % CHUNK_PAGES
            tl.store(dest, _page_ids(row, p, pages, r2t_width, num_slots, PAGE),
                     mask=p < CHUNKS * CHUNK_PAGES)
    if FIXED:  # the new tokens' slots, then slot 0 up to fix_n (a replay of fewer tokens)
        offs_t = tl.arange(0, BLOCK_T)
        for t0 in range((b * nx + x) * BLOCK_T, fix_n, bs * nx * BLOCK_T):
            t = t0 + offs_t
            loc = tl.load(OutLoc + t * stride_loc, mask=t < num_tokens, other=0)
            tl.store(FixLoc + t, loc.to(tl.int64), mask=t < fix_n)


def _columns(width: int, owners: int) -> tuple[int, int]:
    """``(BLOCK_X, X)``: the column block and the column programs for rows of ``width``
    columns shared by ``owners`` programs each (at most ``MAX_COLUMN_PROGRAMS`` per row)."""
    block = min(MAX_BLOCK_X, next_pow2(width, lo=16))
    return block, max(1, min(MAX_COLUMN_PROGRAMS, ceil_div(ceil_div(width, block), owners)))


def decode_tables(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                  out_cache_loc: torch.Tensor, runner, bufs, bs: int, page_size: int,
                  fixed: Optional[tuple] = None) -> KernelLaunch:
    """Fill ``bufs`` (a ``_decode._Buffers`` of either kind) for a draft round of ``bs``
    requests in one launch, and return the launch, which repeats it for other
    ``(req_pool_indices, seq_lens, out_cache_loc)`` of these dtypes, devices, shapes and
    strides.

    out_cache_loc: ``[B, K, S]``, ``B <= bs``. fixed: a CUDA-graph round's fixed
    ``(req_pool_indices [>=bs], seq_lens [>=bs], out_cache_loc [>=bs, K, S])`` (int64,
    contiguous), filled with the ``B`` requests given, padded to ``bs``; without it
    ``B == bs``."""
    raw, topk, steps = out_cache_loc.shape
    r2t = runner.req_to_token
    two_pass = bufs.two_pass
    if two_pass:
        table, used, hist, lane_len = bufs.prefix_pt, bufs.chunk_used, bufs.hist_pt, None
        owners = topk
        span = bufs.chunk_pages * page_size
    else:
        table, used, hist, lane_len = bufs.full_pt, bufs.full_used, None, bufs.lane_len
        owners, span = 1, 0
    width = table.shape[1]
    block_x, nx = _columns(width, owners)
    fix = fixed if fixed is not None else (table, table, table)  # never written
    tail = (r2t, table, used, table if hist is None else hist,
            table if lane_len is None else lane_len, *fix,
            req_pool_indices.stride(0), seq_lens.stride(0), out_cache_loc.stride(0),
            out_cache_loc.stride(1), out_cache_loc.stride(2), r2t.stride(0), r2t.shape[1],
            r2t.shape[0], runner.num_slots, raw, width, table.stride(0), used.stride(0))
    consts = dict(TOPK=topk, NUM_STEPS=steps, BLOCK_S=next_pow2(steps), PAGE=page_size,
                  CHUNKS=bufs.chunks, BLOCK_C=next_pow2(bufs.chunks), CHUNK_SPAN=span,
                  TWO_PASS=two_pass, FIXED=fixed is not None, BLOCK_X=block_x,
                  num_warps=4 if block_x >= 512 else 1)
    launch = KernelLaunch(_decode_tables_kernel, (bs * topk, nx), tail, consts)
    launch(req_pool_indices, seq_lens, out_cache_loc)
    return launch


def extend_tables(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                  extend_lens: torch.Tensor, out_cache_loc: torch.Tensor, runner, bufs,
                  page_size: int, fixed_loc: Optional[torch.Tensor] = None,
                  tail_pages: Optional[int] = None) -> KernelLaunch:
    """Fill ``bufs`` (an ``_extend._Buffers``, split or not) for an extend batch in one
    launch and return the launch (called with ``(req_pool_indices, seq_lens, extend_lens,
    out_cache_loc)``, as ``decode_tables``). fixed_loc: a CUDA-graph round's fixed
    ``out_cache_loc`` view (int64, ``[>= T]``), which gets the new tokens' slots and slot 0
    in its rows past them (a replay of fewer tokens than its capture). tail_pages:
    the tail table's columns a split batch reads at most (default: all)."""
    bs, tokens = req_pool_indices.shape[0], out_cache_loc.shape[0]
    r2t, table = runner.req_to_token, bufs.pt
    width = table.shape[1] if tail_pages is None else min(tail_pages, table.shape[1])
    split = bufs.chunks > 1
    block_x, nx = _columns(max(width, bufs.chunks * bufs.chunk_pages if split else 0), 1)
    ctable = bufs.cpt if split else table
    tail = (r2t, table, bufs.seq, bufs.cu, table if fixed_loc is None else fixed_loc,
            ctable, bufs.cused if split else bufs.seq, bufs.ccu if split else bufs.cu,
            req_pool_indices.stride(0), seq_lens.stride(0), extend_lens.stride(0),
            out_cache_loc.stride(0), r2t.stride(0), r2t.shape[1], r2t.shape[0],
            runner.num_slots, bs, tokens, tokens if fixed_loc is None else fixed_loc.shape[0],
            width, table.stride(0), ctable.stride(0))
    consts = dict(PAGE=page_size, BLOCK_B=next_pow2(bs), BLOCK_X=block_x,
                  BLOCK_T=min(MAX_BLOCK_X, next_pow2(ceil_div(tokens, bs), lo=16)),
                  FIXED=fixed_loc is not None, CHUNKS=bufs.chunks,
                  CHUNK_PAGES=bufs.chunk_pages if split else 1,
                  num_warps=4 if block_x >= 512 else 1)
    launch = KernelLaunch(_extend_tables_kernel, (bs, nx), tail, consts)
    launch(req_pool_indices, seq_lens, extend_lens, out_cache_loc)
    return launch
