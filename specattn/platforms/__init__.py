"""Platforms: what machine we are on, as a value, detected lazily and overridable.

>>> from specattn.platforms import Platform, use_platform, current_platform, is_hopper
>>> with use_platform(Platform("cuda", (9, 0))):
...     is_hopper(current_platform())
True
"""

from .detect import (current_platform, detect, torch_device_type, triton_interpret_enabled,
                     use_platform)
from .interface import DEVICE_TYPES, DeviceType, Platform
from .predicates import (
    Predicate,
    any_platform,
    cpu_has_amx,
    cuda_capability,
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
    triton_interpret,
)

__all__ = [
    "Platform", "DeviceType", "DEVICE_TYPES", "current_platform", "detect", "use_platform",
    "torch_device_type", "Predicate", "any_platform", "cpu_has_amx", "cuda_capability",
    "has_library", "is_blackwell", "is_cpu", "is_cpu_with_amx", "is_cuda", "is_hip",
    "is_hopper", "is_musa", "is_npu", "is_xpu", "triton_interpret", "triton_interpret_enabled",
]
