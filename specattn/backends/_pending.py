"""Intermediate bases for rows whose kernels land in a later issue.

A class built on these is registered (selection, ``specattn list`` and the error paths are
real), declares ``pending`` with the issue that brings its kernels, and raises
``BackendUnavailableError`` from its constructor. ``validate`` reports ``pending`` too, so
``auto`` never picks it.
"""

from __future__ import annotations

from ..base import DraftDecodeBackend, DraftExtendBackend
from ..errors import BackendUnavailableError


def _not_built(self: object, *args: object, **kwargs: object) -> None:
    cls = type(self)
    raise BackendUnavailableError(f"{cls.name}: {cls.pending}", cls.name)


class PendingDecode(DraftDecodeBackend):
    init_forward_metadata = _not_built
    forward = _not_built


class PendingExtend(DraftExtendBackend):
    init_forward_metadata = _not_built
    forward = _not_built


def pending_reason(issue: int, what: str) -> str:
    return f"not implemented yet in this version of specattn ({what}: issue #{issue})"


def pending_pair(module: str, name: str, doc: str, reason: str, **decl: object):
    """Declare a pending row's decode and extend classes (identical declarations)."""
    attrs = {"pending": reason, "__doc__": doc, "__module__": module,
             **decl.pop("attrs", {})}  # type: ignore[arg-type]
    flavour = str(decl.get("flavour", ""))
    suffix = "".join(p.capitalize() for p in f"{name}_{flavour}".split("_"))
    dec = type(f"{suffix}Decode", (PendingDecode,), dict(attrs), name=name, **decl)
    ext = type(f"{suffix}Extend", (PendingExtend,), dict(attrs), name=name, **decl)
    return dec, ext
