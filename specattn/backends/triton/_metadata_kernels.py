"""Triton kernels that build the attention kernels' metadata on the device (no host sync):
one launch per draft round or extend batch, into buffers the caller may keep fixed for CUDA
graphs; index tensors are read through their strides (engines pass slices).

- ``Meta [B, 5]`` int32 per request: ``req_pool_index, prefix_len, split_len, q_start, n_q``
  (``split_len``: one split's prefix slice, a multiple of ``BLOCK_N``).
- decode: ``Hist [B*K, S]`` int32, ``Hist[z, t]`` = the slot lane ``z`` wrote at step ``t``;
  path mode reads it at the ancestor lanes found through ``parents``; the ``gluon-wl``
  work list (``worklist``) in the same launch.
- extend: ``Hist [T]`` int32, the new tokens' slots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._attn_kernels import META_W
from .worklist import write_work


# The caller's index tensors move between a graph's replays: no alignment specialization on
# them, so one compiled kernel serves them all (``kernel_launch``).
_CALLER_DECODE = ("ReqPoolIdx", "SeqLens", "OutLoc")
_CALLER_EXTEND = ("ReqPoolIdx", "SeqLens", "ExtLens", "OutLoc")


@triton.jit(do_not_specialize_on_alignment=_CALLER_DECODE)
def _decode_metadata_kernel(ReqPoolIdx, SeqLens, OutLoc, Meta, Hist, FixRpi, FixSeq, FixLoc,
                            Work, stride_rpi, stride_seq, stride_loc_b, stride_loc_k,
                            stride_loc_s, num_slots, raw_bs, num_programs, tail,
                            TOPK: tl.constexpr, NUM_STEPS: tl.constexpr,
                            BLOCK_S: tl.constexpr, NUM_SPLITS: tl.constexpr,
                            BLOCK_N: tl.constexpr, FIXED: tl.constexpr, WORK: tl.constexpr,
                            BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr):
    """Grid ``(B * K + WORK,)``: lane ``z < B * K`` copies its slots; lane ``j == 0`` writes
    its request. Requests ``b >= raw_bs`` are padding (request row 0, ``seq_lens`` 1, slot
    0). ``FIXED`` (CUDA-graph rounds): the round's fixed ``req_pool_indices`` / ``seq_lens``
    / ``out_cache_loc`` buffers (int64, contiguous) get the padded batch too. ``WORK``
    (``gluon-wl``): program ``B * K`` writes the work list (``worklist.write_work``, over
    the padded lengths; ``BLOCK_B >= B``)."""
    z = tl.program_id(0)
    if WORK:
        if z == tl.num_programs(0) - 1:
            offs = tl.arange(0, BLOCK_B)
            seq = tl.load(SeqLens + tl.minimum(offs, raw_bs - 1) * stride_seq)
            seq = tl.where(offs < raw_bs, seq.to(tl.int32), 1)
            write_work(offs, seq, z // TOPK, Work, num_programs, tail, BLOCK_P, BLOCK_N)
        else:
            _lane_metadata(z, ReqPoolIdx, SeqLens, OutLoc, Meta, Hist, FixRpi, FixSeq, FixLoc,
                           stride_rpi, stride_seq, stride_loc_b, stride_loc_k, stride_loc_s,
                           num_slots, raw_bs, TOPK, NUM_STEPS, BLOCK_S, NUM_SPLITS, BLOCK_N,
                           FIXED)
    else:
        _lane_metadata(z, ReqPoolIdx, SeqLens, OutLoc, Meta, Hist, FixRpi, FixSeq, FixLoc,
                       stride_rpi, stride_seq, stride_loc_b, stride_loc_k, stride_loc_s,
                       num_slots, raw_bs, TOPK, NUM_STEPS, BLOCK_S, NUM_SPLITS, BLOCK_N, FIXED)


@triton.jit
def _lane_metadata(z, ReqPoolIdx, SeqLens, OutLoc, Meta, Hist, FixRpi, FixSeq, FixLoc,
                   stride_rpi, stride_seq, stride_loc_b, stride_loc_k, stride_loc_s, num_slots,
                   raw_bs, TOPK: tl.constexpr, NUM_STEPS: tl.constexpr, BLOCK_S: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, FIXED: tl.constexpr):
    """Lane ``z``'s slots, and its request's ``Meta`` row where it is the request's lane 0."""
    b = z // TOPK
    j = z % TOPK
    real = b < raw_bs
    src = tl.minimum(b, raw_bs - 1)  # padding loads a real request, then drops it
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_STEPS
    loc = tl.load(OutLoc + src * stride_loc_b + j * stride_loc_k + offs_s * stride_loc_s,
                  mask=s_ok, other=0)
    loc = tl.where(real, loc, 0)
    if FIXED:
        tl.store(FixLoc + z * NUM_STEPS + offs_s, loc.to(tl.int64), mask=s_ok)
    # Clamped into the pool once per round: the attention kernels read and write through it.
    loc = tl.minimum(tl.maximum(loc, 0), num_slots - 1)
    tl.store(Hist + z * NUM_STEPS + offs_s, loc.to(tl.int32), mask=s_ok)
    if j == 0:
        seq = tl.where(real, tl.load(SeqLens + src * stride_seq).to(tl.int32), 1)
        rpi = tl.where(real, tl.load(ReqPoolIdx + src * stride_rpi), 0)
        if FIXED:
            tl.store(FixRpi + b, rpi.to(tl.int64))
            tl.store(FixSeq + b, seq.to(tl.int64))
        per = (seq + NUM_SPLITS - 1) // NUM_SPLITS
        split_len = (per + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        tl.store(Meta + b * META_W, rpi.to(tl.int32))
        tl.store(Meta + b * META_W + 1, seq)
        tl.store(Meta + b * META_W + 2, split_len)
        tl.store(Meta + b * META_W + 3, b * TOPK)
        tl.store(Meta + b * META_W + 4, TOPK)


@triton.jit(do_not_specialize_on_alignment=_CALLER_EXTEND)
def _extend_metadata_kernel(ReqPoolIdx, SeqLens, ExtLens, OutLoc, Meta, Hist, FixLoc, bs,
                            num_tokens, pad_bs, pad_tokens, stride_rpi, stride_seq,
                            stride_ext, stride_loc,
                            BLOCK_B: tl.constexpr, NUM_SPLITS: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                            FIXED: tl.constexpr):
    """Grid ``(1,)``: per request the prefix ``L' - E``, its split length and ``cumsum(E)``;
    the ``num_tokens`` new tokens' slots into ``Hist [>=T]`` (int32), and with ``FIXED``
    (CUDA-graph rounds) into the round's fixed ``out_cache_loc`` buffer ``FixLoc`` (int64).
    A graph replay smaller than its capture is padded to ``pad_bs`` requests and
    ``pad_tokens`` tokens: the padding requests have no prefix and no new tokens (their
    programs do nothing), the padding tokens the slot 0 (a KV write over the captured tokens
    writes them there), so the captured launches find no earlier round's values."""
    offs = tl.arange(0, BLOCK_B)
    ok = offs < bs
    ext = tl.load(ExtLens + offs * stride_ext, mask=ok, other=0).to(tl.int32)
    seq = tl.load(SeqLens + offs * stride_seq, mask=ok, other=0).to(tl.int32)
    rpi = tl.load(ReqPoolIdx + offs * stride_rpi, mask=ok, other=0).to(tl.int32)
    prefix = seq - ext
    per = (prefix + NUM_SPLITS - 1) // NUM_SPLITS
    split_len = (per + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    q_start = tl.cumsum(ext, 0) - ext
    row = Meta + offs * META_W
    pad = offs < pad_bs  # the batch's requests, then the padding ones (zeros loaded)
    tl.store(row, rpi, mask=pad)
    tl.store(row + 1, prefix, mask=pad)
    tl.store(row + 2, split_len, mask=pad)
    tl.store(row + 3, q_start, mask=pad)
    tl.store(row + 4, ext, mask=pad)
    for t0 in range(0, pad_tokens, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_ok = offs_t < num_tokens
        t_pad = offs_t < pad_tokens
        loc = tl.load(OutLoc + offs_t * stride_loc, mask=t_ok, other=0)
        tl.store(Hist + offs_t, loc.to(tl.int32), mask=t_pad)
        if FIXED:
            tl.store(FixLoc + offs_t, loc.to(tl.int64), mask=t_pad)
