"""Small helpers every backend shares: integer maths, the device's SM count, whether Triton
kernels can run on a device, and the lazy import of a vendor library."""

from __future__ import annotations

import functools
import importlib
import inspect
from types import ModuleType
from typing import Optional

import torch

from .errors import BackendUnavailableError
from .install import install_hint
from .platforms import triton_interpret_enabled

__all__ = ["ceil_div", "keyword_args", "next_pow2", "prev_pow2", "sm_count", "triton_runs",
           "vendor_module"]


def ceil_div(a, b):
    """``ceil(a / b)`` for ints or int tensors (``b > 0``)."""
    return (a + b - 1) // b


def next_pow2(x: int, lo: int = 1) -> int:
    """The smallest power of two ``>= max(x, 1)``, at least ``lo`` (Triton block sizes)."""
    return max(lo, 1 << (max(x, 1) - 1).bit_length())


def prev_pow2(x: int) -> int:
    """The largest power of two ``<= x`` (``x >= 1``)."""
    return 1 << (x.bit_length() - 1)


def sm_count(device: torch.device) -> Optional[int]:
    """Streaming multiprocessors of a CUDA (or HIP) device; ``None`` on any other device.
    (torch caches the device properties: cheap enough for a per-round plan.)"""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def device_index(device: torch.device) -> int:
    """The CUDA device ordinal ``device`` names (the current one for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def device_capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index``, read once."""
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def triton_runs(device: torch.device) -> bool:
    """Triton kernels can run on ``device``: a CUDA/HIP GPU, or the CPU under
    ``TRITON_INTERPRET=1``, with a Triton that imports."""
    device = torch.device(device)
    if not (device.type == "cuda" or (device.type == "cpu" and triton_interpret_enabled())):
        return False
    try:
        importlib.import_module("triton")
    except Exception:  # no (working) Triton here
        return False
    return True


def vendor_module(name: str, pip_name: str, backend: str) -> ModuleType:
    """``import name`` when a backend is *built* (never when specattn is imported), or a
    ``BackendUnavailableError`` naming the package to install. Whatever ``sys.modules[name]``
    holds is used, so a test can inject a recording stand-in of the library."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{backend}: needs the '{name}' package, which cannot be imported here ({exc}); "
            f"install it with: {install_hint(pip_name)}", backend,
            {backend: [f"needs the '{name}' package ({install_hint(pip_name)})"]}) from exc


def keyword_args(cls: type) -> set[str]:
    """The keyword-only arguments of ``cls``'s constructor (the options a caller may set)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params if p.kind is p.KEYWORD_ONLY}
