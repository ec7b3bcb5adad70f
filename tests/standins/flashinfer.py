"""A pure-torch stand-in for the FlashInfer API the ``flashinfer`` glue uses.

Page-size-1 CSR wrappers (prefill, decode, MLA) with FlashInfer's documented semantics:
indptrs staged on the host at ``plan``, indices read at run time (or copied into the graph
buffers), bottom-right causal masks, base-2 LSE. The prefill wrapper's ``plan`` also takes
``seq_lens=`` and ``max_token_per_sequence=`` (values FlashInfer otherwise computes from the
indptrs; checked to be those). ``make()`` returns a fresh ``flashinfer`` module.

FP8 KV as FlashInfer 0.7.4 takes it: ``plan(..., q_data_type=, kv_data_type=)`` names the
dtypes ``run`` must be given (``_check_cached_qkv_data_type``); the MHA wrappers' ``run(...,
k_scale=, v_scale=)`` are host floats (``sm_scale *= k_scale``, ``out *= v_scale`` in the
output dtype); the MLA wrapper takes an FP8 pool only as e4m3 with a bf16 query, rank 512 and
rope 0/64, ``scale_mode="kv-per-tensor"``, and ``run(..., ckv_scale=, kpe_scale=)`` floats.

Plan state as 0.7.4 keeps it, so a direct replan (``_replan``) is checked against the public
``plan``: each wrapper (MLA: its planned backend, a new one per public plan) has the float,
int and pinned int workspaces, the captured buffers, ``_plan_info`` and ``_cached_module``
under 0.7.4's names; the public plan ends with the native planner (``FakePlanner``, the
argument list of 0.7.4's call), which writes a schedule of its arguments into the int
workspace. ``run`` reads the CSR from the captured buffers and checks that the int workspace
holds their schedule; the MLA wrapper's planner writes FlashInfer's real MLA schedule
(``flashinfer_mla``) and its ``run`` computes what that schedule says, reading nothing else. The public MLA plan reads the range of ``kv_indices`` back from the
device (``aminmax(...).item()``), as 0.7.4 does.
"""

from __future__ import annotations

import math
import types
from typing import Optional

import torch

from . import flashinfer_mla as mla
from . import flashinfer_prefill as prefill
from ._common import expect, masked_pv

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SMS = prefill.SMS  # the SMs the stand-in's planners count


def _host_scale(name, value):
    """FlashInfer multiplies its scales into host numbers: a float (or None), no tensor."""
    expect(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)),
           f"{name}: FlashInfer takes a host float here, got {type(value).__name__}")
    return 1.0 if value is None else float(value)


def _check_dtypes(wrapper, q, k):
    expect(q.dtype == wrapper.q_data_type and k.dtype == wrapper.kv_data_type,
           f"run: q {q.dtype} / kv {k.dtype}, the plan said q_data_type "
           f"{wrapper.q_data_type} / kv_data_type {wrapper.kv_data_type}")


def _attend_csr(q, k, v, qo, kv, indices, causal, scale, cap, v_scale=1.0):
    """Per sequence: rows ``q[qo[m]:qo[m+1]]`` over slots ``indices[kv[m]:kv[m+1]]``.
    q: [rows, H, D]; k: [slots, H_kv, D]; v: [slots, H_kv, Dv] (FP8 codes: ``scale`` holds
    the key scale, ``v_scale`` multiplies the output). Returns (o, lse base 2)."""
    rows, heads = q.shape[0], q.shape[1]
    out = torch.zeros(rows, heads, v.shape[-1], dtype=q.dtype)
    lse = torch.full((rows, heads), float("-inf"))
    group = heads // k.shape[1]
    for m in range(len(kv) - 1):
        a, b = qo[m], qo[m + 1]
        slots = indices[kv[m]:kv[m + 1]].long()
        if b == a or slots.numel() == 0:
            continue
        kk = k[slots].float().repeat_interleave(group, 1)
        vv = v[slots].float().repeat_interleave(group, 1)
        s = torch.einsum("mhd,nhd->hmn", q[a:b].float(), kk) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        vis = None
        if causal:
            n_kv, n_q = slots.numel(), b - a
            vis = (torch.arange(n_kv)[None, :] <= torch.arange(n_q)[:, None] + n_kv - n_q)[None]
            s = s.masked_fill(~vis, float("-inf"))
        out[a:b] = (masked_pv(torch.softmax(s, -1), vv, vis, "hmn,nhd->mhd").to(q.dtype)
                    .float() * v_scale).to(q.dtype)
        lse[a:b] = (torch.logsumexp(s, -1) / math.log(2)).T
    return out, lse


