"""Launchers: split counts, scratch buffers, grids and the launch of each plan's kernel.
``plan_splits`` reads Python ints only (one plan serves every replay of a graph); the rest
launches on tensors only: graph-safe, no host sync.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton

from ...fp8 import scale_tensor
from ...kernels.kv_write import Fp8Write, head_rows, fp8_write, layer_pools, write_new_kv
from ...kernels.merge import merge_partials
from ...kernels.pdl import launch_args as pdl_launch_args
from ...kernels.tiles import Q_F16_PRESCALE, cvt_args, dot_args
from ...util import next_pow2
from . import _attn_kernels as K
from . import cute_mla, gluon_mla, plans, worklist
from ._metadata_kernels import _decode_metadata_kernel, _extend_metadata_kernel
from ...kernels.kernel_launch import KernelLaunch
from .plans import (DECODE_ONLY_KERNELS, DOT_MAX_SPLITS, MAX_SPLITS, PARTIAL_ROWS, AttnShape,
                    Kernel, Plan)

# Kernels launched as programmatic dependents of the KV write launch before them (``pdl``).
PDL_AFTER_WRITE = (Kernel.DOT,)


def _pow2(x: int) -> int:
    return next_pow2(x, lo=16)


def split_cap(plan: Plan, rows: int, extend: bool = False) -> int:
    """The most prefix splits a round of ``rows`` query rows (lanes; extend: new tokens) may
    take. The partial buffers hold ``partial_room(rows)`` parts per row, so a round of few
    rows (one request) gives the ``tl.dot`` kernels (split-KV and MLA) and ``gluon-split``'s
    extend more splits, up to ``DOT_MAX_SPLITS``: enough programs to fill the GPU from one
    prefix; ``cute`` writes one part per cluster of up to ``MAX_CLUSTER`` splits.
    ``gluon-wl`` sizes its partials by its work list (programs per row tile), so it takes
    up to ``DOT_MAX_SPLITS`` at any row count. The others keep ``MAX_SPLITS``."""
    if plan.kernel is Kernel.GLUON_WL:
        return DOT_MAX_SPLITS
    if plan.kernel is Kernel.CUTE:
        return cute_mla.MAX_CLUSTER * partial_room(rows)
    if plan.kernel not in (Kernel.DOT, Kernel.DOT_MLA) and not (
            extend and plan.kernel is Kernel.GLUON_SPLIT):
        return MAX_SPLITS
    tail_parts = num_parts(plan, 0)  # split-KV: the tail's own partial
    return max(1, min(DOT_MAX_SPLITS, partial_room(rows) - tail_parts))


def partial_room(rows: int) -> int:
    """Parts per query row the partial buffers hold for a round of ``rows`` rows: they hold
    ``MAX_SPLITS + 1`` parts of ``max(rows, PARTIAL_ROWS)`` rows."""
    return max(rows, PARTIAL_ROWS) * (MAX_SPLITS + 1) // max(1, rows)


def unsplit_programs(plan: Plan, shape: AttnShape, rows_per_group: int,
                     num_groups: int) -> int:
    """Programs of a round before prefix splits: row tiles x groups x KV heads (what
    ``plans.few_groups`` judges)."""
    return triton.cdiv(rows_per_group, plan.tile(rows_per_group)[0]) * num_groups * \
        shape.num_kv_heads


def plan_splits(plan: Plan, shape: AttnShape, rows_per_group: int, num_groups: int,
                device: torch.device, extend: bool, rows: int, kv_bytes: int = 2) -> int:
    """Prefix splits of a round of ``rows`` query rows (host ints only: graph-safe), at most
    ``split_cap``; for ``gluon-wl`` the work list's programs per row tile. The ``tl.dot``
    split-KV kernel: where a round has few programs (``plans.few_groups``; in decode, for
    ``plans.ONE_WAVE_PLANS`` wherever they fit in one wave), as many prefix splits as fill
    one wave of the SMs' program slots (``Plan.programs_per_sm``) without a straggling
    second one (the short tail programs may start a second); else about 4 programs per SM,
    rounded up, in extend about 2 (``docs/kernels.md``). The others (~200 KB of shared
    memory: one program per SM): one wave, rounded down (``cute``: one wave of clusters).
    ``kv_bytes``: bytes of a pool element."""
    if plan.kernel is Kernel.GLUON_WL:
        row_tiles = triton.cdiv(rows_per_group, plan.tile(rows_per_group)[0])
        return worklist.programs_per_row_tile(row_tiles, num_groups, device)
    programs = unsplit_programs(plan, shape, rows_per_group, num_groups)
    sms = plans.sms(device)
    if plan.kernel is not Kernel.DOT:
        n = sms // programs
    else:
        slots = plan.programs_per_sm(rows_per_group, kv_bytes) * sms
        one_wave = plans.few_groups(programs, device) or (
            not extend and plan.name in plans.ONE_WAVE_PLANS and programs <= slots)
        n = slots // programs if one_wave else triton.cdiv((2 if extend else 4) * sms,
                                                           programs)
    n = max(1, min(split_cap(plan, rows, extend), n))
    if plan.kernel is Kernel.CUTE:
        return cute_mla.plan_splits(programs, device, n, partial_room(rows))
    return n


def num_parts(plan: Plan, num_splits: int, programs: int = 1,
              device: Optional[torch.device] = None, rows: int = 1) -> int:
    """Partials per row: one per split, plus the history's own program in the ``tl.dot``
    split-KV kernel (the others walk it in their last split); ``cute``: one per cluster
    of the ``programs`` (request, row tile) pairs' splits (``cute_mla.cluster_shape``) in
    a round of ``rows`` query rows on ``device``."""
    if plan.kernel is Kernel.CUTE:  # plan_splits and a forced count's check found a shape
        shape = cute_mla.cluster_shape(num_splits, programs, device, partial_room(rows))
        if shape is None:
            raise ValueError(f"plan cute: {num_splits} splits form no cluster shape")
        return shape[1]
    return num_splits + 1 if plan.kernel is Kernel.DOT else num_splits


def decode_metadata(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    out_cache_loc: torch.Tensor, meta: torch.Tensor, hist: torch.Tensor,
                    num_splits: int, block_n: int, num_slots: int,
                    work: Optional[torch.Tensor] = None, tail: int = 0,
                    fixed: Optional[tuple] = None) -> KernelLaunch:
    """Fill ``meta [>=B, 5]`` and ``hist [>=B*K, S]`` (int32) for a draft round in one launch;
    with ``work``, also the ``gluon-wl`` work list for ``num_splits`` programs per row tile
    and ``tail`` tail units per request (``worklist.write_work``).

    out_cache_loc: ``[B, K, S]``. fixed: a CUDA-graph round's fixed ``(req_pool_indices
    [bs], seq_lens [bs], out_cache_loc [bs, K, S])`` (int64, contiguous), filled from the
    ``B <= bs`` requests given and padded (request row 0, ``seq_lens`` 1, slot 0): the
    metadata then covers ``bs`` requests.

    Returns the launch, which repeats it for other ``(req_pool_indices, seq_lens,
    out_cache_loc)`` of these dtypes, devices, shapes and strides (``KernelLaunch``)."""
    launch = decode_metadata_launch(req_pool_indices, seq_lens, out_cache_loc, meta, hist,
                                    num_splits, block_n, num_slots, work, tail, fixed)
    launch(req_pool_indices, seq_lens, out_cache_loc)
    return launch


def decode_metadata_launch(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                           out_cache_loc: torch.Tensor, meta: torch.Tensor,
                           hist: torch.Tensor, num_splits: int, block_n: int, num_slots: int,
                           work: Optional[torch.Tensor] = None, tail: int = 0,
                           fixed: Optional[tuple] = None) -> KernelLaunch:
    """``decode_metadata``'s launch, not run: called with ``(req_pool_indices, seq_lens,
    out_cache_loc)``."""
    raw, topk, steps = out_cache_loc.shape
    bs = raw if fixed is None else fixed[0].shape[0]
    fix = fixed if fixed is not None else (meta, meta, meta)
    block_b = next_pow2(bs)
    wl = work is not None
    tail_args = (meta, hist, *fix, meta if work is None else work,
                 req_pool_indices.stride(0), seq_lens.stride(0), out_cache_loc.stride(0),
                 out_cache_loc.stride(1), out_cache_loc.stride(2), num_slots, raw,
                 num_splits, tail)
    consts = dict(TOPK=topk, NUM_STEPS=steps, BLOCK_S=next_pow2(steps),
                  NUM_SPLITS=num_splits, BLOCK_N=block_n, FIXED=fixed is not None, WORK=wl,
                  BLOCK_B=block_b if wl else 1, BLOCK_P=worklist.block_p(block_b) if wl else 1,
                  num_warps=4 if wl else 1)
    return KernelLaunch(_decode_metadata_kernel, (bs * topk + int(wl),), tail_args, consts)


def extend_metadata(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    extend_lens: torch.Tensor, out_cache_loc: torch.Tensor, meta: torch.Tensor,
                    hist: torch.Tensor, num_splits: int, block_n: int,
                    fixed_loc: Optional[torch.Tensor] = None,
                    padded: Optional[tuple[int, int]] = None) -> KernelLaunch:
    """Fill ``meta [>=B, 5]`` for an extend batch (prefix ``L' - E``, ``cumsum(E)``) and
    ``hist[:T, 0]`` with the new tokens' slots ``out_cache_loc [T]`` (int32), in one launch;
    ``fixed_loc``: a CUDA-graph round's fixed ``out_cache_loc`` view (int64, at least
    ``[T]``), which gets them too. ``padded``: a graph replay's captured ``(requests,
    tokens)``, at least the batch's: the rest filled as padding (no-op requests, tokens in
    slot 0). Returns the launch (as ``decode_metadata``), called with ``(req_pool_indices,
    seq_lens, extend_lens, out_cache_loc)``."""
    bs, tokens = req_pool_indices.shape[0], out_cache_loc.shape[0]
    pad_bs, pad_tokens = padded or (bs, tokens)
    if hist.stride(0) != 1:
        raise ValueError("extend_metadata needs hist [rows, 1] with unit row stride")
    tail_args = (meta, hist, meta if fixed_loc is None else fixed_loc, bs, tokens, pad_bs,
                 pad_tokens, req_pool_indices.stride(0), seq_lens.stride(0),
                 extend_lens.stride(0), out_cache_loc.stride(0))
    consts = dict(BLOCK_B=next_pow2(pad_bs), NUM_SPLITS=num_splits, BLOCK_N=block_n,
                  BLOCK_T=min(1024, next_pow2(pad_tokens)), FIXED=fixed_loc is not None,
                  num_warps=4)
    launch = KernelLaunch(_extend_metadata_kernel, (1,), tail_args, consts)
    launch(req_pool_indices, seq_lens, extend_lens, out_cache_loc)
    return launch


def partial_dtype(plan: Plan, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a call's normalised partial outputs: the query's (bf16 / fp16) where the
    plan is ``gluon-wl``, whose programs write 64 rows x 512 columns each (at one request
    as many bytes as half the prefix it reads) and store them through a blocked layout;
    fp32 elsewhere. LSEs stay fp32 and the merges sum in fp32."""
    half = dtype in (torch.bfloat16, torch.float16)
    return dtype if half and plan.kernel is Kernel.GLUON_WL else torch.float32


