"""Pinned selection cases, one per rule of ``selection.md`` (literal expectations, no oracle).

A case about a backend whose kernels are still pending accepts "unavailable, and the only
reason is that it is pending" in place of the class, so it keeps passing when the kernels land.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from specattn import DraftBackendFactory, SpecConfig
from specattn.errors import (
    BackendUnavailableError,
    ModelMismatchError,
    SpecAttnError,
    UnknownBackendError,
)
from specattn.platforms import Platform
from specattn.registry import default_registry

import oracle

CPU = Platform("cpu", libraries=frozenset())
CPU_AMX = Platform("cpu", cpu_has_amx=True, libraries=frozenset())
CPU_INTERP = Platform("cpu", triton_interpret=True, libraries={"triton"})
H100 = Platform("cuda", (9, 0), libraries={"flashinfer", "triton"})
B200 = Platform("cuda", (10, 0), libraries={"flashinfer", "triton"})
HIP = Platform("hip", libraries={"triton", "aiter"})
NPU = Platform("npu", libraries={"torch_npu"})
MUSA = Platform("musa", libraries={"mate"})


def resolve(kind, platform, mla=False, num_steps=3, topk=1, **config):
    factory = DraftBackendFactory(SpecConfig(**config), SimpleNamespace(use_mla_backend=mla),
                                  topk, num_steps, platform=platform)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return (factory.resolve_decode_backend() if kind == "decode"
                    else factory.resolve_draft_extend_backend())
        except SpecAttnError as exc:
            return exc


def assert_lands_on(kind, outcome, name, flavour=None):
    """``outcome`` is the class registered as ``name`` (``flavour``), or that class is
    unavailable for no reason but its pending kernels."""
    if isinstance(outcome, type):
        assert outcome.name == name, outcome
        assert flavour is None or outcome.flavour == flavour, outcome.flavour
        return
    assert isinstance(outcome, BackendUnavailableError), outcome
    assert outcome.name == name, outcome
    matches = [c for c in default_registry.classes(kind, name)
               if flavour is None or c.flavour == flavour]
    assert any(c.pending and outcome.reasons.get(c.qualified_name()) == [c.pending]
               for c in matches), outcome.reasons


# --- rule 1: decode None for num_steps <= 1 ----------------------------------------------------

@pytest.mark.parametrize("num_steps", [0, 1])
@pytest.mark.parametrize("name", ["torch_ref", "flashinfr", "trtllm_mla", None])
def test_rule1_no_decode_backend_for_one_step(num_steps, name):
    assert resolve("decode", CPU, num_steps=num_steps, attention_backend=name) is None


def test_rule1_extend_is_still_built_for_one_step():
    assert resolve("extend", CPU, num_steps=1, attention_backend="torch_ref").name == \
        "torch_ref"


# --- rule 2: name precedence -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_rule2_override_wins(kind):
    got = resolve(kind, CPU, attention_backend="flashinfr", decode_attention_backend="nope",
                  prefill_attention_backend="nope",
                  speculative_draft_attention_backend="torch_ref")
    assert got.name == "torch_ref"


def test_rule2_mode_field_per_kind():
    cfg = dict(attention_backend="unknown_a", decode_attention_backend="torch_ref",
               prefill_attention_backend="unknown_p")
    assert resolve("decode", CPU, **cfg).name == "torch_ref"
    err = resolve("extend", CPU, **cfg)
    assert isinstance(err, UnknownBackendError) and err.name == "unknown_p"
    err = resolve("extend", CPU, speculative_attention_mode="decode", **cfg)
    assert err.name == "torch_ref"


def test_rule2_falls_back_to_attention_backend():
    for kind in ("decode", "extend"):
        assert resolve(kind, CPU, attention_backend="torch_ref").name == "torch_ref"


def test_rule2_empty_override_is_ignored_but_empty_field_is_a_name():
    assert resolve("decode", CPU, attention_backend="torch_ref",
                   speculative_draft_attention_backend="").name == "torch_ref"
    err = resolve("decode", CPU, attention_backend="torch_ref", decode_attention_backend="")
    assert isinstance(err, UnknownBackendError)
    assert str(err).startswith("EAGLE is not supported in decode attention backend .")


# --- rule 3: unknown names ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["flashinfr", "FlashInfer", "torch_native", " triton", "fa2"])
def test_rule3_unknown_names(name):
    for kind, prefix in (("decode", "EAGLE is not supported in decode attention backend "),
                         ("extend", "EAGLE is not supported in attention backend ")):
        err = resolve(kind, CPU, attention_backend=name)
        assert isinstance(err, UnknownBackendError) and isinstance(err, ValueError)
        assert str(err).startswith(prefix + name)


# --- rule 4: flashinfer MHA vs MLA -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["decode", "extend"])
@pytest.mark.parametrize("mla,flavour", [(False, "mha"), (True, "mla")])
def test_rule4_flashinfer_follows_use_mla_backend(kind, mla, flavour):
    got = resolve(kind, H100, mla=mla, attention_backend="flashinfer")
    assert_lands_on(kind, got, "flashinfer", flavour)
    assert ("mla" in got.models) == mla if isinstance(got, type) else True


def test_rule4_flashinfer_needs_cuda_and_the_library():
    err = resolve("decode", CPU, attention_backend="flashinfer")
    assert isinstance(err, BackendUnavailableError) and len(err.reasons) == 2
    err = resolve("decode", Platform("cuda", (9, 0), libraries=frozenset()),
                  attention_backend="flashinfer")
    assert any("flashinfer" in r for rs in err.reasons.values() for r in rs)


# --- rule 5: fa3 / fa4 flavours ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["fa3", "fa4"])
def test_rule5_musa_flavour(name):
    assert_lands_on("decode", resolve("decode", MUSA, attention_backend=name), name, "musa")


def test_rule5_fa3_flavours_on_cuda():
    sm80 = Platform("cuda", (8, 0), libraries={"flash_attn_interface"})
    assert_lands_on("decode", resolve("decode", sm80, attention_backend="fa3"), "fa3", "sm8x")
    cute_only = Platform("cuda", (9, 0), libraries={"flash_attn.cute"})
    assert_lands_on("extend", resolve("extend", cute_only, attention_backend="fa3"), "fa3",
                    "sm90")
    # sm8x is MHA only: an MLA model has no fa3 on Ampere.
    err = resolve("decode", sm80, mla=True, attention_backend="fa3")
    assert isinstance(err, BackendUnavailableError)
    assert any("serves MHA models" in r for r in sum(err.reasons.values(), []))


def test_rule5_fa4_on_hopper_and_blackwell():
    for cap in ((9, 0), (10, 0)):
        p = Platform("cuda", cap, libraries={"flash_attn.cute"})
        assert_lands_on("decode", resolve("decode", p, attention_backend="fa4"), "fa4", "cuda")
    err = resolve("decode", Platform("cuda", (8, 0), libraries={"flash_attn.cute"}),
                  attention_backend="fa4")
    assert isinstance(err, BackendUnavailableError)


# --- rule 6: hybrid_linear_attn ----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["decode", "extend"])
@pytest.mark.parametrize("platform,target", [
    (CPU_AMX, "intel_amx"),
    (CPU, "fa3"),
    (Platform("cuda", (10, 0)), "triton"),
    (Platform("cuda", (11, 0)), "triton"),
    (Platform("cuda", (12, 0)), "triton"),
    (Platform("cuda", (9, 0)), "fa3"),
    (Platform("hip", cpu_has_amx=True), "fa3"),
], ids=["cpu-amx", "cpu", "sm100", "sm110", "sm120", "sm90", "hip-amx-host"])
def test_rule6_hybrid_linear_attn(kind, platform, target):
    factory = DraftBackendFactory(SpecConfig(attention_backend="hybrid_linear_attn"),
                                  SimpleNamespace(use_mla_backend=False), 1, 3,
                                  platform=platform)
    try:
        sel = (factory.explain_decode_backend() if kind == "decode"
               else factory.explain_draft_extend_backend())
        assert sel.backend.name == target
    except BackendUnavailableError as exc:
        assert exc.name == target


# --- rule 7: cutedsl_mla -----------------------------------------------------------------------

def test_rule7_cutedsl_mla_decode_and_extend():
    p = Platform("cuda", (10, 0), libraries={"flashinfer"})
    dec = resolve("decode", p, mla=True, page_size=64, attention_backend="cutedsl_mla")
    assert_lands_on("decode", dec, "cutedsl_mla")
    ext = resolve("extend", p, mla=True, page_size=64, attention_backend="cutedsl_mla")
    assert_lands_on("extend", ext, "trtllm_mla")


# --- rule 8: MLA-only names, before any platform check -----------------------------------------

@pytest.mark.parametrize("kind", ["decode", "extend"])
@pytest.mark.parametrize("name,reported", [("trtllm_mla", "trtllm_mla"),
                                           ("cutedsl_mla", "trtllm_mla"),
                                           ("tokenspeed_mla", "tokenspeed_mla")])
@pytest.mark.parametrize("platform", [CPU, B200, NPU], ids=["cpu", "sm100", "npu"])
def test_rule8_mla_only_names(kind, name, reported, platform):
    err = resolve(kind, platform, mla=False, attention_backend=name)
    assert type(err) is ModelMismatchError and isinstance(err, ValueError)
    assert str(err) == f"{reported} backend requires MLA model (use_mla_backend=True)."


def test_rule8_mla_model_goes_on_to_platform_checks():
    err = resolve("decode", CPU, mla=True, attention_backend="trtllm_mla")
    assert isinstance(err, BackendUnavailableError)


# --- rule 9: flashmla extend -------------------------------------------------------------------

@pytest.mark.parametrize("platform", [CPU, H100], ids=["cpu", "sm90"])
@pytest.mark.parametrize("mla", [False, True])
def test_rule9_flashmla_extend_is_none(platform, mla):
    assert resolve("extend", platform, mla=mla, attention_backend="flashmla") is None


def test_rule9_flashmla_decode_needs_page_64():
    p = Platform("cuda", (9, 0), libraries={"flash_mla"})
    assert_lands_on("decode", resolve("decode", p, mla=True, page_size=64,
                                      attention_backend="flashmla"), "flashmla")
    err = resolve("decode", p, mla=True, page_size=1, attention_backend="flashmla")
    assert any("page sizes [64]" in r for r in sum(err.reasons.values(), []))


# --- rule 10: dsv4 -----------------------------------------------------------------------------

@pytest.mark.parametrize("platform,flavour", [(NPU, "npu"), (HIP, "hip"), (B200, "cuda")],
                         ids=["npu", "hip", "cuda"])
def test_rule10_dsv4_flavours(platform, flavour):
    for kind in ("decode", "extend"):
        # page 128: SGLang's NPU page size (torch_npu's paged ops need 16-aligned pages).
        assert_lands_on(kind, resolve(kind, platform, mla=True, page_size=128,
                                      attention_backend="dsv4"), "dsv4", flavour)


# --- rule 11 / 17: one backend per name; nsa is dsa --------------------------------------------

def test_nsa_resolves_to_dsa():
    p = Platform("cuda", (9, 0), libraries={"triton"})
    for kind in ("decode", "extend"):
        assert_lands_on(kind, resolve(kind, p, mla=True, page_size=64,
                                      attention_backend="nsa"), "dsa")


@pytest.mark.parametrize("platform", [CPU, CPU_AMX, H100, B200, HIP, NPU, MUSA,
                                      Platform("xpu", libraries=frozenset())])
def test_torch_ref_runs_everywhere(platform):
    for kind in ("decode", "extend"):
        for mla in (False, True):
            got = resolve(kind, platform, mla=mla, page_size=128, topk=8,
                          attention_backend="torch_ref")
            assert isinstance(got, type) and got.name == "torch_ref", got


# --- rule 16: auto -----------------------------------------------------------------------------

@pytest.mark.parametrize("platform,expected", [
    (Platform("xpu", libraries=frozenset()), "torch_ref"),
    (Platform("xpu", libraries={"triton"}), "triton"),
    (Platform("hip", libraries={"triton"}), "triton"),
    (Platform("cuda", (9, 0), libraries={"flashinfer", "triton"}), "flashinfer"),
    (Platform("cuda", (10, 0), libraries={"flashinfer", "triton"}), "flashinfer"),
    (Platform("cuda", (8, 6), libraries={"triton"}), "triton"),
], ids=["xpu-bare", "xpu-triton", "hip-triton", "h100-fi", "b200-fi-page1", "sm86-triton"])
@pytest.mark.parametrize("name", [None, "auto"])
def test_rule16_auto(platform, expected, name):
    for kind in ("decode", "extend"):
        got = resolve(kind, platform, attention_backend=name)
        assert isinstance(got, type) and got.name == expected, got


@pytest.mark.parametrize("device", sorted(oracle.AUTO_DESIGN_ORDER))
def test_rule16_auto_order_is_the_design(device):
    """The declared priorities put the built-in names in the designed order for `auto`."""
    platform = Platform(device, (9, 0) if device == "cuda" else None)
    design = oracle.AUTO_DESIGN_ORDER[device]
    best = {}
    for kind in ("decode", "extend"):
        for cls in default_registry.classes(kind):
            if cls.name in design:
                best[cls.name] = max(best.get(cls.name, -10**9), cls.priority_on(platform))
    ranked = sorted(design, key=lambda n: (-best[n], n))
    assert tuple(ranked) == design


def test_rule16_auto_never_picks_model_specific_backends():
    for kind in ("decode", "extend"):
        for cls in default_registry.classes(kind):
            if cls.name in ("dsa", "dsv4"):
                assert cls.auto_eligible is False


def test_rule16_auto_oracle_needs_no_edit_for_a_new_backend(scoped_registry):
    """A backend the documents do not list takes part in `auto` through its declaration."""
    from specattn import DraftDecodeBackend
    from specattn.platforms import any_platform

    class BrandNew(DraftDecodeBackend, name="brand_new", platforms=any_platform,
                   priority=1000):
        def init_forward_metadata(self, batch): ...

        def forward(self, step, layer, q, k, v): ...

    config = SpecConfig(attention_backend="auto")
    for platform in (CPU, Platform("cuda", (9, 0), libraries={"flashinfer"})):
        want = oracle.expected("decode", config, False, 3, 2, platform)
        got = oracle.factory_outcome("decode", config, False, 3, 2, platform)
        oracle.assert_matches(want, got)
        assert got is BrandNew


def test_resolve_name_follows_aliases_and_dispatchers():
    from specattn.platforms import Platform
    from specattn.selection import resolve_name

    cpu, amx = Platform("cpu"), Platform("cpu", cpu_has_amx=True)
    assert resolve_name("extend", "cutedsl_mla", cpu) == "trtllm_mla"
    assert resolve_name("decode", "cutedsl_mla", cpu) == "cutedsl_mla"
    assert resolve_name("decode", "nsa", cpu) == "dsa"
    assert resolve_name("decode", "hybrid_linear_attn", cpu) == "fa3"
    assert resolve_name("decode", "hybrid_linear_attn", amx) == "intel_amx"
    assert resolve_name("extend", "flashmla", cpu) is None  # routes to no backend
    assert resolve_name("decode", "intel_xpu", cpu) is None
