"""Metadata builders shared by every backend: slot lists, index layouts, page tables and the
draft-slot allocation helpers of an engine.

Pure torch, device-agnostic. Notation of ``semantics.md``: ``B`` requests, ``K = topk``,
``S = num_steps``, ``P = page_size``, ``L_b = seq_lens[b]``,
``R_b[x] = req_to_token[req_pool_indices[b], x]``, lane ``z = b * K + j``.

Draft slot layout (``reference/upstream-draft-backends.md`` D.1 / D.2), position in ``R_b`` of
lane ``(b, j)``'s step-``t`` slot:

- case A (``P == 1 or K == 1``): ``L_b + j * S + t``;
- case B (``P > 1 and K > 1``): ``base_b + j * npp_b * P + last_b + t`` with
  ``last_b = L_b % P``, ``base_b = L_b - last_b``, ``npp_b = ceil((last_b + S) / P)``; the
  partial last page ``R_b[base_b : L_b]`` is duplicated into every branch's first page.

Functions that take an optional ``max_len`` / ``max_pages`` / ``row_width`` need no host
synchronisation when it is given (CUDA-graph friendly); without it they read one scalar
(``seq_lens.max()`` or ``seq_lens.sum()``) from the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from .errors import InvalidInputError
from .util import ceil_div

if TYPE_CHECKING:
    from .data import DraftBatch, DraftRunner

__all__ = [
    "lane_history_slots", "path_history_slots", "history_slots", "prefix_token_slots",
    "ExtendSlots", "extend_token_slots", "draft_slot_positions", "draft_kv_indices",
    "prefix_page_table", "history_page_table", "draft_extend_lens", "max_draft_extend_len",
    "assign_draft_cache_locs", "duplicate_last_page_copies", "copy_kv_slots",
    "uses_duplicated_pages", "lane_block_table", "lane_rows",
]


def uses_duplicated_pages(topk: int, page_size: int) -> bool:
    """Case B of the draft allocation: the partial last page is duplicated per branch."""
    return page_size > 1 and topk > 1


# --- per-lane draft history ----------------------------------------------------------------


def lane_history_slots(out_cache_loc: torch.Tensor, step: int) -> torch.Tensor:
    """``lane`` mode history. out_cache_loc: ``[B, K, S]`` → ``[B, K, step + 1]``."""
    return out_cache_loc[:, :, :step + 1]


def path_history_slots(out_cache_loc: torch.Tensor, parents: torch.Tensor,
                       step: int) -> torch.Tensor:
    """``path`` mode history: the slots of each lane's ancestor chain.

    out_cache_loc: ``[B, K, S]``; parents: ``[S, B, K]`` (row ``t`` gives the lane at step
    ``t - 1`` holding the parent of lane ``j``'s step-``t`` token; row 0 unused).
    Returns ``[B, K, step + 1]``: column ``t`` is ``out_cache_loc[b, a_t, t]`` with
    ``a_step = j`` and ``a_{t-1} = parents[t, b, a_t]``.
    """
    bs, topk = out_cache_loc.shape[0], out_cache_loc.shape[1]
    anc = torch.arange(topk, device=out_cache_loc.device).expand(bs, topk)
    cols = [None] * (step + 1)
    for t in range(step, -1, -1):
        cols[t] = torch.gather(out_cache_loc[:, :, t], 1, anc)
        if t > 0:
            anc = torch.gather(parents[t].long(), 1, anc)
    return torch.stack(cols, dim=2)


def history_slots(out_cache_loc: torch.Tensor, parents: Optional[torch.Tensor], step: int,
                  tree_mode: str) -> torch.Tensor:
    """Draft history ``[B, K, step + 1]`` of every lane in ``tree_mode`` (``lane``/``path``)."""
    if tree_mode == "lane":
        return lane_history_slots(out_cache_loc, step)
    if tree_mode == "path":
        if parents is None:
            raise InvalidInputError("parents", "a [num_steps, B, topk] tensor in "
                                    "tree_mode='path'", None)
        return path_history_slots(out_cache_loc, parents, step)
    raise InvalidInputError("tree_mode", "'lane' or 'path'", repr(tree_mode))


# --- prefix and extend slot lists ----------------------------------------------------------


def in_pool(slots: torch.Tensor, num_slots: Optional[int]) -> torch.Tensor:
    """``slots`` clamped into ``[0, num_slots)`` (``None``: unchanged). The slot lists built
    for vendor kernels go through this, so no kernel reads outside the pool whatever
    ``req_to_token`` holds; ``validation`` refuses such entries where values are checked."""
    return slots if num_slots is None else slots.clamp(0, num_slots - 1)


def _request_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                  positions: torch.Tensor, num_slots: Optional[int] = None) -> torch.Tensor:
    """``R_b[positions[b, ...]]`` as int64. positions: ``[B, ...]`` (clamped into the row so
    padded entries gather safely; callers mask them); slots clamped into the pool when
    ``num_slots`` is given."""
    rows = req_to_token[req_pool_indices.long()]
    flat = positions.reshape(positions.shape[0], -1).clamp(0, req_to_token.shape[1] - 1)
    slots = torch.gather(rows, 1, flat.long()).long().reshape(positions.shape)
    return in_pool(slots, num_slots)


def prefix_token_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor, max_len: Optional[int] = None, *,
                       num_slots: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix slots ``R_b[0 : L_b]`` padded to ``Lmax`` (pad slot 0) and their mask.

    Returns ``slots [B, Lmax]`` int64 and ``valid [B, Lmax]`` bool. ``Lmax = max_len`` when
    given (no host sync), else ``max(seq_lens)``. ``num_slots``: clamp into the pool.
    """
    if max_len is None:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    pos = torch.arange(max_len, device=seq_lens.device).expand(seq_lens.shape[0], max_len)
    valid = pos < seq_lens.long()[:, None]
    slots = _request_rows(req_to_token, req_pool_indices, pos, num_slots)
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


class ExtendSlots(NamedTuple):
    """What the extend paths need (``T = sum(E)`` new tokens, request-major).

    slots: ``[B, Lmax]`` int64, ``R_b[0 : L'_b]`` padded with slot 0.
    valid: ``[B, Lmax]`` bool, ``x < L'_b``.
    prefix_lens: ``[B]`` int64, ``L'_b - E_b`` (tokens before the new ones).
    qo_indptr: ``[B + 1]`` int64, ``cumsum(E)`` with a leading 0.
    token_req: ``[T]`` int64, the request of each new token.
    token_pos: ``[T]`` int64, its index ``t`` inside its request (``0 .. E_b - 1``).
    token_visible: ``[T]`` int64, keys it sees: ``L'_b - E_b + t + 1``.
    """

    slots: torch.Tensor
    valid: torch.Tensor
    prefix_lens: torch.Tensor
    qo_indptr: torch.Tensor
    token_req: torch.Tensor
    token_pos: torch.Tensor
    token_visible: torch.Tensor


def extend_token_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                       max_len: Optional[int] = None,
                       num_tokens: Optional[int] = None, *,
                       num_slots: Optional[int] = None) -> ExtendSlots:
    """Slot lists of a draft-extend batch. seq_lens (``L'``, new tokens included) and
    extend_lens (``E``): ``[B]``. ``num_tokens = sum(E)`` given = no host sync for it.
    ``num_slots``: clamp the slots into the pool."""
    slots, valid = prefix_token_slots(req_to_token, req_pool_indices, seq_lens, max_len,
                                      num_slots=num_slots)
    ext = extend_lens.long()
    qo_indptr = torch.zeros(ext.shape[0] + 1, dtype=torch.long, device=ext.device)
    qo_indptr[1:] = torch.cumsum(ext, 0)
    if num_tokens is None:
        num_tokens = int(qo_indptr[-1])
    token_req = torch.repeat_interleave(torch.arange(ext.shape[0], device=ext.device), ext,
                                        output_size=num_tokens)
    token_pos = torch.arange(num_tokens, device=ext.device) - qo_indptr[token_req]
    prefix_lens = seq_lens.long() - ext
    return ExtendSlots(slots, valid, prefix_lens, qo_indptr, token_req, token_pos,
                       prefix_lens[token_req] + token_pos + 1)


