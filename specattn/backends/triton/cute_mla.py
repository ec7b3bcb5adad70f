"""MLA draft decode on Hopper in CuTe-DSL, with the prefix splits merged on chip.

The default where a request's ``K * H`` query rows take more than one 64-row tile and
CuTe-DSL serves (``launchers.gluon_config``, ``serves``); elsewhere opt-in
(``KernelConfig.cute``; the ``cute`` config label). Beside the Gluon kernel (``gluon_mla``),
with the same call contract; a request's splits merge on chip. Gluon in
Triton 3.6 cannot address another CTA's shared memory (``tools/gluon_cluster_probe.py``), so
this kernel is written in CuTe-DSL (NVIDIA's ``nvidia-cutlass-dsl``, installed with
FlashAttention-4), compiled at first use per (dtype, heads, tree mode, logit cap, KV write,
cluster shape).

Kernel (``_cute_mla_kernel``; one CTA of 256 threads per (prefix split, 64-row tile,
request); the splits of a (request, row tile) form ``groups`` thread-block clusters of
``cluster`` CTAs, ``cluster_shape``):

- the 64 query rows (``K`` lanes x ``H`` heads) stay in shared memory; key tiles of 64 are
  gathered through ``req_to_token`` (any page size) by 16-byte ``cp.async`` into a ring of
  2 stages, one tile ahead of the MMAs;
- roles: warpgroup 1 alone gathers the key tiles; warpgroup 0 computes ``S = Q K^T`` over the
  whole tile (wgmma m64n64k16 over the 576-wide row) and the online softmax (base 2) over
  whole rows, and writes ``P`` and each row's rescale factor to shared memory; each
  warpgroup adds ``P V`` into its 256 output columns, ``V`` read in place from the key tile;
- the last split also walks the tail (each lane's ``step + 1`` history keys, ``lane`` or
  ``path`` mode, masked to the key's lane; the call's new key is read from ``k_new``, and
  split 0 stores it in the pool);
- after the loop each CTA leaves its normalised fp32 partial and LSE in its own shared
  memory; after a cluster barrier, CTA ``r`` of a cluster merges rows ``r, r + cluster,
  ...`` reading the others' partials through distributed shared memory, and writes the
  output (one group) or the cluster's merged partial, which ``merge_kernel`` then combines
  (several groups).

Run on: H200, torch 2.11 + cu130, CuTe-DSL 4.8.1 (with flash-attn 4.0.0b36). v9 (session
14; the sm90 PTX of session 13's ``trial`` build, measured then): the Gluon kernel's GPU
tests (variant ``cute``: every shape forced onto this kernel), every cluster shape with and
without the fused merge, the conformance kit with its config, the 100-batch stress loop,
memcheck over a small ragged run (0 errors), a soak. Same run (session 14, call 4):
mla-long 63.2 us (Gluon default 69.8, FlashInfer 65.6), mla-k1 58.1 (63.8, 65.3),
mla-long-k8 90.8 (FlashInfer 91.5; the Gluon split kernel 113.4 in session 13); call 8:
mla-wide (H 128) 161.2, about 450 TFLOP/s, two thirds of the bf16 matmul rate (the Gluon
split kernel 206.6 in session 12). On ragged batches at one row tile it is about even with
the Gluon work list (mla-long 77.4 against 77.2), and it is slower at small batches
(mla-small, B 4: 20.1 against 16.1). Over the work list (``work``; label ``... gluon wl
cute``; the same checks in session 14) it is 5-6% faster than the Gluon work list at 32
requests of one row tile with 4096-key prefixes, uniform or ragged (mla-long 66.6 / 72.6,
mla-k1 60.4 / 69.6), and by 8-21% at 48, but slower at 8 and 16 requests, at 32 with 1024-
or 2048-key prefixes and at mla-wide (179.5 uniform): opt-in. Versions, profile and
next steps: ``benchmarks/results/2026-12-01-h200/cute-notes.md``. Not the ``cutedsl_mla``
backend (a vendor MLA kernel for Blackwell).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from ...errors import InvalidInputError

log = logging.getLogger(__name__)

MAX_CLUSTER = 8  # the portable thread-block cluster size
MAX_SPLITS = 16  # prefix splits in all (cluster x groups; the partial buffers hold 16)
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


_LOGGED: set = set()


def serves(runner, interpret: bool, rows: int) -> bool:
    """Whether this kernel serves ``runner``'s MLA draft decode here (``cute_reason``), for
    the default choice at ``rows`` query rows per request; the answer is logged once per
    reason, naming the kernel that runs instead."""
    reason = cute_reason(runner, interpret)
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        if reason is None:
            log.info("triton MLA decode at %d query rows per request: the CuTe-DSL kernel "
                     "(compiled at first use, a few seconds per variant)", rows)
        else:
            log.info("triton MLA decode at %d query rows per request: the Gluon split "
                     "kernel, not the CuTe-DSL kernel: %s", rows, reason)
    return reason is None


def installed() -> bool:
    """Whether CuTe-DSL is installed (found, not imported: ``specattn list`` stays fast)."""
    import importlib.util

    return importlib.util.find_spec("cutlass") is not None


@functools.lru_cache(maxsize=None)
def max_active_clusters(device_index: int, size: int) -> int:
    """Clusters of ``size`` CTAs (one per SM: the kernel takes most of an SM's shared
    memory) that the GPU runs at once: CUDA's occupancy answer (a cluster must fit in one
    GPC, so this can be less than SMs / size)."""
    from cutlass.utils import HardwareInfo

    return int(HardwareInfo(device_id=device_index).get_max_active_clusters(size))


def cluster_shape(splits: int, programs: int, device: torch.device) -> tuple[int, int]:
    """``(cluster, groups)`` for ``splits`` prefix splits of each of ``programs`` (request,
    row tile) pairs: the largest cluster size that divides ``splits`` (at most
    ``MAX_CLUSTER``) whose ``programs * groups`` clusters all run at once, else the
    largest that divides it. More than one group: each cluster merges its CTAs on chip
    and the groups' partials are merged after (one more launch, or fused: ``attention``)."""
    shape = _one_wave_shape(splits, programs, device)
    if shape is not None:
        return shape
    largest = max(c for c in range(1, min(splits, MAX_CLUSTER) + 1) if splits % c == 0)
    return largest, splits // largest


