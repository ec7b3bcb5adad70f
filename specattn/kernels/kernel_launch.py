"""``KernelLaunch``: one Triton kernel launched again and again with the same grid, the same
trailing arguments and the same constexprs, only its leading tensor arguments new.

``kernel[grid](*args, **constexprs)`` (``JITFunction.run``) binds every argument, computes
each one's specialization and the cache key and looks the compiled kernel up on every call:
tens of microseconds of host time per launch on the H200's host (Triton 3.6). A graph
round's metadata launch repeats one call whose only new arguments are the caller's index
tensors, so a ``KernelLaunch`` keeps the compiled kernel the first call returns and launches
it directly afterwards (``CompiledKernel.run``, the call ``JITFunction.run`` ends with).

That is exact only while everything the compiled kernel was specialized for is unchanged.
Whoever keeps a ``KernelLaunch`` reuses it only for calls whose leading tensors have the
dtypes, devices, shapes and strides of its first call (the backends key it by them:
``specattn.graph_calls.signature``), and the kernels declare those tensors
``do_not_specialize_on_alignment``, so their data pointers may move. The trailing arguments
and constexprs are the ones it was made with. Its trailing tensors go to the direct launch
as their addresses (the ``KernelLaunch`` holds the tensors): Triton's launcher asks the
driver about every tensor's pointer (``cuPointerGetAttribute``, a driver call each), which
the first, ordinary launch did for them already.

The ordinary launch is used instead where there is no compiled kernel (the CPU
interpreter: ``TRITON_INTERPRET=1``), where a launch hook is installed (profilers read
launch metadata), where the current device is not the one the kernel was loaded on, and with
a Triton whose compiled kernels take another argument list (``_direct``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

try:  # releases without triton.knobs keep the ordinary launch
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - depends on the installed Triton
    _knobs = None


class KernelLaunch:
    """``kernel[grid](*head, *tail, **consts)`` for any ``head`` of the first call's kind.

    ``grid``: up to 3 ints; ``tail``: the fixed non-constexpr arguments after ``head``;
    ``consts``: constexprs (by name) and launch options (``num_warps``...). The kernel's
    constexpr parameters must all come after its other parameters."""

    __slots__ = ("kernel", "grid", "tail", "consts", "_grid3", "_direct_tail", "_compiled",
                 "_device", "_current_device", "_current_stream")

    def __init__(self, kernel: Any, grid: tuple, tail: tuple, consts: dict) -> None:
        self.kernel, self.grid, self.tail, self.consts = kernel, tuple(grid), tail, consts
        self._grid3 = (tuple(grid) + (1, 1))[:3]
        self._compiled = None

    def __call__(self, *head: Any) -> None:
        compiled = self._compiled
        if compiled is not None and self._current_device() == self._device and _hooks_idle():
            g0, g1, g2 = self._grid3
            compiled.run(g0, g1, g2, self._current_stream(self._device), compiled.function,
                         compiled.packed_metadata, None, None, None, *head, *self._direct_tail)
            return
        compiled = self.kernel[self.grid](*head, *self.tail, **self.consts)
        if self._compiled is None:
            self._keep(compiled, len(head))

    @property
    def direct(self) -> bool:
        """Whether the next calls launch the compiled kernel directly."""
        return self._compiled is not None

    def _keep(self, compiled: Any, n_head: int) -> None:
        """Keep ``compiled`` (what the ordinary launch returned) when it can be launched
        directly: a CUDA/HIP compiled kernel of a Triton whose ``JITFunction.run`` passes it
        every bound argument, constexprs included, in parameter order."""
        tail = _direct(self.kernel, compiled, n_head + len(self.tail), self.tail, self.consts)
        if tail is None:
            return
        self._current_device, self._current_stream = _driver_functions()
        self._device = self._current_device()
        self._direct_tail = tail
        self._compiled = compiled


def _direct(kernel: Any, compiled: Any, n_args: int, tail: tuple,
            consts: dict) -> Optional[tuple]:
    """The arguments after ``head`` that ``compiled.run`` takes (``tail`` and the
    constexprs' values), or ``None`` where the direct launch does not apply."""
    if _knobs is None or compiled is None or not all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "src")):
        return None
    params = getattr(kernel, "params", None)
    signature = getattr(compiled.src, "signature", None)
    if params is None or not isinstance(signature, dict) or len(signature) != len(params):
        return None  # a Triton whose launcher takes the non-constexpr arguments only
    names = [p.name for p in params]
    if any(p.is_constexpr for p in params[:n_args]) or not all(
            p.is_constexpr and p.name in consts for p in params[n_args:]):
        return None
    if compiled.function is None:
        return None
    return _addresses(tail) + tuple(consts[name] for name in names[n_args:])


def _addresses(args: tuple) -> tuple:
    """``args`` with each tensor replaced by its data pointer."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def _driver_functions():
    """Triton's ``(current device, current stream of a device)`` functions (its launch's)."""
    from triton.runtime.driver import driver

    active = driver.active
    return active.get_current_device, active.get_current_stream


def _hooks_idle() -> bool:
    """No launch hook is installed (Triton's are chains of hooks, or ``None``)."""
    runtime = _knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and \
        (leave is None or not getattr(leave, "calls", True))
