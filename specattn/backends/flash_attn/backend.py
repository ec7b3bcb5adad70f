"""The registered ``flash_attn`` classes (declarations and capabilities); the package doc
says what they compute."""


from __future__ import annotations

from typing import Optional

import torch

from ...fp8 import FP8_KV_DTYPES
from ...keys import BackendRequest
from ...platforms import Platform, cuda_capability, is_musa
from ._decode import MODES, FlashAttnDecodeGlue
from ._extend import FlashAttnExtendGlue
from ._library import FA3_INSTALL_HINT, FA4_REQUIREMENT

__all__ = ["FA3DecodeSM8x", "FA3DecodeSM90", "FA3DecodeMUSA", "FA4Decode", "FA4DecodeMUSA",
           "FA3ExtendSM8x", "FA3ExtendSM90", "FA3ExtendMUSA", "FA4Extend", "FA4ExtendMUSA",
           "MODES"]

_MUSA = (("mate", "mate"),)
_FA4_REQ = (("flash_attn.cute", FA4_REQUIREMENT),)
_TESTED = "not run on hardware (FA3 library path)"
_TESTED_FA4 = "H200 (sm90, FA4 4.0.0b36): GPU tests incl. CUDA-graph replay"
_TESTED_FA3_VIA_FA4 = "H200 through FA4's sm90 kernel; FA3 library path untested"
_TESTED_MUSA = "not run on hardware (MUSA port untested)"
_MHA = ("mha",)
# Why each library's FP8 K/V path cannot serve a bf16/fp16 query over an FP8 pool (read in
# flash_attn_4 4.0.0b36, flash_attn/cute/interface.py: _flash_attn_fwd asserts "FP8 is only
# supported on SM100" and "q, k, v, and qv must have the same dtype"; flash_attn_varlen_func
# has no descale arguments).
_FP8_REFUSALS = {
    "fa4": "FlashAttention-4 (flash_attn.cute 4.0.0b36) runs FP8 K/V only on SM100, only with "
           "the query in the same FP8 dtype, and its varlen API takes no descales",
    "fa3": "FlashAttention-3's FP8 kernel wants q, k and v in one FP8 dtype (e4m3, with "
           "descales): the bf16/fp16 query would be quantized to e4m3; FA4's sm90 kernel "
           "(fa3's stand-in on Hopper) takes no FP8 K/V",
    "mate": "the MUSA port's FP8 path (the FA3-style API, query in the K/V dtype) is not "
            "wired",
}


def _fa3_library_reason(platform: Platform) -> str | None:
    if platform.has_library("flash_attn_interface"):
        return None
    if platform.has_library("flash_attn.cute") and cuda_capability(9)(platform):
        return None
    return "needs a FlashAttention library: " + FA3_INSTALL_HINT


class _Caps:
    """Capabilities shared by every class of the family."""

    dtypes = (torch.bfloat16, torch.float16)
    supports_cuda_graph = False  # protocol implemented; set after the H200 capture test
    tested_on = _TESTED

    @classmethod
    def check_request(cls, request: BackendRequest, platform: Platform) -> Optional[str]:
        """FP8 pools are refused with the library's reason (``_FP8_REFUSALS``)."""
        if request.kv_cache_dtype in FP8_KV_DTYPES:
            return _FP8_REFUSALS[cls.library]
        return None


class _FA3Cuda(_Caps):
    """Library rule shared by the fa3 CUDA flavours (FA3, or FA4's sm90 kernel)."""

    library = "fa3"

    @classmethod
    def platform_reasons(cls, platform: Platform) -> list[str]:
        reasons = super().platform_reasons(platform)  # type: ignore[misc]
        lib = _fa3_library_reason(platform)
        return reasons + ([lib] if lib else [])

    @classmethod
    def runtime_note(cls, platform: Platform, request=None) -> str:
        if not platform.has_library("flash_attn_interface") and platform.has_library(
                "flash_attn.cute"):
            return "runs FlashAttention-4's sm90 kernel (FA3 not installed)"
        return "FA3 path untested on hardware"


class _Mate(_Caps):
    library = "mate"
    tested_on = _TESTED_MUSA


class _FA4(_Caps):
    library = "fa4"
    supports_cuda_graph = True
    tested_on = _TESTED_FA4


_SM8X = cuda_capability(8)
_SM90 = cuda_capability(9, minors=(0,))
_SM9X_10X = cuda_capability(9, 10)


