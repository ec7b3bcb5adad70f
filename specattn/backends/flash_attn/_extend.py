"""The draft-extend glue shared by every FlashAttention flavour.

One causal varlen pass over the page table: ``cu_seqlens_q = cumsum(E)``,
``seqused_k = L'_b`` (new tokens included, their KV written first), page ids of
``R_b[0 : L'_b]``. Causal attention is bottom-right aligned in both FA3 and FA4, so query
``t`` of request ``b`` sees ``R_b[0 : L'_b - E_b + t + 1]``.

Metadata on the device. Eager ``init_forward_metadata`` reads ``max(extend_lens)`` once
(``max_seqlen_q``: FA3 sizes its grid with it), as upstream does. CUDA graphs: fixed buffers
for ``max_bs`` requests and ``max_num_tokens`` tokens; capture and replay use the bound
``T - B + 1`` (no host read), so a graph serves any split of ``T`` tokens over ``B`` requests.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...base import DraftExtendBackend
from ...errors import InvalidInputError
from ...metadata import prefix_page_table
from ...platforms import current_platform
from ...validation import check_extend_batch, check_extend_forward
from ._kernels import resolve_kernel
from ._tables import ceil_div, check_page_aligned, paged_pools


class _Buffers:
    """seq ``[bs]`` int32 ``L'``; cu ``[bs + 1]`` int32; pt ``[bs, ceil(ctx / P)]`` int32 page
    ids; loc ``[tokens]`` int64 slots of the new tokens."""

    def __init__(self, bs: int, tokens: int, pages: int, device: torch.device) -> None:
        self.bs, self.tokens = bs, tokens
        self.seq = torch.zeros(bs, dtype=torch.int32, device=device)
        self.cu = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        self.pt = torch.zeros(bs, pages, dtype=torch.int32, device=device)
        self.loc = torch.zeros(tokens, dtype=torch.int64, device=device)


class FlashAttnExtendGlue(DraftExtendBackend):
    """Common body of the registered fa3 / fa4 extend classes (not registered)."""

    library = "fa4"

    def __init__(self, runner, *, topk: int = 1, num_steps: int = 1) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self.kernel = resolve_kernel(self.library, current_platform(), type(self).name)
        self._pages = ceil_div(runner.max_context_len, self.page_size)
        self._bufs: Optional[_Buffers] = None
        self._graph_bufs: Optional[_Buffers] = None
        self._active: Optional[_Buffers] = None
        self._bs = self._tokens = self._max_q = 0

    def init_forward_metadata(self, batch) -> None:
        check_extend_batch(self.runner, batch)
        bs, tokens = batch.batch_size, int(batch.out_cache_loc.shape[0])
        b = self._bufs
        if b is None or b.bs < bs or b.tokens < tokens:
            b = self._bufs = _Buffers(max(bs, b.bs if b else 0), max(tokens, b.tokens if b else 0),
                                      self._pages, self.runner.device)
        self._fill(b, batch, int(batch.extend_lens.max()))  # one host read, as upstream

    def _fill(self, bufs: _Buffers, batch, max_q: int) -> None:
        rpi, seq, ext = batch.req_pool_indices, batch.seq_lens, batch.extend_lens
        check_page_aligned(self.runner, rpi, seq, "sequences")
        bs, tokens = batch.batch_size, int(batch.out_cache_loc.shape[0])
        bufs.seq[:bs].copy_(seq)
        bufs.cu[0] = 0
        bufs.cu[1:bs + 1].copy_(torch.cumsum(ext, 0))
        bufs.pt[:bs].copy_(prefix_page_table(self.runner.req_to_token, rpi, seq,
                                             self.page_size, max_pages=self._pages))
        bufs.loc[:tokens].copy_(batch.out_cache_loc)
        self._active, self._bs, self._tokens, self._max_q = bufs, bs, tokens, max_q

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        bufs = self._active
        self._require_metadata(bufs)
        check_extend_forward(self.runner, self._tokens, layer, q, k, v)
        self.runner.write_kv(layer.layer_id, bufs.loc[:self._tokens], k, v)
        q = q if q.is_contiguous() else q.contiguous()
        kp, vp = paged_pools(self.runner, layer.layer_id, self.page_size)
        o, _ = self.kernel(q, kp, vp, page_table=bufs.pt[:self._bs], seqused=bufs.seq[:self._bs],
                           cu_seqlens_q=bufs.cu[:self._bs + 1], max_seqlen_q=self._max_q,
                           causal=True, scale=float(layer.scaling),
                           softcap=float(layer.logit_cap), with_lse=False)
        return o

    # --- CUDA graphs -------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if not isinstance(max_bs, int) or max_bs < 1:
            raise InvalidInputError("max_bs", "an int >= 1", repr(max_bs))
        if not isinstance(max_num_tokens, int) or max_num_tokens < max_bs:
            raise InvalidInputError("max_num_tokens", f"an int >= max_bs={max_bs}",
                                    repr(max_num_tokens))
        self.cuda_graph_max_bs = max_bs
        self._graph_bufs = _Buffers(max_bs, max_num_tokens, self._pages, self.runner.device)

    def _graph_fill(self, batch) -> None:
        self._require_graph_state(self._graph_bufs is not None)
        check_extend_batch(self.runner, batch)
        bs, tokens = batch.batch_size, int(batch.out_cache_loc.shape[0])
        if bs > self._graph_bufs.bs or tokens > self._graph_bufs.tokens:
            raise InvalidInputError("batch", f"at most {self._graph_bufs.bs} requests and "
                                    f"{self._graph_bufs.tokens} tokens (init_cuda_graph_state)",
                                    f"{bs} requests, {tokens} tokens")
        # Every E_b >= 1, so max(E) <= T - B + 1: a bound that needs no host read.
        self._fill(self._graph_bufs, batch, tokens - bs + 1)

    def init_forward_metadata_capture_cuda_graph(self, batch) -> None:
        self._graph_fill(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch, bs: int) -> None:
        self._graph_fill(batch)
