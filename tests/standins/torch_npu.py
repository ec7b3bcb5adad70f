"""Stand-in ``torch_npu`` (torch_npu API reference; SGLang's Ascend backend):

- ``npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None,
  actual_seq_lengths=None, actual_seq_lengths_kv=None, ..., block_table=None, ...,
  query_rope=None, key_rope=None, ..., num_heads=1, scale=1.0, pre_tokens=2147483647,
  next_tokens=2147483647, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
  inner_precise=0, block_size=0, antiquant_mode=0, softmax_lse_flag=False, ...)`` →
  ``(attention_out, softmax_lse)``. Modelled: ``input_layout="BSND"`` with page attention
  (``key``/``value`` ``[blocknum, blocksize, H_kv * D]``, ``block_table [B, >= pages]`` int32,
  ``actual_seq_lengths_kv`` an int list), ``Q_S == 1`` (pre/next tokens unused), an optional
  bool ``atten_mask [B, KV_S]`` (``True`` = masked, ``sparse_mode=0``); ``softmax_lse``
  ``[B, N, 1, 1]`` (natural log) when ``softmax_lse_flag`` else ``[1]`` zeros.
- ``_npu_paged_attention_mla(query [T, h, 576], key_cache [blocks, page, h_kv, 576],
  num_kv_heads, num_heads, scale_value, block_table, context_lens, mla_vheadsize, out)``:
  writes ``out [T, h, mla_vheadsize]``; ``context_lens`` is a CPU int32 tensor.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import attention_lse, build, expect, expect_tensor

INT_MAX = 2147483647


def _paged_keys(cache: torch.Tensor, table_row: torch.Tensor, n: int, block: int):
    x = torch.arange(n, device=cache.device)
    rows = table_row[x // block].long() * block + x % block
    return cache.reshape(-1, *cache.shape[2:])[rows]


def make():
    def npu_fused_infer_attention_score(
            query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
            actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
            dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
            antiquant_offset=None, block_table=None, query_padding_size=None,
            kv_padding_size=None, key_antiquant_scale=None, key_antiquant_offset=None,
            value_antiquant_scale=None, value_antiquant_offset=None, key_shared_prefix=None,
            value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
            key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
            pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
            num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
            antiquant_mode=0, softmax_lse_flag=False, key_antiquant_mode=0,
            value_antiquant_mode=0):
        expect(input_layout == "BSND", f"stand-in models input_layout BSND, got {input_layout}")
        expect_tensor("query", query, ndim=4, dtype=(torch.bfloat16, torch.float16))
        B, S, N, D = query.shape
        expect(S == 1, "stand-in models Q_S == 1")
        expect(num_heads == N, f"num_heads {num_heads} != query N {N}")
        hkv = num_key_value_heads or num_heads
        expect(num_heads % hkv == 0 and num_heads // hkv <= 64, "num_heads / kv heads")
        expect(query_rope is None and key_rope is None, "no MLA rope here")
        expect(block_table is not None, "page attention: block_table")
        expect_tensor("block_table", block_table, ndim=2, dtype=(torch.int32,), shape=(B,))
        expect(block_size > 0 and block_size % 16 == 0 and block_size <= 512,
               f"block_size: 16-aligned for fp16/bf16, got {block_size}")
        for name, t in (("key", key), ("value", value)):
            expect_tensor(name, t, ndim=3, dtype=(query.dtype,),
                          shape=(None, block_size, None))
            expect(t.shape[2] % hkv == 0, f"{name}: H = H_kv * D")
        expect(key.shape[2] == hkv * D, "key: [blocknum, blocksize, H_kv * D]")
        expect(isinstance(actual_seq_lengths_kv, list) and len(actual_seq_lengths_kv) == B
               and all(isinstance(x, int) for x in actual_seq_lengths_kv),
               "actual_seq_lengths_kv: an int list, one per batch")
        kv_s = block_table.shape[1] * block_size
        if atten_mask is not None:
            expect(sparse_mode == 0, "Q_S == 1 with a mask: sparse_mode 0")
            expect_tensor("atten_mask", atten_mask, ndim=2, dtype=(torch.bool,),
                          shape=(B, kv_s))
        dv = value.shape[2] // hkv
        out = torch.empty(B, 1, N, dv, dtype=query.dtype, device=query.device)
        lse = torch.empty(B, N, 1, 1, dtype=torch.float32, device=query.device)
        for b in range(B):
            n = actual_seq_lengths_kv[b]
            expect(0 < n <= kv_s, f"actual_seq_lengths_kv[{b}] = {n} exceeds the table")
            k = _paged_keys(key, block_table[b], n, block_size).view(n, hkv, D)
            v = _paged_keys(value, block_table[b], n, block_size).view(n, hkv, dv)
            keep = torch.ones(n, dtype=torch.bool, device=query.device)
            if atten_mask is not None:
                keep = ~atten_mask[b, :n]
            o, l = attention_lse(query[b], k[keep], v[keep], scale)
            out[b, 0] = o[0].to(query.dtype)
            lse[b, :, 0, 0] = l[0]
        if not softmax_lse_flag:
            lse = torch.zeros(1, dtype=torch.float32, device=query.device)
        return out, lse

    def _npu_paged_attention_mla(query, key_cache, num_kv_heads, num_heads, scale_value,
                                 block_table, context_lens, mla_vheadsize, out):
        expect_tensor("query", query, ndim=3, dtype=(torch.bfloat16, torch.float16))
        T, h, d = query.shape
        expect(h == num_heads, "num_heads")
        expect_tensor("key_cache", key_cache, ndim=4, dtype=(query.dtype,),
                      shape=(None, None, num_kv_heads, d))
        expect(num_kv_heads == 1, "MLA: one latent KV head")
        block = key_cache.shape[1]
        expect_tensor("block_table", block_table, ndim=2, dtype=(torch.int32,), shape=(T,))
        expect_tensor("context_lens", context_lens, ndim=1, dtype=(torch.int32,), shape=(T,))
        expect(context_lens.device.type == "cpu", "context_lens: a CPU tensor")
        expect_tensor("out", out, ndim=3, dtype=(query.dtype,), shape=(T, h, mla_vheadsize))
        for t in range(T):
            n = int(context_lens[t])
            k = _paged_keys(key_cache, block_table[t], n, block)  # [n, 1, d]
            o, _ = attention_lse(query[t:t + 1], k, k[..., :mla_vheadsize], scale_value)
            out[t] = o[0].to(out.dtype)

    return build("torch_npu", {
        "npu_fused_infer_attention_score": npu_fused_infer_attention_score,
        "_npu_paged_attention_mla": _npu_paged_attention_mla})
