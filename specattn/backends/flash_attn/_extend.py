"""The draft-extend glue shared by every FlashAttention flavour.

One causal varlen pass over the page table: ``cu_seqlens_q = cumsum(E)``,
``seqused_k = L'_b`` (new tokens included, their KV written first), page ids of
``R_b[0 : L'_b]``. Causal attention is bottom-right aligned in both FA3 and FA4, so query
``t`` of request ``b`` sees ``R_b[0 : L'_b - E_b + t + 1]``.

``split_prefix = C > 1`` (FA4 has no split-KV on sm90: one CTA per (request, KV head)
reads the whole prefix, 8 CTAs on 132 SMs for one request): the full pages before the first
new token's page, ``R_b[0 : s_b]``, run as ``C`` chunks of whole pages in one non-causal
pass (each chunk a sequence of the request's ``E_b`` queries, ``q`` repeated ``C`` times),
and the tail ``R_b[s_b : L'_b]`` (at most a page plus the new tokens) in one causal pass;
``kernels.merge.merge_chunks_and_tail`` merges the ``C + 1`` states by LSE, empty chunks
weighted 0. By default (``split_prefix=None``) ``_route.choose_route`` picks ``C`` per batch
size from the same model as decode (host ints only: one captured graph keeps its route);
the split needs Triton (the table launch and the merge), elsewhere the route is one pass.

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

from ...errors import InvalidInputError
from ...graph_calls import KeptExtendCalls
from ...metadata import prefix_page_table
from ...platforms import current_platform
from ...util import ceil_div, sm_count, triton_runs
from ...validation import check_whole_pages
from ._library import resolve_kernel
from ._route import check_split_prefix, choose_route
from ._tables import check_page_aligned, paged_pools, table_launch_key


class _Buffers:
    """seq ``[bs]`` int32 keys (``L'``; split: the tail's); cu ``[bs + 1]`` int32; pt ``[bs,
    ceil(ctx / P)]`` int32 page ids (split: the tail's). Split (``chunks = C > 1``): cpt
    ``[C * bs, cp]`` the chunks' page ids (row ``c * B + b``), cused ``[C * bs]`` their keys,
    ccu ``[C * bs + 1]`` their query offsets."""

    def __init__(self, bs: int, pages: int, device: torch.device, chunks: int = 1) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        self.bs, self.chunks = bs, chunks
        self.seq = torch.zeros(bs, **i32)
        self.cu = torch.zeros(bs + 1, **i32)
        self.pt = torch.zeros(bs, pages, **i32)
        self.chunk_pages = ceil_div(pages, chunks)
        if chunks > 1:
            self.cpt = torch.zeros(chunks * bs, self.chunk_pages, **i32)
            self.cused = torch.zeros(chunks * bs, **i32)
            self.ccu = torch.zeros(chunks * bs + 1, **i32)


class FlashAttnExtendGlue(KeptExtendCalls):
    """Common body of the registered fa3 / fa4 extend classes (not registered)."""

    known_limits = {"extend/*/isolation/*": (
        "FlashAttention's causal varlen kernel multiplies the masked (zero) probabilities of a "
        "tile by every value in it: a non-finite key/value of a later new token reaches the "
        "earlier tokens of its request (0 * NaN; seen on the H200 with FA4 4.0.0b36, also "
        "through fa3's sm90 path); the vendor kernel would have to change")}

    library = "fa4"

    def __init__(self, runner, *, topk: int = 1, num_steps: int = 1,
                 split_prefix: Optional[int] = None) -> None:
        """``split_prefix``: prefix chunks per request (``1``: one causal pass), or ``None``
        to route per batch size (module docstring)."""
        super().__init__(runner, topk=topk, num_steps=num_steps)
        check_whole_pages(runner, type(self).name)
        check_split_prefix(split_prefix, none_means="routed per batch")
        self.kernel = resolve_kernel(self.library, current_platform(), type(self).name)
        self._pages = ceil_div(runner.max_context_len, self.page_size)
        # Where Triton runs, the tables are one launch (``_metadata``); else torch ops.
        self._meta_kernel = triton_runs(runner.device)
        if split_prefix not in (None, 1) and not self._meta_kernel:
            raise InvalidInputError("split_prefix", f"None or 1 here (the split needs Triton, "
                                    f"which cannot run on {runner.device})", split_prefix)
        self.chunks = split_prefix
        self._bufs: dict = {}  # chunks -> _Buffers (eager batches)
        self._graph_bufs: dict = {}  # chunks -> _Buffers for cuda_graph_max_bs
        self._active: Optional[_Buffers] = None
        self._max_q = 0

    def chunks_for(self, bs: int) -> int:
        """Prefix chunks of a batch of ``bs`` requests (host ints only)."""
        if self.chunks is not None:
            return self.chunks
        r = self.runner
        if not self._meta_kernel:
            return 1
        return choose_route(bs=bs, topk=1, prefix_len=r.max_context_len,
                            num_kv_heads=r.num_kv_heads, num_sms=sm_count(r.device),
                            head_dim=r.head_dim)[1]

    def _buffers(self, store: dict, bs: int, chunks: int) -> _Buffers:
        bufs = store.get(chunks)
        if bufs is None or bufs.bs < bs:
            bufs = store[chunks] = _Buffers(bs, self._pages, self.runner.device, chunks)
        return bufs

    def _check_batch(self, batch, debug: Optional[bool]) -> None:
        check_page_aligned(self.runner, batch.req_pool_indices, batch.seq_lens, "sequences")

    def _plan(self, batch) -> None:
        bs = batch.batch_size
        bufs = self._buffers(self._bufs, bs, self.chunks_for(bs))
        self._tables(bufs, batch, int(batch.extend_lens.max()))  # one host read, as upstream

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
                None if source is None else self.padded_graph_loc(),
                tail_pages=ceil_div(self.page_size - 1 + max_q, self.page_size)
                if bufs.chunks > 1 else None)
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
        common = dict(max_seqlen_q=self._max_q, scale=float(layer.scaling),
                      softcap=float(layer.logit_cap))
        split = bufs.chunks > 1
        o, lse = self.kernel(q, kp, vp, page_table=bufs.pt[:bs], seqused=bufs.seq[:bs],
                             cu_seqlens_q=bufs.cu[:bs + 1], causal=True, with_lse=split,
                             **common)
        if not split:
            return o
        rows = bufs.chunks * bs
        o_c, lse_c = self.kernel(q.repeat(bufs.chunks, 1, 1), kp, vp,
                                 page_table=bufs.cpt[:rows], seqused=bufs.cused[:rows],
                                 cu_seqlens_q=bufs.ccu[:rows + 1], causal=False,
                                 with_lse=True, **common)
        from ...kernels.merge import merge_chunks_and_tail

        return merge_chunks_and_tail(o_c, lse_c, o, lse)

    # --- CUDA graphs -------------------------------------------------------------------------

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """One set of fixed buffers per chunk count the captured sizes take (made at
        capture, reused by every replay), each for ``max_bs`` requests."""
        self._graph_bufs = {}

    def _fills_graph_round(self) -> bool:
        return self._meta_kernel

    def _plan_graph(self, batch, *, capture: bool) -> None:
        # Every E_b >= 1, so max(E) <= T - B + 1: a bound that needs no host read.
        bs = batch.batch_size
        if self.graph_size[0] != bs:  # the captured tables' grid and slices are its size's
            raise InvalidInputError("batch", f"the {self.graph_size[0]} requests of the "
                                    "capture (the engine pads a round's requests)",
                                    f"{bs} requests")
        bufs = self._buffers(self._graph_bufs, self.cuda_graph_max_bs, self.chunks_for(bs))
        self._tables(bufs, batch, self.num_tokens - bs + 1,
                     self.graph_source if self._meta_kernel else None)

    # --- kept graph calls (``graph_calls``) --------------------------------------------------

    _graph_key_extra = table_launch_key

    def _kept_plan(self) -> int:
        return self._max_q

    def _resume_plan(self, max_q: int) -> None:
        self._max_q = max_q
