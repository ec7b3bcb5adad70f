"""SGLang's own EAGLE draft loop with SGLang's backends and with specattn's through the plugin.

    python tools/sglang_gpu.py --out DIR [--quick] [--budget-s 300] [--no-timing]
                               [--device cuda|cpu] [--dtype bf16|fp32] [--tiny]

Correctness (MHA and MLA; topk 1/4/8; page 1/16, MLA 1/64; ragged lengths; graphs captured
one batch larger, so replays pad), per SGLang name ``triton`` / ``flashinfer``: SGLang's
backend eager and through ``EAGLEDraftCudaGraphRunner``; specattn through the plugin under
the same name, ``auto`` against SGLang's ``triton``, ``path`` mode against a float32 tree
reference (``draft_round.compare`` / ``check_tree``). Timing: the graph runner's
``execute`` and each step's attention call, stock against specattn, B 1/8/32 x L
4096/32768 x K 1/4/8. Cases run most important first until ``--budget-s`` (correctness
gets half); ``results.md``, ``results.csv`` and ``timing.csv`` go to ``--out``; exit 1 if a
case failed. ``tools/sglang_gpu.sh`` runs it on a GPU host (docs/sglang.md);
``--device cpu --dtype fp32 --tiny`` runs it on a CPU (``tests/test_sglang_gpu_tool.py``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

TOLERANCE = {"bf16": 2e-2, "fp32": 1e-4}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MHA_SHAPE, MLA_SHAPE = (32, 8, 128), (16, 512, 64)  # as specattn bench (docs/performance.md)
TINY = {"mha": (4, 2, 16), "mla": (4, 256, 32)}  # SGLang's Triton MLA kernel splits 288 in 256+32
PAGES = {"mha": (1, 16), "mla": (1, 64)}
CORRECT_LENGTHS = (77, 513, 1500, 2900)
TINY_LENGTHS = (5, 11, 2)
CORRECT_STEPS, TIMING_STEPS = 3, 5
TIMING_GRID = ((8, 4096), (32, 4096), (1, 32768), (8, 32768), (1, 4096), (32, 32768))
TIMING_TOPKS = (4, 1, 8)
BACKENDS = ("triton", "flashinfer")

CSV_COLUMNS = ("model", "backend", "served_by", "mode", "topk", "page", "run", "against",
               "status", "tokens", "attn_err", "kv_err", "logit_err", "note")
TIMING_COLUMNS = ("model", "backend", "batch", "prefix", "topk", "steps", "page",
                  "stock_round_us", "specattn_round_us", "round_speedup",
                  "stock_round_event_us", "specattn_round_event_us",
                  "stock_step_us", "specattn_step_us", "step_speedup", "served_by", "check",
                  "note")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="sglang_gpu.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--quick", action="store_true", help="the minimal correctness subset "
                   "(triton; MHA and MLA; topk 1 and 4; page 1 and 16/64), no timing")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="start no case after this many seconds (default 300)")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and lengths (CPU tests)")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--models", nargs="+", default=["mha", "mla"], choices=("mha", "mla"))
    p.add_argument("--case", action="append", metavar="MODEL:TOPK:PAGE",
                   help="only these correctness cases (repeatable), for each --backends")
    p.add_argument("--timing", action="append", metavar="BxL",
                   help="only these timing points (repeatable; default: the grid)")
    p.add_argument("--timing-topks", nargs="+", type=int, default=list(TIMING_TOPKS))
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="run the graph runner (default: on cuda; on the CPU with an eager "
                   "stand-in for the CUDA graph)")
    p.add_argument("--torch-compile", action="store_true", help="leave TorchDynamo on "
                   "(SGLang compiles its later top-k selection; default off: it runs eagerly, "
                   "on both sides, and no compile time is spent)")
    p.add_argument("--perturb", action="store_true", help="also compare a deliberately "
                   "wrong copy of each specattn eager output (rows '<mode> perturbed', which "
                   "must fail; they do not count in the exit status)")
    args = p.parse_args(argv)
    if args.graphs is None:
        args.graphs = args.device == "cuda"
    if args.quick:
        args.no_timing = True
    try:
        args.case = [(m, int(k), int(pg)) for m, k, pg in (c.split(":") for c in args.case or ())]
        args.timing = [tuple(int(x) for x in t.lower().split("x")) for t in args.timing or ()]
    except ValueError:
        p.error("--case MODEL:TOPK:PAGE (e.g. mha:4:16), --timing BxL (e.g. 8x4096)")
    if any(m not in ("mha", "mla") for m, _, _ in args.case):
        p.error("--case: the model is mha or mla")
    return args


# --- the case lists ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Corr:
    model: str
    backend: str
    topk: int
    page: int


def correctness_cases(args) -> list[Corr]:
    """Most important first: the quick subset (triton), then flashinfer's, then the rest."""
    if args.case:
        return [Corr(m, b, k, pg) for b in args.backends for m, k, pg in args.case]
    quick = [(m, 1, 1) for m in args.models] + [(m, 4, PAGES[m][1]) for m in args.models]
    if args.tiny:
        quick = [(m, 1, 1) for m in args.models] + [(m, 2, 4) for m in args.models]
    if args.quick:
        return [Corr(m, "triton", k, p) for m, k, p in quick]
    topks = (1, 2) if args.tiny else (1, 4, 8)
    rest = [(m, k, p) for k in topks[::-1] for m in args.models
            for p in (PAGES[m] if not args.tiny else (1, 4)) if (m, k, p) not in quick]
    out = [Corr(m, b, k, p) for b in args.backends for m, k, p in quick]
    out += [Corr(m, b, k, p) for b in args.backends for m, k, p in rest]
    return out


