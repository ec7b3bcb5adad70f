"""The plugin as SGLang loads it: entry point, opt-in, name stamps, the explanation, fallbacks,
``path`` tree mode, refusals; and that ``import specattn`` never imports SGLang."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from specattn.errors import InvalidInputError
from specattn.integrations.sglang.settings import read_settings


@pytest.mark.no_sglang
def test_import_specattn_does_not_import_sglang():
    code = ("import sys, specattn, specattn.integrations.sglang, "
            "specattn.integrations.sglang.plugin; assert 'sglang' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.no_sglang
def test_settings_opt_in():
    assert not read_settings({}).enabled
    assert not read_settings({"SPECATTN_SGLANG": "0"}).enabled
    on = read_settings({"SPECATTN_SGLANG": "1"})
    assert on.enabled and on.specattn_name("fa3") == "fa3" and on.tree_mode == "lane"
    forced = read_settings({"SPECATTN_SGLANG_BACKEND": "Auto", "SPECATTN_SGLANG_TREE_MODE": "path"})
    assert forced.enabled and forced.specattn_name("fa3") == "auto" and forced.tree_mode == "path"
    with pytest.raises(InvalidInputError, match="SPECATTN_SGLANG_TREE_MODE"):
        read_settings({"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_TREE_MODE": "tree"})
    for name in ("tritn", "0"):
        with pytest.raises(InvalidInputError, match=f"SPECATTN_SGLANG_BACKEND: .*got '{name}'"):
            read_settings({"SPECATTN_SGLANG_BACKEND": name})
    assert read_settings({"SPECATTN_SGLANG_BACKEND": "nsa"}).backend == "nsa"  # an alias
    # A backend named while the switch says off: contradictory, refused (it had turned on).
    for off in ("0", "off"):
        with pytest.raises(InvalidInputError, match=f"^SPECATTN_SGLANG: expected on or unset "
                                                    f"while SPECATTN_SGLANG_BACKEND .*'{off}'"):
            read_settings({"SPECATTN_SGLANG": off, "SPECATTN_SGLANG_BACKEND": "triton"})
    assert read_settings({"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_BACKEND": "triton"}).enabled


@pytest.mark.no_sglang
def test_settings_switch_is_on_or_off_and_stray_variables_are_named():
    """``SPECATTN_SGLANG=disabled`` had counted as on; a misspelt variable, or the tree mode
    and options without the opt-in, are set but never read: ``stray_settings`` names them
    (the plugin logs them at start-up)."""
    from specattn.integrations.sglang.settings import stray_settings

    for value in ("1", "TRUE", "yes", "on"):
        assert read_settings({"SPECATTN_SGLANG": value}).enabled
    for value in ("disabled", "none", "2"):
        with pytest.raises(InvalidInputError, match=f"^SPECATTN_SGLANG: expected on .*, got "
                                                    f"'{value}'"):
            read_settings({"SPECATTN_SGLANG": value})
    assert stray_settings({"SPECATTN_SGLANG_BACKENDS": "torch_ref",
                           "SPECATTN_SGLANG_TREE_MODE": "path"}) == [
        "SPECATTN_SGLANG_BACKENDS", "SPECATTN_SGLANG_TREE_MODE"]
    assert stray_settings({"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_TREE_MODE": "path",
                           "SPECATTN_SGLANG_OPTIONS": "triton:pdl=False"}) == []
    assert stray_settings({"specattn_sglang": "1", "Specattn_Sglang_Backend": "triton",
                           "SPECATTN_SGLANG": "1", "SPECATTN_SGLANGX": "1"}) == [
        "Specattn_Sglang_Backend", "specattn_sglang"]


@pytest.mark.no_sglang
def test_settings_errors_quote_a_long_value_cut():
    """Every variable's refusal quotes a long value cut, on one short line (the tree mode
    had quoted it whole, unlike the switch, the backend and the options)."""
    long = "x" * 5000
    for env in ({"SPECATTN_SGLANG": long}, {"SPECATTN_SGLANG_BACKEND": long},
                {"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_TREE_MODE": long}):
        with pytest.raises(InvalidInputError) as info:
            read_settings(env)
        message = str(info.value)
        assert len(message) < 300 and message.endswith("...'"), message[-80:]


@pytest.mark.no_sglang
def test_settings_backend_options():
    """``SPECATTN_SGLANG_OPTIONS``: ``specattn bench --option`` items separated by ``;``,
    values converted as the bench converts them; a bad one is refused naming the variable."""
    s = read_settings({"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_OPTIONS":
                       "triton:mode=per-branch; triton:plan=gluon-split"})
    opts = s.backend_options()
    assert opts == {"triton": {"mode": "per-branch", "plan": "gluon-split"}}
    assert read_settings({"SPECATTN_SGLANG": "1"}).backend_options() == {}
    for bad in ("triton", "triton:nope=1", "nosuch:x=1", "triton:plan=gluon",
                "triton:plan=dot,plan=dot-m16", "triton:plan=dot; triton:plan=dot-m16"):
        with pytest.raises(InvalidInputError, match="SPECATTN_SGLANG_OPTIONS"):
            read_settings({"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_OPTIONS": bad})
    long = "triton:mode=per-branch; " + "x" * 5000 + ":k=1"  # the value once, cut
    with pytest.raises(InvalidInputError) as info:
        read_settings({"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_OPTIONS": long})
    assert len(str(info.value)) < 5600 and str(info.value).endswith("...'"), str(info.value)[-80:]


@pytest.mark.no_sglang
def test_settings_backend_options_of_a_third_party_backend(monkeypatch):
    """A backend of a ``specattn.backends`` plugin takes options too: the plugins are loaded
    before the names are checked (they were refused as unregistered at SGLang's start)."""
    import importlib.metadata

    from specattn import DraftDecodeBackend, plugins
    from specattn.registry import default_registry

    made = []

    def target():
        class ThirdParty(DraftDecodeBackend, name="third_party_opts", kernel_library="none"):
            auto_eligible = False

            def __init__(self, runner, topk, num_steps, *, tree_mode="lane", block=64):
                super().__init__(runner, topk, num_steps, tree_mode=tree_mode)

            def init_forward_metadata(self, batch):
                pass

            def forward(self, step, layer, q, k, v):
                raise NotImplementedError

        made.append(ThirdParty)

    class EntryPoint:
        name, value = "third_party_opts", "fake:third_party_opts"

        def load(self):
            return target

    monkeypatch.setattr(plugins, "_loaded", False)
    monkeypatch.setattr(plugins, "loaded_plugins", {})
    monkeypatch.delenv(plugins.DISABLE_ENV, raising=False)
    monkeypatch.delenv(plugins.ALLOW_ENV, raising=False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: (
        [EntryPoint()] if group == plugins.ENTRY_POINT_GROUP else []))
    try:
        s = read_settings({"SPECATTN_SGLANG": "1",
                           "SPECATTN_SGLANG_OPTIONS": "third_party_opts:block=32"})
        assert s.backend_options() == {"third_party_opts": {"block": 32}}
    finally:
        for cls in made:
            default_registry.unregister(cls)


def _load_through_entry_point(monkeypatch, env):
    """SGLang's own plugin loader, restricted to this plugin, run afresh."""
    import sglang.srt.plugins as plugins

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SGLANG_PLUGINS", "specattn")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    plugins.load_plugins()


def test_entry_point_without_opt_in_changes_nothing(specattn_plugin, monkeypatch):
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    before = DraftBackendFactory.__dict__["create_decode_backend"]
    monkeypatch.delenv("SPECATTN_SGLANG", raising=False)
    monkeypatch.delenv("SPECATTN_SGLANG_BACKEND", raising=False)
    _load_through_entry_point(monkeypatch, {})
    assert DraftBackendFactory.__dict__["create_decode_backend"] is before


def test_entry_point_with_opt_in_routes_to_specattn(specattn_plugin, monkeypatch, caplog):
    import sglang_harness as H
    from specattn.integrations.sglang import plugin

    _load_through_entry_point(monkeypatch, {"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    monkeypatch.setattr(plugin, "_explained", set())
    fx = H.build_fixture(H.Shape(page_size=4))
    H.configure_draft(fx, topk=2, steps=3)
    with caplog.at_level(logging.INFO, logger=plugin.__name__):
        first = H.create_decode_container(fx, 2, 3)
        second = H.create_decode_container(fx, 2, 3)
    assert type(first.specattn_backend).name == "torch_ref"
    for b in (first, *first.attn_backends, second):  # the names SGLang's models dispatch on
        assert b.prefill_attention_backend_str == b.decode_attention_backend_str == "triton"
    explained = [r for r in caplog.records if "serves SGLang's draft decode" in r.message]
    assert len(explained) == 1 and "torch_ref" in explained[0].message
    assert H.create_decode_container(fx, 2, 1) is None  # one step: no decode backend


@pytest.mark.parametrize("env,variable", [
    ({"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_TREE_MODE": "tree"}, "SPECATTN_SGLANG_TREE_MODE"),
    ({"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_OPTIONS": "triton:nope=1"},
     "SPECATTN_SGLANG_OPTIONS"),
    # A forced name is the user's choice: a typo is refused, not served by SGLang's backend.
    ({"SPECATTN_SGLANG_BACKEND": "tritn"}, "SPECATTN_SGLANG_BACKEND: .*did you mean 'triton'"),
])
def test_bad_setting_stops_start_up(specattn_plugin, monkeypatch, env, variable):
    """SGLang's loader logs a plugin's exception and starts without the plugin: a bad value
    must still stop start-up (it started with SGLang's own backends), when the draft
    backends are built, naming the variable."""
    import sglang_harness as H

    _load_through_entry_point(monkeypatch, env)
    fx = H.build_fixture(H.Shape())
    H.configure_draft(fx, topk=1, steps=3)
    for create in (H.create_decode_container, H.create_extend_backend):
        with pytest.raises(InvalidInputError, match=variable):
            create(fx, 1, 3)


def test_unknown_name_keeps_sglang_backend(specattn_plugin, monkeypatch, caplog):
    """A name SGLang resolves that specattn does not know (``intel_xpu``) keeps SGLang's."""
    import sglang_harness as H
    from sglang.srt.layers.attention.triton_backend import TritonMultiStepDraftBackend

    from specattn.integrations.sglang import plugin

    specattn_plugin({"SPECATTN_SGLANG": "1"})
    monkeypatch.setattr(plugin, "sglang_backend_name", lambda factory, kind: "intel_xpu")
    fx = H.build_fixture(H.Shape())
    H.configure_draft(fx, topk=1, steps=3)
    with caplog.at_level(logging.WARNING):
        container = H.create_decode_container(fx, 1, 3)
    assert isinstance(container, TritonMultiStepDraftBackend)
    assert "no draft decode backend named 'intel_xpu'" in caplog.text


def test_refuses_what_it_cannot_serve(specattn_plugin):
    import sglang_harness as H

    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    fx = H.build_fixture(H.Shape())
    H.configure_draft(fx, topk=1, steps=3)
    container = H.create_decode_container(fx, 1, 3)
    layer = fx.layer
    layer.sliding_window_size = 8
    with pytest.raises(InvalidInputError, match="layer.sliding_window_size"):
        container.adapter.layers.require(layer)
    fx.runner.kv_index_translator.is_translating = True
    with pytest.raises(InvalidInputError, match="kv_index_translator"):
        H.create_decode_container(fx, 1, 3)


def test_a_layer_specattn_refuses_stops_start_up(specattn_plugin):
    """The draft model's layers are checked when the backends are built: a sliding-window
    layer stops start-up there (it had been refused at its first forward)."""
    import sglang_harness as H

    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    fx = H.build_fixture(H.Shape())
    H.configure_draft(fx, topk=1, steps=3)
    fx.runner.model = torch.nn.ModuleList([fx.module])  # as SGLang's ModelRunner holds it
    H.create_decode_container(fx, 1, 3)  # full attention: served
    fx.layer.sliding_window_size = 8
    for create in (H.create_decode_container, H.create_extend_backend):
        with pytest.raises(InvalidInputError, match="^layer.sliding_window_size: expected -1"):
            create(fx, 1, 3)


def test_refuses_a_pool_of_another_dtype_than_the_model(specattn_plugin):
    """``--kv-cache-dtype bf16`` under another model dtype: refused when the backends are
    built, naming the pool (it was accepted, and the first forward refused the query)."""
    import sglang_harness as H
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    fx = H.build_fixture(H.Shape())
    H.configure_draft(fx, topk=1, steps=3)
    old = fx.runner.token_to_kv_pool
    fx.runner.token_to_kv_pool = MHATokenToKVPool(
        size=old.size, page_size=old.page_size, dtype=torch.bfloat16, head_num=old.head_num,
        head_dim=old.head_dim, layer_num=1, device="cpu", enable_memory_saver=False,
        enable_alt_stream=False)
    for create in (H.create_decode_container, H.create_extend_backend):
        with pytest.raises(InvalidInputError, match="token_to_kv_pool: .* of torch.bfloat16 "
                                                    "stored as torch.bfloat16 under a "
                                                    "torch.float32 model"):
            create(fx, 1, 3)


def test_backend_options_reach_the_backend_sglang_gets(specattn_plugin):
    """``SPECATTN_SGLANG_OPTIONS`` reaches the constructor of the backend that serves."""
    import sglang_harness as H
    import test_sglang_draft as D

    fx, _, _, _ = D._setup(H.Shape(page_size=1), 2)
    for options, want in (("triton:mode=per-branch", "per-branch"), ("", "shared")):
        specattn_plugin({"SPECATTN_SGLANG_BACKEND": "triton",
                         "SPECATTN_SGLANG_OPTIONS": options})
        container = H.create_decode_container(fx, 2, D.STEPS)
        assert container.adapter.backend.mode == want


def test_a_refused_option_or_backend_names_the_setting_that_chose_it(specattn_plugin, caplog):
    """An option the serving backend refuses (``plan=dot-mla`` on an MHA model) is refused
    naming ``SPECATTN_SGLANG_OPTIONS``; a backend that cannot serve here, naming the
    variable that chose it and how to keep SGLang's own; an option for another backend than
    the serving one is said to be unused."""
    import sglang_harness as H

    from specattn.errors import BackendUnavailableError

    fx = H.build_fixture(H.Shape())
    H.configure_draft(fx, topk=1, steps=3)
    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "triton",
                     "SPECATTN_SGLANG_OPTIONS": "triton:plan=dot-mla"})
    with pytest.raises(InvalidInputError, match=r"^SPECATTN_SGLANG_OPTIONS: expected options "
                                                r"the serving backend takes \(plan: .*got "
                                                r"'triton\[plan=dot-mla\]'"):
        H.create_decode_container(fx, 1, 3)
    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "flashinfer"})
    with pytest.raises(BackendUnavailableError, match=r"^SPECATTN_SGLANG_BACKEND=flashinfer "
                                                      r"chose specattn's 'flashinfer', which "
                                                      r"cannot serve here: .*needs CUDA.*unset "
                                                      r"SPECATTN_SGLANG_BACKEND to keep"):
        H.create_decode_container(fx, 1, 3)
    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref",
                     "SPECATTN_SGLANG_OPTIONS": "triton:pdl=False"})
    with caplog.at_level(logging.WARNING):
        H.create_decode_container(fx, 1, 3)
    assert "SPECATTN_SGLANG_OPTIONS: triton[pdl=False] is not used for SGLang's draft decode, " \
        "which specattn's 'torch_ref' serves" in caplog.text


