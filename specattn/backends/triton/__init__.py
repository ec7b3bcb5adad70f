"""Triton backend (``triton``): shared-prefix draft decode and draft extend, MHA and MLA.

Layout: ``backend.py`` (the registered classes; imports no Triton), ``plans.py`` (which
kernel runs a call, and its tiles: the plan table), ``launchers.py`` (split counts, buffers,
grids, the launch of each plan's kernel), ``_attn_kernels.py`` (the ``tl.dot`` kernels and the
KV write), ``_metadata_kernels.py`` (device-side metadata), ``gluon_mla.py`` /
``_gluon_mla_kernel.py`` / ``_gluon_mla_wl_kernel.py`` / ``worklist.py`` (the sm90 Gluon MLA
kernels and their work list), ``cute_mla.py`` / ``_cute_mla_kernel.py`` (the sm90 CuTe-DSL
MLA kernel). Triton itself is imported only when a backend builds its metadata.
"""

from __future__ import annotations

from .backend import TritonDecode, TritonExtend

__all__ = ["TritonDecode", "TritonExtend"]
