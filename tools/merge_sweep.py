"""The split merge's tiles swept on a case's own partials, and the step with the fastest.

    python tools/merge_sweep.py --case gqa-b1-32k gqa-b1-k8 mla-b1-32k --out merge.md

For each case, one ``triton`` step records the merge launch it makes (``merge_partials``, or
the work list's segment merge) on the partials it wrote. That launch alone is timed as a
CUDA graph of ``GRAPH_LAUNCHES`` launches (the bench's clock, ``--rep-ms`` a tile; us a launch),
with the tiles the rule picks (``merge.merge_tiles``, ``worklist.segment_tiles``) and with
each tile of the sweep (columns a program, parts a load, warps; every output checked
against the rule's). Then the step of
one layer, timed as ``specattn bench`` times it (``harness.time_step``), with the rule's
tiles against the fastest, alternating for ``--rounds`` rounds in one process.

Output: a markdown table (stdout, and ``--out FILE``); ``--tiles FILE``: every tile's time
of every case as CSV, to fit a rule to the whole surface. GPU only; ``record`` and
``launch_with`` also run on the CPU (the Triton interpreter), as the test does.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

GRAPH_LAUNCHES = 20
TILE_COLUMNS = ["case", "launch", "parts", "columns", "rows", "block_d", "block_p", "warps",
                "us", "rule"]


class NoMerge(Exception):
    """A case whose step merges nothing (one segment a request)."""


@dataclass
class Recorded:
    """One merge launch of a case's step: its launcher, arguments and output."""

    name: str  # "merge" or "segment merge"
    launch: Callable[..., None]
    args: tuple
    kwargs: dict
    out: torch.Tensor
    parts: int  # the launch's parts per row (the segment merge: a request's average)
    rule: Any  # the MergeTiles the rule gave, or None (a program per row)

    @property
    def width(self) -> int:
        return self.out.shape[-1]

    @property
    def rows(self) -> int:
        return self.out.shape[0] * self.out.shape[1]


def _modules():
    from specattn.backends.triton import cute_mla, launchers, worklist
    from specattn.kernels import merge

    return merge, launchers, cute_mla, worklist


