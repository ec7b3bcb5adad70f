"""FP8 KV pools with one scale per tensor (``kv_cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"``):
the helpers of ``specattn.fp8``, the layer's scales, the runner's pools and writes, the names
``SpecConfig`` accepts, what ``auto`` picks and the reasons of the backends that refuse FP8.

The attention over FP8 pools is the conformance kit's (``.../kv-fp8_*`` cases, run for every
backend that declares them in ``tests/conformance``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specattn import AttentionLayer, DraftRunner, SpecConfig
from specattn.backends.torch_ref import TorchRefDecode, reference_decode
from specattn.data import DraftBatch
from specattn.errors import BackendUnavailableError, InvalidInputError
from specattn.fp8 import (FP8_KV_DTYPES, check_scale, dequantize, host_value, library_scales,
                          quantize, scale_rows, scale_tensor)
from specattn.keys import BackendRequest
from specattn.kv_layouts import KV_CACHE_DTYPES
from specattn.platforms import Platform
from specattn.registry import default_registry
from specattn.selection import select

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
H200 = Platform("cuda", (9, 0), libraries=frozenset({"flashinfer", "flash_attn.cute",
                                                     "flash_mla", "triton"}))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# --- helpers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale", [0.37, torch.tensor([1.9])])
def test_quantize_is_the_expression_and_dequantize_inverts_it(dtype, scale):
    x = torch.randn(64, 8, dtype=torch.bfloat16) * 3
    codes = quantize(x, scale, dtype)
    assert codes.dtype == dtype
    assert torch.equal(_bits(codes), _bits((x.float() / scale).to(dtype)))
    back = dequantize(codes, scale)
    assert back.dtype == torch.float32
    assert torch.equal(back, codes.float() * scale)
    assert dequantize(codes, scale, torch.float64).dtype == torch.float64
    # Codes of dequantized codes are the codes (a write of rows read back leaves them).
    assert torch.equal(_bits(quantize(back, scale, dtype)), _bits(codes))


def test_scale_tensor_caches_floats_and_keeps_ready_tensors():
    a, b = scale_tensor(0.37, "cpu"), scale_tensor(0.37, torch.device("cpu"))
    assert a is b and a.dtype == torch.float32 and a.shape == (1,) and float(a) == \
        pytest.approx(0.37)
    assert scale_tensor(0.5, "cpu") is not a
    ready = torch.tensor([0.25])
    assert scale_tensor(ready, "cpu").data_ptr() == ready.data_ptr()
    converted = scale_tensor(torch.tensor(2.0, dtype=torch.bfloat16), "cpu")
    assert converted.dtype == torch.float32 and converted.shape == (1,)


def test_host_value_and_scale_rows():
    assert host_value(2) == 2.0 and host_value(torch.tensor([2.0])) is None
    x = torch.randn(4, 3, dtype=torch.bfloat16)
    assert scale_rows(x, 1.0) is x
    y = scale_rows(x, torch.tensor([0.37]))
    assert y.dtype == x.dtype and torch.equal(y, (x.float() * 0.37).to(x.dtype))


@pytest.mark.parametrize("bad,got", [(0.0, "0.0"), (-1.0, "-1.0"), (float("inf"), "inf"),
                                     (float("nan"), "nan"), (True, "True"), ("1", "'1'"),
                                     (None, "None")])
def test_bad_float_scales_are_one_line_naming_the_argument(bad, got):
    with pytest.raises(InvalidInputError) as info:
        check_scale("layer.k_scale", bad)
    assert str(info.value) == ("layer.k_scale: expected a finite float > 0 or a one-element "
                               f"floating tensor, got {got}")


@pytest.mark.parametrize("bad,got", [
    (torch.ones(2), "a tensor of dtype float32, shape (2,)"),
    (torch.ones(1, dtype=torch.int32), "a tensor of dtype int32, shape (1,)"),
    (torch.ones(1, dtype=E4M3), "a tensor of dtype float8_e4m3fn, shape (1,)"),
    (torch.tensor([0.0]), "a tensor holding 0.0"),
    (torch.tensor([float("nan")]), "a tensor holding nan")])
def test_bad_tensor_scales_are_refused(bad, got):
    with pytest.raises(InvalidInputError, match="layer.v_scale: expected") as info:
        AttentionLayer(0, 0.1, v_scale=bad)
    assert str(info.value).endswith(f"got {got}")


def test_device_tensor_values_are_not_read_without_debug_checks(monkeypatch):
    meta = torch.empty(1, device="meta")  # no value to read: a read would raise
    monkeypatch.delenv("SPECATTN_DEBUG_CHECKS", raising=False)
    check_scale("layer.k_scale", meta)
    monkeypatch.setenv("SPECATTN_DEBUG_CHECKS", "1")
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):  # the read
        check_scale("layer.k_scale", meta)


def test_library_scales_split_floats_from_device_tensors():
    q = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    floats = library_scales(AttentionLayer(0, 0.1, k_scale=0.37, v_scale=1.9), q, mla=False)
    assert floats.q is q and (floats.k_scale, floats.v_scale, floats.out_scale) == \
        (0.37, 1.9, 1.0)
    kt, vt = torch.tensor([0.37]), torch.tensor([1.9])
    tensors = library_scales(AttentionLayer(0, 0.1, k_scale=kt, v_scale=vt), q, mla=False)
    assert torch.equal(tensors.q, scale_rows(q, kt))
    assert (tensors.k_scale, tensors.v_scale) == (1.0, 1.0) and tensors.out_scale is vt
    mla = library_scales(AttentionLayer(0, 0.1, k_scale=0.37, v_scale=5.0), q, mla=True)
    assert (mla.k_scale, mla.v_scale) == (0.37, 0.37)  # one latent pool: k_scale for both


def test_layer_scales_take_no_part_in_equality():
    a = AttentionLayer(0, 0.1, k_scale=torch.tensor([0.5]))
    assert a == AttentionLayer(0, 0.1) and hash(a) == hash(AttentionLayer(0, 0.1))


# --- names ------------------------------------------------------------------------------------


def test_the_one_list_of_names():
    assert KV_CACHE_DTYPES == ("auto", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "fp8_ds_v4")
    assert tuple(FP8_KV_DTYPES) == ("fp8_e4m3", "fp8_e5m2")
    for name in KV_CACHE_DTYPES:
        SpecConfig(kv_cache_dtype=name)
    with pytest.raises(InvalidInputError) as info:
        SpecConfig(kv_cache_dtype="fp8")
    assert str(info.value) == ("kv_cache_dtype: expected one of ['auto', 'fp8_e4m3', "
                               "'fp8_e5m2', 'fp8_ds_mla', 'fp8_ds_v4'], got 'fp8'")
    with pytest.raises(InvalidInputError, match="^kv_cache_dtype: expected one of"):
        DraftRunner.mha(2, 1, 8, num_layers=1, num_slots=4, max_reqs=1, max_context_len=4,
                        kv_cache_dtype="float8")


# --- the runner ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", E4M3), ("fp8_e5m2", E5M2)])
def test_constructors_allocate_fp8_pools(name, dtype):
    mha = DraftRunner.mha(4, 2, 8, num_layers=2, num_slots=16, max_reqs=2, max_context_len=8,
                          kv_cache_dtype=name)
    mla = DraftRunner.mla(2, 16, 8, num_layers=1, num_slots=16, max_reqs=2,
                          max_context_len=8, kv_cache_dtype=name)
    for r, pools in ((mha, mha.k_buffer + mha.v_buffer), (mla, mla.kv_buffer)):
        assert r.fp8 and r.kv_dtype == dtype and r.dtype == torch.bfloat16
        assert all(p.dtype == dtype for p in pools)
        assert f"kv_cache_dtype={name}" in repr(r)
    plain = DraftRunner.mha(4, 2, 8, num_layers=1, num_slots=4, max_reqs=1, max_context_len=4,
                            dtype=torch.float16)
    assert not plain.fp8 and plain.kv_dtype == torch.float16


def test_uint8_pools_are_viewed_without_a_copy():
    k = [torch.zeros(16, 2, 8, dtype=torch.uint8)]
    v = [torch.zeros(16, 2, 8, dtype=torch.uint8)]
    r = DraftRunner.wrap_mha(torch.zeros(2, 8, dtype=torch.int32), k, v, 4,
                             kv_cache_dtype="fp8_e5m2")
    assert r.k_buffer[0].dtype == E5M2 and r.k_buffer[0].data_ptr() == k[0].data_ptr()
    assert k[0].dtype == torch.uint8  # the engine's own list and tensors are untouched
    r.write_kv(0, torch.tensor([3]), torch.ones(1, 2, 8), torch.ones(1, 2, 8), 0.5, 2.0)
    assert int(k[0][3, 0, 0]) == int(_bits(torch.tensor([2.0]).to(E5M2))[0])
    kv = [torch.zeros(16, 24, dtype=torch.uint8)]
    mla = DraftRunner.wrap_mla(torch.zeros(2, 8, dtype=torch.int32), kv, 2, 16,
                               kv_cache_dtype="fp8_e4m3")
    assert mla.kv_buffer[0].dtype == E4M3 and mla.qk_rope_head_dim == 8


@pytest.mark.parametrize("name,pool_dtype,expected", [
    ("fp8_e4m3", E5M2, "dtype float8_e4m3fn (or uint8 storage) for kv_cache_dtype='fp8_e4m3'"),
    ("fp8_e5m2", torch.bfloat16, "dtype float8_e5m2 (or uint8 storage) for kv_cache_dtype="
                                 "'fp8_e5m2'"),
    ("auto", E4M3, "dtype bfloat16/float16/float32 (an FP8 pool, or its uint8 storage, "
                   "needs kv_cache_dtype 'fp8_e4m3' or 'fp8_e5m2') for kv_cache_dtype='auto'"),
    ("auto", torch.uint8, "dtype bfloat16/float16/float32 (an FP8 pool, or its uint8 "
                          "storage, needs kv_cache_dtype 'fp8_e4m3' or 'fp8_e5m2') for "
                          "kv_cache_dtype='auto'")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, None])
def test_a_pool_whose_dtype_disagrees_is_refused(name, pool_dtype, expected, dtype):
    """Without ``dtype`` too: an FP8 pool wrapped under ``"auto"`` had been blamed on
    ``runner.dtype`` (the activation dtype taken from the pool)."""
    pools = [torch.zeros(8, 1, 8, dtype=pool_dtype)]
    with pytest.raises(InvalidInputError) as info:
        DraftRunner.wrap_mha(torch.zeros(1, 8, dtype=torch.int32), pools, pools, 2,
                             kv_cache_dtype=name, dtype=dtype)
    assert str(info.value) == f"runner.k_buffer[0]: expected {expected}, got " \
        f"{str(pool_dtype).replace('torch.', '')}"
    if name == "auto":
        with pytest.raises(InvalidInputError, match=r"^runner\.kv_buffer\[0\]: expected "
                           r"dtype bfloat16/float16/float32 \(an FP8 pool"):
            DraftRunner.wrap_mla(torch.zeros(1, 8, dtype=torch.int32),
                                 [torch.zeros(8, 24, dtype=pool_dtype)], 2, 16, dtype=dtype)


@pytest.mark.parametrize("mla", [False, True])
def test_write_kv_quantizes_with_the_scales_and_plain_pools_ignore_them(mla):
    def runner(kv):
        if mla:
            return DraftRunner.mla(2, 16, 8, num_layers=1, num_slots=8, max_reqs=1,
                                   max_context_len=8, kv_cache_dtype=kv)
        return DraftRunner.mha(2, 1, 8, num_layers=1, num_slots=8, max_reqs=1,
                               max_context_len=8, kv_cache_dtype=kv)

    loc = torch.tensor([5, 2])
    k = torch.randn(2, 24) if mla else torch.randn(2, 1, 8)
    v = None if mla else torch.randn(2, 1, 8)
    fp8, plain = runner("fp8_e4m3"), runner("auto")
    fp8.write_kv(0, loc, k.bfloat16(), None if v is None else v.bfloat16(), 0.37, 1.9)
    plain.write_kv(0, loc, k.bfloat16(), None if v is None else v.bfloat16(), 0.37, 1.9)
    if mla:
        assert torch.equal(_bits(fp8.kv_buffer[0][loc]), _bits(quantize(k.bfloat16(), 0.37,
                                                                        E4M3)))
        assert torch.equal(plain.kv_buffer[0][loc], k.bfloat16())
    else:
        assert torch.equal(_bits(fp8.k_buffer[0][loc]), _bits(quantize(k.bfloat16(), 0.37,
                                                                       E4M3)))
        assert torch.equal(_bits(fp8.v_buffer[0][loc]), _bits(quantize(v.bfloat16(), 1.9,
                                                                       E4M3)))
        assert torch.equal(plain.v_buffer[0][loc], v.bfloat16())


def test_forward_writes_with_the_layers_scales_and_reads_them_back():
    r = DraftRunner.mha(2, 1, 8, num_layers=1, num_slots=32, max_reqs=2, max_context_len=16,
                        kv_cache_dtype="fp8_e4m3")
    r.req_to_token[1, :4] = torch.arange(4, 8)
    r.write_kv(0, torch.arange(4, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8), 0.37, 1.9)
    batch = DraftBatch(torch.tensor([1]), torch.tensor([4]), torch.tensor([[[20, 21]]]))
    layer = AttentionLayer(0, 0.3, k_scale=torch.tensor([0.37]), v_scale=1.9)
    backend = TorchRefDecode(r, 1, 2)
    backend.init_forward_metadata(batch)
    q, k, v = (torch.randn(1, n, 8).bfloat16() for n in (2, 1, 1))
    out = backend.forward(0, layer, q, k, v)
    assert torch.equal(_bits(r.k_buffer[0][20]), _bits(quantize(k[0], 0.37, E4M3)))
    assert torch.equal(_bits(r.v_buffer[0][20]), _bits(quantize(v[0], 1.9, E4M3)))
    # The same attention over dequantized pools in float32.
    dense = DraftRunner.mha(2, 1, 8, num_layers=1, num_slots=32, max_reqs=2,
                            max_context_len=16, dtype=torch.float32)
    dense.req_to_token.copy_(r.req_to_token)
    dense.k_buffer[0].copy_(dequantize(r.k_buffer[0], 0.37))
    dense.v_buffer[0].copy_(dequantize(r.v_buffer[0], 1.9))
    ref = reference_decode(dense, AttentionLayer(0, 0.3), q, batch, 0)
    assert torch.allclose(out.float(), ref.float(), atol=1e-2)


# --- selection and refusals ------------------------------------------------------------------


def test_auto_picks_a_backend_that_serves_the_dtype():
    for kv in FP8_KV_DTYPES:
        for mla in (False, True):
            sel = select("decode", None, BackendRequest("decode", mla=mla, topk=2,
                                                        kv_cache_dtype=kv),
                         Platform("cpu", None, libraries=frozenset()))
            assert sel.backend.name == "intel_amx", sel.explain()
    request = BackendRequest("decode", topk=2, kv_cache_dtype="fp8_e4m3")
    sel = select("decode", "auto", request, H200)
    assert sel.backend.name == "flashinfer", sel.explain()  # fa4 ranks higher, refuses FP8
    assert any(q.endswith("FA4Decode") and "SM100" in " ".join(r)
               for q, r in sel.rejected.items()), sel.rejected


def test_the_factory_asks_for_the_runners_dtype_and_refuses_another():
    """``SpecConfig.kv_cache_dtype="auto"`` takes the runner's FP8 pools into selection (on a
    GPU where the first backend in auto order refuses them, auto must pass it by); a config
    naming another dtype than the runner's pools is refused at creation, as a page size is."""
    from specattn import DraftBackendFactory

    runner = DraftRunner.mla(num_layers=1, num_slots=64, max_reqs=2, max_context_len=32,
                             num_heads=4, kv_lora_rank=64, qk_rope_head_dim=16,
                             kv_cache_dtype="fp8_e5m2")
    gpu = Platform("cuda", (10, 0), libraries=frozenset({"flashinfer", "triton"}))
    factory = DraftBackendFactory(SpecConfig(), runner, 2, 3, platform=gpu)
    sel = factory.explain_decode_backend()
    assert sel.request.kv_cache_dtype == "fp8_e5m2"
    assert sel.backend.name == "triton", sel.explain()  # flashinfer's MLA: e4m3 pools only
    bf16 = DraftRunner.mha(num_layers=1, num_slots=64, max_reqs=2, max_context_len=32,
                           num_q_heads=4, num_kv_heads=2, head_dim=64)
    factory = DraftBackendFactory(SpecConfig(kv_cache_dtype="fp8_e4m3"), bf16, 2, 3)
    for create in (factory.create_decode_backend, factory.create_draft_extend_backend):
        with pytest.raises(InvalidInputError, match=r"^runner.kv_cache_dtype: expected "
                           r"config.kv_cache_dtype='fp8_e4m3', got 'auto'$"):
            create()


