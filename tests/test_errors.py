"""Every user-facing error: its class (and the builtin it subclasses), and its message."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specattn import (DraftBackendFactory, DraftDecodeBackend, DraftExtendBackend, DraftRunner,
                      SpecConfig, list_backends)
from specattn.errors import (
    BackendUnavailableError,
    DuplicateBackendError,
    InvalidInputError,
    ModelMismatchError,
    RegistrationError,
    SpecAttnError,
    UnknownBackendError,
)
from specattn.keys import BackendRequest
from specattn.platforms import Platform, is_cuda
from specattn.registry import default_registry
from specattn.selection import auto_order, describe_error, select

CPU = Platform("cpu", libraries=frozenset())
SM90 = Platform("cuda", (9, 0), libraries={"flashinfer"})


def factory(name=None, mla=False, num_steps=3, page_size=1, platform=CPU):
    return DraftBackendFactory(SpecConfig(attention_backend=name, page_size=page_size),
                               SimpleNamespace(use_mla_backend=mla), 1, num_steps,
                               platform=platform)


def error_of(fn):
    with pytest.raises(SpecAttnError) as info:
        fn()
    return info.value


def test_hierarchy_matches_the_builtins_callers_catch():
    assert issubclass(UnknownBackendError, ValueError)
    assert issubclass(ModelMismatchError, ValueError)
    assert issubclass(InvalidInputError, ValueError)
    assert issubclass(BackendUnavailableError, RuntimeError)
    assert issubclass(RegistrationError, TypeError)
    assert issubclass(DuplicateBackendError, RegistrationError)
    for cls in (UnknownBackendError, ModelMismatchError, InvalidInputError,
                BackendUnavailableError, RegistrationError):
        assert issubclass(cls, SpecAttnError)


# --- unknown names (rules 3 and 15) ------------------------------------------------------------

@pytest.mark.parametrize("kind,prefix", [
    ("decode", "EAGLE is not supported in decode attention backend "),
    ("extend", "EAGLE is not supported in attention backend "),
])
@pytest.mark.parametrize("name,closest", [("flashinfr", "flashinfer"),
                                          ("FlashInfer", "flashinfer"),
                                          ("trtlm_mha", "trtllm_mha"), ("tritonn", "triton")])
def test_unknown_name_message(kind, prefix, name, closest):
    f = factory(name)
    err = error_of(f.resolve_decode_backend if kind == "decode"
                   else f.resolve_draft_extend_backend)
    assert type(err) is UnknownBackendError
    text = str(err)
    # The original's sentence, then the answer, then the names: short enough to read.
    assert text.startswith(f"{prefix}{name}. Did you mean {closest!r}? ")
    valid = sorted(set(default_registry.all_names(kind)) | {"auto"})
    assert text.endswith(f" Valid {kind} backend names: {', '.join(valid)}.")
    assert text.count(f"{closest!r}") == 1 and len(text) < 300, text
    assert err.name == name and err.closest == closest and list(err.valid_names) == valid


def test_unknown_name_close_to_none_gets_no_hint():
    err = error_of(factory("nope").resolve_decode_backend)
    assert type(err) is UnknownBackendError and err.closest is None
    assert "Did you mean" not in str(err) and str(err).startswith(
        "EAGLE is not supported in decode attention backend nope. Valid decode backend names: ")


def test_an_unknown_name_is_cut_in_the_messages_not_on_the_error():
    name = "x" * 20_000
    err = error_of(factory(name).resolve_decode_backend)
    assert type(err) is UnknownBackendError and err.name == name
    assert str(err).startswith("EAGLE is not supported in decode attention backend "
                               + "x" * 57 + "...."), str(err)[:120]
    assert len(str(err)) < 1000 and len(describe_error(err)) < 1000


def test_unknown_name_message_snapshot(empty_registry):
    for name in ("alpha", "beta"):
        type(name, (DraftDecodeBackend,), {"__module__": "fakes",
                                           "init_forward_metadata": lambda s, b: None,
                                           "forward": lambda s, *a: None}, name=name)
    with pytest.raises(UnknownBackendError) as info:
        select("decode", "alpah", BackendRequest(kind="decode"), CPU)
    assert str(info.value) == ("EAGLE is not supported in decode attention backend alpah. "
                               "Did you mean 'alpha'? "
                               "Valid decode backend names: alpha, auto, beta.")


def test_a_name_of_the_other_kind_only_says_which_field_names_it(empty_registry):
    """A decode-only backend named in attention_backend (both kinds): extend's error keeps
    the original sentence, then says where to name it instead of a spelling hint; decode
    selects it from decode_attention_backend and extend goes to auto."""
    type("Mine", (DraftDecodeBackend,), {"__module__": "fakes",
                                         "_attend": lambda s, *a: None}, name="mine")
    type("Ref", (DraftExtendBackend,), {"__module__": "fakes",
                                        "_attend": lambda s, *a: None}, name="ref")
    with pytest.raises(UnknownBackendError) as info:
        select("extend", "mine", BackendRequest(kind="extend"), CPU)
    assert str(info.value) == (
        "EAGLE is not supported in attention backend mine. 'mine' is registered for decode "
        "only: name it in decode_attention_backend, and the extend backend in "
        "prefill_attention_backend or nowhere (auto; docs/selection.md, rule 2). "
        "Valid extend backend names: auto, ref.")
    assert info.value.only_kind == "decode" and info.value.closest is None
    assert describe_error(info.value) == (
        "backend 'mine' has no extend class (it is registered for decode only): name it in "
        "decode_attention_backend, and the extend backend in prefill_attention_backend or "
        "nowhere (auto; docs/selection.md, rule 2)")
    with pytest.raises(UnknownBackendError) as info:
        select("decode", "ref", BackendRequest(kind="decode", num_steps=3), CPU)
    assert "'ref' is registered for extend only: name it in prefill_attention_backend, and " \
           "the decode backend in decode_attention_backend or nowhere" in str(info.value)
    f = DraftBackendFactory(SpecConfig(decode_attention_backend="mine"),
                            SimpleNamespace(use_mla_backend=False), 1, 3, platform=CPU)
    assert f.resolve_decode_backend().name == "mine"
    assert f.resolve_draft_extend_backend().name == "ref"


# --- MLA-only names (rule 8) -------------------------------------------------------------------

@pytest.mark.parametrize("name,reported", [("trtllm_mla", "trtllm_mla"),
                                           ("cutedsl_mla", "trtllm_mla"),
                                           ("tokenspeed_mla", "tokenspeed_mla")])
def test_mla_only_message_is_the_original(name, reported):
    for kind in ("decode", "extend"):
        f = factory(name)
        err = error_of(f.resolve_decode_backend if kind == "decode"
                       else f.resolve_draft_extend_backend)
        assert type(err) is ModelMismatchError
        assert str(err) == f"{reported} backend requires MLA model (use_mla_backend=True)."


# --- unavailable (rule 14) ---------------------------------------------------------------------

def test_unavailable_names_the_backend_every_candidate_and_reason():
    err = error_of(factory("trtllm_mha", platform=SM90).resolve_decode_backend)
    assert type(err) is BackendUnavailableError and err.name == "trtllm_mha"
    text = str(err)
    assert text.startswith("trtllm_mha: no decode backend registered as 'trtllm_mha' can "
                           "serve decode MHA")
    assert "needs CUDA compute capability 10.x, this platform is cuda 9.0" in text
    assert "supports page sizes [16, 32, 64], got 1" in text
    assert text.endswith("Run `specattn list` to see what runs here.")
    classes = default_registry.classes("decode", "trtllm_mha")
    assert set(err.reasons) == {c.qualified_name() for c in classes}
    for qualname, reasons in err.reasons.items():
        assert qualname in text and reasons and all(r in text for r in reasons)


def test_unavailable_lists_every_flavour():
    err = error_of(factory("flashinfer").resolve_draft_extend_backend)
    assert len(err.reasons) == 2
    text = str(err)
    for cls in default_registry.classes("extend", "flashinfer"):
        assert cls.qualified_name() in text
    assert "needs CUDA, this platform is cpu without AMX" in text
    assert ("needs the 'flashinfer' package, which is not installed "
            "(pip install flashinfer-python~=0.7.0)") in text
    assert "serves MHA models, the model is MHA" not in text
    assert "serves MLA models, the model is MHA" in text


@pytest.mark.parametrize("mla", [False, True])
def test_summary_of_a_backend_with_a_flavour_per_model_is_what_that_flavour_needs(mla):
    """flashinfer on a CPU: the one line says what its class for the model needs, not that
    its class for the other model serves the other model (the full message says so)."""
    from specattn.selection import describe_error

    err = error_of(factory("flashinfer", mla=mla).resolve_decode_backend)
    assert isinstance(err, BackendUnavailableError)
    other, model = ("MHA", "MLA") if mla else ("MLA", "MHA")
    assert f"serves {other} models, the model is {model}" in str(err)
    assert err.summary == ("flashinfer: needs CUDA; needs the 'flashinfer' package, which is "
                           "not installed (pip install flashinfer-python~=0.7.0)")
    assert "serves" not in describe_error(err)
    # Where no class serves the model, that is the cause.
    err = error_of(factory("fa3", mla=True).resolve_decode_backend)
    assert isinstance(err, BackendUnavailableError)
    assert err.summary == "fa3: serves MHA models, the model is MLA"


def test_unavailable_message_snapshot(empty_registry):
    type("Only", (DraftDecodeBackend,), {"__module__": "fakes", "page_sizes": frozenset({64}),
                                         "init_forward_metadata": lambda s, b: None,
                                         "forward": lambda s, *a: None},
         name="only", platforms=is_cuda, requires=(("vendorlib", "vendor-lib"),))
    with pytest.raises(BackendUnavailableError) as info:
        select("decode", "only", BackendRequest(kind="decode", num_steps=3), CPU)
    assert str(info.value) == (
        "only: no decode backend registered as 'only' can serve decode MHA topk=1 num_steps=3 "
        "page_size=1 kv_cache_dtype=auto tree_mode=lane on cpu without AMX. Candidates: "
        "fakes.Only: needs CUDA, this platform is cpu without AMX, needs the 'vendorlib' "
        "package, which is not installed (pip install vendor-lib), supports page sizes [64], "
        "got 1. Run `specattn list` to see what runs here.")
    assert info.value.reasons == {"fakes.Only": [
        "needs CUDA, this platform is cpu without AMX",
        "needs the 'vendorlib' package, which is not installed (pip install vendor-lib)",
        "supports page sizes [64], got 1"]}
    # One candidate: all its reasons, without the platform (the caller names it).
    assert info.value.summary == ("only: needs CUDA; needs the 'vendorlib' package, which is "
                                  "not installed (pip install vendor-lib); supports page "
                                  "sizes [64], got 1")


def test_summary_and_describe_error_are_one_short_line(empty_registry):
    """The cause a person reads: what the candidates that run here refuse (not the reasons
    of the ones that cannot run here), one short line; an unknown name gets the closest name
    when one is close, else the known names."""
    from specattn.selection import describe_error

    base = {"__module__": "fakes", "init_forward_metadata": lambda s, b: None,
            "forward": lambda s, *a: None}
    type("Gpu", (DraftDecodeBackend,), dict(base), name="gpu", platforms=is_cuda)
    type("Paged", (DraftDecodeBackend,), dict(base, page_sizes=frozenset({64})),
         name="paged")
    with pytest.raises(BackendUnavailableError) as info:
        select("decode", "auto", BackendRequest(kind="decode", num_steps=3), CPU)
    assert info.value.summary == ("auto: no decode backend can serve the request here: "
                                  "supports page sizes [64], got 1")
    assert describe_error(info.value) == "BackendUnavailableError: " + info.value.summary
    for name, line in [("pagd", "unknown backend 'pagd'; did you mean 'paged'?"),
                       ("zzzz", "unknown backend 'zzzz'; known names: gpu, paged")]:
        with pytest.raises(UnknownBackendError) as info:
            select("decode", name, BackendRequest(kind="decode", num_steps=3), CPU)
        assert describe_error(info.value) == line


def test_auto_with_nothing_usable(empty_registry):
    with pytest.raises(BackendUnavailableError) as info:
        select("extend", "auto", BackendRequest(kind="extend"), CPU)
    assert str(info.value).startswith("auto: no extend backend can serve extend MHA")
    assert info.value.name == "auto"


def test_auto_error_is_one_line_with_the_cause_the_reasons_apart():
    """Every registered class's reasons would be thousands of characters in a traceback:
    the message holds the cause, the reasons are the error's ``reasons``."""
    request = BackendRequest(kind="decode", mla=True, num_steps=3, page_size=64,
                             kv_cache_dtype="fp8_ds_v4")
    with pytest.raises(BackendUnavailableError) as info:
        select("decode", "auto", request, CPU)
    text = str(info.value)
    assert len(text) < 600 and "\n" not in text, text
    assert text.startswith(f"auto: no decode backend can serve {request} on {CPU}: ")
    assert "torch_ref: supports kv_cache_dtype ['auto', 'fp8_e4m3', 'fp8_e5m2'], got " \
        "'fp8_ds_v4'" in text
    assert text.endswith("Each candidate's reasons: the error's .reasons, or `specattn "
                         "select --explain`.")
    assert len(info.value.reasons) > 10  # every class, with its reasons


