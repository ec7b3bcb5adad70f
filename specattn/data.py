"""The data serving code hands to a backend: runner (pools + shape), layer, batches.

Shapes use the notation of ``semantics.md``: ``B`` requests, ``K = topk`` lanes per request,
``S = num_steps``; lane ``z = b * K + j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ._tensor_checks import (ACT_DTYPES, INDEX_DTYPES, _is_int, _last_dim_contiguous, _shape,
                             _tensor, debug_checks_enabled, dtype_name)
from .errors import InvalidInputError
from .fp8 import FP8_KV_DTYPES, Scale, check_scale, is_fp8_dtype, quantize, write_rows, zeros
from .keys import BackendRequest, Kind
from .kv_layouts import LAYOUT_NAMES, layout_for, rope_for_width
from .layer import AttentionLayer

__all__ = ["DraftRunner", "AttentionLayer", "DraftBatch", "DraftExtendBatch", "check_runner",
           "HOST_COPIES", "host_lengths"]

# The optional host copies of a batch's device lengths (field -> the device field it mirrors).
HOST_COPIES = {"seq_lens_cpu": "seq_lens", "extend_lens_cpu": "extend_lens"}


@dataclass
class DraftBatch:
    """One draft-decode round.

    req_pool_indices: ``[B]`` int, rows of ``req_to_token``.
    seq_lens: ``[B]`` int, committed KV length ``L_b`` of each request.
    out_cache_loc: ``[B, K, S]`` int, the KV slot lane ``(b, j)`` writes at step ``i``.
    parents: ``[S, B, K]`` int or ``None``; ``path`` tree mode only. ``parents[i, b, j]`` is
        the lane at step ``i - 1`` whose token is the parent of lane ``j``'s token at step
        ``i`` (row 0 is unused). The caller fills row ``i`` in place before step ``i`` runs,
        so one tensor serves a whole round and a captured CUDA graph.
    seq_lens_cpu: ``[B]`` int on the CPU or ``None``: the same values as ``seq_lens``, where
        the caller already has them on the host (SGLang's ``forward_batch.seq_lens_cpu``).
        A backend that plans on the host (``flashinfer``) reads its lengths from here;
        without it, it copies ``seq_lens`` to the host once per round, which waits for the
        device (``HOST_COPIES``).
    """

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    parents: Optional[torch.Tensor] = None
    seq_lens_cpu: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def topk(self) -> int:
        return int(self.out_cache_loc.shape[1])

    @property
    def num_steps(self) -> int:
        return int(self.out_cache_loc.shape[2])


@dataclass
class DraftExtendBatch:
    """One draft-extend batch (after verification).

    req_pool_indices: ``[B]`` int.
    seq_lens: ``[B]`` int, ``L'_b``: committed length *including* the new tokens.
    extend_lens: ``[B]`` int, ``E_b >= 1`` new tokens per request.
    out_cache_loc: ``[sum(E)]`` int, slots of the new tokens, request-major.
    seq_lens_cpu, extend_lens_cpu: ``[B]`` int on the CPU or ``None``: host copies of
        ``seq_lens`` / ``extend_lens`` (as ``DraftBatch.seq_lens_cpu``).
    """

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_cpu: Optional[torch.Tensor] = None
    extend_lens_cpu: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])


def host_lengths(batch, *fields: str) -> list[torch.Tensor]:
    """``batch``'s length fields (``"seq_lens"``, ``"extend_lens"``) on the host, int64: each
    from its host copy (``<field>_cpu``) where the batch has one, and the missing ones copied
    from the device together, in one transfer. That copy waits for the device's queued work
    (a sync), the one fallback of a backend that plans on the host; engines that keep host
    copies (SGLang) give them and avoid it."""
    out: list[Optional[torch.Tensor]] = []
    missing: list[int] = []
    for i, name in enumerate(fields):
        host = getattr(batch, name + "_cpu", None)
        if host is None:
            missing.append(i)
            out.append(None)
        else:  # (a dtype test costs less host time than a no-op ``to``)
            out.append(host if host.dtype == torch.int64 else host.to(torch.int64))
    if missing:
        rows = [getattr(batch, fields[i]).to(torch.int64) for i in missing]
        copied = (rows[0] if len(rows) == 1 else torch.stack(rows)).to("cpu")
        for n, i in enumerate(missing):
            out[i] = copied if len(rows) == 1 else copied[n]
    return out  # type: ignore[return-value]


class DraftRunner:
    """The draft model's attention shape and the KV pools it owns or wraps.

    MHA/GQA pools: ``k_buffer[layer] [num_slots, num_kv_heads, head_dim]`` and
    ``v_buffer[layer] [num_slots, num_kv_heads, v_head_dim]``. MLA pool:
    ``kv_buffer[layer] [num_slots, kv_lora_rank + qk_rope_head_dim]`` (compressed KV ``c``
    first, then the rotary key). ``req_to_token [max_reqs, max_context_len]`` int32 maps a
    request's token positions to slots. Slot ``s`` lies in page ``s // page_size``.
    ``kv_cache_dtype`` (one of ``kv_layouts.KV_CACHE_DTYPES``): ``"auto"``, pools of the model's
    dtype. ``"fp8_e4m3"`` / ``"fp8_e5m2"``: pools of the same shapes in
    ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (``runner.fp8``; ``specattn.fp8``); a
    ``uint8`` pool (SGLang's storage of the same bytes) is viewed as that dtype, no copy.
    ``"fp8_ds_mla"`` / ``"fp8_ds_v4"`` (MLA only): ``kv_buffer[layer]`` is a uint8
    ``[num_slots, bytes_per_token]`` pool in that FP8 layout (``runner.kv_layout``,
    ``specattn.kv_layouts``). ``write_kv`` quantizes into either kind of FP8 pool.
    ``runner.kv_dtype`` is the dtype of the pools as backends read them.

    Build one with ``DraftRunner.mha(...)`` / ``DraftRunner.mla(...)`` (allocates zeroed
    pools) or ``DraftRunner.wrap_mha(...)`` / ``wrap_mla(...)`` (uses an engine's tensors,
    no copy).
    """

    # The shape fields and pools of the other model type (MLA's on an MHA runner and the
    # reverse) are None.
    num_q_heads: Optional[int]
    num_kv_heads: Optional[int]
    head_dim: Optional[int]
    v_head_dim: Optional[int]
    k_buffer: Optional[list[torch.Tensor]]
    v_buffer: Optional[list[torch.Tensor]]
    num_heads: Optional[int]
    kv_lora_rank: Optional[int]
    qk_rope_head_dim: Optional[int]
    kv_buffer: Optional[list[torch.Tensor]]

    def __init__(self, *, use_mla_backend: bool, dtype: torch.dtype,
                 device: torch.device | str, page_size: int, num_layers: int,
                 req_to_token: torch.Tensor,
                 num_q_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, v_head_dim: Optional[int] = None,
                 k_buffer: Optional[Sequence[torch.Tensor]] = None,
                 v_buffer: Optional[Sequence[torch.Tensor]] = None,
                 num_heads: Optional[int] = None, kv_lora_rank: Optional[int] = None,
                 qk_rope_head_dim: Optional[int] = None,
                 kv_buffer: Optional[Sequence[torch.Tensor]] = None,
                 kv_cache_dtype: str = "auto") -> None:
        self.use_mla_backend = bool(use_mla_backend)
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_size = page_size
        self.num_layers = num_layers
        self.req_to_token = req_to_token
        # An FP8 byte layout (``specattn.kv_layouts``) or None: plain pools of the pool's dtype.
        self.kv_layout = layout_for(kv_cache_dtype, use_mla_backend=self.use_mla_backend,
                                    kv_lora_rank=kv_lora_rank,
                                    qk_rope_head_dim=qk_rope_head_dim, page_size=page_size)
        self.kv_cache_dtype = kv_cache_dtype
        fp8 = FP8_KV_DTYPES.get(kv_cache_dtype)
        if fp8 is not None:  # SGLang stores FP8 pools as uint8: the same bytes, viewed
            k_buffer, v_buffer, kv_buffer = (None if pools is None else [
                t.view(fp8) if isinstance(t, torch.Tensor) and t.dtype == torch.uint8 else t
                for t in pools] for pools in (k_buffer, v_buffer, kv_buffer))
        if self.use_mla_backend:
            self.num_heads = num_heads
            self.kv_lora_rank = kv_lora_rank
            self.qk_rope_head_dim = qk_rope_head_dim
            self.kv_buffer = list(kv_buffer) if kv_buffer is not None else None
            self.num_q_heads, self.num_kv_heads = num_heads, 1
            self.head_dim = None if kv_lora_rank is None else kv_lora_rank + (
                qk_rope_head_dim or 0)
            self.v_head_dim = kv_lora_rank
            self.k_buffer = self.v_buffer = None
        else:
            self.num_q_heads = num_q_heads
            self.num_kv_heads = num_kv_heads
            self.head_dim = head_dim
            self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
            self.k_buffer = list(k_buffer) if k_buffer is not None else None
            self.v_buffer = list(v_buffer) if v_buffer is not None else None
            self.num_heads = self.kv_lora_rank = self.qk_rope_head_dim = None
            self.kv_buffer = None
        check_runner(self)

    # --- constructors ----------------------------------------------------------------------

    @classmethod
    def mha(cls, num_q_heads: int, num_kv_heads: int, head_dim: int,
            v_head_dim: Optional[int] = None, *, num_layers: int, num_slots: int,
            max_reqs: int, max_context_len: int, page_size: int = 1,
            dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
            kv_cache_dtype: str = "auto") -> "DraftRunner":
        """Allocate zeroed MHA/GQA pools and an all-zero ``req_to_token``.

        ``kv_cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"``: FP8 pools (``dtype`` stays the
        activation dtype)."""
        _check_allocation(dtype, device, num_layers=num_layers, num_slots=num_slots,
                          max_reqs=max_reqs, max_context_len=max_context_len,
                          page_size=page_size, num_q_heads=num_q_heads,
                          num_kv_heads=num_kv_heads, head_dim=head_dim,
                          v_head_dim=head_dim if v_head_dim is None else v_head_dim)
        layout_for(kv_cache_dtype, use_mla_backend=False, kv_lora_rank=None,
                   qk_rope_head_dim=None, page_size=page_size)  # the name, before its pools
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        store = _pool_dtype(kv_cache_dtype, dtype)
        k = [zeros((num_slots, num_kv_heads, head_dim), store, device)
             for _ in range(num_layers)]
        v = [zeros((num_slots, num_kv_heads, v_head_dim), store, device)
             for _ in range(num_layers)]
        r2t = torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=device)
        return cls(use_mla_backend=False, dtype=dtype, device=device, page_size=page_size,
                   num_layers=num_layers, req_to_token=r2t, num_q_heads=num_q_heads,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                   k_buffer=k, v_buffer=v, kv_cache_dtype=kv_cache_dtype)

    @classmethod
    def mla(cls, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, *,
            num_layers: int, num_slots: int, max_reqs: int, max_context_len: int,
            page_size: int = 1, dtype: torch.dtype = torch.bfloat16,
            device: torch.device | str = "cpu", kv_cache_dtype: str = "auto",
            ) -> "DraftRunner":
        """Allocate zeroed MLA latent pools and an all-zero ``req_to_token``.

        ``kv_cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"``: FP8 pools; ``"fp8_ds_mla"`` /
        ``"fp8_ds_v4"``: uint8 pools in that FP8 layout (``specattn.kv_layouts``). ``dtype``
        stays the activation dtype."""
        _check_allocation(dtype, device, num_layers=num_layers, num_slots=num_slots,
                          max_reqs=max_reqs, max_context_len=max_context_len,
                          page_size=page_size, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                          qk_rope_head_dim=qk_rope_head_dim, zero_ok=("qk_rope_head_dim",))
        layout = layout_for(kv_cache_dtype, use_mla_backend=True, kv_lora_rank=kv_lora_rank,
                            qk_rope_head_dim=qk_rope_head_dim, page_size=page_size)
        if layout is not None:
            kv = [layout.allocate(num_slots, device) for _ in range(num_layers)]
        else:
            kv = [zeros((num_slots, kv_lora_rank + qk_rope_head_dim),
                        _pool_dtype(kv_cache_dtype, dtype), device) for _ in range(num_layers)]
        r2t = torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=device)
        return cls(use_mla_backend=True, dtype=dtype, device=device, page_size=page_size,
                   num_layers=num_layers, req_to_token=r2t, num_heads=num_heads,
                   kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                   kv_buffer=kv, kv_cache_dtype=kv_cache_dtype)

    @classmethod
    def wrap_mha(cls, req_to_token: torch.Tensor, k_buffer: Sequence[torch.Tensor],
                 v_buffer: Sequence[torch.Tensor], num_q_heads: int, *, page_size: int = 1,
                 kv_cache_dtype: str = "auto",
                 dtype: Optional[torch.dtype] = None) -> "DraftRunner":
        """Wrap an engine's MHA pools (no copy); shapes are read from the tensors. ``dtype``
        (activations) defaults to the pools' dtype, bfloat16 for FP8 pools."""
        k0 = _first_pool("k_buffer", k_buffer, 3, "[num_slots, num_kv_heads, head_dim]")
        _first_pool("v_buffer", v_buffer, 3, "[num_slots, num_kv_heads, v_head_dim]")
        if dtype is None:
            dtype = _default_dtype(kv_cache_dtype, k0)
        return cls(use_mla_backend=False, dtype=dtype, device=k0.device,
                   page_size=page_size, num_layers=len(k_buffer), req_to_token=req_to_token,
                   num_q_heads=num_q_heads, num_kv_heads=k0.shape[1], head_dim=k0.shape[2],
                   v_head_dim=v_buffer[0].shape[2], k_buffer=k_buffer, v_buffer=v_buffer,
                   kv_cache_dtype=kv_cache_dtype)

    @classmethod
    def wrap_mla(cls, req_to_token: torch.Tensor, kv_buffer: Sequence[torch.Tensor],
                 num_heads: int, kv_lora_rank: int, *, page_size: int = 1,
                 kv_cache_dtype: str = "auto",
                 dtype: Optional[torch.dtype] = None) -> "DraftRunner":
        """Wrap an engine's MLA latent pools (no copy). FP8 layouts (uint8 pools): the rope
        width is solved from the byte width. ``dtype`` (activations) defaults to the pools'
        dtype, bfloat16 for FP8 pools."""
        kv0 = _first_pool("kv_buffer", kv_buffer, 2,
                          "[num_slots, kv_lora_rank + qk_rope_head_dim]")
        if kv_cache_dtype in LAYOUT_NAMES:  # byte rows: the rank is not bounded by them
            if not _is_int(kv_lora_rank) or kv_lora_rank < 1:
                raise InvalidInputError("kv_lora_rank", f"an int >= 1 ({kv_cache_dtype!r} "
                                        "pools hold bytes)", repr(kv_lora_rank))
        elif not _is_int(kv_lora_rank) or not 0 < kv_lora_rank <= kv0.shape[1]:
            raise InvalidInputError("kv_lora_rank", f"an int in [1, {int(kv0.shape[1])}] (the "
                                    "latent pool's width)", repr(kv_lora_rank))
        if kv_cache_dtype in LAYOUT_NAMES:
            rope = rope_for_width(kv_cache_dtype, kv_lora_rank, int(kv0.shape[1]))
            dtype = dtype or torch.bfloat16
        else:
            rope = kv0.shape[1] - kv_lora_rank
            dtype = dtype or _default_dtype(kv_cache_dtype, kv0)
        return cls(use_mla_backend=True, dtype=dtype, device=kv0.device,
                   page_size=page_size, num_layers=len(kv_buffer), req_to_token=req_to_token,
                   num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                   qk_rope_head_dim=rope, kv_buffer=kv_buffer,
                   kv_cache_dtype=kv_cache_dtype)

    # --- views -----------------------------------------------------------------------------

    @property
    def max_reqs(self) -> int:
        return int(self.req_to_token.shape[0])

    @property
    def max_context_len(self) -> int:
        return int(self.req_to_token.shape[1])

    @property
    def num_slots(self) -> int:
        pool = self.kv_buffer if self.use_mla_backend else self.k_buffer
        return int(pool[0].shape[0]) if pool else 0

    @property
    def model(self) -> str:
        return "mla" if self.use_mla_backend else "mha"

    @property
    def fp8(self) -> bool:
        """The pools hold FP8 codes with one scale per tensor (``"fp8_e4m3"`` /
        ``"fp8_e5m2"``; the layer's ``k_scale`` / ``v_scale``). The DeepSeek byte layouts are
        ``kv_layout`` instead."""
        return self.kv_cache_dtype in FP8_KV_DTYPES

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the pools as backends read them: the FP8 dtype, ``uint8`` for a byte
        layout, else the pools' own dtype."""
        if self.kv_layout is not None:
            return torch.uint8
        fp8 = FP8_KV_DTYPES.get(self.kv_cache_dtype)
        if fp8 is not None:
            return fp8
        return self.layer_pools(0)[0].dtype

    def layer_pools(self, layer_id: int) -> list[torch.Tensor]:
        """Layer ``layer_id``'s pools: ``[kv_buffer[layer_id]]`` (MLA) or
        ``[k_buffer[layer_id], v_buffer[layer_id]]`` (MHA)."""
        pools = [self.kv_buffer] if self.use_mla_backend else [self.k_buffer, self.v_buffer]
        return [p[layer_id] for p in pools if p is not None]

    def backend_request(self, kind: Kind, *, topk: int = 1, num_steps: int = 2,
                        tree_mode: str = "lane") -> BackendRequest:
        """The full ``BackendRequest`` for this runner (dtype and head dim included)."""
        return BackendRequest(kind=kind, mla=self.use_mla_backend, topk=topk,
                              num_steps=num_steps, page_size=self.page_size,
                              kv_cache_dtype=self.kv_cache_dtype, tree_mode=tree_mode,
                              dtype=self.dtype, head_dim=self.head_dim)

    def write_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                 v: Optional[torch.Tensor], k_scale: Scale = 1.0, v_scale: Scale = 1.0) -> None:
        """Store new KV at slots ``loc [N]``: MHA ``k [N, H_kv, D]``, ``v [N, H_kv, D_v]``;
        MLA ``k [N, kv_lora_rank + rope]`` and ``v = None``. FP8 pools (``fp8``) store
        ``fp8.quantize(k, k_scale)`` and ``fp8.quantize(v, v_scale)`` (MLA: ``k_scale``);
        other pools ignore the scales. The arguments are checked first (``InvalidInputError``;
        the slots' values where they need no sync: a CPU ``loc``, or debug checks); a
        backend's ``forward``, whose arguments were checked, stores through ``_store_kv``."""
        self._check_write(layer_id, loc, k, v)
        check_scale("k_scale", k_scale)
        check_scale("v_scale", v_scale)
        self._store_kv(layer_id, loc, k, v, k_scale, v_scale)

    def _check_write(self, layer_id: object, loc: object, k: object, v: object) -> None:
        """``write_kv``'s arguments fit the pools: a pool index, slots inside them, rows of
        their shape (a wrong one could broadcast into them silently)."""
        if not _is_int(layer_id) or not 0 <= layer_id < self.num_layers:
            raise InvalidInputError("layer_id", f"an int in [0, {self.num_layers})",
                                    repr(layer_id))
        # loc: any shape (a [B, K] column of out_cache_loc); k's rank is checked below.
        loc = _tensor("loc", loc, dtypes=INDEX_DTYPES, ndim=getattr(loc, "ndim", 1),
                      device=self.device)
        n, floats = loc.numel(), ACT_DTYPES + (torch.float64,)
        k = _tensor("k", k, dtypes=floats, ndim=getattr(k, "ndim", 0), device=self.device)
        if self.use_mla_backend:
            if k.dim() < 1 or k.shape[0] != n or k.numel() != n * (self.head_dim or 0):
                raise InvalidInputError("k", f"the new latent rows [{n}, {self.head_dim}] "
                                        "(one per slot of loc)", f"shape {tuple(k.shape)}")
            if v is not None:
                raise InvalidInputError("v", "None for MLA (the latent k carries both)",
                                        f"a {type(v).__name__}")
        else:
            if v is None:
                raise InvalidInputError("v", "the new values [N, H_kv, D_v] (an MHA runner)",
                                        "None")
            _shape("k", k, (n, self.num_kv_heads, self.head_dim))
            v = _tensor("v", v, dtypes=floats, ndim=3, device=self.device)
            _shape("v", v, (n, self.num_kv_heads, self.v_head_dim))
        if n and (loc.device.type == "cpu" or debug_checks_enabled()):
            lo, hi = int(loc.min()), int(loc.max())
            if lo < 0 or hi >= self.num_slots:
                raise InvalidInputError("loc", f"slots in [0, {self.num_slots})",
                                        f"a value {lo if lo < 0 else hi}")

    def _store_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                  v: Optional[torch.Tensor], k_scale: Scale = 1.0,
                  v_scale: Scale = 1.0) -> None:
        """``write_kv`` without its checks, for arguments already checked."""
        loc = loc.reshape(-1).long()
        pools = self.layer_pools(layer_id)
        if self.kv_layout is not None:  # FP8 byte layout: quantize on write
            self.kv_layout.write(pools[0], loc, k.reshape(loc.shape[0], -1))
            return
        if self.use_mla_backend:
            rows = [k.reshape(loc.shape[0], -1)]
        elif v is None:
            raise InvalidInputError("v", "the new values [N, H_kv, D_v] (an MHA runner)", "None")
        else:
            rows = [k, v]
        for pool, x, scale in zip(pools, rows, (k_scale, v_scale)):
            if self.fp8:
                write_rows(pool, loc, quantize(x, scale, pool.dtype))
            else:
                pool[loc] = x.to(pool.dtype)

    def __repr__(self) -> str:
        if self.use_mla_backend:
            shape = (f"MLA heads={self.num_heads} kv_lora_rank={self.kv_lora_rank} "
                     f"rope={self.qk_rope_head_dim}")
        else:
            shape = (f"MHA q_heads={self.num_q_heads} kv_heads={self.num_kv_heads} "
                     f"head_dim={self.head_dim} v_head_dim={self.v_head_dim}")
        return (f"DraftRunner({shape}, layers={self.num_layers}, slots={self.num_slots}, "
                f"page_size={self.page_size}, dtype={str(self.dtype).replace('torch.', '')}, "
                f"kv_cache_dtype={self.kv_cache_dtype}, device={self.device})")


