"""``tests/interpreter_patch_once.py``: under the interpreter, a launch patches the language
once, its helpers do not re-patch it, and what the kernel computes is unchanged."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from interpreter_patch_once import install  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton interpreter is off (a GPU machine)")


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _helper_loop_kernel(X, Out, N: tl.constexpr, REPS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    acc = tl.zeros([N], tl.float32)  # a helper of triton.language itself
    for _ in range(REPS):
        acc += _twice(x)
    tl.store(Out + offs, tl.sum(acc, 0) + acc)


def test_a_launch_patches_the_language_once_and_computes_the_same():
    from triton.runtime import interpreter

    assert install(), "Triton's interpreter changed: tests/interpreter_patch_once.py no " \
        "longer applies (the Triton tests run about twice as long)"
    wrapped = interpreter._patch_lang
    changed = []

    def counting(fn):
        scope = wrapped(fn)
        changed.append(bool(scope._changes))
        return scope

    interpreter._patch_lang = counting
    try:
        x = torch.randn(16)
        out = torch.full((16,), float("nan"))
        _helper_loop_kernel[(1,)](x, out, N=16, REPS=5)
    finally:
        interpreter._patch_lang = wrapped
    acc = x * 2.0 * 5
    torch.testing.assert_close(out, acc.sum() + acc)
    # One patch by the launch; the 5 + 2 helper calls (_twice, tl.zeros, tl.sum) change nothing.
    assert changed[0] and not any(changed[1:]) and len(changed) >= 7, changed
