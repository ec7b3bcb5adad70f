"""``aiter``: ROCm attention through AMD's aiter kernels. Glue lands with issue #7."""

from __future__ import annotations

from ..platforms import is_hip
from ._pending import pending_pair, pending_reason

AiterDecode, AiterExtend = pending_pair(
    __name__, "aiter", "ROCm attention through AMD's aiter kernels.",
    pending_reason(7, "the aiter glue"), platforms=is_hip, requires=(("aiter", "aiter"),),
    kernel_library="aiter", priority={"hip": 70})