def _check_allocation(dtype: object, device: object, zero_ok: tuple[str, ...] = (),
                      **sizes: object) -> None:
    """The arguments ``mha`` / ``mla`` allocate with, checked before the first allocation
    (torch would refuse them first, with its own error): each of ``sizes`` an int >= 1 (>= 0
    for those named in ``zero_ok``), ``dtype`` an activation dtype, ``device`` a device
    torch can name and use here."""
    for name, value in sizes.items():
        least = 0 if name in zero_ok else 1
        if not _is_int(value) or value < least:
            raise InvalidInputError(name, "a positive int" if least == 1 else
                                    f"an int >= {least}", repr(value))
    if dtype not in ACT_DTYPES:
        raise InvalidInputError("dtype", "bfloat16, float16 or float32", repr(dtype))
    try:
        where = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        raise InvalidInputError("device", "a torch device ('cpu', 'cuda', 'cuda:1', ...)",
                                repr(device)) from None
    if where.type == "meta":  # no memory: the runner's pools could never be read
        raise InvalidInputError("device", "a device that holds data ('cpu', 'cuda', ...)",
                                repr(device))
    if where.type == "cuda" and not torch.cuda.is_available():  # torch's own: an assert
        raise InvalidInputError("device", "a device this torch can use (it sees no CUDA "
                                "device: 'cpu')", repr(device))


