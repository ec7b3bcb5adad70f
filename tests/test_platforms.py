"""Platforms: the value, its validation, predicates, lazy detection and the override."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specattn.errors import InvalidInputError
from specattn.platforms import (
    Platform,
    any_platform,
    cpu_has_amx,
    cuda_capability,
    current_platform,
    detect,
    has_library,
    is_blackwell,
    is_cpu,
    is_cpu_with_amx,
    is_cuda,
    is_hip,
    is_hopper,
    is_musa,
    is_npu,
    is_xpu,
    torch_device_type,
    triton_interpret,
    use_platform,
)
from specattn.platforms._probes import module_available

# --- the value ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(device="gpu"), dict(device="CUDA"), dict(device="cuda", capability=(9,)),
    dict(device="cuda", capability=(9, 0, 1)), dict(device="cuda", capability=("9", "0")),
    dict(device="cuda", capability=(9.0, 0)),
])
def test_platform_validation(kwargs):
    with pytest.raises(InvalidInputError) as info:
        Platform(**kwargs)
    assert isinstance(info.value, ValueError)
    assert info.value.argument in ("device", "capability")


def test_platform_normalises_and_compares():
    p = Platform("cuda", [9, 0], libraries=["flashinfer"])
    assert p.capability == (9, 0) and p.libraries == frozenset({"flashinfer"})
    assert p == Platform("cuda", (9, 0), libraries={"flashinfer"}, device_name="H100")
    assert hash(p) == hash(Platform("cuda", (9, 0), libraries={"flashinfer"}))
    assert str(Platform("cuda", (10, 0))) == "cuda 10.0"
    assert str(Platform("cpu")) == "cpu without AMX"
    assert str(Platform("cpu", cpu_has_amx=True, triton_interpret=True)) == \
        "cpu with AMX TRITON_INTERPRET=1"
    assert str(Platform("npu", device_name="Ascend NPU")) == "npu (Ascend NPU)"


def test_has_library_uses_the_given_set_or_probes():
    assert Platform("cpu", libraries={"triton"}).has_library("triton")
    assert not Platform("cpu", libraries=frozenset()).has_library("torch")
    assert Platform("cpu").has_library("torch")  # probed (torch is installed)
    assert not Platform("cpu").has_library("surely_not_a_module_xyz")


def test_torch_device_type():
    assert torch_device_type(Platform("hip")) == "cuda"
    assert torch_device_type(Platform("cpu")) == "cpu"
    assert torch_device_type(Platform("cuda", (9, 0))) == "cuda"


# --- predicates --------------------------------------------------------------------------------

@pytest.mark.parametrize("capability,blackwell,hopper", [
    ((8, 0), False, False), ((9, 0), False, True), ((9, 1), False, True),
    ((10, 0), True, False), ((10, 3), True, False), ((11, 0), True, False),
    ((12, 0), True, False), ((12, 1), True, False), ((13, 0), False, False),
])
def test_blackwell_and_hopper(capability, blackwell, hopper):
    p = Platform("cuda", capability)
    assert is_blackwell(p) is blackwell
    assert is_hopper(p) is hopper


@pytest.mark.parametrize("device", ["cpu", "hip", "npu", "musa", "xpu"])
def test_capability_predicates_need_cuda(device):
    p = Platform(device, (10, 0))
    assert not is_blackwell(p) and not is_hopper(p) and not cuda_capability(10)(p)


def test_device_predicates_are_exclusive():
    preds = {"cuda": is_cuda, "hip": is_hip, "npu": is_npu, "musa": is_musa, "xpu": is_xpu,
             "cpu": is_cpu}
    for device in preds:
        p = Platform(device, (9, 0) if device == "cuda" else None)
        assert [d for d, pred in preds.items() if pred(p)] == [device]
        assert any_platform(p)


def test_cuda_capability_minors_and_text():
    sm90 = cuda_capability(9, minors=(0,))
    assert sm90(Platform("cuda", (9, 0))) and not sm90(Platform("cuda", (9, 1)))
    assert sm90.description == "CUDA compute capability 9.0"
    assert cuda_capability(9, 10).description == "CUDA compute capability 9.x/10.x"
    assert not cuda_capability(9)(Platform("cuda", None))


def test_predicate_algebra_and_descriptions():
    pred = is_cuda | is_hip | (is_cpu & triton_interpret)
    assert pred(Platform("hip")) and pred(Platform("cpu", triton_interpret=True))
    assert not pred(Platform("cpu")) and not pred(Platform("xpu"))
    assert pred.description == "CUDA or ROCm (HIP) or the CPU and TRITON_INTERPRET=1"
    inverted = ~(is_cuda | is_hip)
    assert inverted(Platform("cpu")) and not inverted(Platform("hip"))
    assert inverted.description == "not (CUDA or ROCm (HIP))"
    assert cpu_has_amx(Platform("cpu", cpu_has_amx=True))
    # The host's flag alone holds on a GPU machine too; a CPU with AMX is the CPU device.
    assert cpu_has_amx(Platform("hip", cpu_has_amx=True))
    assert is_cpu_with_amx(Platform("cpu", cpu_has_amx=True))
    assert not is_cpu_with_amx(Platform("cpu")) and not is_cpu_with_amx(
        Platform("hip", cpu_has_amx=True))
    assert is_cpu_with_amx.description == "a CPU with AMX"
    lib = has_library("flashinfer", "flashinfer-python")
    assert lib(Platform("cuda", (9, 0), libraries={"flashinfer"}))
    assert not lib(Platform("cuda", (9, 0), libraries=frozenset()))
    assert "pip install flashinfer-python" in lib.description


# --- the override ------------------------------------------------------------------------------

def test_use_platform_nests_and_restores():
    here = current_platform()
    a, b = Platform("cuda", (9, 0)), Platform("npu")
    with use_platform(a) as got:
        assert got is a and current_platform() is a
        with use_platform(b):
            assert current_platform() is b
        assert current_platform() is a
        with pytest.raises(RuntimeError):
            with use_platform(b):
                raise RuntimeError("boom")
        assert current_platform() is a
    assert current_platform() == here


def test_use_platform_rejects_other_values():
    with pytest.raises(InvalidInputError):
        with use_platform("cuda:9.0"):
            pass


def test_selection_reads_the_override():
    import specattn
    from types import SimpleNamespace

    factory = specattn.DraftBackendFactory(specattn.SpecConfig(attention_backend="trtllm_mha"),
                                           SimpleNamespace(use_mla_backend=False), 1, 3)
    with use_platform(Platform("cuda", (9, 0), libraries={"flashinfer"})):
        with pytest.raises(specattn.BackendUnavailableError, match="this platform is cuda 9.0"):
            factory.resolve_decode_backend()


# --- detection ---------------------------------------------------------------------------------

def test_detect_is_cached_and_is_the_default():
    assert detect() is detect()
    assert current_platform() is detect()


def test_detect_on_this_machine_creates_no_device_context():
    code = ("import json, sys, torch; from specattn.platforms import detect; p = detect(); "
            "print(json.dumps([p.device, torch.cuda.is_initialized(), "
            "sorted(m for m in ('flashinfer', 'flash_attn', 'triton', 'torch_npu') "
            "if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    device, initialized, vendors = json.loads(out.stdout.strip().splitlines()[-1])
    import torch

    assert device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert initialized is False
    assert vendors == []


def test_module_available_does_not_import_the_parent(tmp_path, monkeypatch):
    pkg = tmp_path / "specattn_probe_pkg"
    (pkg / "cute").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('the parent must not be imported')\n")
    (pkg / "cute" / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_available("specattn_probe_pkg.cute")
    assert module_available("specattn_probe_pkg.mod")
    assert not module_available("specattn_probe_pkg.absent")
    assert module_available("specattn_probe_pkg")
    assert "specattn_probe_pkg" not in sys.modules
    assert not module_available("specattn_no_such_pkg.cute")


def test_flash_attn_cute_probe_imports_nothing():
    # With flash-attn-4 installed (the fa extra) an earlier test may have imported it.
    before = set(sys.modules)
    module_available.cache_clear()
    module_available("flash_attn.cute")
    assert not {m for m in set(sys.modules) - before if m.startswith("flash_attn")}


# --- AMX probe ---------------------------------------------------------------------------------

@pytest.fixture
def fresh_detect():
    """``detect()`` re-probes inside the test and again (unpatched) after it."""
    detect.cache_clear()
    yield detect
    detect.cache_clear()


def _fake_capabilities(monkeypatch, amx_tile: bool) -> None:
    """torch's public CPU probe answers ``amx_tile``; torch's private per-feature probes are
    gone, as in torch builds where ``get_capabilities`` is the one probe."""
    import torch

    caps = {"architecture": "x86_64", "avx512_f": True, "amx_tile": amx_tile}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps, raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.delattr(torch._C._cpu, "_is_amx_tile_supported", raising=False)


@pytest.mark.parametrize("amx_tile", [True, False])
def test_detect_reads_amx_from_torchs_public_probe(monkeypatch, fresh_detect, amx_tile):
    _fake_capabilities(monkeypatch, amx_tile)
    assert fresh_detect().cpu_has_amx is amx_tile


@pytest.mark.parametrize("amx_tile,target", [(True, "intel_amx"), (False, "fa3")])
def test_detected_amx_routes_hybrid_linear_attn(monkeypatch, fresh_detect, amx_tile, target):
    from types import SimpleNamespace

    from specattn import DraftBackendFactory, SpecConfig
    from specattn.errors import BackendUnavailableError

    _fake_capabilities(monkeypatch, amx_tile)
    assert fresh_detect().device == "cpu"
    factory = DraftBackendFactory(SpecConfig(attention_backend="hybrid_linear_attn"),
                                  SimpleNamespace(use_mla_backend=False), 1, 3)
    try:
        name = factory.explain_decode_backend().backend.name
    except BackendUnavailableError as exc:
        name = exc.name
    assert name == target


def test_detect_without_any_torch_amx_probe_reports_none(monkeypatch, fresh_detect):
    import torch

    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert fresh_detect().cpu_has_amx is False


def _cpuinfo_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        return None
    return None


def test_amx_probe_agrees_with_proc_cpuinfo(fresh_detect):
    import platform as py_platform

    flags = _cpuinfo_flags()
    if flags is None or py_platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("no x86 /proc/cpuinfo flags line on this machine")
    assert fresh_detect().cpu_has_amx is ("amx_tile" in flags)