def test_a_dispatchers_target_is_named_with_the_dispatcher():
    err = error_of(factory("hybrid_linear_attn").resolve_decode_backend)
    assert isinstance(err, BackendUnavailableError) and err.name == "fa3"
    assert str(err).startswith("hybrid_linear_attn (-> fa3): no decode backend registered "
                               "as 'fa3' can serve")
    assert err.summary.startswith("hybrid_linear_attn (-> fa3): ")


def test_list_backends_pattern_is_a_string():
    with pytest.raises(InvalidInputError, match="^pattern: expected an fnmatch pattern"):
        list_backends(pattern=3)


def test_backend_request_kv_cache_dtype_is_a_known_name():
    with pytest.raises(InvalidInputError, match="^kv_cache_dtype: expected one of "):
        BackendRequest(kind="decode", kv_cache_dtype="bogus")


def test_pending_backend_is_refused_by_selection_and_its_constructor(empty_registry):
    """A class declared ``pending`` (registered, not implemented yet): selection names the
    reason, and constructing it directly is refused the same way."""
    cls = type("Later", (DraftDecodeBackend,), {"__module__": "fakes",
                                                 "pending": "not implemented yet (issue #99)",
                                                 "init_forward_metadata": lambda s, b: None,
                                                 "forward": lambda s, *a: None},
               name="later")
    with pytest.raises(BackendUnavailableError) as info:
        select("decode", "later", BackendRequest(kind="decode", num_steps=3), CPU)
    assert info.value.reasons == {"fakes.Later": ["not implemented yet (issue #99)"]}
    from specattn import DraftRunner

    runner = DraftRunner.mha(4, 2, 16, num_layers=1, num_slots=8, max_reqs=1,
                             max_context_len=8)
    with pytest.raises(BackendUnavailableError, match=r"^later: not implemented yet \(issue"):
        cls(runner, 1, 3)


