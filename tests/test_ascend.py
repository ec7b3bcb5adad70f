"""``ascend`` and ``dsv4`` (NPU flavour) glue through the recording ``torch_npu`` stand-in.

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``); this file keeps the ones specific to Ascend: a
prefix ending on a page boundary, the recorded calls and their arguments (block tables,
per-lane lengths), dsv4's windows and sinks on the NPU, graph buffers, errors.
"""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import random_qkv as _qkv
from specattn.backends.ascend import AscendDecode, AscendExtend, DSV4NpuDecode, DSV4NpuExtend
from specattn.backends.torch_ref import reference_decode
from specattn.backends.torch_ref_sparse import reference_window_decode, reference_window_extend
from specattn.data import AttentionLayer, DraftRunner
from specattn.errors import BackendUnavailableError, InvalidInputError
from specattn.platforms import Platform, use_platform
from standins import torch_npu as npu_standin
from standins._common import assert_close, extend_batch, install, paged_round

NPU = Platform("npu", libraries={"torch_npu"})


def _mha(dtype, page=16, slots=16 * 24):
    return DraftRunner.mha(4, 2, 32, num_layers=2, num_slots=slots, max_reqs=8,
                           max_context_len=160, page_size=page, dtype=dtype)


def _mla(dtype, page=16):
    return DraftRunner.mla(4, 64, 16, num_layers=2, num_slots=16 * 24, max_reqs=8,
                           max_context_len=160, page_size=page, dtype=dtype)


def _window_runner(dtype):
    return DraftRunner.mla(2, 64, 0, num_layers=1, num_slots=16 * 24, max_reqs=8,
                           max_context_len=160, page_size=16, dtype=dtype)


def _make(cls, runner, *args, **kw):
    with use_platform(NPU):
        return cls(runner, *args, **kw)


@pytest.mark.parametrize("model", ["mha", "mla"])
def test_decode_prefix_ending_on_a_page_boundary(monkeypatch, model):
    """L = 16 = P: no partial prefix page to copy into the lanes' pages (``last = 0``); the
    kit's prefix lengths always leave one."""
    install(monkeypatch, "torch_npu", npu_standin.make()[0])
    gen = torch.Generator().manual_seed(11)
    dtype, topk, lens = torch.bfloat16, 3, [16, 5]
    runner = (_mha if model == "mha" else _mla)(dtype)
    backend = _make(AscendDecode, runner, topk, 3)
    batch = paged_round(runner, lens, topk, 3, gen)
    backend.init_forward_metadata(batch)
    for step in range(3):
        layer = AttentionLayer(1, 0.11)
        q, k, v = _qkv(runner, len(lens) * topk, gen)
        out = backend.forward(step, layer, q, k, v)
        assert_close(out, reference_decode(runner, layer, q, batch, step), dtype)


def test_fia_arguments_are_the_documented_ones(monkeypatch):
    mod, calls = npu_standin.make()
    install(monkeypatch, "torch_npu", mod)
    gen = torch.Generator().manual_seed(13)
    runner = _mha(torch.float16)
    backend = _make(AscendDecode, runner, 2, 2)
    batch = paged_round(runner, [20, 7], 2, 2, gen)
    backend.init_forward_metadata(batch)
    q, k, v = _qkv(runner, 4, gen)
    backend.forward(1, AttentionLayer(0, 0.3), q, k, v)
    (c,) = calls
    assert c.name == "npu_fused_infer_attention_score"
    assert set(c.passed) == {"query", "key", "value", "num_heads", "num_key_value_heads",
                             "input_layout", "scale", "block_table", "block_size",
                             "actual_seq_lengths_kv"}
    assert c.describe("query") == ((4, 1, 4, 32), torch.float16, "cpu")
    assert c.describe("key") == ((24, 16, 64), torch.float16, "cpu")
    assert c.args["key"].data_ptr() == runner.k_buffer[0].data_ptr()
    assert c.args["value"].data_ptr() == runner.v_buffer[0].data_ptr()
    assert (c.args["num_heads"], c.args["num_key_value_heads"]) == (4, 2)
    assert c.args["input_layout"] == "BSND" and c.args["block_size"] == 16
    assert c.args["actual_seq_lengths_kv"] == [22, 22, 9, 9]  # L_b + step + 1 per lane
    table = c.args["block_table"]
    r2t = runner.req_to_token
    # Lane 1 of request 0: the full prefix page, then its own page (after lane 0's).
    assert table[1, 0] == int(r2t[1, 0]) // 16
    assert table[1, 1] == int(r2t[1, 16 + 16]) // 16  # base 16 + j*npp*P, npp = 1
    assert table[0, 1] == int(r2t[1, 16]) // 16


