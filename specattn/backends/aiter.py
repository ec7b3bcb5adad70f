"""``aiter``: ROCm attention through AMD's aiter kernels, with SGLang's argument lists.
Vendor glue, **not run on hardware** (no ROCm GPU here); tests drive it through a recording
stand-in of ``aiter`` / ``aiter.mla`` (``tests/standins/aiter.py``).

Layout: the token pool seen as pages of one token (``block_size = 1``), so kv indices are
slots and any engine page size works. Draft decode uses the upstream flat layout
(``metadata.draft_kv_indices``, SGLang's ``generate_draft_decode_kv_indices``): one sequence
per lane, ``R_b[0 : L_b]`` then the lane's ``i + 1`` history slots, for every step at once;
``path`` tree mode rewrites the history entries of the step's row before the call. So
``topk > 1`` works (the prefix is read once per lane, as upstream).

Calls (per layer):

- MHA decode: ``aiter.paged_attention_ragged(out [N, H, D], workspace, query [N, H, D],
  key_cache [slots, 1, H_kv, D], value_cache [slots, 1, H_kv, D], scale, kv_indptr,
  kv_page_indices, kv_last_page_lens (ones), block_size=1, max_num_partitions,
  alibi_slopes=None, kv_cache_dtype="auto", kv_cache_layout="NHD", logits_soft_cap,
  k_scale, v_scale, fp8_out_scale=None, partition_size=256)`` (positional, as SGLang passes
  them); the workspace holds ``N*H*parts*D*4 + 2*N*H*parts*4`` bytes.
- MLA decode: ``aiter.mla.mla_decode_fwd(q [N, H, R + rope], kv_buffer [slots, 1, 1, R + rope],
  o [N, H, R], qo_indptr (arange), kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q=1,
  sm_scale=, logit_cap=)`` (non-persistent mode: no ``get_mla_metadata_v1`` work buffers).
- MHA extend: ``aiter.mha_batch_prefill_func(q [T, H, D], k_cache [slots, H_kv, D], v_cache,
  qo_indptr [B + 1], kv_indptr [B + 1], kv_indices (``R_b[0 : L'_b]``), max_q_len,
  max_kv_len, causal=True, logits_soft_cap=, alibi_slopes=None, return_lse=False,
  return_attn_probs=False, softmax_scale=layer.scaling)``; the causal mask is aligned
  bottom-right, so query ``t`` sees ``L'_b - E_b + t + 1`` keys.
- MLA extend: ``mla_decode_fwd`` with ``qo_indptr = cumsum(E)`` and ``max_seqlen_q = max(E)``
  (the decode kernel masks a sequence's query tokens causally, bottom-right, as SGLang's
  verify/draft-extend paths use it).

Limits: MLA has no logit soft-cap (aiter asserts ``logit_cap <= 0``); MHA needs
``v_head_dim == head_dim`` (one head size in the paged kernel); fp8 KV (``k_scale/v_scale``
other than 1) is not wired. CUDA graphs: ``init_cuda_graph_state`` sizes the indptr/index
buffers for ``max_bs * K`` lanes of ``max_context_len`` keys and the workspace; capture/replay
refill them in place with no host sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..base import DraftDecodeBackend, DraftExtendBackend
from ..buffers import Buffers
from ..errors import BackendUnavailableError
from ..metadata import draft_kv_indices, extend_token_slots, history_slots
from ..platforms import is_hip
from ..util import ceil_div, vendor_module

if TYPE_CHECKING:
    from ..data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner

__all__ = ["AiterDecode", "AiterExtend", "PARTITION_SIZE"]

PARTITION_SIZE = 256  # _AITER_PARTITION_SIZE_ROCM
_PIP = "amd-aiter"
_DECL = dict(platforms=is_hip, requires=(("aiter", _PIP),), kernel_library="aiter",
             priority={"hip": 70})
_SOFT_CAP = frozenset({"mha"})  # aiter's MLA kernel asserts logit_cap <= 0
_TESTED = "not run on hardware (stand-in tested)"


def _modules(runner: "DraftRunner"):
    aiter = vendor_module("aiter", _PIP, "aiter")
    mla = vendor_module("aiter.mla", _PIP, "aiter") if runner.use_mla_backend else None
    if not runner.use_mla_backend and runner.v_head_dim != runner.head_dim:
        raise BackendUnavailableError(
            f"aiter: paged_attention_ragged has one head size, the model has head_dim "
            f"{runner.head_dim} and v_head_dim {runner.v_head_dim}", "aiter")
    return aiter, mla


def _latent(runner: "DraftRunner", layer_id: int) -> torch.Tensor:
    kv = runner.kv_buffer[layer_id]
    return kv.view(-1, 1, 1, kv.shape[-1])


class AiterDecode(DraftDecodeBackend, name="aiter", **_DECL):
    """Per-lane ragged paged decode (see the module doc).

    MHA: q ``[B*K, H_q, D]`` → ``[B*K, H_q, D]``; MLA: q ``[B*K, H, R + rope]`` →
    ``[B*K, H, R]``."""

    dtypes = (torch.bfloat16, torch.float16)
    supports_cuda_graph = True
    tested_on = _TESTED
    soft_cap_models = _SOFT_CAP

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane") -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        self._aiter, self._mla = _modules(runner)
        self._bufs = Buffers(runner.device)
        self._parts = ceil_div(runner.max_context_len + num_steps, PARTITION_SIZE)
        one = torch.ones(1, dtype=torch.float32, device=runner.device)
        self._k_scale, self._v_scale = one, one.clone()

    def _workspace(self, lanes: int) -> torch.Tensor:
        r = self.runner
        heads, parts = r.num_q_heads, self._parts
        nbytes = lanes * heads * parts * r.head_dim * 4 + 2 * lanes * heads * parts * 4
        return self._bufs.get("workspace", (nbytes,), torch.uint8)

    def _plan(self, batch: "DraftBatch", row_width: Optional[int] = None) -> None:
        """The flat index layout of every step (graph rounds: at the fixed bound)."""
        r, b, topk, steps = self.runner, self._bufs, self.topk, self.num_steps
        bs = batch.batch_size
        max_len = r.max_context_len if b.fixed else None
        indptr, indices = draft_kv_indices(r.req_to_token, batch.req_pool_indices,
                                           batch.seq_lens, topk, steps, r.page_size,
                                           batch.out_cache_loc, max_len=max_len,
                                           row_width=row_width, num_slots=r.num_slots)
        n = bs * topk
        b.get("kv_indptr", (steps, n + 1)).copy_(indptr)
        b.get("kv_indices", (steps, indices.shape[1])).copy_(indices)
        b.get("kv_last_page_lens", (n,)).fill_(1)
        qo = b.get("qo_indptr", (n + 1,))
        qo.copy_(torch.arange(n + 1, device=r.device, dtype=torch.int32))
        self._width = indices.shape[1]

    def _graph_width(self, bs: int) -> int:
        return bs * self.topk * (self.runner.max_context_len + self.num_steps)

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed indptr/index/length buffers and workspace for ``max_bs * topk`` lanes."""
        b, n, steps = self._bufs, max_bs * self.topk, self.num_steps
        b.get("kv_indptr", (steps, n + 1))
        b.get("kv_indices", (steps, self._graph_width(max_bs)))
        b.get("kv_last_page_lens", (n,))
        b.get("qo_indptr", (n + 1,))
        self._workspace(n)
        b.freeze()

    def _plan_graph(self, batch: "DraftBatch", *, capture: bool) -> None:
        self._plan(batch, self._graph_width(batch.batch_size))

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        r, b, batch, topk = self.runner, self._bufs, self.batch, self.topk
        n = self.num_lanes
        indptr = b.get("kv_indptr", (self.num_steps, n + 1))[step]
        indices = b.get("kv_indices", (self.num_steps, self._width))[step]
        if self.tree_mode == "path":
            hist = history_slots(batch.out_cache_loc, batch.parents, step, "path")
            hist = hist.reshape(n, step + 1)
            lens = batch.seq_lens.long().repeat_interleave(topk)
            pos = indptr[:-1].long()[:, None] + lens[:, None] + torch.arange(
                step + 1, device=r.device)
            indices[pos.reshape(-1)] = hist.reshape(-1).to(indices.dtype)
        last = b.get("kv_last_page_lens", (n,))
        if r.use_mla_backend:
            o = torch.empty(n, r.num_heads, r.kv_lora_rank, dtype=q.dtype, device=q.device)
            self._mla.mla_decode_fwd(q, _latent(r, layer.layer_id), o,
                                     b.get("qo_indptr", (n + 1,)), indptr, indices, last, 1,
                                     sm_scale=layer.scaling, logit_cap=layer.logit_cap)
            return o
        out = torch.empty(n, r.num_q_heads, r.head_dim, dtype=q.dtype, device=q.device)
        k_cache = r.k_buffer[layer.layer_id]
        v_cache = r.v_buffer[layer.layer_id]
        self._aiter.paged_attention_ragged(
            out, self._workspace(n), q, k_cache.view(-1, 1, r.num_kv_heads, r.head_dim),
            v_cache.view(-1, 1, r.num_kv_heads, r.v_head_dim), layer.scaling, indptr, indices,
            last, 1, self._parts, None, "auto", "NHD", layer.logit_cap, self._k_scale,
            self._v_scale, None, PARTITION_SIZE)
        return out


