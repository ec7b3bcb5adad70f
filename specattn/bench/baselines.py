"""Baselines of ``specattn bench``: raw-library ``per-branch`` calls, and ``dequant`` for FP8
pools.

Raw-library ``per-branch`` baselines: each lane its own sequence (prefix + history), the
upstream design, called straight on the kernel library (no specattn backend in between).

Each baseline has the decode call protocol (``init_forward_metadata(batch)``, then
``forward(step, layer, q, k, v)`` writing the new KV first), MHA/GQA only:

- ``FlashInferPerLane``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` on tensor cores
  over the token pool seen as pages of one token; one plan per step (host), reused by every
  layer; planned on first use, so a CUDA-graph capture after a warm-up call is plan-free.
- ``FA4PerLane``: ``flash_attn.cute.flash_attn_varlen_func``, one query row per lane, a
  page-size-1 page table ``[B*K, L_max + n]`` and ``seqused_k``.
- ``SDPAPerLane``: torch ``scaled_dot_product_attention`` over the same per-lane table with
  a length mask (the CPU counterpart: the prefix is gathered and read ``K`` times).

Vendor libraries are imported inside the calls only.

``DequantStep`` (FP8 cases, variant ``<backend>/dequant``): an FP8 pool read by an engine
whose attention takes bf16 KV only, as SGLang's MLA backends do every layer: the new KV is
quantized into the FP8 pool, the layer's whole pool is dequantized into one bf16 scratch pool
(``fp8.dequantize_into``: K codes times ``k_scale``, V codes times ``v_scale``), then the same
backend's bf16 call runs over it. All three are one call, timed (and graphed) as one step.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..fp8 import dequantize_into, layer_scales
from ..metadata import history_slots, prefix_token_slots

if TYPE_CHECKING:
    from ..data import AttentionLayer, DraftBatch, DraftRunner

__all__ = ["per_lane_table", "FlashInferPerLane", "FA4PerLane", "SDPAPerLane",
           "RAW_BASELINES", "has_module", "DequantStep", "scratch_runner", "layer_pools"]


def has_module(name: str) -> bool:
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def per_lane_table(runner: "DraftRunner", batch: "DraftBatch",
                   step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each lane's KV slots, prefix then ``step + 1`` history slots.

    Returns ``table [B*K, L_max + step + 1]`` int64 (entries past a lane's length are slot 0)
    and ``lens [B*K]`` int64 (``L_b + step + 1``)."""
    prefix, _ = prefix_token_slots(runner.req_to_token, batch.req_pool_indices, batch.seq_lens)
    hist = history_slots(batch.out_cache_loc, batch.parents, step, "lane").long()  # [B, K, n]
    bs, topk, n = hist.shape
    lmax = prefix.shape[1]
    lens_b = batch.seq_lens.long()
    x = torch.arange(lmax + n, device=prefix.device)
    pre = prefix[:, x.clamp(max=max(lmax - 1, 0))]  # [B, W]
    in_prefix = x[None, :] < lens_b[:, None]
    h_pos = (x[None, :] - lens_b[:, None]).clamp(0, n - 1)  # [B, W]
    in_hist = (~in_prefix) & (x[None, :] < lens_b[:, None] + n)
    h = torch.gather(hist, 2, h_pos[:, None, :].expand(bs, topk, -1))  # [B, K, W]
    table = torch.where(in_prefix[:, None, :], pre[:, None, :], h)
    table = torch.where((in_prefix | in_hist)[:, None, :], table, torch.zeros_like(table))
    lens = (lens_b + n).repeat_interleave(topk)
    return table.reshape(bs * topk, -1), lens


