"""``dsa`` (DeepSeek V3.2 sparse attention; ``nsa`` is its deprecated alias) on Triton.

What it computes (exact sets in the ``torch_ref_sparse`` module doc): each query row picks,
with the lightning indexer (its own small heads: ``I[x] = sum_h w[h] relu(q_idx[h] .
k_idx[R_b[x]])``), the top ``index_topk`` (default 2048) of its candidate prefix positions,
then runs absorbed MLA (``q [.., H, R + rope]``, score ``q . [c | k_pe]``, value ``c``, output
``[.., H, R]``) over only those slots.

- Decode, lane ``(b, j)`` at step ``i``: candidates ``R_b[0 : L_b]``; the lane's draft history
  (``i + 1`` slots, ``lane`` or ``path`` mode) is attended in addition, always. Upstream's
  draft steps attend the selected prefix only (exotic-rows.md 0.1) and run ``topk == 1``;
  specattn attends the history too and serves any ``topk``.
- Extend, new token at position ``p``: candidates ``R_b[0 : p + 1]`` (itself included), as
  upstream's causal indexer; no separate history.

API (keyword arguments to ``forward``, so the base ``forward(step, layer, q, k, v)`` still
works)::

    forward(step, layer, q, k, None, *, index_q=None, index_weights=None, index_k=None)

- ``index_q [rows, nh, d]``, ``index_weights [rows, nh]`` (the FP8 scales of upstream folded
  in), ``index_k [rows, d]``: the new tokens' index keys, written to the index-key pool at
  the same slots as their KV.
- The index-key pool, one ``[num_slots, d]`` tensor per layer, is ``index_k_buffer=`` of the
  constructor, else ``runner.index_k_buffer``; ``make_index_k_buffer`` allocates one. Pass
  the same list to the decode and extend backends; the caller fills the prefix's keys.
- Without ``index_q``/``index_weights`` every candidate is attended (dense MLA): exact when
  no candidate list can exceed ``index_topk``, which the backend knows from the round's
  longest sequence (eager: one host read of ``max(seq_lens)`` per round; CUDA graphs: the
  static ``runner.max_context_len``). Beyond that, omitting them raises
  ``InvalidInputError``. When every list fits, the indexer is skipped even if its inputs are
  given (upstream does the same: the top-k of ``n <= index_topk`` is everything).

Kernels (``_kernels``): a Triton indexer (a request's rows share each index-key tile; the
scores are per row), ``torch.topk`` on the scores, then a split-K Triton sparse-MLA over the
per-row slot lists plus one history split, merged by LSE. Any page size (slots are read token
by token through ``req_to_token``; 64 and 1 are what upstream uses).

KV: bf16/fp16/fp32 latent pools (``kv_cache_dtype="auto"``), or V3.2's FP8 "with scale" layout
(``kv_cache_dtype="fp8_ds_mla"`` on the runner: ``DraftRunner.mla(..., kv_cache_dtype=
"fp8_ds_mla")`` allocates uint8 ``[slots, 656]`` pools for rank 512 + rope 64, ``write_kv``
quantizes, the kernel dequantizes; layout in ``backends/_fp8_kv``; ``kv_lora_rank`` a multiple
of 128). Its reference is "dequantize, then exact attention" (``torch_ref_sparse``). The
index keys stay in their own bf16/fp16/fp32 pool (upstream's 132-byte FP8 index-K cache is
not built).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ... import metadata, validation
from ...base import DraftDecodeBackend, DraftExtendBackend
from ...errors import InvalidInputError
from ...platforms import is_cpu, is_cuda, is_hip, triton_interpret

if TYPE_CHECKING:
    from ...data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner

__all__ = ["DSADecode", "DSAExtend", "make_index_k_buffer", "DEFAULT_INDEX_TOPK"]

log = logging.getLogger(__name__)

DEFAULT_INDEX_TOPK = 2048
# "auto": the pool's own dtype; "fp8_ds_mla": V3.2's 656-byte FP8 layout (backends/_fp8_kv).
_KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")
_TESTED_ON = ("H200 (sm90) GPU tests incl. CUDA-graph replay and the FP8 KV pools + CPU "
              "interpreter")
_NEG_INF = float("-inf")


def _k():
    from . import _kernels

    return _kernels


def make_index_k_buffer(runner: "DraftRunner", index_head_dim: int,
                        dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """Zeroed index-key pool: one ``[num_slots, index_head_dim]`` tensor per layer."""
    if not isinstance(index_head_dim, int) or index_head_dim < 1:
        raise InvalidInputError("index_head_dim", "an int >= 1", repr(index_head_dim))
    return [torch.zeros(runner.num_slots, index_head_dim, dtype=dtype or runner.dtype,
                        device=runner.device) for _ in range(runner.num_layers)]


def _check_pool(runner: "DraftRunner", pool: Optional[Sequence[torch.Tensor]]):
    if pool is None:
        return None
    pool = list(pool)
    if len(pool) != runner.num_layers:
        raise InvalidInputError("index_k_buffer", f"{runner.num_layers} tensors (one per "
                                "layer)", f"{len(pool)} tensors")
    for i, t in enumerate(pool):
        validation._tensor(f"index_k_buffer[{i}]", t, dtypes=validation.ACT_DTYPES, ndim=2,
                           device=runner.device)
        if t.shape[0] != runner.num_slots or t.shape[1] != pool[0].shape[1]:
            raise InvalidInputError(f"index_k_buffer[{i}]", f"shape [{runner.num_slots}, "
                                    f"{pool[0].shape[1]}]", f"shape {tuple(t.shape)}")
        validation._last_dim_contiguous(f"index_k_buffer[{i}]", t)
    return pool


def _check_topk(index_topk: int) -> int:
    if not isinstance(index_topk, int) or isinstance(index_topk, bool) or index_topk < 1:
        raise InvalidInputError("index_topk", "an int >= 1", repr(index_topk))
    return index_topk


class _Meta:
    """Fixed metadata buffers.

    row: ``[rows, 2]`` int32 (req row, candidate count); group: ``[groups, 4]`` int32 (req
    row, first row, rows, key length); loc: draft slots ``[bs, K, S]`` (decode) or
    ``[T]`` (extend) int64; scores: ``[rows, width]`` fp32 (indexer only); mid: flat fp32
    split partials."""

    def __init__(self, rows: int, groups: int, loc_shape: tuple, width: int, scores: bool,
                 heads: int, rank: int, device: torch.device) -> None:
        self.row = torch.zeros(max(1, rows), 2, dtype=torch.int32, device=device)
        self.group = torch.zeros(max(1, groups), 4, dtype=torch.int32, device=device)
        self.loc = torch.zeros(loc_shape, dtype=torch.int64, device=device)
        self.scores = (torch.empty(max(1, rows), width, dtype=torch.float32, device=device)
                       if scores else None)
        parts = _k().MAX_SPLITS + 1
        self.mid = (torch.empty(max(1, rows) * heads * parts * rank, dtype=torch.float32,
                                device=device),
                    torch.empty(max(1, rows) * heads * parts, dtype=torch.float32,
                                device=device))
        self.dense_sel: Optional[torch.Tensor] = None

    def fits(self, rows: int, groups: int, loc_shape: tuple, width: int, scores: bool) -> bool:
        return (self.row.shape[0] >= rows and self.group.shape[0] >= groups
                and tuple(self.loc.shape[1:]) == tuple(loc_shape[1:])
                and self.loc.shape[0] >= loc_shape[0]
                and (not scores or (self.scores is not None and self.scores.shape[1] >= width)))


def _flat_slots(req_to_token: torch.Tensor, rpi: torch.Tensor,
                pos: torch.Tensor) -> torch.Tensor:
    """``R[rpi[r], pos[r, c]]`` without copying whole rows. rpi: ``[rows]``; pos ``[rows, c]``."""
    flat = rpi.long()[:, None] * req_to_token.stride(0) + pos.clamp(0, req_to_token.shape[1] - 1)
    return req_to_token.reshape(-1)[flat]


class _DSAMixin:
    """What decode and extend share: pool, selection and the sparse-attention launch."""

    runner: "DraftRunner"

    def _setup(self, index_topk: int, index_k_buffer) -> None:
        if not self.runner.use_mla_backend:  # the registry refuses MHA first; be explicit
            raise InvalidInputError("runner", "an MLA runner for dsa", "an MHA runner")
        self.index_topk = _check_topk(index_topk)
        pool = index_k_buffer if index_k_buffer is not None else getattr(
            self.runner, "index_k_buffer", None)
        self.index_k_buffer = _check_pool(self.runner, pool)
        self._meta: Optional[_Meta] = None
        self._graph_meta: Optional[_Meta] = None
        self._active: Optional[_Meta] = None
        self._width = 0

    def _meta_for(self, rows: int, groups: int, loc_shape: tuple, width: int,
                  graph: bool) -> _Meta:
        scores = width > self.index_topk and self.index_k_buffer is not None
        cached = self._graph_meta if graph else self._meta
        if cached is not None and cached.fits(rows, groups, loc_shape, width, scores):
            return cached
        if graph:
            raise InvalidInputError("batch", "a batch within init_cuda_graph_state's sizes",
                                    f"{rows} rows, {groups} requests")
        self._meta = _Meta(rows, groups, loc_shape, width, scores, self.runner.num_heads,
                           self.runner.kv_lora_rank, self.runner.device)
        return self._meta

    def _dense_selection(self, meta: _Meta, rows: int, width: int) -> None:
        """Every candidate: ``sel[r, x] = R[rpi, x]`` for ``x < count[r]``, else -1."""
        x = torch.arange(width, device=self.runner.device).expand(rows, width)
        slots = _flat_slots(self.runner.req_to_token, meta.row[:rows, 0], x)
        ok = x < meta.row[:rows, 1:2].long()
        sel = torch.where(ok, slots, -1).to(torch.int32)
        # Refill in place: a captured graph holds the buffer's address.
        if meta.dense_sel is None or meta.dense_sel.shape != sel.shape:
            meta.dense_sel = sel
        else:
            meta.dense_sel.copy_(sel)

    def _check_index_inputs(self, rows: int, index_q, index_weights, index_k) -> None:
        pool = self.index_k_buffer
        given = [n for n, t in (("index_q", index_q), ("index_weights", index_weights),
                                ("index_k", index_k)) if t is not None]
        if given and pool is None:
            raise InvalidInputError(given[0], "None: this backend has no index-key pool "
                                    "(pass index_k_buffer= or set runner.index_k_buffer)",
                                    "a tensor")
        if (index_q is None) != (index_weights is None):
            raise InvalidInputError("index_weights" if index_q is not None else "index_q",
                                    "index_q and index_weights together", "only one of them")
        dev = self.runner.device
        if pool is not None:
            d, dt = pool[0].shape[1], pool[0].dtype
        if index_q is not None:
            validation._tensor("index_q", index_q, dtypes=(dt,), ndim=3, device=dev)
            nh = index_q.shape[1]
            validation._shape("index_q", index_q, (rows, nh, d))
            validation._last_dim_contiguous("index_q", index_q)
            validation._tensor("index_weights", index_weights, dtypes=validation.ACT_DTYPES,
                               ndim=2, device=dev)
            validation._shape("index_weights", index_weights, (rows, nh))
            validation._last_dim_contiguous("index_weights", index_weights)
        if index_k is not None:
            validation._tensor("index_k", index_k, dtypes=(dt,), ndim=2, device=dev)
            validation._shape("index_k", index_k, (rows, d))

    def _selection(self, layer_id: int, rows: int, index_q, index_weights) -> torch.Tensor:
        """``[rows, W]`` int32 slot lists (``-1`` = none) for this layer and step."""
        meta, width = self._active, self._width
        if width <= self.index_topk:
            return meta.dense_sel
        if index_q is None:
            raise InvalidInputError(
                "index_q", f"index inputs (index_q, index_weights): a candidate list may "
                f"exceed index_topk={self.index_topk} (longest {width} tokens)", "None")
        scores = meta.scores[:rows, :width]
        _k().index_scores(index_q, index_weights, self.index_k_buffer[layer_id],
                          self.runner.req_to_token, meta.row, meta.group[:self._groups],
                          scores)
        vals, pos = torch.topk(scores, self.index_topk, dim=1)
        slots = _flat_slots(self.runner.req_to_token, meta.row[:rows, 0], pos)
        return torch.where(vals > _NEG_INF, slots, -1).to(torch.int32)

    def selected_slots(self, layer: "AttentionLayer", index_q: Optional[torch.Tensor] = None,
                       index_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The prefix slot lists ``[rows, W]`` int32 (``-1`` = none, order not semantic) that a
        ``forward`` with these index inputs selects, for tests and debugging. Reads the
        index-key pool as it is now (``forward`` writes the new tokens' keys first)."""
        if self._active is None:
            raise RuntimeError("dsa: selected_slots() called before init_forward_metadata")
        rows = self._rows()
        self._check_index_inputs(rows, index_q, index_weights, None)
        return self._selection(layer.layer_id, rows, index_q, index_weights)

    def _attend(self, layer, q, sel, hist, hl) -> torch.Tensor:
        kernels = _k()
        splits = kernels.choose_num_splits(sel.shape[1], q.device)
        return kernels.sparse_mla(q, self.runner.kv_buffer[layer.layer_id], layer, sel, hist,
                                  hl, self.runner.kv_lora_rank, splits, self._active.mid,
                                  layout=self.runner.kv_layout)


