"""A pure-torch stand-in for the FlashInfer API the ``flashinfer`` glue uses.

Page-size-1 CSR wrappers (prefill, decode, MLA) with FlashInfer's documented semantics:
indptrs staged on the host at ``plan``, indices read at run time (or copied into the graph
buffers), bottom-right causal masks, base-2 LSE. The prefill wrapper's ``plan`` also takes
``seq_lens=`` and ``max_token_per_sequence=`` (values FlashInfer otherwise computes from the
indptrs; checked to be those). ``make()`` returns a fresh ``flashinfer`` module.

FP8 KV as FlashInfer 0.7.4 takes it: ``plan(..., q_data_type=, kv_data_type=)`` names the
dtypes ``run`` must be given (``_check_cached_qkv_data_type``); the MHA wrappers' ``run(...,
k_scale=, v_scale=)`` are host floats (``sm_scale *= k_scale``, ``out *= v_scale`` in the
output dtype); the MLA wrapper takes an FP8 pool only as e4m3 with a bf16 query, rank 512 and
rope 0/64, ``scale_mode="kv-per-tensor"``, and ``run(..., ckv_scale=, kpe_scale=)`` floats.
"""

from __future__ import annotations

import math
import types
from typing import Optional

import torch

from ._common import expect, masked_pv

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _host_scale(name, value):
    """FlashInfer multiplies its scales into host numbers: a float (or None), no tensor."""
    expect(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)),
           f"{name}: FlashInfer takes a host float here, got {type(value).__name__}")
    return 1.0 if value is None else float(value)


def _check_dtypes(wrapper, q, k):
    expect(q.dtype == wrapper.q_data_type and k.dtype == wrapper.kv_data_type,
           f"run: q {q.dtype} / kv {k.dtype}, the plan said q_data_type "
           f"{wrapper.q_data_type} / kv_data_type {wrapper.kv_data_type}")


def _attend_csr(q, k, v, qo, kv, indices, causal, scale, cap, v_scale=1.0):
    """Per sequence: rows ``q[qo[m]:qo[m+1]]`` over slots ``indices[kv[m]:kv[m+1]]``.
    q: [rows, H, D]; k: [slots, H_kv, D]; v: [slots, H_kv, Dv] (FP8 codes: ``scale`` holds
    the key scale, ``v_scale`` multiplies the output). Returns (o, lse base 2)."""
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
        out[a:b] = (masked_pv(torch.softmax(s, -1), vv, vis, "hmn,nhd->mhd").to(q.dtype)
                    .float() * v_scale).to(q.dtype)
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
             fixed_split_size=None, seq_lens=None, max_token_per_sequence=None):
        assert page_size == 1 and bool((last_page_len == 1).all())
        if uniform_q_len:  # FlashInfer drops a hint that does not describe the batch
            assert bool(((qo_indptr[1:] - qo_indptr[:-1]) == uniform_q_len).all())
        # The key counts and the most query rows per sequence, which FlashInfer otherwise
        # computes from the indptrs: given, they must be those values.
        if seq_lens is not None:
            assert seq_lens.device.type == "cpu" and seq_lens.dtype == torch.int32
            assert seq_lens.tolist() == (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        if max_token_per_sequence is not None:
            assert max_token_per_sequence == int((qo_indptr[1:] - qo_indptr[:-1]).max())
        self._stage(qo_indptr, kv_indptr, indices)
        self.causal, self.scale, self.cap = causal, sm_scale, logits_soft_cap
        self.uniform_q_len = uniform_q_len
        self.q_data_type, self.kv_data_type = q_data_type, kv_data_type

    def run(self, q, kv, *, k_scale=None, v_scale=None, return_lse=False):
        k, v = kv[0][:, 0], kv[1][:, 0]
        _check_dtypes(self, q, k)
        o, lse = _attend_csr(q, k, v, self.qo, self.kv, self.indices, self.causal,
                             self.scale * _host_scale("k_scale", k_scale), self.cap,
                             _host_scale("v_scale", v_scale))
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
                         sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                         q_data_type=q_data_type, kv_data_type=kv_data_type)


class FakeMLA(_FakeWrapper):
    def __init__(self, ws, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        super().__init__(kv_indices, use_cuda_graph)

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
             sm_scale, q_data_type, kv_data_type, query_layout, kv_cache_layout, lse_mode,
             scale_mode="default"):
        assert page_size == 1 and query_layout == kv_cache_layout == "split"
        m = metadata
        assert m.kv_len_arr.tolist() == (m.kv_indptr[1:] - m.kv_indptr[:-1]).tolist()
        if kv_data_type in _FP8:  # mla/_batch_mla/_backends/_fa_common.py
            expect(kv_data_type == torch.float8_e4m3fn, f"MLA kv_data_type {kv_data_type}: "
                   "FP8 only as float8_e4m3fn")
            expect(q_data_type == torch.bfloat16, "FP8 MLA: q_data_type bfloat16 only")
            expect(head_dim_ckv == 512 and head_dim_kpe in (0, 64),
                   f"FP8 MLA: head_dim_ckv 512, head_dim_kpe 0/64, got {head_dim_ckv}/"
                   f"{head_dim_kpe}")
            expect(scale_mode == "kv-per-tensor", "FP8 MLA plans: scale_mode='kv-per-tensor'")
        else:
            expect(scale_mode == "default", "non-FP8 MLA plans: scale_mode='default'")
        self._stage(m.qo_indptr, m.kv_indptr, m.kv_indices)
        self.causal, self.scale, self.lse_mode = causal, sm_scale, lse_mode
        self.q_data_type, self.kv_data_type = q_data_type, kv_data_type

    def run(self, *, query, kv_cache, return_lse=False, ckv_scale=None, kpe_scale=None):
        assert return_lse == (self.lse_mode == "base2")
        _check_dtypes(self, query[0], kv_cache[0])
        fp8 = self.kv_data_type in _FP8
        expect(fp8 == (ckv_scale is not None) == (kpe_scale is not None),
               "ckv_scale and kpe_scale: required with an FP8 pool, refused otherwise")
        ckv, kpe = _host_scale("ckv_scale", ckv_scale), _host_scale("kpe_scale", kpe_scale)
        q = torch.cat([query[0], query[1]], -1)
        kv = torch.cat([kv_cache[0][:, 0].float() * ckv, kv_cache[1][:, 0].float() * kpe],
                       -1)[:, None]
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