class _PerLane:
    """Common body: KV write then the per-lane call of one step."""

    label = ""

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int) -> None:
        self.runner, self.topk, self.num_steps = runner, topk, num_steps
        self.batch: Optional["DraftBatch"] = None
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def init_forward_metadata(self, batch: "DraftBatch") -> None:
        self.batch = batch
        self._tables = {}

    def _table(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step not in self._tables:
            self._tables[step] = per_lane_table(self.runner, self.batch, step)
        return self._tables[step]

    def forward(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        self.runner._store_kv(layer.layer_id, self.batch.out_cache_loc[:, :, step], k, v)
        return self._attend(step, layer, q)

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class SDPAPerLane(_PerLane):
    """Per-lane masked SDPA (see the module doc). q: ``[B*K, H_q, D]``."""

    label = "sdpa per lane (raw)"

    def _attend(self, step, layer, q):
        r = self.runner
        table, lens = self._table(step)
        k = r.k_buffer[layer.layer_id][table].transpose(1, 2)  # [N, H_kv, W, D]
        v = r.v_buffer[layer.layer_id][table].transpose(1, 2)
        mask = torch.arange(table.shape[1], device=q.device)[None, :] < lens[:, None]
        group = r.num_q_heads // r.num_kv_heads
        qg = q.view(q.shape[0], r.num_kv_heads, group, -1)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :],
                                           scale=layer.scaling)
        return o.reshape(q.shape[0], r.num_q_heads, -1)


class FlashInferPerLane(_PerLane):
    """FlashInfer batch decode with tensor cores, one sequence per lane."""

    label = "flashinfer decode per lane (raw)"

    def __init__(self, runner, topk, num_steps) -> None:
        super().__init__(runner, topk, num_steps)
        self._wrappers: dict[tuple[int, float], object] = {}
        self._ws = None

    def init_forward_metadata(self, batch) -> None:
        super().init_forward_metadata(batch)
        self._wrappers = {}

    def _wrapper(self, step: int, layer):
        key = (step, float(layer.scaling))
        if key in self._wrappers:
            return self._wrappers[key]
        import flashinfer

        r = self.runner
        if self._ws is None:
            self._ws = torch.zeros(128 * 2 ** 20, dtype=torch.uint8, device=r.device)
        table, lens = self._table(step)
        valid = torch.arange(table.shape[1], device=table.device)[None, :] < lens[:, None]
        indices = table[valid].to(torch.int32)
        indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(lens.cpu(), 0)
        last = torch.ones(lens.numel(), dtype=torch.int32)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._ws, "NHD", use_tensor_cores=True)
        w.plan(indptr, indices, last, r.num_q_heads, r.num_kv_heads, r.head_dim, 1,
               sm_scale=layer.scaling, q_data_type=r.dtype, kv_data_type=r.dtype)
        w._bench_indices = indices  # keep the index buffer alive with its plan
        self._wrappers[key] = w
        return w

    def _attend(self, step, layer, q):
        r = self.runner
        kv = (r.k_buffer[layer.layer_id].unsqueeze(1), r.v_buffer[layer.layer_id].unsqueeze(1))
        return self._wrapper(step, layer).run(q, kv)


class FA4PerLane(_PerLane):
    """FlashAttention-4 varlen, one query row per lane, page size 1."""

    label = "fa4 varlen per lane (raw)"

    def __init__(self, runner, topk, num_steps) -> None:
        super().__init__(runner, topk, num_steps)
        self._args: dict[int, tuple] = {}

    def init_forward_metadata(self, batch) -> None:
        super().init_forward_metadata(batch)
        self._args = {}

    def _attend(self, step, layer, q):
        from flash_attn.cute import flash_attn_varlen_func

        r = self.runner
        if step not in self._args:
            table, lens = self._table(step)
            n = lens.numel()
            cu_q = torch.arange(n + 1, dtype=torch.int32, device=q.device)
            self._args[step] = (table.to(torch.int32).contiguous(), lens.to(torch.int32), cu_q)
        table, lens, cu_q = self._args[step]
        k = r.k_buffer[layer.layer_id].unsqueeze(1)
        v = r.v_buffer[layer.layer_id].unsqueeze(1)
        out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, max_seqlen_q=1,
                                        seqused_k=lens, page_table=table,
                                        softmax_scale=layer.scaling)
        return out


