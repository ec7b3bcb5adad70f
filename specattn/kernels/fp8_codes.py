"""FP8 codes as torch stores them, computed inside a Triton kernel.

An FP8 pool write stores ``fp8.quantize(x, scale, dtype) = (x.float() / scale).to(dtype)``.
A kernel that stores its own codes must give torch's bytes, so this module mirrors torch's
expression instead of Triton's ``.to(tl.float8e4nv)`` (which saturates where torch may not):

- the division (``QUANT``): CUDA torch (2.11) divides by a Python number as a
  multiplication by the reciprocal ``1.0 / scale`` computed in double on the host and
  rounded to float32 (``QUANT_MUL``; ``write_scale`` makes that tensor), and by a device
  tensor as an IEEE division (``QUANT_DIV``, ``div_rn``), as CPU torch divides by either.
  The two differ on values whose quotient lands next to a rounding boundary, so
  ``torch_codes`` asks the device torch which it does for a Python number.
- the conversion (``fp8_code``): c10's ``fp8e4m3fn_from_fp32_value`` /
  ``fp8e5m2_from_fp32_value`` in integer bits: round to nearest even, subnormals through the
  same float addition. Torch releases differ at the edges: e4m3fn overflow (``>= 480`` and
  infinities, and values rounding to ``0x7f``) gives NaN (``0x7f``) in torch <= 2.11 and
  saturates to +-448 (``0x7e``) since; builds that convert with CUDA's intrinsics
  (``__nv_cvt_float_to_fp8``) give NaN without its sign. ``SATURATE`` and ``SIGNED_NAN``
  select the variant, and ``torch_codes(device, dtype)`` finds the device torch's variant
  by asking it once (a probe of special values, checked against this kernel on a sweep).

Shapes: ``x`` any block; codes a ``uint8`` block of the same shape, stored into the pool
viewed as bytes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch
import triton
import triton.language as tl

from ..fp8 import scale_tensor

__all__ = ["QUANT_NONE", "QUANT_MUL", "QUANT_DIV", "Codes", "fp8_code", "quantize_block",
           "write_scale", "torch_variant", "torch_codes", "quantize", "probe_values"]

QUANT_NONE, QUANT_MUL, QUANT_DIV = 0, 1, 2


class Codes(NamedTuple):
    """The conversion variant of one pool dtype (the ``fp8_code`` constexprs)."""

    e5m2: bool  # float8_e5m2 (else float8_e4m3fn)
    saturate: bool  # e4m3fn overflow and infinities -> +-448 (else NaN)
    signed_nan: bool  # a NaN keeps its sign bit (else 0x7f)
    scalar_quant: int = QUANT_MUL  # how torch divides by a Python-number scale

    def kwargs(self) -> dict:
        return dict(E5M2=self.e5m2, SATURATE=self.saturate, SIGNED_NAN=self.signed_nan)


@triton.jit
def fp8_code(x, E5M2: tl.constexpr, SATURATE: tl.constexpr, SIGNED_NAN: tl.constexpr):
    """``x`` (any shape, fp32 values) -> its FP8 codes (``uint8``, same shape), c10's
    ``fp8e4m3fn_from_fp32_value`` / ``fp8e5m2_from_fp32_value`` in integer bits (module doc):
    below the smallest normal, adding ``2^14`` (e4m3) / ``2^7`` (e5m2) rounds the value into
    the low mantissa bits; above, the exponent is rebased and the mantissa rounded to nearest
    even by adding ``0x7ffff`` (``0xfffff``) plus the kept mantissa's low bit."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    a = bits ^ sign
    nan = a > 0x7F800000
    if E5M2:
        small = (a.to(tl.float32, bitcast=True) + 128.0).to(tl.uint32, bitcast=True) \
            - 0x43000000
        normal = (a + 0xC80FFFFF + ((a >> 21) & 1)) >> 21  # exponent - 112 (wraps)
        code = tl.where(a < 0x38800000, small, normal)  # below 2^-14
        big = tl.where(nan, 0x7F, 0x7C).to(tl.uint32)
        code = tl.where(a >= 0x47800000, big, code)  # 65536 and up
    else:
        small = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) \
            - 0x46800000
        normal = (a + 0xC407FFFF + ((a >> 20) & 1)) >> 20  # exponent - 120 (wraps)
        if SATURATE:
            normal = tl.where(normal == 0x7F, 0x7E, normal)
        code = tl.where(a < 0x3C800000, small, normal)  # below 2^-6
        big = tl.where(nan, 0x7F, 0x7E if SATURATE else 0x7F).to(tl.uint32)
        code = tl.where(a >= 0x43F00000, big, code)  # 480 and up
    top = sign >> 24
    if not SIGNED_NAN:
        top = tl.where(nan, 0, top).to(tl.uint32)
    return (code | top).to(tl.uint8)


