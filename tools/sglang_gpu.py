"""SGLang's own EAGLE draft loop with SGLang's backends and with specattn's through the plugin.

    python tools/sglang_gpu.py --out DIR [--preset quick] [--b32] [--quick] [--budget-s S]
                               [--no-timing] [--device cuda|cpu] [--dtype bf16|fp32] [--tiny]

Correctness (MHA and MLA; topk 1/4/8; page 1/16, MLA 1/64; ragged lengths; replays padded
by one), per SGLang name ``triton`` / ``flashinfer``: SGLang's backend eager and through
``EAGLEDraftCudaGraphRunner``; specattn through the plugin, ``auto`` against SGLang's
``triton``, ``path`` against a float32 tree reference; a stock backend of
``draft_round.UPSTREAM`` against a float32 model of what it reads (``upstream``), specattn
then against SGLang's ``triton``. Timing: the graph runner's ``execute`` and each step's
attention, B 1/8/32 x L 4096/32768 x K 1/4/8 (``--preset quick``: B 1/8, K 1/4, 240 s;
``--b32`` adds B 32). Most important first until ``--budget-s``; the tables in ``--out`` are
rewritten after every case; exit 1 if one failed. docs/sglang.md; tools/gpu.sh sglang.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter, namedtuple
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from specattn.bench.harness import short_error  # noqa: E402

TOLERANCE = {"bf16": 2e-2, "fp32": 1e-4}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MHA_SHAPE, MLA_SHAPE = (32, 8, 128), (16, 512, 64)  # as specattn bench (docs/performance.md)
TINY = {"mha": (4, 2, 16), "mla": (4, 256, 32)}  # SGLang's Triton MLA kernel splits 288 in 256+32
PAGES = {"mha": (1, 16), "mla": (1, 64)}
CORRECT_LENGTHS, TINY_LENGTHS = (77, 513, 1500, 2900), (5, 11, 2)
CORRECT_STEPS, TIMING_STEPS = 3, 5
TIMING_GRID = ((8, 4096), (32, 4096), (1, 32768), (8, 32768), (1, 4096), (32, 32768))
QUICK_GRID, B32 = ((8, 4096), (1, 32768), (8, 32768), (1, 4096)), ((32, 4096), (32, 32768))
BACKENDS = ("triton", "flashinfer")
# share: the part of the budget before which the correctness cases start
PRESETS = {"quick": dict(budget_s=240.0, share=0.7, grid=QUICK_GRID, topks=[4, 1], reps=15)}

CSV_COLUMNS = ("model", "backend", "served_by", "mode", "topk", "page", "run", "against",
               "status", "tokens", "attn_err", "kv_err", "logit_err", "secs", "note")
TIMING_COLUMNS = ("model", "backend", "batch", "prefix", "topk", "steps", "page",
                  "stock_round_us", "specattn_round_us", "round_speedup",
                  "stock_round_event_us", "specattn_round_event_us",
                  "stock_step_us", "specattn_step_us", "step_speedup", "served_by", "check",
                  "secs", "note")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="sglang_gpu.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--preset", choices=tuple(PRESETS), help="quick: timing B 1/8 x L "
                   "4096/32768 x K 1/4, --budget-s 240 (correctness in the first 70%%)")
    p.add_argument("--b32", action="store_true", help="also time B 32 x L 4096/32768, last")
    p.add_argument("--quick", action="store_true", help="the minimal correctness subset "
                   "(triton; MHA and MLA; topk 1 and 4; page 1 and 16/64), no timing")
    p.add_argument("--budget-s", type=float, help="start no case after (default 300)")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and lengths (CPU tests)")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--models", nargs="+", default=["mha", "mla"], choices=("mha", "mla"))
    p.add_argument("--case", action="append", metavar="MODEL:TOPK:PAGE",
                   help="only these correctness cases (repeatable), for each --backends")
    p.add_argument("--timing", action="append", metavar="BxL", help="only these points")
    p.add_argument("--timing-topks", nargs="+", type=int)
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="run the graph runner (default: on cuda; on a CPU an eager stand-in)")
    p.add_argument("--torch-compile", action="store_true", help="leave TorchDynamo on "
                   "(default off: SGLang's later top-k selection runs eagerly, both sides)")
    p.add_argument("--perturb", action="store_true", help="also compare a wrong copy of each "
                   "specattn eager output (rows '<mode> perturbed' must fail; not counted)")
    args = p.parse_args(argv)
    preset = PRESETS.get(args.preset, {})
    args.no_timing = args.no_timing or args.quick
    args.budget_s = args.budget_s or preset.get("budget_s", 300.0)
    args.share = 1.0 if args.no_timing else preset.get("share", 0.5)
    args.reps = 1 if args.tiny else preset.get("reps", 30)  # tiny: checked, not timed
    args.timing_topks = args.timing_topks or preset.get("topks", [4, 1, 8])
    args.graphs = args.device == "cuda" if args.graphs is None else args.graphs
    try:
        args.case = [(m, int(k), int(pg)) for m, k, pg in (c.split(":") for c in args.case or ())]
        args.timing = [tuple(int(x) for x in t.lower().split("x")) for t in args.timing or ()]
    except ValueError:
        p.error("--case MODEL:TOPK:PAGE (e.g. mha:4:16), --timing BxL (e.g. 8x4096)")
    if any(m not in ("mha", "mla") for m, _, _ in args.case):
        p.error("--case: the model is mha or mla")
    grid = list(args.timing or preset.get("grid", TIMING_GRID))
    args.timing = grid + [pt for pt in B32 if args.b32 and pt not in grid]
    return args


Corr = namedtuple("Corr", "model backend topk page")


def correctness_cases(args) -> list[Corr]:
    """Most important first: the quick subset, then the rest; a case's backends one after
    the other (they share its fixture)."""
    if args.case:
        return [Corr(m, b, k, pg) for m, k, pg in args.case for b in args.backends]
    wide = [(m, 2, 4) if args.tiny else (m, 4, PAGES[m][1]) for m in args.models]
    quick = [(m, 1, 1) for m in args.models] + wide
    if args.quick:
        return [Corr(m, "triton", k, p) for m, k, p in quick]
    rest = [(m, k, p) for k in ((2, 1) if args.tiny else (8, 4, 1)) for m in args.models
            for p in ((1, 4) if args.tiny else PAGES[m]) if (m, k, p) not in quick]
    return [Corr(m, b, k, p) for m, k, p in quick + rest for b in args.backends]


@dataclass
class Rows:
    correct: list = field(default_factory=list)
    timing: list = field(default_factory=list)
    skipped: list = field(default_factory=list)   # what the budget left out
    stubs: Counter = field(default_factory=Counter)  # stand-ins called
    shims: Counter = field(default_factory=Counter)  # pure-Python shims called
    flush: Callable[[], None] = lambda: None  # rewrites the tables (after every case)


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _shape(args, model: str) -> tuple:
    return TINY[model] if args.tiny else (MLA_SHAPE if model == "mla" else MHA_SHAPE)


# --- correctness ------------------------------------------------------------------------------

def run_correctness(args, R, rows: Rows, deadline: float) -> None:
    tol = TOLERANCE[args.dtype]
    fixtures: dict = {}
    for case in correctness_cases(args):
        if time.monotonic() > deadline:
            rows.skipped.append("correctness {} {} topk {} page {}".format(*case))
            continue
        key = (case.model, case.page)
        start = time.monotonic()
        try:
            if key not in fixtures:
                fixtures.clear()
                _free(args.device)
                lengths = TINY_LENGTHS if args.tiny else CORRECT_LENGTHS
                fixtures[key] = R.build_fixture(
                    case.model, lengths, shape=_shape(args, case.model), page_size=case.page,
                    steps=CORRECT_STEPS, topk_max=max(2 if args.tiny else 8, case.topk),
                    graph_bs=len(lengths) + 1, hidden=32 if args.tiny else 256, vocab=50,
                    dtype=DTYPES[args.dtype], device=args.device)
            _correct_case(args, R, rows, fixtures[key], case, tol, start)
        except Exception as exc:  # one case's failure is a row; the rest still run
            traceback.print_exc()
            rows.correct.append(_row(case, "", "", "", "", "error", note=short_error(exc)))
        _free(args.device)
        rows.flush()


def _row(case: Corr, served: str, mode: str, run: str, against: str, status: str,
         verdict=None, note: str = "") -> dict:
    """One correctness row (``against`` a float32 reference: the attention error alone)."""
    row = {"model": case.model, "backend": case.backend, "served_by": served, "mode": mode,
           "topk": case.topk, "page": case.page, "run": run, "against": against,
           "status": status, "note": note}
    if verdict is not None:
        row["attn_err"] = f"{verdict.out_err:.2e}"
        if not against.startswith("float32"):
            ties = f" (+{verdict.near_ties} near-tie)" if verdict.near_ties else ""
            row.update(tokens=f"{verdict.tokens_equal}/{verdict.requests}{ties}",
                       kv_err=f"{verdict.kv_err:.2e}", logit_err=f"{verdict.logit_err:.2e}")
        if not verdict.ok:
            row["note"] = "; ".join(verdict.problems[:3])
    return row


def _correct_case(args, R, rows: Rows, fx, case: Corr, tol: float, start: float) -> None:
    from specattn.integrations.sglang import stubs

    rc = R.RoundCase(case.model, fx.lengths, case.topk, CORRECT_STEPS, case.page, fx.shape,
                     fx.hidden, fx.vocab, capture_bs=fx.graph_bs)
    settings = fx.use(rc, case.backend)
    model, inputs, saved = R.DraftModel(fx), fx.inputs(), fx.snapshot()
    clock = [start]

    def eager(env):
        container = R.make_container(fx, env)
        try:
            return container, R.run_eager(fx, container, settings, model, inputs,
                                          keep_pools=True)
        finally:
            fx.restore(saved)

    def graph(env):
        container = R.make_container(fx, env)
        try:
            runner = R.capture_graph_recorded(fx, container, settings, model)
            fx.restore(saved)
            return R.run_graph(fx, runner, model, inputs, container)
        finally:
            fx.restore(saved)

    def add(served, mode, run, against, verdict=None, status=None, note=""):
        called = stubs.calls()
        rows.stubs.update(called)
        rows.shims.update(stubs.shim_calls())
        stubs.reset_counts()
        extra = ("stand-ins called: " + ", ".join(f"{k} x{v}" for k, v in called.items())
                 if called else "")
        if status is None:
            status = "ok" if verdict.ok and not extra else "FAIL"
        row = _row(case, served, mode, run, against, status, verdict, note)
        row["note"] = "; ".join(x for x in (row["note"], extra) if x)
        now = time.monotonic()
        row["secs"], clock[0] = f"{now - clock[0]:.1f}", now
        rows.correct.append(row)
        print(f"[correctness] {case.model} {case.backend} K{case.topk} P{case.page} {mode} "
              f"{run} vs {against}: {status} {verdict.summary if verdict else note}", flush=True)

    stubs.reset_counts()
    ref_name, ref_graph, stock_ok = case.backend, None, False
    try:
        stock, ref = eager(None)
    except Exception as exc:  # e.g. SGLang's FlashInfer MLA: topk 1 only
        add(f"SGLang {case.backend}", "stock", "eager", "", status="unsupported",
            note=short_error(exc))
    else:
        label = f"SGLang {type(stock).__name__}"
        lane = R.tree_verdict(fx, ref, "lane", tol)
        up = None if lane.ok else R.upstream_check(fx, ref, stock, "eager", tol)
        stock_ok = up is None or not up[2].ok
        if stock_ok:
            add(label, "stock", "eager", "float32 lane reference", lane)
        else:  # a known upstream difference: the record matches the model of what it reads
            add(label, "stock", "eager", f"float32 {up[0]} reference", up[2], "upstream",
                f"{up[1]}; the lane reference is {lane.out_err:.2g} off")
        if args.graphs:
            got = graph(None)
            gup = None if stock_ok else R.upstream_check(fx, got, stock, "graph", tol)
            if gup is None:
                ref_graph = got if stock_ok else None
                add(label, "stock", "graph", "SGLang eager", R.compare(ref, got, rc.topk, tol))
            else:
                add(label, "stock", "graph", f"float32 {gup[0]} reference", gup[2],
                    "upstream" if gup[2].ok else None, gup[1])
    if not stock_ok:  # specattn against SGLang's triton
        if case.backend == "triton":
            return
        ref_name = "triton"
        fx.use(rc, "triton")
        _, ref = eager(None)
        fx.use(rc, case.backend)
    against = f"SGLang {ref_name} eager"
    envs = [("lane", {"SPECATTN_SGLANG": "1"})]
    if case.backend == "triton":
        envs.append(("auto", {"SPECATTN_SGLANG_BACKEND": "auto"}))
    for mode, env in envs:
        container, got = eager(env)
        add(R.served_by(container), mode, "eager", against, R.compare(ref, got, rc.topk, tol))
        if args.perturb:  # the comparison must catch a wrong attention output
            add(R.served_by(container), f"{mode} perturbed", "eager", against,
                R.compare(ref, R.perturbed(got), rc.topk, tol))
        if args.graphs:
            add(R.served_by(container), mode, "graph",
                f"SGLang {ref_name} graph" if ref_graph is not None else against,
                R.compare(ref if ref_graph is None else ref_graph, graph(env), rc.topk,
                          tol))
    if case.topk > 1:
        env = {"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_TREE_MODE": "path"}
        container, got = eager(env)
        verdict = R.tree_verdict(fx, got, "path", tol)
        add(R.served_by(container), "path", "eager", "float32 path reference", verdict,
            note=verdict.problems[0] if verdict.problems else "")
        if args.graphs and case.backend == "triton":
            add(R.served_by(container), "path", "graph", "specattn path eager",
                R.compare(got, graph(env), rc.topk, tol))


# --- timing -----------------------------------------------------------------------------------

def run_timing(args, R, rows: Rows, deadline: float) -> None:
    for batch, prefix in args.timing:
        for model in args.models:
            fx = None  # built by the first unit that runs (a failure is that unit's row)
            for backend, topk in [(b, k) for b in args.backends for k in args.timing_topks]:
                if time.monotonic() > deadline:
                    rows.skipped.append(f"timing {model} {backend} B {batch} L {prefix} "
                                        f"K {topk}")
                    continue
                start = time.monotonic()
                try:
                    fx = fx or R.build_fixture(
                        model, (prefix,) * batch, shape=_shape(args, model), page_size=1,
                        steps=CORRECT_STEPS if args.tiny else TIMING_STEPS, graph_bs=batch,
                        topk_max=max(args.timing_topks), hidden=32 if args.tiny else 256,
                        vocab=64, dtype=DTYPES[args.dtype], device=args.device)
                    row = _time_unit(R, fx, model, backend, batch, prefix, topk,
                                     TOLERANCE[args.dtype], reps=args.reps)
                except Exception as exc:
                    traceback.print_exc()
                    row = _timing_row(model, backend, batch, prefix, topk, note=short_error(exc))
                row["secs"] = f"{time.monotonic() - start:.1f}"
                rows.timing.append(row)
                _free(args.device)
                rows.flush()
            del fx
            _free(args.device)


def _timing_row(model, backend, batch, prefix, topk, **kw) -> dict:
    return {"model": model, "backend": backend, "batch": batch, "prefix": prefix,
            "topk": topk, "steps": "", "page": 1, **kw}


def _fmt(x) -> str:
    return "" if x is None else f"{x:.1f}"


def _mean(xs):
    return sum(xs) / len(xs) if xs and None not in xs else None


def _time_unit(R, fx, model, backend, batch, prefix, topk, tol, reps: int) -> dict:
    rc = R.RoundCase(model, fx.lengths, topk, fx.steps, 1, fx.shape, fx.hidden, fx.vocab,
                     capture_bs=batch)
    res = R.time_pair(fx, rc, backend, tol, reps=reps, free=lambda: _free(fx.device))
    spec, stock, verdict = res["specattn"], res["stock"], res["verdict"]
    check = "not compared: SGLang's is not the tree's (correctness)" if res["upstream"] else ""
    if verdict is not None:
        check = (("ok" if verdict.ok else "FAIL") + f" (eager: {verdict.summary}; graph "
                 f"tokens {res['graph_tokens_equal']}/{fx.batch})")
    row = _timing_row(model, backend, batch, prefix, topk, steps=fx.steps,
                      served_by=spec["served_by"], check=check,
                      note=f"SGLang: {res['stock_error']}" if res["stock_error"] else "",
                      specattn_round_us=_fmt(spec["round_wall_us"]),
                      specattn_round_event_us=_fmt(spec["round_event_us"]),
                      specattn_step_us=_fmt(_mean(spec["step_us"])))
    if stock is not None:
        ss = _mean(stock["step_us"])
        row.update(stock_round_us=_fmt(stock["round_wall_us"]),
                   stock_round_event_us=_fmt(stock["round_event_us"]), stock_step_us=_fmt(ss))
        if stock["round_wall_us"] and spec["round_wall_us"]:
            row["round_speedup"] = f"{stock['round_wall_us'] / spec['round_wall_us']:.2f}"
        if ss and _mean(spec["step_us"]):
            row["step_speedup"] = f"{ss / _mean(spec['step_us']):.2f}"
    print(f"[timing] {model} {backend} B{batch} L{prefix} K{topk}: stock "
          f"{row.get('stock_round_us', '-')}, specattn {row['specattn_round_us']} us", flush=True)
    return row


# --- the report -------------------------------------------------------------------------------

def versions(device: str) -> str:
    import importlib.metadata as md

    from specattn.bench.report import versions as info

    v = info(torch.device(device))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    libs = ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "flashinfer") if v.get(k))
    return (f"{v['gpu'] or 'CPU (' + v['cpu'] + ')'}; Python {v['python']}, {libs}, sglang "
            f"{md.version('sglang')}; specattn commit "
            f"{os.environ.get('SPECATTN_COMMIT', commit) or '?'}")


def _table(rows: list, columns: tuple) -> str:
    cols = [c for c in columns if any(str(r.get(c, "")) for r in rows)]
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + [
        "| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in cols) + " |"
        for r in rows])


def _write(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)``, then ``tmp`` renamed to ``path``: a run killed mid-write keeps the
    tables of its last finished case."""
    write(path + ".part")
    os.replace(path + ".part", path)