# --- draft slot layout (D.1 / D.2) ---------------------------------------------------------


def draft_slot_positions(seq_lens: torch.Tensor, topk: int, num_steps: int,
                         page_size: int) -> torch.Tensor:
    """Position in ``R_b`` of lane ``(b, j)``'s step-``t`` draft slot: ``[B, K, S]`` int64."""
    L = seq_lens.long()[:, None, None]
    j = torch.arange(topk, device=seq_lens.device)[None, :, None]
    t = torch.arange(num_steps, device=seq_lens.device)[None, None, :]
    if not uses_duplicated_pages(topk, page_size):
        return L + j * num_steps + t
    last = L % page_size
    npp = ceil_div(last + num_steps, page_size)
    return (L - last) + j * npp * page_size + last + t


def draft_extend_lens(seq_lens: torch.Tensor, topk: int, num_steps: int,
                      page_size: int) -> torch.Tensor:
    """Slots each request's draft round needs, ``[B]`` int64: ``K * S`` (case A) or
    ``T_b - L_b = K * npp_b * P - last_b`` (case B)."""
    L = seq_lens.long()
    if not uses_duplicated_pages(topk, page_size):
        return torch.full_like(L, topk * num_steps)
    last = L % page_size
    return topk * ceil_div(last + num_steps, page_size) * page_size - last


