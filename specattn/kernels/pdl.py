"""Programmatic dependent launch (PDL, sm90+): inside kernels, ``wait_for_primary`` blocks until
the launch before this one has ended and its writes are visible, ``launch_dependents`` lets
the launch after this one start once every program of this one has called it (or ended).
Both are no-ops in a kernel that was not launched that way (``launch_pdl=True``); kernels call
them under a ``PDL`` constexpr only, never under the interpreter. Triton's own are
builtins that Gluon kernels call too (the sm90 MLA kernels).
"""

from __future__ import annotations

try:
    from triton.language.extra.cuda import gdc_launch_dependents as launch_dependents
    from triton.language.extra.cuda import gdc_wait as wait_for_primary
except ImportError:  # a Triton without them: the same PTX
    import triton
    import triton.language as tl

    @triton.jit
    def wait_for_primary():
        tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def launch_dependents():
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)

__all__ = ["launch_args", "launch_dependents", "wait_for_primary"]


def launch_args(pdl: bool, dependent: bool = False) -> dict:
    """A launch's ``PDL`` constexpr (the kernel waits for the launch before it, or releases
    the one after) and, when ``dependent``, ``launch_pdl``: a programmatic dependent launch
    (sm90+). Empty when off: the kernels' default, the launch as without the option."""
    if not pdl:
        return {}
    return dict(PDL=True, launch_pdl=True) if dependent else dict(PDL=True)