def write_report(args, rows: Rows, elapsed: float, stand_ins: list) -> None:
    from specattn.bench.report import write_csv

    os.makedirs(args.out, exist_ok=True)
    for name, columns, table in (("results.csv", CSV_COLUMNS, rows.correct),
                                 ("timing.csv", TIMING_COLUMNS, rows.timing)):
        _write(os.path.join(args.out, name), lambda tmp: write_csv(table, tmp, list(columns)))
    real = [r for r in rows.correct if not r["mode"].endswith("perturbed")]
    perturbed = [r for r in rows.correct if r["mode"].endswith("perturbed")]
    count = {s: sum(r["status"] == s for r in real) for s in ("ok", "upstream", "unsupported")}
    failed = sum(r["status"] in ("FAIL", "error") for r in real)
    joined = lambda d: ", ".join(f"{k} x{v}" for k, v in d.items()) or "none"  # noqa: E731
    lines = [
        f"# SGLang's EAGLE draft loop: SGLang's backends and specattn's, "
        f"{datetime.date.today().isoformat()}", "",
        versions(args.device) + f"; {args.dtype}; {elapsed:.0f} s.", "",
        "`python tools/sglang_gpu.py " + " ".join(sys.argv[1:]) + "`: SGLang's attention "
        "test kit, `EagleDraftWorker.draft_forward`, `EAGLEDraftCudaGraphRunner`; specattn "
        "through the plugin's hooks (docs/sglang.md). TorchDynamo "
        + ("on" if args.torch_compile else "off (SGLang's compiled top-k selection runs "
           "eagerly, for both sides)") + ". Import-only stand-ins: "
        + (", ".join(stand_ins) or "none") + f"; calls of them: {joined(rows.stubs)}; "
        f"pure-Python shims called: {joined(rows.shims)}.", "",
        "## Correctness", "",
        f"{count['ok']} ok, {failed} failed or errors, {count['upstream']} known upstream "
        f"differences (`draft_round.UPSTREAM`), {count['unsupported']} unsupported by SGLang"
        + (f"; {sum(r['status'] == 'FAIL' for r in perturbed)} of {len(perturbed)} "
           "deliberately perturbed outputs caught" if perturbed else "") + ". "
        f"Lengths {TINY_LENGTHS if args.tiny else CORRECT_LENGTHS}, {CORRECT_STEPS} steps, "
        "padded replays. Errors: max |x - ref| / max |ref| (tolerance "
        f"{TOLERANCE[args.dtype]:g}); tokens: requests whose draft tokens are equal (a "
        "near-tie: the logits that chose them agree within it; later steps not compared); "
        "secs: the row's wall time.", "",
        _table(rows.correct, CSV_COLUMNS) if rows.correct else "(none run)", ""]
    if not args.no_timing:
        lines += [
            "## Timing: SGLang's draft round, stock and specattn", "",
            "Uniform lengths, page 1, one layer; `round`: `EAGLEDraftCudaGraphRunner.execute` "
            f"(host preparation + replay), median of {args.reps} host wall times; "
            "`round_event`: the CUDA-event span around it; `step`: one step's attention call, "
            "eager, CUDA events, mean over the steps. Speedups: stock / specattn.", "",
            _table(rows.timing, TIMING_COLUMNS) if rows.timing else "(none run)", ""]
    if rows.skipped:
        lines += ["## Not run (budget)", "", f"--budget-s {args.budget_s:g} left these out: "
                  + "; ".join(rows.skipped) + ".", ""]
    _write(os.path.join(args.out, "results.md"), lambda tmp: Path(tmp).write_text("\n".join(lines)))


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("sglang_gpu.py: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    from specattn.integrations.sglang import draft_round as R

    stand_ins = R.install_stubs(gpu=args.device == "cuda")
    rows = Rows()
    rows.flush = lambda: write_report(args, rows, time.monotonic() - start, stand_ins)
    # A time-out's SIGTERM ends the run through the finally below (the tables get written).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        with torch._dynamo.config.patch(disable=not args.torch_compile), torch.no_grad():
            run_correctness(args, R, rows, start + args.share * args.budget_s)
            if not args.no_timing:
                run_timing(args, R, rows, start + args.budget_s)
    finally:
        write_report(args, rows, time.monotonic() - start, stand_ins)
    print(f"wrote {args.out}/ (results.md, results.csv, timing.csv)")
    bad = [r for r in rows.correct if r["status"] in ("FAIL", "error")
           and not r["mode"].endswith("perturbed")]
    bad += [r for r in rows.timing if str(r.get("check", "")).startswith("FAIL")]
    return 1 if bad or rows.stubs else 0


if __name__ == "__main__":
    sys.exit(main())