# --- rows -------------------------------------------------------------------------------------

@dataclass
class Rows:
    correct: list = field(default_factory=list)
    timing: list = field(default_factory=list)
    skipped: list = field(default_factory=list)   # what the budget left out
    stubs: dict = field(default_factory=dict)
    shims: dict = field(default_factory=dict)
    flush: Callable[[], None] = lambda: None  # rewrites the tables (after every case)


def short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --- correctness ------------------------------------------------------------------------------

def run_correctness(args, R, rows: Rows, deadline: float) -> None:
    dtype, tol = DTYPES[args.dtype], TOLERANCE[args.dtype]
    lengths = TINY_LENGTHS if args.tiny else CORRECT_LENGTHS
    fixtures: dict = {}
    stock_cache: dict = {}
    for case in correctness_cases(args):
        label = f"{case.model} {case.backend} topk {case.topk} page {case.page}"
        if time.monotonic() > deadline:
            rows.skipped.append(f"correctness {label}")
            continue
        key = (case.model, case.page)
        try:
            if key not in fixtures:
                fixtures.clear()
                stock_cache.clear()
                _free(args.device)
                shape = TINY[case.model] if args.tiny else (
                    MLA_SHAPE if case.model == "mla" else MHA_SHAPE)
                fixtures[key] = R.build_fixture(
                    case.model, lengths, shape=shape, page_size=case.page,
                    steps=CORRECT_STEPS, topk_max=max(2 if args.tiny else 8, case.topk),
                    graph_bs=len(lengths) + 1, hidden=32 if args.tiny else 256, vocab=50,
                    dtype=dtype, device=args.device)
            fx = fixtures[key]
            _correct_case(args, R, rows, fx, case, tol, stock_cache)
        except Exception as exc:  # one case's failure is a row; the rest still run
            traceback.print_exc()
            rows.correct.append(_row(case, "", "", "", "", "error", note=short(exc)))
        _free(args.device)
        rows.flush()


def _row(case: Corr, served: str, mode: str, run: str, against: str, status: str,
         verdict=None, note: str = "") -> dict:
    """One correctness row (a tree check, ``against`` a float32 reference: the attention
    error alone)."""
    row = {"model": case.model, "backend": case.backend, "served_by": served, "mode": mode,
           "topk": case.topk, "page": case.page, "run": run, "against": against,
           "status": status, "note": note}
    if verdict is not None and against.startswith("float32"):
        row["attn_err"] = f"{verdict.out_err:.2e}"
        if not verdict.ok:
            row["note"] = "; ".join(verdict.problems[:3])
    elif verdict is not None:
        row.update(tokens=f"{verdict.tokens_equal}/{verdict.requests}"
                   + (f" (+{verdict.near_ties} near-tie)" if verdict.near_ties else ""),
                   attn_err=f"{verdict.out_err:.2e}", kv_err=f"{verdict.kv_err:.2e}",
                   logit_err=f"{verdict.logit_err:.2e}")
        if not verdict.ok:
            row["note"] = "; ".join(verdict.problems[:3])
    return row


