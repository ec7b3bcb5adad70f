"""``specattn bench``'s ``sglang/<name>`` rows (``specattn.bench.sglang_rows``) on the CPU:
SGLang's own draft round for a tiny float32 case (Triton interpreter; the graph runner with
an eager stand-in for its CUDA graph), SGLang's backend and specattn's through the plugin,
as rows the bench's report takes."""

from __future__ import annotations

import pytest
import torch

from specattn.bench import report
from specattn.bench.cases import Case
from specattn.bench.sglang_rows import merge_rows, sglang_names, sglang_rows


@pytest.mark.no_sglang
def test_names_follow_the_backend_option():
    assert sglang_names(None) == ["triton", "flashinfer"]
    assert sglang_names(["triton", "fa4"]) == ["triton"]
    assert sglang_names(["sglang/flashinfer"]) == ["flashinfer"]
    assert sglang_names(["sglang"]) == ["triton", "flashinfer"]
    assert sglang_names(["fa4"]) == []


@pytest.mark.no_sglang
def test_rows_go_after_their_case():
    rows = [{"case": "a", "lengths": "uniform"}, {"case": "b", "lengths": "uniform"}]
    extra = [{"case": "a", "lengths": "uniform", "variant": "sglang/triton"}]
    assert [r.get("variant") for r in merge_rows(rows, extra)] == [None, "sglang/triton", None]


def test_sglang_rows_of_a_tiny_case(sglang_cpu):
    case = Case("tiny", "mha", 2, 8, 2, 3, dtype=torch.float32, shape=(4, 2, 16))
    rows = sglang_rows([case], torch.device("cpu"), backends=["triton"])
    assert [r["variant"] for r in rows] == ["sglang/triton", "sglang/triton+specattn"]
    stock, spec = rows
    assert stock["status"] == spec["status"] == "ok", rows
    assert stock["round_graph_us"] > 0 and spec["time_us"] > 0
    assert spec["max_err"] < 1e-4 and "specattn triton" in spec["notes"][0]
    report.add_ratios(rows)
    assert "sglang/triton+specattn" in report.render_table(rows, cpu=True)
