"""Pool views and page-table helpers shared by the FlashAttention decode and extend glue.

Pure torch; nothing here reads a value back to the host except ``check_page_aligned``,
which runs only where validation scans values (CPU tensors, or ``SPECATTN_DEBUG_CHECKS=1``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ...errors import InvalidInputError
from ...graph_calls import signature
from ...metadata import prefix_page_table, prefix_token_slots
from ...util import ceil_div
from ...validation import debug_checks_enabled

if TYPE_CHECKING:
    from ...data import DraftRunner

__all__ = ["paged_pools", "check_page_aligned", "table_launch_key"]


def paged_pools(runner: "DraftRunner", layer_id: int,
                page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's token pools viewed as pages: ``k [num_pages, P, H_kv, D]``,
    ``v [num_pages, P, H_kv, D_v]`` (no copy). Slots past the last whole page are not
    addressable, so the backends refuse such pools when built
    (``validation.check_whole_pages``); an engine's pool is a whole number of pages."""
    k, v = runner.k_buffer[layer_id], runner.v_buffer[layer_id]
    n = k.shape[0] // page_size
    return (k[:n * page_size].unflatten(0, (n, page_size)),
            v[:n * page_size].unflatten(0, (n, page_size)))


def check_page_aligned(runner: "DraftRunner", req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor, what: str) -> None:
    """A page table of page ids is only right if ``R_b[x] == page(x) * P + x % P`` for the
    ``seq_lens[b]`` positions it covers (the engine's paged allocation). Checked where the
    values can be read for free; a violation would otherwise be a silent wrong answer."""
    p = runner.page_size
    if p == 1 or seq_lens.numel() == 0:
        return
    if not (debug_checks_enabled() or seq_lens.device.type == "cpu"):
        return
    slots, valid = prefix_token_slots(runner.req_to_token, req_pool_indices, seq_lens)
    width = slots.shape[1]
    pages = prefix_page_table(runner.req_to_token, req_pool_indices, seq_lens, p,
                              max_pages=ceil_div(width, p)).long()
    x = torch.arange(width, device=slots.device)
    expect = pages[:, x // p] * p + x % p
    bad = (valid & (slots != expect)).nonzero()
    if bad.numel():
        b, pos = int(bad[0, 0]), int(bad[0, 1])
        raise InvalidInputError(
            "runner.req_to_token", f"page-aligned {what} for page_size={p} "
            "(R_b[x] == (R_b[x - x % P] // P) * P + x % P: whole pages, as an engine's "
            "paged allocator hands them out)",
            f"request {b} position {pos}: slot {int(slots[b, pos])}, the page table implies "
            f"{int(expect[b, pos])}")


def table_launch_key(glue) -> Optional[tuple]:
    """What a kept table launch of the decode/extend ``glue`` reads beyond the caller's index
    tensors: the runner's ``req_to_token`` (``graph_calls``' ``_graph_key_extra``); ``None``
    where the tables are torch ops (nothing kept)."""
    if not glue._meta_kernel:
        return None
    r2t = glue.runner.req_to_token
    return id(glue.runner), r2t.data_ptr(), signature(r2t)
