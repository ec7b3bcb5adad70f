"""Pure-torch metadata for the FlashInfer glue: page-size-1 CSR slot lists.

Every FlashInfer call here sees the token pool ``[num_slots, H_kv, D]`` as pages of one token
(NHD ``[num_slots, 1, H_kv, D]``), so a "page id" is a token slot, ``last_page_len`` is all
ones and any engine page size works. A *pass* is a list of sequences, each with some query
rows and a KV slot list; its CSR form is ``kv_indptr [M + 1]`` plus ``kv_indices
[kv_indptr[-1]]`` (int32).

Three sequence layouts cover the draft decode (``N = B * K`` lanes, step ``i``, ``n = i + 1``):

- *prefix*: one sequence per request, ``R_b[0 : L_b]`` (all ``K`` lanes of request ``b`` are
  its query rows);
- *history*: one sequence per lane, its ``n`` history slots;
- *full*: one sequence per lane, ``R_b[0 : L_b]`` followed by its ``n`` history slots
  (``topk == 1`` and the ``per-branch`` mode).

The host needs only the lengths (for FlashInfer's plan); the indices are built on the device
from ``req_to_token`` without a host round trip.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...metadata import in_pool

__all__ = ["csr_indptr", "fill_ragged_slots", "history_positions", "host_indptr"]


def host_indptr(lens: torch.Tensor) -> torch.Tensor:
    """``[0, cumsum(lens)]`` as int32 on the CPU. lens: ``[M]`` int (CPU)."""
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(lens.to(torch.int64), 0).to(torch.int32)
    return out


def csr_indptr(lens: torch.Tensor) -> torch.Tensor:
    """``[0, cumsum(lens)]`` as int64 on ``lens``' device (no host sync). lens: ``[M]``."""
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int64, device=lens.device)
    out[1:] = torch.cumsum(lens.to(torch.int64), 0)
    return out


def fill_ragged_slots(out: torch.Tensor, total: int, req_to_token: torch.Tensor,
                      rows: torch.Tensor, prefix_lens: torch.Tensor,
                      history: Optional[torch.Tensor] = None, *,
                      num_slots: Optional[int] = None) -> torch.Tensor:
    """Write the concatenated slot lists of ``M`` sequences into ``out[:total]``.

    Sequence ``m`` is ``req_to_token[rows[m], 0 : prefix_lens[m]]`` followed by
    ``history[m, :]`` (if given), so ``total = sum(prefix_lens) + M * n``.

    out: ``[>= total]`` int32 (written in place; returned as ``out[:total]``).
    req_to_token: ``[max_reqs, max_context_len]``. rows, prefix_lens: ``[M]`` int.
    history: ``[M, n]`` int or ``None``.
    ``total`` comes from the host (the plan needs it anyway), so nothing is read back.
    ``num_slots``: every slot clamped into the pool (no read outside it).
    """
    dev = out.device
    m = rows.shape[0]
    n = 0 if history is None else history.shape[1]
    if total == 0 or m == 0:
        return out[:0]
    plen = prefix_lens.to(torch.int64)
    indptr = csr_indptr(plen + n)
    pos = torch.arange(total, device=dev)
    seq = torch.searchsorted(indptr[1:], pos, right=True).clamp_(max=m - 1)
    t = pos - indptr[seq]
    width = req_to_token.shape[1]
    slots = req_to_token[rows.to(torch.int64)[seq], t.clamp(max=width - 1)].to(torch.int64)
    if history is not None:
        h = history.to(torch.int64)[seq, (t - plen[seq]).clamp(0, n - 1)]
        slots = torch.where(t < plen[seq], slots, h)
    out[:total] = in_pool(slots, num_slots).to(out.dtype)
    return out[:total]


def history_positions(prefix_lens: torch.Tensor, n: int) -> torch.Tensor:
    """Where the ``n`` history entries of each sequence sit in a *full* slot list.

    prefix_lens: ``[M]``. Returns ``[M * n]`` int64: ``indptr[m] + prefix_lens[m] + t``.
    """
    plen = prefix_lens.to(torch.int64)
    start = csr_indptr(plen + n)[:-1] + plen
    return (start[:, None] + torch.arange(n, device=plen.device)).reshape(-1)
