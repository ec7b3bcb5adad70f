"""The ``specattn`` command: ``list``, ``select``, ``demo`` / ``bench`` delegation."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

import specattn
from specattn._logging import reset_once_registry
from specattn.cli import main, parse_platform
from specattn.errors import InvalidInputError
from specattn.platforms import Platform, current_platform
from specattn.registry import default_registry


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- list --------------------------------------------------------------------------------------

@pytest.mark.parametrize("columns", [80, 120])
def test_list_is_one_line_per_backend(capsys, monkeypatch, columns):
    """The default: a line per name (runs here?, the first reason or the kernel note), the
    full reasons only with --details."""
    monkeypatch.setenv("COLUMNS", str(columns))
    cpu = ["--platform", "cpu", "--with-library", "triton"]
    code, out, _ = run(capsys, "list", *cpu)
    assert code == 0
    lines = out.splitlines()
    names = sorted({n for k in ("decode", "extend") for n in default_registry.names(k)})
    rows = [line for line in lines if line.split() and line.split()[0] in names]
    assert [line.split()[0] for line in rows] == names
    assert len(lines) <= len(names) + 5 and all(len(line) <= columns for line in lines)
    # Short: no line padded to the table's width, a few words of reason a name (1418
    # characters for 16 names at 120 columns).
    assert all(line == line.rstrip() for line in rows)
    assert len(out) < 100 * len(names), len(out)
    table = {line.split()[0]: line.split(None, 2)[1:] for line in rows}
    assert table["torch_ref"] == ["yes"]
    if not parse_platform("cpu").triton_interpret:
        assert table["triton"][0] == "no"
        assert table["triton"][1].startswith("set TRITON_INTERPRET=1 to run it on this CPU")
        assert table["dsv4"] == table["triton"]  # what would make one flavour run, alone
    assert table["flashinfer"] == ["no", "needs CUDA"]
    # The flavours' needs in one reason (fa3: sm8x, sm90 and MUSA classes).
    assert table["fa3"] == ["no", "needs CUDA compute capability 8.x/9.0 or MUSA"]
    # A flavour whose platform fits says what else it needs; the others stay out.
    code, out, _ = run(capsys, "list", "--platform", "cuda:9.0", "--with-library", "none")
    table = {line.split()[0]: line.split(None, 2)[1:] for line in out.splitlines()
             if line.split() and line.split()[0] in names}
    assert table["dsv4"] == table["triton"]
    assert table["dsv4"][1].startswith("needs the 'triton' package")
    assert table["fa3"][1].startswith("needs a FlashAttention library")
    assert table["torch_ref"] == ["yes"]
    assert f"{len(names)} backends, " in lines[-1] and "--details" in lines[-1]
    assert "capabilities" not in out and "this platform is" not in out
    code, details, _ = run(capsys, "list", *cpu, "--details")
    assert code == 0 and "capabilities: " in details and len(details) > 3 * len(out)


def test_list_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    code, out, _ = run(capsys, "list", "--details")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"platform: {current_platform()}"
    assert any(line.startswith("NAME ") and "RUNS HERE?" in line for line in lines)
    too_long = [line for line in lines if len(line) > 120]
    assert not too_long, too_long
    for kind in ("decode", "extend"):
        for name in default_registry.names(kind):
            assert any(line.startswith(name + " ") for line in lines), name
    ref = next(line for line in lines if line.startswith("torch_ref "))
    assert ref.split()[1:5] == ["yes", "decode+extend,", "default,", "mha/mla;"]
    assert "aliases: nsa" in out  # dsa's deprecated alias
    assert "cutedsl_mla (extend)" in out  # trtllm_mla's extend-only alias


def test_list_counts_what_it_shows_and_splits_no_number(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # the narrowest table: the most wrapping
    code, out, _ = run(capsys, "list", "--details")
    assert code == 0
    lines = out.splitlines()
    rows = specattn.list_backends()
    shown = [line for line in lines if line.split() and line.split()[0] in {r.name for r in rows}
             and not line.startswith(" ")]
    classes = [r for r in rows if r.flavour != "dispatcher"]
    summary = " ".join(" ".join(lines[-3:]).split())
    assert f"{len(shown)} entries: {len(classes)} backend classes" in summary
    assert f"and {len(rows) - len(classes)} dispatchers" in summary
    # Long lists of numbers are written as ranges; a wrapped cell never splits a number.
    start = next(line for line in lines if line.startswith("NAME ")).index("KINDS")
    details = [line[start:].rstrip() for line in lines if len(line) > start]
    assert "page 16-512 (multiples of 16)" in " ".join(" ".join(details).split())
    from specattn.cli import _details, _merge_rows

    for entry in _merge_rows(rows):
        for word in _details(entry).split():
            if any(ch.isdigit() for ch in word):
                assert any(word in line for line in details), word


def test_available_lists_no_dispatcher_whose_target_cannot_run(capsys):
    cpu = Platform("cpu", None, cpu_has_amx=False, libraries=frozenset())
    rows = specattn.list_backends(available_only=True, platform=cpu)
    assert "hybrid_linear_attn" not in {r.name for r in rows}  # -> fa3 on a plain CPU
    amx = Platform("cpu", None, cpu_has_amx=True, libraries=frozenset())
    hybrid = [r for r in specattn.list_backends(available_only=True, platform=amx)
              if r.name == "hybrid_linear_attn"]
    assert {r.kind for r in hybrid} == {"decode", "extend"}  # -> intel_amx, which runs
    assert all(r.reason == "here -> intel_amx" for r in hybrid)


def test_list_json_has_every_field(capsys):
    code, out, _ = run(capsys, "list", "--json")
    assert code == 0
    data = json.loads(out)
    here = current_platform()
    assert data["platform"]["device"] == here.device
    assert data["platform"]["description"] == str(here)
    rows = specattn.list_backends()
    assert len(data["backends"]) == len(rows)
    fields = {"name", "kind", "flavour", "aliases", "models", "platforms", "kernel_library",
              "capabilities", "tested_on", "qualified_name", "runs_here", "reason"}
    for got, row in zip(data["backends"], rows):
        assert set(got) == fields
        assert (got["name"], got["kind"], got["flavour"], got["runs_here"], got["reason"]) == \
            (row.name, row.kind, row.flavour, row.runs_here, row.reason)


def test_list_filters(capsys):
    code, out, _ = run(capsys, "list", "--kind", "extend", "--pattern", "trt*", "--json")
    names = {(r["name"], r["kind"]) for r in json.loads(out)["backends"]}
    assert code == 0 and names == {("trtllm_mha", "extend"), ("trtllm_mla", "extend")}
    code, out, _ = run(capsys, "list", "--pattern", "nsa", "--json")
    assert {r["name"] for r in json.loads(out)["backends"]} == {"dsa"}
    code, out, _ = run(capsys, "list", "--available", "--json")
    assert all(r["runs_here"] for r in json.loads(out)["backends"])


def test_list_for_another_platform(capsys):
    code, out, _ = run(capsys, "list", "--platform", "cuda:10.0", "--with-library",
                       "flashinfer", "--json")
    data = json.loads(out)
    assert code == 0 and data["platform"]["capability"] == [10, 0]
    assert data["platform"]["libraries"] == ["flashinfer"]
    expected = specattn.list_backends(platform=Platform("cuda", (10, 0),
                                                        libraries={"flashinfer"}))
    assert [r["runs_here"] for r in data["backends"]] == [r.runs_here for r in expected]
    rows = {(r["name"], r["kind"], r["flavour"]): r for r in data["backends"]}
    assert "needs CUDA" not in rows[("flashinfer", "decode", "mha")]["reason"]
    hybrid = rows[("hybrid_linear_attn", "decode", "dispatcher")]
    # Blackwell (rule 6); triton is not among the given libraries, so it cannot run.
    assert hybrid["reason"].startswith("here -> triton, which cannot run here")
    assert hybrid["runs_here"] is False
    code, out, _ = run(capsys, "list", "--platform", "cuda:10.0", "--with-library",
                       "flashinfer", "--details")
    assert out.splitlines()[0] == "platform: cuda 10.0"
    assert "libraries: flashinfer (given with --with-library)" in out
    code, out, _ = run(capsys, "list", "--platform", "cuda:10.0", "--with-library",
                       "flashinfer")
    assert out.splitlines()[0] == ("platform: cuda 10.0; libraries found: flashinfer (given "
                                   "with --with-library)")


def test_list_order_is_autos_order_per_kind(capsys, monkeypatch):
    """``list --order``: one table per kind, ranked as ``auto`` tries them, with why a row
    cannot run; its JSON rows are ``selection.auto_order``'s."""
    from specattn.selection import auto_order

    monkeypatch.setenv("COLUMNS", "120")
    argv = ["list", "--order", "--platform", "cuda:9.0", "--with-library", "triton",
            "flashinfer"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "platform: cuda 9.0"
    heads = [i for i, line in enumerate(lines) if line.endswith("auto tries these in this order")]
    assert [lines[i].split(":")[0] for i in heads] == ["decode", "extend"]
    want = auto_order(Platform("cuda", (9, 0), libraries={"triton", "flashinfer"}))
    decode = [line.split() for line in lines[heads[0]:heads[1]] if line[:1].isdigit()]
    assert [(int(c[0]), c[1], c[2]) for c in decode] == \
        [(r.rank, r.name, r.flavour) for r in want if r.kind == "decode"]
    rows = {(c[1], c[2]): " ".join(c[5:]) for c in decode}
    assert rows[("flashinfer", "mha")] == "yes" and rows[("triton", "default")] == "yes"
    assert rows[("fa4", "cuda")].startswith("no: needs the 'flash_attn.cute' package")
    assert rows[("trtllm_mha", "default")].startswith("no: needs CUDA compute capability 10")
    assert all(len(line) <= 120 for line in lines)
    assert "dsa, dsv4: model-specific, chosen by name only" in " ".join(out.split())

    code, out, _ = run(capsys, *argv, "--json", "--kind", "extend", "--available")
    data = json.loads(out)
    assert code == 0 and data["platform"]["capability"] == [9, 0]
    got = [(r["kind"], r["rank"], r["qualified_name"], r["runs_here"]) for r in data["order"]]
    assert got == [(r.kind, r.rank, r.qualified_name, True) for r in want
                   if r.kind == "extend" and r.runs_here]
    assert got[0][2].endswith("FlashInferExtend")


# --- select ------------------------------------------------------------------------------------

def _answers(out):
    """``{kind: answer}`` from the answer block (``decode, extend: X`` when they agree)."""
    tail = out[out.index("\nanswer:\n"):].splitlines()
    answers = {}
    for line in tail:
        if line.startswith("  "):
            kinds, answer = line.split(":", 1)
            answers.update({k.strip(): answer.strip() for k in kinds.split(",")})
    return answers


def test_select_cutedsl_mla_on_blackwell(capsys):
    argv = ["select", "--platform", "cuda:10.0", "--with-library", "flashinfer", "--mla",
            "--attention-backend", "cutedsl_mla", "--explain"]
    code, out, _ = run(capsys, *argv)
    assert out.splitlines()[0] == "platform: cuda 10.0"
    assert "decode: requested 'cutedsl_mla'" in out
    assert "attention_backend='cutedsl_mla' is set: use it" in out
    # page size 1 (the default) is not a trtllm-gen MLA page size: both kinds say so.
    assert code == 1
    answers = _answers(out)
    assert answers["decode"].startswith("error: BackendUnavailableError: cutedsl_mla: ")
    assert answers["extend"].startswith("error: BackendUnavailableError: trtllm_mla: ")
    assert out.count("supports page sizes [32, 64], got 1") >= 2
    # With page size 64, decode lands on cutedsl_mla and extend on trtllm_mla (rule 7).
    code, out, _ = run(capsys, *argv, "--page-size", "64")
    answers = _answers(out)
    pending = {c.name for c in default_registry.classes("decode") if c.pending}
    if "cutedsl_mla" in pending:
        assert code == 1 and "not implemented yet" in answers["decode"]
        assert answers["extend"].startswith("error: BackendUnavailableError: trtllm_mla: ")
    else:
        assert code == 0
        assert "name 'cutedsl_mla'" in answers["decode"]
        assert "name 'trtllm_mla'" in answers["extend"]


def test_select_unknown_name_is_one_short_line(capsys):
    """A misspelled name: one line naming the closest name, exit 1; the trace, the valid
    names and the original factory's sentences behind --explain."""
    code, out, err = run(capsys, "select", "--attention-backend", "tritno")
    assert code == 1 and out == ""
    assert err == "specattn select: error: unknown backend 'tritno'; did you mean 'triton'?\n"
    code, out, err = run(capsys, "select", "--attention-backend", "qqqq",
                         "--prefill-attention-backend", "torch_ref")
    assert code == 1 and len(err.splitlines()) == 1 and len(err) < 250
    assert "unknown backend 'qqqq'; known names: " in err and "torch_ref" in err
    code, out, _ = run(capsys, "select", "--attention-backend", "flashinfr", "--explain")
    assert code == 1
    assert "EAGLE is not supported in decode attention backend flashinfr." in out
    assert "EAGLE is not supported in attention backend flashinfr." in out
    assert "Did you mean 'flashinfer'?" in out
    assert "not a known name, alias or dispatcher (rule 3)" in out
    answers = _answers(out)
    for kind in ("decode", "extend"):
        assert answers[kind] == "error: unknown backend 'flashinfr'; did you mean 'flashinfer'?"


def test_select_kv_cache_dtype_is_checked_at_parse_time(capsys):
    """Every value the library accepts (one tuple), listed by --help; any other is one
    line that names them all."""
    from specattn.cli import build_parser
    from specattn.kv_layouts import KV_CACHE_DTYPES

    select = build_parser()._subparsers._group_actions[0].choices["select"]
    action = next(a for a in select._actions if a.dest == "kv_cache_dtype")
    assert action.choices is KV_CACHE_DTYPES
    code, out, err = run(capsys, "select", "--kv-cache-dtype", "fp8")
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and len(err) < 200
    assert all(repr(value) in err for value in KV_CACHE_DTYPES)
    code, out, _ = run(capsys, "select", "--help")
    assert code == 0 and all(value in " ".join(out.split()) for value in KV_CACHE_DTYPES)
    with pytest.raises(InvalidInputError, match="kv_cache_dtype"):
        specattn.SpecConfig(kv_cache_dtype="fp8")
    import torch

    pools = [torch.zeros(4, 1, 8)]
    with pytest.raises(InvalidInputError, match="kv_cache_dtype"):
        specattn.DraftRunner.wrap_mha(torch.zeros(1, 4, dtype=torch.int32), pools, pools, 1,
                                      kv_cache_dtype="fp8")


def test_select_answers_briefly_and_explains_on_request(capsys):
    """A request no backend here accepts: the cause in the answer (what the backends that
    run here refuse), each candidate's reasons only with --explain."""
    argv = ["select", "--platform", "cpu", "--with-library", "none", "--kv-cache-dtype",
            "fp8_ds_mla"]
    code, out, _ = run(capsys, *argv)
    assert code == 1 and len(out) < 1200 and "rejected" not in out
    answers = _answers(out)
    assert answers["decode"].startswith("error: BackendUnavailableError: auto: no decode "
                                        "backend can serve the request here: ")
    assert "torch_ref: supports kv_cache_dtype ['auto', 'fp8_e4m3', 'fp8_e5m2'], got 'fp8_ds_mla'" in answers["decode"]
    assert "needs" not in answers["decode"]  # the backends that cannot run here stay out
    assert "--explain" in out.splitlines()[-1]
    code, out, _ = run(capsys, *argv, "--explain")
    assert code == 1 and "specattn.backends.aiter.AiterDecode: rejected: needs ROCm" in out


def test_with_library_names_a_module_some_backend_needs(capsys):
    """A typo in --with-library would answer for a machine without that library."""
    code, _, err = run(capsys, "select", "--platform", "cuda:9.0", "--with-library",
                       "flashinfr")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "specattn select: error: --with-library: expected a module a backend needs, or "
        "'none' (`specattn list --details` names them; did you mean 'flashinfer'?), got "
        "'flashinfr'")
    code, _, _ = run(capsys, "select", "--platform", "cuda:9.0", "--with-library",
                     "flashinfer", "flash_attn.cute")
    assert code == 0


