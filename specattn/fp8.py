"""FP8 KV pools with one scale per tensor: ``kv_cache_dtype="fp8_e4m3"`` / ``"fp8_e5m2"``.

A pool holds codes of ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (or a ``uint8`` view of
the same bytes, as SGLang stores them) in the shapes of a bf16 pool. A layer's ``k_scale`` and
``v_scale`` (``AttentionLayer``) say what a code means: a stored key is ``code * k_scale``, a
stored value ``code * v_scale``; an MLA latent pool uses ``k_scale`` for all of its columns.

- ``quantize(x, scale, dtype)``: the codes a write stores, ``(x.float() / scale).to(dtype)``.
  That is the expression, so its bits are torch's on the device it runs on: on the CPU an
  fp32 division; on CUDA torch 2.11 divides by a Python float as a multiplication by
  ``float32(1.0 / scale)`` (the reciprocal computed in double on the host), by a tensor as
  an fp32 division; their codes differ on a few values. A kernel that stores codes itself
  must reproduce the device's expression to match (``specattn.kernels.fp8_codes``: the
  triton backend's KV write on CUDA asks the device torch which it is).
- ``dequantize(codes, scale)``: ``codes.float() * scale`` (float32 unless asked otherwise);
  ``dequantize_into(out, codes, scale)`` the same values written into ``out`` (an
  activation-dtype tensor of the codes' shape) without a float32 copy.
- ``read_rows(pool, index)`` / ``write_rows(pool, index, codes)``: ``pool[index]`` and
  ``pool[index] = codes`` through the pool's bytes (a ``uint8`` view of the same memory), and
  ``zeros(shape, dtype, device)`` a zeroed pool allocated as bytes, so no float8 indexing or
  fill kernel of the device is relied on.
- ``scale_tensor(scale, device)``: the scale as a one-element float32 tensor for kernels
  that read it from memory. A Python float gets one cached tensor per value and device, so a
  forward allocates nothing for it; a tensor that already is one is returned as is.
- ``host_value(scale)``: a Python float as is, ``None`` for a tensor (whose value lives on
  the device: reading it would sync, and a captured graph would keep the old value).
- ``check_scale(name, scale)``: a Python float must be finite and > 0; a tensor must have
  one element of a floating dtype, and its value is checked only where that needs no sync
  (a CPU tensor, or ``SPECATTN_DEBUG_CHECKS=1``).
- ``layer_scales(layer, mla)``: the scales of a layer's keys and values (MLA: ``k_scale``
  twice). ``scale_rows(x, scale)``: ``x * scale`` in ``x``'s dtype, computed in float32 and
  nothing done for a float 1. Scores are linear in the key and the output in the values, so
  a kernel that reads codes gives the attention of the dequantized pool with the query
  scaled by ``k_scale`` and its output by ``v_scale``: device ops on a few rows, safe under
  graph replay, where a library takes no scale from memory. ``library_scales(layer, q,
  mla)`` splits a call that way: Python floats go to the library as its scale arguments,
  device tensors are folded into the query and the output.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch

from ._tensor_checks import debug_checks_enabled
from .errors import InvalidInputError

__all__ = ["FP8_KV_DTYPES", "KV_DTYPES_WITH_FP8", "Scale", "pool_dtype", "is_fp8_dtype",
           "quantize", "dequantize", "dequantize_into", "scale_tensor", "host_value",
           "check_scale", "layer_scales", "scale_rows", "LibraryScales", "library_scales",
           "read_rows", "write_rows", "zeros"]

# kv_cache_dtype name -> the pool's torch dtype.
FP8_KV_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn,
                                         "fp8_e5m2": torch.float8_e5m2}
# The ``kv_cache_dtypes`` declaration of a backend that serves both FP8 pools.
KV_DTYPES_WITH_FP8 = ("auto", *FP8_KV_DTYPES)
Scale = Union[float, torch.Tensor]
_EXPECTED = "a finite float > 0 or a one-element floating tensor"
_CACHE: dict[tuple[float, torch.device], torch.Tensor] = {}


def pool_dtype(kv_cache_dtype: str) -> Optional[torch.dtype]:
    """The FP8 dtype ``kv_cache_dtype`` names, ``None`` for any other name."""
    return FP8_KV_DTYPES.get(kv_cache_dtype)


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES.values()


def quantize(x: torch.Tensor, scale: Scale, dtype: torch.dtype) -> torch.Tensor:
    """The codes of ``x`` for a pool of ``dtype`` (module doc)."""
    return (x.float() / scale).to(dtype)


def dequantize(codes: torch.Tensor, scale: Scale,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes`` (an FP8 tensor) as values ``codes * scale`` in ``out_dtype`` (computed in
    float32, or float64 when ``out_dtype`` is float64)."""
    values = codes.float()  # exact; the widest conversion every device has from FP8
    if out_dtype == torch.float64:
        values = values.double()
    return (values * scale).to(out_dtype)


