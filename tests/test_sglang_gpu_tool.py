"""``tools/sglang_gpu.py`` on the CPU: its correctness path over SGLang's real draft loop
(float32, tiny shapes, SGLang's Triton backend under ``TRITON_INTERPRET=1``; one MHA and one
MLA case, eager), one timing point through the graph runner (an eager stand-in for its CUDA
graph), the tables it writes, ``draft_round.compare`` failing on wrong outputs, tokens and
KV, and what a draft step reads: ``kv_reads`` and the float32 models of ``UPSTREAM`` (synthetic
records, no SGLang)."""

from __future__ import annotations

import csv
import importlib.metadata
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch

from interpreter_patch_once import script_command
from specattn.integrations.sglang.draft_round import (Record, compare, kv_reads,
                                                      tree_verdict, upstream_check)

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
    cmd = script_command(os.path.join(ROOT, "tools", "sglang_gpu.py"), "--out", str(out),
                         "--device", "cpu", "--dtype", "fp32", "--tiny", "--backends",
                         "triton", "--case", "mha:2:4", "--case", "mla:1:1", "--perturb",
                         "--timing", "2x8", "--timing-topks", "2", "--models", "mha")
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


# --- what a draft step reads, and the float32 models of SGLang's backends ------------------------

def test_kv_reads_lane_path_prefix_and_packed():
    lane = kv_reads((3, 2), 2, 1, "lane")
    assert lane[0] == [("prefix", 0, 0, 3), ("draft", 0, 0, 0), ("draft", 0, 0, 1)]
    assert lane[3] == [("prefix", 1, 0, 2), ("draft", 1, 1, 0), ("draft", 1, 1, 1)]
    parents = torch.zeros(3, 2, 2, dtype=torch.long)  # [step, request, lane]
    parents[1, 1, 1] = 0                              # request 1's lane-1 token descends lane 0
    assert kv_reads((3, 2), 2, 1, "path", parents)[3][1:] == [("draft", 1, 0, 0),
                                                              ("draft", 1, 1, 1)]
    assert kv_reads((3, 2), 2, 1, "prefix") == [[("prefix", 0, 0, 3)]] * 2 + [
        [("prefix", 1, 0, 2)]] * 2
    # packed: the requests' prefix + step + 1 ids end to end, each read from the offset of
    # the prefixes alone: request 1 reads request 0's drafts, then its own prefix's head
    assert kv_reads((3, 4), 1, 0, "packed") == [[("prefix", 0, 0, 3)],
                                               [("draft", 0, 0, 0), ("prefix", 1, 0, 3)]]
    assert kv_reads((3, 2), 1, 1, "packed")[1] == [("draft", 0, 0, 0), ("draft", 0, 0, 1)]


H_, RANK, ROPE = 2, 8, 4   # a tiny MLA: keys [RANK + ROPE], values their first RANK


def _mla_round(lengths, reads_of, seed=0):
    """A fixture and a topk-1 record of an MLA round whose attention read, per step and
    request, the slots ``reads_of(step, b, r2t, loc)`` (float32, by hand)."""
    g = torch.Generator().manual_seed(seed)
    steps, bs, width = 3, len(lengths), max(lengths) + 3
    r2t = torch.arange(bs * width).view(bs, width) + 1
    loc = torch.stack([r2t[b, n:n + steps] for b, n in enumerate(lengths)]).view(bs, 1, steps)
    pool = torch.randn(bs * width + 1, 1, RANK + ROPE, generator=g)
    fx = SimpleNamespace(
        model="mla", shape=(H_, RANK, ROPE), lengths=tuple(lengths), batch=bs, loc=loc.flatten(),
        case=SimpleNamespace(topk=1, steps=steps), layer=SimpleNamespace(scaling=0.3),
        runner=SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=r2t)),
        pools=lambda: [pool])
    queries, outputs = [], []
    for step in range(steps - 1):
        q = torch.randn(bs, H_, RANK + ROPE, generator=g)
        out = torch.stack([torch.softmax(q[b] @ pool[reads_of(step, b, r2t, loc)][:, 0].T
                                         * 0.3, -1) @ pool[reads_of(step, b, r2t, loc)][:, 0, :RANK]
                           for b in range(bs)])
        queries.append(q.flatten(1))
        outputs.append(out.flatten(1))
    kv = pool[loc][:, :, :, 0].view(bs, 1, steps, -1)
    return fx, Record(None, [], [], queries, outputs, kv)


def _prefix_only(step, b, r2t, loc):
    return r2t[b, :(3, 5, 2)[b]]


def _packed(step, b, r2t, loc):  # SGLang's FlashInfer MLA replay, spelled out for (3, 5, 2)
    layout = torch.cat([torch.cat([r2t[x, :n], loc[x, 0, :step + 1]])
                        for x, n in enumerate((3, 5, 2))])
    start = sum((3, 5, 2)[:b])
    return layout[start:start + (3, 5, 2)[b]]


def _lane(step, b, r2t, loc):
    return torch.cat([r2t[b, :(3, 5, 2)[b]], loc[b, 0, :step + 1]])


class FlashInferMLAMultiStepDraftBackend:  # the name draft_round.UPSTREAM knows
    pass


@pytest.mark.parametrize("reads, mode, run", [(_prefix_only, "prefix", "eager"),
                                              (_packed, "packed", "graph")])
def test_upstream_model_matches_what_the_backend_read(reads, mode, run):
    fx, rec = _mla_round((3, 5, 2), reads)
    assert not tree_verdict(fx, rec, "lane", 1e-4).ok     # not the draft tree's attention
    got_mode, where, verdict = upstream_check(fx, rec, FlashInferMLAMultiStepDraftBackend(),
                                              run, 1e-4)
    assert got_mode == mode and verdict.ok, verdict.problems
    assert "flashinfer_mla_backend.py:" in where
    assert upstream_check(fx, rec, object(), run, 1e-4) is None  # no model for other classes


def test_lane_reference_matches_a_lane_round_and_no_upstream_model_does():
    fx, rec = _mla_round((3, 5, 2), _lane)
    assert tree_verdict(fx, rec, "lane", 1e-4).ok
    for mode in ("prefix", "packed"):
        assert not tree_verdict(fx, rec, mode, 1e-4).ok


def test_a_package_named_twice_is_one_stand_in():
    # The GPU host's list and the CPU list share `datasets`: the report names it once.
    from specattn.integrations.sglang import stubs

    name = "specattn_absent_package_for_stub_test"
    assert stubs.install([name, name]) == [name]
    assert stubs.installed().count(name) == 1


def test_a_stand_in_gives_the_packages_own_answers(monkeypatch):
    # matplotlib calls IPython.get_ipython() when it picks a backend (the bench's charts,
    # with SGLang's stand-ins in place): it answers None, as IPython does outside a shell.
    from specattn.integrations.sglang import stubs

    assert stubs._ANSWERS["IPython.get_ipython"]() is None
    name = "specattn_absent_package_with_answer"
    monkeypatch.setitem(stubs._ANSWERS, f"{name}.get_shell", lambda: None)
    stubs.install([name])
    module = __import__(name)
    assert module.get_shell() is None
    with pytest.raises(Exception, match="import-only stand-in was called"):
        module.anything_else()