def _perturbed(rec):
    """A copy of ``rec`` whose first step's attention output is wrong by 10% of its scale."""
    import copy

    bad = copy.copy(rec)
    bad.outputs = [o.clone() for o in rec.outputs]
    bad.outputs[0] += 0.1 * bad.outputs[0].abs().max()
    return bad


def _correct_case(args, R, rows: Rows, fx, case: Corr, tol: float, stock_cache: dict) -> None:
    from specattn.integrations.sglang import stubs

    rc = R.RoundCase(case.model, fx.lengths, case.topk, CORRECT_STEPS, case.page, fx.shape,
                     fx.hidden, fx.vocab, capture_bs=fx.graph_bs)
    settings = fx.use(rc, case.backend)
    model = R.DraftModel(fx)
    inputs = fx.inputs()
    saved = fx.snapshot()

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

    def stub_note() -> str:
        called = stubs.calls()
        for name, n in called.items():
            rows.stubs[name] = rows.stubs.get(name, 0) + n
        for name, n in stubs.shim_calls().items():
            rows.shims[name] = rows.shims.get(name, 0) + n
        stubs.reset_counts()
        return ("stand-ins called: " + ", ".join(f"{k} x{v}" for k, v in called.items())
                if called else "")

    def add(served, mode, run, against, verdict=None, status=None, note=""):
        extra = stub_note()
        if status is None:
            status = "ok" if verdict.ok and not extra else "FAIL"
        row = _row(case, served, mode, run, against, status, verdict, note)
        if extra:
            row["note"] = "; ".join(x for x in (row["note"], extra) if x)
        rows.correct.append(row)
        print(f"[correctness] {case.model} {case.backend} K{case.topk} P{case.page} {mode} "
              f"{run} vs {against}: {row['status']} {verdict.summary if verdict else note}",
              flush=True)

    stubs.reset_counts()
    # SGLang's own backend of this name (the reference); its graph against its eager round.
    ref_name = case.backend
    try:
        stock, ref = eager(None)
    except Exception as exc:  # e.g. SGLang's FlashInfer MLA: topk 1 only
        add(f"SGLang {case.backend}", "stock", "eager", "", status="unsupported",
            note=short(exc))
        if case.backend == "triton":
            return
        ref_name = "triton"  # the same case, SGLang's triton as the reference
        fx.use(rc, "triton")
        stock, ref = eager(None)
        fx.use(rc, case.backend)
    stock_label = f"SGLang {type(stock).__name__}"
    if ref_name == case.backend:
        add(stock_label, "stock", "eager", "float32 lane reference",
            _tree_verdict(R, fx, ref, "lane", tol))
    ref_graph = None
    if args.graphs and ref_name == case.backend:
        ref_graph = graph(None)
        add(stock_label, "stock", "graph", "SGLang eager", R.compare(ref, ref_graph, rc.topk,
                                                                     tol))
    against = f"SGLang {ref_name} eager"
    envs = [("lane", {"SPECATTN_SGLANG": "1"})]
    if case.backend == "triton":
        envs.append(("auto", {"SPECATTN_SGLANG_BACKEND": "auto"}))
    for mode, env in envs:
        container, got = eager(env)
        add(R.served_by(container), mode, "eager", against, R.compare(ref, got, rc.topk, tol))
        if args.perturb:  # the comparison must catch a wrong attention output
            add(R.served_by(container), f"{mode} perturbed", "eager", against,
                R.compare(ref, _perturbed(got), rc.topk, tol))
        if args.graphs:
            got_graph = graph(env)
            add(R.served_by(container), mode, "graph",
                f"SGLang {ref_name} graph" if ref_graph is not None else against,
                R.compare(ref_graph if ref_graph is not None else ref, got_graph, rc.topk,
                          tol))
    if case.topk > 1:
        env = {"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_TREE_MODE": "path"}
        container, got = eager(env)
        verdict = _tree_verdict(R, fx, got, "path", tol)
        add(R.served_by(container), "path", "eager", "float32 path reference", verdict,
            note=verdict.problems[0] if verdict.problems else "")
        if args.graphs and case.backend == "triton":
            add(R.served_by(container), "path", "graph", "specattn path eager",
                R.compare(got, graph(env), rc.topk, tol))