class FakePlanner:
    """The compiled module's native planner (0.7.4): ``plan(float_ws, int_ws, pinned_int_ws,
    qo_indptr_h, kv_indptr_h, kv_lens_h, *scalars)`` with host int32 CSR arrays. It writes a
    schedule derived from every argument into the pinned buffer, copies it into the int
    workspace (as the real planner's ``cudaMemcpyAsync``) and returns ``plan_info``, a list of
    ints; ``calls`` records each call's arguments. ``copies=False``: the MLA module's
    native planner, which only stages the schedule in the pinned buffer (``FakeMLAProxy``
    copies it)."""

    def __init__(self, copies: bool = True) -> None:
        self.calls: list[tuple] = []
        self.copies = copies

    def plan(self, *args):
        return self._plan_staged(*args)[0]

    def _plan_staged(self, *args):
        fws, iws, pin, qo, kv, lens = args[:6]
        for t in (qo, kv, lens):
            expect(t.device.type == "cpu" and t.dtype == torch.int32,
                   "the native planner reads host int32 CSR arrays")
        expect(pin.device.type == "cpu" and iws.device == fws.device,
               "the native planner takes the pinned host copy of the int workspace")
        self.calls.append(args)
        plan_info, used = self._stage(*args)
        if self.copies:
            iws[:used].copy_(pin[:used], non_blocking=True)
        return plan_info, used

    def _stage(self, fws, iws, pin, qo, kv, lens, *scalars):
        """``(plan_info, bytes)``: a schedule of every argument staged in ``pin``."""
        schedule = torch.tensor(qo.tolist() + kv.tolist() + lens.tolist()
                                + [int(a) for a in scalars], dtype=torch.int32)
        used = schedule.numel() * 4
        pin.view(torch.int32)[:schedule.numel()].copy_(schedule)
        return [used, lens.numel(), int(qo[-1]), int(kv[-1]), hash(tuple(schedule.tolist()))], used


class FakeFA2Planner(FakePlanner):
    """The prefill module's native planner (0.7.4's FA2 ``PrefillPlan``): FlashInfer's real
    schedule and ``plan_info`` (``flashinfer_prefill``) for ``SMS`` SMs."""

    def _stage(self, fws, iws, pin, qo, kv, lens, total_rows, bs, hq, hkv, page, graph,
               d_qk, d_vo, causal, window, split, disable, colocated, uniform, fixed_uniform):
        expect(window == -1 and colocated == 0 and not fixed_uniform,
               "the stand-in plans without a window, colocated CTAs or fixed uniform rows")
        plan_info, arrays, used = prefill.fa2_plan(
            qo.tolist(), kv.tolist(), total_rows, hq, hkv, d_vo, page=page, graph=bool(graph),
            uniform=uniform, disable_split_kv=bool(disable), fixed_split_size=split,
            sms=prefill.SMS)
        prefill.stage(pin, plan_info, arrays)
        return plan_info, used


class FakeMLANative(FakePlanner):
    """The MLA module's native planner (0.7.4): stages FlashInfer's MLA schedule
    (``flashinfer_mla.mla_plan``) in the pinned buffer it is given, copies nothing and returns
    ``(plan_info, staged bytes)``: ``plan(float_ws, int_ws, pinned, qo, kv, lens, heads,
    head_dim, causal)``."""

    def __init__(self) -> None:
        super().__init__(copies=False)

    def plan(self, *args):
        return self._plan_staged(*args)

    def _stage(self, fws, iws, pin, qo, kv, lens, heads, head_dim, causal):
        plan_info, arrays = mla.mla_plan(qo.tolist(), kv.tolist(), lens.tolist(), heads,
                                         causal)
        return plan_info, mla.stage(pin, arrays)


class FakeMLAProxy:
    """0.7.4's ``_BatchMLAModuleProxy`` around ``FakeMLANative`` (``_module``):
    ``plan_with_staged_workspace_bytes`` copies the staged bytes on the host into a fresh
    buffer, then into the int workspace; ``calls``: the native planner's."""

    def __init__(self) -> None:
        self._module = FakeMLANative()
        self.calls = self._module.calls

    def plan_with_staged_workspace_bytes(self, *args):
        plan_info, staged = self._module.plan(*args)
        staging = args[2][:staged].clone()
        args[1][:staged].copy_(staging, non_blocking=True)
        return plan_info, staged

    def plan(self, *args):
        return self.plan_with_staged_workspace_bytes(*args)[0]