@pytest.mark.parametrize("name,mla,kv,why", [
    ("fa4", False, "fp8_e4m3", "runs FP8 K/V only on SM100"),
    ("fa3", False, "fp8_e5m2", "the bf16/fp16 query would be quantized to e4m3"),
    ("flashmla", True, "fp8_e4m3", "dense decode (the kernel this backend runs on sm90) reads "
                                   "bf16/fp16 latent pools only"),
    ("flashinfer", True, "fp8_e5m2", "MLA kernels take an FP8 latent pool only as e4m3")])
def test_backends_without_the_dtype_say_why(name, mla, kv, why):
    request = BackendRequest("decode", mla=mla, topk=2, kv_cache_dtype=kv,
                             dtype=torch.bfloat16)
    classes = [c for c in default_registry.classes("decode", name)
               if ("mla" if mla else "mha") in c.models and not c.platform_reasons(H200)]
    assert classes
    for cls in classes:
        reasons = cls.validate(request, H200)
        assert any(why in r for r in reasons), reasons


def test_flashinfers_mla_fp8_reason_names_the_query_dtype_only_when_known():
    from specattn.backends.flashinfer import FlashInferMLADecode

    sm100 = Platform("cuda", (10, 0), libraries=frozenset({"flashinfer"}))
    for dtype, tail in ((None, "asked for fp8_e4m3 on cuda 10.0"),
                        (torch.float16, "asked for fp8_e4m3 with a float16 query on cuda 10.0")):
        request = BackendRequest("decode", mla=True, topk=2, kv_cache_dtype="fp8_e4m3",
                                 dtype=dtype)
        reasons = FlashInferMLADecode.validate(request, sm100)
        assert any(r.endswith(tail) for r in reasons), reasons


