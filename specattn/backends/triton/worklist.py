"""The balanced work list of plan ``gluon-wl``: ragged batches at uniform speed.

Request ``b`` holds ``units_b`` key tiles (its prefix tiles, then ``tail_units`` for its
history at the round's last step); ``chunk`` is the smallest tile count with
``sum_b ceil(units_b / chunk) <= P`` (``P``: programs per row tile, at least ``B``). Laid end
to end, request ``b`` starts at unit ``U[b]`` (a multiple of ``chunk``) and program ``p``
takes units ``[p * chunk, (p + 1) * chunk)``: one segment of one request. A request with one
program is written directly; the others write a partial (in the query's dtype:
``launchers.partial_dtype``) and an fp32 natural-log LSE into slot ``p + b``, merged in fp32
by ``merge_segments_kernel`` (no launch at ``P == B``).

``Work`` (int32, ``work_numel(P, B)``): ``[chunk, first request of each program (B: none),
U[0], ..., U[B]]``, written on the device once per round (graph-safe) by ``write_work``: in
the round's metadata launch (``launchers.decode_metadata``), or alone by ``fill``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernels.merge import ONE_WARP_LOAD, MergeTiles, merge_parts
from ...kernels.pdl import launch_args, wait_for_primary
from ...util import next_pow2, prev_pow2, sm_count
from . import plans
from .plans import TILE_ROWS as BLOCK_M  # rows per program: the wgmma height
from .plans import num_row_tiles


def programs_per_row_tile(row_tiles: int, batch: int, device: torch.device) -> int:
    """``P``: one program per SM over all row tiles (the Gluon kernel's ~200 KB of shared
    memory leaves room for one), and one per request at the least."""
    return max(1, batch, plans.sms(device) // max(1, row_tiles))


def lane_span(topk: int, heads: int) -> int:
    """The most lanes one 64-row tile of a request's ``topk * heads`` rows touches."""
    rows = topk * heads
    return max(min(topk, (lo + BLOCK_M + heads - 1) // heads) - lo // heads
               for lo in range(0, rows, BLOCK_M))


def tail_units(topk: int, heads: int, num_steps: int, block_n: int) -> int:
    """Tail tiles a request's units reserve: its row tile's history keys at the last step."""
    return triton.cdiv(lane_span(topk, heads) * num_steps, block_n)


def work_numel(programs: int, batch: int) -> int:
    return 2 + programs + batch


def partial_rows(topk: int, heads: int) -> int:
    """Rows of one partial slot: a request's ``topk * heads`` rows, padded to row tiles."""
    return num_row_tiles(topk * heads) * BLOCK_M


@triton.jit
def write_work(offs, seq, bs, Work, num_programs, tail, BLOCK_P: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """``Work = [chunk, first request per program, U[0..B]]`` from the prefix lengths ``seq``
    of requests ``offs`` (a block ``0, 1, ...``; those ``< bs`` are the batch)."""
    ok = offs < bs
    units = tl.where(ok, (seq + BLOCK_N - 1) // BLOCK_N + tail, 0)
    # The smallest chunk with sum(ceil(units / chunk)) <= P, by bisection between the even
    # share and the longest request (one program each: P >= B).
    lo = tl.maximum((tl.sum(units, 0) + num_programs - 1) // num_programs, 1)
    hi = tl.maximum(tl.max(units, 0), lo)
    for _ in range(32):
        mid = (lo + hi) // 2
        fits = tl.sum((units + mid - 1) // mid, 0) <= num_programs
        hi = tl.where(fits, mid, hi)
        lo = tl.where(fits, lo, mid + 1)
    chunk = hi
    units = (units + chunk - 1) // chunk * chunk
    ends = tl.cumsum(units, 0)
    total = tl.sum(units, 0)
    tl.store(Work, chunk)
    tl.store(Work + 1 + num_programs + offs, ends - units, mask=ok)
    tl.store(Work + 1 + num_programs + bs, total)
    for p0 in range(0, num_programs, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        # The request holding unit p * chunk: the count of requests that end at or before it.
        before = (ends[None, :] <= (offs_p * chunk)[:, None]) & ok[None, :]
        tl.store(Work + 1 + offs_p, tl.sum(before.to(tl.int32), 1), mask=offs_p < num_programs)


@triton.jit
def _worklist_kernel(SeqLens, stride_seq, Work, bs, num_programs, tail,
                     BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid ``(1,)``: ``write_work`` for the ``bs`` prefix lengths ``SeqLens``."""
    offs = tl.arange(0, BLOCK_B)
    ok = offs < bs
    seq = tl.load(SeqLens + offs * stride_seq, mask=ok, other=0).to(tl.int32)
    write_work(offs, seq, bs, Work, num_programs, tail, BLOCK_P, BLOCK_N)


def block_p(block_b: int) -> int:
    """Programs per step of ``write_work``'s last loop: a ``[BLOCK_P, BLOCK_B]`` tile of at
    most 4096 elements."""
    return max(1, min(64, 4096 // block_b))


def fill(seq_lens: torch.Tensor, work: torch.Tensor, programs: int, tail: int,
         block_n: int) -> None:
    """Write ``work`` for a round (one launch). seq_lens: ``[B]`` prefix lengths;
    ``programs >= B`` (``programs_per_row_tile``). A round's metadata launch writes it too
    (``launchers.decode_metadata``)."""
    bs = seq_lens.shape[0]
    block_b = next_pow2(bs)
    _worklist_kernel[(1,)](seq_lens, seq_lens.stride(0), work, bs, programs, tail,
                           BLOCK_B=block_b, BLOCK_P=block_p(block_b), BLOCK_N=block_n,
                           num_warps=4)


@triton.jit
def merge_segments_kernel(MidO, MidLse, Out, Work, stride_mo_g, stride_ml_g, stride_ot,
                          stride_oh, num_programs, TOPK, H: tl.constexpr, D_V: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Grid ``(B * K, H, cdiv(D_V, BLOCK_D))`` (``segment_tiles``): columns ``[c *
    BLOCK_D, (c + 1) * BLOCK_D)`` of ``Out[z, h]`` from request ``b = z // K``'s partial
    slots, row ``(z % K) * H + h`` of each (``MidO [slots, rows, D_V]``, ``MidLse [slots,
    rows]``; ``merge.merge_parts``); requests with one segment were written by the kernel
    and are left alone. ``PDL``: a programmatic dependent launch, waits for the partials."""
    if PDL:
        wait_for_primary()
    z = tl.program_id(0)
    h = tl.program_id(1)
    b = z // TOPK
    chunk = tl.load(Work)
    lo = tl.load(Work + 1 + num_programs + b)
    hi = tl.load(Work + 2 + num_programs + b)
    p_first = lo // chunk
    n_parts = (hi - 1) // chunk - p_first + 1
    if n_parts > 1:
        row = (z % TOPK) * H + h
        offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D_V
        first = (p_first + b).to(tl.int64)
        acc, den = merge_parts(MidO + first * stride_mo_g + row * D_V,
                               MidLse + first * stride_ml_g + row, stride_mo_g, stride_ml_g,
                               n_parts, offs_d, d_ok, BLOCK_P)
        o = acc / tl.where(den > 0.0, den, 1.0)
        tl.store(Out + z.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
                 o.to(Out.dtype.element_ty), mask=d_ok)


SEGMENT_PARTS = 32  # segments a load at most
SEGMENT_PROGRAMS_PER_SM = 6  # the grid the column chunks aim for
WHOLE_ROW_LOAD = 2 * ONE_WARP_LOAD  # a whole row a load, above ONE_WARP_LOAD
WHOLE_ROW_PROGRAMS_PER_SM = 2  # the rows such loads need


def segment_tiles(rows: int, d_v: int, segments: int, device: torch.device) -> MergeTiles:
    """The segment merge's tiles for ``rows`` output rows (``B * K * H``) of ``d_v`` columns,
    a request's partials about ``segments`` segments (``P // B``): one warp a program (its
    fold needs no block barrier); segments a load, the largest power of two at most
    ``segments`` up to ``SEGMENT_PARTS`` (a load past a request's segments is masked
    traffic). Columns, the widest power of two whose load holds ``ONE_WARP_LOAD`` values,
    halved down to 32 while the grid holds fewer than ``SEGMENT_PROGRAMS_PER_SM`` programs
    per SM; but a whole row a program where the row's load is above ``ONE_WARP_LOAD`` and
    at most ``WHOLE_ROW_LOAD`` values and the rows give each SM
    ``WHOLE_ROW_PROGRAMS_PER_SM`` programs (a larger one-warp load spills: 16384 values
    took 11x longer). A sweep's fastest: 8192-value rows at ``mla-b8-p64`` (512 rows of 16
    segments), though 4096-value rows lost to half rows there (8 segments a load)."""
    block_p = min(SEGMENT_PARTS, prev_pow2(max(1, segments)))
    block_d = next_pow2(d_v, 16)
    sms = sm_count(device) or 0
    if ONE_WARP_LOAD < block_d * block_p <= WHOLE_ROW_LOAD and \
            rows >= WHOLE_ROW_PROGRAMS_PER_SM * sms > 0:
        return MergeTiles(1, block_d, block_p, 1)
    programs = SEGMENT_PROGRAMS_PER_SM * sms
    while block_d > 32 and (block_d * block_p > ONE_WARP_LOAD
                            or rows * triton.cdiv(d_v, block_d) < programs):
        block_d //= 2
    return MergeTiles(triton.cdiv(d_v, block_d), block_d, block_p, 1)


def merge(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, work: torch.Tensor,
          programs: int, topk: int, pdl: bool = False) -> None:
    """Merge the partials of every request with several segments into ``out [B*K, H, D]``
    (no launch when ``programs`` is the batch: one program, a direct write, per request).
    mid_o: ``[slots, partial_rows, D]`` (fp32, bf16 or fp16); mid_lse: ``[slots,
    partial_rows]`` fp32.
    ``pdl``: a programmatic dependent launch (sm90+) after the kernel that wrote them."""
    if programs > out.shape[0] // topk:
        _merge_launch(mid_o, mid_lse, out, work, programs, topk, pdl)


def _merge_launch(mid_o, mid_lse, out, work, programs, topk, pdl) -> None:
    rows, heads, d_v = out.shape
    batch = max(1, rows // max(1, topk))
    # A request's segments number about programs / batch (more for a long one: the loop).
    t = segment_tiles(rows * heads, d_v, programs // batch, out.device)
    merge_segments_kernel[(rows, heads, t.chunks)](
        mid_o, mid_lse, out, work, mid_o.stride(0), mid_lse.stride(0), out.stride(0),
        out.stride(1), programs, topk, H=heads, D_V=d_v, BLOCK_D=t.block_d,
        BLOCK_P=t.block_p, num_warps=t.num_warps, **launch_args(pdl, dependent=True))
