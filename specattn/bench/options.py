"""``specattn bench --option``: extra variants of a backend built with constructor keywords.

    --option 'triton:plan=dot-mla' 'fa4:split_prefix=2' 'intel_amx:cache_prefix=False'

``BACKEND:KEY=VALUE[,KEY=VALUE...]`` adds one variant of ``BACKEND`` (a name or alias),
labelled ``BACKEND[KEY=VALUE,...]``, beside the backend's own variants. A value is a Python
literal (``2``, ``2.0``, ``False``, ``None``, ``'x'``; ``true`` / ``false`` too) or else the
text itself (``mode=per-branch``, ``plan=gluon-wl``: Triton's plans are named in
``specattn.backends.triton.plans.PLANS``). A keyword applies to the backend's classes whose
constructor takes it (``mode``: decode only); one that no class of the backend takes is a bad
argument.
"""

from __future__ import annotations

import ast
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

from ..errors import InvalidInputError
from ..util import keyword_args

__all__ = ["BackendOption", "parse_option", "parse_options", "check_options", "keywords"]

_EXAMPLE = "BACKEND:KEY=VALUE[,KEY=VALUE...], e.g. triton:plan=dot-mla"


@dataclass(frozen=True)
class BackendOption:
    """One ``--option``: the backend as named and its constructor keywords."""

    backend: str
    text: str  # "KEY=VALUE,..." as given
    kwargs: tuple[tuple[str, Any], ...]

    @property
    def label(self) -> str:
        return f"{self.backend}[{self.text}]"

    def keys(self) -> set[str]:
        return {k for k, _ in self.kwargs}

    def fits(self, cls: type) -> bool:
        """Whether ``cls``'s constructor takes every keyword."""
        return self.keys() <= keywords(cls)

    def classes(self, registry) -> list[type]:
        """The decode and extend classes registered under the option's backend name (or an
        alias of it)."""
        return [c for kind in ("decode", "extend") for c in registry.classes(kind)
                if self.backend in (c.name, *c.aliases)]

    def kwargs_for(self, cls: type) -> dict[str, Any]:
        """The keywords, values checked or converted for ``cls`` (Triton's plan names)."""
        out = {}
        for key, value in self.kwargs:
            parse = _VALUE_PARSERS.get((cls.name, key))
            out[key] = parse(value) if parse is not None else value
        return out

    def kwargs_taken_by(self, cls: type) -> dict[str, Any]:
        """The keywords ``cls``'s constructor takes, values converted for it: what a serving
        engine's ``DraftBackendFactory`` passes ``cls`` from the same ``backend_options``
        (each keyword to every class of the backend that takes it)."""
        taken = keywords(cls)
        return {k: v for k, v in self.kwargs_for(cls).items() if k in taken}


# Keywords the benchmark sets itself (the case's shape, the lane-mode reference).
_RESERVED = frozenset({"topk", "num_steps", "tree_mode", "max_extend_len"})


def keywords(cls: type) -> set[str]:
    """The keyword-only constructor arguments of ``cls`` an option may set."""
    return keyword_args(cls) - _RESERVED


# Shell and JSON spellings of the booleans, as environment variables are often written.
_BOOLS = {"true": True, "false": False}


