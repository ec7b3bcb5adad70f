"""MLA decode's tile loop in CuTe-DSL on sm90: issue #19's next kernel, de-risked piece by
piece (``gluon-notes.md``, "Session 9", item 2). One warpgroup, in one CTA, over ``TILES``
key tiles of 64, each:

- the key tile gathered from a KV pool through a slot list (a page-size-1 ``req_to_token``
  row), 16 bytes per ``cp.async``, into the 128-byte-swizzled layout wgmma reads;
- ``S = Q K^T`` for 64 query rows x 64 keys over the 576-wide latent + rope row, as one
  wgmma chain of N 64 (36 x m64n64k16). The Gluon kernel splits S's columns over two
  warpgroups, N 32 each, and is shared-memory bound there;
- the online softmax on S's accumulator: row maxima and sums over each thread's columns,
  then across the 4 threads of a quad by butterfly shuffles; O and the sums rescaled to
  the new maxima;
- ``O[:, :256] += P V`` (4 x m64n256k16; divided by the sums at the end), P in bf16 from
  registers (S's accumulator regrouped as the A operand), V read in place: the key tile's
  shared memory (row-major, 128-byte swizzle) viewed as ``(dims, keys)`` is the MN-major
  operand wgmma wants, so V costs no copy.

There is one stage and no overlap: this checks layouts and arithmetic, not speed.

Needs CuTe-DSL (``nvidia-cutlass-dsl`` 4.8, the FA4 part of the offline GPU bundle; Python
3.12; setup in ``tools/cute_cluster_probe.py``). Without a GPU: compiles for sm90a and prints
the wgmma counts and, when ``cuobjdump`` is found (``$CUOBJDUMP``, Triton's, or on PATH),
registers and stack. With ``--run``: also checks S and O against torch (float64) on this
machine's GPU; a layout mistake shows as errors of order 1, P's bf16 rounding as about 1e-3.

Seen here (CuTe-DSL 4.8.1, no GPU): 16-byte ``cp.async.cg`` gathers, 36 m64n64k16 + 4
m64n256k16 (A in registers, B transposed) in a run-time tile loop; 202 registers, no
stack.
H200 (session 10, `benchmarks/results/2026-12-01-h200/s10/call3`): relative max error S
6.5e-07, O 1.2e-03; memcheck clean. Its first run (call 1) stopped on a misaligned address:
the copy tiles were ``(1, 8)``, so ``cute.copy`` with the 16-byte atom issued 8 copies, one
per element, at 2-byte offsets; a single mode of 8 gives one copy per piece.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
# Kept PTX / cubin go to a scratch folder, not the working directory.
os.environ.setdefault("CUTE_DSL_DUMP_DIR", os.path.join(tempfile.gettempdir(), "specattn-cute"))
os.makedirs(os.environ["CUTE_DSL_DUMP_DIR"], exist_ok=True)

import sys  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as hopper  # noqa: E402
from cutlass import BFloat16, Float32  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

# The MLA kernel's own helpers: the probe checks the pieces that kernel is built from.
from specattn.backends.triton._cute_mla_kernel import (  # noqa: E402
    _acc_rows, _quad_reduce, _swizzled, _wgmma)

ROWS, KEYS, WIDTH, V_HALF = 64, 64, 576, 256  # query rows, keys per tile, latent + rope, O half
POOL = 1000  # KV pool rows the tile's keys are gathered from
SCALE, LOG2E = WIDTH ** -0.5, 1.4426950408889634
TILES = 4  # key tiles the probe walks (the online softmax rescales between them)
THREADS = 128  # one warpgroup


@cute.jit
def _acc_as_operand_a(acc: cute.Layout) -> cute.Layout:
    """A wgmma accumulator's per-thread layout ``((2, 2, N / 8), M blocks, N blocks)`` as the
    next wgmma's register A operand ``((2, 2, 2), M blocks, (N / 16, N blocks))``: each k block
    of 16 takes two of the accumulator's 8-column groups."""
    split = cute.logical_divide(acc, ((None, None, 2), None, None))
    return cute.make_layout(
        ((split.shape[0][0], split.shape[0][1], split.shape[0][2][0]), split.shape[1],
         (split.shape[0][2][1], split.shape[2])),
        stride=((split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
                split.stride[1], (split.stride[0][2][1], split.stride[2])))


@cute.jit
def _online_softmax(acc_s: cute.Tensor, acc_o: cute.Tensor, row_max: cute.Tensor,
                    row_sum: cute.Tensor, scale_log2: Float32) -> None:
    """One tile of the online softmax, in place: ``acc_s <- exp2((S - m) * scale_log2)`` with
    ``m`` the running row maximum, ``acc_o`` and ``row_sum`` rescaled to it, then the tile's
    row sums added."""
    s_rows = cute.make_tensor(acc_s.iterator, _acc_rows(acc_s.layout))
    o_rows = cute.make_tensor(acc_o.iterator, _acc_rows(acc_o.layout))
    for r in cutlass.range_constexpr(cute.size(s_rows, mode=[0])):
        top = row_max[r]
        for c in cutlass.range_constexpr(cute.size(s_rows, mode=[1])):
            top = cute.arch.fmax(top, s_rows[r, c])
        top = _quad_reduce(top, cute.arch.fmax)
        alpha = cute.arch.exp2((row_max[r] - top) * scale_log2)  # 0 on the first tile
        row_max[r] = top
        total = Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(s_rows, mode=[1])):
            s_rows[r, c] = cute.arch.exp2((s_rows[r, c] - top) * scale_log2)
            total += s_rows[r, c]
        row_sum[r] = row_sum[r] * alpha + _quad_reduce(total, lambda a, b: a + b)
        for c in cutlass.range_constexpr(cute.size(o_rows, mode=[1])):
            o_rows[r, c] = o_rows[r, c] * alpha