def partial_views(lse_shape: tuple, d_v: int, device: torch.device,
                  flat_o: Optional[torch.Tensor], flat_lse: Optional[torch.Tensor],
                  dtype: torch.dtype = torch.float32):
    """Partials ``(lse_shape + (d_v,)`` in ``dtype`` (fp32, bf16 or fp16), ``lse_shape``
    fp32): views of ``flat_o`` (fp32; a 2-byte ``dtype`` views its bytes) / ``flat_lse``
    (fixed CUDA-graph buffers) when they are large enough, else fresh buffers.
    ``lse_shape``: ``(rows, H_q, parts)``; ``gluon-wl``: ``(slots, rows)``."""
    n_l = math.prod(lse_shape)
    n_o = n_l * d_v
    if flat_o is None or flat_o.numel() < n_o or flat_lse.numel() < n_l:
        flat_o = torch.empty(n_o, dtype=torch.float32, device=device)
        flat_lse = torch.empty(n_l, dtype=torch.float32, device=device)
    o = flat_o if dtype == torch.float32 else flat_o.view(dtype)
    return o[:n_o].view(*lse_shape, d_v), flat_lse[:n_l].view(*lse_shape)


def tail_stores_kv(kb: torch.Tensor, vb: torch.Tensor, new_kv: tuple, programs: int,
                   device: torch.device, fp8: bool = False) -> bool:
    """Whether the split-KV kernel's tail programs store this call's KV (``NEW_KV``) in
    place of a KV write launch before it, so that the call is two launches (kernel, merge):
    decode and extend of a round of few ``programs`` (``plans.few_groups``; in decode one
    launch less is 4-8% of such a step) into pools of the new rows' dtype, or with ``fp8``
    (the caller found the kernel's codes to be torch's: ``fp8_write``) into FP8 pools.
    Rounds of many requests keep it: with the store in the kernel, 32 requests x 4k tokens
    of decode ran 14% slower (H200, ``docs/kernels.md``)."""
    k, v = new_kv
    return plans.few_groups(programs, device) and (fp8 or (k.dtype == kb.dtype and (
        v is None or v.dtype == vb.dtype))) and k.stride(-1) == 1 and (
        v is None or v.stride(-1) == 1)


