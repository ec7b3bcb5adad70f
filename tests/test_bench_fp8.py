"""``specattn bench`` with FP8 pools: the ``fp8`` cases and their bytes, pools written as the
library writes them, the ``dequant`` baseline, refusals, ratios and a CPU run of the CLI."""

from __future__ import annotations

import io

import pytest
import torch

from specattn.backends.torch_ref import (TorchRefDecode, TorchRefExtend, reference_decode,
                                         reference_extend)
from specattn.bench import cli_main
from specattn.bench import cases as C
from specattn.bench import floors, report
from specattn.bench.baselines import DequantStep
from specattn.bench.harness import (Variant, WallClock, build_setup, discover_variants,
                                    measure_variant, tolerance)
from specattn.bench.run import floor_row
from specattn.fp8 import dequantize, dequantize_into, quantize
from specattn.platforms import Platform, current_platform

E4M3 = torch.float8_e4m3fn
H200 = Platform("cuda", (9, 0), libraries=frozenset({"flashinfer", "flash_attn.cute",
                                                     "flash_mla", "triton"}))


def small(name: str, **kw) -> C.Case:
    """The FP8 case ``name`` at a CPU size (its model and kind; GQA 4/2 heads of 16, MLA rank
    32 + rope 8)."""
    case = C.find_cases([name])[0]
    shape = (4, 2, 16) if case.model == "mha" else (4, 32, 8)
    return case.with_(**{"batch": 3, "prefix": 20, "topk": min(case.topk, 2), "steps": 4,
                         "shape": shape, "ragged": True, **kw})


# --- cases and their bytes --------------------------------------------------------------------

def test_fp8_cases_are_their_twins_with_e4m3_pools():
    names = [c.name for c in C.FP8_CASES]
    assert names == ["gqa-long-fp8", "gqa-long-fp8-extend", "mla-long-fp8",
                     "mla-long-fp8-extend", "gqa-b1-32k-fp8", "gqa-b1-32k-fp8-extend",
                     "mla-b1-32k-fp8", "mla-b1-32k-fp8-extend"]
    twins = {c.name: c.twin for c in C.FP8_CASES}
    assert twins == {"gqa-long-fp8": "gqa-long", "gqa-long-fp8-extend": "extend",
                     "mla-long-fp8": "mla-long", "mla-long-fp8-extend": "",
                     "gqa-b1-32k-fp8": "gqa-b1-32k",
                     "gqa-b1-32k-fp8-extend": "gqa-b1-32k-extend",
                     "mla-b1-32k-fp8": "mla-b1-32k",
                     "mla-b1-32k-fp8-extend": "mla-b1-32k-extend"}
    for case in C.FP8_CASES:
        assert case.kv_cache_dtype == "fp8_e4m3" and case.fp8
        assert (case.k_scale, case.v_scale) == (0.45, 0.3)
        assert case.dtype == torch.bfloat16 and case.kv_dtype_name == "fp8_e4m3"
        if case.twin:  # the twin's shape and batch, only the pools differ
            twin = C.find_cases([case.twin])[0]
            assert case.with_(name=twin.name, kv_cache_dtype="auto", k_scale=1.0,
                              v_scale=1.0, twin="") == twin
    extend = C.find_cases(["mla-long-fp8-extend"])[0]
    assert (extend.kind, extend.topk, extend.batch, extend.prefix) == ("extend", 1, 32, 4096)
    assert C.find_cases(["fp8"]) == list(C.FP8_CASES)
    assert set(names) <= {c.name for c in C.default_cases(True)}
    assert not set(names) & {c.name for c in C.default_cases(False)}


def test_fp8_bytes_and_floors_are_half_the_bf16_ones():
    gqa = C.find_cases(["gqa-long-fp8"])[0]
    assert gqa.element_size == 1 and gqa.row_bytes == 8 * (128 + 128)
    lens = gqa.lengths()
    assert gqa.kv_bytes(lens) == (32 * 4096 + 32 * 8 * 3) * 2048
    assert C.find_cases(["mla-b1-32k-fp8"])[0].row_bytes == 576
    for case in C.FP8_CASES:
        bf16 = case.with_(kv_cache_dtype="auto")
        for ragged in (False, True):
            c, b = case.with_(ragged=ragged), bf16.with_(ragged=ragged)
            lens = c.lengths(seed=5)
            assert 2 * c.kv_bytes(lens) == b.kv_bytes(lens)
            assert 2 * floor_row(c, lens, 4e12)["floor_us"] == pytest.approx(
                floor_row(b, lens, 4e12)["floor_us"])
    # Ragged lengths are the twin's, so the two rows compare the same requests.
    fp8 = C.find_cases(["gqa-long-fp8"])[0].with_(ragged=True)
    assert fp8.lengths(3) == C.find_cases(["gqa-long"])[0].with_(ragged=True).lengths(3)
    assert len(set(fp8.lengths(3))) > 1


