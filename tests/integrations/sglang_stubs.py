"""Import-only stand-ins for two packages SGLang's test kit pulls in but never uses here.

``torchvision`` (imported by two SGLang config modules; the PyPI wheel needs a CUDA build of
torch) and HF ``datasets`` (imported by ``sglang.test.test_utils``). Each stub is a module
whose attributes raise when called. Installed only when the real package is missing.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["install"]


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr} is an import-only test stub")

        return unavailable

    module.__getattr__ = __getattr__
    sys.modules[name] = module
    return module


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BOX = "box"
    BILINEAR = "bilinear"
    HAMMING = "hamming"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def install() -> None:
    if importlib.util.find_spec("torchvision") is None:
        # transformers caches "is torchvision available" on first ask: ask it before the stub
        # exists, so it keeps treating torchvision as absent.
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
        vision = _stub("torchvision")
        transforms = _stub("torchvision.transforms", InterpolationMode=InterpolationMode)
        functional = _stub("torchvision.transforms.functional",
                           InterpolationMode=InterpolationMode)
        vision.transforms, transforms.functional = transforms, functional
    if importlib.util.find_spec("datasets") is None:
        _stub("datasets")
