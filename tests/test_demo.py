"""``specattn demo``: smoke runs over its options, and the draft loop against a dense oracle.

The dense oracle runs the same random model token by token with its own contiguous KV lists
(no pools, no slots, no specattn backend): each draft node is recomputed along its true
ancestry, so in ``path`` mode every cumulative score of the tree must match it.
"""

from __future__ import annotations

import io
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import torch

import specattn
from specattn.allocator import PagedKVAllocator
from specattn.backends.torch_ref import reference_decode
from specattn.demo import cli_main
from specattn.demo.cli import _make_runner, build_parser
from specattn.demo.eagle import TOLERANCES, DraftTree, EagleDrafter, ErrorMeter
from specattn.demo.model import DraftModel, ModelConfig
from specattn.demo.render import lane_divergence, render_tree
from specattn.platforms import Platform, current_platform, use_platform

SMALL = ["--batch", "2", "--min-len", "5", "--max-len", "21", "--steps", "3",
         "--rounds", "2", "--layers", "1", "--device", "cpu"]
ERR_LINE = re.compile(r"(extend|decode): (\S+).* max abs error (\S+) over (\d+) calls "
                      r"\(max \|ref\| (\S+); tolerance (\S+) \+ (\S+)\*\|ref\|\): (\w+)")


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    code = cli_main(argv, out=out)
    return code, out.getvalue()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("tree_mode", ["lane", "path"])
@pytest.mark.parametrize("page_size,topk", [(1, 1), (1, 4), (16, 1), (16, 4)])
def test_demo_smoke(mla, tree_mode, page_size, topk):
    argv = SMALL + ["--tree-mode", tree_mode, "--page-size", str(page_size),
                    "--topk", str(topk), "--seed", str(page_size + topk)]
    code, text = run(argv + (["--mla"] if mla else []))
    assert code == 0, text
    assert f"platform: {current_platform()}" in text
    # The classes built (the selection's steps only with --explain).
    assert "requested 'auto'" not in text and "rule" not in text
    assert re.search(r"-> extend: \w+ \(specattn\.", text)
    assert ("MLA" if mla else "GQA") + " draft model" in text
    assert f"tree mode {tree_mode}" in text
    # A tree: the root line, then one line per node with its lane and score.
    assert re.search(r"req 0: prefix \d+ tokens, root token +\d+", text)
    nodes = re.findall(r"[|`]- +\d+ p=[0-9.]+ L(\d+)", text)
    assert len(nodes) == 2 * 2 * 3 * topk  # 2 rounds x 2 trees x 3 depths x topk lanes
    assert {int(j) for j in nodes} == set(range(topk))
    # Lane mode reports how many drafted nodes did not attend to their ancestry.
    assert ("lane mode: " in text) == (tree_mode == "lane" and topk > 1)
    # The torch_ref comparison: both kinds, below the bf16 tolerance.
    errs = ERR_LINE.findall(text)
    assert [e[0] for e in errs] == ["extend", "decode"], text
    for kind, _, err, calls, ref, atol, rtol, verdict in errs:
        assert int(calls) > 0 and verdict == "OK"
        assert float(err) <= float(atol) + float(rtol) * float(ref)
        assert float(err) < 0.1


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_demo_dtypes_and_backend_by_name(dtype):
    code, text = run(SMALL + ["--dtype", dtype, "--backend", "torch_ref", "--trees", "0",
                              "--topk", "2"])
    assert code == 0, text
    assert "-> extend: torch_ref" in text and "decode: torch_ref" in text
    assert "torch_ref (the reference itself) vs torch_ref" in text
    assert "req 0:" not in text  # --trees 0


def test_demo_single_step_has_no_decode_backend():
    code, text = run(SMALL[:-6] + ["--steps", "1", "--rounds", "2", "--layers", "1",
                                   "--device", "cpu"])
    assert code == 0, text
    assert "decode: none (num_steps == 1" in text
    assert "no decode attention calls" in text


def test_demo_is_deterministic_per_seed():
    strip = lambda t: re.sub(r"done in .*", "", t)  # noqa: E731
    a, b, c = (run(SMALL + ["--seed", s])[1] for s in ("3", "3", "4"))
    assert strip(a) == strip(b)
    assert strip(a) != strip(c)


