"""``dsv4`` (DeepSeek V4 draft attention: 128-token sliding window, single KV head of 512,
keys equal to values, per-head attention sink). Flavours by platform (rule 10): NPU
(torch_npu), HIP (the Triton kernels), otherwise CUDA (the Triton kernels). Kernels land
with issue #7.
"""

from __future__ import annotations

from ..platforms import is_cuda, is_hip, is_npu
from ._pending import pending_pair, pending_reason

_PENDING = pending_reason(7, "the DeepSeek V4 kernels")
_TRITON = (("triton", "triton"),)

DSV4CudaDecode, DSV4CudaExtend = pending_pair(
    __name__, "dsv4", "DeepSeek V4 draft attention, CUDA flavour (Triton).", _PENDING,
    flavour="cuda", platforms=is_cuda, requires=_TRITON, kernel_library="triton (specattn)",
    attrs={"auto_eligible": False})
DSV4HipDecode, DSV4HipExtend = pending_pair(
    __name__, "dsv4", "DeepSeek V4 draft attention, HIP flavour (the same Triton kernels).",
    _PENDING, flavour="hip", platforms=is_hip, requires=_TRITON,
    kernel_library="triton (specattn)", attrs={"auto_eligible": False})
