"""Direct replans of FlashInfer graph wrappers (``backends.flashinfer._replan``), CPU, against
the FlashInfer stand-in (0.7.4's plan state and native-planner call, ``standins/flashinfer``).

For the prefix pass (prefill wrapper, ``uniform_q_len``), the extend pass (causal prefill),
the decode wrapper and the MLA wrapper (non-causal prefix, causal extend): after a first
public plan, a replan of another batch calls the native planner with the arguments the
public plan of that batch gives it (pass B, direct, against pass A, public), and leaves the
same ``plan_info``, int workspace, captured buffers and host facts; it reads nothing back
from the device. It falls back to the public plan, with one INFO line, for a FlashInfer whose
wrapper lacks an attribute it needs, for other plan parameters, and for a batch the public
plan must judge.
"""

from __future__ import annotations

import logging

import pytest
import torch

from specattn.backends.flashinfer import _replan
from specattn.backends.flashinfer._passes import DecodePass, MLAPass, Params, PrefillPass
from specattn.backends.flashinfer._slots import host_arange, host_csr, host_indptr
from standins import flashinfer as fi_standin
from test_flashinfer import fake_flashinfer  # noqa: F401 (the stand-in fixture)
from test_flashinfer import make_decode_case
from test_flashinfer_host import DeviceReads

BS, K = 3, 4


def _prefix_csr(lens):
    return host_csr(host_arange(len(lens), K), torch.tensor(lens), K)


def _extend_csr(lens, ext):
    return host_csr(host_indptr(torch.tensor(ext)), torch.tensor(lens), max(ext))


def _decode_csr(lens):
    return host_csr(host_arange(len(lens), 1), torch.tensor(lens), 1)


# (pass maker, causal, first batch, second batch): the second batch differs in every length.
KINDS = {
    "prefix": (lambda r: PrefillPass(r, with_lse=True, uniform_rows=K, graph_rows=BS,
                                     capacity=200), False,
               _prefix_csr([5, 9, 2]), _prefix_csr([7, 1, 30])),
    "extend": (lambda r: PrefillPass(r, with_lse=False, graph_rows=BS, capacity=200), True,
               _extend_csr([5, 9, 4], [2, 3, 1]), _extend_csr([6, 3, 8], [3, 1, 2])),
    "decode": (lambda r: DecodePass(r, with_lse=False, graph_rows=BS, capacity=200), False,
               _decode_csr([5, 9, 2]), _decode_csr([8, 2, 13])),
    "mla": (lambda r: MLAPass(r, with_lse=True, graph_rows=BS, capacity=200), False,
            _prefix_csr([5, 9, 2]), _prefix_csr([7, 1, 30])),
    "mla-extend": (lambda r: MLAPass(r, with_lse=False, graph_rows=BS, capacity=200), True,
                   _extend_csr([5, 9, 4], [2, 3, 1]), _extend_csr([6, 3, 8], [3, 1, 2])),
}
PARAMS = Params(0.25, 0.0)


def _runner(kind, mla_heads: int = 4):
    return make_decode_case(mla=kind.startswith("mla"), bs=BS, topk=K, max_len=60,
                            heads=(mla_heads, 64, 16) if kind.startswith("mla") else None
                            ).runner


def _planned(p):
    """``(wrapper or planned backend, the native planner)`` of a pass."""
    if isinstance(p, MLAPass):
        pb = p.wrapper._planned_backend
        return pb, pb._cached_module
    return p.wrapper, p.wrapper._cached_module


def _same(a, b, own_a, own_b):
    """One planner argument: a workspace is the pass's own; tensors equal by value."""
    for mine, theirs in zip(own_a, own_b):
        if a is mine:
            return b is theirs
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _workspaces(w):
    return [w._float_workspace_buffer, w._int_workspace_buffer,
            w._pin_memory_int_workspace_buffer]


def _captured(w, kind):
    """The captured device buffers and host facts a plan leaves behind."""
    if kind.startswith("mla"):
        bufs = (w._qo_indptr_buf, w._kv_indptr_buf, w._kv_len_arr_buf)
        facts = (w._planned_query_shape, w._staged_int_workspace_bytes, w._causal)
    else:
        bufs = (w._paged_kv_indptr_buf, w._paged_kv_last_page_len_buf)
        if kind != "decode":
            bufs += (w._qo_indptr_buf, w._kv_lens_buffer[:BS])
        facts = (w._batch_size, w._max_kv_len) + (() if kind == "decode" else (
            w._qo_indptr_last, w._max_q_len, w._max_total_num_rows))
    return [b.clone() for b in bufs], facts


