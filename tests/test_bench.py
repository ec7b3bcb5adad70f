"""``specattn bench``: cases, floor arithmetic, ratios, the correctness gate, the GPU control
flow (graphs, rounds) driven by a fake clock, outputs (CSV, table, PNG), the CLI and the
README generator."""

from __future__ import annotations

import dataclasses

import importlib.util
import io
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from specattn import AttentionLayer, DraftDecodeBackend
from specattn.backends.torch_ref import TorchRefDecode, reference_decode
from specattn.bench import cli_main
from specattn.bench import cases as C
from specattn.bench import report
from specattn.bench.baselines import SDPAPerLane, per_lane_table
from specattn.bench.harness import (
    ENGINE_ROUNDS, ENGINE_SPANS, Variant, WallClock, build_setup, discover_variants,
    measure_variant, relative_error,
)
from specattn._console import ItemProgress, make_console
from specattn.bench.run import floor_row, result_row
from specattn.metadata import history_slots
from specattn.platforms import current_platform

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
ROOT = os.path.join(os.path.dirname(__file__), "..")


def tiny(kind="decode", model="mha", ragged=True, dtype=torch.float32, topk=2, page=1):
    shape = (4, 2, 16) if model == "mha" else (4, 32, 8)
    return C.Case("tiny", model, 3, 20, topk, 4, page, kind, dtype, ragged, shape)


# --- cases and the floor ---------------------------------------------------------------------

def test_standard_cases_are_the_performance_table():
    got = {c.name: (c.model, c.batch, c.prefix, c.topk, c.steps, c.page_size, c.kind)
           for c in C.STANDARD_CASES}
    assert got["gqa-long"] == ("mha", 32, 4096, 8, 5, 1, "decode")
    assert got["gqa-chain"] == ("mha", 64, 2048, 1, 4, 1, "decode")
    assert got["gqa-paged"] == ("mha", 32, 4096, 4, 5, 16, "decode")
    assert got["gqa-small"] == ("mha", 4, 1024, 4, 5, 1, "decode")
    assert got["mla-long"][:6] == ("mla", 32, 4096, 4, 5, 1)
    assert got["mla-long-p64"][5] == 64
    assert got["extend"][-1] == "extend"
    sweep = C.sweep_cases(True, False, torch.bfloat16)
    assert {c.topk for c in sweep} == {1, 4, 8}
    assert min(c.prefix for c in sweep) == 512 and max(c.prefix for c in sweep) == 32768


def test_serving_cases_are_the_serving_regime():
    """The serving set: batch 1-8 at long contexts, each decode case with its extend case
    (E_b = S + 1), S 5, bf16; selectable as a set, in the default GPU run; B 1 cases run
    uniform lengths only (a ragged run at B 1 is a uniform one at another length)."""
    got = {c.name: (c.model, c.batch, c.prefix, c.topk, c.steps, c.page_size, c.kind)
           for c in C.SERVING_CASES}
    assert got == {
        "gqa-b1-32k": ("mha", 1, 32768, 4, 5, 1, "decode"),
        "gqa-b1-k8": ("mha", 1, 4096, 8, 5, 1, "decode"),
        "gqa-b8-p16": ("mha", 8, 4096, 4, 5, 16, "decode"),
        "mla-b1-32k": ("mla", 1, 32768, 4, 5, 1, "decode"),
        "mla-b8-p64": ("mla", 8, 4096, 4, 5, 64, "decode"),
        "gqa-b1-32k-extend": ("mha", 1, 32768, 1, 5, 1, "extend"),
        "gqa-b1-k8-extend": ("mha", 1, 4096, 1, 5, 1, "extend"),
        "gqa-b8-p16-extend": ("mha", 8, 4096, 1, 5, 16, "extend"),
        "mla-b1-32k-extend": ("mla", 1, 32768, 1, 5, 1, "extend"),
        "mla-b8-p64-extend": ("mla", 8, 4096, 1, 5, 64, "extend"),
    }
    assert all(c.dtype == torch.bfloat16 for c in C.SERVING_CASES)
    mla = C.find_cases(["mla-b1-32k"])[0]
    assert mla.shape == C.MLA_SHAPE and C.find_cases(["gqa-b1-32k"])[0].shape == C.GQA_SHAPE
    assert C.find_cases(["mla-b8-p64-extend"])[0].lanes == 8 * 6
    assert C.find_cases(["serving"]) == list(C.SERVING_CASES)
    # A set and a name in it: each case once, in the order given.
    assert [c.name for c in C.find_cases(["gqa-b8-p16", "serving"])][:2] == [
        "gqa-b8-p16", "gqa-b1-32k"]
    assert len(C.find_cases(["gqa-b8-p16", "serving"])) == len(C.SERVING_CASES)
    default = {c.name for c in C.default_cases(True)}
    assert set(got) <= default and {c.name for c in C.STANDARD_CASES} <= default
    assert not set(got) & {c.name for c in C.default_cases(False)}


def test_ragged_runs_skip_batch_one():
    from specattn.bench import _select_cases, build_parser

    args = build_parser().parse_args(["--case", "serving"])
    runs = [(c.name, c.lengths_label) for c in _select_cases(args, True)[0]]
    assert ("gqa-b8-p16", "ragged") in runs and ("mla-b8-p64-extend", "ragged") in runs
    assert ("gqa-b1-32k", "uniform") in runs
    assert not any(name.split("-")[1] == "b1" and lengths == "ragged"
                   for name, lengths in runs)
    assert len(runs) == 6 + 2 * 4
    quick = _select_cases(build_parser().parse_args(["--case", "serving", "--quick"]), True)
    assert [c.lengths_label for c in quick[0]] == ["uniform"] * 10


def test_one_draft_step_has_no_decode_case(tmp_path, capsys):
    """A round of ``S`` 1 runs no decode step (the serving loop runs ``S - 1``): a custom
    shape of ``--num-steps 1`` is its extend case only (its decode rows had timed a step-0
    call no engine makes), and ``--steps`` with it is a usage error."""
    from specattn.bench import _select_cases, build_parser

    one = _select_cases(build_parser().parse_args(["--num-steps", "1", "--quick"]), False)[0]
    assert [c.kind for c in one] == ["extend"]
    two = _select_cases(build_parser().parse_args(["--num-steps", "2", "--quick"]), False)[0]
    assert [c.kind for c in two] == ["decode", "extend"]
    out = tmp_path / "out"
    assert cli_main(["--num-steps", "1", "--steps", "--device", "cpu", "--check-only",
                     "--out", str(out)]) == 2
    assert capsys.readouterr().err == ("specattn bench: error: --num-steps: expected 2 or "
                                       "more with --steps (a round of one draft step runs no "
                                       "decode step), got 1\n")
    assert not out.exists()


def test_ragged_lengths_are_seeded_and_in_range():
    case = C.STANDARD_CASES[0].with_(ragged=True)
    lens = case.lengths(seed=3)
    assert lens == case.lengths(seed=3) and lens != case.lengths(seed=4)
    assert all(2048 <= n <= 6144 for n in lens) and len(set(lens)) > 1
    assert C.STANDARD_CASES[0].lengths() == [4096] * 32


def test_floor_matches_performance_md():
    # performance.md: gqa-long, 3 history slots, 4.3 TB/s -> about 125 us for 0.54 GB.
    case = C.find_cases(["gqa-long"])[0]
    lens = case.lengths()
    assert case.row_bytes == 8 * (128 + 128) * 2
    assert case.kv_bytes(lens) == (32 * 4096 + 32 * 8 * 3) * 4096
    row = floor_row(case, lens, 4.3e12)
    assert row["floor_us"] == pytest.approx(125, rel=0.02)
    assert row["status"] == "floor" and row["copy_bw_gbs"] == pytest.approx(4300)
    mla = C.find_cases(["mla-long"])[0]
    assert mla.row_bytes == 576 * 2
    ext = C.find_cases(["extend"])[0]
    assert ext.kv_bytes([100, 200]) == 300 * ext.row_bytes and ext.lanes == 32 * 6


def test_case_errors_and_custom_shapes():
    from specattn.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="--case"):
        C.find_cases(["gqa-long", "nope"])
    with pytest.raises(InvalidInputError, match="--batch"):
        C.custom_case(batch=0)
    # Named as the command line sets it: --steps is the flag that keeps decode cases only.
    with pytest.raises(InvalidInputError, match="^--num-steps: expected an int >= 1, got 0$"):
        C.custom_case(steps=0)
    c = C.custom_case(batch=2, prefix=64, topk=3, mla=True)
    assert (c.model, c.shape, c.topk, c.timed_step) == ("mla", C.MLA_SHAPE, 3, 2)
    assert C.custom_case(steps=2).timed_step == 0


# --- ratios, table, CSV ----------------------------------------------------------------------

def _row(variant, backend, mode, t, status="ok", **kw):
    base = {"case": "c", "lengths": "uniform", "kind": "decode", "steps": 5, "lanes": 64,
            "kv_bytes": 1e9, "floor_us": 250.0, "variant": variant, "backend": backend,
            "mode": mode, "status": status, "time_us": t}
    base.update(kw)
    return base


