"""Draft rounds on poisoned pools, laid out the way a serving engine lays them out.

A ``RoundMaker`` owns one ``DraftRunner`` and places rounds on it:

- pages are page-aligned and random (request ``b`` owns whole pages, ``R_b[x] = page[x // P] *
  P + x % P``); page 0 and request row 0 are reserved for the padded lanes of a captured CUDA
  graph (every page of row 0 is page 0, so padding reads and writes page 0 only);
- every pool is NaN except page 0 and the prefix slots of the round (random values), so a
  kernel that reads a slot no query may read gives NaN;
- draft slots follow ``metadata.assign_draft_cache_locs`` (the page-duplicating layout when
  ``P > 1 and K > 1``, with the partial last page copied into every branch's first page, as
  the serving code does); extend tokens are the last ``E_b`` positions of each row.

Each ``decode``/``extend`` call re-poisons the pools in place and draws new pages, so the same
runner (and the same tensors, as a captured CUDA graph needs) serves several rounds.

Engine-style layouts (``EngineStyle``) build the same data with the strides engines produce:
strided index tensors, q/k/v as views of one fused projection, ``req_to_token`` as a column
slice of a wider table, K and V pools as two views of one buffer, FP8 pools handed over as
``uint8`` storage (SGLang's).

FP8 pools (``kv_cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"``) hold ``fp8.quantize`` codes of the
random values with the maker's ``k_scale`` / ``v_scale`` (MLA: ``k_scale``), the same scales the
round's layers carry; poisoned slots hold the FP8 NaN code.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import metadata
from ..data import DraftBatch, DraftExtendBatch, DraftRunner
from ..fp8 import Scale, pool_dtype, quantize, write_rows, zeros as fp8_zeros

__all__ = ["ModelShape", "EngineStyle", "RoundMaker", "DecodeRound", "ExtendRound",
           "random_qkv", "shadow_runner", "pools_of", "SCALING_FACTOR"]

# The kit's softmax scale over the default 1 / sqrt(head width) (``ModelShape.scaling``).
SCALING_FACTOR = 1.25


@dataclass(frozen=True)
class ModelShape:
    """Attention shape of the draft model, per rank.

    MHA: ``heads = (num_q_heads, num_kv_heads, head_dim)``, and ``v_head_dim`` when the
    values are narrower or wider than the keys (``None``: ``head_dim``); MLA: ``heads =
    (num_heads, kv_lora_rank, qk_rope_head_dim)``."""

    model: str
    heads: tuple[int, int, int]
    v_head_dim: Optional[int] = None

    def label(self) -> str:
        a, b, c = self.heads
        if self.model == "mla":
            return f"mla{a}x{b}+{c}"
        return f"q{a}kv{b}d{c}" + (f"v{self.v_head_dim}" if self.v_head_dim else "")

    @property
    def scaling(self) -> float:
        """The layers' softmax scale: ``SCALING_FACTOR / sqrt(width)``, not the
        ``1 / sqrt(width)`` a kernel would derive from the head width on its own (DeepSeek's
        MLA scales by ``1 / sqrt(192)`` times YaRN's ``mscale**2`` over a 576-wide latent),
        so a backend must read ``layer.scaling``."""
        width = self.heads[1] + self.heads[2] if self.model == "mla" else self.heads[2]
        return SCALING_FACTOR / math.sqrt(width)


@dataclass(frozen=True)
class EngineStyle:
    """Which engine-style layouts to use (all off: plain contiguous tensors)."""

    strided_index: bool = False     # req_pool_indices, seq_lens, ... as strided views
    fused_qkv: bool = False         # q, k, v as views of one projection output
    sliced_req_to_token: bool = False  # req_to_token as a column slice of a wider table
    shared_kv_buffer: bool = False  # MHA: K and V pools as two views of one buffer
    uint8_pools: bool = False  # FP8 pools given to the runner as uint8 storage (SGLang's)
    int32_index: bool = False  # the batch's index tensors in int32 (vLLM's), not int64
    # Pools of one slot past their whole pages (P > 1), a request's last token in it.
    partial_last_page: bool = False

    def label(self) -> str:
        on = [f for f in ("strided_index", "fused_qkv", "sliced_req_to_token",
                          "shared_kv_buffer", "uint8_pools", "int32_index",
                          "partial_last_page")
              if getattr(self, f)]
        return "+".join(on) if on else "contiguous"


def scale_of(name: str, k_scale: Scale, v_scale: Scale) -> Scale:
    """The scale of the pool ``name`` (``pools_of``): ``v_scale`` for value pools."""
    return v_scale if name.startswith("v_buffer") else k_scale


def pools_of(runner: DraftRunner) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every KV pool tensor of ``runner``."""
    if runner.use_mla_backend:
        return [(f"kv_buffer[{i}]", t) for i, t in enumerate(runner.kv_buffer)]
    return ([(f"k_buffer[{i}]", t) for i, t in enumerate(runner.k_buffer)]
            + [(f"v_buffer[{i}]", t) for i, t in enumerate(runner.v_buffer)])


def shadow_runner(runner: DraftRunner) -> DraftRunner:
    """A copy of ``runner`` with cloned pools (same ``req_to_token``): the kit's own idea of
    what the pools must hold."""
    shadow = copy.copy(runner)
    if runner.use_mla_backend:
        shadow.kv_buffer = [t.clone() for t in runner.kv_buffer]
    else:
        shadow.k_buffer = [t.clone() for t in runner.k_buffer]
        shadow.v_buffer = [t.clone() for t in runner.v_buffer]
    return shadow


def _make_runner(shape: ModelShape, *, dtype: torch.dtype, device: torch.device,
                 page_size: int, num_layers: int, num_slots: int, max_reqs: int,
                 max_context_len: int, kv_cache_dtype: str, style: EngineStyle) -> DraftRunner:
    extra_cols = 7 if style.sliced_req_to_token else 0
    wide = torch.zeros(max_reqs, max_context_len + extra_cols, dtype=torch.int32,
                       device=device)
    req_to_token = wide[:, :max_context_len] if extra_cols else wide
    a, b, c = shape.heads
    store = pool_dtype(kv_cache_dtype) or dtype
    if style.uint8_pools and store != dtype:
        store = torch.uint8  # the runner views the bytes as the FP8 dtype

    def zeros(*size: int) -> torch.Tensor:
        return fp8_zeros(size, store, device)

    if shape.model == "mla":
        if kv_cache_dtype != "auto" and pool_dtype(kv_cache_dtype) is None:  # byte layouts
            base = DraftRunner.mla(a, b, c, num_layers=num_layers, num_slots=num_slots,
                                   max_reqs=1, max_context_len=1, page_size=page_size,
                                   dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype)
            kv = base.kv_buffer
        else:
            kv = [zeros(num_slots, b + c) for _ in range(num_layers)]
        return DraftRunner.wrap_mla(req_to_token, kv, a, b, page_size=page_size,
                                    kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    if style.shared_kv_buffer:
        bufs = [zeros(num_slots, 2, b, c) for _ in range(num_layers)]
        k = [buf[:, 0] for buf in bufs]
        v = [buf[:, 1] for buf in bufs]
    else:
        k = [zeros(num_slots, b, c) for _ in range(num_layers)]
        v = [zeros(num_slots, b, shape.v_head_dim or c) for _ in range(num_layers)]
    return DraftRunner.wrap_mha(req_to_token, k, v, a, page_size=page_size,
                                kv_cache_dtype=kv_cache_dtype, dtype=dtype)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other element of a wider buffer)."""
    wide = torch.full((t.numel(), 2), -7, dtype=t.dtype, device=t.device)
    wide[:, 0] = t.reshape(-1)
    return wide[:, 0].view(t.shape) if t.dim() == 1 else wide[:, 0].reshape(t.shape)


def _strided_3d(t: torch.Tensor) -> torch.Tensor:
    """``t [A, B, C]`` as a view whose last dimension is padded (row stride ``C + 1``)."""
    a, b, c = t.shape
    wide = torch.full((a, b, c + 1), -7, dtype=t.dtype, device=t.device)
    wide[..., :c] = t
    return wide[..., :c]


@dataclass
class DecodeRound:
    """One placed draft-decode round.

    ``parents_plan [S, B, K]``: in ``path`` mode, the parents the caller writes into
    ``batch.parents[i]`` just before step ``i`` (row 0 is zero); ``None`` in ``lane`` mode."""

    runner: DraftRunner
    batch: DraftBatch
    parents_plan: Optional[torch.Tensor]
    topk: int
    num_steps: int
    tree_mode: str

    @property
    def lanes(self) -> int:
        return self.batch.batch_size * self.topk


@dataclass
class ExtendRound:
    runner: DraftRunner
    batch: DraftExtendBatch

    @property
    def num_tokens(self) -> int:
        return int(self.batch.extend_lens.sum())


@dataclass
class RoundMaker:
    """Builds a runner sized for rounds of up to ``max_tokens`` tokens per request and
    ``max_reqs - 1`` requests, and places rounds on it (see the module doc). ``k_scale`` /
    ``v_scale``: the scales FP8 pools are filled with (floats or one-element tensors; set
    them between rounds to change them)."""

    shape: ModelShape
    dtype: torch.dtype
    device: torch.device
    page_size: int
    max_tokens: int
    max_reqs: int
    gen: torch.Generator
    num_layers: int = 2
    kv_cache_dtype: str = "auto"
    style: EngineStyle = field(default_factory=EngineStyle)
    k_scale: Scale = 1.0
    v_scale: Scale = 1.0
    runner: DraftRunner = field(init=False)

    def __post_init__(self) -> None:
        p = self.page_size
        pages_per_req = math.ceil(self.max_tokens / p) + 1
        self._num_pages = 1 + (self.max_reqs - 1) * pages_per_req + 2
        self.max_context_len = pages_per_req * p
        # A partial last page: page ``_num_pages``, of one slot (offset 0).
        self._partial = self.style.partial_last_page and p > 1
        self.runner = _make_runner(self.shape, dtype=self.dtype, device=self.device,
                                   page_size=p, num_layers=self.num_layers,
                                   num_slots=self._num_pages * p + int(self._partial),
                                   max_reqs=self.max_reqs,
                                   max_context_len=self.max_context_len,
                                   kv_cache_dtype=self.kv_cache_dtype, style=self.style)
        # Page 0: the padding slots, random and finite (padded lanes read and write them).
        self._pad_values = [torch.randn(self._row_shape(t), generator=self.gen)
                            for _, t in pools_of(self.runner)]

    # --- pools -------------------------------------------------------------------------------

    def _row_shape(self, pool: torch.Tensor) -> tuple:
        if self.runner.kv_layout is not None:
            return (self.page_size, self.shape.heads[1] + self.shape.heads[2])
        return (self.page_size,) + tuple(pool.shape[1:])

    def _write_rows(self, name: str, pool: torch.Tensor, slots: torch.Tensor,
                    values: torch.Tensor):
        layout = self.runner.kv_layout
        slots = slots.to(self.device).long()
        values = values.to(self.device)
        if layout is not None:
            layout.write(pool, slots, values.to(self.dtype))
        elif self.runner.fp8:
            write_rows(pool, slots, quantize(values.to(self.dtype), scale_of(
                name, self.k_scale, self.v_scale), pool.dtype))
        else:
            pool[slots] = values.to(pool.dtype)

    def _reset_pools(self) -> None:
        pad = torch.arange(self.page_size)
        for (name, pool), values in zip(pools_of(self.runner), self._pad_values):
            if self.runner.kv_layout is not None:
                pool.fill_(255)  # e4m3 NaN codes, NaN scales: every unread slot is NaN
            elif self.runner.fp8:
                pool.view(torch.uint8).fill_(0x7F)  # the NaN code of e4m3fn and e5m2
            else:
                pool.fill_(float("nan"))
            self._write_rows(name, pool, pad, values)

    def _fill_random(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        for name, pool in pools_of(self.runner):
            shape = (slots.numel(),) + self._row_shape(pool)[1:]
            self._write_rows(name, pool, slots, torch.randn(shape, generator=self.gen))

    def _allocate(self, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and page-aligned slot rows for requests of ``lens`` tokens (CPU tensors)."""
        p, bs = self.page_size, len(lens)
        if bs > self.max_reqs - 1:
            raise ValueError(f"{bs} requests, the maker holds {self.max_reqs - 1}")
        rows = (torch.randperm(self.max_reqs - 1, generator=self.gen) + 1)[:bs]
        free = (torch.randperm(self._num_pages - 1, generator=self.gen) + 1).tolist()
        table = torch.zeros(bs, self.max_context_len, dtype=torch.int32)
        partial = self._partial  # the partial page goes to the first request it fits
        for b, n in enumerate(lens):
            pages = [free.pop() for _ in range(math.ceil(n / p))]
            if partial and n % p == 1:
                pages[-1], partial = self._num_pages, False
            pages = torch.tensor(pages, dtype=torch.int64)
            x = torch.arange(n)
            table[b, :n] = (pages[x // p] * p + x % p).int()
        return rows, table

    def _install(self, rows: torch.Tensor, table: torch.Tensor) -> None:
        r2t = self.runner.req_to_token
        r2t.zero_()
        # Row 0, the padding request: every one of its pages is page 0 (page-aligned like
        # any other row), so padded lanes read and write page 0 only.
        r2t[0] = torch.arange(r2t.shape[1], device=r2t.device).remainder(self.page_size).to(
            r2t.dtype)
        r2t[rows.to(self.device)] = table.to(self.device)

    def _index(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device, torch.int32 if self.style.int32_index else t.dtype)
        return _strided(t) if self.style.strided_index else t

    # --- rounds ------------------------------------------------------------------------------

    def decode(self, seq_lens: list[int], topk: int, num_steps: int,
               tree_mode: str = "lane") -> DecodeRound:
        """A draft round: prefixes ``seq_lens``, ``topk`` lanes, ``num_steps`` steps."""
        p = self.page_size
        seq = torch.tensor(seq_lens, dtype=torch.int64)
        ext = metadata.draft_extend_lens(seq, topk, num_steps, p)
        rows, table = self._allocate((seq + ext).tolist())
        self._reset_pools()
        self._install(rows, table)
        for b, n in enumerate(seq_lens):
            self._fill_random(table[b, :n])
        new = torch.cat([table[b, n:n + int(ext[b])] for b, n in enumerate(seq_lens)])
        r2t = self.runner.req_to_token
        dev_rows, dev_seq = rows.to(self.device), seq.to(self.device)
        loc = metadata.assign_draft_cache_locs(r2t, dev_rows, dev_seq,
                                               new.long().to(self.device), topk, num_steps, p)
        # The serving code copies the partial last page into every branch's first page.
        src, dst = metadata.duplicate_last_page_copies(r2t, dev_rows, dev_seq, topk,
                                                       num_steps, p)
        metadata.copy_kv_slots(self.runner, src, dst)
        parents = plan = None
        if tree_mode == "path":
            plan = self._parents_plan(num_steps, len(seq_lens), topk)
            parents = torch.zeros(num_steps, len(seq_lens), topk, dtype=torch.int64,
                                  device=self.device)
            if self.style.strided_index:
                parents = _strided_3d(parents)
        if self.style.int32_index:
            loc = loc.to(torch.int32)
            parents = None if parents is None else parents.to(torch.int32)
        if self.style.strided_index:
            loc = _strided_3d(loc.reshape(len(seq_lens), topk, num_steps))
        batch = DraftBatch(self._index(rows), self._index(seq), loc, parents)
        return DecodeRound(self.runner, batch, plan, topk, num_steps, tree_mode)

    def _parents_plan(self, num_steps: int, bs: int, topk: int) -> torch.Tensor:
        """Random parents with at least one lane per step whose parent is another lane (so a
        path history differs from a lane history whenever ``topk > 1``)."""
        plan = torch.randint(0, topk, (num_steps, bs, topk), generator=self.gen)
        plan[0] = 0
        if topk > 1:
            for i in range(1, num_steps):
                plan[i, 0, 0] = 1 + int(torch.randint(0, topk - 1, (1,), generator=self.gen))
        return plan

    def extend(self, seq_lens: list[int], extend_lens: list[int]) -> ExtendRound:
        """A draft-extend batch: request ``b`` holds ``seq_lens[b]`` tokens, the last
        ``extend_lens[b]`` of them new (their slots stay NaN until ``forward`` writes them)."""
        rows, table = self._allocate(list(seq_lens))
        self._reset_pools()
        self._install(rows, table)
        new = []
        for b, (n, e) in enumerate(zip(seq_lens, extend_lens)):
            self._fill_random(table[b, :n - e])
            new.append(table[b, n - e:n].long())
        batch = DraftExtendBatch(self._index(rows), self._index(torch.tensor(seq_lens)),
                                 self._index(torch.tensor(extend_lens)),
                                 self._index(torch.cat(new)))
        return ExtendRound(self.runner, batch)


def random_qkv(runner: DraftRunner, rows: int, gen: torch.Generator, *,
               fused: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One forward's inputs, drawn on the CPU and moved to the runner's device.

    MHA: ``q [rows, H_q, D]``, ``k [rows, H_kv, D]``, ``v [rows, H_kv, D_v]``; MLA:
    ``q [rows, H, R + rope]``, ``k [rows, R + rope]``, ``v = None``. ``fused``: views of one
    ``[rows, width]`` projection output (row stride = the sum of the widths, as after a
    fused QKV matmul)."""
    dt, dev = runner.dtype, runner.device
    if runner.use_mla_backend:
        width = runner.kv_lora_rank + runner.qk_rope_head_dim
        parts = [(runner.num_heads, width), (width,)]
    else:
        parts = [(runner.num_q_heads, runner.head_dim), (runner.num_kv_heads, runner.head_dim),
                 (runner.num_kv_heads, runner.v_head_dim)]
    sizes = [math.prod(p) for p in parts]
    flat = torch.randn(rows, sum(sizes), generator=gen)
    flat[:, sizes[0]:sizes[0] + sizes[1]] *= 0.5  # keys: moderate logits
    flat = flat.to(dt).to(dev)
    if not fused:
        flat = flat.clone()
    out, start = [], 0
    for size, dims in zip(sizes, parts):
        piece = flat[:, start:start + size]
        out.append(piece.view(rows, *dims) if fused else piece.contiguous().view(rows, *dims))
        start += size
    if runner.use_mla_backend:
        return out[0], out[1], None
    return out[0], out[1], out[2]
