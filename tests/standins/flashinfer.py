"""A pure-torch stand-in for the FlashInfer API the ``flashinfer`` glue uses.

Page-size-1 CSR wrappers (prefill, decode, MLA) with FlashInfer's documented semantics:
indptrs staged on the host at ``plan``, indices read at run time (or copied into the graph
buffers), bottom-right causal masks, base-2 LSE. ``make()`` returns a fresh ``flashinfer``
module.
"""

from __future__ import annotations

import math
import types
from typing import Optional

import torch

from ._common import masked_pv


def _attend_csr(q, k, v, qo, kv, indices, causal, scale, cap):
    """Per sequence: rows ``q[qo[m]:qo[m+1]]`` over slots ``indices[kv[m]:kv[m+1]]``.
    q: [rows, H, D]; k: [slots, H_kv, D]; v: [slots, H_kv, Dv]. Returns (o, lse base 2)."""
    rows, heads = q.shape[0], q.shape[1]
    out = torch.zeros(rows, heads, v.shape[-1], dtype=q.dtype)
    lse = torch.full((rows, heads), float("-inf"))
    group = heads // k.shape[1]
    for m in range(len(kv) - 1):
        a, b = qo[m], qo[m + 1]
        slots = indices[kv[m]:kv[m + 1]].long()
        if b == a or slots.numel() == 0:
            continue
        kk = k[slots].float().repeat_interleave(group, 1)
        vv = v[slots].float().repeat_interleave(group, 1)
        s = torch.einsum("mhd,nhd->hmn", q[a:b].float(), kk) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        vis = None
        if causal:
            n_kv, n_q = slots.numel(), b - a
            vis = (torch.arange(n_kv)[None, :] <= torch.arange(n_q)[:, None] + n_kv - n_q)[None]
            s = s.masked_fill(~vis, float("-inf"))
        out[a:b] = masked_pv(torch.softmax(s, -1), vv, vis, "hmn,nhd->mhd").to(q.dtype)
        lse[a:b] = (torch.logsumexp(s, -1) / math.log(2)).T
    return out, lse


class _FakeWrapper:
    def __init__(self, graph_indices: Optional[torch.Tensor], use_cuda_graph: bool):
        self.use_cuda_graph = use_cuda_graph
        self._graph_indices = graph_indices
        self.plans = 0

    def _stage(self, qo, kv, indices):
        assert qo.device.type == "cpu" and kv.device.type == "cpu", "indptrs go in on the host"
        self.qo, self.kv = qo.tolist(), kv.tolist()
        if self.use_cuda_graph:
            self._graph_indices[:indices.numel()].copy_(indices)
            self.indices = self._graph_indices
        else:
            self.indices = indices  # kept by reference, read at run time
        self.plans += 1


class FakePrefill(_FakeWrapper):
    def __init__(self, ws, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, backend="auto"):
        assert kv_layout == "NHD"
        super().__init__(paged_kv_indices_buf, use_cuda_graph)

    def plan(self, qo_indptr, kv_indptr, indices, last_page_len, hq, hkv, d, page_size, *,
             head_dim_vo=None, causal=False, sm_scale=None, logits_soft_cap=None,
             q_data_type=None, kv_data_type=None, uniform_q_len=None, disable_split_kv=False,
             fixed_split_size=None):
        assert page_size == 1 and bool((last_page_len == 1).all())
        if uniform_q_len:  # FlashInfer drops a hint that does not describe the batch
            assert bool(((qo_indptr[1:] - qo_indptr[:-1]) == uniform_q_len).all())
        self._stage(qo_indptr, kv_indptr, indices)
        self.causal, self.scale, self.cap = causal, sm_scale, logits_soft_cap
        self.uniform_q_len = uniform_q_len

    def run(self, q, kv, return_lse=False):
        k, v = kv[0][:, 0], kv[1][:, 0]
        o, lse = _attend_csr(q, k, v, self.qo, self.kv, self.indices, self.causal, self.scale,
                             self.cap)
        return (o, lse) if return_lse else o


class FakeDecode(FakePrefill):
    def __init__(self, ws, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto"):
        _FakeWrapper.__init__(self, paged_kv_indices_buffer, use_cuda_graph)

    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, *, sm_scale=None,
             logits_soft_cap=None, q_data_type=None, kv_data_type=None):
        qo = torch.arange(indptr.numel(), dtype=torch.int32)
        FakePrefill.plan(self, qo, indptr, indices, last_page_len, hq, hkv, d, page_size,
                         sm_scale=sm_scale, logits_soft_cap=logits_soft_cap)


class FakeMLA(_FakeWrapper):
    def __init__(self, ws, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        super().__init__(kv_indices, use_cuda_graph)

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
             sm_scale, q_data_type, kv_data_type, query_layout, kv_cache_layout, lse_mode):
        assert page_size == 1 and query_layout == kv_cache_layout == "split"
        m = metadata
        assert m.kv_len_arr.tolist() == (m.kv_indptr[1:] - m.kv_indptr[:-1]).tolist()
        self._stage(m.qo_indptr, m.kv_indptr, m.kv_indices)
        self.causal, self.scale, self.lse_mode = causal, sm_scale, lse_mode

    def run(self, *, query, kv_cache, return_lse=False):
        assert return_lse == (self.lse_mode == "base2")
        q = torch.cat([query[0], query[1]], -1)
        kv = torch.cat([kv_cache[0][:, 0], kv_cache[1][:, 0]], -1)[:, None]
        o, lse = _attend_csr(q, kv, kv[..., :query[0].shape[-1]], self.qo, self.kv,
                             self.indices, self.causal, self.scale, 0.0)
        return (o, lse) if return_lse else o



def make() -> types.ModuleType:
    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = FakePrefill
    fi.BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    fi.mla = types.SimpleNamespace(
        BatchMLAPagedAttentionWrapper=FakeMLA,
        MLAPlanMetadata=types.SimpleNamespace(csr=lambda qo, kv, idx, lens: types.SimpleNamespace(
            qo_indptr=qo, kv_indptr=kv, kv_indices=idx, kv_len_arr=lens)))
    return fi
