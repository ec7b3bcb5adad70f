"""The draft-extend glue shared by every FlashAttention flavour.

One causal varlen pass over the page table: ``cu_seqlens_q = cumsum(E)``,
``seqused_k = L'_b`` (new tokens included, their KV written first), page ids of
``R_b[0 : L'_b]``. Causal attention is bottom-right aligned in both FA3 and FA4, so query
``t`` of request ``b`` sees ``R_b[0 : L'_b - E_b + t + 1]``.

Metadata on the device: one launch where Triton runs (``_metadata.extend_tables``), else
torch ops writing the same values (``_fill``). Eager ``init_forward_metadata`` reads
``max(extend_lens)`` once (``max_seqlen_q``: FA3 sizes its grid with it), as upstream does.
CUDA graphs: fixed buffers for ``max_bs`` requests (the base class keeps the
``max_num_tokens`` new-token slots, which the launch fills from the caller's batch); capture
and replay use the bound ``T - B + 1`` (no host read), so a graph serves any split of ``T``
tokens over ``B`` requests. As in decode (``_decode``'s module doc), what a graph call of a
given signature of the caller's index tensors repeats is kept by its first, checked call,
and a later one launches the kept compiled kernel and checks only what reads values, where
values are read (CPU tensors).
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import validation as _validation
from ...base import DraftExtendBackend
from ...data import DraftExtendBatch
from ...kernels.kernel_launch import signature
from ...metadata import prefix_page_table
from ...platforms import current_platform
from ...util import ceil_div, triton_runs
from ._library import resolve_kernel
from ._tables import check_page_aligned, paged_pools


class _Buffers:
    """seq ``[bs]`` int32 ``L'``; cu ``[bs + 1]`` int32; pt ``[bs, ceil(ctx / P)]`` int32 page
    ids."""

    def __init__(self, bs: int, pages: int, device: torch.device) -> None:
        self.bs = bs
        self.seq = torch.zeros(bs, dtype=torch.int32, device=device)
        self.cu = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        self.pt = torch.zeros(bs, pages, dtype=torch.int32, device=device)


class FlashAttnExtendGlue(DraftExtendBackend):
    """Common body of the registered fa3 / fa4 extend classes (not registered)."""

    known_limits = {"extend/*/isolation/*": (
        "FlashAttention's causal varlen kernel multiplies the masked (zero) probabilities of a "
        "tile by every value in it: a non-finite key/value of a later new token reaches the "
        "earlier tokens of its request (0 * NaN; seen on the H200 with FA4 4.0.0b36, also "
        "through fa3's sm90 path); the vendor kernel would have to change")}

    library = "fa4"

    def __init__(self, runner, *, topk: int = 1, num_steps: int = 1) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self.kernel = resolve_kernel(self.library, current_platform(), type(self).name)
        self._pages = ceil_div(runner.max_context_len, self.page_size)
        self._bufs: Optional[_Buffers] = None
        self._graph_bufs: Optional[_Buffers] = None
        self._active: Optional[_Buffers] = None
        self._max_q = 0
        # Where Triton runs, the tables are one launch (``_metadata``); else torch ops.
        self._meta_kernel = triton_runs(runner.device)
        self._launch = None  # the last table launch (kernel_launch.KernelLaunch)
        self._replays: dict = {}  # graph-call signature -> _Replay

    def _check_batch(self, batch, debug: Optional[bool]) -> None:
        check_page_aligned(self.runner, batch.req_pool_indices, batch.seq_lens, "sequences")

    def _plan(self, batch) -> None:
        b = self._bufs
        if b is None or b.bs < batch.batch_size:
            b = self._bufs = _Buffers(batch.batch_size, self._pages, self.runner.device)
        self._tables(b, batch, int(batch.extend_lens.max()))  # one host read, as upstream

    def _tables(self, bufs: _Buffers, batch, max_q: int, source=None) -> None:
        """The batch's tables into ``bufs``: one launch where Triton runs, else ``_fill``.
        ``source`` (graph rounds, with ``_fills_graph_round``): the caller's batch, whose
        new tokens' slots the launch also copies into ``batch.out_cache_loc`` (the fixed
        buffer's view)."""
        if self._meta_kernel:
            from ._metadata import extend_tables

            src = batch if source is None else source
            self._launch = extend_tables(
                src.req_pool_indices, src.seq_lens, src.extend_lens, src.out_cache_loc,
                self.runner, bufs, self.page_size,
                None if source is None else batch.out_cache_loc)
        else:
            self._fill(bufs, batch)
        self._active, self._max_q = bufs, max_q

    def _fill(self, bufs: _Buffers, batch) -> None:
        """The tables in torch ops (where Triton does not run; ``_metadata.extend_tables``
        writes the same values)."""
        bs = batch.batch_size
        bufs.seq[:bs].copy_(batch.seq_lens)
        bufs.cu[0] = 0
        bufs.cu[1:bs + 1].copy_(torch.cumsum(batch.extend_lens, 0))
        bufs.pt[:bs].copy_(prefix_page_table(self.runner.req_to_token, batch.req_pool_indices,
                                             batch.seq_lens, self.page_size,
                                             max_pages=self._pages,
                                             num_slots=self.runner.num_slots))

    def _attend(self, layer, q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        bufs, bs = self._active, self.batch.batch_size
        q = q if q.is_contiguous() else q.contiguous()
        kp, vp = paged_pools(self.runner, layer.layer_id, self.page_size)
        o, _ = self.kernel(q, kp, vp, page_table=bufs.pt[:bs], seqused=bufs.seq[:bs],
                           cu_seqlens_q=bufs.cu[:bs + 1], max_seqlen_q=self._max_q,
                           causal=True, scale=float(layer.scaling),
                           softcap=float(layer.logit_cap), with_lse=False)
        return o

    # --- CUDA graphs -------------------------------------------------------------------------

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph_bufs = _Buffers(max_bs, self._pages, self.runner.device)
        self._replays.clear()

    def _fills_graph_round(self) -> bool:
        return self._meta_kernel

    def _plan_graph(self, batch, *, capture: bool) -> None:
        # Every E_b >= 1, so max(E) <= T - B + 1: a bound that needs no host read.
        self._tables(self._graph_bufs, batch, self.num_tokens - batch.batch_size + 1,
                     self.graph_source if self._meta_kernel else None)

    # --- CUDA-graph calls: kept per signature (see the module doc) -------------------------

    def _replay_key(self, batch) -> Optional[tuple]:
        """The signature of a graph call: the runner's ``req_to_token`` (the kept launch
        reads it) and the caller's four index tensors; ``None`` without a table launch."""
        if not self._meta_kernel:
            return None
        try:
            r2t = self.runner.req_to_token
            return (id(self.runner), r2t.data_ptr(), signature(r2t),
                    signature(batch.req_pool_indices), signature(batch.seq_lens),
                    signature(batch.extend_lens), signature(batch.out_cache_loc))
        except (AttributeError, TypeError):
            return None

    def _keep_graph_call(self, key: Optional[tuple]) -> None:
        if key is None:
            return
        if len(self._replays) >= _MAX_REPLAYS:
            self._replays.clear()
        self._replays[key] = _Replay(self._launch, self.batch.out_cache_loc, self.num_tokens,
                                     self._max_q, self._active)

    def init_forward_metadata_capture_cuda_graph(self, batch) -> None:
        """As the base class; keeps the call for the replays."""
        super().init_forward_metadata_capture_cuda_graph(batch)
        self._keep_graph_call(self._replay_key(batch))

    def init_forward_metadata_replay_cuda_graph(self, batch, bs: int) -> None:
        """As the base class (one table launch where Triton runs). A call whose signature a
        checked call had (``_replay_key``) launches the kept compiled kernel on the new
        tensors and checks only what reads values, where values are read (CPU tensors)."""
        key = self._replay_key(batch)
        replay = self._replays.get(key) if key is not None else None
        if replay is None:
            super().init_forward_metadata_replay_cuda_graph(batch, bs)
            self._keep_graph_call(key)
            return
        rpi, seq, ext, loc = (batch.req_pool_indices, batch.seq_lens, batch.extend_lens,
                              batch.out_cache_loc)
        if _validation._scan_values(rpi, False):  # CPU tensors (no debug pass in a graph call)
            self._check_graph_batch(batch)
        replay.launch(rpi, seq, ext, loc)
        self._launch, self.graph_source = replay.launch, batch
        self.batch = DraftExtendBatch(rpi, seq, ext, replay.fixed)
        self.num_tokens = replay.rows
        self._active, self._max_q = replay.bufs, replay.max_q


_MAX_REPLAYS = 64  # signatures kept per backend


class _Replay:
    """What a graph call repeats for one signature: the table launch (run on the caller's
    new tensors), the fixed ``out_cache_loc`` view, its tokens, ``max_seqlen_q`` and the
    buffers."""

    __slots__ = ("launch", "fixed", "rows", "max_q", "bufs")

    def __init__(self, launch, fixed, rows: int, max_q: int, bufs: _Buffers) -> None:
        self.launch, self.fixed, self.rows, self.max_q, self.bufs = \
            launch, fixed, rows, max_q, bufs