def _check_schedule(w, qo, kv, lens, used):
    """``run``: the int workspace holds the schedule of the captured CSR (a plan of another
    batch, or none, would leave another one)."""
    got = w._int_workspace_buffer[:used].view(torch.int32).tolist()
    n = len(qo) + len(kv) + len(lens)
    expect(got[:n] == list(qo) + list(kv) + list(lens),
           "run: the int workspace holds the plan of another batch")


def _int_workspaces(ws, size=1 << 16):
    """0.7.4's per-wrapper int workspace (8 MiB there; smaller here) and its pinned copy."""
    iws = torch.zeros(size, dtype=torch.uint8, device=ws.device)
    return iws, torch.zeros(iws.shape, dtype=torch.uint8)


class _FakeWrapper:
    """What the MHA wrappers share: 0.7.4's attribute names for the workspaces, the captured
    buffers and the plan state (``_plan_info``, ``_cached_module``...)."""

    def __init__(self, ws, use_cuda_graph: bool, backend: str):
        self.use_cuda_graph = self._use_cuda_graph = use_cuda_graph
        self._float_workspace_buffer = ws
        self._int_workspace_buffer, self._pin_memory_int_workspace_buffer = _int_workspaces(ws)
        self._kv_lens_buffer = torch.zeros(4096, dtype=torch.int32, device=ws.device)
        self._requested_backend = backend
        self._backend = "fa2" if backend == "auto" else backend
        self._plan_info = None
        self._cached_module = None
        self._jit_module = None
        self.plans = 0  # public plans

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def _stage(self, qo, kv, indices, last_page_len):
        """The public plan's copies: into the captured buffers (graph) or kept (eager)."""
        assert qo.device.type == "cpu" and kv.device.type == "cpu", "indptrs go in on the host"
        if self.use_cuda_graph:
            expect(indices.numel() <= self._paged_kv_indices_buf.numel(),
                   "The length of paged_kv_indices exceeds the allocated buffer size.")
            self._paged_kv_indptr_buf.copy_(kv, non_blocking=True)
            self._paged_kv_last_page_len_buf.copy_(last_page_len, non_blocking=True)
            self._paged_kv_indices_buf[:indices.numel()].copy_(indices)
        else:
            self._qo_indptr_buf, self._paged_kv_indptr_buf = qo.clone(), kv.clone()
            self._paged_kv_indices_buf = indices  # kept by reference, read at run time
        self.plans += 1


