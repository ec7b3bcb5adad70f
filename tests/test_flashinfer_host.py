"""The host work of the ``flashinfer`` backends' metadata calls (CPU, FlashInfer stand-in).

An engine calls ``init_forward_metadata_replay_cuda_graph`` on the host before every replay,
while the device still runs earlier work: a read of a device tensor there waits for all of
it. Checked per call, for MHA (``K`` 1 and ``K`` > 1), MLA and extend, at two batch sizes and
step counts:

- FlashInfer plans: at most one per wrapper the round uses; one in all in the default
  (``shared``) mode, whatever ``B`` and ``S``; a replay's plan is a direct replan (FlashInfer's
  native planner, ``_replan``), the public ``plan`` runs only at capture;
- reads of device tensors: none when the batch carries the host copies of its lengths
  (``seq_lens_cpu``, ``extend_lens_cpu``, as SGLang's batches do); exactly one transfer
  otherwise (the documented fallback, ``data.host_lengths``).

On a CPU every tensor is a CPU tensor, so ``DeviceReads`` tells them apart by where they come
from: the runner's and the batch's tensors, tensors made with an explicit ``device=``, and
whatever an op computes from one of them are "device" tensors; a transfer of one to the host
(``.cpu()``, ``.to("cpu")``, ``.item()``, ``.tolist()``, ``int()``, ``bool()``, a copy into
a host tensor, ...) or an op whose output size depends on its values (``nonzero``, boolean
indexing, ...; these sync on a GPU) is a read. The validation layer scans values of CPU
tensors; here it runs as on a device (values only under debug checks).
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specattn import validation
from specattn.backends.flashinfer import (FlashInferDecode, FlashInferExtend,
                                          FlashInferMLADecode, FlashInferMLAExtend, _replan)
from specattn.backends.flashinfer import _decode, _extend, _slots
from specattn.data import DraftBatch, DraftExtendBatch, host_lengths
from specattn.errors import InvalidInputError
from helpers import one_token_fewer
from standins import flashinfer as fi_standin
from test_flashinfer import fake_flashinfer  # noqa: F401 (the stand-in fixture)
from test_flashinfer import make_decode_case, make_extend_case

_READS = frozenset({"cpu", "item", "tolist", "numpy", "__int__", "__bool__", "__float__",
                    "__index__", "__repr__", "__str__", "__format__", "nonzero", "argwhere",
                    "masked_select", "unique", "unique_consecutive", "equal", "allclose"})


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _names_cpu(obj) -> bool:
    return (isinstance(obj, str) and obj.startswith("cpu")) or (
        isinstance(obj, torch.device) and obj.type == "cpu")


def _in_triton() -> bool:
    """Called from inside Triton (its CPU interpreter copies kernel arguments around)."""
    f = sys._getframe(2)
    while f is not None:
        if "/triton/" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


class DeviceReads(TorchFunctionMode):
    """Tracks which CPU tensors stand for device tensors (see the module doc) and records
    every host read of one in ``reads`` while ``recording``."""

    def __init__(self, roots) -> None:
        super().__init__()
        self._device: dict[int, torch.Tensor] = {}  # storage address -> a tensor keeping it
        self.reads: list[str] = []
        self.recording = False
        for t in roots:
            self._mark(t)

    def _mark(self, t: torch.Tensor) -> None:
        self._device[t.untyped_storage().data_ptr()] = t

    def on_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        out = func(*args, **kwargs)
        if name in ("data_ptr", "untyped_storage") or _in_triton():
            return out
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        dev_in = [t for t in inputs if self.on_device(t)]
        if dev_in:
            read = name in _READS
            if name == "to":
                read = any(_names_cpu(a) for a in list(args[1:]) + list(kwargs.values()))
            elif name in ("copy_", "__setitem__") and isinstance(args[0], torch.Tensor):
                read = not self.on_device(args[0])  # into a host tensor
            elif name == "__getitem__":
                read = any(t.dtype == torch.bool for t in _tensors(args[1:]))
            elif name == "repeat_interleave":
                read = (len(args) > 1 and isinstance(args[1], torch.Tensor)
                        and kwargs.get("output_size") is None)
            if read:
                if self.recording:
                    self.reads.append(name)
                if isinstance(out, torch.Tensor) and self.on_device(out):
                    out = out.clone()  # a transfer gives a host copy (on a CPU: maybe itself)
                return out
            for t in _tensors(out):
                self._mark(t)
            if name.endswith("_") or name == "__setitem__":
                self._mark(args[0])
        elif kwargs.get("device") is not None:  # made on the runner's device
            for t in _tensors(out):
                self._mark(t)
        return out


class Plans(Counter):
    """FlashInfer's native planner calls per wrapper (by its int workspace, which an MLA
    wrapper's planned backends share in graph mode), and the schedules written on the device
    instead (by the slot-list launch); ``public``:
    the public ``plan`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.public = 0

    def clear(self) -> None:
        super().clear()
        self.public = 0


def _counting_public(plan, plans: Plans):
    def counted(self, *args, **kw):
        plans.public += 1
        return plan(self, *args, **kw)
    return counted


@pytest.fixture
def host_work(fake_flashinfer, monkeypatch):  # noqa: F811 (the imported fixture)
    """``(plans, watch)``: ``plans`` counts FlashInfer plans (``Plans``); ``watch(*roots)``
    is a ``DeviceReads`` over the given runner and batches."""
    plans = Plans()
    native = fi_standin.FakePlanner._plan_staged

    def counting(self, *args):
        plans[id(args[1])] += 1
        return native(self, *args)

    monkeypatch.setattr(fi_standin.FakePlanner, "_plan_staged", counting)
    slots = _slots.prefix_slots_launcher()

    def counting_slots(*args, schedule=None, **kw):  # a schedule in the slot-list launch
        if schedule is not None:
            plans[schedule.work.data_ptr()] += 1
        return slots(*args, schedule=schedule, **kw)

    for glue in (_decode, _extend):
        monkeypatch.setattr(glue, "prefix_slots_launcher", lambda: counting_slots)
    for cls in (fi_standin.FakePrefill, fi_standin.FakeDecode, fi_standin.FakeMLA):
        monkeypatch.setattr(cls, "plan", _counting_public(cls.plan, plans))
    monkeypatch.setattr(validation, "_scan_values", lambda t, debug: bool(debug))

    def watch(runner, *batches) -> DeviceReads:
        roots = [runner.req_to_token]
        for name in ("k_buffer", "v_buffer", "kv_buffer"):
            roots += list(getattr(runner, name, None) or [])
        for b in batches:
            roots += [getattr(b, f) for f in ("req_pool_indices", "seq_lens", "extend_lens",
                                               "out_cache_loc", "parents")
                      if isinstance(getattr(b, f, None), torch.Tensor)]
        return DeviceReads(roots)
    return plans, watch


def _with_host_copy(batch: DraftBatch, rows=None) -> DraftBatch:
    """``batch`` (its requests ``rows``) with ``seq_lens_cpu``, made before any watch."""
    b = batch
    if rows is not None:
        idx = torch.tensor(rows)
        b = DraftBatch(b.req_pool_indices[idx], b.seq_lens[idx], b.out_cache_loc[idx],
                       None if b.parents is None else b.parents[:, idx])
    return DraftBatch(b.req_pool_indices, b.seq_lens, b.out_cache_loc, b.parents,
                      b.seq_lens.clone())


DECODE = [(False, 1, "lane"), (False, 4, "lane"), (False, 3, "path"), (True, 1, "lane"),
          (True, 4, "path")]


@pytest.mark.parametrize("mla, topk, tree_mode", DECODE)
@pytest.mark.parametrize("bs, steps", [(3, 2), (6, 5)])
def test_replay_metadata_plans_once_and_reads_nothing_back(host_work, monkeypatch, mla, topk,
                                                           tree_mode, bs, steps):
    """Default mode: per replay metadata call, one FlashInfer plan, a direct replan (no public
    ``plan`` after the capture's) that copies no key CSR from the host (the slot-list launch
    wrote it), and no read of a device tensor, with a full and a padded batch (``bs - 1``
    requests)."""
    plans, watch = host_work
    on_device = _record_device_csr(monkeypatch)
    case = make_decode_case(mla=mla, bs=bs, topk=topk, steps=steps, seed=bs + steps)
    full = _with_host_copy(case.batch)
    padded = _with_host_copy(case.batch, list(range(bs - 1))[::-1])
    cls = FlashInferMLADecode if mla else FlashInferDecode
    with watch(case.runner, case.batch, full, padded) as dev:
        backend = cls(case.runner, topk, steps, tree_mode=tree_mode)
        backend.init_cuda_graph_state(bs, bs * topk)
        backend.init_forward_metadata_capture_cuda_graph(full)
        direct = backend._graphs[bs].prefix._direct
        for i, batch in enumerate((full, padded, full)):
            plans.clear()
            dev.recording = True
            backend.init_forward_metadata_replay_cuda_graph(batch, bs)
            dev.recording = False
            assert dev.reads == [], dev.reads
            assert sum(plans.values()) == 1 and len(plans) == 1, plans
            assert plans.public == 0 and direct.calls == i + 1
        assert on_device == [(True, False)] * 3  # the prefix pass's query indptr is kept


@pytest.mark.parametrize("mla, topk, tree_mode", DECODE[:2] + DECODE[3:4])
def test_eager_metadata_without_host_copy_reads_lengths_once(host_work, mla, topk, tree_mode):
    """``init_forward_metadata`` and a replay without ``seq_lens_cpu``: one transfer of the
    lengths each (the fallback); with it, none. FlashInfer's public MLA plan (eager calls)
    also reads the range of the slot list back (``aminmax(...).item()``, two reads); a
    replay's direct replan does not."""
    plans, watch = host_work
    case = make_decode_case(mla=mla, bs=4, topk=topk, steps=3, seed=2)
    with_copy = _with_host_copy(case.batch)
    cls = FlashInferMLADecode if mla else FlashInferDecode
    with watch(case.runner, case.batch, with_copy) as dev:
        backend = cls(case.runner, topk, 3, tree_mode=tree_mode)
        public_reads = 2 if mla else 0
        for batch, reads in ((case.batch, 1), (with_copy, 0)):
            plans.clear()
            dev.recording, dev.reads = True, []
            backend.init_forward_metadata(batch)
            dev.recording = False
            assert len(dev.reads) == reads + public_reads, dev.reads
            assert sum(plans.values()) == 1, plans
        backend.init_cuda_graph_state(4, 4 * topk)
        backend.init_forward_metadata_capture_cuda_graph(case.batch)
        dev.recording, dev.reads = True, []
        backend.init_forward_metadata_replay_cuda_graph(case.batch, 4)
        dev.recording = False
        assert len(dev.reads) == 1, dev.reads


@pytest.mark.parametrize("steps", [2, 5])
def test_per_branch_replay_plans_each_step_wrapper_once(host_work, steps):
    """``per-branch`` mode: one wrapper per planned step (their KV sets differ), each planned
    once per call; no read of a device tensor with ``seq_lens_cpu``."""
    plans, watch = host_work
    case = make_decode_case(bs=3, topk=2, steps=steps, seed=steps)
    full = _with_host_copy(case.batch)
    with watch(case.runner, case.batch, full) as dev:
        backend = FlashInferDecode(case.runner, 2, steps, mode="per-branch")
        backend.init_cuda_graph_state(3, 6)
        backend.init_forward_metadata_capture_cuda_graph(full)
        plans.clear()
        dev.recording = True
        backend.init_forward_metadata_replay_cuda_graph(full, 3)
        dev.recording = False
        assert dev.reads == [], dev.reads
        assert len(plans) == max(steps - 1, 1) and set(plans.values()) == {1}, plans
        assert plans.public == 0


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("bs", [2, 5])
def test_extend_replay_metadata_plans_once_and_reads_nothing_back(host_work, monkeypatch, mla,
                                                                  bs):
    """An extend graph replay, with or without the batch's host copies: one schedule (the
    slot-list launch's), a direct replan without host lengths (no CSR copy, no host CSR),
    no public plan and no read of a device tensor."""
    plans, watch = host_work
    on_device = _record_device_csr(monkeypatch)
    lengths = []
    monkeypatch.setattr(_extend, "host_lengths",
                        lambda *a: lengths.append(1) or host_lengths(*a))
    case = make_extend_case(mla=mla, bs=bs, seed=bs)
    b = case.batch
    host = DraftExtendBatch(b.req_pool_indices, b.seq_lens, b.extend_lens, b.out_cache_loc,
                            b.seq_lens.clone(), b.extend_lens.clone())
    cls = FlashInferMLAExtend if mla else FlashInferExtend
    with watch(case.runner, b, host) as dev:
        backend = cls(case.runner)
        backend.init_cuda_graph_state(bs, int(b.extend_lens.sum()))
        backend.init_forward_metadata_capture_cuda_graph(host)
        direct = backend._graphs[bs]._direct
        for i, batch in enumerate((host, b)):
            plans.clear()
            lengths.clear()
            dev.recording, dev.reads = True, []
            backend.init_forward_metadata_replay_cuda_graph(batch, bs)
            dev.recording = False
            assert dev.reads == [], dev.reads
            assert sum(plans.values()) == 1 and len(plans) == 1, plans
            assert plans.public == 0 and direct.calls == i + 1 and lengths == []
    assert on_device == []  # the launch wrote the CSR, query indptr included


def _count_slot_list_launches(monkeypatch) -> list:
    """A list that gets an entry for every slot-list launch built from now on."""
    from specattn.kernels import prefix_slots as slots_module

    made: list = []
    build = slots_module._launch
    monkeypatch.setattr(slots_module, "_launch", lambda *a: made.append(1) or build(*a))
    return made


def _captured_extend(mla: bool, seed: int):
    """``(backend, batch, the batch with host copies)``: a flashinfer extend backend whose
    graph of 3 requests is captured with the host-copy batch."""
    case = make_extend_case(mla=mla, bs=3, seed=seed)
    b = case.batch
    host = DraftExtendBatch(b.req_pool_indices, b.seq_lens, b.extend_lens, b.out_cache_loc,
                            b.seq_lens.clone(), b.extend_lens.clone())
    backend = (FlashInferMLAExtend if mla else FlashInferExtend)(case.runner)
    backend.init_cuda_graph_state(3, int(b.extend_lens.sum()))
    backend.init_forward_metadata_capture_cuda_graph(host)
    return backend, b, host


@pytest.mark.parametrize("mla", [False, True])
def test_extend_replay_of_another_index_signature_builds_its_launch(host_work, monkeypatch,
                                                                     mla):
    """The slot-list launch's key takes the index tensors' signatures that the round's
    graph check computed: lengths of another stride build a launch of their own, and the
    first signature's launch serves its next replay."""
    made = _count_slot_list_launches(monkeypatch)
    backend, _, host = _captured_extend(mla, seed=5)
    backend.init_forward_metadata_replay_cuda_graph(host, 3)
    before = len(made)
    strided = torch.stack([host.seq_lens, host.seq_lens], 1)[:, 0]  # same values, stride 2
    backend.init_forward_metadata_replay_cuda_graph(DraftExtendBatch(
        host.req_pool_indices, strided, host.extend_lens, host.out_cache_loc,
        host.seq_lens_cpu, host.extend_lens_cpu), 3)
    assert len(made) == before + 1
    backend.init_forward_metadata_replay_cuda_graph(host, 3)
    assert len(made) == before + 1


@pytest.mark.parametrize("mla", [False, True])
def test_extend_replay_checks_a_batch_signature_once(host_work, monkeypatch, mla):
    """Where a graph round's checks read no values (device tensors), a replay whose batch
    tensors have the signature of the last checked one is not checked again, another count
    of new tokens included (the checks read only their slots' dtype, rank and device);
    another signature is, and an invalid batch of a new signature is still refused."""
    from specattn import base

    checked = []
    check = base.check_extend_batch
    monkeypatch.setattr(base, "check_extend_batch",
                        lambda *a, **kw: checked.append(1) or check(*a, **kw))
    backend, b, host = _captured_extend(mla, seed=7)
    for _ in range(3):
        backend.init_forward_metadata_replay_cuda_graph(host, 3)
    assert len(checked) == 1
    # One new token fewer: another count, the same signature.
    backend.init_forward_metadata_replay_cuda_graph(one_token_fewer(b, host_lengths=True), 3)
    assert len(checked) == 1
    backend.init_forward_metadata_replay_cuda_graph(b, 3)  # no host copies: a new signature
    assert len(checked) == 2
    bad = DraftExtendBatch(b.req_pool_indices, b.seq_lens, b.extend_lens[:2], b.out_cache_loc,
                           b.seq_lens.clone(), b.extend_lens[:2].clone())
    with pytest.raises(InvalidInputError, match="extend_lens"):
        backend.init_forward_metadata_replay_cuda_graph(bad, 3)


def _record_device_csr(monkeypatch) -> list:
    """The ``(on_device, qo_on_device)`` flags of every direct replan's CSR copy
    (``_replan``)."""
    seen: list = []
    copy = _replan.Replanner._copy_csr

    def recording(self, bufs, csr, on_device, qo_on_device=False):
        seen.append((on_device, qo_on_device))
        return copy(self, bufs, csr, on_device, qo_on_device)

    monkeypatch.setattr(_replan.Replanner, "_copy_csr", recording)
    return seen


def test_sglang_adapter_passes_the_engine_host_copies():
    """SGLang's ``seq_lens_cpu`` (and ``extend_seq_lens_cpu``, a list) become the batch's
    host copies; one of another length, or none, leaves the backend to copy the lengths."""
    from types import SimpleNamespace

    from specattn.backends.torch_ref import TorchRefDecode, TorchRefExtend
    from specattn.integrations.sglang.adapter import DecodeAdapter, ExtendAdapter

    assert FlashInferDecode.reads_host_lengths and FlashInferMLAExtend.reads_host_lengths
    assert not TorchRefDecode.reads_host_lengths
    case = make_decode_case(bs=3, topk=2, steps=3)
    b = case.batch
    adapter = DecodeAdapter(TorchRefDecode(case.runner, 2, 3))
    fb = SimpleNamespace(batch_size=3, req_pool_indices=b.req_pool_indices,
                         seq_lens=b.seq_lens, out_cache_loc=b.out_cache_loc.reshape(-1),
                         seq_lens_cpu=b.seq_lens.clone())
    assert adapter.draft_batch(fb).seq_lens_cpu is fb.seq_lens_cpu
    fb.seq_lens_cpu = fb.seq_lens_cpu[:2]
    assert adapter.draft_batch(fb).seq_lens_cpu is None
    del fb.seq_lens_cpu
    assert adapter.draft_batch(fb).seq_lens_cpu is None

    ext = make_extend_case(bs=3, seed=1)
    e = ext.batch
    adapter = ExtendAdapter(TorchRefExtend(ext.runner))
    fb = SimpleNamespace(batch_size=3, req_pool_indices=e.req_pool_indices,
                         seq_lens=e.seq_lens, extend_seq_lens=e.extend_lens,
                         out_cache_loc=e.out_cache_loc, seq_lens_cpu=e.seq_lens.clone(),
                         extend_seq_lens_cpu=e.extend_lens.tolist(),
                         forward_mode=SimpleNamespace(name="EXTEND"))
    got = adapter.extend_batch(fb)
    assert got.seq_lens_cpu is fb.seq_lens_cpu
    assert got.extend_lens_cpu.tolist() == e.extend_lens.tolist()
    fb.forward_mode = SimpleNamespace(name="DECODE")
    assert adapter.extend_batch(fb).extend_lens_cpu.tolist() == [1, 1, 1]


@pytest.mark.parametrize("mla", [False, True])
def test_kept_replays_reuse_one_slot_list_launch(fake_flashinfer, monkeypatch, mla):  # noqa: F811
    """Replay calls of one signature are kept (``graph_calls``): after the first, each
    launches the kept slot-list kernel, building no new launch."""
    made = _count_slot_list_launches(monkeypatch)
    case = make_decode_case(mla=mla, bs=3, topk=4, steps=3, seed=1)
    full = _with_host_copy(case.batch)
    backend = (FlashInferMLADecode if mla else FlashInferDecode)(case.runner, 4, 3)
    backend.init_cuda_graph_state(3, 12)
    backend.init_forward_metadata_capture_cuda_graph(full)
    backend.init_forward_metadata_replay_cuda_graph(full, 3)
    before = len(made)
    for _ in range(3):
        backend.init_forward_metadata_replay_cuda_graph(full, 3)
    assert len(backend._replays) == 1 and len(made) == before, made


@pytest.mark.parametrize("mla", [False, True])
def test_extend_replays_reuse_one_slot_list_launch(fake_flashinfer, monkeypatch, mla):  # noqa: F811
    """An extend graph pass keys its slot-list launch by the pass, its device CSR and the
    caller's two index tensors' signatures: replays after the first build no new launch."""
    made = _count_slot_list_launches(monkeypatch)
    backend, _, host = _captured_extend(mla, seed=4)
    backend.init_forward_metadata_replay_cuda_graph(host, 3)
    before = len(made)
    for _ in range(3):
        backend.init_forward_metadata_replay_cuda_graph(host, 3)
    assert before >= 1 and len(made) == before, made


def test_extend_replay_past_the_captured_rows_plans_from_host_lengths(fake_flashinfer):  # noqa: F811
    """A replay of more new tokens than the capture (within the graph's buffers) is
    refused before any plan: the captured launches cover the capture's tokens (FlashInfer's
    grid and ``merge_indptr`` are sized for them, and FlashInfer's own plan refused it with
    an assertion); a replay within the capture's tokens plans without the lengths."""
    case = make_extend_case(mla=False, bs=3, seed=6)
    b = case.batch
    host = DraftExtendBatch(b.req_pool_indices, b.seq_lens, b.extend_lens, b.out_cache_loc,
                            b.seq_lens.clone(), b.extend_lens.clone())
    backend = FlashInferExtend(case.runner)
    tokens = int(b.extend_lens.sum())
    backend.init_cuda_graph_state(3, 2 * tokens)
    backend.init_forward_metadata_capture_cuda_graph(host)
    direct = backend._graphs[3]._direct
    backend.init_forward_metadata_replay_cuda_graph(host, 3)
    assert direct.calls == 1
    more = b.extend_lens.clone()
    more[0] += 1
    loc = torch.arange(tokens + 1, dtype=b.out_cache_loc.dtype)
    bigger = DraftExtendBatch(b.req_pool_indices, b.seq_lens + (more - b.extend_lens), more,
                              loc, None, None)
    with pytest.raises(InvalidInputError, match=r"^batch: expected at most 7 new tokens "
                                                r"\(the capture at bs=3"):
        backend.init_forward_metadata_replay_cuda_graph(bigger, 3)
    assert direct.calls == 1


@pytest.mark.parametrize("mla", [False, True])
def test_a_layer_of_other_scaling_after_a_lengthless_replay_is_refused(fake_flashinfer,  # noqa: F811
                                                                        mla):
    """A graph replay's metadata planned without host lengths keeps no host CSR to plan
    other scaling with: a forward of such a layer is refused with the layer named."""
    from specattn.backends.flashinfer._passes import Params, replan

    backend, _, host = _captured_extend(mla, seed=7)
    backend.init_forward_metadata_replay_cuda_graph(host, 3)
    with pytest.raises(InvalidInputError, match="layer: .*without host lengths"):
        replan([backend._pass], backend.params, Params(0.5, 0.0))


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("lengths", [True, False], ids=["host-lengths", "lengthless"])
def test_extend_replay_of_fewer_tokens_pads_the_fixed_slots(host_work, mla, lengths):
    """A replay of one new token fewer than its capture: the fixed ``out_cache_loc`` the
    captured KV write reads holds the batch's slots, then slot 0 (it had kept the capture
    round's last slot, which the replayed write overwrote)."""
    backend, b, host = _captured_extend(mla, seed=9)
    fixed = backend._require_graph_state().loc
    tokens = int(b.extend_lens.sum())
    assert int(fixed[tokens - 1]) != 0
    fewer = one_token_fewer(b, host_lengths=lengths)
    backend.init_forward_metadata_replay_cuda_graph(fewer, 3)
    assert torch.equal(fixed[:tokens - 1], fewer.out_cache_loc) and int(fixed[tokens - 1]) == 0
