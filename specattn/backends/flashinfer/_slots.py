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

The host needs only the lengths (for FlashInfer's plan: ``HostCSR``, from the lengths the
caller has on the host); the indices are built on the device from ``req_to_token`` without a
host round trip: ``fill_ragged_slots`` here (torch, any layout) or, for the prefix layout,
``specattn.kernels.prefix_slots`` (one launch).
"""

from __future__ import annotations

from functools import cache
from itertools import accumulate
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from ...metadata import in_pool

__all__ = ["HostCSR", "KeptCSR", "csr_indptr", "fill_ragged_slots", "history_positions",
           "host_arange", "host_csr", "host_indptr", "prefix_slots_launcher"]


@cache
def prefix_slots_launcher() -> Callable:
    """``specattn.kernels.prefix_slots.prefix_slots``, imported at the first call (it
    imports Triton); a replay calls this, not an import statement, on its host path."""
    from ...kernels.prefix_slots import prefix_slots

    return prefix_slots


class HostCSR(NamedTuple):
    """What FlashInfer's host planner reads for one pass, int32 on the CPU: ``qo_indptr``
    and ``kv_indptr`` ``[M + 1]``, ``kv_lens [M]``; as Python ints ``total = kv_indptr[-1]``,
    ``max_q`` (the most query rows of a sequence), ``rows = qo_indptr[-1]`` and ``max_kv``
    (the most keys of a sequence).

    On a GPU the tensors are in pinned memory (``host_csr(pin=True)``): FlashInfer's plan
    copies them to the device with ``non_blocking=True``, and a copy from pageable memory
    can wait for the work already queued on the stream, the wait this glue avoids. They are
    never written after the plan (the copy may still be pending); torch's pinned-memory
    cache keeps a block until its copies are done."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_lens: torch.Tensor
    total: int
    max_q: int
    rows: int = -1
    max_kv: int = -1


def _host_ints(n: int, pin: bool) -> tuple[torch.Tensor, np.ndarray]:
    """``[n]`` int32 on the CPU (pinned with ``pin``) and its numpy view (written in place:
    one allocation, no torch op per value)."""
    t = torch.empty(n, dtype=torch.int32, pin_memory=pin)
    return t, t.numpy()


def _as_numpy(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def host_indptr(lens, *, pin: bool = False) -> torch.Tensor:
    """``[0, cumsum(lens)]`` as int32 on the CPU (pinned with ``pin``). lens: ``[M]`` int
    (CPU tensor or array)."""
    lens = _as_numpy(lens)
    out, a = _host_ints(lens.shape[0] + 1, pin)
    a[0] = 0
    lens.cumsum(out=a[1:])
    return out


def host_csr(qo_indptr: torch.Tensor, kv_lens, max_q: int, *, pin: bool = False) -> HostCSR:
    """The ``HostCSR`` of sequences of ``kv_lens [M]`` keys (int, CPU tensor or array) with
    the query rows of ``qo_indptr [M + 1]`` (int32, CPU; pinned with ``pin`` by the caller),
    at most ``max_q`` per sequence: numpy arithmetic on ``M`` values written into two new
    host tensors (pinned with ``pin``; each its own allocation: the native planners take
    their start as the array). Graph rounds whose device copies are written on the device
    keep theirs instead (``KeptCSR``)."""
    lens_np = _as_numpy(kv_lens)
    kv_t = host_indptr(lens_np, pin=pin)
    lens_t, lens = _host_ints(lens_np.shape[0], pin)
    lens[:] = lens_np
    longest = int(lens.max()) if lens.shape[0] else 0
    rows = int(qo_indptr.numpy()[-1])
    return HostCSR(qo_indptr, kv_t, lens_t, int(kv_t.numpy()[-1]), max_q, rows, longest)


class KeptCSR:
    """Kept pageable int32 host buffers for the CSR of a graph pass of ``m`` sequences, with
    their numpy views: ``kv_indptr [m + 1]``, ``kv_lens [m]`` and, ``with_qo``, ``qo_indptr
    [m + 1]``. For graph rounds whose device copies the glue writes on the device itself
    (``Pass.device_csr``): nothing copies from these buffers after the plan returns, so
    each round rewrites them in place (the host time of a replay metadata call is what an
    engine waits for): Python sums of up to ``LIST_SUMS`` values, else numpy's."""

    LIST_SUMS = 16  # up to here Python's sums take less host time than numpy's calls

    def __init__(self, m: int, with_qo: bool = False) -> None:
        self.m = m
        self.kv_indptr, self._kv = _host_ints(m + 1, False)
        self.kv_lens, self._lens = _host_ints(m, False)
        self._kv[0] = 0
        self.qo_indptr, self._qo = _host_ints(m + 1, False) if with_qo else (None, None)
        if with_qo:
            self._qo[0] = 0

    def fill(self, kv_lens: np.ndarray, *, qo_lens: Optional[np.ndarray] = None,
             qo_indptr: Optional[torch.Tensor] = None, max_q: int = 0) -> HostCSR:
        """The ``HostCSR`` of sequences of ``kv_lens [m]`` keys, written into the buffers:
        query rows ``qo_lens [m]`` (into the kept ``qo_indptr``; ``max_q`` their largest)
        or a given host ``qo_indptr [m + 1]`` with at most ``max_q`` rows a sequence."""
        self._lens[:] = kv_lens
        total, longest = self._sums(kv_lens, self._kv)
        if qo_lens is not None:
            qo_indptr = self.qo_indptr
            rows, max_q = self._sums(qo_lens, self._qo)
        else:
            rows = int(qo_indptr.numpy()[-1])
        return HostCSR(qo_indptr, self.kv_indptr, self.kv_lens, total, max_q, rows, longest)

    def _sums(self, values: np.ndarray, indptr: np.ndarray) -> tuple[int, int]:
        """``indptr[1:]`` = the running sums of ``values [m]``; returns (their sum, the
        largest value), 0 for none."""
        if self.m <= self.LIST_SUMS:
            ints = values.tolist()
            sums = list(accumulate(ints))
            indptr[1:] = sums
            return (sums[-1], max(ints)) if ints else (0, 0)
        values.cumsum(out=indptr[1:])
        return int(indptr[-1]), int(values.max())


def host_arange(n: int, step: int, *, pin: bool = False) -> torch.Tensor:
    """``[0, step, 2 * step, ..., n * step]`` int32 on the CPU (pinned with ``pin``): the
    ``qo_indptr`` of ``n`` sequences of ``step`` query rows."""
    out, a = _host_ints(n + 1, pin)
    a[:] = np.arange(0, (n + 1) * step, step, dtype=np.int32)
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
