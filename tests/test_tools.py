"""``tools/``, run on the CPU: the GPU script's syntax and its dry run (every command it
would run names files and tests that exist), the A/B table, the CPU soak, the library
signatures and the read-floor kernels (Triton interpreter). The README generator is tested
in ``test_bench.py``."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")
TOOLS = os.path.join(ROOT, "tools")
GPU_SH = os.path.join(TOOLS, "gpu.sh")


def _tool(name: str):
    """Import ``tools/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"tools_{name}",
                                                  os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


# --- tools/gpu.sh ----------------------------------------------------------------------------

def _gpu_host(tmp_path, fa4_first: bool = True) -> dict:
    """A GPU host after `gpu.sh fa4-first`, as the dry run sees it: a bundle carrying the
    flashinfer and fa4 parts, a site holding the first FA4 half, compute-sanitizer on PATH."""
    bundle, site, bin_dir = tmp_path / "bundle", tmp_path / "site", tmp_path / "bin"
    for d in (bundle / "flashinfer", bundle / "fa4", site / ".parts", bin_dir):
        d.mkdir(parents=True)
    (bundle / "install.sh").write_text("exit 9\n")  # a dry run never calls it
    if fa4_first:
        (site / ".parts" / "libs.tar.xz.part-0").write_text("")
    sanitizer = bin_dir / "compute-sanitizer"
    sanitizer.write_text("#!/bin/sh\nexit 9\n")
    sanitizer.chmod(0o755)
    return {"GPU_BUNDLE": str(bundle), "GPU_SITE": str(site), "OUT": str(tmp_path / "out"),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "GPU_DRY_RUN": "1"}


def _gpu_sh(env: dict, *args: str) -> subprocess.CompletedProcess:
    # The caller's PYTHONPATH (e.g. this tree's, to import it) would join the lines' own.
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(["bash", GPU_SH, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**base, **env})


def _steps(stdout: str) -> dict[str, list[str]]:
    """The dry run's ``NAME: command`` lines as ``{NAME: argv}`` (setup lines left out)."""
    steps = {}
    for line in stdout.splitlines():
        name, _, command = line.partition(": ")
        if name != "setup":
            steps[name] = shlex.split(command)
    return steps


def _assert_paths_exist(argv: list[str]) -> None:
    for arg in argv:
        if re.match(r"(tools|tests)/", arg):
            assert os.path.exists(os.path.join(ROOT, arg)), arg


