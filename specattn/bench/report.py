"""Rows, ratios and outputs of ``specattn bench``: the table (markdown), CSV, PNG charts and
the versions record.

One row per (case, lengths, variant), plus two ``floor`` rows per case: the copy-bandwidth
floor (every prefix once plus every lane's history, over the copy bandwidth measured in the
same process) and, on a GPU, the read floor (``floors.py``: one launch that only reads those
bytes through the case's slots, timed as a step). ``add_ratios`` fills the derived columns
from the measured ones, so they are computed in one place (and tested without a GPU).
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform as host_platform
import subprocess
from collections import defaultdict
from importlib import metadata as importlib_metadata
from typing import Any, Optional

import torch

__all__ = ["COLUMNS", "SWEEP_COLUMNS", "PARTS_COLUMNS", "FLOOR", "READ_FLOOR", "NOISY_SPREAD",
           "TERMINAL_DROP_ORDER", "add_ratios", "has_fp8", "fp8_lines", "render_table",
           "print_table", "fit_columns", "parts_rows", "render_parts", "rate_lines",
           "noise_warning", "write_csv", "read_csv", "write_pngs", "case_figure",
           "sweep_figure", "bar_axis_label", "versions", "device_slug"]

FLOOR = "copy-bandwidth floor"
READ_FLOOR = "read-floor"  # floors.py: one launch that only reads the case's bytes
# A timing whose runs spread more than this (interquartile range over the median) is noisy.
NOISY_SPREAD = 0.10
COLUMNS = [
    "case", "lengths", "kind", "model", "batch", "prefix", "topk", "steps", "page_size",
    "dtype", "kv_dtype", "k_scale", "v_scale", "twin_case", "lanes", "variant", "backend",
    "mode", "kernel_library", "status", "error", "max_err",
    "time_us", "spread", "timing", "floor_us", "x_floor", "read_floor_us", "x_read_floor",
    "kv_bytes", "bandwidth_gbs", "per_branch", "x_vs_per_branch", "x_vs_dequant", "x_vs_bf16",
    "tokens_per_s", "x_vs_torch_ref", "round_layers", "round_eager_us", "round_graph_us",
    "round_us", "round_host_us", "round_tokens_per_s", "copy_bw_gbs", "notes",
]
SWEEP_COLUMNS = ["topk", "prefix", "batch", "variant", "status", "time_us", "spread",
                 "floor_us", "x_floor", "error"]
PARTS_COLUMNS = ["case", "lengths", "variant", "part", "kind", "us", "calls"]


def _num(value: Any) -> Optional[float]:
    if value is None or value == "":
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(out) else out


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill ``x_floor``, ``read_floor_us``, ``x_read_floor``, ``bandwidth_gbs``,
    ``tokens_per_s``, ``per_branch``, ``x_vs_per_branch``, ``x_vs_dequant``, ``x_vs_bf16``
    and ``x_vs_torch_ref`` in place (and return ``rows``).

    Per (case, lengths): ``x_floor = time / floor`` (the copy floor); ``x_read_floor = time /
    read floor`` (the group's ``read-floor`` row; every row but the copy floor's);
    ``bandwidth = kv_bytes / time``;
    ``tokens_per_s`` = query rows of one call per second (one layer), ``round_tokens_per_s``
    the rows of a whole round (``S - 1`` steps) over its eager time; ``x_vs_per_branch`` =
    per-branch time / time (above 1 = faster than per-branch), against the backend's own
    ``per-branch`` mode, else the first raw-library per-lane baseline; ``x_vs_dequant`` =
    the backend's ``dequant`` row's time / time (FP8 cases); ``x_vs_bf16`` = the time of the
    same variant (or floor) on the row's ``twin_case`` with the same lengths / time (FP8
    cases whose twin ran); ``x_vs_torch_ref`` = torch_ref time / time. Failed rows get none
    of them.
    """
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["case"], row["lengths"])].append(row)
    times = {(r["case"], r["lengths"], r["variant"]): _num(r.get("time_us")) for r in rows
             if r.get("status") in ("ok", "floor") and _num(r.get("time_us"))}
    for group in groups.values():
        ok = [r for r in group if r.get("status") == "ok" and _num(r.get("time_us"))]
        own_pb = {r["backend"]: r for r in ok if r.get("mode") == "per-branch"}
        own_dq = {r["backend"]: r for r in ok if r.get("mode") == "dequant"}
        raw_pb = next((r for r in ok if r.get("mode") == "raw"), None)
        ref = next((r for r in ok if r.get("backend") == "torch_ref"
                    and r.get("mode") != "dequant"), None)
        read = next((_num(r.get("time_us")) for r in group if r.get("variant") == READ_FLOOR
                     and r.get("status") == "floor"), None)
        for r in group:
            t = _num(r.get("time_us"))
            if r.get("status") not in ("ok", "floor") or not t:
                continue
            floor = _num(r.get("floor_us"))
            r["x_floor"] = t / floor if floor else None
            if r.get("variant") != FLOOR:
                r["read_floor_us"] = read
                r["x_read_floor"] = t / read if read else None
            kv = _num(r.get("kv_bytes"))
            r["bandwidth_gbs"] = kv / (t * 1e-6) / 1e9 if kv else None
            twin = times.get((r.get("twin_case"), r["lengths"], r["variant"]))
            r["x_vs_bf16"] = twin / t if twin else None
            if r["status"] == "floor":
                continue
            lanes = _num(r.get("lanes"))
            r["tokens_per_s"] = lanes / (t * 1e-6) if lanes else None
            base = None
            # torch_ref has no shared-prefix design to compare: no per-branch ratio.
            if (r.get("mode") not in ("per-branch", "raw", "dequant")
                    and r.get("backend") != "torch_ref"):
                base = own_pb.get(r["backend"]) or raw_pb
            r["per_branch"] = base["variant"] if base else ""
            r["x_vs_per_branch"] = _num(base["time_us"]) / t if base else None
            dequant = own_dq.get(r["backend"]) if r.get("mode") != "dequant" else None
            r["x_vs_dequant"] = _num(dequant["time_us"]) / t if dequant else None
            r["x_vs_torch_ref"] = (_num(ref["time_us"]) / t
                                   if ref is not None and ref is not r else None)
            round_us = _num(r.get("round_eager_us"))
            if round_us and lanes:
                steps = int(_num(r.get("steps")) or 2) - 1 if r.get("kind") == "decode" else 1
                r["round_tokens_per_s"] = lanes * max(steps, 1) / (round_us * 1e-6)
    return rows


