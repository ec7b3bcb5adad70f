"""Selection: from a requested name, a request and a platform to a backend class.

One generic lookup over the registry; rules 4-10 of ``docs/selection.md`` live in the backends'
declarations (flavours, aliases, dispatchers), not here. Every decision is recorded in a
``Selection`` so ``specattn select`` can explain it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Optional

from ._logging import deprecation_once, get_logger, warn_once
from .errors import (BackendUnavailableError, InvalidInputError, ModelMismatchError,
                     UnknownBackendError, shorten)
from .keys import BackendRequest, check_kind
from .platforms import Platform, current_platform
from .registry import Registry, active_registry, registry_or_active

if TYPE_CHECKING:
    from .base import DraftBackend
    from .registry import Dispatcher, Route

log = get_logger("selection")

__all__ = ["Selection", "select", "resolve_name", "describe_error", "UNKNOWN_NAME_MESSAGES",
           "AUTO", "AutoRow", "auto_order", "platform_or_current", "check_backend_name"]

AUTO = "auto"
# The original factory's messages (docs/selection.md rule 3), kept verbatim as prefixes.
UNKNOWN_NAME_MESSAGES = {
    "decode": "EAGLE is not supported in decode attention backend {name}",
    "extend": "EAGLE is not supported in attention backend {name}",
}
_MAX_REDIRECTS = 8


@dataclass
class Selection:
    """The outcome of one lookup and the steps that led to it."""

    kind: str
    requested: Optional[str]
    request: BackendRequest
    platform: Platform
    backend: Optional[type[DraftBackend]] = None
    steps: list[str] = field(default_factory=list)
    rejected: dict[str, list[str]] = field(default_factory=dict)

    def explain(self) -> str:
        lines = [f"{self.kind}: requested {self.requested!r} for {self.request} "
                 f"on {self.platform} (rule numbers: docs/selection.md)"]
        lines += [f"  {i}. {s}" for i, s in enumerate(self.steps, 1)]
        return "\n".join(lines)


def select(kind: str, name: Optional[str], request: BackendRequest,
           platform: Optional[Platform] = None, registry: Optional[Registry] = None,
           ) -> Selection:
    """Resolve ``name`` for ``request`` (``kind`` decode or extend) without instantiating.

    Returns a ``Selection`` whose ``backend`` is the class, or ``None`` when the rules say
    no backend (``num_steps <= 1`` for decode; ``flashmla`` extend). Raises
    ``UnknownBackendError``, ``ModelMismatchError`` or ``BackendUnavailableError``.
    """
    check_kind(kind)
    if not isinstance(request, BackendRequest):
        raise InvalidInputError("request", "a specattn.BackendRequest",
                                type(request).__name__)
    platform = platform_or_current(platform)
    registry = registry_or_active(registry)
    sel = Selection(kind, name, request, platform)
    if kind == "decode" and request.num_steps <= 1:
        sel.steps.append(f"num_steps={request.num_steps} <= 1: no multi-step draft decode "
                         "backend is needed (rule 1)")
        return sel
    if name is None or name == AUTO:
        return _select_auto(sel, registry)
    dispatched_from = None  # the first dispatcher of the chain, which the errors name
    for hop in _hops(kind, name, platform, registry):
        if hop.canonical is None:
            raise _unknown(kind, hop.name, registry)
        if hop.deprecated:
            message = f"attention backend name {hop.name!r} is deprecated; use {hop.canonical!r}"
            deprecation_once(message, stacklevel=4)
            sel.steps.append(f"{hop.name!r} is a deprecated alias of {hop.canonical!r}")
        elif hop.canonical != hop.name:
            sel.steps.append(f"{hop.name!r} is an alias of {hop.canonical!r}")
        if hop.dispatcher is None:
            return _select_named(sel, registry, hop.canonical, dispatched_from)
        route, dispatcher = hop.route, hop.dispatcher
        target = None if route is None else route.target
        why = "no route matched" if route is None else f"{route.when.description} holds"
        target_text = repr(target) if target else "no backend"
        note = f" ({dispatcher.note})" if dispatcher.note else ""
        sel.steps.append(f"{hop.canonical!r} dispatches: {why} -> {target_text}{note}")
        if target is None:
            if dispatcher.warning:
                warn_once(log, dispatcher.warning)
            return sel
        dispatched_from = dispatched_from or hop.canonical
    raise AssertionError("unreachable: the last hop is a class name, unknown or no target")


@dataclass(frozen=True)
class _Hop:
    """One name on the way from a requested name to a class name: ``canonical`` (``None``:
    unknown), whether ``name`` is a deprecated alias, and its dispatcher and the route the
    platform takes (``None`` where no route matched)."""

    name: str
    canonical: Optional[str]
    deprecated: bool
    dispatcher: Optional["Dispatcher"]
    route: Optional["Route"]


def _hops(kind: str, name: str, platform: Platform, registry: Registry) -> Iterator[_Hop]:
    """The names ``name`` passes through for ``kind`` on ``platform``: aliases followed,
    dispatchers routed; the last is a class name, an unknown name, or a dispatcher that
    routes to no backend. No capability is checked."""
    for _ in range(_MAX_REDIRECTS):
        canonical, deprecated = registry.canonical(kind, name)
        dispatcher = None if canonical is None else registry.dispatcher(kind, canonical)
        route = None if dispatcher is None else next(
            (r for r in dispatcher.routes if r.when(platform)), None)
        yield _Hop(name, canonical, deprecated, dispatcher, route)
        if route is None or route.target is None:
            return
        name = route.target
    raise RuntimeError(f"dispatcher loop resolving {name!r}")  # registry bug


def resolve_name(kind: str, name: str, platform: Optional[Platform] = None,
                 registry: Optional[Registry] = None) -> Optional[str]:
    """The backend name ``name`` reaches for ``kind`` on ``platform``, aliases (deprecated
    ones too) followed and dispatchers routed: ``cutedsl_mla`` extend -> ``trtllm_mla``,
    ``nsa`` -> ``dsa``, ``hybrid_linear_attn`` -> the platform's. ``None`` for a name no
    backend answers to or a dispatcher that routes to none. Nothing is checked against a
    request (``select`` does that)."""
    check_kind(kind)
    registry = registry_or_active(registry)
    *_, last = _hops(kind, name, platform_or_current(platform), registry)
    return last.canonical if last.dispatcher is None else None


def platform_or_current(platform: object) -> Platform:
    """``platform``, a ``Platform``; ``None``: the current one."""
    if platform is None:
        return current_platform()
    if not isinstance(platform, Platform):
        raise InvalidInputError("platform", "a specattn.platforms.Platform or None",
                                repr(platform))
    return platform


def _select_named(sel: Selection, registry: Registry, name: str,
                  dispatched_from: Optional[str] = None) -> Selection:
    kind, request, platform = sel.kind, sel.request, sel.platform
    classes = registry.classes(kind, name)
    if not request.mla:
        guard = next((c.mla_required_name for c in classes if c.mla_required_name), None)
        if guard and all(c.models == frozenset({"mla"}) for c in classes):
            sel.steps.append(f"{name!r} requires an MLA model and use_mla_backend is False "
                             "(rule 8)")
            raise ModelMismatchError(f"{guard} backend requires MLA model "
                                     "(use_mla_backend=True).")
    usable = []
    for cls in classes:
        reasons = cls.validate(request, platform)
        label = f"{cls.qualified_name()} [{cls.flavour}]"
        if reasons:
            sel.rejected[cls.qualified_name()] = reasons
            sel.steps.append(f"{label}: rejected: " + "; ".join(reasons))
        else:
            usable.append(cls)
            sel.steps.append(f"{label}: accepted")
    if not usable:
        detail = "; ".join(f"{q}: {', '.join(r)}" for q, r in sel.rejected.items())
        # A dispatcher's target: the message names the dispatcher too (what was asked for).
        label = name if dispatched_from is None else f"{dispatched_from} (-> {name})"
        raise BackendUnavailableError(
            f"{label}: no {kind} backend registered as {name!r} can serve {request} on "
            f"{platform}. Candidates: {detail}. Run `specattn list` to see what runs here.",
            name, sel.rejected, summary=f"{label}: " + _cause(classes, sel, platform))
    best = max(usable, key=lambda c: (c.priority_on(platform), c.qualified_name()))
    if len(usable) > 1:
        sel.steps.append(f"several flavours fit; highest priority wins: {best.flavour}")
    sel.backend = best
    sel.steps.append(f"selected {best.qualified_name()} (kernel library: "
                     f"{best.kernel_library}){_note(best, platform, request)}")
    return sel


def _select_auto(sel: Selection, registry: Registry) -> Selection:
    kind, request, platform = sel.kind, sel.request, sel.platform
    sel.steps.append("no explicit name: choose the highest-priority backend that can run "
                     "here (rule 16)")
    usable = []
    for cls in registry.classes(kind):
        if not cls.auto_eligible:
            sel.rejected[cls.qualified_name()] = ["model-specific attention: only chosen by "
                                                  "name, never by auto"]
            continue
        reasons = cls.validate(request, platform)
        if reasons:
            sel.rejected[cls.qualified_name()] = reasons
        else:
            usable.append(cls)
    if not usable:
        # One line: the cause; every candidate's reasons (all the registry's classes, some
        # thousands of characters) are the error's .reasons and `specattn select --explain`.
        eligible = [c for c in registry.classes(kind) if c.auto_eligible]
        if any(not c.platform_reasons(platform) for c in eligible):
            cause = _cause(eligible, sel, platform)
            summary = f"auto: no {kind} backend can serve the request here: {cause}"
        else:
            cause = "none runs here (`specattn list` says why)"
            summary = f"auto: no {kind} backend runs here (`specattn list` says why)"
        raise BackendUnavailableError(
            f"auto: no {kind} backend can serve {request} on {platform}: {cause}. Each "
            "candidate's reasons: the error's .reasons, or `specattn select --explain`.",
            AUTO, sel.rejected, summary=summary)
    ranked = sorted(usable, key=lambda c: _auto_rank(c, platform))
    sel.steps.append("usable, best first: " + ", ".join(
        f"{c.name}[{c.flavour}] (priority {c.priority_on(platform)})" for c in ranked))
    sel.backend = ranked[0]
    sel.steps.append(f"selected {ranked[0].name} ({ranked[0].qualified_name()})"
                     f"{_note(ranked[0], platform, request)}")
    log.info("auto selected %s backend %s for %s on %s", kind, ranked[0].name, request,
             platform)
    return sel


def _cause(classes: list, sel: Selection, platform: Platform) -> str:
    """The short cause of a rejection: what the candidates that run here refuse in the
    request (page size, dtype, ...); when none runs here, each candidate's first reason
    without the platform (the caller names it), each once, from the candidates that serve
    the request's model when one does (``flashinfer`` for an MLA model: what its MLA class
    needs, not that its MHA class serves MHA)."""
    here = [c for c in classes if not c.platform_reasons(platform)]
    if not here:
        classes = [c for c in classes if sel.request.model in c.models] or classes
    if len(here) == 1:
        causes = sel.rejected.get(here[0].qualified_name(), [])
    elif here:
        same_name = len({c.name for c in here}) == 1
        causes = [f"{c.flavour if same_name else c.name}: "
                  + ", ".join(sel.rejected.get(c.qualified_name(), [])) for c in here]
    else:
        each = [sel.rejected.get(c.qualified_name(), []) for c in classes]
        first = each[0] if len(each) == 1 else [r[0] for r in each if r]
        causes = [r.split(", this platform is")[0] for r in first]
    return "; ".join(dict.fromkeys(causes))


def _note(cls: type[DraftBackend], platform: Platform, request: BackendRequest) -> str:
    """``"; <runtime note>"`` (e.g. which kernel runs here) when the class gives one."""
    note = cls.runtime_note(platform, request)
    return f"; {note}" if note else ""


def _auto_rank(cls: type[DraftBackend], platform: Platform) -> tuple:
    """``auto``'s order: highest priority on the platform first, then by name."""
    return (-cls.priority_on(platform), cls.name, cls.qualified_name())