def test_refuses_an_mla_pool_whose_rows_are_not_the_latent(specattn_plugin, monkeypatch):
    """An MLA pool whose rows are not ``kv_lora_rank + qk_rope_head_dim`` elements (SGLang's
    packed FP8 rows of DeepSeek sparse attention: 656 bytes) is refused when the backends are
    built (it was read as a latent with a wider rope, and failed at the first forward)."""
    import sglang_harness as H

    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    fx = H.build_fixture(H.Shape(model="mla"))
    H.configure_draft(fx, topk=1, steps=3)
    pool = fx.runner.token_to_kv_pool
    monkeypatch.setattr(pool, "qk_rope_head_dim", pool.qk_rope_head_dim - 8)
    for create in (H.create_decode_container, H.create_extend_backend):
        with pytest.raises(InvalidInputError, match=r"^model_runner.token_to_kv_pool: expected "
                                                    r"MLA rows of kv_lora_rank \+ "
                                                    r"qk_rope_head_dim = \d+ elements"):
            create(fx, 1, 3)


@pytest.mark.parametrize("sglang_name,decode_stamp,extend_stamp", [
    ("cutedsl_mla", "cutedsl_mla", "trtllm_mla"),  # SGLang builds trtllm_mla's draft extend
    ("nsa", "dsa", "dsa"),                         # a deprecated alias: SGLang builds dsa's
])
def test_name_stamps_are_those_sglangs_factory_gives(specattn_plugin, monkeypatch, sglang_name,
                                                      decode_stamp, extend_stamp):
    """The stamps model code dispatches on are the name of the backend SGLang's own factory
    builds for the name it resolved (DeepSeek's code has no handler for ``cutedsl_mla``
    prefill and took the Triton path)."""
    import sglang_harness as H

    from specattn.integrations.sglang import plugin

    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    monkeypatch.setattr(plugin, "sglang_backend_name", lambda factory, kind: sglang_name)
    fx = H.build_fixture(H.Shape(model="mla"))
    H.configure_draft(fx, topk=1, steps=3)
    for create, stamp in ((H.create_decode_container, decode_stamp),
                          (H.create_extend_backend, extend_stamp)):
        built = create(fx, 1, 3)
        assert built.prefill_attention_backend_str == built.decode_attention_backend_str \
            == stamp


