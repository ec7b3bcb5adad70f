"""SGLang's real EAGLE ``draft_forward`` served by specattn through the plugin equals SGLang's
own ``TritonMultiStepDraftBackend`` (Triton interpreter): same draft tokens, per-step attention
outputs within float32 tolerance; MHA and MLA, topk 1 and > 1, page size 1 and > 1, ragged
prefixes, tensor-parallel head splits, the CUDA-graph metadata calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed (see docs/sglang.md)")

import sglang_harness as H  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonMultiStepDraftBackend  # noqa: E402

from specattn.integrations.sglang.backends import SpecattnMultiStepDraftBackend  # noqa: E402

STEPS = 3
TOL = dict(atol=2e-5, rtol=2e-5)


def _setup(shape: H.Shape, topk: int, steps: int = STEPS):
    fx = H.build_fixture(shape)
    settings = H.configure_draft(fx, topk, steps)
    loc = H.draft_slots(fx, topk, steps)
    model = H.make_draft_model(fx, settings)
    inputs = H.draft_inputs(fx, topk)
    return fx, settings, model, lambda: H.draft_batch(fx, topk, loc, inputs)


def _sglang_reference(fx, settings, model, make_batch, topk, steps=STEPS):
    """SGLang's own backend on a copy of the pools (restored afterwards)."""
    saved = fx.snapshot()
    container = H.create_decode_container(fx, topk, steps)
    assert isinstance(container, TritonMultiStepDraftBackend)
    result = H.run_draft(fx, container, topk, steps, settings, model, make_batch)
    after = fx.snapshot()
    fx.restore(saved)
    return result, after


def _assert_same_draft(got, expected, steps=STEPS):
    (tokens, outputs), (ref_tokens, ref_outputs) = got, expected
    for a, b in zip(tokens, ref_tokens):
        assert torch.equal(a, b)
    assert len(outputs) == len(ref_outputs) == steps - 1
    for out, ref in zip(outputs, ref_outputs):
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("model,topk,page", [
    ("mha", 1, 1), ("mha", 2, 1), ("mha", 1, 4), ("mha", 3, 4), ("mla", 1, 1), ("mla", 2, 4)])
def test_draft_forward_matches_sglang_triton(specattn_plugin, model, topk, page):
    fx, settings, draft_model, make_batch = _setup(H.Shape(model=model, page_size=page), topk)
    expected, pools_after = _sglang_reference(fx, settings, draft_model, make_batch, topk)
    assert len(set(expected[0][2].flatten().tolist())) > 2  # a real draft, not a constant

    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    container = H.create_decode_container(fx, topk, STEPS)
    assert isinstance(container, SpecattnMultiStepDraftBackend)
    assert type(container.specattn_backend).name == "torch_ref"
    got = H.run_draft(fx, container, topk, STEPS, settings, draft_model, make_batch)
    _assert_same_draft(got, expected)
    for ours, theirs in zip(fx.snapshot(), pools_after):  # the same KV was written
        torch.testing.assert_close(ours, theirs, **TOL)


@pytest.mark.parametrize("model,topk,page", [("mha", 2, 4), ("mla", 1, 1)])
def test_same_name_routes_to_specattn_triton(specattn_plugin, model, topk, page):
    """``SPECATTN_SGLANG=1``: SGLang's name ``triton`` is served by specattn's ``triton``,
    whose draft is the reference's (``torch_ref`` through the plugin, on the same pools)."""
    fx, settings, draft_model, make_batch = _setup(H.Shape(model=model, page_size=page), topk)
    saved = fx.snapshot()
    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    container = H.create_decode_container(fx, topk, STEPS)
    assert type(container.specattn_backend).name == "torch_ref"
    expected = H.run_draft(fx, container, topk, STEPS, settings, draft_model, make_batch)
    fx.restore(saved)
    specattn_plugin({"SPECATTN_SGLANG": "1"})
    container = H.create_decode_container(fx, topk, STEPS)
    assert type(container.specattn_backend).name == "triton"
    got = H.run_draft(fx, container, topk, STEPS, settings, draft_model, make_batch)
    _assert_same_draft(got, expected)


