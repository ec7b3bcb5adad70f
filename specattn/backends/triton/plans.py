"""Which kernel runs a ``triton`` call, and with which tiles: the plan table.

``choose_plan`` picks a row of ``PLANS`` by the model's shape, the job, the query rows per
request and KV head, the round's requests and the device; the rest follows from the kernel
(``launchers``). The measured reason for each row: ``docs/kernels.md``. Imports no Triton.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

import torch

from ...errors import InvalidInputError
from ...util import device_capability as _capability  # (tests stand in for it)
from ...util import device_index, sm_count

log = logging.getLogger(__name__)

GLUON_TRITON = ("3.6",)  # Triton releases whose Gluon API the Gluon kernels run with
MLA_LATENT = (512, 64)  # the sm90 kernels' kv_lora_rank + rope width
TILE_ROWS = 64  # query rows of one sm90 program: the wgmma height of one warpgroup
MAX_SPLITS = 16  # prefix splits per request, at most (the partial buffers hold this many)
DOT_MAX_SPLITS = 64  # the tl.dot kernels' (split-KV, MLA), when few query rows leave room
# The partial buffers hold MAX_SPLITS + 1 parts of at least this many rows: 24 lets one
# request's extend of up to 6 new tokens (a 5-step round's accepted tokens) take
# DOT_MAX_SPLITS splits; 16 held 45 at 6 tokens (H200: mla-b1-32k-extend 43.9 -> 36.7 us).
PARTIAL_ROWS = 24
FORCED_MAX_SPLITS = 256  # a forced num_splits, at most (each plan's split_cap bounds it further)


def check_num_splits(num_splits: Optional[int]) -> Optional[int]:
    """``num_splits`` (a forced prefix split count) as given, refused unless ``None`` or an
    int in ``[1, FORCED_MAX_SPLITS]``."""
    if num_splits is not None and not (isinstance(num_splits, int)
                                       and not isinstance(num_splits, bool)
                                       and 1 <= num_splits <= FORCED_MAX_SPLITS):
        raise InvalidInputError("num_splits", f"an int in [1, {FORCED_MAX_SPLITS}] or None",
                                repr(num_splits))
    return num_splits


class Kernel(str, enum.Enum):
    DOT = "tl.dot split-KV"            # _attn_kernels._partial_attn_kernel
    DOT_MLA = "tl.dot MLA"             # _attn_kernels._mla_partial_kernel
    GLUON_WL = "Gluon work list"       # _gluon_mla_wl_kernel (sm90, Triton 3.6; FP8 pools too)
    GLUON_SPLIT = "Gluon split"        # _gluon_mla_kernel (sm90, Triton 3.6; FP8 pools too)
    CUTE = "CuTe-DSL cluster merge"    # _cute_mla_kernel (sm90, CuTe-DSL; bf16/fp16 pools)


SM90_KERNELS = (Kernel.GLUON_WL, Kernel.GLUON_SPLIT, Kernel.CUTE)
DECODE_ONLY_KERNELS = (Kernel.GLUON_WL, Kernel.CUTE)  # sm90 kernels without an extend mode


def sms(device: torch.device) -> int:
    """SMs of ``device``; 4 on the interpreter, so that tests see several splits."""
    return sm_count(device) or 4


def few_groups(groups: int, device: torch.device) -> bool:
    """Whether a round's ``groups`` (row tiles x requests x KV heads) leave SMs idle without
    prefix splits (at most one per SM): the serving regime of few requests, where the
    ``tl.dot`` split-KV plans fill one wave of program slots (``launchers.plan_splits``)."""
    return groups <= sms(device)


# Split-KV plans whose decode programs fill one wave of program slots whenever they fit in
# one, few requests or many: over FP8 pools, 32 requests x 4k tokens (256 programs, 264
# slots) ran 146.1 us in one split against 154.7 in 3 (H200, docs/kernels.md), where bf16's
# `dot` lost (196.2 against 158.1).
ONE_WAVE_PLANS = frozenset({"dot-fp8"})


# Few-request plans sized for MHA/GQA at head dim <= 128 (their tiles, stages and slots per
# SM): forced on wider rows they are refused (64-key tiles in 5 stages over MLA's 576-wide
# rows need 289 KB of shared memory).
HEAD_DIM_128_PLANS = frozenset({"dot-m16", "dot-m32", "dot-extend", "dot-fp8-m16"})


def num_row_tiles(rows: int) -> int:
    """The sm90 kernels' ``TILE_ROWS``-row tiles over a request's ``rows`` query rows."""
    return -(-rows // TILE_ROWS)


@dataclass(frozen=True)
class Plan:
    """A kernel and its tiling. ``block_m``: query rows per tile, at most (a group of fewer
    rows takes the next power of two, at least 16, and 4 warps at 32 rows or fewer);
    ``block_n``: keys per tile; ``num_stages``: the key loop's software-pipeline stages
    (the ``tl.dot`` kernels: Triton divides them between the slot-table load and the key and
    value loads it addresses, so 3 stages keep one key tile in flight and 5 keep two)."""

    name: str
    kernel: Kernel
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def tile(self, rows: int) -> tuple[int, int]:
        """``(block_m, num_warps)`` for a group of ``rows`` query rows per KV head."""
        if self.kernel is not Kernel.DOT:
            return self.block_m, self.num_warps
        block_m = min(self.block_m, max(16, 1 << max(0, rows - 1).bit_length()))
        return block_m, (4 if block_m <= 32 else self.num_warps)

    def programs_per_sm(self, rows: int, kv_bytes: int) -> int:
        """Programs of this plan one SM runs at once for ``rows`` query rows per KV head
        over a pool of ``kv_bytes``-byte elements: measured (``PROGRAMS_PER_SM``), else 1."""
        return PROGRAMS_PER_SM.get((self.name, self.tile(rows)[0], kv_bytes), 1)


#            name           kernel               m   n  warps stages
PLANS = {p.name: p for p in (
    Plan("dot",         Kernel.DOT,          64, 64, 8, 3),  # MHA/GQA, head dim <= 128
    Plan("dot-m16",     Kernel.DOT,          16, 32, 4, 3),  # MHA/GQA, <= 16 rows, dim <= 128
    Plan("dot-m32",     Kernel.DOT,          32, 32, 4, 5),  # MHA/GQA, 17-32 rows, dim <= 128
    Plan("dot-extend",  Kernel.DOT,          64, 64, 8, 5),  # MHA/GQA extend, 17-32 rows
    Plan("dot-fp8",     Kernel.DOT,          64, 128, 8, 3),  # FP8 pools, head dim <= 128
    Plan("dot-fp8-m16", Kernel.DOT,          16, 64, 4, 5),  # FP8 pools, <= 16 rows
    Plan("dot-d256",    Kernel.DOT,          64, 32, 8, 3),  # head dim 129..256
    Plan("dot-wide",    Kernel.DOT,          32, 32, 4, 2),  # rope part or head dim > 256
    Plan("dot-mla",     Kernel.DOT_MLA,      64, 64, 8, 3),  # MLA, >= 64 rows per request
    Plan("gluon-wl",    Kernel.GLUON_WL,     64, 64, 8, 2),  # sm90 MLA decode, <= 64 rows
    Plan("gluon-split", Kernel.GLUON_SPLIT,  64, 64, 8, 2),  # sm90 MLA extend; decode, cute off
    Plan("cute",        Kernel.CUTE,         64, 64, 8, 2),  # sm90 MLA decode, CuTe-DSL
)}


# Programs one sm90 SM holds, by (plan, rows per tile, pool element bytes), at head dim 128:
# the shared memory and registers of the kernel Triton 3.6 builds (bf16 and fp16 alike;
# tests/test_triton_fp8_compile.py compiles each, decode and extend, and checks the count),
# as a few-request round builds it (its tail stores the new KV over bf16/fp16 pools, in
# decode and extend: launchers.tail_stores_kv), the only rounds that size splits by it
# besides dot-fp8's. 64-row tiles (wgmma) and fp32 pools take one.
PROGRAMS_PER_SM = {
    # decode: shared, registers; extend: shared, registers
    ("dot", 16, 2): 3,      # 70 KB, 128; 39 KB, 163
    ("dot", 32, 2): 2,      # 74 KB, 193; 45 KB, 209
    ("dot-m16", 16, 2): 5,  # 37 KB, 94 (decode only)
    ("dot-m32", 32, 2): 2,  # 42 KB, 187; 42 KB, 186
    ("dot-extend", 32, 2): 2,  # 77 KB, 219; 77 KB, 215
    ("dot-fp8", 16, 1): 2,  # 105 KB, 168; 107 KB, 188 (fp16 value tiles: tiles.widen's CVT)
    ("dot-fp8", 32, 1): 2,  # 113 KB, 183; 115 KB, 255
    ("dot-fp8-m16", 16, 1): 3,  # 55 KB, 142; 69 KB, 148
}


@dataclass(frozen=True)
class AttnShape:
    """What the kernels need to know about the model (MHA/GQA or MLA latent)."""

    num_q_heads: int
    num_kv_heads: int
    d_main: int  # MHA: head_dim; MLA: kv_lora_rank
    d_pe: int  # MLA rope width, 0 for MHA
    d_v: int
    v_is_k: bool  # MLA: V = the first d_v columns of the latent row

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def mla_kernel(self) -> bool:
        """Whether the ``tl.dot`` MLA kernel (latent read as two halves + rope) can run."""
        return self.v_is_k and self.d_pe > 0 and self.d_main % 2 == 0 and self.d_main >= 32 \
            and self.d_v == self.d_main

    @classmethod
    def of(cls, runner) -> "AttnShape":
        if runner.use_mla_backend:
            return cls(runner.num_heads, 1, runner.kv_lora_rank, runner.qk_rope_head_dim,
                       runner.kv_lora_rank, True)
        return cls(runner.num_q_heads, runner.num_kv_heads, runner.head_dim, 0,
                   runner.v_head_dim, False)


def choose_plan(runner, job: str, rows: int, interpret: bool, requests: int = 1) -> Plan:
    """The plan for ``job`` (``"decode"``, ``"per-branch"``, ``"extend"``) at ``rows`` query
    rows per request and KV head (decode: ``K * G``; per-branch: ``G``; extend: ``max E * G``)
    for a round of ``requests`` (decode: lane groups) requests.
    MLA decode on sm90: ``gluon-wl`` up to one 64-row tile, ``cute`` above, ``gluon-split``
    above where ``cute`` does not serve (no CuTe-DSL, or an FP8 pool); MLA extend on sm90:
    ``gluon-split``. Over few requests (``few_groups``), GQA decode of at most 16 rows takes
    ``dot-m16``, of 17-32 rows ``dot-m32``, GQA extend of 17-32 rows ``dot-extend``, and FP8
    decode of at most 16 rows ``dot-fp8-m16``."""
    shape = AttnShape.of(runner)
    if job == "extend" and runner.use_mla_backend:
        gluon = gluon_reason(runner, interpret)
        if gluon is None:
            return PLANS["gluon-split"]
        _log_once(f"triton MLA extend: a tl.dot plan, not gluon-split: {gluon}")
    if job == "decode" and runner.use_mla_backend:
        gluon = gluon_reason(runner, interpret)
        cute = cute_reason(runner, interpret)
        if rows <= TILE_ROWS and gluon is None:
            return PLANS["gluon-wl"]
        if cute is None:
            return PLANS["cute"]
        if gluon is None:
            _log_once(f"triton MLA decode at {rows} query rows per request: plan "
                      f"gluon-split, not cute: {cute}")
            return PLANS["gluon-split"]
        _log_once(f"triton MLA decode: a tl.dot plan, not the sm90 kernels: {gluon}; {cute}")
    if shape.mla_kernel and rows >= TILE_ROWS:
        return PLANS["dot-mla"]
    if shape.d_pe > 0 or shape.d_main > 256:
        return PLANS["dot-wide"]
    if shape.d_main > 128:
        return PLANS["dot-d256"]
    few = few_groups(requests * shape.num_kv_heads, torch.device(runner.device))
    if getattr(runner, "fp8", False):
        return PLANS["dot-fp8-m16" if few and job == "decode" and rows <= 16 else "dot-fp8"]
    if few and job == "decode" and rows <= 32:
        return PLANS["dot-m16" if rows <= 16 else "dot-m32"]
    if few and job == "extend" and 16 < rows <= 32:
        return PLANS["dot-extend"]
    return PLANS["dot"]


def plan_named(name: str, runner, job: str, interpret: bool) -> Plan:
    """The plan ``name`` (``--option triton:plan=NAME``), refused where it cannot serve
    ``job`` for ``runner`` here."""
    plan = PLANS.get(name)
    if plan is None:
        raise InvalidInputError("plan", f"one of {', '.join(PLANS)}", repr(name))
    why = None
    shape = AttnShape.of(runner)
    if plan.kernel is Kernel.DOT_MLA and not shape.mla_kernel:
        why = "an MLA latent of an even rank >= 32 plus a rope part"
    elif name in HEAD_DIM_128_PLANS and (shape.d_pe > 0 or shape.d_main > 128):
        why = "MHA/GQA of head dim <= 128"
    elif name == "dot-m16" and job == "extend":  # the table gives it decode rounds only
        why = "draft decode only (its splits are sized by the decode build's slots per SM)"
    elif plan.kernel in SM90_KERNELS:
        serves = ("decode",) if plan.kernel in DECODE_ONLY_KERNELS else ("decode", "extend")
        why = f"shared-prefix draft {' and '.join(serves)} only" if job not in serves else \
            (cute_reason if plan.kernel is Kernel.CUTE else gluon_reason)(runner, interpret)
    if why is not None:
        raise InvalidInputError("plan", f"a plan that serves this {job} here ({name}: {why})",
                                repr(name))
    return plan


# --- what the sm90 kernels need ---------------------------------------------------------------

def model_reason(runner, fp8: bool = True) -> Optional[str]:
    """Why the sm90 MLA kernels cannot take ``runner``'s model (``None``: they can).
    ``fp8``: whether the kernel reads FP8 pools (``fp8_e4m3`` / ``fp8_e5m2``: the Gluon
    kernels do, the CuTe-DSL kernel does not)."""
    if not runner.use_mla_backend:
        return "not an MLA model"
    if getattr(runner, "fp8", False) and not fp8:
        return "FP8 KV pools: the CuTe-DSL kernel reads bf16/fp16 pools only"
    if runner.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(runner.dtype).replace('torch.', '')}: the sm90 kernels take bf16/fp16"
    if (runner.kv_lora_rank, runner.qk_rope_head_dim) != MLA_LATENT:
        return (f"latent {runner.kv_lora_rank} + rope {runner.qk_rope_head_dim}: the sm90 "
                f"kernels are built for {MLA_LATENT[0]} + {MLA_LATENT[1]}")
    return None


def sm90_reason(device: torch.device, interpret: bool) -> Optional[str]:
    """Why an sm90 (Hopper wgmma) kernel cannot run on ``device`` (``None``: it can)."""
    if interpret or device.type != "cuda":
        return "not a CUDA device"
    if getattr(torch.version, "hip", None):
        return "ROCm: the sm90 kernels use NVIDIA Hopper wgmma"
    cap = _capability(device_index(device))
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}: the sm90 kernels need Hopper"
    return None


def pdl_reason(device: torch.device, interpret: bool) -> Optional[str]:
    """Why a programmatic dependent launch (sm90+) cannot run on ``device`` (``None``: it
    can)."""
    if interpret:
        return "the Triton interpreter (TRITON_INTERPRET)"
    if device.type != "cuda":
        return f"a {device.type} device"
    if getattr(torch.version, "hip", None):
        return "ROCm"
    cap = _capability(device_index(device))
    if cap < (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}"
    return _launch_pdl_reason()


@functools.lru_cache(maxsize=None)
def _launch_pdl_reason() -> Optional[str]:
    """Why this Triton cannot launch a kernel with ``launch_pdl=True`` (``None``: it can)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception as exc:
        return f"triton's CUDA backend does not import ({type(exc).__name__})"
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return f"triton {_version('triton')} (no launch_pdl)"
    return None


