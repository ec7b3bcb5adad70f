"""FlashInfer's MLA schedule written on the device (``backends.flashinfer._mla_plan``), CPU
(Triton's interpreter), against FlashInfer 0.7.4's host planner as ported in
``standins/flashinfer_mla`` and the schedule's run there.

The device schedule has FlashInfer's work items (the same chunks of the same query tiles, the
same partial rows), the same merge CTAs in the same order, and clusters as balanced; run as
FlashInfer's kernel reads it, it gives float64 attention; a graph replan writes it in place of
the host planner's and keeps the captured cluster size.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from specattn.backends.flashinfer import _mla_plan as mla_plan
from specattn.backends.flashinfer._mla_plan import MLASchedule, plan_layout
from specattn.backends.flashinfer._passes import MLAPass, Params
from specattn.kernels.prefix_slots import prefix_slots
from helpers import plan_on_device
from standins import flashinfer_mla as mla
from test_flashinfer import fake_flashinfer  # noqa: F401 (the stand-in fixture)
from test_flashinfer_replan import _extend_csr, _prefix_csr, _runner

WORK = ("q_indptr", "kv_indptr", "partial_indptr", "q_len", "kv_len", "q_start", "kv_start",
        "kv_end")


def _indptr(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _device_schedule(q_lens, kv_lens, heads, causal, sms):
    """``(plan_info, FlashInfer's arrays, the device's arrays)`` of one batch: the slot-list
    launch writes the schedule on the host plan's layout into a poisoned workspace (query
    rows from the launch's ``Ext`` where they differ, else ``qrows`` each, as a decode's)."""
    qo, kv = _indptr(q_lens), _indptr(kv_lens)
    plan_info, ref = mla.mla_plan(qo, kv, kv_lens, heads, causal, sms)
    workspace = torch.full((mla.offsets(sms)[1],), 0x7F, dtype=torch.uint8)
    bs = len(kv_lens)
    uniform = len(set(q_lens)) == 1 and q_lens[0] > 0
    schedule = MLASchedule(workspace.view(torch.int32), workspace, plan_layout(plan_info),
                           heads, causal, bs, q_lens[0] if uniform else 0)
    width = max(kv_lens + [1])
    csr = (torch.zeros(bs + 1, dtype=torch.int32), torch.zeros(bs, dtype=torch.int32))
    ext = None if uniform else (torch.tensor(q_lens), torch.zeros(bs + 1, dtype=torch.int32))
    prefix_slots(torch.zeros(max(kv[-1], 1), dtype=torch.int32), kv[-1], width,
                 torch.arange(width, dtype=torch.int32)[None].expand(bs, width),
                 torch.arange(bs), torch.tensor(kv_lens), 1 << 20, csr=csr, qo=ext,
                 schedule=schedule)
    assert csr[0].tolist() == kv  # the launch's own CSR agrees with the schedule's offsets
    return plan_info, ref, mla.read_schedule(workspace, plan_info, sms)


def _works(s):
    return sorted(tuple(s[n][w] for n in WORK) for w in range(s["work_indptr"][-1]))


def _longest_cluster(s, tile):
    """The most work of a cluster, in FlashInfer's cost (keys plus twice the tile)."""
    return max(sum(2 * tile + s["kv_end"][w] - s["kv_start"][w]
                   for w in range(s["work_indptr"][c], s["work_indptr"][c + 1]))
               for c in range(len(s["work_indptr"]) - 1))


def _random_case(requests, rng):
    rows = rng.randint(1, 8)
    return ([rows] * requests, [rng.randint(8, 3000) for _ in range(requests)],
            rng.choice([1, 16, 40]), rng.random() < 0.5, rng.choice([6, 132]))


_rng = random.Random(7)
CASES = [
    ([4], [32768], 16, False, 132),  # one request split over every cluster
    ([4] * 8, [100, 5000, 20000, 3000, 77, 4096, 9000, 12000], 16, False, 132),  # ragged
    ([8], [4096], 16, False, 132),  # 128 packed rows: clusters of 2
    ([2, 3, 1], [900, 40, 3], 128, True, 8),  # causal, several tiles per request
    ([6, 0, 2], [300, 0, 2], 24, True, 6),  # a request without rows, one without keys
    ([3, 3], [0, 0], 4, False, 6),  # no keys at all
] + [_random_case(n, _rng) for n in (1, 3, 9)]


@pytest.mark.parametrize("q_lens, kv_lens, heads, causal, sms", CASES)
def test_device_schedule_is_flashinfers(q_lens, kv_lens, heads, causal, sms):
    plan_info, ref, got = _device_schedule(q_lens, kv_lens, heads, causal, sms)
    for name in mla.ARRAYS:
        if name in mla._PER_CTA:  # merge CTAs: the same, in order, zero past the last
            assert got[name] == ref[name], name
    assert _works(got) == _works(ref)
    bounds = got["work_indptr"]
    assert bounds[0] == 0 and all(a <= b for a, b in zip(bounds, bounds[1:]))
    tile = 64 * plan_info[0]
    limit = max(s["kv_end"][w] - s["kv_start"][w] for s in (ref,)
                for w in range(s["work_indptr"][-1]))
    assert _longest_cluster(got, tile) <= _longest_cluster(ref, tile) + limit + 2 * tile


