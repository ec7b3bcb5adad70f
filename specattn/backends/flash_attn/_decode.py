"""The draft-decode glue shared by every FlashAttention flavour (FA4, FA3, MUSA ``mate``).

Algorithm (``N = B * K`` lanes, step ``i``, ``n = i + 1`` history slots per lane):

- ``shared`` mode, ``K > 1`` (two passes, merged by natural-log LSE):
  *prefix pass*: the ``K`` lanes of request ``b`` are ``K`` non-causal query rows of one varlen
  sequence (``cu_seqlens_q`` steps by ``K``) over the request's prefix page table
  (page ids of ``R_b[0 : L_b]``, ``seqused_k = L_b``), so the prefix is read once per request;
  *history pass*: each lane one query over its ``n`` history slots, through a page-size-1
  view of the pool (``page_table[z] = `` the lane's slots, ``seqused_k = n``).
- ``K == 1``, or ``per-branch`` mode (upstream's design; also the auto route for small
  batches with short prefixes): one pass per step, each lane one query over a page-size-1
  table ``[prefix slots | history slots]`` (``seqused_k = L_b + n``). Page-size-1 because
  the history slots need not continue the prefix's pages.
- ``split_prefix = C > 1``: FA4 has no split-KV on sm90, so small batches with long
  prefixes leave SMs idle. The prefix pass then runs each request's prefix as ``C`` chunks of
  whole pages, each chunk an extra "request" with the request's ``K`` query rows (``q``
  repeated ``C`` times); the ``C`` chunks and the history merge by LSE. Empty chunks carry no
  weight. Also for ``K == 1``.
- ``auto`` mode (default): per round, ``_route.choose_route`` picks shared, split or
  per-branch from ``B``, ``K``, the prefix bound, ``H_kv`` and the SM count (host ints only,
  so one captured graph keeps its route); a route other than ``shared`` is logged once.

History + merge: where Triton runs (a CUDA GPU, or the CPU interpreter), the history pass and
the LSE merge are one Triton kernel (``specattn.kernels.history_merge``, shared with
``flashinfer`` and ``flashmla``) reading the prefix pass's output and head-major LSE in
place; elsewhere (MUSA) the history is a second FlashAttention call and the merge is
``kernels.lse.merge_states`` in torch.

Metadata (``init_forward_metadata``): no host sync, for all steps at once. The tables are
full width (``max_context_len``), so one table serves every step: step ``i`` differs only in
its ``seqused_k`` row (precomputed ``[S, N]``). ``path`` mode rewrites the history columns
from ``parents`` at the start of each step (device ops, graph-safe). Where Triton runs the
tables are one launch (``_metadata.decode_tables``); elsewhere (MUSA) torch ops write the
same values (``_fill``).

CUDA graphs: ``init_cuda_graph_state(max_bs, ...)``; the buffers of each route a captured
batch size takes are allocated for ``max_bs`` requests / ``max_bs * K`` lanes; capture and
replay refill them in place (padded to the captured size; the ``parents`` tensor given at
capture is kept), so a captured graph reads the same addresses every replay. Where Triton
runs, a graph round's metadata is the table launch, which also copies the caller's batch into
the fixed buffers (``_fills_graph_round``), and a replay's call of a signature seen before
(the runner's ``req_to_token`` part of it) launches the kept compiled kernel with the kept
route, buffers and views (``specattn.graph_calls``).
"""

from __future__ import annotations

import logging
from typing import Literal, Optional, get_args

import torch

from ...errors import InvalidInputError
from ...graph_calls import KeptDecodeCalls
from ...kernels.lse import merge_states
from ...metadata import path_history_slots, prefix_page_table, prefix_token_slots
from ...platforms import current_platform
from ...util import ceil_div, sm_count, triton_runs
from ...validation import check_whole_pages
from ._library import resolve_kernel
from ._route import check_split_prefix, choose_route
from ._tables import check_page_aligned, paged_pools, table_launch_key

log = logging.getLogger("specattn.backends.flash_attn")

DecodeMode = Literal["auto", "shared", "per-branch"]
MODES: tuple[str, ...] = get_args(DecodeMode)


