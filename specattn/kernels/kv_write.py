"""The call's new KV into the pool in one launch: ``pool[slots[r]] = k[r]`` (and ``v``), or
for FP8 pools torch's codes of ``k / k_scale`` bit for bit (``fp8_codes``).

``runner.write_kv`` takes one indexed copy per pool, and for FP8 pools about five torch ops
per pool (float, divide, convert, view, index-put): each a launch, a few microseconds under
a CUDA graph at batch 1. ``write_new_kv`` is one launch; ``store_kv`` is the write a
backend whose kernels do not store the KV themselves makes before it attends: that launch
where it gives ``runner.write_kv``'s bytes (a CUDA device with Triton, no byte layout,
FP8 codes only where ``fp8_write`` finds the device torch's conversion), else
``runner.write_kv``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..fp8 import is_fp8_dtype
from ..util import next_pow2, triton_runs
from .fp8_codes import Codes, quantize_block, torch_codes, write_scale
from .pdl import launch_args as pdl_launch_args, launch_dependents

__all__ = ["layer_pools", "head_rows", "Fp8Write", "fp8_write", "write_new_kv", "store_kv"]


@triton.jit
def _write_kv_kernel(Slots, stride_slots, Kin, Vin, Kb, Vb, KScale, VScale, stride_kin_t,
                     stride_kin_h, stride_vin_t, stride_vin_h, stride_ks, stride_kh, stride_vs,
                     stride_vh, num_slots, KW: tl.constexpr, BLOCK_KW: tl.constexpr,
                     D_V: tl.constexpr, BLOCK_DV: tl.constexpr, WRITE_V: tl.constexpr,
                     PDL: tl.constexpr = False, FP8: tl.constexpr = False,
                     K_QUANT: tl.constexpr = 0, V_QUANT: tl.constexpr = 0,
                     E5M2: tl.constexpr = False, SATURATE: tl.constexpr = True,
                     SIGNED_NAN: tl.constexpr = True):
    """Grid ``(rows, H_kv)``: ``Kb[Slots[r], h] = Kin[r, h]`` (and V; Slots strided): the
    call's new KV in one launch (many-request decode, extend, FP8 pools); a slot outside the
    pool is not written. PDL: the split-KV kernel after it may launch at once (its prefix
    programs read other slots; its tail waits for this launch to end).

    FP8 (Kb/Vb: the pools viewed as ``uint8``): stores torch's codes of ``x.float() /
    scale`` (``fp8_codes.quantize_block``: ``K_QUANT`` / ``V_QUANT`` with ``KScale`` /
    ``VScale``, the conversion variant ``E5M2`` / ``SATURATE`` / ``SIGNED_NAN``), the bytes
    ``DraftRunner.write_kv`` stores, in one launch where torch takes ~5 per pool."""
    if PDL:
        launch_dependents()
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dst = tl.load(Slots + r * stride_slots).to(tl.int64)
    offs = tl.arange(0, BLOCK_KW)
    dst_k = dst + offs * 0  # a block, not a scalar: masks are blocks (and the interpreter's)
    x = tl.load(Kin + r * stride_kin_t + h * stride_kin_h + offs, mask=offs < KW)
    if FP8:
        x = quantize_block(x, KScale, K_QUANT, E5M2, SATURATE, SIGNED_NAN)
    tl.store(Kb + dst * stride_ks + h * stride_kh + offs, x.to(Kb.dtype.element_ty),
             mask=(offs < KW) & (dst_k >= 0) & (dst_k < num_slots))
    if WRITE_V:
        offs_v = tl.arange(0, BLOCK_DV)
        dst_v = dst + offs_v * 0
        y = tl.load(Vin + r * stride_vin_t + h * stride_vin_h + offs_v, mask=offs_v < D_V)
        if FP8:
            y = quantize_block(y, VScale, V_QUANT, E5M2, SATURATE, SIGNED_NAN)
        tl.store(Vb + dst * stride_vs + h * stride_vh + offs_v, y.to(Vb.dtype.element_ty),
                 mask=(offs_v < D_V) & (dst_v >= 0) & (dst_v < num_slots))


def layer_pools(runner, layer_id: int):
    """``(Kb, Vb, stride_ks, stride_kh, stride_vs, stride_vh)`` of one layer's pool."""
    if runner.use_mla_backend:
        kv = runner.kv_buffer[layer_id]
        return kv, kv, kv.stride(0), 0, kv.stride(0), 0
    k, v = runner.k_buffer[layer_id], runner.v_buffer[layer_id]
    return k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1)


class Fp8Write(NamedTuple):
    """How ``write_new_kv`` stores codes into FP8 pools (``fp8_write``)."""

    k_scale: torch.Tensor  # one element, float32: what K_QUANT multiplies / divides by
    v_scale: torch.Tensor
    k_quant: int  # fp8_codes.QUANT_DIV, or QUANT_MUL (a Python number, older torch)
    v_quant: int
    codes: Codes  # the device torch's conversion variant