def _literal(text: str) -> Any:
    if text in _BOOLS:
        return _BOOLS[text]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_option(text: str) -> BackendOption:
    """``"triton:plan=dot-mla,num_splits=4"`` as a ``BackendOption``."""
    backend, sep, rest = text.partition(":")
    pairs = [p.partition("=") for p in rest.split(",")] if rest else []
    if not sep or not backend or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise InvalidInputError("--option", _EXAMPLE, repr(text))
    if any(":" in k for k, _, _ in pairs):  # "a:x=1,b:y=2": two backends in one item
        raise InvalidInputError("--option", "one backend per item (another --option; in "
                                "SPECATTN_SGLANG_OPTIONS, items separated by ';')", repr(text))
    kwargs = tuple((k.strip(), _literal(v.strip())) for k, _, v in pairs)
    keys = [k for k, _ in kwargs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:  # a dict of them would keep the last silently
        raise InvalidInputError("--option", "each keyword once in an item",
                                f"{', '.join(repeated)} repeated in {text!r}")
    return BackendOption(backend.strip(), rest, kwargs)


def check_options(options: list[BackendOption], registry) -> None:
    """Raise ``InvalidInputError`` for an option whose backend is not registered, or with a
    keyword that no class of it takes, or a value its parser refuses."""
    for opt in options:
        classes = opt.classes(registry)
        if not classes:
            raise InvalidInputError("--option", f"a registered backend name ({_EXAMPLE})",
                                    repr(opt.backend))
        fitting = [c for c in classes if opt.fits(c)]
        if not fitting:
            takes = sorted(set().union(*(keywords(c) for c in classes))) or ["none"]
            raise InvalidInputError("--option", f"keywords {opt.backend}'s constructors take "
                                    f"({', '.join(takes)})", ", ".join(sorted(opt.keys())))
        for cls in fitting:
            for key, value in opt.kwargs_for(cls).items():  # a parser refuses a bad value
                hint = _annotation(cls, key)
                if hint is not None and not _fits(value, hint):
                    raise InvalidInputError(f"--option {key}", f"a value of type "
                                            f"{_hint_name(hint)} ({cls.name})", repr(value))


# What a constructor's annotation may name (the rest is left unchecked).
_HINT_NAMES = {"Optional": Optional, "Union": Union, "Literal": Literal, "int": int,
               "float": float, "bool": bool, "str": str, "None": None}


def _annotation(cls: type, key: str) -> Any:
    """The type annotation of ``cls``'s keyword ``key``, resolved as ``typing.get_type_hints``
    would (names of the constructor's module too: ``mode: DecodeMode``, a ``Literal``);
    ``None`` where it cannot be resolved."""
    init = cls.__init__
    param = inspect.signature(init).parameters.get(key)
    ann = None if param is None else param.annotation
    if isinstance(ann, str):
        scope = dict(getattr(init, "__globals__", {}))
        try:
            ann = eval(ann, scope, _HINT_NAMES)  # noqa: S307 - an annotation of the class's code
        except Exception:  # noqa: BLE001 - a name only TYPE_CHECKING imports: not checked
            return None
    return None if ann is inspect.Parameter.empty else ann


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as the option gives it) is of type ``hint``: a text for an int or
    a bool keyword is not (``cache_prefix=maybe`` had run as true, ``num_splits=abc`` failed
    every case after the run)."""
    origin = typing.get_origin(hint)
    if origin is Union:
        return any(_fits(value, h) for h in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is None or hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def _hint_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def parse_options(texts: list[str], registry=None) -> list[BackendOption]:
    """``BACKEND:KEY=VALUE`` texts as checked ``BackendOption``s (``check_options`` against
    ``registry``, by default the active one with the ``specattn.backends`` plugins loaded, as
    the factory that takes the options loads them)."""
    from ..plugins import load_plugins
    from ..registry import active_registry

    options = [parse_option(t) for t in texts]
    if registry is None and options:
        load_plugins()  # a third-party backend's options name it before anything loads it
    check_options(options, registry or active_registry())
    return options


def plan_name(text: Any) -> Any:
    """A Triton plan name (``plans.PLANS``), refused here when unknown: before any case runs
    (a value of another type is left to the type check)."""
    from ..backends.triton.plans import PLANS

    if isinstance(text, str) and text not in PLANS:
        raise InvalidInputError("--option plan", f"one of {', '.join(PLANS)}", repr(text))
    return text


def _num_splits(value: Any) -> Any:
    from ..backends.triton.plans import check_num_splits

    return _as_option(check_num_splits, value)


def _split_prefix(value: Any) -> Any:
    from ..backends.flash_attn._route import check_split_prefix

    # None: the extend's per-batch route (the decode's int annotation refuses it)
    return value if value is None else _as_option(check_split_prefix, value)


def _as_option(check: Callable[[Any], Any], value: Any) -> Any:
    """``check(value)``, its refusal named as the option (``--option num_splits``)."""
    try:
        return check(value)
    except InvalidInputError as exc:
        raise InvalidInputError(f"--option {exc.argument}", exc.expected, exc.got) from None


# The values a constructor refuses beyond their type, checked before any case runs (the
# constructors call the same checks).
_VALUE_PARSERS: dict[tuple[str, str], Callable[[Any], Any]] = {
    ("triton", "plan"): plan_name,
    ("triton", "num_splits"): _num_splits,
    ("fa3", "split_prefix"): _split_prefix,
    ("fa4", "split_prefix"): _split_prefix,
}
