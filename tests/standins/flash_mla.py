"""Stand-in ``flash_mla`` (FlashMLA's old interface, ``flash_mla/flash_mla_interface.py``):

- ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
  is_fp8_kvcache=False, topk=None)`` → ``(tile_scheduler_metadata [num_sm_parts, 8] int32,
  num_splits [B + 1] int32)``;
- ``flash_mla_with_kvcache(q [B, s_q, h_q, 576], k_cache [num_blocks, 64, 1, 576],
  block_table [B, max_blocks] int32, cache_seqlens [B] int32, head_dim_v=512,
  tile_scheduler_metadata, num_splits, softmax_scale=None, causal=False,
  is_fp8_kvcache=False, indices=None)`` → ``(out [B, s_q, h_q, 512],
  softmax_lse [B, h_q, s_q] fp32, natural log)``. ``causal=True`` aligns bottom-right.

``make(sgl_legacy=True)`` models the ``sgl-flash-mla`` 1.0 wheel (seen on the H200,
2026-11-29): it adds
``has_legacy()`` and a ``use_legacy`` keyword, and its current kernels refuse dense decoding
("Dense MLA decoding was removed from the current kernels; pass use_legacy=True").
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import attention_lse, build, expect, expect_tensor

NUM_SM_PARTS = 4


def make(*, new_interface: bool = False, sgl_legacy: bool = False):
    """Old interface by default; ``new_interface=True`` returns ``(sched_meta, None)``;
    ``sgl_legacy=True`` is the sgl-flash-mla wheel (dense decode only with use_legacy)."""
    seen_sched: dict[int, tuple] = {}

    def get_mla_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int,
                         num_heads_k: int, num_heads_q: Optional[int] = None,
                         is_fp8_kvcache: bool = False, topk: Optional[int] = None):
        expect_tensor("cache_seqlens", cache_seqlens, ndim=1, dtype=(torch.int32,))
        expect(isinstance(num_q_tokens_per_head_k, int) and num_q_tokens_per_head_k > 0,
               "num_q_tokens_per_head_k: a positive int")
        expect(num_heads_k == 1, "num_heads_k: MLA has one KV head")
        if new_interface:
            return {"sched": True, "have_initialized": False}, None
        b = cache_seqlens.shape[0]
        tile = torch.zeros(NUM_SM_PARTS, 8, dtype=torch.int32, device=cache_seqlens.device)
        splits = torch.arange(b + 1, dtype=torch.int32, device=cache_seqlens.device)
        return tile, splits

    def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor,
                               block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                               head_dim_v: int, tile_scheduler_metadata, num_splits,
                               softmax_scale: Optional[float] = None, causal: bool = False,
                               is_fp8_kvcache: bool = False,
                               indices: Optional[torch.Tensor] = None,
                               use_legacy: Optional[bool] = None):
        if sgl_legacy:
            expect(use_legacy is True, "sgl-flash-mla: dense decode needs use_legacy=True")
        else:
            expect(use_legacy is None, "FlashMLA's own interface has no use_legacy keyword")
        expect_tensor("q", q, ndim=4, dtype=(torch.bfloat16, torch.float16))
        b, s_q, h_q, d = q.shape
        expect(d == 576, f"q: head_dim 576, got {d}")
        expect(head_dim_v == 512, f"head_dim_v: 512, got {head_dim_v}")
        expect_tensor("k_cache", k_cache, ndim=4, dtype=(q.dtype,), shape=(None, 64, 1, 576))
        expect_tensor("block_table", block_table, ndim=2, dtype=(torch.int32,), shape=(b,))
        expect_tensor("cache_seqlens", cache_seqlens, ndim=1, dtype=(torch.int32,),
                      shape=(b,))
        expect(indices is None and not is_fp8_kvcache, "dense bf16/fp16 decode only")
        if new_interface:
            expect(isinstance(tile_scheduler_metadata, dict) and num_splits is None,
                   "new interface: (FlashMLASchedMeta, None)")
        else:
            expect_tensor("tile_scheduler_metadata", tile_scheduler_metadata, ndim=2,
                          dtype=(torch.int32,), shape=(NUM_SM_PARTS, 8))
            expect_tensor("num_splits", num_splits, ndim=1, dtype=(torch.int32,),
                          shape=(b + 1,))
        for name, t in (("k_cache", k_cache), ("block_table", block_table),
                        ("cache_seqlens", cache_seqlens)):
            expect(t.device == q.device, f"{name}: on {q.device}, got {t.device}")
        scale = d ** -0.5 if softmax_scale is None else softmax_scale
        flat = k_cache.reshape(-1, 576)
        out = torch.empty(b, s_q, h_q, head_dim_v, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
        for i in range(b):
            n = int(cache_seqlens[i])
            x = torch.arange(n, device=q.device)
            slots = block_table[i, x // 64].long() * 64 + x % 64
            keys = flat[slots][:, None, :]
            vis = (n - s_q + torch.arange(s_q) + 1) if causal else torch.full((s_q,), n)
            o, l = attention_lse(q[i], keys, keys[..., :head_dim_v], scale, vis)
            out[i] = o.to(q.dtype)
            lse[i] = l.transpose(0, 1)
        return out, lse

    functions = {"get_mla_metadata": get_mla_metadata,
                 "flash_mla_with_kvcache": flash_mla_with_kvcache}
    if sgl_legacy:
        functions["has_legacy"] = lambda: True
    return build("flash_mla", functions)
