"""``PagedKVAllocator``: engine-style KV-slot bookkeeping for tests, the demo and examples.

Page-granular over a runner's pool: page ``p`` owns slots ``p*P .. p*P + P - 1`` and a
request's positions fill its pages in order, so ``R_b[x]`` for the ``x`` of one page are
consecutive slots (what page-table kernels assume). Page 0 is never handed out: padded
entries of index lists point at slot 0, and writes of padded lanes land there harmlessly.

Draft rounds follow upstream (``reference/upstream-draft-backends.md`` D.1 / D.2):
``alloc_draft`` extends each request by ``metadata.draft_extend_lens``, lays the draft slots
out with ``metadata.assign_draft_cache_locs`` and, for ``P > 1 and K > 1``, copies the partial
last page into each branch's first page; the draft slots are scratch and ``release_draft``
gives them back, restoring every committed length.

Bookkeeping lives on the host (Python lists); only ``req_to_token`` and the KV pool are
device tensors.
"""

from __future__ import annotations

import logging
import torch

from . import metadata
from ._tensor_checks import INDEX_DTYPES, _is_int, dtype_name
from .data import DraftRunner
from .errors import CallOrderError, InvalidInputError, OutOfCapacityError
from .keys import check_draft_params
from .util import ceil_div

__all__ = ["PagedKVAllocator"]

logger = logging.getLogger("specattn.allocator")


