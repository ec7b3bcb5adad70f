"""CPU tests of the FlashAttention backends (``fa3``, ``fa4``, MUSA flavours) via stand-ins.

The libraries are replaced by ``tests/standins/fa_*.py``: modules with the documented
signatures that check their arguments and compute the answer in torch from exactly what they
receive (page table, key counts, head-major natural-log LSE). The glue's outputs are compared
with ``torch_ref`` only. Pools are NaN except the slots a lane may read (and slot 0, the
padding slot), allocations are page-aligned like an engine's. The case builders are reused by
``tests/gpu/test_flash_attn_gpu.py`` against the real libraries.

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``); this file keeps the ones specific to FlashAttention:
the recorded library calls, page sizes the kit does not reach, ``mode``, ``split_prefix``
and the merge variants, graph buffers, the LSE layout, routing, fallback and errors.
"""

from __future__ import annotations

import logging
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from helpers import extend_lengths, fill_slots, poison_pools
from helpers import randn_qkv as qkv
from specattn import metadata
from specattn.backends import flash_attn as fa
from specattn.backends.flash_attn import _library
from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from specattn.errors import BackendUnavailableError, InvalidInputError
from specattn.keys import BackendRequest
from specattn.kernels.lse import merge_states
from specattn.listing import list_backends
from specattn.platforms import Platform, use_platform
from specattn.selection import select
from standins import fa_cute, fa_interface, fa_mate
from standins.flash_attn_family import ALL as ALL_FA_MODULES
from standins.flash_attn_family import flash_attn_modules, swapped_modules

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
HOPPER_FA4 = Platform("cuda", (9, 0), libraries={"flash_attn.cute"})
HOPPER_FA3 = Platform("cuda", (9, 0), libraries={"flash_attn_interface"})
MUSA = Platform("musa", libraries={"mate"})
# (decode class, extend class, platform, stand-in recorder)
LIBS = {
    "fa4": (fa.FA4Decode, fa.FA4Extend, HOPPER_FA4, fa_cute.RECORDER),
    "fa3": (fa.FA3DecodeSM90, fa.FA3ExtendSM90, HOPPER_FA3, fa_interface.RECORDER),
    "fa3-via-fa4": (fa.FA3DecodeSM90, fa.FA3ExtendSM90, HOPPER_FA4, fa_cute.RECORDER),
    "mate": (fa.FA4DecodeMUSA, fa.FA4ExtendMUSA, MUSA, fa_mate.RECORDER),
}


# --- stand-in installation -------------------------------------------------------------------


@contextmanager
def installed(platform: Platform, modules=ALL_FA_MODULES):
    """Put the stand-ins where ``importlib`` finds them and make ``platform`` current."""
    with swapped_modules(flash_attn_modules(modules)):
        for rec in (fa_cute.RECORDER, fa_interface.RECORDER, fa_mate.RECORDER):
            rec.clear()
        with use_platform(platform):
            yield


# --- case builders (also used by the GPU tests) ----------------------------------------------


@dataclass
class Case:
    runner: DraftRunner
    batch: object
    layer: AttentionLayer


def _pages_for(gen, count: int, free: list) -> list:
    return [free.pop() for _ in range(count)]


def _paged_runner(total_pages: int, page_size: int, max_reqs: int, max_ctx: int, dtype,
                  device, heads, gen) -> DraftRunner:
    hq, hkv, d = heads
    runner = DraftRunner.mha(hq, hkv, d, num_layers=2, num_slots=total_pages * page_size,
                             max_reqs=max_reqs, max_context_len=max_ctx, page_size=page_size,
                             dtype=dtype, device=device)
    return poison_pools(runner, gen)  # NaN, random values in slot 0 (the padding slot)