# --- invalid inputs ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,argument", [
    (dict(speculative_attention_mode="verify"), "speculative_attention_mode"),
    (dict(page_size=0), "page_size"),
    (dict(page_size=True), "page_size"),
    (dict(page_size="64"), "page_size"),
    (dict(attention_backend=3), "attention_backend"),
    (dict(speculative_draft_attention_backend=["fa3"]), "speculative_draft_attention_backend"),
])
def test_spec_config_rejects_bad_fields(kwargs, argument):
    with pytest.raises(InvalidInputError) as info:
        SpecConfig(**kwargs)
    assert info.value.argument == argument
    assert str(info.value).startswith(f"{argument}: expected ")
    assert ", got " in str(info.value)


def test_spec_config_message_text():
    with pytest.raises(InvalidInputError) as info:
        SpecConfig(page_size=0)
    assert str(info.value) == "page_size: expected an int >= 1, got 0"


@pytest.mark.parametrize("args,argument", [
    (("not a config", SimpleNamespace(use_mla_backend=False), 1, 3), "config"),
    ((SpecConfig(), SimpleNamespace(use_mla_backend=False), 0, 3), "topk"),
    ((SpecConfig(), SimpleNamespace(use_mla_backend=False), True, 3), "topk"),
    ((SpecConfig(), SimpleNamespace(use_mla_backend=False), 1, -1), "num_steps"),
    ((SpecConfig(), SimpleNamespace(use_mla_backend=False), 1, 2.0), "num_steps"),
    ((SpecConfig(), object(), 1, 3), "runner"),
])
def test_factory_rejects_bad_arguments(args, argument):
    with pytest.raises(InvalidInputError) as info:
        DraftBackendFactory(*args)
    assert info.value.argument == argument


