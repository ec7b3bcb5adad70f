"""MLA draft decode on Hopper in CuTe-DSL, with the prefix splits merged on chip.

Opt-in (``KernelConfig.cute``; the ``cute`` config label) beside the Gluon kernel
(``gluon_mla``), with the same call contract but no partials in global memory and no merge
launch. Gluon in Triton 3.6 cannot address another CTA's shared memory
(``tools/gluon_cluster_probe.py``), so this kernel is written in CuTe-DSL (NVIDIA's
``nvidia-cutlass-dsl``, installed with FlashAttention-4), compiled at first use per
(dtype, heads, tree mode, logit cap, KV write, splits).

Kernel (``_cute_mla_kernel``; one CTA of 256 threads per (prefix split, 64-row tile,
request); the splits of a (request, row tile) form one thread-block cluster):

- the 64 query rows (``K`` lanes x ``H`` heads) stay in shared memory; key tiles of 64 are
  gathered through ``req_to_token`` (any page size) by 16-byte ``cp.async`` into a ring of
  2 stages, one tile ahead of the MMAs;
- ``S = Q K^T``: each warpgroup computes 32 of a tile's 64 columns (wgmma m64n32k16 over the
  576-wide row); the online softmax (base 2) shares row maxima through shared memory; ``P``
  goes to shared memory and each warpgroup adds ``P V`` into its 256 output columns, ``V``
  read in place from the key tile;
- the last split also walks the tail (each lane's ``step + 1`` history keys, ``lane`` or
  ``path`` mode, masked to the key's lane; the call's new key is read from ``k_new``, and
  split 0 stores it in the pool);
- after the loop each CTA leaves its normalised fp32 partial and LSE in its own shared
  memory; after a cluster barrier, CTA ``s`` merges rows ``s, s + splits, ...`` reading the
  others' partials through distributed shared memory and writes the output.

Run on: H200, torch 2.11 + cu130, CuTe-DSL 4.8.1 (with flash-attn 4.0.0b36): the Gluon
kernel's GPU tests (variant ``cute``), the 100-batch stress loop, memcheck and a soak, all
passing; slower than the Gluon kernel so far (mla-long 83.8 vs 69.4 us). Versions, profile
and next steps: ``benchmarks/results/2026-12-01-h200/cute-notes.md``. Not the
``cutedsl_mla`` backend (a vendor MLA kernel for Blackwell).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from ...errors import InvalidInputError

log = logging.getLogger(__name__)

MAX_SPLITS = 8  # the portable thread-block cluster size
STAGES = 2  # key tiles in the ring (two 72 KB tiles + Q fill the 227 KB of shared memory)


@functools.lru_cache(maxsize=None)
def import_reason() -> Optional[str]:
    """Why CuTe-DSL is not usable here (``None``: it is)."""
    try:
        import cuda.bindings.driver  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as exc:
        return f"CuTe-DSL does not import ({type(exc).__name__}: {exc})"
    return None


def cute_reason(runner, interpret: bool = False) -> Optional[str]:
    """``None`` when this kernel can serve ``runner``'s MLA draft decode, else why not (the
    Gluon kernel's model and device rules, then CuTe-DSL's import)."""
    from . import gluon_mla

    return (gluon_mla.model_reason(runner)
            or gluon_mla.hopper_reason(torch.device(runner.device), interpret,
                                       "the CuTe-DSL kernel")
            or import_reason())


@functools.lru_cache(maxsize=None)
def max_active_clusters(device_index: int, size: int) -> int:
    """Clusters of ``size`` CTAs (one per SM: the kernel takes most of an SM's shared
    memory) that the GPU runs at once: CUDA's occupancy answer (a cluster must fit in one
    GPC, so this can be less than SMs / size)."""
    from cutlass.utils import HardwareInfo

    return int(HardwareInfo(device_id=device_index).get_max_active_clusters(size))


def plan_splits(clusters: int, device: torch.device, limit: int) -> int:
    """Prefix splits (the cluster size) for ``clusters`` (request, row tile) pairs: at most
    ``limit`` (the SM-count answer) and ``MAX_SPLITS``, and fewer while the clusters would
    not all run at once (a second wave of clusters costs more than a shorter split)."""
    from .gluon_mla import device_index

    splits = max(1, min(limit, MAX_SPLITS))
    index = device_index(device)
    while splits > 1 and clusters > max_active_clusters(index, splits):
        splits -= 1
    return splits


def _dtype(torch_dtype: torch.dtype):
    import cutlass

    table = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
             torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}
    return table[torch_dtype]


@functools.lru_cache(maxsize=None)
def _compiled(dtype: torch.dtype, heads: int, path: bool, use_cap: bool, write_new: bool,
              splits: int, r2t_dtype: torch.dtype, parent_dtype: torch.dtype, diag: int = 0,
              v4: bool = False, options: str = ""):
    """The kernel compiled for one variant (CuTe-DSL JIT, a few seconds the first time);
    ``options``: CuTe-DSL compile options (``tools/cute_ptx_hashes.py`` keeps the PTX)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from . import _cute_mla_kernel as K

    kernel = K.MlaDecodeKernel(_dtype(dtype), heads, path, use_cap, write_new, splits,
                               STAGES, _dtype(parent_dtype), diag, v4)
    ptrs = [_ptr(_dtype(dtype), 256)] * 4 + [_ptr(_dtype(r2t_dtype), 256)] + \
        [_ptr(cutlass.Int32, 256)] * 2 + [_ptr(_dtype(parent_dtype), 256)]
    ints = [cutlass.Int32(1)] * 15
    floats = [cutlass.Float32(1.0)] * 2
    log.info("compiling the CuTe-DSL MLA decode kernel (%s, H %d, %s, cap %s, write %s, "
             "%d splits)", dtype, heads, "path" if path else "lane", use_cap, write_new,
             splits)
    extra = {"options": options} if options else {}
    return cute.compile(kernel, *ptrs, *ints, *floats, cuda.CUstream(0), **extra)


