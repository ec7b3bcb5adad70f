"""The draft-decode glue shared by the MHA and MLA flavours.

Algorithm (``N = B * K`` lanes, step ``i``, ``n = i + 1`` history slots per lane):

- ``shared`` mode (the default, any ``K``): a *prefix* pass (FlashInfer) attends the ``K``
  query rows of each request to ``R_b[0 : L_b]`` together (the prefix is read once per
  request, not ``K`` times); one Triton kernel then attends each lane to its ``n`` history
  slots and merges with the prefix result by its base-2 LSE
  (``specattn.kernels.history_merge``). The prefix pass is planned once per round and
  serves every step (its KV set does not change within a round); the history kernel
  needs no plan (it reads the slots from ``out_cache_loc`` / ``parents`` on the device).
  At ``K == 1`` the prefix is read once per lane anyway; the mode still saves host work: one
  FlashInfer plan per round instead of one per step.
- The ``per-branch`` mode (upstream's design, kept for benchmarks): one pass per step, each
  lane a sequence over ``R_b[0 : L_b]`` plus its history.

Plan step (``init_forward_metadata``): the CSR indptrs FlashInfer's host scheduler needs
come from the lengths on the host (``batch.seq_lens_cpu``, which engines keep; without it
one copy of ``seq_lens`` per round, a sync: ``data.host_lengths``); slot lists are built on
the device. ``shared`` mode: one launch (``kernels.prefix_slots``) writes the prefix slot
list (in graph rounds it also copies the caller's batch into the fixed buffers, padded; the
launch is kept per signature and grid and launched directly), and one FlashInfer plan of the
prefix pass serves every step. Host work per round, whatever ``B`` and ``S``: that launch,
numpy arithmetic on ``B + 1`` lengths, the plan (in graph rounds a direct replan,
``_replan``, whose captured ``kv_indptr`` / ``kv_lens`` and schedule the launch writes too:
no host-to-device copy of the CSR, no host planner; ``_prefill_plan``, ``_mla_plan``); no
device-to-host read.
``per-branch`` mode plans the passes of steps ``0 .. max(S - 2, 0)`` (one wrapper and one
plan each: their KV sets differ; the serving loop never runs step ``S - 1``; eager calls
plan it on first use), their slot lists built with torch (``_slots.fill_ragged_slots``). Run
step (``forward``): build the ``path`` histories on the device (graph-safe), run the passes;
``shared`` mode's history kernel also stores the step's K/V (the prefix pass never reads
them), except into FP8 pools; the other modes, and FP8 pools, store them first in one launch
(``kernels.kv_write.store_kv``: torch's codes, bit for bit, where ``runner.write_kv`` takes
about ten launches).

CUDA graphs: one set of wrappers per captured batch size, on fixed buffers sized for
``max_bs * K`` lanes. FlashInfer's plan is host code that writes the split schedule into the
wrapper's int workspace, so ``init_forward_metadata_replay_cuda_graph`` re-plans (outside the
graph) before every replay, as upstream does (only the prefix pass in ``shared`` mode).
The graph-mode prefix plan promises FlashInfer ``K`` query rows per request
(``uniform_q_len``), so its query tile is sized for ``K`` rows rather than for the ragged
worst case of ``B * K - B + 1`` rows (4x padded work at ``K = 8``); see ``_passes.py``.
Under graphs, ``path`` mode reads the ``parents`` tensor given at capture (the draft loop
inside the graph fills it); a replay batch's own ``parents`` are copied into it. Padded lanes
write and read slot 0 (``out_cache_loc`` padded with 0), like upstream's padding.
"""

from __future__ import annotations

from typing import Literal, Optional, get_args

import numpy as np
import torch

from ...data import host_lengths
from ...errors import InvalidInputError
from ...fp8 import scale_rows
from ...graph_calls import KeptDecodeCalls, Replay
from ...metadata import path_history_slots
from ._passes import OneLaunchKvWrite, Params, Pass, captured, capturing, fp8_scales, replan
from ._slots import (KeptCSR, fill_ragged_slots, history_positions, host_arange, host_csr,
                     prefix_slots_launcher)

DecodeMode = Literal["shared", "per-branch"]
MODES: tuple[str, ...] = get_args(DecodeMode)