@dataclass(frozen=True)
class AutoRow:
    """One backend class in ``auto``'s order on a platform (``auto_order``)."""

    kind: str
    rank: int  # 1 = tried first
    name: str
    flavour: str
    priority: int
    models: tuple[str, ...]
    runs_here: bool  # the platform and library predicates hold
    reason: str  # why not, when it does not run here
    qualified_name: str


def auto_order(platform: Optional[Platform] = None, kind: Optional[str] = None,
               registry: Optional[Registry] = None) -> list[AutoRow]:
    """The order in which ``auto`` tries the backends on ``platform`` (default: this one),
    as one table: per kind, every class ``auto`` may pick, best first. ``auto`` takes the
    first row that runs here and accepts the request (model, topk, page size, dtype, ...).
    Model-specific classes (``auto_eligible = False``) are never picked and not listed."""
    if kind is not None:
        check_kind(kind)
    platform = platform_or_current(platform)
    registry = registry_or_active(registry)
    rows = []
    for k in (("decode", "extend") if kind is None else (kind,)):
        eligible = [c for c in registry.classes(k) if c.auto_eligible]
        for rank, cls in enumerate(sorted(eligible, key=lambda c: _auto_rank(c, platform)), 1):
            reasons = cls.platform_reasons(platform) + ([cls.pending] if cls.pending else [])
            rows.append(AutoRow(k, rank, cls.name, cls.flavour, cls.priority_on(platform),
                                tuple(sorted(cls.models)), not reasons, "; ".join(reasons),
                                cls.qualified_name()))
    return rows


