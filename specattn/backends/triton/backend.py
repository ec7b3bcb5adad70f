"""``triton`` backend classes: shared-prefix draft decode and draft extend, MHA and MLA
(imports no Triton: the kernels load on the first metadata call).

A round's metadata is one launch (the ``gluon-wl`` work list included), graph-safe, no host
sync; ``forward`` runs the plan's kernel (``plans``; ``plan=NAME`` forces one) and merges
the partials. ``mode="per-branch"``: every lane its own sequence (the upstream design).

A CUDA-graph round's metadata is the same launch, which also copies the caller's batch into
the fixed buffers, padded; a replay's call of a signature seen before launches the kept
compiled kernel and repeats only the checks that read values (``specattn.graph_calls``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional, get_args

import torch

from ..._tensor_checks import _is_int
from ...errors import InvalidInputError
from ...graph_calls import KeptDecodeCalls, KeptExtendCalls
from ...platforms import (is_cpu, is_cuda, is_hip, is_xpu, triton_interpret,
                          triton_interpret_enabled)
from . import plans as P

if TYPE_CHECKING:
    from ...data import AttentionLayer, DraftBatch, DraftExtendBatch

_PLATFORMS = is_cuda | is_hip | is_xpu | (is_cpu & triton_interpret)
_PRIORITY = {"cuda": 60, "hip": 60, "xpu": 60, "cpu": 5}
_DECL = dict(platforms=_PLATFORMS, requires=(("triton", "triton>=3.2"),),
             kernel_library="triton (specattn)", priority=_PRIORITY)
DecodeMode = Literal["shared", "per-branch"]
DECODE_MODES: tuple[str, ...] = get_args(DecodeMode)


def _launchers():
    from . import launchers

    return launchers


class _TritonCommon:
    """What the decode and extend classes share: capabilities and the keyword checks."""

    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2")  # FP8: tl.dot and Gluon plans
    supports_cuda_graph = True
    tested_on = "H200 (sm90) + CPU interpreter"

    @classmethod
    def check_request(cls, request, platform) -> Optional[str]:
        """float32 at DeepSeek's 512 + 64 latent needs 443 KB of shared memory (H200: 227)."""
        if request.mla and request.dtype == torch.float32 and (request.head_dim or 0) > 320:
            return (f"float32 MLA with a latent row of {request.head_dim} does not fit shared "
                    "memory in the Triton MLA kernels (bf16/fp16 do; float32 up to 320)")
        return None

    def _splits(self, plan: "P.Plan", shape: "P.AttnShape", rows_per_group: int,
                num_groups: int, rows: int, extend: bool) -> int:
        """A round's prefix splits: ``num_splits`` when given (at most ``split_cap`` for the
        round's ``rows`` query rows), else ``plan_splits``'s."""
        L = _launchers()
        forced = self._num_splits_override
        if forced is None:
            return L.plan_splits(plan, shape, rows_per_group, num_groups, self.runner.device,
                                 extend, rows, self.runner.kv_dtype.itemsize)
        cap = L.split_cap(plan, rows, extend)
        if forced > cap:
            raise InvalidInputError("num_splits", f"at most {cap} with plan {plan.name} for "
                                    f"{rows} query rows", forced)
        if plan.kernel is P.Kernel.CUTE and L.cute_mla.cluster_shape(
                forced, L.unsplit_programs(plan, shape, rows_per_group, num_groups),
                self.runner.device, L.partial_room(rows)) is None:
            raise InvalidInputError(
                "num_splits", f"clusters of at most {L.cute_mla.MAX_CLUSTER} splits, at most "
                f"{L.partial_room(rows)} per row, with plan cute for {rows} query rows", forced)
        return forced

    def _options(self, num_splits: Optional[int], plan: Optional[str], job: str,
                 pdl: Optional[bool] = None) -> None:
        """``num_splits`` / ``plan`` / ``pdl`` checked and kept; the per-round caches
        emptied."""
        P.check_num_splits(num_splits)
        if plan is not None and not isinstance(plan, str):
            raise InvalidInputError("plan", f"a plan name ({', '.join(P.PLANS)}) or None",
                                    repr(plan))
        self._pdl = self._checked_pdl(pdl)
        self._num_splits_override = num_splits
        self._forced = None if plan is None else P.plan_named(
            plan, self.runner, job, triton_interpret_enabled())
        self._bufs: Optional[_GraphBuffers] = None
        self._graph_bufs: Optional[_GraphBuffers] = None
        self._plans: dict = {}
        self._round_plan = None

    def _checked_pdl(self, pdl: Optional[bool]) -> bool:
        """``pdl``: ``None`` (on where programmatic dependent launch runs: CUDA sm90+, not
        under the interpreter), or ``True`` / ``False``, ``True`` refused where it cannot
        run."""
        if pdl is not None and not isinstance(pdl, bool):
            raise InvalidInputError("pdl", "True, False or None", repr(pdl))
        if pdl is False:
            return False
        why = P.pdl_reason(torch.device(self.runner.device), triton_interpret_enabled())
        if why is not None and pdl:
            raise InvalidInputError("pdl", f"False or None here (programmatic dependent "
                                    f"launch needs CUDA sm90+; this is {why})", repr(pdl))
        return why is None

    def _kept_plan(self) -> dict:
        return self._round_plan

    def _resume_plan(self, plan: dict) -> None:
        self._round_plan = plan

    def _kernel_writes_kv(self) -> bool:
        return True  # launchers.attention stores it

    def _buffers_for(self, bs: int, rows: int) -> "_GraphBuffers":
        """The graph's fixed buffers where they fit, else the eager ones (grown as needed)."""
        for bufs in (self._graph_bufs, self._bufs):
            if bufs is not None and bufs.fits(bs, rows):
                return bufs
        self._bufs = self._new_buffers(bs, rows)
        return self._bufs


