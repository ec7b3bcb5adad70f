"""Stand-in ``aiter`` and ``aiter.mla`` (aiter's Python API as SGLang's aiter backend calls it):

- ``aiter.paged_attention_ragged(out, workspace_buffer, query, key_cache, value_cache, scale,
  kv_indptr, kv_page_indices, kv_last_page_lens, block_size, max_num_partitions,
  alibi_slopes, kv_cache_dtype, kv_cache_layout, logits_soft_cap, k_scale, v_scale,
  fp8_out_scale=None, partition_size=256, mtp=1)``: writes ``out [num_seqs, H, D]``; the NHD
  caches are ``[num_blocks, block_size, H_kv, D]``;
- ``aiter.mha_batch_prefill_func(q, k, v, cu_seqlens_q, kv_indptr, kv_page_indices,
  max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0,
  causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
  return_lse=False, return_attn_probs=False, out=None)`` → ``out [T, H, D_v]`` (causal:
  bottom-right aligned);
- ``aiter.mla.mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices,
  kv_last_page_lens, max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
  ...)``: writes ``o [T, H, v_head_dim]``; the queries of a sequence are causal, bottom-right;
  returns ``(logits, lse)``.
"""

from __future__ import annotations

import types

import torch

from ._common import attention_lse, build, expect, expect_tensor

_ACT = (torch.bfloat16, torch.float16)


def _csr(name, indptr, n):
    expect_tensor(name, indptr, ndim=1, dtype=(torch.int32,), shape=(n + 1,))


def make() -> tuple[types.ModuleType, types.ModuleType, list]:
    def paged_attention_ragged(out, workspace_buffer, query, key_cache, value_cache, scale,
                               kv_indptr, kv_page_indices, kv_last_page_lens, block_size,
                               max_num_partitions, alibi_slopes, kv_cache_dtype,
                               kv_cache_layout, logits_soft_cap, k_scale, v_scale,
                               fp8_out_scale=None, partition_size=256, mtp=1):
        expect_tensor("query", query, ndim=3, dtype=_ACT)
        n, h, d = query.shape
        expect_tensor("out", out, ndim=3, dtype=(query.dtype,), shape=(n, h, d))
        expect(kv_cache_layout == "NHD" and kv_cache_dtype == "auto", "NHD, auto")
        expect(block_size == 1 and partition_size == 256, "block_size 1, partition 256")
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            expect_tensor(name, t, ndim=4, dtype=(query.dtype,), shape=(None, 1, None, d))
        hkv = key_cache.shape[2]
        _csr("kv_indptr", kv_indptr, n)
        expect_tensor("kv_last_page_lens", kv_last_page_lens, ndim=1, dtype=(torch.int32,),
                      shape=(n,))
        expect(bool((kv_last_page_lens == 1).all()), "kv_last_page_lens: ones (page 1)")
        expect_tensor("workspace_buffer", workspace_buffer, ndim=1, dtype=(torch.uint8,))
        need = n * h * max_num_partitions * d * 4 + 2 * n * h * max_num_partitions * 4
        expect(workspace_buffer.numel() >= need, "workspace too small")
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            expect_tensor(name, t, dtype=(torch.float32,))
        expect(alibi_slopes is None and fp8_out_scale is None, "no alibi / fp8 out")
        for i in range(n):
            a, b = int(kv_indptr[i]), int(kv_indptr[i + 1])
            expect(b - a <= max_num_partitions * partition_size, "max_num_partitions")
            slots = kv_page_indices[a:b].long()
            o, _ = attention_lse(query[i:i + 1], key_cache[slots, 0], value_cache[slots, 0],
                                 scale, cap=logits_soft_cap)
            out[i] = o[0].to(out.dtype)
        return out

    def mha_batch_prefill_func(q, k, v, cu_seqlens_q, kv_indptr, kv_page_indices,
                               max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                               logits_soft_cap=0.0, causal=False, window_size=(-1, -1),
                               alibi_slopes=None, deterministic=False, return_lse=False,
                               return_attn_probs=False, out=None):
        expect_tensor("q", q, ndim=3, dtype=_ACT)
        expect_tensor("k", k, ndim=3, dtype=(q.dtype,))
        expect_tensor("v", v, ndim=3, dtype=(q.dtype,), shape=(k.shape[0], k.shape[1]))
        b = cu_seqlens_q.shape[0] - 1
        _csr("cu_seqlens_q", cu_seqlens_q, b)
        _csr("kv_indptr", kv_indptr, b)
        expect(not return_lse and not return_attn_probs and dropout_p == 0.0, "plain output")
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        res = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
        for i in range(b):
            qa, qb = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            ka, kb = int(kv_indptr[i]), int(kv_indptr[i + 1])
            expect(qb - qa <= max_seqlen_q and kb - ka <= max_seqlen_k, "max seqlens")
            slots = kv_page_indices[ka:kb].long()
            vis = (kb - ka) - (qb - qa) + torch.arange(qb - qa) + 1 if causal else None
            o, _ = attention_lse(q[qa:qb], k[slots], v[slots], scale, vis, logits_soft_cap)
            res[qa:qb] = o.to(q.dtype)
        return res

    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                       max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
                       num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None,
                       work_indptr=None, work_info_set=None, reduce_indptr=None,
                       reduce_final_map=None, reduce_partial_map=None, q_scale=None,
                       kv_scale=None, intra_batch_mode=False, return_logits=False,
                       return_lse=False):
        expect(logit_cap <= 0, f"logit_cap={logit_cap} is not supported")
        expect_tensor("q", q, ndim=3, dtype=_ACT)
        t, h, w = q.shape
        expect_tensor("kv_buffer", kv_buffer, ndim=4, dtype=(q.dtype,), shape=(None, 1, 1, w))
        expect_tensor("o", o, ndim=3, dtype=(q.dtype,), shape=(t, h))
        b = qo_indptr.shape[0] - 1
        _csr("qo_indptr", qo_indptr, b)
        _csr("kv_indptr", kv_indptr, b)
        expect_tensor("kv_last_page_lens", kv_last_page_lens, ndim=1, dtype=(torch.int32,),
                      shape=(b,))
        scale = w ** -0.5 if sm_scale is None else sm_scale
        flat = kv_buffer.reshape(-1, 1, w)
        for i in range(b):
            qa, qb = int(qo_indptr[i]), int(qo_indptr[i + 1])
            expect(qb - qa <= max_seqlen_q, "max_seqlen_q")
            ka, kb = int(kv_indptr[i]), int(kv_indptr[i + 1])
            keys = flat[kv_indices[ka:kb].long()]
            vis = (kb - ka) - (qb - qa) + torch.arange(qb - qa) + 1
            out, _ = attention_lse(q[qa:qb], keys, keys[..., :o.shape[2]], scale, vis)
            o[qa:qb] = out.to(o.dtype)
        return o, None

    aiter, calls = build("aiter", {"paged_attention_ragged": paged_attention_ragged,
                                   "mha_batch_prefill_func": mha_batch_prefill_func})
    from ._common import recorder

    mla = types.ModuleType("aiter.mla")
    mla.mla_decode_fwd = recorder(mla, calls, mla_decode_fwd)
    aiter.mla = mla  # type: ignore[attr-defined]
    return aiter, mla, calls