# The SpecConfig field that names only the backend of each kind (rule 2; extend's under the
# default speculative_attention_mode).
_KIND_FIELDS = {"decode": "decode_attention_backend", "extend": "prefill_attention_backend"}


def _unknown(kind: str, name: object, registry: Registry) -> UnknownBackendError:
    valid = [n for n in registry.all_names(kind)] + [AUTO]
    other = "extend" if kind == "decode" else "decode"
    only = other if name in registry.all_names(other) else None
    # Case folded (``FlashInfer``); no hint for a name close to none (``nope``), nor for a
    # name of the other kind only (not a typo).
    folded = {n.lower(): n for n in valid}
    closest = [] if only else difflib.get_close_matches(str(name).lower(), list(folded), n=1)
    hint = folded[closest[0]] if closest else None
    # The original's sentence, then the answer, then the list it comes from.
    message = (UNKNOWN_NAME_MESSAGES[kind].format(name=shorten(str(name))) + "."
               + (f" Did you mean {hint!r}?" if hint else "")
               + (f" {name!r} is registered for {other} only: {_only_advice(kind)}."
                  if only else "")
               + f" Valid {kind} backend names: {', '.join(sorted(valid))}.")
    return UnknownBackendError(message, name, sorted(valid), hint, only)


def check_backend_name(argument: str, name: str, expected: str,
                       also: tuple[str, ...] = ()) -> None:
    """``name`` is a backend registered for either kind (aliases included, the
    ``specattn.backends`` plugins loaded) or one of ``also``; else an ``InvalidInputError``
    naming ``argument`` (a setting or a flag): ``expected``, then the closest known name."""
    from .plugins import load_plugins

    load_plugins()
    registry = active_registry()
    known = sorted({*registry.all_names("decode"), *registry.all_names("extend"), *also})
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise InvalidInputError(argument, f"{expected} (`specattn list` shows the "
                                f"backends{hint})", repr(shorten(name)))