class _Buffers:
    """Every per-round tensor, sized for ``bs`` requests (fixed under CUDA graphs).

    cu_req: ``[bs*C + 1]`` int32, ``K`` rows per (chunk of a) request; cu_lane: ``[N + 1]``.
    Two-pass: prefix_pt ``[bs, C * cp]`` int32 page ids (chunk ``c`` = columns
    ``c*cp : (c+1)*cp``), chunk_used ``[bs * C]``, hist_pt ``[N, S]`` slots,
    hist_used ``[S, N]`` = ``i + 1``. One-pass: full_pt ``[N, ctx + S]`` slots,
    full_used ``[S, N]`` = ``L_b + i + 1``, lane_len ``[N]`` int64.
    """

    def __init__(self, bs: int, topk: int, steps: int, ctx: int, page_size: int,
                 chunks: int, two_pass: bool, device: torch.device) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        lanes = bs * topk
        self.bs = bs
        self.chunks = chunks
        self.cu_req = torch.arange(bs * chunks + 1, **i32) * topk
        self.cu_lane = torch.arange(lanes + 1, **i32)
        self.two_pass = two_pass
        if two_pass:
            self.chunk_pages = ceil_div(ceil_div(ctx, page_size), chunks)
            self.prefix_pt = torch.zeros(bs, chunks * self.chunk_pages, **i32)
            self.chunk_used = torch.zeros(bs * chunks, **i32)
            self.hist_pt = torch.zeros(lanes, steps, **i32)
            self.hist_used = (torch.arange(steps, **i32) + 1)[:, None].repeat(1, lanes)
        else:
            self.full_pt = torch.zeros(lanes, ctx + steps, **i32)
            self.full_used = torch.zeros(steps, lanes, **i32)
            self.lane_len = torch.zeros(lanes, dtype=torch.int64, device=device)


