"""MLA draft decode on Hopper in Gluon (``triton.experimental.gluon``): wgmma + async copies.

Used by the ``triton`` backend for shared-prefix MLA draft decode when ``gluon_reason``
returns ``None`` (CUDA sm90, Triton 3.6.x with Gluon's Hopper ops, a 512 + 64 latent in bf16
or fp16, plain pools); otherwise the backend runs the ``tl.dot`` kernel
(``_attn_kernels._mla_partial_kernel``) and logs why once.

Kernel (one program per (64-row tile, request, prefix split); 8 warps = two warpgroups):

- The request's ``K * H`` query rows (``K`` lanes x ``H`` heads: 64 at K 4 / H 16; more
  rows: more 64-row tiles, each its own program) stay in shared memory (the latent
  ``[64, 512]`` and rope ``[64, 64]`` parts) for the whole program, so the request's prefix
  is read once per row tile and step.
- Keys arrive ``BLOCK_N`` at a time through ``cp.async`` row gathers (``req_to_token``, any
  page size) into a ring of ``NUM_STAGES`` shared-memory stages, ``NUM_STAGES - 1`` tiles
  ahead of the MMAs. ``PREFETCH``: each tile's ``req_to_token`` entries are loaded one tile
  earlier and first read at its copy issue, so that load's latency passes behind the MMAs.
- ``S = Q.K^T`` is one wgmma chain per tile (latent, then rope); the two warpgroups each
  compute half of the tile's columns, so S is computed once. The online softmax (base 2)
  reduces across both; ``P`` reaches the ``P.V`` wgmma as a register operand (a layout
  conversion through shared memory), and each warpgroup owns one 256-wide half of the
  ``[64, 512]`` fp32 output accumulator.
- ``OVERLAP``: the next tile's ``S`` wgmma is issued before this tile's ``P.V`` and the
  softmax runs while ``P.V`` is in flight (FA3-style intra-warpgroup overlap).
- The last prefix split also walks the tail (each lane's ``step + 1`` history keys, ``lane``
  or ``path`` mode, masked to the key's own lane); the call's new key is read from ``k``
  (``NEW_KV_FIRST``: split 0 stores it in the pool, so no program waits on another).
- One split: the program normalises and writes the output directly (no merge launch);
  several: fp32 partials + natural-log LSE, merged by ``specattn.kernels.merge.merge_kernel``.
- ``_gluon_mla_ws_kernel`` (opt-in, ``KernelConfig.gluon_ws``): the warp-specialized variant,
  with the two warpgroups on alternate key tiles (passes the H200 tests, no faster).
- ``_gluon_mla_wl_kernel`` (opt-in, ``KernelConfig.gluon_worklist``; ``attention_worklist``):
  the same tile loop over ``worklist``'s balanced work list, programs in proportion to each
  request's length (H200: faster on ragged batches, slower on uniform ones).

Run on: H200, torch 2.11 + cu130, Triton 3.6.0 (see ``docs/gluon-mla.md`` and
``benchmarks/results/2026-11-30-h200/gluon-*.md``).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)

# Triton releases whose Gluon API this kernel was written against and run with.
TESTED_TRITON = ("3.6",)
D_MAIN = 512  # kv_lora_rank
D_PE = 64  # rope width
BLOCK_M = 64  # rows per program: the wgmma height of one warpgroup
NUM_WARPS = 8  # two warpgroups


def _import_gluon() -> tuple[Optional[object], str]:
    """``(module namespace, "")`` when Gluon's Hopper ops import and the Triton version is
    one the kernel was run with, else ``(None, reason)``."""
    try:
        import triton
    except Exception as exc:  # pragma: no cover - triton is a requirement of the backend
        return None, f"triton does not import ({type(exc).__name__})"
    version = getattr(triton, "__version__", "?")
    if not any(version == v or version.startswith(v + ".") for v in TESTED_TRITON):
        return None, (f"triton {version}: the Gluon MLA kernel was run with triton "
                      f"{'/'.join(v + '.x' for v in TESTED_TRITON)} only (Gluon's API moves "
                      "between releases)")
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon import language as gl  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
            async_copy, fence_async_shared, warpgroup_mma, warpgroup_mma_wait)
    except Exception as exc:
        return None, f"Gluon's Hopper ops do not import ({type(exc).__name__}: {exc})"
    from . import _gluon_mla_kernel as kernels

    return kernels, ""


@functools.lru_cache(maxsize=None)
def _kernels() -> tuple[Optional[object], str]:
    return _import_gluon()


def kernel_module():
    """The compiled-kernel module (``_gluon_mla_kernel``); raises if unavailable."""
    mod, reason = _kernels()
    if mod is None:
        raise RuntimeError(reason)
    return mod


def shape_reason(num_heads: int, d_main: int, d_pe: int, d_v: int,
                 dtype: torch.dtype, fp8_layout: bool) -> Optional[str]:
    """Why the kernel cannot take this model shape (``None``: it can)."""
    if fp8_layout:
        return "FP8 KV byte layouts use the tl.dot kernel"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(dtype).replace('torch.', '')}: the Gluon kernel takes bf16/fp16"
    if (d_main, d_pe, d_v) != (D_MAIN, D_PE, D_MAIN):
        return (f"latent {d_main} + rope {d_pe}: the Gluon kernel is built for "
                f"{D_MAIN} + {D_PE}")
    if num_heads < 1:
        return "no heads"
    return None


def device_reason(device: torch.device, interpret: bool) -> Optional[str]:
    """Why the kernel cannot run on ``device`` (``None``: it can)."""
    return hopper_reason(device, interpret, "the Gluon kernel",
                         " (the Triton CPU interpreter has no Gluon)") or _kernels()[1] or None


def hopper_reason(device: torch.device, interpret: bool, kernel: str,
                  cpu_note: str = "") -> Optional[str]:
    """Why ``kernel`` (an sm90 wgmma kernel: this one, or ``cute_mla``'s) cannot run on
    ``device`` (``None``: it can); ``cpu_note`` follows the answer off a CUDA device."""
    if interpret or device.type != "cuda":
        return "not a CUDA device" + cpu_note
    if getattr(torch.version, "hip", None):
        return f"ROCm: {kernel} uses NVIDIA Hopper wgmma"
    cap = _capability(device_index(device))
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}: {kernel} needs sm90 (Hopper)"
    return None


def device_index(device: torch.device) -> int:
    """The CUDA device ordinal ``device`` names (the current one for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def gluon_reason(runner, interpret: bool = False) -> Optional[str]:
    """``None`` when the Gluon kernel serves this runner's MLA draft decode, else why not."""
    return model_reason(runner) or device_reason(torch.device(runner.device), interpret)


def model_reason(runner) -> Optional[str]:
    """Why the MLA decode kernels here (Gluon, ``cute_mla``) cannot take ``runner``'s model
    (``None``: they can)."""
    if not runner.use_mla_backend:
        return "not an MLA model"
    return shape_reason(runner.num_heads, runner.kv_lora_rank, runner.qk_rope_head_dim,
                        runner.kv_lora_rank, runner.dtype,
                        getattr(runner, "kv_layout", None) is not None)


_LOGGED: set = set()


def log_fallback(reason: str) -> None:
    """Log (once per reason) that MLA decode runs the ``tl.dot`` kernel instead."""
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        log.info("triton MLA decode: tl.dot kernel, not the Gluon kernel: %s", reason)


def platform_note(device: str, capability: Optional[tuple[int, int]], interpret: bool,
                  triton_version: Optional[str], cute_installed: bool = False) -> str:
    """What ``specattn list`` / ``select`` say about the MLA decode kernel on a platform
    (no import of Triton: ``triton_version`` comes from package metadata;
    ``cute_installed``: CuTe-DSL is installed, so requests of several row tiles get the
    ``cute_mla`` kernel)."""
    if interpret or device != "cuda":
        why = "not a CUDA device"
    elif capability != (9, 0):
        why = "needs sm90" if capability is None else \
            f"sm{capability[0]}{capability[1]}, needs sm90"
    elif triton_version is None:
        why = "triton not installed"
    elif not any(triton_version == v or triton_version.startswith(v + ".")
                 for v in TESTED_TRITON):
        why = f"triton {triton_version}, run with {'/'.join(TESTED_TRITON)}.x only"
    else:
        above = ("above, the CuTe-DSL kernel (a request's prefix splits merged on chip)"
                 if cute_installed else "a fixed prefix split above (the CuTe-DSL kernel "
                 "there needs CuTe-DSL: the 'fa' extra)")
        return ("MLA draft decode: Gluon wgmma kernel (sm90, triton "
                f"{triton_version}; bf16/fp16, rank 512 + rope 64, plain KV; a balanced work "
                f"list up to 64 query rows per request; {above})")
    return f"MLA draft decode: tl.dot kernel (Gluon kernel off: {why})"


def parent_args(parents: Optional[torch.Tensor], placeholder: torch.Tensor) -> tuple:
    """``(tensor, stride_s, stride_b)`` the kernels take for ``parents [S, B, K]`` (path
    mode); without it any int tensor (never read) and zero strides."""
    if parents is None:
        return placeholder, 0, 0
    return parents, parents.stride(0), parents.stride(1)


def num_row_tiles(rows_per_group: int) -> int:
    return -(-rows_per_group // BLOCK_M)


def attention(q: torch.Tensor, kv: torch.Tensor, k_new: torch.Tensor, out: torch.Tensor,
              mid_o: torch.Tensor, mid_lse: torch.Tensor, req_to_token: torch.Tensor,
              meta: torch.Tensor, hist: torch.Tensor, parents: Optional[torch.Tensor], *,
              mode: int, batch: int, topk: int, num_steps: int, step: int, num_splits: int,
              sm_scale: float, logit_cap: float, block_n: int, num_stages: int,
              overlap: bool, prefetch: bool, write_new: bool,
              warp_specialized: bool = False, diag: int = 0) -> bool:
    """Launch the kernel; returns whether the output was written directly (one split) or
    the caller must merge ``mid_o``/``mid_lse`` (``num_splits`` partials).

    q: ``[B*K, H, 576]``; kv: the layer's latent pool ``[slots, 576]``; k_new: ``[B*K, 576]``
    (this step's keys, stored at ``hist[:, step]`` by split 0 when ``write_new``);
    out: ``[B*K, H, 512]``; mid_o: ``[B*K, H, >= splits, 512]`` fp32; mid_lse:
    ``[B*K, H, >= splits]`` fp32; meta: ``[>= B, 5]`` int32 (``_metadata_kernels``);
    hist: ``[B*K, S]`` int32; parents: ``[S, B, K]`` (path mode, ``mode == 1``).
    ``warp_specialized``: the seesaw kernel (``_gluon_mla_ws_kernel``; experimental).
    ``diag``: timing experiments (1: copies alone, 2: math alone, 3: copies alone with no
    result stores and no merge, 4: no key tiles; wrong results; ``tools/gluon_diag.py``)."""
    K = kernel_module()
    H = q.shape[1]
    par, par_s, par_b = parent_args(parents, meta)
    direct = num_splits == 1
    grid = (num_row_tiles(topk * H), batch, num_splits)
    args = (q, kv, k_new, mid_o, mid_lse, out, req_to_token, meta, hist, par,
            step, float(sm_scale), float(logit_cap),
            q.stride(0), q.stride(1), kv.stride(0), k_new.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0),
            par_s, par_b, kv.shape[0], topk, num_steps, num_splits)
    common = dict(H=H, MODE=mode, BLOCK_N=block_n, NUM_STAGES=num_stages, PREFETCH=prefetch,
                  USE_CAP=logit_cap > 0, DIRECT_OUT=direct, WRITE_NEW=write_new)
    if warp_specialized:
        from . import _gluon_mla_ws_kernel as W

        # 4 warps here, 4 more in the worker partition: two consumer warpgroups.
        W._gluon_mla_ws_kernel[grid](*args, **common, num_warps=NUM_WARPS // 2)
    else:
        extra = dict(DIAG=diag) if diag else {}  # not a key of the default compile
        K._gluon_mla_kernel[grid](*args, **common, OVERLAP=overlap, num_warps=NUM_WARPS,
                                  **extra)
    return direct or diag == 3  # 3: nothing to merge


def attention_worklist(q: torch.Tensor, kv: torch.Tensor, k_new: torch.Tensor,
                       out: torch.Tensor, mid_o: torch.Tensor, mid_lse: torch.Tensor,
                       req_to_token: torch.Tensor, meta: torch.Tensor, work: torch.Tensor,
                       hist: torch.Tensor, parents: Optional[torch.Tensor], *, mode: int,
                       batch: int, topk: int, num_steps: int, step: int, programs: int,
                       sm_scale: float, logit_cap: float, block_n: int, num_stages: int,
                       prefetch: bool, write_new: bool) -> None:
    """The kernel on ``worklist``'s balanced work list (``work``, filled for this round with
    ``programs`` per row tile): writes ``out`` for requests with one program, partials for
    the others (the caller merges them: ``worklist.merge``).

    mid_o: ``[slots >= programs + batch, worklist.partial_rows(topk, H), 512]`` fp32;
    mid_lse: ``[slots, partial_rows]`` fp32; the rest as in ``attention``."""
    from . import _gluon_mla_wl_kernel as W

    kernel_module()  # the version and Gluon checks
    H = q.shape[1]
    par, par_s, par_b = parent_args(parents, meta)
    W._gluon_mla_wl_kernel[(num_row_tiles(topk * H), programs)](
        q, kv, k_new, mid_o, mid_lse, out, req_to_token, meta, work, hist, par,
        step, float(sm_scale), float(logit_cap),
        q.stride(0), q.stride(1), kv.stride(0), k_new.stride(0), mid_o.stride(0),
        mid_lse.stride(0), out.stride(0), out.stride(1), req_to_token.stride(0), par_s, par_b,
        kv.shape[0], topk, num_steps, batch, programs,
        H=H, MODE=mode, BLOCK_N=block_n, NUM_STAGES=num_stages, PREFETCH=prefetch,
        USE_CAP=logit_cap > 0, WRITE_NEW=write_new, num_warps=NUM_WARPS)
