"""``hybrid_linear_attn``: not a backend but a dispatcher (rule 6), the same for both kinds:
a CPU with AMX gets ``intel_amx``, Blackwell gets ``triton``, anything else ``fa3``."""

from __future__ import annotations

from ..keys import KINDS
from ..platforms import any_platform, is_blackwell, is_cpu_with_amx
from ..registry import Dispatcher, Route, default_registry

ROUTES = (
    Route(is_cpu_with_amx, "intel_amx"),
    Route(is_blackwell, "triton"),
    Route(any_platform, "fa3"),
)

for _kind in KINDS:
    default_registry.add_dispatcher(Dispatcher(
        "hybrid_linear_attn", _kind, ROUTES,
        note="full-attention layers of hybrid linear-attention models"))