def tail_kv_args(tail_kv: bool, kb: torch.Tensor, vb: torch.Tensor, new_kv: tuple,
                 fp8: Optional[Fp8Write] = None) -> tuple:
    """The split-KV kernel's ``(Kin, Vin, WKScale, WVScale, constexprs)``: where ``tail_kv``,
    the call's k and v as ``[rows, H_kv, D]`` with ``NEW_KV`` and ``BLOCK_KW`` (and with
    ``fp8``, the FP8 write's scales and constexprs, as ``write_new_kv`` passes them); else
    the pools (never read)."""
    if not tail_kv:
        return kb, vb, kb, vb, {}
    k3, v3 = head_rows(*new_kv)
    consts = dict(NEW_KV=True, BLOCK_KW=_pow2(k3.shape[2]))
    if fp8 is None:
        return k3, v3, kb, vb, consts
    return k3, v3, fp8.k_scale, fp8.v_scale, dict(
        consts, FP8=True, K_QUANT=fp8.k_quant, V_QUANT=fp8.v_quant, **fp8.codes.kwargs())


def parent_args(parents: Optional[torch.Tensor], placeholder: torch.Tensor) -> tuple:
    """``(tensor, stride_s, stride_b)`` the kernels take for ``parents [S, B, K]`` (path
    mode); without it any int tensor (never read) and zero strides."""
    if parents is None:
        return placeholder, 0, 0
    if parents.stride(2) != 1:
        raise ValueError("parents must have unit stride in its last dimension")
    return parents, parents.stride(0), parents.stride(1)


