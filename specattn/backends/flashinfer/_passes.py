"""One FlashInfer attention call over page-size-1 sequences: a *pass*.

A pass owns a FlashInfer wrapper and the int32 ``indices`` buffer its KV slot list lives in.
Plan step (host, outside graph capture): ``plan(csr, causal, params)`` with the host CSR
(``_slots.HostCSR``: CPU indptrs and lengths, nothing read from the device), before or after
the caller writes ``indices[:csr.total]`` on the device (FlashInfer's plan does not read the
indices, and the kernels run later on the same stream). One ``plan`` is one FlashInfer plan
call; the host tensors that do not change between rounds (``last_page_len``, the graph plan's
split arguments) are made once per pass. Run step (tensors only, graph-safe): ``run(q,
layer_id) -> (o, lse or None)``; ``lse`` is base 2 (FlashInfer's), the base
``flashinfer.merge_state`` expects.

The wrapper keeps a reference to ``indices`` (eager) or was built on it (CUDA graph: it is the
fixed ``paged_kv_indices`` buffer), so slot lists rewritten in place after ``plan`` (``path``
histories) are what the kernel reads. The softmax scale and soft cap are plan arguments in
FlashInfer; ``replan(params)`` re-plans with the last host arguments when a layer asks for
other values (eager only).

CUDA-graph passes re-plan before every replay: the first plan of a graph wrapper is
FlashInfer's public ``plan`` (it sets up the wrapper, its module and captured buffers); later
plans with the same scale, soft cap and causality replan directly (``_replan``: the
slot-list launch writes the schedule, ``_prefill_plan`` / ``_mla_plan``, or FlashInfer's
native planner is called), falling back to the public plan for anything it does not
recognise.

FP8 pools (``runner.fp8``): the plans name the pool's dtype as ``kv_data_type`` (the query
stays in the model dtype), and ``run(q, layer_id, k_scale, v_scale)`` passes the scales as
FlashInfer's host floats: ``k_scale=`` / ``v_scale=`` of the MHA wrappers (FlashInfer
multiplies ``sm_scale`` by ``k_scale`` and the output by ``v_scale``), ``ckv_scale=`` /
``kpe_scale=`` of the MLA wrapper (``scale_mode="kv-per-tensor"``; e4m3 only).

Vendor imports happen only inside these functions.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from ...errors import InvalidInputError
from ...fp8 import LibraryScales, library_scales
from ...util import sm_count
from ._replan import Replanner, direct_replanner

if TYPE_CHECKING:
    from ...data import DraftRunner
    from ._slots import HostCSR, KeptCSR

__all__ = ["Params", "Pass", "PrefillPass", "DecodePass", "MLAPass", "workspace",
           "flashinfer_module", "capturing", "captured", "replan", "fp8_scales", "pins"]

log = logging.getLogger("specattn.backends.flashinfer")

_WORKSPACE_BYTES = 128 * 1024 * 1024
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def flashinfer_module():
    """``import flashinfer`` (the only place the vendor library is imported)."""
    import flashinfer

    return flashinfer


def pins(device: torch.device) -> bool:
    """Whether the host tensors given to FlashInfer's plans for ``device`` go in pinned memory
    (a CUDA device: ``_slots.HostCSR`` says why)."""
    return torch.device(device).type == "cuda"


def capturing() -> bool:
    """A CUDA graph is being captured (FlashInfer's plans are host code: none may run)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def replan(passes: list["Pass"], old: "Params", new: "Params") -> None:
    """Re-plan ``passes`` for a layer whose softmax scale / soft cap (``new``) differ from
    the planned ones (``old``): FlashInfer plans them. Eager only: a plan is host code."""
    if capturing():
        raise InvalidInputError(
            "layer", f"scaling={old.scale} and logit_cap={old.cap} under CUDA graph capture "
            "(FlashInfer plans them; run one eager call or the warm-up first)",
            f"scaling={new.scale}, logit_cap={new.cap}")
    if any(p._last is None and p.wrapper is not None for p in passes):
        raise InvalidInputError(
            "layer", f"scaling={old.scale} and logit_cap={old.cap} after a CUDA-graph "
            "replay's metadata (planned on the device, without host lengths)",
            f"scaling={new.scale}, logit_cap={new.cap}")
    log.debug("re-planning for scaling=%s logit_cap=%s", new.scale, new.cap)
    for p in passes:
        p.replan(new)


def captured(table: dict, bs: int, capture: bool, make):
    """The passes of captured batch size ``bs`` in ``table``: made by ``make()`` at capture;
    a replay of a size that was never captured is an error."""
    entry = table.get(bs)
    if entry is None:
        if not capture:
            raise InvalidInputError("bs", f"a captured batch size {sorted(table)}", bs)
        entry = table[bs] = make()
    return entry


def fp8_scales(runner: "DraftRunner", layer, q: torch.Tensor) -> LibraryScales:
    """An FP8 pool's scales for one call: Python floats as FlashInfer's (and the history
    kernel's) arguments, device tensors folded into ``q`` and the output
    (``fp8.library_scales``: FlashInfer reads its scales on the host). Other pools ignore
    the layer's scales."""
    if not runner.fp8:
        return LibraryScales(q, 1.0, 1.0, 1.0)
    return library_scales(layer, q, runner.use_mla_backend)


def workspace(device: torch.device) -> torch.Tensor:
    """The float workspace shared by every pass on ``device`` (128 MiB, zeroed once).

    Passes run one after another on one stream, and split-KV partials live in it only during
    one ``run``, so sharing is safe (SGLang shares one the same way)."""
    buf = _WORKSPACES.get(device)
    if buf is None:
        buf = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _WORKSPACES[device] = buf
    return buf


class OneLaunchKvWrite:
    """Decode and extend glues: a step's new KV stored in one launch on CUDA
    (``kernels.kv_write.store_kv``, FP8 codes included) where ``runner.write_kv`` takes one
    launch per pool, or about ten for FP8 pools."""

    def _write_kv(self, layer, loc: torch.Tensor, k: torch.Tensor,
                  v: Optional[torch.Tensor]) -> None:
        from ...kernels.kv_write import store_kv  # Triton, imported when a KV is stored

        store_kv(self.runner, layer, loc, k, v)


class Params(NamedTuple):
    """Plan-time attention parameters: softmax scale and logit soft cap (0 = off)."""

    scale: float
    cap: float


def default_params(head_dim: int) -> Params:
    return Params(1.0 / math.sqrt(head_dim), 0.0)


class Pass:
    """Base: indices buffer, plan bookkeeping. ``rows`` fixed = CUDA-graph mode."""

    def __init__(self, runner: "DraftRunner", *, with_lse: bool, graph_rows: Optional[int] = None,
                 capacity: int = 0) -> None:
        self.runner = runner
        self.with_lse = with_lse
        self.graph_rows = graph_rows  # number of sequences, frozen in graph mode
        self.indices = torch.zeros(max(capacity, 1), dtype=torch.int32, device=runner.device)
        self.wrapper = None
        self.pin = pins(runner.device)
        self._last: Optional[tuple] = None
        self._ones: Optional[torch.Tensor] = None  # last_page_len (host), by sequence count
        self._direct: Optional[Replanner] = None  # graph passes: after the first public plan
        self._plan_kw: dict = {}  # the keyword arguments of the last public plan
        # Graph passes planned from a device-written CSR: its host copy, kept (pageable).
        self.kept_csr: Optional["KeptCSR"] = None

    @property
    def graph(self) -> bool:
        return self.graph_rows is not None

    def reserve(self, total: int) -> torch.Tensor:
        """The indices buffer, grown (eager) to hold ``total`` entries."""
        if total > self.indices.numel():
            if self.graph:
                raise InvalidInputError("batch", f"at most {self.indices.numel()} KV slots in "
                                        "this pass (init_cuda_graph_state sizes)", total)
            self.indices = torch.zeros(int(total * 1.25) + 1, dtype=torch.int32,
                                       device=self.indices.device)
            self.wrapper = self._direct = None  # its reference is to the old buffer
        return self.indices

    def device_csr(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(kv_indptr [M + 1], kv_lens [M], qo_indptr [M + 1])``: the captured int32
        buffers of the next plan's CSR, which a caller may write on the device itself (then
        ``plan(..., on_device=True)``, and ``qo_on_device=True`` for the last); ``None``
        where the next plan copies them from the host (no direct replanner yet, or one that
        takes none)."""
        return self._direct.device_buffers() if self._direct is not None else None

    def device_schedule(self, causal: bool, params: Params,
                        rows: Optional[int] = None) -> Optional[Any]:
        """Where a caller's launch may write the next plan's schedule itself (then
        ``plan(..., scheduled=True)``): the direct replanner's, for a plan with these
        parameters (``prefill_schedule.Fa2Schedule``, ``_mla_plan.MLASchedule``); ``None``
        where FlashInfer's planner writes it. ``rows``: the query rows of every request
        where the launch does not write the query indptr (a decode's ``K``)."""
        direct = self._direct_for(causal, params)
        if direct is None:
            return None
        return direct.schedule if rows is None else direct.schedule_for(rows)

    def plan_lengthless(self, bs: int, rows: int, causal: bool, params: Params) -> bool:
        """A direct replan without host lengths (``Replanner.lengthless``): the caller's
        launch wrote the CSR and ``device_schedule(causal, params)``'s schedule of ``bs``
        sequences and ``rows`` query rows. ``False``: plan from host lengths instead."""
        direct = self._direct_for(causal, params)
        if direct is None or not direct.lengthless(bs, rows):
            return False
        self._last = None  # no host CSR: a later public replan needs one
        return True

    def plan(self, csr: "HostCSR", causal: bool, params: Params, *,
             on_device: bool = False, qo_on_device: bool = False,
             scheduled: bool = False) -> None:
        """One FlashInfer plan over ``indices[:csr.total]`` (``csr``: host tensors only): a
        direct replan where the graph wrapper's last public plan had these parameters.
        ``on_device``: ``device_csr()`` already holds ``csr``'s key indptr and lengths,
        ``qo_on_device``: and its query indptr, ``scheduled``: and ``device_schedule()``
        its schedule."""
        if self.wrapper is None:
            self.wrapper = self._make_wrapper(csr.kv_lens.numel())
            self._direct = None
        self._last = (csr, causal)
        direct = self._direct_for(causal, params)
        if direct is not None and direct(csr, on_device, qo_on_device, scheduled):
            return
        self._public_plan(csr, causal, params)

    def _direct_for(self, causal: bool, params: Params) -> Optional[Replanner]:
        """The direct replanner where the last public plan had these parameters."""
        direct = self._direct
        return direct if direct is not None and direct.key == (causal, params) else None

    def replan(self, params: Params) -> None:
        if self._last is not None:
            self._public_plan(*self._last, params)

    def _public_plan(self, csr: "HostCSR", causal: bool, params: Params) -> None:
        """FlashInfer's ``plan``; a graph pass then keeps a direct replanner for its next
        plans with these parameters."""
        self._direct = None
        self._plan(csr, causal, params)
        if self.graph:
            self._direct = self._make_direct((causal, params))

    def _make_direct(self, key: tuple) -> Optional[Replanner]:
        """The direct replanner of the wrapper after its public plan (``None``: keep the
        public plan; ``_replan`` says why)."""
        return None

    def _last_page_len(self, seqs: int) -> torch.Tensor:
        """``[seqs]`` int32 ones on the host (pages of one token), kept between plans."""
        if self._ones is None or self._ones.numel() != seqs:
            self._ones = torch.ones(seqs, dtype=torch.int32, pin_memory=self.pin)
        return self._ones

    def _make_wrapper(self, num_seqs: int):
        raise NotImplementedError

    def _plan(self, csr: "HostCSR", causal: bool, params: Params) -> None:
        raise NotImplementedError

    def run(self, q: torch.Tensor, layer_id: int, k_scale: float = 1.0, v_scale: float = 1.0):
        """``(o, lse or None)``; ``k_scale`` / ``v_scale``: an FP8 pool's scales."""
        raise NotImplementedError

    def _graph_csr_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dev, m = self.runner.device, self.graph_rows
        return (torch.zeros(m + 1, dtype=torch.int32, device=dev),
                torch.zeros(m + 1, dtype=torch.int32, device=dev),
                torch.ones(m, dtype=torch.int32, device=dev))


def _mha_kv(runner: "DraftRunner", layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token pools as NHD pages of one token: ``[num_slots, 1, H_kv, D]``."""
    return runner.k_buffer[layer_id].unsqueeze(1), runner.v_buffer[layer_id].unsqueeze(1)


def _graph_split_kwargs(runner: "DraftRunner", rows: Optional[int], seqs: int) -> dict:
    """Extra ``plan`` arguments of a CUDA-graph prefill plan.

    FlashInfer's graph-mode scheduler (``PrefillSplitQOKVIndptr``) must cover any row
    distribution a replay may bring, so it sizes the query tile for ``total_rows - seqs + 1``
    rows per sequence: 225 packed-by-4 rows for ``gqa-long`` (B 32, K 8), a 128-row tile
    with 32 rows used. ``uniform_q_len`` promises every replay has ``rows`` per sequence (true
    for the prefix pass: ``K`` per request), so the tile fits. Graph mode also always takes
    the split-KV path (partials + a merge kernel); when the ``seqs x H_kv`` grid already
    fills every SM, no request would be split anyway, so ``disable_split_kv`` drops that
    detour (measured on the H200, 2026-11-29).
    """
    kw = {}
    if rows:
        kw["uniform_q_len"] = rows
    sms = sm_count(runner.device)
    if sms is not None and seqs * runner.num_kv_heads >= sms:
        kw["disable_split_kv"] = True
    return kw


class _MHAPass(Pass):
    """A pass over the MHA token pools (NHD pages of one token)."""

    def run(self, q: torch.Tensor, layer_id: int, k_scale: float = 1.0, v_scale: float = 1.0):
        kv = _mha_kv(self.runner, layer_id)
        scales = dict(k_scale=k_scale, v_scale=v_scale) if self.runner.fp8 else {}
        if self.with_lse:
            return self.wrapper.run(q, kv, return_lse=True, **scales)
        return self.wrapper.run(q, kv, **scales), None


class PrefillPass(_MHAPass):
    """``BatchPrefillWithPagedKVCacheWrapper``: any number of query rows per sequence
    (prefix pass with ``K`` rows per request; causal draft extend).

    ``uniform_rows``: the number of query rows of every sequence in every plan, if fixed (the
    prefix pass: ``K``); CUDA-graph plans then size FlashInfer's query tile for it.
    ``plan_kwargs`` are passed to every ``plan`` last (they override the graph defaults).

    Where the wrapper's ``plan`` takes them, it is also given ``seq_lens`` (the key counts,
    which it would otherwise derive from the indptrs and copy to the device from pageable
    memory) and ``max_token_per_sequence`` (the most query rows, which it would otherwise
    find with a Python loop over the sequences): the values it computes itself."""

    def __init__(self, runner: "DraftRunner", *, backend: str = "auto",
                 plan_kwargs: Optional[dict] = None, uniform_rows: Optional[int] = None,
                 **kw) -> None:
        super().__init__(runner, **kw)
        self.backend = backend
        self.plan_kwargs = dict(plan_kwargs or {})  # e.g. fixed_split_size (benchmarks)
        self.uniform_rows = uniform_rows
        self._extra: Optional[tuple[int, dict]] = None  # (sequences, extra plan arguments)
        self._hints: Optional[frozenset] = None  # the length arguments the plan takes

    def _make_wrapper(self, num_seqs: int):
        fi = flashinfer_module()
        ws = workspace(self.runner.device)
        if not self.graph:
            return fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=self.backend)
        qo, kv, last = self._graph_csr_buffers()
        return fi.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qo, paged_kv_indptr_buf=kv,
            paged_kv_indices_buf=self.indices, paged_kv_last_page_len_buf=last,
            backend=self.backend)

    def _extra_kwargs(self, seqs: int) -> dict:
        """The graph plan's split arguments and ``plan_kwargs`` for ``seqs`` sequences."""
        if self._extra is None or self._extra[0] != seqs:
            extra = _graph_split_kwargs(self.runner, self.uniform_rows, seqs) if self.graph \
                else {}
            extra.update(self.plan_kwargs)
            self._extra = (seqs, extra)
        return self._extra[1]

    def _length_hints(self, csr) -> dict:
        if self._hints is None:
            takes = inspect.signature(self.wrapper.plan).parameters
            self._hints = frozenset(n for n in ("seq_lens", "max_token_per_sequence")
                                    if n in takes)
        hints = {}
        if "seq_lens" in self._hints:
            hints["seq_lens"] = csr.kv_lens
        if "max_token_per_sequence" in self._hints:
            hints["max_token_per_sequence"] = csr.max_q
        return hints

    def _plan(self, csr, causal, params) -> None:
        r = self.runner
        seqs = csr.kv_lens.numel()
        kw = self._plan_kw = dict(
            head_dim_vo=r.v_head_dim, causal=causal, sm_scale=params.scale,
            logits_soft_cap=params.cap if params.cap > 0 else None, q_data_type=r.dtype,
            kv_data_type=r.kv_dtype, **self._length_hints(csr), **self._extra_kwargs(seqs))
        self.wrapper.plan(csr.qo_indptr, csr.kv_indptr, self.indices[:csr.total],
                          self._last_page_len(seqs), r.num_q_heads, r.num_kv_heads,
                          r.head_dim, 1, **kw)

    def _make_direct(self, key):
        r = self.runner
        return direct_replanner("prefill", self.wrapper, key, self._plan_kw,
                                heads=(r.num_q_heads, r.num_kv_heads, r.head_dim, 1))


class DecodePass(_MHAPass):
    """``BatchDecodeWithPagedKVCacheWrapper`` on tensor cores: one query row per sequence
    (history pass, ``topk == 1`` and ``per-branch`` full sequences)."""

    def _make_wrapper(self, num_seqs: int):
        fi = flashinfer_module()
        ws = workspace(self.runner.device)
        if not self.graph:
            return fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True,
                                                         backend="fa2")
        _, kv, last = self._graph_csr_buffers()
        return fi.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=kv,
            paged_kv_indices_buffer=self.indices, paged_kv_last_page_len_buffer=last,
            backend="fa2")

    def _plan(self, csr, causal, params) -> None:
        r = self.runner
        kw = self._plan_kw = dict(
            sm_scale=params.scale, logits_soft_cap=params.cap if params.cap > 0 else None,
            q_data_type=r.dtype, kv_data_type=r.kv_dtype)
        self.wrapper.plan(csr.kv_indptr, self.indices[:csr.total],
                          self._last_page_len(csr.kv_lens.numel()), r.num_q_heads,
                          r.num_kv_heads, r.head_dim, 1, **kw)

    def _make_direct(self, key):
        r = self.runner
        return direct_replanner("decode", self.wrapper, key, self._plan_kw,
                                heads=(r.num_q_heads, r.num_kv_heads, r.head_dim, 1))


