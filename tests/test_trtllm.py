"""``trtllm_mha`` / ``trtllm_mla`` / ``cutedsl_mla`` glue through the recording ``flashinfer``
stand-in (``tests/standins/trtllm_flashinfer.py``).

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``), which runs these backends at their smallest page size
(16 for MHA, 32 for MLA); this file keeps the ones specific to TRT-LLM: the other page
sizes, prefixes ending on a page boundary, the recorded library calls and their arguments,
the per-lane block tables and draft layout, graph buffers and errors.
"""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import random_qkv as _qkv
from specattn import DraftBackendFactory, SpecConfig
from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.backends.trtllm import (CuteDSLMLADecode, TRTLLMMHADecode, TRTLLMMHAExtend,
                                      TRTLLMMLADecode, TRTLLMMLAExtend)
from specattn.data import AttentionLayer, DraftBatch, DraftRunner
from specattn.errors import BackendUnavailableError, InvalidInputError, ModelMismatchError
from specattn.platforms import Platform, use_platform
from standins import trtllm_flashinfer as fi_standin
from standins._common import assert_close, extend_batch, paged_round

B200 = Platform("cuda", (10, 0), libraries={"flashinfer"})
H100 = Platform("cuda", (9, 0), libraries={"flashinfer"})
HQ, HKV, D = 4, 2, 32
HM = 2  # MLA heads
STEPS = 3


@pytest.fixture
def fi(monkeypatch):
    mod, calls = fi_standin.make()
    fi_standin.install_flashinfer(monkeypatch, mod)
    return calls


def _mha(page, dtype=torch.bfloat16, v_head_dim=None):
    return DraftRunner.mha(HQ, HKV, D, v_head_dim, num_layers=2, num_slots=64 * 16,
                           max_reqs=8, max_context_len=320, page_size=page, dtype=dtype)


def _mla(page, kv_lora_rank=512):
    return DraftRunner.mla(HM, kv_lora_rank, 64, num_layers=2, num_slots=64 * 12, max_reqs=8,
                           max_context_len=320, page_size=page, dtype=torch.bfloat16)


def _make(cls, runner, *args, platform=B200, **kw):
    with use_platform(platform):
        return cls(runner, *args, **kw)


def _run_round(backend, runner, batch, gen, steps=range(STEPS), layers=(1, 0)):
    """Every step and layer: backend (NaN-poisoned slots written first) vs torch_ref."""
    n = batch.batch_size * backend.topk
    for step in steps:
        for lid in layers:
            layer = AttentionLayer(lid, runner.head_dim ** -0.5 * 1.2)
            q, k, v = _qkv(runner, n, gen)
            out = backend.forward(step, layer, q, k, v)
            assert_close(out, reference_decode(runner, layer, q, batch, step), runner.dtype)


@pytest.mark.parametrize("dtype,topk,page,lens", [
    (torch.float16, 1, 64, [65, 65]), (torch.float16, 3, 32, [70, 64]),
    (torch.bfloat16, 2, 64, [31, 1]),
    (torch.bfloat16, 2, 16, [16, 16])])  # L = 16: the prefix fills its last page
def test_mha_decode_matches_reference(fi, dtype, topk, page, lens):
    gen = torch.Generator().manual_seed(51)
    runner = _mha(page, dtype)
    backend = _make(TRTLLMMHADecode, runner, topk, STEPS)
    batch = paged_round(runner, lens, topk, STEPS, gen)
    backend.init_forward_metadata(batch)
    _run_round(backend, runner, batch, gen, layers=(1,))


@pytest.mark.parametrize("cls", [TRTLLMMLADecode, CuteDSLMLADecode])
@pytest.mark.parametrize("topk,page,lens", [(3, 64, [70, 64])])
def test_mla_decode_matches_reference(fi, cls, topk, page, lens):
    gen = torch.Generator().manual_seed(52)
    runner = _mla(page)
    backend = _make(cls, runner, topk, STEPS)
    batch = paged_round(runner, lens, topk, STEPS, gen)
    backend.init_forward_metadata(batch)
    _run_round(backend, runner, batch, gen, layers=(1,))


