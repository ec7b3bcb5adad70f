"""``torch_ref``: the reference backend (placeholder until issue #3 lands it)."""

from __future__ import annotations

from ..platforms import any_platform
from ._pending import PendingDecode, PendingExtend, pending_reason


class TorchRefDecode(PendingDecode, name="torch_ref", platforms=any_platform,
                     kernel_library="torch", priority=0):
    pending = pending_reason(3, "the reference")


class TorchRefExtend(PendingExtend, name="torch_ref", platforms=any_platform,
                     kernel_library="torch", priority=0):
    pending = pending_reason(3, "the reference")