def test_a_name_without_a_specattn_draft_extend_keeps_sglangs(specattn_plugin, monkeypatch):
    """``flashmla``'s draft extend is none in specattn (as in the original factory): SGLang's
    own backend for it stays (``None`` had replaced it)."""
    import sglang_harness as H

    from specattn.integrations.sglang import plugin

    specattn_plugin({"SPECATTN_SGLANG": "1"})
    monkeypatch.setattr(plugin, "sglang_backend_name", lambda factory, kind: "flashmla")
    fx = H.build_fixture(H.Shape(model="mla", page_size=64))
    H.configure_draft(fx, topk=1, steps=3)
    kept = H.create_extend_backend(fx, 1, 3)
    assert kept is not None and type(kept).__module__.startswith("sglang.")


def test_path_tree_mode_attends_to_ancestors(specattn_plugin):
    """``path``: step 1 of lane j attends to its parent's step-0 slot (recorded from SGLang's
    own top-k selection); specattn's Triton kernel agrees with torch_ref; ``lane`` differs."""
    import sglang_harness as H
    import test_sglang_draft as D

    topk = 3
    fx, settings, model, make_batch = D._setup(H.Shape(page_size=1), topk)
    saved = fx.snapshot()
    results = {}
    for env in ({"SPECATTN_SGLANG_BACKEND": "torch_ref", "SPECATTN_SGLANG_TREE_MODE": "path"},
                {"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_TREE_MODE": "path"},
                {"SPECATTN_SGLANG_BACKEND": "torch_ref"}):
        fx.restore(saved)
        specattn_plugin(env)
        container = H.create_decode_container(fx, topk, D.STEPS)
        results[tuple(env.values())] = (H.run_draft(fx, container, topk, D.STEPS, settings,
                                                    model, make_batch), container)
    (ref, ref_c), (tri, _), (lane, _) = results.values()
    D._assert_same_draft(tri, ref)
    parents = ref_c.adapter.parents[1]
    lanes = torch.arange(topk).expand_as(parents)
    assert ((parents >= 0) & (parents < topk)).all() and (parents != lanes).any()
    (_, path_out), (_, lane_out) = ref, lane
    torch.testing.assert_close(path_out[0], lane_out[0], **D.TOL)  # step 0: no history yet
    moved = (parents != lanes).reshape(-1)
    assert not torch.allclose(path_out[1][moved], lane_out[1][moved])
    torch.testing.assert_close(path_out[1][~moved], lane_out[1][~moved], **D.TOL)
