"""Hypothesis strategies shared by the selection tests: platforms, configs, requests."""

from __future__ import annotations

from hypothesis import strategies as st

from specattn.config import SpecConfig
from specattn.platforms import Platform

from oracle import AUTO, KNOWN_NAMES, LIBRARIES

DEVICES = ("cuda", "hip", "npu", "musa", "xpu", "cpu")
PAGE_SIZES = (1, 16, 32, 64, 128)
# Real compute capabilities from Volta to Blackwell, plus odd minors (9.1, 10.3, 11.0).
CUDA_CAPABILITIES = ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (9, 1), (10, 0), (10, 3),
                     (11, 0), (12, 0), (12, 1))
# Strings that are not backend names: near misses, case and whitespace variants, names of
# upstream backends the draft factory never supported, and the empty string.
NOT_NAMES = ("flashinfr", "FlashInfer", "TRITON", "Triton", " triton", "triton ", "fa2",
             "fa5", "flash_attn", "torch_native", "flex_attention", "cutlass_mla", "wave",
             "intel_xpu", "dual_chunk_flash_attn", "nsa_", "hybrid", "", "Auto", "AUTO",
             "torch-ref", "trtllm-mla")


@st.composite
def platforms(draw, devices=DEVICES) -> Platform:
    """Any platform flavour; libraries are always an explicit random subset."""
    device = draw(st.sampled_from(devices))
    if device == "cuda":
        capability = draw(st.sampled_from(CUDA_CAPABILITIES))
    elif device in ("hip", "musa"):  # may carry a capability; the rules must ignore it
        capability = draw(st.none() | st.sampled_from(((9, 4), (3, 1))))
    else:
        capability = None
    return Platform(device, capability, cpu_has_amx=draw(st.booleans()),
                    libraries=draw(st.frozensets(st.sampled_from(LIBRARIES))),
                    triton_interpret=draw(st.booleans()))


def unknown_names() -> st.SearchStrategy[str]:
    return st.sampled_from(NOT_NAMES) | st.text(
        st.characters(min_codepoint=32, max_codepoint=126), max_size=12).filter(
        lambda s: s not in KNOWN_NAMES and s != AUTO)


def backend_names() -> st.SearchStrategy:
    """A value for one config field: a known name or alias, `auto`, None, or not a name."""
    # Weights: 6/10 known names, 1/10 each `auto`, None, two tenths not a name.
    return st.integers(0, 9).flatmap(
        lambda i: st.sampled_from(KNOWN_NAMES) if i < 6 else st.just(AUTO) if i == 6
        else st.none() if i == 7 else unknown_names())


def field_names() -> st.SearchStrategy:
    """Mostly None (as in real configs), otherwise any backend_names() value."""
    return st.integers(0, 2).flatmap(lambda i: st.none() if i < 2 else backend_names())


@st.composite
def configs(draw, override=None) -> SpecConfig:
    """A SpecConfig; ``override`` True/False forces the draft override set/unset."""
    if override is None:
        draft = draw(field_names())
    elif override:
        draft = draw(st.sampled_from(KNOWN_NAMES) | unknown_names().filter(bool))
    else:
        draft = None
    return SpecConfig(
        attention_backend=draw(backend_names()),
        decode_attention_backend=draw(field_names()),
        prefill_attention_backend=draw(field_names()),
        speculative_draft_attention_backend=draft,
        speculative_attention_mode=draw(st.sampled_from(("prefill", "decode"))),
        page_size=draw(st.sampled_from(PAGE_SIZES)))


modes = st.sampled_from(("prefill", "decode"))
kinds = st.sampled_from(("decode", "extend"))
mla_flags = st.booleans()
num_steps = st.integers(0, 6)
topks = st.integers(1, 8)
page_sizes = st.sampled_from(PAGE_SIZES)
