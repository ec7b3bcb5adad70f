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
kernel dequantizes; layout in ``specattn.kv_layouts``). The FP8 reference is "dequantize, then
exact attention" (``torch_ref_sparse``).

The sink: ``forward(..., attn_sink=t)`` or a ``SinkAttentionLayer`` carrying it; neither
(or ``-inf``) = no sink.

Layout: ``backend.py`` (the glue and the registered flavours), ``_kernels.py`` (the window
kernel); the layer type and input rules shared with the Ascend flavour live in
``specattn.sink_window``.

Kernel (one launch per layer and step, grid ``(rows, head_blocks)``): each program walks its
row's window (at most ``window`` keys, so no split-K), gathering key tiles through
``req_to_token`` (prefix part) or the per-row history table, and applies the sink to the
normalised output with the natural-log LSE. The key tiles are ``kernels.latent.latent_tile``
(plain or FP8 rows). Plan step (outside graph capture): block sizes from the shapes. Run step:
device-side metadata with torch ops into fixed buffers (no host sync), then the kernel.
"""

from __future__ import annotations

from .backend import (DEFAULT_WINDOW, DSV4CudaDecode, DSV4CudaExtend, DSV4HipDecode,
                      DSV4HipExtend, SinkAttentionLayer)

__all__ = ["SinkAttentionLayer", "DSV4CudaDecode", "DSV4CudaExtend", "DSV4HipDecode",
           "DSV4HipExtend", "DEFAULT_WINDOW"]
