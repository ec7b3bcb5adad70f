"""The least time one kernel launch takes to read a bench case's bytes on this GPU, timed as
``specattn bench`` times a step: the median of ``triton.testing.do_bench`` over a CUDA graph
that makes one launch per rotating layer (each layer its own buffer, together past L2).

Rows per case (uniform lengths, the timed step's bytes: every prefix once plus every lane's
history, ``Case.kv_bytes``):

- ``floor``: those bytes over the copy bandwidth measured a moment before (the bench's floor);
- ``empty launch``: a one-program kernel that stores one word: what a launch in a graph
  costs before any byte is read;
- ``contiguous read``: one launch of a streaming read (load and sum) of the bytes, the best
  of a few block sizes: the bandwidth a kernel reaches at this size, latency included;
- ``paged read``: the same rows gathered through a slot table (page size 1): a chain of two
  dependent loads per program, as every paged attention kernel has; slots in order, as the
  bench's allocator lays a request out;
- ``shuffled read``: the same with the slots in random order (a fragmented pool).

These are not attention kernels. They answer whether a target stated as a multiple of the
floor can be met by *any* single launch at that size: ``mla-small``'s 2x target is 2.2 us.

    python tools/read_floor.py [--case mla-small mla-long ...] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEFAULT_CASES = ("mla-small", "mla-long", "mla-k1", "gqa-small", "gqa-long")
READ_BLOCKS = (4096, 8192, 16384)  # elements per program of the contiguous read
READS = ("contiguous read", "paged read", "shuffled read")
GATHER_BYTES = 32768  # at most this much per program of the paged read (a power-of-two row count)


@triton.jit
def _empty(out_ptr):
    tl.store(out_ptr, 1.0)


@triton.jit
def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(x.to(tl.float32), axis=0))


@triton.jit
def _gather(pool_ptr, slots_ptr, out_ptr, n_keys, ROW: tl.constexpr, HEAD: tl.constexpr,
            TAIL: tl.constexpr, KEYS: tl.constexpr):
    # ROW = HEAD + TAIL elements per row; HEAD and TAIL powers of two (MLA: 512 + 64).
    pid = tl.program_id(0)
    k = pid * KEYS + tl.arange(0, KEYS)
    slot = tl.load(slots_ptr + k, mask=k < n_keys, other=0).to(tl.int64)
    base = pool_ptr + slot[:, None] * ROW
    head = tl.load(base + tl.arange(0, HEAD)[None, :], mask=(k < n_keys)[:, None], other=0.0)
    total = tl.sum(tl.sum(head.to(tl.float32), axis=1), axis=0)
    if TAIL > 0:
        tail = tl.load(base + HEAD + tl.arange(0, TAIL)[None, :], mask=(k < n_keys)[:, None],
                       other=0.0)
        total += tl.sum(tl.sum(tail.to(tl.float32), axis=1), axis=0)
    tl.store(out_ptr + pid, total)


def _split_row(row: int) -> tuple[int, int]:
    """``row`` as a power of two plus a smaller power of two (or 0): 576 -> (512, 64)."""
    head = 1 << (row.bit_length() - 1)
    tail = row - head
    if tail and tail & (tail - 1):
        raise ValueError(f"row of {row} elements is not a sum of two powers of two")
    return head, tail


def _per_layer_us(clock, launches: list[Callable[[], None]]) -> float:
    """Microseconds per launch of one graph replay that makes every launch once."""
    def run() -> None:
        for launch in launches:
            launch()
    run()  # compile outside the capture
    return clock.time(clock.graph(run)) * 1e3 / len(launches)


def measure(case, clock, bandwidth: float, device: torch.device) -> dict[str, float]:
    from specattn.bench.harness import _num_layers  # as many layers as the bench rotates

    lengths = case.lengths()
    nbytes = case.kv_bytes(lengths)
    row = case.row_bytes // case.element_size
    rows = nbytes // case.row_bytes
    layers = _num_layers(case, lengths, device, None)
    gen = torch.Generator(device=device).manual_seed(0)
    pools = [torch.randn(rows, row, device=device, generator=gen).to(case.dtype)
             for _ in range(layers)]
    out = torch.empty(max(rows, 1024), device=device, dtype=torch.float32)
    result = {"bytes": float(nbytes), "layers": float(layers),
              "floor": nbytes / bandwidth * 1e6,
              "empty launch": _per_layer_us(clock, [lambda: _empty[(1,)](out)] * layers)}

    n = rows * row
    best = float("inf")
    for block in READ_BLOCKS:
        grid = (triton.cdiv(n, block),)
        launches = [(lambda p=p: _read[grid](p, out, n, BLOCK=block, num_warps=8))
                    for p in pools]
        best = min(best, _per_layer_us(clock, launches))
    result["contiguous read"] = best

    head, tail = _split_row(row)
    keys = 1 << max(0, (GATHER_BYTES // case.row_bytes).bit_length() - 1)
    grid = (triton.cdiv(rows, keys),)
    for name, slots in (("paged read", torch.arange(rows, device=device, dtype=torch.int32)),
                        ("shuffled read", torch.randperm(rows, device=device, generator=gen)
                         .to(torch.int32))):
        launches = [(lambda p=p, slots=slots: _gather[grid](
            p, slots, out, rows, ROW=row, HEAD=head, TAIL=tail, KEYS=keys, num_warps=4))
            for p in pools]
        result[name] = _per_layer_us(clock, launches)
    return result


def table(rows: list[tuple[str, dict[str, float]]], header: str) -> str:
    lines = [header, "",
             "| case | MB per layer | layers | floor us | empty launch us | "
             + " | ".join(f"{r} us (x floor)" for r in READS) + " |",
             "|---|---|---|---|---|" + "---|" * len(READS)]
    for name, r in rows:
        f = r["floor"]
        lines.append(f"| {name} | {r['bytes'] / 1e6:.1f} | {int(r['layers'])} | {f:.1f} | "
                     f"{r['empty launch']:.2f} | "
                     + " | ".join(f"{r[k]:.1f} ({r[k] / f:.2f})" for k in READS) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from specattn.bench.cases import find_cases
    from specattn.bench.harness import CudaClock, copy_bandwidth

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", nargs="+", default=list(DEFAULT_CASES))
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("read_floor: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    clock = CudaClock()
    bandwidth = copy_bandwidth(device, clock)
    props = torch.cuda.get_device_properties(device)
    header = (f"{props.name}, torch {torch.__version__}, triton {triton.__version__}; copy "
              f"bandwidth {bandwidth / 1e12:.2f} TB/s (read + written); do_bench median over "
              "a CUDA graph of one launch per rotating layer; uniform lengths")
    rows = [(c.name, measure(c, clock, bandwidth, device)) for c in find_cases(args.case)]
    text = table(rows, header)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
