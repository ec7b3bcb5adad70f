"""Triton backend (``triton``): shared-prefix draft decode and draft extend, MHA and MLA.

``backend`` (the registered classes; imports no Triton), ``plans`` (the plan table),
``launchers`` (splits, buffers, launches; a metadata launch is a
``specattn.kernels.kernel_launch.KernelLaunch``), ``_attn_kernels`` / ``_metadata_kernels``
(the ``tl.dot`` kernels, the KV write, device-side metadata), ``gluon_mla`` + ``worklist`` and
``cute_mla`` (the sm90 MLA kernels, in ``_gluon_mla*_kernel`` and ``_cute_mla_kernel``).
"""

from __future__ import annotations

from .backend import TritonDecode, TritonExtend

__all__ = ["TritonDecode", "TritonExtend"]