# --- table -----------------------------------------------------------------------------------

def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    v = _num(value)
    return "-" if v is None else f"{v:{spec}}{suffix}"


def _ratio(value: Any, suffix: str = "") -> str:
    """A ratio to two decimals, or to two significant digits below 0.1 (an interpreted
    kernel against ``torch_ref``: ``0.0031x``, not ``0.00x``)."""
    v = _num(value)
    return _fmt(value, ".2f" if v is None or abs(v) >= 0.095 else ".2g", suffix)


def has_fp8(rows: list[dict[str, Any]]) -> bool:
    """Whether some row is of a case with FP8 pools (its ``kv_dtype``)."""
    return any(str(r.get("kv_dtype", "")).startswith("fp8") for r in rows)


def _table_cells(rows: list[dict[str, Any]], cpu: bool) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the results table (one line per row; failed rows say why); the
    FP8 ratios (``x vs dequant``, ``x vs bf16``) when an FP8 case is in ``rows``."""
    fp8 = has_fp8(rows)
    head = ["case", "lengths", "variant", "time us"] + (["spread"] if cpu else [])
    head += ["x copy floor"] + ([] if cpu else ["x read floor"])
    head += ["x vs per-branch"] + (["x vs dequant", "x vs bf16"] if fp8 else []) + ["GB/s"]
    head += ["tokens/s", "x vs torch_ref"] if cpu else []
    head += ["round us", "host us", "round eager us"]
    head += ["round tokens/s" if cpu else "round graph us", "check"]
    body = []
    for r in rows:
        status = r.get("status")
        cells = [r["case"], r["lengths"], r["variant"]]
        if status in ("failed", "unsupported"):
            word = "FAILED" if status == "failed" else "not run"
            cells += [f"{word}: {r.get('error', '')}"]
            cells += [""] * (len(head) - len(cells))
        else:
            vs_pb = _ratio(r.get("x_vs_per_branch"), "x")
            cells.append(_fmt(r.get("time_us"), ",.1f"))
            if cpu:
                cells.append(_fmt(r.get("spread"), ".0%"))
            cells.append(_ratio(r.get("x_floor")))
            if not cpu:
                cells.append(_ratio(r.get("x_read_floor")))
            cells.append(vs_pb)
            if fp8:
                cells += [_ratio(r.get(k), "x") for k in ("x_vs_dequant", "x_vs_bf16")]
            cells.append(_fmt(r.get("bandwidth_gbs"), ",.0f"))
            if cpu:
                cells += [_fmt(r.get("tokens_per_s"), ",.0f"),
                          _ratio(r.get("x_vs_torch_ref"), "x")]
            if status == "floor":  # no round
                cells += ["", ""]
            else:  # n/a: no graph round here (CPU, raw baselines, no graph support)
                cells += ["n/a" if _num(r.get(k)) is None else _fmt(r.get(k), ",.1f")
                          for k in ("round_us", "round_host_us")]
            cells.append(_fmt(r.get("round_eager_us"), ",.0f"))
            if cpu:
                cells.append(_fmt(r.get("round_tokens_per_s"), ",.0f"))
            else:
                cells.append(_fmt(r.get("round_graph_us"), ",.0f"))
            if status == "floor":
                cells.append("")
            elif status == "checked":
                cells.append(_fmt(r.get("max_err"), ".1e") + " (not timed)")
            else:
                cells.append(_fmt(r.get("max_err"), ".1e"))
        body.append([str(c) for c in cells])
    return head, body


def render_table(rows: list[dict[str, Any]], *, cpu: bool = False) -> str:
    """The markdown table of ``table.md``."""
    head, body = _table_cells(rows, cpu)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in cells) + " |" for cells in body]
    return "\n".join(lines)


# The terminal table leaves columns out until it fits the terminal's width (table.md and
# bench.csv have them all): first those with no value in any row, then these, in this
# order; case, lengths, variant and time stay.
TERMINAL_DROP_ORDER = ("round eager us", "round graph us", "round tokens/s", "GB/s",
                       "tokens/s", "spread", "check", "host us", "x vs torch_ref",
                       "round us", "x vs bf16", "x vs per-branch", "x vs dequant",
                       "x read floor", "x copy floor")
_GAP = 2  # characters between two columns of make_table's tables


def fit_columns(head: list[str], body: list[list[str]], width: int,
                drop_order: tuple[str, ...] = TERMINAL_DROP_ORDER,
                ) -> tuple[list[int], list[int], list[str]]:
    """Which columns of the table fit in ``width`` characters, and how wide each is.

    A column is at least as wide as its longest word (header or cell: text wraps at spaces
    only, never inside a word) and at most as its longest text. Columns named in
    ``drop_order`` are left out until the narrowest table fits: first those without a
    value in any row (every cell empty, ``-`` or ``n/a``), then in that order; the room
    left widens the kept columns from the left. Returns the kept column indices, their
    widths and the headers left out."""
    def longest(i, split):
        return max(len(p) for cells in [head] + body
                   for p in (cells[i].split() if split else [cells[i]]) or [""])

    least = [longest(i, True) for i in range(len(head))]
    most = [max(longest(i, False), least[i]) for i in range(len(head))]
    keep = list(range(len(head)))
    dropped: list[str] = []
    order = [head.index(h) for h in drop_order if h in head]
    empty = [i for i in order if all(cells[i] in ("", "-", "n/a") for cells in body)]
    order = empty + [i for i in order if i not in empty]

    def total(cols):
        return sum(least[i] for i in cols) + _GAP * (len(cols) - 1)
    while total(keep) > width and order:
        i = order.pop(0)
        keep.remove(i)
        dropped.append(head[i])
    widths = [least[i] for i in keep]
    room = width - total(keep)
    for n, i in enumerate(keep):
        more = min(max(room, 0), most[i] - least[i])
        widths[n] += more
        room -= more
    return keep, widths, dropped


def print_table(rows: list[dict[str, Any]], console, *, cpu: bool = False) -> None:
    """The same table on a terminal, in the terminal's width (``fit_columns``): text wraps
    at spaces only, columns are left out by a fixed rule (``TERMINAL_DROP_ORDER``, said
    below the table), and the reasons of failed or not run rows are numbered notes below it
    instead of cells."""
    from .._console import make_table, print_unpadded

    head, body = _table_cells(rows, cpu)
    reasons = []
    for r, cells in zip(rows, body):
        if r.get("status") in ("failed", "unsupported"):
            word = "FAILED" if r["status"] == "failed" else "not run"
            reasons.append(f"[{len(reasons) + 1}] {r['case']} {r['lengths']} {r['variant']}: "
                           f"{word}: {r.get('error', '')}")
            cells[3] = f"{word.replace(' ', '-')}[{len(reasons)}]"  # one word: never wrapped
    keep, widths, dropped = fit_columns(head, body, console.width)
    table = make_table(*(head[i] for i in keep))
    table.padding = (0, 1)
    for column, w in zip(table.columns, widths):
        column.width = w
    for cells in body:
        table.add_row(*(cells[i] for i in keep))
    print_unpadded(console, table)
    if dropped:
        console.print(f"Left out at {console.width} characters: {', '.join(dropped)} "
                      "(table.md and bench.csv have every column).")
    for line in reasons:
        console.print(line)


def _fastest(group: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The fastest passing row of a backend's own or option variant (``torch_ref`` only when
    nothing else passed), or ``None``."""
    timed = [r for r in group if r.get("status") == "ok" and _num(r.get("time_us"))
             and r.get("mode") in ("shared", "default", "option")]
    pool = [r for r in timed if r.get("backend") != "torch_ref"] or timed
    return min(pool, key=lambda r: _num(r["time_us"]), default=None)