def test_demo_explain_and_a_true_total(capsys):
    """--explain prints the selection's steps; the total counts from ``started`` (the
    command passes specattn's import), with the rounds' own share beside it."""
    import time

    code, text = run(SMALL + ["--trees", "0", "--explain"])
    assert code == 0 and "extend: requested 'auto'" in text and "decode: requested 'auto'" in text
    assert "(rule 16)" in text
    out = io.StringIO()
    assert cli_main(SMALL + ["--trees", "0", "--no-check"], out=out,
                    started=time.perf_counter() - 100) == 0
    total, rounds = re.search(r"done in ([\d.]+) s \(([\d.]+) s of draft rounds",
                              out.getvalue()).groups()
    assert float(total) >= 100 > float(rounds)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_total_counts_from_the_process_start():
    """specattn._STARTED is the process's start, not the import: half a second of work
    before ``import specattn`` is in the total; a shell that forks, waits, then execs the
    command (``sh -c 'sleep 3; exec ...'``) does not add its wait."""
    probe = ("import time; {}before = time.perf_counter(); import specattn; "
             "print(before - specattn._STARTED)")
    root = pathlib.Path(__file__).resolve().parents[1]  # this checkout's specattn
    since = float(subprocess.run([sys.executable, "-c", probe.format("time.sleep(0.5); ")],
                                 capture_output=True, text=True, check=True, cwd=root,
                                 timeout=120).stdout)
    assert since >= 0.5
    forked = subprocess.run(["sh", "-c", f"sleep 3; exec {shlex.quote(sys.executable)} -c "
                             f"{shlex.quote(probe.format(''))}"], capture_output=True,
                            text=True, check=True, cwd=root, timeout=120).stdout
    assert float(forked) < 1  # from the import: the 3 s wait is not counted


def test_the_command_skips_the_exit_collections_after_the_total(monkeypatch, capsys):
    """Run as the program, ``main`` freezes the garbage collector's objects when the command
    is done: the collections at exit over torch's objects took 0.4 s after the printed
    total; in-process calls (tests, argv given) leave the collector alone."""
    import gc

    from specattn.cli import main

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    monkeypatch.setattr(sys, "argv", ["specattn", "list", "--kind", "decode"])
    assert main() == 0 and frozen == [True]
    assert main(["list", "--kind", "decode"]) == 0 and frozen == [True]
    capsys.readouterr()


def test_demo_says_before_round_0_when_triton_kernels_make_it_slow(scoped_registry):
    from specattn.backends.torch_ref import TorchRefDecode, TorchRefExtend

    triton = (("triton", "triton>=3.2"),)

    class Decode(TorchRefDecode, name="triton_like_demo", requires=triton, priority=-5):
        pass

    class Extend(TorchRefExtend, name="triton_like_demo", requires=triton, priority=-5):
        pass

    with use_platform(Platform("cpu", None, libraries=frozenset({"triton"}))):
        code, text = run(SMALL + ["--backend", "triton_like_demo", "--trees", "0"])
    assert code == 0, text
    note = text.index("Triton kernels run in Triton's interpreter on this CPU")
    assert note < text.index("round 0:")
    code, text = run(SMALL + ["--backend", "torch_ref", "--trees", "0"])
    assert code == 0 and "Triton" not in text
    # On a GPU the first calls compile the kernels: the same line says so.
    from specattn.demo.render import slow_start_note

    gpu = Platform("cuda", (9, 0), libraries=frozenset({"triton"}))
    assert slow_start_note([Extend.__new__(Extend), None], gpu) == (
        "round 0 compiles the Triton kernels on their first calls (seconds)...")
    assert slow_start_note([None, None], gpu) == ""


def test_demo_through_the_specattn_command(capsys):
    from specattn.cli import main

    assert main(["demo"] + SMALL + ["--trees", "1", "--no-check"]) == 0
    text = capsys.readouterr().out
    assert "check against torch_ref skipped" in text and "req 0:" in text


