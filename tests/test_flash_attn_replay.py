"""The FlashAttention glue's table launch (``flash_attn._metadata``) and its CUDA-graph replay
metadata call, on the CPU (interpreter).

- The launch writes the tables, and the graph's fixed buffers, bit for bit as the torch fill
  (``_fill``, used where Triton does not run) and the base class's padding do: random ragged
  batches, page sizes 1 and 16, ``K`` 1 and 4, 1 to 16 prefix chunks, the one-pass routes,
  padded graph batches, strided and int32 index tensors, request rows holding slots outside
  the pool, and small column blocks (several programs and loop trips per row).
- The replay metadata call's host work is fixed: the same Python lines and calls whatever
  the batch size and step count, no torch op, no host read, one launch; the checks run at
  the first call of a signature only (capture included), and again, where values are read
  (CPU tensors), on the values of every call.
- A replay of a kept signature fills the buffers as a first, checked call and as the torch
  path do.
(``tests/gpu/test_host_work_gpu.py``: the same on the H200, and its host time.)
"""

from __future__ import annotations

import pytest
import torch

from helpers import (CountedKernel, checked_replay, first_requests, one_token_fewer,
                     quiet_replay, require_triton_interpret, strided_seq_lens, with_bad_slot)
from specattn.base import _FixedRound
from specattn.data import DraftBatch, DraftExtendBatch
from specattn.errors import InvalidInputError
from test_flash_attn import (HOPPER_FA4, LIBS, installed, make_case_on, make_decode_case,
                             make_extend_case)

require_triton_interpret()

from specattn.backends.flash_attn import _decode, _extend, _metadata  # noqa: E402

FA4_DECODE, FA4_EXTEND = LIBS["fa4"][0], LIBS["fa4"][1]
ROUTES = [("shared", c) for c in (1, 2, 4, 8, 16)] + [("per-branch", 1)]