def dequantize_into(out: torch.Tensor, codes: torch.Tensor, scale: Scale) -> torch.Tensor:
    """``out[...] = codes * scale`` in ``out``'s dtype; returns ``out``.

    Two element-wise passes over ``out``: the conversion (exact: every FP8 code is a
    bfloat16, float16 and float32 value), then the scale in place (float32 arithmetic, one
    rounding), so the values are ``dequantize(codes, scale, out.dtype)``'s."""
    out.copy_(codes)
    if isinstance(scale, torch.Tensor) or float(scale) != 1.0:
        out.mul_(scale)
    return out


def zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed tensor of ``shape``; one-byte dtypes are allocated as bytes and viewed."""
    if torch.empty((), dtype=dtype).element_size() == 1 and dtype != torch.uint8:
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def read_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``pool[index]`` of a one-byte pool, indexed as bytes (module doc)."""
    return pool.view(torch.uint8)[index].view(pool.dtype)


def write_rows(pool: torch.Tensor, index: torch.Tensor, codes: torch.Tensor) -> None:
    """``pool[index] = codes`` (``codes`` of the pool's dtype), written as bytes."""
    pool.view(torch.uint8)[index] = codes.view(torch.uint8)


def scale_tensor(scale: Scale, device: Union[torch.device, str]) -> torch.Tensor:
    """``scale`` as a contiguous one-element float32 tensor on ``device`` (module doc)."""
    device = torch.device(device)
    if isinstance(scale, torch.Tensor):
        if (scale.dtype == torch.float32 and scale.numel() == 1 and scale.is_contiguous()
                and scale.device.type == device.type
                and (device.index is None or scale.device.index == device.index)):
            return scale.reshape(1)
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    key = (float(scale), device)
    cached = _CACHE.get(key)
    if cached is None:
        cached = _CACHE[key] = torch.tensor([float(scale)], dtype=torch.float32, device=device)
    return cached


def host_value(scale: Scale) -> Optional[float]:
    """A Python-number scale as a float; ``None`` for a tensor (module doc)."""
    return None if isinstance(scale, torch.Tensor) else float(scale)


def check_scale(name: str, scale: object) -> None:
    """A valid ``k_scale`` / ``v_scale`` (module doc); raises ``InvalidInputError``."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point() or is_fp8_dtype(scale.dtype):
            dtype = str(scale.dtype).replace("torch.", "")
            raise InvalidInputError(name, _EXPECTED, f"a tensor of dtype {dtype}, shape "
                                    f"{tuple(scale.shape)}")
        if scale.device.type == "cpu" or debug_checks_enabled():
            value = float(scale.reshape(()))
            if not (math.isfinite(value) and value > 0):
                raise InvalidInputError(name, _EXPECTED, f"a tensor holding {value}")
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InvalidInputError(name, _EXPECTED, repr(scale))
    if not (math.isfinite(scale) and scale > 0):
        raise InvalidInputError(name, _EXPECTED, repr(scale))


def layer_scales(layer: object, mla: bool) -> tuple[Scale, Scale]:
    """``(scale of the keys, scale of the values)`` of ``layer`` (an ``AttentionLayer``); an
    MLA latent pool uses ``k_scale`` for both."""
    k_scale = layer.k_scale  # type: ignore[attr-defined]
    return k_scale, k_scale if mla else layer.v_scale  # type: ignore[attr-defined]


def scale_rows(x: torch.Tensor, scale: Scale) -> torch.Tensor:
    """``x * scale`` in ``x``'s dtype, computed in float32; ``x`` itself for a float 1."""
    if not isinstance(scale, torch.Tensor) and float(scale) == 1.0:
        return x
    return (x.float() * scale).to(x.dtype)


class LibraryScales(NamedTuple):
    """One call of a library that takes its FP8 scales as host floats (``library_scales``)."""

    q: torch.Tensor  # the query to pass (times k_scale when that is a device tensor)
    k_scale: float  # the library's key scale argument (1.0 when folded into q)
    v_scale: float  # the library's value scale argument (1.0 when left to out_scale)
    out_scale: Scale  # what the library's output is multiplied by afterwards


def library_scales(layer: object, q: torch.Tensor, mla: bool) -> LibraryScales:
    """Split ``layer``'s scales between a library's float arguments and device ops on ``q``
    and the output (module doc). MLA: ``k_scale`` is the key and the value scale."""
    k_scale, v_scale = layer_scales(layer, mla)
    k_host, v_host = host_value(k_scale), host_value(v_scale)
    return LibraryScales(q if k_host is not None else scale_rows(q, k_scale),
                         1.0 if k_host is None else k_host, 1.0 if v_host is None else v_host,
                         1.0 if v_host is not None else v_scale)