def test_demo_selects_for_the_device_it_runs_on():
    """``--device cpu`` on a GPU machine picks among CPU backends, not the GPU's."""
    with use_platform(Platform("cuda", (9, 0), libraries=frozenset({"triton", "flashinfer"}))):
        code, text = run(SMALL + ["--trees", "0", "--explain"])
    assert code == 0, text
    assert "platform: cpu" in text and "on cpu" in text and "on cuda" not in text


@pytest.mark.parametrize("argv,code,message", [
    (["--min-len", "9", "--max-len", "3"], 2, "--min-len 9 > --max-len 3"),
    (["--topk", "0"], 2, "expected an int >= 1"),
    (["--topk", "257"], 2, "error: --topk 257 > the model's 256 tokens"),
    (["--tree-mode", "tree"], 2, "invalid choice"),
    (["--backend", "no_such_backend"], 1, "unknown backend 'no_such_backend'; known names: "),
    (["--backend", "torch_rf"], 1, "error: unknown backend 'torch_rf'; did you mean "
                                   "'torch_ref'?\n"),
    (["--backend", "flashmla", "--mla"], 1, "BackendUnavailableError"),
])
def test_demo_usage_errors(argv, code, message, capsys):
    assert cli_main(SMALL + argv, out=io.StringIO()) == code
    assert message in capsys.readouterr().err


def test_demo_flags_a_wrong_backend(scoped_registry, capsys):
    """A decode backend that attends before writing the new KV must fail the check."""
    from specattn.backends.torch_ref import TorchRefDecode, TorchRefExtend

    class AttendsFirst(TorchRefDecode, name="attends_first_demo", priority=-5):
        def forward(self, step, layer, q, k, v):
            o = reference_decode(self.runner, layer, q, self.batch, step, self.tree_mode)
            self.runner.write_kv(layer.layer_id, self.batch.out_cache_loc[:, :, step], k, v)
            return o

    class Extend(TorchRefExtend, name="attends_first_demo", priority=-5):
        pass  # a correct extend, so only decode is flagged

    code, text = run(SMALL + ["--backend", "attends_first_demo", "--dtype", "fp32",
                              "--topk", "2"])
    assert code == 1
    assert re.search(r"decode: attends_first_demo vs torch_ref: .*: MISMATCH", text)
    assert re.search(r"extend: .*: OK", text)


# --- the draft loop against a dense oracle ----------------------------------------------------

def _dense_attend(cache: list, mla: bool, kv_lora_rank: int):
    """attend(layer, q, k, v) over an explicit growing per-layer KV list (causal, float64)."""
    def attend(layer, q, k, v):
        ks, vs = cache[layer.layer_id]
        ks.append(k.double())
        vs.append(k[:, :kv_lora_rank].double() if mla else v.double())
        kk, vv = torch.cat(ks), torch.cat(vs)           # [n, (H_kv,) d]
        if mla:
            kk, vv = kk[:, None], vv[:, None]
        group = q.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
        s = torch.einsum("thd,nhd->htn", q.double(), kk) * layer.scaling
        t, n = q.shape[0], kk.shape[0]
        visible = torch.arange(n)[None, :] <= (n - t + torch.arange(t))[:, None]
        s = s.masked_fill(~visible[None], float("-inf"))
        return torch.einsum("htn,nhd->thd", s.softmax(-1), vv).to(q.dtype)
    return attend


class DenseOracle:
    """Probabilities of the next token after ``committed`` + a draft chain, recomputed with
    contiguous KV lists. The committed part runs once (hidden input zeros, as the demo's
    extend); each chain token runs once (hidden input = its parent's output, as EAGLE)."""

    def __init__(self, model: DraftModel, committed: list[int]) -> None:
        self.model, self.n = model, len(committed)
        cache = [([], []) for _ in range(model.cfg.num_layers)]
        logits, hidden = model(torch.tensor(committed), torch.arange(self.n), None,
                               self._attend(cache))
        self.memo = {(): (cache, torch.softmax(logits[-1], -1), hidden[-1:])}

    def _attend(self, cache):
        return _dense_attend(cache, self.model.cfg.mla, self.model.cfg.kv_lora_rank)

    def probs(self, chain: tuple[int, ...]) -> torch.Tensor:
        if chain not in self.memo:
            self.probs(chain[:-1])  # the parent first
            cache, _, h = self.memo[chain[:-1]]
            cache = [(list(ks), list(vs)) for ks, vs in cache]  # branch: copy the lists
            pos = torch.tensor([self.n + len(chain) - 1])
            logits, hidden = self.model(torch.tensor(chain[-1:]), pos, h, self._attend(cache))
            self.memo[chain] = (cache, torch.softmax(logits[0], -1), hidden)
        return self.memo[chain][1]


