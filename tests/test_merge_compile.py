"""The split merge compiled for sm90 without a GPU: ``merge_partials`` is called on CPU tensors
at the bench's serving shapes (an H200's 132 SMs) with its launch captured, and the launch is
compiled by Triton down to SASS, in a child process without ``TRITON_INTERPRET``, with the
Triton release the GPU runs (skipped under any other).

Checked: the tiles ``merge_tiles`` picks give one-warp programs that fold their parts with a
single block barrier (a reduction across warps takes shared memory and about a dozen) and no
spills, and the MLA rows of a program a row keep four warps; the work list's segment merge
(``worklist.segment_tiles``) builds one-warp programs without spills at the MLA serving
shapes, over the bf16 partials ``gluon-wl`` writes. The timings: ``docs/kernels.md``
(one-warp merge programs).
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

pytest.importorskip("triton")

from specattn.backends.triton import plans  # noqa: E402
from sm90_compile import Capture, compile_launch, in_child, sass_counts  # noqa: E402

_SASS_OPS = re.compile(r"\b(BAR|STS)\b")


def built_counts(kernel, capture: Capture) -> dict:
    """The one launch ``capture`` recorded of ``kernel``: its grid, tiles and its sm90
    build's barriers, shared stores, registers and spills."""
    (_, grid, args, kw), = capture.launches
    built = compile_launch(kernel, args, kw)
    return dict(grid=list(grid), block_d=kw["BLOCK_D"], block_p=kw["BLOCK_P"],
                warps=kw["num_warps"], **sass_counts(built.asm["cubin"], _SASS_OPS))


def compile_case(rows: int, heads: int, parts: int, d_v: int) -> dict:
    """The captured ``merge_partials`` launch of ``[rows, heads, parts, d_v]`` partials: its
    tiles and its sm90 build's barriers, shared stores, registers and spills."""
    from specattn.kernels import merge

    merge.sm_count = lambda device: 132
    kernel = merge.merge_kernel
    capture = Capture(kernel)
    merge.merge_kernel = capture
    merge.merge_partials(torch.zeros(rows, heads, parts, d_v), torch.zeros(rows, heads, parts),
                         torch.zeros(rows, heads, d_v, dtype=torch.bfloat16), parts)
    return built_counts(kernel, capture)


def compile_segments(batch: int, topk: int, heads: int, programs: int, d_v: int) -> dict:
    """The captured segment-merge launch of ``batch`` requests over ``programs`` programs:
    its tiles and its sm90 build's counts."""
    from specattn.backends.triton import worklist

    worklist.sm_count = lambda device: 132
    kernel = worklist.merge_segments_kernel
    capture = Capture(kernel)
    worklist.merge_segments_kernel = capture
    slots, rows = programs + batch, worklist.partial_rows(topk, heads)
    # bf16 partials, as ``gluon-wl`` writes them under a bf16 model.
    worklist.merge(torch.zeros(slots, rows, d_v, dtype=torch.bfloat16), torch.zeros(slots, rows),
                   torch.zeros(batch * topk, heads, d_v, dtype=torch.bfloat16),
                   torch.zeros(worklist.work_numel(programs, batch), dtype=torch.int32),
                   programs, topk)
    return built_counts(kernel, capture)


@pytest.fixture(scope="module")
def triton_of_the_gpu():
    import triton

    if not plans._gluon_version(triton.__version__):
        pytest.skip(f"triton {triton.__version__}: compiled with the GPU's triton "
                    f"({'/'.join(plans.GLUON_TRITON)}) only")


@pytest.mark.parametrize("name,shape,warps", [
    ("gqa-b1-32k", (4, 32, 65, 128), 1),  # chunks of 32 columns, every part in one load
    ("gqa-b1-32k-fp8", (4, 32, 50, 128), 1),
    ("gqa-b1-k8", (8, 32, 34, 128), 1),  # a program a row, 64 parts x 128 columns a load
    ("gqa-b8-p16", (32, 32, 11, 128), 1),
    ("mla-b1-32k-extend", (6, 16, 64, 512), 1),
    ("mla-b8-p64-extend", (48, 16, 8, 512), 4),  # a program a row of 512 columns
])
def test_merge_builds_for_sm90(triton_of_the_gpu, name, shape, warps):
    got = in_child(__file__, dict(zip(("rows", "heads", "parts", "d_v"), shape)))
    print(name, got)
    assert got["warps"] == warps and got["stack"] == 0, got
    if warps == 1:
        assert got.get("BAR", 0) <= 1, got


@pytest.mark.parametrize("name,shape,tiles", [
    ("mla-b1-32k", (1, 4, 16, 132), (32, 32)),  # batch, topk, heads, programs; columns, parts
    ("mla-small", (4, 4, 16, 132), (128, 32)),
    ("mla-b8-p64", (8, 4, 16, 132), (512, 16)),  # a whole row: 8192 values
    ("mla-long", (32, 4, 16, 132), (512, 4)),
])
def test_segment_merge_builds_for_sm90(triton_of_the_gpu, name, shape, tiles):
    got = in_child(__file__, dict(zip(("batch", "topk", "heads", "programs"), shape), d_v=512))
    print(name, got)
    assert (got["block_d"], got["block_p"], got["warps"]) == (*tiles, 1), got
    assert got["stack"] == 0 and got.get("BAR", 0) <= 2, got


if __name__ == "__main__":
    case = json.loads(sys.argv[1])
    print(json.dumps((compile_segments if "programs" in case else compile_case)(**case)))
