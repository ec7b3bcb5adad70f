"""``dsv4``: DeepSeek V4 draft (MTP) layer attention on Triton, CUDA and HIP flavours.

What it computes (``torch_ref_sparse`` module doc has the exact key sets): sliding-window
(``window``, 128 in V4) single-KV-head attention with ``D``-wide heads (512 in V4), keys equal
to values (the pool stores one vector per slot) and a per-head attention sink ``attn_sink
[H]`` (fp32): ``o_h = softmax(scale * q_h . K) K * exp(lse_h) / (exp(lse_h) + exp(s_h))``.

- Decode, lane ``(b, j)`` at step ``i``: the last ``window`` keys of the prefix
  ``R_b[0 : L_b]`` followed by the lane's draft history (``i + 1`` slots, ``lane`` or ``path``
  tree mode), i.e. positions ``max(0, L_b + i + 1 - window) .. L_b + i``. Upstream's CUDA
  graph path reuses step 0's window (ending at ``L_b - 1``) for every step and has no
  history (exotic-rows.md 0.1); specattn's window moves with the step and sees the history.
  Upstream refuses ``topk > 1``; here any ``topk`` works (each lane its own window).
- Extend, token at position ``p``: ``R_b[max(0, p + 1 - window) : p + 1]``.
- Only the draft layer's SWA part: the target model's C4/C128 compressors and C4 indexer
  never run in the MTP layer (compress ratio 0), so they are not built here.

Data: an MLA runner with ``qk_rope_head_dim == 0`` (``kv_buffer [slots, D]``, ``q [N, H, D]``,
``k [N, D]``, ``v = None``), or an MHA runner with one KV head and ``head_dim == v_head_dim``
(``k_buffer [slots, 1, D]`` is the pool; pass ``v = k``: it is stored, never read). The pool
is bf16/fp16/fp32 (``kv_cache_dtype="auto"``), or, on an MLA runner, upstream's FP8 SWA layout
(``kv_cache_dtype="fp8_ds_v4"``: ``DraftRunner.mla(H, 512, 0, ..., kv_cache_dtype="fp8_ds_v4")``
allocates uint8 ``[slots, 584]`` pools, page-blocked by the runner's page size: 448 e4m3 in
blocks of 64 with ue8m0 exponents, then 64 bf16 RoPE values; ``write_kv`` quantizes, the
kernel dequantizes; layout in ``backends/_fp8_kv``). The FP8 reference is "dequantize, then
exact attention" (``torch_ref_sparse``).

The sink: ``forward(..., attn_sink=t)`` or a ``SinkAttentionLayer`` carrying it; neither
(or ``-inf``) = no sink.

Kernel (one launch per layer and step, grid ``(rows, head_blocks)``): each program walks its
row's window (at most ``window`` keys, so no split-K), gathering key tiles through
``req_to_token`` (prefix part) or the per-row history table, and applies the sink to the
normalised output with the natural-log LSE. The key tiles use the ``triton`` backend's
``_attend_tile``. Plan step (outside graph capture): block sizes from the shapes. Run step:
device-side metadata with torch ops into fixed buffers (no host sync), then the kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ... import metadata, validation
from ...base import DraftDecodeBackend, DraftExtendBackend
from ...data import AttentionLayer
from ...errors import InvalidInputError
from ...platforms import is_cpu, is_cuda, is_hip, triton_interpret

if TYPE_CHECKING:
    from ...data import DraftBatch, DraftExtendBatch, DraftRunner

__all__ = ["SinkAttentionLayer", "DSV4CudaDecode", "DSV4CudaExtend", "DSV4HipDecode",
           "DSV4HipExtend", "DEFAULT_WINDOW"]

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 128
# "auto": the pool's own dtype; "fp8_ds_v4": V4's 584-byte FP8 layout (backends/_fp8_kv).
_KV_CACHE_DTYPES = ("auto", "fp8_ds_v4")
_TRITON = (("triton", "triton>=3.2"),)
_TESTED_ON = ("H200 (sm90) GPU tests incl. CUDA-graph replay and the FP8 KV pools + CPU "
              "interpreter")
_HIP_TESTED_ON = "not run on hardware (the CUDA flavour's kernels, CPU interpreter tested)"


@dataclass(frozen=True, eq=False)
class SinkAttentionLayer(AttentionLayer):
    """An ``AttentionLayer`` with DeepSeek V4's per-head sink: ``attn_sink [H]`` float32."""

    attn_sink: Optional[torch.Tensor] = None


# --- kernel (built on first use: Triton is imported lazily) ---------------------------------


def _window_attention(*args):
    from ._kernels import window_attention

    return window_attention(*args)


# --- shared checks and metadata -------------------------------------------------------------


