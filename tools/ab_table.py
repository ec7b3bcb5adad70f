"""Join the ``specattn bench`` runs of an A/B (``bash tools/gpu.sh ab``) into one table.

    python tools/ab_table.py DIR [--a-label REF] [--b-label DIR] [--out ab.md]

``DIR`` holds the runs as ``a1/ b1/ a2/ b2/ ...`` (A: the older package, B: this tree or
another package, in the order they ran), each with its ``bench.csv``. Per (case, lengths,
variant): every run's time and the ratio of the medians, B over A (below 1: B is faster).
Rows that failed or ran on one side only show ``-``.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import sys
from typing import Optional


def read_runs(root: str) -> dict[str, list[dict[tuple, float]]]:
    """``{"a": [times of a1, a2, ...], "b": [...]}``, each ``{(case, lengths, variant): us}``."""
    runs: dict[str, list[dict[tuple, float]]] = {"a": [], "b": []}
    for name in sorted(os.listdir(root), key=lambda n: (len(n), n)):  # a1 a2 ... a10
        found = re.fullmatch(r"([ab])\d+", name)
        path = os.path.join(root, name, "bench.csv")
        if not found or not os.path.isfile(path):
            continue
        with open(path, newline="") as f:
            times = {(r["case"], r["lengths"], r["variant"]): float(r["time_us"])
                     for r in csv.DictReader(f)
                     if r.get("status") in ("ok", "floor") and r.get("time_us")}
        runs[found.group(1)].append(times)
    return runs


def table(runs: dict[str, list[dict[tuple, float]]], a_label: str = "A",
          b_label: Optional[str] = None) -> str:
    keys = list(dict.fromkeys(k for side in ("b", "a") for run in runs[side] for k in run))

    def cell(side: str, key: tuple) -> tuple[str, Optional[float]]:
        times = [run[key] for run in runs[side] if key in run]
        if not times:
            return "-", None
        return ", ".join(f"{t:.1f}" for t in times), statistics.median(times)

    lines = [f"# A/B: A = `{a_label}`, B = " + (f"`{b_label}`" if b_label else "this tree"),
             "",
             f"Runs in the order A1 B1 A2 B2 ... ({len(runs['a'])} of A, {len(runs['b'])} of "
             "B); us per run; `B/A`: median over median (below 1: B is faster). A drift "
             "between A1 and A2 is the run-to-run noise.",
             "",
             "| case | lengths | variant | A us | B us | B/A |",
             "|---|---|---|---|---|---|"]
    for key in keys:
        (a_text, a), (b_text, b) = cell("a", key), cell("b", key)
        ratio = f"{b / a:.3f}" if a and b else "-"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {a_text} | {b_text} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--a-label", default="A")
    ap.add_argument("--b-label", help="B's package folder (default: this tree)")
    ap.add_argument("--out", help="write the table here (default: print it)")
    args = ap.parse_args(argv)
    runs = read_runs(args.dir)
    if not runs["a"] or not runs["b"]:
        print(f"ab_table: {args.dir} needs a1/bench.csv and b1/bench.csv at least",
              file=sys.stderr)
        return 1
    text = table(runs, args.a_label, args.b_label)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