def _build(mla: bool, backend: str, *, topk: int, steps: int, page: int, tree_mode: str):
    args = build_parser().parse_args(["--batch", "2", "--max-len", "13", "--topk", str(topk),
                                      "--steps", str(steps), "--page-size", str(page),
                                      "--rounds", "2", "--device", "cpu"])
    cfg = ModelConfig(num_layers=2, mla=mla, hidden=64, num_q_heads=4, num_kv_heads=2,
                      head_dim=16, num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16, vocab_size=64)
    model = DraftModel(cfg, seed=7, dtype=torch.float32)
    runner = _make_runner(cfg, args, torch.float32)
    factory = specattn.DraftBackendFactory(
        specattn.SpecConfig(attention_backend=backend, page_size=page), runner, topk, steps,
        tree_mode=tree_mode)
    meter = ErrorMeter(torch.float32)
    drafter = EagleDrafter(model, runner, PagedKVAllocator(runner),
                           factory.create_draft_extend_backend(),
                           factory.create_decode_backend(), topk=topk, num_steps=steps,
                           tree_mode=tree_mode, meter=meter)
    return model, drafter, meter


@pytest.mark.parametrize("backend,mla,page,topk", [
    ("torch_ref", False, 1, 3), ("auto", False, 4, 3), ("auto", True, 4, 2),
    ("torch_ref", True, 1, 1)])
def test_path_tree_scores_match_dense_recompute(backend, mla, page, topk):
    """Path mode is exact EAGLE: every node's cumulative score equals its parent's times the
    dense model's probability of its token given the true ancestry; the tree's per-depth
    selection is the top-k of the expanded scores. Checked over two rounds (the second
    starts from an extend of accepted + bonus tokens)."""
    steps = 4
    model, drafter, meter = _build(mla, backend, topk=topk, steps=steps, page=page,
                                   tree_mode="path")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 64, (n,), generator=gen) for n in (6, 13)]
    committed = [p.tolist() for p in prompts]
    drafter.add_requests(prompts)
    for _ in range(2):
        tree = drafter.draft()
        for b in range(2):
            oracle = DenseOracle(model, committed[b])
            top_p, top_i = oracle.probs(()).topk(topk)
            assert tree.tokens[0, b].tolist() == top_i.tolist()
            torch.testing.assert_close(tree.scores[0, b], top_p.float(), rtol=1e-4, atol=1e-6)
            for d in range(1, steps):
                # All K*K candidates of depth d, from the dense probs of each parent.
                cand = []
                for pj in range(topk):
                    lanes = tree.ancestry(d - 1, b, pj)
                    chain = [int(tree.tokens[t, b, lanes[t]]) for t in range(d)]
                    p, i = oracle.probs(tuple(chain)).topk(topk)
                    cand += [(float(tree.scores[d - 1, b, pj]) * float(pp), pj, int(ii))
                             for pp, ii in zip(p, i)]
                best = sorted(cand, key=lambda c: -c[0])[:topk]
                torch.testing.assert_close(tree.scores[d, b],
                                           torch.tensor([c[0] for c in best]),
                                           rtol=1e-4, atol=1e-7)
                assert tree.tokens[d, b].tolist() == [c[2] for c in best]
                assert tree.parents[d, b].tolist() == [c[1] for c in best]
        counts, new = drafter.simulate_acceptance(tree, gen)
        for b in range(2):
            lanes = tree.best_path(b)
            assert new[b][:-1].tolist() == [int(tree.tokens[d, b, lanes[d]])
                                            for d in range(counts[b])]
            committed[b] += new[b].tolist()
        drafter.extend(new)
    assert meter.ok and meter.calls["decode"] == 2 * 2 * (steps - 1)


