"""PagedKVAllocator: page-granular bookkeeping and upstream-style draft rounds."""

from __future__ import annotations

import math

import pytest
import torch

from specattn import DraftRunner
from specattn.allocator import PagedKVAllocator
from specattn.errors import CallOrderError, InvalidInputError, OutOfCapacityError


def _runner(page_size=4, num_slots=256, mla=False, max_context_len=128, max_reqs=4):
    kw = dict(num_layers=2, num_slots=num_slots, max_reqs=max_reqs,
              max_context_len=max_context_len, page_size=page_size, dtype=torch.float32)
    return DraftRunner.mla(2, 8, 4, **kw) if mla else DraftRunner.mha(2, 1, 8, **kw)


def _pools(runner):
    return [runner.kv_buffer] if runner.use_mla_backend else [runner.k_buffer,
                                                              runner.v_buffer]


def _check_page_layout(alloc, req):
    """Positions fill the request's pages in order; page 0 is never used."""
    P, L = alloc.page_size, alloc.seq_len(req)
    pages = alloc.pages(req)
    assert len(pages) == math.ceil(L / P) and 0 not in pages
    row = alloc.runner.req_to_token[req, :L].tolist()
    assert row == [pages[x // P] * P + x % P for x in range(L)]


def test_extend_truncate_free():
    runner = _runner(page_size=4, num_slots=64)
    alloc = PagedKVAllocator(runner)
    assert alloc.num_free_pages == 15
    a, b = alloc.new_request(), alloc.new_request()
    assert a != b
    sa = alloc.extend(a, 5)
    sb = alloc.extend(b, 3)
    assert sa.tolist() == runner.req_to_token[a, :5].tolist()
    assert set(sa.tolist()).isdisjoint(sb.tolist())
    sa2 = alloc.extend(a, 6)
    assert alloc.seq_len(a) == 11 and runner.req_to_token[a, 5:11].tolist() == sa2.tolist()
    assert alloc.extend(a, 0).numel() == 0
    for r in (a, b):
        _check_page_layout(alloc, r)
    assert alloc.num_free_pages == 15 - 3 - 1
    alloc.truncate(a, 8)  # 8 tokens = exactly 2 pages
    assert alloc.seq_len(a) == 8 and alloc.num_free_pages == 15 - 2 - 1
    _check_page_layout(alloc, a)
    alloc.truncate(a, 5)  # the partial page stays
    assert alloc.num_free_pages == 15 - 2 - 1
    alloc.extend(a, 3)
    _check_page_layout(alloc, a)
    assert runner.req_to_token[a, :5].tolist() == sa.tolist()  # committed prefix kept
    alloc.free_request(a)
    assert alloc.num_free_pages == 15 - 1 and alloc.active_requests == [b]
    with pytest.raises(InvalidInputError, match="req"):
        alloc.seq_len(a)
    c = alloc.new_request()
    assert alloc.seq_len(c) == 0


def test_errors():
    runner = _runner(page_size=4, num_slots=32, max_context_len=20, max_reqs=2)
    alloc = PagedKVAllocator(runner)
    a, b = alloc.new_request(), alloc.new_request()
    with pytest.raises(OutOfCapacityError, match="out of request rows"):
        alloc.new_request()
    with pytest.raises(InvalidInputError, match="max_context_len=20"):
        alloc.extend(a, 21)
    for n in (-1, True, 2.0):  # a bool is no count (True would extend by one)
        with pytest.raises(InvalidInputError, match="^n:"):
            alloc.extend(a, n)
    alloc.extend(a, 20)  # 5 of the 7 usable pages
    with pytest.raises(OutOfCapacityError, match="out of KV slots: need 3 more pages"):
        alloc.extend(b, 12)
    assert alloc.seq_len(b) == 0 and alloc.num_free_pages == 2  # all or nothing
    for new_len in (21, False):
        with pytest.raises(InvalidInputError, match="new_len"):
            alloc.truncate(a, new_len)
    with pytest.raises(InvalidInputError, match="req"):
        alloc.free_request(7)
    with pytest.raises(CallOrderError, match="^alloc_draft: .*no draft round"):
        alloc.release_draft()
    with pytest.raises(InvalidInputError, match="runner.num_slots"):
        PagedKVAllocator(_runner(page_size=16, num_slots=16))
    with pytest.raises(InvalidInputError, match="^runner: expected a specattn.DraftRunner, "
                       "got NoneType$"):
        PagedKVAllocator(None)


def test_draft_errors():
    runner = _runner(page_size=4, num_slots=64, max_context_len=16)
    alloc = PagedKVAllocator(runner)
    a = alloc.new_request()
    alloc.extend(a, 5)
    with pytest.raises(InvalidInputError, match="distinct"):
        alloc.alloc_draft(torch.tensor([a, a]), 2, 2)
    with pytest.raises(InvalidInputError, match="^req_pool_indices: .* got dtype float32"):
        alloc.alloc_draft(torch.tensor([float(a)]), 2, 2)
    for reqs, got in ((None, "NoneType"), ("0", "str")):
        with pytest.raises(InvalidInputError, match=f"^req_pool_indices: .*got {got}$"):
            alloc.alloc_draft(reqs, 2, 2)
    with pytest.raises(InvalidInputError, match="^reqs: .*got dtype float32$"):
        alloc.seq_lens([0.5])
    assert alloc.seq_lens(a).tolist() == alloc.seq_lens([a]).tolist() == [5]
    with pytest.raises(InvalidInputError, match="topk"):
        alloc.alloc_draft(torch.tensor([a]), 0, 2)
    with pytest.raises(InvalidInputError, match="num_steps"):
        alloc.alloc_draft(torch.tensor([a]), 2, 0)
    with pytest.raises(InvalidInputError, match="^topk: .*got True$"):
        alloc.alloc_draft(torch.tensor([a]), True, 2)
    with pytest.raises(InvalidInputError, match="^num_steps: .*got True$"):
        alloc.alloc_draft(torch.tensor([a]), 2, True)
    with pytest.raises(InvalidInputError, match="max_context_len=16"):
        alloc.alloc_draft(torch.tensor([a]), 4, 3)  # needs 4 + 4*4 = 20 positions
    alloc.alloc_draft(torch.tensor([a]), 2, 2)
    for call in (lambda: alloc.alloc_draft(torch.tensor([a]), 2, 2),
                 lambda: alloc.extend(a, 1), lambda: alloc.truncate(a, 1),
                 lambda: alloc.free_request(a)):
        with pytest.raises(CallOrderError, match="^release_draft: "):
            call()
    alloc.release_draft()
    assert alloc.seq_len(a) == 5


def _draft_round(page_size, topk, num_steps, lengths, mla=False):
    runner = _runner(page_size=page_size, num_slots=1024, mla=mla)
    alloc = PagedKVAllocator(runner)
    reqs = [alloc.new_request() for _ in lengths]
    for r, L in zip(reqs, lengths):
        alloc.extend(r, L)
    for pool in _pools(runner):
        for buf in pool:
            buf.copy_(torch.randn_like(buf))
    return runner, alloc, reqs


@pytest.mark.parametrize("page_size,topk", [(1, 4), (16, 1), (1, 1)])
def test_draft_case_a(page_size, topk):
    S, lengths = 3, [5, 16, 1]
    runner, alloc, reqs = _draft_round(page_size, topk, S, lengths)
    free_before = alloc.num_free_pages
    committed = [runner.req_to_token[r, :L].clone() for r, L in zip(reqs, lengths)]
    kv_before = [[b.clone() for b in pool] for pool in _pools(runner)]
    loc = alloc.alloc_draft(torch.tensor(reqs), topk, S)
    assert loc.shape == (3, topk, S)
    for b, (r, L) in enumerate(zip(reqs, lengths)):
        assert alloc.seq_len(r) == L + topk * S
        for j in range(topk):
            for t in range(S):
                assert int(loc[b, j, t]) == int(runner.req_to_token[r, L + j * S + t])
        _check_page_layout(alloc, r)
    used = loc.reshape(-1).tolist()
    assert len(set(used)) == len(used)
    prefix = set(torch.cat(committed).tolist())
    assert prefix.isdisjoint(used)
    # Case A copies no KV.
    for pool, old in zip(_pools(runner), kv_before):
        for buf, o in zip(pool, old):
            assert torch.equal(buf, o)
    alloc.release_draft()
    assert alloc.num_free_pages == free_before
    for r, L, c in zip(reqs, lengths, committed):
        assert alloc.seq_len(r) == L and torch.equal(runner.req_to_token[r, :L], c)
        _check_page_layout(alloc, r)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("page_size,S", [(4, 3), (16, 5), (4, 6)])
def test_draft_case_b_duplicates_last_page(page_size, S, mla):
    P, K = page_size, 3
    lengths = [5, 2 * P, 3 * P - 1, 1]
    runner, alloc, reqs = _draft_round(P, K, S, lengths, mla=mla)
    free_before = alloc.num_free_pages
    committed = [runner.req_to_token[r, :L].clone() for r, L in zip(reqs, lengths)]
    loc = alloc.alloc_draft(torch.tensor(reqs), K, S)
    for b, (r, L) in enumerate(zip(reqs, lengths)):
        last, base = L % P, L - L % P
        npp = math.ceil((last + S) / P)
        assert alloc.seq_len(r) == base + K * npp * P
        _check_page_layout(alloc, r)
        row = runner.req_to_token[r]
        assert torch.equal(row[:L], committed[b])
        for j in range(K):
            region = base + j * npp * P
            for t in range(S):
                assert int(loc[b, j, t]) == int(row[region + last + t])
            # Branch j's first page starts with a copy of the partial last page.
            for t in range(last):
                src, dst = int(row[base + t]), int(row[region + t])
                assert (dst == src) == (j == 0)
                for pool in _pools(runner):
                    for buf in pool:
                        assert torch.equal(buf[dst], buf[src])
            if j > 0:
                assert int(row[region]) % P == 0  # a fresh page, page-aligned
        assert int(loc[b, 0, 0]) == int(row[L])  # branch 0 continues in place
    used = loc.reshape(-1).tolist()
    assert len(set(used)) == len(used)
    assert set(torch.cat(committed).tolist()).isdisjoint(used)
    alloc.release_draft()
    assert alloc.num_free_pages == free_before
    for r, L, c in zip(reqs, lengths, committed):
        assert alloc.seq_len(r) == L and torch.equal(runner.req_to_token[r, :L], c)
    # The freed pages are usable again.
    alloc.alloc_draft(torch.tensor(reqs[:2]), K, S)
    alloc.release_draft()
    assert alloc.num_free_pages == free_before


def test_draft_out_of_slots_leaves_state_unchanged():
    runner = _runner(page_size=4, num_slots=40)  # 9 usable pages
    alloc = PagedKVAllocator(runner)
    a = alloc.new_request()
    alloc.extend(a, 6)
    with pytest.raises(OutOfCapacityError, match="out of KV slots"):
        alloc.alloc_draft(torch.tensor([a]), 4, 7)  # 13 pages
    assert alloc.seq_len(a) == 6 and alloc.num_free_pages == 7
    alloc.alloc_draft(torch.tensor([a]), 2, 2)  # still allowed afterwards
    alloc.release_draft()
