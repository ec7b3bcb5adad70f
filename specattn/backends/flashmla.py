"""``flashmla``: MLA draft decode through FlashMLA's dense paged decode
(``flash_mla.flash_mla_with_kvcache``, page size 64). Run on an H200 (sm90, torch 2.11) with
the ``sgl-flash-mla`` 1.0.0 wheel's legacy dense decode (``use_legacy=True``): 5 GPU tests
against ``torch_ref`` (K 1/4, lane/path, bf16/fp16, padded CUDA-graph replay), which also
confirm the natural-log LSE. CPU tests drive it through a recording stand-in of ``flash_mla``.
No FP8 KV pools (``fp8_e4m3`` / ``fp8_e5m2``): the dense decode reads bf16/fp16 latent pools.

Draft extend is not provided (original behaviour): the factory logs
``EXTEND_WARNING`` and returns ``None`` (the dispatcher below).

Algorithm (draft step ``i``, ``N = B*K`` lanes), per layer:

1. (torch history only) write the new latent rows at ``out_cache_loc[:, :, i]``;
2. *prefix pass* (FlashMLA): the ``K`` lanes of request ``b`` are the ``s_q = K`` query tokens
   of one batch row, ``causal=False``, over ``R_b[0 : L_b]`` through a page-64 block table,
   so each request's prefix is read once for all its lanes. Returns ``out [B, K, H, 512]`` and
   ``softmax_lse [B, H, K]`` (natural log, FlashMLA's reference definition);
3. *history pass + merge*, default where Triton runs (``fused_history = True``): one Triton
   kernel (``specattn.kernels.history_merge``, shared with ``flashinfer`` and ``fa4``)
   continues each lane's online softmax from the prefix state over its ``i + 1`` history
   slots (``lane`` or ``path`` tree mode) and stores the step's latent rows itself (the
   prefix pass never reads them). Otherwise (``fused_history = False``, or no Triton):
   write first, a torch fp32 history pass, then ``kernels.lse.merge_states``. Both ran on
   the H200 (``tests/gpu/test_flashmla_gpu.py``, 8 passed); at mla-long-p64 the fused pass
   made the step 89.6 us instead of 163.2 (H200, 2026-11-29, one run).

Upstream refuses ``topk > 1`` ("Currently FlashMLA only supports topk=1 for speculative
decoding"); the split above lifts that and also gives exact ``path`` trees. Note the
semantics: specattn's draft step ``i`` attends to the prefix *and* its ``i + 1`` draft
tokens (``semantics.md``), not SGLang's prefix-only metadata (exotic-rows 0.1).

Metadata: the block table ``[B, ceil(max_context_len / 64)]`` int32, ``cache_seqlens [B]``
int32 and the tile-scheduler metadata (``get_mla_metadata(cache_seqlens, K * H, 1)``) are
built once per round (the prefix does not change within a round) and shared by every step
and layer. Both FlashMLA interfaces work: the old one returns
``(tile_scheduler_metadata [num_sm_parts, 8], num_splits [B + 1])``, the new one
``(FlashMLASchedMeta, None)`` filled by the first kernel call and then reused (eager); under
CUDA graphs each call gets a fresh one, so the scheduler runs inside the graph and a replay
re-schedules for its lengths.

CUDA graphs: ``init_cuda_graph_state`` sizes the block table, lengths and (old interface)
scheduler buffers for ``max_bs``; capture/replay refill them in place (the scheduler output is
copied into the fixed buffers, as SGLang does). Padded requests get ``seq_lens = 1``.

Limits: MLA with ``kv_lora_rank = 512`` and rope 64 (FlashMLA's only shape); bf16/fp16; no
logit soft-cap; the pool's slot count must be a multiple of 64; every ``L_b >= 1``; no FP8 KV:
the dense decode this backend runs on sm90 reads bf16/fp16 latent pools, FlashMLA's FP8 KV
(``is_fp8_kvcache``) being its sparse V3.2 byte layout (the ``dsa`` backend); SGLang fork's
``descale_q/descale_k`` are not wired.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..base import DraftDecodeBackend
from ..buffers import Buffers
from ..errors import BackendUnavailableError
from ..fp8 import FP8_KV_DTYPES
from ..keys import BackendRequest
from ..kernels.lse import merge_states
from ..metadata import history_slots, prefix_page_table
from ..platforms import Platform, any_platform, cuda_capability
from ..registry import Dispatcher, Route, default_registry
from ..util import ceil_div, triton_runs, vendor_module
from ..validation import check_whole_pages

if TYPE_CHECKING:
    from ..data import AttentionLayer, DraftBatch, DraftRunner

__all__ = ["FlashMLADecode", "EXTEND_WARNING", "PAGE_SIZE"]

EXTEND_WARNING = "flashmla prefill backend is not yet supported for draft extend."
PAGE_SIZE = 64
_HEAD_DIM, _HEAD_DIM_V = 576, 512
_PIP = "sgl-flash-mla"


def _latent_history(runner: "DraftRunner", layer: "AttentionLayer", q: torch.Tensor,
                    hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """History pass in fp32. q: ``[N, H, W]``; hist: ``[N, n]`` slots.
    Returns ``o [N, H, R]`` fp32 and ``lse [N, H]`` (natural log)."""
    kv = runner.kv_buffer[layer.layer_id]
    keys = kv[hist.reshape(-1).long()].float().view(hist.shape[0], hist.shape[1], -1)
    s = torch.einsum("nhw,nkw->nhk", q.float(), keys) * layer.scaling
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("nhk,nkr->nhr", torch.exp(s - lse[..., None]),
                     keys[..., :runner.kv_lora_rank])
    return o, lse


class FlashMLADecode(DraftDecodeBackend, name="flashmla",
                     platforms=cuda_capability(9, 10), models=("mla",),
                     requires=(("flash_mla", _PIP),), kernel_library="flash_mla",
                     priority={"cuda": 65}):
    """FlashMLA prefix pass + history pass, merged by LSE (see the module doc).

    q: ``[B*K, H, 576]``, k: ``[B*K, 576]``, v: ``None`` → ``[B*K, H, 512]``.
    """

    dtypes = (torch.bfloat16, torch.float16)
    page_sizes = frozenset({PAGE_SIZE})
    head_dims = frozenset({_HEAD_DIM})
    supports_cuda_graph = True
    soft_cap_models = frozenset()  # FlashMLA has no soft cap
    tested_on = ("H200 (sm90) GPU tests with the sgl-flash-mla wheel's legacy dense decode, "
                 "incl. CUDA-graph replay; stand-in tested on CPU")
    # The Triton history + merge kernel where Triton runs (H200: 89.6 vs 163.2 us per step).
    fused_history = True

    @classmethod
    def check_request(cls, request: BackendRequest, platform: Platform) -> Optional[str]:
        if request.kv_cache_dtype in FP8_KV_DTYPES:
            return ("FlashMLA's dense decode (the kernel this backend runs on sm90) reads "
                    "bf16/fp16 latent pools only; its FP8 KV is the sparse V3.2 byte layout "
                    "(the dsa backend)")
        return None

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane") -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        if runner.kv_lora_rank != _HEAD_DIM_V:
            raise BackendUnavailableError(
                f"flashmla: FlashMLA needs kv_lora_rank {_HEAD_DIM_V} (head_dim_v), the model "
                f"has {runner.kv_lora_rank}", "flashmla")
        check_whole_pages(runner, "flashmla", PAGE_SIZE)
        self._fm = vendor_module("flash_mla", _PIP, "flashmla")
        # The sgl-flash-mla wheel (the one that loads on the H200) keeps dense decoding only
        # in its legacy sm90 kernels, reached with use_legacy=True.
        has_legacy = getattr(self._fm, "has_legacy", None)
        self._dense_kwargs = {"use_legacy": True} if has_legacy and has_legacy() else {}
        self._bufs = Buffers(runner.device)
        self._width = ceil_div(runner.max_context_len, PAGE_SIZE)
        self._sched = None  # (tile_scheduler_metadata, num_splits) for this round

    # --- metadata ------------------------------------------------------------------------

    def _plan(self, batch: "DraftBatch") -> None:
        """Round metadata into the buffers (no host sync)."""
        r, bufs, bs = self.runner, self._bufs, batch.batch_size
        table = bufs.get("block_table", (bs, self._width))
        table.copy_(prefix_page_table(r.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                      PAGE_SIZE, self._width, num_slots=r.num_slots))
        seqlens = bufs.get("cache_seqlens", (bs,))
        seqlens.copy_(batch.seq_lens)
        tile, splits = self._fm.get_mla_metadata(seqlens, self.topk * r.num_heads, 1)
        if splits is not None and bufs.fixed:
            # Old interface under CUDA graphs: scheduler output into the fixed buffers.
            fixed_tile = bufs.get("tile_scheduler_metadata", tuple(tile.shape))
            fixed_tile.copy_(tile)
            fixed_splits = bufs.get("num_splits", (bs + 1,))
            fixed_splits.copy_(splits)
            tile, splits = fixed_tile, fixed_splits
        self._sched = (tile, splits)

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed block table, lengths and scheduler buffers for ``max_bs`` requests."""
        bufs = self._bufs
        bufs.get("block_table", (max_bs, self._width))
        seqlens = bufs.get("cache_seqlens", (max_bs,))
        seqlens.fill_(1)
        tile, splits = self._fm.get_mla_metadata(seqlens, self.topk * self.runner.num_heads, 1)
        if splits is not None:
            bufs.get("tile_scheduler_metadata", tuple(tile.shape))
            bufs.get("num_splits", (max_bs + 1,))
        bufs.freeze()

    # --- forward -------------------------------------------------------------------------

    def _fused(self) -> bool:
        return self.fused_history and triton_runs(self.runner.device)

    def _kernel_writes_kv(self) -> bool:
        # The fused history kernel stores the step's latent rows (the prefix pass never
        # reads them).
        return self._fused()

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        r, batch, topk = self.runner, self.batch, self.topk
        bs = batch.batch_size
        tile, splits = self._sched
        if splits is None and self._bufs.fixed:
            # New interface: the scheduler runs inside the first flash_mla_with_kvcache call on
            # an empty FlashMLASchedMeta. Under CUDA graphs that must happen inside the graph,
            # so that a replay re-schedules for its lengths: a fresh meta per call.
            tile, _ = self._fm.get_mla_metadata(self._bufs.get("cache_seqlens", (bs,)),
                                                topk * r.num_heads, 1)
        kv = r.kv_buffer[layer.layer_id]
        o_pre, lse_pre = self._fm.flash_mla_with_kvcache(
            q.view(bs, topk, r.num_heads, _HEAD_DIM), kv.view(-1, PAGE_SIZE, 1, _HEAD_DIM),
            self._bufs.get("block_table", (bs, self._width)),
            self._bufs.get("cache_seqlens", (bs,)), _HEAD_DIM_V, tile, splits,
            softmax_scale=layer.scaling, causal=False, **self._dense_kwargs)
        o_pre = o_pre.reshape(bs * topk, r.num_heads, _HEAD_DIM_V)
        lse_pre = lse_pre.transpose(1, 2).reshape(bs * topk, r.num_heads)

        hist = history_slots(batch.out_cache_loc, batch.parents, step, self.tree_mode)
        hist = hist.reshape(bs * topk, step + 1)
        if self._fused():  # stores k at hist[:, -1] (this step's slots) and merges in one launch
            from ..kernels.history_merge import history_merge

            return history_merge(q, kv.unsqueeze(1), kv[:, :_HEAD_DIM_V].unsqueeze(1), hist,
                                 o_pre, lse_pre, layer.scaling, 0.0, k_new=k, lse_base="e")
        o_his, lse_his = _latent_history(r, layer, q, hist)
        return merge_states([o_pre, o_his], [lse_pre, lse_his], r.dtype)


default_registry.add_dispatcher(Dispatcher(
    "flashmla", "extend", (Route(any_platform, None),),
    note="draft extend is not provided for flashmla (original behaviour)",
    warning=EXTEND_WARNING))