def _attention(q, kv, value_dim, q_lens, kv_lens, kv_indptr, indices, causal, scale):
    """float64 attention of every request's rows over its slots (bottom-right causal)."""
    out = torch.zeros(q.shape[0], q.shape[1], value_dim, dtype=torch.float64)
    row = 0
    for i, (n_q, n_kv) in enumerate(zip(q_lens, kv_lens)):
        keys = kv[indices[kv_indptr[i]:kv_indptr[i] + n_kv].long()].double()
        s = torch.einsum("thd,nd->thn", q[row:row + n_q].double(), keys) * scale
        if causal:
            seen = torch.arange(n_kv)[None, :] <= torch.arange(n_q)[:, None] + n_kv - n_q
            s = s.masked_fill(~seen[:, None, :], -math.inf)
        if n_kv:
            out[row:row + n_q] = torch.softmax(s, -1) @ keys[:, :value_dim]
        row += n_q
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_device_schedule_runs_to_attention(causal):
    """Split tiles, partial rows and merges, as FlashInfer's kernel reads them."""
    torch.manual_seed(0)
    q_lens, kv_lens, heads, sms = [3, 1, 2], [150, 9, 260], 8, 6
    plan_info, ref, got = _device_schedule(q_lens, kv_lens, heads, causal, sms)
    assert any(p >= 0 for p in got["partial_indptr"])  # some tiles are split
    kv_indptr = _indptr(kv_lens)
    indices = torch.randperm(600)[:kv_indptr[-1]].to(torch.int32)
    q = torch.randn(sum(q_lens), heads, 24)
    kv = torch.randn(600, 24)
    o, _ = mla.run_schedule(plan_info, got, indices, q, kv, 16, heads, causal, 0.3, sms)
    want = _attention(q, kv, 16, q_lens, kv_lens, kv_indptr, indices, causal, 0.3)
    torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-5)


PARAMS = Params(0.25, 0.0)


@pytest.mark.parametrize("kind, causal, batches, heads", [
    ("mla", False, ([5, 9, 2], [7, 1, 30]), 4),
    ("mla-extend", True, (([5, 9, 4], [2, 3, 1]), ([6, 3, 8], [3, 1, 2])), 4),
    # Capture at 3 new tokens x 24 heads (72 rows: clusters of 2), replay at 1 (24 rows:
    # FlashInfer's own plan would pick single CTAs, which the captured grid is not).
    ("mla-extend", True, (([5, 9, 4], [3, 3, 3]), ([6, 3, 8], [1, 1, 1])), 24),
])
def test_graph_replan_writes_the_schedule_on_the_device(fake_flashinfer, kind, causal,  # noqa: F811
                                                        batches, heads):
    """After the capture's public plan the slot-list launch writes the schedule: FlashInfer's
    planner is not called again, ``plan_info`` (the captured grid) is kept, and the run gives what a
    public plan of the same batch gives."""
    csr = [_prefix_csr(b) if kind == "mla" else _extend_csr(*b) for b in batches]
    runner = _runner(kind, heads)
    graph = MLAPass(runner, with_lse=kind == "mla", graph_rows=3, capacity=200)
    graph.plan(csr[0], causal, PARAMS)
    captured = list(graph.wrapper._plan_info)
    native = graph.wrapper._planned_backend._cached_module.calls
    before = len(native)
    ext = None if kind == "mla" else torch.tensor(batches[1][1])
    assert plan_on_device(graph, csr[1], causal, PARAMS, ext)
    assert graph._direct.calls == 1
    assert len(native) == before and list(graph.wrapper._plan_info) == captured
    public = MLAPass(runner, with_lse=kind == "mla", capacity=200)
    public.plan(csr[1], causal, PARAMS)
    if heads == 24:
        assert captured[0] == 2 and public.wrapper._plan_info[0] == 1
    rows = csr[1].rows
    torch.manual_seed(1)
    q = torch.randn(rows, heads, runner.kv_lora_rank + runner.qk_rope_head_dim,
                    dtype=runner.dtype)
    finite = (~runner.kv_buffer[0].isnan().any(-1)).nonzero()[:, 0]  # slots in use
    for p in (graph, public):  # the slot list, as the glue writes it
        p.indices[:csr[1].total] = finite[:csr[1].total].to(torch.int32)
    got, want = graph.run(q, 0)[0], public.run(q, 0)[0]
    torch.testing.assert_close(got, want)


def test_plan_layout_reads_flashinfers_plan_info_only():
    plan_info, _ = mla.mla_plan([0, 4], [0, 100], [100], 16, False)
    layout = plan_layout(plan_info)
    assert layout.cluster == 1 and layout.clusters == mla.SMS
    assert layout.offsets == tuple(o // 4 for o in plan_info[2:16])
    squeezed = list(plan_info)
    squeezed[3] = squeezed[2] + 16 * 1024  # room for 4,096 work items, not 16,384
    for bad in ([64, 1, 4, 4, 0], plan_info[:2] + [4] + plan_info[3:], [3] + plan_info[1:],
                squeezed, None):
        assert plan_layout(bad) is None


def test_replan_without_the_device_planner_runs_flashinfers(fake_flashinfer,  # noqa: F811
                                                            monkeypatch):
    """Where ``plan_info`` is not 0.7.4's MLA layout the host planner serves every replan."""
    monkeypatch.setattr(mla_plan, "plan_layout", lambda info: None)
    runner = _runner("mla")
    p = MLAPass(runner, with_lse=True, graph_rows=3, capacity=200)
    p.plan(_prefix_csr([5, 9, 2]), False, PARAMS)
    native = p.wrapper._planned_backend._cached_module.calls
    assert not plan_on_device(p, _prefix_csr([7, 1, 30]), False, PARAMS)
    assert p._direct.schedule is None and len(native) == 2
