"""``tokenspeed_mla``: dense paged MLA through the tokenspeed-mla CuTe-DSL kernels (Blackwell
only: sm100/sm103). Vendor glue, **not run on hardware** (no Blackwell GPU here); tests drive
it through a recording stand-in of ``tokenspeed_mla`` (``tests/standins/tokenspeed_mla.py``).

Call (per layer; TRT-LLM-MLA semantics, as SGLang's ``TokenspeedMLABackend``)::

    tokenspeed_mla.tokenspeed_mla_decode(query [rows, q_len, H, R + rope],
        kv_cache [pages, P, R + rope], workspace_buffer (int8), kv_lora_rank, qk_rope_head_dim,
        block_tables [rows, width] int32, seq_lens [rows] int32, max_seq_len,
        softmax_scale = layer.scaling * k_scale, output_scale = k_scale, enable_pdl=False)
    → out [rows, q_len, H, R] bf16

``causal_mask`` is left at its default (True): query ``j`` of a row sees
``seq_len - q_len + j + 1`` keys. ``k_scale`` is the layer's (``AttentionLayer.k_scale``, the
scale of the whole latent row) with an FP8 pool, else 1; the library takes it as host floats,
so a device-tensor scale is folded into the query and the output instead
(``fp8.library_scales``).

- Draft decode: one row per lane (``q_len = 1``), ``L_b + i + 1`` keys through the lane's
  page table (``metadata.lane_rows``: shared full prefix pages, then the lane's own
  pages of the serving engine's draft allocation; ``lane`` tree mode). The 2.0.4 API returns
  no LSE, so the shared-prefix split of ``flashmla`` is not available; upstream refuses
  ``topk > 1``, the per-lane tables lift that.
- Draft extend: one row per request, its ``E_b`` queries right-aligned in
  ``q_len = max(E)`` slots so the bottom-right causal mask gives query ``t`` exactly
  ``L'_b - E_b + t + 1`` keys (the padding rows' outputs are dropped).

KV: bf16 (``kv_cache_dtype="auto"``) or fp8 e4m3 (``"fp8_e4m3"``, SGLang's requirement);
query and KV dtypes must match, so with fp8 KV the query is cast to fp8. Page size 32 or 64.
Workspace: ``num_sms * H * max(8, q_len) * (R + 1) * 4`` bytes (SGLang sizes it for
``q_len <= 8``). ``max_seq_len`` is the static bound ``max_context_len + S`` (no host sync).

CUDA graphs (decode): the request/length/slot buffers, the lane table and the workspace are
fixed (``init_cuda_graph_state``); the table is rebuilt per step with torch ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..base import DraftDecodeBackend, DraftExtendBackend
from ..buffers import Buffers
from ..fp8 import library_scales, scale_rows
from ..metadata import extend_token_slots, lane_rows, prefix_page_table
from ..platforms import cuda_capability
from ..util import ceil_div, sm_count, vendor_module
from ..validation import check_whole_pages

if TYPE_CHECKING:
    from ..data import AttentionLayer, DraftExtendBatch, DraftRunner

__all__ = ["TokenspeedMLADecode", "TokenspeedMLAExtend"]

_DECL = dict(platforms=cuda_capability(10), models=("mla",), mla_required_name="tokenspeed_mla",
             requires=(("tokenspeed_mla", "tokenspeed-mla"),), kernel_library="tokenspeed-mla",
             priority={"cuda": 60})
_TESTED = "not run on hardware (stand-in tested; needs sm100/sm103)"


class _Tokenspeed:
    """Shared setup: vendor module, workspace, kv view and the call."""

    page_sizes = frozenset({32, 64})
    dtypes = (torch.bfloat16,)
    kv_cache_dtypes = ("auto", "fp8_e4m3")
    tested_on = _TESTED
    known_limits = {"*/kv-fp8_e4m3*": (
        "tokenspeed-mla takes the query in the KV dtype: with an FP8 pool the bf16 query is "
        "rounded to e4m3 (the library's contract, as in SGLang), beyond the kit's bf16 "
        "tolerance; tests/test_tokenspeed.py checks it against the rounded query")}
    soft_cap_models = frozenset()  # tokenspeed-mla has no soft cap

    def _open_library(self, runner: "DraftRunner", max_keys: int) -> None:
        """The library, buffers and the block-table width for rows of ``max_keys`` keys."""
        check_whole_pages(runner, "tokenspeed_mla")
        self._ts = vendor_module("tokenspeed_mla", "tokenspeed-mla", "tokenspeed_mla")
        self._bufs = Buffers(runner.device)
        self._num_sms = sm_count(runner.device) or 1
        self._width = ceil_div(max_keys, runner.page_size)

    def _workspace(self, q_len: int) -> torch.Tensor:
        r = self.runner
        nbytes = self._num_sms * r.num_heads * max(8, q_len) * (r.kv_lora_rank + 1) * 4
        return self._bufs.get("workspace", (nbytes,), torch.int8)

    def _call(self, q: torch.Tensor, layer: "AttentionLayer", table: torch.Tensor,
              lens: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """q: ``[rows, q_len, H, R + rope]`` → ``[rows, q_len, H, R]`` (runner dtype)."""
        r = self.runner
        kv = r.kv_buffer[layer.layer_id]
        k_scale, out_scale = 1.0, 1.0
        if r.fp8:
            q, k_scale, _, out_scale = library_scales(layer, q, mla=True)
        if q.dtype != kv.dtype:  # fp8 KV: the kernel wants the query in the KV dtype
            q = q.to(kv.dtype)
        out = self._ts.tokenspeed_mla_decode(
            query=q, kv_cache=kv.view(-1, r.page_size, kv.shape[-1]),
            workspace_buffer=self._workspace(q.shape[1]), kv_lora_rank=r.kv_lora_rank,
            qk_rope_head_dim=r.qk_rope_head_dim, block_tables=table, seq_lens=lens,
            max_seq_len=max_seq_len, softmax_scale=layer.scaling * k_scale,
            output_scale=k_scale, enable_pdl=False)
        return scale_rows(out.to(r.dtype), out_scale)


class TokenspeedMLADecode(_Tokenspeed, DraftDecodeBackend, name="tokenspeed_mla", **_DECL):
    """Per-lane dense paged MLA decode. q ``[B*K, H, R + rope]`` → ``[B*K, H, R]``."""

    tree_modes = frozenset({"lane"})
    supports_cuda_graph = True

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane") -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        self._open_library(runner, runner.max_context_len + num_steps)

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        b, n = self._bufs, max_bs * self.topk
        b.get("table", (n, self._width))
        b.get("lens", (n,))
        self._workspace(1)
        b.freeze()

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        r, b, n = self.runner, self._bufs, self.num_lanes
        table, lens = lane_rows(b.get("table", (n, self._width)), b.get("lens", (n,)),
                                r.req_to_token, self.batch, step, r.page_size,
                                num_slots=r.num_slots)
        out = self._call(q.view(n, 1, r.num_heads, q.shape[-1]), layer, table, lens,
                         r.max_context_len + self.num_steps)
        return out.view(n, r.num_heads, r.kv_lora_rank)


class TokenspeedMLAExtend(_Tokenspeed, DraftExtendBackend, name="tokenspeed_mla", **_DECL):
    """Draft extend: right-aligned padded queries, bottom-right causal mask (module doc)."""

    supports_cuda_graph = False  # max(E) sizes q_len on the host per batch

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self._open_library(runner, runner.max_context_len)

    def _plan(self, batch: "DraftExtendBatch") -> None:
        r = self.runner
        meta = extend_token_slots(r.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                  batch.extend_lens, max_len=1, num_slots=r.num_slots)
        self._q_len = int(batch.extend_lens.max())
        ext = batch.extend_lens.long()
        # Token t of request b sits in padded row b * q_len + (q_len - E_b + t).
        self._rows = meta.token_req * self._q_len + (self._q_len - ext[meta.token_req]
                                                     + meta.token_pos)
        self._table = prefix_page_table(r.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                        r.page_size, self._width, num_slots=r.num_slots)
        self._lens = batch.seq_lens.to(torch.int32)

    def _attend(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        r, bs = self.runner, self.batch.batch_size
        q_pad = q.new_zeros(bs * self._q_len, r.num_heads, q.shape[-1])
        q_pad[self._rows] = q
        out = self._call(q_pad.view(bs, self._q_len, r.num_heads, q.shape[-1]), layer,
                         self._table, self._lens, r.max_context_len)
        return out.reshape(bs * self._q_len, r.num_heads, r.kv_lora_rank)[self._rows]