class FakePrefill(_FakeWrapper):
    def __init__(self, ws, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, backend="auto"):
        assert kv_layout == "NHD"
        super().__init__(ws, use_cuda_graph, backend)
        self._fixed_batch_size = len(qo_indptr_buf) - 1 if use_cuda_graph else 0
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._max_total_num_rows = None
        self._eagle_verify_fp8kv_sm90_state = None

    def plan(self, qo_indptr, kv_indptr, indices, last_page_len, hq, hkv, d, page_size, *,
             head_dim_vo=None, causal=False, sm_scale=None, logits_soft_cap=None,
             q_data_type=None, kv_data_type=None, uniform_q_len=None, disable_split_kv=False,
             fixed_split_size=None, seq_lens=None, max_token_per_sequence=None):
        assert page_size == 1 and bool((last_page_len == 1).all())
        # The key counts and the most query rows per sequence, which FlashInfer otherwise
        # computes from the indptrs: given, they must be those values.
        q_lens = qo_indptr[1:] - qo_indptr[:-1]
        kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
        if seq_lens is not None:
            assert seq_lens.device.type == "cpu" and seq_lens.dtype == torch.int32
            assert seq_lens.tolist() == kv_lens.tolist()
        if max_token_per_sequence is not None:
            assert max_token_per_sequence == int(q_lens.max())
        bs, rows = len(qo_indptr) - 1, int(qo_indptr[-1])
        self._max_q_len = int(q_lens.max()) if bs else 0
        self._max_kv_len = int(kv_lens.max()) if bs else 0
        self._qo_indptr_last, self._batch_size = rows, bs
        self._kv_lens_buffer[:bs].copy_(kv_lens, non_blocking=True)
        if self.use_cuda_graph:
            if self._max_total_num_rows is None:
                self._max_total_num_rows = rows
            expect(rows <= self._max_total_num_rows and bs == self._fixed_batch_size,
                   "cuda graph mode: the rows and batch size of the first plan at most")
            self._qo_indptr_buf.copy_(qo_indptr, non_blocking=True)
        self._stage(qo_indptr, kv_indptr, indices, last_page_len)
        self._cached_module = self._cached_module or FakeFA2Planner()
        # prefill.py: the FA2 planner's arguments, uniform_q_len forwarded in graph mode
        # when it describes the batch (else dropped with a warning).
        uniform = int(uniform_q_len or 0)
        if not (self.use_cuda_graph and uniform > 0 and bool((q_lens == uniform).all())):
            uniform = 0
        split = -1 if fixed_split_size is None else fixed_split_size
        self._fa2 = dict(hq=hq, hkv=hkv, head_dim=head_dim_vo or d, page=page_size,
                         graph=self.use_cuda_graph, uniform=uniform,
                         disable_split_kv=bool(disable_split_kv),
                         fixed_split_size=split or -1)
        self._plan_info = self._cached_module.plan(
            self._float_workspace_buffer, self._int_workspace_buffer,
            self._pin_memory_int_workspace_buffer, qo_indptr, kv_indptr, kv_lens,
            self._max_total_num_rows or rows, bs, hq, hkv, page_size, self.use_cuda_graph, d,
            head_dim_vo or d, causal, -1, split or -1, disable_split_kv, 0, uniform, False)
        self.causal, self.scale, self.cap = causal, sm_scale, logits_soft_cap
        self.uniform_q_len = uniform_q_len
        self.q_data_type, self.kv_data_type = q_data_type, kv_data_type
        self._seq_lens_kv = self._seq_lens_q = seq_lens

    def _planned_csr(self):
        """``(qo, kv, indices)`` the kernels would read (the captured buffers in graph mode);
        the int workspace must hold FlashInfer's FA2 schedule of that CSR (as its kernel
        reads it: graph mode's valid work items and rows)."""
        kv = self._paged_kv_indptr_buf.tolist()
        qo = self._qo_indptr_buf.tolist()
        plan_info = self._plan_info
        _, want, _ = prefill.fa2_plan(qo, kv, plan_info[1], **self._fa2, sms=prefill.SMS)
        got = prefill.read_schedule(self._int_workspace_buffer, plan_info, len(qo) - 1,
                                    len(want["request"]), qo[-1])
        expect(got == want, "run: the int workspace holds another FA2 schedule than the "
               f"CSR's: {got} against {want}")
        lens = self._kv_lens_buffer[:len(kv) - 1].tolist()
        expect(lens == [b - a for a, b in zip(kv, kv[1:])],
               "run: kv_lens does not match kv_indptr")
        return qo, kv, self._paged_kv_indices_buf

    def run(self, q, kv, *, k_scale=None, v_scale=None, return_lse=False):
        k, v = kv[0][:, 0], kv[1][:, 0]
        _check_dtypes(self, q, k)
        expect(q.shape[0] == self._qo_indptr_last, "q.shape[0] does not match qo_indptr[-1]")
        qo, kvp, indices = self._planned_csr()
        o, lse = _attend_csr(q, k, v, qo, kvp, indices, self.causal,
                             self.scale * _host_scale("k_scale", k_scale), self.cap,
                             _host_scale("v_scale", v_scale))
        return (o, lse) if return_lse else o


class FakeDecode(FakePrefill):
    def __init__(self, ws, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto"):
        _FakeWrapper.__init__(self, ws, use_cuda_graph, backend)
        self._use_tensor_cores = use_tensor_cores
        self._fixed_batch_size = len(paged_kv_last_page_len_buffer) if use_cuda_graph else 0
        self._qo_indptr_buf = None
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self._use_xqa_mtp_decode = False
        self._q_len_per_req = None

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def _uses_cudnn(self) -> bool:
        return self._backend == "cudnn"

    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, *, sm_scale=None,
             logits_soft_cap=None, q_data_type=None, kv_data_type=None):
        assert page_size == 1 and bool((last_page_len == 1).all())
        bs = len(last_page_len)
        expect(not self.use_cuda_graph or bs == self._fixed_batch_size,
               "The batch size should be fixed in cudagraph mode")
        qo = torch.arange(bs + 1, dtype=torch.int32)
        kv_lens = (indptr[1:] - indptr[:-1]).to(torch.int32)
        self._stage(qo, indptr, indices, last_page_len)
        self._kv_lens_buffer[:bs].copy_(kv_lens)  # the stand-in's run reads it
        self._max_kv_len, self._batch_size, self._qo_indptr_last = int(kv_lens.max()), bs, bs
        self._cached_module = self._cached_module or FakePlanner()
        # decode.py, tensor cores: the FA2 planner's arguments for one row per request.
        self._plan_info = self._cached_module.plan(
            self._float_workspace_buffer, self._int_workspace_buffer,
            self._pin_memory_int_workspace_buffer, qo, indptr, kv_lens, bs, bs, hq, hkv,
            page_size, self.use_cuda_graph, d, d, False, -1, -1, False, 0, 1, True)
        self._q_len_per_req = 1
        self.causal, self.scale, self.cap = False, sm_scale, logits_soft_cap
        self.q_data_type, self.kv_data_type = q_data_type, kv_data_type

    def _planned_csr(self):
        kv = self._paged_kv_indptr_buf.tolist()
        qo = list(range(len(kv)))
        # The real decode planner has no kv_lens buffer: the schedule is checked on the CSR.
        lens = [b - a for a, b in zip(kv, kv[1:])]
        _check_schedule(self, qo, kv, lens, self._plan_info[0])
        return qo, kv, self._paged_kv_indices_buf


