"""Detect the current platform once, lazily; override it in tests.

Order of probes: NPU (``torch_npu``), MUSA (``torch.version.musa``), HIP
(``torch.version.hip``), CUDA, XPU, then CPU. Detection never creates a device context: CUDA's
capability comes from NVML, with ``torch.cuda.get_device_capability`` only as a fallback.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

from .._logging import get_logger
from ._probes import module_available, nvml_capability
from .interface import Platform

log = get_logger("platforms")

_override: contextvars.ContextVar[Platform | None] = contextvars.ContextVar(
    "specattn_platform_override", default=None)


def _cpu_has_amx() -> bool:
    """Whether the CPU has AMX tiles, by torch's CPU feature probe:
    ``torch.cpu.get_capabilities()["amx_tile"]`` (public; cpuinfo's CPUID and OS-support
    check). A torch without ``get_capabilities`` is asked through
    ``torch.cpu._is_amx_tile_supported``; a torch with neither reports no AMX."""
    import torch

    capabilities = getattr(torch.cpu, "get_capabilities", None)
    try:
        if capabilities is not None:
            return bool(capabilities().get("amx_tile", False))
        probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def triton_interpret_enabled() -> bool:
    """``TRITON_INTERPRET`` is set to something other than ``""``/``"0"``: Triton kernels run
    on the CPU interpreter. The one place that reads the variable (read at each call)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def detect() -> Platform:
    """Probe this process's platform (cached for the life of the process)."""
    import torch

    amx = _cpu_has_amx()
    interp = triton_interpret_enabled()
    if module_available("torch_npu"):
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)

            if torch.npu.is_available():  # type: ignore[attr-defined]  # torch_npu's
                return Platform("npu", None, amx, triton_interpret=interp,
                                device_name="Ascend NPU")
        except Exception as exc:  # a broken CANN install must not break CPU users
            log.info("torch_npu present but unusable: %s", exc)
    if getattr(torch.version, "musa", None) is not None:
        return Platform("musa", None, amx, triton_interpret=interp, device_name="MUSA GPU")
    if getattr(torch.version, "hip", None) is not None and torch.cuda.is_available():
        return Platform("hip", None, amx, triton_interpret=interp, device_name="ROCm GPU")
    if getattr(torch.version, "cuda", None) is not None and torch.cuda.is_available():
        nv = nvml_capability(0)
        if nv is None:
            cap = torch.cuda.get_device_capability(0)
            return Platform("cuda", (int(cap[0]), int(cap[1])), amx, triton_interpret=interp)
        return Platform("cuda", nv[0], amx, triton_interpret=interp, device_name=nv[1])
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return Platform("xpu", None, amx, triton_interpret=interp, device_name="Intel XPU")
    return Platform("cpu", None, amx, triton_interpret=interp)


def current_platform() -> Platform:
    """The platform selection uses: the innermost ``use_platform`` override, else ``detect()``."""
    override = _override.get()
    return override if override is not None else detect()


@contextlib.contextmanager
def use_platform(platform: Platform) -> Iterator[Platform]:
    """Make ``platform`` the current one inside the ``with`` block (tests, dry runs)."""
    if not isinstance(platform, Platform):
        from ..errors import InvalidInputError

        raise InvalidInputError("platform", "a specattn.platforms.Platform", type(platform))
    token = _override.set(platform)
    try:
        yield platform
    finally:
        _override.reset(token)


def torch_device_type(platform: Platform) -> str:
    """The torch device string for tensors on ``platform`` (``hip`` uses ``cuda``)."""
    return {"hip": "cuda"}.get(platform.device, platform.device)


__all__ = ["detect", "current_platform", "use_platform", "module_available",
           "torch_device_type", "triton_interpret_enabled"]
