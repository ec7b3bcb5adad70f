"""``tools/sglang_gpu.py`` on the CPU: its correctness path over SGLang's real draft loop
(float32, tiny shapes, SGLang's Triton backend under ``TRITON_INTERPRET=1``; one MHA and one
MLA case, eager), one timing point through the graph runner (an eager stand-in for its CUDA
graph), the tables it writes, and ``draft_round.compare`` failing on wrong outputs, tokens
and KV (synthetic records, no SGLang)."""

from __future__ import annotations

import csv
import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

from specattn.integrations.sglang.draft_round import Record, compare

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _sglang_missing() -> str:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "SGLang is not installed (docs/sglang.md)"
    return "" if version == "0.5.23" else f"the tool pins SGLang 0.5.23, found {version}"


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    if _sglang_missing():
        pytest.skip(_sglang_missing())
    out = tmp_path_factory.mktemp("sglang")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.path.abspath(ROOT)}
    cmd = [sys.executable, os.path.join(ROOT, "tools", "sglang_gpu.py"), "--out", str(out),
           "--device", "cpu", "--dtype", "fp32", "--tiny", "--backends", "triton",
           "--case", "mha:2:4", "--case", "mla:1:1", "--perturb",
           "--timing", "2x8", "--timing-topks", "2", "--models", "mha"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    return res, out


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.sglang
def test_tool_writes_the_tables_and_every_case_passes(tool_run):
    res, out = tool_run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = _rows(out / "results.csv")
    real = [r for r in rows if not r["mode"].endswith("perturbed")]
    assert {r["model"] for r in real} == {"mha", "mla"}
    assert {r["mode"] for r in real} == {"stock", "lane", "auto", "path"}
    assert all(r["status"] == "ok" for r in real), real
    lane = [r for r in real if r["mode"] == "lane"]
    assert all(r["tokens"] == "3/3" and r["served_by"].startswith("specattn triton")
               for r in lane)
    path = [r for r in real if r["mode"] == "path"]
    assert path and "rows differ from lane attention" in path[0]["note"]
    assert not path[0]["note"].startswith("0 of")  # topk 2: the tree re-ranks some lanes
    text = (out / "results.md").read_text()
    assert "## Correctness" in text and "## Timing" in text
    assert "calls of them: none" in text
    timing = _rows(out / "timing.csv")
    assert len(timing) == 1
    t = timing[0]
    assert float(t["stock_round_us"]) > 0 and float(t["specattn_round_us"]) > 0
    assert float(t["stock_step_us"]) > 0 and t["check"].startswith("ok"), t


@pytest.mark.sglang
def test_tool_fails_a_perturbed_output(tool_run):
    res, out = tool_run
    rows = [r for r in _rows(out / "results.csv") if r["mode"].endswith("perturbed")]
    assert len(rows) == 4 and all(r["status"] == "FAIL" for r in rows), rows
    assert all("attention output" in r["note"] for r in rows)
    assert "4 of 4 deliberately perturbed outputs caught" in (out / "results.md").read_text()


# --- compare on synthetic records -------------------------------------------------------------

BS, K, S, V, H = 3, 2, 3, 10, 8


def _record(seed: int = 0) -> Record:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(V, (BS * K,), generator=g) for _ in range(S - 1)]
    logits = [torch.randn(BS * K, V, generator=g) for _ in range(S - 1)]
    outs = [torch.randn(BS * K, H, generator=g) for _ in range(S - 1)]
    tree = (torch.zeros(BS, 4, dtype=torch.long), torch.zeros(BS, 4, dtype=torch.long),
            torch.randint(V, (BS, 5), generator=g))
    return Record(tree, ids, logits, [o.clone() for o in outs], outs,
                  torch.randn(BS, K, S, 6, generator=g))


def _copy(rec: Record) -> Record:
    return Record(tuple(t.clone() for t in rec.tree), [x.clone() for x in rec.input_ids],
                  [x.clone() for x in rec.logits], rec.queries,
                  [x.clone() for x in rec.outputs], rec.kv.clone())


def test_compare_equal_records_pass():
    ref = _record()
    v = compare(ref, _copy(ref), K, 2e-2)
    assert v.ok and v.tokens_equal == BS and v.out_err == 0


@pytest.mark.parametrize("what", ["output", "kv", "logits"])
def test_compare_fails_a_wrong_tensor(what):
    ref = _record()
    got = _copy(ref)
    target = {"output": got.outputs[1], "kv": got.kv[:, :, 0], "logits": got.logits[0]}[what]
    target[0] += 0.5 * target.abs().max()
    v = compare(ref, got, K, 2e-2)
    assert not v.ok and v.problems


def test_compare_tokens_that_differ_need_logits_within_tolerance():
    ref = _record()
    got = _copy(ref)
    got.input_ids[1][K:2 * K] += 1      # request 1 takes other tokens at selection 1
    got.outputs[1][K:2 * K] += 100.0    # ... so its later attention is not compared
    v = compare(ref, got, K, 2e-2)
    assert v.ok and v.near_ties == 1 and v.tokens_equal == BS - 1, v.problems
    got.logits[0][K:2 * K] += 1.0       # but the logits that chose them disagree
    v = compare(ref, got, K, 2e-2)
    assert not v.ok and "request 1" in v.problems[0]


def test_compare_a_last_selection_that_differs():
    ref = _record()
    got = _copy(ref)
    got.tree[2][0, -1] += 1             # only the final tree differs: chosen by forward S-2
    assert compare(ref, got, K, 2e-2).near_ties == 1
    got.logits[S - 2][:K] *= 3
    assert not compare(ref, got, K, 2e-2).ok
