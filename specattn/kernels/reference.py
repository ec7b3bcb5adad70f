"""The plain-torch attention math of the reference backends (``torch_ref``,
``torch_ref_sparse``): float32 softmax attention and the pool gathers feeding it (FP8 pools
dequantized with the layer's scales; float64 pools, the conformance kit's dequantized copies,
in float64). Slow and obviously correct; no Triton."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..fp8 import Scale, dequantize, read_rows

if TYPE_CHECKING:
    from ..data import DraftRunner

__all__ = ["attend", "gather_kv", "out_shape"]


def _values(pool: torch.Tensor, slots: torch.Tensor, scale: Scale, fp8: bool) -> torch.Tensor:
    """Rows ``slots`` of ``pool`` as float32 values (float64 pools stay float64); FP8 codes
    times ``scale``."""
    if fp8:
        return dequantize(read_rows(pool, slots), scale)
    rows = pool[slots]
    return rows if rows.dtype == torch.float64 else rows.float()


def gather_kv(runner: DraftRunner, layer_id: int, slots: torch.Tensor, *,
              k_scale: Scale = 1.0, v_scale: Scale = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``slots [n]`` in float32, heads expanded to the query heads.

    MHA: ``k [n, H_q, D]``, ``v [n, H_q, D_v]``. MLA: ``k [n, 1, R + rope]`` (the whole
    latent row), ``v [n, 1, R]`` (its first ``kv_lora_rank`` columns). FP8 pools
    (``runner.fp8``) are dequantized with ``k_scale`` / ``v_scale`` (MLA: ``k_scale``).
    """
    slots = slots.long()
    fp8 = runner.fp8
    if runner.use_mla_backend:
        kv = _values(runner.kv_buffer[layer_id], slots, k_scale, fp8)
        return kv[:, None, :], kv[:, None, :runner.kv_lora_rank]
    k = _values(runner.k_buffer[layer_id], slots, k_scale, fp8)
    v = _values(runner.v_buffer[layer_id], slots, v_scale, fp8)
    group = runner.num_q_heads // runner.num_kv_heads
    # q head h reads kv head h // group.
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           logit_cap: float = 0.0, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Softmax attention in float32 (float64 when ``k`` is float64).

    q: ``[m, H, D]``; k: ``[n, H or 1, D]``; v: ``[n, H or 1, D_v]``; mask: ``[m, n]`` bool
    (True = visible) or None. Returns ``[m, H, D_v]`` in ``k``'s dtype.
    """
    wide = torch.float64 if k.dtype == torch.float64 else torch.float32
    s = torch.einsum("mhd,nhd->hmn", q.to(wide), k.expand(-1, q.shape[1], -1)) * scaling
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    vv = v.expand(-1, q.shape[1], -1)
    if mask is None:
        return torch.einsum("hmn,nhd->mhd", p, vv)
    # A key a query does not see must not reach it, not even as 0 * NaN: non-finite values
    # are left out of the sum and reach exactly the queries that see them.
    finite = torch.isfinite(vv)
    out = torch.einsum("hmn,nhd->mhd", p, torch.where(finite, vv, 0.0))
    seen = torch.einsum("mn,nhd->mhd", mask.to(wide), (~finite).to(wide)) > 0
    return out.masked_fill(seen, float("nan"))


def out_shape(runner: DraftRunner, rows: int) -> tuple[int, int, int]:
    """``(rows, heads, value width)`` of an attention output for ``runner``'s model."""
    if runner.use_mla_backend:
        return rows, runner.num_heads, runner.kv_lora_rank
    return rows, runner.num_q_heads, runner.v_head_dim
