"""The FlashAttention libraries' entry points: one varlen, paged call, whatever the library
(a *kernel* object per backend, resolved at construction).

``Kernel.__call__`` runs one varlen, paged attention call and returns the output and, when
asked, the natural-log LSE **token-major** ``[total_q, H_q]`` (both libraries return it
head-major ``(H_q, total_q)``; the transpose happens here, once).

- ``FA4Kernel``: ``flash_attn.cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=...,
  max_seqlen_q=..., seqused_k=..., page_table=..., softmax_scale=..., causal=...,
  softcap=..., return_lse=...)`` -> ``(out, lse)`` (flash-attn-4 4.0.0b36 interface).
- ``FA3Kernel``: ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=...,
  page_table=..., cu_seqlens_q=..., max_seqlen_q=..., softmax_scale=..., causal=...,
  softcap=..., return_softmax_lse=...)`` -> ``out`` or ``(out, lse, *rest)``, from
  ``flash_attn_interface`` (FlashAttention-3, hopper/ build) or ``mate`` (the MUSA port).

Arguments common to both: q ``[total_q, H_q, D]``; k/v ``[num_pages, page_size, H_kv, D]``
(views of the token pool); page_table int32 ``[batch, max_pages]`` (unit last stride);
seqused int32 ``[batch]`` (keys per sequence); cu_seqlens_q int32 ``[batch + 1]``.

Vendor modules are imported only in ``resolve_kernel`` (construction time), never at import.
"""

from __future__ import annotations

import importlib
import logging
from typing import Optional

import torch

from ...errors import BackendUnavailableError
from ...install import install_hint
from ...platforms import Platform, cuda_capability

log = logging.getLogger("specattn.backends.flash_attn")

__all__ = ["Kernel", "FA4Kernel", "FA3Kernel", "resolve_kernel", "FA3_INSTALL_HINT",
           "FA4_REQUIREMENT"]

FA4_REQUIREMENT = "flash-attn-4~=4.0.0b36"  # only pre-releases exist; the one run on the H200
FA3_INSTALL_HINT = ("install FlashAttention-3 ('flash_attn_interface', built from "
                    "flash-attention's hopper/ directory) or, on a Hopper GPU, "
                    f"FlashAttention-4 ({install_hint(FA4_REQUIREMENT)})")
_fallback_logged = False


class Kernel:
    """A library entry point. ``label`` names it in logs and ``describe``."""

    label = ""

    def __init__(self, module) -> None:
        self.module = module

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 page_table: torch.Tensor, seqused: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 max_seqlen_q: int, causal: bool, scale: float, softcap: float,
                 with_lse: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError


class FA4Kernel(Kernel):
    label = "flash_attn.cute.flash_attn_varlen_func"

    def __call__(self, q, k, v, *, page_table, seqused, cu_seqlens_q, max_seqlen_q, causal,
                 scale, softcap, with_lse):
        # cu_seqlens_k must stay None with a page table: key counts go in seqused_k.
        out, lse = self.module.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
            seqused_k=seqused, page_table=page_table, softmax_scale=scale, causal=causal,
            softcap=softcap, return_lse=with_lse)
        return out, (lse.t() if with_lse else None)


class FA3Kernel(Kernel):
    def __init__(self, module, label: str) -> None:
        super().__init__(module)
        self.label = label

    def __call__(self, q, k, v, *, page_table, seqused, cu_seqlens_q, max_seqlen_q, causal,
                 scale, softcap, with_lse):
        res = self.module.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=seqused, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q, softmax_scale=scale, causal=causal, softcap=softcap,
            return_softmax_lse=with_lse)
        if not with_lse:
            return (res[0] if isinstance(res, tuple) else res), None
        return res[0], res[1].t()


def _import(module: str, backend: str, hint: str):
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken build failing at import
        raise BackendUnavailableError(
            f"{backend}: importing '{module}' failed ({type(exc).__name__}: {exc}); {hint}",
            backend) from exc


def resolve_kernel(library: str, platform: Platform, backend: str) -> Kernel:
    """The kernel for ``library`` (``"fa4"``, ``"fa3"`` or ``"mate"``) on ``platform``.

    ``fa3``: FlashAttention-3 when installed; else, on a Hopper GPU with FlashAttention-4,
    FA4's sm90 kernel (logged once per process); else ``BackendUnavailableError``."""
    global _fallback_logged
    if library == "fa4":
        return FA4Kernel(_import("flash_attn.cute", backend, install_hint(FA4_REQUIREMENT)))
    if library == "mate":
        mod = _import("mate", backend, install_hint("mate"))
        return FA3Kernel(mod, "mate.flash_attn_with_kvcache")
    if platform.has_library("flash_attn_interface"):
        mod = _import("flash_attn_interface", backend, FA3_INSTALL_HINT)
        return FA3Kernel(mod, "flash_attn_interface.flash_attn_with_kvcache")
    if platform.has_library("flash_attn.cute") and cuda_capability(9)(platform):
        kernel = FA4Kernel(_import("flash_attn.cute", backend, FA3_INSTALL_HINT))
        if not _fallback_logged:
            _fallback_logged = True
            log.warning("fa3: FlashAttention-3 (flash_attn_interface) is not installed; "
                        "running FlashAttention-4's sm90 kernel (flash_attn.cute) instead")
        return kernel
    raise BackendUnavailableError(f"{backend}: no FlashAttention library here; "
                                  f"{FA3_INSTALL_HINT}", backend)