def test_select_mla_only_name_for_mha(capsys):
    code, out, _ = run(capsys, "select", "--attention-backend", "tokenspeed_mla")
    assert code == 1
    assert _answers(out)["decode"] == ("error: ModelMismatchError: tokenspeed_mla backend "
                                       "requires MLA model (use_mla_backend=True).")


def test_select_torch_ref_step_by_step(capsys):
    code, out, _ = run(capsys, "select", "--platform", "cpu", "--with-library", "none",
                       "--explain", "--decode-attention-backend", "torch_ref",
                       "--prefill-attention-backend", "torch_ref", "--topk", "4",
                       "--num-steps", "5", "--tree-mode", "path")
    assert code == 0
    assert "model: MHA; topk=4 num_steps=5 tree_mode=path" in out
    assert "  1. name precedence (rule 2): speculative_draft_attention_backend is not set" in out
    assert "  2. name precedence (rule 2): decode_attention_backend='torch_ref' is set" in out
    answers = _answers(out)
    assert answers["decode"].startswith("specattn.backends.torch_ref.TorchRefDecode")
    assert answers["extend"].startswith("specattn.backends.torch_ref.TorchRefExtend")


def test_select_none_answers_exit_0(capsys):
    reset_once_registry()
    code, out, _ = run(capsys, "select", "--platform", "cpu", "--attention-backend",
                       "torch_ref", "--prefill-attention-backend", "flashmla",
                       "--num-steps", "1", "--explain")
    assert code == 0
    assert _answers(out) == {"decode": "None", "extend": "None"}
    assert "no multi-step draft decode backend is needed (rule 1)" in out
    assert "warning: flashmla prefill backend is not yet supported for draft extend." in out


