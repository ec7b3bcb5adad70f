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
tokens over ``B`` requests. As in decode, a replay's call of a signature seen before launches
the kept compiled kernel (``specattn.graph_calls``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...graph_calls import KeptExtendCalls
from ...metadata import prefix_page_table
from ...platforms import current_platform
from ...util import ceil_div, triton_runs
from ._library import resolve_kernel
from ._tables import check_page_aligned, paged_pools, table_launch_key


class _Buffers:
    """seq ``[bs]`` int32 ``L'``; cu ``[bs + 1]`` int32; pt ``[bs, ceil(ctx / P)]`` int32 page
    ids."""

    def __init__(self, bs: int, pages: int, device: torch.device) -> None:
        self.bs = bs
        self.seq = torch.zeros(bs, dtype=torch.int32, device=device)
        self.cu = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        self.pt = torch.zeros(bs, pages, dtype=torch.int32, device=device)


class FlashAttnExtendGlue(KeptExtendCalls):
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

    def _fills_graph_round(self) -> bool:
        return self._meta_kernel

    def _plan_graph(self, batch, *, capture: bool) -> None:
        # Every E_b >= 1, so max(E) <= T - B + 1: a bound that needs no host read.
        self._tables(self._graph_bufs, batch, self.num_tokens - batch.batch_size + 1,
                     self.graph_source if self._meta_kernel else None)

    # --- kept graph calls (``graph_calls``) --------------------------------------------------

    _graph_key_extra = table_launch_key

    def _kept_plan(self) -> int:
        return self._max_q

    def _resume_plan(self, max_q: int) -> None:
        self._max_q = max_q
