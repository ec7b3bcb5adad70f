"""The backend under test: which class serves each (kind, model), in which environment.

A ``Target`` is built from a registered name (resolved like the factory does: aliases,
dispatchers, the flavour that runs on the platform) or from backend classes (a user's class
need not be registered). ``Target.environment()`` makes the platform current and enters the
caller's ``setup`` (for example stand-in vendor modules) around every call the kit makes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Mapping, Optional, Sequence, Union

import torch

from ..base import DraftBackend, DraftDecodeBackend
from ..errors import InvalidInputError, UnknownBackendError
from ..keys import KINDS, a_kind
from ..platforms import Platform, current_platform, torch_device_type, use_platform
from ..registry import active_registry
from ..selection import select
from .outcomes import CaseSkipped

__all__ = ["Target", "BackendSpec"]

BackendSpec = Union[str, type, Sequence[type]]
MODELS = ("mha", "mla")


@dataclass
class Target:
    """``classes[(kind, model)]`` is the class under test, or a string: why none is."""

    label: str
    classes: dict[tuple[str, str], Union[type, str]]
    platform: Platform
    device: torch.device
    setup: Optional[Callable[[], ContextManager[Any]]] = None
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    _pinned_platform: bool = False

    @classmethod
    def build(cls, backend: BackendSpec, *, platform: Optional[Platform] = None,
              device: Union[str, torch.device, None] = None,
              setup: Optional[Callable[[], ContextManager[Any]]] = None,
              decode_options: Optional[Mapping[str, Any]] = None,
              extend_options: Optional[Mapping[str, Any]] = None) -> "Target":
        pinned = platform is not None
        options = {"decode": dict(decode_options or {}), "extend": dict(extend_options or {})}
        with _maybe_platform(platform):
            with (setup() if setup is not None else contextlib.nullcontext()):
                plat = current_platform()
                if isinstance(backend, str):
                    label, classes = backend, _resolve_name(backend, plat)
                else:
                    label, classes = _from_classes(backend)
        return cls(label, classes, plat, _device_for(plat, device), setup, options, pinned)

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        with _maybe_platform(self.platform if self._pinned_platform else None):
            with (self.setup() if self.setup is not None else contextlib.nullcontext()):
                yield

    def class_for(self, kind: str, model: str) -> Union[type, str]:
        return self.classes.get((kind, model), f"no {kind} backend for {model.upper()}")

    def construct(self, cls: type, runner: Any, kind: str, topk: int, num_steps: int,
                  tree_mode: str) -> DraftBackend:
        given = self.options.get(kind, {})
        opts = {**getattr(cls, "kit_options", {}), **given}
        try:
            if kind == "decode":
                return cls(runner, topk, num_steps, tree_mode=tree_mode, **opts)
            return cls(runner, topk=topk, num_steps=num_steps, **opts)
        except InvalidInputError as exc:
            # A caller's option that does not fit this case (a kernel config forced for MLA
            # decode, met by an MHA or extend case): the case is skipped, not failed.
            if exc.argument.split(".")[0] not in given:
                raise
            raise CaseSkipped(f"option {exc.argument!r} does not apply here: {exc}") from exc


@contextlib.contextmanager
def _maybe_platform(platform: Optional[Platform]) -> Iterator[None]:
    if platform is None:
        yield
    else:
        with use_platform(platform):
            yield


def _device_for(platform: Platform, device: Union[str, torch.device, None]) -> torch.device:
    if device is not None:
        return torch.device(device)
    wanted = torch_device_type(platform)
    if wanted == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _from_classes(backend: Union[type, Sequence[type]]) -> tuple[str, dict]:
    classes = [backend] if isinstance(backend, type) else list(backend)
    found: dict[tuple[str, str], Union[type, str]] = {}
    for c in classes:
        if not (isinstance(c, type) and issubclass(c, DraftBackend) and c.kind in KINDS):
            raise InvalidInputError("backend", "a backend name, a DraftDecodeBackend / "
                                    "DraftExtendBackend subclass, or a list of them", repr(c))
        for model in MODELS:
            if model in c.models:
                found[(c.kind, model)] = c
    for kind in KINDS:
        for model in MODELS:
            found.setdefault((kind, model), f"no {kind} class among those given serves "
                                            f"{model.upper()} models")
    # A class's own registered name, else its class name (an unregistered subclass of a
    # registered class inherits the parent's ``name``, which would label it as the parent).
    names = sorted({c.__dict__.get("name") or c.__name__ for c in classes})
    return "/".join(names), found


def _resolve_name(name: str, platform: Platform) -> dict:
    """Per (kind, model): the class the factory would pick for ``name`` on ``platform``,
    ignoring what only a concrete request decides (page size, topk, dtype): the kit checks
    those per case, with the class's own reasons."""
    registry = active_registry()
    found: dict[tuple[str, str], Union[type, str]] = {}
    known = False
    for kind in KINDS:
        target, why = _follow(kind, name, platform, registry)
        known = known or target is not None or why is not None
        for model in MODELS:
            if target is None:
                found[(kind, model)] = why or f"{name!r} is not {a_kind(kind)} backend name"
                continue
            classes = [c for c in registry.classes(kind, target) if model in c.models]
            usable = [c for c in classes if not c.platform_reasons(platform)]
            if usable:
                found[(kind, model)] = max(
                    usable, key=lambda c: (c.priority_on(platform), c.qualified_name()))
            elif classes:
                reasons = "; ".join(f"{c.qualified_name()}: {', '.join(c.platform_reasons(platform))}"
                                    for c in classes)
                found[(kind, model)] = f"cannot run on {platform}: {reasons}"
            else:
                served = sorted({m for c in registry.classes(kind, target) for m in c.models})
                found[(kind, model)] = (f"{target} serves {'/'.join(served).upper()} models "
                                        "only")
    if not known:
        # Let selection raise its usual error (valid names, closest match).
        select("decode", name, _probe_request("decode"), platform, registry)
        raise UnknownBackendError(f"unknown backend {name!r}", name, [], None)  # unreachable
    return found


def _follow(kind: str, name: str, platform: Platform, registry) -> tuple[Optional[str],
                                                                          Optional[str]]:
    """``(canonical target name, None)`` or ``(None, why there is none)``."""
    for _ in range(8):
        canonical, _deprecated = registry.canonical(kind, name)
        if canonical is None:
            return None, None
        dispatcher = registry.dispatcher(kind, canonical)
        if dispatcher is None:
            return canonical, None
        route = next((r for r in dispatcher.routes if r.when(platform)), None)
        if route is None or route.target is None:
            note = f" ({dispatcher.note})" if dispatcher.note else ""
            return None, f"{canonical!r} has no {kind} backend on {platform}{note}"
        name = route.target
    return None, f"{name!r}: dispatcher loop"


def _probe_request(kind: str):
    from ..keys import BackendRequest

    return BackendRequest(kind=kind, num_steps=3)


def is_decode(cls: type) -> bool:
    return issubclass(cls, DraftDecodeBackend)