def _tree_verdict(R, fx, rec, mode: str, tol: float):
    ok, err, differ, total = R.check_tree(fx, rec, mode, tol)
    bs = fx.batch
    verdict = R.Verdict(ok, bs, bs, 0, out_err=err)
    if not ok:
        verdict.problems.append(f"attention {err:.2g} off the float32 {mode} reference")
    if mode == "path":
        verdict.problems.append(f"{differ} of {total} rows differ from lane attention")
        if fx.case.topk > 1 and differ == 0:
            verdict.ok = False
            verdict.problems.insert(0, "no row differs from lane attention")
    return verdict


# --- timing -----------------------------------------------------------------------------------

def run_timing(args, R, rows: Rows, deadline: float) -> None:
    dtype, tol = DTYPES[args.dtype], TOLERANCE[args.dtype]
    for batch, prefix in args.timing or TIMING_GRID:
        for model in args.models:
            units = [(b, k) for b in args.backends for k in args.timing_topks]
            if time.monotonic() > deadline:
                rows.skipped += [f"timing {model} {b} B {batch} L {prefix} K {k}"
                                 for b, k in units]
                continue
            fx = None
            try:
                shape = TINY[model] if args.tiny else (
                    MLA_SHAPE if model == "mla" else MHA_SHAPE)
                fx = R.build_fixture(model, (prefix,) * batch, shape=shape, page_size=1,
                                     steps=CORRECT_STEPS if args.tiny else TIMING_STEPS,
                                     topk_max=max(args.timing_topks),
                                     graph_bs=batch, hidden=32 if args.tiny else 256,
                                     vocab=64, dtype=dtype, device=args.device)
            except Exception as exc:
                traceback.print_exc()
                rows.timing += [_timing_row(model, b, batch, prefix, k, note=short(exc))
                                for b, k in units]
                _free(args.device)
                continue
            for backend, topk in units:
                if time.monotonic() > deadline:
                    rows.skipped.append(f"timing {model} {backend} B {batch} L {prefix} "
                                        f"K {topk}")
                    continue
                try:
                    rows.timing.append(_time_unit(R, fx, model, backend, batch, prefix, topk,
                                                  tol, reps=3 if args.tiny else 30))
                except Exception as exc:
                    traceback.print_exc()
                    rows.timing.append(_timing_row(model, backend, batch, prefix, topk,
                                                   note=short(exc)))
                _free(args.device)
                rows.flush()
            del fx
            _free(args.device)


def _timing_row(model, backend, batch, prefix, topk, **kw) -> dict:
    row = {"model": model, "backend": backend, "batch": batch, "prefix": prefix,
           "topk": topk, "steps": "", "page": 1}
    row.update(kw)
    return row


def _fmt(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.1f}"


def _time_unit(R, fx, model, backend, batch, prefix, topk, tol, reps: int) -> dict:
    rc = R.RoundCase(model, fx.lengths, topk, fx.steps, 1, fx.shape, fx.hidden, fx.vocab,
                     capture_bs=batch)
    res = R.time_pair(fx, rc, backend, tol, reps=reps, free=lambda: _free(fx.device))
    spec, stock, verdict = res["specattn"], res["stock"], res["verdict"]
    check = ""
    if verdict is not None:
        check = (("ok" if verdict.ok else "FAIL") + f" (eager: {verdict.summary}; graph "
                 f"tokens {res['graph_tokens_equal']}/{fx.batch})")

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    row = _timing_row(model, backend, batch, prefix, topk, steps=fx.steps,
                      served_by=spec["served_by"], check=check,
                      note=f"SGLang: {res['stock_error']}" if res["stock_error"] else "",
                      specattn_round_us=_fmt(spec["round_wall_us"]),
                      specattn_round_event_us=_fmt(spec["round_event_us"]),
                      specattn_step_us=_fmt(mean(spec["step_us"])))
    if stock is not None:
        ss = mean(stock["step_us"])
        row.update(stock_round_us=_fmt(stock["round_wall_us"]),
                   stock_round_event_us=_fmt(stock["round_event_us"]), stock_step_us=_fmt(ss))
        if stock["round_wall_us"] and spec["round_wall_us"]:
            row["round_speedup"] = f"{stock['round_wall_us'] / spec['round_wall_us']:.2f}"
        if ss and mean(spec["step_us"]):
            row["step_speedup"] = f"{ss / mean(spec['step_us']):.2f}"
    print(f"[timing] {model} {backend} B{batch} L{prefix} K{topk}: "
          f"stock {row.get('stock_round_us', '-')} us, specattn {row['specattn_round_us']} us"
          f" {check[:60]}", flush=True)
    return row


