"""The draft-extend glue shared by the MHA and MLA flavours.

One causal pass over ragged requests: ``qo_indptr = cumsum(E)``, ``kv_indptr = cumsum(L')``,
slots ``R_b[0 : L'_b]`` (the new tokens' KV is written first, so FlashInfer's bottom-right
causal alignment gives query ``t`` the keys ``R_b[0 : L'_b - E_b + t + 1]``).

Plan step (``init_forward_metadata``): the indptrs from the lengths on the host
(``batch.seq_lens_cpu`` / ``extend_lens_cpu``; the missing ones copied from the device
together, a sync: ``data.host_lengths``), the slot list built on the device in one launch
(``kernels.prefix_slots``, kept per signature and grid; ``_slots.fill_ragged_slots`` where
Triton cannot run), one plan (a graph replay's: a direct replan, ``_replan``, whose FA2
schedule the slot-list launch writes, ``_prefill_plan``).
Run step (``forward``): write K/V (``kernels.kv_write.store_kv``: one launch on CUDA), run.

A graph replay whose pass takes the device schedule reads no host lengths: its one launch is
sized by the pass (the grid by ``max_context_len``, the writes by the slot list's capacity)
and its replan checks only what the host knows (the captured size, the capture's query rows;
``Pass.plan_lengthless``). A layer of other scaling cannot be planned after such a round.

CUDA graphs: one pass per captured batch size on fixed buffers (slot list for
``bs * max_context_len`` slots, ``max_num_tokens`` new-token slots); capture and replay plan
on the host (outside the graph) like the eager path. FlashInfer's graph-mode plan sizes its
query tile for the worst split of the captured token count (``T - B + 1`` rows in one
request), so any split of those ``T`` tokens over the ``B`` requests replays.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import validation
from ...base import DraftExtendBackend
from ...data import HOST_COPIES, host_lengths
from ...fp8 import scale_rows
from ...graph_calls import signature
from ...util import triton_runs
from ._passes import OneLaunchKvWrite, Params, Pass, captured, fp8_scales, replan
from ._slots import (KeptCSR, fill_ragged_slots, host_csr, host_indptr,
                     prefix_slots_launcher)

_INDEX_FIELDS = ("req_pool_indices", "seq_lens", "extend_lens", "out_cache_loc")


class FlashInferExtendGlue(OneLaunchKvWrite, DraftExtendBackend):
    """Common body of ``FlashInferExtend`` and ``FlashInferMLAExtend`` (not registered)."""

    known_limits = {"extend/*/isolation/*": (
        "FlashInfer's causal prefill multiplies the masked (zero) probabilities of a tile by "
        "every value in it: a non-finite key/value of a later new token reaches the earlier "
        "tokens of its request (0 * NaN; seen on the H200 with FlashInfer 0.7.4, both MHA and "
        "MLA); the vendor kernel, not this glue, would have to change")}

    def __init__(self, runner, *, topk: int = 1, num_steps: int = 1) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self.params = self._default_params()
        self._eager: Optional[Pass] = None
        self._graphs: dict[int, Pass] = {}
        self._pass: Optional[Pass] = None  # the pass forward() runs
        self._triton: Optional[bool] = None  # the slot-list kernel runs on this device
        self._slot_launches: dict = {}  # graph passes' kept slot-list launches (prefix_slots)
        self._checked_batch: Optional[tuple] = None  # the last checked graph batch's signature

    def _default_params(self) -> Params:
        raise NotImplementedError

    def _check_layer_params(self, layer) -> Params:
        return Params(float(layer.scaling), float(layer.logit_cap))

    def _new_pass(self, graph_rows: Optional[int] = None, capacity: int = 0) -> Pass:
        raise NotImplementedError

    def _plan(self, batch) -> None:
        if self._eager is None:
            self._eager = self._new_pass()
        self._prepare(self._eager, batch)

    def _prepare(self, p: Pass, batch, replay: bool = False) -> None:
        """Slot list on the device, one plan (host). ``replay``: a graph replay's, which
        needs no host lengths where the launch writes the CSR and the schedule."""
        r = self.runner
        if self._triton is None:
            self._triton = triton_runs(r.device)
        # Graph passes keep their slot-list launches (an eager pass's buffer may be
        # replaced) and write the CSR, query indptr included, into the captured buffers:
        # its host copy then goes into kept pageable buffers (nothing copies from them).
        # With it, FlashInfer's schedule of the round too (the host planner then idles).
        dev_csr = p.device_csr() if p.graph and self._triton else None
        schedule = None if dev_csr is None else p.device_schedule(True, self.params)
        if replay and schedule is not None and p.plan_lengthless(
                batch.batch_size, int(batch.out_cache_loc.shape[0]), True, self.params):
            self._launch_lengthless(p, batch, dev_csr, schedule)
            return
        seq_host, ext_host = host_lengths(batch, "seq_lens", "extend_lens")
        seq_np, ext_np = seq_host.numpy(), ext_host.numpy()
        if dev_csr is None:
            qo = host_indptr(ext_np, pin=p.pin)
            csr = host_csr(qo, seq_np, int(ext_np.max()), pin=p.pin)
        else:
            if p.kept_csr is None or p.kept_csr.m != seq_np.shape[0]:
                p.kept_csr = KeptCSR(seq_np.shape[0], with_qo=True)
            csr = p.kept_csr.fill(seq_np, qo_lens=ext_np)
        out = p.reserve(csr.total)
        if self._triton:
            rows, lens, ext = batch.req_pool_indices, batch.seq_lens, batch.extend_lens
            # With the device CSR the launch also copies the new tokens' slots into the
            # graph's fixed buffer (``_fills_graph_round``).
            loc = None if dev_csr is None else (self.graph_source.out_cache_loc,
                                                self.padded_graph_loc())
            key = self._launch_key(p, batch, loc, dev_csr, schedule) if p.graph else None
            prefix_slots = prefix_slots_launcher()
            prefix_slots(out, csr.total, csr.max_kv, r.req_to_token, rows, lens, r.num_slots,
                         csr=None if dev_csr is None else dev_csr[:2],
                         qo=None if dev_csr is None else (ext, dev_csr[2]), ext_loc=loc,
                         schedule=schedule, kept=self._slot_launches if p.graph else None,
                         kept_key=key)
        else:
            fill_ragged_slots(out, csr.total, r.req_to_token, batch.req_pool_indices,
                              batch.seq_lens, num_slots=r.num_slots)
        if p.graph and dev_csr is None:
            batch.out_cache_loc.copy_(self.graph_source.out_cache_loc)
            self.padded_graph_loc()[batch.out_cache_loc.shape[0]:].fill_(0)
        on_device = dev_csr is not None
        p.plan(csr, True, self.params, on_device=on_device, qo_on_device=on_device,
               scheduled=schedule is not None)
        self._pass = p

    def _launch_lengthless(self, p: Pass, batch, dev_csr: tuple, schedule) -> None:
        """A graph replay's slot list, CSR and schedule in one launch sized by the pass's
        capacity (the grid by ``max_context_len``: programs past a request's keys write
        nothing), after a replan from what the host knows without the lengths
        (``Pass.plan_lengthless``)."""
        r = self.runner
        loc = (self.graph_source.out_cache_loc, self.padded_graph_loc())
        prefix_slots_launcher()(p.indices, p.indices.numel(), r.max_context_len,
                                r.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                r.num_slots, csr=dev_csr[:2], qo=(batch.extend_lens, dev_csr[2]),
                                ext_loc=loc, schedule=schedule, kept=self._slot_launches,
                                kept_key=self._launch_key(p, batch, loc, dev_csr, schedule))
        self._pass = p

    def _launch_key(self, p: Pass, batch, loc: Optional[tuple], dev_csr: Optional[tuple],
                    schedule) -> tuple:
        """The key of a graph pass's kept slot-list launch. Its buffers (slot list, device
        CSR, fixed slots) stay put: the pass, their addresses and the caller's index
        tensors' signatures (those the round's check left, if any) key it, the new tokens'
        slots by dtype and stride (their count varies), and the schedule it writes."""
        sigs = self._checked_batch
        key = (id(p), *(sigs[1:4] if sigs is not None else
                        (signature(batch.req_pool_indices), signature(batch.seq_lens),
                         signature(batch.extend_lens))))
        if loc is not None:
            key += (loc[0].dtype, loc[0].stride(0), loc[1].shape[0],
                    tuple(t.data_ptr() for t in (*dev_csr, loc[1])),
                    None if schedule is None else schedule.key())
        return key

    def _attend(self, layer, q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        want = self._check_layer_params(layer)
        if want != self.params:
            replan([self._pass], self.params, want)
            self.params = want
        q = q if q.is_contiguous() else q.contiguous()
        fp8 = fp8_scales(self.runner, layer, q)
        o, _ = self._pass.run(fp8.q, layer.layer_id, fp8.k_scale, fp8.v_scale)
        return scale_rows(o, fp8.out_scale)

    # --- CUDA graphs -------------------------------------------------------------------------

    def _check_graph_batch(self, batch) -> None:
        """As the base class, once per signature of the batch's tensors where no check reads
        their values (device tensors: ``validation.graph_checks_read_values``): what it
        checks there is their dtypes, shapes and devices. The round's signature (or
        ``None``) stays in ``_checked_batch``: the slot-list launch's key reads it."""
        key = self._batch_signature(batch)
        if key is None or key != self._checked_batch:
            super()._check_graph_batch(batch)
            self._checked_batch = key

    def _batch_signature(self, batch) -> Optional[tuple]:
        """The signature of ``batch``'s index tensors and host copies (``None``: the checks
        read values here, or ``batch`` is not a batch). A signature equal to the last checked
        one holds its devices: no check reads values there either."""
        try:
            index = tuple(getattr(batch, name) for name in _INDEX_FIELDS)
            # The new tokens' slots by all but their count: the device-side checks read only
            # their dtype, rank and device, and the count changes from round to round.
            loc = index[3]
            key = (type(batch), *(signature(t) for t in index[:3]),
                   (loc.dtype, loc.dim(), loc.stride(), loc.device),
                   *(None if getattr(batch, name, None) is None else
                     signature(getattr(batch, name)) for name in HOST_COPIES))
        except (AttributeError, TypeError):
            return None
        if key != self._checked_batch and validation.graph_checks_read_values(*index):
            return None
        return key

    def _fills_graph_round(self) -> bool:
        """A graph round's new-token slots are copied into the fixed buffer by the slot-list
        launch where it writes the device CSR, else by ``_prepare`` (one copy)."""
        return True

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """The passes of each captured batch size are made at capture."""
        self._graphs.clear()
        self._slot_launches.clear()
        self._checked_batch = None

    def _plan_graph(self, batch, *, capture: bool) -> None:
        bs = batch.batch_size
        self._prepare(captured(self._graphs, bs, capture,
                               lambda: self._new_pass(bs, bs * self.runner.max_context_len)),
                      batch, replay=not capture)