def _check_runner(runner: "DraftRunner") -> None:
    if runner.use_mla_backend:
        if runner.qk_rope_head_dim != 0:
            raise InvalidInputError(
                "runner.qk_rope_head_dim", "0 for dsv4 (keys equal values: the pool stores "
                "one vector per slot, all of it is the value)", runner.qk_rope_head_dim)
        return
    if runner.num_kv_heads != 1:
        raise InvalidInputError("runner.num_kv_heads", "1 for dsv4 (single-KV-head MQA)",
                                runner.num_kv_heads)
    if runner.v_head_dim != runner.head_dim:
        raise InvalidInputError("runner.v_head_dim", f"head_dim={runner.head_dim} for dsv4 "
                                "(keys equal values)", runner.v_head_dim)


def _check_window(window: int) -> int:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise InvalidInputError("window", "an int >= 1", repr(window))
    return window


def _sink(runner: "DraftRunner", layer: AttentionLayer,
          attn_sink: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    sink = attn_sink if attn_sink is not None else getattr(layer, "attn_sink", None)
    if sink is None:
        return None
    validation._tensor("attn_sink", sink, dtypes=(torch.float32,), ndim=1, device=runner.device)
    validation._shape("attn_sink", sink, (runner.num_q_heads,))
    validation._last_dim_contiguous("attn_sink", sink)
    return sink


class _Buffers:
    """Fixed metadata buffers: per row ``meta [rows, 2]`` int32 (req row, keys taken from
    ``req_to_token`` before the history) and the draft slots ``loc [bs, K, S]`` int64."""

    def __init__(self, max_rows: int, max_bs: int, topk: int, num_steps: int,
                 device: torch.device) -> None:
        self.meta = torch.zeros(max(1, max_rows), 2, dtype=torch.int32, device=device)
        self.loc = torch.zeros(max(1, max_bs), topk, num_steps, dtype=torch.int64,
                               device=device)


def _ensure(bufs: Optional[_Buffers], rows: int, bs: int, topk: int, steps: int,
            device: torch.device) -> _Buffers:
    if bufs is None or bufs.meta.shape[0] < rows or bufs.loc.shape[0] < bs:
        bufs = _Buffers(rows, bs, topk, steps, device)
    return bufs


def _fill_decode(bufs: _Buffers, batch: "DraftBatch", topk: int) -> None:
    bs = batch.batch_size
    bufs.meta[:bs * topk, 0].copy_(batch.req_pool_indices.repeat_interleave(topk))
    bufs.meta[:bs * topk, 1].copy_(batch.seq_lens.repeat_interleave(topk))
    bufs.loc[:bs].copy_(batch.out_cache_loc)


def _fill_extend(bufs: _Buffers, batch: "DraftExtendBatch") -> None:
    """Per new token: its request row and ``p + 1`` visible keys (no host sync)."""
    n = int(batch.out_cache_loc.shape[0])
    ext = batch.extend_lens.long()
    start = torch.cumsum(ext, 0) - ext
    req = torch.repeat_interleave(torch.arange(ext.shape[0], device=ext.device), ext,
                                  output_size=n)
    pos = torch.arange(n, device=ext.device) - start[req]
    bufs.meta[:n, 0].copy_(batch.req_pool_indices.long()[req])
    bufs.meta[:n, 1].copy_(batch.seq_lens.long()[req] - ext[req] + pos + 1)
    bufs.loc.view(-1)[:n].copy_(batch.out_cache_loc)


# --- backends ---------------------------------------------------------------------------------


class _DSV4Decode(DraftDecodeBackend):
    """Sink-aware sliding-window draft decode (see the module doc).

    ``window``: keys per query (default 128). ``forward(step, layer, q, k, v, *,
    attn_sink=None)``."""

    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    kv_cache_dtypes = _KV_CACHE_DTYPES
    supports_cuda_graph = True
    tested_on = _TESTED_ON
    auto_eligible = False

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane", window: int = DEFAULT_WINDOW) -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        _check_runner(runner)
        self.window = _check_window(window)
        self._bufs: Optional[_Buffers] = None
        self._graph_bufs: Optional[_Buffers] = None
        self._active: Optional[_Buffers] = None
        self._batch: Optional["DraftBatch"] = None
        self._bs = 0

    def init_forward_metadata(self, batch: "DraftBatch") -> None:
        """Fill the row table and the draft slots for all steps (torch ops, no sync)."""
        validation.check_decode_batch(self.runner, self.topk, self.num_steps, self.tree_mode,
                                      batch)
        bs = batch.batch_size
        self._bufs = _ensure(self._bufs, bs * self.topk, bs, self.topk, self.num_steps,
                             self.runner.device)
        self._activate(self._bufs, batch)

    def _activate(self, bufs: _Buffers, batch: "DraftBatch") -> None:
        _fill_decode(bufs, batch, self.topk)
        self._active, self._batch, self._bs = bufs, batch, batch.batch_size

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed buffers for ``max_bs`` requests (``max_bs * topk`` lanes)."""
        self.cuda_graph_max_bs = max_bs
        self._graph_bufs = _Buffers(max_bs * self.topk, max_bs, self.topk, self.num_steps,
                                    self.runner.device)

    def init_forward_metadata_capture_cuda_graph(self, batch: "DraftBatch") -> None:
        self._graph_batch(batch, batch.batch_size)

    def init_forward_metadata_replay_cuda_graph(self, batch: "DraftBatch", bs: int) -> None:
        """Refill the fixed buffers; ``batch`` holds the ``bs`` (padded) requests, and in path
        mode its ``parents`` is the tensor used at capture, filled in place per step."""
        self._graph_batch(batch, bs)

    def _graph_batch(self, batch: "DraftBatch", bs: int) -> None:
        self._check_graph_batch(batch, bs, ready=self._graph_bufs is not None)
        self._activate(self._graph_bufs, batch)

    def forward(self, step: int, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], *, attn_sink: Optional[torch.Tensor] = None,
                ) -> torch.Tensor:
        """q: ``[B*K, H, D]`` → ``[B*K, H, D]``; attn_sink: ``[H]`` fp32 or None."""
        self._require_metadata(self._batch)
        bufs, bs = self._active, self._bs
        rows = bs * self.topk
        validation.check_decode_forward(self.runner, rows, self.num_steps, step, layer, q, k, v)
        if self.tree_mode == "path":
            validation.check_parents_step(self._batch, step, self.topk)
        sink = _sink(self.runner, layer, attn_sink)
        loc = bufs.loc[:bs]
        self.runner.write_kv(layer.layer_id, loc[:, :, step].reshape(-1), k, v)
        hist = metadata.history_slots(loc, self._batch.parents, step, self.tree_mode)
        hist = hist.reshape(rows, step + 1).to(torch.int32)
        return _window_attention(q, self.runner, layer, bufs.meta[:rows], hist, step + 1,
                          self.window, sink)


class _DSV4Extend(DraftExtendBackend):
    """Sink-aware sliding-window draft extend (see the module doc)."""

    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    kv_cache_dtypes = _KV_CACHE_DTYPES
    supports_cuda_graph = True
    tested_on = _TESTED_ON
    auto_eligible = False

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1,
                 window: int = DEFAULT_WINDOW) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        _check_runner(runner)
        self.window = _check_window(window)
        self._bufs: Optional[_Buffers] = None
        self._graph_bufs: Optional[_Buffers] = None
        self._active: Optional[_Buffers] = None
        self._num_tokens = 0
        self._batch = None

    def init_forward_metadata(self, batch: "DraftExtendBatch") -> None:
        validation.check_extend_batch(self.runner, batch)
        n = int(batch.out_cache_loc.shape[0])
        self._bufs = _ensure(self._bufs, n, n, 1, 1, self.runner.device)
        self._activate(self._bufs, batch)

    def _activate(self, bufs: _Buffers, batch: "DraftExtendBatch") -> None:
        _fill_extend(bufs, batch)
        self._active, self._batch = bufs, batch
        self._num_tokens = int(batch.out_cache_loc.shape[0])

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed buffers for ``max_num_tokens`` new tokens."""
        self.cuda_graph_max_bs = max_bs
        self._graph_bufs = _Buffers(max_num_tokens, max_num_tokens, 1, 1, self.runner.device)

    def init_forward_metadata_capture_cuda_graph(self, batch: "DraftExtendBatch") -> None:
        self._graph_batch(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: "DraftExtendBatch",
                                                bs: int) -> None:
        self._graph_batch(batch)

    def _graph_batch(self, batch: "DraftExtendBatch") -> None:
        self._check_graph_batch(batch, ready=self._graph_bufs is not None)
        n = int(batch.out_cache_loc.shape[0])
        if n > self._graph_bufs.meta.shape[0]:
            raise InvalidInputError("batch.out_cache_loc", f"at most max_num_tokens="
                                    f"{self._graph_bufs.meta.shape[0]} tokens", n)
        self._activate(self._graph_bufs, batch)

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], *, attn_sink: Optional[torch.Tensor] = None,
                ) -> torch.Tensor:
        """q: ``[T, H, D]`` → ``[T, H, D]``; attn_sink: ``[H]`` fp32 or None."""
        self._require_metadata(self._batch)
        n, bufs = self._num_tokens, self._active
        validation.check_extend_forward(self.runner, n, layer, q, k, v)
        sink = _sink(self.runner, layer, attn_sink)
        self.runner.write_kv(layer.layer_id, bufs.loc.view(-1)[:n], k, v)
        return _window_attention(q, self.runner, layer, bufs.meta[:n], bufs.meta[:n], 0,
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