def test_flashinfer_mla_fp8_needs_its_shape():
    from specattn.backends.flashinfer import FlashInferMLADecode
    from specattn.platforms import use_platform

    runner = DraftRunner.mla(4, 32, 16, num_layers=1, num_slots=64, max_reqs=2,
                             max_context_len=16, kv_cache_dtype="fp8_e4m3")
    with use_platform(H200), pytest.raises(BackendUnavailableError,
                                           match="kv_lora_rank 512 and rope 0 or 64; the "
                                                 "runner has kv_lora_rank 32, rope 16"):
        FlashInferMLADecode(runner, 2, 3)


# --- the SGLang adapter's engine-neutral half ----------------------------------------------


def _sglang_like(model: str, store=torch.uint8):
    """SGLang's FP8 pool as the adapter reads it: ``dtype`` e4m3, ``store_dtype`` uint8."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    codes = lambda *s: (torch.randn(*s, generator=g) * 4).to(E4M3).view(torch.uint8)  # noqa
    if model == "mla":
        pool = SimpleNamespace(kv_buffer=[codes(64, 1, 24)], kv_lora_rank=16,
                               qk_rope_head_dim=8, dtype=E4M3, store_dtype=store)
    else:
        pool = SimpleNamespace(k_buffer=[codes(64, 2, 8)], v_buffer=[codes(64, 2, 8)],
                               dtype=E4M3, store_dtype=store)
    r2t = torch.arange(64, dtype=torch.int32).reshape(2, 32)
    return SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(
        req_to_token=r2t), page_size=1, use_mla_backend=model == "mla", dtype=torch.float16)


@pytest.mark.parametrize("model", ["mha", "mla"])
def test_adapter_maps_sglang_fp8_pools_and_scales(model):
    from types import SimpleNamespace

    from specattn.backends.torch_ref import TorchRefExtend
    from specattn.data import DraftExtendBatch
    from specattn.integrations.sglang.adapter import ExtendAdapter, wrap_pools

    mr = _sglang_like(model)
    runner = wrap_pools(mr, 4)
    assert runner.kv_cache_dtype == "fp8_e4m3" and runner.dtype == torch.float16
    raw = (mr.token_to_kv_pool.kv_buffer if model == "mla" else
           mr.token_to_kv_pool.k_buffer + mr.token_to_kv_pool.v_buffer)
    before = [t.clone() for t in raw]
    adapter = ExtendAdapter(TorchRefExtend(runner))
    heads, dim = (1, 24) if model == "mla" else (2, 8)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=4, tp_k_head_num=heads,
                            qk_head_dim=dim, v_head_dim=16 if model == "mla" else 8,
                            scaling=0.3, logit_cap=0.0, sliding_window_size=-1,
                            k_scale=torch.tensor(0.37), v_scale=None, v_scale_float=1.9)
    converted = adapter.layers.require(layer)
    assert converted.k_scale is layer.k_scale and converted.v_scale == 1.9
    fb = SimpleNamespace(req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([6]),
                         extend_seq_lens=torch.tensor([2]), out_cache_loc=torch.tensor([36, 37]),
                         forward_mode=SimpleNamespace(name="EXTEND"), batch_size=1)
    adapter.begin(fb)
    q = torch.randn(2, 4 * dim, dtype=torch.float16)
    out = adapter.forward(q, None, None, layer, save_kv_cache=False)  # the model stored the KV
    assert all(torch.equal(a, b) for a, b in zip(raw, before))  # codes unchanged, bytes kept
    ref = TorchRefExtend(runner)
    ref.init_forward_metadata(DraftExtendBatch(fb.req_pool_indices, fb.seq_lens,
                                               fb.extend_seq_lens, fb.out_cache_loc))
    from specattn.backends.torch_ref import reference_extend

    want = reference_extend(runner, converted, q.view(2, 4, dim), ref.batch)
    assert torch.allclose(out.float(), want.reshape(2, -1).float(), atol=1e-3)


def test_adapter_refuses_pools_it_cannot_read():
    from specattn.integrations.sglang.adapter import wrap_pools

    mr = _sglang_like("mha")
    mr.token_to_kv_pool.dtype = torch.float8_e4m3fnuz
    with pytest.raises(InvalidInputError, match="a KV pool of the model dtype, float8_e4m3fn "
                                                "or float8_e5m2"):
        wrap_pools(mr, 4)
    mr = _sglang_like("mha")
    mr.token_to_kv_pool.is_quantized_kv_cache = True
    with pytest.raises(InvalidInputError, match="stored as torch.uint8"):
        wrap_pools(mr, 4)


# --- codes stored by a Triton kernel (specattn.kernels.fp8_codes, the triton KV write) -------


def _sweep() -> torch.Tensor:
    """fp32 values for the conversion: ``probe_values`` (every code and midpoint of both
    formats and +-2 ulps around them, overflow boundaries, infinities, NaNs, zeros, fp32
    subnormals) plus random bit patterns of every exponent."""
    from specattn.kernels.fp8_codes import probe_values

    g = torch.Generator().manual_seed(0)
    rand = torch.randint(-2 ** 31, 2 ** 31 - 1, (4096,), generator=g, dtype=torch.int64)
    extra = torch.tensor([-0.0, 2.0 ** -149, -(2.0 ** -149), 1e-40, 2.0 ** -9 * 0.5,
                          2.0 ** -16 * 0.5, 448.0, 464.0, 464.00003, 479.99997, 480.0,
                          57344.0, 61439.996, 61440.0, 65536.0, float("-inf")])
    return torch.cat([probe_values(), rand.to(torch.int32).view(torch.float32), extra])


def _codes(x, dtype, saturate=None, signed_nan=None, scale=1.0, scalar_quant=None):
    from specattn.kernels import fp8_codes as F

    cpu = F.torch_variant(torch.device("cpu"), dtype)
    codes = F.Codes(dtype == E5M2, cpu.saturate if saturate is None else saturate,
                    cpu.signed_nan if signed_nan is None else signed_nan)
    s, quant = F.write_scale(scale, torch.device("cpu"),
                             F.QUANT_DIV if scalar_quant is None else scalar_quant)
    return F.quantize(x, s, quant, codes)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_code_is_torchs_conversion_bit_for_bit(dtype):
    """``fp8_code`` with CPU torch's variant: torch's ``.to(dtype)`` bytes on every value
    class (ties to even, subnormals, overflow, inf, NaN, -0.0, fp32 subnormals)."""
    x = _sweep()
    assert torch.equal(_codes(x, dtype), _bits(x.to(dtype)))


def test_fp8_code_variants_of_other_torch_releases():
    """e4m3fn without saturation (torch <= 2.11's c10): overflow (rounding past 448) and
    infinities are NaN with their sign; unsigned NaN (CUDA's intrinsics): 0x7f for any NaN."""
    x = _sweep()
    sat = _bits(x.to(E4M3))
    over = (x.abs() > 464) & ~x.isnan()
    want = torch.where(over, (sat & 0x80) | 0x7F, sat)
    assert torch.equal(_codes(x, E4M3, saturate=False), want)
    for dtype in (E4M3, E5M2):
        want = torch.where(x.isnan(), torch.tensor(0x7F, dtype=torch.uint8), _bits(x.to(dtype)))
        assert torch.equal(_codes(x, dtype, signed_nan=False), want)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_divisions_of_torch_releases(dtype):
    """A Python-number scale: ``QUANT_MUL`` is the multiplication by ``float32(1.0 / scale)``
    (CUDA torch 2.11), ``QUANT_DIV`` the division by ``float32(scale)`` (CPU torch); they
    differ on some values. A tensor scale: the correctly rounded division."""
    from specattn.kernels import fp8_codes as F

    x = torch.cat([_sweep(), _sweep() * 1.7])
    inv = torch.tensor(np.float32(1 / 1.7))
    mul = _bits((x * inv).to(dtype))
    div = _bits((x / 1.7).to(dtype))
    assert not torch.equal(mul, div)  # the values tell them apart
    assert torch.equal(_codes(x, dtype, scale=1.7), div)
    assert torch.equal(_codes(x, dtype, scale=1.7, scalar_quant=F.QUANT_MUL), mul)
    t = torch.tensor([1.7])
    assert torch.equal(_codes(x, dtype, scale=t), _bits((x / t).to(dtype)))


def test_write_scale_serves_what_stays_float32():
    from specattn.kernels.fp8_codes import QUANT_DIV, QUANT_MUL, write_scale

    cpu = torch.device("cpu")
    s, quant = write_scale(0.37, cpu)  # CUDA torch's: the double reciprocal, as float32
    assert quant == QUANT_MUL and s.item() == float(np.float32(1 / 0.37))
    s, quant = write_scale(0.37, cpu, QUANT_DIV)
    assert quant == QUANT_DIV and s.item() == float(np.float32(0.37))
    for t in (torch.tensor([0.5]), torch.tensor(0.5, dtype=torch.float64),
              torch.tensor([0.5], dtype=torch.bfloat16)):
        s, quant = write_scale(t, cpu)
        assert quant == QUANT_DIV and s.dtype == torch.float32 and s.item() == 0.5
    assert write_scale(torch.tensor([0.5], dtype=torch.float64), cpu) is None  # divides in f64
    assert write_scale(torch.tensor([0.5, 1.0]), cpu) is None
    assert write_scale(torch.tensor([0.5], device="meta"), cpu) is None  # another device


def _telling(act: torch.dtype, dtype: torch.dtype, scale) -> torch.Tensor:
    """8 values of ``act`` whose codes differ between ``x.float() / scale`` and ``x.float() *
    float32(1.0 / scale)``, where the two divisions are told apart (four multiples of the
    scale where no ``act`` value does)."""
    x = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(act).float()
    s = float(scale)
    inv = torch.tensor(np.float32(1 / s))
    told = x[_bits((x * inv).to(dtype)) != _bits((x / s).to(dtype))]
    if told.numel() == 0:
        told = torch.tensor([1e-3, 0.3, 2.5, 100.0]) * s
    return told[torch.arange(8) % told.numel()]


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("model,act,scales", [
    ("mha", torch.bfloat16, (1.7, torch.tensor([0.6]))),
    ("mha", torch.float16, (torch.tensor(0.3), 0.6)),
    ("mla", torch.bfloat16, (torch.tensor([0.3]), 1.0)),
    ("mla", torch.float16, (1.7, 1.0)),
])
@pytest.mark.parametrize("scalar_quant", ["div", "mul"])
def test_triton_kv_write_stores_cudas_codes(kv, model, act, scales, scalar_quant):
    """``write_new_kv`` with ``Fp8Write`` (the triton backend's FP8 write on CUDA) stores the
    codes of ``(x.float() / scale).to(dtype)``, mirrored on the CPU: a Python scale by the
    division or (``mul``, older torch on CUDA) the multiplication by its float32 reciprocal,
    a tensor scale by the division (MLA: one latent pool, ``k_scale``); slots outside the
    pool are not written."""
    from specattn.kernels.kv_write import Fp8Write, write_new_kv
    from specattn.kernels import fp8_codes as F

    cpu = torch.device("cpu")
    make = DraftRunner.mla if model == "mla" else DraftRunner.mha
    heads = (4, 32, 16) if model == "mla" else (4, 2, 48)
    runner = make(*heads, num_layers=1, num_slots=16, max_reqs=1, max_context_len=16,
                  dtype=act, device="cpu", kv_cache_dtype=kv)
    dtype = FP8_KV_DTYPES[kv]
    k_scale, v_scale = scales
    k = torch.randn(5, 48 if model == "mla" else 2 * 48, dtype=torch.float32) * 300
    k[0, :4] = torch.tensor([float("nan"), float("inf"), -1e-9, 0.0])
    k[2, :8] = _telling(act, dtype, k_scale)
    k = k.to(act).view(5, -1) if model == "mla" else k.to(act).view(5, 2, 48)
    v = None if model == "mla" else (torch.randn(5, 2, 48) * 40).to(act)
    if v is not None:
        v[4, 1, :8] = _telling(act, dtype, v_scale)
    slots = torch.tensor([3, -1, 15, 16, 7])
    sq = F.QUANT_MUL if scalar_quant == "mul" else F.QUANT_DIV
    ks, kq = F.write_scale(k_scale, cpu, sq)
    vs, vq = (ks, kq) if model == "mla" else F.write_scale(v_scale, cpu, sq)
    fp8 = Fp8Write(ks, vs, kq, vq, F.torch_variant(cpu, dtype)._replace(scalar_quant=sq))
    assert write_new_kv(runner, 0, slots, k, v, fp8=fp8)

    def ref(x, scale):
        if isinstance(scale, torch.Tensor) or scalar_quant == "div":
            return _bits((x.float() / scale).to(dtype))
        inv = torch.tensor(np.float32(1 / float(scale)))
        return _bits((x.float() * inv).to(dtype))

    ok = torch.tensor([True, False, True, False, True])
    pools = [runner.kv_buffer[0]] if model == "mla" else [runner.k_buffer[0], runner.v_buffer[0]]
    for pool, x, scale in zip(pools, (k, v), (k_scale, v_scale)):
        want = torch.zeros_like(_bits(pool))
        want[slots[ok]] = ref(x, scale)[ok]
        assert torch.equal(_bits(pool), want)


def test_triton_attention_keeps_torchs_write_off_cuda():
    """On the CPU (the interpreter) the triton backend's FP8 write stays
    ``runner.write_kv``'s (``fp8_write`` is ``None``): the one launch serves CUDA only."""
    from specattn.kernels.kv_write import fp8_write

    runner = DraftRunner.mha(4, 2, 16, num_layers=1, num_slots=8, max_reqs=1,
                             max_context_len=8, device="cpu", kv_cache_dtype="fp8_e4m3")
    k = torch.randn(2, 2, 16)
    assert fp8_write(runner, AttentionLayer(0, 0.25, k_scale=0.5), (k, k),
                     torch.device("cpu")) is None


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_torch_codes_finds_the_division_the_device_torch_does(monkeypatch, dtype):
    """The probe behind the FP8 write launch, run on the CPU: CPU torch divides by a Python
    number exactly, so the reciprocal variant is refused and the exact one found."""
    from specattn.kernels import fp8_codes as F

    monkeypatch.setattr(F, "_PROBED", {})
    codes = F.torch_codes(torch.device("cpu"), dtype)
    assert codes == F.torch_variant(torch.device("cpu"), dtype)._replace(
        scalar_quant=F.QUANT_DIV)
