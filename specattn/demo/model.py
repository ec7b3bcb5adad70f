"""A tiny EAGLE-style draft model with random weights, whose attention goes through specattn.

The model owns no KV cache: every attention layer projects ``q, k, v`` and hands them to an
``attend(layer, q, k, v) -> o`` callable, which is a specattn backend's ``forward`` (draft
extend or one draft-decode step). That is exactly the split a serving engine has: the model
computes projections, the backend stores KV in the runner's paged pools and attends.

Two attention flavours:

- MHA/GQA: ``q [T, H_q, D]``, ``k, v [T, H_kv, D]``, RoPE (rotate-half) on ``q`` and ``k``.
- MLA with absorbed queries (DeepSeek style): the cache holds one latent row per token,
  ``[c (kv_lora_rank) | k_pe (rope)]``; ``q_nope`` is multiplied into the latent space by
  ``W_UK`` so the backend sees ``q [T, H, kv_lora_rank + rope]`` and returns the latent output
  ``[T, H, kv_lora_rank]``, which ``W_UV`` maps back to per-head values.

The input of each position is ``fc([embed(token) | hidden])`` as in EAGLE, where ``hidden`` is
the draft's own last hidden state of the parent token (zeros where there is none: the demo
has no target model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..data import AttentionLayer

__all__ = ["ModelConfig", "DraftModel", "Attend"]

# attend(layer, q, k, v) -> o; see the module docstring for the shapes.
Attend = Callable[[AttentionLayer, torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
                  torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the draft model. MHA fields are used when ``mla`` is False, MLA fields else."""

    vocab_size: int = 256
    hidden: int = 128
    num_layers: int = 2
    mla: bool = False
    # MHA / GQA
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    # MLA
    num_heads: int = 4
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rope_theta: float = 10000.0
    # Sharper logits make the random model's top-k trees less uniform.
    logit_scale: float = 3.0


def _linear(fan_in: int, fan_out: int, gen: torch.Generator) -> nn.Parameter:
    w = torch.randn(fan_out, fan_in, generator=gen) / math.sqrt(fan_in)
    return nn.Parameter(w, requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, ..., d] (d even); positions: [T] int."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    shape = (ang.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class GQAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, gen: torch.Generator) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden, cfg.head_dim
        self.wq = _linear(h, cfg.num_q_heads * d, gen)
        self.wk = _linear(h, cfg.num_kv_heads * d, gen)
        self.wv = _linear(h, cfg.num_kv_heads * d, gen)
        self.wo = _linear(cfg.num_q_heads * d, h, gen)
        self.layer = AttentionLayer(layer_id, scaling=d ** -0.5)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        cfg, t = self.cfg, x.shape[0]
        q = (x @ self.wq.T).view(t, cfg.num_q_heads, cfg.head_dim)
        k = (x @ self.wk.T).view(t, cfg.num_kv_heads, cfg.head_dim)
        v = (x @ self.wv.T).view(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        o = attend(self.layer, q.contiguous(), k.contiguous(), v.contiguous())
        return o.reshape(t, -1) @ self.wo.T


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, gen: torch.Generator) -> None:
        super().__init__()
        self.cfg = cfg
        h, nh, r = cfg.hidden, cfg.num_heads, cfg.kv_lora_rank
        nope, rp = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.wq = _linear(h, nh * (nope + rp), gen)
        self.w_dkv = _linear(h, r, gen)        # down-projection to the latent c
        self.w_kr = _linear(h, rp, gen)        # shared rotary key
        self.kv_norm = RMSNorm(r)
        # Up-projections, kept per head so they can be absorbed: k_nope = W_UK c, v = W_UV c.
        self.w_uk = nn.Parameter(torch.randn(nh, nope, r, generator=gen) / math.sqrt(r),
                                 requires_grad=False)
        self.w_uv = nn.Parameter(torch.randn(nh, r, cfg.v_head_dim, generator=gen)
                                 / math.sqrt(r), requires_grad=False)
        self.wo = _linear(nh * cfg.v_head_dim, h, gen)
        self.layer = AttentionLayer(layer_id, scaling=(nope + rp) ** -0.5)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; the backend sees absorbed queries and latents."""
        cfg, t = self.cfg, x.shape[0]
        nope = cfg.qk_nope_head_dim
        q = (x @ self.wq.T).view(t, cfg.num_heads, nope + cfg.qk_rope_head_dim)
        q_nope, q_pe = q[..., :nope], rope(q[..., nope:], positions, cfg.rope_theta)
        c = self.kv_norm(x @ self.w_dkv.T)                              # [T, R]
        k_pe = rope(x @ self.w_kr.T, positions, cfg.rope_theta)          # [T, rope]
        # q_nope . (W_UK c) == (q_nope W_UK) . c: the attention never expands the latent.
        q_lat = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)         # [T, H, R]
        q_abs = torch.cat([q_lat, q_pe], dim=-1).contiguous()
        latent = torch.cat([c, k_pe], dim=-1).contiguous()               # [T, R + rope]
        o_lat = attend(self.layer, q_abs, latent, None)                  # [T, H, R]
        o = torch.einsum("thr,hrv->thv", o_lat, self.w_uv)
        return o.reshape(t, -1) @ self.wo.T


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, gen: torch.Generator) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = (MLAAttention if cfg.mla else GQAAttention)(cfg, layer_id, gen)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.w_gate = _linear(cfg.hidden, 2 * cfg.hidden, gen)
        self.w_up = _linear(cfg.hidden, 2 * cfg.hidden, gen)
        self.w_down = _linear(2 * cfg.hidden, cfg.hidden, gen)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, attend)
        h = self.mlp_norm(x)
        return x + (nn.functional.silu(h @ self.w_gate.T) * (h @ self.w_up.T)) @ self.w_down.T


class DraftModel(nn.Module):
    """Embedding + EAGLE input fusion + ``num_layers`` blocks + RMSNorm + LM head."""

    def __init__(self, cfg: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden, generator=gen),
                                  requires_grad=False)
        self.fc = _linear(2 * cfg.hidden, cfg.hidden, gen)
        self.blocks = nn.ModuleList(Block(cfg, i, gen) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = _linear(cfg.hidden, cfg.vocab_size, gen)
        self.to(device=device, dtype=dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                hidden_in: Optional[torch.Tensor], attend: Attend,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions: [T] int; hidden_in: [T, hidden] or None (zeros).

        Returns ``logits [T, vocab]`` (float32) and the last hidden states ``[T, hidden]``."""
        emb = self.embed[ids]
        if hidden_in is None:
            hidden_in = torch.zeros_like(emb)
        x = torch.cat([emb, hidden_in.to(emb.dtype)], dim=-1) @ self.fc.T
        for block in self.blocks:
            x = block(x, positions, attend)
        logits = (self.norm(x) @ self.lm_head.T).float() * self.cfg.logit_scale
        return logits, x