def attention(q: torch.Tensor, runner, layer, shape: AttnShape, meta: torch.Tensor,
              req_to_token: torch.Tensor, *, mode: int, num_groups: int,
              rows_per_group: int, lanes_per_group: int, topk: int, num_steps: int,
              step: int, num_splits: int, plan: Plan, mid_o: torch.Tensor,
              mid_lse: torch.Tensor, hist: torch.Tensor, new_kv: tuple,
              parents: Optional[torch.Tensor] = None,
              work: Optional[torch.Tensor] = None, pdl: bool = False) -> torch.Tensor:
    """Store this call's KV, attend, merge. q: ``[rows, H_q, D]`` -> o: ``[rows, H_q, D_v]``
    in ``q.dtype``.

    new_kv: ``(k, v)`` of this call (``v`` None for MLA), stored at ``hist[row, step]``
    (decode: ``hist [lanes, num_steps]``; extend: ``hist [tokens, 1]``, ``step = 0``): by the
    ``tl.dot`` split-KV kernel's tail programs in a few-request decode or extend
    (``tail_stores_kv``), else by one launch before it; by the other kernels' first split
    (the Gluon kernels': the programs whose tails read them). Into an FP8 pool as torch's
    codes: on CUDA (``fp8_write``) by the Gluon kernels, the few-request ``tl.dot`` tail
    programs or that launch, else by ``runner.write_kv`` before any kernel; read back by the
    ``tl.dot`` and Gluon kernels with the layer's scales (``layer.k_scale`` / ``v_scale``)
    folded in (``cute`` reads bf16/fp16 pools only).
    work: the ``gluon-wl`` round's work list (``decode_metadata``); ``num_splits`` is then the
    programs per row tile and ``mid_o`` / ``mid_lse`` are its slots (``partial_views``).
    pdl (sm90+; not ``cute``): the merge is a programmatic dependent launch, and so is the
    split-KV kernel after the KV write launch (not after torch's FP8 write, which is several
    launches); ``dot-mla`` and the Gluon kernels stay ordinary launches (all they read may
    come from the launch before). The ``tl.dot`` plans
    over FP8 pools under a bf16 model dot in fp16 on a prescaled query (``Q_F16``,
    ``_attn_kernels``)."""
    if not hist.is_contiguous():
        raise ValueError("a KV write needs the contiguous slot table `hist`")
    kb, vb, sks, skh, svs, svh = layer_pools(runner, layer.layer_id)
    out = torch.empty(q.shape[0], shape.num_q_heads, shape.d_v, dtype=q.dtype, device=q.device)
    kernel = plan.kernel
    scaled = getattr(runner, "fp8", False)
    written = False  # whether the launch just before the split-KV kernel is the KV write
    tail_kv = False  # whether the split-KV kernel's tail programs store the new KV
    fp8: Optional[Fp8Write] = None  # how a kernel stores FP8 codes torch's way
    k_scale = v_scale = meta  # placeholders, never read without FP8
    if scaled:  # the kernels read the codes from the pool, the layer's scales folded in
        k_scale = scale_tensor(layer.k_scale, q.device)
        v_scale = scale_tensor(layer.v_scale, q.device)
        fp8 = fp8_write(runner, layer, new_kv, q.device)
        if fp8 is None:  # torch's codes, stored by torch
            runner._store_kv(layer.layer_id, hist[:, step], *new_kv, k_scale=layer.k_scale,
                             v_scale=layer.v_scale)
        elif kernel is Kernel.DOT and tail_stores_kv(
                kb, vb, new_kv, unsplit_programs(plan, shape, rows_per_group, num_groups),
                q.device, fp8=True):
            tail_kv = True  # the kernel's tail programs store the codes
        elif kernel in (Kernel.GLUON_WL, Kernel.GLUON_SPLIT):
            tail_kv = True  # so do the Gluon kernels' (gluon_mla.attention's write)
        else:
            written = write_new_kv(runner, layer.layer_id, hist[:, step], *new_kv, pdl=pdl,
                                   fp8=fp8) and kernel in PDL_AFTER_WRITE
    elif kernel is Kernel.DOT:
        tail_kv = tail_stores_kv(kb, vb, new_kv, unsplit_programs(
            plan, shape, rows_per_group, num_groups), q.device)
        if not tail_kv:
            written = write_new_kv(runner, layer.layer_id, hist[:, step], *new_kv, pdl=pdl)
    if kernel in DECODE_ONLY_KERNELS and mode == 2:
        raise ValueError(f"plan {plan.name} serves decode only")
    if kernel is Kernel.CUTE and scaled:
        raise ValueError("plan cute serves bf16/fp16 pools only")
    if kernel is Kernel.CUTE:  # a request's splits merged on chip
        cute_mla.attention(q, kb, new_kv[0], out, req_to_token, meta, hist, parents,
                           mode=mode, batch=num_groups, topk=topk, num_steps=num_steps,
                           step=step, num_splits=num_splits, sm_scale=layer.scaling,
                           logit_cap=layer.logit_cap, mid_o=mid_o, mid_lse=mid_lse)
        return out
    if kernel in (Kernel.GLUON_WL, Kernel.GLUON_SPLIT):
        wl = kernel is Kernel.GLUON_WL
        if wl and work is None:
            raise ValueError("plan gluon-wl needs the round's work list (work)")
        gluon_mla.attention(
            q, kb, new_kv[0], out, mid_o, mid_lse, req_to_token, meta, hist,
            parent_args(parents, meta),
            mode=mode, batch=num_groups, topk=topk, num_steps=num_steps, step=step,
            num_splits=num_splits, sm_scale=layer.scaling, logit_cap=layer.logit_cap,
            block_n=plan.block_n, num_stages=plan.num_stages, work=work if wl else None,
            k_scale=k_scale if scaled else None, rows=rows_per_group, pdl=pdl,
            write=fp8 if tail_kv else None)
        if wl:
            worklist.merge(mid_o, mid_lse, out, work, num_splits, topk, pdl=pdl)
        elif num_splits > 1:
            merge_partials(mid_o, mid_lse, out, num_splits, pdl=pdl)
        return out
    par, par_s, par_b = parent_args(parents, meta)
    dots = dot_args(q.dtype, q.device)
    dots["Q_F16"] = scaled and q.dtype == torch.bfloat16
    common = (step, float(layer.scaling), float(layer.logit_cap),
              Q_F16_PRESCALE if dots["Q_F16"] else 1.0)
    block_m, num_warps = plan.tile(rows_per_group)
    if kernel is Kernel.DOT_MLA:
        if not shape.mla_kernel:
            raise ValueError(f"plan dot-mla needs an MLA shape with an even latent width, "
                             f"got {shape}")
        half = shape.d_main // 2
        k_in = new_kv[0]
        K._mla_partial_kernel[(triton.cdiv(rows_per_group, block_m), num_groups, num_splits)](
            q, kb, k_in, mid_o, mid_lse, req_to_token, meta, hist, par, k_scale, *common,
            q.stride(0), q.stride(1), sks, k_in.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), req_to_token.stride(0), par_s, par_b, kb.shape[0], topk,
            num_steps, lanes_per_group, num_splits,
            GROUP=shape.group, MODE=mode, D_HALF=half, D_PE=shape.d_pe,
            BLOCK_H=_pow2(half), BLOCK_DPE=_pow2(shape.d_pe), BLOCK_M=block_m,
            BLOCK_N=plan.block_n, USE_CAP=layer.logit_cap > 0,
            BLOCK_KW=_pow2(shape.d_main + shape.d_pe), SCALED=scaled, **dots,
            num_warps=num_warps, num_stages=plan.num_stages, **pdl_launch_args(pdl))
    else:
        grid = (triton.cdiv(rows_per_group, block_m), num_groups * shape.num_kv_heads,
                num_splits + 1)
        k_in, v_in, wk_scale, wv_scale, new_kv_args = tail_kv_args(
            tail_kv, kb, vb, new_kv, fp8)
        K._partial_attn_kernel[grid](
            q, kb, vb, k_in, v_in, mid_o, mid_lse, req_to_token, meta, hist, par, k_scale,
            k_scale if shape.v_is_k else v_scale, wk_scale, wv_scale, *common,
            q.stride(0), q.stride(1), sks, skh, svs, svh,
            k_in.stride(0), k_in.stride(1), v_in.stride(0), v_in.stride(1),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), req_to_token.stride(0), par_s, par_b, kb.shape[0], topk,
            num_steps, lanes_per_group, num_splits,
            NUM_KV_HEADS=shape.num_kv_heads, GROUP=shape.group, MODE=mode,
            D_MAIN=shape.d_main, D_PE=shape.d_pe, D_V=shape.d_v,
            BLOCK_D=_pow2(shape.d_main), BLOCK_DPE=_pow2(shape.d_pe),
            BLOCK_DV=_pow2(shape.d_v), V_IS_K=shape.v_is_k, BLOCK_M=block_m,
            BLOCK_N=plan.block_n, USE_CAP=layer.logit_cap > 0, SCALED=scaled, **dots,
            V_CVT=scaled and cvt_args(q.device),
            num_warps=num_warps, num_stages=plan.num_stages, **new_kv_args,
            **pdl_launch_args(pdl, dependent=written))
    merge_partials(mid_o, mid_lse, out, num_parts(plan, num_splits), pdl=pdl)
    return out
