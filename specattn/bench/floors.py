"""The read floor of a ``specattn bench`` case: the least time one kernel launch takes to
only read the case's bytes with its paging, timed as a step is timed.

The bytes are those of the copy floor (``Case.kv_bytes``: every prefix once plus every lane's
history at the timed step; extend: every request's KV), read from the case's own pools in
their layout (MHA: a row of ``k_buffer[layer]`` and one of ``v_buffer[layer]`` per token;
MLA: a row of ``kv_buffer[layer]``; FP8 pools: one byte an element) through the slots its
slot table lists: per request the prefix ``req_to_token[r, :L]``, then its lanes' history
slots. One launch per layer; the layers rotate inside one CUDA graph as the step's do
(``harness.time_per_layer``).

The kernel (``_gather_rows``) is not attention: each program loads a block of slots, then
the rows they name, and stores the sum of what it read (so no load is dropped). The least
time over a few block sizes is the row's time. It answers whether a target stated against
the copy floor can be met by any single paged launch at the case's size.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from ..errors import InvalidInputError
from ..fp8 import is_fp8_dtype
from ..metadata import lane_history_slots, prefix_token_slots
from .baselines import layer_pools
from .harness import Setup, short_error, time_per_layer

__all__ = ["READ_TILES", "split_row", "case_slots", "case_pools", "read_launches",
           "read_floor_ms"]

# (bytes of KV per program, warps) tried; the least time is kept.
READ_TILES = ((32768, 4), (65536, 8))


@triton.jit
def _gather_rows(a_ptr, b_ptr, slots_ptr, out_ptr, n_keys, stride_a, stride_b,
                 HEAD: tl.constexpr, TAIL: tl.constexpr, KEYS: tl.constexpr,
                 TWO: tl.constexpr):
    # Rows of HEAD + TAIL elements (powers of two; TAIL may be 0) at pool[slot]; TWO: a
    # second pool (V) read at the same slots.
    pid = tl.program_id(0)
    k = pid * KEYS + tl.arange(0, KEYS)
    live = k < n_keys
    slot = tl.load(slots_ptr + k, mask=live, other=0).to(tl.int64)
    a = a_ptr + slot[:, None] * stride_a
    total = tl.sum(tl.sum(tl.load(a + tl.arange(0, HEAD)[None, :], mask=live[:, None],
                                  other=0.0).to(tl.float32), axis=1), axis=0)
    if TAIL > 0:
        total += tl.sum(tl.sum(tl.load(a + HEAD + tl.arange(0, TAIL)[None, :],
                                       mask=live[:, None], other=0.0).to(tl.float32),
                               axis=1), axis=0)
    if TWO:
        b = b_ptr + slot[:, None] * stride_b
        total += tl.sum(tl.sum(tl.load(b + tl.arange(0, HEAD)[None, :], mask=live[:, None],
                                       other=0.0).to(tl.float32), axis=1), axis=0)
        if TAIL > 0:
            total += tl.sum(tl.sum(tl.load(b + HEAD + tl.arange(0, TAIL)[None, :],
                                           mask=live[:, None], other=0.0).to(tl.float32),
                                   axis=1), axis=0)
    tl.store(out_ptr + pid, total)


def split_row(row: int) -> tuple[int, int]:
    """``row`` elements as a power of two plus a smaller power of two or 0: 576 -> (512, 64),
    1024 -> (1024, 0)."""
    if not isinstance(row, int) or row < 1:
        raise InvalidInputError("row", "an int >= 1", repr(row))
    head = 1 << (row.bit_length() - 1)
    tail = row - head
    if tail & (tail - 1):
        raise InvalidInputError("row", "a sum of two powers of two elements (512 + 64)", row)
    return head, tail


def case_slots(setup: Setup) -> torch.Tensor:
    """The slots the case reads, int32, request by request: the prefix through the slot
    table (decode: ``seq_lens``; extend: the whole request, new tokens included), then every
    lane's history at the timed step (decode)."""
    case, runner, batch = setup.case, setup.runner, setup.batch
    slots, valid = prefix_token_slots(runner.req_to_token, batch.req_pool_indices,
                                      batch.seq_lens)
    parts = []
    history = (lane_history_slots(batch.out_cache_loc, case.timed_step)
               if case.kind == "decode" else None)
    for r in range(slots.shape[0]):
        parts.append(slots[r][valid[r]])
        if history is not None:
            parts.append(history[r].reshape(-1).long())
    return torch.cat(parts).to(torch.int32)


def case_pools(setup: Setup, layer: int) -> list[torch.Tensor]:
    """Layer ``layer``'s pools as ``[num_slots, row]`` views (MHA: K then V; MLA: the latent
    pool); FP8 pools as their bytes (``uint8``: the launch reads bytes, not values)."""
    out = []
    for pool in layer_pools(setup.runner, layer):
        flat = pool.reshape(pool.shape[0], -1)
        if is_fp8_dtype(flat.dtype):
            flat = flat.view(torch.uint8)
        if flat.stride(-1) != 1:
            raise InvalidInputError("pool", "rows contiguous in memory", tuple(pool.stride()))
        out.append(flat)
    return out


def read_launches(setup: Setup, tile_bytes: int = READ_TILES[0][0], num_warps: int = 4,
                  ) -> tuple[list[Callable[[], None]], torch.Tensor]:
    """One launch per layer of ``setup`` reading the case's bytes (``case_slots`` through that
    layer's pools), and the output the launches write (one float per program)."""
    case = setup.case
    slots = case_slots(setup).to(setup.device)
    layer_pools = [case_pools(setup, layer.layer_id) for layer in setup.layers]
    row = layer_pools[0][0].shape[1]
    head, tail = split_row(row)
    keys = 1 << max(0, (tile_bytes // case.row_bytes).bit_length() - 1)
    n = int(slots.numel())
    grid = (triton.cdiv(n, keys),)
    out = torch.empty(grid[0], device=setup.device, dtype=torch.float32)

    def launch(pools):
        a, b = pools[0], pools[-1]
        return lambda: _gather_rows[grid](a, b, slots, out, n, a.stride(0), b.stride(0),
                                          HEAD=head, TAIL=tail, KEYS=keys,
                                          TWO=len(pools) == 2, num_warps=num_warps)
    return [launch(p) for p in layer_pools], out


def read_floor_ms(setup: Setup, clock, tiles=READ_TILES) -> tuple[float, str, list[str]]:
    """Milliseconds of one launch that reads the case's bytes (the least over ``tiles``),
    timed as ``time_step`` times a step; how it was timed; notes (a tile that failed)."""
    best, timing, notes, error = None, "", [], None
    for tile_bytes, warps in tiles:
        launches, _ = read_launches(setup, tile_bytes, warps)

        def all_layers(launches=launches):
            for launch in launches:
                launch()
        try:
            ms, how, more = time_per_layer(clock, all_layers, len(launches), setup.device)
        except Exception as exc:  # one tile size failing leaves the others
            notes.append(f"read tile {tile_bytes} B / {warps} warps failed "
                         f"({short_error(exc)})")
            error = exc
            continue
        notes += more
        if best is None or ms < best:
            best, timing = ms, how
    if best is None:
        raise error
    return best, timing, notes