class _DSADecode(_DSAMixin, DraftDecodeBackend):
    """DSA draft decode (see the module doc). ``index_topk`` (default 2048),
    ``index_k_buffer`` (per-layer index-key pools)."""

    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    kv_cache_dtypes = _KV_CACHE_DTYPES
    supports_cuda_graph = True
    tested_on = _TESTED_ON
    auto_eligible = False
    # Upstream's page sizes (64 CUDA, 1 ROCm); the kernels read slots token by token.
    page_sizes = frozenset({1, 64})

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane", index_topk: int = DEFAULT_INDEX_TOPK,
                 index_k_buffer: Optional[Sequence[torch.Tensor]] = None) -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        self._setup(index_topk, index_k_buffer)
        self._batch: Optional["DraftBatch"] = None
        self._bs = self._groups = 0

    def _rows(self) -> int:
        return self._bs * self.topk

    def init_forward_metadata(self, batch: "DraftBatch") -> None:
        """Row tables and slot lists for all steps; one host read of ``max(seq_lens)``."""
        validation.check_decode_batch(self.runner, self.topk, self.num_steps, self.tree_mode,
                                      batch)
        width = max(1, int(batch.seq_lens.max()))
        self._fill(batch, width, graph=False)

    def _fill(self, batch: "DraftBatch", width: int, graph: bool) -> None:
        bs, topk = batch.batch_size, self.topk
        rows = bs * topk
        meta = self._meta_for(rows, bs, (bs, topk, self.num_steps), width, graph)
        rpi, seq = batch.req_pool_indices, batch.seq_lens
        meta.row[:rows, 0].copy_(rpi.repeat_interleave(topk))
        meta.row[:rows, 1].copy_(seq.repeat_interleave(topk))
        meta.group[:bs, 0].copy_(rpi)
        meta.group[:bs, 1].copy_(torch.arange(bs, device=rpi.device) * topk)
        meta.group[:bs, 2] = topk
        meta.group[:bs, 3].copy_(seq)
        meta.loc[:bs].copy_(batch.out_cache_loc)
        self._active, self._width, self._batch, self._bs, self._groups = (
            meta, width, batch, bs, bs)
        if width <= self.index_topk:
            self._dense_selection(meta, rows, width)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed buffers for ``max_bs * topk`` lanes; candidate lists up to
        ``runner.max_context_len`` (the indexer's scores buffer when that exceeds
        ``index_topk``)."""
        self.cuda_graph_max_bs = max_bs
        width = self.runner.max_context_len
        self._graph_meta = _Meta(max_bs * self.topk, max_bs, (max_bs, self.topk,
                                 self.num_steps), width, width > self.index_topk
                                 and self.index_k_buffer is not None, self.runner.num_heads,
                                 self.runner.kv_lora_rank, self.runner.device)

    def init_forward_metadata_capture_cuda_graph(self, batch: "DraftBatch") -> None:
        self._graph_fill(batch, batch.batch_size)

    def init_forward_metadata_replay_cuda_graph(self, batch: "DraftBatch", bs: int) -> None:
        """Refill the fixed buffers; ``batch`` holds ``bs`` (padded) requests."""
        self._graph_fill(batch, bs)

    def _graph_fill(self, batch: "DraftBatch", bs: int) -> None:
        self._check_graph_batch(batch, bs, ready=self._graph_meta is not None)
        self._fill(batch, self.runner.max_context_len, graph=True)

    def forward(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], *, index_q: Optional[torch.Tensor] = None,
                index_weights: Optional[torch.Tensor] = None,
                index_k: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: ``[B*K, H, R + rope]``, k: ``[B*K, R + rope]`` → ``[B*K, H, R]``."""
        self._require_metadata(self._batch)
        rows = self._bs * self.topk
        validation.check_decode_forward(self.runner, rows, self.num_steps, step, layer, q, k, v)
        if self.tree_mode == "path":
            validation.check_parents_step(self._batch, step, self.topk)
        self._check_index_inputs(rows, index_q, index_weights, index_k)
        loc = self._active.loc[:self._bs]
        new = loc[:, :, step].reshape(-1)
        self.runner.write_kv(layer.layer_id, new, k, None)
        if index_k is not None:
            self.index_k_buffer[layer.layer_id][new] = index_k
        sel = self._selection(layer.layer_id, rows, index_q, index_weights)
        hist = metadata.history_slots(loc, self._batch.parents, step, self.tree_mode)
        hist = hist.reshape(rows, step + 1).to(torch.int32)
        return self._attend(layer, q, sel, hist, step + 1)


