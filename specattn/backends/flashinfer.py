"""FlashInfer backends (``flashinfer``, MHA and MLA flavours).

Kernels: FlashInfer 0.7.x paged decode/prefill/cascade wrappers and
``BatchMLAPagedAttentionWrapper`` (glue lands with issue #5). Mind the base-2 LSE.
"""

from __future__ import annotations

from ..platforms import has_library, is_cuda
from ._pending import PendingDecode, PendingExtend, pending_reason

_REQUIRES = (("flashinfer", "flashinfer-python"),)
_PENDING = pending_reason(5, "the FlashInfer kernels")
_PRIORITY = {"cuda": 70}


class FlashInferDecode(PendingDecode, name="flashinfer", flavour="mha", platforms=is_cuda,
                       models=("mha",), requires=_REQUIRES, kernel_library="flashinfer",
                       priority=_PRIORITY):
    """Shared-prefix draft decode for MHA/GQA through FlashInfer (issue #5)."""

    pending = _PENDING


class FlashInferMLADecode(PendingDecode, name="flashinfer", flavour="mla", platforms=is_cuda,
                          models=("mla",), requires=_REQUIRES, kernel_library="flashinfer",
                          priority=_PRIORITY):
    """MLA draft decode through ``BatchMLAPagedAttentionWrapper`` (issue #5)."""

    pending = _PENDING


class FlashInferExtend(PendingExtend, name="flashinfer", flavour="mha", platforms=is_cuda,
                       models=("mha",), requires=_REQUIRES, kernel_library="flashinfer",
                       priority=_PRIORITY):
    """Draft extend through the paged prefill wrapper (issue #5)."""

    pending = _PENDING


class FlashInferMLAExtend(PendingExtend, name="flashinfer", flavour="mla", platforms=is_cuda,
                          models=("mla",), requires=_REQUIRES, kernel_library="flashinfer",
                          priority=_PRIORITY):
    """MLA draft extend through ``BatchMLAPagedAttentionWrapper`` (issue #5)."""

    pending = _PENDING
