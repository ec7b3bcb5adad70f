"""SGLang-backed tests: marked ``sglang`` (deselect with ``-m "not sglang"``), skipped with the
reason when SGLang (the pinned version) is not installed."""

from __future__ import annotations

import contextlib
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
def specattn_plugin(sglang_cpu):
    """Factory: opt in with ``env`` (e.g. ``{"SPECATTN_SGLANG": "1"}``), run the plugin's
    entry function and apply SGLang's hooks (``draft_round.sglang_hooks``); SGLang's factory,
    hooks, top-k selection and the opt-in variables are restored afterwards, also after a
    test that applied the plugin some other way."""
    from specattn.integrations.sglang.draft_round import sglang_hooks

    with contextlib.ExitStack() as stack:
        stack.enter_context(sglang_hooks(None))  # the state to restore, and no opt-in
        yield lambda env: stack.enter_context(sglang_hooks(env))
