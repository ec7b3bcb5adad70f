"""Where the Gluon MLA kernel's tile time goes (an sm90 GPU with Triton 3.6): one bench step
of each case timed three ways, as ``specattn bench`` times it (do_bench median, CUDA graph,
layers rotated past L2):

- ``full``: the kernel as it runs;
- ``copies``: ``DIAG=1``, the key copies and their waits without the math;
- ``math``: ``DIAG=2``, the math on whatever the stages hold, without copies after the first;
- ``copies, no stores or merge``: ``DIAG=3``, as ``copies`` without the result stores and the
  merge launch;
- ``no tiles``: ``DIAG=4``, no key tiles (Q, the prologue's copies, the epilogue, the merge):
  the fixed cost of a call;
- ``no merge`` (the CuTe-DSL kernel, ``cute`` configs, only): ``diag=5``, each CTA writes
  its own partial to the output straight from its registers (no on-chip merge, no
  cluster barrier): ``full`` minus this is what the merge on chip costs. (Until session 11 this
  mode dropped the stores altogether; the compiler then dropped most of ``P.V`` too, so its
  figure was not the merge's cost.) The CuTe kernel is timed ``full``, ``no tiles`` and
  ``no merge`` only (since session 11 its loop has no copies-alone or math-alone mode).

If ``full`` is near ``copies``, the gathers set the tile time; if near ``math``, the MMA and
softmax chain does; if above both, the two do not overlap. DIAG runs give wrong outputs by
design: timing only.

    python tools/gluon_diag.py [--case mla-long mla-wide ...] [--config LABEL ...]
                               [--prefix N ...]

Several ``--config`` labels (tile size, ring depth) show how each part's time depends on the
bytes in flight (``BLOCK_N x stages x 1152`` bytes) and the tile size.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MODES = {"full": 0, "copies": 1, "math": 2, "copies, no stores or merge": 3, "no tiles": 4,
         "no merge": 5}
GLUON_MODES = set(MODES) - {"no merge"}
CUTE_MODES = {"full", "no tiles", "no merge"}  # the CuTe kernel's (its loop has no DIAG 1-3)


def main() -> None:
    from specattn.bench.harness import CudaClock
    from specattn.bench.options import kernel_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", nargs="+", default=["mla-long", "mla-wide"])
    ap.add_argument("--config", nargs="+", default=["m64 n64 w8 s2 kv-first gluon pf"],
                    help="split-per-request Gluon KernelConfig labels (DIAG is in their tile "
                         "step), or the CuTe-DSL kernel's ('... gluon cute')")
    ap.add_argument("--prefix", type=int, nargs="+", default=None,
                    help="prefix lengths to run each case at instead of its own (the time "
                         "per extra tile, apart from the fixed cost of a call)")
    args = ap.parse_args()
    configs = [kernel_config(label) for label in args.config]
    for cfg in configs:
        if not cfg.gluon or cfg.gluon_worklist or cfg.gluon_ws or cfg.gluon_overlap:
            raise SystemExit(f"--config {cfg.label()}: the split-per-request Gluon kernel "
                             "without overlap, or the CuTe-DSL kernel")
    clock = CudaClock()
    print(f"| case | config | tiles per program | {' | '.join(MODES)} | full per tile |")
    print("|---|---|---|" + "---|" * (len(MODES) + 1))
    for name, case, setup in case_setups(args.case, args.prefix):
        for cfg in configs:
            _diag_row(name, case, setup, cfg, clock)


def case_setups(names, prefixes=None):
    """``(name, case, setup)`` for each bench case named (at each of ``prefixes`` instead
    of its own prefix length, if given), one GPU setup alive at a time."""
    import torch

    from specattn.bench import cases as C
    from specattn.bench.harness import build_setup

    by_name = {c.name: c for c in C.STANDARD_CASES + C.EXTRA_CASES}
    runs = [(name, by_name[name]) for name in names]
    if prefixes:
        runs = [(f"{name} L {n}", dataclasses.replace(case, prefix=n))
                for name, case in runs for n in prefixes]
    for name, case in runs:
        setup = build_setup(case, "cuda")
        yield name, case, setup
        del setup
        torch.cuda.empty_cache()


def _diag_row(name, case, setup, cfg, clock) -> None:
    """One table row: ``case`` under ``cfg``, timed in every mode."""
    from specattn.backends.triton import TritonDecode, cute_mla, gluon_mla
    from specattn.bench.harness import Variant, time_step

    kernel = cute_mla if cfg.cute else gluon_mla  # whose attention() takes diag
    real = kernel.attention
    times = {}
    for mode, diag in MODES.items():
        if mode not in (CUTE_MODES if cfg.cute else GLUON_MODES):
            continue
        kernel.attention = functools.partial(real, diag=diag)
        try:
            variant = Variant(mode, "triton", "option", "triton",
                              lambda s: TritonDecode(s.runner, case.topk, case.steps,
                                                     config=cfg), graphs=True)
            times[mode] = time_step(variant, setup, clock)[0] * 1e3
        finally:
            kernel.attention = real
    plan = TritonDecode(setup.runner, case.topk, case.steps, config=cfg)._make_plan(case.batch)
    tiles = -(-max(setup.lengths) // plan["num_splits"] // cfg.block_n) + 1
    print(f"| {name} | {cfg.label()} | {tiles} | " +
          " | ".join(f"{times[m]:.1f} us" if m in times else "-" for m in MODES) +
          f" | {times['full'] / tiles:.2f} us |", flush=True)


if __name__ == "__main__":
    main()
