"""``merge_partials`` (the split-KV merge) under the interpreter against a float64 softmax
of the partials: one part and many, in one load and in several, in one column chunk and in
the chunks a GPU's SM count asks for (a last chunk past the row's width too); parts past the
count are NaN and never read."""

from __future__ import annotations

import pytest
import torch

from specattn.kernels import merge

DEV = "cpu"


@pytest.mark.parametrize("sms", [None, 132])
@pytest.mark.parametrize("parts,d_v,rows", [(1, 128, 3), (4, 16, 3), (65, 128, 3),
                                             (45, 512, 3), (7, 80, 24)])
def test_merge_partials_is_the_lse_softmax(monkeypatch, sms, parts, d_v, rows):
    monkeypatch.setattr(merge, "sm_count", lambda device: sms)
    heads = 2
    tiles = merge.merge_tiles(rows * heads, d_v, parts, torch.device(DEV))
    if sms and d_v > 16:
        assert tiles.chunks > 1  # few rows: the columns are split
        if d_v == 80:  # 48 rows of 80 columns: chunks of 32, the last one half masked
            assert (tiles.chunks, tiles.block_d) == (3, 32)
    else:
        assert sms is None or d_v == 16 or tiles is None
    gen = torch.Generator().manual_seed(parts * d_v)
    o = torch.randn(rows, heads, parts, d_v, generator=gen, dtype=torch.float64)
    lse = 4 * torch.randn(rows, heads, parts, generator=gen, dtype=torch.float64)
    lse[0, 0, 0] = float("-inf")  # a part that saw no key
    mid_o = torch.full((rows, heads, parts + 2, d_v), float("nan"))
    mid_lse = torch.full((rows, heads, parts + 2), float("nan"))
    mid_o[:, :, :parts], mid_lse[:, :, :parts] = o.float(), lse.float()
    out = torch.full((rows, heads, d_v), float("nan"), dtype=torch.bfloat16)
    merge.merge_partials(mid_o, mid_lse, out, parts)
    want = (torch.softmax(lse, -1)[..., None] * o).sum(2)
    if parts == 1:
        want[0, 0] = float("nan")  # its only part saw no key
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2, equal_nan=True)


def test_merge_tiles_fill_the_gpu_only_where_rows_do_not(monkeypatch):
    dev = torch.device(DEV)
    assert merge.merge_tiles(64, 512, 264, dev) is None  # no SM count: one program per row
    monkeypatch.setattr(merge, "sm_count", lambda device: 132)
    assert merge.merge_tiles(256 * 32, 128, 4, dev) is None  # gqa-long: the rows fill the GPU
    assert merge.merge_tiles(32 * 16, 512, 33, dev) is None  # mla-b8-p64 too
    one = merge.merge_tiles(4 * 16, 512, 264, dev)  # one MLA request over every SM
    assert (one.chunks, one.block_d, one.block_p, one.num_warps) == (16, 32, 256, 4)
    # gqa-b1-32k (4 lanes x 32 heads, 65 parts): 32 columns, every part in one load, one warp
    assert merge.merge_tiles(4 * 32, 128, 65, dev) == (4, 32, 128, 1)
    assert merge.merge_tiles(6 * 16, 512, 64, dev) == (16, 32, 64, 1)  # mla-b1-32k-extend
    assert merge.merge_tiles(2 * 8, 128, 33, dev) == (8, 16, 64, 1)  # 64 programs at 32 wide


def test_merge_partials_one_warp_a_row_of_up_to_128_columns(monkeypatch):
    """Where the rows fill the GPU, a program a row: one warp up to 128 columns (GQA), four
    above (an MLA latent)."""
    from specattn.backends.triton import launchers

    monkeypatch.setattr(merge, "sm_count", lambda device: 132)
    launches = []

    class Capture:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw["BLOCK_D"], kw["BLOCK_P"],
                                                        kw["num_warps"]))

    monkeypatch.setattr(merge, "merge_kernel", Capture())
    for rows, heads, parts, d_v in ((8, 32, 34, 128), (32, 32, 11, 128), (32, 16, 5, 512)):
        merge.merge_partials(torch.zeros(rows, heads, parts, d_v), torch.zeros(rows, heads, parts),
                             torch.zeros(rows, heads, d_v), parts)
    assert launches == [((8, 32, 1), 128, 64, 1), ((32, 32, 1), 128, 16, 1),
                        ((32, 16, 1), 512, 8, 4)]
    assert launchers.merge_partials is merge.merge_partials