@cute.jit
def _gather_tile(sK: cute.Tensor, gKV: cute.Tensor, gSlots: cute.Tensor, tile, tidx) -> None:
    """Key rows ``gSlots[tile * 64 ...]`` of the pool into ``sK``, 16 bytes per ``cp.async``
    (a 128-byte swizzle moves whole 16-byte pieces, so each lands contiguous); one commit
    group."""
    piece = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                BFloat16, num_bits_per_copy=128)
    per_row = WIDTH // 8
    for i in cutlass.range(KEYS * per_row // THREADS):
        e = tidx + THREADS * i
        row, col = e // per_row, e % per_row
        # Rows are 1152 bytes: every piece's address is 16-byte aligned, which the copy
        # atom needs told (an index read from memory hides it).
        src = cute.make_ptr(BFloat16,
                            (gKV.iterator + gSlots[tile * KEYS + row] * WIDTH + col * 8).toint(),
                            cute.AddressSpace.gmem, assumed_align=16)
        # One atom moves all 8 elements: both tensors are one mode of 8 (a (1, 8) tile
        # would be 8 copies of 16 bytes, one per element).
        cute.copy(piece, cute.make_tensor(src, cute.make_layout(8)),
                  cute.local_tile(sK, (1, 8), (row, col))[0, None])
    cute.arch.cp_async_commit_group()


@cute.kernel
def tile_kernel(gQ: cute.Tensor, gKV: cute.Tensor, gSlots: cute.Tensor, gS: cute.Tensor,
                gO: cute.Tensor):
    """gQ ``[64, 576]`` bf16; the keys are rows ``gSlots [T * 64]`` (int32) of the pool
    ``gKV [slots, 576]`` bf16, T tiles of 64 -> gS ``[64, 64]`` = Q K^T of the first tile,
    gO ``[64, 256]`` = softmax(Q K^T * SCALE) K[:, :256] over all T tiles (both fp32)."""
    tidx, _, _ = cute.arch.thread_idx()
    alloc = SmemAllocator()
    lay_q, lay_k = _swizzled(BFloat16, ROWS, WIDTH), _swizzled(BFloat16, KEYS, WIDTH)
    sQ = alloc.allocate_tensor(BFloat16, lay_q.outer, 1024, swizzle=lay_q.inner)
    sK = alloc.allocate_tensor(BFloat16, lay_k.outer, 1024, swizzle=lay_k.inner)
    for i in cutlass.range(ROWS * WIDTH // THREADS):
        e = tidx + THREADS * i
        sQ[e // WIDTH, e % WIDTH] = gQ[e // WIDTH, e % WIDTH]

    mma_s = hopper.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K,
                                          OperandMajorMode.K, Float32, (1, 1, 1), (ROWS, KEYS))
    thr_s = mma_s.get_slice(tidx)
    frag_q = thr_s.make_fragment_A(thr_s.partition_A(sQ))
    frag_k = thr_s.make_fragment_B(thr_s.partition_B(sK))
    # V in place: the key rows as (dims, keys), dims contiguous (MN-major), first 256 dims.
    sVt = cute.make_tensor(sK.iterator, cute.select(sK.layout, mode=[1, 0]))
    mma_o = hopper.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K,
                                          OperandMajorMode.MN, Float32, (1, 1, 1),
                                          (ROWS, V_HALF), a_source=warpgroup.OperandSource.RMEM)
    thr_o = mma_o.get_slice(tidx)
    frag_v = thr_o.make_fragment_B(thr_o.partition_B(cute.local_tile(sVt, (V_HALF, KEYS),
                                                                     (0, 0))))
    acc_o = cute.make_rmem_tensor(thr_o.partition_shape_C((ROWS, V_HALF)), Float32)
    acc_o.fill(0.0)
    rows_here = cute.size(_acc_rows(acc_o.layout), mode=[0])
    row_max = cute.make_rmem_tensor(rows_here, Float32)
    row_sum = cute.make_rmem_tensor(rows_here, Float32)
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)

    for t in cutlass.range(cute.size(gSlots) // KEYS):
        _gather_tile(sK, gKV, gSlots, t, tidx)
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_proxy("async.shared", space="cta")  # copies and stores -> wgmma
        cute.arch.barrier()
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((ROWS, KEYS)), Float32)
        _wgmma(mma_s, acc_s, frag_q, frag_k, True)
        if t == 0:
            out_s = thr_s.partition_C(gS)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                out_s[i] = acc_s[i]
        _online_softmax(acc_s, acc_o, row_max, row_sum, Float32(SCALE * LOG2E))
        # P in bf16 stays in registers: S's accumulator, regrouped as the A operand.
        frag_p = thr_o.make_fragment_A(thr_o.partition_shape_A((ROWS, KEYS)))
        frag_p.store(cute.make_tensor(acc_s.iterator, _acc_as_operand_a(acc_s.layout))
                     .load().to(BFloat16))
        _wgmma(mma_o, acc_o, frag_p, frag_v, False)
        cute.arch.barrier()  # every warp is done with sK before the next gather

    out_o = cute.make_tensor(thr_o.partition_C(gO).iterator,
                             _acc_rows(thr_o.partition_C(gO).layout))
    o_rows = cute.make_tensor(acc_o.iterator, _acc_rows(acc_o.layout))
    for r in cutlass.range_constexpr(cute.size(o_rows, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(o_rows, mode=[1])):
            out_o[r, c] = o_rows[r, c] / row_sum[r]


@cute.jit
def launch(gQ: cute.Tensor, gKV: cute.Tensor, gSlots: cute.Tensor, gS: cute.Tensor,
           gO: cute.Tensor):
    tile_kernel(gQ, gKV, gSlots, gS, gO).launch(grid=(1, 1, 1), block=(THREADS, 1, 1))


def compile_only() -> str:
    """Compile for sm90a with stand-in tensors; a one-line summary."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    args = (make_fake_compact_tensor(BFloat16, (ROWS, WIDTH)),
            make_fake_compact_tensor(BFloat16, (POOL, WIDTH), assumed_align=16),
            make_fake_compact_tensor(cutlass.Int32, (TILES * KEYS,)),
            make_fake_compact_tensor(Float32, (ROWS, KEYS)),
            make_fake_compact_tensor(Float32, (ROWS, V_HALF)))
    compiled = cute.compile(launch, *args, options="--keep-ptx --keep-cubin")
    ptx = compiled.__ptx__
    line = ", ".join(f"{op}: {len(re.findall(op, ptx))}"
                     for op in ("cp.async.cg.shared.global", "m64n64k16", "m64n256k16"))
    return line + _resources(compiled.__cubin__)


def _resources(cubin: bytes) -> str:
    """``; registers R, stack S B`` from cuobjdump ($CUOBJDUMP, Triton's copy, or one on
    PATH), or ''."""
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    try:
        import triton

        bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                               "cuobjdump")
        tool = bundled if os.path.exists(bundled) and "CUOBJDUMP" not in os.environ else tool
    except ImportError:
        pass
    if tool is None or not cubin:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"; registers {found.group(1)}, stack {found.group(2)} B" if found else ""


def run_and_check() -> tuple[float, float]:
    """Run on this machine's GPU; the largest errors of S and O against torch (float64)."""
    import torch
    from cutlass.cute.runtime import from_dlpack

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(ROWS, WIDTH, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(POOL, WIDTH, device="cuda", generator=gen).bfloat16()
    slots = torch.randperm(POOL, device="cuda", generator=gen)[:TILES * KEYS].int()
    k = kv[slots.long()]  # [TILES * 64, 576]
    s = torch.full((ROWS, KEYS), float("nan"), device="cuda")
    o = torch.full((ROWS, V_HALF), float("nan"), device="cuda")
    args = [from_dlpack(t, assumed_align=16) for t in (q, kv, slots, s, o)]
    cute.compile(launch, *args)(*args)
    torch.cuda.synchronize()
    scores = q.double() @ k.double().T
    want_s = scores[:, :KEYS]
    want_o = torch.softmax(scores * SCALE, dim=1) @ k[:, :V_HALF].double()
    return ((s.double() - want_s).abs().max().item() / want_s.abs().max().item(),
            (o.double() - want_o).abs().max().item() / want_o.abs().max().item())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="store_true", help="also run it on this machine's GPU")
    args = ap.parse_args()
    print("compiles for sm90a; " + compile_only())
    if args.run:
        err_s, err_o = run_and_check()
        print(f"ran: relative max error S {err_s:.2e}, O {err_o:.2e}")
        return 0 if err_s < 1e-4 and err_o < 2e-2 else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
