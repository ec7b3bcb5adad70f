"""The on-chip merge of split partials in CuTe-DSL: issue #19's route past Gluon 3.6
(``tools/gluon_cluster_probe.py``). A cluster of ``SPLITS`` CTAs, one per prefix split. Each
CTA leaves its partial ``[ROWS, COLS]`` in its own shared memory. After a cluster barrier, CTA
``c`` sums columns ``[8c, 8c + 8)`` of every partial, reading the other CTAs' shared memory
(``mapa`` + ``ld.shared::cluster``). A second barrier keeps each CTA alive until the others
have read it.

Needs CuTe-DSL (``nvidia-cutlass-dsl`` 4.8, in the FA4 part of the offline GPU bundle; Python
3.12). Without a GPU it compiles for sm90a and counts the distributed-shared-memory
instructions in the PTX. With one (``--run``) it also runs the kernel and checks the merge
against torch. On this CPU machine:

    python3.12 -m venv /tmp/cute-venv && /tmp/cute-venv/bin/pip install numpy cuda-python
    bash .gpu/install.sh /tmp/cute-site fa4-first && bash .gpu/install.sh /tmp/cute-site fa4
    PYTHONPATH=/tmp/cute-site/nvidia_cutlass_dsl/dsl_packages:/tmp/cute-site \\
        /tmp/cute-venv/bin/python tools/cute_cluster_probe.py

Seen here (CuTe-DSL 4.8.1, no GPU): it compiles; ``mapa`` 4, ``ld.shared::cluster`` 4,
``barrier.cluster`` 4. H200 (session 10, call 1): matches torch.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
# Kept PTX / cubin go to a scratch folder, not the working directory.
os.environ.setdefault("CUTE_DSL_DUMP_DIR", os.path.join(tempfile.gettempdir(), "specattn-cute"))
os.makedirs(os.environ["CUTE_DSL_DUMP_DIR"], exist_ok=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

# The MLA kernel's own remote load: the probe checks the piece that kernel merges with.
from specattn.backends.triton._cute_mla_kernel import _ld_cluster_f32  # noqa: E402

SPLITS, ROWS, COLS = 4, 4, 32  # one partial per CTA; each CTA merges COLS / SPLITS columns
THREADS = ROWS * COLS // SPLITS  # one merged element per thread
DSMEM_OPS = ("mapa", "ld.shared::cluster", "barrier.cluster")


@cute.kernel
def merge_kernel(parts: cute.Tensor, out: cute.Tensor):
    """parts: ``[SPLITS * ROWS * COLS]`` (split-major); out: ``[ROWS * COLS]``, the sum over
    splits."""
    tidx, _, _ = cute.arch.thread_idx()
    rank = cute.arch.block_idx_in_cluster()
    mine = SmemAllocator().allocate_tensor(cutlass.Float32, cute.make_layout(ROWS * COLS), 16)
    for i in cutlass.range_constexpr(ROWS * COLS // THREADS):
        mine[tidx + THREADS * i] = parts[rank * ROWS * COLS + tidx + THREADS * i]
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    width = COLS // SPLITS
    row = tidx // width
    col = rank * width + tidx % width
    total = cutlass.Float32(0.0)
    for src in cutlass.range_constexpr(SPLITS):
        total += _ld_cluster_f32(cute.arch.map_dsmem_ptr(mine.iterator + (row * COLS + col),
                                                         src))
    out[row * COLS + col] = total
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


@cute.jit
def launch(parts: cute.Tensor, out: cute.Tensor):
    merge_kernel(parts, out).launch(grid=(SPLITS, 1, 1), block=(THREADS, 1, 1),
                                    cluster=(SPLITS, 1, 1))


def compile_only() -> dict:
    """Compile for sm90a with stand-in tensors; the count of each of ``DSMEM_OPS``."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    parts = make_fake_compact_tensor(cutlass.Float32, (SPLITS * ROWS * COLS,))
    out = make_fake_compact_tensor(cutlass.Float32, (ROWS * COLS,))
    ptx = cute.compile(launch, parts, out, options="--keep-ptx").__ptx__
    return {op: len(re.findall(re.escape(op), ptx)) for op in DSMEM_OPS}


def run_and_check() -> float:
    """Run on the current GPU; the largest error against torch's sum over splits."""
    import torch
    from cutlass.cute.runtime import from_dlpack

    parts = torch.randn(SPLITS * ROWS * COLS, device="cuda")
    out = torch.full((ROWS * COLS,), float("nan"), device="cuda")
    cute.compile(launch, from_dlpack(parts), from_dlpack(out))(from_dlpack(parts),
                                                               from_dlpack(out))
    torch.cuda.synchronize()
    want = parts.view(SPLITS, ROWS * COLS).sum(0)
    return (out - want).abs().max().item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="store_true", help="also run it on this machine's GPU")
    args = ap.parse_args()
    counts = compile_only()
    print("compiles for sm90a; " + ", ".join(f"{op}: {n}" for op, n in counts.items()))
    if args.run:
        err = run_and_check()
        print(f"ran: max error against torch {err:.3g}")
        return 0 if err < 1e-5 else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
