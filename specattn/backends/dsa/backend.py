"""The ``dsa`` backend classes: the glue around the kernels (``_kernels``) and the
registered flavours; the package doc says what they compute."""


from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ... import validation
from ...base import DraftDecodeBackend, DraftExtendBackend
from ...errors import InvalidInputError
from ...metadata import history_slots, in_pool
from ...platforms import is_cpu, is_cuda, is_hip, triton_interpret

if TYPE_CHECKING:
    from ...data import DraftBatch, DraftExtendBatch, DraftRunner
    from ...layer import AttentionLayer

__all__ = ["DSADecode", "DSAExtend", "make_index_k_buffer", "DEFAULT_INDEX_TOPK"]

log = logging.getLogger(__name__)

DEFAULT_INDEX_TOPK = 2048
# "auto": the pool's own dtype; "fp8_ds_mla": V3.2's 656-byte FP8 layout (specattn.kv_layouts).
_KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")
_TESTED_ON = ("H200 (sm90) GPU tests incl. CUDA-graph replay and the FP8 KV pools + CPU "
              "interpreter")
_NEG_INF = float("-inf")


def _k():
    from . import _kernels  # Triton is imported on first use

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
    width = None  # every layer's index keys as wide as layer 0's
    for i, t in enumerate(pool):
        t = validation.check_tensor(f"index_k_buffer[{i}]", t, dtypes=validation.ACT_DTYPES,
                                    shape=(runner.num_slots, width), device=runner.device)
        width = t.shape[1]
    return pool


def _check_topk(index_topk: int) -> int:
    if not isinstance(index_topk, int) or isinstance(index_topk, bool) or index_topk < 1:
        raise InvalidInputError("index_topk", "an int >= 1", repr(index_topk))
    return index_topk


class _Meta:
    """Metadata buffers (fixed in graph rounds).

    row: ``[rows, 2]`` int32 (req row, candidate count); group: ``[groups, 4]`` int32 (req
    row, first row, rows, key length); scores: ``[rows, width]`` fp32 (indexer only); mid:
    flat fp32 split partials."""

    def __init__(self, rows: int, groups: int, width: int, scores: bool, heads: int,
                 rank: int, device: torch.device) -> None:
        self.row = torch.zeros(max(1, rows), 2, dtype=torch.int32, device=device)
        self.group = torch.zeros(max(1, groups), 4, dtype=torch.int32, device=device)
        self.scores = (torch.empty(max(1, rows), width, dtype=torch.float32, device=device)
                       if scores else None)
        parts = _k().MAX_SPLITS + 1
        self.mid = (torch.empty(max(1, rows) * heads * parts * rank, dtype=torch.float32,
                                device=device),
                    torch.empty(max(1, rows) * heads * parts, dtype=torch.float32,
                                device=device))
        self.dense_sel: Optional[torch.Tensor] = None

    def fits(self, rows: int, groups: int, width: int, scores: bool) -> bool:
        return (self.row.shape[0] >= rows and self.group.shape[0] >= groups
                and (not scores or (self.scores is not None and self.scores.shape[1] >= width)))


def _flat_slots(req_to_token: torch.Tensor, rpi: torch.Tensor, pos: torch.Tensor,
                num_slots: int) -> torch.Tensor:
    """``R[rpi[r], pos[r, c]]`` without copying whole rows (any strides: an engine may pass a
    slice of a wider table), clamped into the pool. rpi: ``[rows]``; pos ``[rows, c]``."""
    return in_pool(req_to_token[rpi.long()[:, None], pos.clamp(0, req_to_token.shape[1] - 1)],
                   num_slots)