class AiterExtend(DraftExtendBackend, name="aiter", **_DECL):
    """Draft extend: ``mha_batch_prefill_func`` (MHA) or ``mla_decode_fwd`` (MLA)."""

    dtypes = (torch.bfloat16, torch.float16)
    supports_cuda_graph = False  # max_q_len / max_kv_len are host values read per batch
    tested_on = _TESTED
    soft_cap_models = _SOFT_CAP

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self._aiter, self._mla = _modules(runner)

    def _plan(self, batch: "DraftExtendBatch") -> None:
        """CSR lists of ``R_b[0 : L'_b]`` and the query indptr; reads the max lengths."""
        r = self.runner
        meta = extend_token_slots(r.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                  batch.extend_lens, num_slots=r.num_slots)
        lens = batch.seq_lens.long()
        kv_indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=r.device)
        kv_indptr[1:] = torch.cumsum(lens, 0).to(torch.int32)
        self._kv_indptr = kv_indptr
        self._kv_indices = meta.slots[meta.valid].to(torch.int32)
        self._qo_indptr = meta.qo_indptr.to(torch.int32)
        self._last = torch.ones(lens.shape[0], dtype=torch.int32, device=r.device)
        self._max_q = int(batch.extend_lens.max())
        self._max_kv = int(lens.max())

    def _attend(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        r = self.runner
        if r.use_mla_backend:
            o = torch.empty(self.num_tokens, r.num_heads, r.kv_lora_rank, dtype=q.dtype,
                            device=q.device)
            self._mla.mla_decode_fwd(q, _latent(r, layer.layer_id), o, self._qo_indptr,
                                     self._kv_indptr, self._kv_indices, self._last,
                                     self._max_q, sm_scale=layer.scaling,
                                     logit_cap=layer.logit_cap)
            return o
        return self._aiter.mha_batch_prefill_func(
            q, r.k_buffer[layer.layer_id], r.v_buffer[layer.layer_id], self._qo_indptr,
            self._kv_indptr, self._kv_indices, self._max_q, self._max_kv, causal=True,
            logits_soft_cap=layer.logit_cap, alibi_slopes=None, return_lse=False,
            return_attn_probs=False, softmax_scale=layer.scaling)