def _only_advice(kind: str) -> str:
    """Where to name a backend that has no class of ``kind`` (the other kind's only)."""
    other = "extend" if kind == "decode" else "decode"
    return (f"name it in {_KIND_FIELDS[other]}, and the {kind} backend in "
            f"{_KIND_FIELDS[kind]} or nowhere (auto; docs/selection.md, rule 2)")


def describe_error(exc: BaseException) -> str:
    """One short line for a person. An unknown name: ``unknown backend 'flashinfr'; did you
    mean 'flashinfer'?`` (the known names when none is close; the exception's own message
    keeps the original factory's sentence, for code that matches it). A backend that cannot
    run: ``BackendUnavailableError: `` and its ``summary``. Else ``Type: message``."""
    if isinstance(exc, UnknownBackendError):
        if exc.only_kind:
            kind = "extend" if exc.only_kind == "decode" else "decode"
            return (f"backend {exc.name!r} has no {kind} class (it is registered for "
                    f"{exc.only_kind} only): {_only_advice(kind)}")
        if exc.closest:
            return f"unknown backend {shorten(repr(exc.name))}; did you mean {exc.closest!r}?"
        known = ", ".join(n for n in exc.valid_names if n != AUTO)
        return f"unknown backend {shorten(repr(exc.name))}; known names: {known}"
    if isinstance(exc, BackendUnavailableError):
        return f"{type(exc).__name__}: {exc.summary}"
    return f"{type(exc).__name__}: {exc}"
