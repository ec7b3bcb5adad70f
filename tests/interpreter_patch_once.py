"""Triton's CPU interpreter, without its repeated language patching (test suite speed only).

Triton's interpreter (3.9 and others) runs a launch by patching ``triton.language`` for the
whole grid (``_patch_lang``: every builtin of ``tl``, ``tl.tensor`` and ``tl.math``
rewrapped, found with ``inspect.getmembers``), then restores it. It also calls
``_patch_lang`` at every call of a ``@triton.jit`` helper from inside a kernel, although the
launch has already patched the same modules: about a millisecond per call, which in this
suite is a third to a half of a Triton test's time (helpers called per tile and per part).

``install()`` wraps the launch and ``_patch_lang``: a launch patches both language modules
a helper may name (``triton.language`` and ``triton.language.core``, whose own helpers such
as ``tl.zeros`` and ``tl.sum`` name the latter), and a call made inside it for a function
that sees no other language module returns an empty patch scope (nothing to change, nothing
to restore). What a kernel computes is unchanged: the helper runs on the launch's patched
language, as it would on its own re-patch of it. Where the interpreter's internals are not
as expected, ``install`` changes nothing. ``script_command`` runs a script the same way in
a subprocess.
"""

from __future__ import annotations

import inspect
import os
import sys
from types import SimpleNamespace

_KNOWN: dict[tuple[int, int], frozenset] = {}  # language modules per namespace and size


def _language_modules(fn, tl) -> frozenset:
    """The language modules ``_patch_lang(fn)`` patches: those ``fn``'s globals name."""
    key = (id(fn.__globals__), len(fn.__globals__))
    if key not in _KNOWN:
        _KNOWN[key] = frozenset(id(v) for v in fn.__globals__.values()
                                if v is tl or v is tl.core)
    return _KNOWN[key]


def script_command(path: str, *args: str) -> list[str]:
    """The command that runs the Python script ``path`` with ``args`` as ``python path args``
    does (its folder first on ``sys.path``), with ``install()`` done first: for tests that
    run a script under the interpreter in a subprocess."""
    code = ("import os, runpy, sys; sys.path.insert(0, {here!r}); "
            "import interpreter_patch_once as p; p.install(); sys.argv = sys.argv[1:]; "
            "sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0])); "
            "runpy.run_path(sys.argv[0], run_name='__main__')"
            ).format(here=os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, "-c", code, path, *args]


def install() -> bool:
    """Wrap the interpreter's launch and ``_patch_lang`` once; True when they are wrapped."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 - no Triton, or one that does not import here
        return False
    original = getattr(interpreter, "_patch_lang", None)
    grid = getattr(interpreter, "GridExecutor", None)
    if getattr(original, "_patched_once", False):
        return True
    if original is None or grid is None or not hasattr(interpreter, "_LangPatchScope") or \
            "_patch_lang(self.fn)" not in inspect.getsource(grid.__call__):
        return False
    scope_type = interpreter._LangPatchScope
    run_grid = grid.__call__
    both = SimpleNamespace(__globals__={"tl": tl, "core": tl.core})
    patched = _language_modules(both, tl)  # what every launch patches
    # Launches running, and whether the next _patch_lang call is a launch's own.
    state = {"launches": 0, "launch_patch": False}

    def patch_lang(fn):
        if state["launch_patch"]:  # a launch patches both modules its helpers may name
            state["launch_patch"] = False
            return original(both)
        if state["launches"] and _language_modules(fn, tl) <= patched:
            return scope_type()  # a helper inside a launch: its modules are patched
        return original(fn)

    def launch(self, *args, **kwargs):
        state["launches"] += 1
        state["launch_patch"] = True
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            state["launch_patch"] = False
            state["launches"] -= 1

    patch_lang._patched_once = True
    interpreter._patch_lang = patch_lang
    grid.__call__ = launch
    return True
