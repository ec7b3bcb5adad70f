"""Direct replans of FlashInfer CUDA-graph wrappers: the native planner, not the public ``plan``.

Shapes: a graph wrapper of ``M`` sequences (fixed at capture) over the captured device buffers
``qo_indptr [M + 1]``, ``kv_indptr [M + 1]``, ``kv_indices [capacity]`` (and ``kv_lens [M]``),
int32. A replan takes the round's ``HostCSR`` (pinned host ``qo_indptr``, ``kv_indptr`` ``[M +
1]``, ``kv_lens [M]`` and their totals as Python ints) and leaves the wrapper as FlashInfer
0.7.4's public ``plan`` of the same batch would: the native planner's ``plan_info`` where the
public plan stores it (its schedule written into the wrapper's int workspace by the planner
itself), the host CSR copied into the captured buffers (``non_blocking`` from pinned memory)
and the host facts ``run`` reads (query rows, longest key list).

Why: an engine re-plans before every replay, and the public ``plan`` costs far more host
time than the native planner it ends with. The prefill and decode plans redo dozens of small
torch ops and the backend pick every time; the MLA plan builds a new planned-backend object
with a fresh 8 MiB pinned buffer, validates the CSR twice, clones the captured buffers and
reads ``aminmax(kv_indices)`` back from the device (a sync). For a graph wrapper whose
module, dtypes, heads, scale and flags are those of its last public plan, everything but the
CSR is already settled, so a replan is the planner call and the CSR's copies. The slot list
needs no copy: the glue writes it into the captured ``kv_indices`` buffer itself, and in
graph rounds the key indptr and lengths too (``Replanner.device_buffers``), so a replan
copies at most the query indptr, and a kept one (the prefix pass's ``K`` rows per request)
not again. ``last_page_len`` (pages of one token: all ones) was copied by the first plan and
never changes. The MLA bound that the public plan reads from the device (the range of
``kv_indices``, checked by its ``run``) is the pool: every slot the glue lists is clamped
into ``[0, num_slots)``.

A graph replan calls no planner at all where the caller's slot-list launch wrote the
round's schedule (``schedule``; ``scheduled=True``): a prefill wrapper planned by FA2 (the
extend pass, the decode's prefix pass; ``_prefill_plan``) and an MLA wrapper
(``_mla_plan``). Their grids (and FA2's query tile and split path) are the capture's, so the
capture's ``plan_info`` stays. Where that launch cannot write it (Triton does not run on the
device, a ``plan_info`` not laid out as 0.7.4's) the native planner serves.

``direct_replanner`` makes a replanner after a public plan, or returns ``None`` (the caller
keeps the public plan) for any state it does not recognise: not a graph wrapper, another
backend than FlashInfer's fa2/fa3 planners, plan arguments it does not reproduce, or a
FlashInfer whose wrapper attributes differ from 0.7.4's; it logs once at INFO why. A
replanner also declines a batch the public plan would refuse or treat otherwise (another
batch size, more query rows than captured, a broken ``uniform_q_len`` promise): the caller
then runs the public plan, which raises or plans it.
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch

from ...util import sm_count
from ._prefill_plan import device_schedule

if TYPE_CHECKING:
    from ._mla_plan import MLASchedule
    from ._slots import HostCSR

__all__ = ["Replanner", "direct_replanner"]

log = logging.getLogger("specattn.backends.flashinfer")

_LOGGED: set[str] = set()

# Plan arguments a replan reproduces (anything else keeps the public plan), by wrapper kind.
_PREFILL_ARGS = frozenset({"head_dim_vo", "causal", "sm_scale", "logits_soft_cap",
                           "q_data_type", "kv_data_type", "seq_lens",
                           "max_token_per_sequence", "uniform_q_len", "disable_split_kv",
                           "fixed_split_size"})
_DECODE_ARGS = frozenset({"sm_scale", "logits_soft_cap", "q_data_type", "kv_data_type"})
_MLA_ARGS = frozenset({"metadata", "num_heads", "head_dim_ckv", "head_dim_kpe", "page_size",
                       "causal", "sm_scale", "q_data_type", "kv_data_type", "query_layout",
                       "kv_cache_layout", "lse_mode", "scale_mode"})

_PREFILL_ATTRS = ("_float_workspace_buffer", "_int_workspace_buffer",
                  "_pin_memory_int_workspace_buffer", "_qo_indptr_buf", "_paged_kv_indptr_buf",
                  "_kv_lens_buffer", "_max_total_num_rows", "_fixed_batch_size", "_backend",
                  "_cached_module", "_plan_info", "_jit_module")
_DECODE_ATTRS = ("_float_workspace_buffer", "_int_workspace_buffer",
                 "_pin_memory_int_workspace_buffer", "_paged_kv_indptr_buf",
                 "_fixed_batch_size", "_backend", "_cached_module", "_plan_info", "_jit_module",
                 "use_tensor_cores", "_use_xqa_mtp_decode", "_uses_cudnn", "_q_len_per_req")
_MLA_BACKEND_ATTRS = ("_float_workspace_buffer", "_int_workspace_buffer",
                      "_pin_memory_int_workspace_buffer", "_qo_indptr_buf", "_kv_indptr_buf",
                      "_kv_indices_buf", "_kv_len_arr_buf", "_cached_module", "_plan_info",
                      "_backend", "_plan_capabilities", "_causal", "_head_dim_ckv",
                      "_kv_data_type", "_plan_generated_fa", "device")


def _fall_back(why: str, what: str = "FlashInfer graph replans use the public plan") -> None:
    """Log once at INFO why a wrapper keeps FlashInfer's public plan (or, ``what``, another
    fallback)."""
    if why not in _LOGGED:
        _LOGGED.add(why)
        log.info("%s: %s", what, why)


def _missing(obj: Any, names: tuple) -> Optional[str]:
    absent = [n for n in names if not hasattr(obj, n)]
    return f"{type(obj).__name__} has no {', '.join(absent)} (not FlashInfer 0.7.4's " \
        "attributes)" if absent else None


class Replanner:
    """``replanner(csr, on_device, qo_on_device) -> bool``: one direct replan of its wrapper
    for ``csr``; ``False`` (nothing changed) where the public plan must serve this batch.
    ``key``: the plan-time parameters it was made for (the caller's; another key needs a
    public plan).

    ``on_device``: the caller wrote ``kv_indptr`` and ``kv_lens`` of ``csr`` into
    ``device_buffers()`` itself (``kernels.prefix_slots``), so only the query indptr is
    copied, and only when it is another host tensor than the last one copied (a kept
    ``qo_indptr`` is never written); ``qo_on_device``: it wrote the query indptr there too
    (an extend's), so nothing is copied."""

    #: Where the caller's slot-list launch writes this wrapper's schedule (``None``: the
    #: native planner writes it; ``_prefill_plan``, ``_mla_plan``).
    schedule: Optional[Any] = None

    def __init__(self, wrapper: Any, key: Any) -> None:
        self.wrapper = wrapper
        self.key = key
        self.calls = 0  # direct replans made
        self._qo_copied: Any = None  # the host qo_indptr last copied to the device
        self._rows_schedule: Any = None  # ``schedule`` for the last ``schedule_for`` rows

    def schedule_for(self, rows: int) -> Any:
        """``schedule`` for a launch whose requests have ``rows`` query rows each where it
        does not write the query indptr (a decode's ``K``), kept for the next round."""
        s = self.schedule
        if s is None or s.qrows == rows:
            return s
        if self._rows_schedule is None or self._rows_schedule.qrows != rows:
            self._rows_schedule = s._replace(qrows=rows)  # (``schedule`` is set once)
        return self._rows_schedule

    def __call__(self, csr: "HostCSR", on_device: bool = False,
                 qo_on_device: bool = False, scheduled: bool = False) -> bool:
        """``scheduled``: the caller's launch wrote ``csr``'s schedule at ``schedule``."""
        if not self._replan(csr, on_device, qo_on_device, scheduled):
            return False
        self.calls += 1
        return True

    def device_buffers(self) -> Optional[tuple]:
        """``(kv_indptr [M + 1], kv_lens [M], qo_indptr [M + 1])``: the captured int32
        buffers a replan copies the host CSR's into (``None``: this wrapper takes no
        device-written CSR)."""
        return None

    def lengthless(self, bs: int, rows: int) -> bool:
        """One replan of a round whose CSR and schedule (``schedule``) the caller's launch
        writes, made from what the host knows without the lengths: ``bs`` sequences and
        ``rows`` query rows in all. ``False`` (nothing changed) where that does not settle
        it: the caller then plans from host lengths."""
        return False

    def _copy_csr(self, bufs: tuple, csr: "HostCSR", on_device: bool,
                  qo_on_device: bool = False) -> None:
        """The host CSR into the captured ``bufs`` ``(qo_indptr, kv_indptr, kv_lens)``
        (``non_blocking`` from pinned memory), but what ``on_device`` / ``qo_on_device`` say
        is there."""
        qo, kv, lens = bufs
        if qo_on_device:
            self._qo_copied = None
        elif csr.qo_indptr is not self._qo_copied or not on_device:
            qo.copy_(csr.qo_indptr, non_blocking=True)
            self._qo_copied = csr.qo_indptr if on_device else None
        if not on_device:
            kv.copy_(csr.kv_indptr, non_blocking=True)
            lens.copy_(csr.kv_lens, non_blocking=True)

    def _replan(self, csr: "HostCSR", on_device: bool, qo_on_device: bool,
                scheduled: bool) -> bool:
        raise NotImplementedError


def _uniform_rows(csr: "HostCSR", rows: int) -> bool:
    """Every sequence of ``csr`` has ``rows`` query rows (host arithmetic)."""
    qo = csr.qo_indptr.numpy()
    return bool(np.all(np.diff(qo) == rows))


class _PrefillReplanner(Replanner):
    """``BatchPrefillWithPagedKVCacheWrapper`` (0.7.4 ``prefill.py``: ``plan``'s native call
    and graph-buffer copies)."""

    def __init__(self, wrapper: Any, key: Any, kw: dict, heads: tuple) -> None:
        super().__init__(wrapper, key)
        w = wrapper
        hq, hkv, d_qk, page = heads
        d_vo = kw.get("head_dim_vo") or d_qk
        fa2 = w._backend == "fa2"
        self.uniform = int(kw.get("uniform_q_len") or 0) if fa2 else 0
        # plan(): fixed_split_size None -> -1, forwarded as `fixed_split_size or -1`.
        split = kw.get("fixed_split_size")
        split = -1 if split is None else split
        self.head = (w._float_workspace_buffer, w._int_workspace_buffer,
                     w._pin_memory_int_workspace_buffer)
        self.shape = (hq, hkv, page, True, d_qk, d_vo, bool(kw.get("causal", False)), -1)
        self.tail = (split or -1, bool(kw.get("disable_split_kv", False)), 0) if fa2 else None
        self.seq_lens = kw.get("seq_lens") is not None
        self.plan = w._cached_module.plan
        self._uniform_qo = None  # the last qo_indptr found uniform (host CSRs are not written)
        # The captured CSR buffers, sliced once (a replan serves the captured size only).
        self.bufs = (w._qo_indptr_buf, w._paged_kv_indptr_buf,
                     w._kv_lens_buffer[:w._fixed_batch_size])
        if fa2:
            self.schedule = device_schedule(w, w._plan_info, w._fixed_batch_size, heads,
                                            uniform=self.uniform,
                                            disable_split_kv=self.tail[1],
                                            fixed_split_size=split)
            if self.schedule is None:
                _fall_back(f"plan_info {w._plan_info!r} is not FlashInfer 0.7.4's FA2 graph "
                           "layout, another FlashInfer release, or Triton does not run there",
                           "FlashInfer prefill graph replans run its host planner")

    def device_buffers(self) -> Optional[tuple]:
        return (*self.bufs[1:], self.bufs[0])

    def lengthless(self, bs: int, rows: int) -> bool:
        """The captured size and at most the captured rows (FlashInfer's ``merge_indptr``
        and grid are sized for them), no uniform-rows promise to check; the facts ``run``
        would read that need no lengths (a graph replay reads none)."""
        w = self.wrapper
        cap = w._max_total_num_rows
        if self.schedule is None or self.uniform or bs != w._fixed_batch_size or \
                cap is None or rows > cap:
            return False
        w._batch_size = bs
        w._qo_indptr_last = rows
        self.calls += 1
        return True

    def _replan(self, csr: "HostCSR", on_device: bool, qo_on_device: bool,
                scheduled: bool) -> bool:
        w = self.wrapper
        bs = csr.kv_lens.shape[0]
        cap = w._max_total_num_rows
        if bs != w._fixed_batch_size or (cap is not None and csr.rows > cap):
            return False  # the public plan raises its error
        args = [*self.head, csr.qo_indptr, csr.kv_indptr, csr.kv_lens, cap or csr.rows, bs,
                *self.shape]
        if self.tail is not None:
            uniform = self.uniform
            # A query indptr the caller wrote on the device is in a kept host buffer whose
            # values change: checked every time.
            if uniform and (qo_on_device or csr.qo_indptr is not self._uniform_qo):
                if not _uniform_rows(csr, uniform):
                    return False  # FlashInfer drops the hint with a warning: its plan serves it
                self._uniform_qo = csr.qo_indptr
            args += [*self.tail, uniform, False]
        self._copy_csr(self.bufs, csr, on_device, qo_on_device)
        if not (scheduled and self.schedule is not None):
            w._plan_info = self.plan(*args)
        w._batch_size = bs
        w._qo_indptr_last = csr.rows
        w._max_q_len = csr.max_q
        w._max_kv_len = csr.max_kv
        if self.seq_lens:
            w._seq_lens_kv = w._seq_lens_q = csr.kv_lens
        return True


class _DecodeReplanner(Replanner):
    """``BatchDecodeWithPagedKVCacheWrapper`` on tensor cores (0.7.4 ``decode.py``:
    ``_plan_impl``'s native call and graph-buffer copies; one query row per sequence)."""

    def __init__(self, wrapper: Any, key: Any, kw: dict, heads: tuple) -> None:
        super().__init__(wrapper, key)
        w = wrapper
        hq, hkv, d, page = heads
        self.head = (w._float_workspace_buffer, w._int_workspace_buffer,
                     w._pin_memory_int_workspace_buffer)
        self.shape = (hq, hkv, page, True, d, d, False, -1)
        # fixed_split_size -1, disable_split_kv, num_colocated_ctas, q_len_per_req, fixed.
        self.tail = (-1, False, 0, 1, True) if w._backend == "fa2" else ()
        self.plan = w._cached_module.plan

    def _replan(self, csr: "HostCSR", on_device: bool, qo_on_device: bool,
                scheduled: bool) -> bool:
        w = self.wrapper
        bs = csr.kv_lens.shape[0]
        if on_device or bs != w._fixed_batch_size or csr.rows != bs:
            return False
        w._paged_kv_indptr_buf.copy_(csr.kv_indptr, non_blocking=True)
        w._plan_info = self.plan(*self.head, csr.qo_indptr, csr.kv_indptr, csr.kv_lens, bs, bs,
                                 *self.shape, *self.tail)
        w._batch_size = bs
        w._max_kv_len = csr.max_kv
        return True


class _MLAReplanner(Replanner):
    """``BatchMLAPagedAttentionWrapper`` planned on fa2/fa3 (0.7.4
    ``mla/_batch_mla/_backends/_fa_common.py``: ``_plan_generated_fa`` on the planned backend
    the first plan made, which a graph wrapper keeps).

    ``schedule`` (``_mla_plan.MLASchedule``, ``None`` where it cannot run): where the
    caller's slot-list launch writes the round's schedule (``scheduled=True``); a replan
    then copies at most the query indptr. FlashInfer's planner below serves otherwise.

    0.7.4's MLA module is a proxy (``_BatchMLAModuleProxy``) whose native planner writes the
    schedule into the pinned int workspace and returns the bytes it staged; the proxy then
    copies them on the host into a fresh pinned buffer and from there to the device, so that
    the next plan cannot overwrite bytes whose copy is still pending. A replan calls the
    native planner itself on a pinned block from torch's caching host allocator (which hands
    out a block only once the copies from it are done) and copies the staged bytes from that
    block: the same bytes, without the host copy.

    The public plan's check of the workload against the native planner's limits
    (``_validate_fa_plan_workload``) runs where it could refuse the batch: where the
    work-item bound, ``ceil(max_q * H / 64)`` items per sequence plus one split per SM,
    could pass the planner's capacity, and for a causal plan whose heads do not divide 64
    (FlashInfer then refuses query tiles that end inside a query's heads at some key
    positions)."""

    def __init__(self, wrapper: Any, key: Any, num_heads: int, kv_bound: int,
                 validate: Callable, capacity: Optional[int]) -> None:
        super().__init__(wrapper, key)
        pb = self.backend = wrapper._planned_backend
        self.schedule = _device_mla_schedule(pb, num_heads)
        self.head = (pb._float_workspace_buffer, pb._int_workspace_buffer,
                     pb._pin_memory_int_workspace_buffer)
        self.num_heads, self.kv_bound, self.validate = num_heads, kv_bound, validate
        self.capacity = capacity  # the planner's work items (None: always check)
        self.sms = sm_count(pb.device) or 0
        module = pb._cached_module
        self.staged = hasattr(module, "plan_with_staged_workspace_bytes")
        raw = getattr(module, "_module", None) if self.staged else None
        self.raw = raw.plan if raw is not None and hasattr(raw, "plan") else None
        self.pin = pb._pin_memory_int_workspace_buffer.is_pinned()
        self.plan = module.plan_with_staged_workspace_bytes if self.staged else module.plan

    def device_buffers(self) -> Optional[tuple]:
        pb = self.backend
        return pb._kv_indptr_buf, pb._kv_len_arr_buf, pb._qo_indptr_buf

    def lengthless(self, bs: int, rows: int) -> bool:
        """The captured size, and a workload the planner's check could not refuse with
        ``rows`` as the bound of every sequence's rows; the facts ``run`` would read."""
        pb = self.backend
        if self.schedule is None or bs != pb._kv_len_arr_buf.shape[0] or \
                self._checked(rows, bs):
            return False
        pb._planned_query_shape = (rows, self.num_heads)
        pb._planned_kv_page_range = (0, self.kv_bound)
        self.calls += 1
        return True

    def _checked(self, max_q: int, bs: int) -> bool:
        """Whether the batch needs the public plan's workload check. Its work count is at
        most the query tiles plus one split per cluster (a split is at least the average
        of a cluster's keys), causal or not; a causal plan is also refused where a 64-row
        query tile can end inside a query's heads (heads not dividing 64). ``max_q``: the
        most query rows of a sequence (or a bound of it)."""
        if self.capacity is None or not self.sms or (self.backend._causal
                                                     and 64 % self.num_heads):
            return True
        items = bs * -(-max_q * self.num_heads // 64)
        # Key counts under 2**29 keep the planner's int32 split arithmetic in range.
        return items + self.sms > self.capacity or \
            self.backend._kv_indices_buf.shape[0] >= 1 << 29

    def _native(self, csr: "HostCSR") -> tuple:
        """``(plan_info, staged bytes)`` of the native planner, its schedule in the int
        workspace (copy queued)."""
        pb = self.backend
        args = (csr.qo_indptr, csr.kv_indptr, csr.kv_lens, self.num_heads, pb._head_dim_ckv,
                pb._causal)
        if self.raw is None:
            out = self.plan(*self.head, *args)
            return out if self.staged else (out, 0)
        scratch = self.head[2]
        block = torch.empty(scratch.numel(), dtype=torch.uint8, pin_memory=self.pin)
        plan_info, staged = self.raw(self.head[0], self.head[1], block, *args)
        staged = int(staged)
        device = self.head[1].view(torch.uint8)
        if not 0 <= staged <= min(block.numel(), device.numel()):
            raise ValueError(f"FlashInfer's MLA planner staged {staged} bytes of a "
                             f"{block.numel()}-byte workspace")
        device[:staged].copy_(block[:staged], non_blocking=True)
        return plan_info, staged

    def _replan(self, csr: "HostCSR", on_device: bool, qo_on_device: bool,
                scheduled: bool) -> bool:
        pb = self.backend
        bs = csr.kv_lens.shape[0]
        if bs != pb._kv_len_arr_buf.shape[0] or csr.total > pb._kv_indices_buf.shape[0]:
            return False
        if self._checked(csr.max_q, bs):  # host lists: the CSR is on the host
            self.validate(csr.qo_indptr, csr.kv_lens, self.num_heads, pb._causal, pb.device,
                          pb._backend, pb._kv_data_type)
        self._copy_csr((pb._qo_indptr_buf, pb._kv_indptr_buf, pb._kv_len_arr_buf), csr,
                       on_device, qo_on_device)
        if not (scheduled and self.schedule is not None):  # else the caller's launch wrote it
            plan_info, staged = self._native(csr)
            pb._plan_info = self.wrapper._plan_info = plan_info
            pb._staged_int_workspace_bytes = staged
        pb._planned_query_shape = (csr.rows, self.num_heads)
        pb._planned_kv_page_range = (0, self.kv_bound) if csr.total > 0 else (0, 0)
        return True


def _device_mla_schedule(backend: Any, num_heads: int) -> Optional["MLASchedule"]:
    """Where a slot-list launch writes a planned MLA backend's schedule (``_mla_plan``), or
    ``None`` (logged once) where Triton does not run on its device or its ``plan_info`` is
    not 0.7.4's."""
    from ._mla_plan import mla_schedule_for  # Triton: once a graph pass plans

    schedule = mla_schedule_for(backend, num_heads)
    if schedule is None:
        _fall_back(f"plan_info {backend._plan_info!r} is not FlashInfer 0.7.4's MLA layout, "
                   f"or Triton does not run on {backend.device}",
                   "FlashInfer MLA graph replans run its host planner")
    return schedule


def _prefill(wrapper: Any, key: Any, kw: dict, heads: tuple):
    why = _missing(wrapper, _PREFILL_ATTRS)
    if why:
        return why
    extra = sorted(set(kw) - _PREFILL_ARGS)
    if extra:
        return f"prefill plan arguments {extra}"
    if wrapper._backend not in ("fa2", "fa3") or wrapper._jit_module is not None:
        return f"prefill backend {wrapper._backend!r} (the native planner: fa2/fa3)"
    if getattr(wrapper, "_eagle_verify_fp8kv_sm90_state", None) is not None or \
            getattr(wrapper, "_cudnn_q_lens_buffer", None) is not None:
        return "a prefill plan with a specialized kernel (eagle-verify / cuDNN state)"
    return _PrefillReplanner(wrapper, key, kw, heads)


def _decode(wrapper: Any, key: Any, kw: dict, heads: tuple):
    why = _missing(wrapper, _DECODE_ATTRS)
    if why:
        return why
    extra = sorted(set(kw) - _DECODE_ARGS)
    if extra:
        return f"decode plan arguments {extra}"
    w = wrapper
    if not w.use_tensor_cores or w._backend not in ("fa2", "fa3") or w._jit_module is not None \
            or w._use_xqa_mtp_decode or w._uses_cudnn or w._q_len_per_req != 1:
        return f"decode backend {w._backend!r} (the native planner: fa2/fa3 on tensor cores)"
    return _DecodeReplanner(wrapper, key, kw, heads)


def _mla(wrapper: Any, key: Any, kw: dict, kv_bound: int):
    extra = sorted(set(kw) - _MLA_ARGS)
    if extra:
        return f"MLA plan arguments {extra}"
    pb = getattr(wrapper, "_planned_backend", None)
    if pb is None:
        return "an MLA wrapper without a planned backend (not FlashInfer 0.7.4's)"
    why = _missing(pb, _MLA_BACKEND_ATTRS)
    if why:
        return why
    if pb._backend not in ("fa2", "fa3") or \
            not getattr(pb._plan_capabilities, "supports_cuda_graph_replan", False):
        return f"MLA backend {pb._backend!r} (the native planner: fa2/fa3)"
    common = inspect.getmodule(pb._plan_generated_fa)
    validate = getattr(common, "_validate_fa_plan_workload", None)
    if validate is None:
        return "FlashInfer's MLA workload check (_validate_fa_plan_workload) is missing"
    capacity = getattr(common, "_FA_MAX_WORK_ITEMS", None)
    return _MLAReplanner(wrapper, key, kw["num_heads"], kv_bound, validate,
                         capacity if isinstance(capacity, int) else None)


def direct_replanner(kind: str, wrapper: Any, key: Any, kw: dict, *, heads: tuple = (),
                     kv_bound: int = 0) -> Optional[Replanner]:
    """The replanner of ``wrapper`` after a public plan, or ``None`` (logged once at INFO).

    kind: ``"prefill"``, ``"decode"`` or ``"mla"``; key: the caller's plan-time parameters;
    kw: the keyword arguments that public plan was given. heads: ``(num_qo_heads,
    num_kv_heads, head_dim, page_size)`` of a prefill / decode plan (its positional
    arguments); kv_bound: the pages (token slots) of the MLA pool, which bound every listed
    index."""
    if not getattr(wrapper, "_use_cuda_graph", False):
        _fall_back(f"{type(wrapper).__name__} is not a CUDA-graph wrapper")
        return None
    if kind == "prefill":
        got = _prefill(wrapper, key, kw, heads)
    elif kind == "decode":
        got = _decode(wrapper, key, kw, heads)
    else:
        got = _mla(wrapper, key, kw, kv_bound)
    if isinstance(got, str):
        _fall_back(got)
        return None
    return got