@pytest.mark.parametrize("dtype,page,lens,ext", [
    (torch.bfloat16, 16, [50, 3, 33], [4, 3, 1]), (torch.float16, 64, [20, 20], [2, 2])])
def test_mha_extend_matches_reference(fi, dtype, page, lens, ext):
    gen = torch.Generator().manual_seed(53)
    runner = _mha(page, dtype)
    backend = _make(TRTLLMMHAExtend, runner)
    batch = extend_batch(runner, lens, ext, gen)
    backend.init_forward_metadata(batch)
    layer = AttentionLayer(1, 0.2)
    q, k, v = _qkv(runner, sum(ext), gen)
    out = backend.forward(layer, q, k, v)
    assert_close(out, reference_extend(runner, layer, q, batch), dtype)
    (c,) = fi
    q_len = max(ext)  # left-aligned rows; keys run to L' - E + q_len (module doc)
    assert c.args["q_len_per_req"] == q_len
    assert c.describe("query") == ((len(lens) * q_len, HQ, D), dtype, "cpu")
    assert c.args["seq_lens"].tolist() == [L - e + q_len for L, e in zip(lens, ext)]


@pytest.mark.parametrize("page,lens,ext", [(64, [9], [1])])
def test_mla_extend_matches_reference(fi, page, lens, ext):
    gen = torch.Generator().manual_seed(54)
    runner = _mla(page)
    backend = _make(TRTLLMMLAExtend, runner)
    batch = extend_batch(runner, lens, ext, gen)
    backend.init_forward_metadata(batch)
    layer = AttentionLayer(0, 0.04)
    q, k, _ = _qkv(runner, sum(ext), gen)
    out = backend.forward(layer, q, k, None)
    assert_close(out, reference_extend(runner, layer, q, batch), torch.bfloat16)