def _allocate(lens: torch.Tensor, page_size: int, max_ctx: int, gen):
    """Page-aligned rows: request ``b`` owns random whole pages (page 0 is reserved),
    ``R_b[x] = pages[x // P] * P + x % P`` for ``x < lens[b]``. Returns the rows and the
    number of pages."""
    need = [math.ceil(int(n) / page_size) for n in lens]
    total = sum(need) + 2
    free = (torch.randperm(total - 1, generator=gen) + 1).tolist()
    rows = torch.zeros(len(need), max_ctx, dtype=torch.int32)
    for b, n in enumerate(need):
        pages = torch.tensor(_pages_for(gen, n, free), dtype=torch.int64)
        x = torch.arange(int(lens[b]))
        rows[b, :int(lens[b])] = (pages[x // page_size] * page_size + x % page_size).int()
    return rows, total


def make_decode_case(*, bs=3, topk=2, steps=3, page_size=1, dtype=torch.bfloat16,
                     device="cpu", seed=0, ragged=True, max_len=40, min_len=1,
                     heads=(4, 2, 16), logit_cap=0.0) -> Case:
    """A draft round on an engine-like paged allocation (draft slots per
    ``metadata.assign_draft_cache_locs``, page-duplicating layout when ``P > 1 and K > 1``)."""
    gen = torch.Generator().manual_seed(seed)
    seq = (torch.randint(min_len, max_len + 1, (bs,), generator=gen) if ragged
           else torch.full((bs,), max_len))
    ext = metadata.draft_extend_lens(seq, topk, steps, page_size)
    max_ctx = max_len + metadata.max_draft_extend_len(topk, steps, page_size) + page_size
    rows, total_pages = _allocate(seq + ext, page_size, max_ctx, gen)
    max_reqs = bs + 2
    runner = _paged_runner(total_pages, page_size, max_reqs, max_ctx, dtype, device, heads, gen)
    rpi = torch.randperm(max_reqs, generator=gen)[:bs]
    r2t = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
    r2t[rpi] = rows
    for b in range(bs):
        fill_slots(runner, rows[b, :int(seq[b])], gen)
    new = torch.cat([rows[b, int(seq[b]):int(seq[b] + ext[b])] for b in range(bs)])
    loc = metadata.assign_draft_cache_locs(r2t, rpi, seq, new.long(), topk, steps, page_size)
    runner.req_to_token.copy_(r2t.to(device))
    parents = torch.randint(0, topk, (steps, bs, topk), generator=gen)
    parents[0] = 0
    batch = DraftBatch(rpi.to(device), seq.to(device), loc.to(device), parents.to(device))
    return Case(runner, batch, AttentionLayer(1, 1.0 / math.sqrt(heads[2]), logit_cap))


def make_extend_case(*, bs=3, page_size=1, dtype=torch.bfloat16, device="cpu", seed=0,
                     ragged=True, max_len=40, max_ext=5, heads=(4, 2, 16)) -> Case:
    gen = torch.Generator().manual_seed(seed)
    ext, seq = extend_lengths(bs, max_len, max_ext, ragged, gen)
    max_ctx = int(seq.max()) + page_size
    rows, total_pages = _allocate(seq, page_size, max_ctx, gen)
    max_reqs = bs + 1
    runner = _paged_runner(total_pages, page_size, max_reqs, max_ctx, dtype, device, heads, gen)
    rpi = torch.randperm(max_reqs, generator=gen)[:bs]
    r2t = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
    r2t[rpi] = rows
    new = []
    for b in range(bs):
        prefix = int(seq[b] - ext[b])
        fill_slots(runner, rows[b, :prefix], gen)
        new.append(rows[b, prefix:int(seq[b])].long())
    runner.req_to_token.copy_(r2t.to(device))
    batch = DraftExtendBatch(rpi.to(device), seq.to(device), ext.to(device),
                             torch.cat(new).to(device))
    return Case(runner, batch, AttentionLayer(0, 1.0 / math.sqrt(heads[2])))


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite output (a read of a poisoned slot?)"
    err = (out.float() - ref.float()).abs().max().item()
    scale = max(ref.float().abs().max().item(), 1.0)
    assert err <= TOL[dtype] * scale, f"max abs err {err} (ref scale {scale})"


def run_decode_round(backend, case: Case, seed: int = 1):
    """Metadata, then every step against ``torch_ref``."""
    gen = torch.Generator().manual_seed(seed)
    backend.init_forward_metadata(case.batch)
    return decode_steps(backend, case, gen)


def decode_steps(backend, case: Case, gen, pad_lanes: int = 0):
    b = case.batch
    lanes = b.batch_size * b.topk
    outs = []
    for step in range(b.num_steps):
        q, k, v = qkv(case.runner, lanes + pad_lanes, gen)
        out = backend.forward(step, case.layer, q, k, v)
        if pad_lanes:  # padded lanes (slot 0) are not compared
            out, q = out[:lanes], q[:lanes]
        ref = reference_decode(case.runner, case.layer, q, b, step, backend.tree_mode)
        assert_close_rel(out, ref, case.runner.dtype)
        outs.append(out)
    return outs


def run_extend(backend, case: Case, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    backend.init_forward_metadata(case.batch)
    q, k, v = qkv(case.runner, int(case.batch.extend_lens.sum()), gen)
    out = backend.forward(case.layer, q, k, v)
    ref = reference_extend(case.runner, case.layer, q, case.batch)
    assert_close_rel(out, ref, case.runner.dtype)
    return out


# --- draft decode ----------------------------------------------------------------------------


DECODE_GRID = [
    # lib, topk, page_size, tree_mode
    ("fa4", 1, 1, "lane"), ("fa4", 4, 1, "lane"), ("fa4", 4, 1, "path"),
    ("fa4", 1, 16, "path"), ("fa4", 4, 16, "lane"), ("fa4", 4, 16, "path"),
    ("fa4", 4, 64, "lane"), ("fa4", 1, 64, "lane"),
    ("fa3", 1, 1, "lane"), ("fa3", 4, 16, "path"), ("fa3", 4, 64, "lane"),
    ("fa3-via-fa4", 4, 16, "lane"), ("mate", 4, 1, "path"), ("mate", 1, 16, "lane"),
]


def _decode_params():
    """Every grid row with the Triton merge; the torch merge (FA history pass, the
    non-Triton path) for the two-pass rows. bf16 only: the calls do not depend on the dtype,
    and the kit checks fp16."""
    out = []
    for lib, topk, page_size, tree_mode in DECODE_GRID:
        out.append(pytest.param(lib, topk, page_size, tree_mode, None,
                                id=f"{lib}-{topk}-{page_size}-{tree_mode}-triton-merge"))
        if topk > 1:
            out.append(pytest.param(lib, topk, page_size, tree_mode, False,
                                    id=f"{lib}-{topk}-{page_size}-{tree_mode}-torch-merge"))
    return out


@pytest.mark.parametrize("lib,topk,page_size,tree_mode,fused", _decode_params())
def test_decode_calls_and_matches_reference(lib, topk, page_size, tree_mode, fused):
    cls, _, platform, rec = LIBS[lib]
    case = make_decode_case(topk=topk, page_size=page_size, seed=topk + page_size, steps=3)
    with installed(platform):
        backend = cls(case.runner, topk, 3, tree_mode=tree_mode, fused_merge=fused)
        run_decode_round(backend, case)
    # topk > 1: prefix pass (K rows per request) per step, then the history either in the
    # Triton kernel (fused) or as a second library call; topk == 1: one pass.
    per_step = 2 if topk > 1 and fused is False else 1
    assert backend.fused == (fused is not False)
    assert len(rec.calls) == 3 * per_step
    if topk > 1:
        prefix = rec.calls[0]
        assert (prefix.batch, prefix.total_q, prefix.max_seqlen_q) == (3, 3 * topk, topk)
        assert prefix.page_size == page_size and prefix.with_lse
        if fused is False:
            assert rec.calls[1].page_size == 1 and rec.calls[1].batch == 3 * topk
    assert not any(c.causal for c in rec.calls)


@pytest.mark.parametrize("lib,topk,page_size,tree_mode", [
    ("fa4", 4, 1, "path"), ("fa4", 4, 16, "lane"), ("fa3", 2, 64, "path")])
def test_decode_per_branch_mode(lib, topk, page_size, tree_mode):
    cls, _, platform, rec = LIBS[lib]
    case = make_decode_case(topk=topk, page_size=page_size, seed=7)
    with installed(platform):
        run_decode_round(cls(case.runner, topk, 3, tree_mode=tree_mode, mode="per-branch"),
                         case)
    # One pass per step, every lane its own sequence over a page-size-1 table.
    assert [(c.batch, c.page_size) for c in rec.calls] == [(3 * topk, 1)] * 3


@pytest.mark.parametrize("lib,topk,page_size,chunks", [
    ("fa4", 4, 1, 3), ("fa4", 1, 16, 4), ("fa4", 4, 16, 5), ("fa3", 2, 1, 4)])
def test_decode_split_prefix(lib, topk, page_size, chunks):
    """Chunks past a short prefix are empty (no keys): they must get no weight."""
    cls, _, platform, rec = LIBS[lib]
    case = make_decode_case(topk=topk, page_size=page_size, seed=11, max_len=60, min_len=2)
    with installed(platform):
        run_decode_round(cls(case.runner, topk, 3, tree_mode="path", split_prefix=chunks), case)
    prefix = rec.calls[0]
    assert prefix.batch == 3 * chunks and prefix.total_q == 3 * chunks * topk


def test_decode_rounds_of_changing_batch_size():
    cls, _, platform, _ = LIBS["fa4"]
    small = make_decode_case(bs=2, topk=2, page_size=16, seed=3)
    with installed(platform):
        backend = cls(small.runner, 2, 3, tree_mode="path")
        run_decode_round(backend, small)
        big = make_decode_case(bs=5, topk=2, page_size=16, seed=4)
        backend.runner = big.runner
        run_decode_round(backend, big)
        run_decode_round(backend, make_case_on(big, seed=5))


def make_case_on(case: Case, seed: int) -> Case:
    """Another round on ``case``'s pools: requests reversed, lanes' draft slots permuted
    within each request (the allocation stays page-aligned)."""
    b = case.batch
    order = torch.arange(b.batch_size - 1, -1, -1)
    gen = torch.Generator().manual_seed(seed)
    loc = b.out_cache_loc[order][:, torch.randperm(b.topk, generator=gen)]
    parents = torch.randint(0, b.topk, tuple(b.parents.shape), generator=gen).to(
        b.parents.device)
    return Case(case.runner, DraftBatch(b.req_pool_indices[order], b.seq_lens[order], loc,
                                        parents), case.layer)


# --- CUDA graph protocol (eager on the CPU: fixed buffers, padding, parents) ------------------


@pytest.mark.parametrize("lib,topk,page_size,tree_mode,mode", [
    ("fa4", 4, 16, "path", "shared"), ("fa4", 1, 1, "lane", "shared"),
    ("fa3", 2, 1, "path", "per-branch")])
def test_graph_protocol_fixed_buffers_and_padding(lib, topk, page_size, tree_mode, mode):
    cls, _, platform, rec = LIBS[lib]
    case = make_decode_case(bs=3, topk=topk, page_size=page_size, seed=21)
    with installed(platform):
        backend = cls(case.runner, topk, 3, tree_mode=tree_mode, mode=mode)
        backend.init_cuda_graph_state(4, 4 * topk)
        backend.init_forward_metadata_capture_cuda_graph(case.batch)
        decode_steps(backend, case, torch.Generator().manual_seed(1))
        captured = [c.ptrs for c in rec.calls]
        captured_parents = case.batch.parents
        # Replay with another round of two requests, padded to the captured three.
        other = make_case_on(case, seed=22)
        b = other.batch
        two = Case(case.runner, DraftBatch(b.req_pool_indices[:2], b.seq_lens[:2],
                                           b.out_cache_loc[:2], b.parents[:, :2].clone()),
                   case.layer)
        rec.clear()
        backend.init_forward_metadata_replay_cuda_graph(two.batch, 3)
        if tree_mode == "path":  # the graph reads the captured parents tensor
            assert torch.equal(captured_parents[:, :2], two.batch.parents)
        decode_steps(backend, two, torch.Generator().manual_seed(2), pad_lanes=topk)
        assert [c.ptrs for c in rec.calls] == captured, "a replay must read the same buffers"
        with pytest.raises(InvalidInputError, match="bs"):
            backend.init_forward_metadata_replay_cuda_graph(two.batch, 5)


def test_graph_state_required_before_capture():
    cls, _, platform, _ = LIBS["fa4"]
    case = make_decode_case()
    with installed(platform):
        backend = cls(case.runner, 2, 3)
        with pytest.raises(InvalidInputError, match="init_cuda_graph_state"):
            backend.init_forward_metadata_capture_cuda_graph(case.batch)


# --- draft extend ----------------------------------------------------------------------------


@pytest.mark.parametrize("lib,page_size,ragged", [
    ("fa4", 1, True), ("fa4", 16, True), ("fa4", 64, False), ("fa3", 16, False),
    ("fa3", 1, True), ("fa3-via-fa4", 64, True), ("mate", 16, True)])
def test_extend_calls_and_matches_reference(lib, page_size, ragged):
    """bf16 only: the call does not depend on the dtype, and the kit checks fp16."""
    _, cls, platform, rec = LIBS[lib]
    case = make_extend_case(page_size=page_size, ragged=ragged, seed=page_size + ragged)
    with installed(platform):
        run_extend(cls(case.runner), case)
    (call,) = rec.calls
    assert call.causal and call.page_size == page_size and call.batch == 3
    assert call.max_seqlen_q == int(case.batch.extend_lens.max())


@pytest.mark.parametrize("lib,page_size,ragged,chunks", [
    ("fa4", 1, True, 3), ("fa4", 16, True, 4), ("fa4", 64, False, 2), ("fa3", 16, True, 5)])
def test_extend_split_prefix(lib, page_size, ragged, chunks):
    """A split extend: the chunks of the full pages before the first new token's page in
    one non-causal call, the tail (that page and the new tokens) in one causal call, merged
    by LSE; chunks past a short prefix are empty and must get no weight."""
    _, cls, platform, rec = LIBS[lib]
    case = make_extend_case(page_size=page_size, ragged=ragged, seed=20 + chunks,
                            max_len=90, max_ext=6)
    with installed(platform):
        run_extend(cls(case.runner, split_prefix=chunks), case)
    tail, prefix = rec.calls
    assert tail.causal and not prefix.causal
    assert tail.batch == 3 and prefix.batch == 3 * chunks
    assert prefix.total_q == chunks * tail.total_q


def test_extend_split_graph_replays_with_new_lengths():
    """Captured with a split route, replayed with the tokens split otherwise over the same
    requests (other prefix lengths, other tails)."""
    _, cls, platform, rec = LIBS["fa4"]
    case = make_extend_case(page_size=16, ragged=True, max_len=90, max_ext=4, seed=31)
    b, runner = case.batch, case.runner
    tokens = int(b.extend_lens.sum())
    ext = b.extend_lens.roll(1)
    rows = runner.req_to_token[b.req_pool_indices].long()
    loc = torch.cat([rows[i, int(b.seq_lens[i] - ext[i]):int(b.seq_lens[i])] for i in range(3)])
    gen = torch.Generator().manual_seed(1)
    with installed(platform):
        backend = cls(runner, split_prefix=3)
        backend.init_cuda_graph_state(3, tokens)
        for batch in (b, DraftExtendBatch(b.req_pool_indices, b.seq_lens, ext, loc)):
            if batch is b:
                backend.init_forward_metadata_capture_cuda_graph(batch)
            else:
                backend.init_forward_metadata_replay_cuda_graph(batch, 3)
            q, k, v = qkv(runner, tokens, gen)
            out = backend.forward(case.layer, q, k, v)
            assert_close_rel(out, reference_extend(runner, case.layer, q, batch), runner.dtype)
    assert rec.calls[-1].batch == 3 * 3 and not rec.calls[-1].causal


def test_extend_split_prefix_is_checked():
    _, cls, platform, _ = LIBS["fa4"]
    case = make_extend_case(page_size=16, ragged=False, seed=3)
    with installed(platform):
        for bad in (0, 2.0, True):
            with pytest.raises(InvalidInputError, match="split_prefix"):
                cls(case.runner, split_prefix=bad)
        assert cls(case.runner).chunks_for(1) == 1  # no SM count here: one pass


def test_extend_graph_protocol():
    _, cls, platform, rec = LIBS["fa4"]
    case = make_extend_case(page_size=16, ragged=False, max_ext=4, seed=5)
    with installed(platform):
        backend = cls(case.runner)
        backend.init_cuda_graph_state(4, 16)
        backend.init_forward_metadata_capture_cuda_graph(case.batch)
        gen = torch.Generator().manual_seed(0)
        q, k, v = qkv(case.runner, 12, gen)
        out = backend.forward(case.layer, q, k, v)
        assert_close_rel(out, reference_extend(case.runner, case.layer, q, case.batch),
                         case.runner.dtype)
        # The bound T - B + 1 stands in for max(E) (no host read under graphs).
        assert rec.calls[-1].max_seqlen_q == 12 - 3 + 1
        b, pick = case.batch, torch.tensor([0, 1, 2, 0, 1])
        starts = torch.cumsum(b.extend_lens, 0) - b.extend_lens
        loc = torch.cat([b.out_cache_loc[starts[i]:starts[i] + b.extend_lens[i]] for i in pick])
        five = DraftExtendBatch(b.req_pool_indices[pick], b.seq_lens[pick],
                                b.extend_lens[pick], loc)
        with pytest.raises(InvalidInputError, match="at most 4 requests"):
            backend.init_forward_metadata_replay_cuda_graph(five, 5)


# --- the glue can fail: mutations the stand-ins must catch -----------------------------------


def test_wrong_lse_layout_is_caught(monkeypatch):
    """If the glue read FA's head-major LSE as token-major, the merge would be wrong."""
    cls, _, platform, _ = LIBS["fa4"]
    real = _library.FA4Kernel.__call__

    def no_transpose(self, *args, **kw):
        out, lse = real(self, *args, **kw)
        return out, (None if lse is None else lse.t().reshape(lse.shape))

    monkeypatch.setattr(_library.FA4Kernel, "__call__", no_transpose)
    case = make_decode_case(topk=4, page_size=16, heads=(4, 4, 16), bs=1)
    with installed(platform):
        with pytest.raises(AssertionError, match="max abs err"):
            run_decode_round(cls(case.runner, 4, 3), case)


def test_misaligned_pages_are_refused():
    """Page ids are only right for whole pages: a token-scattered allocation is an error."""
    cls, _, platform, _ = LIBS["fa4"]
    case = make_decode_case(topk=2, page_size=16, seed=9)
    r2t = case.runner.req_to_token
    b = int(case.batch.req_pool_indices[0])
    r2t[b, 0] += 1  # slot no longer at its page's offset 0
    with installed(platform):
        backend = cls(case.runner, 2, 3)
        with pytest.raises(InvalidInputError, match="page-aligned"):
            backend.init_forward_metadata(case.batch)


@pytest.mark.parametrize("which", [0, 1])
def test_a_pool_of_a_partial_last_page_is_refused(which):
    """FlashAttention views a pool as whole pages: a slot of a partial last page is in no
    page its table can name (it had been accepted, and read past the view)."""
    runner = DraftRunner.mha(4, 2, 16, num_layers=1, num_slots=100, page_size=16, max_reqs=2,
                             max_context_len=64)
    _, _, platform, _ = LIBS["fa4"]
    with installed(platform), pytest.raises(
            InvalidInputError, match="^runner pools: expected a slot count that is a multiple "
                                     "of the page size 16 .*got 100"):
        LIBS["fa4"][which](runner, 2, 3) if which == 0 else LIBS["fa4"][which](runner)


def test_stand_in_rejects_undocumented_arguments():
    with pytest.raises(TypeError):
        fa_cute.flash_attn_varlen_func(None, None, None, return_softmax_lse=True)
    q = torch.zeros(2, 2, 8, dtype=torch.bfloat16)
    kv = torch.zeros(3, 1, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="int32"):
        fa_cute.flash_attn_varlen_func(
            q, kv, kv, cu_seqlens_q=torch.tensor([0, 2]), max_seqlen_q=2,
            seqused_k=torch.tensor([1], dtype=torch.int32),
            page_table=torch.zeros(1, 3, dtype=torch.int32), softmax_scale=1.0)


# --- selection, fallback, errors -------------------------------------------------------------


def test_fa3_falls_back_to_fa4_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(_library, "_fallback_logged", False)
    case = make_decode_case(topk=2)
    with installed(HOPPER_FA4, modules=("flash_attn.cute",)):
        with caplog.at_level(logging.WARNING, logger="specattn.backends.flash_attn"):
            first = fa.FA3DecodeSM90(case.runner, 2, 3)
            fa.FA3ExtendSM90(case.runner)
        assert isinstance(first.kernel, _library.FA4Kernel)
        lines = [r.getMessage() for r in caplog.records if "sm90 kernel" in r.getMessage()]
        assert len(lines) == 1 and "FlashAttention-3" in lines[0]
        run_decode_round(first, case)
    assert fa_cute.RECORDER.calls and not fa_interface.RECORDER.calls
    rows = [r for r in list_backends(pattern="fa3", platform=HOPPER_FA4) if r.runs_here]
    assert rows and all("FlashAttention-4's sm90 kernel" in r.reason for r in rows)


def test_fa3_prefers_fa3_when_both_are_installed():
    both = Platform("cuda", (9, 0), libraries={"flash_attn.cute", "flash_attn_interface"})
    case = make_decode_case(topk=2)
    with installed(both):
        backend = fa.FA3DecodeSM90(case.runner, 2, 3)
        assert isinstance(backend.kernel, _library.FA3Kernel)
        assert "flash_attn_interface" in backend.kernel.label


def test_selection_picks_the_flavours():
    req = BackendRequest(kind="decode", mla=False, topk=4, num_steps=3, page_size=16,
                         dtype=torch.bfloat16)
    assert select("decode", "fa4", req, platform=HOPPER_FA4).backend is fa.FA4Decode
    assert select("decode", "fa3", req, platform=HOPPER_FA4).backend is fa.FA3DecodeSM90
    assert select("decode", "fa3", req, platform=MUSA).backend is fa.FA3DecodeMUSA
    assert select("decode", "auto", req, platform=HOPPER_FA4).backend is fa.FA4Decode
    sm80 = Platform("cuda", (8, 0), libraries={"flash_attn_interface"})
    assert select("decode", "fa3", req, platform=sm80).backend is fa.FA3DecodeSM8x


def test_errors_without_libraries():
    case = make_decode_case(topk=2)
    with installed(Platform("cuda", (9, 0), libraries=frozenset()), modules=()):
        with pytest.raises(BackendUnavailableError) as err:
            fa.FA3DecodeSM90(case.runner, 2, 3)
        assert "flash_attn_interface" in str(err.value) and "flash-attn-4" in str(err.value)
        with pytest.raises(BackendUnavailableError, match="pip install flash-attn-4"):
            fa.FA4Extend(case.runner)
    # The platform claims the library but the import fails (a broken or missing build).
    with installed(HOPPER_FA4, modules=()):
        sys.modules["flash_attn.cute"] = None  # makes the import raise ImportError
        with pytest.raises(BackendUnavailableError, match="importing 'flash_attn.cute' failed"):
            fa.FA4Decode(case.runner, 2, 3)


def test_capability_errors():
    case = make_decode_case(topk=2)
    mla = DraftRunner.mla(4, 32, 8, num_layers=1, num_slots=8, max_reqs=2,
                          max_context_len=8)
    fp32 = DraftRunner.mha(4, 2, 16, num_layers=1, num_slots=8, max_reqs=2, max_context_len=8,
                           dtype=torch.float32)
    with installed(HOPPER_FA4):
        with pytest.raises(BackendUnavailableError, match="serves MHA"):
            fa.FA4Decode(mla, 2, 3)
        with pytest.raises(BackendUnavailableError, match="dtypes"):
            fa.FA4Extend(fp32)
        with pytest.raises(InvalidInputError, match="mode"):
            fa.FA4Decode(case.runner, 2, 3, mode="cascade")
        with pytest.raises(InvalidInputError, match="split_prefix"):
            fa.FA4Decode(case.runner, 2, 3, mode="per-branch", split_prefix=2)
        with pytest.raises(InvalidInputError, match="split_prefix"):
            fa.FA4Decode(case.runner, 2, 3, split_prefix=0)


def test_merge_states_weights_and_empty_parts():
    gen = torch.Generator().manual_seed(0)
    o1, o2 = torch.randn(5, 3, 4, generator=gen), torch.randn(5, 3, 4, generator=gen)
    l1, l2 = torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen)
    got = merge_states([o1, o2], [l1, l2], torch.float32)
    w1 = torch.sigmoid(l1 - l2)[..., None]  # e^l1 / (e^l1 + e^l2)
    torch.testing.assert_close(got, w1 * o1 + (1 - w1) * o2)
    nan = torch.full_like(o1, float("nan"))
    for empty in (float("inf"), float("-inf")):
        got = merge_states([nan, o2], [torch.full_like(l1, empty), l2], torch.float32)
        torch.testing.assert_close(got, o2)


def test_chunk_tail_merge_kernel_matches_torch():
    """The split extend's merge as FA calls it: chunk states at rows ``c * T + t``, LSEs
    token-major views of head-major tensors, empty chunks (+-inf LSE, NaN output) with no
    weight, against ``merge_states``."""
    from specattn.kernels.merge import merge_chunks_and_tail

    gen = torch.Generator().manual_seed(3)
    chunks, tokens, heads, d = 3, 5, 4, 24
    o_c = torch.randn(chunks * tokens, heads, d, generator=gen).to(torch.bfloat16)
    lse_c = (torch.randn(heads, chunks * tokens, generator=gen) * 3).t()
    o_t = torch.randn(tokens, heads, d, generator=gen).to(torch.bfloat16)
    lse_t = (torch.randn(heads, tokens, generator=gen) * 3).t()
    lse_c[2], lse_c[tokens + 4, 1] = float("inf"), float("-inf")
    o_c[2], o_c[tokens + 4, 1] = float("nan"), float("nan")
    got = merge_chunks_and_tail(o_c, lse_c, o_t, lse_t)
    want = merge_states([o_c[c * tokens:(c + 1) * tokens] for c in range(chunks)] + [o_t],
                        [lse_c[c * tokens:(c + 1) * tokens] for c in range(chunks)] + [lse_t],
                        torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


# --- the Triton history+merge kernel and the routing rule ------------------------------------


def _history_case(gen, lanes=6, topk=3, chunks=2, hq=4, hkv=2, d=16, steps=4):
    slots = 40
    kc = torch.randn(slots, hkv, d, generator=gen).to(torch.bfloat16)
    vc = torch.randn(slots, hkv, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(lanes, hq, d, generator=gen).to(torch.bfloat16)
    hist = torch.randint(0, slots, (lanes, steps), generator=gen, dtype=torch.int32)
    rows = lanes * chunks
    po = torch.randn(rows, hq, d, generator=gen).to(torch.bfloat16)
    lse_hm = torch.randn(hq, rows, generator=gen) * 3  # head-major, as FA returns it
    return kc, vc, q, hist, po, lse_hm


@pytest.mark.parametrize("cap", [0.0, 2.5])
@pytest.mark.parametrize("n_hist", [1, 3])
def test_history_merge_kernel_matches_torch(n_hist, cap):
    """The shared history + merge kernel as FA calls it: rows ``(b, c, k)`` of the prefix
    states, head-major natural-log LSE read through strides, empty chunks (+-inf LSE, NaN
    output) with no weight; history attention with soft cap."""
    from specattn.backends.torch_ref import attend
    from specattn.kernels.history_merge import history_merge

    gen = torch.Generator().manual_seed(n_hist)
    topk, chunks, lanes = 3, 2, 6
    kc, vc, q, hist, po, lse_hm = _history_case(gen, lanes, topk, chunks)
    lse_hm[:, 1] = float("inf")  # row (b0, c0, k1): FA3's empty marker
    lse_hm[:, 3] = float("-inf")  # row (b0, c1, k0): FA4's
    po[1], po[3] = float("nan"), float("nan")
    scale = 0.3
    got = history_merge(q, kc, vc, hist[:, :n_hist], po, lse_hm.t(), scale, cap,
                        lse_base="e", chunks=chunks, topk=topk, inf_is_empty=True)
    # Torch: history state per lane, then merge_states with the chunk states.
    group = q.shape[1] // kc.shape[1]
    o_h, lse_h = [], []
    for z in range(lanes):
        sl = hist[z, :n_hist].long()
        k = kc[sl].float().repeat_interleave(group, 1)
        v = vc[sl].float().repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[z].float(), k) * scale
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        lse_h.append(torch.logsumexp(s, -1))
        o_h.append(attend(q[z:z + 1], k, v, scale, cap)[0])
    o_h, lse_h = torch.stack(o_h), torch.stack(lse_h)
    b, j = torch.arange(lanes) // topk, torch.arange(lanes) % topk
    outs = [po[(b * chunks + c) * topk + j].float() for c in range(chunks)]
    lses = [lse_hm.t()[(b * chunks + c) * topk + j] for c in range(chunks)]
    want = merge_states(outs + [o_h], lses + [lse_h], torch.float32)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    # Not a trivial pass: the history changes the answer.
    assert (want - merge_states(outs, lses, torch.float32)).abs().max() > 0.05


def test_route_rule_is_a_pure_function_of_shapes():
    from specattn.backends.flash_attn._route import SPLITS, choose_route, route_cost

    big = dict(bs=32, topk=8, prefix_len=4096, num_kv_heads=8, num_sms=132)
    assert choose_route(**big) == ("shared", 1)  # gqa-long: the prefix read once
    assert choose_route(**{**big, "num_sms": None}) == ("shared", 1)  # no GPU: shared
    small = dict(bs=4, topk=4, prefix_len=1024, num_kv_heads=8, num_sms=132)
    assert choose_route(**small) != ("shared", 1)  # gqa-small: SMs idle in the prefix pass
    assert choose_route(**small) == choose_route(**small)
    for bs in (1, 2, 4, 8, 64):  # K == 1 has no per-branch alternative
        assert choose_route(**{**small, "bs": bs, "topk": 1})[0] == "shared"
    # The pick is the cheapest option of the model.
    for bs in (1, 3, 8, 17, 32, 100):
        kw = {**small, "bs": bs}
        pick = choose_route(**kw)
        options = [("shared", c) for c in (1,) + SPLITS] + [("per-branch", 1)]
        assert route_cost(pick, **kw) == min(route_cost(r, **kw) for r in options)
    # One request, a long prefix: unsplit, 8 CTAs would stream it; the chunks fill the chip.
    b1 = dict(bs=1, topk=4, prefix_len=32768, num_kv_heads=8, num_sms=132)
    assert choose_route(**b1)[0] == "shared" and choose_route(**b1)[1] >= 8


def test_auto_mode_routes_small_batches_and_logs_once(monkeypatch, caplog):
    from specattn.backends.flash_attn import _decode, _route

    monkeypatch.setattr(_decode, "sm_count", lambda device: 132)
    cls, _, platform, rec = LIBS["fa4"]
    case = make_decode_case(bs=2, topk=4, page_size=16, seed=31, max_len=60)
    want = _route.choose_route(bs=2, topk=4, prefix_len=case.runner.max_context_len,
                               num_kv_heads=2, num_sms=132, head_dim=16)
    assert want != ("shared", 1)
    with installed(platform), caplog.at_level(logging.DEBUG, "specattn.backends.flash_attn"):
        backend = cls(case.runner, 4, 3, tree_mode="path")
        run_decode_round(backend, case)
        run_decode_round(backend, make_case_on(case, seed=32))
        assert backend._route == want
        routed = [r for r in caplog.records if "route to" in r.getMessage()]
        assert len(routed) == 1 and routed[0].levelno == logging.DEBUG
        if want[0] == "per-branch":
            assert all(c.page_size == 1 and c.batch == 8 for c in rec.calls)
        else:
            assert rec.calls[0].batch == 2 * want[1]
        # Explicit mode="shared" is never rerouted.
        rec.clear()
        run_decode_round(cls(case.runner, 4, 3, mode="shared"), case)
        assert rec.calls[0].batch == 2 and rec.calls[0].max_seqlen_q == 4
