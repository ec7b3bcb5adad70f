"""The two backend ABCs and their registration hook.

A backend is a subclass of ``DraftDecodeBackend`` (multi-step draft decode) or
``DraftExtendBackend`` (draft extend) that passes ``name=`` as a class keyword::

    class MyDecode(DraftDecodeBackend, name="mine", aliases=("my",),
                   platforms=is_cuda, models=("mha",), requires=(("mylib", "mylib"),),
                   kernel_library="mylib", priority={"cuda": 40}):
        dtypes = (torch.bfloat16, torch.float16)
        def _plan(self, batch): ...                        # the round's metadata
        def _attend(self, step, layer, q, k, v): ...       # one layer at one step

The public methods (``init_forward_metadata``, ``forward``, the CUDA-graph methods) run the
call protocol around these hooks (``DraftDecodeBackend`` lists them all).

``__init_subclass__`` only records and checks the declaration (PEP 487): it imports no vendor
library, touches no device and decides nothing. Classes without ``name=`` (intermediate bases)
do not register, and a subclass of a registered class does not inherit its registration:
per-class settings are read from ``cls.__dict__``. A subclass that passes its own ``name=``
keeps where its parent runs (``platforms``, ``models``, ``requires``, ``kernel_library``)
unless it declares them; its aliases, flavour and priority are its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from abc import ABC
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Optional, cast

import torch

from ._tensor_checks import _is_int, dtype_name
from .data import DraftBatch, DraftExtendBatch, DraftRunner
from .errors import (BackendUnavailableError, CallOrderError, InvalidInputError, RegistrationError,
                     shorten)
from .install import install_hint
from .keys import BackendRequest, a_kind, check_draft_params
from .kv_layouts import KV_CACHE_DTYPES
from .platforms import Platform, Predicate, any_platform, current_platform
from .validation import (check_decode_batch, check_decode_forward, check_extend_batch,
                         check_extend_forward, check_padding_slot, check_parents_copied,
                         check_parents_step, check_replay_slots)

if TYPE_CHECKING:
    from .layer import AttentionLayer

__all__ = ["DraftBackend", "DraftDecodeBackend", "DraftExtendBackend", "MODELS"]

MODELS = frozenset({"mha", "mla"})
_KV_DTYPES = frozenset(KV_CACHE_DTYPES)
_DECLARATION_KEYWORDS = ("name", "aliases", "deprecated_aliases", "flavour", "platforms",
                         "models", "requires", "priority", "kernel_library", "mla_required_name",
                         "replace")


class DraftBackend(ABC):
    """Common base of decode and extend backends: declaration, capabilities, validation.

    Capabilities are data (``ClassVar``s) turned into readable reasons by ``validate``.
    """

    kind: ClassVar[str] = ""
    # Set by the hook for registered classes only.
    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    deprecated_aliases: ClassVar[tuple[str, ...]] = ()
    flavour: ClassVar[str] = "default"
    platforms: ClassVar[Predicate] = any_platform
    models: ClassVar[frozenset[str]] = MODELS
    requires: ClassVar[tuple[tuple[str, str], ...]] = ()
    priority: ClassVar[Mapping[str, int]] = {}
    kernel_library: ClassVar[str] = "torch"
    mla_required_name: ClassVar[Optional[str]] = None

    # Capabilities (override in the class body).
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16, torch.float32)
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    page_sizes: ClassVar[Optional[frozenset[int]]] = None  # None: any page size
    max_topk: ClassVar[Optional[int]] = None  # None: any topk
    tree_modes: ClassVar[frozenset[str]] = frozenset({"lane", "path"})
    head_dims: ClassVar[Optional[frozenset[int]]] = None  # None: any head dim
    supports_cuda_graph: ClassVar[bool] = False
    # Models whose kernels apply a logit soft cap (``layer.logit_cap > 0``); others refuse it.
    soft_cap_models: ClassVar[frozenset[str]] = MODELS
    # Where the code was actually run, for `specattn list` ("CPU", "H200", "not run on hardware").
    tested_on: ClassVar[str] = "not run on hardware"
    # Non-empty while the kernels are not written yet: the reason, naming the issue.
    pending: ClassVar[Optional[str]] = None
    # False for model-specific math (sparse / windowed attention): `auto` never picks it.
    auto_eligible: ClassVar[bool] = True
    # Conformance-kit cases this class does not meet, on purpose or until a named fix lands:
    # {fnmatch pattern over case ids, e.g. "decode/mha/*": why}. `specattn.testing` reports
    # matching cases as declared limits instead of running them.
    known_limits: ClassVar[Mapping[str, str]] = {}
    # True when the metadata call reads the batch's host copies of its lengths
    # (``DraftBatch.seq_lens_cpu``, ``DraftExtendBatch.extend_lens_cpu``): a library planner
    # on the host. Without them such a class copies the lengths once per round (a sync); an
    # engine adapter asks its engine for them (SGLang: ``needs_cpu_seq_lens``).
    reads_host_lengths: ClassVar[bool] = False
    # Constructor keywords under which the class computes the dense attention the kit's
    # reference computes (e.g. a sliding window wide enough to cover any prefix); the
    # caller's options override them.
    kit_options: ClassVar[Mapping[str, Any]] = {}
    # Set by the hook: False on a class without name= (no registration inherited).
    _registered: ClassVar[bool] = False

    # The round ``forward`` reads (``DraftBatch`` / ``DraftExtendBatch``; the subclasses
    # declare which): ``None`` until the first metadata call.
    batch: Any

    def __init_subclass__(cls, *, name: Optional[str] = None, **declaration: Any) -> None:
        unknown = set(declaration) - set(_DECLARATION_KEYWORDS)
        if unknown:
            raise RegistrationError(
                f"{cls.__module__}.{cls.__qualname__}: unknown class keyword(s) "
                f"{sorted(unknown)}; expected some of {list(_DECLARATION_KEYWORDS)}")
        super().__init_subclass__()
        _check_capabilities(cls)
        _check_one_kind(cls)
        if name is None:
            if declaration:
                raise RegistrationError(
                    f"{cls.__module__}.{cls.__qualname__}: {sorted(declaration)} given "
                    "without name=; only classes that pass name= register")
            # Not registered: do not let the parent's registration leak into this class.
            cls._registered = False
            return
        _apply_declaration(cls, name, declaration)
        from .registry import active_registry

        active_registry().register(cls, replace=bool(declaration.get("replace", False)))

    # --- selection -------------------------------------------------------------------------

    @classmethod
    def is_registered(cls) -> bool:
        return bool(cls.__dict__.get("_registered", False))

    @classmethod
    def qualified_name(cls) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"

    @classmethod
    def runtime_note(cls, platform: Platform,
                     request: Optional[BackendRequest] = None) -> str:
        """What this class runs on ``platform`` when worth saying (which kernel, a slow
        path), for ``specattn list`` and ``select``; empty by default. ``request``: the
        request being selected (``None`` in ``specattn list``), so that a note about one
        model is left out for the other."""
        return ""

    @classmethod
    def priority_on(cls, platform: Platform) -> int:
        """Priority of this class for ``auto`` on ``platform`` (higher wins; default 0)."""
        return int(cls.priority.get(platform.device, cls.priority.get("*", 0)))

    @classmethod
    def platform_reasons(cls, platform: Platform) -> list[str]:
        """Reasons this class cannot run on ``platform`` (platform and libraries only)."""
        reasons = []
        try:
            if not cls.platforms(platform):
                interpreted = dataclasses.replace(platform, triton_interpret=True)
                if platform.device == "cpu" and cls.platforms(interpreted):
                    # The only thing missing is the interpreter switch: say that first,
                    # since installing triton alone does not change the answer.
                    reasons.append("set TRITON_INTERPRET=1 to run it on this CPU (Triton's "
                                   "interpreter, slow)")
                else:
                    reasons.append(f"needs {cls.platforms.description}, this platform is "
                                   f"{platform}")
        except Exception as exc:  # noqa: BLE001 - one class's predicate, not every selection
            reasons.append(f"its platforms= predicate ({cls.platforms.description}) raised "
                           f"{type(exc).__name__}: {shorten(str(exc))}")
        for module, pip_name in cls.requires:
            if not platform.has_library(module):
                reasons.append(f"needs the '{module}' package, which is not installed "
                               f"({install_hint(pip_name)})")
        return reasons

    @classmethod
    def validate(cls, request: BackendRequest, platform: Optional[Platform] = None) -> list[str]:
        """Every reason this class cannot serve ``request`` on ``platform``; empty = usable.

        ``platform`` defaults to the current one. The checks are pure data: no vendor
        import, no device access."""
        platform = current_platform() if platform is None else platform
        reasons = []
        if request.kind != cls.kind:
            reasons.append(f"is {a_kind(cls.kind)} backend, {request.kind} was asked for")
        if request.model not in cls.models:
            served = "/".join(sorted(m.upper() for m in cls.models))
            reasons.append(f"serves {served} models, the model is {request.model.upper()}")
        reasons += cls.platform_reasons(platform)
        if request.dtype is not None and request.dtype not in cls.dtypes:
            names = ", ".join(dtype_name(d) for d in cls.dtypes)
            reasons.append(f"supports dtypes {names}, got {dtype_name(request.dtype)}")
        if request.kv_cache_dtype not in cls.kv_cache_dtypes:
            reasons.append(f"supports kv_cache_dtype {list(cls.kv_cache_dtypes)}, "
                           f"got {request.kv_cache_dtype!r}")
        if cls.page_sizes is not None and request.page_size not in cls.page_sizes:
            reasons.append(f"supports page sizes {sorted(cls.page_sizes)}, "
                           f"got {request.page_size}")
        if cls.kind == "decode" and cls.max_topk is not None and request.topk > cls.max_topk:
            reasons.append(f"supports topk <= {cls.max_topk}, got {request.topk}")
        if cls.kind == "decode" and request.tree_mode not in cls.tree_modes:
            reasons.append(f"supports tree modes {sorted(cls.tree_modes)}, "
                           f"got {request.tree_mode!r}")
        if (request.head_dim is not None and cls.head_dims is not None
                and request.head_dim not in cls.head_dims):
            reasons.append(f"supports head dims {sorted(cls.head_dims)}, got {request.head_dim}")
        extra = cls.check_request(request, platform)
        if extra:
            reasons.append(extra)
        if cls.pending:
            reasons.append(cls.pending)
        return reasons

    @classmethod
    def check_request(cls, request: BackendRequest, platform: Platform) -> Optional[str]:
        """Hook for a combination rule the ClassVars cannot express; ``None`` = fine."""
        return None

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """The declaration as plain data (for ``specattn list`` and docs)."""
        caps = []
        if cls.max_topk is None or cls.max_topk > 1:
            caps.append("topk>1")
        if cls.kind == "decode" and "path" in cls.tree_modes:
            caps.append("path-exact trees")
        if cls.supports_cuda_graph:
            caps.append("cuda-graph")
        if cls.page_sizes is None:
            caps.append("any page size")
        else:
            caps.append("page " + "/".join(str(p) for p in sorted(cls.page_sizes)))
        if cls.kv_cache_dtypes != ("auto",):
            caps.append("kv " + "/".join(cls.kv_cache_dtypes))
        return {
            "name": cls.name, "kind": cls.kind, "flavour": cls.flavour,
            "aliases": cls.aliases + cls.deprecated_aliases,
            "models": sorted(cls.models), "platforms": cls.platforms.description,
            "kernel_library": cls.kernel_library, "capabilities": caps,
            "tested_on": cls.tested_on, "class": cls.qualified_name(),
        }

    # --- construction ------------------------------------------------------------------------

    def _construct(self, runner: "DraftRunner", request: BackendRequest) -> None:
        """What every constructor does: keep the runner, refuse a pending class, then check
        ``request`` (the runner's full request) against the declared capabilities."""
        cls = type(self)
        self.runner = runner
        self.page_size = runner.page_size
        self.cuda_graph_max_bs = 0
        self.batch = None  # the round forward() reads (see the subclasses)
        self._graph: Optional[_FixedRound] = None
        if cls.pending:
            raise BackendUnavailableError(f"{cls.name}: {cls.pending}", cls.name,
                                          {cls.qualified_name(): [cls.pending]})
        reasons = cls.validate(request)
        if reasons:
            raise BackendUnavailableError(
                f"{cls.name} ({cls.qualified_name()}) cannot serve {request}: "
                + "; ".join(reasons), cls.name, {cls.qualified_name(): reasons})

    # --- the protocol's checks (one place, one error type per mistake) ----------------------

    def _require_round(self, call: str = "forward()") -> None:
        """``forward`` (or another per-round ``call``) before any ``init_forward_metadata``
        (or capture/replay)."""
        if self.batch is None:
            raise CallOrderError("init_forward_metadata", f"a call before {call}",
                                 f"{type(self).name}.{call} first")

    def _require_graph_state(self) -> "_FixedRound":
        """Capture/replay before ``init_cuda_graph_state``."""
        if self._graph is None:
            raise CallOrderError("init_cuda_graph_state", "a call before capture/replay",
                                 f"{type(self).name}: no call")
        return self._graph

    def _check_layer(self, layer: "AttentionLayer") -> None:
        """A soft cap the kernels cannot apply is refused, not ignored."""
        model = self.runner.model
        if layer.logit_cap > 0 and model not in type(self).soft_cap_models:
            raise InvalidInputError("layer.logit_cap", f"0 ({type(self).name} has no logit "
                                    f"soft cap for {model.upper()})", layer.logit_cap)

    # --- hooks (defaults) ---------------------------------------------------------------------

    def _check_batch(self, batch: Any, debug: Optional[bool]) -> None:
        """Rules of this backend beyond ``validation.check_*_batch`` (``debug`` as there)."""

    def _forward_options(self, layer: "AttentionLayer", **options: Any) -> dict[str, Any]:
        """Check this backend's extra ``forward`` keywords (``attn_sink=``, ``index_q=``...)
        before anything is written; returns the keywords ``_attend`` receives."""
        if options:
            raise TypeError(f"{type(self).name}.forward() got unexpected keyword argument(s) "
                            f"{sorted(options)}")
        return {}

    def _kernel_writes_kv(self) -> bool:
        """True when ``_attend`` stores the call's new KV itself (fused into its kernel);
        otherwise ``forward`` writes it with ``_write_kv`` first."""
        return False

    def _write_kv(self, layer: "AttentionLayer", loc: torch.Tensor, k: torch.Tensor,
                  v: Optional[torch.Tensor]) -> None:
        """Store the call's new KV at slots ``loc`` before ``_attend`` (unless
        ``_kernel_writes_kv()``); default: ``runner.write_kv``'s store without its checks
        (the call is checked already). A backend may store the same bytes its own way
        (``flashinfer``: ``kernels.kv_write.store_kv``, one launch)."""
        self.runner._store_kv(layer.layer_id, loc, k, v, layer.k_scale, layer.v_scale)

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the fixed buffers a captured graph reads (``init_cuda_graph_state``)."""

    def _check_replay(self, batch: Any, bs: int) -> None:
        """A replay's rules beyond its batch's own, for captured size ``bs`` (the kept calls
        of ``graph_calls`` run them too); default: none."""

    def _plan(self, batch: Any) -> None:
        """Build the round's metadata (``init_forward_metadata``); default: nothing."""

    def _plan_graph(self, batch: Any, *, capture: bool) -> None:
        """Build the round's metadata into the fixed buffers, outside the graph (capture
        and replay); default: ``_plan``."""
        self._plan(batch)


def _check_runner_type(runner: object) -> None:
    """A constructor's ``runner`` is a ``DraftRunner``: the backend reads its pools, table and
    shape fields (an engine object with only ``use_mla_backend``, which selection reads, does
    not have them)."""
    if not isinstance(runner, DraftRunner):
        raise InvalidInputError("runner", "a specattn.DraftRunner (DraftRunner.mha, mla, "
                                "wrap_mha or wrap_mla)", type(runner).__name__)


def _ints(value: Any) -> bool:
    return isinstance(value, frozenset) and all(
        _is_int(v) and v >= 1 for v in value)


def _strings(value: Any, allowed: Optional[frozenset] = None) -> bool:
    return all(isinstance(v, str) and (allowed is None or v in allowed) for v in value)


# Each capability ClassVar: (what it must be, the check). A wrong type would otherwise pass
# silently (a list of page sizes works with `in`) or fail at the first request.
_CAPABILITIES: dict[str, tuple[str, Any]] = {
    "dtypes": ("a non-empty tuple of torch dtypes", lambda v: isinstance(v, tuple) and v and all(
        isinstance(d, torch.dtype) for d in v)),
    "kv_cache_dtypes": ("a non-empty tuple of names from specattn.kv_layouts.KV_CACHE_DTYPES",
                        lambda v: isinstance(v, tuple) and v and _strings(v, _KV_DTYPES)),
    "page_sizes": ("None or a frozenset of ints >= 1", lambda v: v is None or _ints(v)),
    "max_topk": ("None or an int >= 1", lambda v: v is None or (
        _is_int(v) and v >= 1)),
    "tree_modes": ("a non-empty frozenset of 'lane' / 'path'", lambda v: isinstance(
        v, frozenset) and v and _strings(v, frozenset({"lane", "path"}))),
    "head_dims": ("None or a frozenset of ints >= 1", lambda v: v is None or _ints(v)),
    "supports_cuda_graph": ("a bool", lambda v: isinstance(v, bool)),
    "soft_cap_models": ("a frozenset of 'mha' / 'mla'", lambda v: isinstance(
        v, frozenset) and _strings(v, MODELS)),
    "tested_on": ("a str", lambda v: isinstance(v, str)),
    "pending": ("None or a str", lambda v: v is None or isinstance(v, str)),
    "auto_eligible": ("a bool", lambda v: isinstance(v, bool)),
    "known_limits": ("a mapping of case-id patterns to reasons (str: str)", lambda v: isinstance(
        v, Mapping) and _strings(v) and _strings(v.values())),
    "kit_options": ("a mapping of constructor keywords (str) to values", lambda v: isinstance(
        v, Mapping) and _strings(v)),
    "reads_host_lengths": ("a bool", lambda v: isinstance(v, bool)),
    "max_extend_len": ("None or an int >= 1", lambda v: v is None or (
        _is_int(v) and v >= 1)),
}


# Declaration keywords that the class statement's keywords set and a class body's value of
# the same name would not (``name = "mine"`` registers nothing, ``platforms = is_cuda`` is
# replaced by ``any_platform``); ``kernel_library`` is read from the body too.
_BODY_IGNORED = frozenset(_DECLARATION_KEYWORDS) - {"kernel_library"}


def _check_capabilities(cls: type[DraftBackend]) -> None:
    """The capability ClassVars a class body sets (``cls.__dict__``: inherited ones were
    checked on their class) have the right types, and no name in it is a misspelled
    capability (``max_top_k``) or a declaration keyword (``platforms``), which would
    otherwise be ignored."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    for field, value in cls.__dict__.items():
        if field in _BODY_IGNORED:
            raise RegistrationError(
                f"{where}: {field}: expected a class keyword (class {cls.__name__}(..., "
                f"{field}=...)), got {field} = {value!r} in the class body, where it would "
                "be ignored")
        if field in _CAPABILITIES:
            expected, ok = _CAPABILITIES[field]
            if not ok(value):
                raise RegistrationError(f"{where}: {field} must be {expected}, got {value!r}")
        elif not field.startswith("_") and not callable(value) and not isinstance(
                value, (classmethod, staticmethod, property)):
            close = difflib.get_close_matches(field, _CAPABILITIES, n=1, cutoff=0.8)
            if close:
                raise RegistrationError(f"{where}: {field}: expected a capability name (did "
                                        f"you mean {close[0]!r}?), got {field} = {value!r}")


# Backend names and aliases: what `--option NAME:KEY=VALUE`, SGLang's options, the CLI and the
# docs' page paths can carry; `auto` is not a name but the request for the best backend.
_NAME = re.compile(r"[a-z][a-z0-9_]*")
_NAME_RULE = "([a-z][a-z0-9_]*, not 'auto')"


def _is_backend_name(value: Any) -> bool:
    return isinstance(value, str) and bool(_NAME.fullmatch(value)) and value != "auto"


def _check_one_kind(cls: type[DraftBackend]) -> None:
    """A class is a decode or an extend backend: one of both would register as the kind its
    bases list first and be called with the other kind's arguments."""
    kinds = {b.__dict__["kind"] for b in cls.__mro__ if b.__dict__.get("kind")}
    if len(kinds) > 1:
        raise RegistrationError(
            f"{cls.__module__}.{cls.__qualname__}: expected a subclass of DraftDecodeBackend "
            "or of DraftExtendBackend, got one of both (one class per kind; the two classes "
            "may share name=)")


def _as_tuple(value: Any) -> Optional[tuple[Any, ...]]:
    """A keyword's collection as a tuple; ``None`` for a value that is not one (a str, None,
    a number), which the caller refuses with its own expectation."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return None
    return tuple(value)


def _apply_declaration(cls: type[DraftBackend], name: str, decl: dict[str, Any]) -> None:
    where = f"{cls.__module__}.{cls.__qualname__}"

    def bad(what: str, value: Any) -> RegistrationError:
        return RegistrationError(f"{where}: {what}, got {value!r}")

    if not _is_backend_name(name):
        raise bad(f"name= must be a lowercase identifier {_NAME_RULE}", name)
    cls.name = name
    for key in ("aliases", "deprecated_aliases"):
        value = _as_tuple(decl.get(key, ()))
        if value is None or not all(_is_backend_name(a) for a in value):
            raise bad(f"{key}= must be a tuple of lowercase identifiers {_NAME_RULE}",
                      decl.get(key))
        setattr(cls, key, value)
    cls.flavour = decl.get("flavour", "default")
    if not isinstance(cls.flavour, str) or not cls.flavour:
        raise bad("flavour= must be a non-empty string", cls.flavour)
    # Where the code runs follows the code: a subclass of a registered class keeps its
    # parent's platforms, models and requires (as kernel_library) unless it declares them.
    platforms = decl.get("platforms", cls.platforms)
    if not isinstance(platforms, Predicate):
        raise bad("platforms= must be a specattn.platforms.Predicate (a function wrapped as "
                  "Predicate(fn, description))", platforms)
    cls.platforms = platforms
    models = frozenset(_as_tuple(decl.get("models", cls.models)) or ())
    if not models or not models <= MODELS:
        raise bad("models= must be a non-empty subset of {'mha', 'mla'}", decl.get("models"))
    cls.models = models
    requires = _as_tuple(decl.get("requires", cls.requires))
    if requires is None or not all(
            isinstance(r, tuple) and len(r) == 2 and all(isinstance(x, str) for x in r)
            for r in requires):
        raise bad("requires= must be a tuple of (module, pip name) pairs", decl.get("requires"))
    cls.requires = requires
    priority = decl.get("priority", {})
    if _is_int(priority):
        priority = {"*": priority}
    if not isinstance(priority, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in priority.items()):
        raise bad("priority= must be an int or a {device: int} mapping", priority)
    cls.priority = dict(priority)
    cls.kernel_library = decl.get("kernel_library", cls.kernel_library)
    if not isinstance(cls.kernel_library, str) or not cls.kernel_library:
        raise bad("kernel_library= must be a non-empty string", cls.kernel_library)
    if not isinstance(decl.get("replace", False), bool):
        raise bad("replace= must be a bool", decl["replace"])
    mla_name = decl.get("mla_required_name")
    if mla_name is not None and not isinstance(mla_name, str):
        raise bad("mla_required_name= must be None or a str", mla_name)
    if mla_name is not None and models != frozenset({"mla"}):
        raise bad("mla_required_name= only makes sense with models=('mla',)", mla_name)
    cls.mla_required_name = mla_name
    kind_base = next((b for b in cls.__mro__ if b.__dict__.get("kind") in ("decode", "extend")),
                     None)
    if kind_base is not None and all(getattr(cls, hook) is getattr(kind_base, hook)
                                     for hook in ("_attend", "forward")):
        raise RegistrationError(f"{where}: implements neither _attend (the hook the protocol "
                                "calls) nor forward")
    _check_attend_signature(cls, where)
    cls._registered = True


# The positional arguments ``forward`` passes to ``_attend``, by kind.
_ATTEND_ARGS = {"decode": ("step", "layer", "q", "k", "v"), "extend": ("layer", "q", "k", "v")}


def _check_attend_signature(cls: type[DraftBackend], where: str) -> None:
    """``_attend`` takes the arguments ``forward`` of its kind passes (a decode class with
    the extend hook's signature would fail at its first call)."""
    args = _ATTEND_ARGS.get(cls.kind)
    if args is None:  # not a kind (the registry refuses it)
        return
    try:
        signature = inspect.signature(getattr(cls, "_attend"))
    except (TypeError, ValueError):  # not introspectable: the call will tell
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        # Keyword-only parameters come from ``_forward_options``; the positional ones
        # are ``forward``'s.
        bound = signature.bind_partial(None, *args).arguments
        fits = all(p.name in bound or p.default is not p.empty
                   for p in signature.parameters.values() if p.kind in positional)
    except TypeError:
        fits = False
    if not fits:
        raise RegistrationError(
            f"{where}: _attend: expected the {cls.kind} hook's arguments (self, "
            f"{', '.join(args)}, **options), got _attend{signature}")


class DraftDecodeBackend(DraftBackend):
    """Multi-step draft decode: ``S`` steps, ``K`` lanes per request (``semantics.md``).

    One object serves every step of a draft round. Call protocol::

        backend.init_forward_metadata(batch)          # once per round, all steps
        for step in range(num_steps - 1):
            for layer in layers:
                o = backend.forward(step, layer, q, k, v)

    Shapes (``N = B * topk`` lanes, lane ``z = b * topk + j``):

    - MHA: ``q [N, H_q, D]``, ``k [N, H_kv, D]``, ``v [N, H_kv, D_v]`` → ``o [N, H_q, D_v]``.
    - MLA: ``q [N, H, kv_lora_rank + rope]`` (absorbed), ``k [N, kv_lora_rank + rope]`` (the new
      latent), ``v = None`` → ``o [N, H, kv_lora_rank]``.

    ``forward`` first writes ``k``/``v`` to ``batch.out_cache_loc[:, :, step]``, then attends
    each lane to its request's prefix and its draft history (``tree_mode`` ``"lane"`` or
    ``"path"``).

    **Writing a backend.** The public methods are template methods: they run the protocol
    (validation, metadata before forward, step bounds, ``parents`` checks, the KV write, the
    CUDA-graph buffers and padding) and call these hooks:

    - ``_attend(step, layer, q, k, v, **options) -> o`` (required): one layer at one step.
      The call is valid and the new KV is in the pool (unless ``_kernel_writes_kv()``);
      ``self.batch`` is the round.
    - ``_plan(batch)``: the round's metadata (eager); ``_plan_graph(batch, capture=...)``:
      the same into fixed buffers (default ``_plan``); ``_alloc_graph_buffers(max_bs,
      max_num_tokens)``: those buffers.
    - ``_check_batch(batch, debug)``, ``_forward_options(layer, **options)``,
      ``_kernel_writes_kv()``, ``_write_kv(layer, loc, k, v)``: extra batch rules, extra
      ``forward`` keywords, the KV-write policy and the write itself (default
      ``runner.write_kv``).

    ``self.batch`` is the ``DraftBatch`` forward reads: the caller's batch in an eager round;
    in a captured/replayed round, views of fixed buffers (``req_pool_indices``,
    ``seq_lens``, ``out_cache_loc``; padded requests get request 0, ``seq_lens = 1`` and slot
    0) and the ``parents`` tensor given at capture, which every replay refills.
    """

    kind = "decode"
    batch: DraftBatch  # set by the metadata calls; forward() before one is a CallOrderError

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane") -> None:
        check_draft_params(topk, num_steps, tree_mode)
        _check_runner_type(runner)
        self.topk = topk
        self.num_steps = num_steps
        self.tree_mode = tree_mode
        self._construct(runner, runner.backend_request(
            "decode", topk=topk, num_steps=num_steps, tree_mode=tree_mode))
        self.num_lanes = 0
        # After a replay whose ``parents`` went into another tensor (the capture's, or a
        # padded copy): (the caller's tensor, the one forward reads), else None.
        self._parents_copied: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    # --- the protocol (template methods) ----------------------------------------------------

    def init_forward_metadata(self, batch: "DraftBatch") -> None:
        """Prepare every step's metadata for one draft round (no per-step host work)."""
        check_decode_batch(self.runner, self.topk, self.num_steps, self.tree_mode, batch)
        self._check_batch(batch, None)
        self._begin(batch)
        self._plan(batch)

    def forward(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], **options: Any) -> torch.Tensor:
        """Write ``k``/``v`` for ``step``, then attend; returns ``o`` (see the class doc)."""
        self._require_round()
        batch = self.batch
        check_decode_forward(self.runner, self.num_lanes, self.num_steps, step, layer, q, k, v)
        if self.tree_mode == "path":
            check_parents_step(batch, step, self.topk)
            if self._parents_copied is not None:
                check_parents_copied(*self._parents_copied, step)
        self._check_layer(layer)
        options = self._forward_options(layer, **options)
        if not self._kernel_writes_kv():
            self._write_kv(layer, batch.out_cache_loc[:, :, step], k, v)
        return self._attend(step, layer, q, k, v, **options)

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], **options: Any) -> torch.Tensor:
        """Attention of one layer at draft step ``step``: ``q [N, H_q, D]`` (``N = B * topk``,
        lane ``z = b * topk + j``) -> ``o [N, H_q, D_v]`` (MLA: see the class doc).

        The call is checked and ``k``/``v`` are already in the pool at
        ``self.batch.out_cache_loc[:, :, step]`` (unless ``_kernel_writes_kv()``). What it may
        read:

        - ``self.batch`` (``DraftBatch``): ``req_pool_indices [B]``, ``seq_lens [B]`` (the
          committed prefix ``L_b``), ``out_cache_loc [B, K, S]`` (the slot of lane ``j`` at each
          step), ``parents [S, B, K]`` (``path`` mode; row ``step`` is filled),
          ``seq_lens_cpu [B]`` (a host copy of ``seq_lens`` or ``None``; ``_plan`` reads it:
          ``data.host_lengths``);
        - ``self.runner`` (``DraftRunner``): ``req_to_token [max_reqs, max_context_len]``
          (request row -> slot of each position), the pools ``k_buffer[layer.layer_id]
          [slots, H_kv, D]`` / ``v_buffer[...] [slots, H_kv, D_v]`` (MLA: ``kv_buffer[...]
          [slots, kv_lora_rank + rope]``), ``page_size``, ``num_q_heads``, ``num_kv_heads``,
          ``head_dim``, ``v_head_dim``;
        - ``self.topk``, ``self.num_steps``, ``self.tree_mode``; ``layer.scaling``,
          ``layer.logit_cap``.

        Lane ``(b, j)`` attends to ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` and to
        its draft history: ``out_cache_loc[b, j, :step + 1]`` in ``lane`` mode, the slots of
        its ancestors (through ``parents``) in ``path`` mode. Whatever ``_plan`` stored on
        ``self`` is there too. ``specattn.backends.torch_ref.reference_decode`` is this
        computation in plain torch."""
        raise NotImplementedError(f"{type(self).qualified_name()} implements no _attend")

    def _begin(self, batch: "DraftBatch") -> None:
        self.batch = batch
        self.num_lanes = batch.batch_size * self.topk
        self._parents_copied = None

    # --- CUDA graphs ------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate fixed buffers for up to ``max_bs`` requests (``max_bs * topk`` lanes);
        ``max_num_tokens`` (the engine's token bound, SGLang's ``max_bs * topk``) is passed
        on to backends that size buffers by it."""
        if not _is_int(max_bs) or max_bs < 1:
            raise InvalidInputError("max_bs", "an int >= 1", repr(max_bs))
        if not _is_int(max_num_tokens) or max_num_tokens < 1:
            raise InvalidInputError("max_num_tokens", "an int >= 1", repr(max_num_tokens))
        self.cuda_graph_max_bs = max_bs
        self._graph = _FixedRound(max_bs, (max_bs, self.topk, self.num_steps),
                                  self.runner.device, with_requests=True)
        self._alloc_graph_buffers(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, batch: "DraftBatch") -> None:
        """Fill the fixed buffers before capture (called outside the graph). In ``path``
        mode the graph reads ``batch.parents`` live: the draft loop fills it per step."""
        graph = self._require_graph_state()
        self._check_graph_batch(batch)
        bs = batch.batch_size
        if self.tree_mode == "path" and batch.parents is not None:  # checked: set in path mode
            graph.parents[bs] = batch.parents
        self._graph_round(graph, batch, bs)
        self._plan_graph(self.batch, capture=True)

    def init_forward_metadata_replay_cuda_graph(self, batch: "DraftBatch", bs: int) -> None:
        """Refill the fixed buffers for a replay of the graph captured with ``bs`` requests;
        a batch of fewer requests is padded (request 0, ``seq_lens = 1``, slot 0). In
        ``path`` mode the graph reads the ``parents`` given at capture: a batch with another
        tensor has it copied in here, and a row written to it afterwards is refused by
        ``forward`` where values are checked."""
        graph = self._require_graph_state()
        self._check_graph_batch(batch)
        raw = batch.batch_size
        if not _is_int(bs) or not raw <= bs <= self.cuda_graph_max_bs:
            raise InvalidInputError("bs", f"an int in [{raw}, {self.cuda_graph_max_bs}] (the "
                                    "captured batch size)", repr(bs))
        self._check_replay(batch, bs)
        captured = graph.parents.get(bs)
        if self.tree_mode == "path" and captured is not None and batch.parents is not None \
                and batch.parents.data_ptr() != captured.data_ptr():
            # The graph reads the tensor given at capture ([S, bs, K], validated then); this
            # batch's values go into it.
            captured[:, :raw].copy_(batch.parents)
        self._graph_round(graph, batch, bs)
        used = self.batch.parents
        if self.tree_mode == "path" and used is not None and batch.parents is not None \
                and used.data_ptr() != batch.parents.data_ptr():
            # forward reads ``used``: rows the caller writes to its own tensor from now on
            # are not seen (forward refuses them where values are checked).
            self._parents_copied = (batch.parents, used[:, :raw])
        self._plan_graph(self.batch, capture=False)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` value for padded requests in a captured batch."""
        return 1

    def _check_replay(self, batch: "DraftBatch", bs: int) -> None:
        """A replay's rules beyond its batch's own (a kept call runs them too): padded to
        ``bs`` requests, no token of the batch in slot 0, which the padding lanes write;
        distinct free slots outside page 0 (``check_replay_slots``)."""
        check_replay_slots(self.runner, batch)
        if batch.batch_size < bs:
            check_padding_slot(self.runner, batch)

    def _graph_round(self, graph: "_FixedRound", batch: "DraftBatch", bs: int) -> None:
        """The round's fixed views, padded to ``bs`` requests: copied here, or (a backend
        whose ``_fills_graph_round`` is True) by its ``_plan_graph``, which reads the caller's
        ``batch`` from ``self.graph_source``: one launch instead of six copies."""
        fill = self.get_cuda_graph_seq_len_fill_value()
        if self._fills_graph_round():
            self.graph_source = batch
            self._begin(graph.views(batch, bs, fill))
        else:
            self._begin(graph.round(batch, bs, fill))

    def _fills_graph_round(self) -> bool:
        """True when ``_plan_graph`` copies ``self.graph_source`` into the fixed views itself
        (requests past its batch padded: request row 0, ``seq_lens`` 1, slot 0)."""
        return False

    def _check_graph_batch(self, batch: "DraftBatch") -> None:
        """A graph round's batch is valid within ``cuda_graph_max_bs`` (no debug pass:
        capture must not sync)."""
        check_decode_batch(self.runner, self.topk, self.num_steps, self.tree_mode, batch,
                           max_bs=self.cuda_graph_max_bs, debug=False, graph=True)
        self._check_batch(batch, False)