def test_mha_arguments_are_the_documented_ones(fi):
    gen = torch.Generator().manual_seed(55)
    runner = _mha(16)
    backend = _make(TRTLLMMHADecode, runner, 2, STEPS)
    batch = paged_round(runner, [40, 5], 2, STEPS, gen)
    backend.init_forward_metadata(batch)
    q, k, v = _qkv(runner, 4, gen)
    backend.forward(1, AttentionLayer(1, 0.07), q, k, v)
    (c,) = fi
    assert c.name == "trtllm_batch_decode_with_kv_cache"
    assert set(c.passed) == {"query", "kv_cache", "workspace_buffer", "block_tables",
                             "seq_lens", "max_seq_len", "bmm1_scale", "bmm2_scale",
                             "q_len_per_req"}
    assert c.describe("query") == ((4, HQ, D), torch.bfloat16, "cpu")
    kc, vc = c.args["kv_cache"]
    assert c.args["kv_layout"] == "HND" and tuple(kc.shape) == (64, HKV, 16, D)
    assert kc.data_ptr() == runner.k_buffer[1].data_ptr()  # a view, no copy
    assert vc.data_ptr() == runner.v_buffer[1].data_ptr()
    assert c.args["seq_lens"].dtype == torch.int32
    assert c.args["seq_lens"].tolist() == [42, 42, 7, 7]  # L_b + step + 1 per lane
    assert (c.args["bmm1_scale"], c.args["bmm2_scale"]) == (0.07, 1.0)
    assert c.args["max_seq_len"] == 320 + STEPS and c.args["q_len_per_req"] == 1
    table = c.args["block_tables"]
    assert table.dtype == torch.int32 and table.shape == (4, 21)
    r2t = runner.req_to_token
    # Lane 1 of request 0: the full prefix pages, then its own page (L = 40, P = 16).
    assert table[1, :2].tolist() == [int(r2t[1, 0]) // 16, int(r2t[1, 16]) // 16]
    npp = -(-(40 % 16 + STEPS) // 16)
    assert table[1, 2] == int(r2t[1, 32 + npp * 16]) // 16


def test_mla_arguments_and_cutedsl_backend(fi):
    gen = torch.Generator().manual_seed(56)
    runner = _mla(32)
    for cls in (TRTLLMMLADecode, CuteDSLMLADecode):
        backend = _make(cls, runner, 1, STEPS)
        backend.init_forward_metadata(paged_round(runner, [40], 1, STEPS, gen))
        q, k, _ = _qkv(runner, 1, gen)
        backend.forward(0, AttentionLayer(0, 0.05), q, k, None)
    trt, cute = fi
    for c in (trt, cute):
        assert c.name == "trtllm_batch_decode_with_kv_cache_mla"
        assert c.describe("query") == ((1, 1, HM, 576), torch.bfloat16, "cpu")
        assert c.describe("kv_cache") == ((24, 1, 32, 576), torch.bfloat16, "cpu")
        assert c.args["kv_cache"].data_ptr() == runner.kv_buffer[0].data_ptr()
        assert (c.args["qk_nope_head_dim"], c.args["kv_lora_rank"],
                c.args["qk_rope_head_dim"]) == (128, 512, 64)
        assert c.args["block_tables"].shape == (1, 12)  # ceil(323 / 32) = 11 → multiple of 4
        assert c.args["seq_lens"].tolist() == [41]
    assert "backend" not in trt.passed and cute.args["backend"] == "cute-dsl"
    assert trt.args["workspace_buffer"].data_ptr() != cute.args["workspace_buffer"].data_ptr()


def test_wrong_block_table_gives_wrong_answer(fi):
    """The stand-in reads through the table it is given (so the parity tests can fail)."""
    gen = torch.Generator().manual_seed(57)
    runner = _mha(16, torch.float16)
    backend = _make(TRTLLMMHADecode, runner, 1, 2)
    batch = paged_round(runner, [60], 1, 2, gen)
    backend.init_forward_metadata(batch)
    real = backend._lane_metadata

    def corrupted(step):
        table, lens = real(step)
        table[0, 1] = (table[0, 1] + 1) % 64  # the second prefix page → another page
        return table, lens

    backend._lane_metadata = corrupted
    layer = AttentionLayer(0, 0.2)
    q, k, v = _qkv(runner, 1, gen)
    out = backend.forward(0, layer, q, k, v)
    want = reference_decode(runner, layer, q, batch, 0)
    assert not torch.allclose(out.float(), want.float(), atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("cls,runner_fn", [(TRTLLMMHADecode, lambda: _mha(32)),
                                           (TRTLLMMLADecode, lambda: _mla(64))])
def test_cuda_graph_buffers_are_fixed_and_replay_matches(fi, cls, runner_fn):
    gen = torch.Generator().manual_seed(58)
    runner = runner_fn()
    backend = _make(cls, runner, 2, 2)
    backend.init_cuda_graph_state(max_bs=3, max_num_tokens=6)
    ptrs = {n: backend._bufs.data_ptr(n) for n in ("table", "lens", "workspace")}
    backend.init_forward_metadata_capture_cuda_graph(paged_round(runner, [64, 1, 99], 2, 2,
                                                                 gen))
    replay = paged_round(runner, [3, 120, 70], 2, 2, gen)
    backend.init_forward_metadata_replay_cuda_graph(replay, 3)
    _run_round(backend, runner, replay, gen, steps=range(2), layers=(0,))
    for c in fi:
        assert c.args["block_tables"].data_ptr() == ptrs["table"]
        assert c.args["seq_lens"].data_ptr() == ptrs["lens"]
        assert c.args["workspace_buffer"].data_ptr() == ptrs["workspace"]
    with pytest.raises(InvalidInputError, match="max_bs=3"):
        backend.init_forward_metadata_replay_cuda_graph(
            paged_round(runner, [3, 4, 5, 6], 2, 2, gen), 4)


def test_other_draft_layouts_are_rejected(fi):
    gen = torch.Generator().manual_seed(59)
    runner = _mha(16)
    backend = _make(TRTLLMMHADecode, runner, 2, STEPS)
    batch = paged_round(runner, [40, 5], 2, STEPS, gen)
    swapped = DraftBatch(batch.req_pool_indices, batch.seq_lens,
                         batch.out_cache_loc.flip(1), None)  # lanes' slots exchanged
    with pytest.raises(InvalidInputError, match=r"draft layout.*out_cache_loc\[0, 0, 0\]"):
        backend.init_forward_metadata(swapped)


def test_hopper_and_model_errors(fi):
    for cls, runner in ((TRTLLMMHADecode, _mha(16)), (TRTLLMMLADecode, _mla(32)),
                        (CuteDSLMLADecode, _mla(32))):
        with pytest.raises(BackendUnavailableError, match="CUDA compute capability 10.x"):
            _make(cls, runner, 1, 2, platform=H100)
    with pytest.raises(BackendUnavailableError, match="CUDA compute capability 10.x"):
        _make(TRTLLMMLAExtend, _mla(32), platform=H100)
    for name in ("trtllm_mla", "cutedsl_mla"):
        factory = DraftBackendFactory(SpecConfig(attention_backend=name, page_size=32),
                                      _mha(32), 1, 3, platform=B200)
        for create in (factory.create_decode_backend, factory.create_draft_extend_backend):
            with pytest.raises(ModelMismatchError) as err:
                create()
            assert str(err.value) == ("trtllm_mla backend requires MLA model "
                                      "(use_mla_backend=True).")
    factory = DraftBackendFactory(SpecConfig(attention_backend="cutedsl_mla", page_size=64),
                                  _mla(64), 1, 3, platform=B200)
    with use_platform(B200):
        assert type(factory.create_decode_backend()) is CuteDSLMLADecode
        assert type(factory.create_draft_extend_backend()) is TRTLLMMLAExtend


def test_capability_errors(fi, monkeypatch):
    with pytest.raises(BackendUnavailableError, match="page sizes"):
        _make(TRTLLMMHADecode, _mha(1), 1, 2)
    with pytest.raises(BackendUnavailableError, match="page sizes"):
        _make(TRTLLMMLAExtend, _mla(16))
    with pytest.raises(BackendUnavailableError, match="tree modes"):
        _make(TRTLLMMHADecode, _mha(16), 2, 2, tree_mode="path")
    with pytest.raises(BackendUnavailableError, match="v_head_dim == head_dim"):
        _make(TRTLLMMHAExtend, _mha(16, v_head_dim=16))
    with pytest.raises(BackendUnavailableError, match=r"head dims \[576\]"):
        _make(TRTLLMMLADecode, _mla(32, kv_lora_rank=448), 1, 2)
    backend = _make(TRTLLMMHADecode, _mha(16), 1, 2)
    backend.init_forward_metadata(paged_round(backend.runner, [4], 1, 2,
                                              torch.Generator().manual_seed(0)))
    q, k, v = _qkv(backend.runner, 1, torch.Generator().manual_seed(1))
    with pytest.raises(InvalidInputError, match="soft cap"):
        backend.forward(0, AttentionLayer(0, 0.1, logit_cap=4.0), q, k, v)
    monkeypatch.delattr(sys.modules["flashinfer.decode"], "trtllm_batch_decode_with_kv_cache")
    with pytest.raises(BackendUnavailableError, match="has no flashinfer.decode.trtllm_batch"):
        _make(TRTLLMMHAExtend, _mha(16))
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(BackendUnavailableError, match="pip install flashinfer-python"):
        _make(TRTLLMMHADecode, _mha(16), 1, 2)
    for cls in (TRTLLMMHADecode, TRTLLMMHAExtend, TRTLLMMLADecode, CuteDSLMLADecode,
                TRTLLMMLAExtend):
        assert cls.pending is None
        assert cls.tested_on == "not run on hardware (Blackwell only; stand-in tested)"
