"""The target model's side: a dense KV cache and tree attention with an ancestor mask.

Verification is not specattn's job (``semantics.md`` covers the draft phase only), so this is
plain torch: each request keeps the target KV of its committed tokens in one contiguous
buffer, and a verification forward attends every tree row to that prefix plus the rows it
may see (its ancestors and itself), given as a dense boolean matrix.

Every target forward, the plain greedy reference's included, goes through ``forward_rows``:
a prompt prefill is a "tree" with a causal mask, a plain decode step a one-row tree. The
target runs in float64 so that the tree-verify forward and the plain forward, whose matmuls
and softmax reductions have different shapes, agree far below any argmax margin.
"""

from __future__ import annotations

from typing import Optional

import torch

from .llama import Llama

__all__ = ["TargetCache"]


class TargetCache:
    """Committed target KV of ``batch`` requests and the forward over new rows.

    k, v: ``[num_layers, batch, max_len, H_kv, D]`` on the model's device; lens: ``[batch]``
    committed rows. The last committed *token* of a request has no KV yet: it is the root of
    the next tree. Inputs may live on any device; they are moved to the model's.
    """

    def __init__(self, model: Llama, batch: int, max_len: int) -> None:
        cfg = model.cfg
        self.model = model
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.device = model.device
        self.k = torch.zeros(shape, dtype=model.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=model.dtype, device=self.device)
        self.lens = [0] * batch
        self.max_len = max_len
        self._new_k: Optional[torch.Tensor] = None  # [num_layers, T, H_kv, D] of the last call
        self._new_v: Optional[torch.Tensor] = None
        self._offsets: list[int] = []

    @torch.inference_mode()
    def forward_rows(self, ids: list[torch.Tensor], depths: list[torch.Tensor],
                     visible: list[torch.Tensor]) -> list[torch.Tensor]:
        """One target forward over new rows of every request; the cache is not changed.

        ids[b]: ``[T_b]`` tokens; depths[b]: ``[T_b]`` offset of each row's position from
        ``lens[b]``; visible[b]: ``[T_b, T_b]`` bool, row ``r`` sees new row ``c`` (its
        ancestors and itself) besides the whole committed prefix. Returns logits
        ``[T_b, vocab]`` per request (model dtype). ``commit`` then keeps chosen rows' KV.
        """
        cfg = self.model.cfg
        sizes = [int(t.numel()) for t in ids]
        self._offsets = [0]
        for n in sizes:
            self._offsets.append(self._offsets[-1] + n)
        for b, n in enumerate(sizes):
            if self.lens[b] + n > self.max_len:
                raise RuntimeError(f"target cache of request {b} is full: {self.lens[b]} + {n} "
                                   f"rows > max_len {self.max_len}")
        dev = self.device
        visible = [m.to(dev) for m in visible]
        positions = torch.cat([self.lens[b] + d.to(dev).long() for b, d in enumerate(depths)])
        new_k, new_v = [], []
        group = cfg.num_q_heads // cfg.num_kv_heads

        def attend(layer, q, k, v):
            new_k.append(k)
            new_v.append(v)
            out = torch.empty_like(q)
            for b in range(len(sizes)):
                lo, hi, n = self._offsets[b], self._offsets[b + 1], self.lens[b]
                keys = torch.cat([self.k[layer.layer_id, b, :n], k[lo:hi]])
                vals = torch.cat([self.v[layer.layer_id, b, :n], v[lo:hi]])
                keys = keys.repeat_interleave(group, dim=1)    # [n + T_b, H_q, D]
                vals = vals.repeat_interleave(group, dim=1)
                s = torch.einsum("thd,nhd->htn", q[lo:hi], keys) * layer.scaling
                mask = torch.cat([visible[b].new_ones(hi - lo, n), visible[b]], dim=1)
                s = s.masked_fill(~mask[None], float("-inf"))
                out[lo:hi] = torch.einsum("htn,nhd->thd", torch.softmax(s, dim=-1), vals)
            return out

        logits, _ = self.model.forward(torch.cat(ids).to(dev), positions, attend)
        self._new_k, self._new_v = torch.stack(new_k), torch.stack(new_v)
        return [logits[self._offsets[b]:self._offsets[b + 1]] for b in range(len(sizes))]

    def commit(self, b: int, rows: list[int]) -> None:
        """Append the KV of new rows ``rows`` (indices into request ``b``'s rows of the last
        ``forward_rows``) to request ``b``'s committed cache, in that order."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.device) + self._offsets[b]
        n = self.lens[b]
        self.k[:, b, n:n + len(rows)] = self._new_k[:, idx]
        self.v[:, b, n:n + len(rows)] = self._new_v[:, idx]
        self.lens[b] = n + len(rows)

    def prefill(self, prompts: list[torch.Tensor]) -> None:
        """Commit every prompt token but the last (the first tree's root)."""
        ids = [p[:-1] for p in prompts]
        depths = [torch.arange(int(t.numel())) for t in ids]
        causal = [torch.ones(len(d), len(d), dtype=torch.bool).tril() for d in depths]
        self.forward_rows(ids, depths, causal)
        for b, t in enumerate(ids):
            self.commit(b, list(range(int(t.numel()))))