def _default_dtype(kv_cache_dtype: str, pool: torch.Tensor) -> torch.dtype:
    """The activation dtype ``wrap_mha`` / ``wrap_mla`` assume when given none: the pool's
    for ``"auto"`` pools of a model dtype, else bfloat16 (a pool of FP8 or uint8 under
    ``"auto"`` is then refused by ``check_runner`` as such, naming ``kv_cache_dtype``)."""
    if kv_cache_dtype == "auto" and pool.dtype in ACT_DTYPES:
        return pool.dtype
    return torch.bfloat16


def _pool_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a constructor allocates pools in: the FP8 dtype, else the model's."""
    return FP8_KV_DTYPES.get(kv_cache_dtype, dtype)


def _first_pool(name: str, pools: Sequence[torch.Tensor], ndim: int,
                shape: str) -> torch.Tensor:
    """Layer 0's pool of an engine's per-layer list: the shapes are read from it."""
    if isinstance(pools, torch.Tensor) or not isinstance(pools, Sequence) or not pools:
        got = (f"a tensor of shape {tuple(pools.shape)}" if isinstance(pools, torch.Tensor)
               else repr(pools) if not pools else type(pools).__name__)
        raise InvalidInputError(name, f"a non-empty list of per-layer tensors {shape}", got)
    first = pools[0]
    if not isinstance(first, torch.Tensor) or first.dim() != ndim:
        got = (f"shape {tuple(first.shape)}" if isinstance(first, torch.Tensor)
               else type(first).__name__)
        raise InvalidInputError(f"{name}[0]", f"a {ndim}-D tensor {shape}", got)
    return first


