"""Triton backend (``triton``): shared-prefix draft decode and draft extend, MHA and MLA.

Layout: ``backend.py`` (the registered classes; imports no Triton), ``launchers.py`` (plans,
grids, buffers), ``_attn_kernels.py`` (split-KV stage 1 and the KV write; tiles and merges
from ``specattn.kernels``), ``_metadata_kernels.py`` (device-side metadata). Triton itself is
imported only when a backend builds its metadata.
"""

from __future__ import annotations

from .backend import TritonDecode, TritonExtend

__all__ = ["TritonDecode", "TritonExtend"]
