"""The backend registry: names, aliases and dispatchers per kind.

``Registry`` is a plain class; the module's default instance holds the built-in backends.
``__init_subclass__`` writes into the *active* registry (a ``ContextVar``), which is the
default unless a test has entered ``scoped_registry()``, so classes created inside tests never
leak into the global registry.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from ._logging import get_logger
from .errors import (DuplicateBackendError, InvalidInputError, NotRegisteredError,
                     RegistrationError)
from .keys import KINDS
from .platforms import Predicate

log = get_logger("registry")

# A registered class: a subclass of ``specattn.base.DraftBackend``, typed loosely here because
# that module registers its subclasses into this one (an import back would be a circle).
BackendClass = type[Any]

__all__ = ["Registry", "Route", "Dispatcher", "default_registry", "active_registry",
           "registry_or_active", "scoped_registry"]


@dataclass(frozen=True)
class Route:
    """One branch of a dispatcher: when ``when`` holds, use ``target`` (``None``: no backend)."""

    when: Predicate
    target: Optional[str]


@dataclass(frozen=True)
class Dispatcher:
    """A name that is not a backend but resolves to one by platform (data, not ``if``s).

    ``routes`` are tried in order; the first whose predicate holds decides. A route to
    ``None`` makes the factory return ``None`` after logging ``warning``.
    """

    name: str
    kind: str
    routes: tuple[Route, ...]
    note: str = ""
    warning: str = ""


class Registry:
    """Backend classes by kind and name, with aliases and dispatchers.

    Several classes may share one name when they declare different ``flavour=`` (e.g.
    ``flashinfer`` for MHA and for MLA); selection picks among them by their predicates.
    """

    def __init__(self) -> None:
        self._classes: dict[str, dict[str, dict[str, BackendClass]]] = {k: {} for k in KINDS}
        self._aliases: dict[str, dict[str, tuple[str, bool]]] = {k: {} for k in KINDS}
        self._dispatchers: dict[str, dict[str, Dispatcher]] = {k: {} for k in KINDS}

    # --- writing ---------------------------------------------------------------------------

    def register(self, cls: BackendClass, *, replace: bool = False) -> None:
        """Add a declared backend class (called by ``__init_subclass__``)."""
        kind, name, flavour = cls.kind, cls.name, cls.flavour
        if kind not in KINDS:
            raise RegistrationError(f"{cls.qualified_name()}: subclass DraftDecodeBackend or "
                                    "DraftExtendBackend, not DraftBackend directly")
        # Every check runs before anything changes: a refused class leaves no trace.
        self._check_name_free(kind, name, cls, is_alias=False)
        old = self._classes[kind].get(name, {}).get(flavour)
        # The same class statement run again (a module reloaded, a notebook cell re-run)
        # replaces its earlier class: it is one definition, not two backends.
        again = old is not None and old.qualified_name() == cls.qualified_name()
        if old is not None and old is not cls and not (replace or again):
            raise DuplicateBackendError(
                f"{kind} backend name {name!r} (flavour {flavour!r}) is declared twice: "
                f"{old.qualified_name()} and {cls.qualified_name()}; pass replace=True "
                "to override on purpose")
        for alias in cls.aliases + cls.deprecated_aliases:
            self._check_name_free(kind, alias, cls, is_alias=True)
        if again and old is not cls:
            log.debug("%s backend %r (flavour %r): %s defined again", kind, name, flavour,
                      cls.qualified_name())
        elif old is not None and old is not cls:
            log.warning("%s backend %r (flavour %r): %s replaces %s", kind, name, flavour,
                        cls.qualified_name(), old.qualified_name())
        self._classes[kind].setdefault(name, {})[flavour] = cls
        self._reindex_aliases(kind)

    def _reindex_aliases(self, kind: str) -> None:
        """Aliases live while a registered class declares them (one table, rebuilt)."""
        table: dict[str, tuple[str, bool]] = {}
        for flavours in self._classes[kind].values():
            for c in flavours.values():
                table.update({a: (c.name, False) for a in c.aliases})
                table.update({a: (c.name, True) for a in c.deprecated_aliases})
        self._aliases[kind] = table

    def _check_name_free(self, kind: str, name: str, cls: BackendClass, *, is_alias: bool
                         ) -> None:
        if name in self._dispatchers[kind]:
            raise DuplicateBackendError(f"{cls.qualified_name()}: {name!r} is already a "
                                        f"{kind} dispatcher")
        if is_alias:
            owner = self._aliases[kind].get(name, (cls.name, False))[0]
            clash = name in self._classes[kind] or owner != cls.name
        else:
            clash = name in self._aliases[kind] and self._aliases[kind][name][0] != name
        if clash:
            other = self._owner_of(kind, name)
            raise DuplicateBackendError(
                f"{kind} name {name!r} of {cls.qualified_name()} is already taken by "
                f"{other}")

    def _owner_of(self, kind: str, name: str) -> str:
        canonical = self._aliases[kind].get(name, (name, False))[0]
        classes = self._classes[kind].get(canonical, {})
        return ", ".join(c.qualified_name() for c in classes.values()) or repr(canonical)

    def add_dispatcher(self, dispatcher: Dispatcher) -> None:
        """Register a dispatcher name (``hybrid_linear_attn``, ``flashmla`` extend)."""
        kind = dispatcher.kind
        if kind not in KINDS:
            raise RegistrationError(f"dispatcher {dispatcher.name!r}: unknown kind {kind!r}")
        if (dispatcher.name in self._classes[kind] or dispatcher.name in self._aliases[kind]
                or dispatcher.name in self._dispatchers[kind]):
            raise DuplicateBackendError(f"{kind} name {dispatcher.name!r} is already taken")
        self._dispatchers[kind][dispatcher.name] = dispatcher

    def unregister(self, cls: BackendClass) -> None:
        """Remove ``cls`` (and the aliases no remaining class declares)."""
        flavours = self._classes[cls.kind].get(cls.name, {})
        if flavours.get(cls.flavour) is not cls:
            raise NotRegisteredError(f"{cls.qualified_name()} is not registered here")
        del flavours[cls.flavour]
        if not flavours:
            del self._classes[cls.kind][cls.name]
        self._reindex_aliases(cls.kind)

    # --- reading ---------------------------------------------------------------------------

    def names(self, kind: str) -> list[str]:
        """Canonical backend and dispatcher names of ``kind``, sorted."""
        return sorted(set(self._classes[kind]) | set(self._dispatchers[kind]))

    def all_names(self, kind: str) -> list[str]:
        """Canonical names, aliases and dispatchers of ``kind``, sorted."""
        return sorted(set(self.names(kind)) | set(self._aliases[kind]))

    def canonical(self, kind: str, name: str) -> tuple[Optional[str], bool]:
        """``(canonical name or None, is a deprecated alias)``."""
        if name in self._classes[kind] or name in self._dispatchers[kind]:
            return name, False
        if name in self._aliases[kind]:
            return self._aliases[kind][name]
        return None, False

    def dispatcher(self, kind: str, name: str) -> Optional[Dispatcher]:
        return self._dispatchers[kind].get(name)

    def classes(self, kind: str, name: Optional[str] = None) -> list[BackendClass]:
        """Classes of ``kind`` (all, or those registered under ``name``), by qualified name."""
        if name is None:
            found = [c for flavours in self._classes[kind].values() for c in flavours.values()]
        else:
            found = list(self._classes[kind].get(name, {}).values())
        return sorted(found, key=lambda c: c.qualified_name())

    def dispatchers(self, kind: str) -> list[Dispatcher]:
        return [self._dispatchers[kind][n] for n in sorted(self._dispatchers[kind])]

    def aliases_of(self, kind: str, name: str) -> list[str]:
        return sorted(a for a, (c, _) in self._aliases[kind].items() if c == name)

    # --- copies ----------------------------------------------------------------------------

    def copy(self) -> "Registry":
        new = Registry()
        for kind in KINDS:
            new._classes[kind] = {n: dict(f) for n, f in self._classes[kind].items()}
            new._aliases[kind] = dict(self._aliases[kind])
            new._dispatchers[kind] = dict(self._dispatchers[kind])
        return new


default_registry = Registry()
_active: contextvars.ContextVar[Registry] = contextvars.ContextVar(
    "specattn_active_registry", default=default_registry)


def active_registry() -> Registry:
    """The registry that new backend classes register into and selection reads."""
    return _active.get()


def registry_or_active(registry: object) -> Registry:
    """``registry``, a ``Registry``; ``None``: the active one. Checked where a caller passes
    it, not where selection first reads it (an ``AttributeError`` deep inside)."""
    if registry is None:
        return active_registry()
    if not isinstance(registry, Registry):
        raise InvalidInputError("registry", "a specattn.Registry or None", repr(registry))
    return registry


@contextlib.contextmanager
def scoped_registry(base: Optional[Registry] = None, *,
                    empty: bool = False) -> Iterator[Registry]:
    """Make a private registry active for the ``with`` block.

    By default it starts as a copy of ``base`` (the default registry), so built-ins stay
    selectable; ``empty=True`` starts with nothing. Classes created inside land only there.
    """
    registry = Registry() if empty else (base or default_registry).copy()
    token = _active.set(registry)
    try:
        yield registry
    finally:
        _active.reset(token)


def use_registry(registry: Registry) -> contextlib.AbstractContextManager[Registry]:
    """Make an existing ``registry`` active for a ``with`` block."""

    @contextlib.contextmanager
    def _cm() -> Iterator[Registry]:
        token = _active.set(registry)
        try:
            yield registry
        finally:
            _active.reset(token)

    return _cm()