@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_factory_creates_only_with_a_draft_runner(kind):
    """Selection reads only ``use_mla_backend``, so ``resolve_*`` takes an engine's runner;
    building the backend needs a ``DraftRunner``, and says so."""
    f = DraftBackendFactory(SpecConfig(attention_backend="torch_ref"),
                            SimpleNamespace(use_mla_backend=False), 1, 3)
    assert (f.resolve_decode_backend if kind == "decode" else f.resolve_draft_extend_backend)()
    with pytest.raises(InvalidInputError, match="^runner: expected a specattn.DraftRunner .*"
                       "got SimpleNamespace$"):
        (f.create_decode_backend if kind == "decode" else f.create_draft_extend_backend)()


@pytest.mark.parametrize("key,got", [("trition", "'trition'"), (1, "1")])
def test_factory_refuses_backend_options_for_no_backend(key, got):
    """A misspelled ``backend_options`` key is refused when a backend is built, not ignored
    with its keywords."""
    runner = DraftRunner.mha(2, 1, 16, num_layers=1, num_slots=8, max_reqs=1,
                             max_context_len=8, dtype=torch.float32)
    f = DraftBackendFactory(SpecConfig(attention_backend="torch_ref"), runner, 1, 3,
                            backend_options={key: {"plan": "dot"}})
    with pytest.raises(InvalidInputError) as info:
        f.create_decode_backend()
    assert info.value.argument == "backend_options" and str(info.value).endswith(f"got {got}")
    assert ("did you mean 'triton'?" in str(info.value)) == (key == "trition")


