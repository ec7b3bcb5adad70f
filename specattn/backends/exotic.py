"""Rows for model-specific or vendor-specific hardware: ``dsa`` (alias ``nsa``),
``dsv4``, ``tokenspeed_mla``, ``aiter``, ``ascend``. Their kernels and glue land with
issue #7; until then they are declared (selection, listing, errors) and raise from their
constructors.
"""

from __future__ import annotations

from ..platforms import cuda_capability, has_library, is_cuda, is_hip, is_npu
from ._pending import PendingDecode, PendingExtend, pending_reason

_PENDING = pending_reason(7, "these kernels")
_TRITON = (("triton", "triton"),)
_NPU = (("torch_npu", "torch-npu"),)


def _pair(name: str, doc: str, **decl):
    """Declare the decode and extend classes of one row (identical declarations)."""
    attrs = {"pending": _PENDING, "__doc__": doc, "__module__": __name__,
             **decl.pop("attrs", {})}
    suffix = "".join(p.capitalize() for p in (name + "_" + decl.get("flavour", "")).split("_"))
    dec = type(f"{suffix}Decode", (PendingDecode,), dict(attrs), name=name, **decl)
    ext = type(f"{suffix}Extend", (PendingExtend,), dict(attrs), name=name, **decl)
    return dec, ext


DSADecode, DSAExtend = _pair(
    "dsa", "DeepSeek V3.2 sparse attention: lightning indexer top-2048, then sparse MLA.",
    deprecated_aliases=("nsa",), platforms=is_cuda | is_hip, models=("mla",),
    requires=_TRITON, kernel_library="triton (specattn)",
    attrs={"auto_eligible": False, "page_sizes": frozenset({1, 64})})
DSV4CudaDecode, DSV4CudaExtend = _pair(
    "dsv4", "DeepSeek V4 draft attention (sliding window 128, sink), CUDA flavour.",
    flavour="cuda", platforms=is_cuda, requires=_TRITON, kernel_library="triton (specattn)",
    attrs={"auto_eligible": False})
DSV4HipDecode, DSV4HipExtend = _pair(
    "dsv4", "DeepSeek V4 draft attention, HIP flavour (same Triton kernels).",
    flavour="hip", platforms=is_hip, requires=_TRITON, kernel_library="triton (specattn)",
    attrs={"auto_eligible": False})
DSV4NpuDecode, DSV4NpuExtend = _pair(
    "dsv4", "DeepSeek V4 draft attention, Ascend flavour (torch_npu).",
    flavour="npu", platforms=is_npu, requires=_NPU, kernel_library="torch_npu",
    attrs={"auto_eligible": False})
TokenspeedMLADecode, TokenspeedMLAExtend = _pair(
    "tokenspeed_mla", "Dense paged MLA through the tokenspeed-mla CuTe-DSL kernels.",
    platforms=cuda_capability(10), models=("mla",), mla_required_name="tokenspeed_mla",
    requires=(("tokenspeed_mla", "tokenspeed-mla"),), kernel_library="tokenspeed-mla",
    priority={"cuda": 60}, attrs={"page_sizes": frozenset({32, 64})})
AiterDecode, AiterExtend = _pair(
    "aiter", "ROCm attention through AMD's aiter kernels.", platforms=is_hip,
    requires=(("aiter", "aiter"),), kernel_library="aiter", priority={"hip": 70})
AscendDecode, AscendExtend = _pair(
    "ascend", "Ascend NPU attention through torch_npu's fused attention ops.",
    platforms=is_npu, requires=_NPU, kernel_library="torch_npu", priority={"npu": 70})

__all__ = ["has_library"]