class _GraphBuffers:
    """Fixed buffers for CUDA graphs (or the eager cache): meta, hist (the new tokens'
    slots), partials and the ``gluon-wl`` work list (``work``; ``work_rows`` partial rows at
    the least)."""

    def __init__(self, max_reqs: int, max_rows: int, num_steps: int, num_q_heads: int,
                 d_v: int, device: torch.device, work_rows: int = 0,
                 work_numel: int = 0) -> None:
        rows = max(max(max_rows, P.PARTIAL_ROWS) * num_q_heads * (P.MAX_SPLITS + 1),
                   work_rows)  # launchers.split_cap: what a round of few rows may take
        self.meta = torch.zeros(max_reqs, 5, dtype=torch.int32, device=device)
        self.hist = torch.zeros(max(1, max_rows), num_steps, dtype=torch.int32, device=device)
        self.mid_o = torch.empty(rows * d_v, dtype=torch.float32, device=device)
        self.mid_lse = torch.empty(rows, dtype=torch.float32, device=device)
        self.work = torch.zeros(work_numel, dtype=torch.int32, device=device) \
            if work_numel else None

    def fits(self, reqs: int, rows: int) -> bool:
        return self.meta.shape[0] >= reqs and self.hist.shape[0] >= rows


class TritonDecode(_TritonCommon, KeptDecodeCalls, name="triton", **_DECL):
    """Multi-step draft decode on Triton kernels (see the module doc).

    ``mode``: ``"shared"`` or ``"per-branch"``; ``num_splits``: fixed prefix split count
    (``gluon-wl``: programs per row tile; default: from the SM count and the grid size);
    ``plan``: a plan name from ``plans.PLANS`` instead of the table's choice (benchmarks;
    an error where the plan cannot serve this model here); ``pdl``: the split-KV and
    Gluon kernels and their merge as programmatic dependent launches (default ``None``: where
    they run, CUDA sm90+; ``True`` elsewhere is an error; ``cute`` launches as without it:
    ``launchers.attention``). The ``tl.dot``
    plans over FP8 pools under a bf16 model dot in fp16, on a query prescaled to fp16 (codes
    widen to fp16 in one exact conversion: ``launchers.attention``)."""

    known_limits = {"decode/*/isolation/*": (
        "the lanes of a request share one history tile: a non-finite value in one lane's "
        "draft KV reaches its sibling lanes through P.V (0 * NaN) in the tl.dot plans. "
        "Zeroing the tile cost 40 registers per thread, one occupancy step and 18% at "
        "gqa-long on the H200 (156 -> 188 registers; 156 vs 184 us), so it is not done; the "
        "sm90 MLA plans do zero it at no measurable cost")}

    def __init__(self, runner, topk: int, num_steps: int, *, tree_mode: str = "lane",
                 mode: DecodeMode = "shared", num_splits: Optional[int] = None,
                 plan: Optional[str] = None, pdl: Optional[bool] = None) -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        if mode not in DECODE_MODES:
            raise InvalidInputError("mode", f"one of {DECODE_MODES}", repr(mode))
        self.mode = mode
        self._options(num_splits, plan, "decode" if mode == "shared" else "per-branch", pdl)

    @property
    def plan(self) -> P.Plan:
        """The plan of a one-request round (``plan_for``)."""
        return self.plan_for(1)

    def plan_for(self, bs: int) -> P.Plan:
        """The plan a round of ``bs`` requests runs (``plans.choose_plan`` unless forced)."""
        if self._forced is not None:
            return self._forced
        shape = P.AttnShape.of(self.runner)
        shared = self.mode == "shared"
        rows = (self.topk if shared else 1) * shape.group
        groups = bs if shared else bs * self.topk
        return P.choose_plan(self.runner, "decode" if shared else "per-branch", rows,
                             triton_interpret_enabled(), groups)

    def _make_plan(self, bs: int) -> dict:
        """The round's launch plan for ``bs`` requests (cached: host ints only)."""
        if bs in self._plans:
            return self._plans[bs]
        L = _launchers()
        shape = L.AttnShape.of(self.runner)
        lanes = self.topk if self.mode == "shared" else 1
        rows_per_group = lanes * shape.group
        plan = self.plan_for(bs)
        num_groups = bs * self.topk // lanes
        splits = self._splits(plan, shape, rows_per_group, num_groups, bs * self.topk, False)
        out = dict(shape=shape, lanes=lanes, rows_per_group=rows_per_group, plan=plan,
                   num_groups=num_groups, num_splits=splits, bs=bs,
                   parts=L.num_parts(plan, splits, L.unsplit_programs(
                       plan, shape, rows_per_group, num_groups), self.runner.device,
                       bs * self.topk))
        if plan.kernel is P.Kernel.GLUON_WL:
            from . import worklist

            # A program per request at the least; partial slots p + b; tail units per request.
            out["num_splits"] = splits = max(splits, num_groups)
            out.update(wl_slots=splits + bs,
                       wl_rows=worklist.partial_rows(self.topk, shape.num_q_heads),
                       wl_tail=worklist.tail_units(self.topk, shape.num_q_heads,
                                                   self.num_steps, plan.block_n),
                       wl_numel=worklist.work_numel(splits, bs))
        self._plans[bs] = out
        return out

    @classmethod
    def runtime_note(cls, platform, request=None) -> str:
        """Which MLA decode plans run on ``platform`` (``specattn list`` / ``select``; none
        for an MHA request: its plan is the ``tl.dot`` table's, ``plan_for``)."""
        if request is not None and not request.mla:
            return ""
        return P.platform_note(platform.device, platform.capability,
                               platform.triton_interpret)

    def _new_buffers(self, bs: int, lanes: int) -> _GraphBuffers:
        """Buffers for ``bs`` requests (and the work list's slots when the plan uses one)."""
        plan = self._make_plan(bs)
        return _GraphBuffers(bs, lanes, self.num_steps, plan["shape"].num_q_heads,
                             plan["shape"].d_v, self.runner.device,
                             plan.get("wl_slots", 0) * plan.get("wl_rows", 0),
                             plan.get("wl_numel", 0))

    def _plan(self, batch: "DraftBatch", source: Optional["DraftBatch"] = None) -> None:
        """One metadata launch for all steps of the round (no host sync on a GPU); with
        ``source`` (graph rounds) it also copies the caller's batch into ``batch``'s fixed
        buffers, padded."""
        bs = batch.batch_size
        plan = self._make_plan(bs)
        bufs = self._buffers_for(bs, bs * self.topk)
        src = source or batch
        self._launch = _launchers().decode_metadata(
            src.req_pool_indices, src.seq_lens, src.out_cache_loc, bufs.meta, bufs.hist,
            plan["num_splits"], plan["plan"].block_n, self.runner.num_slots, bufs.work,
            plan.get("wl_tail", 0), fixed=None if source is None else (
                batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc))
        self._round_plan, self._active = plan, bufs

    def _fills_graph_round(self) -> bool:
        return True

    def _plan_graph(self, batch: "DraftBatch", *, capture: bool) -> None:
        self._plan(batch, self.graph_source)

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed buffers for ``max_bs`` requests, ``max_bs * topk`` lanes."""
        self._graph_bufs = self._new_buffers(max_bs, max_bs * self.topk)

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        plan, bufs, lanes = self._round_plan, self._active, self.num_lanes
        parents = self.batch.parents if self.tree_mode == "path" else None
        L = _launchers()
        shape, kernel_plan = plan["shape"], plan["plan"]
        if kernel_plan.kernel is P.Kernel.GLUON_WL:
            mid_o, mid_lse = L.partial_views((plan["wl_slots"], plan["wl_rows"]), shape.d_v,
                                             q.device, bufs.mid_o, bufs.mid_lse,
                                             L.partial_dtype(kernel_plan, q.dtype))
        else:
            mid_o, mid_lse = L.partial_views((lanes, shape.num_q_heads, plan["parts"]),
                                             shape.d_v, q.device, bufs.mid_o, bufs.mid_lse)
        return L.attention(q, self.runner, layer, shape, bufs.meta, self.runner.req_to_token,
                           mode=1 if self.tree_mode == "path" else 0,
                           num_groups=plan["num_groups"],
                           rows_per_group=plan["rows_per_group"],
                           lanes_per_group=plan["lanes"], topk=self.topk,
                           num_steps=self.num_steps, step=step,
                           num_splits=plan["num_splits"], plan=kernel_plan, mid_o=mid_o,
                           mid_lse=mid_lse, hist=bufs.hist[:lanes], parents=parents,
                           new_kv=(k, v), work=bufs.work, pdl=self._pdl)


class TritonExtend(_TritonCommon, KeptExtendCalls, name="triton", **_DECL):
    """Draft extend on the same kernels: per request and KV head, the ``E_b * G`` query rows
    read the prefix ``R_b[0 : L' - E]`` once, then the new tokens causally.

    ``max_extend_len``: CUDA graphs only, the largest ``extend_lens`` of any graph round
    (EAGLE: ``num_steps + 1``), which sizes the grid; without it the grid covers any split of
    the ``T`` tokens (mostly empty row blocks: 2.1x the eager time at ``extend`` on the
    H200). ``num_splits``, ``plan`` and ``pdl`` as in ``TritonDecode`` (the ``tl.dot``
    plans)."""

    def __init__(self, runner, *, topk: int = 1, num_steps: int = 1,
                 num_splits: Optional[int] = None, plan: Optional[str] = None,
                 max_extend_len: Optional[int] = None, pdl: Optional[bool] = None) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        if max_extend_len is not None and not (_is_int(max_extend_len)
                                               and max_extend_len >= 1):
            raise InvalidInputError("max_extend_len", "an int >= 1 or None",
                                    repr(max_extend_len))
        self._options(num_splits, plan, "extend", pdl)
        self.max_extend_len = max_extend_len  # checked by the base class in graph rounds

    def _plan_for(self, bs: int, num_tokens: int, max_extend: int) -> dict:
        key = (bs, num_tokens, max_extend)
        if key in self._plans:
            return self._plans[key]
        L = _launchers()
        shape = L.AttnShape.of(self.runner)
        rows_per_group = max_extend * shape.group
        plan = self._forced or P.choose_plan(self.runner, "extend", rows_per_group,
                                             triton_interpret_enabled())
        splits = self._splits(plan, shape, rows_per_group, bs, num_tokens, True)
        out = self._plans[key] = dict(shape=shape, plan=plan, rows_per_group=rows_per_group,
                                      num_splits=splits, bs=bs, num_tokens=num_tokens)
        return out

    def _plan(self, batch: "DraftExtendBatch") -> None:
        """Eager: reads ``max(extend_lens)`` to size the grid (one host sync, as upstream)."""
        self._fill(batch, int(batch.extend_lens.max()))

    def _fill(self, batch: "DraftExtendBatch", max_extend: int,
              source: Optional["DraftExtendBatch"] = None) -> None:
        """One launch: the metadata, and the new tokens' slots into the fixed ``hist`` (so a
        replayed graph writes the new ones); with ``source`` (graph rounds) the caller's batch,
        whose slots also go into ``batch``'s fixed ``out_cache_loc``."""
        bs, num_tokens = self.graph_size if source is not None else (batch.batch_size,
                                                                     self.num_tokens)
        plan = self._plan_for(bs, num_tokens, max_extend)
        bufs = self._buffers_for(bs, num_tokens)
        src = source or batch
        self._launch = _launchers().extend_metadata(
            src.req_pool_indices, src.seq_lens, src.extend_lens, src.out_cache_loc, bufs.meta,
            bufs.hist, plan["num_splits"], plan["plan"].block_n,
            None if source is None else self.padded_graph_loc(),
            None if source is None else (bs, num_tokens))
        self._round_plan, self._active = plan, bufs

    def _new_buffers(self, bs: int, num_tokens: int) -> _GraphBuffers:
        shape = P.AttnShape.of(self.runner)
        return _GraphBuffers(bs, num_tokens, 1, shape.num_q_heads, shape.d_v, self.runner.device)

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph_bufs = self._new_buffers(max_bs, max_num_tokens)

    def _fills_graph_round(self) -> bool:
        return True

    def _plan_graph(self, batch: "DraftExtendBatch", *, capture: bool) -> None:
        """Rows per request of the graph's grid: any split of ``T`` tokens has
        ``max E <= T - B + 1``; ``max_extend_len`` bounds it further. A replay is planned
        at its capture's size (``graph_size``: the captured launches' grid and constants),
        a smaller batch padded."""
        bs, tokens = self.graph_size
        bound = tokens - bs + 1
        self._fill(batch, bound if self.max_extend_len is None
                   else min(bound, self.max_extend_len), self.graph_source)

    def _attend(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        plan, bufs = self._round_plan, self._active
        L = _launchers()
        shape = plan["shape"]
        parts = L.num_parts(plan["plan"], plan["num_splits"])
        rows = q.shape[0]  # the plan's tokens, or a padded replay's batch run eagerly
        mid_o, mid_lse = L.partial_views((rows, shape.num_q_heads, parts),
                                         shape.d_v, q.device, bufs.mid_o, bufs.mid_lse)
        return L.attention(q, self.runner, layer, shape, bufs.meta, self.runner.req_to_token,
                           mode=2, num_groups=plan["bs"], rows_per_group=plan["rows_per_group"],
                           lanes_per_group=1, topk=1, num_steps=1, step=0,
                           num_splits=plan["num_splits"], plan=plan["plan"], mid_o=mid_o,
                           mid_lse=mid_lse, hist=bufs.hist[:rows], new_kv=(k, v),
                           pdl=self._pdl)
