"""``intel_amx``: the CPU backend (placeholder until issue #3 lands it)."""

from __future__ import annotations

from ..platforms import is_cpu
from ._pending import PendingDecode, PendingExtend, pending_reason


class IntelAMXDecode(PendingDecode, name="intel_amx", platforms=is_cpu,
                     kernel_library="torch (oneDNN)", priority={"cpu": 50}):
    pending = pending_reason(3, "the CPU backend")


class IntelAMXExtend(PendingExtend, name="intel_amx", platforms=is_cpu,
                     kernel_library="torch (oneDNN)", priority={"cpu": 50}):
    pending = pending_reason(3, "the CPU backend")
