"""FP8 KV pools (``kv_cache_dtype`` ``"fp8_e4m3"`` / ``"fp8_e5m2"``) on the GPU, for every backend
that serves them here: ``flashinfer`` (MHA e4m3/e5m2; MLA e4m3 on SM90) and ``torch_ref``
(the reference's own dequantizing path on CUDA). Marked ``gpu``.

- The conformance kit's FP8 cases (``select="kv-fp8"``): decode rounds and extends with
  ``k_scale`` / ``v_scale`` != 1, pools checked bit for bit against ``runner.write_kv``'s
  codes, ``uint8`` pool storage, captured CUDA graphs whose scale tensors change value
  before every replay.
- The kit's case bodies at serving sizes (the kit's GPU shapes, MHA 8 query / 2 KV heads and
  MLA 16 x 512 + 64; topk 4, page 16, prefixes up to 300, both layers): Python-float scales
  (FlashInfer's ``k_scale=`` / ``v_scale=`` and ``ckv_scale=`` / ``kpe_scale=`` arguments)
  and device-tensor scales (folded into q and the output), shared-prefix and per-branch
  decode, a captured graph with float scales.
- Selection and refusals on this machine: ``auto`` picks a backend that declares the dtype;
  fa4 refuses with FlashAttention-4's reason.

Every comparison is with float64 attention over the pool dequantized (the kit's reference).
"""

from __future__ import annotations

import pytest
import torch

from specattn.fp8 import FP8_KV_DTYPES
from specattn.keys import BackendRequest
from specattn.platforms import current_platform
from specattn.platforms._probes import module_available
from specattn.selection import select
from specattn.testing import check_backend
from specattn.testing.checks import (FP8_SCALES, Case, Session, decode_graph, decode_numerics,
                                     extend_numerics)
from specattn.testing.kit import run_case
from specattn.testing.report import PASSED
from specattn.testing.target import Target

pytestmark = pytest.mark.gpu
DEV = "cuda"
LENS = [300, 129, 37, 5]
EXTEND = ([300 + 4, 129 + 6, 5 + 1, 3], [4, 6, 1, 3])
KVS = tuple(FP8_KV_DTYPES)


def _needs_flashinfer():
    if not module_available("flashinfer"):
        pytest.skip("flashinfer is not installed here (shared/gpu/install.sh flashinfer)")


def _run(name: str, case: Case, device: str = DEV, **target) -> str:
    """One kit case body on ``name``; fails with the kit's detail."""
    result = run_case(Session(Target.build(name, device=device, **target)), case)
    print(result.line())
    assert result.status == PASSED, result.line()
    return result.detail


def _case(kind: str, model: str, body, kv: str, *, topk: int = 4, page: int = 16,
          tree: str = "path", tag: str = "serving", **params) -> Case:
    cid = f"{kind}/{model}/fp8-gpu/bf16/k{topk}/p{page}/{tree}/kv-{kv}/{tag}"
    return Case(cid, kind, model, body, torch.bfloat16, topk, page, tree, kv, params)


# --- the conformance kit's FP8 cases -------------------------------------------------------


@pytest.mark.parametrize("model", ["mha", "mla"])
def test_flashinfer_kit_fp8_cases(model):
    _needs_flashinfer()
    report = check_backend("flashinfer", device=DEV, models=(model,), select="kv-fp8",
                           raise_on_failure=False)
    print(report)
    assert report.ok, report
    # MHA: both dtypes x (decode, uint8 pools, decode graph, extend, extend graph); MLA e4m3.
    assert report.passed == (10 if model == "mha" else 5), report
    graphs = [r for r in report.results if "/scale_change" in r.case]
    assert graphs and all("captured CUDA graph" in r.detail for r in graphs), report


def test_torch_ref_kit_fp8_cases_on_cuda():
    report = check_backend("torch_ref", device=DEV, select="kv-fp8", raise_on_failure=False)
    print(report)
    # The same cases pass on CUDA as on the CPU (all but the graph ones: torch_ref has none).
    cpu = check_backend("torch_ref", device="cpu", select="kv-fp8", raise_on_failure=False)
    passed = {r.case for r in report.results if r.status == "passed"}
    assert report.ok and passed == {r.case for r in cpu.results if r.status == "passed"}
    assert len(passed) >= 20 and not any("/graph/" in c for c in passed), report


