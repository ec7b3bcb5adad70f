"""Metadata builders against the upstream formulas (reference/upstream-draft-backends.md D),
written out here with plain Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from specattn import DraftRunner
from specattn import metadata as M

LENGTHS = {"uniform": [33, 33, 33], "ragged": [1, 17, 64, 130]}


def _table(num_reqs: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """A req_to_token of distinct random slots (so any mix-up changes the result)."""
    return torch.randperm(num_reqs * width, generator=gen).reshape(num_reqs, width).to(
        torch.int32)


def _setup(lengths, extra: int = 1200, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    bs = len(lengths)
    r2t = _table(bs + 3, max(lengths) + extra, gen)
    rpi = torch.randperm(bs + 3, generator=gen)[:bs]
    return r2t, rpi, torch.tensor(lengths, dtype=torch.int32)


def _draft_pos(L: int, j: int, t: int, K: int, S: int, P: int) -> int:
    """Position in R_b of lane j's step-t slot (D.1 case A / D.2 case B)."""
    if P == 1 or K == 1:
        return L + j * S + t
    last = L % P
    base = L - last
    npp = math.ceil((last + S) / P)
    return base + j * npp * P + last + t


def _upstream_kv_indices(r2t, rpi, lengths, K, S, P):
    """generate_draft_decode_kv_indices, one program (r, b, j) at a time."""
    B = len(lengths)
    width = K * sum(lengths) + B * K * S
    indptr = [[0] * (B * K + 1) for _ in range(S)]
    indices = [[0] * width for _ in range(S)]
    positions = [L for L in lengths for _ in range(K)]
    for r in range(S):
        n = r + 1
        for b, L in enumerate(lengths):
            row = r2t[int(rpi[b])].tolist()
            for j in range(K):
                z = b * K + j
                off = K * sum(lengths[:b]) + b * n * K + j * (L + n)
                for x in range(L):
                    indices[r][off + x] = row[x]
                for t in range(n):
                    indices[r][off + L + t] = row[_draft_pos(L, j, t, K, S, P)]
                indptr[r][z + 1] = sum(positions[:z + 1]) + (z + 1) * n
    return torch.tensor(indptr), torch.tensor(indices)