def plan_splits(programs: int, device: torch.device, limit: int) -> int:
    """Prefix splits for ``programs`` (request, row tile) pairs: the most, up to ``limit``
    (the SM-count answer) and ``MAX_SPLITS``, whose clusters (``cluster_shape``) all run at
    once (a second wave of clusters costs more than a shorter split), else 1."""
    for splits in range(max(1, min(limit, MAX_SPLITS)), 1, -1):
        if _one_wave_shape(splits, programs, device) is not None:
            return splits
    return 1


def _one_wave_shape(splits: int, programs: int,
                    device: torch.device) -> Optional[tuple[int, int]]:
    """The largest cluster size dividing ``splits`` (at most ``MAX_CLUSTER``) whose
    ``programs * groups`` clusters all run at once, as ``(cluster, groups)``; None if none."""
    from .gluon_mla import device_index

    index = device_index(device)
    for c in range(min(splits, MAX_CLUSTER), 0, -1):
        if splits % c == 0 and programs * (splits // c) <= max_active_clusters(index, c):
            return c, splits // c
    return None


def _dtype(torch_dtype: torch.dtype):
    import cutlass

    table = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
             torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}
    return table[torch_dtype]


@functools.lru_cache(maxsize=None)
def _compiled(dtype: torch.dtype, heads: int, path: bool, use_cap: bool, write_new: bool,
              cluster: int, groups: int, r2t_dtype: torch.dtype, parent_dtype: torch.dtype,
              diag: int = 0, fuse: bool = False, options: str = "", work_list: bool = False):
    """The kernel compiled for one variant (CuTe-DSL JIT, a few seconds the first time);
    ``options``: CuTe-DSL compile options (``tools/cute_ptx_hashes.py`` keeps the PTX)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from . import _cute_mla_kernel as K

    kernel = K.MlaDecodeKernel(_dtype(dtype), heads, path, use_cap, write_new, cluster,
                               groups, STAGES, _dtype(parent_dtype), diag, fuse, work_list)
    ptrs = [_ptr(_dtype(dtype), 256)] * 4 + [_ptr(cutlass.Float32, 256)] * 2 + \
        [_ptr(_dtype(r2t_dtype), 256)] + [_ptr(cutlass.Int32, 256)] * 2 + \
        [_ptr(_dtype(parent_dtype), 256), _ptr(cutlass.Int32, 256)]
    ints = [cutlass.Int32(1)] * 21
    floats = [cutlass.Float32(1.0)] * 2
    log.info("compiling the CuTe-DSL MLA decode kernel (%s, H %d, %s, cap %s, write %s, "
             "clusters of %d x %d)", dtype, heads, "path" if path else "lane", use_cap,
             write_new, cluster, groups)
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
              write_new: bool, mid_o: Optional[torch.Tensor] = None,
              mid_lse: Optional[torch.Tensor] = None,
              counter: Optional[torch.Tensor] = None, diag: int = 0,
              stamps: Optional[torch.Tensor] = None,
              work: Optional[torch.Tensor] = None, programs: int = 0) -> None:
    """Launch the kernel: ``out`` written, merged on chip (``gluon_mla.attention``'s contract)
    and, when the splits take more than one cluster per request row tile
    (``cluster_shape``), the clusters' partials merged by one more launch.

    q: ``[B*K, H, 576]``; kv: ``[slots, 576]``; k_new: ``[B*K, 576]``; out:
    ``[B*K, H, 512]``; req_to_token: ``[pool rows, max len]`` int32/int64; meta: ``[>= B, 5]``
    int32; hist: ``[B*K, S]`` int32 (contiguous); parents: ``[S, B, K]`` (``mode == 1``);
    mid_o / mid_lse: fp32 ``[B*K, H, >= groups, 512]`` / ``[B*K, H, >= groups]`` with unit
    last stride (needed with more than one group); counter: int32 zeros, at least ``B *
    row tiles * cluster`` (a fixed buffer for CUDA graphs): with it and more than one group
    the groups' merge is fused into the kernel (the last group's CTAs merge; they leave the
    counters at 0; correct on the H200 and slower than the launch, session 12), else one
    more launch merges them.
    ``num_splits``: 1 to ``MAX_SPLITS`` (ignored with ``work``: ``programs`` counts its
    clusters).
    ``diag``: timing experiments (``MlaDecodeKernel``; 4 and 5 give wrong results,
    ``tools/gluon_diag.py``); 6 writes each CTA's timestamps into ``stamps`` (int32, at
    least ``STAMPS`` per CTA of the grid; ``tools/cute_stamps.py``). ``work`` (int32,
    ``worklist.fill``'s table for ``programs`` programs per row tile, ``work_list_shape``):
    the balanced work list instead of ``num_splits`` splits per request: each program is a
    cluster on one segment of one request; ``mid_o`` / ``mid_lse`` are then
    ``worklist_scratch``'s slots ``[slots, rows, 512]`` / ``[slots, rows]`` and
    ``worklist.merge`` combines them."""
    _check("q", q, 3, (0, 1))
    _check("kv", kv, 2, (0,))
    _check("k_new", k_new, 2, (0,))
    _check("out", out, 3, (0, 1))  # the merge stores a row's 4 columns at once
    if not hist.is_contiguous():
        raise InvalidInputError("hist", "a contiguous [B*K, S] int32 table", hist.stride())
    if mode == 1 and (parents is None or parents.stride(2) != 1):
        raise InvalidInputError("parents", "an [S, B, K] tensor with unit last stride in path "
                                "mode", None if parents is None else parents.stride())
    from .gluon_mla import num_row_tiles

    row_tiles = num_row_tiles(topk * q.shape[1])
    if work is not None:
        if diag or counter is not None:
            raise InvalidInputError("work", "None with diag or the fused merge's counters",
                                    f"diag {diag}, counter {counter is not None}")
        return _attention_work_list(q, kv, k_new, out, req_to_token, meta, hist, parents,
                                    mode=mode, batch=batch, topk=topk, num_steps=num_steps,
                                    step=step, sm_scale=sm_scale, logit_cap=logit_cap,
                                    write_new=write_new, mid_o=mid_o, mid_lse=mid_lse,
                                    work=work, programs=programs, row_tiles=row_tiles)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise InvalidInputError("num_splits", f"1 to {MAX_SPLITS} prefix splits", num_splits)
    cluster, groups = cluster_shape(num_splits, batch * row_tiles, q.device)
    fuse = counter is not None and groups > 1 and diag != 6
    if diag == 6:
        from ._cute_mla_kernel import STAMPS

        need = num_splits * row_tiles * batch * STAMPS
        if stamps is None or stamps.dtype != torch.int32 or stamps.numel() < need:
            raise InvalidInputError("stamps", f"int32, at least {need} words (diag 6)",
                                    None if stamps is None else tuple(stamps.shape))
    if groups > 1:
        _check_partials(mid_o, mid_lse, q, groups)
    if fuse:
        need = batch * row_tiles * cluster
        if counter.dtype != torch.int32 or not counter.is_contiguous() \
                or counter.numel() < need:
            raise InvalidInputError("counter", f"contiguous int32 zeros, at least {need} "
                                    "(one per request, row tile and cluster rank)",
                                    f"{counter.dtype} {tuple(counter.shape)}")
    path = mode == 1
    par = parents if path else meta
    mo, ml = (mid_o, mid_lse) if groups > 1 else (out, out)  # unused with one group
    fn = _compiled(q.dtype, q.shape[1], path, logit_cap > 0, write_new, cluster, groups,
                   req_to_token.dtype, par.dtype, diag, fuse)
    _run(fn, (q, kv, k_new, out, mo, ml, req_to_token, meta, hist, par,
              stamps if diag == 6 else counter if fuse else meta),
         (batch, row_tiles, 0, step, topk, num_steps),
         (mo.stride(0), mo.stride(1), mo.stride(2), ml.stride(0), ml.stride(1)), path,
         sm_scale, logit_cap)
    if groups > 1 and not fuse:
        from ...kernels.merge import merge_partials

        merge_partials(mid_o, mid_lse, out, groups)


def _run(fn, tensors: tuple, counts: tuple, mid_strides: tuple, path: bool, sm_scale: float,
         logit_cap: float) -> None:
    """Call compiled ``fn`` on the current stream: ``tensors`` = (q, kv, k_new, out, mid_o,
    mid_lse, req_to_token, meta, hist, parents, the last pointer: counters, stamps or the
    work table), ``counts`` = (batch, row tiles, programs, step, topk, num_steps),
    ``mid_strides`` = the partials' five strides (``MlaDecodeKernel``'s ``s_mo*``, ``s_ml*``)."""
    import cuda.bindings.driver as cuda
    import cutlass

    from ._cute_mla_kernel import LOG2E

    q, kv, k_new, out, mo, ml, req_to_token, meta, hist, par, last = tensors
    i32 = cutlass.Int32
    args = ([_ptr(_dtype(q.dtype), t.data_ptr()) for t in (q, kv, k_new, out)]
            + [_ptr(cutlass.Float32, t.data_ptr()) for t in (mo, ml)]
            + [_ptr(_dtype(req_to_token.dtype), req_to_token.data_ptr()),
               _ptr(cutlass.Int32, meta.data_ptr()), _ptr(cutlass.Int32, hist.data_ptr()),
               _ptr(_dtype(par.dtype), par.data_ptr()), _ptr(cutlass.Int32, last.data_ptr())]
            + [i32(v) for v in counts[:3]]
            + [i32(v) for v in (
                *counts[3:], kv.shape[0], q.stride(0), q.stride(1), kv.stride(0),
                k_new.stride(0), out.stride(0), out.stride(1), *mid_strides,
                req_to_token.stride(0), par.stride(0) if path else 0,
                par.stride(1) if path else 0)]
            + [cutlass.Float32(sm_scale * LOG2E), cutlass.Float32(logit_cap)])
    fn(*args, cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream))


def work_list_shape(row_tiles: int, batch: int, device: torch.device) -> tuple[int, int]:
    """``(cluster, programs)`` for the work list: ``programs`` clusters per row tile, all
    running at once, at least ``batch`` (one per request); the cluster size that keeps the
    most SMs busy (``cluster * programs * row_tiles``), the larger on a tie (more of the
    merge on chip). Where no size gives every request a cluster in one wave (a batch above
    the SM count), clusters of one and one program per request."""
    from .gluon_mla import device_index

    index = device_index(device)
    best = None
    for c in range(MAX_CLUSTER, 0, -1):
        p = max_active_clusters(index, c) // max(1, row_tiles)
        if p >= batch and (best is None or c * p > best[0] * best[1]):
            best = (c, p)
    return best or (1, batch)


def work_list_shares(prefix_lens: list, tail_keys: list, tail_units: int, cluster: int,
                     programs: int, block_n: int = 64) -> dict:
    """What each CTA of the work list walks, in Python (the kernel's ``_program`` and
    ``_share``, for tests): ``{b: [(prefix start, end, tail lo, tail hi, first), ...]}``
    over request ``b``'s programs and ranks; ``tail_keys[b]``: its row tile's history keys
    at this step (at most ``tail_units * block_n``)."""
    from .worklist import schedule

    plan = schedule(prefix_lens, tail_units, block_n, programs)
    shares: dict = {b: [] for b in range(len(prefix_lens))}
    for p, b in enumerate(plan.first_request):
        if b >= len(prefix_lens):
            continue  # an idle program
        u_b, u_end = plan.unit_starts[b], plan.unit_starts[b + 1]
        seg_lo, seg_hi = p * plan.chunk - u_b, min((p + 1) * plan.chunk, u_end) - u_b
        per_cta = -(-(seg_hi - seg_lo) // cluster)
        n_pref_all = -(-prefix_lens[b] // block_n)
        for rank in range(cluster):
            u0 = seg_lo + rank * per_cta
            u1 = min(u0 + per_cta, seg_hi)
            end = min(prefix_lens[b], min(u1, n_pref_all) * block_n)
            t_lo = max(u0 - n_pref_all, 0) * block_n
            t_hi = min(tail_keys[b], max(u1 - n_pref_all, 0) * block_n)
            shares[b].append((u0 * block_n, end, t_lo, max(t_hi, t_lo), u0 == 0))
    return shares


def _attention_work_list(q, kv, k_new, out, req_to_token, meta, hist, parents, *, mode,
                         batch, topk, num_steps, step, sm_scale, logit_cap, write_new, mid_o,
                         mid_lse, work, programs, row_tiles) -> None:
    """``attention`` over the work list (``work``, ``programs`` per row tile)."""
    from .worklist import merge, partial_rows, work_numel

    cluster, planned = work_list_shape(row_tiles, batch, q.device)
    if programs != planned:
        raise InvalidInputError("programs", f"the work list's programs per row tile here "
                                f"({planned}: work_list_shape)", programs)
    if work.dtype != torch.int32 or not work.is_contiguous() or \
            work.numel() < work_numel(programs, batch):
        raise InvalidInputError("work", f"the work list's contiguous int32 table, at least "
                                f"{work_numel(programs, batch)} words",
                                f"{work.dtype} {tuple(work.shape)}")
    rows = partial_rows(topk, q.shape[1])
    for name, t, dims in (("mid_o", mid_o, 3), ("mid_lse", mid_lse, 2)):
        if t is None or t.dtype != torch.float32 or t.dim() != dims or \
                not t.is_contiguous() or t.shape[0] < programs + batch or t.shape[1] < rows:
            raise InvalidInputError(name, f"contiguous fp32 [>= {programs + batch}, >= {rows}"
                                    f"{', 512' if dims == 3 else ''}] (a slot per program "
                                    "and request)",
                                    None if t is None else f"{t.dtype} {tuple(t.shape)}")
    path = mode == 1
    par = parents if path else meta
    fn = _compiled(q.dtype, q.shape[1], path, logit_cap > 0, write_new, cluster, 1,
                   req_to_token.dtype, par.dtype, work_list=True)
    _run(fn, (q, kv, k_new, out, mid_o, mid_lse, req_to_token, meta, hist, par, work),
         (batch, row_tiles, programs, step, topk, num_steps),
         (0, 0, mid_o.stride(0), mid_lse.stride(0), 0), path, sm_scale, logit_cap)
    merge(mid_o, mid_lse, out, work, programs, topk)


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