class DraftExtendBackend(DraftBackend):
    """Draft extend: causal attention of the newly accepted tokens over the paged prefix.

    ``init_forward_metadata(batch)`` then per layer ``forward(layer, q, k, v) -> o`` with
    ``T = sum(extend_lens)`` rows: MHA ``q [T, H_q, D]``, ``k [T, H_kv, D]``,
    ``v [T, H_kv, D_v]`` → ``o [T, H_q, D_v]``; MLA ``q [T, H, kv_lora_rank + rope]``,
    ``k [T, kv_lora_rank + rope]``, ``v = None`` → ``o [T, H, kv_lora_rank]``. Query ``t`` of
    request ``b`` attends to ``R_b[0 : seq_lens[b] - extend_lens[b] + t + 1]`` (``seq_lens``
    already includes the new tokens, whose KV ``forward`` writes to ``out_cache_loc`` first).

    Hooks as in ``DraftDecodeBackend``, with ``_attend(layer, q, k, v, **options)``.
    ``self.batch`` is the caller's batch, its ``out_cache_loc`` in a fixed buffer in graph
    rounds; ``self.num_tokens`` is ``T``. ``max_extend_len`` (set by a backend whose graph
    grid needs it) bounds ``extend_lens`` in graph rounds.
    """

    kind = "extend"
    batch: DraftExtendBatch  # set by the metadata calls; forward() before one is a CallOrderError
    # A graph round's (requests, tokens): the capture's, which a smaller replay is padded to.
    graph_size: tuple[int, int] = (0, 0)
    max_extend_len: Optional[int] = None

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1) -> None:
        _check_runner_type(runner)
        self.topk = topk
        self.num_steps = num_steps
        self._construct(runner, runner.backend_request("extend", topk=topk,
                                                       num_steps=num_steps))
        self.num_tokens = 0

    def init_forward_metadata(self, batch: "DraftExtendBatch") -> None:
        """Prepare the metadata of one draft-extend batch."""
        check_extend_batch(self.runner, batch)
        self._check_batch(batch, None)
        self._begin(batch)
        self._plan(batch)

    def forward(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], **options: Any) -> torch.Tensor:
        """Write the new tokens' KV, then attend causally (see the class doc)."""
        self._require_round()
        check_extend_forward(self.runner, self.num_tokens, layer, q, k, v)
        self._check_layer(layer)
        options = self._forward_options(layer, **options)
        if not self._kernel_writes_kv():
            self._write_kv(layer, self.batch.out_cache_loc, k, v)
        return self._attend(layer, q, k, v, **options)

    def _attend(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], **options: Any) -> torch.Tensor:
        """Causal attention of the batch's new tokens: ``q [T, H_q, D]`` -> ``o [T, H_q, D_v]``
        (``T = sum(extend_lens)``, request-major; MLA: see the class doc).

        The new KV is already in the pool at ``self.batch.out_cache_loc`` (unless
        ``_kernel_writes_kv()``). What it may read: ``self.batch`` (``DraftExtendBatch``:
        ``req_pool_indices [B]``, ``seq_lens [B]`` including the new tokens, ``extend_lens
        [B]``, ``out_cache_loc [T]``, and ``seq_lens_cpu`` / ``extend_lens_cpu``, host copies
        of the lengths or ``None``), ``self.num_tokens`` (``T``), ``self.runner`` (as for
        decode: ``req_to_token``, the pools of ``layer.layer_id``, ``page_size`` and the head
        shape), ``layer.scaling``, ``layer.logit_cap``. Query ``t`` of request ``b`` attends to
        ``req_to_token[req_pool_indices[b], :seq_lens[b] - extend_lens[b] + t + 1]``;
        ``specattn.backends.torch_ref.reference_extend`` is this computation in plain
        torch."""
        raise NotImplementedError(f"{type(self).qualified_name()} implements no _attend")

    def _begin(self, batch: "DraftExtendBatch") -> None:
        self.batch = batch
        self.num_tokens = int(batch.out_cache_loc.shape[0])

    # --- CUDA graphs ------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed buffers for up to ``max_bs`` requests and ``max_num_tokens`` new tokens."""
        if not _is_int(max_bs) or max_bs < 1:
            raise InvalidInputError("max_bs", "an int >= 1", repr(max_bs))
        if not _is_int(max_num_tokens) or max_num_tokens < max_bs:
            raise InvalidInputError("max_num_tokens", f"an int >= max_bs={max_bs}",
                                    repr(max_num_tokens))
        self.cuda_graph_max_bs = max_bs
        self._graph = _FixedRound(max_bs, (max_num_tokens,), self.runner.device,
                                  with_requests=False)
        self._alloc_graph_buffers(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, batch: "DraftExtendBatch") -> None:
        self._graph_round(batch, capture=True)

    def init_forward_metadata_replay_cuda_graph(self, batch: "DraftExtendBatch",
                                                bs: int) -> None:
        """Refill the fixed buffers from ``batch``: at most ``bs`` requests (the captured
        batch size) and at most the capture's new tokens. A smaller round is padded to the
        capture's size: its work sized by the capture (the captured launches' grids, a KV
        write over the captured tokens) finds inert requests and writes the padding tokens
        to slot 0, the dummy slot (a batch with a token in slot 0 is refused)."""
        self._graph_round(batch, capture=False, captured_bs=bs)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def _graph_round(self, batch: "DraftExtendBatch", *, capture: bool,
                     captured_bs: object = None) -> None:
        """Graph-round checks (a replay's ``captured_bs`` too), then the new tokens' slots
        into the fixed buffer (here, or by a backend whose ``_fills_graph_round`` is True, in
        its ``_plan_graph``) and ``_plan_graph``."""
        graph = self._require_graph_state()
        self._check_graph_batch(batch)
        bs, tokens = batch.batch_size, int(batch.out_cache_loc.shape[0])
        capacity = graph.loc.shape[0]
        if bs > self.cuda_graph_max_bs or tokens > capacity:
            raise InvalidInputError("batch", f"at most {self.cuda_graph_max_bs} requests and "
                                    f"{capacity} tokens (init_cuda_graph_state)",
                                    f"{bs} requests, {tokens} tokens")
        if not capture and (not _is_int(captured_bs)
                            or not bs <= captured_bs <= self.cuda_graph_max_bs):
            raise InvalidInputError("bs", f"an int in [{bs}, {self.cuda_graph_max_bs}] (the "
                                    "captured batch size)", repr(captured_bs))
        if capture:
            graph.tokens[bs] = tokens
            self.graph_size = (bs, tokens)
        else:
            self._check_replay(batch, cast(int, captured_bs))
        loc = graph.loc[:tokens]
        if self._fills_graph_round():
            self.graph_source = batch
        else:
            loc.copy_(batch.out_cache_loc)
            self.padded_graph_loc()[tokens:].fill_(0)  # the padding tokens: slot 0
        self._begin(DraftExtendBatch(batch.req_pool_indices, batch.seq_lens,
                                     batch.extend_lens, loc,
                                     getattr(batch, "seq_lens_cpu", None),
                                     getattr(batch, "extend_lens_cpu", None)))
        self._plan_graph(self.batch, capture=capture)

    def _replay_size(self, batch: "DraftExtendBatch", bs: int, tokens: int) -> tuple[int, int]:
        """``(requests, tokens)`` a replay at captured size ``bs`` runs: the capture's (a
        replay of more new tokens is refused: the captured launches cover the capture's),
        or the batch's own where nothing was captured at ``bs``. A smaller batch's padding
        writes slot 0, which then must hold none of its tokens (checked where values are
        checked; the kept calls of ``graph_calls`` run this too)."""
        captured = self._require_graph_state().tokens.get(bs)
        if captured is None:
            return batch.batch_size, tokens
        if tokens > captured:
            raise InvalidInputError("batch", f"at most {captured} new tokens (the capture at "
                                    f"bs={bs}; pad smaller rounds, not larger)",
                                    f"{tokens} tokens")
        if (batch.batch_size, tokens) != (bs, captured):
            check_padding_slot(self.runner, batch)
        return bs, captured

    def _check_replay(self, batch: "DraftExtendBatch", bs: int) -> None:
        """Sets ``graph_size`` (``_replay_size``), refusing what a replay at ``bs`` cannot
        run, and tokens sharing a slot outside page 0 (``check_replay_slots``)."""
        check_replay_slots(self.runner, batch)
        self.graph_size = self._replay_size(batch, bs, int(batch.out_cache_loc.shape[0]))

    def padded_graph_loc(self) -> torch.Tensor:
        """The graph round's fixed ``out_cache_loc`` over the capture's tokens
        (``graph_size``): the batch's new-token slots, then the padding's slot 0, which a
        backend whose ``_plan_graph`` fills it writes (the captured KV write covers it all)."""
        return self._require_graph_state().loc[:self.graph_size[1]]

    def _fills_graph_round(self) -> bool:
        """True when ``_plan_graph`` copies ``self.graph_source.out_cache_loc`` (the caller's
        batch) into ``self.batch.out_cache_loc`` (the fixed buffer's view) itself, and pads
        it to ``self.graph_size``'s tokens with slot 0."""
        return False

    def _check_graph_batch(self, batch: "DraftExtendBatch") -> None:
        """A graph round's batch is valid (no debug pass: capture must not sync)."""
        check_extend_batch(self.runner, batch, debug=False, max_extend_len=self.max_extend_len,
                           graph=True)
        self._check_batch(batch, False)


