"""Triton backend (``triton``): shared-prefix draft decode and draft extend, MHA and MLA.

Kernels land with issue #4.
"""

from __future__ import annotations

from ...platforms import is_cpu, is_cuda, is_hip, is_xpu, triton_interpret
from .._pending import PendingDecode, PendingExtend, pending_reason

_PLATFORMS = is_cuda | is_hip | is_xpu | (is_cpu & triton_interpret)
_PRIORITY = {"cuda": 60, "hip": 60, "xpu": 60, "cpu": 5}


class TritonDecode(PendingDecode, name="triton", platforms=_PLATFORMS,
                   requires=(("triton", "triton"),), kernel_library="triton (specattn)",
                   priority=_PRIORITY):
    pending = pending_reason(4, "the Triton kernels")


class TritonExtend(PendingExtend, name="triton", platforms=_PLATFORMS,
                   requires=(("triton", "triton"),), kernel_library="triton (specattn)",
                   priority=_PRIORITY):
    pending = pending_reason(4, "the Triton kernels")
