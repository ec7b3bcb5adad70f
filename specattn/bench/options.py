"""``specattn bench --option``: extra variants of a backend built with constructor keywords.

    --option 'triton:split_waves=2' 'fa4:split_prefix=2' 'intel_amx:cache_prefix=False'
    --option 'triton:config=m64 n32 w8 s3 kv-first gluon'

``BACKEND:KEY=VALUE[,KEY=VALUE...]`` adds one variant of ``BACKEND`` (a name or alias),
labelled ``BACKEND[KEY=VALUE,...]``, beside the backend's own variants. A value is a Python
literal (``2``, ``2.0``, ``False``, ``None``, ``'x'``) or else the text itself
(``mode=per-branch``); Triton's ``config`` is a ``KernelConfig`` written as the benchmark
table prints it (``KernelConfig.label()``: ``m64 n32 w8 s3 kv-first gluon``). A keyword
applies to the backend's classes whose constructor takes it (``split_prefix``: decode only);
one that no class of the backend takes is a bad argument.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InvalidInputError
from ..util import keyword_args

__all__ = ["BackendOption", "parse_option", "parse_options", "check_options", "keywords",
           "kernel_config"]

_EXAMPLE = "BACKEND:KEY=VALUE[,KEY=VALUE...], e.g. triton:split_waves=2"


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
        """The keywords, values converted for ``cls`` (Triton's ``config`` label)."""
        out = {}
        for key, value in self.kwargs:
            parse = _VALUE_PARSERS.get((cls.name, key))
            out[key] = parse(value) if parse is not None and isinstance(value, str) else value
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


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_option(text: str) -> BackendOption:
    """``"triton:split_waves=2,num_splits=4"`` as a ``BackendOption``."""
    backend, sep, rest = text.partition(":")
    pairs = [p.partition("=") for p in rest.split(",")] if rest else []
    if not sep or not backend or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise InvalidInputError("--option", _EXAMPLE, repr(text))
    kwargs = tuple((k.strip(), _literal(v.strip())) for k, _, v in pairs)
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
            opt.kwargs_for(cls)  # a bad value fails here, before any case runs


def parse_options(texts: list[str], registry=None) -> list[BackendOption]:
    """``BACKEND:KEY=VALUE`` texts as checked ``BackendOption``s (``check_options`` against
    ``registry``, by default the active one)."""
    from ..registry import active_registry

    options = [parse_option(t) for t in texts]
    check_options(options, registry or active_registry())
    return options


# --- Triton's KernelConfig, written as its label --------------------------------------------

_FIELDS = {"m": "block_m", "n": "block_n", "w": "num_warps", "s": "num_stages",
           "dv": "dv_split"}
_FLAGS = {"mla3": {"mla_v3": True}, "vr": {"v_reload": True}, "fm": {"fuse_merge": True},
          "gluon": {"gluon": True}, "gluon-ov": {"gluon": True, "gluon_overlap": True},
          "pf": {"gluon_prefetch": True}, "ws": {"gluon_ws": True},
          "wl": {"gluon_worklist": True}, "cute": {"cute": True}}


def kernel_config(label: str):
    """``launchers.KernelConfig`` from its ``label()`` (``"m64 n32 w8 s3 kv-first gluon"``);
    the four sizes ``m n w s`` are required."""
    from ..backends.triton.launchers import KernelConfig

    fields: dict[str, Any] = {}
    for token in label.split():
        if token in _FLAGS:
            fields.update(_FLAGS[token])
        elif token.startswith("kv-"):
            fields["kv_write"] = token[3:]
        else:
            head = token.rstrip("0123456789")
            if head not in _FIELDS or head == token:
                raise InvalidInputError("--option config", "a KernelConfig label such as "
                                        "'m64 n32 w8 s3 kv-first gluon'", repr(label))
            fields[_FIELDS[head]] = int(token[len(head):])
    missing = [f for f in ("block_m", "block_n", "num_warps", "num_stages") if f not in fields]
    if missing:
        raise InvalidInputError("--option config", "m, n, w and s sizes (e.g. m64 n32 w8 s3)",
                                repr(label))
    return KernelConfig(**fields)


_VALUE_PARSERS: dict[tuple[str, str], Callable[[str], Any]] = {
    ("triton", "config"): kernel_config,
}
