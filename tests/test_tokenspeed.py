"""``tokenspeed_mla`` glue through the recording ``tokenspeed_mla`` stand-in.

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``), which runs tokenspeed at page size 32 (bf16 and FP8
KV); this file keeps the ones specific to it: page size 64 with a prefix ending on a page
boundary, the recorded call and its arguments (the FP8 query cast), graph buffers, errors.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specattn.backends.tokenspeed import TokenspeedMLADecode, TokenspeedMLAExtend
from specattn.backends.torch_ref import reference_decode
from specattn.data import AttentionLayer, DraftRunner
from specattn.errors import BackendUnavailableError, InvalidInputError
from specattn.platforms import Platform, use_platform
from standins import tokenspeed_mla as ts_standin
from standins._common import assert_close, install, paged_round

B200 = Platform("cuda", (10, 0), libraries={"tokenspeed_mla"})
H, R, ROPE = 2, 32, 16


def _runner(page=32, kv_dtype=torch.bfloat16):
    def pool():
        return torch.zeros(32 * 20, R + ROPE, dtype=kv_dtype)

    return DraftRunner(use_mla_backend=True, dtype=torch.bfloat16, device="cpu",
                       page_size=page, num_layers=2,
                       req_to_token=torch.zeros(8, 320, dtype=torch.int32), num_heads=H,
                       kv_lora_rank=R, qk_rope_head_dim=ROPE, kv_buffer=[pool(), pool()],
                       kv_cache_dtype="auto" if kv_dtype == torch.bfloat16 else "fp8_e4m3")


def _make(cls, runner, *args, **kw):
    with use_platform(B200):
        return cls(runner, *args, **kw)


def _q(n, gen, fp8=False):
    q = torch.randn(n, H, R + ROPE, generator=gen).bfloat16()
    # With fp8 KV the glue casts q to fp8: compare against the same rounded query.
    return q.to(torch.float8_e4m3fn).bfloat16() if fp8 else q


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("topk,page,lens", [(3, 64, [70, 64])])
def test_decode_matches_reference(monkeypatch, fp8, topk, page, lens):
    install(monkeypatch, "tokenspeed_mla", ts_standin.make()[0])
    gen = torch.Generator().manual_seed(31)
    runner = _runner(page, torch.float8_e4m3fn if fp8 else torch.bfloat16)
    backend = _make(TokenspeedMLADecode, runner, topk, 3)
    batch = paged_round(runner, lens, topk, 3, gen)
    backend.init_forward_metadata(batch)
    for step in range(3):
        for lid in (0, 1):
            layer = AttentionLayer(lid, 0.15)
            q = _q(len(lens) * topk, gen, fp8)
            k = (torch.randn(len(lens) * topk, R + ROPE, generator=gen) * 0.5).bfloat16()
            out = backend.forward(step, layer, q, k, None)
            assert_close(out, reference_decode(runner, layer, q, batch, step), torch.bfloat16)


@pytest.mark.parametrize("tensor_scale", [False, True], ids=["float", "device-tensor"])
def test_fp8_k_scale_reaches_the_library_or_the_query(monkeypatch, tensor_scale):
    """A float ``k_scale`` is tokenspeed's ``softmax_scale`` / ``output_scale`` factor (as in
    SGLang); a device tensor is folded into the query before its e4m3 cast and into the
    output. Both against the reference over the dequantized pool with the rounded query."""
    from specattn.fp8 import scale_rows

    mod, calls = ts_standin.make()
    install(monkeypatch, "tokenspeed_mla", mod)
    gen = torch.Generator().manual_seed(35)
    runner = _runner(32, torch.float8_e4m3fn)
    ks = torch.tensor([0.37]) if tensor_scale else 0.37
    backend = _make(TokenspeedMLADecode, runner, 2, 2)
    batch = paged_round(runner, [9, 40], 2, 2, gen)
    backend.init_forward_metadata(batch)
    layer = AttentionLayer(0, 0.3, k_scale=ks)
    q = torch.randn(4, H, R + ROPE, generator=gen).bfloat16()
    k = torch.randn(4, R + ROPE, generator=gen).bfloat16()
    out = backend.forward(0, layer, q, k, None)
    (c,) = calls
    if tensor_scale:
        assert (c.args["softmax_scale"], c.args["output_scale"]) == (0.3, 1.0)
        q_seen = scale_rows(q, ks).to(torch.float8_e4m3fn)
        q_ref = (q_seen.float() / ks).bfloat16()
    else:
        assert (c.args["softmax_scale"], c.args["output_scale"]) == (0.3 * 0.37, 0.37)
        q_seen = q.to(torch.float8_e4m3fn)
        q_ref = q_seen.bfloat16()
    assert torch.equal(c.args["query"].view(torch.uint8).reshape(-1),
                       q_seen.view(torch.uint8).reshape(-1))
    assert_close(out, reference_decode(runner, layer, q_ref, batch, 0), torch.bfloat16)


def test_arguments_and_graph_buffers(monkeypatch):
    mod, calls = ts_standin.make()
    install(monkeypatch, "tokenspeed_mla", mod)
    gen = torch.Generator().manual_seed(33)
    runner = _runner(32, torch.float8_e4m3fn)
    backend = _make(TokenspeedMLADecode, runner, 2, 2)
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=4)
    ptr = backend._bufs.data_ptr("table")
    backend.init_forward_metadata_capture_cuda_graph(paged_round(runner, [9, 40], 2, 2, gen))
    replay = paged_round(runner, [33, 2], 2, 2, gen)
    backend.init_forward_metadata_replay_cuda_graph(replay, 2)
    q = _q(4, gen, fp8=True)
    k = torch.randn(4, R + ROPE, generator=gen).bfloat16()
    out = backend.forward(1, AttentionLayer(0, 0.3), q, k, None)
    assert_close(out, reference_decode(runner, AttentionLayer(0, 0.3), q, replay, 1),
                 torch.bfloat16)
    (c,) = calls
    assert set(c.passed) == {"query", "kv_cache", "workspace_buffer", "kv_lora_rank",
                             "qk_rope_head_dim", "block_tables", "seq_lens", "max_seq_len",
                             "softmax_scale", "output_scale", "enable_pdl"}
    assert c.describe("query") == ((4, 1, H, R + ROPE), torch.float8_e4m3fn, "cpu")
    assert c.describe("kv_cache") == ((20, 32, R + ROPE), torch.float8_e4m3fn, "cpu")
    assert c.args["seq_lens"].tolist() == [35, 35, 4, 4]  # L_b + step + 1 per lane
    assert (c.args["softmax_scale"], c.args["output_scale"]) == (0.3, 1.0)
    assert c.args["block_tables"].data_ptr() == ptr
    assert c.args["max_seq_len"] == 322  # max_context_len + S


def test_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenspeed_mla", None)
    with pytest.raises(BackendUnavailableError, match="pip install tokenspeed-mla"):
        _make(TokenspeedMLADecode, _runner(), 1, 2)
    install(monkeypatch, "tokenspeed_mla", ts_standin.make()[0])
    with pytest.raises(BackendUnavailableError, match="page sizes"):
        _make(TokenspeedMLAExtend, _runner(page=16))
    with pytest.raises(BackendUnavailableError, match="tree modes"):
        _make(TokenspeedMLADecode, _runner(), 2, 2, tree_mode="path")
    with pytest.raises(BackendUnavailableError, match="needs CUDA"):
        with use_platform(Platform("cuda", (9, 0), libraries={"tokenspeed_mla"})):
            TokenspeedMLADecode(_runner(), 1, 2)
    backend = _make(TokenspeedMLADecode, _runner(), 1, 2)
    backend.init_forward_metadata(paged_round(backend.runner, [4], 1, 2,
                                              torch.Generator().manual_seed(0)))
    with pytest.raises(InvalidInputError, match="soft cap"):
        backend.forward(0, AttentionLayer(0, 0.1, logit_cap=4.0),
                        torch.zeros(1, H, R + ROPE).bfloat16(),
                        torch.zeros(1, R + ROPE).bfloat16(), None)
    for cls in (TokenspeedMLADecode, TokenspeedMLAExtend):
        assert cls.pending is None and cls.tested_on.startswith("not run on hardware")
