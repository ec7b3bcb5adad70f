"""The ``dsv4`` backend classes: the glue around the kernels (``_kernels``) and the
registered flavours; the package doc says what they compute."""


from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from ... import metadata
from ...base import DraftDecodeBackend, DraftExtendBackend
from ...platforms import is_cpu, is_cuda, is_hip, triton_interpret
from ...sink_window import (DEFAULT_WINDOW, KIT_LIMITS, SinkAttentionLayer, check_window,
                            check_window_runner, layer_sink)

if TYPE_CHECKING:
    from ...data import DraftBatch, DraftExtendBatch, DraftRunner
    from ...layer import AttentionLayer

__all__ = ["SinkAttentionLayer", "DSV4CudaDecode", "DSV4CudaExtend", "DSV4HipDecode",
           "DSV4HipExtend", "DEFAULT_WINDOW"]

log = logging.getLogger(__name__)

# "auto": the pool's own dtype; "fp8_ds_v4": V4's 584-byte FP8 layout (specattn.kv_layouts).
_KV_CACHE_DTYPES = ("auto", "fp8_ds_v4")
_TRITON = (("triton", "triton>=3.2"),)
_TESTED_ON = ("H200 (sm90) GPU tests incl. CUDA-graph replay and the FP8 KV pools + CPU "
              "interpreter")
_HIP_TESTED_ON = "not run on hardware (the CUDA flavour's kernels, CPU interpreter tested)"


def _window_attention(*args):
    from ._kernels import window_attention  # Triton is imported on first use

    return window_attention(*args)


def _row_table(rows: int, device: torch.device) -> torch.Tensor:
    """``[rows, 2]`` int32 per query row: its request row and the keys it takes from
    ``req_to_token`` before the history (decode: ``L_b``; extend: ``p + 1``)."""
    return torch.zeros(max(1, rows), 2, dtype=torch.int32, device=device)


class _SinkWindow:
    """What decode and extend share: the runner rule, ``window``, the ``attn_sink`` keyword
    and the row-metadata buffers (eager: grown; graph: fixed)."""

    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    kv_cache_dtypes = _KV_CACHE_DTYPES
    supports_cuda_graph = True
    tested_on = _TESTED_ON
    auto_eligible = False
    known_limits = KIT_LIMITS
    kit_options = {"window": 1 << 30}  # every key in the window: dense attention

    def _open(self, runner: "DraftRunner", window: int) -> None:
        check_window_runner(runner)
        self.window = check_window(window)
        self._eager_meta: Optional[torch.Tensor] = None
        self._graph_meta: Optional[torch.Tensor] = None

    def _row_meta(self, rows: int, graph: bool) -> torch.Tensor:
        """The ``[rows, 2]`` row table of this round (``_row_table``)."""
        if graph:
            return self._graph_meta[:rows]
        if self._eager_meta is None or self._eager_meta.shape[0] < rows:
            self._eager_meta = _row_table(rows, self.runner.device)
        return self._eager_meta[:rows]

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        rows = max_bs * self.topk if self.kind == "decode" else max_num_tokens
        self._graph_meta = _row_table(rows, self.runner.device)

    def _plan_graph(self, batch, *, capture: bool) -> None:
        self._fill(batch, graph=True)

    def _plan(self, batch) -> None:
        self._fill(batch, graph=False)

    def _forward_options(self, layer: "AttentionLayer", *,
                         attn_sink: Optional[torch.Tensor] = None) -> dict:
        return {"sink": layer_sink(self.runner, layer, attn_sink)}


class _DSV4Decode(_SinkWindow, DraftDecodeBackend):
    """Sink-aware sliding-window draft decode (see the module doc).

    ``window``: keys per query (default 128). ``forward(step, layer, q, k, v, *,
    attn_sink=None)``."""

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane", window: int = DEFAULT_WINDOW) -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        self._open(runner, window)

    def _fill(self, batch: "DraftBatch", graph: bool) -> None:
        """Each lane's request row and prefix length (torch ops, no sync)."""
        meta = self._meta = self._row_meta(self.num_lanes, graph)
        meta[:, 0].copy_(batch.req_pool_indices.repeat_interleave(self.topk))
        meta[:, 1].copy_(batch.seq_lens.repeat_interleave(self.topk))

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], *, sink: Optional[torch.Tensor]) -> torch.Tensor:
        """q: ``[B*K, H, D]`` → ``[B*K, H, D]``; sink: ``[H]`` fp32 or None."""
        batch = self.batch
        hist = metadata.history_slots(batch.out_cache_loc, batch.parents, step, self.tree_mode)
        hist = hist.reshape(self.num_lanes, step + 1).to(torch.int32)
        return _window_attention(q, self.runner, layer, self._meta, hist, step + 1,
                                 self.window, sink)


class _DSV4Extend(_SinkWindow, DraftExtendBackend):
    """Sink-aware sliding-window draft extend (see the module doc)."""

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1,
                 window: int = DEFAULT_WINDOW) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self._open(runner, window)

    def _fill(self, batch: "DraftExtendBatch", graph: bool) -> None:
        """Per new token: its request row and ``p + 1`` visible keys (no host sync)."""
        n = self.num_tokens
        meta = self._meta = self._row_meta(n, graph)
        ext = batch.extend_lens.long()
        start = torch.cumsum(ext, 0) - ext
        req = torch.repeat_interleave(torch.arange(ext.shape[0], device=ext.device), ext,
                                      output_size=n)
        pos = torch.arange(n, device=ext.device) - start[req]
        meta[:, 0].copy_(batch.req_pool_indices.long()[req])
        meta[:, 1].copy_(batch.seq_lens.long()[req] - ext[req] + pos + 1)

    def _attend(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], *, sink: Optional[torch.Tensor]) -> torch.Tensor:
        """q: ``[T, H, D]`` → ``[T, H, D]``; sink: ``[H]`` fp32 or None."""
        return _window_attention(q, self.runner, layer, self._meta, self._meta, 0,
                                 self.window, sink)


# Flavours (selection rule 10). The CUDA flavour also runs on the CPU under
# TRITON_INTERPRET=1, so CI exercises the kernels; HIP reuses the same kernels.
_CUDA_PLATFORMS = is_cuda | (is_cpu & triton_interpret)
_DECL = dict(requires=_TRITON, kernel_library="triton (specattn)")


class DSV4CudaDecode(_DSV4Decode, name="dsv4", flavour="cuda", platforms=_CUDA_PLATFORMS,
                     **_DECL):
    """DeepSeek V4 draft decode, CUDA flavour (Triton)."""


class DSV4CudaExtend(_DSV4Extend, name="dsv4", flavour="cuda", platforms=_CUDA_PLATFORMS,
                     **_DECL):
    """DeepSeek V4 draft extend, CUDA flavour (Triton)."""


class DSV4HipDecode(_DSV4Decode, name="dsv4", flavour="hip", platforms=is_hip, **_DECL):
    """DeepSeek V4 draft decode, HIP flavour (the same Triton kernels)."""

    tested_on = _HIP_TESTED_ON


class DSV4HipExtend(_DSV4Extend, name="dsv4", flavour="hip", platforms=is_hip, **_DECL):
    """DeepSeek V4 draft extend, HIP flavour (the same Triton kernels)."""

    tested_on = _HIP_TESTED_ON