class FA3DecodeSM8x(_FA3Cuda, FlashAttnDecodeGlue, name="fa3", flavour="sm8x",
                    platforms=_SM8X, models=_MHA, kernel_library="flash-attn 3",
                    priority={"cuda": 72}):
    """fa3 draft decode on Ampere/Ada (FlashAttention-3 only). FA3 path untested on hardware.

    q: ``[B*K, H_q, D]``, k: ``[B*K, H_kv, D]``, v: ``[B*K, H_kv, D_v]`` → ``[B*K, H_q, D_v]``.
    """


class FA3DecodeSM90(_FA3Cuda, FlashAttnDecodeGlue, name="fa3", flavour="sm90",
                    platforms=_SM90, models=_MHA, kernel_library="flash-attn 3 (or 4 on sm90)",
                    priority={"cuda": 72}):
    """fa3 draft decode on Hopper: FlashAttention-3, or FA4's sm90 kernel when FA3 is absent.
    FA3 path untested on hardware. Shapes as ``FA3DecodeSM8x``."""

    tested_on = _TESTED_FA3_VIA_FA4


class FA3DecodeMUSA(_Mate, FlashAttnDecodeGlue, name="fa3", flavour="musa", platforms=is_musa,
                    models=_MHA, requires=_MUSA, kernel_library="mate (MUSA flash-attn)",
                    priority={"musa": 70}):
    """fa3 draft decode on MUSA through ``mate.flash_attn_with_kvcache``. Untested on
    hardware."""


class FA4Decode(_FA4, FlashAttnDecodeGlue, name="fa4", flavour="cuda", platforms=_SM9X_10X,
                models=_MHA, requires=_FA4_REQ, kernel_library="flash-attn 4",
                priority={"cuda": 75}):
    """fa4 draft decode (FlashAttention-4 varlen with a page table). Glue tested through a
    stand-in on the CPU; GPU tests against torch_ref on the H200 (2026-11-29).

    q: ``[B*K, H_q, D]``, k: ``[B*K, H_kv, D]``, v: ``[B*K, H_kv, D_v]`` → ``[B*K, H_q, D_v]``.
    """


class FA4DecodeMUSA(_Mate, FlashAttnDecodeGlue, name="fa4", flavour="musa", platforms=is_musa,
                    models=_MHA, requires=_MUSA, kernel_library="mate (MUSA flash-attn)",
                    priority={"musa": 65}):
    """fa4 draft decode on MUSA (the FA3-style ``mate`` API). Untested on hardware."""


class FA3ExtendSM8x(_FA3Cuda, FlashAttnExtendGlue, name="fa3", flavour="sm8x",
                    platforms=_SM8X, models=_MHA, kernel_library="flash-attn 3",
                    priority={"cuda": 72}):
    """fa3 draft extend on Ampere/Ada. FA3 path untested on hardware.

    q: ``[T, H_q, D]``, k: ``[T, H_kv, D]``, v: ``[T, H_kv, D_v]`` → ``[T, H_q, D_v]``."""


class FA3ExtendSM90(_FA3Cuda, FlashAttnExtendGlue, name="fa3", flavour="sm90",
                    platforms=_SM90, models=_MHA, kernel_library="flash-attn 3 (or 4 on sm90)",
                    priority={"cuda": 72}):
    """fa3 draft extend on Hopper (FA3, or FA4's sm90 kernel). FA3 path untested on
    hardware."""

    tested_on = _TESTED_FA3_VIA_FA4


class FA3ExtendMUSA(_Mate, FlashAttnExtendGlue, name="fa3", flavour="musa", platforms=is_musa,
                    models=_MHA, requires=_MUSA, kernel_library="mate (MUSA flash-attn)",
                    priority={"musa": 70}):
    """fa3 draft extend on MUSA (``mate``). Untested on hardware."""


class FA4Extend(_FA4, FlashAttnExtendGlue, name="fa4", flavour="cuda", platforms=_SM9X_10X,
                models=_MHA, requires=_FA4_REQ, kernel_library="flash-attn 4",
                priority={"cuda": 75}):
    """fa4 draft extend: one causal varlen pass over the page table.

    q: ``[T, H_q, D]``, k: ``[T, H_kv, D]``, v: ``[T, H_kv, D_v]`` → ``[T, H_q, D_v]``."""


class FA4ExtendMUSA(_Mate, FlashAttnExtendGlue, name="fa4", flavour="musa", platforms=is_musa,
                    models=_MHA, requires=_MUSA, kernel_library="mate (MUSA flash-attn)",
                    priority={"musa": 65}):
    """fa4 draft extend on MUSA (``mate``). Untested on hardware."""