def test_factory_rejects_a_bad_tree_mode():
    with pytest.raises(InvalidInputError, match="tree_mode"):
        DraftBackendFactory(SpecConfig(), SimpleNamespace(use_mla_backend=False), 1, 3,
                            tree_mode="tree", platform=CPU).resolve_decode_backend()


@pytest.mark.parametrize("kwargs,argument", [
    (dict(kind="verify"), "kind"), (dict(kind="decode", tree_mode="x"), "tree_mode"),
    (dict(kind="decode", topk=0), "topk"), (dict(kind="decode", page_size=0), "page_size"),
    (dict(kind="decode", num_steps=-1), "num_steps"),
])
def test_backend_request_rejects_bad_fields(kwargs, argument):
    with pytest.raises(InvalidInputError) as info:
        BackendRequest(**kwargs)
    assert info.value.argument == argument


@pytest.mark.parametrize("call,argument,got", [
    (lambda: select("prefill", "triton", BackendRequest("decode")), "kind", "'prefill'"),
    (lambda: select("decode", "triton", None), "request", "NoneType"),
    (lambda: select("decode", "triton", BackendRequest("decode"), "cuda:9.0"), "platform",
     "'cuda:9.0'"),
    (lambda: DraftBackendFactory(SpecConfig(), SimpleNamespace(use_mla_backend=False), 1, 3,
                                 platform="cpu").resolve_decode_backend(), "platform", "'cpu'"),
    (lambda: list_backends(kind="verify"), "kind", "'verify'"),
    (lambda: list_backends(platform="cpu"), "platform", "'cpu'"),
    (lambda: auto_order(kind="verify"), "kind", "'verify'"),
    (lambda: auto_order(platform="cpu"), "platform", "'cpu'"),
    (lambda: select("decode", "triton", BackendRequest("decode"), registry="default"),
     "registry", "'default'"),
    (lambda: DraftBackendFactory(SpecConfig(), SimpleNamespace(use_mla_backend=False), 1, 3,
                                 registry="default"), "registry", "'default'"),
    (lambda: list_backends(registry={}), "registry", "{}"),
    (lambda: auto_order(registry=[]), "registry", "[]"),
])
def test_selection_and_listing_check_their_arguments(call, argument, got):
    """A kind, request, platform or registry of the wrong kind is named, not met as a KeyError or
    AttributeError deep in the registry."""
    with pytest.raises(InvalidInputError) as info:
        call()
    assert info.value.argument == argument and str(info.value).endswith(f"got {got}")


def test_platform_errors_say_what_is_expected():
    with pytest.raises(InvalidInputError) as info:
        Platform("gpu")
    assert str(info.value) == ("device: expected one of ('cuda', 'hip', 'npu', 'musa', 'xpu', "
                               "'cpu'), got 'gpu'")
    with pytest.raises(InvalidInputError, match=r"capability: expected \(major, minor\)"):
        Platform("cuda", (9,))


def test_a_cpu_backend_that_lacks_only_the_interpreter_says_so_first():
    """After ``pip install triton`` on a CPU the Triton backends still need
    TRITON_INTERPRET=1: the reason says that, not the list of GPU platforms."""
    import dataclasses

    from specattn.backends.triton import TritonDecode

    cpu = Platform("cpu", libraries=frozenset({"triton"}))
    assert TritonDecode.platform_reasons(cpu) == [
        "set TRITON_INTERPRET=1 to run it on this CPU (Triton's interpreter, slow)"]
    assert TritonDecode.platform_reasons(dataclasses.replace(cpu, triton_interpret=True)) == []
    reasons = TritonDecode.platform_reasons(CPU)  # triton missing as well: both, in order
    assert reasons[0].startswith("set TRITON_INTERPRET=1") and "pip install" in reasons[1]
    amx_only = Platform("cpu", cpu_has_amx=False, libraries=frozenset())
    from specattn.backends.flashinfer import FlashInferDecode

    assert FlashInferDecode.platform_reasons(amx_only)[0].startswith("needs CUDA")