def _garbage(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``t`` filled with random values (so entries a fill leaves alone are compared too)."""
    t.copy_(torch.randint(-1000, 1000, t.shape, generator=gen).to(t.dtype))
    return t


def _tensors(obj) -> dict:
    return {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


def _same_garbage(a, b, seed: int) -> None:
    for x, y in zip(_tensors(a).values(), _tensors(b).values(), strict=True):
        _garbage(x, torch.Generator().manual_seed(seed))
        _garbage(y, torch.Generator().manual_seed(seed))


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def _caller_tensors(batch: DraftBatch, variant: int) -> DraftBatch:
    """The batch as an engine may hand it: contiguous int64 (variant 0), or int32 columns
    of wider tensors and a transposed ``out_cache_loc`` (variant 1)."""
    if variant == 0:
        return batch
    bs = batch.batch_size
    wide = torch.zeros(bs, 3, dtype=torch.int32)
    wide[:, 0], wide[:, 2] = batch.req_pool_indices, batch.seq_lens
    loc = torch.zeros(bs, batch.num_steps, batch.topk, dtype=torch.int32)
    loc.copy_(batch.out_cache_loc.transpose(1, 2))
    return DraftBatch(wide[:, 0], wide[:, 2], loc.transpose(1, 2), batch.parents)


def _slots_outside_the_pool(case) -> None:
    """Prefix entries below 0 and past the pool (both fills clamp them into the pool)."""
    r2t, b = case.runner.req_to_token, case.batch
    r2t[int(b.req_pool_indices[0]), 0] = -3
    last = b.batch_size - 1
    r2t[int(b.req_pool_indices[last]), int(b.seq_lens[last]) - 1] = case.runner.num_slots + 5


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph-padded"])
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r[0]}-c{r[1]}")
@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_tables_match_the_torch_fill(monkeypatch, page_size, topk, route, padded):
    """Two random ragged rounds per case; the second with small column blocks, int32
    strided index tensors and slots outside the pool."""
    for seed in (0, 1):
        if seed:
            monkeypatch.setattr(_metadata, "MAX_BLOCK_X", 16)
            monkeypatch.setattr(_metadata, "MAX_COLUMN_PROGRAMS", 2)
        case = make_decode_case(bs=3, topk=topk, steps=3, page_size=page_size, seed=seed,
                                max_len=70, min_len=0 if seed else 1)
        if seed:
            _slots_outside_the_pool(case)
        batch = _caller_tensors(case.batch, seed)
        with installed(HOPPER_FA4):
            backend = FA4_DECODE(case.runner, topk, 3)
        max_bs, bs = 5, 4 if padded else 3
        kernel_bufs, torch_bufs = (backend._new_buffers(max_bs, route) for _ in range(2))
        _same_garbage(kernel_bufs, torch_bufs, seed)
        if padded:
            kernel_fixed, torch_fixed = (_FixedRound(max_bs, (max_bs, topk, 3), "cpu",
                                                     with_requests=True) for _ in range(2))
            _same_garbage(kernel_fixed, torch_fixed, seed + 7)
            views = kernel_fixed.views(batch, bs, 1)
            _metadata.decode_tables(batch.req_pool_indices, batch.seq_lens,
                                    batch.out_cache_loc, case.runner, kernel_bufs, bs,
                                    page_size, fixed=(views.req_pool_indices, views.seq_lens,
                                                      views.out_cache_loc))
            backend._fill(torch_bufs, route, torch_fixed.round(batch, bs, 1))
            _assert_same(_tensors(kernel_fixed), _tensors(torch_fixed))
        else:
            _metadata.decode_tables(batch.req_pool_indices, batch.seq_lens,
                                    batch.out_cache_loc, case.runner, kernel_bufs, bs,
                                    page_size)
            backend._fill(torch_bufs, route, batch)
        _assert_same(_tensors(kernel_bufs), _tensors(torch_bufs))


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_tables_match_the_torch_fill(monkeypatch, page_size, fixed):
    for seed in (0, 1):
        if seed:
            monkeypatch.setattr(_metadata, "MAX_BLOCK_X", 16)
            monkeypatch.setattr(_metadata, "MAX_COLUMN_PROGRAMS", 2)
        case = make_extend_case(bs=4, page_size=page_size, seed=seed, ragged=not seed,
                                max_len=60, max_ext=4)
        batch = case.batch
        if seed:  # int32 columns of a wider tensor
            wide = torch.zeros(4, 4, dtype=torch.int32)
            for i, t in enumerate((batch.req_pool_indices, batch.seq_lens, batch.extend_lens)):
                wide[:, i] = t
            batch = DraftExtendBatch(wide[:, 0], wide[:, 1], wide[:, 2], batch.out_cache_loc)
        with installed(HOPPER_FA4):
            backend = FA4_EXTEND(case.runner)
        kernel_bufs, torch_bufs = (_extend._Buffers(6, backend._pages, "cpu")
                                   for _ in range(2))
        _same_garbage(kernel_bufs, torch_bufs, seed)
        tokens = batch.out_cache_loc.shape[0]
        loc = _garbage(torch.zeros(tokens + 3, dtype=torch.int64), torch.Generator())
        want_loc = loc.clone()
        want_loc[:tokens] = batch.out_cache_loc
        _metadata.extend_tables(batch.req_pool_indices, batch.seq_lens, batch.extend_lens,
                                batch.out_cache_loc, case.runner, kernel_bufs, page_size,
                                loc[:tokens] if fixed else None)
        backend._fill(torch_bufs, batch)
        _assert_same(_tensors(kernel_bufs), _tensors(torch_bufs))
        if fixed:
            assert torch.equal(loc, want_loc)


# --- the replay metadata call ----------------------------------------------------------------

# (name, topk, constructor keywords, page size): the two-pass shared route, its split
# prefix, the one-pass routes (K 1, per-branch), path mode, draft extend.
KINDS = [("shared", 2, {}, 16), ("split", 2, {"split_prefix": 4}, 16),
         ("k1", 1, {}, 16), ("per-branch", 2, {"mode": "per-branch"}, 1),
         ("path", 2, {"tree_mode": "path"}, 16), ("extend", 1, {}, 16)]
KIND_IDS = [k[0] for k in KINDS]


def _graph_backend(kind: str, topk: int, options: dict, page_size: int, bs: int,
                   steps: int, seed: int = 0):
    """A backend after ``init_cuda_graph_state`` and a capture at ``bs`` requests; the
    capture's batch and a batch of its signature with other values (path mode: the
    captured ``parents`` tensor, refilled)."""
    options = dict(options, mode=options.get("mode", "shared"))
    if kind == "extend":
        case = make_extend_case(bs=bs, page_size=page_size, seed=seed, max_ext=steps)
        backend = FA4_EXTEND(case.runner, num_steps=steps)
        backend.init_cuda_graph_state(bs, bs * steps)
        backend.init_forward_metadata_capture_cuda_graph(case.batch)
        b, order = case.batch, torch.arange(bs - 1, -1, -1)
        starts = torch.cumsum(b.extend_lens, 0) - b.extend_lens
        loc = torch.cat([b.out_cache_loc[int(starts[i]):int(starts[i] + b.extend_lens[i])]
                         for i in order])
        return backend, case.batch, DraftExtendBatch(
            b.req_pool_indices[order], b.seq_lens[order], b.extend_lens[order], loc)
    case = make_decode_case(bs=bs, topk=topk, steps=steps, page_size=page_size, seed=seed,
                            max_len=50)
    other = make_case_on(case, seed + 1).batch
    first, parents = case.batch, case.batch.parents
    if options.get("tree_mode", "lane") == "lane":  # an engine passes no parents there
        first, parents = DraftBatch(first.req_pool_indices, first.seq_lens,
                                    first.out_cache_loc), None
    backend = FA4_DECODE(case.runner, topk, steps, **options)
    backend.init_cuda_graph_state(bs, bs * topk)
    backend.init_forward_metadata_capture_cuda_graph(first)
    if parents is not None:  # the graph reads the captured tensor: new values go into it
        parents.copy_(other.parents)
    return backend, first, DraftBatch(other.req_pool_indices, other.seq_lens,
                                      other.out_cache_loc, parents)


def _count_launches(monkeypatch) -> list:
    counted = []
    for name in ("_decode_tables_kernel", "_extend_tables_kernel"):
        counted.append(CountedKernel(getattr(_metadata, name)))
        monkeypatch.setattr(_metadata, name, counted[-1])
    return counted


@pytest.mark.parametrize("kind,topk,options,page_size", KINDS, ids=KIND_IDS)
def test_replay_metadata_call_is_fixed_host_work(monkeypatch, kind, topk, options, page_size):
    """At (B 1, S 2) and (B 4, S 5): the same calls and line count, one launch, no torch op,
    no host read, no check of the batch; checks again at a signature not seen."""
    counted = _count_launches(monkeypatch)
    seen = []
    with installed(HOPPER_FA4):
        for bs, steps in ((1, 2), (4, 5)):
            backend, _, batch = _graph_backend(kind, topk, options, page_size, bs, steps)
            assert backend._fills_graph_round()
            for stand_in in counted:
                stand_in.launches, stand_in.idle = 0, True
            calls, lines, ops, checks = quiet_replay(monkeypatch, backend, batch, bs,
                                                     (_decode, _extend))
            assert ops == [] and checks == []
            assert sum(s.launches for s in counted) == 1
            seen.append((calls, lines))
            # Another signature (a strided view): checked, then launched.
            for stand_in in counted:
                stand_in.idle = False
            assert checked_replay(monkeypatch, backend, strided_seq_lens(batch), bs) == 1
    assert seen[0] == seen[1], "host work that grows with the batch size or step count"


def _filled(backend) -> dict:
    """What the metadata call wrote: the round's buffers and its fixed views."""
    out = {k: v.clone() for k, v in _tensors(backend._active).items()}
    batch = backend.batch
    out["out_cache_loc"] = batch.out_cache_loc.clone()
    if isinstance(batch, DraftBatch):
        out["req_pool_indices"] = batch.req_pool_indices.clone()
        out["seq_lens"] = batch.seq_lens.clone()
    return out


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("kind,topk,options,page_size", KINDS, ids=KIND_IDS)
def test_kept_replay_fills_as_a_checked_call(kind, topk, options, page_size, padded):
    """A replay of a kept signature (after the capture, or after a first padded replay), a
    first, checked replay of the same batch on a fresh backend and the torch path (no
    table launch: the base class's copies and ``_fill``) write the same buffers. A kept
    signature's values are still checked on CPU tensors (slots; page alignment)."""
    if padded and kind in ("extend", "path"):
        pytest.skip("extend replays are not padded; path mode pads its own parents tensor")
    bs, steps = 3, 3
    with installed(HOPPER_FA4):
        kept, first, batch = _graph_backend(kind, topk, options, page_size, bs, steps, 1)
        if padded:
            kept.init_forward_metadata_replay_cuda_graph(first_requests(first, 2), bs)
            batch = first_requests(batch, 2)
        kept.init_forward_metadata_replay_cuda_graph(batch, bs)
        assert len(kept._replays) == 1 + padded
        results = [_filled(kept)]
        for meta_kernel in (True, False):
            fresh, _, _ = _graph_backend(kind, topk, options, page_size, bs, steps, 1)
            fresh._replays.clear()
            fresh._meta_kernel = meta_kernel
            fresh.init_forward_metadata_replay_cuda_graph(batch, bs)
            assert fresh._fills_graph_round() == meta_kernel
            # (path mode: ``batch.parents`` is not the tensor this graph reads: copied in,
            # not kept)
            assert bool(fresh._replays) == (meta_kernel and kind != "path")
            results.append(_filled(fresh))
        for other in results[1:]:
            _assert_same(results[0], other)
        if kind != "extend":
            assert kept._route == fresh._route and kept.num_lanes == fresh.num_lanes
        with pytest.raises(InvalidInputError, match="out_cache_loc"):
            kept.init_forward_metadata_replay_cuda_graph(
                with_bad_slot(batch, kept.runner.num_slots), bs)
        if kind == "extend" or kept.two_pass:  # prefixes read through page ids
            r2t = kept.runner.req_to_token
            row = int(batch.req_pool_indices[0])
            r2t[row, 0] += 1  # no longer at its page's offset 0
            with pytest.raises(InvalidInputError, match="page-aligned"):
                kept.init_forward_metadata_replay_cuda_graph(batch, bs)
            r2t[row, 0] -= 1


