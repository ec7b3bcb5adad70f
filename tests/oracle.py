"""The selection oracle: ``selection.md`` and issue #2's platform list, written as tables.

Written from the documents, not from ``specattn/selection.py`` or the backend modules, so a
property test comparing the two catches a disagreement. Sources:

- ``selection.md`` rules 1-11 (the original factory) and 12-17 (what specattn adds);
- issue #2, "Register a class for every name ..." (platform and model predicates per name);
- ``reference/upstream-draft-backends.md`` A.2 (name precedence), table (B) (libraries, page
  sizes) and A.5 rule 25 (page sizes the serving engine forces).

``expected(...)`` returns ``None``, ``("class", name, flavour)`` or an ``ExpectedError``.
It never imports the backend modules; only exception classes and ``Platform`` (values).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Union

from specattn.config import SpecConfig
from specattn.errors import BackendUnavailableError, ModelMismatchError, UnknownBackendError
from specattn.platforms import Platform

KINDS = ("decode", "extend")

# Rule 3: the names of the original factory (both kinds), plus the deprecated alias.
ORIGINAL_NAMES = ("flashinfer", "triton", "intel_amx", "aiter", "fa3", "fa4",
                  "hybrid_linear_attn", "flashmla", "trtllm_mha", "trtllm_mla", "cutedsl_mla",
                  "tokenspeed_mla", "dsa", "ascend", "dsv4")
DEPRECATED_ALIASES = {"nsa": "dsa"}  # rule 17
# Issue #2: specattn adds the reference backend (every platform, lowest priority) and `auto`.
ADDED_NAMES = ("torch_ref",)
AUTO = "auto"
KNOWN_NAMES = ORIGINAL_NAMES + tuple(DEPRECATED_ALIASES) + ADDED_NAMES

# Rule 3: the original messages, kept as prefixes.
UNKNOWN_PREFIX = {
    "decode": "EAGLE is not supported in decode attention backend {name}",
    "extend": "EAGLE is not supported in attention backend {name}",
}
# Rule 8: MLA-only names and the name their (exact) error message uses.
MLA_ONLY = {"trtllm_mla": "trtllm_mla", "cutedsl_mla": "trtllm_mla",
            "tokenspeed_mla": "tokenspeed_mla"}
MLA_ONLY_MESSAGE = "{name} backend requires MLA model (use_mla_backend=True)."
FLASHMLA_EXTEND_WARNING = "flashmla prefill backend is not yet supported for draft extend."
DEPRECATION_TEXT = "deprecated"

# ---------------------------------------------------------------------------------------------
# PENDING_NOW: names whose kernels have not landed yet. Their classes are registered but
# cannot be built, so the oracle treats them as unavailable (never chosen by a name or by
# `auto`). This is today's state of the `pending` ClassVar in specattn/backends/*; each later
# issue that lands kernels removes its names here (test_pending_now_is_current says which).
# ---------------------------------------------------------------------------------------------
PENDING_NOW: frozenset[str] = frozenset()  # issue #5 landed the trtllm family last

# Vendor modules a platform may have (the strategies draw subsets of this).
LIBRARIES = ("flashinfer", "triton", "flash_attn_interface", "flash_attn.cute", "flash_mla",
             "aiter", "torch_npu", "tokenspeed_mla", "mate")


def _cuda(*majors: int, minor: Optional[int] = None) -> Callable[[Platform], bool]:
    def check(p: Platform) -> bool:
        return (p.device == "cuda" and p.capability is not None
                and p.capability[0] in majors and (minor is None or p.capability[1] == minor))
    return check


def _device(*devices: str) -> Callable[[Platform], bool]:
    return lambda p: p.device in devices


def _libs(*any_of: str) -> Callable[[Platform], bool]:
    return lambda p: any(lib in (p.libraries or ()) for lib in any_of)


def _fa3_sm90_libs(p: Platform) -> bool:
    # Issue #2 / brief: FA3's own package, or on a 9.x GPU FlashAttention-4's cute kernel.
    return _libs("flash_attn_interface")(p) or (_cuda(9)(p) and _libs("flash_attn.cute")(p))


@dataclass(frozen=True)
class Row:
    """One backend class the documents call for: a name, a flavour, when it can run."""

    name: str
    flavour: str
    kinds: tuple[str, ...]
    platform: Callable[[Platform], bool]
    library: Callable[[Platform], bool] = lambda p: True
    models: frozenset[str] = frozenset({"mha", "mla"})
    page_sizes: Optional[frozenset[int]] = None  # None: any
    auto_eligible: bool = True
    # Largest draft-decode topk (None: any). Upstream limits several MLA kernels to topk 1
    # (table (B), A.6); specattn's classes lift that today, so no row sets it yet.
    max_topk: Optional[int] = None


_BOTH = KINDS
_NPU_PAGES = frozenset(range(16, 513, 16))
_MHA, _MLA = frozenset({"mha"}), frozenset({"mla"})
_TRITON_PLATFORMS = lambda p: (p.device in ("cuda", "hip", "xpu")  # noqa: E731
                               or (p.device == "cpu" and p.triton_interpret))
# Brief H7a (issue #7): the dsa kernels and dsv4's CUDA flavour are Triton kernels, so they
# also run on the CPU under TRITON_INTERPRET=1 (CI tests them there); dsv4's HIP flavour stays
# HIP-only so that exactly one dsv4 flavour matches a platform.
_DSA_PLATFORMS = lambda p: (p.device in ("cuda", "hip")  # noqa: E731
                            or (p.device == "cpu" and p.triton_interpret))
_DSV4_CUDA_PLATFORMS = lambda p: (p.device == "cuda"  # noqa: E731
                                  or (p.device == "cpu" and p.triton_interpret))

# Issue #2's platform list as a table. Facts beyond selection.md, with their source:
# - libraries: backend table (B) of upstream-draft-backends.md (flashinfer for the trtllm
#   kernels, torch_npu for Ascend, triton for dsa/dsv4 kernels) and issue #2;
# - page sizes: table (B) and A.5 rule 25 (flashmla 64; trtllm_mha 16/32/64; trtllm_mla
#   and cutedsl_mla 32/64; tokenspeed_mla like trtllm_mla; dsa 64 on CUDA and 1 on ROCm);
# - MLA-only: rule 8 plus table (B) (flashmla, dsa: DeepSeek MLA models);
# - auto_eligible: dsa and dsv4 are model-specific attention (sparse / windowed), only ever
#   chosen by name (rule 16 picks "the best backend that can run here" for any model).
ROWS: tuple[Row, ...] = (
    Row("flashinfer", "mha", _BOTH, _device("cuda"), _libs("flashinfer"), _MHA),
    Row("flashinfer", "mla", _BOTH, _device("cuda"), _libs("flashinfer"), _MLA),
    Row("triton", "default", _BOTH, _TRITON_PLATFORMS, _libs("triton")),
    Row("intel_amx", "default", _BOTH, _device("cpu")),
    Row("aiter", "default", _BOTH, _device("hip"), _libs("aiter")),
    # fa3/fa4 (issue #6) serve MHA only: FA4 runs the absorbed MLA shape (576/512) only on
    # SM100/110, so the fa3-through-FA4 and fa4 rows cannot serve MLA on Hopper, and FA3's
    # MLA path (`qv`) is not wired; the MUSA port follows the FA3 glue.
    Row("fa3", "sm8x", _BOTH, _cuda(8), _libs("flash_attn_interface"), _MHA),
    Row("fa3", "sm90", _BOTH, _cuda(9, minor=0), _fa3_sm90_libs, _MHA),
    Row("fa3", "musa", _BOTH, _device("musa"), _libs("mate"), _MHA),
    Row("fa4", "cuda", _BOTH, _cuda(9, 10), _libs("flash_attn.cute"), _MHA),
    Row("fa4", "musa", _BOTH, _device("musa"), _libs("mate"), _MHA),
    Row("flashmla", "default", ("decode",), _cuda(9, 10), _libs("flash_mla"), _MLA,
        frozenset({64})),
    Row("trtllm_mha", "default", _BOTH, _cuda(10), _libs("flashinfer"), _MHA,
        frozenset({16, 32, 64})),
    Row("trtllm_mla", "default", _BOTH, _cuda(10), _libs("flashinfer"), _MLA,
        frozenset({32, 64})),
    Row("cutedsl_mla", "default", ("decode",), _cuda(10), _libs("flashinfer"), _MLA,
        frozenset({32, 64})),
    Row("tokenspeed_mla", "default", _BOTH, _cuda(10), _libs("tokenspeed_mla"), _MLA,
        frozenset({32, 64})),
    Row("dsa", "default", _BOTH, _DSA_PLATFORMS, _libs("triton"), _MLA,
        frozenset({1, 64}), auto_eligible=False),
    # Ascend rows: torch_npu's page attention needs 16-aligned blocks for fp16/bf16 (torch_npu
    # API reference, npu_fused_infer_attention_score, "page attention" constraints).
    Row("ascend", "default", _BOTH, _device("npu"), _libs("torch_npu"),
        page_sizes=_NPU_PAGES),
    Row("dsv4", "npu", _BOTH, _device("npu"), _libs("torch_npu"), page_sizes=_NPU_PAGES,
        auto_eligible=False),
    Row("dsv4", "hip", _BOTH, _device("hip"), _libs("triton"), auto_eligible=False),
    Row("dsv4", "cuda", _BOTH, _DSV4_CUDA_PLATFORMS, _libs("triton"), auto_eligible=False),
    Row("torch_ref", "default", _BOTH, lambda p: True),
)

# Rule 16: `auto` picks, among the usable classes, the one with the highest declared
# priority on the platform's device (ties: by name). The priorities come from the registry
# (``_registered_priority``), so a new backend needs no edit here; the design order of the
# built-in names (vendor kernels first, the portable Triton kernels next, torch_ref last) is
# pinned once, in tests/test_selection_examples.py::test_rule16_auto_order_is_the_design.
AUTO_DESIGN_ORDER = {
    "cuda": ("trtllm_mha", "trtllm_mla", "cutedsl_mla", "fa4", "fa3", "flashinfer",
             "flashmla", "tokenspeed_mla", "triton", "torch_ref"),
    "hip": ("aiter", "triton", "torch_ref"),
    "xpu": ("triton", "torch_ref"),
    "musa": ("fa3", "fa4", "torch_ref"),
    "npu": ("ascend", "torch_ref"),
    "cpu": ("intel_amx", "triton", "torch_ref"),
}


def _registered(kind: str, name: str, flavour: str):
    from specattn.registry import active_registry

    return next((c for c in active_registry().classes(kind, name) if c.flavour == flavour),
                None)


def _registered_priority(kind: str, name: str, flavour: str, platform: Platform) -> int:
    cls = _registered(kind, name, flavour)
    if cls is None:
        raise AssertionError(f"oracle row {name}[{flavour}] has no registered {kind} class")
    return cls.priority_on(platform)


# Rule 6: hybrid_linear_attn, the same for both kinds.
def hybrid_target(p: Platform) -> str:
    if p.device == "cpu" and p.cpu_has_amx:
        return "intel_amx"
    if p.device == "cuda" and p.capability is not None and p.capability[0] in (10, 11, 12):
        return "triton"
    return "fa3"


# --- the oracle --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpectedError:
    """An expected exception: its type, and what its message / attributes must say."""

    type: type
    backend: str = ""                 # the backend name the error is about (after aliases)
    prefix: Optional[str] = None      # message must start with this
    exact: Optional[str] = None       # message must equal this
    candidates: int = 0               # unavailable: classes registered under the name
    why: dict[str, list[str]] = field(default_factory=dict, compare=False)


Expected = Union[None, tuple, ExpectedError]


def requested_name(kind: str, config: SpecConfig) -> Optional[str]:
    """Rule 2 (and upstream A.2 rule 4: the override counts when truthy, the mode field when
    not None)."""
    if config.speculative_draft_attention_backend:
        return config.speculative_draft_attention_backend
    if kind == "decode" or config.speculative_attention_mode == "decode":
        name = config.decode_attention_backend
    else:
        name = config.prefill_attention_backend
    return config.attention_backend if name is None else name


def rows_for(kind: str, name: str) -> list[Row]:
    return [r for r in ROWS if r.name == name and kind in r.kinds]


def row_reasons(row: Row, mla: bool, page_size: int, platform: Platform, kind: str = "",
                topk: int = 1) -> list[str]:
    """Why ``row`` cannot serve the request (empty: it can). Words for humans only."""
    why = []
    if kind == "decode" and row.max_topk is not None and topk > row.max_topk:
        why.append("topk")
    if ("mla" if mla else "mha") not in row.models:
        why.append("model")
    if not row.platform(platform):
        why.append("platform")
    if not row.library(platform):
        why.append("library")
    if row.page_sizes is not None and page_size not in row.page_sizes:
        why.append("page size")
    if row.name in PENDING_NOW:
        why.append("pending")
    return why


def expected(kind: str, config: SpecConfig, mla: bool, num_steps: int, topk: int,
             platform: Platform) -> Expected:
    """What the factory must answer for ``kind`` (``"decode"`` or ``"extend"``).

    ``topk`` matters only for rows with ``max_topk`` (none today)."""
    page_size = config.page_size
    if kind == "decode" and num_steps <= 1:  # rule 1, before any name is looked at
        return None
    name = requested_name(kind, config)
    if name is None or name == AUTO:  # rule 16
        return _auto(kind, mla, page_size, platform, topk)
    if name not in KNOWN_NAMES:  # rule 3
        return ExpectedError(UnknownBackendError, name,
                             prefix=UNKNOWN_PREFIX[kind].format(name=name))
    name = DEPRECATED_ALIASES.get(name, name)  # rule 17
    if name == "hybrid_linear_attn":  # rule 6
        name = hybrid_target(platform)
    if name == "flashmla" and kind == "extend":  # rule 9
        return None
    if name in MLA_ONLY and not mla:  # rule 8, before any platform check
        return ExpectedError(ModelMismatchError, name,
                             exact=MLA_ONLY_MESSAGE.format(name=MLA_ONLY[name]))
    if name == "cutedsl_mla" and kind == "extend":  # rule 7
        name = "trtllm_mla"
    rows = rows_for(kind, name)
    why = {r.flavour: row_reasons(r, mla, page_size, platform, kind, topk) for r in rows}
    usable = [r for r in rows if not why[r.flavour]]
    if len(usable) > 1:
        raise AssertionError(f"oracle table is ambiguous for {name} {kind}: {usable}")
    if not usable:  # rule 14
        return ExpectedError(BackendUnavailableError, name, candidates=len(rows), why=why)
    return ("class", usable[0].name, usable[0].flavour)


def _auto(kind: str, mla: bool, page_size: int, platform: Platform, topk: int) -> Expected:
    candidates = [(r.name, r.flavour) for r in ROWS if kind in r.kinds and r.auto_eligible
                  and not row_reasons(r, mla, page_size, platform, kind, topk)]
    candidates += _unlisted_usable(kind, mla, page_size, platform, topk)
    if not candidates:
        return ExpectedError(BackendUnavailableError, AUTO)
    best = min(candidates, key=lambda nf: (-_registered_priority(kind, *nf, platform), nf[0]))
    return ("class", *best)


def _unlisted_usable(kind: str, mla: bool, page_size: int, platform: Platform,
                     topk: int) -> list[tuple[str, str]]:
    """Registered classes whose name the documents do not list (a backend added since, or a
    plugin): for those, the class's own declaration is the only source of when it runs."""
    from specattn.keys import BackendRequest
    from specattn.registry import active_registry

    listed = {r.name for r in ROWS}
    request = BackendRequest(kind=kind, mla=mla, topk=topk, num_steps=2, page_size=page_size)
    return [(c.name, c.flavour) for c in active_registry().classes(kind)
            if c.name not in listed and c.auto_eligible and not c.validate(request, platform)]


