"""The two backend ABCs and their registration hook.

A backend is a subclass of ``DraftDecodeBackend`` (multi-step draft decode) or
``DraftExtendBackend`` (draft extend) that passes ``name=`` as a class keyword::

    class MyDecode(DraftDecodeBackend, name="mine", aliases=("my",),
                   platforms=is_cuda, models=("mha",), requires=(("mylib", "mylib"),),
                   kernel_library="mylib", priority={"cuda": 40}):
        dtypes = (torch.bfloat16, torch.float16)
        def init_forward_metadata(self, batch): ...
        def forward(self, step, layer, q, k, v): ...

``__init_subclass__`` only records and checks the declaration (PEP 487): it imports no vendor
library, touches no device and decides nothing. Classes without ``name=`` (intermediate bases)
do not register, and a subclass of a registered class does not inherit its registration:
per-class settings are read from ``cls.__dict__``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch

from .errors import BackendUnavailableError, InvalidInputError, RegistrationError
from .install import install_hint
from .keys import BackendRequest
from .platforms import Platform, Predicate, any_platform, current_platform

if TYPE_CHECKING:
    from .data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner

__all__ = ["DraftBackend", "DraftDecodeBackend", "DraftExtendBackend", "MODELS"]

MODELS = frozenset({"mha", "mla"})
_DECLARATION_KEYWORDS = ("name", "aliases", "deprecated_aliases", "flavour", "platforms",
                         "models", "requires", "priority", "kernel_library", "mla_required_name",
                         "replace")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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
    # Where the code was actually run, for `specattn list` ("CPU", "H200", "not run on hardware").
    tested_on: ClassVar[str] = "not run on hardware"
    # Non-empty while the kernels are not written yet: the reason, naming the issue.
    pending: ClassVar[Optional[str]] = None
    # False for model-specific math (sparse / windowed attention): `auto` never picks it.
    auto_eligible: ClassVar[bool] = True

    def __init_subclass__(cls, *, name: Optional[str] = None, **declaration: Any) -> None:
        unknown = set(declaration) - set(_DECLARATION_KEYWORDS)
        if unknown:
            raise RegistrationError(
                f"{cls.__module__}.{cls.__qualname__}: unknown class keyword(s) "
                f"{sorted(unknown)}; expected some of {list(_DECLARATION_KEYWORDS)}")
        super().__init_subclass__()
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
    def priority_on(cls, platform: Platform) -> int:
        """Priority of this class for ``auto`` on ``platform`` (higher wins; default 0)."""
        return int(cls.priority.get(platform.device, cls.priority.get("*", 0)))

    @classmethod
    def platform_reasons(cls, platform: Platform) -> list[str]:
        """Reasons this class cannot run on ``platform`` (platform and libraries only)."""
        reasons = []
        if not cls.platforms(platform):
            reasons.append(f"needs {cls.platforms.description}, this platform is {platform}")
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
            reasons.append(f"is a {cls.kind} backend, {request.kind} was asked for")
        if request.model not in cls.models:
            served = "/".join(sorted(m.upper() for m in cls.models))
            reasons.append(f"serves {served} models, the model is {request.model.upper()}")
        reasons += cls.platform_reasons(platform)
        if request.dtype is not None and request.dtype not in cls.dtypes:
            names = ", ".join(_dtype_name(d) for d in cls.dtypes)
            reasons.append(f"supports dtypes {names}, got {_dtype_name(request.dtype)}")
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

    # --- protocol checks shared by the backends -----------------------------------------------

    def _require_metadata(self, prepared: object) -> None:
        """``forward`` before ``init_forward_metadata``: ``prepared`` (the backend's round
        state) is still ``None``."""
        if prepared is None:
            raise RuntimeError(f"{type(self).name}: forward() called before "
                               "init_forward_metadata(batch)")

    @staticmethod
    def _require_graph_state(ready: bool) -> None:
        """Capture/replay before ``init_cuda_graph_state`` (``ready`` False)."""
        if not ready:
            raise InvalidInputError("init_cuda_graph_state", "a call before capture/replay",
                                    "no call")

    # --- construction ------------------------------------------------------------------------

    def _check_constructible(self, request: BackendRequest) -> None:
        reasons = type(self).validate(request)
        if reasons:
            raise BackendUnavailableError(
                f"{type(self).name} ({type(self).qualified_name()}) cannot serve {request}: "
                + "; ".join(reasons), type(self).name, {type(self).qualified_name(): reasons})


def _apply_declaration(cls: type, name: str, decl: dict[str, Any]) -> None:
    where = f"{cls.__module__}.{cls.__qualname__}"

    def bad(what: str, value: Any) -> RegistrationError:
        return RegistrationError(f"{where}: {what}, got {value!r}")

    if not isinstance(name, str) or not name or name != name.lower() or name.strip() != name:
        raise bad("name= must be a non-empty lowercase string", name)
    cls.name = name
    for key in ("aliases", "deprecated_aliases"):
        value = tuple(decl.get(key, ()))
        if isinstance(decl.get(key), str) or not all(
                isinstance(a, str) and a and a == a.lower() for a in value):
            raise bad(f"{key}= must be a tuple of lowercase strings", decl.get(key))
        setattr(cls, key, value)
    cls.flavour = decl.get("flavour", "default")
    if not isinstance(cls.flavour, str) or not cls.flavour:
        raise bad("flavour= must be a non-empty string", cls.flavour)
    platforms = decl.get("platforms", any_platform)
    if not isinstance(platforms, Predicate):
        raise bad("platforms= must be a specattn.platforms.Predicate", platforms)
    cls.platforms = platforms
    models = frozenset(decl.get("models", MODELS))
    if not models or not models <= MODELS:
        raise bad("models= must be a non-empty subset of {'mha', 'mla'}", decl.get("models"))
    cls.models = models
    requires = tuple(decl.get("requires", ()))
    if not all(isinstance(r, tuple) and len(r) == 2 and all(isinstance(x, str) for x in r)
               for r in requires):
        raise bad("requires= must be a tuple of (module, pip name) pairs", decl.get("requires"))
    cls.requires = requires
    priority = decl.get("priority", {})
    if isinstance(priority, int) and not isinstance(priority, bool):
        priority = {"*": priority}
    if not isinstance(priority, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in priority.items()):
        raise bad("priority= must be an int or a {device: int} mapping", priority)
    cls.priority = dict(priority)
    cls.kernel_library = decl.get("kernel_library", cls.kernel_library)
    mla_name = decl.get("mla_required_name")
    if mla_name is not None and models != frozenset({"mla"}):
        raise bad("mla_required_name= only makes sense with models=('mla',)", mla_name)
    cls.mla_required_name = mla_name
    cls._registered = True


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
    """

    kind = "decode"

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane") -> None:
        from .validation import check_draft_params

        check_draft_params(topk, num_steps, tree_mode)
        self.runner = runner
        self.topk = topk
        self.num_steps = num_steps
        self.tree_mode = tree_mode
        self.page_size = runner.page_size
        if type(self).pending:
            raise BackendUnavailableError(f"{type(self).name}: {type(self).pending}",
                                          type(self).name,
                                          {type(self).qualified_name(): [type(self).pending]})
        self._check_constructible(runner.backend_request("decode", topk=topk,
                                                         num_steps=num_steps,
                                                         tree_mode=tree_mode))
        self.cuda_graph_max_bs = 0

    @abstractmethod
    def init_forward_metadata(self, batch: "DraftBatch") -> None:
        """Prepare every step's metadata for one draft round (no per-step host work)."""

    @abstractmethod
    def forward(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        """Write ``k``/``v`` for ``step``, then attend; returns ``o`` (see the class doc)."""

    # CUDA graph protocol (semantics.md). Defaults run eagerly, which is right for CPU
    # backends; GPU backends override all three with fixed buffers.
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate fixed buffers for up to ``max_bs`` requests (``max_bs * topk`` lanes)."""
        self.cuda_graph_max_bs = max_bs

    def init_forward_metadata_capture_cuda_graph(self, batch: "DraftBatch") -> None:
        """Fill the fixed buffers before capture (called outside the graph)."""
        self.init_forward_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: "DraftBatch", bs: int) -> None:
        """Refill the fixed buffers for a replay with ``bs`` (padded) requests."""
        self.init_forward_metadata(batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` value for padded requests in a captured batch."""
        return 1

    @staticmethod
    def _check_padded(batch: "DraftBatch", bs: int) -> None:
        """A replayed batch holds exactly the ``bs`` (padded) requests of the graph."""
        if batch.batch_size != bs:
            raise InvalidInputError("batch", f"a batch padded to bs={bs} requests",
                                    f"{batch.batch_size} requests")

    def _check_graph_batch(self, batch: "DraftBatch", bs: Optional[int], *,
                           ready: bool) -> None:
        """Capture/replay checks, in this order: ``init_cuda_graph_state`` ran (``ready``),
        ``batch`` is padded to ``bs`` requests (skipped for ``bs=None``), and the batch is
        valid within ``cuda_graph_max_bs`` (no debug pass: capture must not sync)."""
        from .validation import check_decode_batch

        self._require_graph_state(ready)
        if bs is not None:
            self._check_padded(batch, bs)
        check_decode_batch(self.runner, self.topk, self.num_steps, self.tree_mode, batch,
                           max_bs=self.cuda_graph_max_bs, debug=False)


class DraftExtendBackend(DraftBackend):
    """Draft extend: causal attention of the newly accepted tokens over the paged prefix.

    ``init_forward_metadata(batch)`` then per layer ``forward(layer, q, k, v) -> o`` with
    ``T = sum(extend_lens)`` rows: MHA ``q [T, H_q, D]``, ``k [T, H_kv, D]``,
    ``v [T, H_kv, D_v]`` → ``o [T, H_q, D_v]``; MLA ``q [T, H, kv_lora_rank + rope]``,
    ``k [T, kv_lora_rank + rope]``, ``v = None`` → ``o [T, H, kv_lora_rank]``. Query ``t`` of
    request ``b`` attends to ``R_b[0 : seq_lens[b] - extend_lens[b] + t + 1]`` (``seq_lens``
    already includes the new tokens, whose KV ``forward`` writes to ``out_cache_loc`` first).
    """

    kind = "extend"

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1) -> None:
        self.runner = runner
        self.topk = topk
        self.num_steps = num_steps
        self.page_size = runner.page_size
        if type(self).pending:
            raise BackendUnavailableError(f"{type(self).name}: {type(self).pending}",
                                          type(self).name,
                                          {type(self).qualified_name(): [type(self).pending]})
        self._check_constructible(runner.backend_request("extend", topk=topk,
                                                         num_steps=num_steps))
        self.cuda_graph_max_bs = 0

    @abstractmethod
    def init_forward_metadata(self, batch: "DraftExtendBatch") -> None:
        """Prepare the metadata of one draft-extend batch."""

    @abstractmethod
    def forward(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        """Write the new tokens' KV, then attend causally (see the class doc)."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.cuda_graph_max_bs = max_bs

    def init_forward_metadata_capture_cuda_graph(self, batch: "DraftExtendBatch") -> None:
        self.init_forward_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: "DraftExtendBatch",
                                                bs: int) -> None:
        self.init_forward_metadata(batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def _check_graph_batch(self, batch: "DraftExtendBatch", *, ready: bool) -> None:
        """Capture/replay checks: ``init_cuda_graph_state`` ran (``ready``), then the batch
        is valid (no debug pass: capture must not sync)."""
        from .validation import check_extend_batch

        self._require_graph_state(ready)
        check_extend_batch(self.runner, batch, debug=False)