@triton.jit
def quantize_block(x, Scale, QUANT: tl.constexpr, E5M2: tl.constexpr,
                   SATURATE: tl.constexpr, SIGNED_NAN: tl.constexpr):
    """``x`` (any shape, any float dtype) -> codes ``uint8`` of ``x.float() / scale``:
    ``QUANT_MUL``: ``x * Scale[0]`` (``Scale`` holds the reciprocal, ``write_scale``);
    ``QUANT_DIV``: ``x / Scale[0]`` correctly rounded; ``QUANT_NONE``: ``x`` as is."""
    y = x.to(tl.float32)
    if QUANT == 1:
        y = y * tl.load(Scale)
    elif QUANT == 2:
        s = tl.load(Scale)
        # div_rn takes two tensors of one shape: `s` broadcast to y's (a select, not
        # zeros_like, so that Gluon kernels, whose tensors carry a layout, can call this).
        y = tl.math.div_rn(y, tl.where(y == y, s, s))
    return fp8_code(y, E5M2, SATURATE, SIGNED_NAN)


@triton.jit
def _quantize_kernel(X, Scale, Out, n, QUANT: tl.constexpr, E5M2: tl.constexpr,
                     SATURATE: tl.constexpr, SIGNED_NAN: tl.constexpr, BLOCK: tl.constexpr):
    """Grid ``(cdiv(n, BLOCK),)``: ``Out[i] = quantize_block(X[i])`` (flat, contiguous)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(Out + offs, quantize_block(x, Scale, QUANT, E5M2, SATURATE, SIGNED_NAN),
             mask=offs < n)


def quantize(x: torch.Tensor, scale: torch.Tensor, quant: int, codes: Codes) -> torch.Tensor:
    """``uint8`` codes of ``x`` (any shape) by ``quantize_block``: one launch."""
    flat = x.reshape(-1).contiguous()
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    block = 1024
    if flat.numel():
        _quantize_kernel[(triton.cdiv(flat.numel(), block),)](
            flat, scale, out, flat.numel(), QUANT=quant, BLOCK=block, enable_fp_fusion=False,
            **codes.kwargs())
    return out.view(x.shape)


def write_scale(scale, device: torch.device, scalar_quant: int = QUANT_MUL
                ) -> Optional[tuple[torch.Tensor, int]]:
    """``(scale tensor, QUANT)`` with which ``quantize_block`` gives torch's ``x.float() /
    scale`` on ``device``; ``None`` where it cannot. A Python number: ``scalar_quant`` (the
    device torch's, ``Codes.scalar_quant``): ``QUANT_DIV`` with ``float32(scale)``, or
    ``QUANT_MUL`` with ``float32(1.0 / scale)`` (the host's double division); a
    one-element float tensor on ``device`` whose division stays float32 (float32/fp16/bf16,
    or float64 of no dimension): itself as float32 and ``QUANT_DIV``."""
    device = torch.device(device)
    if not isinstance(scale, torch.Tensor):
        if scalar_quant == QUANT_MUL:
            return scale_tensor(float(np.float32(1.0 / float(scale))), device), \
                QUANT_MUL
        return scale_tensor(float(np.float32(float(scale))), device), QUANT_DIV
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    if scale.numel() != 1 or scale.device.type != device.type or scale.device.index != index:
        return None
    if scale.dtype not in (torch.float32, torch.float16, torch.bfloat16) and not (
            scale.dtype == torch.float64 and scale.dim() == 0):
        return None
    return scale_tensor(scale, device), QUANT_DIV


def probe_values() -> torch.Tensor:
    """float32 values where FP8 conversions differ: every code and midpoint of both formats
    and their neighbouring floats, overflow boundaries, infinities, NaNs, zeros, float32
    subnormals."""
    f = torch.float32
    codes = torch.arange(256, dtype=torch.uint8)
    anchors = [torch.tensor([0.0, 448.0, 464.0, 480.0, 57344.0, 61440.0, 65536.0, 1e30,
                             2.0 ** -149, 2.0 ** -126, 2.0 ** -10, 2.0 ** -17], dtype=f)]
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        v = codes.view(dtype).float()
        v = v[torch.isfinite(v) & (v >= 0)].sort().values
        anchors += [v, (v[1:] + v[:-1]) / 2]  # midpoints: exact in float32
    base = torch.cat(anchors).view(torch.int32)
    near = torch.cat([base + d for d in (-2, -1, 0, 1, 2)]).view(f)
    near = near[near >= 0]
    special = torch.tensor([float("inf"), float("nan")], dtype=f)
    return torch.cat([near, -near, special, -special])


def torch_variant(device: torch.device, dtype: torch.dtype) -> Codes:
    """The conversion flags of torch's ``.to(dtype)`` on ``device``, read off three special
    values (480, inf, -NaN); one sync. ``scalar_quant`` is left at CUDA torch's
    ``QUANT_MUL`` (``torch_codes`` checks it)."""
    special = torch.tensor([480.0, float("inf"), -float("nan")], device=device)
    got = special.to(dtype).view(torch.uint8).tolist()
    return Codes(dtype == torch.float8_e5m2, got[0] == 0x7E and got[1] == 0x7E,
                 got[2] >= 0x80)


_PROBED: dict[tuple[torch.device, torch.dtype], Optional[Codes]] = {}


def torch_codes(device: torch.device, dtype: torch.dtype) -> Optional[Codes]:
    """How torch's ``(x / scale).to(dtype)`` gives codes on ``device`` (module doc), or
    ``None`` where this kernel would not give its bytes. Found once per device and dtype:
    torch converts the special values (``torch_variant``); ``quantize`` must then match
    torch on ``probe_values`` for a Python scale, by the division or by the reciprocal,
    and for a tensor scale. ``None`` without caching while a CUDA graph is being captured
    (the probe syncs)."""
    device = torch.device(device)
    key = (device, dtype)
    if key in _PROBED:
        return _PROBED[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    x = probe_values()
    x = torch.cat([x, x * 1.7]).to(device)  # / 1.7: where the reciprocal's codes differ
    scales = (1.0, 1.7, torch.tensor([1.7], device=device))  # Python numbers, a tensor
    want = [(x / scale).to(dtype).view(torch.uint8) for scale in scales]

    def matches(codes: Codes, i: int) -> bool:
        s, quant = write_scale(scales[i], device, codes.scalar_quant)
        return bool(torch.equal(quantize(x, s, quant, codes), want[i]))

    variant = torch_variant(device, dtype)
    found = next((codes for codes in (variant._replace(scalar_quant=q)
                                      for q in (QUANT_MUL, QUANT_DIV))
                  if matches(codes, 0) and matches(codes, 1)), None)
    if found is not None and not matches(found, 2):
        found = None
    _PROBED[key] = found
    return found