class MLAPass(Pass):
    """``BatchMLAPagedAttentionWrapper`` over the latent pool ``[num_slots, R + rope]`` seen
    as split ``ckv [num_slots, 1, R]`` / ``kpe [num_slots, 1, rope]`` (strided views, no
    copy). Query ``[rows, H, R + rope]`` is split the same way."""

    def _make_wrapper(self, num_seqs: int):
        fi = flashinfer_module()
        ws = workspace(self.runner.device)
        if not self.graph:
            return fi.mla.BatchMLAPagedAttentionWrapper(ws, backend="auto")
        qo, kv, _ = self._graph_csr_buffers()
        kv_len = torch.zeros(self.graph_rows, dtype=torch.int32, device=self.runner.device)
        return fi.mla.BatchMLAPagedAttentionWrapper(
            ws, use_cuda_graph=True, qo_indptr=qo, kv_indptr=kv, kv_indices=self.indices,
            kv_len_arr=kv_len, backend="auto")

    def _plan(self, csr, causal, params) -> None:
        fi = flashinfer_module()
        r = self.runner
        meta = fi.mla.MLAPlanMetadata.csr(csr.qo_indptr, csr.kv_indptr,
                                          self.indices[:csr.total], csr.kv_lens)
        fp8 = dict(scale_mode="kv-per-tensor") if r.fp8 else {}
        kw = self._plan_kw = dict(
            metadata=meta, num_heads=r.num_heads, head_dim_ckv=r.kv_lora_rank,
            head_dim_kpe=r.qk_rope_head_dim, page_size=1, causal=causal,
            sm_scale=params.scale, q_data_type=r.dtype, kv_data_type=r.kv_dtype,
            query_layout="split", kv_cache_layout="split",
            lse_mode="base2" if self.with_lse else "none", **fp8)
        self.wrapper.plan(**kw)

    def _make_direct(self, key):
        # Every slot the glue lists is clamped into the pool: its rows bound the indices.
        return direct_replanner("mla", self.wrapper, key, self._plan_kw,
                                kv_bound=self.runner.num_slots)

    def run(self, q: torch.Tensor, layer_id: int, k_scale: float = 1.0, v_scale: float = 1.0):
        """MLA's one latent pool: ``k_scale`` is the scale of both of its parts."""
        r = self.runner
        rank = r.kv_lora_rank
        kv = r.kv_buffer[layer_id]
        query = (q[..., :rank], q[..., rank:])
        cache = (kv[:, :rank].unsqueeze(1), kv[:, rank:].unsqueeze(1))
        scales = dict(ckv_scale=k_scale, kpe_scale=k_scale) if r.fp8 else {}
        if self.with_lse:
            return self.wrapper.run(query=query, kv_cache=cache, return_lse=True, **scales)
        return self.wrapper.run(query=query, kv_cache=cache, **scales), None