class FlashAttnDecodeGlue(KeptDecodeCalls):
    """Common body of the registered fa3 / fa4 decode classes (not registered).

    Extra keywords: ``mode`` (``"auto"`` default: routed per round; ``"shared"``;
    ``"per-branch"``), ``split_prefix`` (``C >= 1`` prefix chunks per request, 1 = off; a
    value > 1 fixes the shared route) and ``fused_merge`` (None: the Triton history+merge
    kernel where Triton runs; False: FlashAttention history pass + torch merge).
    """

    library = "fa4"  # which kernel family: "fa4", "fa3" or "mate"

    def __init__(self, runner, topk: int, num_steps: int, *, tree_mode: str = "lane",
                 mode: DecodeMode = "auto", split_prefix: int = 1,
                 fused_merge: Optional[bool] = None) -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        check_whole_pages(runner, type(self).name)
        if mode not in MODES:
            raise InvalidInputError("mode", f"one of {MODES}", repr(mode))
        check_split_prefix(split_prefix)
        if mode == "per-branch" and split_prefix > 1:
            raise InvalidInputError("split_prefix", "1 in mode='per-branch' (only the shared "
                                    "prefix pass is split)", split_prefix)
        if fused_merge not in (None, True, False):
            raise InvalidInputError("fused_merge", "None, True or False", repr(fused_merge))
        self.kernel = resolve_kernel(self.library, current_platform(), type(self).name)
        self.mode = mode
        self.chunks = split_prefix
        can_fuse = triton_runs(runner.device)
        if fused_merge and not can_fuse:
            raise InvalidInputError("fused_merge", "False or None here (Triton cannot run on "
                                    f"{runner.device})", fused_merge)
        self.fused = can_fuse if fused_merge is None else fused_merge
        self._bufs: dict = {}  # route -> _Buffers (eager rounds)
        self._graph_bufs: dict = {}  # route -> _Buffers for cuda_graph_max_bs
        self._active: Optional[_Buffers] = None
        self._route = self._fixed_route()
        self._logged_routes: set = set()
        # Where Triton runs, the tables are one launch (``_metadata``); else torch ops.
        self._meta_kernel = can_fuse

    # --- routing -----------------------------------------------------------------------------

    def _fixed_route(self) -> tuple:
        if self.mode == "per-branch":
            return ("per-branch", 1)
        return ("shared", self.chunks)

    def route_for(self, bs: int) -> tuple:
        """``(mode, chunks)`` a round of ``bs`` requests runs (host ints only)."""
        if self.mode != "auto" or self.chunks > 1:
            return self._fixed_route()
        r = self.runner
        route = choose_route(bs=bs, topk=self.topk, prefix_len=r.max_context_len,
                             num_kv_heads=r.num_kv_heads, num_sms=sm_count(r.device),
                             head_dim=r.head_dim)
        if route != ("shared", 1) and route not in self._logged_routes:
            self._logged_routes.add(route)
            log.debug("%s: %d requests x %d lanes route to %s (chunks=%d): the shared prefix "
                      "pass would leave SMs idle", type(self).name, bs, self.topk, *route)
        return route

    def _two_pass(self, route: tuple) -> bool:
        return route[0] == "shared" and (self.topk > 1 or route[1] > 1)

    @property
    def two_pass(self) -> bool:
        """Whether the current (or, before any round, the fixed) route has two passes."""
        return self._two_pass(self._route)

    def _new_buffers(self, bs: int, route: tuple) -> _Buffers:
        return _Buffers(bs, self.topk, self.num_steps, self.runner.max_context_len,
                        self.page_size, route[1], self._two_pass(route), self.runner.device)

    # --- metadata ----------------------------------------------------------------------------

    def _plan(self, batch) -> None:
        """Fill this round's tables on the device (no host sync on a GPU)."""
        bs = batch.batch_size
        route = self.route_for(bs)
        bufs = self._bufs.get(route)
        if bufs is None or bufs.bs < bs:
            bufs = self._bufs[route] = self._new_buffers(bs, route)
        self._tables(bufs, route, batch)

    def _tables(self, bufs: _Buffers, route: tuple, batch, source=None) -> None:
        """The round's tables into ``bufs``: one launch where Triton runs, else ``_fill``.
        ``source`` (graph rounds, with ``_fills_graph_round``): the caller's batch, which the
        launch also copies into ``batch``'s fixed buffers, padded. A two-pass route's
        prefixes must be page-aligned (``check_page_aligned``: the caller's requests, where
        values are read)."""
        src = batch if source is None else source
        if self._two_pass(route):
            check_page_aligned(self.runner, src.req_pool_indices, src.seq_lens, "prefixes")
        if self._meta_kernel:
            from ._metadata import decode_tables

            self._launch = decode_tables(
                src.req_pool_indices, src.seq_lens, src.out_cache_loc, self.runner, bufs,
                batch.batch_size, self.page_size, fixed=None if source is None else (
                    batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc))
        else:
            self._fill(bufs, route, batch)
        self._active, self._route = bufs, route

    def _fill(self, bufs: _Buffers, route: tuple, batch) -> None:
        """The tables in torch ops (where Triton does not run; ``_metadata.decode_tables``
        writes the same values)."""
        rpi, seq, loc = batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc
        bs = batch.batch_size
        two_pass, chunks = self._two_pass(route), route[1]
        k, s, p = self.topk, self.num_steps, self.page_size
        lanes = bs * k
        r2t = self.runner.req_to_token
        if two_pass:
            width = bufs.prefix_pt.shape[1]
            bufs.prefix_pt[:bs].copy_(prefix_page_table(r2t, rpi, seq, p, max_pages=width,
                                                        num_slots=self.runner.num_slots))
            span = bufs.chunk_pages * p  # keys per full chunk
            start = torch.arange(chunks, device=seq.device) * span
            used = (seq.long()[:, None] - start[None, :]).clamp(0, span)
            bufs.chunk_used[:bs * chunks].copy_(used.reshape(-1))
            bufs.hist_pt[:lanes].copy_(loc.reshape(lanes, s))
        else:
            ctx = self.runner.max_context_len
            lane_len = seq.long().repeat_interleave(k)
            bufs.lane_len[:lanes].copy_(lane_len)
            slots, _ = prefix_token_slots(r2t, rpi, seq, max_len=ctx,
                                          num_slots=self.runner.num_slots)
            table = bufs.full_pt[:lanes]
            table[:, :ctx].copy_(slots.repeat_interleave(k, dim=0))
            table[:, ctx:].zero_()
            cols = lane_len[:, None] + torch.arange(s, device=seq.device)
            table.scatter_(1, cols, loc.reshape(lanes, s).to(torch.int32))
            bufs.full_used[:, :lanes].copy_(
                lane_len[None, :] + torch.arange(1, s + 1, device=seq.device)[:, None])

    # --- forward -----------------------------------------------------------------------------

    def _attend(self, step: int, layer, q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        bufs, bs, lanes = self._active, self.batch.batch_size, self.num_lanes
        two_pass = self.two_pass
        if self.tree_mode == "path" and self.topk > 1:
            self._refresh_path(bufs, step, two_pass)
        q = q if q.is_contiguous() else q.contiguous()
        common = dict(scale=float(layer.scaling), softcap=float(layer.logit_cap))
        if not two_pass:
            k1, v1 = paged_pools(self.runner, layer.layer_id, 1)
            o, _ = self.kernel(q, k1, v1, page_table=bufs.full_pt[:lanes],
                               seqused=bufs.full_used[step, :lanes],
                               cu_seqlens_q=bufs.cu_lane[:lanes + 1], max_seqlen_q=1,
                               causal=False, with_lse=False, **common)
            return o
        o_p, lse_p = self.prefix_pass(bufs, bs, layer.layer_id, q, common)
        if self.fused:
            from ...kernels.history_merge import history_merge

            lid = layer.layer_id
            return history_merge(q, self.runner.k_buffer[lid], self.runner.v_buffer[lid],
                                 bufs.hist_pt[:lanes, :step + 1], o_p, lse_p,
                                 common["scale"], common["softcap"], lse_base="e",
                                 chunks=bufs.chunks, topk=self.topk, inf_is_empty=True)
        k1, v1 = paged_pools(self.runner, layer.layer_id, 1)
        o_h, lse_h = self.kernel(q, k1, v1, page_table=bufs.hist_pt[:lanes],
                                 seqused=bufs.hist_used[step, :lanes],
                                 cu_seqlens_q=bufs.cu_lane[:lanes + 1], max_seqlen_q=1,
                                 causal=False, with_lse=True, **common)
        outs, lses = self._chunk_states(o_p, lse_p, bs, bufs.chunks)
        return merge_states(outs + [o_h], lses + [lse_h], q.dtype)

    def prefix_pass(self, bufs: _Buffers, bs: int, layer_id: int, q: torch.Tensor,
                    common: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix pass: out ``[B*C*K, H, D_v]`` (rows ``(b, c, k)``) and its LSE as a
        token-major view ``[B*C*K, H]`` of the library's head-major tensor (no copy)."""
        kp, vp = paged_pools(self.runner, layer_id, self.page_size)
        c, k = bufs.chunks, self.topk
        rows = bs * c
        if c > 1:
            qc = q.view(bs, 1, k, *q.shape[1:]).expand(bs, c, k, *q.shape[1:])
            q = qc.reshape(rows * k, *q.shape[1:])
        return self.kernel(q, kp, vp, page_table=bufs.prefix_pt[:bs].view(rows, -1),
                           seqused=bufs.chunk_used[:rows], cu_seqlens_q=bufs.cu_req[:rows + 1],
                           max_seqlen_q=k, causal=False, with_lse=True, **common)

    def _chunk_states(self, o: torch.Tensor, lse: torch.Tensor, bs: int,
                      c: int) -> tuple[list, list]:
        """Per-chunk ``[N, H, D_v]`` / ``[N, H]`` states for the torch merge."""
        if c == 1:
            return [o], [lse]
        k, lanes = self.topk, bs * self.topk
        o = o.view(bs, c, k, *o.shape[1:])
        lse = lse.reshape(bs, c, k, lse.shape[-1])
        return ([o[:, i].reshape(lanes, *o.shape[3:]) for i in range(c)],
                [lse[:, i].reshape(lanes, -1) for i in range(c)])

    def _refresh_path(self, bufs: _Buffers, step: int, two_pass: bool) -> None:
        """Rewrite step ``step``'s history columns from ``parents`` (device ops)."""
        batch, lanes = self.batch, self.num_lanes
        hist = path_history_slots(batch.out_cache_loc, batch.parents, step)
        hist = hist.reshape(lanes, step + 1).to(torch.int32)
        if two_pass:
            bufs.hist_pt[:lanes, :step + 1].copy_(hist)
        else:
            cols = bufs.lane_len[:lanes, None] + torch.arange(step + 1, device=hist.device)
            bufs.full_pt[:lanes].scatter_(1, cols, hist)

    # --- CUDA graphs -------------------------------------------------------------------------

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """One set of fixed buffers per route the captured sizes take (made at capture,
        reused by every replay), each for ``max_bs`` requests / ``max_bs * topk`` lanes."""
        self._graph_bufs = {}

    def _fills_graph_round(self) -> bool:
        return self._meta_kernel

    def _plan_graph(self, batch, *, capture: bool) -> None:
        route = self.route_for(batch.batch_size)  # the captured size's route
        bufs = self._graph_bufs.get(route)
        if bufs is None:
            bufs = self._graph_bufs[route] = self._new_buffers(self.cuda_graph_max_bs, route)
        self._tables(bufs, route, batch, self.graph_source if self._meta_kernel else None)

    # --- kept graph calls (``graph_calls``) --------------------------------------------------

    _graph_key_extra = table_launch_key

    def _kept_plan(self) -> tuple:
        return self._route

    def _resume_plan(self, route: tuple) -> None:
        self._route = route

    def _check_kept_call(self, batch, replay) -> None:
        """The graph batch's checks and, on a two-pass route, page-aligned prefixes."""
        super()._check_kept_call(batch, replay)
        if self._two_pass(replay.plan):
            check_page_aligned(self.runner, batch.req_pool_indices, batch.seq_lens, "prefixes")