class PagedKVAllocator:
    """Requests (rows of ``runner.req_to_token``) and their pages of KV slots."""

    def __init__(self, runner: DraftRunner) -> None:
        if not isinstance(runner, DraftRunner):  # its table and pools are what it manages
            raise InvalidInputError("runner", "a specattn.DraftRunner", type(runner).__name__)
        self.runner = runner
        self.page_size = runner.page_size
        self.num_pages = runner.num_slots // self.page_size
        if self.num_pages < 2:
            raise InvalidInputError("runner.num_slots", f"at least 2 pages of "
                                    f"{self.page_size} slots (page 0 is reserved)",
                                    runner.num_slots)
        # Pop from the end: lowest page ids first.
        self._free_pages = list(range(self.num_pages - 1, 0, -1))
        self._free_reqs = list(range(runner.max_reqs - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._draft: dict[int, int] | None = None  # req -> committed length while drafting

    # --- requests ------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def active_requests(self) -> list[int]:
        return sorted(self._lens)

    def new_request(self) -> int:
        """A free ``req_to_token`` row, with length 0."""
        if not self._free_reqs:
            raise OutOfCapacityError(f"out of request rows: all {self.runner.max_reqs} rows "
                                     "of req_to_token are in use; free_request() some")
        req = self._free_reqs.pop()
        self._pages[req] = []
        self._lens[req] = 0
        return req

    def free_request(self, req: int) -> None:
        """Give back ``req``'s row and all its pages."""
        self._check_req(req)
        self._no_draft("free_request()")
        self._free_pages.extend(reversed(self._pages.pop(req)))
        del self._lens[req]
        self._free_reqs.append(req)

    def seq_len(self, req: int) -> int:
        self._check_req(req)
        return self._lens[req]

    def seq_lens(self, reqs) -> torch.Tensor:
        """``[len(reqs)]`` int32 lengths on the runner's device."""
        return torch.tensor([self.seq_len(r) for r in _request_ids("reqs", reqs)],
                            dtype=torch.int32, device=self.runner.device)

    def pages(self, req: int) -> list[int]:
        self._check_req(req)
        return list(self._pages[req])

    # --- growing and shrinking -----------------------------------------------------------

    def extend(self, req: int, n: int) -> torch.Tensor:
        """Slots ``[n]`` (int64) of positions ``seq_len .. seq_len + n - 1``, written to
        ``req_to_token``; allocates pages as needed."""
        self._check_req(req)
        self._no_draft("extend()")
        if not _is_int(n) or n < 0:
            raise InvalidInputError("n", "an int >= 0", repr(n))
        start = self._lens[req]
        self._reserve({req: start + n})
        slots = self._slots(req, start, start + n)
        self.runner.req_to_token[req, start:start + n] = slots.to(self.runner.req_to_token.dtype)
        self._lens[req] = start + n
        return slots

    def truncate(self, req: int, new_len: int) -> None:
        """Shrink ``req`` to ``new_len`` tokens, freeing the whole pages past it."""
        self._check_req(req)
        self._no_draft("truncate()")
        if not _is_int(new_len) or not 0 <= new_len <= self._lens[req]:
            raise InvalidInputError("new_len", f"an int in [0, {self._lens[req]}] (the "
                                    f"length of request {req})", repr(new_len))
        self._shrink(req, new_len)

    # --- draft rounds --------------------------------------------------------------------

    def alloc_draft(self, req_pool_indices: torch.Tensor, topk: int,
                    num_steps: int) -> torch.Tensor:
        """Draft slots of one round: ``out_cache_loc [B, K, S]`` (int64, runner's device).

        Extends each request to ``L_b + draft_extend_lens[b]`` (upstream D.1 / D.2), writes
        ``req_to_token`` through ``metadata.assign_draft_cache_locs`` and, when
        ``P > 1 and K > 1``, copies the KV of each partial last page into every branch's first
        page. Call ``release_draft()`` after the round.
        """
        self._no_draft("alloc_draft()")
        check_draft_params(topk, num_steps)
        reqs = _request_ids("req_pool_indices", req_pool_indices)
        if not reqs:
            raise InvalidInputError("req_pool_indices", "at least one request", "0")
        if len(set(reqs)) != len(reqs):
            raise InvalidInputError("req_pool_indices", "distinct requests", reqs)
        for r in reqs:
            self._check_req(r)
        dev = self.runner.device
        seq_lens = torch.tensor([self._lens[r] for r in reqs], dtype=torch.int64)
        ext = metadata.draft_extend_lens(seq_lens, topk, num_steps, self.page_size).tolist()
        targets = {r: self._lens[r] + e for r, e in zip(reqs, ext)}
        for r, t in targets.items():
            if t > self.runner.max_context_len:
                raise InvalidInputError("req_pool_indices", f"requests whose draft fits "
                                        f"max_context_len={self.runner.max_context_len}",
                                        f"request {r} of length {self._lens[r]} needs {t}")
        self._reserve(targets)
        new_slots = torch.cat([self._slots(r, self._lens[r], targets[r]) for r in reqs])
        rpi = torch.tensor(reqs, dtype=torch.int64, device=dev)
        seq_dev = seq_lens.to(dev)
        r2t = self.runner.req_to_token
        out = metadata.assign_draft_cache_locs(r2t, rpi, seq_dev, new_slots, topk, num_steps,
                                               self.page_size)
        src, dst = metadata.duplicate_last_page_copies(r2t, rpi, seq_dev, topk, num_steps,
                                                       self.page_size)
        metadata.copy_kv_slots(self.runner, src, dst)
        self._draft = {r: self._lens[r] for r in reqs}
        for r, t in targets.items():
            self._lens[r] = t
        logger.debug("alloc_draft: %d requests, %d slots, %d duplicated", len(reqs),
                     new_slots.numel(), src.numel())
        return out

    def release_draft(self) -> None:
        """Free the draft round's slots; committed lengths are back to their values before
        ``alloc_draft``."""
        if self._draft is None:
            raise CallOrderError("alloc_draft", "a call before release_draft()",
                                 "no draft round is allocated")
        draft, self._draft = self._draft, None
        for r, length in draft.items():
            self._shrink(r, length)

    # --- internals -----------------------------------------------------------------------

    def _check_req(self, req: int) -> None:
        if req not in self._lens:
            raise InvalidInputError("req", f"an active request (one of {self.active_requests})",
                                    repr(req))

    def _no_draft(self, what: str) -> None:
        if self._draft is not None:
            raise CallOrderError("release_draft", f"a call before {what}",
                                 "a draft round is allocated")

    def _reserve(self, targets: dict[int, int]) -> None:
        """Give each request enough pages for ``targets[req]`` tokens, all or nothing."""
        need = {}
        for r, t in targets.items():
            if t > self.runner.max_context_len:
                raise InvalidInputError("n", f"a length within max_context_len="
                                        f"{self.runner.max_context_len}",
                                        f"request {r} would reach {t}")
            need[r] = max(0, ceil_div(t, self.page_size) - len(self._pages[r]))
        total = sum(need.values())
        if total > len(self._free_pages):
            raise OutOfCapacityError(f"out of KV slots: need {total} more pages of "
                                     f"{self.page_size} slots, {len(self._free_pages)} free "
                                     f"of {self.num_pages - 1}")
        for r, k in need.items():
            for _ in range(k):
                self._pages[r].append(self._free_pages.pop())

    def _slots(self, req: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions ``[start, end)`` of ``req`` (its pages must exist)."""
        pos = torch.arange(start, end, dtype=torch.int64)
        pages = torch.tensor(self._pages[req], dtype=torch.int64)
        if pos.numel():
            slots = pages[pos // self.page_size] * self.page_size + pos % self.page_size
        else:
            slots = pos
        return slots.to(self.runner.device)

    def _shrink(self, req: int, new_len: int) -> None:
        keep = ceil_div(new_len, self.page_size)
        freed = self._pages[req][keep:]
        del self._pages[req][keep:]
        self._free_pages.extend(reversed(freed))
        self._lens[req] = new_len


def _request_ids(name: str, reqs: object) -> list[int]:
    """Request rows given as a tensor, a list or an int: int32/int64 values, as a list."""
    try:
        indices = torch.as_tensor(reqs)
    except (TypeError, RuntimeError, ValueError):  # None, a string, a ragged list
        raise InvalidInputError(name, "int32/int64 request indices (a tensor or a list of "
                                "ints)", type(reqs).__name__) from None
    if indices.dtype not in INDEX_DTYPES:
        raise InvalidInputError(name, "int32/int64 request indices",
                                f"dtype {dtype_name(indices.dtype)}")
    return [int(r) for r in indices.reshape(-1).tolist()]
