"""Can this Triton's Gluon move data between the CTAs of a thread-block cluster on sm90?
Compile-only (no GPU needed); the evidence for issue #19's on-chip merge of split partials.

The merge needs each of a request's split programs (one CTA each, one cluster) to read the
other CTAs' partial rows from distributed shared memory. In Gluon that is a
``convert_layout`` between two layouts of one tensor spread over a 4-CTA cluster
(``num_ctas=4``, ``cga_layout`` bases): here a ``[4, 32]`` fp32 tensor whose row ``c`` lives in
CTA ``c`` (a split's partial) is converted to a layout where every CTA holds 8 columns of all
four rows (what a CTA sums to merge its slice). The probe compiles that kernel for sm90 and
prints either the distributed-shared-memory instructions in its PTX (``mapa``,
``shared::cluster``, ``barrier.cluster``) or the compiler's error.

    python tools/gluon_cluster_probe.py

Seen: Triton 3.6.0 (the H200's) fails in its LLVM lowering (``'nvvm.mapa' op result #0 must
be LLVM pointer in address space 0 or LLVM pointer in address space 7, but got
'!llvm.ptr<3>'``); Triton 3.9.0 compiles it to ``mapa`` + ``ld.shared::cluster`` +
``barrier.cluster``.
"""

from __future__ import annotations

import re
import sys
from typing import Optional

DSMEM_OPS = ("mapa", "shared::cluster", "barrier.cluster")


def probe() -> tuple[Optional[dict], Optional[str]]:
    """``(counts, None)``: the kernel compiled, with the count of each of ``DSMEM_OPS`` in its
    PTX; ``(None, error)``: the compiler's answer. MLIR prints its diagnostics on the
    process's stderr, not in the exception, so the compile runs in a child process."""
    import subprocess

    child = subprocess.run([sys.executable, __file__, "--compile"], capture_output=True,
                           text=True)
    if child.returncode == 0:
        counts = re.search(r"^counts (.*)$", child.stdout, re.M)
        return {op: int(n) for op, n in
                (item.split("=") for item in counts.group(1).split())}, None
    found = re.search(r"error: (.*)", child.stderr)
    lines = child.stderr.strip().splitlines() or ["(no output)"]
    return None, found.group(1).strip() if found else lines[-1]


def _compile() -> None:
    """The child: compile the kernel, print ``counts op=n ...`` (raises if it fails)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton_ir_stats import _compile

    # Row c in CTA c (32 lanes along the row); after: 4 x 8 lanes, CTA c holds columns
    # [8c, 8c + 8) of every row. cga_layout bases count per-CTA tiles.
    by_split = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0],
                                             cga_layout=[[1, 0], [2, 0]]))
    by_column = gl.constexpr(gl.BlockedLayout([1, 1], [4, 8], [1, 1], [1, 0],
                                              cga_layout=[[0, 1], [0, 2]]))

    @gluon.jit
    def exchange(X, Y):
        r = gl.arange(0, 4, layout=gl.SliceLayout(1, by_split))
        c = gl.arange(0, 32, layout=gl.SliceLayout(0, by_split))
        x = gl.load(X + r[:, None] * 32 + c[None, :])
        y = gl.convert_layout(x, by_column)
        r2 = gl.arange(0, 4, layout=gl.SliceLayout(1, by_column))
        c2 = gl.arange(0, 32, layout=gl.SliceLayout(0, by_column))
        gl.store(Y + r2[:, None] * 32 + c2[None, :], y)

    kernel = _compile(exchange, {}, 1, 1, gluon=True, ptrs={"X": "*fp32", "Y": "*fp32"},
                      num_ctas=4)
    ptx = kernel.asm["ptx"]
    print("counts " + " ".join(f"{op}={len(re.findall(re.escape(op), ptx))}"
                               for op in DSMEM_OPS))


def main() -> int:
    if sys.argv[1:] == ["--compile"]:
        _compile()
        return 0
    import triton

    counts, error = probe()
    print(f"triton {triton.__version__}, sm90, num_ctas=4: ", end="")
    if error is not None:
        print(f"does not compile: {error}")
        return 1
    print("compiles; " + ", ".join(f"{op}: {n}" for op, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