def fp8_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One markdown list line per (FP8 case, lengths) of ``rows``: its pools, and its fastest
    variant (``_fastest``) against the FP8 targets: over its read floor, over the same
    variant on the bf16 twin, and its speedup over the backend's ``dequant`` row."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if has_fp8([r]):
            groups[(r["case"], r["lengths"])].append(r)
    out = []
    for (case, lengths), group in groups.items():
        first = group[0]
        pools = f"kv {first['kv_dtype']}, k_scale {_fmt(first.get('k_scale'), 'g')}"
        if _num(first.get("v_scale")) is not None:
            pools += f", v_scale {_fmt(first.get('v_scale'), 'g')}"
        twin = first.get("twin_case") or ""
        best = _fastest(group)
        if best is None:
            out.append(f"- {case} ({lengths}; {pools}): no variant passed")
            continue
        found = [f"fastest {best['variant']}, {_fmt(best['time_us'], ',.1f')} us"]
        if _num(best.get("x_read_floor")):
            found.append(f"{_ratio(best['x_read_floor'], 'x')} its read floor")
        if _num(best.get("x_vs_bf16")):
            found.append(f"{_ratio(1 / _num(best['x_vs_bf16']), 'x')} its step on {twin}")
        elif twin:
            found.append(f"{twin}: no {best['variant']} row in this run")
        if _num(best.get("x_vs_dequant")):
            found.append(f"{_ratio(best['x_vs_dequant'], 'x')} faster than "
                         f"{best['backend']}/dequant")
        out.append(f"- {case} ({lengths}; {pools}): " + "; ".join(found))
    return out


