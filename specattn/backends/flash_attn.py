"""FlashAttention backends: ``fa3`` and ``fa4`` (one family; MUSA flavour on MUSA).

``fa3`` runs FlashAttention-3's ``flash_attn_interface`` when installed; on a Hopper GPU
without it, FlashAttention-4's sm90 kernel (``flash_attn.cute``), the same algorithm. Glue
lands with issue #6.
"""

from __future__ import annotations

from ..keys import BackendRequest
from ..platforms import Platform, cuda_capability, is_musa
from ._pending import PendingDecode, PendingExtend, pending_reason

_PENDING = pending_reason(6, "the FlashAttention glue")
_FA3_LIBS = ("flash_attn_interface", "flash_attn.cute")
_MUSA = (("mate", "mate"),)


def _fa3_library_reason(platform: Platform) -> str | None:
    if platform.has_library("flash_attn_interface"):
        return None
    if platform.has_library("flash_attn.cute") and cuda_capability(9)(platform):
        return None
    return ("needs FlashAttention-3 ('flash_attn_interface', built from flash-attention's "
            "hopper/ directory) or, on a Hopper GPU, FlashAttention-4 (pip install "
            "flash-attn-4)")


class _FA3Cuda:
    """Library rule shared by the fa3 CUDA flavours (FA3, or FA4's sm90 kernel)."""

    @classmethod
    def platform_reasons(cls, platform: Platform) -> list[str]:
        reasons = super().platform_reasons(platform)  # type: ignore[misc]
        lib = _fa3_library_reason(platform)
        return reasons + ([lib] if lib else [])

    @classmethod
    def runtime_note(cls, platform: Platform) -> str:
        if not platform.has_library("flash_attn_interface") and platform.has_library(
                "flash_attn.cute"):
            return "runs FlashAttention-4's sm90 kernel (FA3 not installed)"
        return ""


_SM8X = cuda_capability(8)
_SM90 = cuda_capability(9, minors=(0,))
_SM9X_10X = cuda_capability(9, 10)


class FA3DecodeSM8x(_FA3Cuda, PendingDecode, name="fa3", flavour="sm8x", platforms=_SM8X,
                    models=("mha",), kernel_library="flash-attn 3", priority={"cuda": 72}):
    pending = _PENDING


class FA3DecodeSM90(_FA3Cuda, PendingDecode, name="fa3", flavour="sm90", platforms=_SM90,
                    kernel_library="flash-attn 3 (or 4 on sm90)", priority={"cuda": 72}):
    pending = _PENDING


class FA3DecodeMUSA(PendingDecode, name="fa3", flavour="musa", platforms=is_musa,
                    requires=_MUSA, kernel_library="mate (MUSA flash-attn)",
                    priority={"musa": 70}):
    pending = _PENDING


class FA4Decode(PendingDecode, name="fa4", flavour="cuda", platforms=_SM9X_10X,
                requires=(("flash_attn.cute", "flash-attn-4"),), kernel_library="flash-attn 4",
                priority={"cuda": 75}):
    pending = _PENDING


class FA4DecodeMUSA(PendingDecode, name="fa4", flavour="musa", platforms=is_musa,
                    requires=_MUSA, kernel_library="mate (MUSA flash-attn)",
                    priority={"musa": 65}):
    pending = _PENDING


class FA3ExtendSM8x(_FA3Cuda, PendingExtend, name="fa3", flavour="sm8x", platforms=_SM8X,
                    models=("mha",), kernel_library="flash-attn 3", priority={"cuda": 72}):
    pending = _PENDING


class FA3ExtendSM90(_FA3Cuda, PendingExtend, name="fa3", flavour="sm90", platforms=_SM90,
                    kernel_library="flash-attn 3 (or 4 on sm90)", priority={"cuda": 72}):
    pending = _PENDING


class FA3ExtendMUSA(PendingExtend, name="fa3", flavour="musa", platforms=is_musa,
                    requires=_MUSA, kernel_library="mate (MUSA flash-attn)",
                    priority={"musa": 70}):
    pending = _PENDING


class FA4Extend(PendingExtend, name="fa4", flavour="cuda", platforms=_SM9X_10X,
                requires=(("flash_attn.cute", "flash-attn-4"),), kernel_library="flash-attn 4",
                priority={"cuda": 75}):
    pending = _PENDING


class FA4ExtendMUSA(PendingExtend, name="fa4", flavour="musa", platforms=is_musa,
                    requires=_MUSA, kernel_library="mate (MUSA flash-attn)",
                    priority={"musa": 65}):
    pending = _PENDING


__all__ = ["BackendRequest"]
