"""MLA draft decode on Hopper in Gluon (``triton.experimental.gluon``): wgmma + async copies.

Plans ``gluon-wl`` and ``gluon-split`` (``plans``): shared-prefix MLA draft decode on CUDA
sm90 with Triton 3.6.x, a 512 + 64 latent in bf16 or fp16 (``plans.gluon_reason``).

Kernel (one program per (64-row tile, request, prefix split); 8 warps = two warpgroups):

- The request's ``K * H`` query rows (``K`` lanes x ``H`` heads: 64 at K 4 / H 16; more
  rows: more 64-row tiles, each its own program) stay in shared memory (the latent
  ``[64, 512]`` and rope ``[64, 64]`` parts) for the whole program, so the request's prefix
  is read once per row tile and step.
- Keys arrive ``BLOCK_N`` at a time through ``cp.async`` row gathers (``req_to_token``, any
  page size) into a ring of ``NUM_STAGES`` shared-memory stages, ``NUM_STAGES - 1`` tiles
  ahead of the MMAs; each tile's ``req_to_token`` entries are loaded one tile earlier and
  first read at its copy issue, so that load's latency passes behind the MMAs.
- ``S = Q.K^T`` is one wgmma chain per tile (latent, then rope); the two warpgroups each
  compute half of the tile's columns, so S is computed once. The online softmax (base 2)
  reduces across both; ``P`` reaches the ``P.V`` wgmma as a register operand (a layout
  conversion through shared memory), and each warpgroup owns one 256-wide half of the
  ``[64, 512]`` fp32 output accumulator.
- The last prefix split also walks the tail (each lane's ``step + 1`` history keys, ``lane``
  or ``path`` mode, masked to the key's own lane); the call's new key is read from ``k``
  (split 0 stores it in the pool, so no program waits on another).
- One split: the program normalises and writes the output directly (no merge launch);
  several: fp32 partials + natural-log LSE, merged by ``specattn.kernels.merge``.
- ``gluon-wl`` (``_gluon_mla_wl_kernel``, ``attention_worklist``): the same tile loop over
  ``worklist``'s balanced work list, programs in proportion to each request's length.

Run on: H200, torch 2.11 + cu130, Triton 3.6.0 (``docs/kernels.md``).
"""

from __future__ import annotations

import functools
import torch

from .plans import gluon_import_reason
from .worklist import num_row_tiles

NUM_WARPS = 8  # two warpgroups


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
              meta: torch.Tensor, hist: torch.Tensor, parents: tuple, *,
              mode: int, batch: int, topk: int, num_steps: int, step: int, num_splits: int,
              sm_scale: float, logit_cap: float, block_n: int, num_stages: int) -> None:
    """Launch the split kernel: one split writes ``out``, several write ``mid_o``/``mid_lse``
    (``num_splits`` partials the caller merges).

    q: ``[B*K, H, 576]``; kv: the layer's latent pool ``[slots, 576]``; k_new: ``[B*K, 576]``
    (this step's keys, stored at ``hist[:, step]`` by split 0); out: ``[B*K, H, 512]``;
    mid_o: ``[B*K, H, >= splits, 512]`` fp32; mid_lse: ``[B*K, H, >= splits]`` fp32; meta:
    ``[>= B, 5]`` int32 (``_metadata_kernels``); hist: ``[B*K, S]`` int32; parents:
    ``launchers.parent_args`` of ``[S, B, K]`` (path mode, ``mode == 1``)."""
    K = kernel_module()
    H = q.shape[1]
    par, par_s, par_b = parents
    K._gluon_mla_kernel[(num_row_tiles(topk * H), batch, num_splits)](
        q, kv, k_new, mid_o, mid_lse, out, req_to_token, meta, hist, par,
        step, float(sm_scale), float(logit_cap),
        q.stride(0), q.stride(1), kv.stride(0), k_new.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0),
        par_s, par_b, kv.shape[0], topk, num_steps, num_splits,
        H=H, MODE=mode, BLOCK_N=block_n, NUM_STAGES=num_stages, USE_CAP=logit_cap > 0,
        DIRECT_OUT=num_splits == 1, num_warps=NUM_WARPS)


def attention_worklist(q: torch.Tensor, kv: torch.Tensor, k_new: torch.Tensor,
                       out: torch.Tensor, mid_o: torch.Tensor, mid_lse: torch.Tensor,
                       req_to_token: torch.Tensor, meta: torch.Tensor, work: torch.Tensor,
                       hist: torch.Tensor, parents: tuple, *, mode: int,
                       batch: int, topk: int, num_steps: int, step: int, programs: int,
                       sm_scale: float, logit_cap: float, block_n: int,
                       num_stages: int) -> None:
    """The kernel on ``worklist``'s balanced work list (``work``, filled for this round with
    ``programs`` per row tile): writes ``out`` for requests with one program, partials for
    the others (the caller merges them: ``worklist.merge``).

    mid_o: ``[slots >= programs + batch, worklist.partial_rows(topk, H), 512]`` fp32;
    mid_lse: ``[slots, partial_rows]`` fp32; the rest as in ``attention``."""
    kernel_module()  # the version and Gluon checks
    from . import _gluon_mla_wl_kernel as W

    H = q.shape[1]
    par, par_s, par_b = parents
    W._gluon_mla_wl_kernel[(num_row_tiles(topk * H), programs)](
        q, kv, k_new, mid_o, mid_lse, out, req_to_token, meta, work, hist, par,
        step, float(sm_scale), float(logit_cap),
        q.stride(0), q.stride(1), kv.stride(0), k_new.stride(0), mid_o.stride(0),
        mid_lse.stride(0), out.stride(0), out.stride(1), req_to_token.stride(0), par_s, par_b,
        kv.shape[0], topk, num_steps, batch, programs,
        H=H, MODE=mode, BLOCK_N=block_n, NUM_STAGES=num_stages, USE_CAP=logit_cap > 0,
        num_warps=NUM_WARPS)