@pytest.mark.parametrize("script", ["gpu.sh", "sglang_wheels.sh"])
def test_shell_scripts_parse(script):
    res = subprocess.run(["bash", "-n", os.path.join(TOOLS, script)], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    text = open(os.path.join(TOOLS, script)).read()
    for path in re.findall(r"\b((?:tools|tests/gpu)/[\w/]+\.py)\b", text):
        assert os.path.isfile(os.path.join(ROOT, path)), (script, path)


def test_gpu_script_parses_and_explains_itself():
    res = subprocess.run(["bash", "-n", GPU_SH], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    for args in ([], ["bogus"]):
        res = subprocess.run(["bash", GPU_SH, *args], capture_output=True, text=True,
                             timeout=30, env={**os.environ, "OUT": "/nonexistent"})
        assert res.returncode == 2
        for command in ("fa4-first", "check [PYTEST_ARGS]", "bench [ARGS]", "sglang [ARGS]",
                        "ab REF [ARGS]"):
            assert f"bash tools/gpu.sh {command}" in res.stderr, res.stderr


def test_gpu_check_dry_run_names_what_exists(tmp_path):
    env = _gpu_host(tmp_path)
    res = _gpu_sh(env, "check", "-k", "triton")
    assert res.returncode == 0, res.stderr
    assert f"install.sh {env['GPU_SITE']} flashinfer fa4" in res.stdout, res.stdout
    steps = _steps(res.stdout)
    assert list(steps) == ["gpu-tests", "kit", "memcheck", "memcheck-graphs"], res.stdout
    for argv in steps.values():
        _assert_paths_exist(argv)
    tests = steps["gpu-tests"]
    assert tests[1:3] == ["-m", "pytest"] and "tests/gpu" in tests and "-n" in tests
    assert tests[tests.index("-n") + 1] == "0"  # xdist off
    assert tests[tests.index("tests/gpu") - 2:tests.index("tests/gpu")] == ["-m", "gpu and not slow"]
    assert tests[-2:] == ["-k", "triton"]  # PYTEST_ARGS go to the suites
    assert any(n.startswith("test_") and n.endswith("_gpu.py")
               for n in os.listdir(os.path.join(ROOT, "tests", "gpu")))
    # The kit's -k names are tests of tests/conformance: test_<environment label>.
    kit = steps["kit"]
    assert "tests/conformance" in kit
    labels = re.findall(r'Environment\(\s*"([\w-]+)"',
                        open(os.path.join(ROOT, "tests", "conformance", "environments.py"))
                        .read())
    tests_there = {"test_" + label.replace("-", "_") for label in labels}
    named = set(re.findall(r"\btest_\w+", kit[kit.index("-k") + 1]))
    assert named >= {"test_triton", "test_flashinfer_gpu", "test_fa4_gpu", "test_flashmla_gpu"}
    assert named <= tests_there, named - tests_there
    memcheck = steps["memcheck"]
    assert memcheck[0].endswith("bin/compute-sanitizer") and "memcheck" in memcheck
    assert memcheck[memcheck.index("tools/oob_run.py") + 1:] == ["--backend", "triton"]
    graphs = steps["memcheck-graphs"]
    assert graphs[0] == memcheck[0] and "tests/conformance" in graphs
    assert graphs[-1] == f"graph and ({kit[kit.index('-k') + 1]})"  # the kit's graph cases
    only = _gpu_sh({**env, "CHECK_STEPS": "kit"}, "check")
    assert list(_steps(only.stdout)) == ["kit"], only.stdout


def test_gpu_setup_without_the_first_fa4_half_or_any_bundle(tmp_path):
    env = _gpu_host(tmp_path, fa4_first=False)
    res = _gpu_sh(env, "check")
    assert res.returncode == 3 and "bash tools/gpu.sh fa4-first" in res.stderr, res.stderr
    # GPU_PARTS overrides the detection.
    res = _gpu_sh({**env, "GPU_PARTS": "flashinfer"}, "check")
    assert res.returncode == 0 and "install.sh " + env["GPU_SITE"] + " flashinfer)" in res.stdout
    res = _gpu_sh({**env, "GPU_BUNDLE": str(tmp_path / "none"), "GPU_PARTS": ""}, "bench")
    assert res.returncode == 0 and "no vendor libraries" in res.stdout, res.stdout
    res = _gpu_sh(env, "fa4-first")
    assert res.stdout.strip() == f"fa4-first: bash {env['GPU_BUNDLE']}/install.sh " \
                                 f"{env['GPU_SITE']} fa4-first"


def test_gpu_sglang_runs_the_harness_then_its_gpu_test(tmp_path):
    """`gpu.sh sglang ARGS`: the harness with ARGS into $OUT/sglang, then its GPU test
    (SGLANG_GPU_TEST=0: the harness alone); without SGLang's wheel in .whl/, one line that
    names the script that downloads it."""
    env = {**_gpu_host(tmp_path), "GPU_PARTS": "flashinfer"}
    host = tmp_path / "checkout"
    (host / ".whl").mkdir(parents=True)
    run = lambda e, *a: subprocess.run(["bash", GPU_SH, "sglang", *a], cwd=host,  # noqa: E731
                                       capture_output=True, text=True, timeout=60,
                                       env={**os.environ, **e})
    res = run(env, "--preset", "quick")
    assert res.returncode == 3 and "tools/sglang_wheels.sh" in res.stderr, res.stderr
    (host / ".whl" / "sglang-0.5.23-cp312.tar.xz").write_text("")
    res = run(env, "--preset", "quick")
    assert res.returncode == 0, res.stderr
    steps = _steps(res.stdout)
    assert list(steps) == ["sglang", "sglang-test"], res.stdout
    harness = steps["sglang"]
    assert harness[1] == "tools/sglang_gpu.py" and harness[-2:] == ["--preset", "quick"]
    assert harness[harness.index("--out") + 1] == os.path.join(env["OUT"], "sglang")
    assert "tests/gpu/test_sglang_gpu.py" in steps["sglang-test"]
    for argv in steps.values():
        _assert_paths_exist(argv)
    alone = run({**env, "SGLANG_GPU_TEST": "0"})
    assert list(_steps(alone.stdout)) == ["sglang"], alone.stdout


def test_gpu_bench_dry_run_is_a_bench_command(tmp_path):
    from specattn.bench import build_parser

    res = _gpu_sh(_gpu_host(tmp_path), "bench", "--quick", "--case", "gqa-long", "mla-long")
    assert res.returncode == 0, res.stderr
    argv = _steps(res.stdout)["bench"]
    assert argv[1:4] == ["-m", "specattn", "bench"]
    args = build_parser().parse_args(argv[4:])
    assert args.out == "/tmp/gpu-bench" and args.quick and args.case == ["gqa-long", "mla-long"]


def test_gpu_ab_dry_run_alternates_the_packages(tmp_path):
    env = _gpu_host(tmp_path)
    ref = tmp_path / "ab"
    assert _gpu_sh(env, "ab", str(ref)).returncode == 3  # no such folder
    ref.mkdir()
    res = _gpu_sh(env, "ab", str(ref))
    assert res.returncode == 3 and "git archive" in res.stderr  # no specattn/ in it
    (ref / "specattn").mkdir()
    res = _gpu_sh({**env, "AB_ROUNDS": "3"}, "ab", str(ref), "--quick", "--case", "mla-long")
    assert res.returncode == 0, res.stderr
    steps = _steps(res.stdout)
    assert list(steps) == ["a1", "b1", "a2", "b2", "a3", "b3", "ab-table"]
    a, b = steps["a2"], steps["b2"]
    assert a[:3] == ["env", "-C", str(ref)] and a[3].startswith(f"PYTHONPATH={ref}")
    assert ROOT not in a[3] and os.path.abspath(ROOT) not in a[3]
    assert a[5:8] == ["-m", "specattn", "bench"] and b[1:4] == ["-m", "specattn", "bench"]
    assert a[8:] == ["--out", "/tmp/gpu-ab/a2", "--quick", "--case", "mla-long"]
    assert b[4:] == ["--out", "/tmp/gpu-ab/b2", "--quick", "--case", "mla-long"]
    table = steps["ab-table"]
    _assert_paths_exist(table)
    assert "tools/ab_table.py" in table and table[-2:] == ["--out", env["OUT"] + "/ab.md"]


def test_gpu_ab_dry_run_with_another_b_package(tmp_path):
    """``AB_B=DIR``: B is DIR's package (run from inside it, as A is), the steps and the
    table named by DIR, so that several A/Bs fit one call."""
    env = _gpu_host(tmp_path)
    ref, lab = tmp_path / "ref", tmp_path / "lab-x"
    (ref / "specattn").mkdir(parents=True)
    lab.mkdir()
    res = _gpu_sh({**env, "AB_B": str(lab)}, "ab", str(ref))
    assert res.returncode == 3 and "git archive" in res.stderr  # no specattn/ in B
    (lab / "specattn").mkdir()
    res = _gpu_sh({**env, "AB_B": str(lab)}, "ab", str(ref), "--case", "gqa-b1-k8")
    assert res.returncode == 0, res.stderr
    steps = _steps(res.stdout)
    assert list(steps) == ["ab-lab-x-a1", "ab-lab-x-b1", "ab-lab-x-a2", "ab-lab-x-b2",
                           "ab-lab-x-table"]
    a, b = steps["ab-lab-x-a1"], steps["ab-lab-x-b1"]
    assert a[:3] == ["env", "-C", str(ref)] and b[:3] == ["env", "-C", str(lab)]
    assert b[3].startswith(f"PYTHONPATH={lab}") and ROOT not in b[3]
    assert b[8:] == ["--out", "/tmp/gpu-ab-lab-x/b1", "--case", "gqa-b1-k8"]
    table = steps["ab-lab-x-table"]
    assert table[-4:] == ["--b-label", str(lab), "--out", env["OUT"] + "/ab-lab-x.md"]


def test_ab_table_names_its_b_package(tmp_path):
    sys.path.insert(0, TOOLS)
    try:
        import ab_table
    finally:
        sys.path.remove(TOOLS)
    for side in ("a1", "b1"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "bench.csv").write_text(
            "case,lengths,variant,status,time_us\ngqa-b1-k8,uniform,triton,ok,"
            + ("13.0" if side == "a1" else "12.0") + "\n")
    out = tmp_path / "ab.md"
    assert ab_table.main([str(tmp_path), "--a-label", "REF", "--b-label", "LAB",
                          "--out", str(out)]) == 0
    text = out.read_text()
    assert "A = `REF`, B = `LAB`" in text and "| 0.923 |" in text
    assert ab_table.main([str(tmp_path), "--out", str(out)]) == 0
    assert "B = this tree" in out.read_text()


def test_gpu_host_ab_dry_run_runs_the_tool(tmp_path):
    env = _gpu_host(tmp_path)
    ref = tmp_path / "ab"
    ref.mkdir()
    res = _gpu_sh(env, "host-ab", str(ref), "--case", "gqa-b8-p16-extend")
    assert res.returncode == 3 and "git archive" in res.stderr  # no specattn/ in it
    (ref / "specattn").mkdir()
    res = _gpu_sh(env, "host-ab", str(ref), "--case", "gqa-b8-p16-extend", "--backend",
                  "flashinfer")
    assert res.returncode == 0, res.stderr
    steps = _steps(res.stdout)
    assert list(steps) == ["host-ab"]
    cmd = steps["host-ab"]
    _assert_paths_exist(cmd)
    assert cmd[1:] == ["tools/host_ab.py", str(ref), "--case", "gqa-b8-p16-extend",
                       "--backend", "flashinfer", "--out", env["OUT"] + "/host_ab.md"], cmd


def test_ab_table_joins_the_runs(tmp_path, capsys):
    ab_table = _tool("ab_table")
    rows = {"a1": [("mla-long", "ok", 70.0), ("gqa-long", "ok", 150.0), ("extend", "ok", 9.0)],
            "b1": [("mla-long", "ok", 63.0), ("gqa-long", "failed", ""), ("extend", "ok", 9.9)],
            "a2": [("mla-long", "ok", 72.0), ("extend", "ok", 9.0)],
            "b2": [("mla-long", "ok", 65.0), ("extend", "ok", 9.9)]}
    for run, entries in rows.items():
        (tmp_path / run).mkdir()
        lines = ["case,lengths,variant,status,time_us"]
        lines += [f"{case},uniform,triton,{status},{us}" for case, status, us in entries]
        (tmp_path / run / "bench.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "ab.md"
    assert ab_table.main([str(tmp_path), "--a-label", ".ab", "--out", str(out)]) == 0
    text = out.read_text()
    assert "A = `.ab`" in text and "2 of A, 2 of B" in text
    assert "| mla-long | uniform | triton | 70.0, 72.0 | 63.0, 65.0 | 0.901 |" in text, text
    assert "| gqa-long | uniform | triton | 150.0 | - | - |" in text, text
    assert "| extend | uniform | triton | 9.0, 9.0 | 9.9, 9.9 | 1.100 |" in text, text
    for run in ("b1", "b2"):
        (tmp_path / run / "bench.csv").unlink()
    assert ab_table.main([str(tmp_path)]) == 1


def test_host_ab_times_both_packages_in_one_process(tmp_path):
    """The older package is imported beside this one and each is timed: a REF whose replay
    metadata call sleeps 50 ms comes out slower (far above a loaded CPU's call here, which
    took up to ~16 ms on a busy two-core machine)."""
    ref = tmp_path / "ref" / "specattn"
    shutil.copytree(os.path.join(ROOT, "specattn"), ref,
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(ref / "__init__.py", "a") as f:
        f.write("\nimport time as _time\nfrom .base import DraftDecodeBackend as _Decode\n"
                "_replay = _Decode.init_forward_metadata_replay_cuda_graph\n"
                "_Decode.init_forward_metadata_replay_cuda_graph = "
                "lambda *a: (_time.sleep(0.05), _replay(*a))[1]\n")
    out = tmp_path / "host_ab.md"
    res = subprocess.run([sys.executable, os.path.join(TOOLS, "host_ab.py"), str(ref.parent),
                          "--case", "gqa-small", "--backend", "torch_ref", "--rounds", "2",
                          "--calls", "5", "--device", "cpu", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    row = out.read_text().splitlines()[-1]
    assert row.startswith("| gqa-small | torch_ref | "), row
    ref_us, this_us = (cell.split(" / ") for cell in row.split(" | ")[2:4])
    assert len(ref_us) == len(this_us) == 2
    assert min(map(float, ref_us)) > 50_000 and max(map(float, this_us)) < min(
        map(float, ref_us)), row
    assert float(row.split(" | ")[4].rstrip(" |")) < 0.5, row


def test_cpu_soak_runs_an_environment_and_reports_it():
    res = subprocess.run([sys.executable, os.path.join(TOOLS, "cpu_soak.py"), "2", "torch_ref"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip().splitlines()[0]
    assert line.startswith("torch_ref: soak torch_ref: ") and " 0 mismatches" in line
    assert int(line.split(" random rounds")[0].rsplit(" ", 1)[1]) > 0


def test_cpu_soak_explains_itself_and_names_an_unknown_environment():
    tool = os.path.join(TOOLS, "cpu_soak.py")
    res = subprocess.run([sys.executable, tool, "--help"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "torch_ref" in res.stdout, res.stderr
    res = subprocess.run([sys.executable, tool, "1", "nosuch"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "not 'nosuch'" in res.stderr, res.stderr


def test_library_signatures_reports_what_is_missing(capsys):
    tool = _tool("library_signatures")
    assert tool.main(["--library", "flash_mla", "flash_attn_interface"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"torch {torch.__version__};")
    for name in ("flash_mla", "flash_attn_interface"):
        line = next(line for line in out.splitlines() if line.startswith(name))
        if importlib.util.find_spec(name) is None:
            assert "not importable" in line


def test_library_signatures_prints_each_entry_point(monkeypatch, capsys):
    """With a module whose entry points exist, one ``name(signature)`` line each."""
    import types

    tool = _tool("library_signatures")
    fake = types.ModuleType("fakelib")
    fake.__version__ = "9.9"
    fake.run = lambda q, k, *, scale=1.0: None
    monkeypatch.setitem(sys.modules, "fakelib", fake)
    monkeypatch.setitem(tool.ENTRY_POINTS, "fakelib", ["run", "gone"])
    assert tool.signatures("fakelib") == ["fakelib 9.9", "  run(q, k, *, scale=1.0)",
                                          "  gone: AttributeError: module 'fakelib' has no "
                                          "attribute 'gone'"]


# --- tools/merge_sweep.py --------------------------------------------------------------------

def test_merge_sweep_records_a_steps_merge_and_relaunches_it_with_other_tiles(monkeypatch):
    """The tool's CPU half (the Triton interpreter): a triton step's merge is recorded on its
    own partials, with the tiles the rule gave; launched again with a swept tile it writes
    the rule's output (the timing needs a GPU)."""
    from specattn.bench.cases import custom_case
    from specattn.kernels import merge

    sweep = _tool("merge_sweep")
    monkeypatch.setattr(merge, "sm_count", lambda device: 132)  # the H200's rule, chunks too
    case = custom_case(batch=2, prefix=40, topk=2, steps=2)  # the bench's GQA 32 / 8 x 128
    rec, _, _ = sweep.record(case, torch.device("cpu"))
    assert rec.name == "merge" and rec.rows == 2 * 2 * 32 and rec.width == 128
    want = sweep.launch_with(rec, None)
    assert not want.isnan().any()
    tiles = sweep.sweep(rec)
    assert (32, 4, 1) in tiles and all(d * p <= 16384 for d, p, _ in tiles)
    for tile in ((32, 4, 1), (128, 2 * rec.parts, 2)):
        torch.testing.assert_close(sweep.launch_with(rec, tile), want)
    from specattn.backends.triton import worklist

    assert merge.merge_tiles is sweep._modules()[0].merge_tiles  # the rules are back
    assert worklist.segment_tiles.__module__ == worklist.__name__
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            sweep.main(["--case", "gqa-small"])