class _DSAMixin:
    """What decode and extend share: the index-key pool, the candidate rows, selection and
    the sparse-attention launch. Subclasses fill ``_meta.row`` / ``_meta.group`` for their
    rows (``_rows()``) and groups (``_groups``)."""

    runner: "DraftRunner"
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    kv_cache_dtypes = _KV_CACHE_DTYPES
    supports_cuda_graph = True
    tested_on = _TESTED_ON
    auto_eligible = False
    # Upstream's page sizes (64 CUDA, 1 ROCm); the kernels read slots token by token.
    page_sizes = frozenset({1, 64})

    def _open(self, index_topk: int, index_k_buffer) -> None:
        if not self.runner.use_mla_backend:  # the registry refuses MHA first; be explicit
            raise InvalidInputError("runner", "an MLA runner for dsa", "an MHA runner")
        self.index_topk = _check_topk(index_topk)
        pool = index_k_buffer if index_k_buffer is not None else getattr(
            self.runner, "index_k_buffer", None)
        self.index_k_buffer = _check_pool(self.runner, pool)
        self._meta: Optional[_Meta] = None
        self._graph_meta: Optional[_Meta] = None
        self._active: Optional[_Meta] = None
        self._width = self._groups = 0

    def _new_meta(self, rows: int, groups: int, width: int) -> _Meta:
        return _Meta(rows, groups, width, width > self.index_topk and
                     self.index_k_buffer is not None, self.runner.num_heads,
                     self.runner.kv_lora_rank, self.runner.device)

    def _meta_for(self, rows: int, groups: int, width: int, graph: bool) -> _Meta:
        scores = width > self.index_topk and self.index_k_buffer is not None
        cached = self._graph_meta if graph else self._meta
        if cached is not None and cached.fits(rows, groups, width, scores):
            return cached
        if graph:
            raise InvalidInputError("batch", "a batch within init_cuda_graph_state's sizes",
                                    f"{rows} rows, {groups} requests")
        self._meta = self._new_meta(rows, groups, width)
        return self._meta

    def _plan(self, batch) -> None:
        """One host read of ``max(seq_lens)`` (the candidate-list bound)."""
        self._fill(batch, max(1, int(batch.seq_lens.max())), graph=False)

    def _plan_graph(self, batch, *, capture: bool) -> None:
        """Candidate lists up to the static ``runner.max_context_len``."""
        self._fill(batch, self.runner.max_context_len, graph=True)

    def _activate(self, meta: _Meta, width: int, groups: int) -> None:
        self._active, self._width, self._groups = meta, width, groups
        if width <= self.index_topk:
            self._dense_selection(meta, self._rows(), width)

    def _dense_selection(self, meta: _Meta, rows: int, width: int) -> None:
        """Every candidate: ``sel[r, x] = R[rpi, x]`` for ``x < count[r]``, else -1."""
        x = torch.arange(width, device=self.runner.device).expand(rows, width)
        slots = _flat_slots(self.runner.req_to_token, meta.row[:rows, 0], x,
                            self.runner.num_slots)
        ok = x < meta.row[:rows, 1:2].long()
        sel = torch.where(ok, slots, -1).to(torch.int32)
        # Refill in place: a captured graph holds the buffer's address.
        if meta.dense_sel is None or meta.dense_sel.shape != sel.shape:
            meta.dense_sel = sel
        else:
            meta.dense_sel.copy_(sel)

    def _forward_options(self, layer: "AttentionLayer", *,
                         index_q: Optional[torch.Tensor] = None,
                         index_weights: Optional[torch.Tensor] = None,
                         index_k: Optional[torch.Tensor] = None) -> dict:
        """The index inputs of a call, checked before anything is written."""
        rows, pool = self._rows(), self.index_k_buffer
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
            nh = index_q.shape[1] if isinstance(index_q, torch.Tensor) and \
                index_q.dim() == 3 else None
            validation.check_tensor("index_q", index_q, dtypes=(dt,), shape=(rows, nh, d),
                                    device=dev)
            validation.check_tensor("index_weights", index_weights,
                                    dtypes=validation.ACT_DTYPES, shape=(rows, nh),
                                    device=dev)
        if index_k is not None:
            validation.check_tensor("index_k", index_k, dtypes=(dt,), shape=(rows, d),
                                    device=dev, unit_last_stride=False)
        return dict(index_q=index_q, index_weights=index_weights, index_k=index_k)

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
        slots = _flat_slots(self.runner.req_to_token, meta.row[:rows, 0], pos,
                            self.runner.num_slots)
        return torch.where(vals > _NEG_INF, slots, -1).to(torch.int32)

    def selected_slots(self, layer: "AttentionLayer", index_q: Optional[torch.Tensor] = None,
                       index_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The prefix slot lists ``[rows, W]`` int32 (``-1`` = none, order not semantic) that a
        ``forward`` with these index inputs selects, for tests and debugging. Reads the
        index-key pool as it is now (``forward`` writes the new tokens' keys first)."""
        self._require_round("selected_slots()")
        opts = self._forward_options(layer, index_q=index_q, index_weights=index_weights)
        return self._selection(layer.layer_id, self._rows(), opts["index_q"],
                               opts["index_weights"])

    def _sparse_attend(self, layer, q, new_slots, index_q, index_weights, index_k, hist,
                       hl) -> torch.Tensor:
        """Store the new index keys at ``new_slots``, select, then sparse MLA over the
        selection plus ``hist [rows, hl]``."""
        if index_k is not None:
            self.index_k_buffer[layer.layer_id][new_slots] = index_k
        sel = self._selection(layer.layer_id, self._rows(), index_q, index_weights)
        kernels = _k()
        splits = kernels.choose_num_splits(sel.shape[1], q.device)
        return kernels.sparse_mla(q, self.runner.kv_buffer[layer.layer_id], layer, sel, hist,
                                  hl, self.runner.kv_lora_rank, splits, self._active.mid,
                                  layout=self.runner.kv_layout)


class _DSADecode(_DSAMixin, DraftDecodeBackend):
    """DSA draft decode (see the module doc). ``index_topk`` (default 2048),
    ``index_k_buffer`` (per-layer index-key pools)."""

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane", index_topk: int = DEFAULT_INDEX_TOPK,
                 index_k_buffer: Optional[Sequence[torch.Tensor]] = None) -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        self._open(index_topk, index_k_buffer)

    def _rows(self) -> int:
        return self.num_lanes

    def _fill(self, batch: "DraftBatch", width: int, graph: bool) -> None:
        bs, topk, rows = batch.batch_size, self.topk, self.num_lanes
        meta = self._meta_for(rows, bs, width, graph)
        rpi, seq = batch.req_pool_indices, batch.seq_lens
        meta.row[:rows, 0].copy_(rpi.repeat_interleave(topk))
        meta.row[:rows, 1].copy_(seq.repeat_interleave(topk))
        meta.group[:bs, 0].copy_(rpi)
        meta.group[:bs, 1].copy_(torch.arange(bs, device=rpi.device) * topk)
        meta.group[:bs, 2] = topk
        meta.group[:bs, 3].copy_(seq)
        self._activate(meta, width, bs)

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed buffers for ``max_bs * topk`` lanes; candidate lists up to
        ``runner.max_context_len`` (the indexer's scores buffer when that exceeds
        ``index_topk``)."""
        self._graph_meta = self._new_meta(max_bs * self.topk, max_bs,
                                          self.runner.max_context_len)

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], **index) -> torch.Tensor:
        """q: ``[B*K, H, R + rope]``, k: ``[B*K, R + rope]`` → ``[B*K, H, R]``."""
        loc = self.batch.out_cache_loc
        hist = history_slots(loc, self.batch.parents, step, self.tree_mode)
        hist = hist.reshape(self.num_lanes, step + 1).to(torch.int32)
        return self._sparse_attend(layer, q, loc[:, :, step].reshape(-1), **index, hist=hist,
                                   hl=step + 1)


class _DSAExtend(_DSAMixin, DraftExtendBackend):
    """DSA draft extend (see the module doc)."""

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1,
                 index_topk: int = DEFAULT_INDEX_TOPK,
                 index_k_buffer: Optional[Sequence[torch.Tensor]] = None) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self._open(index_topk, index_k_buffer)

    def _rows(self) -> int:
        return self.num_tokens

    def _fill(self, batch: "DraftExtendBatch", width: int, graph: bool) -> None:
        bs, n = batch.batch_size, self.num_tokens
        meta = self._meta_for(n, bs, width, graph)
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
        self._activate(meta, width, bs)

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph_meta = self._new_meta(max_num_tokens, max_bs, self.runner.max_context_len)

    def _attend(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], **index) -> torch.Tensor:
        """q: ``[T, H, R + rope]``, k: ``[T, R + rope]`` → ``[T, H, R]``."""
        return self._sparse_attend(layer, q, self.batch.out_cache_loc, **index,
                                   hist=self._active.row, hl=0)


_DECL = dict(deprecated_aliases=("nsa",), platforms=is_cuda | is_hip | (is_cpu & triton_interpret),
             models=("mla",), requires=(("triton", "triton>=3.2"),),
             kernel_library="triton (specattn)")


class DSADecode(_DSADecode, name="dsa", **_DECL):
    """DeepSeek V3.2 sparse attention draft decode: lightning indexer top-k, then sparse MLA
    over the selected prefix plus the lane's history (Triton)."""


class DSAExtend(_DSAExtend, name="dsa", **_DECL):
    """DeepSeek V3.2 sparse attention draft extend: per-token indexer top-k, then sparse MLA
    (Triton)."""