def test_select_shows_the_deprecation_and_the_dispatch(capsys):
    reset_once_registry()
    code, out, _ = run(capsys, "select", "--platform", "cpu+amx", "--attention-backend",
                       "hybrid_linear_attn", "--speculative-draft-attention-backend", "nsa",
                       "--speculative-attention-mode", "decode")
    assert code == 1  # nsa -> dsa needs CUDA or HIP and an MLA model
    assert "DeprecationWarning: attention backend name 'nsa' is deprecated; use 'dsa'" in out
    code, out, _ = run(capsys, "select", "--platform", "cpu+amx", "--attention-backend",
                       "hybrid_linear_attn", "--explain")
    assert "'hybrid_linear_attn' dispatches" in out and "-> 'intel_amx'" in out


@pytest.mark.parametrize("argv", [
    ["select", "--platform", "gpu"], ["select", "--platform", "cuda"],
    ["select", "--platform", "cpu+avx"], ["select", "--platform", "cuda:x.0"],
    ["select", "--page-size", "0"], ["select", "--topk", "0"],
    ["select", "--speculative-attention-mode", "verify"], ["list", "--kind", "verify"],
    ["list", "--platform", "tpu"], ["frobnicate"], [],
])
def test_bad_arguments_exit_2(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert code == 2


@pytest.mark.parametrize("argv,message", [
    (["bench", "--dtype", "fp8"], "specattn bench: error: argument --dtype: invalid choice"),
    (["bench", "--reps", "x"], "specattn bench: error: argument --reps: invalid int value"),
    (["demo", "--dtype", "fp8"], "specattn demo: error: argument --dtype: invalid choice"),
    (["demo", "--model", "smollm3"], "specattn demo: error: argument --model: invalid choice"),
    (["demo", "--min-len", "9", "--max-len", "3"], "specattn demo: error: --min-len 9 > "),
])
def test_bench_and_demo_usage_errors_are_one_line(capsys, argv, message):
    """As for list and select: the error and where the options are listed, not argparse's
    usage block (a dozen lines for bench) nor the program name of ``python -m``."""
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err


def test_parse_platform():
    assert parse_platform("cuda:9.0") == Platform("cuda", (9, 0))
    assert parse_platform("cuda:10") == Platform("cuda", (10, 0))
    assert parse_platform("cpu+amx", ["none"]) == Platform("cpu", cpu_has_amx=True,
                                                           libraries=frozenset(),
                                                           triton_interpret=parse_platform(
                                                               "cpu").triton_interpret)
    assert parse_platform("cpu+interpret").triton_interpret
    assert parse_platform("HIP", ["aiter", "triton"]) == Platform(
        "hip", libraries={"aiter", "triton"})
    assert parse_platform(None) == current_platform()
    assert parse_platform(None, ["triton"]).libraries == frozenset({"triton"})
    with pytest.raises(InvalidInputError):
        parse_platform("cuda:9.0+amx+avx")


# --- other commands ----------------------------------------------------------------------------

def test_version_and_help(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"specattn {specattn.__version__}"
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "list" in out and "select" in out and "demo" in out


def test_bench_is_delegated(monkeypatch):
    seen = []
    fake = types.ModuleType("specattn.bench")
    fake.cli_main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "specattn.bench", fake)
    assert main(["bench", "--quick", "--case", "gqa-small"]) == 3
    assert seen == [["--quick", "--case", "gqa-small"]]


def test_demo_is_delegated(capsys, monkeypatch):
    seen = []
    fake = types.ModuleType("specattn.demo")
    fake.cli_main = lambda argv, started: seen.append((argv, started)) or 7
    monkeypatch.setitem(sys.modules, "specattn.demo", fake)
    assert main(["demo", "--steps", "3", "--mla"]) == 7
    (argv, started), = seen
    assert argv == ["--steps", "3", "--mla"]
    assert started == specattn._STARTED  # the total counts from the process's start


def test_demo_missing_is_a_clear_message(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "specattn.demo", None)
    code, _, err = run(capsys, "demo")
    assert code == 2 and "specattn.demo" in err and "not available" in err


@pytest.fixture
def restore_log_level():
    import logging

    log = logging.getLogger("specattn")
    level, handlers = log.level, list(log.handlers)
    yield
    log.setLevel(level)
    log.handlers[:] = handlers


def test_log_level_prints_the_packages_records(capsys, restore_log_level):
    code, out, err = run(capsys, "--log-level", "info", "select", "--platform", "cpu",
                         "--with-library", "none")
    assert code == 0 and "INFO specattn.selection: auto selected decode backend" in err
    code, out, err = run(capsys, "select", "--platform", "cpu", "--log-level", "error")
    assert code == 0 and "auto selected" not in err  # anywhere on the line; error hides info
    code, _, err = run(capsys, "--log-level", "loud", "list")
    assert code == 2 and "--log-level" in err


def test_every_select_option_has_help_and_a_default(capsys):
    from specattn.cli import build_parser

    select = build_parser()._subparsers._group_actions[0].choices["select"]
    for action in select._actions:
        if action.dest == "help":
            continue
        assert action.help, action.dest
        if action.dest not in {"platform", "with_library"} and not action.dest.endswith(
                "_backend"):
            assert "default" in action.help, action.dest


def test_every_bench_and_demo_option_has_help():
    from specattn.bench import build_parser as bench_parser
    from specattn.demo.cli import build_parser as demo_parser

    for parser in (bench_parser(), demo_parser()):
        missing = [a.dest for a in parser._actions if a.dest != "help" and not a.help]
        assert not missing, (parser.prog, missing)


def test_python_dash_m_specattn():
    proc = subprocess.run([sys.executable, "-m", "specattn", "--version"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"specattn {specattn.__version__}"


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "specattn.cli", "--version"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"specattn {specattn.__version__}"
