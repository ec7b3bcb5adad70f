"""Import-only stand-ins for packages SGLang's draft path imports but never needs here.

- ``sgl_kernel`` (the ``sglang-kernel`` wheel: compiled against the torch SGLang pins, so it
  cannot load beside another torch build; SGLang imports it whenever it runs on CUDA),
- ``IPython`` and HF ``datasets`` (imported by SGLang's test utilities),
- ``torchvision`` (imported by two SGLang config modules; on a CPU-only machine its wheel
  would pull in a CUDA build of torch).

A stand-in is a module (and any submodule asked for) whose every attribute is a function
that raises ``BackendUnavailableError`` when called; each call is counted (``calls()``), so a
run can show that none was made even where SGLang catches the error. ``shims`` replaces
chosen attributes with real functions (a pure-Python helper of the stubbed package), whose
calls are counted apart (``shim_calls()``). Stand-ins are installed only for packages that
are missing. Imports nothing from SGLang.
"""

from __future__ import annotations

import enum
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections import Counter
from typing import Callable, Iterable, Mapping, Optional

from ...errors import BackendUnavailableError

__all__ = ["CPU_PACKAGES", "GPU_PACKAGES", "install", "installed", "calls", "shim_calls",
           "reset_counts"]

CPU_PACKAGES = ("torchvision", "datasets")
GPU_PACKAGES = ("sgl_kernel", "IPython", "datasets")

_calls: Counter = Counter()
_shim_calls: Counter = Counter()
_roots: set[str] = set()
_shims: dict[str, Callable] = {}
# Answers that are the package's own where it is absent: ``IPython.get_ipython`` is None
# outside an IPython shell (matplotlib asks it when it picks a backend).
_ANSWERS: dict[str, Callable] = {"IPython.get_ipython": lambda: None}
_absent: set[str] = set()


class InterpolationMode(enum.Enum):
    """``torchvision.transforms.InterpolationMode``: SGLang reads its members at import."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BOX = "box"
    BILINEAR = "bilinear"
    HAMMING = "hamming"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


_ATTRS = {"torchvision.transforms": {"InterpolationMode": InterpolationMode},
          "torchvision.transforms.functional": {"InterpolationMode": InterpolationMode}}
# Submodules read as attributes of their parent (``torchvision.transforms.X``).
_SUBMODULES = {"torchvision": ("torchvision.transforms", "torchvision.transforms.functional")}


def _raiser(qualname: str) -> Callable:
    def unavailable(*args, **kwargs):
        _calls[qualname] += 1
        raise BackendUnavailableError(f"{qualname}: an import-only stand-in was called (the "
                                      f"package is not installed)", name=qualname)

    unavailable.__qualname__ = unavailable.__name__ = qualname.rsplit(".", 1)[-1]
    return unavailable


def _counted(qualname: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def shim(*args, **kwargs):
        _shim_calls[qualname] += 1
        return fn(*args, **kwargs)

    return shim


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package: submodules are stand-ins too
    module.__dict__.update(_ATTRS.get(name, {}))
    for qualname, fn in _shims.items():
        parent, _, attr = qualname.rpartition(".")
        if parent == name:
            setattr(module, attr, _counted(qualname, fn))

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        fn = _raiser(f"{name}.{attr}")
        setattr(module, attr, fn)
        return fn

    module.__getattr__ = __getattr__
    return module


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return _module(spec.name)

    def exec_module(self, module) -> None:
        parent, _, child = module.__name__.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in _roots:
            return None
        if fullname in _absent:  # SGLang falls back when this import fails
            raise ModuleNotFoundError(f"No module named {fullname!r} (import-only stand-in "
                                      "of its package)", name=fullname)
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


_FINDER = _Finder()


def _missing(name: str) -> bool:
    if name in sys.modules:
        return False
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def install(packages: Iterable[str] = CPU_PACKAGES,
            shims: Optional[Mapping[str, Callable]] = None,
            absent: Iterable[str] = ()) -> list[str]:
    """Stand-ins for those of ``packages`` that are missing; returns their names.

    shims: ``{"pkg.module.attr": fn}``: a real function in place of the raising one (counted
    in ``shim_calls()``); only for a package that gets a stand-in. absent: submodules of a
    stand-in whose import fails as if the package were missing (where the importer has a
    fallback for that)."""
    new = [p for p in dict.fromkeys(packages) if p not in _roots and _missing(p)]  # once each
    if "torchvision" in new:
        # transformers caches "is torchvision available" on first ask: ask it before the
        # stand-in exists, so it keeps treating torchvision as absent.
        try:
            from transformers.utils import import_utils

            import_utils.is_torchvision_available()
        except ImportError:
            pass
    _shims.update({k: v for k, v in {**_ANSWERS, **(shims or {})}.items()
                   if k.split(".")[0] in new})
    _absent.update(m for m in absent if m.split(".")[0] in new)
    _roots.update(new)
    if new and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    for name in new:
        for module in (name, *_SUBMODULES.get(name, ())):
            importlib.import_module(module)
    return new


def installed() -> list[str]:
    """The packages that are stand-ins in this process."""
    return sorted(_roots)


def calls() -> dict[str, int]:
    """Calls of raising stand-in functions since the last ``reset_counts()``, by name."""
    return dict(_calls)


def shim_calls() -> dict[str, int]:
    return dict(_shim_calls)


def reset_counts() -> None:
    _calls.clear()
    _shim_calls.clear()
