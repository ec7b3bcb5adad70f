"""A compact Llama forward (RMSNorm, rotate-half RoPE, GQA, SwiGLU, tied LM head).

Like ``specattn.demo.model``, the model owns no KV cache: each layer projects
``q [T, H_q, D]``, ``k, v [T, H_kv, D]`` (RoPE applied) and hands them to an
``attend(layer, q, k, v) -> o [T, H_q, D]`` callable. The draft passes a specattn backend's
``forward`` (which stores the KV in the paged pools and attends); the target passes its own
tree attention over a dense cache (``target.py``). ``num_layers`` lets the draft run only
the first ``N`` layers and then the final norm and LM head (early-exit self-speculation).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...data import AttentionLayer
from ..model import Attend, rope
from .weights import LlamaWeights

__all__ = ["Llama", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] -> [T, hidden], in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Llama:
    """Weights plus the forward; one object serves the draft (first N layers) and target."""

    def __init__(self, weights: LlamaWeights) -> None:
        self.w = weights
        self.cfg = weights.config
        scale = self.cfg.head_dim ** -0.5
        self.attn_layers = [AttentionLayer(i, scaling=scale) for i in range(self.cfg.num_layers)]

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    @property
    def device(self) -> torch.device:
        return self.w.device

    def block(self, i: int, x: torch.Tensor, positions: torch.Tensor,
              attend: Attend) -> torch.Tensor:
        """Layer ``i``: x: [T, hidden], positions: [T] -> [T, hidden]."""
        cfg, w, t = self.cfg, self.w.layers[i], x.shape[0]
        h = rms_norm(x, w["attn_norm"], cfg.rms_eps)
        q = (h @ w["wq"].T).view(t, cfg.num_q_heads, cfg.head_dim)
        k = (h @ w["wk"].T).view(t, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ w["wv"].T).view(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        o = attend(self.attn_layers[i], q.contiguous(), k.contiguous(), v.contiguous())
        x = x + o.reshape(t, -1).to(x.dtype) @ w["wo"].T
        h = rms_norm(x, w["ffn_norm"], cfg.rms_eps)
        gate = torch.nn.functional.silu(h @ w["w_gate"].T)
        return x + (gate * (h @ w["w_up"].T)) @ w["w_down"].T

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + tied LM head: x: [T, hidden] -> logits [T, vocab] in x's dtype."""
        return rms_norm(x, self.w.norm, self.cfg.rms_eps) @ self.w.embed.T

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
                num_layers: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions: [T] int -> (logits [T, vocab], hidden [T, hidden]) after the
        first ``num_layers`` layers (default all) and the final norm + head."""
        n = self.cfg.num_layers if num_layers is None else num_layers
        x = self.w.embed[ids]
        for i in range(n):
            x = self.block(i, x, positions, attend)
        return self.head(x), x