def test_ratios():
    rows = [
        _row(report.FLOOR, "", "floor", 250.0, status="floor"),
        _row("x", "x", "shared", 500.0, round_eager_us=4000.0),
        _row("x/per-branch", "x", "per-branch", 1500.0),
        _row("y", "y", "default", 1000.0),
        _row("raw", "flashinfer-raw", "raw", 2000.0),
        _row("torch_ref", "torch_ref", "default", 5000.0),
        _row("z", "z", "shared", None, status="failed", error="boom"),
        _row("x", "x", "shared", 50.0, lengths="ragged", floor_us=None),
    ]
    report.add_ratios(rows)
    floor, x, xpb, y, raw, ref, z, other = rows
    assert x["x_floor"] == pytest.approx(2.0) and floor["x_floor"] == pytest.approx(1.0)
    assert x["x_vs_per_branch"] == pytest.approx(3.0) and x["per_branch"] == "x/per-branch"
    assert y["x_vs_per_branch"] == pytest.approx(2.0) and y["per_branch"] == "raw"
    assert raw.get("x_vs_per_branch") is None and xpb.get("x_vs_per_branch") is None
    assert x["x_vs_torch_ref"] == pytest.approx(10.0) and ref["x_vs_torch_ref"] is None
    assert ref["x_vs_per_branch"] is None
    assert x["bandwidth_gbs"] == pytest.approx(2000.0)  # 1 GB in 500 us
    assert x["tokens_per_s"] == pytest.approx(64 / 500e-6)
    assert x["round_tokens_per_s"] == pytest.approx(64 * 4 / 4e-3)
    assert all(z.get(k) is None for k in ("x_floor", "x_vs_per_branch", "tokens_per_s"))
    # Ratios never cross cases/lengths: the ragged row has no per-branch partner.
    assert other.get("x_vs_per_branch") is None and other["x_floor"] is None


def test_tiny_ratios_keep_two_significant_digits():
    # An interpreted kernel 320x slower than torch_ref had printed "0.00x".
    rows = report.add_ratios([
        _row(report.FLOOR, "", "floor", 250.0, status="floor"),
        _row("triton", "triton", "shared", 1.6e6),
        _row("torch_ref", "torch_ref", "default", 5000.0),
    ])
    table = report.render_table(rows, cpu=True)
    line = next(s for s in table.splitlines() if "| triton |" in s)
    assert "| 0.0031x |" in line and "0.00x" not in table
    assert "| 6400.00 |" in line  # x copy floor, above 0.1: two decimals as before


def test_csv_columns_and_failed_rows(tmp_path):
    rows = report.add_ratios([
        _row(report.FLOOR, "", "floor", 250.0, status="floor"),
        _row("x", "x", "shared", 500.0, max_err=1e-3, notes=["a", "b"]),
        _row("bad", "bad", "default", None, status="failed",
             error="wrong result: max error 1 | of the reference"),
        _row("gone", "gone", "", None, status="unsupported", error="needs CUDA"),
    ])
    path = tmp_path / "bench.csv"
    report.write_csv(rows, str(path))
    back = report.read_csv(str(path))
    assert list(back[0]) == report.COLUMNS
    assert [r["status"] for r in back] == ["floor", "ok", "failed", "unsupported"]
    assert back[1]["notes"] == "a; b" and float(back[1]["x_floor"]) == pytest.approx(2.0)
    assert back[2]["time_us"] == "" and "wrong result" in back[2]["error"]
    table = report.render_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "FAILED: wrong result" in table and "not run: needs CUDA" in table
    assert "tokens/s" in report.render_table(rows, cpu=True)


def _gpu_rows():
    def row(case, variant, t, status="ok", **kw):
        base = {"case": case, "lengths": "uniform", "kind": "decode", "steps": 5, "lanes": 4,
                "kv_bytes": 1.3e8, "floor_us": 31.2, "variant": variant, "mode": "shared",
                "backend": variant.split("/")[0].split("[")[0], "status": status,
                "time_us": t, "max_err": 3.1e-3, "round_eager_us": 2345.0,
                "round_graph_us": 1234.0, "round_us": 171.3, "round_host_us": 38.2}
        base.update(kw)
        return base

    rows = []
    for case in ("gqa-b1-32k-extend", "mla-b8-p64"):
        rows += [
            row(case, report.FLOOR, 31.2, status="floor", mode="floor"),
            row(case, report.READ_FLOOR, 40.1, status="floor", mode="read-floor"),
            row(case, "triton", 44.0), row(case, "triton/per-branch", 120.3, mode="per-branch"),
            row(case, "triton[config=m64 n32 w8 s3 kv-first gluon-ov]", 43.0, mode="option"),
            row(case, "flashinfer decode per lane (raw)", 300.0, mode="raw", round_us=None,
                round_host_us=None),
            row(case, "fa4", None, status="failed", error="crashed while timed: RuntimeError: "
                "CUDA error: an illegal memory access was encountered at /a/very/long/path/"
                "to/flash_attn/cute/interface.py:1234"),
            row(case, "flashmla", None, status="unsupported", error="needs the flash_mla "
                "package")]
    return report.add_ratios(rows)


@pytest.mark.parametrize("cpu", [False, True], ids=["device-table", "cpu-table"])
def test_terminal_table_fits_120_columns_and_wraps_whole_words(cpu):
    """At 120 columns: one table (no split), no line wider, every header and cell word of
    the columns shown printed whole; columns left out in TERMINAL_DROP_ORDER's order and
    named; failed and not-run reasons as numbered notes below the table. Wide enough,
    nothing is left out."""
    rows = _gpu_rows()
    head, body = report._table_cells(rows, cpu)
    buf = io.StringIO()
    report.print_table(rows, make_console(buf, width=120), cpu=cpu)
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 120
    rules = [i for i, line in enumerate(lines) if set(line.strip()) == {"─"}]
    assert len(rules) == 1  # one table
    header = " ".join(lines[:rules[0]]).split()
    note = next((line for line in lines if line.startswith("Left out at 120 characters: ")),
                "")
    dropped = note[len("Left out at 120 characters: "):].split(" (table.md")[0].split(", ")
    dropped = [h for h in dropped if h]
    assert dropped  # these rows do not fit at 120 columns whole
    # The rule: columns without a value first, then TERMINAL_DROP_ORDER's order.
    order = [h for h in report.TERMINAL_DROP_ORDER if h in head]
    empty = [h for h in order if all(c[head.index(h)] in ("", "-", "n/a") for c in body)]
    rule = empty + [h for h in order if h not in empty]
    assert dropped == rule[:len(dropped)]
    shown = [i for i, h in enumerate(head) if h not in dropped]
    assert {"case", "variant", "time us", "x copy floor"} <= {head[i] for i in shown}
    for i in shown:
        assert all(word in header for word in head[i].split()), head[i]
    printed = set(" ".join(lines[rules[0] + 1:]).split())
    for cells in body:
        for i in shown[:3] + shown[4:]:  # the time column holds the failure markers
            assert set(cells[i].split()) <= printed, cells[i]
    assert "FAILED[1]" in printed and "not-run[2]" in printed
    notes = [line for line in lines if line.startswith("[")]
    assert notes[0].startswith("[1] gqa-b1-32k-extend uniform fa4: FAILED: crashed while")
    assert notes[1] == "[2] gqa-b1-32k-extend uniform flashmla: not run: needs the " \
        "flash_mla package"
    wide = io.StringIO()
    report.print_table(rows, make_console(wide, width=400), cpu=cpu)
    assert "Left out" not in wide.getvalue()
    assert all(h in wide.getvalue() for h in head)


def test_fit_columns_rule():
    head = ["case", "variant", "a b", "GB/s", "check"]
    body = [["x" * 10, "long-word and more", "1", "22", "3.1e-03"]]
    keep, widths, dropped = report.fit_columns(head, body, 200)
    assert keep == [0, 1, 2, 3, 4] and not dropped
    assert widths == [10, 18, 3, 4, 7]  # each at its longest text
    # At least: the longest words, 10 + 9 + 1 + 4 + 7 and 2 between columns: 39.
    assert report.fit_columns(head, body, 39)[2] == []
    keep, widths, dropped = report.fit_columns(head, body, 36)
    assert dropped == ["GB/s"] and keep == [0, 1, 2, 4]  # GB/s goes before check
    assert widths == [10, 12, 1, 7]  # the 3 characters left widen the variant column
    keep, widths, dropped = report.fit_columns(head, body, 30)
    assert dropped == ["GB/s", "check"] and widths == [10, 15, 1]
    # A column without a value in any row goes first (the CPU's n/a round columns).
    empty = [["x" * 10, "long-word and more", "1", "22", "n/a"]]
    assert report.fit_columns(head, empty, 36)[2] == ["check"]
    assert report.fit_columns(head, empty, 39)[2] == []


def test_bar_axis_label_says_scale_and_direction():
    assert report.bar_axis_label(True) == "time, us (log scale; lower is better)"
    assert report.bar_axis_label(False) == "time, us (lower is better)"
    assert report._log_axis([1.0, 31.0]) and not report._log_axis([1.0, 29.0, 0.0])