class _Round:
    """The passes of one draft round (eager) or one captured batch size (graph)."""

    def __init__(self, prefix: Optional[Pass], steps: list[Pass]) -> None:
        self.prefix = prefix  # shared mode (no step passes: the history kernel needs none)
        self.steps = steps  # one full pass per step otherwise
        self.planned = [False] * len(steps)
        self.hist_pos: list[Optional[torch.Tensor]] = [None] * len(steps)
        self.rows = self.plen = self.seq_host = None  # per lane (per-branch mode)
        self.bs = 0
        self.qo: Optional[torch.Tensor] = None  # the prefix pass's qo_indptr (host), by bs
        self.host: Optional[KeptCSR] = None  # graph rounds' kept host CSR buffers
        self.seq_pad: Optional[np.ndarray] = None  # graph rounds' padded host lengths


class FlashInferDecodeGlue(OneLaunchKvWrite, KeptDecodeCalls):
    """Common body of ``FlashInferDecode`` and ``FlashInferMLADecode`` (not registered).

    Extra keyword ``mode``: ``"shared"`` (default; a shared-prefix pass per round) or
    ``"per-branch"`` (each lane its own sequence, the upstream baseline).

    Graph calls of the shared mode are kept per signature (``graph_calls``): a replay call
    whose signature a checked call had skips the batch checks and the fixed views' set-up and
    does only the round's work (the slot-list launch and the plan, ``_resume_plan``).
    """

    def __init__(self, runner, topk: int, num_steps: int, *, tree_mode: str = "lane",
                 mode: DecodeMode = "shared") -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        if mode not in MODES:
            raise InvalidInputError("mode", f"one of {MODES}", repr(mode))
        self.mode = mode
        self.shared = mode == "shared"
        self.params = self._default_params()
        self._eager: Optional[_Round] = None
        self._graphs: dict[int, _Round] = {}
        self._active: Optional[_Round] = None
        self._graph_caps: Optional[tuple[int, int]] = None
        self._slot_launches: dict = {}  # graph rounds' kept slot-list launches (prefix_slots)

    # --- flavour hooks -----------------------------------------------------------------------

    def _default_params(self) -> Params:
        raise NotImplementedError

    def _check_layer_params(self, layer) -> Params:
        return Params(float(layer.scaling), float(layer.logit_cap))

    def _new_pass(self, role: str, graph_rows: Optional[int], capacity: int) -> Pass:
        """role: ``prefix`` (K rows per request, LSE) or ``full`` (1 row per lane)."""
        raise NotImplementedError

    def _history_pools(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pools of a layer for the history kernel: ``[num_slots, H_kv, D]`` and
        ``[num_slots, H_kv, D_v]`` (views)."""
        raise NotImplementedError

    # --- metadata ----------------------------------------------------------------------------

    @property
    def _planned_steps(self) -> int:
        return max(self.num_steps - 1, 1)

    def _new_round(self, graph_bs: Optional[int] = None) -> _Round:
        caps = (0, 0) if graph_bs is None else self._graph_caps
        if self.shared:
            return _Round(self._new_pass("prefix", graph_bs, caps[0]), [])
        lanes = None if graph_bs is None else graph_bs * self.topk
        # Graph wrappers for the steps the serving loop runs; a later step (eager only)
        # gets an ordinary pass planned on first use.
        steps = [self._new_pass("full", lanes, caps[1]) if i < self._planned_steps
                 else self._new_pass("full", None, 0) for i in range(self.num_steps)]
        return _Round(None, steps)

    def _plan(self, batch) -> None:
        if self._eager is None:
            self._eager = self._new_round()
        self._prepare(self._eager, batch)

    def _host_seq_lens(self, rnd: _Round, batch, source):
        """``[bs]`` prefix lengths of the round on the host (tensor or array), padded
        requests included.

        ``batch`` is the round (the fixed views in a graph round), ``source`` the caller's
        batch when this backend fills the fixed views itself (they are not written yet: its
        lengths, ``seq_lens_cpu`` or else one copy, are padded here into the round's kept
        array)."""
        if source is None:
            host = getattr(batch, "seq_lens_cpu", None)
            return host if host is not None else host_lengths(batch, "seq_lens")[0]
        raw = getattr(source, "seq_lens_cpu", None)
        if raw is None:
            raw = host_lengths(source, "seq_lens")[0]
        bs = batch.batch_size
        if rnd.seq_pad is None or rnd.seq_pad.shape[0] != bs:
            rnd.seq_pad = np.empty(bs, dtype=np.int64)
        n = raw.shape[0]
        rnd.seq_pad[:n] = raw.numpy()
        rnd.seq_pad[n:] = self.get_cuda_graph_seq_len_fill_value()
        return rnd.seq_pad

    def _prepare(self, rnd: _Round, batch, source=None, kept_key=None) -> None:
        """Build slot lists on the device and plan the round's passes (host). ``source``:
        the caller's batch of a graph round whose fixed views (``batch``) are filled here;
        ``kept_key``: a kept graph call's key (its slot-list launch is kept under it)."""
        k = self.topk
        rnd.bs = bs = batch.batch_size
        seq_host = self._host_seq_lens(rnd, batch, source)
        rnd.planned = [False] * len(rnd.steps)
        if self.shared:
            # A graph round whose plan takes the key CSR written on the device: the host
            # CSR goes into kept pageable buffers (``KeptCSR``; its lengths are the round's
            # padded array).
            dev_csr = None if source is None else rnd.prefix.device_csr()
            dev_csr = None if dev_csr is None else dev_csr[:2]  # the query indptr is kept
            qo = self._prefix_qo(rnd, bs)
            if dev_csr is None:
                csr = host_csr(qo, seq_host, k, pin=rnd.prefix.pin)
            else:
                if rnd.host is None or rnd.host.m != bs:
                    rnd.host = KeptCSR(bs)
                csr = rnd.host.fill(seq_host, qo_indptr=qo, max_q=k)
            out = rnd.prefix.reserve(csr.total)
            prefix_slots = prefix_slots_launcher()
            # With the device CSR, FlashInfer's schedule of the round too.
            schedule = None if dev_csr is None else \
                rnd.prefix.device_schedule(False, self.params, rows=k)
            if kept_key is not None:  # the CSR buffers and schedule the launch writes, if any
                kept_key = (kept_key, None if dev_csr is None else
                            tuple(t.data_ptr() for t in dev_csr),
                            None if schedule is None else schedule.key())
            if source is None:
                prefix_slots(out, csr.total, csr.max_kv, self.runner.req_to_token,
                             batch.req_pool_indices, batch.seq_lens, self.runner.num_slots)
            else:
                prefix_slots(out, csr.total, csr.max_kv, self.runner.req_to_token,
                             source.req_pool_indices, source.seq_lens, self.runner.num_slots,
                             bs=bs, fill=self.get_cuda_graph_seq_len_fill_value(),
                             fixed=(batch.req_pool_indices, batch.seq_lens,
                                    batch.out_cache_loc),
                             loc=source.out_cache_loc, csr=dev_csr, schedule=schedule,
                             kept=self._slot_launches, kept_key=kept_key)
            rnd.prefix.plan(csr, False, self.params, on_device=dev_csr is not None,
                            scheduled=schedule is not None)
        else:
            rnd.rows = batch.req_pool_indices.to(torch.int64).repeat_interleave(k)
            rnd.plen = batch.seq_lens.to(torch.int64).repeat_interleave(k)
            rnd.seq_host = seq_host.repeat_interleave(k)
            for i in range(self._planned_steps):
                self._plan_step(rnd, i)
        self._active = rnd

    def _prefix_qo(self, rnd: _Round, bs: int) -> torch.Tensor:
        """The prefix pass's ``qo_indptr`` on the host: ``K`` rows per request (kept)."""
        if rnd.qo is None or rnd.qo.numel() != bs + 1:
            rnd.qo = host_arange(bs, self.topk, pin=rnd.prefix.pin)
        return rnd.qo

    def _plan_step(self, rnd: _Round, step: int) -> None:
        """Plan step ``step``'s full pass (``K == 1`` or ``per-branch``)."""
        n = step + 1
        lanes = rnd.bs * self.topk
        # Lane histories; in path mode a placeholder until forward() reads `parents`.
        hist = self.batch.out_cache_loc[:, :, :n].reshape(lanes, n)
        p = rnd.steps[step]
        csr = host_csr(host_arange(lanes, 1, pin=p.pin), rnd.seq_host + n, 1, pin=p.pin)
        fill_ragged_slots(p.reserve(csr.total), csr.total, self.runner.req_to_token, rnd.rows,
                          rnd.plen, hist, num_slots=self.runner.num_slots)
        if self._needs_path_refresh:
            rnd.hist_pos[step] = history_positions(rnd.plen, n)
        p.plan(csr, False, self.params)
        rnd.planned[step] = True

    @property
    def _needs_path_refresh(self) -> bool:
        # With one lane the ancestor chain is the lane itself.
        return self.tree_mode == "path" and self.topk > 1

    # --- forward -----------------------------------------------------------------------------

    def _kernel_writes_kv(self) -> bool:
        # The shared path's history kernel stores the new KV itself (pools of the model's
        # dtype only: FP8 codes are runner.write_kv's, bit for bit fp8.quantize).
        return self.shared and self.runner.kv_layout is None and not self.runner.fp8

    def _attend(self, step: int, layer, q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        rnd = self._active
        lanes = rnd.bs * self.topk
        self._sync_params(rnd, layer)
        if not self.shared and not rnd.steps[step].graph and capturing():
            # A step outside the serving loop has an eager pass, planned for the batch of
            # its first call: captured, it would replay that stale slot list (soak seed 364
            # on the H200: every row NaN at step S-1 after new pages were drawn).
            raise InvalidInputError("step", f"a step < {self._planned_steps} under CUDA "
                                    "graph capture (the serving loop runs steps "
                                    "0 .. num_steps-2)", step)
        if not self.shared and not rnd.planned[step]:
            self._plan_step(rnd, step)
        q = q if q.is_contiguous() else q.contiguous()
        fp8 = fp8_scales(self.runner, layer, q)
        q = fp8.q
        if not self.shared:
            if self._needs_path_refresh:
                self._refresh_path(rnd, step)
            o, _ = rnd.steps[step].run(q, layer.layer_id, fp8.k_scale, fp8.v_scale)
            return scale_rows(o, fp8.out_scale)
        o_p, lse_p = rnd.prefix.run(q, layer.layer_id, fp8.k_scale, fp8.v_scale)
        k_pool, v_pool = self._history_pools(layer.layer_id)
        new_kv = dict(k_new=k, v_new=v) if self._kernel_writes_kv() else {}
        from ...kernels.history_merge import history_merge

        o = history_merge(q, k_pool, v_pool, self._history(step, lanes), o_p, lse_p,
                          self.params.scale * fp8.k_scale, self.params.cap,
                          v_scale=fp8.v_scale, **new_kv)
        return scale_rows(o, fp8.out_scale)

    def _history(self, step: int, lanes: int) -> torch.Tensor:
        """``[lanes, step + 1]`` history slots of every lane (device ops, graph-safe)."""
        loc = self.batch.out_cache_loc
        if self._needs_path_refresh:
            return path_history_slots(loc, self.batch.parents, step).reshape(lanes, step + 1)
        return loc[:, :, :step + 1].reshape(lanes, step + 1)

    def _refresh_path(self, rnd: _Round, step: int) -> None:
        """Rewrite step ``step``'s history slots in its full pass from ``parents`` (device
        ops, graph-safe)."""
        hist = path_history_slots(self.batch.out_cache_loc, self.batch.parents, step)
        hist = hist.reshape(-1).to(torch.int32)
        rnd.steps[step].indices.index_copy_(0, rnd.hist_pos[step], hist)

    def _sync_params(self, rnd: _Round, layer) -> None:
        want = self._check_layer_params(layer)
        if want != self.params:
            planned = [p for p, done in zip(rnd.steps, rnd.planned) if done]
            replan(planned + ([rnd.prefix] if rnd.prefix is not None else []), self.params,
                   want)
            self.params = want

    # --- CUDA graphs -------------------------------------------------------------------------

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """Pass capacities for up to ``max_bs`` requests (``max_bs * topk`` lanes); the passes
        of each captured batch size are made at capture."""
        ctx = self.runner.max_context_len
        self._graph_caps = (max_bs * ctx, max_bs * self.topk * (ctx + self.num_steps))
        self._graphs.clear()
        self._slot_launches.clear()  # their fixed views are of the old buffers

    def _fills_graph_round(self) -> bool:
        # Shared mode: the prefix slot-list launch copies the caller's batch into the fixed
        # views too (one launch instead of six copies).
        return self.shared

    def _plan_graph(self, batch, *, capture: bool) -> None:
        bs = batch.batch_size
        rnd = captured(self._graphs, bs, capture, lambda: self._new_round(graph_bs=bs))
        self._prepare(rnd, batch, self.graph_source if self.shared else None)

    # --- kept graph calls (shared mode) ----------------------------------------------------

    def _graph_key_extra(self) -> Optional[tuple]:
        # Per-branch rounds plan their step passes from the fixed views' lengths (not kept).
        return () if self.shared else None

    def _kept_plan(self) -> tuple:
        # The round and a token for its slot-list launches: a kept call's tensors have the
        # signature checked when it was kept, and the round's buffers do not move.
        return self._active, object()

    def _launch_kept(self, batch, replay: Replay) -> None:
        # The round's launch depends on its lengths (grid, total): made in _resume_plan.
        self.batch, self.num_lanes = replay.fixed, replay.rows

    def _resume_plan(self, plan: tuple) -> None:
        rnd, token = plan
        self._prepare(rnd, self.batch, self.graph_source, kept_key=token)
