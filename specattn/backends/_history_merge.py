"""The history pass and the LSE merge of the shared-prefix draft decode, in one Triton kernel
(used by the ``flashinfer`` and ``flashmla`` glue after their library's prefix pass).

After the prefix pass each lane has ``o_p`` and the LSE of its scores over ``R_b[0 : L_b]``
(base 2 from FlashInfer, natural log from FlashMLA: ``lse_base``); it still has to attend
to its ``n <= S`` history slots. A FlashInfer decode launch for that spends a CTA (and a host
plan) per tiny sequence, and ``merge_state`` is one more launch: 55 us + 5 us on the H200 for
256 lanes x 3 slots, a third of the whole step.
Here one program per (lane, KV head) starts the online softmax from the prefix state
(running max = LSE, running sum = 1, accumulator = ``o_p``) and folds in the history slots,
so the merge costs nothing extra and nothing is planned on the host (graph-safe as is).
With the step's new ``k``/``v`` given, the kernel also stores them at each lane's last slot
and reads that key from them, not the pool: no separate KV write (two or three launches,
~9 us per layer on the H200 at ``gqa-long``), and nothing to order between programs (each
(lane, KV head) is the only reader of its new key).

Only element-wise products and row sums (no ``tl.dot``): the rows are few, and the CPU
interpreter's low-precision ``tl.dot`` is not trusted.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["history_merge"]

_KERNEL = None


def _kernel():
    """The jitted kernel, built on first use (keeps ``import triton`` out of module import)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def history_merge_kernel(q_ptr, k_ptr, v_ptr, hist_ptr, op_ptr, lse_ptr, out_ptr,
                             kn_ptr, vn_ptr, n_hist, scale, cap,
                             sq_l, sq_h, sk_s, sk_h, sv_s, sv_h, sh_l, sh_t,
                             so_l, so_h, sl_l, sl_h, sout_l, sout_h, skn_l, skn_h, svn_l, svn_h,
                             GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                             D_QK: tl.constexpr, D_MAIN: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                             D_V: tl.constexpr, BLOCK_V: tl.constexpr, HAS_CAP: tl.constexpr,
                             NEW_KV: tl.constexpr, WRITE_V: tl.constexpr,
                             LSE_TO_LOG2: tl.constexpr):
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
        # The prefix state; an empty prefix (LSE -inf) contributes nothing.
        m = tl.load(lse_ptr + lane * sl_l + heads * sl_h, mask=gm, other=0.0).to(tl.float32)
        if LSE_TO_LOG2 != 1.0:  # natural-log LSE -> base 2, the running max's base
            m = m * LSE_TO_LOG2
        empty = m == float("-inf")
        acc = tl.load(op_ptr + lane * so_l + heads[:, None] * so_h + dv[None, :], mask=gv,
                      other=0.0).to(tl.float32)
        acc = tl.where(empty[:, None], 0.0, acc)
        l_sum = tl.where(empty, 0.0, 1.0)
        if NEW_KV:  # this step's key: from k/v, stored at the lane's last slot
            slot = tl.load(hist_ptr + lane * sh_l + (n_hist - 1) * sh_t).to(tl.int64)
            kn_row = kn_ptr + lane * skn_l + kvh * skn_h
            vn_row = vn_ptr + lane * svn_l + kvh * svn_h
            tl.store(k_ptr + slot * sk_s + kvh * sk_h + dm, tl.load(kn_row + dm))
            if BLOCK_TAIL > 0:
                tl.store(k_ptr + slot * sk_s + kvh * sk_h + dt,
                         tl.load(kn_row + dt, mask=tm, other=0.0), mask=tm)
            if WRITE_V:  # (MLA: V is a view of the K rows just stored)
                tl.store(v_ptr + slot * sv_s + kvh * sv_h + dv,
                         tl.load(vn_row + dv, mask=vm, other=0.0), mask=vm)
        for t in range(0, n_hist):
            slot = tl.load(hist_ptr + lane * sh_l + t * sh_t).to(tl.int64)
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
            s = s * 1.4426950408889634  # base 2, like the prefix LSE
            m_new = tl.maximum(m, s)
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new)
            v = tl.load(v_row + dv, mask=vm, other=0.0)
            acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)[None, :]
            l_sum = l_sum * alpha + p
            m = m_new
        out = acc / l_sum[:, None]
        tl.store(out_ptr + lane * sout_l + heads[:, None] * sout_h + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gv)

    _KERNEL = history_merge_kernel
    return _KERNEL


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def history_merge(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  hist: torch.Tensor, o_prefix: torch.Tensor, lse_prefix: torch.Tensor,
                  scale: float, cap: float, k_new: Optional[torch.Tensor] = None,
                  v_new: Optional[torch.Tensor] = None, lse_base: str = "2") -> torch.Tensor:
    """Attend each lane to its history slots and merge with its prefix result.

    q: ``[N, H_q, D]``; k_pool: ``[num_slots, H_kv, D]``; v_pool: ``[num_slots, H_kv, D_v]``
    (any strides with a unit last stride: MLA passes views of one latent pool);
    hist: ``[N, n]`` int slots (any strides); o_prefix: ``[N, H_q, D_v]``;
    lse_prefix: ``[N, H_q]`` float32, base 2 (``lse_base="2"``, FlashInfer's) or natural log
    (``"e"``, FlashMLA's); ``-inf`` = empty prefix. Returns ``[N, H_q, D_v]`` in
    ``q.dtype``: softmax over prefix and history together, scores ``scale * q.k`` soft-capped
    by ``cap`` (0 = off).

    k_new: ``[N, H_kv, D]`` (MLA ``[N, D]``), v_new: ``[N, H_kv, D_v]`` or None (MLA: V is
    the first ``D_v`` columns of ``k_new``, and ``v_pool`` a view of ``k_pool``): this step's
    KV, stored here at ``hist[:, -1]`` (unit last strides, pool dtype).
    """
    import triton  # noqa: F401  (the kernel's library; fails clearly if absent)

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
    d_main = _pow2_floor(d)
    tail = d - d_main
    block_g = max(_pow2_ceil(group), 2)
    block_v = _pow2_ceil(dv)
    warps = max(1, min(8, block_g * block_v // 1024))
    new_kv = k_new is not None
    if new_kv:
        k_new = k_new if k_new.dim() == 3 else k_new.unsqueeze(1)
        write_v = v_new is not None
        v_new = v_new if write_v else k_new
    else:
        k_new = v_new = k_pool
        write_v = False
    _kernel()[(lanes, hkv)](
        q, k_pool, v_pool, hist, o_prefix, lse_prefix, out, k_new, v_new, n, scale, cap,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), hist.stride(0), hist.stride(1),
        o_prefix.stride(0), o_prefix.stride(1), lse_prefix.stride(0), lse_prefix.stride(1),
        out.stride(0), out.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), GROUP=group, BLOCK_G=block_g, D_QK=d, D_MAIN=d_main,
        BLOCK_TAIL=_pow2_ceil(tail) if tail else 0, D_V=dv, BLOCK_V=block_v,
        HAS_CAP=cap > 0, NEW_KV=new_kv, WRITE_V=write_v,
        LSE_TO_LOG2=1.0 if lse_base == "2" else 1.4426950408889634, num_warps=warps)
    return out
