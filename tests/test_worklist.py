"""The Gluon MLA kernel's balanced work list (``worklist``), on the CPU.

- ``schedule``'s plan: every unit of every request in exactly one segment, no program over
  ``chunk`` units, one partial slot per segment, a request written directly exactly when it
  has one segment; ``fill`` (Triton, interpreted) writes the same table.
- ``merge_segments_kernel`` against a float64 softmax merge of random partials (NaN in every
  slot it must not read, and in the rows of requests written directly; up to 9 slots a
  request, more than one load of ``BLOCK_P``).
- The launcher path of plan ``gluon-wl``: a stand-in for the Gluon kernel that reads the
  table ``fill`` wrote and writes ``torch_ref``'s answer as the kernel does (directly, or
  into slot ``p + b`` with a random LSE), merged by the real merge kernel; the kernel itself
  runs on the H200 (``tests/gpu/test_sm90_mla_gpu.py``, plan ``gluon-wl``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import DEV, require_triton_interpret
from specattn.backends.torch_ref import reference_decode
from specattn.data import AttentionLayer
from specattn.fp8 import quantize

require_triton_interpret()

from specattn.backends.triton import gluon_mla, plans, worklist  # noqa: E402
from specattn.kernels import fp8_codes as F  # noqa: E402


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The plan ``worklist.fill`` writes and the kernel walks, in Python: the tests' oracle.
@dataclass(frozen=True)
class Segment:
    program: int
    request: int
    first_unit: int  # request-relative
    end_unit: int
    only: bool  # the request's only segment: written directly

    @property
    def slot(self) -> int:
        return self.program + self.request


@dataclass(frozen=True)
class Schedule:
    chunk: int
    first_request: list  # per program
    unit_starts: list  # U[0..B]
    segments: list

    def parts(self, b: int) -> range:
        """Slots of request ``b``'s partials (empty when it is written directly)."""
        lo, hi = self.unit_starts[b] // self.chunk, (self.unit_starts[b + 1] - 1) // self.chunk
        return range(lo + b, hi + b + 1) if hi > lo else range(0)


def schedule(prefix_lens: list, tail: int, block_n: int, programs: int) -> Schedule:
    """The plan ``fill`` writes and the kernel walks, in Python (``programs >= B``)."""
    if programs < len(prefix_lens):
        raise ValueError(f"programs must be at least the batch ({len(prefix_lens)}), got "
                         f"{programs}")
    units = [_cdiv(n, block_n) + tail for n in prefix_lens]
    chunk = max(1, _cdiv(sum(units), programs))
    while sum(_cdiv(u, chunk) for u in units) > programs:
        chunk += 1
    starts = [0]
    for u in units:
        starts.append(starts[-1] + _cdiv(u, chunk) * chunk)
    first, segments = [], []
    for p in range(programs):
        lo, hi = p * chunk, (p + 1) * chunk
        b = sum(1 for e in starts[1:] if e <= lo)
        first.append(b)
        while b < len(units) and starts[b] < hi:
            segments.append(Segment(p, b, max(lo, starts[b]) - starts[b],
                                    min(hi, starts[b] + units[b]) - starts[b],
                                    lo <= starts[b] and starts[b + 1] <= hi))
            b += 1
    return Schedule(chunk, first, starts, segments)




@given(lens=st.lists(st.integers(0, 700), min_size=1, max_size=12),
       tail=st.integers(1, 3), block_n=st.sampled_from([16, 64]),
       extra=st.integers(0, 20))