def test_mla_arguments_are_the_documented_ones(monkeypatch):
    mod, calls = npu_standin.make()
    install(monkeypatch, "torch_npu", mod)
    gen = torch.Generator().manual_seed(14)
    runner = _mla(torch.bfloat16)
    backend = _make(AscendExtend, runner)
    batch = extend_batch(runner, [18, 2], [2, 2], gen)
    backend.init_forward_metadata(batch)
    q, k, _ = _qkv(runner, 4, gen)
    backend.forward(AttentionLayer(1, 0.3), q, k, None)
    (c,) = calls
    assert c.name == "_npu_paged_attention_mla"
    assert c.describe("key_cache") == ((24, 16, 1, 80), torch.bfloat16, "cpu")
    assert c.args["context_lens"].tolist() == [17, 18, 1, 2]  # causal per token
    assert c.args["mla_vheadsize"] == 64 and c.args["num_kv_heads"] == 1
    assert c.describe("out") == ((4, 4, 64), torch.bfloat16, "cpu")


@pytest.mark.parametrize("sink", [None, "random"])
def test_dsv4_npu_window_and_sink(monkeypatch, sink):
    install(monkeypatch, "torch_npu", npu_standin.make()[0])
    gen = torch.Generator().manual_seed(15)
    runner = _window_runner(torch.bfloat16)
    attn_sink = None if sink is None else torch.randn(2, generator=gen)
    dec = _make(DSV4NpuDecode, runner, 2, 2, window=8)
    batch = paged_round(runner, [5, 30], 2, 2, gen)
    dec.init_forward_metadata(batch)
    for step in range(2):
        layer = AttentionLayer(0, 0.1)
        q, k, _ = _qkv(runner, 4, gen)
        out = dec.forward(step, layer, q, k, None, attn_sink=attn_sink)
        want = reference_window_decode(runner, layer, q, batch, step, window=8,
                                       attn_sink=attn_sink)
        assert_close(out, want, torch.bfloat16)
    ext = _make(DSV4NpuExtend, runner, window=8)
    eb = extend_batch(runner, [12, 3], [3, 2], gen)
    ext.init_forward_metadata(eb)
    q, k, _ = _qkv(runner, 5, gen)
    out = ext.forward(AttentionLayer(0, 0.1), q, k, None, attn_sink=attn_sink)
    want = reference_window_extend(runner, AttentionLayer(0, 0.1), q, eb, window=8,
                                   attn_sink=attn_sink)
    assert_close(out, want, torch.bfloat16)


def test_graph_buffers_are_fixed(monkeypatch):
    mod, calls = npu_standin.make()
    install(monkeypatch, "torch_npu", mod)
    gen = torch.Generator().manual_seed(16)
    runner = _mha(torch.bfloat16)
    backend = _make(AscendDecode, runner, 2, 2)
    backend.init_cuda_graph_state(max_bs=3, max_num_tokens=6)
    ptr = backend._bufs.data_ptr("table")
    backend.init_forward_metadata_capture_cuda_graph(paged_round(runner, [5, 9], 2, 2, gen))
    replay = paged_round(runner, [40, 2], 2, 2, gen)
    backend.init_forward_metadata_replay_cuda_graph(replay, 2)
    layer = AttentionLayer(0, 0.2)
    q, k, v = _qkv(runner, 4, gen)
    out = backend.forward(0, layer, q, k, v)
    assert_close(out, reference_decode(runner, layer, q, replay, 0), torch.bfloat16)
    assert calls[-1].args["block_table"].data_ptr() == ptr
    mla = _make(AscendDecode, _mla(torch.bfloat16), 1, 2)
    mla.init_cuda_graph_state(2, 2)
    with pytest.raises(InvalidInputError, match="eagerly only"):
        mla.init_forward_metadata_capture_cuda_graph(
            paged_round(mla.runner, [5], 1, 2, gen))


def test_errors_and_declaration(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(BackendUnavailableError, match="pip install torch-npu"):
        _make(AscendDecode, _mha(torch.bfloat16), 1, 2)
    install(monkeypatch, "torch_npu", npu_standin.make()[0])
    with pytest.raises(BackendUnavailableError, match="page sizes"):
        _make(AscendDecode, _mha(torch.bfloat16, page=1), 1, 2)
    with pytest.raises(BackendUnavailableError, match="tree modes"):
        _make(AscendDecode, _mha(torch.bfloat16), 2, 2, tree_mode="path")
    with pytest.raises(InvalidInputError, match="multiple of the page size"):
        _make(AscendExtend, _mha(torch.bfloat16, slots=100))
    with pytest.raises(InvalidInputError, match="qk_rope_head_dim"):
        _make(DSV4NpuDecode, _mla(torch.bfloat16), 1, 2)
    backend = _make(AscendDecode, _mha(torch.bfloat16), 1, 2)
    backend.init_forward_metadata(paged_round(backend.runner, [4], 1, 2,
                                              torch.Generator().manual_seed(0)))
    q, k, v = _qkv(backend.runner, 1, torch.Generator().manual_seed(0))
    with pytest.raises(InvalidInputError, match="soft cap"):
        backend.forward(0, AttentionLayer(0, 0.1, logit_cap=5.0), q, k, v)
    for cls in (AscendDecode, AscendExtend, DSV4NpuDecode, DSV4NpuExtend):
        assert cls.pending is None and cls.tested_on.startswith("not run on hardware")