def _boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_case_chart_labels_its_axis_and_shows_both_floors():
    """matplotlib objects of a case chart: the y label names the scale and says lower is
    better (log when the times span more than 30x), both floors drawn, the legend outside
    the plot."""
    pytest.importorskip("matplotlib")
    plt = report._pyplot()
    rows = [r for r in _gpu_rows() if r["case"] == "mla-b8-p64"]
    fig = report.case_figure(plt, "mla-b8-p64", "uniform", rows, "H200")
    try:
        ax = fig.axes[0]
        assert ax.get_yscale() == "linear" and ax.get_ylabel() == report.bar_axis_label(False)
        legend = ax.get_legend()
        assert [t.get_text() for t in legend.get_texts()] == ["copy floor 31.2 us",
                                                             "read floor 40.1 us"]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert not _boxes_overlap(legend.get_window_extent(renderer),
                                  ax.get_window_extent(renderer))
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert report.READ_FLOOR not in labels and "triton" in labels  # floors are lines
    finally:
        plt.close(fig)
    rows.append(dict(rows[2], variant="torch_ref", time_us=40000.0))
    fig = report.case_figure(plt, "mla-b8-p64", "uniform", rows, "H200")
    try:
        assert fig.axes[0].get_yscale() == "log"
        assert fig.axes[0].get_ylabel() == "time, us (log scale; lower is better)"
    finally:
        plt.close(fig)


def test_sweep_chart_has_one_legend_outside_the_panels():
    pytest.importorskip("matplotlib")
    plt = report._pyplot()
    sweep = [{"topk": k, "prefix": n, "variant": v, "status": "ok", "time_us": n / 100 * i,
              "floor_us": n / 200} for k in (1, 4, 8) for n in (512, 1024, 2048)
             for i, v in enumerate(("triton", "flashinfer", "fa4"), 1)]
    fig = report.sweep_figure(plt, sweep, "H200")
    try:
        assert all(ax.get_legend() is None for ax in fig.axes)
        assert len(fig.legends) == 1
        texts = [t.get_text() for t in fig.legends[0].get_texts()]
        assert texts == ["triton", "flashinfer", "fa4", "copy floor"]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box = fig.legends[0].get_window_extent(renderer)
        assert not any(_boxes_overlap(box, ax.get_window_extent(renderer)) for ax in fig.axes)
        assert fig.axes[0].get_ylabel() == "time, us (log scale; lower is better)"
        assert all(ax.get_xscale() == "log" and ax.get_xlabel().endswith("(log scale)")
                   for ax in fig.axes)
        # Each variant in one colour, the same in every panel (the one legend holds).
        colours = [{ln.get_label(): ln.get_color() for ln in ax.lines} for ax in fig.axes]
        assert all(c == colours[0] for c in colours) and len(set(colours[0].values())) == 4
    finally:
        plt.close(fig)


def test_device_slug():
    assert report.device_slug({"gpu": "NVIDIA H200"}) == "h200"
    assert report.device_slug({"gpu": None}) == "cpu"
    assert report.versions(torch.device("cpu"))["torch"] == torch.__version__


# --- variants and the correctness gate --------------------------------------------------------

def test_cpu_variants_default_and_named(scoped_registry):
    plat = current_platform()
    variants, skipped = discover_variants(tiny(), plat)
    labels = [v.label for v in variants]
    assert labels == ["intel_amx", "torch_ref", SDPAPerLane.label]
    mla, _ = discover_variants(tiny(model="mla"), plat)
    assert [v.label for v in mla] == ["intel_amx", "torch_ref"]  # raw baselines: MHA only
    ext, _ = discover_variants(tiny(kind="extend"), plat)
    assert not any(v.raw for v in ext)

    class WithModes(DraftDecodeBackend, name="bench_modes"):
        def __init__(self, runner, topk, num_steps, *, tree_mode="lane", mode="shared"):
            super().__init__(runner, topk, num_steps, tree_mode=tree_mode)

        def init_forward_metadata(self, batch): ...

        def forward(self, step, layer, q, k, v): ...

    variants, skipped = discover_variants(tiny(), plat, ["bench_modes", "flashinfer",
                                                         "no_such_backend"], raw=False)
    assert [(v.label, v.mode) for v in variants] == [("bench_modes", "shared"),
                                                     ("bench_modes/per-branch", "per-branch")]
    why = dict(skipped)
    assert "CUDA" in why["flashinfer"] and "not a backend" in why["no_such_backend"]

    built = []

    class AutoMode(DraftDecodeBackend, name="bench_auto_mode"):
        def __init__(self, runner, topk, num_steps, *, tree_mode="lane", mode="auto"):
            super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
            built.append(mode)

        def init_forward_metadata(self, batch): ...

        def forward(self, step, layer, q, k, v): ...

    # Found on the H200 (2026-12-02): fa4's row was forced to mode="shared", so its default
    # route (a split prefix at batch 1, 3.3x faster at gqa-b1-32k) was never timed.
    variants, _ = discover_variants(tiny(), plat, ["bench_auto_mode"], raw=False)
    assert [(v.label, v.mode) for v in variants] == [("bench_auto_mode", "default"),
                                                     ("bench_auto_mode/per-branch", "per-branch")]
    variants[0].make(build_setup(tiny(), "cpu"))
    assert built == ["auto"]



def test_gpu_variants_skip_model_specific_rows_and_foreign_flavours():
    """Found on the H200 (2026-11-29): the default GPU run timed dsv4 (model-specific math,
    auto_eligible=False) and listed fa4's MUSA flavour as "not run" beside the CUDA one."""
    from specattn.platforms import Platform

    plat = Platform("cuda", (9, 0), libraries=frozenset({"triton", "flash_attn.cute"}))
    case = dataclasses.replace(tiny(), dtype=torch.bfloat16)
    variants, skipped = discover_variants(case, plat, on_gpu=True)
    labels = {v.label for v in variants}
    assert {"triton", "fa4", "fa4/per-branch"} <= labels
    assert not {"dsv4", "dsa"} & labels
    assert not any("MUSA" in why for _, why in skipped), skipped
    named, _ = discover_variants(case, plat, ["dsv4"], raw=False, on_gpu=True)
    assert [v.label for v in named] == ["dsv4"]  # still timed when asked for by name

def test_a_backend_that_runs_nowhere_here_is_one_not_run_row():
    """fa3 on a CPU was three "not run" rows of the same label (its musa, sm8x and sm90
    flavours), fa4 two: one row per name now, each flavour's reason in it."""
    from specattn.platforms import Platform

    plat = Platform("cpu", None, libraries=frozenset())
    _, skipped = discover_variants(tiny(), plat, ["fa3", "fa4", "flashinfer"], raw=False,
                                   on_gpu=False)
    assert [name for name, _ in skipped] == ["fa3", "fa4", "flashinfer"]
    why = dict(skipped)
    assert why["fa3"].startswith("musa: needs MUSA") and "; sm90: needs CUDA" in why["fa3"]
    assert why["fa4"].startswith("cuda: needs CUDA") and "; musa: needs MUSA" in why["fa4"]
    assert why["flashinfer"].startswith("needs CUDA")  # one flavour: its reason alone


def _broken_class(output):
    class Broken(TorchRefDecode, name="bench_broken"):
        def forward(self, step, layer, q, k, v):
            return output(super().forward(step, layer, q, k, v))

    return Broken


class CountingClock(WallClock):
    def __init__(self):
        super().__init__(reps=1)
        self.calls = 0

    def time(self, fn):
        self.calls += 1
        return super().time(fn)


@pytest.mark.parametrize("output", [lambda o: o * 1.1, lambda o: o.fill_(float("nan"))],
                         ids=["wrong", "nan"])
def test_wrong_backend_is_failed_and_not_timed(scoped_registry, output):
    cls = _broken_class(output)
    setup = build_setup(tiny(), "cpu")
    variant = Variant("bench_broken", "bench_broken", "default", "torch",
                      lambda s: cls(s.runner, 2, 4))
    clock = CountingClock()
    res = measure_variant(variant, setup, clock)
    assert res.status == "failed" and "wrong result" in res.error
    assert res.step_ms is None and clock.calls == 0


def test_crashing_backend_is_failed(scoped_registry):
    def boom(o):
        raise RuntimeError("kernel exploded\nsecond line")

    cls = _broken_class(boom)
    setup = build_setup(tiny(), "cpu")
    res = measure_variant(Variant("b", "b", "default", "torch", lambda s: cls(s.runner, 2, 4)),
                          setup, WallClock(1))
    assert res.status == "failed" and res.error.endswith("RuntimeError: kernel exploded")


@pytest.mark.parametrize("kind,model,page,dtype", [
    ("decode", "mha", 1, torch.bfloat16), ("decode", "mla", 4, torch.float16),
    ("decode", "mha", 4, torch.float32), ("extend", "mha", 1, torch.bfloat16),
    ("extend", "mla", 1, torch.float32)])