def max_draft_extend_len(topk: int, num_steps: int, page_size: int) -> int:
    """Upper bound of ``draft_extend_lens`` over any ``seq_lens`` (a static size)."""
    if not uses_duplicated_pages(topk, page_size):
        return topk * num_steps
    return topk * ceil_div(page_size - 1 + num_steps, page_size) * page_size


def assign_draft_cache_locs(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                            seq_lens: torch.Tensor, new_slots: torch.Tensor, topk: int,
                            num_steps: int, page_size: int) -> torch.Tensor:
    """Write the draft round's slots into ``req_to_token`` and return ``out_cache_loc``.

    new_slots: ``[sum(draft_extend_lens)]``, request-major; request ``b``'s share goes to
    ``R_b[L_b : L_b + draft_extend_lens[b]]`` (in place). Returns ``out_cache_loc [B, K, S]``
    (dtype of ``new_slots``) per ``draft_slot_positions``. No host sync.
    """
    bs = seq_lens.shape[0]
    dev = seq_lens.device
    ext = draft_extend_lens(seq_lens, topk, num_steps, page_size)
    start = torch.cumsum(ext, 0) - ext
    width = max_draft_extend_len(topk, num_steps, page_size)
    e = torch.arange(width, device=dev).expand(bs, width)
    # Padding entries repeat the request's last real write (same position, same value), so
    # the scatter is deterministic without a mask-driven (host-syncing) selection.
    e = torch.minimum(e, ext[:, None] - 1)
    rows = req_pool_indices.long()[:, None].expand(bs, width)
    cols = seq_lens.long()[:, None] + e
    if new_slots.numel():
        vals = new_slots.reshape(-1)[(start[:, None] + e).clamp(max=new_slots.numel() - 1)]
        req_to_token[rows, cols] = vals.to(req_to_token.dtype)
    pos = draft_slot_positions(seq_lens, topk, num_steps, page_size)
    return _request_rows(req_to_token, req_pool_indices, pos).to(new_slots.dtype)