def _plain_rows(runner, new_kv: tuple, device: torch.device) -> bool:
    """The one launch can store ``new_kv`` into ``runner``'s pools: a CUDA device, no byte
    layout (``runner.kv_layout``), rows of unit stride."""
    return device.type == "cuda" and getattr(runner, "kv_layout", None) is None and \
        all(x is None or x.stride(-1) == 1 for x in new_kv)


def _fp8_codes(runner, layer, device: torch.device) -> Optional[Fp8Write]:
    """``fp8_write``'s answer once the rows are plain (``_plain_rows``)."""
    kb = layer_pools(runner, layer.layer_id)[0]
    if not is_fp8_dtype(kb.dtype):
        return None
    codes = torch_codes(device, kb.dtype)
    if codes is None:
        return None
    k = write_scale(layer.k_scale, device, codes.scalar_quant)
    v = k if runner.use_mla_backend else write_scale(layer.v_scale, device, codes.scalar_quant)
    if k is None or v is None:
        return None
    return Fp8Write(k[0], v[0], k[1], v[1], codes)


def fp8_write(runner, layer, new_kv: tuple, device: torch.device) -> Optional[Fp8Write]:
    """The arguments with which ``write_new_kv`` stores an FP8 pool's codes bit for bit as
    ``runner.write_kv`` does on ``device`` (CUDA torch's ``(x.float() / scale).to(dtype)``,
    ``specattn.kernels.fp8_codes``); ``None`` where ``runner.write_kv`` stores them: not a
    CUDA device (the CPU divides differently), a byte layout (``runner.kv_layout``), a
    scale the kernel does not mirror (``fp8_codes.write_scale``), rows without unit stride,
    or a torch whose conversion the kernel does not give (``fp8_codes.torch_codes``)."""
    if not _plain_rows(runner, new_kv, device):
        return None
    return _fp8_codes(runner, layer, device)


def head_rows(k: torch.Tensor, v: Optional[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A call's new ``(k, v)`` as ``[rows, H_kv, D]`` each (MLA's ``[rows, D]`` latent: one
    head, and the values are the keys)."""
    k3 = k if k.dim() == 3 else k.unsqueeze(1)
    return k3, k3 if v is None else v


def write_new_kv(runner, layer_id: int, slots: torch.Tensor, k: torch.Tensor,
                 v: Optional[torch.Tensor], pdl: bool = False,
                 fp8: Optional[Fp8Write] = None) -> bool:
    """One launch: ``pool[slots[r]] = k[r]`` (and ``v``). slots: ``[rows]`` int;
    k: ``[rows, H_kv, D]`` (MLA ``[rows, D]``). ``pdl``: the kernel lets a programmatic
    dependent launch after it start at once. ``fp8`` (FP8 pools, ``fp8_write``): stores
    ``runner.write_kv``'s codes, one launch where torch takes about ten per step. Returns
    whether it launched (no rows: no launch)."""
    kb, vb, sks, skh, svs, svh = layer_pools(runner, layer_id)
    rows = slots.shape[0]
    if rows == 0:
        return False
    k3, v3 = head_rows(k, v)
    quant: dict = {}
    k_scale = v_scale = slots  # placeholders, never read without FP8
    if fp8 is not None:
        kb, vb = kb.view(torch.uint8), vb.view(torch.uint8)
        k_scale, v_scale = fp8.k_scale, fp8.v_scale
        quant = dict(FP8=True, K_QUANT=fp8.k_quant, V_QUANT=fp8.v_quant,
                     enable_fp_fusion=False, **fp8.codes.kwargs())  # no fma: torch's roundings
    _write_kv_kernel[(rows, k3.shape[1])](
        slots, slots.stride(0), k3, v3, kb, vb, k_scale, v_scale, k3.stride(0), k3.stride(1),
        v3.stride(0), v3.stride(1), sks, skh, svs, svh, kb.shape[0], KW=k3.shape[2],
        BLOCK_KW=next_pow2(k3.shape[2], lo=16), D_V=v3.shape[2],
        BLOCK_DV=next_pow2(v3.shape[2], lo=16),
        WRITE_V=v is not None, num_warps=1, **quant, **pdl_launch_args(pdl))
    return True


def store_kv(runner, layer, loc: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor]
             ) -> None:
    """``runner.write_kv(layer.layer_id, loc, k, v, layer.k_scale, layer.v_scale)``'s bytes,
    in one launch where it can (module doc). loc: the slots, any shape of ``rows`` elements;
    k / v as ``write_new_kv`` takes them."""
    if triton_runs(k.device) and _plain_rows(runner, (k, v), k.device):
        fp8 = _fp8_codes(runner, layer, k.device) if runner.fp8 else None
        if fp8 is not None or not runner.fp8:
            write_new_kv(runner, layer.layer_id, loc.reshape(-1), k, v, fp8=fp8)
            return
    runner._store_kv(layer.layer_id, loc, k, v, layer.k_scale, layer.v_scale)