def test_cpu_backends_pass_the_gate(kind, model, page, dtype):
    case = tiny(kind, model, dtype=dtype, page=page)
    setup = build_setup(case, "cpu")
    variants, _ = discover_variants(case, current_platform())
    for v in variants:
        res = measure_variant(v, setup, WallClock(1), round_layers=2)
        assert res.status == "ok", (v.label, res.error)
        assert res.max_err <= 2e-2 and res.step_ms > 0
        assert (res.round_eager_ms is None) == v.raw and res.round_graph_ms is None


@pytest.mark.parametrize("seed", range(4))
def test_setup_sizes_context_for_duplicated_pages(seed):
    """P > 1 with K > 1: each lane copies the partial last page, so the round can need more
    than K * (S + P) slots (the H200 run's mla-long-p64 ragged setup failure)."""
    case = tiny(topk=4, page=16)
    setup = build_setup(case, "cpu", seed=seed)
    assert setup.batch.out_cache_loc.shape == (case.batch, 4, case.steps)


def test_per_lane_table_is_prefix_then_history():
    setup = build_setup(tiny(topk=3), "cpu")
    r, b = setup.runner, setup.batch
    table, lens = per_lane_table(r, b, 2)
    hist = history_slots(b.out_cache_loc, None, 2, "lane")
    for z in range(table.shape[0]):
        i, j = divmod(z, 3)
        n = int(b.seq_lens[i])
        want = torch.cat([r.req_to_token[int(b.req_pool_indices[i]), :n].long(), hist[i, j]])
        assert int(lens[z]) == n + 3
        assert torch.equal(table[z, :n + 3], want) and not table[z, n + 3:].any()


def test_relative_error():
    ref = torch.tensor([1.0, -2.0])
    assert relative_error(ref + 0.02, ref) == pytest.approx(0.01)
    assert relative_error(torch.tensor([float("nan"), 0.0]), ref) == math.inf
    with pytest.raises(ValueError):
        relative_error(ref[:1], ref)


# --- --option, --parts, --check-only ------------------------------------------------------------

def test_option_parsing_and_plan_names():
    from specattn.bench.options import check_options, parse_option
    from specattn.errors import InvalidInputError
    from specattn.registry import default_registry

    opt = parse_option("triton:plan=dot-mla,mode=per-branch,num_splits=None")
    assert opt.label == "triton[plan=dot-mla,mode=per-branch,num_splits=None]"
    assert dict(opt.kwargs) == {"plan": "dot-mla", "mode": "per-branch", "num_splits": None}
    check_options([opt, parse_option("fa4:split_prefix=2"),
                   parse_option("intel_amx:cache_prefix=False")], default_registry)
    from specattn.backends.triton import TritonDecode

    got = parse_option("triton:plan=gluon-wl,num_splits=6").kwargs_for(TritonDecode)
    assert got == {"plan": "gluon-wl", "num_splits": 6}
    assert dict(parse_option("intel_amx:cache_prefix=false").kwargs) == {"cache_prefix": False}
    assert dict(parse_option("x:a=true,b='false'").kwargs) == {"a": True, "b": "false"}
    with pytest.raises(InvalidInputError, match=r"each keyword once.*plan repeated"):
        parse_option("triton:plan=dot,num_splits=4,plan=dot-m16")  # not the last silently
    bad = ["triton", "triton:", "triton:=2", "no_such:x=1", "triton:blocks=2",
           "triton:topk=2", "triton:plan=dotx", "triton:config=m64 n32 w8 s3",
           "fa4:split_prefix=2,cache_prefix=True"]
    for text in bad:
        with pytest.raises(InvalidInputError, match="--option"):
            check_options([parse_option(text)], default_registry)
    with pytest.raises(InvalidInputError, match=r"--option plan.*one of dot, .*'dotx'"):
        check_options([parse_option("triton:plan=dotx")], default_registry)
    # A value of another type than the keyword's annotation, refused before any case runs
    # (num_splits=abc failed every case after the run; cache_prefix=maybe ran as true).
    # So is a value of the right type that the constructor refuses (mode=bogus, a split
    # count of 0 had been a FAILED row in every case after the run): a mode's annotation is
    # a Literal of the module (resolved there), a range the backend's own check.
    for text, message in (("triton:num_splits=abc", "num_splits: expected an int in "
                                                     "[1, 256] or None, got 'abc'"),
                          ("intel_amx:cache_prefix=maybe", "cache_prefix: expected a value "
                                                            "of type bool (intel_amx), got "
                                                            "'maybe'"),
                          ("triton:mode=bogus", "mode: expected a value of type "
                                                "Literal['shared', 'per-branch'] (triton), "
                                                "got 'bogus'"),
                          ("fa4:mode=per_branch", "mode: expected a value of type "
                                                  "Literal['auto', 'shared', 'per-branch'] "
                                                  "(fa4), got 'per_branch'"),
                          ("flashinfer:mode=auto", "mode: expected a value of type "
                                                   "Literal['shared', 'per-branch'] "
                                                   "(flashinfer), got 'auto'"),
                          ("triton:num_splits=0", "num_splits: expected an int in [1, 256] "
                                                  "or None, got 0"),
                          ("triton:num_splits=True", "num_splits: expected an int in "
                                                     "[1, 256] or None, got True"),
                          ("fa3:split_prefix=0", "split_prefix: expected an int >= 1 "
                                                 "(1 = one pass), got 0")):
        with pytest.raises(InvalidInputError) as info:
            check_options([parse_option(text)], default_registry)
        assert str(info.value) == f"--option {message}"
    check_options([parse_option("triton:num_splits=None,pdl=False")], default_registry)
    check_options([parse_option(t) for t in ("triton:mode=per-branch", "fa3:mode=auto",
                                             "flashinfer:mode=shared", "triton:num_splits=256",
                                             "fa4:split_prefix=4")], default_registry)
    # Two backends joined by ',' (in SPECATTN_SGLANG_OPTIONS items are separated by ';'):
    # it had read "triton:mode" as a keyword.
    with pytest.raises(InvalidInputError, match=r"^--option: expected one backend per item"):
        parse_option("triton:plan=dot-mla,triton:mode=shared")


def test_option_variants_join_the_backends_own(scoped_registry):
    """An option adds a variant (mode 'option') for the classes of its backend that take its
    keywords, whether or not the backend's own variants run; it is checked and timed like
    them and compared with the backend's own per-branch mode."""
    from specattn.bench.options import parse_option

    plat = current_platform()
    opts = [parse_option("intel_amx:cache_prefix=False")]
    variants, _ = discover_variants(tiny(), plat, options=opts)
    assert [(v.label, v.mode) for v in variants] == [
        ("intel_amx", "default"), ("intel_amx[cache_prefix=False]", "option"),
        ("torch_ref", "default"), (SDPAPerLane.label, "raw")]
    only, _ = discover_variants(tiny(), plat, ["torch_ref"], raw=False, options=opts)
    assert [v.label for v in only] == ["intel_amx[cache_prefix=False]", "torch_ref"]
    ext, _ = discover_variants(tiny(kind="extend"), plat, ["torch_ref"], options=opts)
    assert [v.label for v in ext] == ["torch_ref"]  # IntelAMXExtend takes no cache_prefix
    setup = build_setup(tiny(), "cpu")
    res = measure_variant(variants[1], setup, WallClock(1), round_layers=1)
    assert res.status == "ok" and res.step_ms > 0
    assert not variants[1].make(setup).cache_prefix


def test_parts_of_a_cpu_step_and_of_a_triton_step():
    """--parts on the CPU: the metadata call's host time, then the step's torch ops (self
    time per step); Triton (interpreter) at a tiny size too."""
    from specattn.bench.options import parse_option
    from specattn.bench.parts import measure_parts

    setup = build_setup(tiny(), "cpu")
    variants, _ = discover_variants(tiny(), current_platform(), ["torch_ref", "triton"],
                                    raw=False, options=[parse_option("triton:plan=dot-wide")])
    assert [v.label for v in variants] == ["torch_ref", "triton", "triton/per-branch",
                                           "triton[plan=dot-wide]"]
    for variant in variants[::3]:
        parts = measure_parts(variant, setup, WallClock(1), reps=1)
        assert parts[0]["part"] == "init_forward_metadata" and parts[0]["kind"] == "host"
        ops = parts[1:]
        assert ops and all(p["kind"] == "op" and p["us"] > 0 and p["calls"] > 0 for p in ops)
        assert len(ops) <= 11 and not any(p["part"].startswith("ProfilerStep") for p in ops)
    ref_ops = {p["part"] for p in measure_parts(variants[0], setup, WallClock(1), reps=1)}
    assert "aten::bmm" in ref_ops or "aten::einsum" in ref_ops  # the reference's attention