# --- serving shapes --------------------------------------------------------------------------


@pytest.mark.parametrize("kv", KVS)
@pytest.mark.parametrize("scales", ["floats", "tensors"])
@pytest.mark.parametrize("mode", ["shared", "per-branch"])
def test_flashinfer_mha_decode_at_serving_shapes(kv, scales, mode):
    _needs_flashinfer()
    case = _case("decode", "mha", decode_numerics, kv, tag=f"{scales}-{mode}", lens=LENS,
                 scales=_scales(scales), both_layers=True)
    _run("flashinfer", case, decode_options={"mode": mode})


@pytest.mark.parametrize("scales", ["floats", "tensors"])
@pytest.mark.parametrize("topk", [1, 4])
def test_flashinfer_mla_decode_at_serving_shapes(scales, topk):
    _needs_flashinfer()
    case = _case("decode", "mla", decode_numerics, "fp8_e4m3", topk=topk,
                 tree="path" if topk > 1 else "lane", tag=scales, lens=LENS,
                 scales=_scales(scales), both_layers=True)
    _run("flashinfer", case)


@pytest.mark.parametrize("model,kv", [("mha", "fp8_e4m3"), ("mha", "fp8_e5m2"),
                                      ("mla", "fp8_e4m3")])
@pytest.mark.parametrize("scales", ["floats", "tensors"])
def test_flashinfer_extend_at_serving_shapes(model, kv, scales):
    _needs_flashinfer()
    case = _case("extend", model, extend_numerics, kv, topk=1, tag=scales, lens=EXTEND,
                 scales=_scales(scales), both_layers=True)
    _run("flashinfer", case)


@pytest.mark.parametrize("model", ["mha", "mla"])
def test_flashinfer_graph_with_float_scales(model):
    """A captured graph whose layers carry Python-float scales (what SGLang's adapter passes
    for a checkpoint without KV scales is 1.0; here 0.37 / 1.9): FlashInfer's float
    arguments and the history kernel's, captured as constants."""
    _needs_flashinfer()
    case = _case("decode", model, decode_graph, "fp8_e4m3", topk=2, tag="float-scales",
                 scales=FP8_SCALES)
    assert "captured CUDA graph" in _run("flashinfer", case)


def _scales(kind: str):
    if kind == "floats":
        return FP8_SCALES
    return tuple(torch.tensor([x], dtype=torch.float32, device=DEV) for x in FP8_SCALES)


# --- selection and refusals here -------------------------------------------------------------


@pytest.mark.parametrize("kv", KVS)
def test_auto_picks_a_backend_that_serves_the_dtype_here(kv):
    sel = select("decode", "auto", BackendRequest("decode", topk=4, kv_cache_dtype=kv))
    print(sel.explain())
    assert kv in sel.backend.kv_cache_dtypes and sel.backend.name != "fa4", sel.explain()