def check_runner(runner: DraftRunner) -> None:
    """The runner's shape fields, pools and ``req_to_token`` agree with each other."""
    if not _is_int(runner.page_size) or runner.page_size < 1:
        raise InvalidInputError("runner.page_size", "an int >= 1", repr(runner.page_size))
    if runner.dtype not in ACT_DTYPES:
        raise InvalidInputError("runner.dtype", "bfloat16, float16 or float32",
                                repr(runner.dtype))
    if not _is_int(runner.num_layers) or runner.num_layers < 1:
        raise InvalidInputError("runner.num_layers", "an int >= 1", repr(runner.num_layers))
    _tensor("runner.req_to_token", runner.req_to_token, dtypes=INDEX_DTYPES, ndim=2,
            device=runner.device)
    if min(runner.req_to_token.shape) < 1:
        raise InvalidInputError("runner.req_to_token", "shape [max_reqs >= 1, "
                                "max_context_len >= 1]",
                                f"shape {tuple(runner.req_to_token.shape)}")
    _last_dim_contiguous("runner.req_to_token", runner.req_to_token)  # rows by stride
    if runner.use_mla_backend:
        _int_field(runner, "num_heads")
        width = _int_field(runner, "kv_lora_rank") + _int_field(runner, "qk_rope_head_dim", 0)
        pools = {"runner.kv_buffer": runner.kv_buffer}
        expected: dict[str, tuple[int, ...]] = {"runner.kv_buffer": (width,)}
        layout = getattr(runner, "kv_layout", None)
        if layout is not None:  # FP8 byte layout (specattn.kv_layouts): uint8 pools
            _check_layout_pools(runner, layout)
            return
    else:
        q_heads, kv_heads = _int_field(runner, "num_q_heads"), _int_field(runner, "num_kv_heads")
        head_dim, v_head_dim = _int_field(runner, "head_dim"), _int_field(runner, "v_head_dim")
        if q_heads % kv_heads:
            raise InvalidInputError("runner.num_q_heads", f"a multiple of num_kv_heads={kv_heads}",
                                    q_heads)
        pools = {"runner.k_buffer": runner.k_buffer, "runner.v_buffer": runner.v_buffer}
        expected = {"runner.k_buffer": (kv_heads, head_dim),
                    "runner.v_buffer": (kv_heads, v_head_dim)}
    num_slots = None
    first: Optional[tuple[str, torch.dtype]] = None  # K and V pools share one dtype
    for name, pool in pools.items():
        if pool is None or len(pool) != runner.num_layers:
            got = None if pool is None else f"{len(pool)} tensors"
            raise InvalidInputError(name, f"a list of {runner.num_layers} tensors (one per "
                                    "layer)", got)
        for i, t in enumerate(pool):
            if isinstance(t, torch.Tensor):  # first: it names kv_cache_dtype for an FP8 pool
                _check_pool_dtype(runner, f"{name}[{i}]", t)
            _tensor(f"{name}[{i}]", t, dtypes=ACT_DTYPES + _fp8_dtypes(), ndim=1 + len(
                expected[name]), device=runner.device)
            if first is None:
                first = (f"{name}[{i}]", t.dtype)
            elif t.dtype != first[1]:
                raise InvalidInputError(f"{name}[{i}]", f"dtype {dtype_name(first[1])} like "
                                        f"{first[0]}", dtype_name(t.dtype))
            if tuple(t.shape[1:]) != expected[name]:
                raise InvalidInputError(f"{name}[{i}]", f"shape [num_slots, "
                                        f"{', '.join(map(str, expected[name]))}]",
                                        f"shape {tuple(t.shape)}")
            _last_dim_contiguous(f"{name}[{i}]", t)
            if num_slots is not None and t.shape[0] != num_slots:
                raise InvalidInputError(f"{name}[{i}]", f"{num_slots} slots like layer 0",
                                        t.shape[0])
            if t.shape[0] < 1:
                raise InvalidInputError(f"{name}[{i}]", "at least one slot", "0 slots")
            num_slots = t.shape[0]