# --- the report -------------------------------------------------------------------------------

def versions(device: str) -> str:
    import importlib.metadata as md

    parts = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    for name in ("triton", "sglang", "flashinfer-python"):
        try:
            parts.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    where = (torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available()
             else f"CPU ({platform.processor() or platform.machine()})")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    commit = os.environ.get("SPECATTN_COMMIT", commit) or "?"
    return f"{where}; " + ", ".join(parts) + f"; specattn commit {commit}"


def _table(rows: list, columns: tuple) -> str:
    cols = [c for c in columns if any(str(r.get(c, "")) for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in cols)
                     + " |")
    return "\n".join(lines)


def write_report(args, rows: Rows, elapsed: float, stand_ins: list) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows.correct)
    with open(os.path.join(args.out, "timing.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=TIMING_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows.timing)
    real = [r for r in rows.correct if not r["mode"].endswith("perturbed")]
    perturbed = [r for r in rows.correct if r["mode"].endswith("perturbed")]
    failed = [r for r in real if r["status"] in ("FAIL", "error")]
    ok = sum(r["status"] == "ok" for r in real)
    lines = [
        f"# SGLang's EAGLE draft loop: SGLang's backends and specattn's, "
        f"{datetime.date.today().isoformat()}",
        "",
        versions(args.device) + f"; {args.dtype}; {elapsed:.0f} s.",
        "",
        "`python tools/sglang_gpu.py " + " ".join(sys.argv[1:]) + "`. SGLang's attention "
        "test kit (its mock model runner and pools, a RadixAttention layer), its real "
        "`EagleDraftWorker.draft_forward` and `EAGLEDraftCudaGraphRunner`; specattn through "
        "the plugin's hooks applied by SGLang's `HookRegistry`. TorchDynamo "
        + ("on" if args.torch_compile else "off (SGLang's compiled top-k selection runs "
           "eagerly, for both sides)") + ". Import-only stand-ins: "
        + (", ".join(stand_ins) or "none") + "; calls of them: "
        + (", ".join(f"{k} x{v}" for k, v in rows.stubs.items()) or "none")
        + "; pure-Python shims called: "
        + (", ".join(f"{k} x{v}" for k, v in rows.shims.items()) or "none") + ".",
        "",
        "## Correctness",
        "",
        f"{ok} ok, {len(failed)} failed or errors, "
        f"{sum(r['status'] == 'unsupported' for r in real)} unsupported by SGLang"
        + (f"; {sum(r['status'] == 'FAIL' for r in perturbed)} of {len(perturbed)} "
           "deliberately perturbed outputs caught" if perturbed else "") + ". "
        f"Lengths {TINY_LENGTHS if args.tiny else CORRECT_LENGTHS}, {CORRECT_STEPS} steps, "
        "the graph captured at one batch more (padded replays). Errors: max |x - ref| / "
        f"max |ref| (tolerance {TOLERANCE[args.dtype]:g}); tokens: requests whose draft "
        "tokens are equal (a near-tie: they differ where the logits that chose them agree "
        "within the tolerance; later steps of that request are not compared).",
        "",
        _table(rows.correct, CSV_COLUMNS) if rows.correct else "(none run)",
        "",
    ]
    if not args.no_timing:
        lines += [
            "## Timing: SGLang's draft round, stock and specattn",
            "",
            "Uniform lengths, page 1, one layer; `round`: "
            "`EAGLEDraftCudaGraphRunner.execute` (host preparation + graph replay), median "
            "host wall time to completion; `round_event`: the CUDA-event span around it; "
            "`step`: one step's attention call (RadixAttention with the step's backend), "
            "eager, CUDA events, mean over the steps. Speedups: stock / specattn.",
            "",
            _table(rows.timing, TIMING_COLUMNS) if rows.timing else "(none run)",
            "",
        ]
    if rows.skipped:
        lines += ["## Not run (budget)", "",
                  f"--budget-s {args.budget_s:g} left these out: " + "; ".join(rows.skipped)
                  + ".", ""]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines))


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
            share = 1.0 if args.no_timing else 0.5
            run_correctness(args, R, rows, start + share * args.budget_s)
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