def test_schedule_covers_every_unit_once(lens, tail, block_n, extra):
    programs = len(lens) + extra
    plan = schedule(lens, tail, block_n, programs)
    units = [math.ceil(n / block_n) + tail for n in lens]
    # The smallest chunk that gives every request whole programs within the P programs.
    c = plan.chunk
    assert sum(math.ceil(u / c) for u in units) <= programs
    assert c == 1 or sum(math.ceil(u / (c - 1)) for u in units) > programs
    assert plan.unit_starts == [sum(math.ceil(u / c) * c for u in units[:b])
                                for b in range(len(lens) + 1)]
    seen = {b: [] for b in range(len(lens))}
    per_program = [0] * programs
    for s in plan.segments:
        assert 0 <= s.first_unit < s.end_unit <= units[s.request]
        seen[s.request].append((s.first_unit, s.end_unit))
        per_program[s.program] += s.end_unit - s.first_unit
    for b, pieces in seen.items():
        pieces.sort()
        assert pieces[0][0] == 0 and pieces[-1][1] == units[b]
        assert all(a[1] == c[0] for a, c in zip(pieces, pieces[1:]))  # no gap, no overlap
        only = [s.only for s in plan.segments if s.request == b]
        assert only == [len(pieces) == 1] * len(only)
        slots = [s.slot for s in plan.segments if s.request == b]
        assert (list(plan.parts(b)) == sorted(slots)) == (len(pieces) > 1)
    assert max(per_program) <= plan.chunk
    assert len({s.program for s in plan.segments}) == len(plan.segments)  # one per program
    slots = [s.slot for s in plan.segments]
    assert len(set(slots)) == len(slots) and max(slots) < programs + len(lens)


@settings(max_examples=50)  # a kernel launch per example under the interpreter: ~0.25 s each
@given(lens=st.lists(st.integers(0, 700), min_size=1, max_size=40),
       tail=st.integers(1, 3), block_n=st.sampled_from([16, 64]),
       extra=st.integers(0, 100))
def test_fill_writes_the_schedule(lens, tail, block_n, extra):
    programs = len(lens) + extra
    plan = schedule(lens, tail, block_n, programs)
    # Engine-style: the prefix lengths as a strided int64 column of a wider tensor.
    seq = torch.tensor([[n, -1] for n in lens], dtype=torch.int64, device=DEV)[:, 0]
    work = torch.full((worklist.work_numel(programs, len(lens)) + 3,), -7, dtype=torch.int32,
                      device=DEV)
    worklist.fill(seq, work, programs, tail, block_n)
    want = [plan.chunk] + plan.first_request + plan.unit_starts
    assert work.tolist() == want + [-7] * 3


@pytest.mark.parametrize("topk,heads,steps,block_n,want", [
    (4, 16, 5, 64, 1),  # mla-long: 4 lanes x 5 keys in one tile
    (1, 16, 5, 64, 1),
    (8, 16, 5, 64, 1),  # two row tiles of 4 lanes each
    (2, 128, 5, 64, 1),  # a lane spans two row tiles
    (8, 24, 9, 16, 3),  # 64 rows of 24 heads touch up to 4 lanes: 36 keys
])
def test_tail_units(topk, heads, steps, block_n, want):
    assert worklist.tail_units(topk, heads, steps, block_n) == want