def test_profile_parts_keeps_gpu_kernels_and_sums_the_tail():
    """The GPU branch, on fake profiler events: kernels only (CUDA device type), per call,
    names without their templates, the smallest summed as '(other ...)'."""
    from types import SimpleNamespace

    from specattn.bench.parts import profile_parts

    def ev(key, us, count, device="DeviceType.CUDA"):
        return SimpleNamespace(key=key, device_time_total=us, count=count, device_type=device,
                               self_cpu_time_total=1.0)

    events = [ev("aten::mm", 500.0, 4, "DeviceType.CPU"),
              ev("void flashinfer::PrefillKernel<128, true>(Params)", 400.0, 4),
              ev("_history_merge_kernel", 80.0, 4), ev("Memcpy HtoD (Pageable -> Device)", 8.0, 4)]
    events += [ev(f"k{i}", 1.0, 4) for i in range(3)]
    rows = profile_parts(events, on_gpu=True, calls=4, top=3)
    assert [(r["part"], r["us"], r["calls"]) for r in rows] == [
        ("flashinfer::PrefillKernel", 100.0, 1.0), ("_history_merge_kernel", 20.0, 1.0),
        ("Memcpy HtoD", 2.0, 1.0), ("(other: 3 more)", 0.75, 3.0)]
    assert {r["kind"] for r in rows} == {"kernel"}


