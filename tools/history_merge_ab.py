"""One Triton kernel per draft step after the prefix pass: history attention + LSE merge.

The two-pass decode used to run the history pass as a second FlashAttention call (one query
per lane over ``i + 1`` slots) and merge the two states with ~15 small torch kernels. Both
are tiny next to the prefix pass, but at ``gqa-long`` they cost more than half of a step
(profile in ``benchmarks/results/2026-11-29-h200/flash-attn-bench-v2.md``). Here one program
per (lane, kv head) reads the lane's ``n <= S`` history keys itself, and merges the result
with the prefix pass's ``C`` chunk states, read in place (FA's head-major LSE through its
strides, no transpose or copy).

Shapes (``N`` lanes, ``K`` lanes per request, ``C`` prefix chunks per request):
q ``[N, H_q, D]``; k/v pools ``[num_slots, H_kv, D | D_v]``; hist_pt ``[N, >= n]`` slots;
prefix_o ``[B*C*K, H_q, D_v]`` rows ordered ``(b, c, k)``; prefix_lse indexed
``(row, head)`` through strides (natural log; ``+-inf`` = a chunk with no keys, weight 0).
Returns ``[N, H_q, D_v]`` in q's dtype.
"""

from __future__ import annotations

import importlib
import os

import torch

__all__ = ["fused_available", "history_merge"]


def fused_available(device: torch.device) -> bool:
    """Triton runs on this device: a CUDA GPU, or the CPU under ``TRITON_INTERPRET=1``."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not (device.type == "cuda" or (device.type == "cpu" and interpret)):
        return False
    try:
        importlib.import_module("triton")
    except Exception:  # no (working) Triton here: the torch merge path stays
        return False
    return True


def _pow2(x: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(x, 1) - 1).bit_length())


_KERNEL = None


def _kernel():
    """Compile-on-first-use, so importing the backend never needs Triton."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def history_merge_kernel(
            Q, Kc, Vc, Hist, PO, PLse, Out,
            stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ht,
            stride_pot, stride_poh, stride_plt, stride_plh, stride_ot, stride_oh,
            n_hist, topk, chunks, scale, softcap,
            GROUP: tl.constexpr, D: tl.constexpr, D_V: tl.constexpr, BLOCK_G: tl.constexpr,
            BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            USE_CAP: tl.constexpr):
        lane = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        g_ok = offs_g < GROUP
        s_ok = offs_s < n_hist
        dv_ok = offs_dv < D_V
        head = kvh * GROUP + offs_g

        q = tl.load(Q + lane * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=g_ok[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
        slot = tl.load(Hist + lane * stride_ht + offs_s, mask=s_ok, other=0).to(tl.int64)
        k = tl.load(Kc + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                    mask=s_ok[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
        v = tl.load(Vc + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :],
                    mask=s_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
        # [G, S] scores by broadcast: G and S are too small for tl.dot's 16-row minimum.
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        if USE_CAP:  # softcap * tanh(s / softcap), tanh through the sigmoid
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        s = tl.where(s_ok[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)  # finite: every lane has >= 1 history key
        p = tl.exp(s - m[:, None])
        den = tl.sum(p, axis=1)
        acc = tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G, D_v]

        b = lane // topk
        j = lane - b * topk
        for c in range(chunks):
            row = (b * chunks + c) * topk + j
            lse = tl.load(PLse + row * stride_plt + head * stride_plh, mask=g_ok,
                          other=float("-inf"))
            ok = (lse > float("-inf")) & (lse < float("inf"))  # empty chunk: no weight
            lse = tl.where(ok, lse, float("-inf"))
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            o = tl.load(PO + row * stride_pot + head[:, None] * stride_poh + offs_dv[None, :],
                        mask=(g_ok & ok)[:, None] & dv_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + w[:, None] * o.to(tl.float32)
            den = den * alpha + w
            m = m_new

        out = acc / den[:, None]
        tl.store(Out + lane * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                 out.to(Out.dtype.element_ty), mask=g_ok[:, None] & dv_ok[None, :])

    _KERNEL = history_merge_kernel
    return _KERNEL


def history_merge(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  hist_pt: torch.Tensor, n_hist: int, prefix_o: torch.Tensor,
                  prefix_lse: torch.Tensor, *, topk: int, chunks: int, scale: float,
                  softcap: float) -> torch.Tensor:
    """Attend each lane's ``n_hist`` history slots and merge with the prefix states.

    q: ``[N, H_q, D]``; k_pool/v_pool: ``[num_slots, H_kv, D | D_v]``; hist_pt: ``[N, >= n]``
    int; prefix_o: ``[N * C, H_q, D_v]``; prefix_lse: ``[N * C, H_q]`` (any strides).
    Returns ``[N, H_q, D_v]``. One launch, no host sync (CUDA-graph safe).
    """
    lanes, hq, d = q.shape
    hkv, dv = k_pool.shape[1], v_pool.shape[-1]
    group = hq // hkv
    out = torch.empty(lanes, hq, dv, dtype=q.dtype, device=q.device)
    if lanes == 0:
        return out
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool), ("prefix_o", prefix_o)):
        if t.stride(-1) != 1:  # internal invariant: the glue passes unit-stride views
            raise ValueError(f"history_merge: {name} needs unit stride in its last dim")
    _kernel()[(lanes, hkv)](
        q, k_pool, v_pool, hist_pt, prefix_o, prefix_lse, out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0),
        v_pool.stride(1), hist_pt.stride(0), prefix_o.stride(0), prefix_o.stride(1),
        prefix_lse.stride(0), prefix_lse.stride(1), out.stride(0), out.stride(1),
        n_hist, topk, chunks, float(scale), float(softcap) if softcap > 0 else 1.0,
        GROUP=group, D=d, D_V=dv, BLOCK_G=_pow2(group), BLOCK_S=_pow2(hist_pt.shape[1]),
        BLOCK_D=_pow2(d, 16), BLOCK_DV=_pow2(dv, 16), USE_CAP=softcap > 0, num_warps=4)
    return out