def _int_field(runner: DraftRunner, field: str, least: int = 1) -> int:
    """``runner.<field>``, checked to be an int >= ``least``."""
    value = getattr(runner, field)
    if not _is_int(value) or value < least:
        raise InvalidInputError(f"runner.{field}", "a positive int" if least == 1 else
                                f"an int >= {least}", repr(value))
    return value


def _check_layout_pools(runner: DraftRunner, layout) -> None:
    pool = runner.kv_buffer
    if pool is None or len(pool) != runner.num_layers:
        got = None if pool is None else f"{len(pool)} tensors"
        raise InvalidInputError("runner.kv_buffer", f"a list of {runner.num_layers} tensors "
                                "(one per layer)", got)
    for i, t in enumerate(pool):
        _tensor(f"runner.kv_buffer[{i}]", t, dtypes=(torch.uint8,), ndim=2,
                device=runner.device)
        layout.check_pool(f"runner.kv_buffer[{i}]", t)
        if t.shape[0] != pool[0].shape[0]:
            raise InvalidInputError(f"runner.kv_buffer[{i}]", f"{pool[0].shape[0]} slots like "
                                    "layer 0", t.shape[0])


def _fp8_dtypes() -> tuple:
    return tuple(FP8_KV_DTYPES.values())


def _check_pool_dtype(runner: DraftRunner, name: str, pool: torch.Tensor) -> None:
    """A pool's dtype agrees with ``runner.kv_cache_dtype``: its FP8 dtype, or a model dtype
    for ``"auto"``."""
    want = FP8_KV_DTYPES.get(runner.kv_cache_dtype)
    if want is not None and pool.dtype != want:
        names = f"{dtype_name(want)} (or uint8 storage)"
    elif want is None and (is_fp8_dtype(pool.dtype) or pool.dtype == torch.uint8):
        names = "bfloat16/float16/float32 (an FP8 pool, or its uint8 storage, needs " \
                "kv_cache_dtype 'fp8_e4m3' or 'fp8_e5m2')"
    else:
        return
    raise InvalidInputError(name, f"dtype {names} for kv_cache_dtype="
                            f"{runner.kv_cache_dtype!r}", dtype_name(pool.dtype))
