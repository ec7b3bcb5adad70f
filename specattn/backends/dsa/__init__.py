"""``dsa`` (DeepSeek V3.2 sparse attention; ``nsa`` is its deprecated alias) on Triton.

What it computes (exact sets in the ``torch_ref_sparse`` module doc): each query row picks,
with the lightning indexer (its own small heads: ``I[x] = sum_h w[h] relu(q_idx[h] .
k_idx[R_b[x]])``), the top ``index_topk`` (default 2048) of its candidate prefix positions,
then runs absorbed MLA (``q [.., H, R + rope]``, score ``q . [c | k_pe]``, value ``c``, output
``[.., H, R]``) over only those slots.

- Decode, lane ``(b, j)`` at step ``i``: candidates ``R_b[0 : L_b]``; the lane's draft history
  (``i + 1`` slots, ``lane`` or ``path`` mode) is attended in addition, always. Upstream's
  draft steps attend the selected prefix only (exotic-rows.md 0.1) and run ``topk == 1``;
  specattn attends the history too and serves any ``topk``.
- Extend, new token at position ``p``: candidates ``R_b[0 : p + 1]`` (itself included), as
  upstream's causal indexer; no separate history.

API (keyword arguments to ``forward``, so the base ``forward(step, layer, q, k, v)`` still
works)::

    forward(step, layer, q, k, None, *, index_q=None, index_weights=None, index_k=None)

- ``index_q [rows, nh, d]``, ``index_weights [rows, nh]`` (the FP8 scales of upstream folded
  in), ``index_k [rows, d]``: the new tokens' index keys, written to the index-key pool at
  the same slots as their KV.
- The index-key pool, one ``[num_slots, d]`` tensor per layer, is ``index_k_buffer=`` of the
  constructor, else ``runner.index_k_buffer``; ``make_index_k_buffer`` allocates one. Pass
  the same list to the decode and extend backends; the caller fills the prefix's keys.
- Without ``index_q``/``index_weights`` every candidate is attended (dense MLA): exact when
  no candidate list can exceed ``index_topk``, which the backend knows from the round's
  longest sequence (eager: one host read of ``max(seq_lens)`` per round; CUDA graphs: the
  static ``runner.max_context_len``). Beyond that, omitting them raises
  ``InvalidInputError``. When every list fits, the indexer is skipped even if its inputs are
  given (upstream does the same: the top-k of ``n <= index_topk`` is everything).

Layout: ``backend.py`` (the glue and the registered classes), ``_kernels.py`` (the kernels).

Kernels (``_kernels``): a Triton indexer (a request's rows share each index-key tile; the
scores are per row), ``torch.topk`` on the scores, then a split-K Triton sparse-MLA over the
per-row slot lists plus one history split, merged by LSE. Any page size (slots are read token
by token through ``req_to_token``; 64 and 1 are what upstream uses).

KV: bf16/fp16/fp32 latent pools (``kv_cache_dtype="auto"``), or V3.2's FP8 "with scale" layout
(``kv_cache_dtype="fp8_ds_mla"`` on the runner: ``DraftRunner.mla(..., kv_cache_dtype=
"fp8_ds_mla")`` allocates uint8 ``[slots, 656]`` pools for rank 512 + rope 64, ``write_kv``
quantizes, the kernel dequantizes; layout in ``specattn.kv_layouts``; ``kv_lora_rank`` a multiple
of 128). Its reference is "dequantize, then exact attention" (``torch_ref_sparse``). The
index keys stay in their own bf16/fp16/fp32 pool (upstream's 132-byte FP8 index-K cache is
not built).
"""

from __future__ import annotations

from .backend import DEFAULT_INDEX_TOPK, DSADecode, DSAExtend, make_index_k_buffer

__all__ = ["DSADecode", "DSAExtend", "make_index_k_buffer", "DEFAULT_INDEX_TOPK"]
