"""The plain-torch attention math of the reference backends (``torch_ref``,
``torch_ref_sparse``): float32 softmax attention and the pool gathers feeding it. Slow and
obviously correct; no Triton."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from ..data import DraftRunner

__all__ = ["attend", "gather_kv", "out_shape"]


def gather_kv(runner: DraftRunner, layer_id: int,
              slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``slots [n]`` in float32, heads expanded to the query heads.

    MHA: ``k [n, H_q, D]``, ``v [n, H_q, D_v]``. MLA: ``k [n, 1, R + rope]`` (the whole
    latent row), ``v [n, 1, R]`` (its first ``kv_lora_rank`` columns).
    """
    slots = slots.long()
    if runner.use_mla_backend:
        kv = runner.kv_buffer[layer_id][slots].float()
        return kv[:, None, :], kv[:, None, :runner.kv_lora_rank]
    k = runner.k_buffer[layer_id][slots].float()
    v = runner.v_buffer[layer_id][slots].float()
    group = runner.num_q_heads // runner.num_kv_heads
    # q head h reads kv head h // group.
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           logit_cap: float = 0.0, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Softmax attention in float32.

    q: ``[m, H, D]``; k: ``[n, H or 1, D]``; v: ``[n, H or 1, D_v]``; mask: ``[m, n]`` bool
    (True = visible) or None. Returns ``[m, H, D_v]`` float32.
    """
    s = torch.einsum("mhd,nhd->hmn", q.float(), k.expand(-1, q.shape[1], -1)) * scaling
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
    seen = torch.einsum("mn,nhd->mhd", mask.float(), (~finite).float()) > 0
    return out.masked_fill(seen, float("nan"))


def out_shape(runner: DraftRunner, rows: int) -> tuple[int, int, int]:
    """``(rows, heads, value width)`` of an attention output for ``runner``'s model."""
    if runner.use_mla_backend:
        return rows, runner.num_heads, runner.kv_lora_rank
    return rows, runner.num_q_heads, runner.v_head_dim
