"""Stand-in ``tokenspeed_mla`` (tokenspeed-mla 2.0.x):

``tokenspeed_mla_decode(query, kv_cache, workspace_buffer, kv_lora_rank, qk_rope_head_dim,
block_tables, seq_lens, max_seq_len, softmax_scale, output_scale=1.0, out=None,
is_var_seq=True, causal_mask=True, enable_pdl=False)`` → ``out [B, q_len, H, R]`` bf16.
``query [B, q_len, H, R + rope]`` and ``kv_cache [pages, P, R + rope]`` (3-D) share a dtype
(bf16 or fp8 e4m3); ``block_tables [B, max_pages]`` and ``seq_lens [B]`` are int32. With
``causal_mask`` query ``j`` sees ``seq_len - q_len + j + 1`` keys; the result is scaled by
``output_scale``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import attention_lse, build, expect, expect_tensor

_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def make():
    def tokenspeed_mla_decode(query: torch.Tensor, kv_cache: torch.Tensor,
                              workspace_buffer: torch.Tensor, kv_lora_rank: int,
                              qk_rope_head_dim: int, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, max_seq_len: int, softmax_scale: float,
                              output_scale: float = 1.0, out: Optional[torch.Tensor] = None,
                              is_var_seq: bool = True, causal_mask: bool = True,
                              enable_pdl: bool = False) -> torch.Tensor:
        expect_tensor("query", query, ndim=4, dtype=_DTYPES)
        b, q_len, h, w = query.shape
        expect(w == kv_lora_rank + qk_rope_head_dim, "query: D_qk = kv_lora_rank + rope")
        expect_tensor("kv_cache", kv_cache, ndim=3, dtype=(query.dtype,), shape=(None, None, w))
        page = kv_cache.shape[1]
        expect(page in (32, 64), f"page size 32/64, got {page}")
        expect_tensor("block_tables", block_tables, ndim=2, dtype=(torch.int32,), shape=(b,))
        expect_tensor("seq_lens", seq_lens, ndim=1, dtype=(torch.int32,), shape=(b,))
        expect_tensor("workspace_buffer", workspace_buffer, ndim=1, dtype=(torch.int8,))
        expect(workspace_buffer.numel() >= h * max(8, q_len) * (kv_lora_rank + 1) * 4,
               "workspace: num_sms * H * q_len * (kv_lora_rank + 1) * 4 bytes")
        expect(isinstance(max_seq_len, int) and max_seq_len >= int(seq_lens.max()),
               "max_seq_len: an int bound of seq_lens")
        flat = kv_cache.reshape(-1, w)
        res = torch.empty(b, q_len, h, kv_lora_rank, dtype=torch.bfloat16,
                          device=query.device)
        for i in range(b):
            n = int(seq_lens[i])
            x = torch.arange(n, device=query.device)
            keys = flat[block_tables[i, x // page].long() * page + x % page].float()[:, None]
            vis = n - q_len + torch.arange(q_len) + 1 if causal_mask else None
            o, _ = attention_lse(query[i].float(), keys, keys[..., :kv_lora_rank],
                                 softmax_scale, vis)
            res[i] = (o * output_scale).to(torch.bfloat16)
        return res

    return build("tokenspeed_mla", {"tokenspeed_mla_decode": tokenspeed_mla_decode})
