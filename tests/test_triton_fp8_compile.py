"""The ``tl.dot`` kernels over FP8 pools compiled for sm90 without a GPU: ``launchers.attention``
is called on CPU tensors with the kernel launch captured, and the captured launch (the
launcher's arguments and constexprs, with the GPU's dot precision) is compiled by Triton for
an sm90 target down to SASS. GQA (``dot``) and MLA (``dot-mla``), e4m3 and e5m2 pools,
decode and extend, under bf16 queries (``Q_F16``: fp16 dots on a prescaled query) and fp16
ones.

Checked: the launcher matches the kernels' signatures, shared memory fits the H200's 227 KB,
and the widening of FP8 codes takes no per-element ``F2F`` conversion (the cost that made FP8
steps slower than bf16), nor bf16's fp16 -> fp32 step (``HADD2.F32``): the dots are fp16;
the query's prescale stays an fp32 multiply (no ``mul.f16x2``). Each
case compiles in a child process without ``TRITON_INTERPRET``, with the Triton release the
GPU runs (``plans.GLUON_TRITON``; skipped under any other). The numbers:
``tests/conformance`` and ``specattn bench --case fp8`` on the H200.

The FP8 KV write (``write_new_kv`` with ``Fp8Write``) compiles under any Triton release: its
PTX has torch's float arithmetic only (``mul.rn`` / ``div.rn`` / ``add.rn``, no fma, no
flush to zero, no hardware FP8 conversion).
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

pytest.importorskip("triton")

from specattn.backends.triton import plans  # noqa: E402
from sm90_compile import (H200_SHARED, Capture, compile_launch, in_child,  # noqa: E402
                          sass_counts)

_SASS_OPS = re.compile(r"\b(F2F|F2FP|I2F|PRMT|HADD2\.F32|LDS\.U8)\b")


@pytest.fixture(scope="module")
def triton_of_the_gpu():
    import triton

    if not plans._gluon_version(triton.__version__):
        pytest.skip(f"triton {triton.__version__}: compiled with the GPU's triton "
                    f"({'/'.join(plans.GLUON_TRITON)}) only")


def _launch(model: str, kv: str, plan: str, extend: bool, dtype: str, topk: int = 0):
    """One ``launchers.attention`` call on CPU tensors (``dtype`` queries, the bench's shapes:
    GQA 32 / 8 heads of 128 at K 8, MLA 16 heads of 512 + 64 at K 4; ``topk``: another K):
    its captured launch. Two requests on an H200's 132 SMs: a few-request round, whose
    tail stores the new KV over bf16/fp16 pools, decode and extend
    (``launchers.tail_stores_kv``)."""
    from specattn.backends.triton import _attn_kernels as K
    from specattn.backends.triton import launchers as L
    from specattn.data import AttentionLayer, DraftRunner

    plans.sms = lambda device: 132  # a child process per case: nothing else sees it

    name = "_mla_partial_kernel" if plan.startswith("dot-mla") else "_partial_attn_kernel"
    capture = Capture(getattr(K, name))
    setattr(K, name, capture)
    from specattn.kernels import kv_write as W

    W._write_kv_kernel = Capture(W._write_kv_kernel)  # the KV write launch, where there is one
    L.merge_partials = lambda *args, **kw: None
    # FP8 pools as on a CUDA device whose torch the kernels' codes match (``fp8_write``):
    # a few-request round's tail stores the codes (``NEW_KV`` with ``FP8``).
    from specattn.kernels import fp8_codes as F

    def fp8_write(runner, layer, new_kv, device):
        k, v = (F.write_scale(x, device) for x in (layer.k_scale, layer.v_scale))
        e5m2 = L.layer_pools(runner, layer.layer_id)[0].dtype == torch.float8_e5m2
        return W.Fp8Write(k[0], v[0], k[1], v[1], F.Codes(e5m2, True, False))

    L.fp8_write = fp8_write
    dt = getattr(torch, dtype)
    topk, steps, slots = (topk or (4 if model == "mla" else 8)), 3, 256
    if model == "mla":
        runner = DraftRunner.mla(16, 512, 64, num_layers=1, num_slots=slots, max_reqs=2,
                                 max_context_len=64, kv_cache_dtype=kv, dtype=dt)
    else:
        runner = DraftRunner.mha(32, 8, 128, num_layers=1, num_slots=slots, max_reqs=2,
                                 max_context_len=64, kv_cache_dtype=kv, dtype=dt)
    shape = plans.AttnShape.of(runner)
    rows = 2 * topk
    width = shape.d_main + shape.d_pe
    q = torch.zeros(rows, shape.num_q_heads, width, dtype=dt)
    k = torch.zeros(rows, width, dtype=dt) if model == "mla" else \
        torch.zeros(rows, 8, 128, dtype=dt)
    v = None if model == "mla" else torch.zeros(rows, 8, 128, dtype=dt)
    meta = torch.zeros(2, 5, dtype=torch.int32)
    hist = torch.zeros(rows, 1 if extend else steps, dtype=torch.int32)
    parts = 4
    mid_o = torch.zeros(rows, shape.num_q_heads, parts, shape.d_v)
    lanes = 1 if extend else topk
    L.attention(q, runner, AttentionLayer(0, width ** -0.5, k_scale=0.37, v_scale=1.9), shape,
                meta, runner.req_to_token, mode=2 if extend else 1, num_groups=2,
                rows_per_group=(topk if extend else lanes) * shape.group,
                lanes_per_group=lanes, topk=1 if extend else topk,
                num_steps=1 if extend else steps, step=0 if extend else 1, num_splits=3,
                plan=plans.PLANS[plan], mid_o=mid_o, mid_lse=torch.zeros(mid_o.shape[:-1]),
                hist=hist, new_kv=(k, v), parents=None if extend else
                torch.zeros(steps, 2, topk, dtype=torch.int64))
    (launch,) = capture.launches
    return launch


def compile_case(model: str, kv: str, plan: str, extend: bool, dtype: str,
                 topk: int = 0) -> dict:
    """Capture and compile one launch: what the tests check."""
    fn, _, args, kw = _launch(model, kv, plan, extend, dtype, topk)
    gpu = dict(DOT_PREC="tf32", DOT_F32=False)  # the GPU's dots
    if "V_CVT" in kw:  # and an sm90's widening of FP8 values (``tiles.cvt_args``)
        gpu["V_CVT"] = kw["SCALED"]
    kernel = compile_launch(fn, args, dict(kw, **gpu))
    got = dict(kernel=fn.__name__, shared=kernel.metadata.shared, q_f16=bool(kw["Q_F16"]),
               warps=kw["num_warps"], new_kv=bool(kw.get("NEW_KV", False)),
               fp8_store=bool(kw.get("FP8", False)),
               f16_mul=len(re.findall(r"\bmul(?:\.rn)?\.f16x2\b", kernel.asm["ptx"])),
               **sass_counts(kernel.asm["cubin"], _SASS_OPS))
    if got["fp8_store"]:  # the same kernel without the tail's FP8 store: the widening alone
        plain = {k: v for k, v in kw.items() if k not in _FP8_STORE}
        got["widen"] = sass_counts(compile_launch(fn, args, dict(plain, **gpu)).asm["cubin"],
                                   _SASS_OPS)
    return got


# The split-KV kernel's constexprs of a tail that stores FP8 codes (``launchers.tail_kv_args``).
_FP8_STORE = ("NEW_KV", "BLOCK_KW", "FP8", "K_QUANT", "V_QUANT", "E5M2", "SATURATE",
              "SIGNED_NAN")


@pytest.mark.parametrize("model,kv,plan,extend,dtype", [
    ("mha", "fp8_e4m3", "dot-fp8", False, "bfloat16"),
    ("mha", "fp8_e5m2", "dot-fp8", True, "bfloat16"),
    ("mha", "fp8_e4m3", "dot", False, "bfloat16"),
    ("mla", "fp8_e4m3", "dot-mla", False, "bfloat16"),
    ("mla", "fp8_e5m2", "dot-mla", True, "bfloat16"),
    ("mha", "fp8_e4m3", "dot-fp8", False, "float16"),
    ("mla", "fp8_e5m2", "dot-mla", True, "float16"),
])
def test_fp8_kernels_compile_for_sm90(triton_of_the_gpu, model, kv, plan, extend, dtype):
    got = in_child(__file__, dict(model=model, kv=kv, plan=plan, extend=extend, dtype=dtype))
    print(got)
    assert got["q_f16"] is (dtype == "bfloat16"), got  # the prescaled fp16 query under bf16
    assert got["shared"] <= H200_SHARED, got
    # FP8 codes widen through fp16 (F2FP), never by a per-element F2F conversion.
    assert got.get("F2F", 0) == 0 and got.get("F2FP", 0) > 0, got
    # fp16 operands under both models: no fp16 -> fp32 step (HADD2.F32) of bf16's route. A
    # few-request decode's tail storing FP8 codes converts the call's fp16 rows to fp32 for
    # torch's quantization (HADD2.F32 under an fp16 model): checked without that store.
    widen = got.get("widen", got)
    assert widen.get("HADD2.F32", 0) == 0, got
    assert got.get("HADD2.F32", 0) == 0 or (got["fp8_store"] and dtype == "float16"), got
    # The split-KV kernel's value tiles widen where they are loaded (``V_CVT``): P.V's
    # operand is then read as fp16, never a code at a time (LDS.U8).
    if got["kernel"] == "_partial_attn_kernel":
        assert got.get("LDS.U8", 0) == 0, got
    # The query's 2^-8 prescale is an fp32 multiply before the conversion to fp16: moved
    # past it (an fp16 multiply), queries past fp16's range become infinities.
    assert got["f16_mul"] == 0, got


SM_SHARED, SM_REGISTERS, SM_WARPS = 228 * 1024, 65536, 64  # one sm90 SM


def programs_per_sm(shared: int, regs: int, warps: int) -> int:
    """Programs one sm90 SM holds: shared memory (1 KB reserved per program), registers
    (allocated per warp in units of 256) and warps."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(SM_SHARED // (shared + 1024), SM_REGISTERS // (warps * per_warp),
               SM_WARPS // warps)


