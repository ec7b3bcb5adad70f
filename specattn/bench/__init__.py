"""``specattn bench``: the side-by-side benchmark of every backend that runs here (issue #8).

    specattn bench [--case NAME ...] [--backend NAME ...] [--steps] [--extend]
                   [--batch B --prefix L --topk K --num-steps S --page-size P --mla]
                   [--kv-cache-dtype fp8_e4m3]
                   [--option BACKEND:KEY=VALUE ...] [--parts] [--check-only]
                   [--dtype bf16] [--out DIR] [--quick]

Per case (``cases.py``; ``--case`` also takes the sets ``standard``, ``serving``, ``fp8``,
``cpu``): the copy-bandwidth floor, on a GPU the read floor (``floors.py``), then every
variant (each backend in its shared-prefix and ``per-branch`` modes where it has both,
``--option`` variants built with constructor keywords (``options.py``), raw-library per-lane
baselines, and on FP8 cases each backend's ``dequant`` baseline (``baselines.py``)) checked
against ``torch_ref`` and timed, with the engine round where the backend has CUDA graphs
(``harness.py``); ``--parts`` adds where each step's time goes (``parts.py``); a table,
CSV, PNG charts and the versions go to ``--out``, by default
``~/.cache/specattn/bench/<date>-<gpu or cpu>/`` (``report.py``). On a CPU the small cases
run for ``torch_ref`` and ``intel_amx`` (``torch.utils.benchmark`` medians with their
spread, tokens/s, ratio to ``torch_ref``). The protocol: ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
from typing import Optional, Sequence

from .._argparse import CommandParser

__all__ = ["cli_main", "build_parser"]

log = logging.getLogger("specattn.bench")


def build_parser() -> argparse.ArgumentParser:
    from .cases import KV_CACHE_DTYPES

    p = CommandParser(
        prog="specattn bench",
        description="Time every draft-attention backend that runs here against the "
        "copy-bandwidth floor, the read floor (GPU) and the per-branch baselines. The protocol, the cases and how "
        "to read the table: docs/performance.md in the repository.")
    p.add_argument("--case", metavar="NAME", nargs="+", action="extend",
                   help="cases to run, by name or set: 'standard', 'serving' (batch 1-8, "
                   "long contexts), 'fp8' (FP8 pools, with the dequant baseline), 'cpu' "
                   "(default: standard, serving and fp8 on a GPU, cpu on a CPU; "
                   "--list-cases shows them)")
    p.add_argument("--backend", metavar="NAME", nargs="+", action="extend",
                   help="backends to run (names or aliases; flashinfer-raw, fa4-raw, "
                   "sdpa-raw or 'raw' for the raw baselines); default: all that run here")
    p.add_argument("--option", metavar="BACKEND:KEY=VALUE", nargs="+", action="extend",
                   help="one more variant of BACKEND built with these constructor keywords "
                   "(comma-separated; e.g. triton:plan=dot-mla, fa4:split_prefix=2, "
                   "intel_amx:cache_prefix=False); docs/performance.md lists them")
    p.add_argument("--parts", action="store_true", help="also where each step's time goes: "
                   "the metadata call's host time and the kernels (CPU: ops) of one step, "
                   "from torch.profiler (parts.csv, and a table)")
    p.add_argument("--check-only", action="store_true", help="check every variant against "
                   "torch_ref and time nothing (no floor, sweep or charts): e.g. under "
                   "compute-sanitizer or ncu")
    p.add_argument("--steps", action="store_true", help="draft decode (multi-step) cases only")
    p.add_argument("--extend", action="store_true", help="draft extend cases only")
    shape = p.add_argument_group("custom shape (replaces the standard cases unless --case "
                                 "is given)")
    shape.add_argument("--batch", type=int, help="requests B (default 4)")
    shape.add_argument("--prefix", type=int, help="prefix length L (default 1024)")
    shape.add_argument("--topk", type=int, help="lanes per request K (default 4)")
    shape.add_argument("--num-steps", type=int, help="draft steps S (default 5)")
    shape.add_argument("--page-size", type=int, help="page size P (default 1)")
    shape.add_argument("--mla", action="store_true", help="MLA shape (16 heads, rank 512, "
                       "rope 64) instead of GQA (32/8 heads, head dim 128)")
    shape.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="pools of the shape: 'auto' (the --dtype) or FP8 (k_scale 0.45, "
                       "v_scale 0.3, as the fp8 cases; case custom-fp8)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="model dtype of every case: queries, keys, values and the pools "
                   "unless FP8 (default: bf16)")
    p.add_argument("--out", metavar="DIR", help="results folder (default: "
                   f"{_default_root()}/<date>-<gpu or cpu>, or its first free -2, -3... "
                   "when it already holds a run and --append is not given; "
                   "$XDG_CACHE_HOME moves it); a folder given here that holds a run needs "
                   "--append")
    p.add_argument("--append", action="store_true", help="merge into the CSVs already in "
                   "--out (rows of the cases run now are replaced): split a long run into "
                   "several commands, on the machine and libraries of the folder's run")
    p.add_argument("--quick", action="store_true", help="uniform lengths only, shorter "
                   "timing, fewer sweep points (CPU default cases: prefixes / 4)")
    p.add_argument("--no-sweep", action="store_true", help="skip the prefix-length sweep "
                   "(it follows the default cases only, not --case, a custom shape or "
                   "--extend)")
    p.add_argument("--only-sweep", action="store_true", help="run the prefix-length sweep "
                   "only (with --append: add it to an earlier run's folder)")
    p.add_argument("--no-round", action="store_true", help="skip whole-round timing")
    p.add_argument("--no-raw", action="store_true", help="skip raw-library baselines")
    p.add_argument("--no-sglang", action="store_true", help="skip the sglang/<name> rows "
                   "(GPU, when SGLang is importable: SGLang's own draft round with its backend "
                   "and with specattn's; docs/sglang.md)")
    p.add_argument("--round-layers", type=int, default=4, help="layers per timed round")
    p.add_argument("--reps", type=int, help="CPU: timed runs per measurement; the "
                   "median is reported with the spread (default: 7; --quick: 5)")
    p.add_argument("--threads", type=int, help="CPU: torch threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="CPU: wall time, or this process's CPU time (steadier on a shared "
                   "machine, with --threads 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the inputs and of the ragged lengths (default: 0)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where to run: auto is CUDA when torch sees a GPU, else the CPU "
                   "(default: auto)")
    p.add_argument("--list-cases", action="store_true", help="print the cases and exit")
    return p


def _select_cases(args, on_gpu: bool):
    from . import cases as C

    custom = any(getattr(args, f) is not None for f in
                 ("batch", "prefix", "topk", "num_steps", "page_size")) or args.mla \
        or args.kv_cache_dtype != "auto"
    dtype = C.DTYPES[args.dtype]
    chosen = []
    if args.case:
        chosen = C.find_cases(args.case)
    elif not custom:
        chosen = list(C.default_cases(on_gpu))
        if args.quick and not on_gpu:
            chosen = [C.scaled(c, 4) for c in chosen]
    if custom:
        kw = {k: getattr(args, a) for k, a in (("batch", "batch"), ("prefix", "prefix"),
                                              ("topk", "topk"), ("steps", "num_steps"),
                                              ("page_size", "page_size"))
              if getattr(args, a) is not None}
        kw.update(mla=args.mla, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype)
        if kw.get("steps") != 1:  # a round of S 1 runs no decode step: its extend only
            chosen.append(C.custom_case(**kw))
        if not (args.steps and not args.extend):  # (--steps: its prefix needs no extend)
            chosen.append(C.custom_case(extend=True, **kw))
    if args.steps != args.extend:  # exactly one of them: that kind only
        kind = "decode" if args.steps else "extend"
        chosen = [c for c in chosen if c.kind == kind]
    chosen = [c.with_(dtype=dtype) for c in chosen]
    lengths = (False,) if args.quick else (False, True)
    # At B 1 a ragged run is the uniform one at another length: uniform only.
    return [c.with_(ragged=r) for c in chosen for r in lengths if c.has_ragged or not r], custom


def _check_backend_names(names) -> None:
    """Every ``--backend`` name is a registered backend of either kind, a raw baseline or
    ``raw``: an ``InvalidInputError`` naming the flag otherwise (a typo had been a "not
    run" row per case and exit status 0)."""
    from ..selection import check_backend_name
    from .baselines import RAW_BASELINES

    raw = ("raw", *(key for key, *_ in RAW_BASELINES))
    for name in names or ():
        check_backend_name("--backend", name, "a backend name, a raw baseline or 'raw'",
                           also=raw)


def _check_counts(args) -> None:
    """``--reps``, ``--round-layers`` and ``--threads`` (when given) are counts of at least one:
    an ``InvalidInputError`` naming the flag otherwise (a round of no layers would be timed
    as its metadata call alone, torch refuses a thread count below one); ``--only-sweep``
    does not take ``--check-only`` (that run would do nothing); ``--steps`` (decode cases
    only) does not take ``--num-steps 1`` (a round of one draft step runs no decode step)."""
    from ..errors import InvalidInputError

    for flag, value in (("--reps", args.reps), ("--round-layers", args.round_layers),
                        ("--threads", args.threads)):
        if value is not None and value < 1:
            raise InvalidInputError(flag, "an int >= 1", value)
    if not 0 <= args.seed < 2 ** 63:  # torch's generators take a 64-bit seed
        raise InvalidInputError("--seed", "an int in [0, 2**63)", args.seed)
    if args.only_sweep and args.check_only:  # the sweep is timed, never only checked
        raise InvalidInputError("--only-sweep", "no --check-only (the sweep has nothing to "
                                "check without timing it)", "--check-only")
    if args.steps and not args.extend and args.num_steps == 1:
        raise InvalidInputError("--num-steps", "2 or more with --steps (a round of one draft "
                                "step runs no decode step)", 1)


def _default_root() -> str:
    """Where results go without ``--out``: a cache folder of the user, never the directory
    the command happens to run in."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                               ".cache")
    return os.path.join(cache, "specattn", "bench")


def _out_dir(args, info) -> str:
    """``--out``, else ``<cache>/specattn/bench/<date>-<device>``. Without ``--append`` a
    default folder that already holds a run is kept: the new run goes to the first free
    ``...-2``, ``...-3``."""
    from .report import device_slug

    if args.out:
        return args.out
    base = os.path.join(_default_root(),
                        f"{datetime.date.today().isoformat()}-{device_slug(info)}")
    out, n = base, 1
    while not args.append and os.path.exists(os.path.join(out, "bench.csv")):
        n += 1
        out = f"{base}-{n}"
    return out


def _earlier_steps(rows) -> str:
    """'' or ``"; CASE: step N, ..."``: the decode cases of ``rows`` whose ``S`` is below 4,
    timed at an earlier step (``cases.timed_step``: the last the round runs)."""
    from .cases import TIMED_STEP, timed_step

    steps: dict[str, int] = {}
    for r in rows:
        if r.get("kind") == "decode" and r.get("steps") not in (None, ""):
            step = timed_step(int(r["steps"]))
            if step != TIMED_STEP:
                steps.setdefault(r["case"], step)
    return "".join(f"; {case}: step {n}" for case, n in steps.items())


def _header(info, bandwidth: Optional[float], clock_name: str, on_gpu: bool, rows) -> str:
    from . import cases as C

    where = (f"{info['gpu']}, driver {info.get('driver')}, CUDA {info.get('cuda')}" if on_gpu
             else f"{info['cpu']} ({info.get('cpu_capability')}), "
             f"{info['torch_threads']} torch threads")
    libs = ", ".join(f"{k} {info[k]}" for k in ("torch", "triton", "flashinfer", "flash-attn")
                     if info.get(k))
    round_layers = "/".join(sorted({str(r["round_layers"]) for r in rows
                                    if r.get("round_layers")}))
    step = (f"one forward of one layer at step {C.TIMED_STEP} ({C.TIMED_STEP + 1} history "
            f"slots{_earlier_steps(rows)}; KV write included) or one draft extend")
    lines = [
        f"# specattn bench, {datetime.date.today().isoformat()}",
        "",
        f"{where}; {libs}; "
        + (f"copy bandwidth {bandwidth / 1e9:,.1f} GB/s (same process)." if bandwidth else
           "--check-only: every variant checked against torch_ref, nothing timed."),
        "",
        f"`time us`: {step}, {clock_name}"
        + (", layers rotated past L2 in one CUDA graph" if on_gpu else "")
        + ". `x copy floor`: over the copy-bandwidth floor (every prefix once + every lane's "
        "history, over the copy bandwidth)."
        + (" `x read floor`: over the read floor (`read-floor`: one launch that only reads "
           "those bytes through the case's slots, timed as a step)." if on_gpu else "")
        + " `x vs per-branch`: speedup over the backend's own per-branch mode, else "
        "the raw per-lane baseline. `round us`: the round an engine feels, device time per "
        "round of [replay metadata call; graph replay of one layer's S-1 steps (extend: one "
        "call)] back to back; `host us`: the replay metadata call's host time"
        + ("" if on_gpu else " (n/a: no CUDA graphs on a CPU)")
        + ". `round eager us`" + (" / `round graph us`" if on_gpu else "")
        + ": metadata + S-1 steps (extend: one call) x "
        + (f"{round_layers} layers" + ("" if on_gpu else f" ({clock_name}, eager)")
           if round_layers else "the round's layers (no round timed in this run)")
        + ". `check`: max error against torch_ref on sampled requests.",
    ]
    return "\n".join(lines)


def _merge(out: str, rows: list, sweep_rows: list,
           parts: Sequence = ()) -> tuple[list, list, list]:
    """Earlier rows of ``out`` whose case (or sweep point) did not run now, then the new
    rows: of the table, the sweep and the step parts."""
    from .report import read_csv

    def older(name, key, new):
        path = os.path.join(out, name)
        if not os.path.exists(path):
            return []
        seen = {key(r) for r in new}
        return [r for r in read_csv(path) if key(r) not in seen]

    def case_key(r):
        return r["case"], r["lengths"]

    return (older("bench.csv", case_key, rows) + rows,
            older("sweep.csv", lambda r: (str(r["topk"]), str(r["prefix"])), sweep_rows)
            + sweep_rows,
            older("parts.csv", case_key, rows) + list(parts))


FP8_NOTE = ("Cases with FP8 pools (`kv_dtype`, `k_scale`, `v_scale` in bench.csv) count one "
            "byte an element in both floors. `x vs dequant`: the time of the backend's "
            "`<backend>/dequant` row (the layer's whole pool dequantized to bf16, then the "
            "same backend's bf16 step, timed together as one step) over the row's. `x vs "
            "bf16`: the same variant's time on the case's bf16 twin (`twin_case`, same shape "
            "and lengths) over the row's. Targets (docs/performance.md): the fastest FP8 step "
            "within 1.2x of its read floor at B 32, at most 0.6x its bf16 step (`x vs bf16` "
            "1.67 or more), 3x or more faster than dequant.")


PARTS_NOTE = ("`--parts`: per variant, the host time of the metadata call(s), and what one "
              "eager step of one layer runs, from torch.profiler over the rotating layers: "
              "per kernel its device time and launches per step (CPU: each torch op's self "
              "time). The parts of an eager step; `time us` above is a graph replay where "
              "the backend supports graphs.")


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``specattn bench``; returns the exit status (0: every variant passed its
    check, 1: some failed, 2: bad arguments)."""
    import torch

    from ..errors import InvalidInputError
    from ..platforms import current_platform
    from . import cases as C
    from . import report, run
    from .._console import ItemProgress
    from .harness import CudaClock, WallClock, copy_bandwidth

    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    on_gpu = (args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()))
    if on_gpu and not torch.cuda.is_available():
        print("specattn bench: error: --device cuda, but torch sees no CUDA device",
              file=sys.stderr)
        return 2
    from .options import parse_options

    try:
        _check_counts(args)
        _check_backend_names(args.backend)
        cases, custom = _select_cases(args, on_gpu)
        options = parse_options(args.option or [])
    except InvalidInputError as exc:
        print(f"specattn bench: error: {exc}", file=sys.stderr)
        return 2
    if args.list_cases:
        sets = {c.name: name for name, group in C.CASE_SETS.items() for c in group}
        for c in C.all_cases():
            where = f" [{sets[c.name]}]" if c.name in sets else " [named only]"
            print(c.describe() + where + ("" if c.has_ragged else " (uniform lengths only)"))
        return 0
    if not cases:
        print("specattn bench: error: no case left to run (check --case, --steps, --extend)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda" if on_gpu else "cpu")
    platform = current_platform()
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = args.reps or (5 if args.quick else 7)  # a --reps given is kept with --quick
    clock = CudaClock(rep_ms=100 if args.quick else 200) if on_gpu else WallClock(
        reps, cpu_time=args.clock == "cpu")
    plans = [] if args.only_sweep else run.plan_cases(cases, platform, args.backend,
                                                      raw=not args.no_raw, on_gpu=on_gpu,
                                                      options=options)
    no_sweep = args.no_sweep or custom or args.case or (args.extend and not args.steps)
    sweep = [] if (no_sweep and not args.only_sweep) or args.check_only \
        else run.plan_cases(C.sweep_cases(on_gpu, args.quick, C.DTYPES[args.dtype]),
                            platform, args.backend, raw=not args.no_raw, on_gpu=on_gpu,
                            options=options)
    read_floor = on_gpu and not args.check_only  # Triton kernels on the case's pools
    total = sum(len(p.variants) for p in plans + sweep) + (len(plans) if read_floor else 0)
    info = report.versions(device)
    out = _out_dir(args, info)
    try:  # before anything is measured
        os.makedirs(out, exist_ok=True)
        if not os.access(out, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
        _check_folder(args, out, info, cases)
    except OSError as exc:
        bad = InvalidInputError("--out", "a folder it can create or write to",
                                f"{out!r} ({exc.strerror})")
        print(f"specattn bench: error: {bad}", file=sys.stderr)
        return 2
    except InvalidInputError as exc:
        print(f"specattn bench: error: {exc}", file=sys.stderr)
        return 2
    print(f"specattn bench: {len(plans)} cases, {len(sweep)} sweep points, {total} runs on "
          f"{device.type}; results will be written to {out}/", file=sys.stderr)
    bandwidth = None if args.check_only else copy_bandwidth(device, clock)
    # --append --check-only: the folder's timed rows keep their header and versions.json.
    recorded = bandwidth or (_folder_bandwidth(out) if args.append else None)

    def checkpoint(rows_so_far: list) -> None:
        """bench.csv and table.md (the table alone) after each case, final or not."""
        done = [dict(r) for r in rows_so_far]
        if args.append:
            done = _merge(out, done, [])[0]
        report.add_ratios(done)
        report.write_csv(done, os.path.join(out, "bench.csv"))
        with open(os.path.join(out, "table.md"), "w") as f:
            f.write(_header(info, recorded, clock.name, on_gpu, done) + "\n\n"
                    + report.render_table(done, cpu=not on_gpu) + "\n")

    with ItemProgress(total, "bench") as progress:
        rows = run.run_cases(plans, device, clock, bandwidth, progress, seed=args.seed,
                             rounds=not (args.no_round or args.check_only),
                             round_layers=args.round_layers, timed=not args.check_only,
                             parts=args.parts, read_floor=read_floor, on_case=checkpoint)
        sweep_rows = run.run_sweep(sweep, device, clock, bandwidth, progress, seed=args.seed)
    if on_gpu and not (args.check_only or args.only_sweep or args.no_sglang):
        from .sglang_rows import merge_rows, sglang_rows

        rows = merge_rows(rows, sglang_rows([p.case for p in plans], device, seed=args.seed,
                                            backends=args.backend))
    rows, sweep_rows = _write_results(args, argv, out, info, recorded, clock.name, on_gpu,
                                      rows, sweep_rows)
    failed = [r for r in rows + sweep_rows if r.get("status") == "failed"]
    return 1 if failed else 0


# What versions.json says a run was measured on: rows of one folder share it.
RUN_IDENTITY = ("gpu", "cpu", "torch", "triton", "flashinfer", "flash-attn")


# The columns that make a case's shape: a case name of the folder must keep it.
SHAPE_COLUMNS = ("kind", "model", "batch", "prefix", "topk", "steps", "page_size", "dtype",
                 "kv_dtype")


def _check_folder(args, out: str, info: dict, cases: Sequence = ()) -> None:
    """``out`` may take this run: without ``--append`` it holds no run (its sweep, parts and
    charts would stay beside the new files); with it, its run was measured on this machine
    with these libraries (the header and versions.json describe every row), and a case it
    holds under a name of this run's cases has the same shape (every custom shape is
    ``custom``; ``--quick`` scales the CPU's default prefixes): else its rows would be
    replaced by another shape's."""
    from ..errors import InvalidInputError
    from .report import read_csv
    from .run import case_fields

    held = os.path.exists(os.path.join(out, "bench.csv"))
    if held and not args.append:
        raise InvalidInputError("--out", "a folder without a run, or --append to merge into "
                                "it", f"{out!r}, which holds one (bench.csv)")
    if not held:  # (a fresh folder, or --append into one that holds nothing yet)
        return

    def shape(row) -> tuple:
        return tuple(str(row[k]) for k in SHAPE_COLUMNS)

    there = {r["case"]: shape(r) for r in read_csv(os.path.join(out, "bench.csv"))}
    for case in cases:
        here = shape({k: ("" if v is None else v) for k, v in case_fields(case, []).items()})
        if there.get(case.name, here) != here:
            raise InvalidInputError("--append", f"case {case.name!r} of the folder's shape "
                                    f"({', '.join(there[case.name])}), or another --out",
                                    ", ".join(here))
    try:
        with open(os.path.join(out, "versions.json")) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return
    differ = [f"{k} {old.get(k)!r} there, {info.get(k)!r} here" for k in RUN_IDENTITY
              if old.get(k) != info.get(k)]
    if differ:
        raise InvalidInputError("--append", "a folder of a run on this machine, with these "
                                "libraries (one folder per run)", "; ".join(differ))


def _folder_bandwidth(out: str) -> Optional[float]:
    """The copy bandwidth (bytes/s) an earlier run recorded in ``out/versions.json``, if any:
    ``--append --check-only`` into a timed folder keeps it (its header had said "nothing
    timed" over the folder's timed rows, and versions.json lost the bandwidth)."""
    try:
        with open(os.path.join(out, "versions.json")) as f:
            gbs = json.load(f).get("copy_bandwidth_gbs")
    except (OSError, ValueError):
        return None
    return float(gbs) * 1e9 if isinstance(gbs, (int, float)) and gbs > 0 else None


def _write_results(args, argv: Optional[Sequence[str]], out: str, info: dict,
                   bandwidth: Optional[float], clock_name: str, on_gpu: bool, rows: list,
                   sweep_rows: list) -> tuple[list, list]:
    """The run's files in ``out`` (``bench.csv``, ``sweep.csv``, ``parts.csv``,
    ``versions.json``, PNGs, ``table.md`` with its notes; ``--append``: merged with the
    folder's earlier rows) and its table on the console; returns the rows and sweep rows
    written."""
    from .._console import make_console
    from . import report

    parts = report.parts_rows(rows)
    if args.append:
        rows, sweep_rows, parts = _merge(out, rows, sweep_rows, parts)
    report.add_ratios(rows)
    report.write_csv(rows, os.path.join(out, "bench.csv"))
    if sweep_rows:
        report.write_csv(sweep_rows, os.path.join(out, "sweep.csv"), report.SWEEP_COLUMNS)
    if parts:
        report.write_csv(parts, os.path.join(out, "parts.csv"), report.PARTS_COLUMNS)
    info["copy_bandwidth_gbs"] = round(bandwidth / 1e9, 1) if bandwidth else None
    info["date"] = datetime.date.today().isoformat()
    info["command"] = "specattn bench " + " ".join(argv if argv is not None else sys.argv[1:])
    old_info = os.path.join(out, "versions.json")
    if args.append and os.path.exists(old_info):
        with open(old_info) as f:
            info["command"] = json.load(f).get("command", "?") + " && " + info["command"]
    report.write_versions(info, os.path.join(out, "versions.json"))
    title = info["gpu"] or "CPU"
    pngs, png_note = ([], "") if args.check_only else report.write_pngs(rows, sweep_rows, out,
                                                                        title)
    header = _header(info, bandwidth, clock_name, on_gpu, rows)
    notes = _notes(rows, sweep_rows, parts, pngs, png_note)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(header + "\n\n" + report.render_table(rows, cpu=not on_gpu) + "\n" + notes)
    console = make_console()
    console.print(header + "\n")
    report.print_table(rows, console, cpu=not on_gpu)
    console.print(notes)
    print(f"wrote {out}/ (bench.csv, table.md, versions.json"
          + (", sweep.csv" if sweep_rows else "") + (", parts.csv" if parts else "")
          + (f", {len(pngs)} PNG" if pngs else "") + ")")
    return rows, sweep_rows


def _notes(rows: list, sweep_rows: list, parts: list, pngs: list, png_note: str) -> str:
    """The markdown under ``table.md``'s table: compute rates, FP8 pools, step parts, the
    sweep's files, chart and noise warnings (each where the run has them)."""
    from . import report

    notes = ""
    rates = report.rate_lines(rows)
    if rates:
        notes += "\n## Compute rate (compute-bound cases)\n\n" + "\n".join(rates) + "\n"
    if report.has_fp8(rows):
        notes += (f"\n## FP8 pools\n\n{FP8_NOTE}\n\n" + "\n".join(report.fp8_lines(rows))
                  + "\n")
    if parts:
        notes += f"\n## Step parts\n\n{PARTS_NOTE}\n\n{report.render_parts(parts)}\n"
    if sweep_rows:
        notes += "\nPrefix-length sweep (uniform lengths, one step): `sweep.csv`"
        notes += ", `prefix-sweep.png`.\n" if pngs else ".\n"
    if png_note:
        notes += f"\n{png_note}.\n"
    noise = report.noise_warning(rows + sweep_rows)
    if noise:
        notes += f"\n{noise}.\n"
    return notes