def duplicate_last_page_copies(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                               seq_lens: torch.Tensor, topk: int, num_steps: int,
                               page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV copies of case B (D.2 step 2): ``src [N]``, ``dst [N]`` int64 slots,
    ``N = (K - 1) * sum(L_b % P)``, packed request-major, then branch ``j >= 1``, then ``t``.

    ``src = R_b[base_b + t]``, ``dst = R_b[base_b + j * npp_b * P + t]`` for ``t < last_b``.
    Empty when ``P == 1 or K == 1``. Call after ``assign_draft_cache_locs``; reads the number
    of copies from the device (one sync).
    """
    dev = seq_lens.device
    if not uses_duplicated_pages(topk, page_size):
        empty = torch.empty(0, dtype=torch.long, device=dev)
        return empty, empty.clone()
    bs = seq_lens.shape[0]
    L = seq_lens.long()
    last = (L % page_size)[:, None, None]
    base = L[:, None, None] - last
    npp = ceil_div(last + num_steps, page_size)
    j = torch.arange(1, topk, device=dev)[None, :, None]
    t = torch.arange(page_size, device=dev)[None, None, :].expand(bs, topk - 1, page_size)
    keep = t < last
    src_pos = (base + t).expand(bs, topk - 1, page_size)
    dst_pos = base + j * npp * page_size + t
    src = _request_rows(req_to_token, req_pool_indices, src_pos)[keep]
    dst = _request_rows(req_to_token, req_pool_indices, dst_pos)[keep]
    return src, dst


def copy_kv_slots(runner: "DraftRunner", src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy every layer's KV from slots ``src [N]`` to slots ``dst [N]`` (disjoint sets)."""
    if src.shape != dst.shape:
        raise InvalidInputError("dst", f"shape {tuple(src.shape)} like src",
                                f"shape {tuple(dst.shape)}")
    if src.numel() == 0:
        return
    src, dst = src.long(), dst.long()
    pools = ([runner.kv_buffer] if runner.use_mla_backend
             else [runner.k_buffer, runner.v_buffer])
    for pool in pools:
        for buf in pool:
            if buf.element_size() == 1:  # FP8 codes: copied as bytes (no float8 indexing)
                buf = buf.view(torch.uint8)
            buf[dst] = buf[src]


# --- upstream flat layout (D.3) ------------------------------------------------------------


def draft_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, topk: int, num_steps: int, page_size: int,
                     out_cache_loc: Optional[torch.Tensor] = None,
                     index_dtype: torch.dtype = torch.int32, *,
                     max_len: Optional[int] = None, row_width: Optional[int] = None,
                     num_slots: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream ``generate_draft_decode_kv_indices`` for every step at once.

    Returns ``kv_indptr [S, B*K + 1]`` int32 (as upstream) and ``kv_indices [S, row_width]``
    (``index_dtype``).
    Row ``r`` (step ``r``, ``n = r + 1`` history slots), lane ``z = b*K + j``: entries
    ``R_b[0 : L_b]`` then the lane's ``n`` draft slots, starting at
    ``kv_indptr[r, z] = K * sum_{b'<b} L_b' + b*n*K + j*(L_b + n)``; ``kv_indptr[r, B*K]``
    is the used length ``K * sum(L) + B*K*n``; unused entries are 0.

    The draft slots come from ``out_cache_loc [B, K, S]`` when given, else from
    ``req_to_token`` at ``draft_slot_positions`` (the upstream kernel's reading).
    ``row_width`` defaults to ``K * sum(L) + B*K*S``; with ``max_len`` and ``row_width``
    given nothing is read back from the device. ``num_slots``: clamp every entry into the
    pool.
    """
    bs, dev = seq_lens.shape[0], seq_lens.device
    L = seq_lens.long()
    if row_width is None:
        row_width = topk * int(L.sum()) + bs * topk * num_steps
    prefix, pmask = prefix_token_slots(req_to_token, req_pool_indices, seq_lens, max_len,
                                       num_slots=num_slots)
    if out_cache_loc is None:
        hist = _request_rows(req_to_token, req_pool_indices,
                             draft_slot_positions(seq_lens, topk, num_steps, page_size),
                             num_slots)
    else:
        hist = in_pool(out_cache_loc.long(), num_slots)
    lmax = prefix.shape[1]
    cum = torch.cumsum(L, 0) - L
    j = torch.arange(topk, device=dev)
    x = torch.arange(lmax, device=dev)
    kv_indptr = torch.zeros(num_steps, bs * topk + 1, dtype=torch.int32, device=dev)
    # One spare column at the end swallows the padded entries' writes.
    kv_indices = torch.zeros(num_steps, row_width + 1, dtype=index_dtype, device=dev)
    for r in range(num_steps):
        n = r + 1
        off = (topk * cum[:, None] + torch.arange(bs, device=dev)[:, None] * n * topk
               + j[None, :] * (L[:, None] + n))  # [B, K]
        kv_indptr[r, :-1] = off.reshape(-1).to(torch.int32)
        kv_indptr[r, -1] = (topk * L.sum() + bs * topk * n).to(torch.int32)
        pre_dst = off[:, :, None] + x[None, None, :]  # [B, K, Lmax]
        pre_dst = torch.where(pmask[:, None, :], pre_dst, row_width)
        his_dst = (off + L[:, None])[:, :, None] + torch.arange(n, device=dev)  # [B, K, n]
        dst = torch.cat([pre_dst.reshape(-1), his_dst.reshape(-1)])
        src = torch.cat([prefix[:, None, :].expand(bs, topk, lmax).reshape(-1),
                         hist[:, :, :n].reshape(-1)])
        kv_indices[r].scatter_(0, dst.clamp(max=row_width), src.to(index_dtype))
    return kv_indptr, kv_indices[:, :row_width]


# --- page tables ---------------------------------------------------------------------------


def prefix_page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                      seq_lens: torch.Tensor, page_size: int,
                      max_pages: Optional[int] = None, *,
                      num_slots: Optional[int] = None) -> torch.Tensor:
    """Page ids of each prefix: ``[B, max_pages]`` int32, entry ``p`` = ``R_b[p*P] // P`` for
    ``p < ceil(L_b / P)``, 0 past the end. ``max_pages`` defaults to ``ceil(max(L) / P)``.
    ``num_slots``: slots clamped into the pool first (so pages are pool pages)."""
    if max_pages is None:
        max_pages = ceil_div(int(seq_lens.max()), page_size) if seq_lens.numel() else 0
    bs = seq_lens.shape[0]
    p = torch.arange(max_pages, device=seq_lens.device).expand(bs, max_pages)
    valid = p < ceil_div(seq_lens.long(), page_size)[:, None]
    pages = _request_rows(req_to_token, req_pool_indices, p * page_size, num_slots) // page_size
    return torch.where(valid, pages, torch.zeros_like(pages)).to(torch.int32)


def lane_block_table(out: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     out_cache_loc: torch.Tensor, parents: Optional[torch.Tensor], step: int,
                     tree_mode: str, page_size: int, *,
                     num_slots: Optional[int] = None) -> torch.Tensor:
    """Block table of every lane at draft step ``step``, written into ``out [B*K, width]``
    (``num_slots``: slots clamped into the pool first).

    Lane ``z = b*K + j`` sees ``L_b + step + 1`` positions, the prefix then its history:

    - ``page_size == 1``: entries are slots: ``R_b[0 : L_b]`` then the lane's history
      (``lane`` or ``path`` tree mode), so any slot list is expressible;
    - ``page_size > 1``: entries are page ids: the full prefix pages ``R_b[p*P] // P`` for
      ``p*P < base_b`` (``base_b = L_b - L_b % P``), then the lane's own pages at positions
      ``base_b + j*npp_b*P + p'*P`` (``npp_b = ceil((L_b % P + S) / P)``). This is the serving
      engine's draft allocation (``metadata.draft_slot_positions``; ``K == 1`` is its special
      case): the partial last page is duplicated into each lane's first page, so the lane's
      history sits right after the prefix in its own pages. ``lane`` tree mode only.

    Entries past a lane's length are 0. No host sync.
    """
    bs, topk, num_steps = out_cache_loc.shape
    width = out.shape[1]
    dev = out.device
    L = seq_lens.long()
    rows = req_to_token[req_pool_indices.long()]  # [B, ctx]
    x = torch.arange(width, device=dev)
    ctx = req_to_token.shape[1]
    if page_size == 1:
        hist = history_slots(out_cache_loc, parents, step, tree_mode).long()  # [B, K, n]
        pre = torch.gather(rows, 1, x.clamp(max=ctx - 1).expand(bs, width)).long()
        n = step + 1
        hcol = (x[None, :] - L[:, None]).clamp(0, n - 1)  # [B, width]
        his = torch.gather(hist, 2, hcol[:, None, :].expand(bs, topk, width))
        table = in_pool(torch.where((x[None, :] < L[:, None])[:, None, :], pre[:, None, :],
                                    his), num_slots)
        valid = x[None, :] < (L[:, None] + n)
    else:
        P = page_size
        last = L % P
        base = L - last
        npp = ceil_div(last + num_steps, P)
        j = torch.arange(topk, device=dev)
        pos_pre = x * P  # [width]
        own = base[:, None, None] + j[None, :, None] * npp[:, None, None] * P + (
            x[None, None, :] * P - base[:, None, None])  # [B, K, width]
        pos = torch.where(pos_pre[None, None, :] < base[:, None, None],
                          pos_pre[None, None, :].expand(bs, topk, width), own)
        slots = torch.gather(rows[:, None, :].expand(bs, topk, ctx), 2,
                             pos.clamp(0, ctx - 1)).long()
        table = in_pool(slots, num_slots) // P
        valid = x[None, :] < ceil_div(L[:, None] + step + 1, P)
    table = torch.where(valid[:, None, :], table, torch.zeros_like(table))
    out.copy_(table.reshape(bs * topk, width))
    return out


def lane_rows(table: torch.Tensor, lens: torch.Tensor, req_to_token: torch.Tensor,
              batch: "DraftBatch", step: int, page_size: int, *,
              num_slots: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel row per lane at draft step ``step`` (``lane`` tree mode), written into
    ``table [B*K, width]`` (``lane_block_table``) and ``lens [B*K]`` (``L_b + step + 1``).
    No host sync; returns ``(table, lens)``."""
    topk = batch.out_cache_loc.shape[1]
    lane_block_table(table, req_to_token, batch.req_pool_indices, batch.seq_lens,
                     batch.out_cache_loc, None, step, "lane", page_size, num_slots=num_slots)
    lens.copy_(batch.seq_lens.repeat_interleave(topk) + step + 1)
    return table, lens


def history_page_table(out_cache_loc: torch.Tensor, parents: Optional[torch.Tensor],
                       step: int, tree_mode: str = "lane") -> torch.Tensor:
    """Per-lane draft history as a page-size-1 table: ``[B*K, step + 1]`` int32 slot ids."""
    hist = history_slots(out_cache_loc, parents, step, tree_mode)
    return hist.reshape(-1, step + 1).to(torch.int32)
