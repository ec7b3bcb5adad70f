"""Sparse and windowed references: the executable form of the ``dsa`` and ``dsv4`` rows.

Plain torch, float32, Python loops over lanes / tokens, like ``torch_ref`` (whose ``attend``
and pool gathers, ``specattn.kernels.reference``, this module uses too). The ``dsa`` and
``dsv4`` kernels are tested against these functions only. Nothing here writes to a pool.

``dsa`` (DeepSeek V3.2 sparse MLA, exotic-rows.md 1.1). Lightning-indexer score of prefix
position ``x`` for a query with index heads ``q_idx [nh, d]`` and head weights ``w [nh]``::

    I[x] = sum_h w[h] * relu(q_idx[h] . k_idx[R_b[x]])

(bf16/fp16/fp32 keys; the FP8 scales of upstream fold into ``w`` and the keys). A query keeps
the ``min(index_topk, n)`` best of its ``n`` candidate positions (a set: order is not
semantic), then attends MLA-style (score ``q . [c | k_pe]``, value ``c``) to them.

- decode, lane ``(b, j)`` at step ``i``: candidates ``R_b[0 : L_b]`` (the committed prefix);
  the lane's draft history (``i + 1`` slots, ``lane`` or ``path`` mode) is always attended
  in addition. Upstream attends the prefix only (exotic-rows.md 0.1); specattn's draft
  semantics attend the history too.
- extend, new token ``t`` of request ``b`` at position ``p = L'_b - E_b + t``: candidates
  ``R_b[0 : p + 1]`` (causal, itself included), as upstream's indexer.
- without index inputs every candidate is kept (dense MLA; right when ``n <= index_topk``).

``dsv4`` (DeepSeek V4 MTP layer, exotic-rows.md 2.2). Single-KV-head attention with keys
equal to values (one ``D``-wide vector per slot), a sliding window of ``W`` keys and a
per-head sink ``s_h``::

    o_h = softmax(scale * q_h . K) K * exp(lse_h) / (exp(lse_h) + exp(s_h))

- decode, lane ``(b, j)`` at step ``i``: the key sequence is the prefix ``R_b[0 : L_b]``
  followed by the lane's history ``h_0 .. h_i`` (positions ``L_b .. L_b + i``, the last one
  being the query's own token); the window is its last ``W`` keys, positions
  ``max(0, L_b + i + 1 - W) .. L_b + i``. Upstream's graph path shares one window ending at
  ``L_b - 1`` across steps (exotic-rows.md 0.1); specattn's window moves with the step.
- extend, token at position ``p``: ``R_b[max(0, p + 1 - W) : p + 1]``.
- ``s_h = -inf`` (or no sink) gives plain attention, ``+inf`` gives zeros.

Key pool for ``dsv4``: MLA runner with ``qk_rope_head_dim == 0`` (``kv_buffer [slots, D]``)
or MHA runner with one KV head (``k_buffer [slots, 1, D]``; ``v_buffer`` is not read).

FP8 pools (``runner.kv_layout``: ``fp8_ds_mla`` for ``dsa``, ``fp8_ds_v4`` for ``dsv4``;
``specattn.kv_layouts``): the reference is "dequantize, then exact attention": every key row is
read through the layout's ``read`` (float32) and the math above runs unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .. import metadata
from ..kernels.reference import attend, gather_kv, out_shape
from ..sink_window import window_key_pool

if TYPE_CHECKING:
    from ..data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner

__all__ = [
    "index_scores", "select_positions", "reference_dsa_decode", "reference_dsa_extend",
    "dsa_decode_selection", "dsa_extend_selection", "window_key_pool", "window_rows",
    "latent_rows", "sink_attend", "reference_window_decode", "reference_window_extend",
]


def latent_rows(runner: "DraftRunner", layer_id: int, slots: torch.Tensor) -> torch.Tensor:
    """The MLA pool's rows ``[n, R + rope]`` float32 of ``slots [n]``; an FP8 pool
    (``runner.kv_layout``) is dequantized (``specattn.kv_layouts``)."""
    pool = runner.kv_buffer[layer_id]
    if getattr(runner, "kv_layout", None) is not None:
        return runner.kv_layout.read(pool, slots)
    return pool[slots.long()].float()


def _mla_kv(runner: "DraftRunner", layer_id: int, slots: torch.Tensor):
    """``gather_kv`` for MLA runners, FP8 pools included: ``k [n, 1, R + rope]``,
    ``v [n, 1, R]`` float32."""
    if getattr(runner, "kv_layout", None) is None:
        return gather_kv(runner, layer_id, slots)
    kv = latent_rows(runner, layer_id, slots)
    return kv[:, None, :], kv[:, None, :runner.kv_lora_rank]


# --- dsa --------------------------------------------------------------------------------------


def index_scores(index_q: torch.Tensor, index_weights: torch.Tensor,
                 index_keys: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores in float32.

    index_q: ``[m, nh, d]``; index_weights: ``[m, nh]``; index_keys: ``[n, d]`` → ``[m, n]``.
    """
    s = torch.einsum("mhd,nd->mhn", index_q.float(), index_keys.float()).relu()
    return torch.einsum("mhn,mh->mn", s, index_weights.float())


