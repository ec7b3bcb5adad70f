"""The conformance kit over every built-in backend (``environments.py`` says where each runs).

Each environment contributes one pytest test per kit case (``conformance_tests``); skipped
cases and declared limits show as skips with their reasons. ``test_every_class_is_covered``
keeps the table complete: a new built-in backend fails it until it has an environment.
"""

from __future__ import annotations

import pytest

from environments import NATIVE, STANDIN, environments
from specattn.registry import default_registry
from specattn.testing import conformance_tests

for _env in environments():
    globals()[f"test_{_env.label.replace('-', '_')}"] = conformance_tests(
        _env.name, **_env.options())


def test_every_class_is_covered():
    covered = {c for env in NATIVE + STANDIN for c in env.covers}
    registry = default_registry
    classes = {f"{cls.name}[{cls.flavour}]" for kind in ("decode", "extend")
               for cls in registry.classes(kind) if cls.__module__.startswith("specattn.")}
    missing = sorted(classes - covered)
    assert not missing, f"built-in backend classes with no conformance environment: {missing}"


def test_standins_run_under_the_interpreter_only(monkeypatch):
    """The stand-ins' backends launch Triton kernels on the CPU (the flashinfer decode's slot
    list): without the interpreter, on a GPU host, each such case failed in Triton's launcher;
    they are collected where the interpreter is on."""
    import environments as envs

    standins = {e.label for e in envs.STANDIN}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not standins & {e.label for e in envs.environments()}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert standins <= {e.label for e in envs.environments()}


def test_the_partial_page_case_fails_a_backend_that_pages_the_pool_unchecked(monkeypatch):
    """FlashAttention views a pool as whole pages. Without its refusal of a partial last
    page, the extend case, whose new token sits in that page's one slot, fails (the slot is
    in no page the table can name); the decode case's draft slot there is read through the
    token view of the lane history and passes. With the refusal both are skips naming it."""
    import environments as envs
    from specattn.backends.flash_attn import _decode, _extend
    from specattn.testing import check_backend

    env = next((e for e in envs.environments() if e.name == "fa4"), None)
    if env is None:
        pytest.skip("the FlashAttention stand-ins run under TRITON_INTERPRET=1 only")
    select = "mha/engine/partial_last_page"  # decode and extend
    kept = check_backend("fa4", select=select, raise_on_failure=False, **env.options())
    assert kept.skipped == 2 and "refuses pools of a partial last page" in str(kept)
    for module in (_decode, _extend):
        monkeypatch.setattr(module, "check_whole_pages", lambda *args, **kwargs: None)
    unchecked = check_backend("fa4", select=select, raise_on_failure=False, **env.options())
    assert [r.case.split("/")[0] for r in unchecked.failures] == ["extend"], str(unchecked)
    assert unchecked.passed == 1, str(unchecked)
