"""``flashmla`` glue through the recording ``flash_mla`` stand-in (tests/standins).

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``); this file keeps the ones specific to FlashMLA: the
recorded library calls and their arguments, ``fused_history = False``, a prefix ending on a
page boundary, the library's interface variants, graph buffers and errors.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specattn.backends.flashmla import FlashMLADecode
from specattn.backends.torch_ref import reference_decode
from specattn.data import AttentionLayer, DraftRunner
from specattn.errors import BackendUnavailableError, InvalidInputError
from specattn.platforms import Platform, use_platform
from standins import flash_mla as fm_standin
from standins._common import assert_close, install, paged_round

H100 = Platform("cuda", (9, 0), libraries={"flash_mla"})
HEADS = 2


def _runner(dtype, num_slots=64 * 16, kv_lora_rank=512):
    return DraftRunner.mla(HEADS, kv_lora_rank, 64, num_layers=2, num_slots=num_slots,
                           max_reqs=8, max_context_len=640, page_size=64, dtype=dtype)


def _backend(runner, topk, steps, tree_mode="lane"):
    with use_platform(H100):
        return FlashMLADecode(runner, topk, steps, tree_mode=tree_mode)


def _run_round(backend, runner, batch, gen, layers=(1, 0)):
    """Every step, every layer: backend vs torch_ref (after the backend's KV write)."""
    n = batch.batch_size * backend.topk
    for step in range(backend.num_steps):
        for lid in layers:
            layer = AttentionLayer(lid, 576 ** -0.5 * 1.3)
            q = torch.randn(n, HEADS, 576, generator=gen).to(runner.dtype)
            k = torch.randn(n, 576, generator=gen).to(runner.dtype) * 0.5
            out = backend.forward(step, layer, q, k, None)
            want = reference_decode(runner, layer, q, batch, step, backend.tree_mode)
            assert_close(out, want, runner.dtype)


@pytest.mark.parametrize("dtype,topk,tree_mode,lens,fused", [
    (torch.bfloat16, 3, "lane", [64, 17], True),  # L = 64: the prefix fills its last page
    (torch.bfloat16, 3, "path", [90, 40], False),
    (torch.float16, 3, "path", [90, 40], False)])
def test_decode_matches_reference(monkeypatch, dtype, topk, tree_mode, lens, fused):
    """``fused``: the Triton history + merge kernel stores the step's KV (the reference reads
    it from the pool afterwards; the kit's cases run it); else the torch history pass and
    merge."""
    install(monkeypatch, "flash_mla", fm_standin.make()[0])
    gen = torch.Generator().manual_seed(1)
    runner = _runner(dtype)
    backend = _backend(runner, topk, 3, tree_mode)
    backend.fused_history = fused
    batch = paged_round(runner, lens, topk, 3, gen, parents=tree_mode == "path")
    backend.init_forward_metadata(batch)
    _run_round(backend, runner, batch, gen)


def test_sgl_flash_mla_wheel_dense_decode_goes_through_use_legacy(monkeypatch):
    """Found on the H200: sgl-flash-mla 1.0 refuses dense decoding without use_legacy=True."""
    install(monkeypatch, "flash_mla", fm_standin.make(sgl_legacy=True)[0])
    gen = torch.Generator().manual_seed(2)
    runner = _runner(torch.bfloat16)
    backend = _backend(runner, 2, 2)
    batch = paged_round(runner, [70, 9], 2, 2, gen)
    backend.init_forward_metadata(batch)
    _run_round(backend, runner, batch, gen, layers=(0,))


def test_new_interface_sched_meta(monkeypatch):
    """FlashMLA's newer interface: ``get_mla_metadata`` → ``(FlashMLASchedMeta, None)``."""
    mod, calls = fm_standin.make(new_interface=True)
    install(monkeypatch, "flash_mla", mod)
    gen = torch.Generator().manual_seed(2)
    runner = _runner(torch.bfloat16)
    backend = _backend(runner, 2, 2)
    batch = paged_round(runner, [65, 3], 2, 2, gen)
    backend.init_forward_metadata(batch)
    _run_round(backend, runner, batch, gen, layers=(0,))
    kernel = [c for c in calls if c.name == "flash_mla_with_kvcache"]
    assert all(c.args["num_splits"] is None for c in kernel)


def test_arguments_are_the_documented_ones(monkeypatch):
    mod, calls = fm_standin.make()
    install(monkeypatch, "flash_mla", mod)
    gen = torch.Generator().manual_seed(3)
    runner = _runner(torch.bfloat16)
    topk, steps = 3, 2
    backend = _backend(runner, topk, steps)
    batch = paged_round(runner, [70, 5], topk, steps, gen)
    backend.init_forward_metadata(batch)
    layer = AttentionLayer(1, 0.07)
    q = torch.randn(2 * topk, HEADS, 576).bfloat16()
    backend.forward(0, layer, q, torch.randn(2 * topk, 576).bfloat16(), None)

    meta, kernel = calls
    assert meta.name == "get_mla_metadata"
    assert meta.passed == ("cache_seqlens", "num_q_tokens_per_head_k", "num_heads_k")
    assert meta.describe("cache_seqlens") == ((2,), torch.int32, "cpu")
    assert meta.args["cache_seqlens"].tolist() == [70, 5]
    assert meta.args["num_q_tokens_per_head_k"] == topk * HEADS  # s_q * h_q // h_k
    assert meta.args["num_heads_k"] == 1
    assert kernel.name == "flash_mla_with_kvcache"
    assert kernel.passed == ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v",
                             "tile_scheduler_metadata", "num_splits", "softmax_scale",
                             "causal")
    assert kernel.describe("q") == ((2, topk, HEADS, 576), torch.bfloat16, "cpu")
    assert kernel.describe("k_cache") == ((16, 64, 1, 576), torch.bfloat16, "cpu")
    assert kernel.args["k_cache"].data_ptr() == runner.kv_buffer[1].data_ptr()
    assert kernel.args["head_dim_v"] == 512
    assert kernel.args["softmax_scale"] == 0.07 and kernel.args["causal"] is False
    # Page-level block table: entry p is R_b[p * 64] // 64.
    table = kernel.args["block_table"]
    assert table.dtype == torch.int32 and table.shape == (2, 10)
    r2t = runner.req_to_token
    assert table[0, :2].tolist() == [int(r2t[1, 0]) // 64, int(r2t[1, 64]) // 64]
    assert table[1, 0] == int(r2t[3, 0]) // 64
    assert kernel.describe("tile_scheduler_metadata") == ((fm_standin.NUM_SM_PARTS, 8),
                                                          torch.int32, "cpu")
    assert kernel.args["num_splits"].tolist() == [0, 1, 2]  # the stand-in's answer, passed on


def test_wrong_block_table_gives_wrong_answer(monkeypatch):
    """The stand-in really reads through the table (so the parity tests can fail)."""
    install(monkeypatch, "flash_mla", fm_standin.make()[0])
    gen = torch.Generator().manual_seed(4)
    runner = _runner(torch.float16)
    backend = _backend(runner, 1, 2)
    batch = paged_round(runner, [130], 1, 2, gen)
    backend.init_forward_metadata(batch)
    backend._bufs.get("block_table", (1, 10))[0, 1] += 1
    layer = AttentionLayer(0, 0.05)
    q = torch.randn(1, HEADS, 576, generator=gen).half()
    out = backend.forward(0, layer, q, torch.randn(1, 576, generator=gen).half(), None)
    want = reference_decode(runner, layer, q, batch, 0)
    assert not torch.allclose(out.float(), want.float(), atol=5e-3, rtol=5e-3)


def test_cuda_graph_buffers_are_fixed_and_replay_matches(monkeypatch):
    mod, calls = fm_standin.make()
    install(monkeypatch, "flash_mla", mod)
    gen = torch.Generator().manual_seed(5)
    runner = _runner(torch.bfloat16)
    backend = _backend(runner, 2, 2)
    backend.init_cuda_graph_state(max_bs=3, max_num_tokens=6)
    ptrs = {n: backend._bufs.data_ptr(n) for n in
            ("block_table", "cache_seqlens", "tile_scheduler_metadata", "num_splits")}
    capture = paged_round(runner, [64, 1, 99], 2, 2, gen)
    backend.init_forward_metadata_capture_cuda_graph(capture)
    replay = paged_round(runner, [3, 120, 70], 2, 2, gen)
    backend.init_forward_metadata_replay_cuda_graph(replay, 3)
    _run_round(backend, runner, replay, gen, layers=(0,))
    for c in calls:
        if c.name == "flash_mla_with_kvcache":
            assert c.args["block_table"].data_ptr() == ptrs["block_table"]
            assert c.args["cache_seqlens"].data_ptr() == ptrs["cache_seqlens"]
            assert c.args["tile_scheduler_metadata"].data_ptr() == ptrs[
                "tile_scheduler_metadata"]
            assert c.args["num_splits"].data_ptr() == ptrs["num_splits"]
    with pytest.raises(InvalidInputError, match="max_bs=3"):
        backend.init_forward_metadata_replay_cuda_graph(
            paged_round(runner, [5, 5, 5, 5], 2, 2, gen), 4)


def test_graph_methods_need_init(monkeypatch):
    install(monkeypatch, "flash_mla", fm_standin.make()[0])
    runner = _runner(torch.bfloat16)
    backend = _backend(runner, 1, 2)
    batch = paged_round(runner, [5], 1, 2, torch.Generator().manual_seed(0))
    with pytest.raises(InvalidInputError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_capture_cuda_graph(batch)


def test_without_the_library_the_constructor_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import flash_mla fails
    with pytest.raises(BackendUnavailableError, match="pip install sgl-flash-mla"):
        _backend(_runner(torch.bfloat16), 1, 2)


def test_shape_and_layer_errors(monkeypatch):
    install(monkeypatch, "flash_mla", fm_standin.make()[0])
    with pytest.raises(BackendUnavailableError, match="kv_lora_rank 512"):
        _backend(DraftRunner.mla(HEADS, 448, 128, num_layers=1, num_slots=128, max_reqs=2,
                                 max_context_len=64, page_size=64), 1, 2)
    with pytest.raises(InvalidInputError, match="multiple of the page size 64"):
        _backend(_runner(torch.bfloat16, num_slots=100), 1, 2)
    runner = _runner(torch.bfloat16)
    backend = _backend(runner, 1, 2)
    backend.init_forward_metadata(paged_round(runner, [5], 1, 2,
                                              torch.Generator().manual_seed(0)))
    q = torch.zeros(1, HEADS, 576).bfloat16()
    with pytest.raises(InvalidInputError, match="soft cap"):
        backend.forward(0, AttentionLayer(0, 0.1, logit_cap=30.0), q,
                        torch.zeros(1, 576).bfloat16(), None)
    with pytest.raises(BackendUnavailableError, match="page sizes"):
        with use_platform(H100):
            FlashMLADecode(DraftRunner.mla(HEADS, 512, 64, num_layers=1, num_slots=128,
                                           max_reqs=2, max_context_len=64, page_size=1), 1, 2)


def test_listing_says_where_it_ran():
    assert FlashMLADecode.describe()["tested_on"].startswith("H200 (sm90) GPU tests")
    assert FlashMLADecode.pending is None