def select_positions(scores: torch.Tensor, index_topk: int) -> torch.Tensor:
    """Positions of the ``min(index_topk, n)`` largest of ``scores [n]``, ascending."""
    k = min(index_topk, scores.shape[0])
    return torch.topk(scores, k).indices.sort().values


def _selected(runner, req: int, n: int, index_topk: int, index_pool, idx_q, idx_w):
    """Positions ``[0, n)`` of request row ``req`` a query keeps (all without index inputs)."""
    if idx_q is None or n <= index_topk:
        return torch.arange(n, device=runner.req_to_token.device)
    keys = index_pool[runner.req_to_token[req, :n].long()]
    return select_positions(index_scores(idx_q[None], idx_w[None], keys)[0], index_topk)


def dsa_decode_selection(runner: "DraftRunner", batch: "DraftBatch", index_topk: int,
                         index_pool: Optional[torch.Tensor] = None,
                         index_q: Optional[torch.Tensor] = None,
                         index_weights: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """Per lane ``z``, the prefix positions it keeps (ascending, int64).

    index_pool: the layer's index keys ``[num_slots, d]``; index_q ``[B*K, nh, d]``,
    index_weights ``[B*K, nh]``; all ``None`` = keep the whole prefix."""
    topk = batch.out_cache_loc.shape[1]
    out = []
    for z in range(batch.batch_size * topk):
        b = z // topk
        req, n = int(batch.req_pool_indices[b]), int(batch.seq_lens[b])
        out.append(_selected(runner, req, n, index_topk, index_pool,
                             None if index_q is None else index_q[z],
                             None if index_weights is None else index_weights[z]))
    return out


def dsa_extend_selection(runner: "DraftRunner", batch: "DraftExtendBatch", index_topk: int,
                         index_pool: Optional[torch.Tensor] = None,
                         index_q: Optional[torch.Tensor] = None,
                         index_weights: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """Per new token (request-major), the positions ``< p + 1`` it keeps."""
    out = []
    t_all = 0
    for b in range(batch.batch_size):
        req = int(batch.req_pool_indices[b])
        seq_len, ext = int(batch.seq_lens[b]), int(batch.extend_lens[b])
        for t in range(ext):
            n = seq_len - ext + t + 1
            out.append(_selected(runner, req, n, index_topk, index_pool,
                                 None if index_q is None else index_q[t_all],
                                 None if index_weights is None else index_weights[t_all]))
            t_all += 1
    return out


def reference_dsa_decode(runner: "DraftRunner", layer: "AttentionLayer", q: torch.Tensor,
                         batch: "DraftBatch", step: int, tree_mode: str = "lane", *,
                         index_topk: int, index_pool: Optional[torch.Tensor] = None,
                         index_q: Optional[torch.Tensor] = None,
                         index_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DSA draft decode of step ``step`` (MLA runner; no write).

    q: ``[B*K, H, R + rope]`` → ``[B*K, H, R]`` in ``q.dtype``. Lane ``z`` attends to its
    selected prefix slots and its ``step + 1`` history slots (module doc)."""
    bs, topk = batch.out_cache_loc.shape[:2]
    hist = metadata.history_slots(batch.out_cache_loc, batch.parents, step, tree_mode)
    sel = dsa_decode_selection(runner, batch, index_topk, index_pool, index_q, index_weights)
    out = torch.empty(out_shape(runner, bs * topk), dtype=q.dtype, device=q.device)
    for z in range(bs * topk):
        b, j = divmod(z, topk)
        row = runner.req_to_token[int(batch.req_pool_indices[b])]
        slots = torch.cat([row[sel[z]].long(), hist[b, j].long()])
        k, v = _mla_kv(runner, layer.layer_id, slots)
        out[z] = attend(q[z:z + 1], k, v, layer.scaling, layer.logit_cap)[0].to(q.dtype)
    return out


def reference_dsa_extend(runner: "DraftRunner", layer: "AttentionLayer", q: torch.Tensor,
                         batch: "DraftExtendBatch", *, index_topk: int,
                         index_pool: Optional[torch.Tensor] = None,
                         index_q: Optional[torch.Tensor] = None,
                         index_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DSA draft extend (no write). q: ``[T, H, R + rope]`` → ``[T, H, R]``."""
    sel = dsa_extend_selection(runner, batch, index_topk, index_pool, index_q, index_weights)
    out = torch.empty(out_shape(runner, q.shape[0]), dtype=q.dtype, device=q.device)
    t_all = 0
    for b in range(batch.batch_size):
        row = runner.req_to_token[int(batch.req_pool_indices[b])]
        for _ in range(int(batch.extend_lens[b])):
            k, v = _mla_kv(runner, layer.layer_id, row[sel[t_all]].long())
            out[t_all] = attend(q[t_all:t_all + 1], k, v, layer.scaling,
                                layer.logit_cap)[0].to(q.dtype)
            t_all += 1
    return out


# --- dsv4 -------------------------------------------------------------------------------------


def window_rows(runner: "DraftRunner", layer_id: int, slots: torch.Tensor) -> torch.Tensor:
    """Keys (= values) ``[n, D]`` float32 of ``slots [n]``, FP8 pools dequantized."""
    if getattr(runner, "kv_layout", None) is not None:
        return latent_rows(runner, layer_id, slots)
    return window_key_pool(runner, layer_id)[slots.long()].float()


def sink_attend(q: torch.Tensor, kv: torch.Tensor, scaling: float, logit_cap: float = 0.0,
                attn_sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One query row with a sink, float32. q: ``[H, D]``; kv: ``[n, D]`` (keys = values);
    attn_sink: ``[H]`` or None → ``[H, D]``."""
    s = q.float() @ kv.float().T * scaling  # [H, n]
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1) @ kv.float()
    if attn_sink is not None:
        # exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); sink = -inf gives 1.
        o = o * torch.sigmoid(lse - attn_sink.float())[:, None]
    return o


def reference_window_decode(runner: "DraftRunner", layer: "AttentionLayer", q: torch.Tensor,
                            batch: "DraftBatch", step: int, tree_mode: str = "lane", *,
                            window: int, attn_sink: Optional[torch.Tensor] = None,
                            ) -> torch.Tensor:
    """DSv4 draft decode of step ``step`` (no write). q: ``[B*K, H, D]`` → ``[B*K, H, D]``.

    Lane ``(b, j)`` sees the last ``window`` keys of ``R_b[0 : L_b] ++ history`` (module
    doc)."""
    bs, topk = batch.out_cache_loc.shape[:2]
    hist = metadata.history_slots(batch.out_cache_loc, batch.parents, step, tree_mode)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for z in range(bs * topk):
        b, j = divmod(z, topk)
        seq_len = int(batch.seq_lens[b])
        prefix = runner.req_to_token[int(batch.req_pool_indices[b]), :seq_len].long()
        slots = torch.cat([prefix, hist[b, j].long()])[-window:]
        out[z] = sink_attend(q[z], window_rows(runner, layer.layer_id, slots), layer.scaling,
                             layer.logit_cap, attn_sink).to(q.dtype)
    return out


def reference_window_extend(runner: "DraftRunner", layer: "AttentionLayer", q: torch.Tensor,
                            batch: "DraftExtendBatch", *, window: int,
                            attn_sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DSv4 draft extend (no write). q: ``[T, H, D]``; token at position ``p`` sees
    ``R_b[max(0, p + 1 - window) : p + 1]``."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    t_all = 0
    for b in range(batch.batch_size):
        row = runner.req_to_token[int(batch.req_pool_indices[b])]
        seq_len, ext = int(batch.seq_lens[b]), int(batch.extend_lens[b])
        for t in range(ext):
            p = seq_len - ext + t
            slots = row[max(0, p + 1 - window):p + 1].long()
            out[t_all] = sink_attend(q[t_all], window_rows(runner, layer.layer_id, slots),
                                     layer.scaling, layer.logit_cap, attn_sink).to(q.dtype)
            t_all += 1
    return out
