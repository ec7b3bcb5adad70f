"""The Gluon MLA kernels compiled for sm90 without a GPU: ``gluon_mla.attention`` is called on
CPU tensors with its launches captured, and each captured launch (the arguments the launcher
passes, in its order, with its constexprs) is compiled by Triton for an sm90 target down to a
cubin. FP8 pools (e4m3 and e5m2) under bf16 and fp16 queries, the split and the work-list
kernel, lane and path mode and the split kernel's extend, with and without a logit cap; the
bf16 path alongside.

Compiling checks the launcher against the kernels' signatures, that Gluon accepts the FP8
path's layouts and conversions, and that shared memory fits the H200's 227 KB. Each case
compiles in a child process without ``TRITON_INTERPRET`` (under the interpreter, Triton's
own library functions cannot be compiled). It needs the Triton release the Gluon kernels
are written for (``plans.GLUON_TRITON``; skipped with the reason under any other). The
kernels' numbers are checked on the H200: ``tests/gpu/test_sm90_mla_gpu.py``.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("triton")

from specattn.backends.triton import gluon_mla, plans  # noqa: E402
from sm90_compile import H200_SHARED, Capture, compile_launch, in_child  # noqa: E402



@pytest.fixture(scope="module")
def gluon():
    why = plans.gluon_import_reason()
    if why is not None:
        pytest.skip(f"compiling the Gluon kernels needs their Triton: {why}")


def _launch(*, q_dtype, kv_dtype, heads, topk, mode, cap, work):
    """One ``gluon_mla.attention`` call on CPU tensors: its captured launch."""
    from specattn.backends.triton import _gluon_mla_wl_kernel as W

    split = Capture(gluon_mla.kernel_module()._gluon_mla_kernel)
    wl = Capture(W._gluon_mla_wl_kernel)
    gluon_mla.kernel_module = lambda: type("M", (), {"_gluon_mla_kernel": split})
    W._gluon_mla_wl_kernel = wl
    extend = mode == 2  # topk: new tokens per request
    rows, steps, slots, batch = 2 * topk, 1 if extend else 3, 4096, 2
    fp8 = kv_dtype != q_dtype
    q = torch.zeros(rows, heads, 576, dtype=q_dtype)
    kv = torch.zeros(slots, 576, dtype=torch.uint8).view(kv_dtype)
    meta = torch.zeros(batch, 5, dtype=torch.int32)
    hist = torch.zeros(rows, steps, dtype=torch.int32)
    parents = torch.zeros(steps, batch, topk, dtype=torch.int64)
    splits = 3
    # The work list's partials are in the query's dtype (``launchers.partial_dtype``).
    mid_o = torch.zeros(rows + splits + batch, heads, splits, 512,
                        dtype=q_dtype if work else torch.float32)
    gluon_mla.attention(
        q, kv, torch.zeros(rows, 576, dtype=q_dtype), torch.zeros(rows, heads, 512,
                                                                 dtype=q_dtype),
        mid_o, torch.zeros(mid_o.shape[:-1]), torch.zeros(batch, 320, dtype=torch.int32),
        meta, hist, (parents, parents.stride(0), parents.stride(1)) if mode == 1 else
        (meta, 0, 0), mode=mode, batch=batch, topk=1 if extend else topk, num_steps=steps,
        step=0 if extend else 1, rows=topk * heads if extend else None,
        num_splits=splits, sm_scale=576 ** -0.5, logit_cap=cap, block_n=64, num_stages=2,
        work=torch.zeros(64, dtype=torch.int32) if work else None,
        k_scale=torch.ones(1) if fp8 else None, pdl=True, write=_fp8_write(kv_dtype) if fp8
        else None)
    (launch,) = (wl if work else split).launches
    assert launch[3]["FP8"] is fp8
    assert launch[3]["Q_F16"] is (fp8 and q_dtype == torch.bfloat16)
    return launch


def _fp8_write(kv_dtype):
    """The FP8 write a CUDA device whose torch the kernels' codes match gets
    (``kv_write.fp8_write``), its torch's variant: under e4m3 pools a Python-number scale's
    reciprocal (``QUANT_MUL``), under e5m2 a tensor scale (``QUANT_DIV``, a correctly
    rounded division)."""
    from specattn.kernels import fp8_codes as F
    from specattn.kernels.kv_write import Fp8Write

    e5m2 = kv_dtype == torch.float8_e5m2
    scale, quant = F.write_scale(torch.full((1,), 0.37) if e5m2 else 0.37, torch.device("cpu"))
    assert quant == (F.QUANT_DIV if e5m2 else F.QUANT_MUL)
    return Fp8Write(scale, scale, quant, quant, F.Codes(e5m2, True, False))


def compile_case(q_dtype: str, kv_dtype: str, heads: int, topk: int, mode: int, cap: float,
                 work: bool) -> dict:
    """Capture and compile one launch (dtypes by torch name): what the test checks."""
    launch = _launch(q_dtype=getattr(torch, q_dtype), kv_dtype=getattr(torch, kv_dtype),
                     heads=heads, topk=topk, mode=mode, cap=cap, work=work)
    fn, _, args, kw = launch
    kernel = compile_launch(fn, args, kw, gluon=True)
    ptx = kernel.asm["ptx"]
    return dict(kernel=fn.__name__, fp8=kw["FP8"], shared=kernel.metadata.shared,
                cubin=len(kernel.asm["cubin"]), wgmma="wgmma.mma_async" in ptx,
                cp_async="cp.async" in ptx, e4m3_cvt="cvt.rn.f16x2.e4m3x2" in ptx,
                e4m3_cvts=ptx.count("cvt.rn.f16x2.e4m3x2"), f16_selects=ptx.count("selp.b16"),
                pdl_wait="griddepcontrol.wait" in ptx, warp_specialised="setmaxnreg" in ptx,
                pdl_release="griddepcontrol.launch_dependents" in ptx,
                launch_pdl=kernel.metadata.launch_pdl,
                f16_to_bf16="cvt.bf16.f16" in ptx or "cvt.rn.bf16.f16" in ptx,
                v4_stores=ptx.count("st.global.v4"), pair_stores=ptx.count("st.global.v2"))


@pytest.mark.parametrize("q_dtype,kv_dtype,heads,topk,mode,cap,work", [
    # Both FP8 dtypes under both query dtypes, on each kernel; lane / path, cap on / off.
    ("bfloat16", "float8_e4m3fn", 16, 4, 1, 0.0, True),
    ("bfloat16", "float8_e4m3fn", 128, 2, 0, 30.0, False),
    ("bfloat16", "float8_e5m2", 16, 1, 0, 0.0, True),
    ("bfloat16", "float8_e5m2", 16, 8, 1, 0.0, False),
    ("float16", "float8_e4m3fn", 16, 4, 0, 20.0, True),
    ("float16", "float8_e4m3fn", 16, 8, 1, 0.0, False),
    ("float16", "float8_e5m2", 16, 2, 1, 0.0, True),
    ("float16", "float8_e5m2", 128, 1, 0, 0.0, False),
    # The bf16/fp16 path, same launcher.
    ("bfloat16", "bfloat16", 16, 4, 1, 0.0, True),
    ("float16", "float16", 16, 8, 0, 0.0, False),
    # Extend (mode 2, the split kernel; topk = new tokens per request), bf16 and FP8.
    ("bfloat16", "bfloat16", 16, 6, 2, 0.0, False),
    ("float16", "float8_e4m3fn", 16, 6, 2, 0.0, False),
    ("bfloat16", "float8_e5m2", 128, 3, 2, 30.0, False),
])
def test_gluon_kernels_compile_for_sm90(gluon, q_dtype, kv_dtype, heads, topk, mode, cap,
                                        work):
    got = in_child(__file__, dict(q_dtype=q_dtype, kv_dtype=kv_dtype, heads=heads, topk=topk,
                         mode=mode, cap=cap, work=work))
    print(got)
    assert got["kernel"] == ("_gluon_mla_wl_kernel" if work else "_gluon_mla_kernel")
    assert got["fp8"] == kv_dtype.startswith("float8")
    assert got["shared"] <= H200_SHARED and got["cubin"] > 0, got
    assert got["wgmma"] and got["cp_async"], got
    # Both kernels are warp-specialised (a producer warpgroup copying, over FP8 pools also
    # widening, the key tiles; its registers moved to the computing warps).
    assert got["warp_specialised"], got
    # As the launcher builds them on sm90 (``pdl``): the merge released once the results are
    # stored; over FP8 pools the kernel stores the call's codes itself (no write launch to
    # wait for).
    assert got["pdl_release"] and not got["pdl_wait"] and not got["launch_pdl"], got
    # e4m3 codes are widened by the hardware conversion, to fp16 under either query dtype
    # (bf16 queries: the Q_F16 prescale), never on to bf16 (a quarter-rate F2F per code).
    assert got["e4m3_cvt"] == (kv_dtype == "float8_e4m3fn"), got
    # The finite check of history tiles (a select per fp16 code) is compiled into the tail
    # tiles' widening only: the prefix tiles' widening is a second copy of the conversions
    # without it (one widening with a runtime check selected on every code of every tile).
    if kv_dtype == "float8_e4m3fn":
        assert got["e4m3_cvts"] > got["f16_selects"] // 2, got
    assert not (got["fp8"] and got["f16_to_bf16"]), got
    # The work list's half-width partials leave through a blocked layout, 16 bytes a thread
    # (16 stores of a 64 x 512 tile; from the wgmma layout, 4 bytes a thread, they were
    # slower than fp32 ones); the split kernel's fp32 partials leave from the wgmma layout,
    # 8 bytes a thread (64 stores).
    if work:
        assert got["v4_stores"] >= 16 and got["pair_stores"] < 64, got
    else:
        assert got["pair_stores"] >= 64, got


def test_launcher_refuses_a_pool_it_cannot_read():
    """An FP8 pool needs its scale tensor; any other pool must be of the query's dtype
    (checked before the kernel module is loaded)."""
    q = torch.zeros(4, 16, 576, dtype=torch.float16)
    meta = torch.zeros(2, 5, dtype=torch.int32)
    kw = dict(mode=0, batch=1, topk=4, num_steps=2, step=0, num_splits=1, sm_scale=0.04,
              logit_cap=0.0, block_n=64, num_stages=2)
    rest = (q[:, 0], torch.empty(4, 16, 512, dtype=torch.float16), torch.empty(1),
            torch.empty(1), meta, meta, torch.zeros(4, 2, dtype=torch.int32), (meta, 0, 0))
    fp8 = torch.zeros(64, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for scale in (None, torch.ones(2), torch.ones(1, dtype=torch.float16)):
        with pytest.raises(ValueError, match="k_scale"):
            gluon_mla.attention(q, fp8, *rest, **kw, k_scale=scale)
    with pytest.raises(ValueError, match="query's dtype or FP8"):
        gluon_mla.attention(q, torch.zeros(64, 576, dtype=torch.bfloat16), *rest, **kw)


if __name__ == "__main__":
    print(json.dumps(compile_case(**json.loads(sys.argv[1]))))