class _DSAExtend(_DSAMixin, DraftExtendBackend):
    """DSA draft extend (see the module doc)."""

    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    kv_cache_dtypes = _KV_CACHE_DTYPES
    supports_cuda_graph = True
    tested_on = _TESTED_ON
    auto_eligible = False
    # Upstream's page sizes (64 CUDA, 1 ROCm); the kernels read slots token by token.
    page_sizes = frozenset({1, 64})

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1,
                 index_topk: int = DEFAULT_INDEX_TOPK,
                 index_k_buffer: Optional[Sequence[torch.Tensor]] = None) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self._setup(index_topk, index_k_buffer)
        self._batch = None
        self._n = self._groups = 0

    def _rows(self) -> int:
        return self._n

    def init_forward_metadata(self, batch: "DraftExtendBatch") -> None:
        """One host read of ``max(seq_lens)`` (the candidate-list bound)."""
        validation.check_extend_batch(self.runner, batch)
        self._fill(batch, max(1, int(batch.seq_lens.max())), graph=False)

    def _fill(self, batch: "DraftExtendBatch", width: int, graph: bool) -> None:
        bs, n = batch.batch_size, int(batch.out_cache_loc.shape[0])
        meta = self._meta_for(n, bs, (n,), width, graph)
        ext = batch.extend_lens.long()
        start = torch.cumsum(ext, 0) - ext
        req = torch.repeat_interleave(torch.arange(bs, device=ext.device), ext, output_size=n)
        pos = torch.arange(n, device=ext.device) - start[req]
        seq = batch.seq_lens.long()
        meta.row[:n, 0].copy_(batch.req_pool_indices.long()[req])
        meta.row[:n, 1].copy_(seq[req] - ext[req] + pos + 1)
        meta.group[:bs, 0].copy_(batch.req_pool_indices)
        meta.group[:bs, 1].copy_(start)
        meta.group[:bs, 2].copy_(ext)
        meta.group[:bs, 3].copy_(seq)
        meta.loc[:n].copy_(batch.out_cache_loc)
        self._active, self._width, self._batch, self._n, self._groups = meta, width, batch, n, bs
        if width <= self.index_topk:
            self._dense_selection(meta, n, width)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.cuda_graph_max_bs = max_bs
        width = self.runner.max_context_len
        self._graph_meta = _Meta(max_num_tokens, max_bs, (max_num_tokens,), width,
                                 width > self.index_topk and self.index_k_buffer is not None,
                                 self.runner.num_heads, self.runner.kv_lora_rank,
                                 self.runner.device)

    def init_forward_metadata_capture_cuda_graph(self, batch: "DraftExtendBatch") -> None:
        self._graph_fill(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: "DraftExtendBatch",
                                                bs: int) -> None:
        self._graph_fill(batch)

    def _graph_fill(self, batch: "DraftExtendBatch") -> None:
        self._check_graph_batch(batch, ready=self._graph_meta is not None)
        self._fill(batch, self.runner.max_context_len, graph=True)

    def forward(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], *, index_q: Optional[torch.Tensor] = None,
                index_weights: Optional[torch.Tensor] = None,
                index_k: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: ``[T, H, R + rope]``, k: ``[T, R + rope]`` → ``[T, H, R]``."""
        self._require_metadata(self._batch)
        n = self._n
        validation.check_extend_forward(self.runner, n, layer, q, k, v)
        self._check_index_inputs(n, index_q, index_weights, index_k)
        new = self._active.loc[:n]
        self.runner.write_kv(layer.layer_id, new, k, None)
        if index_k is not None:
            self.index_k_buffer[layer.layer_id][new] = index_k
        sel = self._selection(layer.layer_id, n, index_q, index_weights)
        return self._attend(layer, q, sel, self._active.row, 0)


_DECL = dict(deprecated_aliases=("nsa",), platforms=is_cuda | is_hip | (is_cpu & triton_interpret),
             models=("mla",), requires=(("triton", "triton>=3.2"),),
             kernel_library="triton (specattn)")


class DSADecode(_DSADecode, name="dsa", **_DECL):
    """DeepSeek V3.2 sparse attention draft decode: lightning indexer top-k, then sparse MLA
    over the selected prefix plus the lane's history (Triton)."""


class DSAExtend(_DSAExtend, name="dsa", **_DECL):
    """DeepSeek V3.2 sparse attention draft extend: per-token indexer top-k, then sparse MLA
    (Triton)."""