# key (for --backend), class, module that must be importable, device it runs on
RAW_BASELINES = (
    ("flashinfer-raw", FlashInferPerLane, "flashinfer", "cuda"),
    ("fa4-raw", FA4PerLane, "flash_attn.cute", "cuda"),
    ("sdpa-raw", SDPAPerLane, "torch", "cpu"),
)


# --- dequant (FP8 cases) -------------------------------------------------------------------

def layer_pools(runner: "DraftRunner", layer_id: int) -> list[torch.Tensor]:
    """Layer ``layer_id``'s pools: ``[k, v]`` (MHA) or ``[kv]`` (MLA)."""
    if runner.use_mla_backend:
        return [runner.kv_buffer[layer_id]]
    return [runner.k_buffer[layer_id], runner.v_buffer[layer_id]]


def scratch_runner(runner: "DraftRunner") -> "DraftRunner":
    """A runner of ``runner``'s shape and slot table with pools in the activation dtype, one
    zeroed tensor per pool kind shared by every layer (a per-layer scratch)."""
    from ..data import DraftRunner

    pools = [torch.zeros(p.shape, dtype=runner.dtype, device=runner.device)
             for p in layer_pools(runner, 0)]
    layers = runner.num_layers
    if runner.use_mla_backend:
        return DraftRunner.wrap_mla(runner.req_to_token, pools * layers, runner.num_heads,
                                    runner.kv_lora_rank, page_size=runner.page_size)
    return DraftRunner.wrap_mha(runner.req_to_token, [pools[0]] * layers,
                                [pools[1]] * layers, runner.num_q_heads,
                                page_size=runner.page_size)


class DequantStep:
    """The ``dequant`` baseline (module doc) around the bf16 backend ``make(scratch)``.

    The protocol of that backend: decode ``forward(step, layer, q, k, v)``, extend
    ``forward(layer, q, k, v)``; metadata and CUDA-graph calls pass through. The bf16 call
    gets the new rows as the scratch pool holds them (the FP8 values), so its output is the
    attention of the FP8 pool. The batch of the capture is the one replayed (the bench's)."""

    def __init__(self, runner: "DraftRunner", make: Callable[["DraftRunner"], Any]) -> None:
        self.runner = runner
        self.scratch = scratch_runner(runner)
        self.backend = make(self.scratch)
        self.supports_cuda_graph = bool(getattr(self.backend, "supports_cuda_graph", False))
        self.batch = None

    def init_forward_metadata(self, batch) -> None:
        self.batch = batch
        self.backend.init_forward_metadata(batch)

    def init_cuda_graph_state(self, *args) -> None:
        self.backend.init_cuda_graph_state(*args)

    def init_forward_metadata_capture_cuda_graph(self, batch) -> None:
        self.batch = batch
        self.backend.init_forward_metadata_capture_cuda_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, *args) -> None:
        self.backend.init_forward_metadata_replay_cuda_graph(*args)

    def forward(self, *args) -> torch.Tensor:
        """Write, dequantize the layer's pools, attend in bf16 (the class doc)."""
        *step, layer, q, k, v = args
        loc = self.batch.out_cache_loc
        loc = (loc[:, :, step[0]] if step else loc).reshape(-1)
        self.runner._store_kv(layer.layer_id, loc, k, v, layer.k_scale, layer.v_scale)
        scratch = layer_pools(self.scratch, layer.layer_id)
        scales = layer_scales(layer, self.runner.use_mla_backend)
        for out, codes, scale in zip(scratch, layer_pools(self.runner, layer.layer_id),
                                     scales):
            dequantize_into(out, codes, scale)
        new = [pool[loc] for pool in scratch]
        return self.backend.forward(*step, layer, q, new[0], new[1] if v is not None else v)
