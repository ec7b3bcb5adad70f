"""Triton backend (``triton``): shared-prefix draft decode and draft extend, MHA and MLA.

Modules: ``backend`` (the registered classes; imports no Triton), ``launchers`` (plans,
grids, buffers), ``_attn_kernels`` (split-KV attention + LSE merge), ``_metadata_kernels``
(device-side metadata). Triton itself is imported only when a backend builds its metadata.
"""

from __future__ import annotations

from .backend import TritonDecode, TritonExtend

__all__ = ["TritonDecode", "TritonExtend"]
