"""The user's opt-in: environment variables read when SGLang builds its draft backends.

- ``SPECATTN_SGLANG=1``: serve SGLang's draft attention with the specattn backend of the
  same name as the one SGLang resolved (``--attention-backend``,
  ``--decode-attention-backend`` / ``--prefill-attention-backend``,
  ``--speculative-draft-attention-backend``); also ``true`` / ``yes`` / ``on``. Unset,
  ``0``, ``false``, ``no`` or ``off``: SGLang is unchanged; any other value is refused.
- ``SPECATTN_SGLANG_BACKEND=NAME``: serve it with specattn backend ``NAME`` (any specattn
  name, ``auto`` included) whatever SGLang resolved; implies ``SPECATTN_SGLANG=1``.
- ``SPECATTN_SGLANG_TREE_MODE=lane|path``: ``lane`` (default) attends exactly as SGLang's own
  backends do; ``path`` attends each draft token to its real tree ancestors.
- ``SPECATTN_SGLANG_OPTIONS='BACKEND:KEY=VALUE[,KEY=VALUE...][;...]'``: constructor keywords
  for a specattn backend when it serves (as ``specattn bench --option`` writes them), e.g.
  ``triton:plan=gluon-split`` (``DraftBackendFactory``'s ``backend_options``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ...errors import InvalidInputError, shorten

__all__ = ["ENABLE_ENV", "BACKEND_ENV", "TREE_MODE_ENV", "OPTIONS_ENV", "Settings",
           "opted_in", "read_settings"]

ENABLE_ENV = "SPECATTN_SGLANG"
BACKEND_ENV = "SPECATTN_SGLANG_BACKEND"
TREE_MODE_ENV = "SPECATTN_SGLANG_TREE_MODE"
OPTIONS_ENV = "SPECATTN_SGLANG_OPTIONS"

_FALSE = ("", "0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")
KNOWN_ENV = (ENABLE_ENV, BACKEND_ENV, TREE_MODE_ENV, OPTIONS_ENV)


@dataclass(frozen=True)
class Settings:
    enabled: bool
    backend: Optional[str] = None  # a specattn name forced for every draft backend
    tree_mode: str = "lane"
    options: tuple = ()  # specattn.bench.options.BackendOption, from OPTIONS_ENV

    def specattn_name(self, sglang_name: str) -> str:
        """The specattn backend name that serves SGLang's resolved ``sglang_name``."""
        return self.backend or sglang_name

    def backend_options(self) -> dict[str, dict[str, Any]]:
        """``DraftBackendFactory``'s ``backend_options`` (values converted as ``specattn
        bench`` converts them, e.g. Triton's ``config`` label)."""
        from ...registry import active_registry

        out: dict[str, dict[str, Any]] = {}
        for opt in self.options:
            classes = opt.classes(active_registry())
            kwargs = opt.kwargs_for(classes[0]) if classes else dict(opt.kwargs)
            out.setdefault(opt.backend, {}).update(kwargs)
        return out


def opted_in(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the user opted in (``SPECATTN_SGLANG`` on or ``SPECATTN_SGLANG_BACKEND`` set),
    whatever the other variables hold; never raises (``read_settings`` refuses a
    ``SPECATTN_SGLANG`` that is neither on nor off)."""
    env = os.environ if environ is None else environ
    return bool(env.get(BACKEND_ENV, "").strip()) or (
        env.get(ENABLE_ENV, "").strip().lower() not in _FALSE)


def stray_settings(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """``SPECATTN_SGLANG_*`` variables that are set but not read: a name none of the four
    is (a typo such as ``SPECATTN_SGLANG_BACKENDS``, or a known name in another case, which
    the environment keeps apart), and, without the opt-in, the tree mode and the options
    (read only when specattn serves)."""
    env = os.environ if environ is None else environ
    names = [n for n in env
             if (n.upper().startswith(ENABLE_ENV + "_") and n not in KNOWN_ENV)
             or (n.upper() == ENABLE_ENV and n != ENABLE_ENV)]
    if not opted_in(env):
        names += [n for n in (TREE_MODE_ENV, OPTIONS_ENV) if env.get(n, "").strip()]
    return sorted(names)


def read_settings(environ: Optional[Mapping[str, str]] = None) -> Settings:
    env = os.environ if environ is None else environ
    backend = env.get(BACKEND_ENV, "").strip().lower() or None
    switch = env.get(ENABLE_ENV, "").strip().lower()
    if switch not in _FALSE + _TRUE:
        raise InvalidInputError(ENABLE_ENV, f"on ({'/'.join(_TRUE)}) or off "
                                f"({'/'.join(repr(v) for v in _FALSE)})", repr(shorten(switch)))
    if switch and switch in _FALSE and backend is not None:  # off, said explicitly
        raise InvalidInputError(ENABLE_ENV, f"on or unset while {BACKEND_ENV} is set (it "
                                "turns the plugin on; unset it to keep SGLang's backends)",
                                repr(shorten(switch)))
    enabled = opted_in(env)
    tree_mode = env.get(TREE_MODE_ENV, "").strip().lower() or "lane"
    if tree_mode not in ("lane", "path"):
        raise InvalidInputError(TREE_MODE_ENV, "'lane' or 'path'", repr(shorten(tree_mode)))
    if backend is not None:
        _check_backend(backend)
    return Settings(enabled=enabled, backend=backend, tree_mode=tree_mode,
                    options=_read_options(env.get(OPTIONS_ENV, "")))


def _check_backend(name: str) -> None:
    """A forced name must be specattn's (of either kind, or ``auto``): the user asked for
    specattn, so a typo is refused rather than left to SGLang's own backend, as a name SGLang
    resolved that specattn does not know is."""
    from ...selection import AUTO, check_backend_name

    check_backend_name(BACKEND_ENV, name, "a specattn backend name or 'auto'", also=(AUTO,))


def _read_options(text: str) -> tuple:
    from ...bench.options import parse_options

    items = [t.strip() for t in text.split(";") if t.strip()]
    try:
        options = parse_options(items)
    except InvalidInputError as exc:  # the bench's message names the item: the value, cut
        raise InvalidInputError(OPTIONS_ENV, "'BACKEND:KEY=VALUE[,KEY=VALUE...]' items "
                                "separated by ';' (e.g. 'triton:plan=gluon-split'), backends and "
                                f"keywords that exist ({exc})", repr(shorten(text))) from exc
    _check_each_keyword_once(options)
    return tuple(options)


def _check_each_keyword_once(options: list) -> None:
    """Refuse a keyword that two items give one backend (``triton:plan=a;triton:plan=b``,
    or a name and its alias): the factory takes one value, and keeping either would be a
    silent choice."""
    from ...registry import active_registry

    seen: dict[tuple[str, str], str] = {}
    for opt in options:
        classes = opt.classes(active_registry())
        name = classes[0].name if classes else opt.backend
        for key in opt.keys():
            if (name, key) in seen:
                raise InvalidInputError(OPTIONS_ENV, f"each keyword once per backend "
                                        f"({key!r} of {name!r} in two items)",
                                        repr(shorten(f"{seen[name, key]}; {opt.backend}:"
                                                     f"{opt.text}")))
            seen[name, key] = f"{opt.backend}:{opt.text}"
