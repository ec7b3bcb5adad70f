"""MLA draft decode and extend on Hopper in Gluon (plans ``gluon-wl`` and ``gluon-split``;
sm90, Triton 3.6.x, a 512 + 64 latent, bf16/fp16 queries over a pool of their dtype or of
FP8 codes: ``plans.gluon_reason``); run on the H200.

One program of 12 warps per (64-row tile, request, prefix split; ``gluon-wl``: per segment
of ``worklist``'s work list), warp-specialised: a producer warpgroup (4 warps) gathers key
tiles by ``cp.async`` into a ring (``req_to_token`` read a tile ahead) and hands each over
by mbarrier, while 8 warps hold the tile's ``K * H`` query rows in shared memory and run S
by wgmma (each warpgroup on half its columns) and P.V from registers into each warpgroup's
256 output columns. Split 0 stores the call's keys; the last split walks the lanes'
history (the new key read from ``k``). Extend (``gluon-split``): the lanes are a request's
new tokens and the tail is every new token up to the tile's last, causal. An FP8 pool
(``float8_e4m3fn`` / ``float8_e5m2`` codes, a key is ``code * k_scale``): the producer
copies the codes into a ring of their own and widens them exactly into a staging tile that
the wgmmas read (fp16 under bf16 queries too: the query rows prescaled as the ``tl.dot``
kernels' ``Q_F16``); ``k_scale`` scales the scores and the output; the call's codes are
stored by the programs whose tails read them (``write``), or by torch
(``runner.write_kv``) before the kernel, and read from the pool. ``docs/kernels.md`` has
the measurements.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ...kernels.kv_write import Fp8Write
from ...kernels.pdl import launch_args
from ...kernels.tiles import Q_F16_PRESCALE
from .plans import gluon_import_reason, num_row_tiles

NUM_WARPS = 8  # the two computing warpgroups (the producer's 4 warps are warp_specialize's)
FP8_POOLS = (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.lru_cache(maxsize=None)
def kernel_module():
    """The compiled-kernel module (``_gluon_mla_kernel``); raises if Gluon is unusable."""
    reason = gluon_import_reason()
    if reason is not None:
        raise RuntimeError(reason)
    from . import _gluon_mla_kernel

    return _gluon_mla_kernel


def attention(q: torch.Tensor, kv: torch.Tensor, k_new: torch.Tensor, out: torch.Tensor,
              mid_o: torch.Tensor, mid_lse: torch.Tensor, req_to_token: torch.Tensor,
              meta: torch.Tensor, hist: torch.Tensor, parents: tuple, *, mode: int, batch: int,
              topk: int, num_steps: int, step: int, num_splits: int, sm_scale: float,
              logit_cap: float, block_n: int, num_stages: int,
              work: Optional[torch.Tensor] = None,
              k_scale: Optional[torch.Tensor] = None, rows: Optional[int] = None,
              pdl: bool = False, write: Optional[Fp8Write] = None) -> None:
    """Launch the split kernel, or with ``work`` the work-list kernel; the caller merges the
    partials (``merge_partials``; ``worklist.merge``).

    q: ``[B*K, H, 576]``; kv: the layer's latent pool ``[slots, 576]``; k_new: ``[B*K, 576]``
    (this step's keys, stored at ``hist[:, step]``); out: ``[B*K, H, 512]``; meta: ``[>= B,
    5]`` int32 (``_metadata_kernels``); hist: ``[B*K, S]`` int32; parents:
    ``launchers.parent_args`` of ``[S, B, K]`` (path mode, ``mode == 1``).
    Split: one split writes ``out``, several the fp32 partials ``mid_o [B*K, H, >= splits,
    512]`` / ``mid_lse [B*K, H, >= splits]``. Work list (``worklist``'s table for
    ``num_splits`` programs per row tile): requests with one program write ``out``, the
    others partial slots ``mid_o [>= programs + B, worklist.partial_rows(topk, H), 512]``
    (fp32, or the query's dtype: ``launchers.partial_dtype``) / ``mid_lse [slots,
    partial_rows]`` fp32.
    FP8 pool (``kv`` of ``FP8_POOLS``): ``k_scale`` is a one-element float32 tensor (a key is
    ``code * k_scale[0]``); with ``write`` (``kv_write.fp8_write``'s answer) the kernel
    stores torch's codes of ``k_new`` itself, from the programs whose tails read them, else
    the call's codes are in the pool already (``k_new`` is not read).
    Extend (``mode == 2``, the split kernel): q ``[T, H, 576]`` and k_new ``[T, 576]`` the
    new tokens, hist ``[T, 1]`` their slots, meta rows as ``_extend_metadata_kernel``
    writes them; ``rows``: the grid's query rows per request (``max E * H``; decode: ``K *
    H``, the default).
    ``pdl`` (sm90): every program releases the merge launch (a programmatic dependent
    launch, ``pdl.launch_args``) once it has stored its result; the kernel itself is an
    ordinary launch (it may read what the launch before wrote)."""
    fp8 = kv.dtype in FP8_POOLS
    if write is not None and not fp8:
        raise ValueError("the Gluon kernels' FP8 write serves FP8 pools only: over other "
                         "pools they store the call's keys themselves")
    if fp8 and (k_scale is None or k_scale.dtype != torch.float32 or k_scale.numel() != 1):
        raise ValueError("an FP8 pool needs k_scale, a one-element float32 tensor")
    if not fp8 and kv.dtype != q.dtype:
        raise ValueError(f"the Gluon kernels read a pool of the query's dtype or FP8 codes, "
                         f"got a {kv.dtype} pool for {q.dtype} queries")
    K = kernel_module()  # the version and Gluon checks
    H = q.shape[1]
    par, par_s, par_b = parents
    scale = k_scale if fp8 else meta  # a placeholder, never read without FP8
    q_f16 = fp8 and q.dtype == torch.bfloat16  # fp16 wgmmas: one conversion per two codes
    prescale = Q_F16_PRESCALE if q_f16 else 1.0
    consts = dict(H=H, MODE=mode, BLOCK_N=block_n, NUM_STAGES=num_stages,
                  USE_CAP=logit_cap > 0, FP8=fp8, Q_F16=q_f16, num_warps=NUM_WARPS,
                  **launch_args(pdl))
    w_scale = meta  # a placeholder, never read without write
    if write is not None:
        w_scale = write.k_scale
        consts.update(STORE_FP8=True, W_QUANT=write.k_quant, **write.codes.kwargs())
    if work is None:
        K._gluon_mla_kernel[(num_row_tiles(rows or topk * H), batch, num_splits)](
            q, kv, k_new, mid_o, mid_lse, out, req_to_token, meta, hist, par, scale, w_scale,
            step, float(sm_scale), float(logit_cap), prescale,
            q.stride(0), q.stride(1), kv.stride(0), k_new.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0),
            par_s, par_b, kv.shape[0], topk, num_steps, num_splits,
            DIRECT_OUT=num_splits == 1, **consts)
        return
    from . import _gluon_mla_wl_kernel as W

    W._gluon_mla_wl_kernel[(num_row_tiles(topk * H), num_splits)](
        q, kv, k_new, mid_o, mid_lse, out, req_to_token, meta, work, hist, par, scale, w_scale,
        step, float(sm_scale), float(logit_cap), prescale,
        q.stride(0), q.stride(1), kv.stride(0), k_new.stride(0), mid_o.stride(0),
        mid_lse.stride(0), out.stride(0), out.stride(1), req_to_token.stride(0), par_s, par_b,
        kv.shape[0], topk, num_steps, batch, num_splits, **consts)