def test_fa4_refuses_fp8_with_flash_attention_4s_reason():
    if not current_platform().has_library("flash_attn.cute"):
        pytest.skip("flash_attn.cute (FlashAttention-4) is not installed here")
    from specattn.backends.flash_attn import FA4Decode
    from specattn.data import DraftRunner
    from specattn.errors import BackendUnavailableError

    runner = DraftRunner.mha(8, 2, 128, num_layers=1, num_slots=64, max_reqs=2,
                             max_context_len=32, device=DEV, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(BackendUnavailableError, match="runs FP8 K/V only on SM100"):
        FA4Decode(runner, 4, 3)


# --- the triton backend's FP8 KV write ----------------------------------------------------------


@pytest.mark.parametrize("kv", KVS)
@pytest.mark.parametrize("model", ["mha", "mla"])
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
def test_triton_fp8_kv_write_is_cuda_torchs_bytes(kv, model, act):
    """``write_new_kv`` with ``fp8_write`` (one launch) stores the bytes CUDA torch's
    ``runner.write_kv`` stores (``(x.float() / scale).to(dtype)``), for every bit pattern of
    the activation dtype (ties, subnormals, the overflow boundaries, infinities, NaNs, -0.0),
    Python-number and device-tensor scales; a slot outside the pool is not written."""
    from specattn.kernels.kv_write import fp8_write, write_new_kv
    from specattn.data import AttentionLayer, DraftRunner

    dev = torch.device(DEV)
    every = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32, device=dev).to(torch.int16)
    every = every.view(act)
    rows = 130
    make = DraftRunner.mla if model == "mla" else DraftRunner.mha
    heads = (16, 512, 64) if model == "mla" else (8, 4, 128)
    width = 576 if model == "mla" else 4 * 128

    def values(seed: int) -> torch.Tensor:
        perm = torch.randperm(every.numel(), generator=torch.Generator().manual_seed(seed))
        flat = every[perm.to(dev)].repeat(rows * width // every.numel() + 1)[:rows * width]
        return flat.view(rows, width) if model == "mla" else flat.view(rows, 4, 128)

    slots = torch.randperm(rows, device=dev)
    slots[7] = -1
    slots[9] = rows + 3  # past the pool's last slot
    scales = [(1.0, torch.tensor([0.6], device=dev)), (0.37, 1.7),
              (torch.tensor([1.7], device=dev), 2.0 ** -3),
              (torch.tensor(0.3, device=dev), torch.tensor([0.37], device=dev))]
    for k_scale, v_scale in scales:
        pools = [make(*heads, num_layers=1, num_slots=rows + 2, max_reqs=1,
                      max_context_len=8, dtype=act, device=DEV, kv_cache_dtype=kv)
                 for _ in range(2)]
        layer = AttentionLayer(0, 0.1, k_scale=k_scale, v_scale=v_scale)
        k = values(0)
        v = None if model == "mla" else values(1)
        fp8 = fp8_write(pools[0], layer, (k, v), dev)
        assert fp8 is not None, "the probe found the kernel's codes differ from torch's"
        assert write_new_kv(pools[0], 0, slots, k, v, fp8=fp8)
        ok = (slots >= 0) & (slots < rows + 2)
        pools[1].write_kv(0, slots[ok], k[ok], None if v is None else v[ok],
                          k_scale=k_scale, v_scale=v_scale)
        for name in (("kv_buffer",) if model == "mla" else ("k_buffer", "v_buffer")):
            got, want = (getattr(p, name)[0].view(torch.uint8) for p in pools)
            assert torch.equal(got, want), (name, k_scale, v_scale)


@pytest.mark.parametrize("kv", ("auto",) + KVS)
@pytest.mark.parametrize("model", ["mha", "mla"])
def test_store_kv_is_one_launch_of_write_kvs_bytes(kv, model):
    """``kernels.kv_write.store_kv`` (the KV write of ``flashinfer``'s decode and extend)
    stores ``runner.write_kv``'s bytes, bf16 and FP8 pools, Python-number and device-tensor
    scales, slots as a strided ``[B, K]`` view, in one CUDA kernel."""
    from specattn.data import AttentionLayer, DraftRunner
    from specattn.kernels.kv_write import store_kv

    make = DraftRunner.mla if model == "mla" else DraftRunner.mha
    heads = (16, 512, 64) if model == "mla" else (8, 4, 128)
    dev = torch.device(DEV)
    loc_all = torch.randperm(96, device=dev)[:4 * 4 * 3].view(4, 4, 3)  # [B, K, S]
    loc = loc_all[:, :, 1]
    for k_scale, v_scale in ((0.37, 1.7), (torch.tensor([0.6], device=dev), 2.0 ** -3)):
        runners = [make(*heads, num_layers=1, num_slots=96, max_reqs=1, max_context_len=8,
                        dtype=torch.bfloat16, device=DEV, kv_cache_dtype=kv) for _ in range(2)]
        layer = AttentionLayer(0, 0.1, k_scale=k_scale, v_scale=v_scale)
        shape = (16, 576) if model == "mla" else (16, 4, 128)
        k = torch.randn(shape, device=dev, dtype=torch.bfloat16) * 3
        v = None if model == "mla" else torch.randn(shape, device=dev, dtype=torch.bfloat16)
        store_kv(runners[0], layer, loc, k, v)  # the first call may probe torch's codes
        runners[1].write_kv(0, loc, k, v, k_scale=k_scale, v_scale=v_scale)
        for name in (("kv_buffer",) if model == "mla" else ("k_buffer", "v_buffer")):
            got, want = (getattr(r, name)[0].view(torch.uint8) for r in runners)
            assert torch.equal(got, want), (name, k_scale, v_scale)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            store_kv(runners[0], layer, loc, k, v)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        assert kernels == ["_write_kv_kernel"], kernels
