"""Stand-in ``flashinfer`` for the TRT-LLM family (``flashinfer.decode`` / ``flashinfer.mla``):

- ``trtllm_batch_decode_with_kv_cache(query [tokens, H_q, D], kv_cache, workspace_buffer,
  block_tables [B, pages] int32, seq_lens [B] int32, max_seq_len, bmm1_scale=1.0,
  bmm2_scale=1.0, window_left=-1, out=None, out_dtype=None, o_sf_scale=None,
  o_sf_vec_size=None, sinks=None, kv_layout="HND", enable_pdl=None, backend="auto",
  q_len_per_req=1, o_scale=1.0, mask=None, max_q_len=None, cum_seq_lens_q=None)``
  → ``[tokens, H_q, D]`` in the query dtype. ``kv_cache`` is a ``(k, v)`` tuple of 4-D
  tensors, ``[pages, H_kv, P, D]`` (HND) or ``[pages, P, H_kv, D]`` (NHD), or one 5-D tensor
  ``[pages, 1 or 2, ...]``; ``B = tokens // q_len_per_req``.
- ``trtllm_batch_decode_with_kv_cache_mla(query [B, q_len, H, 576], kv_cache [pages, 1, P,
  576], workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim, block_tables
  [B, pages] int32 (pages a multiple of 128 / P), seq_lens [B] int32, max_seq_len,
  sparse_mla_top_k=0, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None,
  enable_pdl=None, backend="auto")`` → bf16 ``[B, q_len, H, 512]``.

Both: request ``i`` attends to its first ``seq_lens[i]`` positions through its block-table
row (page ``block_tables[i, x // P]``, offset ``x % P``); with ``q_len > 1`` query ``t``
sees ``seq_len - q_len + t + 1`` keys (causal, bottom-right). Scores ``bmm1_scale * q.k``,
output ``bmm2_scale * softmax . v``. A workspace must be zero the first time it is seen.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from ._common import attention_lse, build, expect, expect_tensor, install

_ACT = (torch.bfloat16, torch.float16)
_WS = (torch.int8, torch.uint8)


def _paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                     table: torch.Tensor, lens: torch.Tensor, q_len: int,
                     scale: float) -> torch.Tensor:
    """q ``[B, q_len, H, D]``; k/v pages ``[pages, P, H_kv, D]`` → fp32 ``[B, q_len, H, Dv]``."""
    P = k_pages.shape[1]
    out = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        expect(n >= q_len, f"seq_lens[{i}] = {n} < q_len {q_len}")
        x = torch.arange(n, device=q.device)
        pages = table[i, x // P].long()
        expect(bool((pages >= 0).all()) and bool((pages < k_pages.shape[0]).all()),
               f"block_tables[{i}]: page ids out of the cache")
        vis = n - q_len + torch.arange(q_len) + 1
        o, _ = attention_lse(q[i], k_pages[pages, x % P], v_pages[pages, x % P], scale, vis)
        out.append(o)
    return torch.stack(out)


def make():
    """Returns ``(flashinfer, calls)``; ``flashinfer.decode`` and ``flashinfer.mla`` are
    attributes (``install_flashinfer`` puts all three in ``sys.modules``)."""
    seen_workspaces: set[int] = set()

    def check_workspace(ws: torch.Tensor) -> None:
        expect_tensor("workspace_buffer", ws, ndim=1, dtype=_WS)
        if ws.data_ptr() not in seen_workspaces:
            expect(not bool(ws.any()), "workspace_buffer: must be zero at its first use")
            seen_workspaces.add(ws.data_ptr())

    def trtllm_batch_decode_with_kv_cache(
            query: torch.Tensor, kv_cache, workspace_buffer: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
            bmm1_scale=1.0, bmm2_scale=1.0, window_left: int = -1,
            out: Optional[torch.Tensor] = None, out_dtype=None, o_sf_scale=None,
            o_sf_vec_size=None, sinks=None, kv_layout: str = "HND", enable_pdl=None,
            backend: str = "auto", q_len_per_req: Optional[int] = 1, o_scale=1.0,
            mask=None, max_q_len=None, cum_seq_lens_q=None) -> torch.Tensor:
        expect_tensor("query", query, ndim=3, dtype=_ACT)
        tokens, h, d = query.shape
        expect(backend in ("auto", "trtllm-gen"), f"backend: trtllm-gen, got {backend}")
        expect(window_left == -1 and sinks is None and mask is None, "no window/sinks/mask")
        expect(cum_seq_lens_q is None and max_q_len is None, "uniform q_len_per_req")
        expect(isinstance(q_len_per_req, int) and q_len_per_req >= 1
               and tokens % q_len_per_req == 0, "q_len_per_req divides the query tokens")
        b = tokens // q_len_per_req
        if isinstance(kv_cache, tuple):
            k, v = kv_cache
        else:
            expect_tensor("kv_cache", kv_cache, ndim=5)
            k, v = (kv_cache[:, 0], kv_cache[:, 0]) if kv_cache.shape[1] == 1 else (
                kv_cache[:, 0], kv_cache[:, 1])
        expect(kv_layout in ("HND", "NHD"), f"kv_layout: HND or NHD, got {kv_layout}")
        for name, t in (("k_cache", k), ("v_cache", v)):
            expect_tensor(name, t, ndim=4, dtype=(query.dtype,))
            expect(t.device == query.device, f"{name}: on the query's device")
        if kv_layout == "HND":  # [pages, H_kv, P, D] → token-major pages
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        P, hkv = k.shape[1], k.shape[2]
        expect(P in (16, 32, 64, 128), f"page size 16/32/64/128, got {P}")
        expect(k.shape[3] == d and v.shape[3] == d, "head_dim of q, k and v agree")
        expect(h % hkv == 0, f"H_q {h} a multiple of H_kv {hkv}")
        expect_tensor("block_tables", block_tables, ndim=2, dtype=(torch.int32,), shape=(b,))
        expect_tensor("seq_lens", seq_lens, ndim=1, dtype=(torch.int32,), shape=(b,))
        expect(isinstance(max_seq_len, int) and max_seq_len >= int(seq_lens.max()),
               "max_seq_len: an int bound of seq_lens")
        expect(block_tables.shape[1] * P >= int(seq_lens.max()), "block_tables wide enough")
        check_workspace(workspace_buffer)
        scale = float(bmm1_scale)
        o = _paged_attention(query.view(b, q_len_per_req, h, d), k, v, block_tables,
                             seq_lens, q_len_per_req, scale) * float(bmm2_scale)
        res = o.reshape(tokens, h, d).to(query.dtype if out_dtype is None else out_dtype)
        if out is not None:
            out.copy_(res)
            return out
        return res

    def trtllm_batch_decode_with_kv_cache_mla(
            query: torch.Tensor, kv_cache: torch.Tensor, workspace_buffer: torch.Tensor,
            qk_nope_head_dim: int, kv_lora_rank: int, qk_rope_head_dim: int,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
            sparse_mla_top_k: int = 0, out: Optional[torch.Tensor] = None, bmm1_scale=1.0,
            bmm2_scale=1.0, sinks=None, enable_pdl=None,
            backend: str = "auto") -> torch.Tensor:
        expect(backend in ("auto", "trtllm-gen", "cute-dsl"), f"backend: {backend}")
        expect((qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim) == (128, 512, 64),
               "qk_nope_head_dim 128, kv_lora_rank 512, qk_rope_head_dim 64")
        expect(sparse_mla_top_k == 0 and sinks is None, "dense MLA, no sinks")
        if backend == "cute-dsl":
            expect(isinstance(bmm1_scale, float) and isinstance(bmm2_scale, float),
                   "cute-dsl: float scales")
        expect_tensor("query", query, ndim=4, dtype=(torch.bfloat16,))
        b, q_len, h, d = query.shape
        expect(d == 576, f"query: head_dim 576, got {d}")
        expect_tensor("kv_cache", kv_cache, ndim=4, dtype=(query.dtype,),
                      shape=(None, 1, None, 576))
        P = kv_cache.shape[2]
        expect(P in (32, 64), f"block size 32 or 64, got {P}")
        expect_tensor("block_tables", block_tables, ndim=2, dtype=(torch.int32,), shape=(b,))
        expect(block_tables.shape[1] % (128 // P) == 0,
               f"block_num % (128 / block_size) == 0, got {block_tables.shape[1]} and {P}")
        expect_tensor("seq_lens", seq_lens, ndim=1, dtype=(torch.int32,), shape=(b,))
        expect(isinstance(max_seq_len, int) and max_seq_len >= int(seq_lens.max()),
               "max_seq_len: an int bound of seq_lens")
        check_workspace(workspace_buffer)
        pages = kv_cache[:, 0][:, :, None, :]  # [pages, P, 1, 576]
        o = _paged_attention(query, pages, pages[..., :kv_lora_rank], block_tables,
                             seq_lens, q_len, float(bmm1_scale)) * float(bmm2_scale)
        return o.to(torch.bfloat16)

    fns = {"trtllm_batch_decode_with_kv_cache": trtllm_batch_decode_with_kv_cache,
           "trtllm_batch_decode_with_kv_cache_mla": trtllm_batch_decode_with_kv_cache_mla}
    root, calls = build("flashinfer", fns)
    decode = types.ModuleType("flashinfer.decode")
    mla = types.ModuleType("flashinfer.mla")
    for name in fns:
        setattr(decode, name, getattr(root, name))  # decode re-exports the MLA entry
    mla.trtllm_batch_decode_with_kv_cache_mla = root.trtllm_batch_decode_with_kv_cache_mla
    root.decode, root.mla = decode, mla
    return root, calls


def install_flashinfer(monkeypatch, root: types.ModuleType) -> types.ModuleType:
    install(monkeypatch, "flashinfer", root)
    install(monkeypatch, "flashinfer.decode", root.decode)
    install(monkeypatch, "flashinfer.mla", root.mla)
    return root
