"""TRT-LLM-gen backends from FlashInfer (Blackwell): ``trtllm_mha``, ``trtllm_mla``,
``cutedsl_mla``.

``cutedsl_mla`` decodes with the CuTe-DSL MLA kernel; its draft extend is the ``trtllm_mla``
extend class (the CuTe-DSL kernel is decode-only), declared here as an alias. Both MLA names
report a non-MLA model as ``trtllm_mla``, as the original factory does. Glue lands with
issue #5; none of it can run on a Hopper GPU.
"""

from __future__ import annotations

from ..platforms import cuda_capability
from ._pending import PendingDecode, PendingExtend, pending_reason

_SM10X = cuda_capability(10)
_REQUIRES = (("flashinfer", "flashinfer-python"),)
_PENDING = pending_reason(5, "the TRT-LLM-gen glue")
_PRIORITY = {"cuda": 85}


class TRTLLMMHADecode(PendingDecode, name="trtllm_mha", platforms=_SM10X, models=("mha",),
                      requires=_REQUIRES, kernel_library="flashinfer (trtllm-gen)",
                      priority=_PRIORITY):
    page_sizes = frozenset({16, 32, 64})
    pending = _PENDING


class TRTLLMMHAExtend(PendingExtend, name="trtllm_mha", platforms=_SM10X, models=("mha",),
                      requires=_REQUIRES, kernel_library="flashinfer (trtllm-gen)",
                      priority=_PRIORITY):
    page_sizes = frozenset({16, 32, 64})
    pending = _PENDING


class TRTLLMMLADecode(PendingDecode, name="trtllm_mla", platforms=_SM10X, models=("mla",),
                      mla_required_name="trtllm_mla", requires=_REQUIRES,
                      kernel_library="flashinfer (trtllm-gen)", priority=_PRIORITY):
    page_sizes = frozenset({32, 64})
    pending = _PENDING


class CuteDSLMLADecode(PendingDecode, name="cutedsl_mla", platforms=_SM10X, models=("mla",),
                       mla_required_name="trtllm_mla", requires=_REQUIRES,
                       kernel_library="flashinfer (CuTe-DSL)", priority={"cuda": 84}):
    page_sizes = frozenset({32, 64})
    pending = _PENDING


class TRTLLMMLAExtend(PendingExtend, name="trtllm_mla", aliases=("cutedsl_mla",),
                      platforms=_SM10X, models=("mla",), mla_required_name="trtllm_mla",
                      requires=_REQUIRES, kernel_library="flashinfer (trtllm-gen)",
                      priority=_PRIORITY):
    """Draft extend for ``trtllm_mla`` and, by alias, ``cutedsl_mla``."""

    page_sizes = frozenset({32, 64})
    pending = _PENDING