def test_check_only_and_extra_cases(tmp_path, capsys):
    """--check-only checks Triton (interpreter) and an --option variant against torch_ref
    and times nothing: no floor, no sweep, no chart; mla-long-k8 runs only when named."""
    assert "mla-long-k8" in {c.name for c in C.all_cases()}
    assert "mla-long-k8" not in {c.name for c in C.default_cases(True)}
    out = tmp_path / "check"
    code = cli_main(["--batch", "2", "--prefix", "24", "--topk", "2", "--num-steps", "3",
                     "--mla", "--steps", "--quick", "--backend", "triton", "--option",
                     "triton:plan=dot-wide,num_splits=2", "--check-only", "--out",
                     str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    rows = report.read_csv(str(out / "bench.csv"))
    assert [(r["variant"], r["status"]) for r in rows] == [
        ("triton", "checked"), ("triton/per-branch", "checked"),
        ("triton[plan=dot-wide,num_splits=2]", "checked")]
    assert all(float(r["max_err"]) < 2e-2 and not r["time_us"] for r in rows)
    table = (out / "table.md").read_text()
    assert "--check-only" in table and "(not timed)" in table
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "table.md", "versions.json"]
    assert cli_main(["--option", "triton:nope=1", "--check-only"]) == 2
    assert "--option" in capsys.readouterr().err


# --- the GPU control flow with a fake clock ---------------------------------------------------

class FakeGraphClock:
    """Stands in for CudaClock: 'captures' by returning the function, fixed times (a device
    span: 5 ms)."""

    name = "fake"
    graphs = True

    def __init__(self, fail_capture=False):
        self.fail_capture = fail_capture
        self.captured = 0
        self.spans = 0

    def time(self, fn):
        fn()
        return 2.0

    def span(self, fn):
        self.spans += 1
        fn()
        return 5.0

    def graph(self, fn):
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured += 1
        return fn


def _graph_backend(calls):
    class GraphRef(TorchRefDecode, name="bench_graphs"):
        supports_cuda_graph = True

        def init_cuda_graph_state(self, max_bs, max_num_tokens):
            calls.append(("state", max_bs, max_num_tokens))
            super().init_cuda_graph_state(max_bs, max_num_tokens)

        def init_forward_metadata_capture_cuda_graph(self, batch):
            calls.append("capture")
            super().init_forward_metadata_capture_cuda_graph(batch)

        def init_forward_metadata_replay_cuda_graph(self, batch, bs):
            calls.append(("replay", bs))
            super().init_forward_metadata_replay_cuda_graph(batch, bs)

    return GraphRef


def test_graph_step_and_round_protocol(scoped_registry):
    calls = []
    cls = _graph_backend(calls)
    case = tiny()
    setup = build_setup(case, "cpu", max_layers=2)
    variant = Variant("g", "bench_graphs", "default", "torch", lambda s: cls(s.runner, 2, 4),
                      graphs=True)
    clock = FakeGraphClock()
    res = measure_variant(variant, setup, clock, round_layers=2)
    assert res.status == "ok" and res.step_timing == "graph"
    assert res.step_ms == pytest.approx(2.0 / len(setup.layers))
    assert res.round_eager_ms == 2.0 and res.round_graph_ms == 2.0 and res.round_layers == 2
    # The step, round and engine-round backends all go through the graph protocol (the
    # round's graph: one replay call, timed once by the fake clock); the engine round
    # captures one graph per rotating layer and calls the replay metadata before each
    # replay: a warm-up loop, then ENGINE_SPANS spans of ENGINE_ROUNDS rounds.
    state = [("state", case.batch, case.lanes), "capture"]
    assert calls[:7] == state * 2 + [("replay", case.batch)] + state
    assert calls[7:] == [("replay", case.batch)] * (ENGINE_SPANS + 1) * ENGINE_ROUNDS
    assert clock.captured == 2 + len(setup.layers) and clock.spans == ENGINE_SPANS
    assert res.engine_round_ms == pytest.approx(5.0 / ENGINE_ROUNDS)
    assert res.engine_host_ms >= 0 and not res.notes
    row = result_row(case, setup.lengths, variant, res, 1e12)
    assert row["round_us"] == pytest.approx(5e3 / ENGINE_ROUNDS)
    assert row["round_host_us"] == pytest.approx(res.engine_host_ms * 1e3)


def test_graph_capture_failure_falls_back_to_eager(scoped_registry):
    cls = _graph_backend([])
    setup = build_setup(tiny(), "cpu")
    variant = Variant("g", "bench_graphs", "default", "torch", lambda s: cls(s.runner, 2, 4),
                      graphs=True)
    res = measure_variant(variant, setup, FakeGraphClock(fail_capture=True))
    assert res.status == "ok" and res.step_timing == "eager" and res.round_graph_ms is None
    assert any("graph capture failed" in n for n in res.notes)
    assert any("round graph failed" in n for n in res.notes)
    assert any("engine round failed" in n for n in res.notes) and res.engine_round_ms is None


class FakeNow:
    """A host clock that a call moves on by a fixed amount."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def after(self, seconds, log=None, name=""):
        def fn():
            self.t += seconds
            if log is not None:
                log.append(name)
        return fn


def test_engine_round_times_host_around_the_metadata_call_only():
    """[metadata; replay] back to back, layers rotating; host time around the metadata
    call alone (a replay's host time is not in it), the device span over the rounds."""
    from specattn.bench.harness import engine_round

    now, log = FakeNow(), []
    metadata = now.after(40e-6, log, "m")
    replays = [now.after(1.0, log, f"r{i}") for i in range(3)]
    clock = FakeGraphClock()
    round_ms, host_ms = engine_round(metadata, replays, clock, rounds=4, spans=3, now=now)
    assert log[:8] == ["m", "r0", "m", "r1", "m", "r2", "m", "r0"]
    assert len(log) == 2 * 4 * (1 + 3) and clock.spans == 3
    assert round_ms == pytest.approx(5.0 / 4) and host_ms == pytest.approx(0.040)


def test_parts_report_the_replay_metadata_host_time(scoped_registry):
    """--parts with graphs: the host time of the replay metadata call, after a capture of
    the graph protocol, beside the metadata call's."""
    from specattn.bench.parts import measure_parts

    calls = []
    cls = _graph_backend(calls)
    setup = build_setup(tiny(), "cpu", max_layers=2)
    variant = Variant("g", "bench_graphs", "default", "torch", lambda s: cls(s.runner, 2, 4),
                      graphs=True)
    parts = measure_parts(variant, setup, FakeGraphClock(), reps=1)
    host = [p for p in parts if p["kind"] == "host"]
    assert [p["part"] for p in host] == ["init_forward_metadata",
                                         "init_forward_metadata_replay_cuda_graph"]
    assert all(p["us"] > 0 for p in host)
    assert calls[:2] == [("state", 3, 6), "capture"]
    assert calls[2:] == [("replay", 3)] * 11  # one warm-up call, then ten timed


def test_parts_host_time_leaves_the_synchronisation_out():
    from specattn.bench.parts import host_us

    now, log = FakeNow(), []
    us = host_us(now.after(25e-6, log, "call"), now.after(1.0, log, "sync"), reps=3, now=now)
    assert us == pytest.approx(25.0)
    assert log == ["call"] + ["sync", "call"] * 3 + ["sync"]


# --- the read floor (Triton interpreter on the CPU) -------------------------------------------

@pytest.mark.parametrize("kind,model,page,ragged", [
    ("decode", "mha", 1, True), ("decode", "mla", 4, True), ("decode", "mha", 16, False),
    ("extend", "mha", 4, True), ("extend", "mla", 1, False)])
def test_read_floor_reads_every_byte_of_the_case(kind, model, page, ragged):
    """The read-floor kernel reads the copy floor's bytes, no more, no less: the case's
    prefix slots through its slot table and every lane's history at the timed step
    (extend: every request's tokens), each row whole from the layer's own pools (MHA: K and
    V, rows of 2 x 16; MLA: 32 + 8, a row with a tail), with a partial last program."""
    from specattn.bench import floors
    from specattn.metadata import prefix_token_slots

    case = dataclasses.replace(tiny(kind, model, ragged=ragged, page=page), batch=4)
    setup = build_setup(case, "cpu", max_layers=2)
    slots = floors.case_slots(setup)
    assert slots.dtype == torch.int32
    assert slots.numel() * case.row_bytes == case.kv_bytes(setup.lengths)
    b = setup.batch
    prefix, valid = prefix_token_slots(setup.runner.req_to_token, b.req_pool_indices,
                                       b.seq_lens)
    listed = set(prefix[valid].tolist())
    if kind == "decode":
        listed |= set(b.out_cache_loc[:, :, :case.timed_step + 1].reshape(-1).tolist())
    assert set(slots.tolist()) == listed and len(listed) == slots.numel()  # each slot once
    n = slots.numel()
    keys = (n & -n) * 2  # rows a program: the least power of two that does not divide n
    launches, out = floors.read_launches(setup, tile_bytes=keys * case.row_bytes)
    assert len(launches) == len(setup.layers) and out.numel() == -(-n // keys)
    assert n % keys  # the last program is partial
    for layer, launch in enumerate(launches):
        out.zero_()
        launch()
        pools = floors.case_pools(setup, layer)
        assert len(pools) == (1 if model == "mla" else 2)
        for p in range(out.numel()):  # each program: its slots' rows, every element
            mine = slots[keys * p:keys * (p + 1)].long()
            want = sum(pool[mine].double().sum() for pool in pools)
            assert float(out[p]) == pytest.approx(float(want), rel=1e-4, abs=1e-3)


def test_read_floor_row_split():
    from specattn.bench.floors import split_row
    from specattn.errors import InvalidInputError

    assert split_row(1024) == (1024, 0) and split_row(576) == (512, 64)
    assert split_row(40) == (32, 8) and split_row(1) == (1, 0)
    with pytest.raises(InvalidInputError, match="row: expected a sum of two powers"):
        split_row(704)  # 512 + 192
    with pytest.raises(InvalidInputError, match="row: expected an int >= 1"):
        split_row(0)


class ListClock(FakeGraphClock):
    """A graph clock whose timings are taken from a list."""

    def __init__(self, times, **kw):
        super().__init__(**kw)
        self.times = list(times)

    def time(self, fn):
        fn()
        return self.times.pop(0)


def test_read_floor_is_timed_as_a_step_and_keeps_the_least_tile():
    """Each tile size: one warm-up call of every layer's launch, one graph of them all, its
    time over the layers (as time_step); the least tile's time; a tile that fails is a
    note and the others stand; when every tile fails the error propagates."""
    from specattn.bench.floors import read_floor_ms

    setup = build_setup(tiny(), "cpu", max_layers=2)
    tiles = ((256, 4), (512, 4), (1024, 8))
    clock = ListClock([3.0, 1.0, 2.0])
    ms, timing, notes = read_floor_ms(setup, clock, tiles)
    assert (ms, timing, notes) == (pytest.approx(1.0 / len(setup.layers)), "graph", [])
    assert clock.captured == 3
    ms, _, _ = read_floor_ms(setup, ListClock([6.0, 4.0, 8.0]), ((256, 4), (7, 4), (512, 4)))
    assert ms == pytest.approx(2.0)  # the tile under one row: one key a program
    failing = FakeGraphClock(fail_capture=True)
    ms, timing, notes = read_floor_ms(setup, failing, ((256, 4),))
    assert timing == "eager" and any("graph capture failed" in n for n in notes)
    bad = dataclasses.replace(tiny(), shape=(6, 3, 8))  # rows of 24 elements: 16 + 8
    ms, _, _ = read_floor_ms(build_setup(bad, "cpu", max_layers=2), FakeGraphClock(),
                             ((256, 4),))
    assert ms == pytest.approx(1.0)
    odd = dataclasses.replace(tiny(), shape=(7, 7, 4))  # 28 = 16 + 12: no kernel for it
    from specattn.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="row"):
        read_floor_ms(build_setup(odd, "cpu", max_layers=2), FakeGraphClock(), ((256, 4),))


def test_read_floor_rows_and_ratios(scoped_registry, monkeypatch, tmp_path):
    """run_cases with the read floor: per case the copy floor, the read floor, then the
    variants; every row but the copy floor's gets its ratio to the read floor, in the CSV
    and both tables; a read floor that fails is a failed row with the reason."""
    from specattn.bench import run

    case = tiny()
    plans = run.plan_cases([case], current_platform(), ["torch_ref"], raw=False)
    progress = ItemProgress(2, "t", io.StringIO())
    rows = run.run_cases(plans, torch.device("cpu"), FakeGraphClock(), 1e12, progress,
                         round_layers=1, read_floor=True)
    assert [(r["variant"], r["status"]) for r in rows] == [
        (report.FLOOR, "floor"), (report.READ_FLOOR, "floor"), ("torch_ref", "ok")]
    assert progress.done == 2
    report.add_ratios(rows)
    copy, read, ref = rows
    read_us = 2.0e3 / 2  # the fake clock's 2 ms over the two rotating layers
    assert read["time_us"] == pytest.approx(read_us) and read["timing"] == "graph"
    assert read["x_read_floor"] == pytest.approx(1.0)
    assert read["x_floor"] == pytest.approx(read_us / copy["time_us"])
    assert ref["x_read_floor"] == pytest.approx(ref["time_us"] / read_us)
    assert copy.get("x_read_floor") is None
    table = report.render_table(rows)
    assert "| x copy floor | x read floor |" in table and f"| {report.READ_FLOOR} |" in table
    report.write_csv(rows, str(tmp_path / "bench.csv"))
    back = report.read_csv(str(tmp_path / "bench.csv"))
    assert float(back[2]["x_read_floor"]) == pytest.approx(ref["x_read_floor"], rel=1e-5)
    assert float(back[2]["read_floor_us"]) == pytest.approx(read_us)
    from specattn.bench import floors

    def boom(*a, **k):
        raise RuntimeError("out of resources: shared memory")
    monkeypatch.setattr(floors, "read_floor_ms", boom)
    rows = run.run_cases(plans, torch.device("cpu"), FakeGraphClock(), 1e12,
                         ItemProgress(2, "t", io.StringIO()), round_layers=1, read_floor=True)
    assert rows[1]["status"] == "failed" and "out of resources" in rows[1]["error"]
    assert rows[2].get("read_floor_us") is None
    assert report.add_ratios(rows)[2].get("x_read_floor") is None


def test_sdpa_baseline_matches_reference():
    setup = build_setup(tiny(topk=3, dtype=torch.float32), "cpu")
    be = SDPAPerLane(setup.runner, 3, 4)
    be.init_forward_metadata(setup.batch)
    layer = AttentionLayer(0, 0.25)
    for step in range(3):
        out = be.forward(step, layer, *setup.inputs[step])
    ref = reference_decode(setup.runner, layer, setup.inputs[2][0], setup.batch, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_append_merges_by_case(tmp_path):
    from specattn.bench import _merge

    old = [_row("x", "x", "shared", 1.0, case="a"), _row("x", "x", "shared", 2.0, case="b")]
    report.write_csv(old, str(tmp_path / "bench.csv"))
    report.write_csv([{"topk": 1, "prefix": 512, "variant": "x", "time_us": 3.0}],
                     str(tmp_path / "sweep.csv"), report.SWEEP_COLUMNS)
    report.write_csv([{"case": c, "lengths": "uniform", "variant": "x", "part": "p", "us": 1}
                      for c in "ab"], str(tmp_path / "parts.csv"), report.PARTS_COLUMNS)
    new = [_row("y", "y", "shared", 9.0, case="b")]
    new_parts = [{"case": "b", "lengths": "uniform", "variant": "y", "part": "q", "us": 2}]
    rows, sweep, parts = _merge(str(tmp_path), new, [{"topk": 1, "prefix": 1024}], new_parts)
    assert [(r["case"], r["variant"]) for r in rows] == [("a", "x"), ("b", "y")]
    assert [int(r["prefix"]) for r in sweep] == [512, 1024]
    assert [(r["case"], r["part"]) for r in parts] == [("a", "p"), ("b", "q")]
    assert _merge(str(tmp_path / "missing"), new, []) == (new, [], [])


# --- progress, CLI, README ---------------------------------------------------------------------

def test_progress_plain_text():
    """Not a terminal (a log): one line per item as it starts, nothing redrawn."""
    buf = io.StringIO()
    with ItemProgress(4, "bench", buf) as p:
        p.start("a")
        p.advance()
        p.advance()
        p.start("b")
        p.advance()
    assert buf.getvalue().splitlines() == ["[1/4] a", "[3/4] b"]


def test_cli_errors(capsys):
    assert cli_main(["--case", "nope"]) == 2
    assert "--case" in capsys.readouterr().err
    assert cli_main(["--list-cases"]) == 0
    assert "gqa-long: MHA B=32 L=4096 K=8 S=5 P=1 bfloat16" in capsys.readouterr().out
    assert cli_main(["--case", "extend", "--steps"]) == 2
    capsys.readouterr()
    assert cli_main(["--case", "cpu", "--backend", "torch_ref", "tritn"]) == 2
    assert capsys.readouterr().err.strip().endswith("did you mean 'triton'?), got 'tritn'")


@pytest.mark.parametrize("flag,value", [("--reps", "0"), ("--round-layers", "0"),
                                        ("--round-layers", "-1"), ("--threads", "0"),
                                        ("--threads", "-2")])
def test_cli_counts_below_one_are_usage_errors(flag, value, tmp_path, capsys):
    """A round of no layers was timed as its metadata call alone (and its tokens/s reported),
    ``--threads 0`` was ignored and ``-2`` a torch traceback: each is a usage error naming the
    flag, before anything runs."""
    out = tmp_path / "out"
    assert cli_main(["--case", "cpu-gqa-small", "--device", "cpu", "--check-only", "--out",
                     str(out), flag, value]) == 2
    err = capsys.readouterr().err
    assert err == f"specattn bench: error: {flag}: expected an int >= 1, got {value}\n"
    assert not out.exists()


def test_cli_only_sweep_with_check_only_is_a_usage_error(tmp_path, capsys):
    """``--only-sweep --check-only`` ran nothing and exited 0, rewriting an ``--append``
    folder's header as "nothing timed" and its versions.json's copy bandwidth as null."""
    out = tmp_path / "out"
    assert cli_main(["--only-sweep", "--check-only", "--device", "cpu", "--append", "--out",
                     str(out)]) == 2
    assert capsys.readouterr().err == ("specattn bench: error: --only-sweep: expected no "
                                       "--check-only (the sweep has nothing to check without "
                                       "timing it), got --check-only\n")
    assert not out.exists()


def test_cli_sweep_rows_keep_their_spread(tmp_path):
    """The sweep's rows carry each timing's spread, which the noise warning reads (a noisy
    sweep had passed unremarked)."""
    out = tmp_path / "out"
    assert cli_main(["--only-sweep", "--quick", "--backend", "torch_ref", "--reps", "2",
                     "--device", "cpu", "--out", str(out)]) == 0
    rows = report.read_csv(str(out / "sweep.csv"))
    assert rows and all(float(r["spread"]) >= 0 for r in rows)


def test_cli_out_that_is_not_a_folder_is_a_usage_error(tmp_path, capsys):
    """``--out`` naming a file (or a path under one) is refused in one line, before the copy
    bandwidth is measured; it was a FileExistsError traceback after it."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for out in (afile, afile / "sub"):
        assert cli_main(["--case", "cpu-gqa-small", "--device", "cpu", "--check-only",
                         "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"specattn bench: error: --out: expected a folder it can create "
                              f"or write to, got '{out}' (") and err.count("\n") == 1


def test_cli_out_folders_that_cannot_take_the_run_are_usage_errors(tmp_path, capsys):
    """Refused before anything is measured: a folder that cannot be written (it failed at the
    first checkpoint, a traceback); a folder holding a run, without ``--append`` (its sweep,
    parts and charts stayed beside the new files); ``--append`` into a run of another machine
    or libraries (the header and versions.json then described every row as this run's)."""
    import json
    import os
    import stat

    base = ["--case", "cpu-gqa-small", "--device", "cpu", "--check-only", "--quick"]
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if not os.access(locked, os.W_OK):  # (root writes anywhere)
            assert cli_main(base + ["--out", str(locked)]) == 2
            assert "--out: expected a folder it can create or write to" in capsys.readouterr().err
    finally:
        locked.chmod(stat.S_IRWXU)
    out = tmp_path / "run"
    assert cli_main(base + ["--out", str(out)]) == 0
    capsys.readouterr()
    assert cli_main(base + ["--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"specattn bench: error: --out: expected a folder "
                                       f"without a run, or --append to merge into it, got "
                                       f"'{out}', which holds one (bench.csv)\n")
    assert cli_main(base + ["--out", str(out), "--append"]) == 0
    capsys.readouterr()
    # A case name of the folder with another shape (every custom shape is "custom"): its
    # rows would be replaced by another shape's.
    custom = ["--batch", "1", "--prefix", "16", "--device", "cpu", "--check-only", "--quick",
              "--backend", "torch_ref", "--no-raw", "--out", str(out), "--append"]
    assert cli_main(custom) == 0
    capsys.readouterr()
    assert cli_main(custom + ["--mla"]) == 2
    assert capsys.readouterr().err.startswith("specattn bench: error: --append: expected case "
                                              "'custom' of the folder's shape (decode, mha, ")
    info = json.loads((out / "versions.json").read_text())
    (out / "versions.json").write_text(json.dumps(dict(info, gpu="NVIDIA H200")))
    assert cli_main(base + ["--out", str(out), "--append"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specattn bench: error: --append: expected a folder of a run on this "
                          "machine, with these libraries (one folder per run), got gpu "
                          "'NVIDIA H200' there, None here"), err


def test_cli_seed_reps_and_steps_flags(tmp_path, capsys, monkeypatch):
    """``--seed`` beyond a 64-bit seed is a usage error (every variant had failed); a
    ``--reps`` given is kept with ``--quick`` (it was cut to 5); ``--steps`` takes a prefix
    shorter than the extend case's tokens (it runs no extend case)."""
    from specattn.bench import harness

    assert cli_main(["--case", "cpu-gqa-small", "--device", "cpu", "--check-only",
                     "--seed", str(2 ** 64), "--out", str(tmp_path / "s")]) == 2
    assert "--seed: expected an int in [0, 2**63)" in capsys.readouterr().err
    seen = []
    real = harness.WallClock.__init__

    def record(self, reps, *args, **kwargs):
        seen.append(reps)
        real(self, reps, *args, **kwargs)

    monkeypatch.setattr(harness.WallClock, "__init__", record)
    for extra, reps in ((["--reps", "9"], 9), ([], 5)):
        assert cli_main(["--batch", "1", "--prefix", "4", "--steps", "--quick", "--no-round",
                         "--device", "cpu", "--backend", "torch_ref", "--no-raw", "--check-only",
                         "--out", str(tmp_path / f"r{reps}"), *extra]) == 0
        assert seen[-1] == reps
    capsys.readouterr()


def test_header_names_the_step_of_cases_with_few_steps():
    """A decode case of ``S`` 3 is timed at step 1 (two history slots): the header said step 2
    for every case."""
    from specattn.bench import _header

    info = {"cpu": "x", "cpu_capability": "AVX2", "torch_threads": 1, "torch": "2"}
    rows = [dict(_row("x", "x", "default", 5.0, case="custom", steps=3), round_layers=2),
            _row("x", "x", "default", 5.0, case="custom-extend", kind="extend", steps=3),
            _row("x", "x", "default", 5.0, case="cpu-gqa-small", steps="5"),
            _row("x", "x", "default", 5.0, case="one", steps="1")]
    assert C.timed_step(3) == C.Case("c", "mha", 1, 64, 2, 3).timed_step == 1
    header = _header(info, 1e10, "wall, median", False, rows)
    assert ("one forward of one layer at step 2 (3 history slots; custom: step 1; one: step 0;"
            " KV write included) or one draft extend") in header
    plain = _header(info, 1e10, "wall, median", False, rows[1:3])
    assert "at step 2 (3 history slots; KV write included) or one" in plain
    # Rows without a timed round (--check-only, --no-round): no "x - layers".
    assert "x 2 layers (wall, median, eager)" in header
    assert "x the round's layers (no round timed in this run)" in plain and " - layers" not in plain


def test_default_out_dir_is_a_cache_folder_that_keeps_an_earlier_run(tmp_path, monkeypatch):
    """Without --out, results go to the user's cache folder, not the working directory; a
    folder that holds a run is not overwritten: the new run gets ``-2``, then ``-3``;
    ``--append`` merges into the folder itself."""
    import argparse
    import datetime

    from specattn.bench import _out_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    info = {"gpu": None, "cpu": "x"}
    fresh = argparse.Namespace(out=None, append=False)
    base = _out_dir(fresh, info)
    assert base == str(tmp_path / "cache" / "specattn" / "bench"
                       / f"{datetime.date.today().isoformat()}-cpu")
    os.makedirs(base)
    assert _out_dir(fresh, info) == base  # an empty folder holds no run
    for folder, following in ((base, base + "-2"), (base + "-2", base + "-3")):
        os.makedirs(folder, exist_ok=True)
        (pathlib.Path(folder) / "bench.csv").write_text("case\n")
        assert _out_dir(fresh, info) == following
    assert _out_dir(argparse.Namespace(out=None, append=True), info) == base
    assert _out_dir(argparse.Namespace(out="mine", append=False), info) == "mine"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _out_dir(fresh, info).startswith(str(tmp_path / "home" / ".cache" / "specattn"))
    assert not any(tmp_path.glob("benchmarks"))


def test_wall_clock_reports_median_and_spread():
    """torch.utils.benchmark medians: a run that alternates fast and slow calls has a wide
    spread, a steady one a narrow one."""
    import time as _time

    calls = []

    def jittery():
        calls.append(1)
        _time.sleep(0.002 if len(calls) % 2 else 0.008)

    clock = WallClock(8)
    ms = clock.time(jittery)
    # A warm-up and an estimate, then at least four blocks: ~8 warm-ups' time, up to 3x that
    # while the spread stays above 10%.
    assert 6 <= len(calls) <= 40
    # (A steady call's spread is not asserted: on a shared 2-core machine sleeps jitter.)
    assert 1.5 < ms < 20 and clock.last_spread > report.NOISY_SPREAD


def test_rate_lines_name_each_compute_bound_row():
    """table.md lists the TFLOP/s note of every timed row of a compute-bound case (from the
    run, a list; from an appended CSV, one string), and nothing for failed rows."""
    note = "451 TFLOP/s (65% of the bf16 matmul rate 692 TFLOP/s, same process)"
    rows = [{"case": "mla-wide", "lengths": "uniform", "variant": "triton", "status": "ok",
             "notes": [note]},
            {"case": "mla-wide", "lengths": "ragged", "variant": "fa", "status": "ok",
             "notes": "graph capture failed (x); 300 TFLOP/s"},
            {"case": "mla-wide", "lengths": "uniform", "variant": "b", "status": "failed",
             "notes": [note]},
            {"case": "mla-long", "lengths": "uniform", "variant": "triton", "status": "ok",
             "notes": []}]
    assert report.rate_lines(rows) == [f"- mla-wide (uniform), triton: {note}",
                                       "- mla-wide (ragged), fa: 300 TFLOP/s"]


def test_noise_warning_names_the_worst_timing():
    rows = [{"case": "c", "variant": "a", "status": "ok", "spread": 0.02},
            {"case": "c", "variant": "b", "status": "ok", "spread": 0.35},
            {"case": "c", "variant": "floor", "status": "floor"}]
    text = report.noise_warning(rows)
    assert text.startswith("warning: 1 of 2 timings spread more than 10%")
    assert "worst 35%, c b" in text and "--clock cpu" in text
    assert report.noise_warning(rows[:1]) == ""
    # The sweep's timings count too (its rows had no spread): named by their point.
    sweep = [{"topk": 4, "prefix": 2048, "batch": 4, "variant": "a", "status": "ok",
              "spread": 0.5}]
    text = report.noise_warning(rows[:1] + sweep)
    assert text.startswith("warning: 1 of 2 timings") and "worst 50%, sweep K 4 L 2048 a" in text
    table = report.render_table(report.add_ratios([dict(r, lengths="uniform", time_us=5.0,
                                                        kind="decode", lanes=4, backend="x")
                                                   for r in rows[:2]]), cpu=True)
    assert "| c | uniform | b | 5.0 | 35% |" in table


def test_cli_end_to_end_and_readme(tmp_path, capsys):
    out = tmp_path / "2026-11-29-cpu"
    threads = torch.get_num_threads()
    try:
        code = cli_main(["--batch", "2", "--prefix", "40", "--topk", "2", "--num-steps", "4",
                         "--quick", "--reps", "2", "--round-layers", "1", "--threads", "1",
                         "--parts", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    rows = report.read_csv(str(out / "bench.csv"))
    got = {(r["case"], r["variant"]): r for r in rows}
    assert got[("custom", "intel_amx")]["status"] == "ok"
    assert float(got[("custom", "intel_amx")]["x_vs_torch_ref"]) > 0
    assert got[("custom", SDPAPerLane.label)]["mode"] == "raw"
    assert got[("custom-extend", "torch_ref")]["status"] == "ok"
    assert {r["status"] for r in rows} == {"floor", "ok"}
    info = json.loads((out / "versions.json").read_text())
    assert info["torch"] == torch.__version__ and info["copy_bandwidth_gbs"] > 0
    table = (out / "table.md").read_text()
    assert "| custom | uniform | intel_amx |" in table
    parts = report.read_csv(str(out / "parts.csv"))  # --parts: every timed variant's parts
    timed = {(r["case"], r["variant"]) for r in rows if r["status"] == "ok"}
    assert {(p["case"], p["variant"]) for p in parts} == timed
    assert "## Step parts" in table and "| custom | uniform | intel_amx | init_forward_metadata" \
        " | host |" in table
    assert f"wrote {out}/" in stdout  # and the same table, fitted to the terminal
    printed = [line.split() for line in stdout.splitlines()]
    assert any(cells[:3] == ["custom", "uniform", "intel_amx"] for cells in printed)
    pngs = sorted(p.name for p in out.iterdir() if p.suffix == ".png")
    if HAS_MPL:
        assert "case-custom-uniform.png" in pngs
    else:
        assert not pngs and "matplotlib is not installed" in table

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import make_readme_performance as mrp
    finally:
        sys.path.pop(0)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Performance\n\n{mrp.START}\nOLD-TEXT\n{mrp.END}\ntail\n")
    assert mrp.main([str(out), "--readme", str(readme), "--check"]) == 1
    assert mrp.main([str(out), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "OLD-TEXT" not in text and text.endswith(f"{mrp.END}\ntail\n")
    assert "| custom | MHA B=2 L=40 K=2 S=4 P=1 | intel_amx |" in text
    assert "[`2026-11-29-cpu/table.md`](2026-11-29-cpu/table.md)" in text
    assert mrp.main([str(out), "--readme", str(readme), "--check"]) == 0
    readme.write_text("no markers\n")
    assert mrp.main([str(out), "--readme", str(readme)]) == 1


def test_readme_performance_section_is_generated():
    """The README's Performance section is what ``tools/make_readme_performance.py`` makes
    from the committed results folder it names (nothing typed by hand)."""
    readme = pathlib.Path(ROOT, "README.md").read_text()
    found = re.search(r"generated by `python (tools/make_readme_performance\.py) (\S+)`",
                      readme)
    assert found, "the README names the command that generated its Performance section"
    res = subprocess.run([sys.executable, found.group(1), found.group(2), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


@pytest.mark.gpu
def test_gpu_small_case_end_to_end(tmp_path):
    """On the GPU: every available backend passes the gate on gqa-small, with graph timing
    for graph-capable ones and a graph round."""
    out = tmp_path / "gpu"
    code = cli_main(["--case", "gqa-small", "--quick", "--no-sweep", "--out", str(out)])
    rows = report.read_csv(str(out / "bench.csv"))
    failed = [(r["variant"], r["error"]) for r in rows if r["status"] == "failed"]
    assert code == 0 and not failed, failed
    triton = next(r for r in rows if r["variant"] == "triton")
    assert triton["timing"] == "graph" and float(triton["round_graph_us"]) > 0
    assert float(triton["x_vs_per_branch"]) > 0 and float(triton["x_floor"]) > 0


def test_a_run_stopped_part_way_keeps_its_finished_cases(tmp_path, monkeypatch):
    """bench.csv and table.md are written after every case: a run killed in its second case
    (a timeout on the GPU host) leaves the first case's rows, ratios included."""
    from specattn.bench import run

    real = run._run_plan
    seen = []

    def stop_in_second_case(plan, *args, **kwargs):
        seen.append(plan.case.name)
        if len(seen) == 2:
            raise KeyboardInterrupt  # what a timeout's signal does to the process
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(run, "_run_plan", stop_in_second_case)
    out = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        cli_main(["--case", "cpu-gqa-small", "cpu-extend", "--device", "cpu", "--quick",
                  "--backend", "torch_ref", "--reps", "1", "--no-round", "--no-raw",
                  "--no-sglang", "--out", str(out)])
    rows = report.read_csv(str(out / "bench.csv"))
    assert {r["case"] for r in rows} == {"cpu-gqa-small"}
    timed = [r for r in rows if r["variant"] == "torch_ref"]
    assert timed and float(timed[0]["time_us"]) > 0 and timed[0]["x_floor"]
    table = (out / "table.md").read_text()
    assert table.startswith("# specattn bench") and "| cpu-gqa-small |" in table
    assert "cpu-extend" not in table


def test_versions_name_the_commit_a_gpu_run_was_given(monkeypatch):
    from specattn.bench.report import versions

    monkeypatch.delenv("SPECATTN_COMMIT", raising=False)
    assert "commit" not in versions(torch.device("cpu"))
    monkeypatch.setenv("SPECATTN_COMMIT", "abc1234")
    assert versions(torch.device("cpu"))["commit"] == "abc1234"


def test_append_check_only_keeps_a_timed_folders_bandwidth(tmp_path, capsys):
    """``--append --check-only`` into a timed folder: its header and versions.json keep the
    copy bandwidth its timed rows were measured with (they had become "nothing timed" and
    null); into a folder without one, the header says nothing was timed."""
    timed, fresh = tmp_path / "timed", tmp_path / "fresh"
    timed.mkdir()
    (timed / "versions.json").write_text(json.dumps({"copy_bandwidth_gbs": 123.4,
                                                     "command": "specattn bench --quick"}))
    args = ["--batch", "2", "--prefix", "24", "--topk", "2", "--num-steps", "3", "--device",
            "cpu", "--backend", "torch_ref", "--check-only", "--append", "--no-raw"]
    assert cli_main(args + ["--out", str(timed)]) == 0
    assert cli_main(args + ["--out", str(fresh)]) == 0
    capsys.readouterr()
    assert "copy bandwidth 123.4 GB/s" in (timed / "table.md").read_text()
    info = json.loads((timed / "versions.json").read_text())
    assert info["copy_bandwidth_gbs"] == 123.4 and info["command"].startswith(
        "specattn bench --quick && specattn bench ")
    assert "nothing timed" in (fresh / "table.md").read_text()
    assert json.loads((fresh / "versions.json").read_text())["copy_bandwidth_gbs"] is None