class _FixedRound:
    """The round tensors a captured graph reads, at fixed addresses: ``out_cache_loc``
    (``loc_shape``, int64) and, for decode, ``req_pool_indices`` / ``seq_lens`` ``[max_bs]``
    int64, the ``parents`` tensor given at each captured batch size, and a host buffer for
    the padded ``seq_lens_cpu`` of a batch that gives one."""

    def __init__(self, max_bs: int, loc_shape: tuple[int, ...], device: torch.device, *,
                 with_requests: bool) -> None:
        self.loc = torch.zeros(loc_shape, dtype=torch.int64, device=device)
        if with_requests:
            self.rpi = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self.seq = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self.seq_cpu = torch.zeros(max_bs, dtype=torch.int64)
        self.parents: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, int] = {}  # extend: the new tokens captured at each size

    def round(self, batch: "DraftBatch", bs: int, seq_fill: int) -> "DraftBatch":
        """``batch`` copied in and padded to ``bs`` requests; returns the fixed views."""
        raw = batch.batch_size
        for buf, src, pad in ((self.rpi, batch.req_pool_indices, 0),
                              (self.seq, batch.seq_lens, seq_fill),
                              (self.loc, batch.out_cache_loc, 0)):
            buf[:raw].copy_(src)
            buf[raw:bs].fill_(pad)
        return self.views(batch, bs, seq_fill)

    def views(self, batch: "DraftBatch", bs: int, seq_fill: int) -> "DraftBatch":
        """The fixed views for ``bs`` requests (filled by ``round``, or by a backend's own
        metadata kernel: ``DraftDecodeBackend._fills_graph_round``); the batch's
        ``seq_lens_cpu``, if any, padded with ``seq_fill`` on the host."""
        raw = batch.batch_size
        parents = self.parents.get(bs, batch.parents)
        if parents is not None and parents.shape[1] < bs:  # no capture at this size: pad
            parents = torch.cat([parents, parents.new_zeros(
                (parents.shape[0], bs - raw, parents.shape[2]))], dim=1)
        host = getattr(batch, "seq_lens_cpu", None)
        if host is not None:
            self.seq_cpu[:raw].copy_(host)
            self.seq_cpu[raw:bs].fill_(seq_fill)
            host = self.seq_cpu[:bs]
        return DraftBatch(self.rpi[:bs], self.seq[:bs], self.loc[:bs], parents, host)
