"""``flashmla`` with the real FlashMLA kernels (the ``sgl-flash-mla`` wheel's legacy sm90
extension) on the H200, against ``torch_ref``. Skips with the reason when ``flash_mla`` does
not import (it declares torch >= 2.14; the H200 has 2.11)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from specattn.backends.flashmla import FlashMLADecode  # noqa: E402
from specattn.backends.torch_ref import reference_decode  # noqa: E402
from specattn.data import AttentionLayer, DraftRunner  # noqa: E402
from standins._common import assert_close, paged_round  # noqa: E402

pytestmark = pytest.mark.gpu
HEADS = 16


def _flash_mla_or_skip():
    try:
        import flash_mla  # noqa: F401
    except Exception as exc:  # the wheel may not load beside this torch
        pytest.skip(f"flash_mla does not import here: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("topk,tree_mode,lens", [(1, "lane", [700, 1300]),
                                                 (4, "lane", [640, 65]),
                                                 (4, "path", [1000, 1000, 3])])
def test_flashmla_decode_matches_reference(topk, tree_mode, lens):
    _flash_mla_or_skip()
    gen = torch.Generator().manual_seed(0)
    runner = DraftRunner.mla(HEADS, 512, 64, num_layers=1, num_slots=64 * 256, max_reqs=8,
                             max_context_len=2048, page_size=64, dtype=torch.bfloat16,
                             device="cuda")
    backend = FlashMLADecode(runner, topk, 3, tree_mode=tree_mode)
    batch = paged_round(runner, lens, topk, 3, gen, parents=tree_mode == "path")
    backend.init_forward_metadata(batch)
    n = batch.batch_size * topk
    for step in range(3):
        layer = AttentionLayer(0, 192 ** -0.5)
        q = torch.randn(n, HEADS, 576, generator=gen).to("cuda", torch.bfloat16)
        k = (torch.randn(n, 576, generator=gen) * 0.5).to("cuda", torch.bfloat16)
        out = backend.forward(step, layer, q, k, None)
        want = reference_decode(runner, layer, q, batch, step, tree_mode)
        assert_close(out, want, torch.bfloat16)
