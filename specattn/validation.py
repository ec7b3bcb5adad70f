"""The one input-validation layer every backend goes through.

Checks are cheap by default: shapes, dtypes, devices, strides and Python ints. Checks that
need the *values* of tensors (lengths against ``max_context_len``, slots inside the pool,
``parents`` in range) run when those tensors are on the CPU (no device sync) or when
``SPECATTN_DEBUG_CHECKS=1`` / ``debug=True`` asks for them on a device. Every failure raises
``InvalidInputError`` naming the argument, the expectation and the value.

``check_runner`` is ``specattn.data``'s (a runner checks itself when built) and the tensor
checks and ``debug_checks_enabled`` are ``specattn._tensor_checks``'s; all are re-exported
here. ``data`` imports neither
this module nor anything that does.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from ._tensor_checks import (
    ACT_DTYPES,
    INDEX_DTYPES,
    _is_int,
    _last_dim_contiguous,
    _same_device,
    _shape,
    _tensor,
    check_tensor,
    debug_checks_enabled,
)
from .data import HOST_COPIES, DraftBatch, DraftExtendBatch, DraftRunner, check_runner
from .errors import InvalidInputError
from .keys import check_draft_params
from .layer import AttentionLayer

__all__ = [
    "check_draft_params", "check_tensor", "check_runner", "check_decode_batch",
    "check_decode_forward", "check_padding_slot", "check_parents_copied",
    "check_extend_batch", "check_extend_forward", "debug_checks_enabled",
    "graph_checks_read_values", "check_whole_pages",
    "ACT_DTYPES", "INDEX_DTYPES",
]


def check_whole_pages(runner: DraftRunner, backend: str, page_size: Optional[int] = None
                      ) -> None:
    """Pools of whole pages, for a backend whose library views a pool as ``[num_slots //
    page_size, page_size, ...]``: a slot of a partial last page is in no page its page
    table can name (an engine's pools are whole pages). ``page_size``: the library's, if not
    the runner's."""
    size = runner.page_size if page_size is None else page_size
    if runner.num_slots % size:
        raise InvalidInputError("runner pools", f"a slot count that is a multiple of the "
                                f"page size {size} ({backend} pages the pool)",
                                runner.num_slots)


def _scan_values(t: torch.Tensor, debug: Optional[bool]) -> bool:
    if debug is None:
        debug = debug_checks_enabled()
    return debug or t.device.type == "cpu"


def graph_checks_read_values(*tensors: torch.Tensor) -> bool:
    """Whether a graph round's checks (no debug pass) read the values of ``tensors``: CPU
    tensors only. Where they do not, those checks depend only on the tensors' dtypes, shapes,
    strides and devices."""
    return any(_scan_values(t, False) for t in tensors)


def _check_index_values(name: str, t: torch.Tensor, lo: int, hi: int,
                        debug: Optional[bool]) -> None:
    """All values of ``t`` in ``[lo, hi)``."""
    if t.numel() == 0 or not _scan_values(t, debug):
        return
    mn, mx = int(t.min()), int(t.max())
    if mn < lo or mx >= hi:
        bad = mn if mn < lo else mx
        raise InvalidInputError(name, f"values in [{lo}, {hi})", f"a value {bad}")


def _requests(batch, kind: type, device: torch.device,
              max_bs: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch with the fields of dataclass ``kind`` (any object that has them): its
    ``req_pool_indices [B]`` (``1 <= B <= max_bs``) and ``seq_lens [B]``."""
    fields = tuple(f.name for f in dataclasses.fields(kind) if f.name not in HOST_COPIES)
    if not all(hasattr(batch, f) for f in fields):
        raise InvalidInputError("batch", f"a specattn.{kind.__name__} ({', '.join(fields)})",
                                type(batch).__name__)
    rpi = _tensor("batch.req_pool_indices", batch.req_pool_indices, dtypes=INDEX_DTYPES,
                  ndim=1, device=device)
    bs = rpi.shape[0]
    if bs < 1:
        raise InvalidInputError("batch.req_pool_indices", "at least one request", "0")
    if max_bs is not None and bs > max_bs:
        raise InvalidInputError("batch.req_pool_indices",
                                f"at most max_bs={max_bs} requests (init_cuda_graph_state)", bs)
    seq = _tensor("batch.seq_lens", batch.seq_lens, dtypes=INDEX_DTYPES, ndim=1, device=device)
    _shape("batch.seq_lens", seq, (bs,))
    return rpi, seq


def _check_host_copies(batch, debug: Optional[bool]) -> None:
    """The host copies a batch gives (``data.HOST_COPIES``): ``[B]`` int tensors on the CPU,
    equal to the tensors they mirror where values are checked (``_scan_values``: on a device
    only with debug checks, as the comparison syncs)."""
    for name, mirrored in HOST_COPIES.items():
        host = getattr(batch, name, None)
        if host is None:
            continue
        host = _tensor(f"batch.{name}", host, dtypes=INDEX_DTYPES, ndim=1,
                       device=torch.device("cpu"))
        dev = getattr(batch, mirrored)
        _shape(f"batch.{name}", host, tuple(dev.shape))
        if not _scan_values(dev, debug):
            continue
        differ = (host.to(torch.int64) != dev.to("cpu", torch.int64)).nonzero()
        if differ.numel():  # the first differing request: the lists can be B long
            b = int(differ[0, 0])
            raise InvalidInputError(f"batch.{name}", f"the values of batch.{mirrored}",
                                    f"{name}[{b}]={int(host[b])} ({mirrored}[{b}]="
                                    f"{int(dev[b])})")


def _check_distinct(name: str, loc: torch.Tensor, debug: Optional[bool]) -> None:
    """Every token gets its own slot: two tokens in one slot lose one's KV and make the
    result depend on write order."""
    if loc.numel() < 2 or not _scan_values(loc, debug):
        return
    flat = loc.reshape(-1)
    ordered = flat.sort().values
    same = (ordered[1:] == ordered[:-1]).nonzero()
    if same.numel():
        slot = int(ordered[int(same[0, 0])])
        raise InvalidInputError(name, "a distinct slot for every token",
                                f"slot {slot} given to {int((flat == slot).sum())} tokens")


def _prefix_rows(runner: DraftRunner, rpi: torch.Tensor,
                 lengths: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(rows [B, max L], live [B, max L])``: ``req_to_token``'s rows of the requests and
    which entries a prefix covers (``lengths``, in range); ``None`` without prefixes."""
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest <= 0:
        return None
    rows = runner.req_to_token[rpi.long(), :longest]
    live = torch.arange(longest, device=rows.device)[None, :] < lengths.to(rows.device)[:, None]
    return rows, live


def _check_prefix_slots(runner: DraftRunner, rpi: torch.Tensor, lengths: torch.Tensor,
                        debug: Optional[bool]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``req_to_token[req_pool_indices[b], 0 : lengths[b]]`` are slots of the pool: a kernel
    gathers every one of them. Call after ``rpi`` and ``lengths`` are known in range.
    Returns ``_prefix_rows`` where the values were scanned."""
    if rpi.numel() == 0 or not _scan_values(rpi, debug):
        return None
    prefix = _prefix_rows(runner, rpi, lengths)
    if prefix is None:
        return None
    rows, live = prefix
    bad = live & ((rows < 0) | (rows >= runner.num_slots))
    if bool(bad.any()):
        b, x = (int(i) for i in bad.nonzero()[0])
        raise InvalidInputError(
            "runner.req_to_token", f"slots in [0, {runner.num_slots}) at every position a "
            "request's prefix covers", f"req_to_token[{int(rpi[b])}, {x}] = {int(rows[b, x])} "
            f"(request {b}, seq_lens {int(lengths[b])})")
    return prefix


def _check_draft_slots_free(loc: torch.Tensor, rpi: torch.Tensor,
                            prefix: tuple[torch.Tensor, torch.Tensor]) -> None:
    """No draft slot holds a prefix token of the batch: a decode step writes every lane's
    KV into its slot, which would overwrite committed KV that later reads see."""
    rows, live = prefix
    taken = torch.isin(loc.reshape(-1).to(rows.device, rows.dtype), rows[live])
    if bool(taken.any()):
        i = int(taken.nonzero()[0, 0])
        slot = int(loc.reshape(-1)[i])
        b, x = (int(j) for j in ((rows == slot) & live).nonzero()[0])
        raise InvalidInputError(
            "batch.out_cache_loc", "slots that hold no prefix token of the batch (a decode "
            "step overwrites them)", f"slot {slot}, req_to_token[{int(rpi[b])}, {x}]")


def _check_new_token_slots(loc: torch.Tensor, rpi: torch.Tensor, seq: torch.Tensor,
                           ext: torch.Tensor,
                           prefix: tuple[torch.Tensor, torch.Tensor]) -> None:
    """An extend's new tokens sit at the end of their requests' ``req_to_token`` rows:
    ``out_cache_loc`` (request-major) is ``req_to_token[rpi[b], seq[b] - ext[b] : seq[b]]``.
    Where they differ, a backend that reads the new tokens from the pool and one that reads
    them from ``k`` / ``v`` give different answers."""
    rows, live = prefix
    pos = torch.arange(rows.shape[1], device=rows.device)[None, :]
    new = live & (pos >= (seq - ext).to(rows.device)[:, None])
    expected = rows[new]  # row-major: request-major, then position, as out_cache_loc
    differ = (loc.to(rows.device, rows.dtype) != expected).nonzero()
    if differ.numel():
        i = int(differ[0, 0])
        b, x = (int(j) for j in new.nonzero()[i])
        raise InvalidInputError(
            "batch.out_cache_loc", "the new tokens' slots in req_to_token (request-major, "
            "req_to_token[rpi[b], seq_lens[b] - extend_lens[b] : seq_lens[b]])",
            f"out_cache_loc[{i}] = {int(loc[i])}, req_to_token[{int(rpi[b])}, {x}] = "
            f"{int(expected[i])}")


def check_decode_batch(runner: DraftRunner, topk: int, num_steps: int, tree_mode: str,
                       batch: DraftBatch, *, debug: Optional[bool] = None,
                       max_bs: Optional[int] = None, graph: bool = False) -> None:
    """A ``DraftBatch`` fits the runner, ``topk`` and ``num_steps`` (``semantics.md``).

    ``graph``: a captured/replayed round, whose padded lanes share the padding slot (the
    distinct-slot rule is not checked there)."""
    dev = runner.device
    rpi, seq = _requests(batch, DraftBatch, dev, max_bs)
    bs = rpi.shape[0]
    loc = _tensor("batch.out_cache_loc", batch.out_cache_loc, dtypes=INDEX_DTYPES, ndim=3,
                  device=dev)
    _shape("batch.out_cache_loc", loc, (bs, topk, num_steps))
    if tree_mode == "path":
        if batch.parents is None:
            raise InvalidInputError("batch.parents", "a [num_steps, B, topk] tensor in "
                                    "tree_mode='path'", None)
        par = _tensor("batch.parents", batch.parents, dtypes=INDEX_DTYPES, ndim=3, device=dev)
        _shape("batch.parents", par, (num_steps, bs, topk))
        _last_dim_contiguous("batch.parents", par)  # kernels step through lanes by 1
    _check_host_copies(batch, debug)
    _check_index_values("batch.req_pool_indices", rpi, 0, runner.max_reqs, debug)
    _check_index_values("batch.out_cache_loc", loc, 0, runner.num_slots, debug)
    # Lane histories need up to num_steps extra positions past the prefix.
    _check_index_values("batch.seq_lens", seq, 0, runner.max_context_len + 1, debug)
    if not graph:
        _check_distinct("batch.out_cache_loc", loc, debug)
    if _scan_values(rpi, debug):  # (the clamp is a launch: only where the scan runs)
        prefix = _check_prefix_slots(runner, rpi, seq.clamp(max=runner.max_context_len), debug)
        if prefix is not None and not graph and _scan_values(loc, debug):
            _check_draft_slots_free(loc, rpi, prefix)


def check_replay_slots(runner: DraftRunner, batch: Union[DraftBatch, DraftExtendBatch],
                       debug: Optional[bool] = None) -> None:
    """A graph replay's slots: distinct, and (decode) none holding a prefix token of the
    batch, as in an eager round, except in page 0, where an engine's padding lanes or
    tokens share slots (a capture's dummy batch is not checked)."""
    loc = batch.out_cache_loc
    if not _scan_values(loc, debug):
        return
    flat = loc.reshape(-1)
    loc = flat[flat >= runner.page_size]
    _check_distinct("batch.out_cache_loc", loc, debug)
    if isinstance(batch, DraftBatch) and _scan_values(batch.req_pool_indices, debug):
        seq = batch.seq_lens.clamp(max=runner.max_context_len)
        prefix = _prefix_rows(runner, batch.req_pool_indices, seq)
        if prefix is not None:
            _check_draft_slots_free(loc, batch.req_pool_indices, prefix)


def _engine_padding(runner: DraftRunner, batch: DraftExtendBatch,
                    loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``loc [T]`` (the batch's ``out_cache_loc``) -> ``(requests [B], tokens [T])`` bool:
    which of an extend batch's requests, and their tokens, are the engine's own padding:
    request row 0 with every new token in page 0. An engine pads a round to the captured
    number of requests this way (``semantics.md``), and those tokens write the dummy slot
    whether or not the backend pads further."""
    ext = batch.extend_lens.to(loc.device).long()
    owner = torch.repeat_interleave(torch.arange(ext.shape[0], device=loc.device), ext)
    outside = (loc >= runner.page_size).long()
    stray = torch.zeros(ext.shape[0], dtype=torch.long, device=loc.device)
    stray.index_add_(0, owner, outside)
    padding = (batch.req_pool_indices.to(loc.device) == 0) & (stray == 0)
    return padding, padding[owner]


def check_padding_slot(runner: DraftRunner, batch: Union[DraftBatch, DraftExtendBatch],
                       debug: Optional[bool] = None) -> None:
    """A replay padded to its captured size: the padding (decode: lanes, at every step;
    extend: tokens) writes pool slot 0, so no token of the batch's requests may live there
    (a prefix token would be overwritten and read back, a new token's slot shared). An
    extend batch's own padding requests (``_engine_padding``) are left out: their tokens are
    meant for slot 0."""
    loc = batch.out_cache_loc
    rpi, seq = batch.req_pool_indices, batch.seq_lens
    at_zero = loc == 0 if _scan_values(loc, debug) else None
    if isinstance(batch, DraftExtendBatch) and at_zero is not None and loc.numel():
        padding, padded_tokens = _engine_padding(runner, batch, loc)
        at_zero &= ~padded_tokens
        seq = seq.masked_fill(padding.to(seq.device), 0)  # no prefix of theirs is checked
    if at_zero is not None and bool(at_zero.any()):
        at = ", ".join(str(int(x)) for x in at_zero.nonzero()[0])
        raise InvalidInputError("batch.out_cache_loc", "no slot 0 in a replay padded to the "
                                "captured size (the padding writes slot 0)",
                                f"slot 0 at out_cache_loc[{at}]")
    if not _scan_values(rpi, debug):
        return
    prefix = _prefix_rows(runner, rpi, seq.clamp(max=runner.max_context_len))
    if prefix is None:
        return
    rows, live = prefix
    hit = (live & (rows == 0)).nonzero()
    if hit.numel():
        b, x = int(hit[0, 0]), int(hit[0, 1])
        raise InvalidInputError("runner.req_to_token", "no prefix token in slot 0 in a replay "
                                "padded to the captured size (the padding writes slot 0: "
                                "keep it a dummy slot)",
                                f"req_to_token[{int(rpi[b])}, {x}] = 0 (request {b})")


def check_parents_step(batch: DraftBatch, step: int, topk: int,
                       debug: Optional[bool] = None) -> None:
    """``parents[1 : step + 1]`` are lane indices in ``[0, topk)``."""
    if batch.parents is None or step == 0:
        return
    _check_index_values(f"batch.parents[1:{step + 1}]", batch.parents[1:step + 1], 0, topk,
                        debug)


def check_parents_copied(given: torch.Tensor, used: torch.Tensor, step: int,
                         debug: Optional[bool] = None) -> None:
    """After a replay metadata call whose ``batch.parents`` (``given``) went into another
    tensor (the one given at capture, which the graph reads; ``used``, its first ``B``
    requests), row ``step`` of ``given`` is still what ``used`` holds: a row the draft loop
    wrote to ``given`` after the call would not be seen."""
    if step == 0 or not _scan_values(given, debug):
        return
    if not torch.equal(given[step].to(used.device, used.dtype), used[step]):
        raise InvalidInputError(
            "batch.parents", "each row filled in place in the tensor given at capture "
            "(the graph reads it; a replay's other tensor is copied into it at the replay "
            "call)", f"row {step} of the replay's tensor written after "
            "init_forward_metadata_replay_cuda_graph")


def check_decode_forward(runner: DraftRunner, num_lanes: int, num_steps: int, step: int,
                         layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                         v: Optional[torch.Tensor]) -> None:
    """One ``forward(step, layer, q, k, v)`` call's arguments."""
    if not _is_int(step) or not 0 <= step < num_steps:
        raise InvalidInputError("step", f"an int in [0, {num_steps})", repr(step))
    _check_layer(runner, layer)
    _check_qkv(runner, num_lanes, q, k, v)


def check_extend_batch(runner: DraftRunner, batch: DraftExtendBatch, *,
                       debug: Optional[bool] = None,
                       max_extend_len: Optional[int] = None, graph: bool = False) -> None:
    """``max_extend_len``: a backend's bound on ``extend_lens`` (its graph grid), checked
    where values are scanned (CPU tensors or debug checks). ``graph``: a captured/replayed
    batch, whose padding tokens may share a slot."""
    dev = runner.device
    rpi, seq = _requests(batch, DraftExtendBatch, dev, None)
    bs = rpi.shape[0]
    ext = _tensor("batch.extend_lens", batch.extend_lens, dtypes=INDEX_DTYPES, ndim=1,
                  device=dev)
    _shape("batch.extend_lens", ext, (bs,))
    loc = _tensor("batch.out_cache_loc", batch.out_cache_loc, dtypes=INDEX_DTYPES, ndim=1,
                  device=dev)
    _check_host_copies(batch, debug)
    _check_index_values("batch.req_pool_indices", rpi, 0, runner.max_reqs, debug)
    _check_index_values("batch.out_cache_loc", loc, 0, runner.num_slots, debug)
    _check_index_values("batch.seq_lens", seq, 1, runner.max_context_len + 1, debug)
    _check_index_values("batch.extend_lens", ext, 1, runner.max_context_len + 1, debug)
    if max_extend_len is not None and ext.numel() and _scan_values(ext, debug):
        longest = int(ext.max())
        if longest > max_extend_len:
            raise InvalidInputError("batch.extend_lens", f"values <= max_extend_len="
                                    f"{max_extend_len} (the backend's CUDA-graph bound)",
                                    f"a value {longest}")
    if _scan_values(ext, debug):
        total = int(ext.sum())
        _shape("batch.out_cache_loc", loc, (total,))
        short = (seq < ext).nonzero()
        if short.numel():
            b = int(short[0, 0])
            raise InvalidInputError("batch.seq_lens", "seq_lens >= extend_lens (seq_lens "
                                    "includes the new tokens)",
                                    f"seq_lens[{b}]={int(seq[b])} < extend_lens[{b}]="
                                    f"{int(ext[b])}")
        if not graph:
            _check_distinct("batch.out_cache_loc", loc, debug)
        prefix = _check_prefix_slots(runner, rpi, seq, debug)
        if prefix is not None and not graph and _scan_values(loc, debug):
            _check_new_token_slots(loc, rpi, seq, ext, prefix)


def check_extend_forward(runner: DraftRunner, num_tokens: Optional[int],
                         layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                         v: Optional[torch.Tensor]) -> None:
    _check_layer(runner, layer)
    _check_qkv(runner, num_tokens, q, k, v)


def _check_layer(runner: DraftRunner, layer: AttentionLayer) -> None:
    if not isinstance(layer, AttentionLayer):
        raise InvalidInputError("layer", "a specattn.AttentionLayer", type(layer).__name__)
    if layer.layer_id >= runner.num_layers:
        raise InvalidInputError("layer.layer_id", f"< num_layers={runner.num_layers}",
                                layer.layer_id)
    if runner.fp8:  # the kernels read a tensor scale where it lives: on the pools' device
        for name in ("k_scale", "v_scale"):
            scale = getattr(layer, name)
            if isinstance(scale, torch.Tensor) and not _same_device(scale.device,
                                                                    runner.device):
                raise InvalidInputError(f"layer.{name}", f"a float or a tensor on "
                                        f"{runner.device} (the pools' device)",
                                        f"a tensor on {scale.device}")


def _check_qkv(runner: DraftRunner, rows: Optional[int], q: torch.Tensor, k: torch.Tensor,
               v: Optional[torch.Tensor]) -> None:
    dev, dt = runner.device, (runner.dtype,)
    q = _tensor("q", q, dtypes=dt, ndim=3, device=dev)
    n = q.shape[0] if rows is None else rows
    if runner.use_mla_backend:
        width = runner.head_dim  # MLA: kv_lora_rank + qk_rope_head_dim
        _shape("q", q, (n, runner.num_heads, width))
        k = _tensor("k", k, dtypes=dt, ndim=2, device=dev)
        _shape("k", k, (n, width))
        if v is not None:
            raise InvalidInputError("v", "None for MLA (the latent k carries both)",
                                    f"a tensor of shape {tuple(v.shape)}")
    else:
        _shape("q", q, (n, runner.num_q_heads, runner.head_dim))
        k = _tensor("k", k, dtypes=dt, ndim=3, device=dev)
        _shape("k", k, (n, runner.num_kv_heads, runner.head_dim))
        v = _tensor("v", v, dtypes=dt, ndim=3, device=dev)
        _shape("v", v, (n, runner.num_kv_heads, runner.v_head_dim))
        _last_dim_contiguous("v", v)
    _last_dim_contiguous("q", q)
    _last_dim_contiguous("k", k)
