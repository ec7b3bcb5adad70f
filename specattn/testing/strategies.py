"""Hypothesis strategies for property tests of selection rules and of backends.

>>> from hypothesis import given
>>> from specattn.testing import strategies as sst
>>> @given(sst.configs(), sst.platforms())
... def test_never_crashes(config, platform): ...          # doctest: +SKIP

Values, not mocks: ``platforms()`` draws ``Platform`` values (device, compute capability, AMX,
installed libraries, interpreter flag); ``configs()`` draws ``SpecConfig`` with names from the
live registry (aliases, ``auto``, ``None`` and near misses included); ``backend_requests()``
draws ``BackendRequest``; ``decode_rounds()`` / ``extend_rounds()`` build whole rounds on
NaN-poisoned pools (``RoundMaker``), ready for a backend and ``torch_ref``.

Needs the ``hypothesis`` package (the ``test`` extra).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from hypothesis import strategies as st

from ..config import SpecConfig
from ..keys import KINDS, TREE_MODES, BackendRequest, Kind
from ..platforms import Platform
from ..registry import active_registry
from .rounds import DecodeRound, ExtendRound, ModelShape, RoundMaker

__all__ = ["platforms", "backend_names", "unknown_names", "configs", "backend_requests",
           "model_shapes", "decode_rounds", "extend_rounds", "DEVICES", "PAGE_SIZES",
           "CUDA_CAPABILITIES"]

DEVICES = ("cuda", "hip", "npu", "musa", "xpu", "cpu")
PAGE_SIZES = (1, 16, 32, 64, 128)
# Real compute capabilities from Volta to Blackwell, plus odd minors.
CUDA_CAPABILITIES = ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (9, 1), (10, 0), (10, 3),
                     (11, 0), (12, 0), (12, 1))
# Near misses of real names: case, whitespace, upstream names the draft factory never had.
_NEAR_MISSES = ("flashinfr", "FlashInfer", "TRITON", " triton", "triton ", "fa2", "fa5",
                "flash_attn", "torch_native", "flex_attention", "", "Auto", "torch-ref")


def _known_libraries() -> tuple[str, ...]:
    found = {module for kind in KINDS for cls in active_registry().classes(kind)
             for module, _pip in cls.requires}
    return tuple(sorted(found | {"triton"}))


@st.composite
def platforms(draw, devices: Sequence[str] = DEVICES,
              libraries: Optional[Sequence[str]] = None) -> Platform:
    """Any platform flavour; ``libraries``: the module names to draw subsets from (default:
    every library a registered backend requires)."""
    device = draw(st.sampled_from(tuple(devices)))
    if device == "cuda":
        capability = draw(st.sampled_from(CUDA_CAPABILITIES))
    elif device in ("hip", "musa"):  # may carry a capability that rules must ignore
        capability = draw(st.none() | st.sampled_from(((9, 4), (3, 1))))
    else:
        capability = None
    libs = _known_libraries() if libraries is None else tuple(libraries)
    return Platform(device, capability, cpu_has_amx=draw(st.booleans()),
                    libraries=draw(st.frozensets(st.sampled_from(libs))) if libs else None,
                    triton_interpret=draw(st.booleans()))


def _names(kind: Optional[str]) -> list[str]:
    kinds = KINDS if kind is None else (kind,)
    return sorted({n for k in kinds for n in active_registry().all_names(k)})


def unknown_names(kind: Optional[str] = None) -> st.SearchStrategy[str]:
    """Strings that are no registered name, alias or ``auto``."""
    known = set(_names(kind)) | {"auto"}
    return (st.sampled_from(_NEAR_MISSES) | st.text(
        st.characters(min_codepoint=32, max_codepoint=126), max_size=12)).filter(
        lambda s: s not in known)


def backend_names(kind: Optional[str] = None) -> st.SearchStrategy:
    """A value for one config field: a registered name or alias (6 in 10), ``auto``,
    ``None``, or not a name."""
    names = _names(kind)
    return st.integers(0, 9).flatmap(
        lambda i: st.sampled_from(names) if i < 6 else st.just("auto") if i == 6
        else st.none() if i == 7 else unknown_names(kind))


@st.composite
def configs(draw, names: Optional[st.SearchStrategy] = None,
            page_sizes: Sequence[int] = PAGE_SIZES) -> SpecConfig:
    """A ``SpecConfig``: ``attention_backend`` from ``names`` (default ``backend_names()``),
    the mode fields and the draft override mostly ``None`` as in real configs."""
    names = backend_names() if names is None else names
    field = st.integers(0, 2).flatmap(lambda i: st.none() if i < 2 else names)
    return SpecConfig(
        attention_backend=draw(names),
        decode_attention_backend=draw(field),
        prefill_attention_backend=draw(field),
        speculative_draft_attention_backend=draw(field),
        speculative_attention_mode=draw(st.sampled_from(("prefill", "decode"))),
        page_size=draw(st.sampled_from(tuple(page_sizes))))


@st.composite
def backend_requests(draw, kind: Optional[Kind] = None) -> BackendRequest:
    """What serving code asks of a backend (dtype and head dim included)."""
    mla = draw(st.booleans())
    return BackendRequest(
        kind=draw(st.sampled_from(KINDS)) if kind is None else kind, mla=mla,
        topk=draw(st.integers(1, 8)), num_steps=draw(st.integers(0, 6)),
        page_size=draw(st.sampled_from(PAGE_SIZES)),
        tree_mode=draw(st.sampled_from(TREE_MODES)),
        dtype=draw(st.sampled_from((torch.bfloat16, torch.float16, torch.float32))),
        head_dim=576 if mla else draw(st.sampled_from((64, 128, 256))))


@st.composite
def model_shapes(draw, model: Optional[str] = None, small: bool = True) -> ModelShape:
    """A per-rank attention shape; ``small`` keeps dims CPU-friendly."""
    model = draw(st.sampled_from(("mha", "mla"))) if model is None else model
    if model == "mla":
        heads = draw(st.sampled_from((1, 2, 4, 16)))
        rank, rope = draw(st.sampled_from(((32, 16), (64, 0)) if small else ((512, 64),)))
        return ModelShape("mla", (heads, rank, rope))
    kv = draw(st.sampled_from((1, 2, 4)))
    group = draw(st.sampled_from((1, 2, 4)))
    dim = draw(st.sampled_from((16, 32) if small else (64, 128)))
    return ModelShape("mha", (kv * group, kv, dim))


def _lengths(max_len: int, max_reqs: int):
    return st.lists(st.integers(1, max_len), min_size=1, max_size=max_reqs)


@st.composite
def decode_rounds(draw, shapes: Optional[st.SearchStrategy] = None,
                  dtypes: Sequence[torch.dtype] = (torch.float32,),
                  page_sizes: Sequence[int] = (1, 4, 16), max_topk: int = 4,
                  max_steps: int = 4, max_len: int = 40, max_reqs: int = 4,
                  device: str = "cpu") -> DecodeRound:
    """A whole draft round on a fresh runner (NaN in every slot no lane may read)."""
    shape = draw(model_shapes() if shapes is None else shapes)
    lens = draw(_lengths(max_len, max_reqs))
    topk = draw(st.integers(1, max_topk))
    steps = draw(st.integers(1, max_steps))
    page = draw(st.sampled_from(tuple(page_sizes)))
    tree = draw(st.sampled_from(TREE_MODES))
    seed = draw(st.integers(0, 2**31 - 1))
    from ..metadata import max_draft_extend_len

    maker = RoundMaker(shape, draw(st.sampled_from(tuple(dtypes))), torch.device(device), page,
                       max(lens) + max_draft_extend_len(topk, steps, page), len(lens) + 1,
                       torch.Generator().manual_seed(seed))
    return maker.decode(lens, topk, steps, tree)


@st.composite
def extend_rounds(draw, shapes: Optional[st.SearchStrategy] = None,
                  dtypes: Sequence[torch.dtype] = (torch.float32,),
                  page_sizes: Sequence[int] = (1, 4, 16), max_len: int = 40,
                  max_new: int = 6, max_reqs: int = 4, device: str = "cpu") -> ExtendRound:
    """A draft-extend batch on a fresh runner: ``E_b`` new tokens after a prefix (maybe 0)."""
    shape = draw(model_shapes() if shapes is None else shapes)
    new = draw(st.lists(st.integers(1, max_new), min_size=1, max_size=max_reqs))
    prefix = draw(st.lists(st.integers(0, max_len), min_size=len(new), max_size=len(new)))
    seq = [a + b for a, b in zip(prefix, new)]
    maker = RoundMaker(shape, draw(st.sampled_from(tuple(dtypes))), torch.device(device),
                       draw(st.sampled_from(tuple(page_sizes))), max(seq), len(seq) + 1,
                       torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1))))
    return maker.extend(seq, new)