@pytest.fixture
def host_planner(monkeypatch):
    """MLA graph replans through FlashInfer's native host planner (no device schedule)."""
    monkeypatch.setattr(_replan, "_device_mla_schedule", lambda backend, heads: None)


@pytest.mark.parametrize("kind", list(KINDS))
def test_direct_replan_matches_the_public_plan(fake_flashinfer, host_planner,  # noqa: F811
                                               kind):
    make, causal, first, second = KINDS[kind]
    runner = _runner(kind)
    a, b = make(runner), make(runner)
    for p in (a, b):
        p.plan(first, causal, PARAMS)
    assert a._direct is not None and b._direct is not None
    a._direct = None  # A: FlashInfer's public plan of the second batch
    a.plan(second, causal, PARAMS)
    b.plan(second, causal, PARAMS)
    assert a.wrapper.plans == 2 and b.wrapper.plans == 1 and b._direct.calls == 1
    (wa, ma), (wb, mb) = _planned(a), _planned(b)
    call_a, call_b = ma.calls[-1], mb.calls[-1]
    assert len(call_a) == len(call_b)
    own_a, own_b = _workspaces(wa), _workspaces(wb)
    if kind.startswith("mla"):
        # The MLA replan stages the schedule in a block of torch's pinned cache, not in the
        # proxy's shared scratch buffer (the public plan's): the same size, then compared
        # by what reaches the int workspace below.
        x, y = call_a[2], call_b[2]
        assert x is own_a[2] and y is not own_b[2] and y.shape == x.shape, (x, y)
        call_a, call_b, own_a, own_b = call_a[:2] + call_a[3:], call_b[:2] + call_b[3:], \
            own_a[:2], own_b[:2]
    for i, (x, y) in enumerate(zip(call_a, call_b)):
        assert _same(x, y, own_a, own_b), (i, x, y)
    assert wa._plan_info == wb._plan_info and a.wrapper._plan_info == b.wrapper._plan_info
    used = wb._plan_info[0]
    assert torch.equal(wa._int_workspace_buffer[:used], wb._int_workspace_buffer[:used])
    bufs_a, facts_a = _captured(wa, kind)
    bufs_b, facts_b = _captured(wb, kind)
    assert facts_a == facts_b
    assert all(torch.equal(x, y) for x, y in zip(bufs_a, bufs_b))
    if kind.startswith("mla"):  # the index bound: the pool (public: the listed range)
        assert wb._planned_kv_page_range == (0, runner.num_slots)


@pytest.mark.parametrize("kind", list(KINDS))
def test_direct_replan_reads_nothing_from_the_device(fake_flashinfer, kind):  # noqa: F811
    """The stand-ins of device tensors (``DeviceReads``) are never read by a direct replan;
    the public MLA plan reads the slot list's range back (FlashInfer 0.7.4's ``aminmax``)."""
    make, causal, first, second = KINDS[kind]
    runner = _runner(kind)
    with DeviceReads([runner.req_to_token]) as dev:
        p = make(runner)
        p.plan(first, causal, PARAMS)
        dev.recording = True
        p.plan(second, causal, PARAMS)
        dev.recording = False
        assert p._direct.calls == 1 and dev.reads == [], dev.reads
        if kind.startswith("mla"):
            p._direct = None
            dev.recording = True
            p.plan(second, causal, PARAMS)
            dev.recording = False
            assert dev.reads.count("item") == 2, dev.reads


def test_new_parameters_take_the_public_plan_then_replan_directly(fake_flashinfer):  # noqa: F811
    make, causal, first, second = KINDS["prefix"]
    p = make(_runner("prefix"))
    p.plan(first, causal, PARAMS)
    other = Params(0.5, 3.0)
    p.plan(second, causal, other)
    assert p.wrapper.plans == 2 and p._direct.key == (causal, other)
    assert p.wrapper.scale == 0.5 and p.wrapper.cap == 3.0
    p.plan(first, causal, other)
    assert p.wrapper.plans == 2 and p._direct.calls == 1