def test_case_and_custom_shape_errors():
    from specattn.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="--kv-cache-dtype: expected one of auto"):
        C.custom_case(kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(InvalidInputError, match="case.k_scale"):
        C.find_cases(["gqa-long-fp8"])[0].with_(k_scale=0.0)
    ext = C.custom_case(batch=2, prefix=40, extend=True, kv_cache_dtype="fp8_e5m2")
    assert (ext.name, ext.kind, ext.kv_cache_dtype, ext.k_scale) == (
        "custom-fp8-extend", "extend", "fp8_e5m2", 0.45)
    assert "kv fp8_e5m2 k_scale 0.45 v_scale 0.3" in ext.describe()
    assert C.find_cases(["mla-long-fp8"])[0].describe().endswith("kv fp8_e4m3 k_scale 0.45")


# --- the setup, the read floor ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["gqa-long-fp8", "mla-b1-32k-fp8-extend"])
def test_setup_pools_hold_the_codes_of_the_scaled_kv(name):
    """The pools are FP8 with the case's scales on every layer; what they hold is standard
    normal KV divided by the scale (so K and V codes spread as 1/k_scale and 1/v_scale)."""
    case = small(name)
    setup = build_setup(case, "cpu")
    r = setup.runner
    assert r.kv_cache_dtype == "fp8_e4m3" and r.dtype == torch.bfloat16
    assert all((layer.k_scale, layer.v_scale) == (0.45, 0.3) for layer in setup.layers)
    pools = ([(p, 0.45) for p in r.kv_buffer] if case.model == "mla"
             else [(p, 0.45) for p in r.k_buffer] + [(p, 0.3) for p in r.v_buffer])
    for pool, scale in pools:
        assert pool.dtype == E4M3
        spread = float(pool.float().std())
        assert spread == pytest.approx(1 / scale, rel=0.15)
        assert float(dequantize(pool, scale).std()) == pytest.approx(1.0, rel=0.15)


@pytest.mark.parametrize("name", ["gqa-long-fp8", "mla-long-fp8-extend"])
def test_read_floor_reads_the_fp8_bytes(name):
    """The read floor's launch reads one byte per element: the pools as uint8, the copy
    floor's bytes through the case's slots (Triton interpreter)."""
    case = small(name)
    setup = build_setup(case, "cpu", max_layers=2)
    slots = floors.case_slots(setup)
    assert slots.numel() * case.row_bytes == case.kv_bytes(setup.lengths)
    pools = floors.case_pools(setup, 1)
    assert {p.dtype for p in pools} == {torch.uint8}
    assert sum(p.shape[1] for p in pools) == case.row_bytes
    launches, out = floors.read_launches(setup, tile_bytes=8 * case.row_bytes)
    launches[1]()
    want = sum(float(p[slots.long()].double().sum()) for p in pools)
    assert float(out.double().sum()) == pytest.approx(want)


# --- the dequant baseline --------------------------------------------------------------------

def test_dequantize_into_is_dequantize_in_the_out_dtype():
    codes = quantize(torch.randn(64, 8) * 4, 0.37, E4M3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = torch.full(codes.shape, 7.0, dtype=dtype)
        assert dequantize_into(out, codes, 0.37) is out
        assert torch.equal(out, dequantize(codes, 0.37, dtype))
    out = torch.empty(codes.shape, dtype=torch.bfloat16)
    assert torch.equal(dequantize_into(out, codes, torch.tensor([2.0])),
                       dequantize(codes, 2.0, torch.bfloat16))


@pytest.mark.parametrize("name", ["gqa-long-fp8", "mla-long-fp8", "gqa-b1-32k-fp8-extend"])
def test_dequant_step_runs_the_bf16_backend_over_the_dequantized_pool(name):
    """One call: the new KV quantized into the FP8 pool, the layer's whole pool dequantized
    into the bf16 scratch (codes x k_scale, codes x v_scale), the bf16 backend over it; the
    output is the attention of the FP8 pool (the reference on the FP8 runner)."""
    case = small(name, ragged=False)
    setup = build_setup(case, "cpu", max_layers=2)
    r, layer = setup.runner, setup.layers[1]
    made = []

    def make(runner):
        made.append(runner)
        if case.kind == "decode":
            return TorchRefDecode(runner, case.topk, case.steps)
        return TorchRefExtend(runner)

    step = DequantStep(r, make)
    scratch = made[0]
    assert scratch.kv_cache_dtype == "auto" and scratch.dtype == torch.bfloat16
    assert scratch.req_to_token is r.req_to_token and scratch.num_layers == r.num_layers
    step.init_forward_metadata(setup.batch)
    if case.kind == "decode":
        for s in range(3):
            out = step.forward(s, layer, *setup.inputs[s])
        ref = reference_decode(r, layer, setup.inputs[2][0], setup.batch, 2)
        loc = setup.batch.out_cache_loc[:, :, 2].reshape(-1)
        new_k = setup.inputs[2][1]
    else:
        out = step.forward(layer, *setup.inputs[0])
        ref = reference_extend(r, layer, setup.inputs[0][0], setup.batch)
        loc, new_k = setup.batch.out_cache_loc, setup.inputs[0][1]
    mla = case.model == "mla"
    fp8 = [r.kv_buffer[1]] if mla else [r.k_buffer[1], r.v_buffer[1]]
    bf16 = [scratch.kv_buffer[1]] if mla else [scratch.k_buffer[1], scratch.v_buffer[1]]
    for codes, values, scale in zip(fp8, bf16, (0.45, 0.3)):
        assert torch.equal(values, dequantize(codes, scale, torch.bfloat16))  # whole pool
    written = quantize(new_k.reshape(loc.numel(), -1), 0.45, E4M3)
    assert torch.equal(fp8[0].view(torch.uint8)[loc].reshape(loc.numel(), -1),
                       written.view(torch.uint8))
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert 0 < err <= 1e-2  # bf16 values of the FP8 pool, not the pool itself


def test_dequant_step_keeps_the_graph_protocol_of_its_backend(scoped_registry):
    """With a graph-capable bf16 backend the dequant row is timed as a graph replay: the
    graph calls reach the backend, and the step, round and engine round run."""
    from test_bench import FakeGraphClock, _graph_backend

    calls = []
    cls = _graph_backend(calls)
    case = small("gqa-long-fp8")
    setup = build_setup(case, "cpu", max_layers=2)
    variant = Variant("g/dequant", "bench_graphs", "dequant", "torch",
                      lambda s: DequantStep(s.runner, lambda r: cls(r, 2, 4)), graphs=True)
    res = measure_variant(variant, setup, FakeGraphClock(), round_layers=2)
    assert res.status == "ok" and res.step_timing == "graph" and not res.notes
    assert res.round_graph_ms == 2.0 and res.engine_round_ms is not None
    assert calls[:2] == [("state", case.batch, case.lanes), "capture"]
    assert ("replay", case.batch) in calls


def test_fp8_variants_dequant_rows_and_refusals(scoped_registry):
    """CPU: each backend with its dequant row, no raw baseline (bf16 pools only; named: not
    run, with the reason); a backend that serves no FP8 pool is not run, with the
    factory's reason. GPU (a stand-in H200): the FlashAttention backends say why."""
    class Bf16Only(TorchRefDecode, name="bench_bf16_only"):
        kv_cache_dtypes = ("auto",)

    case = small("gqa-long-fp8")
    variants, skipped = discover_variants(case, current_platform())
    assert [(v.label, v.mode) for v in variants] == [
        ("intel_amx", "default"), ("intel_amx/dequant", "dequant"),
        ("torch_ref", "default"), ("torch_ref/dequant", "dequant")]
    assert not skipped
    named, skipped = discover_variants(case, current_platform(),
                                       ["bench_bf16_only", "torch_ref", "sdpa-raw"])
    assert [v.label for v in named] == ["torch_ref", "torch_ref/dequant"]
    why = dict(skipped)
    assert why["bench_bf16_only"] == ("supports kv_cache_dtype ['auto'], got 'fp8_e4m3'")
    assert why["sdpa-raw"] == ("reads pools of the activation dtype only, not "
                               "kv_cache_dtype 'fp8_e4m3'")
    bf16, _ = discover_variants(case.with_(kv_cache_dtype="auto"), current_platform(),
                                ["bench_bf16_only"])
    assert [v.label for v in bf16] == ["bench_bf16_only"]  # no dequant row without FP8
    gpu = C.find_cases(["gqa-long-fp8"])[0]
    variants, skipped = discover_variants(gpu, H200, on_gpu=True)
    assert {"triton", "triton/dequant", "flashinfer", "flashinfer/dequant"} <= {
        v.label for v in variants}
    why = dict(skipped)
    assert why["fa4"].startswith("supports kv_cache_dtype ['auto'], got 'fp8_e4m3'; ")
    assert not any(v.raw for v in variants)
    mla, skipped = discover_variants(C.find_cases(["mla-long-fp8"])[0], H200, on_gpu=True)
    assert dict(skipped)["flashmla"].startswith("supports kv_cache_dtype ['auto']")


@pytest.mark.parametrize("name", ["mla-long-fp8", "gqa-long-fp8-extend"])
def test_fp8_variants_pass_the_gate_and_time(name):
    case = small(name)
    setup = build_setup(case, "cpu")
    variants, _ = discover_variants(case, current_platform(), ["torch_ref"])
    assert [v.mode for v in variants] == ["default", "dequant"]
    for v in variants:
        res = measure_variant(v, setup, WallClock(1), round_layers=1)
        assert res.status == "ok", (v.label, res.error)
        assert res.max_err <= tolerance(case.dtype) and res.step_ms > 0


def test_a_dequant_that_forgets_the_scale_fails_the_check(monkeypatch):
    """The check compares with the reference on the FP8 pool: a dequant without v_scale is
    a wrong result, not a row."""
    from specattn.bench import baselines

    monkeypatch.setattr(baselines, "layer_scales", lambda layer, mla: (layer.k_scale, 1.0))
    case = small("gqa-long-fp8")
    setup = build_setup(case, "cpu")
    variants, _ = discover_variants(case, current_platform(), ["torch_ref"])
    res = measure_variant(variants[1], setup, WallClock(1))
    assert res.status == "failed" and "wrong result" in res.error


# --- ratios, table, CLI ----------------------------------------------------------------------

def _row(case, variant, t, mode="shared", status="ok", **kw):
    fp8 = case.endswith("-fp8")
    base = {"case": case, "lengths": "uniform", "kind": "decode", "steps": 5, "lanes": 64,
            "kv_bytes": 5e8 if fp8 else 1e9, "floor_us": 125.0 if fp8 else 250.0,
            "variant": variant, "backend": variant.split("/")[0], "mode": mode,
            "status": status, "time_us": t, "kv_dtype": "fp8_e4m3" if fp8 else "bfloat16",
            "k_scale": 0.45 if fp8 else None, "v_scale": 0.3 if fp8 else None,
            "twin_case": "g" if fp8 else ""}
    base.update(kw)
    return base


def _fp8_rows():
    return report.add_ratios([
        _row("g", report.FLOOR, 250.0, "floor", "floor"),
        _row("g", report.READ_FLOOR, 300.0, "read-floor", "floor"),
        _row("g", "triton", 330.0), _row("g", "triton/per-branch", 900.0, "per-branch"),
        _row("g-fp8", report.FLOOR, 125.0, "floor", "floor"),
        _row("g-fp8", report.READ_FLOOR, 160.0, "read-floor", "floor"),
        _row("g-fp8", "triton", 176.0), _row("g-fp8", "triton/per-branch", 500.0,
                                             "per-branch"),
        _row("g-fp8", "triton/dequant", 704.0, "dequant"),
        _row("g-fp8", "torch_ref", 8800.0, "default"),
        _row("g-fp8", "fa4", None, "", "unsupported", error="supports kv_cache_dtype"),
    ])


def test_fp8_ratios():
    rows = _fp8_rows()
    got = {(r["case"], r["variant"]): r for r in rows}
    fp8 = got[("g-fp8", "triton")]
    assert fp8["x_read_floor"] == pytest.approx(1.1)
    assert fp8["x_vs_bf16"] == pytest.approx(330 / 176)
    assert fp8["x_vs_dequant"] == pytest.approx(4.0)
    assert fp8["x_vs_per_branch"] == pytest.approx(500 / 176)
    assert got[("g-fp8", "triton/per-branch")]["x_vs_dequant"] == pytest.approx(704 / 500)
    dq = got[("g-fp8", "triton/dequant")]
    assert dq.get("x_vs_per_branch") is None and dq["x_vs_dequant"] is None
    assert dq["x_vs_bf16"] is None and dq["x_read_floor"] == pytest.approx(4.4)
    assert got[("g-fp8", report.READ_FLOOR)]["x_vs_bf16"] == pytest.approx(300 / 160)
    assert got[("g-fp8", "torch_ref")]["x_vs_dequant"] is None  # no torch_ref/dequant row
    assert got[("g", "triton")].get("x_vs_dequant") is None
    assert got[("g", "triton")]["x_vs_bf16"] is None  # a bf16 row has no twin


def test_fp8_table_columns_and_lines(tmp_path):
    rows = _fp8_rows()
    head, body = report._table_cells(rows, cpu=False)
    assert head[5:9] == ["x read floor", "x vs per-branch", "x vs dequant", "x vs bf16"]
    line = dict(zip(head, body[6]))
    assert (line["variant"], line["x vs dequant"], line["x vs bf16"]) == ("triton", "4.00x",
                                                                          "1.88x")
    plain = [r for r in rows if r["case"] == "g"]
    assert "x vs dequant" not in report._table_cells(plain, cpu=False)[0]
    assert report.fp8_lines(rows) == [
        "- g-fp8 (uniform; kv fp8_e4m3, k_scale 0.45, v_scale 0.3): fastest triton, 176.0 us; "
        "1.10x its read floor; 0.53x its step on g; 4.00x faster than triton/dequant"]
    report.write_csv(rows, str(tmp_path / "bench.csv"))
    back = report.read_csv(str(tmp_path / "bench.csv"))
    assert report.fp8_lines(report.add_ratios(back)) == report.fp8_lines(rows)
    no_twin = [dict(r, twin_case="gone") for r in rows if r["case"] == "g-fp8"]
    assert "gone: no triton row in this run" in report.fp8_lines(
        report.add_ratios(no_twin))[0]
    buf = io.StringIO()
    from specattn._console import make_console

    report.print_table(rows, make_console(buf, width=400))
    assert "x vs dequant" in buf.getvalue()


def test_cli_fp8_run_on_the_cpu(tmp_path, capsys):
    """A custom FP8 shape on the CPU: torch_ref and its dequant row pass the check and are
    timed; the floor counts one byte per element; the CSV, table and notes show the pools."""
    out = tmp_path / "fp8"
    threads = torch.get_num_threads()
    try:
        code = cli_main(["--batch", "2", "--prefix", "40", "--topk", "2", "--num-steps", "4",
                         "--kv-cache-dtype", "fp8_e4m3", "--backend", "torch_ref", "--steps",
                         "--device", "cpu", "--quick", "--reps", "2", "--round-layers", "1",
                         "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    rows = report.read_csv(str(out / "bench.csv"))
    assert [(r["case"], r["variant"], r["status"]) for r in rows] == [
        ("custom-fp8", report.FLOOR, "floor"), ("custom-fp8", "torch_ref", "ok"),
        ("custom-fp8", "torch_ref/dequant", "ok")]
    floor, ref, dq = rows
    case = C.custom_case(batch=2, prefix=40, topk=2, steps=4)
    assert int(floor["kv_bytes"]) * 2 == case.kv_bytes(case.lengths())
    assert {(r["kv_dtype"], r["k_scale"], r["v_scale"]) for r in rows} == {
        ("fp8_e4m3", "0.45", "0.3")}
    assert float(ref["max_err"]) == 0 and 0 < float(dq["max_err"]) <= 1e-2
    assert dq["mode"] == "dequant" and float(dq["time_us"]) > 0
    assert float(ref["x_vs_dequant"]) == pytest.approx(
        float(dq["time_us"]) / float(ref["time_us"]), rel=1e-4)
    table = (out / "table.md").read_text()
    assert "| x vs dequant | x vs bf16 |" in table and "## FP8 pools" in table
    assert "- custom-fp8 (uniform; kv fp8_e4m3, k_scale 0.45, v_scale 0.3): fastest " \
        "torch_ref, " in table
    assert cli_main(["--kv-cache-dtype", "fp8_ds_mla", "--check-only"]) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err


def test_list_cases_shows_the_fp8_set(capsys):
    assert cli_main(["--list-cases"]) == 0
    listed = capsys.readouterr().out.splitlines()
    fp8 = [line for line in listed if line.endswith("[fp8]")
           or line.endswith("[fp8] (uniform lengths only)")]
    assert [line.split(":")[0] for line in fp8] == [c.name for c in C.FP8_CASES]
    assert ("gqa-b1-32k-fp8: MHA B=1 L=32768 K=4 S=5 P=1 bfloat16, kv fp8_e4m3 k_scale 0.45 "
            "v_scale 0.3 [fp8] (uniform lengths only)") in listed


def test_readme_shape_names_fp8_pools():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    try:
        import make_readme_performance as mrp
    finally:
        sys.path.pop(0)
    row = {"model": "mha", "batch": "32", "prefix": "4096", "kind": "decode", "topk": "8",
           "steps": "5", "page_size": "1"}
    assert mrp._shape(dict(row, kv_dtype="fp8_e4m3")) == "MHA B=32 L=4096 K=8 S=5 P=1 kv " \
        "fp8_e4m3"
    assert mrp._shape(dict(row, kv_dtype="bfloat16")) == mrp._shape(row)