def test_padded_replays_keep_one_launch_per_signature():
    """Replays of 1, 2 and 3 requests into a graph captured at 3: each signature checked
    once, each replay padded (request row 0, ``seq_lens`` 1, slot 0)."""
    with installed(HOPPER_FA4):
        backend, _, batch = _graph_backend("shared", 2, {}, 16, 3, 3)
        for _ in range(2):
            for raw in (1, 2, 3):
                backend.init_forward_metadata_replay_cuda_graph(first_requests(batch, raw), 3)
                fixed = backend.batch
                assert torch.equal(fixed.seq_lens[:raw], batch.seq_lens[:raw])
                assert fixed.seq_lens[raw:].eq(1).all()
                assert fixed.req_pool_indices[raw:].eq(0).all()
                assert not fixed.out_cache_loc[raw:].any()
                assert backend._active.chunk_used[raw:3].eq(1).all()  # seq_lens 1
        assert len(backend._replays) == 3  # the capture's signature is raw 3's
        with pytest.raises(InvalidInputError, match=r"^bs: "):
            backend.init_forward_metadata_replay_cuda_graph(batch, 4)


def test_extend_replay_of_fewer_tokens_pads_and_of_fewer_requests_is_refused():
    """A replay of one new token fewer than its capture: the fixed ``out_cache_loc`` the
    captured KV write reads holds the batch's slots, then slot 0 (it had kept the capture
    round's last slot, which the replayed write overwrote). A replay of fewer requests is
    refused (the captured tables' grid and slices are the capture's; the engine pads)."""
    case = make_extend_case(bs=3, page_size=1, seed=4, max_ext=3)
    b = case.batch
    with installed(HOPPER_FA4):
        backend = FA4_EXTEND(case.runner, num_steps=3)
    tokens = int(b.extend_lens.sum())
    backend.init_cuda_graph_state(3, 9)
    backend.init_forward_metadata_capture_cuda_graph(b)
    fixed = backend._require_graph_state().loc
    assert int(fixed[tokens - 1]) != 0
    fewer = one_token_fewer(b)
    backend.init_forward_metadata_replay_cuda_graph(fewer, 3)
    assert torch.equal(fixed[:tokens - 1], fewer.out_cache_loc) and int(fixed[tokens - 1]) == 0
    n = int(b.extend_lens[0])
    with pytest.raises(InvalidInputError, match=r"^batch: expected the 3 requests of the "
                                                r"capture .*got 1 requests$"):
        backend.init_forward_metadata_replay_cuda_graph(DraftExtendBatch(
            b.req_pool_indices[:1], b.seq_lens[:1], b.extend_lens[:1], b.out_cache_loc[:n]), 3)