def test_path_parents_are_filled_before_each_step():
    """``batch.parents[i]`` holds the tree's row ``i`` when step ``i`` runs (in place, one
    tensor for the round), and rows after ``i`` are still unwritten."""
    _, drafter, _ = _build(False, "torch_ref", topk=3, steps=4, page=1, tree_mode="path")
    seen = []
    backend = drafter.decode_backend
    inner = backend.forward

    def spy(step, layer, q, k, v):
        if layer.layer_id == 0:
            seen.append((step, backend.batch.parents.clone(), backend.batch.parents))
        return inner(step, layer, q, k, v)
    backend.forward = spy
    drafter.add_requests([torch.arange(5), torch.arange(9)])
    tree = drafter.draft()
    assert [s for s, _, _ in seen] == [0, 1, 2]
    assert len({id(t) for _, _, t in seen}) == 1  # the same tensor every step
    for step, snapshot, _ in seen:
        for i in range(1, step + 1):
            assert snapshot[i].tolist() == tree.parents[i].tolist()
        assert not snapshot[step + 1:].any()


def test_lane_mode_histories_are_upstream_lanes():
    """Lane mode: the same top-k selection, but step ``i`` of lane ``j`` attends to lane
    ``j``'s slots; the demo marks every forwarded node whose lane is not its ancestry."""
    _, drafter, meter = _build(False, "auto", topk=3, steps=4, page=4, tree_mode="lane")
    drafter.add_requests([torch.arange(7), torch.arange(12)])
    tree = drafter.draft()
    assert meter.ok
    lines = render_tree(tree, 0, tree_mode="lane")
    marked = sum("~" in line for line in lines[1:])
    expected = sum(any(a != j for a in tree.ancestry(d, 0, j)[:-1])
                   for d in range(1, tree.depth - 1) for j in range(3))
    assert marked == expected


def test_tree_helpers_on_a_hand_built_tree():
    # depth 1: lanes 0,1; depth 2: both children of lane 1; depth 3: children of 0 and 1.
    tree = DraftTree(root=torch.tensor([9]), prefix_lens=torch.tensor([4]),
                     tokens=torch.tensor([[[10, 11]], [[20, 21]], [[30, 31]]]),
                     parents=torch.tensor([[[-1, -1]], [[1, 1]], [[1, 0]]]),
                     scores=torch.tensor([[[.6, .4]], [[.3, .1]], [[.05, .2]]]))
    assert tree.ancestry(2, 0, 0) == [1, 1, 0]
    assert tree.ancestry(2, 0, 1) == [1, 0, 1]
    assert tree.best_path(0) == [1, 0, 1]
    lines = render_tree(tree, 0, tree_mode="lane", accepted=2)
    assert lines[0].startswith("req 0: prefix 4 tokens, root token   9")
    # lane 0's depth-1 node has no children; lane 1's has both depth-2 nodes.
    assert [ln.split("p=")[0].strip() for ln in lines[1:]] == [
        "|-  10", "`-  11", "|-  20", "|  `-  31", "`-  21", "`-  30"]
    assert lines[1].endswith("L0") and lines[2].endswith("*+") and lines[3].endswith("*+~")
    assert lines[4].endswith("*") and lines[5].endswith("L1") and lines[6].endswith("L0")
    assert lane_divergence(tree) == (1, 2)  # depth-2 nodes: lane 0 descends from lane 1
    # Path mode never marks '~' (the history is the ancestry by construction).
    assert not any("~" in ln for ln in render_tree(tree, 0, tree_mode="path"))


def test_error_meter_tolerances():
    meter = ErrorMeter(torch.bfloat16)
    ref = torch.ones(4, 2, 8)
    meter.update("decode", ref + 0.01, ref)
    assert meter.ok and meter.max_err["decode"] == pytest.approx(0.01, rel=1e-3)
    meter.update("decode", ref.masked_fill(ref > 0, float("nan")), ref)
    assert not meter.ok and meter.max_err["decode"] == float("inf")
    meter = ErrorMeter(torch.float32)
    meter.update("extend", ref + 1e-4, ref)
    assert meter.failed["extend"] and TOLERANCES[torch.float32][0] < 1e-4