def gluon_reason(runner, interpret: bool) -> Optional[str]:
    """``None`` when the Gluon kernels serve ``runner``'s MLA decode here (bf16/fp16 or FP8
    pools), else why not."""
    return _sm90_model(runner, interpret, fp8=True) or gluon_import_reason()


def cute_reason(runner, interpret: bool) -> Optional[str]:
    """``None`` when the CuTe-DSL kernel serves ``runner``'s MLA decode here (any Triton;
    bf16/fp16 pools)."""
    return _sm90_model(runner, interpret, fp8=False) or cute_import_reason()


def _sm90_model(runner, interpret: bool, fp8: bool) -> Optional[str]:
    return model_reason(runner, fp8) or sm90_reason(torch.device(runner.device), interpret)


@functools.lru_cache(maxsize=None)
def gluon_import_reason() -> Optional[str]:
    """Why Gluon's Hopper ops are not usable with this Triton (``None``: they are)."""
    try:
        import triton
    except Exception as exc:  # pragma: no cover - triton is a requirement of the backend
        return f"triton does not import ({type(exc).__name__})"
    version = getattr(triton, "__version__", "?")
    if not _gluon_version(version):
        return (f"triton {version}: the Gluon kernels run with triton "
                f"{'/'.join(v + '.x' for v in GLUON_TRITON)} only (Gluon's API moves)")
    try:
        from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
            async_copy, fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)
    except Exception as exc:
        return f"Gluon's Hopper ops do not import ({type(exc).__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=None)