# The partials: fp32, or the query's dtype as ``gluon-wl`` writes them.
@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sms", [None, 132])  # one column chunk; 2 chunks of 32 (an H200)
@pytest.mark.parametrize("programs", [9, 20])  # at most 4 slots per request (a load each),
def test_merge_segments_kernel(monkeypatch, programs, sms, part_dtype):  # and 9 (loads of 4)
    monkeypatch.setattr(worklist, "sm_count", lambda device: sms)
    gen = torch.Generator().manual_seed(programs)
    lens, tail, block_n, topk, heads, d = [500, 3, 260, 0, 90], 1, 16, 2, 3, 64
    plan = schedule(lens, tail, block_n, programs)
    bs, rows = len(lens), worklist.partial_rows(topk, heads)
    work = torch.tensor([plan.chunk] + plan.first_request + plan.unit_starts,
                        dtype=torch.int32, device=DEV)
    mid_o = torch.full((programs + bs, rows, d), float("nan"), dtype=part_dtype, device=DEV)
    mid_lse = torch.full((programs + bs, rows), float("nan"), device=DEV)
    out = torch.full((bs * topk, heads, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    want = torch.full(out.shape, float("nan"), dtype=torch.float64)
    for b in range(bs):
        slots = list(plan.parts(b))
        if not slots:
            continue
        o = torch.randn(len(slots), topk * heads, d, generator=gen, dtype=torch.float64)
        lse = 5 * torch.randn(len(slots), topk * heads, generator=gen, dtype=torch.float64)
        lse[0, 0] = float("-inf")  # a segment that saw no key for this row
        mid_o[slots, :topk * heads] = o.to(part_dtype).to(DEV)
        mid_lse[slots, :topk * heads] = lse.float().to(DEV)
        o = o.to(part_dtype).double()  # the partials as stored
        w = torch.softmax(lse, 0)
        want[b * topk:(b + 1) * topk] = (w[..., None] * o).sum(0).view(topk, heads, d)
    worklist.merge(mid_o, mid_lse, out, work, programs, topk)
    assert max(len(plan.parts(b)) for b in range(bs)) == (4 if programs == 9 else 9)
    merged = ~torch.isnan(want)
    assert merged.any() and (~merged).any()  # both kinds of request in the batch
    torch.testing.assert_close(out.cpu().double()[merged], want[merged], atol=2e-2, rtol=2e-2)
    assert torch.isnan(out.cpu()[~merged]).all()  # direct requests: left to the kernel


def test_segment_tiles_one_warp_at_the_mla_serving_shapes(monkeypatch):
    """One warp a program; segments a load the power of two at most a request's share (up to
    32); columns as wide as 4096 values a load allow, narrower where the grid would hold
    fewer than 6 programs per SM; a whole row where its load is above 4096 values and at
    most 8192 and the rows give each SM two programs (the fastest or next-fastest of a
    sweep, H200)."""
    dev = torch.device(DEV)
    tiles = worklist.segment_tiles
    assert tiles(4 * 16, 512, 132, dev) == (4, 128, 32, 1)  # no SM count: the load alone
    monkeypatch.setattr(worklist, "sm_count", lambda device: 132)
    assert tiles(1 * 4 * 16, 512, 132, dev) == (16, 32, 32, 1)  # mla-b1-32k: 1024 programs
    assert tiles(4 * 4 * 16, 512, 33, dev) == (4, 128, 32, 1)  # mla-small
    assert tiles(8 * 4 * 16, 512, 16, dev) == (1, 512, 16, 1)  # mla-b8-p64: a whole row
    assert tiles(8 * 16, 512, 16, dev) == (8, 64, 16, 1)  # at K 1: too few rows for whole ones
    assert tiles(9 * 4 * 16, 512, 8, dev) == (2, 256, 8, 1)  # 4096-value rows: halved
    assert tiles(32 * 4 * 16, 512, 4, dev) == (1, 512, 4, 1)  # mla-long: a program a row
    assert tiles(2, 512, 1, dev) == (16, 32, 1, 1)  # never narrower than 32 columns
    assert tiles(2, 16, 40, dev) == (1, 16, 32, 1)  # nor wider than the row


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 8192), d_v=st.integers(1, 1024), segments=st.integers(1, 600),
       sms=st.sampled_from([None, 1, 78, 132, 170]))
