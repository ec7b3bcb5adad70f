"""``torch_ref``: the reference backend, the executable form of ``semantics.md``.

Plain torch, float32 accumulation, a Python loop over lanes (decode) and requests (extend):
obviously correct rather than fast. Every other backend is tested against it. Works for
MHA/GQA and MLA, ``lane`` and ``path`` trees, any topk, any page size (slots are read through
``req_to_token``, so pages need no special casing), with an optional logit soft-cap. FP8 pools
(``kv_cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"``) are read dequantized with the layer's
``k_scale`` / ``v_scale``.

``reference_decode`` and ``reference_extend`` are the pure functions (no KV write) that tests
of other backends compare against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .. import metadata
from ..base import DraftDecodeBackend, DraftExtendBackend
from ..fp8 import KV_DTYPES_WITH_FP8
from ..kernels.reference import attend, gather_kv, out_shape
from ..platforms import any_platform

if TYPE_CHECKING:
    from ..data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner

__all__ = ["TorchRefDecode", "TorchRefExtend", "reference_decode", "reference_extend",
           "attend"]


def reference_decode(runner: "DraftRunner", layer: "AttentionLayer", q: torch.Tensor,
                     batch: "DraftBatch", step: int, tree_mode: str = "lane") -> torch.Tensor:
    """Draft-decode attention of step ``step`` over the KV already in the pool (no write).

    q: ``[B*K, H_q, D]`` (MLA ``[B*K, H, R + rope]``). Lane ``(b, j)`` attends to
    ``R_b[0 : L_b]`` then its ``step + 1`` history slots (``metadata.history_slots``).
    Returns ``[B*K, H_q, D_v]`` (MLA ``[B*K, H, R]``) in ``q.dtype``.
    """
    bs, topk = batch.out_cache_loc.shape[:2]
    hist = metadata.history_slots(batch.out_cache_loc, batch.parents, step, tree_mode)
    out = torch.empty(out_shape(runner, bs * topk), dtype=q.dtype, device=q.device)
    for b in range(bs):
        req, seq_len = int(batch.req_pool_indices[b]), int(batch.seq_lens[b])
        prefix = runner.req_to_token[req, :seq_len]
        for j in range(topk):
            z = b * topk + j
            slots = torch.cat([prefix.long(), hist[b, j].long()])
            k, v = gather_kv(runner, layer.layer_id, slots, k_scale=layer.k_scale,
                             v_scale=layer.v_scale)
            o = attend(q[z:z + 1], k, v, layer.scaling, layer.logit_cap)
            out[z] = o[0].to(q.dtype)
    return out


def reference_extend(runner: "DraftRunner", layer: "AttentionLayer", q: torch.Tensor,
                     batch: "DraftExtendBatch") -> torch.Tensor:
    """Draft-extend attention over the KV already in the pool (no write).

    q: ``[T, H_q, D]`` (``T = sum(E)``, request-major). Query ``t`` of request ``b`` attends to
    ``R_b[0 : L'_b - E_b + t + 1]``. Returns ``[T, H_q, D_v]`` (MLA ``[T, H, R]``).
    """
    out = torch.empty(out_shape(runner, q.shape[0]), dtype=q.dtype, device=q.device)
    start = 0
    for b in range(batch.batch_size):
        req = int(batch.req_pool_indices[b])
        seq_len, ext = int(batch.seq_lens[b]), int(batch.extend_lens[b])
        k, v = gather_kv(runner, layer.layer_id, runner.req_to_token[req, :seq_len],
                         k_scale=layer.k_scale, v_scale=layer.v_scale)
        visible = seq_len - ext + torch.arange(ext, device=q.device)[:, None] + 1
        mask = torch.arange(seq_len, device=q.device)[None, :] < visible
        o = attend(q[start:start + ext], k, v, layer.scaling, layer.logit_cap, mask)
        out[start:start + ext] = o.to(q.dtype)
        start += ext
    return out


class TorchRefDecode(DraftDecodeBackend, name="torch_ref", platforms=any_platform,
                     kernel_library="torch", priority=0):
    """Reference multi-step draft decode (see the module doc)."""

    tested_on = "CPU"
    supports_cuda_graph = False
    kv_cache_dtypes = KV_DTYPES_WITH_FP8

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        return reference_decode(self.runner, layer, q, self.batch, step, self.tree_mode)


class TorchRefExtend(DraftExtendBackend, name="torch_ref", platforms=any_platform,
                     kernel_library="torch", priority=0):
    """Reference draft extend (see the module doc)."""

    tested_on = "CPU"
    supports_cuda_graph = False
    kv_cache_dtypes = KV_DTYPES_WITH_FP8

    def _attend(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        return reference_extend(self.runner, layer, q, self.batch)