def test_a_batch_the_public_plan_must_judge_goes_to_it(fake_flashinfer):  # noqa: F811
    """More query rows than the capture's: the public plan refuses it (its error)."""
    make, causal, first, _ = KINDS["extend"]
    p = make(_runner("extend"))
    p.plan(first, causal, PARAMS)
    with pytest.raises(AssertionError, match="rows and batch size"):
        p.plan(_extend_csr([5, 9, 4], [3, 3, 1]), causal, PARAMS)
    assert p._direct is None or p._direct.calls == 0


class _PrefillWithoutJit(fi_standin.FakePrefill):
    """A FlashInfer whose prefill wrapper has no ``_jit_module`` attribute."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        del self._jit_module


def test_missing_wrapper_attribute_keeps_the_public_plan(fake_flashinfer, monkeypatch,  # noqa: F811
                                                         caplog):
    monkeypatch.setattr(fake_flashinfer, "BatchPrefillWithPagedKVCacheWrapper",
                        _PrefillWithoutJit)
    monkeypatch.setattr(_replan, "_LOGGED", set())
    make, causal, first, second = KINDS["prefix"]
    p = make(_runner("prefix"))
    with caplog.at_level(logging.INFO, logger="specattn.backends.flashinfer"):
        for csr in (first, second, first):
            p.plan(csr, causal, PARAMS)
    assert p.wrapper.plans == 3 and p._direct is None
    lines = [r.getMessage() for r in caplog.records if "public plan" in r.getMessage()]
    assert len(lines) == 1 and "_jit_module" in lines[0], lines


def test_other_backends_keep_the_public_plan(fake_flashinfer, monkeypatch, caplog):  # noqa: F811
    """A planned MLA backend that cannot replan a graph (not fa2/fa3) is left to FlashInfer;
    an eager pass never gets a replanner."""
    monkeypatch.setattr(_replan, "_LOGGED", set())
    monkeypatch.setattr(fi_standin.FakeMLABackend, "_plan_capabilities",
                        type("Caps", (), {"supports_cuda_graph_replan": False})())
    make, causal, first, second = KINDS["mla"]
    runner = _runner("mla")
    p = make(runner)
    with caplog.at_level(logging.INFO, logger="specattn.backends.flashinfer"):
        p.plan(first, causal, PARAMS)
        p.plan(second, causal, PARAMS)
    assert p._direct is None and p.wrapper.plans == 2
    assert any("MLA backend" in r.getMessage() for r in caplog.records)
    eager = MLAPass(runner, with_lse=True)
    eager.plan(first, causal, PARAMS)
    eager.plan(second, causal, PARAMS)
    assert eager._direct is None and eager.wrapper.plans == 2


@pytest.mark.parametrize("kind, capacity, heads, checks", [
    ("mla", 16384, 4, 0), ("mla-extend", 16384, 4, 0), ("mla-extend", 16384, 24, 1),
    ("mla", 16384, 24, 0), ("mla-extend", 134, 4, 1), ("mla", 134, 4, 1), ("mla", None, 4, 1)])
def test_mla_replan_checks_the_workload_where_the_planner_could_refuse_it(
        fake_flashinfer, monkeypatch, kind, capacity, heads, checks):  # noqa: F811
    """FlashInfer's MLA workload check runs where ``ceil(max_q * H / 64)`` work items per
    sequence plus one per SM could pass the planner's capacity (``_FA_MAX_WORK_ITEMS``),
    where that capacity is unknown, and for a causal plan whose heads do not divide 64
    (its query-tile boundary check); not otherwise."""
    monkeypatch.setattr(_replan, "sm_count", lambda device: 132)
    if capacity is None:
        monkeypatch.delattr(fi_standin, "_FA_MAX_WORK_ITEMS", raising=False)
    else:
        monkeypatch.setattr(fi_standin, "_FA_MAX_WORK_ITEMS", capacity, raising=False)
    make, causal, first, second = KINDS[kind]
    p = make(_runner(kind, heads))
    p.plan(first, causal, PARAMS)
    before = fi_standin._validate_fa_plan_workload.calls
    p.plan(second, causal, PARAMS)
    assert p._direct.calls == 1
    assert fi_standin._validate_fa_plan_workload.calls - before == checks