def test_tensor_parallel_rank_with_one_kv_head(specattn_plugin):
    """A rank of a TP=2 model (4 query / 2 KV heads in all): 2 query heads, 1 KV head."""
    shape = H.Shape(num_heads=2, num_kv_heads=1, tp_size=2, page_size=1)
    fx, settings, draft_model, make_batch = _setup(shape, topk=2)
    with H.tensor_parallel(2):
        expected, _ = _sglang_reference(fx, settings, draft_model, make_batch, 2)
    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    container = H.create_decode_container(fx, 2, STEPS)
    runner = container.specattn_backend.runner
    assert (runner.num_q_heads, runner.num_kv_heads) == (2, 1)
    with H.tensor_parallel(2):
        got = H.run_draft(fx, container, 2, STEPS, settings, draft_model, make_batch)
    _assert_same_draft(got, expected)


def _graph_init(max_bs, topk):
    """What SGLang's EAGLEDraftCudaGraphRunner calls: state, capture (outside the graph),
    the in-graph hook."""
    def init(container, batch):
        container.init_cuda_graph_state(max_bs, max_bs * topk)
        assert container.attn_backends[0].get_cuda_graph_seq_len_fill_value() == 1
        container.init_forward_metadata_out_graph(batch, in_capture=True)
        container.init_forward_metadata_in_graph(batch)
    return init


@pytest.mark.parametrize("model,topk,page", [("mha", 2, 4), ("mla", 1, 1)])
def test_graph_metadata_calls_give_the_eager_result(specattn_plugin, model, topk, page):
    """Capture-time and replay-time metadata (fixed buffers, then a batch padded the way the
    graph runner pads it) give the eager draft for the real requests."""
    fx, settings, draft_model, make_batch = _setup(H.Shape(model=model, page_size=page), topk)
    specattn_plugin({"SPECATTN_SGLANG": "1"})
    saved = fx.snapshot()
    eager = H.run_draft(fx, H.create_decode_container(fx, topk, STEPS), topk, STEPS, settings,
                        draft_model, make_batch)
    fx.restore(saved)
    container = H.create_decode_container(fx, topk, STEPS)
    captured = H.run_draft(fx, container, topk, STEPS, settings, draft_model, make_batch,
                           init=_graph_init(4, topk))
    _assert_same_draft(captured, eager)

    # Replay: one padded request (seq_len = fill value, request row 0, slot 0, zero inputs).
    fx.restore(saved)
    bs = len(fx.shape.prefix_lens)

    def padded_batch():
        fb = make_batch()
        pad = topk * STEPS
        fb.batch_size = bs + 1
        fb.seq_lens = torch.cat([fb.seq_lens, torch.ones(1, dtype=fb.seq_lens.dtype)])
        fb.seq_lens_sum += 1
        fb.req_pool_indices = torch.cat([fb.req_pool_indices, fb.req_pool_indices[:1] * 0])
        fb.out_cache_loc = torch.cat([fb.out_cache_loc, torch.zeros(pad, dtype=torch.int64)])
        fb.positions = torch.cat([fb.positions, torch.zeros(topk, dtype=torch.int64)])
        spec = fb.spec_info
        spec.topk_p = torch.cat([spec.topk_p, torch.zeros(1, topk)])
        spec.topk_index = torch.cat([spec.topk_index, torch.zeros(1, topk, dtype=torch.int64)])
        spec.hidden_states = torch.cat([spec.hidden_states, torch.zeros(1, H.HIDDEN)])
        return fb

    def replay(container_, batch):
        container_.init_forward_metadata_out_graph(SimpleNamespace(**vars(batch),
                                                                   num_padding=1))
    (parents, index, tokens), outputs = H.run_draft(fx, container, topk, STEPS, settings,
                                                    draft_model, padded_batch, init=replay)
    (ref_parents, ref_index, ref_tokens), ref_outputs = eager
    assert torch.equal(tokens[:bs], ref_tokens)
    for out, ref in zip(outputs, ref_outputs):
        torch.testing.assert_close(out[:bs * topk], ref, **TOL)