@pytest.mark.parametrize("lengths", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("topk", [1, 4, 8])
def test_draft_kv_indices_matches_upstream(lengths, page_size, topk):
    r2t, rpi, seq = _setup(lengths)
    for num_steps in range(1, 7):
        indptr, indices = M.draft_kv_indices(r2t, rpi, seq, topk, num_steps, page_size)
        ref_ptr, ref_idx = _upstream_kv_indices(r2t, rpi, lengths, topk, num_steps, page_size)
        assert indptr.dtype == torch.int32 and indices.dtype == torch.int32
        assert torch.equal(indptr.long(), ref_ptr), (num_steps, indptr, ref_ptr)
        assert torch.equal(indices.long(), ref_idx), num_steps


def test_draft_kv_indices_static_sizes_and_out_cache_loc():
    """max_len/row_width given (graph path): same entries, wider row zero-padded; history
    taken from out_cache_loc equals the req_to_token reading after assignment."""
    lengths, K, S, P = [5, 40, 23], 4, 3, 16
    r2t, rpi, seq = _setup(lengths)
    ptr, idx = M.draft_kv_indices(r2t, rpi, seq, K, S, P, index_dtype=torch.int64)
    assert idx.dtype == torch.int64
    width = idx.shape[1]
    ptr2, idx2 = M.draft_kv_indices(r2t, rpi, seq, K, S, P, index_dtype=torch.int64,
                                    max_len=64, row_width=width + 50)
    assert torch.equal(ptr, ptr2)
    assert torch.equal(idx2[:, :width], idx) and not idx2[:, width:].any()
    loc = torch.stack([torch.tensor([[int(r2t[int(rpi[b]), _draft_pos(L, j, t, K, S, P)])
                                      for t in range(S)] for j in range(K)])
                       for b, L in enumerate(lengths)])
    _, idx3 = M.draft_kv_indices(r2t, rpi, seq, K, S, P, out_cache_loc=loc,
                                 index_dtype=torch.int64)
    assert torch.equal(idx3, idx)
    # A different out_cache_loc must change exactly the history entries.
    _, idx4 = M.draft_kv_indices(r2t, rpi, seq, K, S, P, out_cache_loc=loc + 100000,
                                 index_dtype=torch.int64)
    assert (idx4 != idx).sum() == sum(K * (r + 1) * len(lengths) for r in range(S))


@pytest.mark.parametrize("lengths", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("topk", [1, 4, 8])
def test_assign_and_duplicate_match_upstream(lengths, page_size, topk):
    K, P = topk, page_size
    for S in (1, 3, 6):
        r2t, rpi, seq = _setup(lengths, seed=S)
        before = r2t.clone()
        # Upstream D.1 / D.2 extend lengths.
        exp_ext = []
        for L in lengths:
            if P == 1 or K == 1:
                exp_ext.append(K * S)
            else:
                last = L % P
                exp_ext.append(L - last + K * math.ceil((last + S) / P) * P - L)
        ext = M.draft_extend_lens(seq, K, S, P)
        assert ext.tolist() == exp_ext
        assert max(exp_ext) <= M.max_draft_extend_len(K, S, P)
        new = 10 ** 6 + torch.randperm(sum(exp_ext))
        out = M.assign_draft_cache_locs(r2t, rpi, seq, new, K, S, P)
        assert out.shape == (len(lengths), K, S) and out.dtype == new.dtype
        expected = before.clone()
        start = 0
        for b, L in enumerate(lengths):
            row = int(rpi[b])
            for e in range(exp_ext[b]):
                expected[row, L + e] = int(new[start + e])
            start += exp_ext[b]
        assert torch.equal(r2t, expected)
        for b, L in enumerate(lengths):
            for j in range(K):
                for t in range(S):
                    assert int(out[b, j, t]) == int(r2t[int(rpi[b]), _draft_pos(L, j, t, K, S, P)])
        # Branch 0 continues the request in place: R_b[L_b + t].
        assert torch.equal(out[:, 0, :].long(),
                           torch.stack([r2t[int(rpi[b]), L:L + S].long()
                                        for b, L in enumerate(lengths)]))
        # D.2 step 2, packed request-major, then branch, then t.
        src, dst = M.duplicate_last_page_copies(r2t, rpi, seq, K, S, P)
        exp_src, exp_dst = [], []
        if P > 1 and K > 1:
            for b, L in enumerate(lengths):
                row, last = int(rpi[b]), L % P
                base, npp = L - last, math.ceil((last + S) / P)
                for j in range(1, K):
                    for t in range(last):
                        exp_src.append(int(r2t[row, base + t]))
                        exp_dst.append(int(r2t[row, base + j * npp * P + t]))
        assert src.tolist() == exp_src and dst.tolist() == exp_dst
        assert len(exp_src) == (K - 1) * sum(L % P for L in lengths) * (P > 1 and K > 1)


def test_case_b_branch_regions_are_page_aligned():
    """Case B: each branch's region starts on a page boundary of the request's positions."""
    K, S, P = 4, 5, 16
    seq = torch.tensor([1, 15, 16, 17, 31])
    pos = M.draft_slot_positions(seq, K, S, P)
    for b, L in enumerate(seq.tolist()):
        last = L % P
        for j in range(K):
            assert (int(pos[b, j, 0]) - last) % P == 0
        assert int(pos[b, 0, 0]) == L
        assert int(pos[b, K - 1, S - 1]) < L + int(M.draft_extend_lens(seq, K, S, P)[b])


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_prefix_page_table(page_size):
    P = page_size
    lengths = [1, P, P + 1, 3 * P + 5]
    gen = torch.Generator().manual_seed(1)
    bs = len(lengths)
    max_pages = math.ceil(max(lengths) / P) + 1
    # Page-granular rows: position x lives in page pages[b][x // P] at offset x % P.
    pages = torch.randperm(100, generator=gen)[:bs * max_pages].reshape(bs, max_pages) + 1
    r2t = torch.zeros(bs + 1, max_pages * P, dtype=torch.int32)
    rpi = torch.tensor([3, 0, 4, 1])
    for b in range(bs):
        for x in range(max_pages * P):
            r2t[int(rpi[b]), x] = int(pages[b, x // P]) * P + x % P
    seq = torch.tensor(lengths)
    table = M.prefix_page_table(r2t, rpi, seq, P)
    assert table.dtype == torch.int32
    assert table.shape == (bs, math.ceil(max(lengths) / P))
    for b, L in enumerate(lengths):
        n = math.ceil(L / P)
        assert table[b, :n].tolist() == pages[b, :n].tolist()
        assert not table[b, n:].any()
    wide = M.prefix_page_table(r2t, rpi, seq, P, max_pages=max_pages + 2)
    assert wide.shape == (bs, max_pages + 2) and torch.equal(wide[:, :table.shape[1]], table)


def test_prefix_token_slots():
    r2t, rpi, seq = _setup([3, 0, 7], extra=5)
    slots, valid = M.prefix_token_slots(r2t, rpi, seq)
    assert slots.shape == (3, 7) and slots.dtype == torch.int64
    for b, L in enumerate([3, 0, 7]):
        assert valid[b].tolist() == [x < L for x in range(7)]
        assert slots[b, :L].tolist() == r2t[int(rpi[b]), :L].tolist()
        assert not slots[b, L:].any()
    slots2, valid2 = M.prefix_token_slots(r2t, rpi, seq, max_len=10)
    assert torch.equal(slots2[:, :7], slots) and not valid2[:, 7:].any()


def test_extend_token_slots():
    lengths, ext = [4, 9, 2], [1, 3, 2]
    r2t, rpi, seq = _setup(lengths, extra=3)
    es = M.extend_token_slots(r2t, rpi, seq, torch.tensor(ext))
    assert es.qo_indptr.tolist() == [0, 1, 4, 6]
    assert es.prefix_lens.tolist() == [3, 6, 0]
    req, pos, vis = [], [], []
    for b, (L, E) in enumerate(zip(lengths, ext)):
        for t in range(E):
            req.append(b), pos.append(t), vis.append(L - E + t + 1)
        assert es.slots[b, :L].tolist() == r2t[int(rpi[b]), :L].tolist()
        assert es.valid[b].sum() == L
    assert es.token_req.tolist() == req
    assert es.token_pos.tolist() == pos
    assert es.token_visible.tolist() == vis


def _explicit_tree():
    """One request, K = 3 lanes, S = 4 steps; lane j's step-t slot is 100 + 10*j + t.

    parents[t][j] = lane at step t-1 holding the parent of lane j's step-t token. Chains,
    worked out by hand (slot of (lane, step) = 1<lane><step>):
      step 3, lane 0: (0,3) <- (0,2) <- (1,1) <- (0,0)   -> 100, 111, 102, 103
      step 3, lane 1: (1,3) <- (2,2) <- (0,1) <- (2,0)   -> 120, 101, 122, 113
      step 3, lane 2: (2,3) <- (2,2) <- (0,1) <- (2,0)   -> 120, 101, 122, 123
      step 1, lane 0: (0,1) <- (2,0)                     -> 120, 101
    """
    loc = torch.tensor([[[100 + 10 * j + t for t in range(4)] for j in range(3)]])
    parents = torch.tensor([[0, 0, 0], [2, 0, 2], [1, 1, 0], [0, 2, 2]])[:, None, :]
    expected_step3 = [[100, 111, 102, 103], [120, 101, 122, 113], [120, 101, 122, 123]]
    return loc, parents, expected_step3


def test_path_history_explicit_tree():
    loc, parents, expected = _explicit_tree()
    hist = M.history_slots(loc, parents.to(torch.int32), 3, "path")
    assert hist[0].tolist() == expected
    assert M.history_slots(loc, parents, 1, "path")[0, 0].tolist() == [120, 101]
    assert M.history_slots(loc, parents, 0, "path")[0].tolist() == [[100], [110], [120]]
    # lane mode ignores parents: each lane's own column.
    assert M.history_slots(loc, parents, 3, "lane")[0].tolist() == loc[0].tolist()
    table = M.history_page_table(loc, parents, 3, "path")
    assert table.dtype == torch.int32 and table.tolist() == expected


def test_path_history_random_forest_against_loops():
    gen = torch.Generator().manual_seed(3)
    B, K, S = 3, 5, 6
    loc = torch.randperm(1000, generator=gen)[:B * K * S].reshape(B, K, S)
    parents = torch.randint(0, K, (S, B, K), generator=gen)
    for step in range(S):
        hist = M.path_history_slots(loc, parents, step)
        for b in range(B):
            for j in range(K):
                a, chain = j, []
                for t in range(step, -1, -1):
                    chain.append(int(loc[b, a, t]))
                    a = int(parents[t, b, a])
                assert hist[b, j].tolist() == chain[::-1]


def test_history_slots_path_needs_parents():
    from specattn.errors import InvalidInputError

    loc, _, _ = _explicit_tree()
    with pytest.raises(InvalidInputError, match="parents"):
        M.history_slots(loc, None, 1, "path")
    with pytest.raises(InvalidInputError, match="tree_mode"):
        M.history_slots(loc, None, 1, "tree")


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_copy_kv_slots(mla):
    kw = dict(num_layers=2, num_slots=32, max_reqs=2, max_context_len=8,
              dtype=torch.float32)
    runner = DraftRunner.mla(2, 8, 4, **kw) if mla else DraftRunner.mha(2, 1, 8, **kw)
    pools = [runner.kv_buffer] if mla else [runner.k_buffer, runner.v_buffer]
    for pool in pools:
        for buf in pool:
            buf.copy_(torch.randn_like(buf))
    before = [[buf.clone() for buf in pool] for pool in pools]
    src, dst = torch.tensor([1, 2, 3]), torch.tensor([20, 5, 9])
    M.copy_kv_slots(runner, src, dst)
    for pool, old in zip(pools, before):
        for buf, o in zip(pool, old):
            assert torch.equal(buf[dst], o[src])
            untouched = torch.ones(32, dtype=torch.bool)
            untouched[dst] = False
            assert torch.equal(buf[untouched], o[untouched])
