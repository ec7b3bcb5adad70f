"""``aiter`` glue through the recording ``aiter`` / ``aiter.mla`` stand-in.

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``); this file keeps the ones specific to aiter: the soft
cap passed to the MHA kernel across topk, page sizes, tree modes and dtypes, which kernel
each model calls and with SGLang's arguments, graph buffers, the protocol's pinned messages
and errors.
"""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import random_qkv as _qkv
from specattn.backends.aiter import AiterDecode, AiterExtend
from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.data import AttentionLayer, DraftRunner
from specattn.errors import BackendUnavailableError, CallOrderError, InvalidInputError
from specattn.metadata import draft_kv_indices
from specattn.platforms import Platform, use_platform
from standins import aiter as aiter_standin
from standins._common import assert_close, extend_batch, install, paged_round

HIP = Platform("hip", libraries={"aiter"})


@pytest.fixture
def calls(monkeypatch):
    aiter, mla, calls = aiter_standin.make()
    install(monkeypatch, "aiter", aiter)
    install(monkeypatch, "aiter.mla", mla)
    return calls


def _runner(model, dtype, page=1):
    if model == "mha":
        return DraftRunner.mha(4, 2, 16, num_layers=2, num_slots=512, max_reqs=8,
                               max_context_len=96, page_size=page, dtype=dtype)
    return DraftRunner.mla(4, 32, 16, num_layers=2, num_slots=512, max_reqs=8,
                           max_context_len=96, page_size=page, dtype=dtype)


def _make(cls, runner, *args, **kw):
    with use_platform(HIP):
        return cls(runner, *args, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("topk,tree_mode,page,lens", [
    (1, "lane", 1, [9, 30]), (3, "lane", 16, [17, 4]), (2, "path", 1, [12, 12])])
def test_mha_decode_with_soft_cap_matches_reference(calls, dtype, topk, tree_mode, page, lens):
    """The kit checks the soft cap at one shape; here with every topk, page and tree mode."""
    gen = torch.Generator().manual_seed(21)
    runner = _runner("mha", dtype, page)
    backend = _make(AiterDecode, runner, topk, 3, tree_mode=tree_mode)
    batch = paged_round(runner, lens, topk, 3, gen, parents=tree_mode == "path")
    backend.init_forward_metadata(batch)
    for step in range(3):
        for lid in (1, 0):
            layer = AttentionLayer(lid, 0.17, logit_cap=3.0)
            q, k, v = _qkv(runner, len(lens) * topk, gen)
            out = backend.forward(step, layer, q, k, v)
            want = reference_decode(runner, layer, q, batch, step, tree_mode)
            assert_close(out, want, dtype)


@pytest.mark.parametrize("model", ["mha", "mla"])
def test_extend_calls_the_kernel_of_its_model(calls, model):
    gen = torch.Generator().manual_seed(22)
    runner = _runner(model, torch.float16)
    backend = _make(AiterExtend, runner)
    batch = extend_batch(runner, [20, 4, 9], [3, 4, 1], gen)
    backend.init_forward_metadata(batch)
    layer = AttentionLayer(1, 0.2)
    q, k, v = _qkv(runner, 8, gen)
    assert_close(backend.forward(layer, q, k, v), reference_extend(runner, layer, q, batch),
                 torch.float16)
    name = "mla_decode_fwd" if model == "mla" else "mha_batch_prefill_func"
    assert calls[-1].name == name


def test_decode_arguments_are_sglangs(calls):
    gen = torch.Generator().manual_seed(23)
    runner = _runner("mha", torch.bfloat16)
    backend = _make(AiterDecode, runner, 2, 2)
    batch = paged_round(runner, [5, 8], 2, 2, gen)
    backend.init_forward_metadata(batch)
    q, k, v = _qkv(runner, 4, gen)
    backend.forward(1, AttentionLayer(0, 0.3, logit_cap=2.0), q, k, v)
    (c,) = calls
    assert c.name == "paged_attention_ragged"
    # SGLang passes the first 19 arguments positionally; mtp is left at its default.
    assert c.passed == tuple(list(c.args)[:19])
    assert c.describe("key_cache") == ((512, 1, 2, 16), torch.bfloat16, "cpu")
    assert c.args["key_cache"].data_ptr() == runner.k_buffer[0].data_ptr()
    assert (c.args["block_size"], c.args["kv_cache_dtype"], c.args["kv_cache_layout"],
            c.args["partition_size"], c.args["logits_soft_cap"]) == (1, "auto", "NHD", 256, 2.0)
    assert c.args["max_num_partitions"] == 1  # ceil((96 + 2) / 256)
    indptr, indices = draft_kv_indices(runner.req_to_token, batch.req_pool_indices,
                                       batch.seq_lens, 2, 2, 1, batch.out_cache_loc)
    assert torch.equal(c.args["kv_indptr"], indptr[1])
    assert torch.equal(c.args["kv_page_indices"][:int(indptr[1, -1])],
                       indices[1, :int(indptr[1, -1])])
    assert c.describe("workspace_buffer")[0][0] >= 4 * 4 * 1 * 16 * 4 + 2 * 4 * 4 * 1 * 4


def test_cuda_graph_buffers_are_fixed(calls):
    gen = torch.Generator().manual_seed(24)
    runner = _runner("mla", torch.bfloat16)
    backend = _make(AiterDecode, runner, 2, 2)
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=4)
    ptrs = {n: backend._bufs.data_ptr(n) for n in ("kv_indptr", "kv_indices", "qo_indptr")}
    backend.init_forward_metadata_capture_cuda_graph(paged_round(runner, [3, 40], 2, 2, gen))
    replay = paged_round(runner, [30, 2], 2, 2, gen)
    backend.init_forward_metadata_replay_cuda_graph(replay, 2)
    for step in range(2):
        layer = AttentionLayer(0, 0.2)
        q, k, _ = _qkv(runner, 4, gen)
        assert_close(backend.forward(step, layer, q, k, None),
                     reference_decode(runner, layer, q, replay, step), torch.bfloat16)
    for c in calls:
        assert c.args["kv_indptr"].untyped_storage().data_ptr() == ptrs["kv_indptr"]
        assert c.args["kv_indices"].untyped_storage().data_ptr() == ptrs["kv_indices"]
        assert c.args["qo_indptr"].data_ptr() == ptrs["qo_indptr"]


