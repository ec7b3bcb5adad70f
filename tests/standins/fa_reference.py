"""Shared core of the FlashAttention stand-ins (``fa_cute``, ``fa_interface``, ``fa_mate``).

Each stand-in checks its arguments against the documented API
(``/work/shared/spec/reference/kernel-apis.md`` section 2) and computes the answer in plain
torch from exactly the arguments it was given: keys are gathered through the page table it
receives (``page_table[b, x // P] * P + x % P`` in a ``[num_pages, P, H_kv, D]`` pool),
``seqused`` keys per sequence, bottom-right causal alignment, natural-log LSE returned
head-major ``(H_q, total_q)``. So a wrong page table, a wrong key count or a wrong LSE layout
in the glue gives a wrong answer. Every call is recorded (``Recorder``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ._common import masked_pv

ACT = (torch.float16, torch.bfloat16)


class StandInError(AssertionError):
    """The glue called the stand-in in a way the real library would reject."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise StandInError(msg)


@dataclass
class Call:
    """One recorded call: the entry point, the scalars, and the index tensors' addresses."""

    api: str
    total_q: int
    batch: int
    page_size: int
    max_seqlen_q: int
    causal: bool
    with_lse: bool
    ptrs: dict = field(default_factory=dict)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[Call] = []

    def clear(self) -> None:
        self.calls.clear()


def _index(name: str, t, ndim: int, device) -> torch.Tensor:
    _need(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    _need(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _need(t.dim() == ndim, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    _need(t.device == device, f"{name} on {t.device}, q on {device}")
    _need(t.stride(-1) == 1, f"{name} needs unit stride in its last dim")
    if ndim == 1:
        _need(t.is_contiguous(), f"{name} must be contiguous")
    return t


def check_and_attend(api: str, rec: Recorder, q, k, v, *, page_table, seqused, cu_seqlens_q,
                     max_seqlen_q, scale, causal, softcap, with_lse, empty_lse: float,
                     empty_out: float):
    """Validate, record, compute. Returns ``(out [total_q, H_q, D_v], lse (H_q, total_q))``."""
    _need(isinstance(q, torch.Tensor) and q.dim() == 3, "q must be [total_q, H_q, D] (varlen)")
    _need(q.dtype in ACT, f"q dtype {q.dtype}: fp16/bf16 only")
    _need(q.stride(-1) == 1, "q needs unit stride in its last dim")
    for name, t in (("k", k), ("v", v)):
        _need(isinstance(t, torch.Tensor) and t.dim() == 4,
              f"{name} must be a paged cache [num_pages, page_size, H_kv, D]")
        _need(t.dtype == q.dtype, f"{name} dtype {t.dtype} != q dtype {q.dtype}")
        _need(t.device == q.device, f"{name} on another device than q")
        _need(t.stride(-1) == 1, f"{name} needs unit stride in its last dim")
    _need(k.shape[:3] == v.shape[:3], "k and v pages differ in shape")
    _need(k.shape[-1] == q.shape[-1], "q and k head dims differ")
    num_pages, page_size, hkv, _ = k.shape
    total_q, hq, _ = q.shape
    _need(hq % hkv == 0, f"H_q={hq} not a multiple of H_kv={hkv}")
    cu = _index("cu_seqlens_q", cu_seqlens_q, 1, q.device)
    batch = cu.shape[0] - 1
    pt = _index("page_table", page_table, 2, q.device)
    used = _index("seqused", seqused, 1, q.device)
    _need(pt.shape[0] == batch, f"page_table has {pt.shape[0]} rows for {batch} sequences")
    _need(used.shape[0] == batch, f"seqused has {used.shape[0]} entries for {batch} sequences")
    cu_l = cu.long()
    _need(int(cu_l[0]) == 0 and int(cu_l[-1]) == total_q,
          f"cu_seqlens_q must run 0..total_q={total_q}, got {cu.tolist()}")
    lens = cu_l[1:] - cu_l[:-1]
    _need(bool((lens >= 0).all()), "cu_seqlens_q must be non-decreasing")
    _need(isinstance(max_seqlen_q, int) and max_seqlen_q >= int(lens.max()),
          f"max_seqlen_q={max_seqlen_q!r} below the longest query run {int(lens.max())}")
    _need(bool((used >= 0).all()) and int(used.max()) <= pt.shape[1] * page_size,
          "seqused beyond the page table")
    _need(isinstance(scale, float), "softmax_scale must be a float")
    rec.calls.append(Call(api, total_q, batch, page_size, max_seqlen_q, causal, with_lse,
                          {"page_table": pt.data_ptr(), "seqused": used.data_ptr(),
                           "cu_seqlens_q": cu.data_ptr()}))

    group = hq // hkv
    out = torch.zeros(total_q, hq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(batch):
        s, e, n = int(cu_l[b]), int(cu_l[b + 1]), int(used[b])
        m = e - s
        if m == 0:
            continue
        if n == 0:
            out[s:e] = empty_out
            lse[:, s:e] = empty_lse
            continue
        pages = pt[b, :math.ceil(n / page_size)].long()
        _need(bool(((pages >= 0) & (pages < num_pages)).all()),
              f"page ids {pages.tolist()} outside [0, {num_pages})")
        kb = k[pages].reshape(-1, hkv, k.shape[-1])[:n].float().repeat_interleave(group, 1)
        vb = v[pages].reshape(-1, hkv, v.shape[-1])[:n].float().repeat_interleave(group, 1)
        sc = torch.einsum("mhd,nhd->hmn", q[s:e].float(), kb) * scale
        if softcap > 0:
            sc = softcap * torch.tanh(sc / softcap)
        vis = None
        if causal:  # bottom-right: row r sees keys 0 .. n - m + r
            vis = (torch.arange(n, device=q.device)[None, :] <= (
                n - m + torch.arange(m, device=q.device))[:, None])[None]
            sc = sc.masked_fill(~vis, float("-inf"))
        row_lse = torch.logsumexp(sc, dim=-1)  # [H, m]
        p = torch.exp(sc - row_lse[..., None]).nan_to_num(0.0)
        out[s:e] = masked_pv(p, vb, vis, "hmn,nhd->mhd")
        empty = torch.isinf(row_lse) & (row_lse < 0)
        lse[:, s:e] = torch.where(empty, torch.full_like(row_lse, empty_lse), row_lse)
    return out.to(q.dtype), lse