def _validate_fa_plan_workload(qo_indptr, kv_len_arr, num_heads, causal, device, backend,
                               kv_data_type):
    """0.7.4's host check of an MLA workload (``_fa_common.py``): host lists only."""
    offsets, kv_lens = qo_indptr.tolist(), kv_len_arr.tolist()
    expect(len(offsets) >= len(kv_lens) + 1, "FA MLA requires query offsets for every KV "
           "request.")
    _validate_fa_plan_workload.calls += 1


_validate_fa_plan_workload.calls = 0
_FA_MAX_WORK_ITEMS = 16384  # 0.7.4's work-item capacity of the FA MLA planner (_fa_common.py)


class FakeMLABackend:
    """0.7.4's planned fa2 backend (``_BatchMLAGeneratedFaMechanics``): a new one per public
    plan, sharing the int workspace of the one before in graph mode."""

    _plan_capabilities = types.SimpleNamespace(supports_cuda_graph_replan=True)

    def __init__(self, wrapper, int_workspace, module):
        self._backend = "fa2"
        self._float_workspace_buffer = wrapper._float_workspace_buffer
        self.device = self._float_workspace_buffer.device
        fresh = _int_workspaces(self._float_workspace_buffer, mla.offsets()[1])
        self._int_workspace_buffer = fresh[0] if int_workspace is None else int_workspace
        self._pin_memory_int_workspace_buffer = fresh[1]  # a new pinned buffer per plan
        self._qo_indptr_buf, self._kv_indptr_buf = wrapper.graph_bufs[:2]
        self._kv_indices_buf, self._kv_len_arr_buf = wrapper.graph_bufs[2:]
        self._cached_module = module

    def _plan_generated_fa(self, m, num_heads, head_dim_ckv, causal, kv_data_type):
        _validate_fa_plan_workload(m.qo_indptr, m.kv_len_arr, num_heads, causal, self.device,
                                   self._backend, kv_data_type)
        qo, kv, lens = m.qo_indptr.cpu(), m.kv_indptr.cpu(), m.kv_len_arr.cpu()
        total = int(kv[-1])
        if total:  # the public plan reads the indices' range back from the device
            lo, hi = torch.aminmax(m.kv_indices[:total])
            self._planned_kv_page_range = (int(lo.item()), int(hi.item()) + 1)
        else:
            self._planned_kv_page_range = (0, 0)
        self._plan_info, self._staged_int_workspace_bytes = \
            self._cached_module.plan_with_staged_workspace_bytes(
                self._float_workspace_buffer, self._int_workspace_buffer,
                self._pin_memory_int_workspace_buffer, qo, kv, lens, num_heads, head_dim_ckv,
                causal)
        for target, source in zip((self._qo_indptr_buf, self._kv_indptr_buf,
                                   self._kv_len_arr_buf), (qo, kv, lens)):
            target.copy_(source, non_blocking=True)
        self._kv_indices_buf[:total].copy_(m.kv_indices[:total])
        self._causal, self._head_dim_ckv, self._kv_data_type = causal, head_dim_ckv, \
            kv_data_type
        self._planned_query_shape = (int(qo[-1]), num_heads)


