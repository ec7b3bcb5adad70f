"""``list_backends``: every registered backend with its declaration and "runs here?"."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .errors import InvalidInputError
from .keys import KINDS, check_kind
from .platforms import Platform
from .plugins import load_plugins
from .registry import Dispatcher, Registry, default_registry, registry_or_active
from .selection import platform_or_current

if TYPE_CHECKING:
    from .base import DraftBackend

__all__ = ["BackendInfo", "list_backends", "known_libraries"]

# Vendor modules a class looks for in its own platform rule rather than in ``requires``
# (fa3: FlashAttention-3, or FlashAttention-4's sm90 kernel).
_RULE_LIBRARIES = ("flash_attn_interface", "flash_attn.cute")


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
    backend: Optional[type[DraftBackend]] = None


def _runs_here(cls: type[DraftBackend], platform: Platform) -> tuple[bool, str]:
    reasons = cls.platform_reasons(platform)
    if cls.pending:
        reasons.append(cls.pending)
    note = cls.runtime_note(platform)
    return (not reasons, "; ".join(reasons) if reasons else note)


def _dispatch_here(registry: Registry, disp: Dispatcher, platform: Platform,
                   depth: int = 0) -> tuple[bool, str]:
    """(the target here runs here?, "here -> target" and why it cannot run) of a dispatcher.

    A dispatcher "runs here" only when the backend it routes to on ``platform`` does: one of
    the target's classes of its kind (or, for a dispatcher target, its own target) runs."""
    kind = disp.kind
    route = next((r for r in disp.routes if r.when(platform)), None)
    target = route.target if route else None
    if target is None:
        return False, disp.warning or "here -> no backend"
    inner = registry.dispatcher(kind, target)
    if inner is not None and depth < 8:
        ok, why = _dispatch_here(registry, inner, platform, depth + 1)
        return ok, f"here -> {target}, {why}"
    if any(_runs_here(cls, platform)[0] for cls in registry.classes(kind, target)):
        return True, f"here -> {target}"
    return False, f"here -> {target}, which cannot run here (see {target}'s rows)"


def list_backends(kind: Optional[str] = None, pattern: Optional[str] = None,
                  available_only: bool = False, platform: Optional[Platform] = None,
                  registry: Optional[Registry] = None) -> list[BackendInfo]:
    """Registered backends (and dispatchers), sorted by name, kind, flavour.

    kind: ``"decode"``, ``"extend"`` or ``None`` for both. pattern: ``fnmatch`` pattern on
    names and aliases (``"fa*"``). available_only: only those whose platform and library
    predicates hold here, and dispatchers whose target here does (capabilities such as page
    size are per request and not checked).
    """
    if kind is not None:
        check_kind(kind)
    if pattern is not None and not isinstance(pattern, str):
        raise InvalidInputError("pattern", "an fnmatch pattern (str) or None", repr(pattern))
    platform = platform_or_current(platform)
    registry = registry_or_active(registry)
    if registry is default_registry:
        load_plugins()
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
            ok, reason = _dispatch_here(registry, disp, platform)
            rows.append(BackendInfo(
                disp.name, k, "dispatcher", (), ("mha", "mla"),
                "; ".join(f"{r.when.description} -> {r.target or 'none'}" for r in disp.routes),
                "-", (), "-", "dispatcher", ok, reason))
    if pattern:
        rows = [r for r in rows if fnmatch.fnmatch(r.name, pattern)
                or any(fnmatch.fnmatch(a, pattern) for a in r.aliases)]
    if available_only:
        rows = [r for r in rows if r.runs_here]
    return sorted(rows, key=lambda r: (r.name, r.kind, r.flavour))


def known_libraries(registry: Optional[Registry] = None) -> list[str]:
    """Every vendor module a registered class may need (sorted): what ``--with-library``
    can name."""
    registry = registry_or_active(registry)
    mods = set(_RULE_LIBRARIES)
    for kind in KINDS:
        for cls in registry.classes(kind):
            mods.update(m for m, _ in cls.requires)
    return sorted(mods)