@contextlib.contextmanager
def forced_tiles(tiles: Optional[tuple[int, int, int]]) -> Iterator[None]:
    """Within the block every merge takes ``(columns, parts a load, warps)``; ``None``: the
    rule's tiles."""
    merge, _, _, worklist = _modules()
    real = merge.merge_tiles, worklist.segment_tiles
    if tiles is not None:
        block_d, block_p, warps = tiles

        def forced(rows: int, d_v: int, parts: int, device: torch.device):
            return merge.MergeTiles(-(-d_v // block_d), block_d, block_p, warps)

        merge.merge_tiles = worklist.segment_tiles = forced
    try:
        yield
    finally:
        merge.merge_tiles, worklist.segment_tiles = real


def record(case: Any, device: torch.device) -> tuple[Recorded, Any, Any]:
    """Run one ``triton`` step of ``case`` (a bench case or its name; the bench's setup,
    metadata set eagerly) and return its merge launch, the variant and the setup."""
    from specattn.bench.cases import find_cases
    from specattn.bench.harness import build_setup, discover_variants, timed_step_fn
    from specattn.platforms import current_platform

    merge, launchers, cute_mla, worklist = _modules()
    case = find_cases([case])[0] if isinstance(case, str) else case
    setup = build_setup(case, device)
    variants, _ = discover_variants(case, current_platform(), ["triton"], on_gpu=True)
    variant = next(v for v in variants if v.mode in ("shared", "default"))
    backend = variant.make(setup)
    backend.init_forward_metadata(setup.batch)
    seen: list[Recorded] = []
    rules: list[Any] = []
    real_tiles, real_segment_tiles, real_partials, real_segments = (
        merge.merge_tiles, worklist.segment_tiles, merge.merge_partials, worklist._merge_launch)

    def tiles_spy(rows, d_v, parts, dev):
        rules.append((parts, real_tiles(rows, d_v, parts, dev)))
        return rules[-1][1]

    def segment_tiles_spy(rows, d_v, segments, dev):
        rules.append((segments, real_segment_tiles(rows, d_v, segments, dev)))
        return rules[-1][1]

    def partials_spy(mid_o, mid_lse, out, parts, pdl=False):
        real_partials(mid_o, mid_lse, out, parts, pdl=pdl)
        seen.append(Recorded("merge", real_partials, (mid_o, mid_lse, out, parts),
                             {"pdl": pdl}, out, *rules[-1]))

    def segments_spy(mid_o, mid_lse, out, work, programs, topk, pdl):
        real_segments(mid_o, mid_lse, out, work, programs, topk, pdl)
        seen.append(Recorded("segment merge", real_segments,
                             (mid_o, mid_lse, out, work, programs, topk, pdl), {}, out,
                             *rules[-1]))

    patches = [(merge, "merge_tiles", tiles_spy), (worklist, "segment_tiles", segment_tiles_spy),
               (launchers, "merge_partials", partials_spy),
               (cute_mla, "merge_partials", partials_spy),
               (worklist, "_merge_launch", segments_spy)]
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    try:
        for module, name, fn in patches:
            setattr(module, name, fn)
        timed_step_fn(backend, setup)()
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
    if not seen:
        raise NoMerge(f"a triton step of {case.name} launches no merge")
    return seen[-1], variant, setup


def launch(rec: Recorded, tiles: Optional[tuple[int, int, int]]) -> None:
    """``rec``'s launch again with ``tiles`` (``None``: the rule's)."""
    with forced_tiles(tiles):
        rec.launch(*rec.args, **rec.kwargs)


def launch_with(rec: Recorded, tiles: Optional[tuple[int, int, int]]) -> torch.Tensor:
    """``launch``, its output poisoned first; a copy of the output."""
    rec.out.fill_(float("nan"))
    launch(rec, tiles)
    return rec.out.clone()


def sweep(rec: Recorded) -> list[tuple[int, int, int]]:
    """The tiles swept: columns 16 up to the row's width, parts a load 4 up to twice the
    parts (at most 256), 1 / 2 / 4 warps, at most 16384 values a load."""
    from specattn.util import next_pow2

    widths = [d for d in (16, 32, 64, 128, 256, 512) if d <= next_pow2(rec.width, 16)]
    loads = [p for p in (4, 8, 16, 32, 64, 128, 256) if p <= min(256, 2 * next_pow2(rec.parts))]
    return [(d, p, w) for d, p, w in itertools.product(widths, loads, (1, 2, 4))
            if d * p <= 16384]


def time_launch(clock: Any, fn: Callable[[], Any]) -> float:
    """Us of one ``fn()``: ``clock``'s time of a CUDA graph of ``GRAPH_LAUNCHES`` of them."""
    fn()  # compiled outside the capture
    replay = clock.graph(lambda: [fn() for _ in range(GRAPH_LAUNCHES)])
    return clock.time(replay) * 1000 / GRAPH_LAUNCHES


def _label(tiles: Optional[tuple[int, int, int]], rec: Recorded) -> str:
    if tiles is None:
        t = rec.rule
        return "rule: a program a row" if t is None else \
            f"rule: d{t.block_d} p{t.block_p} w{t.num_warps}"
    return "d{} p{} w{}".format(*tiles)


def run_case(case_name: str, rep_ms: int, rounds: int,
             tile_rows: Optional[list[list[Any]]] = None) -> str:
    """One case's table row; ``tile_rows`` (when given) takes a ``TILE_COLUMNS`` row per tile
    timed, the rule's first."""
    from specattn.bench.harness import CudaClock, time_step

    device = torch.device("cuda")
    rec, variant, setup = record(case_name, device)
    want = launch_with(rec, None)
    tile_clock = CudaClock(rep_ms=rep_ms)
    rule_us = time_launch(tile_clock, lambda: launch(rec, None))
    best: tuple[float, Optional[tuple[int, int, int]]] = (rule_us, None)
    rows = tile_rows if tile_rows is not None else []
    head = [case_name, rec.name, rec.parts, rec.width, rec.rows]
    t = rec.rule
    rows.append(head + ([0, 0, 0] if t is None else [t.block_d, t.block_p, t.num_warps])
                + [round(rule_us, 3), 1])
    for tiles in sweep(rec):
        try:
            got = launch_with(rec, tiles)
        except Exception as exc:  # a tile the compiler refuses (shared memory, registers)
            print(f"{case_name} {_label(tiles, rec)}: {type(exc).__name__}", file=sys.stderr)
            continue
        if not torch.allclose(got.float(), want.float(), atol=1e-3, rtol=1e-3, equal_nan=True):
            raise SystemExit(f"merge_sweep: {case_name} {_label(tiles, rec)} disagrees with "
                             f"the rule's output")
        us = time_launch(tile_clock, lambda t=tiles: launch(rec, t))
        rows.append(head + list(tiles) + [round(us, 3), 0])
        best = min(best, (us, tiles), key=lambda b: b[0])
    clock = CudaClock()
    steps: dict[str, list[float]] = {"rule": [], "fastest": []}
    for _ in range(rounds):
        for key, tiles in (("rule", None), ("fastest", best[1])):
            with forced_tiles(tiles):
                steps[key].append(time_step(variant, setup, clock)[0] * 1000)
    ratio = min(steps["fastest"]) / min(steps["rule"])

    def fmt(xs):
        return ", ".join(f"{x:.2f}" for x in xs)

    return (f"| {case_name} | {rec.name} | {rec.parts} x {rec.width}, {rec.rows} rows | "
            f"{_label(None, rec)} | {rule_us:.2f} | {_label(best[1], rec)} | {best[0]:.2f} | "
            f"{fmt(steps['rule'])} | {fmt(steps['fastest'])} | {ratio:.3f} |")


HEADER = ("| case | launch | parts x columns | rule tiles | rule us | fastest | its us | "
          "rule step us | fastest step us | step ratio |\n" + "|---" * 10 + "|")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="merge_sweep.py", description=__doc__.split("\n")[0])
    parser.add_argument("--case", nargs="+", required=True, help="bench case names")
    parser.add_argument("--rep-ms", type=int, default=50, help="timing of a tile (do_bench rep)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating step rounds")
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--tiles", help="every tile's time as CSV here (rule: rule 1, "
                        "block_d 0 where it is a program a row)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("merge_sweep: needs a CUDA GPU")
    lines = [HEADER]
    tile_rows: list[list[Any]] = []
    for name in args.case:
        try:
            lines.append(run_case(name, args.rep_ms, args.rounds, tile_rows))
        except NoMerge as exc:
            lines.append(f"| {name} | none: {exc} |" + " |" * 8)
        print(lines[-1], flush=True)
        if args.out:  # after every case: a cut-off run keeps what it measured
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")
        if args.tiles:
            with open(args.tiles, "w", newline="") as f:
                csv.writer(f).writerows([TILE_COLUMNS] + tile_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
