"""``list_backends``: every registered backend with its declaration and "runs here?"."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional

from .keys import KINDS
from .platforms import Platform, current_platform
from .plugins import load_plugins
from .registry import Registry, active_registry, default_registry

__all__ = ["BackendInfo", "list_backends"]


@dataclass(frozen=True)
class BackendInfo:
    """One registered class or dispatcher, as ``specattn list`` shows it."""

    name: str
    kind: str
    flavour: str
    aliases: tuple[str, ...]
    models: tuple[str, ...]
    platforms: str
    kernel_library: str
    capabilities: tuple[str, ...]
    tested_on: str
    qualified_name: str
    runs_here: bool
    reason: str  # why not, or a note when it runs
    backend: Optional[type] = None


def _runs_here(cls: type, platform: Platform) -> tuple[bool, str]:
    reasons = cls.platform_reasons(platform)
    if cls.pending:
        reasons.append(cls.pending)
    note = cls.runtime_note(platform) if hasattr(cls, "runtime_note") else ""
    return (not reasons, "; ".join(reasons) if reasons else note)


def list_backends(kind: Optional[str] = None, pattern: Optional[str] = None,
                  available_only: bool = False, platform: Optional[Platform] = None,
                  registry: Optional[Registry] = None) -> list[BackendInfo]:
    """Registered backends (and dispatchers), sorted by name, kind, flavour.

    kind: ``"decode"``, ``"extend"`` or ``None`` for both. pattern: ``fnmatch`` pattern on
    names and aliases (``"fa*"``). available_only: only those whose platform and library
    predicates hold here (capabilities such as page size are per request and not checked).
    """
    registry = active_registry() if registry is None else registry
    if registry is default_registry:
        load_plugins()
    platform = current_platform() if platform is None else platform
    rows: list[BackendInfo] = []
    for k in KINDS if kind is None else (kind,):
        for cls in registry.classes(k):
            d = cls.describe()
            ok, reason = _runs_here(cls, platform)
            rows.append(BackendInfo(d["name"], k, d["flavour"], tuple(d["aliases"]),
                                    tuple(d["models"]), d["platforms"], d["kernel_library"],
                                    tuple(d["capabilities"]), d["tested_on"], d["class"], ok,
                                    reason, cls))
        for disp in registry.dispatchers(k):
            route = next((r for r in disp.routes if r.when(platform)), None)
            target = route.target if route else None
            rows.append(BackendInfo(
                disp.name, k, "dispatcher", (), ("mha", "mla"),
                "; ".join(f"{r.when.description} -> {r.target or 'none'}" for r in disp.routes),
                "-", (), "-", "dispatcher", True,
                f"here -> {target}" if target else (disp.warning or "here -> no backend")))
    if pattern:
        rows = [r for r in rows if fnmatch.fnmatch(r.name, pattern)
                or any(fnmatch.fnmatch(a, pattern) for a in r.aliases)]
    if available_only:
        rows = [r for r in rows if r.runs_here]
    return sorted(rows, key=lambda r: (r.name, r.kind, r.flavour))
