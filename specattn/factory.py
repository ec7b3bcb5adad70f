"""``DraftBackendFactory``: the original factory's interface over the generic lookup."""

from __future__ import annotations

import difflib
from typing import Any, Mapping, Optional, cast

from ._logging import get_logger
from .base import DraftBackend, DraftDecodeBackend, DraftExtendBackend
from .config import SpecConfig
from .errors import InvalidInputError
from .keys import BackendRequest, Kind, check_draft_params
from .platforms import Platform
from .plugins import load_plugins
from .registry import Registry, registry_or_active
from .selection import Selection, select
from .util import keyword_args

log = get_logger("factory")

__all__ = ["DraftBackendFactory"]


class DraftBackendFactory:
    """Builds the draft model's multi-step decode backend and its draft-extend backend.

    ``resolve_*`` return the selected class (or ``None``) without instantiating it and without
    importing any vendor library; they read only ``runner.use_mla_backend``, so any object
    with that attribute works as a runner there. ``create_*`` instantiate it with the runner.
    ``explain_*`` return the ``Selection`` with every step of the decision.

    ``backend_options``: constructor keywords per backend name, used when that backend is
    selected, e.g. ``{"triton": {"plan": "dot-mla"}}``. A keyword goes to the selected class
    if its constructor takes it (decode and extend classes take different ones); one that
    neither class of the backend takes, or a key that names no backend, is an
    ``InvalidInputError`` when a backend is created.
    """

    def __init__(self, config: SpecConfig, runner: Any, topk: int, num_steps: int, *,
                 tree_mode: str = "lane", platform: Optional[Platform] = None,
                 registry: Optional[Registry] = None,
                 backend_options: Optional[Mapping[str, Mapping[str, Any]]] = None) -> None:
        if not isinstance(config, SpecConfig):
            raise InvalidInputError("config", "a specattn.SpecConfig", type(config).__name__)
        check_draft_params(topk, num_steps, tree_mode, min_steps=0)
        if not hasattr(runner, "use_mla_backend"):
            raise InvalidInputError("runner", "an object with a use_mla_backend attribute",
                                    type(runner).__name__)
        self.config = config
        self.runner = runner
        self.topk = topk
        self.num_steps = num_steps
        self.tree_mode = tree_mode
        self.platform = platform
        registry_or_active(registry)  # a wrong one fails here, not inside selection
        self.registry = registry
        if backend_options is not None and not (
                isinstance(backend_options, Mapping)
                and all(isinstance(v, Mapping) for v in backend_options.values())):
            raise InvalidInputError("backend_options", "a mapping of backend name to a mapping "
                                    "of constructor keywords", repr(backend_options))
        self.backend_options = {k: dict(v) for k, v in (backend_options or {}).items()}

    def request(self, kind: Kind) -> BackendRequest:
        """What selection knows for ``kind``: model type, topk, steps, page size, KV dtype."""
        return BackendRequest(kind=kind, mla=bool(self.runner.use_mla_backend),
                              topk=self.topk, num_steps=self.num_steps,
                              page_size=self.config.page_size,
                              kv_cache_dtype=self.kv_cache_dtype(),
                              tree_mode=self.tree_mode)

    def _explain(self, kind: Kind) -> Selection:
        if self.registry is None:
            load_plugins()
        name = self.config.backend_name(kind)
        sel = select(kind, name, self.request(kind), self.platform, self.registry)
        sel.steps[:0] = [f"name precedence (rule 2): {s}" for s in self.config.name_trail(kind)]
        return sel

    def explain_decode_backend(self) -> Selection:
        return self._explain("decode")

    def explain_draft_extend_backend(self) -> Selection:
        return self._explain("extend")

    def resolve_decode_backend(self) -> Optional[type[DraftDecodeBackend]]:
        """The decode class (``None`` when ``num_steps <= 1``), not instantiated."""
        return cast(Optional[type[DraftDecodeBackend]], self.explain_decode_backend().backend)

    def resolve_draft_extend_backend(self) -> Optional[type[DraftExtendBackend]]:
        """The extend class (``None`` for ``flashmla``), not instantiated."""
        return cast(Optional[type[DraftExtendBackend]],
                    self.explain_draft_extend_backend().backend)

    def kv_cache_dtype(self) -> str:
        """The KV dtype selection asks for: the config's, where ``"auto"`` takes the one a
        ``DraftRunner`` names for its pools (an engine's runner object names none)."""
        runner_kv = getattr(self.runner, "kv_cache_dtype", None)
        if self.config.kv_cache_dtype == "auto" and isinstance(runner_kv, str):
            return runner_kv
        return self.config.kv_cache_dtype

    def _check_runner_matches(self) -> None:
        """The runner's pools are what the selection was asked for (page size, KV dtype)."""
        page = getattr(self.runner, "page_size", self.config.page_size)
        if page != self.config.page_size:
            raise InvalidInputError("runner.page_size",
                                    f"config.page_size={self.config.page_size}", page)
        runner_kv = getattr(self.runner, "kv_cache_dtype", None)
        if isinstance(runner_kv, str) and runner_kv != self.kv_cache_dtype():
            raise InvalidInputError("runner.kv_cache_dtype",
                                    f"config.kv_cache_dtype={self.config.kv_cache_dtype!r}",
                                    repr(runner_kv))

    def create_decode_backend(self) -> Optional[DraftDecodeBackend]:
        cls = self.resolve_decode_backend()
        if cls is None:
            return None
        self._check_runner_matches()
        log.info("draft decode backend: %s (%s)", cls.name, cls.qualified_name())
        return cls(self.runner, self.topk, self.num_steps, tree_mode=self.tree_mode,
                   **self._options_for(cls))

    def create_draft_extend_backend(self) -> Optional[DraftExtendBackend]:
        cls = self.resolve_draft_extend_backend()
        if cls is None:
            return None
        self._check_runner_matches()
        log.info("draft extend backend: %s (%s)", cls.name, cls.qualified_name())
        return cls(self.runner, topk=self.topk, num_steps=self.num_steps,
                   **self._options_for(cls))

    def _options_for(self, cls: type[DraftBackend]) -> dict[str, Any]:
        """The ``backend_options`` keywords of ``cls``'s backend that its constructor takes;
        raises for a keyword that no class of that backend takes."""
        registry = registry_or_active(self.registry)
        _check_option_names(self.backend_options, registry)
        names = (cls.name, *cls.aliases)
        given: dict[str, Any] = {}
        for key, opts in self.backend_options.items():
            if key in names:
                given.update(opts)
        if not given:
            return {}
        siblings = [c for kind in ("decode", "extend") for c in registry.classes(kind, cls.name)]
        taken = set().union(*(_keywords(c) for c in siblings or [cls]))
        unknown = sorted(set(given) - taken)
        if unknown:
            raise InvalidInputError(f"backend_options[{cls.name!r}]",
                                    f"keywords {cls.name}'s constructors take "
                                    f"({', '.join(sorted(taken)) or 'none'})",
                                    ", ".join(unknown))
        mine = _keywords(cls)
        chosen = {k: v for k, v in given.items() if k in mine}
        log.info("%s %s backend options: %s", cls.name, cls.kind, chosen)
        return chosen


def _check_option_names(options: Mapping[str, Any], registry: Registry) -> None:
    """Every ``backend_options`` key names a backend: a misspelled one would drop its
    keywords silently."""
    known = set(registry.all_names("decode")) | set(registry.all_names("extend"))
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "`specattn list` names them"
            raise InvalidInputError("backend_options", f"backend names as keys ({hint})",
                                    repr(key))


# Keywords the factory sets itself.
_RESERVED = frozenset({"tree_mode", "topk", "num_steps"})


def _keywords(cls: type[DraftBackend]) -> set[str]:
    """Keyword-only constructor arguments of ``cls`` a ``backend_options`` entry may set."""
    return keyword_args(cls) - _RESERVED