def test_segment_tiles_cover_the_row_in_one_warp_loads(rows, d_v, segments, sms):
    """Any shape: one warp; the chunks cover the row; a load holds at most 4096 values (or
    32 columns of up to 32 segments, or a whole row of at most 8192 values where the rows
    alone give each SM two programs) and never more segments than a request has."""
    import unittest.mock

    with unittest.mock.patch.object(worklist, "sm_count", lambda device: sms):
        t = worklist.segment_tiles(rows, d_v, segments, torch.device(DEV))
    assert t.num_warps == 1 and t.block_p <= min(segments, worklist.SEGMENT_PARTS)
    assert t.chunks == -(-d_v // t.block_d) and (t.chunks - 1) * t.block_d < d_v
    assert t.block_d & (t.block_d - 1) == 0 and t.block_p & (t.block_p - 1) == 0
    load = t.block_d * t.block_p
    if load > max(worklist.ONE_WARP_LOAD, 32 * t.block_p):
        assert t.chunks == 1 and load <= worklist.WHOLE_ROW_LOAD and sms and rows >= 2 * sms
    if t.chunks == 1 and load <= worklist.ONE_WARP_LOAD and sms and t.block_d > 32:
        assert rows >= 6 * sms  # a whole row of at most 4096 values: only where rows fill


class _WorkListStandIn:
    """``_gluon_mla_wl_kernel[grid](...)`` in torch: walks the table the way the kernel does
    and writes ``torch_ref``'s answer per segment (direct rows, or slot ``p + b`` with a random
    LSE); stores the call's keys in the pool (FP8: checks that torch stored their codes)."""

    def __init__(self, runner, batch, tree_mode):
        self.runner, self.batch, self.tree_mode, self.launches = runner, batch, tree_mode, []
        self._gluon_mla_wl_kernel = self

    def __getitem__(self, grid):
        def launch(Q, KV, Kin, MidO, MidLse, Out, R2T, Meta, Work, Hist, Par, KScale, WScale,
                   step, scale, cap, *strides_and_ints, **const):
            self.launches.append((grid, const))
            topk, num_steps, batch, programs = strides_and_ints[-4:]
            if const.get("STORE_FP8"):  # the kernel stores the codes (fp8_codes' own)
                codes = F.Codes(const["E5M2"], const["SATURATE"], const["SIGNED_NAN"])
                KV[Hist[:, step].long()] = F.quantize(Kin, WScale, const["W_QUANT"],
                                                      codes).view(KV.dtype)
            if const["FP8"]:
                assert torch.equal(KV[Hist[:, step].long()].view(torch.uint8),
                                   quantize(Kin, KScale, KV.dtype).view(torch.uint8))
            else:
                KV[Hist[:, step].long()] = Kin
            layer = AttentionLayer(0, scale, cap, k_scale=KScale if const["FP8"] else 1.0)
            ref = reference_decode(self.runner, layer, Q, self.batch, step,
                                   self.tree_mode).float()
            table = Work.tolist()
            chunk, first, starts = table[0], table[1:1 + programs], table[1 + programs:]
            for p in range(programs):
                b = first[p]
                while b < batch and starts[b] < (p + 1) * chunk:
                    rows = ref[b * topk:(b + 1) * topk].reshape(-1, ref.shape[-1])
                    if p * chunk <= starts[b] and starts[b + 1] <= (p + 1) * chunk:
                        Out[b * topk:(b + 1) * topk] = ref[b * topk:(b + 1) * topk]
                    else:
                        MidO[p + b, :rows.shape[0]] = rows
                        MidLse[p + b, :rows.shape[0]] = torch.randn(rows.shape[0])
                    b += 1
        return launch


@pytest.mark.parametrize("lens,programs,want_p,kv", [
    ([7, 300, 18, 0, 45], None, 5, "auto"), ([40, 41], None, 4, "auto"),
    ([40, 41], 1, 2, "auto"), ([900, 5], 9, 9, "auto"),
    ([7, 300, 18, 0, 45], None, 5, "fp8_e4m3"), ([900, 5], 9, 9, "fp8_e5m2"),
    ([900, 5], 9, 9, "fp8_e4m3/kernel-writes")])
def test_launcher_with_a_stand_in_kernel(monkeypatch, lens, programs, want_p, kv):
    """``kernel-writes``: the kernels' FP8 codes are the device torch's (``fp8_write``, as on
    CUDA), so the kernel stores them (``STORE_FP8``)."""
    from test_sm90_plans import _cpu_fp8_write, mla_round, stand_in_steps

    from specattn.backends.triton import launchers

    kv, _, writes = kv.partition("/")
    if writes:
        monkeypatch.setattr(launchers, "fp8_write", _cpu_fp8_write)

    from specattn.backends.triton import TritonDecode, _gluon_mla_wl_kernel

    r, batch = mla_round(lens, topk=2, steps=3, kv=kv, k_scale=0.37)
    stand_in = _WorkListStandIn(r, batch, "path")
    merges = []
    real_merge = worklist._merge_launch
    monkeypatch.setattr(worklist, "_merge_launch", lambda *a: merges.append(a) or real_merge(*a))
    monkeypatch.setattr(plans, "gluon_reason", lambda runner, interpret: None)
    monkeypatch.setattr(gluon_mla, "kernel_module", lambda: stand_in)
    monkeypatch.setattr(_gluon_mla_wl_kernel, "_gluon_mla_wl_kernel", stand_in)
    backend = TritonDecode(r, 2, 3, tree_mode="path", num_splits=programs)
    assert backend.plan.name == "gluon-wl"  # 2 lanes x 16 heads: one row tile
    backend.init_forward_metadata(batch)
    plan = backend._round_plan
    P = want_p  # the interpreter's 4 "SMs" (one row tile), at least one per request
    assert plan["num_splits"] == P
    work = backend._active.work
    block_n = plans.PLANS["gluon-wl"].block_n
    want = schedule(lens, worklist.tail_units(2, 16, 3, block_n), block_n, P)
    assert work[:worklist.work_numel(P, len(lens))].tolist() == \
        [want.chunk] + want.first_request + want.unit_starts
    layer = AttentionLayer(0, 576 ** -0.5, k_scale=0.37)
    for grid, const in stand_in_steps(r, batch, backend, stand_in.launches, layer=layer):
        assert grid == (1, P) and const["MODE"] == 1 and const["H"] == 16
        assert const["BLOCK_N"] == block_n and const["num_warps"] == 8
        assert const["FP8"] == r.fp8 and const.get("STORE_FP8", False) is bool(writes)
    # A merge launch per step exactly when a request has several segments (never at P == B).
    several = any(len(want.parts(b)) for b in range(len(lens)))
    assert several == (P > len(lens))  # these cases: spare programs split a request
    assert len(merges) == (3 if several else 0)


def test_factory_backend_options_reach_the_classes_that_take_them():
    """``DraftBackendFactory(backend_options={"triton": {"mode": "per-branch"}})``: the
    decode class takes it, the extend class (which does not) is built without it; a keyword
    no class of the backend takes is refused when the backend is built, naming it."""
    from test_sm90_plans import mla_round

    from specattn import DraftBackendFactory, SpecConfig
    from specattn.errors import InvalidInputError

    r, _ = mla_round([5, 6], topk=2)
    cfg = SpecConfig(attention_backend="triton")
    f = DraftBackendFactory(cfg, r, 2, 3, backend_options={"triton": {"mode": "per-branch"},
                                                           "flashinfer": {"nope": 1}})
    assert f.create_decode_backend().mode == "per-branch"
    assert type(f.create_draft_extend_backend()).__name__ == "TritonExtend"
    assert DraftBackendFactory(cfg, r, 2, 3).create_decode_backend().mode == "shared"
    both = DraftBackendFactory(cfg, r, 2, 3, backend_options={"triton": {"plan": "dot-wide"}})
    assert both.create_decode_backend().plan.name == "dot-wide"
    assert type(both.create_draft_extend_backend()).__name__ == "TritonExtend"
    bad = DraftBackendFactory(cfg, r, 2, 3, backend_options={"triton": {"mdoe": True}})
    with pytest.raises(InvalidInputError, match=r"backend_options\['triton'\].*mdoe"):
        bad.create_decode_backend()
    with pytest.raises(InvalidInputError, match="backend_options"):
        DraftBackendFactory(cfg, r, 2, 3, backend_options={"triton": True})
