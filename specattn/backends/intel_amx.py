"""``intel_amx``: the fast CPU backend, through torch ops (oneDNN picks AMX tiles when the
CPU has them, else AVX-512/AVX2 kernels).

Algorithm (draft decode, ``semantics.md``). All ``K`` lanes of a request share its prefix,
so the request's ``K * G`` queries of one KV head (``G = H_q / H_kv``; MLA: ``G = H`` and one
latent KV head) attend together, like one bigger GQA group. The keys of request ``b`` are::

    [ prefix R_b[0 : Lmax] (padded) | lane 0's S history slots | ... | lane K-1's S slots ]

and one ``scaled_dot_product_attention`` call per layer and step attends every lane with a
boolean mask: query row ``(j, g)`` sees the valid prefix and the first ``step + 1`` slots of
its own history block only. The prefix is therefore read once per step for all ``K`` lanes;
there is no Python loop over requests or lanes (ragged prefixes are padded and masked).

Plan step (``init_forward_metadata``, once per round): padded prefix slot table and mask
(``specattn.metadata``). Run step (``forward``): write the new KV, gather the lanes' history
(lane or path tree mode), attend. The gathered prefix is kept per layer for the round
(``cache_prefix=True``): it is committed KV that a round never writes, and each later step
then only gathers ``K * (step + 1)`` history rows per request.

Precision: bf16 and fp32 run SDPA in their own dtype (its CPU kernel accumulates in fp32);
fp16 runs in fp32 because CPUs without AVX512-FP16 have no fast fp16 math (fp16 SDPA measured
2-3x slower than fp32 on an AVX-512 EPYC; the conversion is paid once per round per layer with
the prefix cache). A logit soft-cap (``logit_cap > 0``) uses an explicit fp32
matmul/softmax path, since SDPA has no soft-cap. MLA passes the whole latent row as value
(SDPA's fast kernel wants equal key and value widths) and keeps the first ``kv_lora_rank``
output columns.

Draft extend: one masked call per layer over the batch padded to the longest extend and the
longest total length; query ``t`` of request ``b`` sees ``R_b[0 : L'_b - E_b + t + 1]``.

FP8 pools (``kv_cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"``): the gathers convert the codes
to the compute dtype (exact: every e4m3 and e5m2 value is a bf16 value) and the scales go to
the small side of each product: the query is multiplied by ``k_scale`` before the scores, the
output by ``v_scale`` (MLA: ``k_scale``) after them, so the cached prefix holds codes.

Limits: CPU tensors only; no CUDA graphs (the graph methods fill a round like an eager one).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from .._logging import get_logger
from ..base import DraftDecodeBackend, DraftExtendBackend
from ..fp8 import KV_DTYPES_WITH_FP8, layer_scales, scale_rows
from ..metadata import extend_token_slots, history_slots, prefix_token_slots
from ..platforms import Platform, is_cpu

if TYPE_CHECKING:
    from ..data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner

__all__ = ["IntelAMXDecode", "IntelAMXExtend"]

log = get_logger("backends.intel_amx")

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _runtime_note(platform: Platform) -> str:
    if platform.cpu_has_amx:
        return "AMX tiles used by oneDNN (bf16)"
    isa = torch.backends.cpu.get_cpu_capability() if platform.device == "cpu" else "?"
    return f"no AMX on this CPU: oneDNN {isa} kernels"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp16 has no fast CPU math without AVX512-FP16: compute in fp32 (see module doc).
    return torch.float32 if dtype == torch.float16 else dtype


# --- attention ------------------------------------------------------------------------------

def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float, logit_cap: float, check_from: int = 0) -> torch.Tensor:
    """Masked attention, one call for the whole batch.

    q: ``[B, H_kv, M, E]``; keys: ``[B, H_kv, Lk, E]``; values: ``[B, H_kv, Lk, Ev]``;
    mask: ``[B, 1, M, Lk]`` bool (True = attend; every row has at least one True).
    ``check_from``: the first key column some row does not see (columns before it are seen
    by every row, or hold zeros). Returns ``[B, H_kv, M, Ev]`` in ``q``'s dtype.

    A key a row does not see must not reach it, but SDPA adds the mask to the scores and
    ``0 * NaN`` is NaN: non-finite keys/values from ``check_from`` on are zeroed first and the
    rows that do see one come out NaN, as in the reference.
    """
    seen_bad = None
    tail_k, tail_v = keys[:, :, check_from:], values[:, :, check_from:]
    bad = ~(torch.isfinite(tail_k).all(-1) & torch.isfinite(tail_v).all(-1))  # [B, H, n]
    if bool(bad.any()):
        keys, values = keys.clone(), values.clone()
        keys[:, :, check_from:].masked_fill_(bad[..., None], 0)
        values[:, :, check_from:].masked_fill_(bad[..., None], 0)
        seen_bad = (mask[..., check_from:] & bad[:, :, None, :]).any(-1)  # [B, H, M]
    if logit_cap <= 0:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    else:  # SDPA has no soft-cap: explicit fp32 scores.
        scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)).mul_(scale)
        scores = torch.tanh(scores.div_(logit_cap)).mul_(logit_cap)
        scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values.float()).to(q.dtype)
    return out if seen_bad is None else out.masked_fill(seen_bad[..., None], float("nan"))


def _group_queries(q: torch.Tensor, bs: int, rows: int, num_kv_heads: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """q: ``[bs * rows, H_q, E]`` → ``[bs, H_kv, rows * G, E]`` (row ``r * G + g``)."""
    heads, width = q.shape[1], q.shape[2]
    group = heads // num_kv_heads
    q = q.reshape(bs, rows, num_kv_heads, group, width).permute(0, 2, 1, 3, 4)
    return q.to(dtype).reshape(bs, num_kv_heads, rows * group, width)


def _ungroup(o: torch.Tensor, rows: int, out_dtype: torch.dtype) -> torch.Tensor:
    """o: ``[bs, H_kv, rows * G, Ev]`` → ``[bs * rows, H_kv * G, Ev]``."""
    bs, kv_heads, _, width = o.shape
    o = o.view(bs, kv_heads, rows, -1, width).permute(0, 2, 1, 3, 4)
    return o.reshape(bs * rows, -1, width).to(out_dtype)


class _Workspace:
    """Growing flat buffers handed out as views: one is reused while it is big enough, so
    steady-state calls neither allocate nor page-fault fresh memory (measured: a fresh
    gather output costs about twice the gather). Grows with 25% headroom because prefix
    lengths grow a little every round."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flat: dict[object, torch.Tensor] = {}

    def get(self, key: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        flat = self._flat.get(key)
        if flat is None or flat.dtype != dtype or flat.numel() < n:
            flat = torch.empty(n + n // 4, dtype=dtype, device=self.device)
            self._flat[key] = flat
            log.debug("workspace %s: %.1f MB", key, flat.numel() * flat.element_size() / 2**20)
        return flat[:n].view(shape)


class _Pools:
    """One runner's pools as this backend reads them (MLA: one latent KV head)."""

    def __init__(self, runner: "DraftRunner") -> None:
        self.runner = runner
        self.mla = runner.use_mla_backend
        self.fp8 = runner.fp8
        self.num_kv_heads = 1 if self.mla else runner.num_kv_heads
        # Query heads per KV head: MLA's latent row is one KV head for all heads.
        self.group = runner.num_heads if self.mla else runner.num_q_heads // runner.num_kv_heads
        self.v_width = runner.kv_lora_rank if self.mla else runner.v_head_dim
        self.dtype = _compute_dtype(runner.dtype)
        self.ws = _Workspace(runner.device)

    def pools(self, layer_id: int) -> list[torch.Tensor]:
        """``[k_pool]`` (MLA: the latent pool as ``[num_slots, 1, W]``) or ``[k_pool, v_pool]``,
        each ``[num_slots, H_kv, width]``."""
        if self.mla:
            return [self.runner.kv_buffer[layer_id].unsqueeze(1)]
        return [self.runner.k_buffer[layer_id], self.runner.v_buffer[layer_id]]

    def buffers(self, key: object, layer_id: int,
                shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value workspaces of ``shape + (width,)`` in the compute dtype; MLA's value
        is its key buffer (the value is the first ``kv_lora_rank`` columns of the latent)."""
        keys = self.ws.get((key, "k"), shape + (self.pools(layer_id)[0].shape[-1],),
                           self.dtype)
        if self.mla:
            return keys, keys
        return keys, self.ws.get((key, "v"), shape + (self.v_width,), self.dtype)

    def rows(self, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``pool[slots]`` as ``[n, H_kv, width]`` in a reused staging buffer."""
        out = self.ws.get("stage", (slots.numel(),) + tuple(pool.shape[1:]), pool.dtype)
        return torch.index_select(pool, 0, slots.reshape(-1), out=out)

    def attend(self, layer: "AttentionLayer", q: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, mask: torch.Tensor, check_from: int = 0) -> torch.Tensor:
        """``_attend`` over buffers of pool values: FP8 buffers hold codes, so the query is
        scaled by ``k_scale`` first and the output by ``v_scale`` after (module doc).
        Returns the first ``v_width`` output columns."""
        k_scale, v_scale = layer_scales(layer, self.mla) if self.fp8 else (1.0, 1.0)
        o = _attend(scale_rows(q, k_scale), keys, values, mask, layer.scaling,
                    layer.logit_cap, check_from)
        return scale_rows(o[..., :self.v_width], v_scale)


def _copy_grouped(dst: torch.Tensor, rows: torch.Tensor, lead: tuple[int, ...]) -> None:
    """``dst [B, H_kv, *lead[1:], E] <- rows [prod(lead), H_kv, E]`` (converting dtype)."""
    nd = len(lead)
    perm = (0, nd) + tuple(range(1, nd)) + (nd + 1,)
    dst.copy_(rows.view(lead + tuple(rows.shape[1:])).permute(perm))


# --- draft decode -----------------------------------------------------------------------------

class IntelAMXDecode(DraftDecodeBackend, name="intel_amx", platforms=is_cpu,
                     kernel_library="torch (oneDNN)", priority={"cpu": 50}):
    """Multi-step draft decode on CPU with a shared-prefix batched SDPA (see module doc)."""

    dtypes = _DTYPES
    kv_cache_dtypes = KV_DTYPES_WITH_FP8
    tested_on = "CPU (x86-64 AVX-512, no AMX)"

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane", cache_prefix: bool = True) -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        self.cache_prefix = cache_prefix
        self._pools = _Pools(runner)
        # Layers whose key/value buffers [B, H_kv, Lmax + K*S, E] hold this round's prefix.
        self._filled: set[int] = set()
        self._masks: dict[int, torch.Tensor] = {}

    @classmethod
    def runtime_note(cls, platform: Platform, request=None) -> str:
        return _runtime_note(platform)

    def _plan(self, batch: "DraftBatch") -> None:
        """Padded prefix slot table and mask for the round (history is per step)."""
        # Padded entries hold slot 0: they index the pool and are masked out of the scores.
        self._prefix_slots, self._prefix_mask = prefix_token_slots(
            self.runner.req_to_token, batch.req_pool_indices, batch.seq_lens,
            num_slots=self.runner.num_slots)
        self._pad = (~self._prefix_mask).nonzero(as_tuple=True)
        self._filled = set()
        self._masks = {}

    def _mask(self, step: int) -> torch.Tensor:
        """``[B, 1, K*G, Lmax + K*S]`` bool: row ``(j, g)`` sees the valid prefix and the first
        ``step + 1`` slots of history block ``j``. Built once per step, shared by layers."""
        mask = self._masks.get(step)
        if mask is not None:
            return mask
        bs, max_len = self._prefix_mask.shape
        topk, steps, group = self.topk, self.num_steps, self._pools.group
        dev = self._prefix_mask.device
        row_lane = torch.arange(topk, device=dev).repeat_interleave(group)  # [K*G]
        col = torch.arange(topk * steps, device=dev)
        hist = (col[None, :] // steps == row_lane[:, None]) & (col[None, :] % steps <= step)
        mask = torch.cat([self._prefix_mask[:, None, None, :].expand(bs, 1, topk * group,
                                                                     max_len),
                          hist[None, None].expand(bs, 1, -1, -1)], dim=-1)
        self._masks[step] = mask
        return mask

    def _kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's key/value buffers ``[B, H_kv, Lmax + K*S, E]`` with the prefix in
        place (gathered on the layer's first step of the round when caching)."""
        pools = self._pools
        bs, max_len = self._prefix_slots.shape
        shape = (bs, pools.num_kv_heads, max_len + self.topk * self.num_steps)
        # Without the cache every layer and step refills one shared pair of buffers.
        keys, values = pools.buffers(layer_id if self.cache_prefix else 0, layer_id, shape)
        if layer_id in self._filled:
            return keys, values
        pad_b, pad_x = self._pad
        for buf, pool in zip((keys, values), pools.pools(layer_id)):
            _copy_grouped(buf[:, :, :max_len], pools.rows(pool, self._prefix_slots),
                          (bs, max_len))
            # Masked keys get probability 0, but 0 * NaN is NaN: padded positions (slot 0
            # may hold anything) and history slots not reached yet must hold finite values.
            buf[pad_b, :, pad_x] = 0
            buf[:, :, max_len:] = 0
        if self.cache_prefix:
            self._filled.add(layer_id)
        return keys, values

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        """q: ``[B*K, H_q, E]`` → ``[B*K, H_q, Ev]`` (MLA: ``[B*K, H, kv_lora_rank]``)."""
        batch, topk, steps, pools = self.batch, self.topk, self.num_steps, self._pools
        bs = self._prefix_slots.shape[0]
        lid = layer.layer_id
        keys, values = self._kv(lid)
        # History block j of request b: keys Lmax + j*S + t, filled for t <= step.
        hist = history_slots(batch.out_cache_loc, batch.parents, step, self.tree_mode).long()
        max_len = self._prefix_slots.shape[1]
        for buf, pool in zip((keys, values), pools.pools(lid)):
            tail = buf[:, :, max_len:].unflatten(2, (topk, steps))[:, :, :, :step + 1]
            _copy_grouped(tail, pool.index_select(0, hist.reshape(-1)), tuple(hist.shape))

        qg = _group_queries(q, bs, topk, pools.num_kv_heads, pools.dtype)
        o = pools.attend(layer, qg, keys, values, self._mask(step),
                         check_from=max_len)  # the prefix is seen by every row of its request
        return _ungroup(o, topk, self.runner.dtype)


# --- draft extend -----------------------------------------------------------------------------

class IntelAMXExtend(DraftExtendBackend, name="intel_amx", platforms=is_cpu,
                     kernel_library="torch (oneDNN)", priority={"cpu": 50}):
    """Draft extend on CPU: one causal masked SDPA per layer over the padded batch."""

    dtypes = _DTYPES
    kv_cache_dtypes = KV_DTYPES_WITH_FP8
    tested_on = "CPU (x86-64 AVX-512, no AMX)"

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self._pools = _Pools(runner)

    @classmethod
    def runtime_note(cls, platform: Platform, request=None) -> str:
        return _runtime_note(platform)

    def _plan(self, batch: "DraftExtendBatch") -> None:
        """Padded key slots/mask ``[B, Lmax]``, causal mask ``[B, 1, Emax*G, Lmax]`` and the
        padded row of every token."""
        meta = extend_token_slots(self.runner.req_to_token, batch.req_pool_indices,
                                  batch.seq_lens, batch.extend_lens,
                                  num_slots=self.runner.num_slots)
        max_ext = int(batch.extend_lens.max())
        dev = meta.slots.device
        # Token i (query t of request b) sits in padded row b * Emax + t.
        self._rows = meta.token_req * max_ext + meta.token_pos
        self._max_ext = max_ext
        # Query t sees keys x < L' - E + t + 1; padded queries (t >= E) see every valid key,
        # so no row is fully masked.
        visible = meta.prefix_lens[:, None] + torch.arange(max_ext, device=dev) + 1
        col = torch.arange(meta.slots.shape[1], device=dev)
        causal = (col[None, None, :] < visible[:, :, None]) & meta.valid[:, None, :]
        # [B, 1, Emax * G, Lmax], row t * G + g.
        self._mask = causal.repeat_interleave(self._pools.group, dim=1)[:, None]
        self._slots = meta.slots
        self._pad = (~meta.valid).nonzero(as_tuple=True)

    def _attend(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        """q: ``[T, H_q, E]`` (``T = sum(extend_lens)``); returns ``[T, H_q, Ev]``."""
        lid = layer.layer_id
        pools = self._pools
        bs, max_len = self._slots.shape
        # Keys in the pool's own layout [B, Lmax, H_kv, E], gathered straight into the
        # workspace; SDPA reads them through a transposed view (measured cheaper than a
        # permuting copy for a one-shot call).
        keys, values = pools.buffers("extend", lid, (bs, max_len, pools.num_kv_heads))
        pad_b, pad_x = self._pad
        for buf, pool in zip((keys, values), pools.pools(lid)):
            flat = buf.view((bs * max_len,) + tuple(buf.shape[2:]))
            if buf.dtype == pool.dtype:
                torch.index_select(pool, 0, self._slots.reshape(-1), out=flat)
            else:
                flat.copy_(pools.rows(pool, self._slots))
            buf[pad_b, pad_x] = 0  # 0 * NaN is NaN: padded keys must be finite
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)

        q_pad = q.new_zeros(bs * self._max_ext, q.shape[1], q.shape[2])
        q_pad[self._rows] = q
        qg = _group_queries(q_pad, bs, self._max_ext, pools.num_kv_heads, pools.dtype)
        o = pools.attend(layer, qg, keys, values, self._mask)
        return _ungroup(o, self._max_ext, self.runner.dtype)[self._rows]
