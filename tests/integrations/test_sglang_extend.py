"""SGLang's draft-extend backend served by specattn through the plugin equals SGLang's own
``TritonAttnBackend`` (Triton interpreter) on the modes SGLang runs on the draft model's
backend: the prefill extend, spec-v2 draft extend (``DRAFT_EXTEND_V2``), decode batches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed (see docs/sglang.md)")

import sglang_harness as H  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from specattn.integrations.sglang.backends import SpecattnDraftExtendBackend  # noqa: E402
from specattn.errors import InvalidInputError  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("model,page,mode,extend_lens", [
    ("mha", 1, ForwardMode.EXTEND, (3, 1, 4)),
    ("mha", 4, ForwardMode.DRAFT_EXTEND_V2, (4, 4, 4)),
    ("mha", 4, ForwardMode.DECODE, (1, 1, 1)),
    ("mla", 4, ForwardMode.DRAFT_EXTEND_V2, (4, 4, 4)),
    ("mla", 1, ForwardMode.EXTEND, (2, 5, 1)),
])
def test_extend_matches_sglang_triton(specattn_plugin, model, page, mode, extend_lens):
    fx = H.build_fixture(H.Shape(model=model, page_size=page, prefix_lens=(5, 11, 2)))
    H.configure_draft(fx, topk=1, steps=3)
    hidden = torch.randn(sum(extend_lens), H.HIDDEN, generator=torch.Generator().manual_seed(3))
    saved = fx.snapshot()
    reference = H.create_extend_backend(fx, 1, 3)
    assert isinstance(reference, TritonAttnBackend)
    expected = H.run_extend(fx, reference, H.extend_batch(fx, mode, extend_lens), hidden)
    pools_after = fx.snapshot()
    fx.restore(saved)

    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    backend = H.create_extend_backend(fx, 1, 3)
    assert isinstance(backend, SpecattnDraftExtendBackend)
    assert backend.decode_attention_backend_str == "triton"
    # MLA keeps SGLang's backend for the non-absorbed prefill form only.
    assert (backend.fallback is not None) == (model == "mla")
    with H.record_outputs(fx) as outputs:
        got = H.run_extend(fx, backend, H.extend_batch(fx, mode, extend_lens), hidden)
    assert len(outputs) == 1 and not torch.isnan(got).any()
    torch.testing.assert_close(got, expected, **TOL)
    for ours, theirs in zip(fx.snapshot(), pools_after):
        torch.testing.assert_close(ours, theirs, **TOL)


def test_extend_graph_metadata_calls_give_the_eager_result(specattn_plugin):
    fx = H.build_fixture(H.Shape(page_size=4))
    H.configure_draft(fx, topk=1, steps=3)
    lens = (4, 4, 4)
    hidden = torch.randn(sum(lens), H.HIDDEN, generator=torch.Generator().manual_seed(4))
    specattn_plugin({"SPECATTN_SGLANG": "1"})
    saved = fx.snapshot()
    backend = H.create_extend_backend(fx, 1, 3)
    eager = H.run_extend(fx, backend, H.extend_batch(fx, ForwardMode.DRAFT_EXTEND_V2, lens),
                         hidden)
    fx.restore(saved)
    backend.init_cuda_graph_state(4, 16)
    fb = H.extend_batch(fx, ForwardMode.DRAFT_EXTEND_V2, lens)
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    backend.init_forward_metadata = lambda batch: None  # already prepared, as in a replay
    captured = H.run_extend(fx, backend, fb, hidden)
    torch.testing.assert_close(captured, eager, **TOL)



@pytest.mark.parametrize("model,page,mode,extend_lens", [
    ("mha", 4, ForwardMode.DRAFT_EXTEND_V2, (4, 4, 4)),
    ("mla", 1, ForwardMode.EXTEND, (2, 5, 1)),
])
def test_fp8_pool_extend_through_the_plugin(specattn_plugin, model, page, mode, extend_lens):
    """``--kv-cache-dtype fp8_e4m3`` with the layer's scale tensors, through the plugin:
    intel_amx (``auto`` on a CPU) against ``torch_ref``, both over SGLang's uint8 pool in
    place. SGLang's own Triton backend is no reference on the CPU (its MHA extend kernel
    differs from the attention over the dequantized pool by ~1e-2, its MLA one stops in
    the interpreter at an FP8 ``tl.dot``); where it runs (MHA), its pool writes are the
    reference for the codes."""
    fx = H.build_fixture(H.Shape(model=model, page_size=page, kv_cache_dtype="fp8_e4m3",
                                 scales=(0.37, 1.9)))
    H.configure_draft(fx, topk=1, steps=3)
    hidden = torch.randn(sum(extend_lens), H.HIDDEN, generator=torch.Generator().manual_seed(5))
    saved = fx.snapshot()
    sglang_pools = None
    if model == "mha":
        H.run_extend(fx, H.create_extend_backend(fx, 1, 3),
                     H.extend_batch(fx, mode, extend_lens), hidden)
        sglang_pools = fx.snapshot()
    runs = {}
    for name in ("torch_ref", "intel_amx"):
        fx.restore(saved)
        specattn_plugin({"SPECATTN_SGLANG_BACKEND": name})
        backend = H.create_extend_backend(fx, 1, 3)
        assert backend.adapter.runner.kv_cache_dtype == "fp8_e4m3"
        runs[name] = (H.run_extend(fx, backend, H.extend_batch(fx, mode, extend_lens), hidden),
                      fx.snapshot())
    (got, pools), (ref, ref_pools) = runs["intel_amx"], runs["torch_ref"]
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, **TOL)
    for ours, theirs, before in zip(pools, sglang_pools or ref_pools, saved):
        assert torch.equal(ours, theirs) and not torch.equal(ours, before)


def test_forward_before_metadata_is_a_call_order_error(specattn_plugin):
    """A forward of a served mode before ``init_forward_metadata`` names the missing call
    (it said ``forward_mode: expected EXTEND, ..., DECODE, got DECODE``)."""
    from specattn.errors import CallOrderError

    fx = H.build_fixture(H.Shape())
    H.configure_draft(fx, topk=1, steps=3)
    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    backend = H.create_extend_backend(fx, 1, 3)
    fb = H.extend_batch(fx, ForwardMode.DECODE, (1, 1, 1))
    q = torch.zeros(3, fx.layer.tp_q_head_num * fx.layer.qk_head_dim)
    for forward in (backend.forward_decode, backend.forward_extend):
        with pytest.raises(CallOrderError, match="init_forward_metadata: expected a call for "
                                                 "the batch before forward, got a DECODE"):
            forward(q, None, None, fx.layer, fb, save_kv_cache=False)
    with pytest.raises(CallOrderError, match="init_forward_metadata"):
        backend.adapter.forward(q, None, None, fx.layer, save_kv_cache=False)


def test_mla_rope_parts_apart_as_deepseek_passes_them(specattn_plugin):
    """Under the names SGLang's factory gives its FA3, FA4, FlashInfer, TRT-LLM and DSA
    backends, DeepSeek's absorbed attention passes ``q`` / ``k`` as the latent parts and the
    rope parts as ``q_rope`` / ``k_rope``: the adapter had dropped ``q_rope`` and failed to
    reshape ``q``. The split call equals the joined one (output and pool)."""
    fx = H.build_fixture(H.Shape(model="mla", page_size=4, prefix_lens=(5, 11, 2)))
    H.configure_draft(fx, topk=1, steps=3)
    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    backend = H.create_extend_backend(fx, 1, 3)
    lens = (2, 5, 1)
    fb = H.extend_batch(fx, ForwardMode.EXTEND, lens)
    heads, rank, rope = fx.layer.tp_q_head_num, H.KV_LORA_RANK, H.ROPE_DIM
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(sum(lens), n, rank + rope, generator=gen) for n in (heads, 1))
    H.check_split_rope_call(fx, lambda: backend.init_forward_metadata(fb),
                            lambda q_, k_, v_, **rope: backend.forward_extend(
                                q_, k_, v_, fx.layer, fb, **rope), q, k)
    for name in ("cos_sin_cache", "topk_indices", "attn_sink"):
        with pytest.raises(InvalidInputError, match=f"^{name}: expected None"):
            backend.forward_extend(q[..., :rank], k[..., :rank], None, fx.layer, fb,
                                   q_rope=q[..., rank:], k_rope=k[..., rank:],
                                   **{name: torch.zeros(1)})


def test_q_rope_on_an_mha_pool_is_refused(specattn_plugin):
    fx = H.build_fixture(H.Shape())
    H.configure_draft(fx, topk=1, steps=3)
    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    backend = H.create_extend_backend(fx, 1, 3)
    fb = H.extend_batch(fx, ForwardMode.DECODE, (1, 1, 1))
    backend.init_forward_metadata(fb)
    q = torch.zeros(3, fx.layer.tp_q_head_num * fx.layer.qk_head_dim)
    with pytest.raises(InvalidInputError, match=r"^q_rope: expected None for an MHA pool"):
        backend.forward_extend(q, None, None, fx.layer, fb, save_kv_cache=False,
                               q_rope=torch.zeros(3, 8))


def test_fallback_calls_keep_their_keywords(specattn_plugin):
    """A call SGLang's own backend serves (an MLA model's non-absorbed attention, a layer of
    another shape than the pool's) gets every keyword as given; only specattn's own calls
    refuse the ones it cannot honour."""
    import copy

    fx = H.build_fixture(H.Shape(model="mla", page_size=4, prefix_lens=(5, 11, 2)))
    H.configure_draft(fx, topk=1, steps=3)
    specattn_plugin({"SPECATTN_SGLANG_BACKEND": "torch_ref"})
    backend = H.create_extend_backend(fx, 1, 3)
    seen = {}

    class Fallback:
        def init_forward_metadata(self, fb):
            pass

        def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
            seen.update(kwargs)
            return q

    backend.fallback = Fallback()
    mha = copy.copy(fx.layer)
    mha.qk_head_dim, mha.v_head_dim = 48, 32  # the non-absorbed form: not the pool's rows
    mha.tp_k_head_num = mha.tp_v_head_num = mha.tp_q_head_num
    fb = H.extend_batch(fx, ForwardMode.EXTEND, (2, 5, 1))
    backend.init_forward_metadata(fb)
    q = torch.zeros(8, mha.tp_q_head_num * 48)
    keywords = dict(return_lse=True, topk_indices=torch.zeros(8, 4), sinks=torch.zeros(4))
    assert backend.forward_extend(q, q, q, mha, fb, **keywords) is q
    assert seen == keywords
