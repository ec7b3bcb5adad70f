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


@pytest.mark.parametrize("fused", [False, True], ids=["torch-history", "triton-history"])
@pytest.mark.parametrize("topk,tree_mode,lens", [(1, "lane", [700, 1300]),
                                                 (4, "lane", [640, 65]),
                                                 (4, "path", [1000, 1000, 3])])
def test_flashmla_decode_matches_reference(topk, tree_mode, lens, fused):
    _flash_mla_or_skip()
    gen = torch.Generator().manual_seed(0)
    runner = DraftRunner.mla(HEADS, 512, 64, num_layers=1, num_slots=64 * 256, max_reqs=8,
                             max_context_len=2048, page_size=64, dtype=torch.bfloat16,
                             device="cuda")
    backend = FlashMLADecode(runner, topk, 3, tree_mode=tree_mode)
    backend.fused_history = fused
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


def test_flashmla_decode_fp16():
    """fp16 q and latent cache (declared in ``FlashMLADecode.dtypes``), K = 2, path mode."""
    _flash_mla_or_skip()
    gen = torch.Generator().manual_seed(1)
    runner = DraftRunner.mla(HEADS, 512, 64, num_layers=1, num_slots=64 * 128, max_reqs=8,
                             max_context_len=2048, page_size=64, dtype=torch.float16,
                             device="cuda")
    backend = FlashMLADecode(runner, 2, 2, tree_mode="path")
    batch = paged_round(runner, [300, 1500, 64], 2, 2, gen, parents=True)
    backend.init_forward_metadata(batch)
    for step in range(2):
        layer = AttentionLayer(0, 192 ** -0.5)
        q = torch.randn(6, HEADS, 576, generator=gen).to("cuda", torch.float16)
        k = (torch.randn(6, 576, generator=gen) * 0.5).to("cuda", torch.float16)
        out = backend.forward(step, layer, q, k, None)
        assert_close(out, reference_decode(runner, layer, q, batch, step, "path"),
                     torch.float16)


def test_flashmla_cuda_graph_replay_padded():
    """Capture all steps at bs = 4, replay a round of 3 requests padded to 4 with new
    lengths, pool rows, slots and parents: the real lanes equal the reference."""
    _flash_mla_or_skip()
    gen = torch.Generator().manual_seed(2)
    K, S, max_bs, real = 4, 3, 4, 3
    runner = DraftRunner.mla(HEADS, 512, 64, num_layers=1, num_slots=64 * 256, max_reqs=10,
                             max_context_len=2048, page_size=64, dtype=torch.bfloat16,
                             device="cuda")
    backend = FlashMLADecode(runner, K, S, tree_mode="path")
    backend.init_cuda_graph_state(max_bs, max_bs * K)
    batch = paged_round(runner, [1200] * max_bs, K, S, gen, parents=True)
    layer = AttentionLayer(0, 192 ** -0.5)
    n = max_bs * K
    qs = [torch.randn(n, HEADS, 576, generator=gen).to("cuda", torch.bfloat16)
          for _ in range(S)]
    ks = [(torch.randn(n, 576, generator=gen) * 0.5).to("cuda", torch.bfloat16)
          for _ in range(S)]
    backend.init_forward_metadata_capture_cuda_graph(batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph (JIT, scheduler state)
        for step in range(S):
            backend.forward(step, layer, qs[step], ks[step], None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [backend.forward(step, layer, qs[step], ks[step], None) for step in range(S)]

    fresh = paged_round(runner, [900, 65, 1700], K, S, gen, parents=True)  # new pages and lengths
    batch.seq_lens.fill_(backend.get_cuda_graph_seq_len_fill_value())
    batch.seq_lens[:real] = fresh.seq_lens
    batch.req_pool_indices.zero_()
    batch.req_pool_indices[:real] = fresh.req_pool_indices
    batch.out_cache_loc.fill_(runner.num_slots - 1)
    batch.out_cache_loc[:real] = fresh.out_cache_loc
    batch.parents.zero_()
    batch.parents[:, :real] = fresh.parents
    backend.init_forward_metadata_replay_cuda_graph(batch, max_bs)
    graph.replay()
    torch.cuda.synchronize()
    m = real * K
    for step in range(S):
        want = reference_decode(runner, layer, qs[step][:m], fresh, step, "path")
        assert_close(outs[step][:m], want, torch.bfloat16)
