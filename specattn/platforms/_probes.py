"""Side-effect-free probes: module availability and NVML queries.

None of these imports a vendor library or creates a device context. Each is cached.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sys

from .._logging import get_logger

log = get_logger("platforms")


@functools.lru_cache(maxsize=None)
def module_available(module: str) -> bool:
    """Whether ``module`` (possibly dotted) is importable, without importing it.

    ``importlib.util.find_spec("a.b")`` would import ``a``; for dotted names this walks the
    parent package's search path on disk instead.
    """
    head, _, rest = module.partition(".")
    if head in sys.modules and not rest:
        return True
    try:
        spec = importlib.util.find_spec(head)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    locations = list(spec.submodule_search_locations or [])
    parts = rest.split(".")
    for loc in locations:
        path = os.path.join(loc, *parts)
        if os.path.isfile(os.path.join(path, "__init__.py")) or os.path.isfile(path + ".py"):
            return True
    return False


@functools.lru_cache(maxsize=None)
def nvml_capability(index: int = 0) -> tuple[tuple[int, int], str] | None:
    """``((major, minor), name)`` of CUDA device ``index`` through NVML, or ``None``.

    NVML answers without a CUDA context (so it is safe before ``fork``)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        if nvml.nvmlInit_v2() != 0:
            return None
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            return None
        major, minor = ctypes.c_int(), ctypes.c_int()
        if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major),
                                                  ctypes.byref(minor)) != 0:
            return None
        name = ctypes.create_string_buffer(96)
        nvml.nvmlDeviceGetName(handle, name, 96)
        return (major.value, minor.value), name.value.decode(errors="replace")
    except (AttributeError, OSError) as exc:  # old driver without the symbol
        log.debug("NVML probe failed: %s", exc)
        return None