def test_errors(monkeypatch, calls):
    gen = torch.Generator().manual_seed(0)
    runner = _runner("mla", torch.bfloat16)
    backend = _make(AiterDecode, runner, 1, 2)
    backend.init_forward_metadata(paged_round(runner, [4], 1, 2, gen))
    q, k, _ = _qkv(runner, 1, gen)
    with pytest.raises(InvalidInputError, match="logit_cap"):
        backend.forward(0, AttentionLayer(0, 0.1, logit_cap=5.0), q, k, None)
    with pytest.raises(BackendUnavailableError, match="one head size"):
        _make(AiterDecode, DraftRunner.mha(4, 2, 16, 8, num_layers=1, num_slots=64,
                                           max_reqs=2, max_context_len=16), 1, 2)
    monkeypatch.setitem(sys.modules, "aiter", None)
    with pytest.raises(BackendUnavailableError, match="pip install amd-aiter"):
        _make(AiterExtend, _runner("mha", torch.bfloat16))
    for cls in (AiterDecode, AiterExtend):
        assert cls.pending is None and cls.tested_on.startswith("not run on hardware")


def test_graph_protocol_errors(calls):
    """The base class's protocol checks through a vendor class, pinned with their messages."""
    gen = torch.Generator().manual_seed(25)
    runner = _runner("mha", torch.float16)
    backend = _make(AiterDecode, runner, 2, 2)
    batch = paged_round(runner, [5, 9], 2, 2, gen)
    q, k, v = _qkv(runner, 4, gen)
    with pytest.raises(CallOrderError, match=r"^init_forward_metadata: expected a call before "
                       r"forward\(\), got aiter\.forward\(\) first$"):
        backend.forward(0, AttentionLayer(0, 0.2), q, k, v)
    with pytest.raises(CallOrderError, match="^init_cuda_graph_state: "):
        backend.init_forward_metadata_capture_cuda_graph(batch)
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=4)
    with pytest.raises(InvalidInputError, match=r"^bs: expected an int in \[2, 2\]"):
        backend.init_forward_metadata_replay_cuda_graph(batch, 3)
    backend.init_cuda_graph_state(max_bs=1, max_num_tokens=2)
    with pytest.raises(InvalidInputError, match="max_bs"):
        backend.init_forward_metadata_capture_cuda_graph(batch)
