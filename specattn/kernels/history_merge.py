"""The history pass and the LSE merge of a shared-prefix draft decode, in one Triton kernel.

Used after a library's prefix pass (``flashinfer``, ``flashmla``, ``fa3``/``fa4``): each lane
has the prefix pass's output and LSE over ``R_b[0 : L_b]`` (base 2 from FlashInfer, natural
log from FlashMLA and FlashAttention: ``lse_base``), possibly as ``C`` chunk states
(FlashAttention's split prefix), and still has to attend to its ``n <= S`` history slots.
A library launch for that spends a CTA (and a host plan) per tiny sequence, and the merge
is more launches (H200, gqa-long: FlashInfer history pass + ``merge_state`` 58.8 us, this
kernel 7.9 us; FA4 history pass + torch merge 209 us).

One program per (lane, KV head) starts the online softmax from the prefix state (running
max = LSE, running sum = 1, accumulator = the prefix output), folds in the other chunk
states, then the history slots one at a time, so the merge costs nothing extra and nothing
is planned on the host (graph-safe as is). With the step's new ``k``/``v`` given, the kernel
also stores them at each lane's last slot and reads that key from them, not the pool: no
separate KV write (~9 us per layer on the H200 at ``gqa-long``), and nothing to order
between programs (each (lane, KV head) is the only reader of its new key).

FP8 pools (``specattn.fp8``) are read as codes and converted to float32: the caller folds
``k_scale`` into ``scale`` and passes ``v_scale``, for a prefix state computed with the same
scales. The step's new KV of an FP8 pool is written before (``runner.write_kv``), not here.

Only element-wise products and row sums (no ``tl.dot``): the rows are few, and the CPU
interpreter's low-precision ``tl.dot`` is not trusted.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..util import next_pow2, prev_pow2
from .merge import LOG2E, fold_state
from .tiles import in_pool

__all__ = ["history_merge"]


@triton.jit
def history_merge_kernel(q_ptr, k_ptr, v_ptr, hist_ptr, op_ptr, lse_ptr, out_ptr,
                         kn_ptr, vn_ptr, n_hist, scale, cap, v_scale, topk, num_slots,
                         sq_l, sq_h, sk_s, sk_h, sv_s, sv_h, sh_l, sh_t,
                         so_l, so_h, sl_l, sl_h, sout_l, sout_h, skn_l, skn_h, svn_l, svn_h,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                         D_QK: tl.constexpr, D_MAIN: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                         D_V: tl.constexpr, BLOCK_V: tl.constexpr, HAS_CAP: tl.constexpr,
                         NEW_KV: tl.constexpr, WRITE_V: tl.constexpr,
                         LSE_TO_LOG2: tl.constexpr, CHUNKS: tl.constexpr,
                         INF_IS_EMPTY: tl.constexpr, SCALE_V: tl.constexpr):
    """Grid ``(lanes, H_kv)``. Prefix states: ``CHUNKS`` rows per lane at
    ``(b * CHUNKS + c) * topk + j`` (lane ``b * topk + j``); an LSE of ``-inf`` (and
    ``+inf`` with ``INF_IS_EMPTY``) is a state with no keys. ``SCALE_V``: history values
    times ``v_scale``."""
    lane = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    gm = g < GROUP
    heads = kvh * GROUP + g
    dm = tl.arange(0, D_MAIN)
    q_rows = q_ptr + lane * sq_l + heads[:, None] * sq_h
    qm = tl.load(q_rows + dm[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
    if BLOCK_TAIL > 0:  # head dims that are not a power of two (MLA: 512 + 64)
        dt = D_MAIN + tl.arange(0, BLOCK_TAIL)
        tm = dt < D_QK
        qt = tl.load(q_rows + dt[None, :], mask=gm[:, None] & tm[None, :],
                     other=0.0).to(tl.float32)
    dv = tl.arange(0, BLOCK_V)
    vm = dv < D_V
    gv = gm[:, None] & vm[None, :]
    if CHUNKS == 1:
        row = lane
    else:
        b = lane // topk
        row = b * (CHUNKS - 1) * topk + lane  # (b * CHUNKS + 0) * topk + j
    # The prefix state; an empty prefix (LSE -inf) contributes nothing.
    m = tl.load(lse_ptr + row * sl_l + heads * sl_h, mask=gm, other=0.0).to(tl.float32)
    if LSE_TO_LOG2 != 1.0:  # natural-log LSE -> base 2, the running max's base
        m = m * LSE_TO_LOG2
    if INF_IS_EMPTY:
        m = tl.where(m == float("inf"), float("-inf"), m)
    empty = m == float("-inf")
    acc = tl.load(op_ptr + row * so_l + heads[:, None] * so_h + dv[None, :], mask=gv,
                  other=0.0).to(tl.float32)
    acc = tl.where(empty[:, None], 0.0, acc)
    l_sum = tl.where(empty, 0.0, 1.0)
    for c in tl.static_range(1, CHUNKS):  # the other chunk states of a split prefix
        crow = row + c * topk
        lse_c = tl.load(lse_ptr + crow * sl_l + heads * sl_h, mask=gm,
                        other=float("-inf")).to(tl.float32)
        if LSE_TO_LOG2 != 1.0:
            lse_c = lse_c * LSE_TO_LOG2
        ok = (lse_c > float("-inf")) & (lse_c < float("inf"))
        lse_c = tl.where(ok, lse_c, float("-inf"))
        o_c = tl.load(op_ptr + crow * so_l + heads[:, None] * so_h + dv[None, :],
                      mask=gv & ok[:, None], other=0.0).to(tl.float32)
        m, l_sum, acc = fold_state(m, l_sum, acc, lse_c, o_c)
    if NEW_KV:  # this step's key: from k/v, stored at the lane's last slot (if in the pool)
        slot = tl.load(hist_ptr + lane * sh_l + (n_hist - 1) * sh_t).to(tl.int64)
        kn_row = kn_ptr + lane * skn_l + kvh * skn_h
        vn_row = vn_ptr + lane * svn_l + kvh * svn_h
        ok_m = (dm * 0 + slot >= 0) & (dm * 0 + slot < num_slots)  # masks are blocks
        tl.store(k_ptr + slot * sk_s + kvh * sk_h + dm, tl.load(kn_row + dm), mask=ok_m)
        if BLOCK_TAIL > 0:
            ok_t = tm & (dt * 0 + slot >= 0) & (dt * 0 + slot < num_slots)
            tl.store(k_ptr + slot * sk_s + kvh * sk_h + dt,
                     tl.load(kn_row + dt, mask=tm, other=0.0), mask=ok_t)
        if WRITE_V:  # (MLA: V is a view of the K rows just stored)
            ok_v = vm & (dv * 0 + slot >= 0) & (dv * 0 + slot < num_slots)
            tl.store(v_ptr + slot * sv_s + kvh * sv_h + dv,
                     tl.load(vn_row + dv, mask=vm, other=0.0), mask=ok_v)
    for t in range(0, n_hist):
        slot = in_pool(tl.load(hist_ptr + lane * sh_l + t * sh_t).to(tl.int64), num_slots)
        k_row = k_ptr + slot * sk_s + kvh * sk_h
        v_row = v_ptr + slot * sv_s + kvh * sv_h
        if NEW_KV:
            if t == n_hist - 1:
                k_row = kn_row
                v_row = vn_row
        s = tl.sum(qm * tl.load(k_row + dm).to(tl.float32)[None, :], 1)
        if BLOCK_TAIL > 0:
            kt = tl.load(k_row + dt, mask=tm, other=0.0).to(tl.float32)
            s += tl.sum(qt * kt[None, :], 1)
        s = s * scale
        if HAS_CAP:
            # cap * tanh(s / cap), tanh via the sigmoid (portable to the interpreter).
            s = cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)
        s = s * LOG2E  # base 2, like the prefix LSE
        m_new = tl.maximum(m, s)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new)
        v = tl.load(v_row + dv, mask=vm, other=0.0).to(tl.float32)
        if SCALE_V:
            v = v * v_scale
        acc = acc * alpha[:, None] + p[:, None] * v[None, :]
        l_sum = l_sum * alpha + p
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + lane * sout_l + heads[:, None] * sout_h + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gv)


def history_merge(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  hist: torch.Tensor, o_prefix: torch.Tensor, lse_prefix: torch.Tensor,
                  scale: float, cap: float, k_new: Optional[torch.Tensor] = None,
                  v_new: Optional[torch.Tensor] = None, lse_base: str = "2", *,
                  chunks: int = 1, topk: int = 1, inf_is_empty: bool = False,
                  v_scale: float = 1.0) -> torch.Tensor:
    """Attend each lane to its history slots and merge with its prefix state(s).

    q: ``[N, H_q, D]``; k_pool: ``[num_slots, H_kv, D]``; v_pool: ``[num_slots, H_kv, D_v]``
    (any strides with a unit last stride: MLA passes views of one latent pool);
    hist: ``[N, n]`` int slots (any strides); o_prefix: ``[N * chunks, H_q, D_v]``;
    lse_prefix: ``[N * chunks, H_q]`` float32 (any strides: FlashAttention's head-major LSE
    is read in place), base 2 (``lse_base="2"``, FlashInfer's) or natural log (``"e"``,
    FlashMLA's and FlashAttention's); ``-inf`` = no keys, also ``+inf`` with
    ``inf_is_empty`` (the FlashAttention 2/3 convention) and in every chunk after the first.
    ``chunks > 1``: the prefix states are ``chunks`` per lane, rows ordered
    ``(request, chunk, lane in request)`` with ``topk`` lanes per request.
    Returns ``[N, H_q, D_v]`` in ``q.dtype``: softmax over prefix and history together,
    scores ``scale * q.k`` soft-capped by ``cap`` (0 = off).

    k_new: ``[N, H_kv, D]`` (MLA ``[N, D]``), v_new: ``[N, H_kv, D_v]`` or None (MLA: V is
    the first ``D_v`` columns of ``k_new``, and ``v_pool`` a view of ``k_pool``): this step's
    KV, stored here at ``hist[:, -1]`` (unit last strides, pool dtype).

    FP8 pools: the history's keys and values are ``code * k_scale`` and ``code * v_scale``
    when ``scale`` includes ``k_scale`` and ``v_scale`` is given (a host float).
    """
    if lse_base not in ("2", "e"):
        raise ValueError(f"lse_base must be '2' or 'e', got {lse_base!r}")
    if q.stride(-1) != 1 or o_prefix.stride(-1) != 1:
        q, o_prefix = q.contiguous(), o_prefix.contiguous()
    lanes, hq, d = q.shape
    hkv, dv = k_pool.shape[1], v_pool.shape[2]
    group = hq // hkv
    n = hist.shape[1]
    out = torch.empty(lanes, hq, dv, dtype=q.dtype, device=q.device)
    if lanes == 0:
        return out
    d_main = prev_pow2(d)
    tail = d - d_main
    block_g = next_pow2(group, 2)
    block_v = next_pow2(dv)
    warps = max(1, min(8, block_g * block_v // 1024))
    new_kv = k_new is not None
    if new_kv:
        k_new = k_new if k_new.dim() == 3 else k_new.unsqueeze(1)
        write_v = v_new is not None
        v_new = v_new if write_v else k_new
    else:
        k_new = v_new = k_pool
        write_v = False
    history_merge_kernel[(lanes, hkv)](
        q, k_pool, v_pool, hist, o_prefix, lse_prefix, out, k_new, v_new, n, scale, cap,
        float(v_scale), topk,
        k_pool.shape[0],
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), hist.stride(0), hist.stride(1),
        o_prefix.stride(0), o_prefix.stride(1), lse_prefix.stride(0), lse_prefix.stride(1),
        out.stride(0), out.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), GROUP=group, BLOCK_G=block_g, D_QK=d, D_MAIN=d_main,
        BLOCK_TAIL=next_pow2(tail) if tail else 0, D_V=dv, BLOCK_V=block_v,
        HAS_CAP=cap > 0, NEW_KV=new_kv, WRITE_V=write_v,
        LSE_TO_LOG2=1.0 if lse_base == "2" else LOG2E.value, CHUNKS=chunks,
        INF_IS_EMPTY=inf_is_empty, SCALE_V=float(v_scale) != 1.0, num_warps=warps)
    return out