class FakeMLA(_FakeWrapper):
    def __init__(self, ws, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        self.use_cuda_graph = self._use_cuda_graph = use_cuda_graph
        self._float_workspace_buffer = ws
        self.graph_bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self._planned_backend = None
        self._plan_info = None
        self._module = FakeMLAProxy()
        self.plans = 0

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
             sm_scale, q_data_type, kv_data_type, query_layout, kv_cache_layout, lse_mode,
             scale_mode="default"):
        assert page_size == 1 and query_layout == kv_cache_layout == "split"
        m = metadata
        assert m.kv_len_arr.tolist() == (m.kv_indptr[1:] - m.kv_indptr[:-1]).tolist()
        if kv_data_type in _FP8:  # mla/_batch_mla/_backends/_fa_common.py
            expect(kv_data_type == torch.float8_e4m3fn, f"MLA kv_data_type {kv_data_type}: "
                   "FP8 only as float8_e4m3fn")
            expect(q_data_type == torch.bfloat16, "FP8 MLA: q_data_type bfloat16 only")
            expect(head_dim_ckv == 512 and head_dim_kpe in (0, 64),
                   f"FP8 MLA: head_dim_ckv 512, head_dim_kpe 0/64, got {head_dim_ckv}/"
                   f"{head_dim_kpe}")
            expect(scale_mode == "kv-per-tensor", "FP8 MLA plans: scale_mode='kv-per-tensor'")
        else:
            expect(scale_mode == "default", "non-FP8 MLA plans: scale_mode='default'")
        assert m.qo_indptr.device.type == "cpu" and m.kv_indptr.device.type == "cpu", \
            "indptrs go in on the host"
        previous = self._planned_backend
        if not self.use_cuda_graph:  # eager: kv_indices kept by reference, read at run time
            self.graph_bufs = (torch.empty_like(m.qo_indptr), torch.empty_like(m.kv_indptr),
                               m.kv_indices, torch.empty_like(m.kv_len_arr))
        pb = FakeMLABackend(self, previous._int_workspace_buffer
                            if previous is not None and self.use_cuda_graph else None,
                            self._module)
        pb._plan_generated_fa(m, num_heads, head_dim_ckv, causal, kv_data_type)
        self._planned_backend = pb
        self._plan_info = pb._plan_info
        self.plans += 1
        self.causal, self.scale, self.lse_mode = causal, sm_scale, lse_mode
        self.q_data_type, self.kv_data_type = q_data_type, kv_data_type

    def run(self, *, query, kv_cache, return_lse=False, ckv_scale=None, kpe_scale=None):
        assert return_lse == (self.lse_mode == "base2")
        _check_dtypes(self, query[0], kv_cache[0])
        pb = self._planned_backend
        expect(tuple(query[0].shape[:2]) == pb._planned_query_shape,
               "q_nope rows and heads must match the planned query shape.")
        lo, pages = pb._planned_kv_page_range
        expect(lo >= 0 and kv_cache[0].shape[0] >= pages,
               "KV cache does not cover the planned CSR page indices.")
        expect(pb._plan_info == self._plan_info, "run: the wrapper and its backend disagree "
               "on plan_info")
        fp8 = self.kv_data_type in _FP8
        expect(fp8 == (ckv_scale is not None) == (kpe_scale is not None),
               "ckv_scale and kpe_scale: required with an FP8 pool, refused otherwise")
        ckv, kpe = _host_scale("ckv_scale", ckv_scale), _host_scale("kpe_scale", kpe_scale)
        q = torch.cat([query[0], query[1]], -1)
        kv = torch.cat([kv_cache[0][:, 0].float() * ckv, kv_cache[1][:, 0].float() * kpe], -1)
        # The kernel reads the schedule in the int workspace, nothing of the host plan.
        schedule = mla.read_schedule(pb._int_workspace_buffer, pb._plan_info, mla.SMS)
        o, lse = mla.run_schedule(pb._plan_info, schedule, pb._kv_indices_buf, q, kv,
                                  query[0].shape[-1], q.shape[1], self.causal, self.scale,
                                  mla.SMS)
        return (o, lse) if return_lse else o


def make() -> types.ModuleType:
    fi = types.ModuleType("flashinfer")
    fi.__version__ = "0.7.4"  # the release whose planners and attributes it stands for
    fi.BatchPrefillWithPagedKVCacheWrapper = FakePrefill
    fi.BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    fi.mla = types.SimpleNamespace(
        BatchMLAPagedAttentionWrapper=FakeMLA,
        MLAPlanMetadata=types.SimpleNamespace(csr=lambda qo, kv, idx, lens: types.SimpleNamespace(
            qo_indptr=qo, kv_indptr=kv, kv_indices=idx, kv_len_arr=lens)))
    return fi