def cute_import_reason() -> Optional[str]:
    """Why CuTe-DSL is not usable here (``None``: it is)."""
    try:
        import cuda.bindings.driver  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as exc:
        return f"CuTe-DSL does not import ({type(exc).__name__}: {exc}; the 'fa' extra)"
    return None


def platform_note(device: str, capability: Optional[tuple[int, int]],
                  interpret: bool) -> str:
    """The MLA decode plans a platform gets (``specattn list`` / ``select``; finds packages,
    imports none)."""
    if interpret or device != "cuda":
        why = "not a CUDA device"
    elif capability != (9, 0):
        why = "needs sm90" if capability is None else \
            f"sm{capability[0]}{capability[1]}, needs sm90"
    else:
        version = _version("triton")
        gluon = version is not None and _gluon_version(version)
        cute = _found("cutlass")
        if gluon or cute:
            small = "gluon-wl" if gluon else "cute"
            large = "cute" if cute else "gluon-split (cute needs CuTe-DSL: the 'fa' extra)"
            pools = ("bf16/fp16 or FP8 pools" if gluon else "bf16/fp16 pools") + \
                (", FP8 above: gluon-split" if gluon and cute else "")
            extend = "; MLA extend: plan gluon-split" if gluon else ""
            return (f"MLA draft decode: plan {small} up to {TILE_ROWS} query rows per "
                    f"request, {large} above{extend} (sm90; rank 512 + rope 64, {pools})")
        why = f"triton {version} has no tested Gluon and CuTe-DSL is not installed"
    return f"MLA draft decode: plans dot-wide / dot-mla (sm90 kernels off: {why})"


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _gluon_version(version: str) -> bool:
    return any(version == v or version.startswith(v + ".") for v in GLUON_TRITON)


def _found(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


_LOGGED: set = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.info(message)
