"""Launchers: block sizes, split counts, scratch buffers and grids for the Triton kernels.

Plan step (host, outside graph capture): ``choose_config`` / ``choose_num_splits`` from
Python ints only (shapes, batch size, SM count), never from tensor values, so the same plan is
valid for every replay of a captured graph. Run step (``decode_metadata``, ``extend_metadata``,
``attention``): kernel launches on tensors only, graph-safe, no host sync.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from ...kernels.merge import merge_partials
from ...kernels.tiles import dot_args
from ...util import next_pow2, sm_count
from .gluon_mla import parent_args
from . import _attn_kernels as K
from ._metadata_kernels import _decode_metadata_kernel, _extend_metadata_kernel

MAX_SPLITS = 16
KV_WRITES = ("torch", "kernel", "tail", "first")
_NEW_KV = {"tail": 1, "first": 2}  # the kernels' NEW_KV codes (0: already in the pool)



@dataclass(frozen=True)
class KernelConfig:
    """Stage-1 tiling: ``block_m`` query rows x ``block_n`` keys per tile. ``mla_v3``: use
    the MLA stage-1 kernel (MLA shapes only); with it, ``dv_split`` programs share the
    512-wide output (1 or 2) and ``v_reload`` loads V again instead of reusing the K tile.
    ``kv_write``: who stores the call's new KV in the pool: ``"torch"`` (``runner.write_kv``,
    indexed copies), ``"kernel"`` (one Triton launch), ``"tail"`` / ``"first"`` (the
    attention kernel's tail programs / each tile's first prefix split; the tail then reads
    the new keys from k, v). ``fuse_merge``: the last program of each tile merges the
    partials (no merge launch). ``gluon``: the Gluon wgmma kernel (``gluon_mla``; MLA
    shared-prefix decode on sm90; ``block_n`` / ``num_stages`` its key tile and ring depth,
    ``gluon_overlap`` its softmax / P.V overlap, ``gluon_prefetch`` its ``req_to_token``
    loads a tile ahead of the copies, ``gluon_ws`` the warp-specialized kernel (experimental:
    no faster on the H200), ``gluon_worklist`` the balanced work list (``worklist``:
    programs in proportion to each request's length); ``cute``: the CuTe-DSL kernel
    (``cute_mla``: one warpgroup on S and the softmax, one on the gathers, a request's
    splits in thread-block clusters merged on chip; block_n 64, 2 stages, at most
    ``cute_mla.MAX_SPLITS`` splits; with ``fuse_merge``, the merge of several clusters'
    partials is fused into it: correct on the H200, slower; with ``gluon_worklist``, its
    clusters walk the balanced work list: opt-in, ``cute_mla`` says when it is faster))."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    mla_v3: bool = False
    dv_split: int = 1
    v_reload: bool = False
    kv_write: str = "kernel"
    fuse_merge: bool = False
    gluon: bool = False
    gluon_overlap: bool = False
    gluon_prefetch: bool = False
    gluon_ws: bool = False
    gluon_worklist: bool = False
    cute: bool = False

    def __post_init__(self) -> None:
        from ...errors import InvalidInputError

        if self.kv_write not in KV_WRITES:
            raise InvalidInputError("config.kv_write", f"one of {KV_WRITES}",
                                    repr(self.kv_write))
        if self.dv_split not in (1, 2) or (self.dv_split == 2 and not self.mla_v3):
            raise InvalidInputError("config.dv_split", "1, or 2 with mla_v3", self.dv_split)
        if self.fuse_merge and self.dv_split != 1:
            raise InvalidInputError("config.fuse_merge", "False with dv_split=2 (the two "
                                    "halves' partials finish independently)", True)
        if self.gluon and (self.mla_v3 or (self.fuse_merge and not self.cute)
                           or self.kv_write == "tail" or self.block_m != 64
                           or self.num_warps != 8):
            raise InvalidInputError("config.gluon", "block_m 64, 8 warps, no mla_v3 / "
                                    "kv_write='tail', fuse_merge only with cute", self.label())
        if (self.gluon_overlap or self.gluon_prefetch or self.gluon_ws
                or self.gluon_worklist) and not self.gluon:
            raise InvalidInputError("config.gluon", "True with gluon_overlap / gluon_prefetch "
                                    "/ gluon_ws / gluon_worklist", self.label())
        if self.gluon_worklist and (self.gluon_overlap or self.gluon_ws):
            raise InvalidInputError("config.gluon_worklist", "no gluon_overlap / gluon_ws",
                                    self.label())
        if self.cute and (not self.gluon or self.gluon_overlap or self.gluon_ws
                          or self.block_n != 64 or self.num_stages != 2
                          or self.kv_write != "first"
                          or (self.gluon_worklist and self.fuse_merge)):
            raise InvalidInputError("config.cute", "gluon with block_n 64, 2 stages, "
                                    "kv_write='first', no gluon_overlap / gluon_ws, not both "
                                    "gluon_worklist and fuse_merge", self.label())
        if self.gluon_ws and (self.gluon_overlap or self.num_stages % 2 or
                              self.block_n not in (32, 64)):
            raise InvalidInputError("config.gluon_ws", "an even stage count, block_n 32 or 64, "
                                    "no gluon_overlap", self.label())

    def label(self) -> str:
        extra = (" mla3" if self.mla_v3 else "") + \
            (f" dv{self.dv_split}" if self.dv_split != 1 else "") + \
            (" vr" if self.v_reload else "") + f" kv-{self.kv_write}" + \
            (" fm" if self.fuse_merge else "") + \
            ((" gluon-ov" if self.gluon_overlap else " gluon") if self.gluon else "") + \
            (" pf" if self.gluon_prefetch else "") + (" ws" if self.gluon_ws else "") + \
            (" wl" if self.gluon_worklist else "") + (" cute" if self.cute else "")
        return f"m{self.block_m} n{self.block_n} w{self.num_warps} s{self.num_stages}{extra}"


@dataclass(frozen=True)
class AttnShape:
    """What the kernels need to know about the model (MHA/GQA or MLA latent)."""

    num_q_heads: int
    num_kv_heads: int
    d_main: int  # MHA: head_dim; MLA: kv_lora_rank
    d_pe: int  # MLA rope width, 0 for MHA
    d_v: int
    v_is_k: bool  # MLA: V = the first d_v columns of the latent row

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def mla_kernel(self) -> bool:
        """Whether the MLA v3 stage 1 (latent read as two halves + rope) can run."""
        return self.v_is_k and self.d_pe > 0 and self.d_main % 2 == 0 and self.d_main >= 32 \
            and self.d_v == self.d_main

    @classmethod
    def of(cls, runner) -> "AttnShape":
        if runner.use_mla_backend:
            return cls(runner.num_heads, 1, runner.kv_lora_rank, runner.qk_rope_head_dim,
                       runner.kv_lora_rank, True)
        return cls(runner.num_q_heads, runner.num_kv_heads, runner.head_dim, 0,
                   runner.v_head_dim, False)


def _sm_count(device: torch.device) -> int:
    return sm_count(device) or 4  # interpreter: small, so tests see several splits


_pow2 = functools.partial(next_pow2, lo=16)


def choose_config(shape: AttnShape, rows_per_group: int) -> KernelConfig:
    """Block sizes for a group of ``rows_per_group`` query rows per KV head."""
    # Defaults from the H200 sweeps (benchmarks/results/2026-11-29-h200/triton-notes.md);
    # KV write and merge from triton-fusion-ab-{1,2,3}.md there: the one-launch write
    # everywhere but the MLA kernel (its first split writes: 109 vs 128 us at mla-long), the
    # merge launched.
    if shape.mla_kernel and rows_per_group >= 64:
        # v3: K*H rows of a request in one 64-row tile (the wgmma height), 8 warps; 3 stages:
        # 102 vs 108 us at mla-long, ragged -0.4..3% (triton-ab-s4-mla-stages.md).
        return KernelConfig(64, 64, 8, 3, mla_v3=True, kv_write="first")
    if shape.d_pe > 0 or shape.d_main > 256:  # wide rows, keep registers in check
        bm = min(_pow2(rows_per_group), 32)
        return KernelConfig(bm, 32, 4, 2)
    bm = min(_pow2(rows_per_group), 64)
    bn = 64 if shape.d_main <= 128 else 32
    return KernelConfig(bm, bn, 4 if bm <= 32 else 8, 3)


def gluon_config(runner, interpret: bool, topk: int,
                 work_list: Optional[bool] = None) -> Optional[KernelConfig]:
    """The sm90 MLA decode config when ``gluon_mla`` can serve ``runner`` here, else None
    (the reason is logged once). ``work_list``: the balanced work list (``worklist``) or the
    split per request; None picks by shape. Without the work list, a request of several
    64-row tiles (``K * H > 64``) gets the CuTe-DSL kernel where it can run
    (``cute_mla.cute_reason``), else the Gluon split kernel."""
    from . import cute_mla, gluon_mla

    reason = gluon_mla.gluon_reason(runner, interpret)
    if reason is not None:
        gluon_mla.log_fallback(reason)
        return None
    rows = topk * runner.num_heads
    if work_list is None:
        # H200, one run (2026-11-30-h200/gluon-wl-bench-c.md): with a request's K * H rows in
        # one 64-row tile the work list takes 11-12% off ragged batches (mla-long 77.1 vs
        # 87.8 us, -p64 80.0 vs 90.8, mla-k1 73.2 vs 82.7) and adds 2-5% to uniform ones
        # (70.5 vs 67.4, 70.2 vs 67.8, 64.0 vs 62.8); serving batches are ragged. With
        # several row tiles (H 128: mla-wide) it lost both ways (220 vs 206, 305 vs 297).
        work_list = rows <= 64
    if not work_list and rows > 64 and cute_mla.serves(runner, interpret, rows):
        # H200 (2026-12-01-h200/s12/call7, s13/call8): at mla-wide (H 128, K 2) the CuTe
        # kernel took 162.0 us against the Gluon split kernel's 206.6 (ragged 224.5 vs
        # 296.1), at mla-long-k8 (K 8, H 16) 91.4 vs 113.4 (ragged 121.8 vs 157.1). At one
        # row tile it ties the work list on ragged batches and loses at mla-small (B 4).
        return KernelConfig(64, 64, 8, 2, kv_write="first", gluon=True, cute=True)
    return KernelConfig(64, 64, 8, 2, kv_write="first", gluon=True, gluon_prefetch=True,
                        gluon_worklist=work_list)


def default_waves(cfg: KernelConfig, extend: bool) -> float:
    """Programs per SM that the prefix split count aims at (H200 sweeps)."""
    if cfg.mla_v3 or cfg.gluon:
        return 1.0  # ~200 KB of shared memory per program: one resident program per SM
    # Decode: 4 (3 splits at gqa-long): 161 vs 174 us at 6 (4 splits), gqa-long K 1 / paged
    # -5%, ragged +1-2%, gqa-small unchanged (triton-waves-s4.md).
    return 2.0 if extend else 4.0


def choose_num_splits(programs: int, device: torch.device, waves: float = 4.0) -> int:
    """Prefix splits so that ``programs * splits`` fills about ``waves`` programs per SM
    (rounded up; below 2 waves rounded down, so one full wave is not followed by a few
    stragglers)."""
    target = waves * _sm_count(device)
    n = int(target // max(1, programs)) if waves < 2 else triton.cdiv(int(target), max(1, programs))
    return max(1, min(MAX_SPLITS, n))


def plan_splits(shape: AttnShape, cfg: KernelConfig, rows_per_group: int, num_groups: int,
                device: torch.device, waves: Optional[float], extend: bool) -> int:
    """Split count for a stage-1 grid (host ints only: graph-safe); with
    ``cfg.gluon_worklist`` the work list's programs per row tile."""
    if cfg.gluon_worklist:  # programs per row tile, whatever the batch
        from . import worklist

        row_tiles = triton.cdiv(rows_per_group, cfg.block_m)
        if cfg.cute:  # a program is a cluster; all of them at once
            from . import cute_mla

            return cute_mla.work_list_shape(row_tiles, num_groups, device)[1]
        return worklist.programs_per_row_tile(row_tiles, num_groups, device)
    dv = cfg.dv_split if cfg.mla_v3 else 1
    programs = triton.cdiv(rows_per_group, cfg.block_m) * dv * num_groups * shape.num_kv_heads
    w = default_waves(cfg, extend) if waves is None else waves
    splits = choose_num_splits(programs, device, w)
    if cfg.cute:  # one wave of clusters
        from . import cute_mla

        return cute_mla.plan_splits(programs, device, splits)
    return splits


def cap_splits(cfg: KernelConfig, num_splits: int) -> int:
    """``num_splits`` within what ``cfg``'s kernel takes (the CuTe kernel: at most
    ``cute_mla.MAX_SPLITS``)."""
    if cfg.cute and not cfg.gluon_worklist:  # the work list's programs: no cap
        from .cute_mla import MAX_SPLITS

        return min(num_splits, MAX_SPLITS)
    return num_splits


def worklist_scratch(slots: int, rows: int, d_v: int, device: torch.device,
                     flat_o: Optional[torch.Tensor] = None,
                     flat_lse: Optional[torch.Tensor] = None):
    """The work list's partial slots ``[slots, rows, d_v]`` / ``[slots, rows]`` (fp32), views
    of ``flat_o`` / ``flat_lse`` when large enough (fixed CUDA-graph buffers)."""
    return _partial_views((slots, rows), d_v, device, flat_o, flat_lse)


def num_parts(cfg: KernelConfig, num_splits: int) -> int:
    """Partials per row: the generic kernel adds one tail program, MLA v3 fuses it (the CuTe
    kernel: one per cluster, at most ``num_splits``)."""
    return num_splits if cfg.mla_v3 or cfg.gluon else num_splits + 1


def layer_pools(runner, layer_id: int):
    """``(Kb, Vb, stride_ks, stride_kh, stride_vs, stride_vh)`` of one layer's pool."""
    if runner.use_mla_backend:
        kv = runner.kv_buffer[layer_id]
        return kv, kv, kv.stride(0), 0, kv.stride(0), 0
    k, v = runner.k_buffer[layer_id], runner.v_buffer[layer_id]
    return k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1)


def decode_metadata(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    out_cache_loc: torch.Tensor, meta: torch.Tensor, hist: torch.Tensor,
                    num_splits: int, block_n: int, num_slots: int,
                    work: Optional[torch.Tensor] = None, tail: int = 0) -> None:
    """Fill ``meta [>=B, 5]`` and ``hist [>=B*K, S]`` (int32) for a draft round; one launch
    (two with ``work``: the Gluon kernel's work list for ``num_splits`` programs per row tile
    and ``tail`` tail units per request, ``worklist.fill``).

    out_cache_loc: ``[B, K, S]``."""
    bs, topk, steps = out_cache_loc.shape
    _decode_metadata_kernel[(bs * topk,)](
        req_pool_indices, seq_lens, out_cache_loc, meta, hist,
        req_pool_indices.stride(0), seq_lens.stride(0),
        out_cache_loc.stride(0), out_cache_loc.stride(1), out_cache_loc.stride(2), num_slots,
        TOPK=topk, NUM_STEPS=steps, BLOCK_S=next_pow2(steps),
        NUM_SPLITS=num_splits, BLOCK_N=block_n, num_warps=1)
    if work is not None:
        from . import worklist

        worklist.fill(seq_lens, work, num_splits, tail, block_n)


def extend_metadata(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    extend_lens: torch.Tensor, meta: torch.Tensor, num_splits: int,
                    block_n: int) -> None:
    """Fill ``meta [>=B, 5]`` for an extend batch (prefix ``L' - E``, ``cumsum(E)``)."""
    bs = req_pool_indices.shape[0]
    _extend_metadata_kernel[(1,)](
        req_pool_indices, seq_lens, extend_lens, meta, bs,
        req_pool_indices.stride(0), seq_lens.stride(0), extend_lens.stride(0),
        BLOCK_B=next_pow2(bs), NUM_SPLITS=num_splits, BLOCK_N=block_n,
        num_warps=4)


def scratch(rows: int, shape: AttnShape, parts: int, device: torch.device,
            flat_o: Optional[torch.Tensor] = None, flat_lse: Optional[torch.Tensor] = None):
    """Partial-output buffers ``[rows, H_q, parts, D_v]`` / ``[rows, H_q, parts]`` (fp32,
    ``parts = num_parts(cfg, splits)``), views of ``flat_o``/``flat_lse`` when given (fixed
    CUDA-graph buffers)."""
    return _partial_views((rows, shape.num_q_heads, parts), shape.d_v, device, flat_o,
                          flat_lse)


def _partial_views(lse_shape: tuple, d_v: int, device: torch.device,
                   flat_o: Optional[torch.Tensor], flat_lse: Optional[torch.Tensor]):
    """fp32 ``(lse_shape + (d_v,), lse_shape)`` views of ``flat_o`` / ``flat_lse`` when they
    are large enough, else of fresh buffers."""
    n_l = math.prod(lse_shape)
    n_o = n_l * d_v
    if flat_o is None or flat_o.numel() < n_o or flat_lse.numel() < n_l:
        flat_o = torch.empty(n_o, dtype=torch.float32, device=device)
        flat_lse = torch.empty(n_l, dtype=torch.float32, device=device)
    return flat_o[:n_o].view(*lse_shape, d_v), flat_lse[:n_l].view(*lse_shape)


def kv_write_mode(runner, cfg: KernelConfig) -> str:
    """``cfg.kv_write``, or ``"torch"`` for pools with a byte layout (FP8: quantized by
    ``runner.write_kv``)."""
    return cfg.kv_write if getattr(runner, "kv_layout", None) is None else "torch"


def write_new_kv(runner, layer_id: int, slots: torch.Tensor, k: torch.Tensor,
                 v: Optional[torch.Tensor]) -> None:
    """One launch: ``pool[slots[r]] = k[r]`` (and ``v``). slots: ``[rows]`` int;
    k: ``[rows, H_kv, D]`` (MLA ``[rows, D]``)."""
    kb, vb, sks, skh, svs, svh = layer_pools(runner, layer_id)
    rows = slots.shape[0]
    if rows == 0:
        return
    k3 = k if k.dim() == 3 else k.unsqueeze(1)
    v3 = k3 if v is None else v
    K._write_kv_kernel[(rows, k3.shape[1])](
        slots, slots.stride(0), k3, v3, kb, vb, k3.stride(0), k3.stride(1), v3.stride(0),
        v3.stride(1), sks, skh, svs, svh, kb.shape[0], KW=k3.shape[2], BLOCK_KW=_pow2(k3.shape[2]),
        D_V=v3.shape[2], BLOCK_DV=_pow2(v3.shape[2]), WRITE_V=v is not None, num_warps=1)


def _counters(counter: Optional[torch.Tensor], n: int, device: torch.device) -> torch.Tensor:
    """``n`` zeroed arrival counters: the fixed buffer's first ``n``, or a fresh one."""
    if counter is not None and counter.numel() >= n:
        return counter
    return torch.zeros(n, dtype=torch.int32, device=device)


def attention(q: torch.Tensor, runner, layer, shape: AttnShape, meta: torch.Tensor,
              req_to_token: torch.Tensor, *, mode: int, num_groups: int,
              rows_per_group: int, lanes_per_group: int, topk: int, num_steps: int,
              step: int, num_splits: int, cfg: KernelConfig, mid_o: torch.Tensor,
              mid_lse: torch.Tensor, hist: Optional[torch.Tensor] = None,
              parents: Optional[torch.Tensor] = None,
              new_kv: Optional[tuple] = None,
              counter: Optional[torch.Tensor] = None,
              work: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Stage 1 + merge. q: ``[rows, H_q, D]`` -> o: ``[rows, H_q, D_v]`` in ``q.dtype``.

    new_kv: ``(k, v)`` of this call (``v`` None for MLA), stored at ``hist[row, step]``
    (decode: ``hist [lanes, num_steps]``; extend: ``hist [tokens, 1]``, ``step = 0``) the
    way ``kv_write_mode`` says; None: the caller has written them.
    counter: int32 zeros, the fixed buffer for ``cfg.fuse_merge``'s arrival counters.
    work: ``cfg.gluon_worklist``'s table (``decode_metadata``); ``num_splits`` is then the
    programs per row tile and ``mid_o`` / ``mid_lse`` come from ``worklist_scratch``."""
    kb, vb, sks, skh, svs, svh = layer_pools(runner, layer.layer_id)
    rows = q.shape[0]
    hist_t = hist if hist is not None else meta
    par, par_s, par_b = parent_args(parents, meta)
    if parents is not None and parents.stride(2) != 1:
        raise ValueError("parents must have unit stride in its last dimension")
    write = kv_write_mode(runner, cfg) if new_kv is not None else None
    if cfg.gluon and (write is None or mode == 2):
        raise ValueError("the Gluon kernel serves decode with this call's keys (new_kv)")
    if write is not None and (hist is None or not hist.is_contiguous()):
        raise ValueError("a KV write needs the contiguous slot table `hist`")
    if write == "torch":
        runner.write_kv(layer.layer_id, hist[:, step], *new_kv)
    elif write == "kernel":
        write_new_kv(runner, layer.layer_id, hist[:, step], *new_kv)
    in_kernel = write in _NEW_KV
    k_in, v_in = new_kv if in_kernel else (kb, vb)
    if v_in is None:
        v_in = k_in
    dots = dot_args(q.dtype, q.device)
    common = (step, float(layer.scaling), float(layer.logit_cap))
    out = torch.empty(rows, shape.num_q_heads, shape.d_v, dtype=q.dtype, device=q.device)
    parts = num_parts(cfg, num_splits)
    fused = dict(NEW_KV=_NEW_KV.get(write, 0), BLOCK_KW=_pow2(shape.d_main + shape.d_pe),
                 FUSE_MERGE=cfg.fuse_merge, BLOCK_P=_pow2(parts, lo=2))
    if cfg.gluon_worklist and work is None:  # the Gluon or the CuTe kernel's work list
        raise ValueError("config gluon_worklist needs the round's work list (work)")
    if cfg.cute:  # merged on chip (a merge launch only with several clusters per row tile)
        from . import cute_mla
        from .gluon_mla import num_row_tiles

        cute_mla.attention(
            q, kb, new_kv[0], out, req_to_token, meta, hist, parents, mode=mode,
            batch=num_groups, topk=topk, num_steps=num_steps, step=step,
            num_splits=num_splits, sm_scale=layer.scaling, logit_cap=layer.logit_cap,
            write_new=write == "first", mid_o=mid_o, mid_lse=mid_lse,
            counter=_counters(counter, num_groups * num_row_tiles(rows_per_group)
                              * cute_mla.MAX_CLUSTER, q.device) if cfg.fuse_merge else None,
            work=work if cfg.gluon_worklist else None,
            programs=num_splits if cfg.gluon_worklist else 0)
        return out
    if cfg.gluon_worklist:  # implies cfg.gluon (KernelConfig's rule)
        from . import gluon_mla, worklist

        gluon_mla.attention_worklist(
            q, kb, new_kv[0], out, mid_o, mid_lse, req_to_token, meta, work, hist, parents,
            mode=mode, batch=num_groups, topk=topk, num_steps=num_steps, step=step,
            programs=num_splits, sm_scale=layer.scaling, logit_cap=layer.logit_cap,
            block_n=cfg.block_n, num_stages=cfg.num_stages, prefetch=cfg.gluon_prefetch,
            write_new=write == "first")
        worklist.merge(mid_o, mid_lse, out, work, num_splits, topk)
        return out
    if cfg.gluon:
        from . import gluon_mla

        direct = gluon_mla.attention(
            q, kb, new_kv[0], out, mid_o, mid_lse, req_to_token, meta, hist, parents,
            mode=mode, batch=num_groups, topk=topk, num_steps=num_steps, step=step,
            num_splits=num_splits, sm_scale=layer.scaling, logit_cap=layer.logit_cap,
            block_n=cfg.block_n, num_stages=cfg.num_stages, overlap=cfg.gluon_overlap,
            prefetch=cfg.gluon_prefetch, warp_specialized=cfg.gluon_ws,
            write_new=write == "first")
        if direct:
            return out
    elif cfg.mla_v3:
        if not shape.mla_kernel:
            raise ValueError(f"mla_v3 needs an MLA shape with an even latent width, got {shape}")
        dv = cfg.dv_split
        half = shape.d_main // 2
        grid = (triton.cdiv(rows_per_group, cfg.block_m) * dv, num_groups, num_splits)
        cnt = _counters(counter, grid[0] * grid[1], q.device) if cfg.fuse_merge else meta
        K._mla_partial_kernel[grid](
            q, kb, k_in, mid_o, mid_lse, out, cnt, req_to_token, meta, hist_t, par, *common,
            q.stride(0), q.stride(1), sks, k_in.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0), par_s,
            par_b, kb.shape[0], topk, num_steps, lanes_per_group, num_splits,
            GROUP=shape.group, MODE=mode, D_HALF=half, D_PE=shape.d_pe,
            BLOCK_H=_pow2(half), BLOCK_DPE=_pow2(shape.d_pe),
            ACC_B_W=_pow2(half) if dv == 1 else 16, DV_SPLIT=dv, V_RELOAD=cfg.v_reload,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, USE_CAP=layer.logit_cap > 0, **fused,
            **dots, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    else:
        grid = (triton.cdiv(rows_per_group, cfg.block_m), num_groups * shape.num_kv_heads,
                num_splits + 1)
        cnt = _counters(counter, grid[0] * grid[1], q.device) if cfg.fuse_merge else meta
        kin_h = k_in.stride(1) if k_in.dim() == 3 else 0
        vin_h = v_in.stride(1) if v_in.dim() == 3 else 0
        K._partial_attn_kernel[grid](
            q, kb, vb, k_in, v_in, mid_o, mid_lse, out, cnt, req_to_token, meta, hist_t, par,
            *common, q.stride(0), q.stride(1), sks, skh, svs, svh,
            k_in.stride(0), kin_h, v_in.stride(0), vin_h,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0), par_s,
            par_b, kb.shape[0], topk, num_steps, lanes_per_group, num_splits,
            NUM_KV_HEADS=shape.num_kv_heads, GROUP=shape.group, MODE=mode,
            D_MAIN=shape.d_main, D_PE=shape.d_pe, D_V=shape.d_v,
            BLOCK_D=_pow2(shape.d_main), BLOCK_DPE=_pow2(shape.d_pe),
            BLOCK_DV=_pow2(shape.d_v), V_IS_K=shape.v_is_k, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, USE_CAP=layer.logit_cap > 0, **fused, **dots,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not cfg.fuse_merge:
        merge_partials(mid_o, mid_lse, out, parts)
    return out