def _ptr(dtype, address: int):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=16)


def _check(name: str, t: torch.Tensor, dims: int, aligned: tuple[int, ...]) -> None:
    """``t`` has ``dims`` dimensions, unit last stride, a 16-byte aligned start and the
    strides ``aligned`` (indices) in multiples of 16 bytes (the 16-byte copies need it)."""
    per16 = 16 // t.element_size()
    if t.dim() != dims or t.stride(-1) != 1 or t.data_ptr() % 16 or \
            any(t.stride(i) % per16 for i in aligned):
        raise InvalidInputError(name, f"{dims} dimensions, unit last stride, 16-byte aligned "
                                "start and row strides",
                                f"shape {tuple(t.shape)}, strides {t.stride()}")


def attention(q: torch.Tensor, kv: torch.Tensor, k_new: torch.Tensor, out: torch.Tensor,
              req_to_token: torch.Tensor, meta: torch.Tensor, hist: torch.Tensor,
              parents: Optional[torch.Tensor], *, mode: int, batch: int, topk: int,
              num_steps: int, step: int, num_splits: int, sm_scale: float, logit_cap: float,
              write_new: bool, diag: int = 0, v4: bool = False) -> None:
    """Launch the kernel: ``out`` written, merged on chip (``gluon_mla.attention``'s contract
    without the partial buffers).

    q: ``[B*K, H, 576]``; kv: ``[slots, 576]``; k_new: ``[B*K, 576]``; out:
    ``[B*K, H, 512]``; req_to_token: ``[pool rows, max len]`` int32/int64; meta: ``[>= B, 5]``
    int32; hist: ``[B*K, S]`` int32 (contiguous); parents: ``[S, B, K]`` (``mode == 1``).
    ``num_splits``: 1 to ``MAX_SPLITS`` (the cluster size). ``diag``: timing experiments
    (``MlaDecodeKernel``; wrong results, ``tools/gluon_diag.py``). ``v4``: the
    next version's changes, on trial (``MlaDecodeKernel``; not yet run on a GPU)."""
    if not 1 <= num_splits <= MAX_SPLITS:
        raise InvalidInputError("num_splits", f"1 to {MAX_SPLITS} (one thread-block cluster "
                                "per request)", num_splits)
    _check("q", q, 3, (0, 1))
    _check("kv", kv, 2, (0,))
    _check("k_new", k_new, 2, (0,))
    _check("out", out, 3, ())
    if not hist.is_contiguous():
        raise InvalidInputError("hist", "a contiguous [B*K, S] int32 table", hist.stride())
    if mode == 1 and (parents is None or parents.stride(2) != 1):
        raise InvalidInputError("parents", "an [S, B, K] tensor with unit last stride in path "
                                "mode", None if parents is None else parents.stride())
    import cuda.bindings.driver as cuda
    import cutlass

    from ._cute_mla_kernel import LOG2E
    from .gluon_mla import num_row_tiles

    path = mode == 1
    par = parents if path else meta
    fn = _compiled(q.dtype, q.shape[1], path, logit_cap > 0, write_new, num_splits,
                   req_to_token.dtype, par.dtype, diag, v4)
    i32 = cutlass.Int32
    args = ([_ptr(_dtype(q.dtype), t.data_ptr()) for t in (q, kv, k_new, out)]
            + [_ptr(_dtype(req_to_token.dtype), req_to_token.data_ptr()),
               _ptr(cutlass.Int32, meta.data_ptr()), _ptr(cutlass.Int32, hist.data_ptr()),
               _ptr(_dtype(par.dtype), par.data_ptr())]
            + [i32(v) for v in (
                batch, num_row_tiles(topk * q.shape[1]), step, topk, num_steps, kv.shape[0],
                q.stride(0), q.stride(1), kv.stride(0), k_new.stride(0), out.stride(0),
                out.stride(1), req_to_token.stride(0), par.stride(0) if path else 0,
                par.stride(1) if path else 0)]
            + [cutlass.Float32(sm_scale * LOG2E), cutlass.Float32(logit_cap)])
    fn(*args, cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream))