def auto_eligible_names() -> frozenset[str]:
    return frozenset(r.name for r in ROWS if r.auto_eligible)


# --- comparing the factory with the oracle -------------------------------------------------------

def factory_outcome(kind: str, config: SpecConfig, mla: bool, num_steps: int, topk: int,
                    platform: Platform, registry=None):
    """The factory's answer: ``None``, the selected class, or the exception it raised.

    Warnings (deprecation, flashmla) are silenced here; tests that check them do so apart."""
    import warnings
    from types import SimpleNamespace

    from specattn import DraftBackendFactory
    from specattn.errors import SpecAttnError

    factory = DraftBackendFactory(config, SimpleNamespace(use_mla_backend=mla), topk,
                                  num_steps, platform=platform, registry=registry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if kind == "decode":
                return factory.resolve_decode_backend()
            return factory.resolve_draft_extend_backend()
        except SpecAttnError as exc:
            return exc


def assert_matches(exp: Expected, got, context: str = "") -> None:
    """``got`` (class, None or exception) agrees with the oracle's ``exp``."""
    where = f"\n  inputs: {context}\n  oracle: {exp!r}\n  factory: {got!r}"
    if exp is None:
        assert got is None, "expected None" + where
    elif isinstance(exp, tuple):
        assert isinstance(got, type), "expected a class" + where
        assert (got.name, got.flavour) == exp[1:], "wrong class" + where
    else:
        assert isinstance(got, exp.type), f"expected {exp.type.__name__}" + where
        text = str(got)
        if exp.prefix is not None:
            assert text.startswith(exp.prefix), "message prefix" + where
        if exp.exact is not None:
            assert text == exp.exact, "message text" + where
        if exp.type is UnknownBackendError:
            assert isinstance(got, ValueError) and got.name == exp.backend, where
        if exp.type is BackendUnavailableError:
            assert got.name == exp.backend, "error names the backend" + where
            if exp.candidates:
                assert len(got.reasons) == exp.candidates, "every candidate reported" + where
                assert all(got.reasons.values()), "every candidate has a reason" + where
