"""MLA draft decode on Hopper in CuTe-DSL, the prefix splits merged on chip (plan ``cute``;
the kernel: ``_cute_mla_kernel``). Run on the H200 with CuTe-DSL 4.8.1 (``docs/kernels.md``).

A request row tile's splits form ``groups`` thread-block clusters of ``cluster`` CTAs
(``cluster_shape``): each cluster merges its partials through distributed shared memory into
the output or (several groups) into a partial that ``merge_partials`` combines. Compiled at
first use per (dtype, heads, tree mode, logit cap, cluster shape). Not the ``cutedsl_mla``
backend.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from ...errors import InvalidInputError
from ...kernels.merge import merge_partials
from ...util import device_index
from .plans import num_row_tiles

log = logging.getLogger(__name__)

MAX_CLUSTER = 8  # the portable thread-block cluster size
STAGES = 2  # key tiles in the ring (two 72 KB tiles + Q fill the 227 KB of shared memory)


@functools.lru_cache(maxsize=None)
def max_active_clusters(device_index: int, size: int) -> int:
    """Clusters of ``size`` CTAs (one per SM: the kernel takes most of an SM's shared
    memory) that the GPU runs at once: CUDA's occupancy answer (a cluster must fit in one
    GPC, so this can be less than SMs / size)."""
    from cutlass.utils import HardwareInfo

    return int(HardwareInfo(device_id=device_index).get_max_active_clusters(size))


def cluster_shape(splits: int, programs: int, device: torch.device,
                  max_groups: int) -> Optional[tuple[int, int]]:
    """``(cluster, groups)`` for ``splits`` prefix splits of each of ``programs`` (request,
    row tile) pairs, at most ``max_groups`` groups (the partials a row may hold):
    ``_one_wave_shape``, else the largest cluster size (at most ``MAX_CLUSTER``) that
    divides ``splits`` into so few groups; None if none does."""
    shape = _one_wave_shape(splits, programs, device, max_groups)
    if shape is not None:
        return shape
    fits = [c for c in range(1, min(splits, MAX_CLUSTER) + 1)
            if splits % c == 0 and splits // c <= max_groups]
    return (fits[-1], splits // fits[-1]) if fits else None


def plan_splits(programs: int, device: torch.device, limit: int, max_groups: int) -> int:
    """Prefix splits for ``programs`` (request, row tile) pairs: the most, up to ``limit``,
    whose clusters (``cluster_shape``, at most ``max_groups`` of them per row tile) all run
    at once (a second wave of clusters costs more than a shorter split), else 1."""
    for splits in range(max(1, limit), 1, -1):
        if _one_wave_shape(splits, programs, device, max_groups) is not None:
            return splits
    return 1


def _one_wave_shape(splits: int, programs: int, device: torch.device,
                    max_groups: int) -> Optional[tuple[int, int]]:
    """The largest cluster size dividing ``splits`` (at most ``MAX_CLUSTER``) into at most
    ``max_groups`` groups whose ``programs * groups`` clusters all run at once, as
    ``(cluster, groups)``; None if none."""
    for c in range(min(splits, MAX_CLUSTER), 0, -1):
        groups = splits // c
        if splits % c == 0 and groups <= max_groups and \
                programs * groups <= max_active_clusters(device_index(device), c):
            return c, groups
    return None


def _dtype(torch_dtype: torch.dtype):
    import cutlass

    table = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
             torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}
    return table[torch_dtype]


@functools.lru_cache(maxsize=None)
def _compiled(dtype: torch.dtype, heads: int, path: bool, use_cap: bool, cluster: int,
              groups: int, r2t_dtype: torch.dtype, parent_dtype: torch.dtype):
    """The kernel compiled for one variant (CuTe-DSL JIT, a few seconds the first time)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from . import _cute_mla_kernel as K

    kernel = K.MlaDecodeKernel(_dtype(dtype), heads, path, use_cap, cluster, groups, STAGES)
    ptrs = _pointers(dtype, r2t_dtype, parent_dtype, [256] * 10)
    log.info("compiling the CuTe-DSL MLA decode kernel (%s, H %d, %s, cap %s, clusters of "
             "%d x %d)", dtype, heads, "path" if path else "lane", use_cap, cluster, groups)
    return cute.compile(kernel, *ptrs, *[cutlass.Int32(1)] * 20,
                        *[cutlass.Float32(1.0)] * 2, cuda.CUstream(0))