def rate_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One markdown list line per timed row of a compute-bound case: its TFLOP/s beside the
    bf16 matmul rate of the same process (the row's ``TFLOP/s`` note)."""
    out = []
    for r in rows:
        notes = r.get("notes") or []
        if isinstance(notes, str):
            notes = notes.split("; ")
        rate = next((n for n in notes if "TFLOP/s" in n), None)
        if rate and r.get("status") == "ok":
            out.append(f"- {r['case']} ({r['lengths']}), {r['variant']}: {rate}")
    return out


def noise_warning(rows: list[dict[str, Any]], limit: float = NOISY_SPREAD) -> str:
    """'' or a warning naming the timings whose runs spread more than ``limit`` (the
    interquartile range over the median): their ratios are not to be trusted."""
    noisy = [r for r in rows if (_num(r.get("spread")) or 0.0) > limit]
    if not noisy:
        return ""
    worst = max(noisy, key=lambda r: _num(r["spread"]))
    where = worst.get("case") or f"sweep K {worst['topk']} L {worst['prefix']}"
    return (f"warning: {len(noisy)} of {sum(1 for r in rows if r.get('status') == 'ok')} "
            f"timings spread more than {limit:.0%} between runs (interquartile range over "
            f"the median; worst {_num(worst['spread']):.0%}, {where} "
            f"{worst['variant']}): this machine is busy, so the ratios are noisy. Rerun on an "
            "idle machine, or with --threads 1 --clock cpu, or with more --reps")


def parts_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``--parts``: one row per part of every variant (case, lengths, variant, part, kind,
    us per step, calls per step)."""
    return [{"case": r["case"], "lengths": r["lengths"], "variant": r["variant"], **part}
            for r in rows for part in r.get("parts") or ()]


def render_parts(parts: list[dict[str, Any]]) -> str:
    """The markdown table of the step parts."""
    lines = ["| case | lengths | variant | part | kind | us per step | calls per step |",
             "|---|---|---|---|---|---|---|"]
    for p in parts:
        cells = [p["case"], p["lengths"], p["variant"], p["part"], p["kind"],
                 _fmt(p["us"], ",.1f"), _fmt(p["calls"], ".3g")]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


# --- CSV -------------------------------------------------------------------------------------

def write_csv(rows: list[dict[str, Any]], path: str, columns: list[str] = COLUMNS) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_cell(r.get(k)) for k in columns})


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.10g}"  # table.md's digits, whatever the magnitude
    if isinstance(value, (list, tuple)):
        return "; ".join(str(v) for v in value)
    return value


def read_csv(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --- charts ----------------------------------------------------------------------------------

def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_axis_label(log: bool) -> str:
    """The time axis of the charts: what it is, its scale, and which way is better."""
    return "time, us (log scale; lower is better)" if log else "time, us (lower is better)"


def _log_axis(values: list[float]) -> bool:
    """A log axis when the times span more than 30x (torch_ref next to fast kernels)."""
    positive = [v for v in values if v > 0]
    return bool(positive) and max(positive) > 30 * min(positive)


def case_figure(plt, case: str, lengths: str, group: list[dict[str, Any]], title: str):
    """One case's chart: a bar per variant (one step of one layer), the copy floor and the
    read floor as lines, their legend outside the plot; ``None`` without a bar."""
    def floor_of(variant):
        return next((_num(r["time_us"]) for r in group if r.get("status") == "floor"
                     and r.get("variant") == variant), None)

    floors = [(name, floor_of(variant), style) for name, variant, style in (
        ("copy floor", FLOOR, "--"), ("read floor", READ_FLOOR, ":")) if floor_of(variant)]
    bars = [r for r in group if r.get("status") in ("ok", "failed")
            and r.get("mode") != "read-floor"]
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(bars) + 2) + 1.6, 3.6))
    labels = [r["variant"] for r in bars]
    values = [_num(r.get("time_us")) or 0.0 for r in bars]
    colors = ["#bbbbbb" if r.get("mode") in ("per-branch", "raw") else "#3a76b0"
              for r in bars]
    drawn = ax.bar(range(len(bars)), values, color=colors)
    ax.bar_label(drawn, labels=[f"{v:,.0f}" if v else "" for v in values], fontsize=7)
    log = _log_axis(values + [v for _, v, _ in floors])
    if log:
        ax.set_yscale("log")
    positive = [v for v in values if v > 0]
    for i, r in enumerate(bars):
        if r.get("status") == "failed":
            ax.text(i, min(positive or [1.0]), "failed", ha="center", va="bottom",
                    color="#b03a3a")
    for name, value, style in floors:
        ax.axhline(value, color="#b03a3a", linestyle=style, label=f"{name} {value:,.1f} us")
    if floors:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(bar_axis_label(log), fontsize=8)
    ax.set_title(f"{case} ({lengths}): one step of one layer - {title}", fontsize=9)
    fig.tight_layout()
    return fig


def sweep_figure(plt, sweep_rows: list[dict[str, Any]], title: str):
    """Latency against prefix length, one panel per ``K`` (log axes), each variant in one
    colour in every panel, one legend for all of them to the right of the panels."""
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _pos: f"{v:g}")  # 20 and 2048, not 2x10^1 and 2^11
    # Minor ticks of a log axis: 2, 3 and 5 of each decade labelled, the others not.
    some = FuncFormatter(lambda v, _pos: f"{v:g}" if f"{v:e}"[0] in "235" else "")
    topks = sorted({int(r["topk"]) for r in sweep_rows})
    variants = list(dict.fromkeys(r["variant"] for r in sweep_rows))
    color = {v: f"C{i % 10}" for i, v in enumerate(variants)}
    fig, axes = plt.subplots(1, len(topks), figsize=(4.2 * len(topks), 3.6), squeeze=False)
    lines: dict[str, Any] = {}
    for ax, k in zip(axes[0], topks):
        at_k = [r for r in sweep_rows if int(r["topk"]) == k]
        for variant in variants:
            pts = sorted((int(r["prefix"]), _num(r["time_us"])) for r in at_k
                         if r["variant"] == variant and r.get("status") == "ok")
            if pts:
                lines[variant], = ax.plot(*zip(*pts), marker="o", color=color[variant],
                                          label=variant)
        floor = sorted({(int(r["prefix"]), _num(r["floor_us"])) for r in at_k
                        if _num(r.get("floor_us"))})
        if floor:
            lines["copy floor"], = ax.plot(*zip(*floor), linestyle="--", color="#b03a3a",
                                           label="copy floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(plain)
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(some)
        ax.set_xlabel("prefix length, tokens (log scale)")
        ax.set_title(f"K = {k}", fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel(bar_axis_label(True), fontsize=8)
    fig.suptitle(f"one step of one layer against prefix length - {title}", fontsize=9)
    fig.tight_layout()
    if lines:
        fig.legend(list(lines.values()), list(lines), loc="center left",
                   bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
    return fig


def write_pngs(rows: list[dict[str, Any]], sweep_rows: list[dict[str, Any]], out_dir: str,
               title: str) -> tuple[list[str], str]:
    """Per case: bars per variant (step time) with the floors as lines; and latency against
    prefix length per ``K``. Returns the files written and a note ('' or why none)."""
    plt = _pyplot()
    if plt is None:
        return [], "no PNG charts: matplotlib is not installed (pip install matplotlib)"
    written = []
    cases: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        cases[(r["case"], r["lengths"])].append(r)
    for (case, lengths), group in cases.items():
        fig = case_figure(plt, case, lengths, group, title)
        if fig is None:
            continue
        name = f"case-{case}-{lengths}.png"
        fig.savefig(os.path.join(out_dir, name), dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(name)
    if sweep_rows:
        fig = sweep_figure(plt, sweep_rows, title)
        fig.savefig(os.path.join(out_dir, "prefix-sweep.png"), dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append("prefix-sweep.png")
    return written, ""


# --- versions --------------------------------------------------------------------------------

def _dist_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            continue
    return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host_platform.processor() or host_platform.machine()


def versions(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on: device, driver and library versions."""
    from .. import __version__

    info: dict[str, Any] = {
        "specattn": __version__, "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "flashinfer": _dist_version("flashinfer-python", "flashinfer"),
        "flash-attn": _dist_version("flash-attn-4", "flash-attn", "flash_attn"),
        "python": host_platform.python_version(), "cpu": _cpu_name(),
        "torch_threads": torch.get_num_threads(),
    }
    if os.environ.get("SPECATTN_COMMIT"):  # the tree's commit (tools/gpu.sh's GPU_COMMIT)
        info["commit"] = os.environ["SPECATTN_COMMIT"]
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info["gpu"] = None
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return info


def device_slug(info: dict[str, Any]) -> str:
    """``h200`` for "NVIDIA H200", ``cpu`` without a GPU (the results folder's suffix)."""
    gpu = info.get("gpu")
    if not gpu:
        return "cpu"
    words = [w for w in gpu.lower().replace("nvidia", " ").split() if w]
    slug = "-".join("".join(ch for ch in w if ch.isalnum()) for w in words[:2])
    return slug.strip("-") or "gpu"


def write_versions(info: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.write("\n")