@pytest.mark.parametrize("model,topk,page", [("mha", 2, 1), ("mha", 1, 4), ("mla", 2, 4)])
def test_fp8_pool_draft_through_the_plugin(specattn_plugin, model, topk, page):
    """``--kv-cache-dtype fp8_e4m3``: SGLang's uint8-stored pool and the layer's scale tensors
    (``k_scale`` 0.37, ``v_scale`` 1.9; MLA: ``k_scale``) reach specattn without copies.
    SGLang's own Triton backend is no reference for the attention: its decode kernel casts
    the query to the pool's FP8 dtype ("Cast q to the K buffer dtype", decode_attention.py),
    so it is not the attention over the dequantized pool. What it does give: the codes of
    step 0 (whose K/V do not depend on an attention output), which specattn writes bit for
    bit alike. The draft itself runs through intel_amx (``auto`` on a CPU) against
    ``torch_ref`` (the kit checks both against float64 attention over the dequantized pool).
    """
    shape = H.Shape(model=model, page_size=page, kv_cache_dtype="fp8_e4m3", scales=(0.37, 1.9))
    fx, settings, draft_model, make_batch = _setup(shape, topk)
    assert all(t.dtype == torch.uint8 for t in fx.pool_tensors())
    saved = fx.snapshot()
    _, sglang_pools = _sglang_reference(fx, settings, draft_model, make_batch, topk)
    step0 = make_batch().out_cache_loc.view(len(shape.prefix_lens), topk, STEPS)[:, :, 0]
    runs = {}
    for name in ("torch_ref", "intel_amx"):
        fx.restore(saved)
        specattn_plugin({"SPECATTN_SGLANG_BACKEND": name})
        container = H.create_decode_container(fx, topk, STEPS)
        runner = container.specattn_backend.runner
        assert type(container.specattn_backend).name == name
        assert runner.kv_cache_dtype == "fp8_e4m3" and runner.dtype == torch.float32
        pools = runner.kv_buffer if model == "mla" else runner.k_buffer + runner.v_buffer
        assert [p.data_ptr() for p in pools] == [t.data_ptr() for t in fx.pool_tensors()]
        runs[name] = H.run_draft(fx, container, topk, STEPS, settings, draft_model,
                                 make_batch), fx.snapshot()
    (ours, ours_pools), (ref, ref_pools) = runs["intel_amx"], runs["torch_ref"]
    _assert_same_draft(ours, ref)
    rows = step0.reshape(-1)
    for a, b, theirs, before in zip(ours_pools, ref_pools, sglang_pools, saved):
        assert torch.equal(a, b)
        assert torch.equal(a[rows], theirs[rows]) and not torch.equal(a[rows], before[rows])


def test_mla_step_takes_deepseeks_split_rope_under_fa3s_name(specattn_plugin):
    """SGLang's ``fa3`` name (DeepSeek's absorbed attention then passes ``q_rope`` /
    ``k_rope`` apart from the latent ``q`` / ``k``) served by specattn: a draft step's split
    call equals the joined call, output and pool (``q_rope`` had been dropped)."""
    fx, settings, draft_model, make_batch = _setup(H.Shape(model="mla", page_size=4), topk=2)
    fx.runner.draft_attention_backend = "fa3"
    specattn_plugin({"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_BACKEND": "torch_ref"})
    container = H.create_decode_container(fx, 2, STEPS)
    step = container.attn_backends[1]
    assert step.decode_attention_backend_str == "fa3"
    batch = make_batch()
    rows, heads = batch.batch_size * 2, fx.layer.tp_q_head_num
    rank, rope = H.KV_LORA_RANK, H.ROPE_DIM
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(rows, n, rank + rope, generator=gen) for n in (heads, 1))
    H.check_split_rope_call(fx, lambda: container.init_forward_metadata(batch),
                            lambda q_, k_, v_, **rope: step.forward_decode(
                                q_, k_, v_, fx.layer, batch, **rope), q, k)