def _pointers(dtype: torch.dtype, r2t_dtype: torch.dtype, parent_dtype: torch.dtype,
              addresses: list) -> list:
    """The kernel's pointers (q, kv, k_new, out, mid_o, mid_lse, req_to_token, meta, hist,
    parents) at ``addresses``, 16-byte aligned."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    types = [_dtype(dtype)] * 4 + [cutlass.Float32] * 2 + [_dtype(r2t_dtype)] + \
        [cutlass.Int32] * 2 + [_dtype(parent_dtype)]
    return [make_ptr(t, a, cute.AddressSpace.gmem, assumed_align=16)
            for t, a in zip(types, addresses)]


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
              mid_o: Optional[torch.Tensor] = None,
              mid_lse: Optional[torch.Tensor] = None) -> None:
    """Launch the kernel into ``out`` (with more than one cluster per request row tile,
    ``cluster_shape``, their partials merged by one more launch).

    q: ``[B*K, H, 576]``; kv: ``[slots, 576]``; k_new: ``[B*K, 576]`` (this step's keys,
    stored at ``hist[:, step]`` by split 0); out: ``[B*K, H, 512]``; req_to_token: ``[pool
    rows, max len]`` int32/int64; meta: ``[>= B, 5]`` int32; hist: ``[B*K, S]`` int32
    (contiguous); parents: ``[S, B, K]`` (``mode == 1``); mid_o / mid_lse: fp32 ``[B*K, H,
    >= groups, 512]`` / ``[B*K, H, >= groups]`` with unit last stride (needed with more than
    one group); ``num_splits``: clusters of up to ``MAX_CLUSTER`` splits, as many clusters
    per request row tile as ``mid_o`` holds partials (one without ``mid_o``)."""
    _check("q", q, 3, (0, 1))
    _check("kv", kv, 2, (0,))
    _check("k_new", k_new, 2, (0,))
    _check("out", out, 3, (0, 1))  # the merge stores a row's 4 columns at once
    if not hist.is_contiguous():
        raise InvalidInputError("hist", "a contiguous [B*K, S] int32 table", hist.stride())
    if mode == 1 and (parents is None or parents.stride(2) != 1):
        raise InvalidInputError("parents", "an [S, B, K] tensor with unit last stride in path "
                                "mode", None if parents is None else parents.stride())
    row_tiles = num_row_tiles(topk * q.shape[1])
    max_groups = 1 if mid_o is None or mid_o.dim() != 4 else mid_o.shape[2]
    shape = cluster_shape(num_splits, batch * row_tiles, q.device, max_groups) \
        if isinstance(num_splits, int) and num_splits >= 1 else None
    if shape is None:
        raise InvalidInputError("num_splits", f"clusters of at most {MAX_CLUSTER} splits, at "
                                f"most {max_groups} per row (the partials mid_o holds)",
                                num_splits)
    cluster, groups = shape
    if groups > 1:
        _check_partials(mid_o, mid_lse, q, groups)
    path = mode == 1
    par = parents if path else meta
    mo, ml = (mid_o, mid_lse) if groups > 1 else (out, out)  # unused with one group

    import cuda.bindings.driver as cuda
    import cutlass

    from ._cute_mla_kernel import LOG2E

    fn = _compiled(q.dtype, q.shape[1], path, logit_cap > 0, cluster, groups,
                   req_to_token.dtype, par.dtype)
    tensors = (q, kv, k_new, out, mo, ml, req_to_token, meta, hist, par)
    ints = (batch, row_tiles, step, topk, num_steps, kv.shape[0], q.stride(0), q.stride(1),
            kv.stride(0), k_new.stride(0), out.stride(0), out.stride(1), mo.stride(0),
            mo.stride(1), mo.stride(2), ml.stride(0), ml.stride(1), req_to_token.stride(0),
            par.stride(0) if path else 0, par.stride(1) if path else 0)
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    fn(*_pointers(q.dtype, req_to_token.dtype, par.dtype, [t.data_ptr() for t in tensors]),
       *[cutlass.Int32(v) for v in ints], cutlass.Float32(sm_scale * LOG2E),
       cutlass.Float32(logit_cap), stream)
    if groups > 1:
        merge_partials(mid_o, mid_lse, out, groups)


def _check_partials(mid_o: Optional[torch.Tensor], mid_lse: Optional[torch.Tensor],
                    q: torch.Tensor, groups: int) -> None:
    """``mid_o`` / ``mid_lse`` hold ``groups`` fp32 partials of every query row."""
    rows, heads = q.shape[0], q.shape[1]
    for name, t, dims in (("mid_o", mid_o, 4), ("mid_lse", mid_lse, 3)):
        if t is None or t.dtype != torch.float32 or t.dim() != dims or t.stride(-1) != 1 \
                or t.shape[0] < rows or t.shape[1] != heads or t.shape[2] < groups \
                or (dims == 4 and (t.shape[3] != 512 or t.data_ptr() % 16
                                   or any(t.stride(i) % 4 for i in range(3)))):
            raise InvalidInputError(
                name, f"fp32 [>= {rows}, {heads}, >= {groups}{', 512' if dims == 4 else ''}] "
                "with unit last stride (a partial per cluster of each query row; mid_o "
                "16-byte aligned rows)",
                None if t is None else f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
