"""Benchmark cases: the standard table of ``docs/performance.md``, small CPU cases, custom
shapes.

A ``Case`` is one model shape and batch: ``B`` requests of prefix ``L`` (uniform, or ragged
in ``[L/2, 3L/2]``), ``K`` lanes, ``S`` draft steps, page size ``P``, pools in the activation
dtype or FP8 (``kv_cache_dtype``, ``k_scale``, ``v_scale``). Decode cases time one step (step
2: three history slots) and one draft round; extend cases (``E_b = S + 1`` new tokens per
request, already in ``L``) time one draft extend.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import InvalidInputError
from ..fp8 import FP8_KV_DTYPES, check_scale

__all__ = ["Case", "STANDARD_CASES", "SERVING_CASES", "FP8_CASES", "EXTRA_CASES",
           "SMALL_CASES", "FP8_K_SCALE", "FP8_V_SCALE", "KV_CACHE_DTYPES", "CASE_SETS",
           "SWEEP_PREFIXES", "SWEEP_TOPKS", "all_cases", "default_cases", "find_cases",
           "custom_case", "fp8_case", "sweep_cases", "timed_step", "DTYPES"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Per-layer shapes of docs/performance.md: GQA (q heads, kv heads, head dim), MLA (heads,
# kv_lora_rank, rope dim).
GQA_SHAPE = (32, 8, 128)
MLA_SHAPE = (16, 512, 64)
MLA_WIDE_SHAPE = (128, 512, 64)  # all heads on one GPU (DP attention)
# Step timed by the per-step numbers: three history slots, as docs/performance.md measures.
TIMED_STEP = 2
# Pools a case may have: the activation dtype, or FP8 with one scale per tensor.
KV_CACHE_DTYPES = ("auto", *FP8_KV_DTYPES)
# The FP8 cases' scales: the random KV (standard normal) is stored as codes of |x| / 0.45 and
# / 0.3, well inside e4m3's 448 (and e5m2's 57344); not powers of two, so a scale applied in
# the wrong place or precision shows in the check.
FP8_K_SCALE = 0.45
FP8_V_SCALE = 0.3


def timed_step(steps: int) -> int:
    """The decode step timed at ``S`` = ``steps``: ``TIMED_STEP``, or below ``S`` 4 the last
    the round runs, ``S - 2`` (0 at ``S`` 1)."""
    return max(0, min(TIMED_STEP, steps - 2))


@dataclass(frozen=True)
class Case:
    """One benchmark case. ``shape``: ``(H_q, H_kv, D)`` for MHA, ``(H, R, rope)`` for MLA.
    ``compute_bound``: the rows also report TFLOP/s against the bf16 matmul rate.
    ``kv_cache_dtype``: ``"auto"`` (pools in ``dtype``) or an FP8 name, with the layers'
    ``k_scale`` / ``v_scale`` (MLA: ``k_scale`` only). ``twin``: the case of the same shape
    with pools in ``dtype`` (``""``: none), whose ragged lengths it shares and whose rows
    its ``x vs bf16`` compares with."""

    name: str
    model: str
    batch: int
    prefix: int
    topk: int
    steps: int
    page_size: int = 1
    kind: str = "decode"
    dtype: torch.dtype = torch.bfloat16
    ragged: bool = False
    shape: Optional[tuple[int, int, int]] = None
    compute_bound: bool = False
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0
    twin: str = ""

    def __post_init__(self) -> None:
        if self.model not in ("mha", "mla"):
            raise InvalidInputError("case.model", "'mha' or 'mla'", repr(self.model))
        if self.kind not in ("decode", "extend"):
            raise InvalidInputError("case.kind", "'decode' or 'extend'", repr(self.kind))
        for field, flag in (("batch", "--batch"), ("prefix", "--prefix"), ("topk", "--topk"),
                            ("steps", "--num-steps"), ("page_size", "--page-size")):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:  # named as the command line sets it
                raise InvalidInputError(flag, "an int >= 1", repr(value))
        if self.kind == "extend" and self.prefix <= self.steps + 1:
            raise InvalidInputError("--prefix", f"more than the {self.steps + 1} extend tokens",
                                    self.prefix)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidInputError("--kv-cache-dtype", f"one of {', '.join(KV_CACHE_DTYPES)}",
                                    repr(self.kv_cache_dtype))
        check_scale("case.k_scale", self.k_scale)
        check_scale("case.v_scale", self.v_scale)
        if self.shape is None:
            object.__setattr__(self, "shape", MLA_SHAPE if self.model == "mla" else GQA_SHAPE)

    # --- derived sizes -------------------------------------------------------------------

    @property
    def lengths_label(self) -> str:
        return "ragged" if self.ragged else "uniform"

    @property
    def label(self) -> str:
        return f"{self.name} {self.lengths_label}"

    @property
    def has_ragged(self) -> bool:
        """Whether a ragged run differs from the uniform one: not at ``B`` 1, where the one
        request's random length only moves ``L``."""
        return self.batch > 1

    @property
    def lanes(self) -> int:
        """Query rows of one call: ``B*K`` (decode) or ``B*(S+1)`` (extend)."""
        return self.batch * (self.topk if self.kind == "decode" else self.extend_len)

    @property
    def extend_len(self) -> int:
        return self.steps + 1

    @property
    def timed_step(self) -> int:
        """The decode step the per-step numbers time (at most ``S - 2``, the last the serving
        loop runs)."""
        return timed_step(self.steps)

    @property
    def fp8(self) -> bool:
        """The pools hold FP8 codes (``kv_cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"``)."""
        return self.kv_cache_dtype in FP8_KV_DTYPES

    @property
    def kv_dtype_name(self) -> str:
        """The pools' dtype as reports show it: ``"fp8_e4m3"``, ``"bfloat16"``..."""
        return self.kv_cache_dtype if self.fp8 else str(self.dtype).replace("torch.", "")

    @property
    def element_size(self) -> int:
        """Bytes of one pool element: 1 for FP8, else the activation dtype's."""
        dtype = FP8_KV_DTYPES.get(self.kv_cache_dtype, self.dtype)
        return torch.empty(0, dtype=dtype).element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's KV in one layer (K and V; MLA: the latent row)."""
        a, b, c = self.shape
        if self.model == "mla":
            return (b + c) * self.element_size
        return b * 2 * c * self.element_size

    def lengths(self, seed: int = 0) -> list[int]:
        """Per-request prefix lengths: ``L`` each, or uniform in ``[L/2, 3L/2]`` (ragged; the
        twin's when there is one)."""
        if not self.ragged:
            return [self.prefix] * self.batch
        rng = random.Random(f"{seed}:{self.twin or self.name}:{self.batch}:{self.prefix}")
        low = max(self.prefix // 2, self.steps + 2)
        return [rng.randint(low, max(low, 3 * self.prefix // 2)) for _ in range(self.batch)]

    def kv_bytes(self, lengths: list[int], step: Optional[int] = None) -> int:
        """Bytes the floor reads: every prefix once plus every lane's history at ``step``
        (decode, default the timed step), or every request's KV (extend)."""
        if self.kind == "extend":
            return sum(lengths) * self.row_bytes
        step = self.timed_step if step is None else step
        return (sum(lengths) + self.batch * self.topk * (step + 1)) * self.row_bytes

    def flops(self, lengths: list[int], step: Optional[int] = None) -> int:
        """Attention FLOPs of one decode step (default the timed step): every query row
        against its prefix and ``step + 1`` history keys, ``S = q.k`` and ``P.V``."""
        a, b, c = self.shape
        step = self.timed_step if step is None else step
        if self.model == "mla":
            rows, per_key = a, 2 * (b + c) + 2 * b
        else:
            rows, per_key = a, 2 * c + 2 * c
        keys = sum(lengths) + self.batch * (step + 1)
        return rows * self.topk * keys * per_key

    def describe(self) -> str:
        kind = "extend" if self.kind == "extend" else f"K={self.topk}"
        text = (f"{self.name}: {self.model.upper()} B={self.batch} L={self.prefix} {kind} "
                f"S={self.steps} P={self.page_size} {str(self.dtype).replace('torch.', '')}")
        if self.fp8:
            text += f", kv {self.kv_cache_dtype} k_scale {self.k_scale:g}"
            text += "" if self.model == "mla" else f" v_scale {self.v_scale:g}"
        return text

    def with_(self, **changes) -> "Case":
        return dataclasses.replace(self, **changes)


def _std(name, model, batch, prefix, topk, steps, page_size=1, kind="decode", **kw) -> Case:
    return Case(name, model, batch, prefix, topk, steps, page_size, kind, **kw)


# docs/performance.md, "Standard cases" (mla-long and mla-wide also at page size 64): mla-k1
# (plain MLA decode), mla-small (split prefix) and mla-wide (compute bound) with the Gluon
# MLA kernel's work.
STANDARD_CASES = (
    _std("gqa-long", "mha", 32, 4096, 8, 5),
    _std("gqa-chain", "mha", 64, 2048, 1, 4),
    _std("gqa-paged", "mha", 32, 4096, 4, 5, 16),
    _std("gqa-small", "mha", 4, 1024, 4, 5),
    _std("mla-long", "mla", 32, 4096, 4, 5),
    _std("mla-long-p64", "mla", 32, 4096, 4, 5, 64),
    _std("mla-k1", "mla", 32, 4096, 1, 5),
    _std("mla-small", "mla", 4, 1024, 4, 5),
    _std("mla-wide", "mla", 32, 4096, 2, 5, shape=MLA_WIDE_SHAPE, compute_bound=True),
    _std("mla-wide-p64", "mla", 32, 4096, 2, 5, 64, shape=MLA_WIDE_SHAPE,
         compute_bound=True),
    _std("extend", "mha", 32, 4096, 1, 5, kind="extend"),
)

# docs/performance.md, "The serving regime": batch 1-8 at long contexts, each decode case
# with its draft extend (E_b = S + 1). B 1 cases run with uniform lengths only.
_SERVING_DECODE = (
    _std("gqa-b1-32k", "mha", 1, 32768, 4, 5),
    _std("gqa-b1-k8", "mha", 1, 4096, 8, 5),
    _std("gqa-b8-p16", "mha", 8, 4096, 4, 5, 16),
    _std("mla-b1-32k", "mla", 1, 32768, 4, 5),
    _std("mla-b8-p64", "mla", 8, 4096, 4, 5, 64),
)


def _with_extend(decode: Case) -> tuple[Case, Case]:
    """A decode case and its draft extend, ``<name>-extend`` (``E_b = S + 1``)."""
    return decode, decode.with_(name=f"{decode.name}-extend", kind="extend", topk=1)


SERVING_CASES = tuple(c for d in _SERVING_DECODE for c in _with_extend(d))


def _twin_name(case: Case, cases: tuple[Case, ...]) -> str:
    """The first of ``cases`` that is ``case`` with pools in the activation dtype, or ''."""
    plain = case.with_(kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, twin="")
    return next((c.name for c in cases if c.with_(name=case.name) == plain), "")


def fp8_case(case: Case, kv_cache_dtype: str = "fp8_e4m3") -> Case:
    """``case`` as ``<name>-fp8``: FP8 pools with ``FP8_K_SCALE`` / ``FP8_V_SCALE``."""
    return case.with_(name=f"{case.name}-fp8", kv_cache_dtype=kv_cache_dtype,
                      k_scale=FP8_K_SCALE, v_scale=FP8_V_SCALE)


# docs/performance.md, "FP8 pools": gqa-long, mla-long and the B 1 32k cases with e4m3 pools,
# each with its extend case; each names its bf16 twin (gqa-long-fp8-extend: extend).
FP8_CASES = tuple(
    c.with_(twin=_twin_name(c, STANDARD_CASES + SERVING_CASES))
    for d in STANDARD_CASES + SERVING_CASES
    if d.name in ("gqa-long", "mla-long", "gqa-b1-32k", "mla-b1-32k")
    for c in _with_extend(fp8_case(d)))

# Not in the default run (--case names them): mla-long at K = 8, issue #4's per-branch
# ratio for MLA; one request of 32k keys at K = 8 (two 64-row tiles: the cute plan).
EXTRA_CASES = (
    _std("mla-long-k8", "mla", 32, 4096, 8, 5),
    _std("mla-b1-32k-k8", "mla", 1, 32768, 8, 5),
)

# The same shapes scaled down for a small CPU (torch_ref and intel_amx).
SMALL_CASES = (
    _std("cpu-gqa-small", "mha", 4, 1024, 4, 5),
    _std("cpu-gqa-k8", "mha", 4, 1024, 8, 5),
    _std("cpu-gqa-chain", "mha", 8, 1024, 1, 4),
    _std("cpu-gqa-paged", "mha", 4, 1024, 4, 5, 16),
    _std("cpu-mla-small", "mla", 4, 1024, 4, 5),
    _std("cpu-extend", "mha", 8, 1024, 1, 5, kind="extend"),
)

# Latency against prefix length (GQA shape, one step, uniform lengths).
SWEEP_PREFIXES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_TOPKS = (1, 4, 8)


# Names of case sets ``--case`` takes beside single case names.
CASE_SETS = {"standard": STANDARD_CASES, "serving": SERVING_CASES, "fp8": FP8_CASES,
             "cpu": SMALL_CASES}


def all_cases() -> tuple[Case, ...]:
    return STANDARD_CASES + SERVING_CASES + FP8_CASES + EXTRA_CASES + SMALL_CASES


def default_cases(on_gpu: bool) -> tuple[Case, ...]:
    return STANDARD_CASES + SERVING_CASES + FP8_CASES if on_gpu else SMALL_CASES


def find_cases(names: list[str]) -> list[Case]:
    """The cases named (single cases or the sets of ``CASE_SETS``), in the order given, each
    once."""
    known = {c.name: c for c in all_cases()}
    missing = [n for n in names if n not in known and n not in CASE_SETS]
    if missing:
        raise InvalidInputError("--case", f"case names or sets {sorted(CASE_SETS)} "
                                "(--list-cases shows the names)", ", ".join(missing))
    chosen = [c for n in names for c in (CASE_SETS[n] if n in CASE_SETS else (known[n],))]
    return list({c.name: c for c in chosen}.values())


def custom_case(*, batch: int = 4, prefix: int = 1024, topk: int = 4, steps: int = 5,
                page_size: int = 1, mla: bool = False, extend: bool = False,
                dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = "auto") -> Case:
    """A case from the command line's shape flags (model shapes of docs/performance.md):
    ``custom`` / ``custom-extend``, ``custom-fp8`` / ``custom-fp8-extend`` with FP8 pools
    (``fp8_case``'s scales)."""
    case = Case("custom", "mla" if mla else "mha", batch, prefix, topk, steps, page_size,
                dtype=dtype)
    if kv_cache_dtype != "auto":
        case = fp8_case(case, kv_cache_dtype)
    return _with_extend(case)[1] if extend else case


def sweep_cases(on_gpu: bool, quick: bool, dtype: torch.dtype) -> list[Case]:
    """Uniform GQA decode cases over prefix lengths and ``K`` 1/4/8 (the sweep chart)."""
    if on_gpu:
        prefixes = SWEEP_PREFIXES[::2] if quick else SWEEP_PREFIXES
        batch = 32
    else:
        prefixes = (128, 256, 512) if quick else (256, 512, 1024, 2048)
        batch = 2
    return [Case(f"sweep-k{k}-l{n}", "mha", batch, n, k, 5, dtype=dtype)
            for k in SWEEP_TOPKS for n in prefixes]


def scaled(case: Case, factor: int) -> Case:
    """``case`` with its prefix divided by ``factor`` (``--quick``)."""
    return case.with_(prefix=max(case.prefix // factor, case.steps + 3))