@pytest.mark.parametrize("key,extend", [(key, extend) for key in sorted(plans.PROGRAMS_PER_SM)
                                        for extend in (False, True)
                                        if not (extend and key[0] == "dot-m16")])
def test_programs_per_sm_table_is_the_sm90_build(triton_of_the_gpu, key, extend):
    """``plans.PROGRAMS_PER_SM`` (which sizes the serving regime's one-wave prefix splits)
    is what the kernel Triton builds for sm90 leaves room for, bf16 queries at head dim 128:
    the few-request decode and extend builds (``dot-m16`` serves decode only), whose tail
    stores the new KV (``NEW_KV``) over bf16 pools and over FP8 ones (torch's codes)."""
    plan, rows, kv_bytes = key
    got = in_child(__file__, dict(model="mha", kv="auto" if kv_bytes == 2 else "fp8_e4m3",
                                  plan=plan, extend=extend, dtype="bfloat16", topk=rows // 4))
    print(got)
    assert got["new_kv"], got
    assert programs_per_sm(got["shared"], got["regs"], got["warps"]) == \
        plans.PROGRAMS_PER_SM[key], got


def compile_write_case(model: str, kv: str, tensor_scales: bool) -> dict:
    """Capture and compile the FP8 KV write launch (``write_new_kv`` with ``Fp8Write``):
    the float instructions of its PTX."""
    from specattn.data import DraftRunner
    from specattn.fp8 import FP8_KV_DTYPES
    from specattn.kernels import fp8_codes as F
    from specattn.kernels import kv_write as W

    capture = W._write_kv_kernel = Capture(W._write_kv_kernel)
    if model == "mla":
        runner = DraftRunner.mla(16, 512, 64, num_layers=1, num_slots=64, max_reqs=1,
                                 max_context_len=8, kv_cache_dtype=kv)
        k, v = torch.zeros(8, 576, dtype=torch.bfloat16), None
    else:
        runner = DraftRunner.mha(32, 8, 128, num_layers=1, num_slots=64, max_reqs=1,
                                 max_context_len=8, kv_cache_dtype=kv)
        k = v = torch.zeros(8, 8, 128, dtype=torch.bfloat16)
    cpu = torch.device("cpu")
    ks, kq = F.write_scale(torch.tensor([0.37]) if tensor_scales else 0.37, cpu)
    vs, vq = F.write_scale(torch.tensor([1.9]), cpu)
    codes = F.Codes(FP8_KV_DTYPES[kv] == torch.float8_e5m2, True, False)
    W.write_new_kv(runner, 0, torch.arange(8), k, v, fp8=W.Fp8Write(ks, vs, kq, vq, codes))
    (fn, _, args, kw), = capture.launches
    ptx = compile_launch(fn, args, kw).asm["ptx"]
    return dict(ops=sorted(set(re.findall(r"\b(?:fma|mul|div|add|sub)(?:\.\w+)*\.f32\b", ptx))),
                fp8_cvt=bool(re.search(r"e4m3x2|e5m2x2", ptx)))


@pytest.mark.parametrize("model,kv,tensor_scales,want", [
    ("mha", "fp8_e4m3", False, {"mul.rn.f32", "div.rn.f32", "add.rn.f32"}),  # K float, V tensor
    ("mla", "fp8_e5m2", True, {"div.rn.f32", "add.rn.f32"}),  # the latent's tensor k_scale
])
def test_fp8_kv_write_compiles_for_sm90(model, kv, tensor_scales, want):
    """The FP8 KV write's float arithmetic is torch's: a multiplication by the reciprocal
    (``mul.rn``: never contracted into an fma), the tensor scale's ``div.rn``, the subnormal
    rounding's ``add.rn``; no flush to zero and no hardware FP8 conversion (which
    saturates). Any Triton release (no Gluon)."""
    got = in_child(__file__, dict(write=True, model=model, kv=kv,
                                  tensor_scales=tensor_scales))
    print(got)
    assert set(got["ops"]) == want and not got["fp8_cvt"], got


if __name__ == "__main__":
    case = json.loads(sys.argv[1])
    if case.pop("write", False):
        print(json.dumps(compile_write_case(**case)))
    else:
        print(json.dumps(compile_case(**case)))
