"""SGLang-backed tests: marked ``sglang`` (deselect with ``-m "not sglang"``), skipped with the
reason when SGLang (the pinned version) is not installed."""

from __future__ import annotations

import importlib.metadata
import os

import pytest

SGLANG_VERSION = "0.5.23"  # the version these tests ran with (requirements-sglang.txt)


def _sglang_missing() -> str:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return ("SGLang is not installed (pip install --no-deps sglang==0.5.23 && pip install "
                "-r requirements-sglang.txt -c constraints-cpu.txt)")
    if version != SGLANG_VERSION:
        return f"these tests pin SGLang {SGLANG_VERSION}, found {version}"
    return ""


SKIP_REASON = _sglang_missing()


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here) and "no_sglang" not in item.keywords:
            item.add_marker(pytest.mark.sglang)
            if SKIP_REASON:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture
def sglang_cpu():
    """SGLang on the CPU: no torch.compile (SGLang compiles its top-k selection), float32."""
    import torch

    import sglang_stubs

    sglang_stubs.install()
    # The config's own patch: monkeypatch's undo deletes the entry on newer pytest (the
    # config module's attributes are not static), which breaks every later test.
    with torch._dynamo.config.patch(disable=True), torch.no_grad():
        yield


@pytest.fixture
def specattn_plugin(monkeypatch, sglang_cpu):
    """Factory: opt in with ``env`` (e.g. ``{"SPECATTN_SGLANG": "1"}``), run the plugin's
    entry function and apply SGLang's hooks; every patched target is restored afterwards."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative import draft_utils, spec_utils

    import specattn.integrations.sglang.plugin as plugin

    saved_hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    factory = draft_utils.DraftBackendFactory
    originals = {name: factory.__dict__[name]
                 for name in ("create_decode_backend", "create_draft_extend_backend")}
    select = spec_utils.select_top_k_tokens
    holders = _holders_of(select)

    def enable(env: dict) -> None:
        for key in ("SPECATTN_SGLANG", "SPECATTN_SGLANG_BACKEND", "SPECATTN_SGLANG_TREE_MODE",
                    "SPECATTN_SGLANG_OPTIONS"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        HookRegistry.reset()
        plugin.register()
        HookRegistry.apply_hooks()

    yield enable
    for name, fn in originals.items():
        setattr(factory, name, fn)
    for module in holders:
        module.select_top_k_tokens = select
    spec_utils.select_top_k_tokens = select
    HookRegistry.reset()
    HookRegistry._hooks.update(saved_hooks)
    HookRegistry._patched.update(saved_patched)


def _holders_of(fn) -> list:
    import sys

    holders = []
    for module in list(sys.modules.values()):
        try:
            if vars(module).get("select_top_k_tokens") is fn:
                holders.append(module)
        except TypeError:
            continue
    return holders
