"""LSE merge in plain torch: the fallback of the Triton history + merge kernel where Triton
cannot run (MUSA, or a backend asked not to use it)."""

from __future__ import annotations

import torch

__all__ = ["merge_states"]


def merge_states(outs: list[torch.Tensor], lses: list[torch.Tensor],
                 dtype: torch.dtype) -> torch.Tensor:
    """Merge partial attention results over disjoint key sets by natural-log LSE.

    outs: each ``[N, H, D_v]``; lses: each ``[N, H]`` (natural log). A part with no keys may
    carry LSE ``-inf`` or ``+inf`` (FA2/FA3 convention) and any output: it gets weight 0.
    Returns ``[N, H, D_v]`` in ``dtype``. Device ops only (CUDA-graph safe).
    """
    lse = torch.stack([x.float() for x in lses])  # [n, N, H]
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("-inf")), lse)
    m = lse.amax(dim=0, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)  # 0 for empty parts
    acc = torch.zeros_like(outs[0], dtype=torch.float32)
    for i, o in enumerate(outs):
        wi = w[i].unsqueeze(-1)
        acc += torch.where(wi > 0, o.float() * wi, torch.zeros_like(acc))
    return (acc / w.sum(dim=0).unsqueeze(-1).clamp_min(1e-30)).to(dtype)
