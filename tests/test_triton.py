"""Triton backend on the CPU interpreter (TRITON_INTERPRET=1, set by conftest) vs torch_ref.

Tiny shapes (the interpreter is slow): B = 2, L <= 40, head dim 16/32, MLA rank 32 + rope 16.
Scratch buffers are NaN-poisoned before every call, so an unwritten partial shows up.

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``); this file keeps the ones specific to Triton: the
``mode``, ``plan``, ``num_splits``, ``max_extend_len`` and ``pdl`` options, every ``tl.dot``
plan and its KV write, the plan table and split planning, an empty prefix, NaN keys in
extend; FP8 pools on the default plans (fp16 dots under a bf16 model, queries past fp16's
range included) and ``tiles.widen`` over every FP8 code.
"""

from __future__ import annotations

import pytest
import torch

from helpers import (DEV, close, decode_sizes, place_decode_round, place_extend_round,
                     randomize_pools, require_triton_interpret)
from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.data import AttentionLayer, DraftRunner
from specattn.errors import InvalidInputError

require_triton_interpret()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from specattn.backends.triton import TritonDecode, TritonExtend, launchers, plans  # noqa: E402
from specattn.kernels.tiles import widen  # noqa: E402


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    close(out, ref, dtype, "NaN in the output (unwritten partial?)")


def make_runner(model: str, dtype, *, page: int, num_slots: int, max_reqs: int,
                max_ctx: int) -> DraftRunner:
    if model == "mha":
        runner = DraftRunner.mha(4, 2, 32, num_layers=2, num_slots=num_slots,
                                 max_reqs=max_reqs, max_context_len=max_ctx, page_size=page,
                                 dtype=dtype, device=DEV)
    else:
        runner = DraftRunner.mla(4, 32, 16, num_layers=2, num_slots=num_slots,
                                 max_reqs=max_reqs, max_context_len=max_ctx, page_size=page,
                                 dtype=dtype, device=DEV)
    return randomize_pools(runner)


def make_decode(model, dtype, *, topk, steps, page, seq_lens, tree_mode="lane"):
    num_slots, max_ctx = decode_sizes(seq_lens, topk, steps, page)
    runner = make_runner(model, dtype, page=page, num_slots=num_slots,
                         max_reqs=len(seq_lens) + 3, max_ctx=max_ctx)
    return runner, place_decode_round(runner, seq_lens, topk, steps, page, tree_mode)


def new_qkv(runner: DraftRunner, rows: int, dtype):
    if runner.use_mla_backend:
        w = runner.kv_lora_rank + runner.qk_rope_head_dim
        return (torch.randn(rows, runner.num_heads, w, device=DEV).to(dtype),
                torch.randn(rows, w, device=DEV).to(dtype), None)
    return (torch.randn(rows, runner.num_q_heads, runner.head_dim, device=DEV).to(dtype),
            torch.randn(rows, runner.num_kv_heads, runner.head_dim, device=DEV).to(dtype),
            torch.randn(rows, runner.num_kv_heads, runner.v_head_dim, device=DEV).to(dtype))


def _poison(backend) -> None:
    backend._active.mid_o.fill_(float("nan"))
    backend._active.mid_lse.fill_(float("nan"))


def run_decode_round(runner, batch, backend, dtype, layer, tree_mode, q_mul=1.0):
    bs, topk, steps = batch.out_cache_loc.shape
    backend.init_forward_metadata(batch)
    for step in range(steps):
        if tree_mode == "path" and step > 0:
            batch.parents[step] = torch.randint(0, topk, (bs, topk), device=DEV)
        q, k, v = new_qkv(runner, bs * topk, dtype)
        q = (q.float() * q_mul).to(dtype)
        _poison(backend)
        out = backend.forward(step, layer, q, k, v)
        ref = reference_decode(runner, layer, q, batch, step, tree_mode)
        assert out.shape == ref.shape
        _close(out, ref, dtype)


PER_BRANCH_CASES = [
    # model, dtype, topk, page, tree_mode, seq_lens (the default mode="shared" is the kit's)
    ("mha", torch.bfloat16, 4, 16, "lane", [24, 24]),
    ("mha", torch.float16, 4, 1, "path", [9, 40]),
    ("mla", torch.bfloat16, 4, 16, "lane", [29, 11]),
]


@pytest.mark.parametrize("model,dtype,topk,page,tree_mode,seq_lens", PER_BRANCH_CASES)
def test_per_branch_decode_matches_reference(model, dtype, topk, page, tree_mode, seq_lens):
    runner, batch = make_decode(model, dtype, topk=topk, steps=3, page=page,
                                seq_lens=seq_lens, tree_mode=tree_mode)
    backend = TritonDecode(runner, topk, 3, tree_mode=tree_mode, mode="per-branch")
    layer = AttentionLayer(layer_id=1, scaling=runner.head_dim ** -0.5)
    run_decode_round(runner, batch, backend, dtype, layer, tree_mode)


MLA_PLAN_CASES = [
    # topk, tree_mode, seq_lens, heads: the tl.dot MLA plan forced below its 64 rows, and
    # with 8 x 16 = 128 rows (two row blocks; the tail walked by the last split)
    (8, "path", [23, 40], 4),
    (4, "lane", [40, 9], 4),
    (8, "lane", [31, 0], 16),
]


@pytest.mark.parametrize("topk,tree_mode,seq_lens,heads", MLA_PLAN_CASES)
def test_dot_mla_plan(topk, tree_mode, seq_lens, heads):
    num_slots, max_ctx = decode_sizes(seq_lens, topk, 3, 1)
    runner = randomize_pools(DraftRunner.mla(heads, 32, 16, num_layers=2, num_slots=num_slots,
                                             max_reqs=4, max_context_len=max_ctx,
                                             dtype=torch.bfloat16, device=DEV))
    batch = place_decode_round(runner, seq_lens, topk, 3, 1, tree_mode)
    backend = TritonDecode(runner, topk, 3, tree_mode=tree_mode, plan="dot-mla")
    assert backend.plan.name == "dot-mla"
    run_decode_round(runner, batch, backend, torch.bfloat16,
                     AttentionLayer(layer_id=0, scaling=0.15), tree_mode)


def _runner_for(shape: plans.AttnShape, dtype=torch.bfloat16, kv: str = "auto") -> DraftRunner:
    if shape.v_is_k:
        return DraftRunner.mla(shape.num_q_heads, shape.d_main, shape.d_pe, num_layers=1,
                               num_slots=8, max_reqs=2, max_context_len=8, dtype=dtype,
                               device=DEV, kv_cache_dtype=kv)
    return DraftRunner.mha(shape.num_q_heads, shape.num_kv_heads, shape.d_main, num_layers=1,
                           num_slots=8, max_reqs=2, max_context_len=8, dtype=dtype, device=DEV,
                           kv_cache_dtype=kv)


MLA = plans.AttnShape(16, 1, 512, 64, 512, True)
GQA = plans.AttnShape(32, 8, 128, 0, 128, False)


@pytest.mark.parametrize("shape,job,rows,name", [
    (MLA, "decode", 64, "dot-mla"),      # off sm90 (the interpreter): the tl.dot MLA kernel
    (MLA, "decode", 16, "dot-wide"),     # below one 64-row tile
    (MLA, "extend", 96, "dot-mla"),
    (MLA, "per-branch", 16, "dot-wide"),
    (GQA, "decode", 32, "dot"),
    (GQA, "extend", 16, "dot"),
    (GQA, "per-branch", 4, "dot"),
    (GQA, "extend", 24, "dot"),
    (plans.AttnShape(8, 2, 256, 0, 256, False), "decode", 16, "dot-d256"),
    (plans.AttnShape(8, 2, 512, 0, 512, False), "decode", 16, "dot-wide"),
])
def test_plan_table(shape, job, rows, name):
    assert plans.choose_plan(_runner_for(shape), job, rows, True).name == name


def test_few_request_plans(monkeypatch):
    """While a round's groups (requests x KV heads) are at most the SMs, GQA decode takes
    dot-m16 up to 16 rows and dot-m32 up to 32, extend of 17-32 rows dot-extend and FP8
    decode up to 16 rows dot-fp8-m16; more requests, more rows, an extend of 16 rows or
    fewer and FP8 extend keep dot / dot-fp8."""
    monkeypatch.setattr(plans, "sms", lambda device: 132)
    runner, fp8 = _runner_for(GQA), _runner_for(GQA, kv="fp8_e4m3")
    few, many = 16, 17  # x 8 KV heads: 128 and 136 groups on 132 SMs
    for job, rows, name in [("decode", 16, "dot-m16"), ("decode", 17, "dot-m32"),
                            ("decode", 32, "dot-m32"), ("decode", 33, "dot"),
                            ("extend", 16, "dot"), ("extend", 24, "dot-extend"),
                            ("extend", 32, "dot-extend"), ("extend", 40, "dot"),
                            ("per-branch", 4, "dot")]:
        assert plans.choose_plan(runner, job, rows, True, requests=few).name == name
        assert plans.choose_plan(runner, job, rows, True, requests=many).name == "dot"
    for job, rows, name in [("decode", 16, "dot-fp8-m16"), ("decode", 32, "dot-fp8"),
                            ("extend", 16, "dot-fp8")]:
        assert plans.choose_plan(fp8, job, rows, True, requests=few).name == name
        assert plans.choose_plan(fp8, job, rows, True, requests=many).name == "dot-fp8"
    assert TritonDecode(runner, 4, 2).plan_for(32).name == "dot"
    assert TritonDecode(runner, 4, 2).plan_for(8).name == "dot-m16"
    assert TritonDecode(runner, 8, 2).plan_for(8).name == "dot-m32"


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shape,job,rows,name", [
    (GQA, "decode", 32, "dot-fp8"),  # 128-key tiles: the bytes of bf16's 64
    (GQA, "extend", 24, "dot-fp8"),
    (GQA, "per-branch", 4, "dot-fp8"),
    (MLA, "decode", 64, "dot-mla"),
    (MLA, "extend", 96, "dot-mla"),
    (MLA, "decode", 16, "dot-wide"),
    (plans.AttnShape(8, 2, 256, 0, 256, False), "decode", 16, "dot-d256"),
])
def test_plan_table_of_fp8_pools(kv, shape, job, rows, name):
    assert plans.choose_plan(_runner_for(shape, kv=kv), job, rows, True).name == name


def test_plan_tiles_and_splits():
    """Fewer rows take a smaller tile (4 warps at <= 32 rows); the wgmma plans one wave, the
    tl.dot split-KV plan 4 programs per SM in decode and 2 in extend over many requests, one
    wave over few; split-KV adds a tail partial."""
    dot, mla = plans.PLANS["dot"], plans.PLANS["dot-mla"]
    assert dot.tile(4) == (16, 4) and dot.tile(32) == (32, 4) and dot.tile(33) == (64, 8)
    assert plans.PLANS["dot-wide"].tile(128) == (32, 4) and mla.tile(16) == (64, 8)
    assert launchers.num_parts(mla, 4) == 4 and launchers.num_parts(dot, 4) == 5
    cpu = torch.device("cpu")  # 4 "SMs" on the interpreter
    assert launchers.plan_splits(mla, MLA, 64, 3, cpu, extend=False, rows=12) == 1
    assert launchers.plan_splits(mla, MLA, 64, 1, cpu, extend=False, rows=4) == 4
    assert launchers.plan_splits(dot, GQA, 32, 1, cpu, extend=False, rows=4) == 2  # 16 / 8 heads
    assert launchers.plan_splits(dot, GQA, 32, 1, cpu, extend=True, rows=4) == 1


def test_partials_are_half_width_in_the_work_list_plan_only():
    """gluon-wl's partials take a bf16 / fp16 query's dtype, a view of the bytes of the fixed
    fp32 buffer (no copy, no new buffer); fp32 queries and every other plan keep fp32."""
    wl = plans.PLANS["gluon-wl"]
    for dtype in (torch.bfloat16, torch.float16):
        assert launchers.partial_dtype(wl, dtype) is dtype
        for name in ("dot", "dot-mla", "gluon-split", "cute"):
            assert launchers.partial_dtype(plans.PLANS[name], dtype) is torch.float32
    assert launchers.partial_dtype(wl, torch.float32) is torch.float32
    flat_o, flat_lse = torch.zeros(48), torch.zeros(10)
    o, lse = launchers.partial_views((2, 3), 8, flat_o.device, flat_o, flat_lse, torch.bfloat16)
    assert o.shape == (2, 3, 8) and o.dtype is torch.bfloat16 and lse.dtype is torch.float32
    assert o.untyped_storage().data_ptr() == flat_o.untyped_storage().data_ptr()
    o32, _ = launchers.partial_views((2, 3), 8, flat_o.device, flat_o, flat_lse)
    assert o32.dtype is torch.float32 and o32.data_ptr() == flat_o.data_ptr()
    # A buffer too small for the fp32 count gets fresh buffers, in the dtype asked for.
    o, _ = launchers.partial_views((4, 4), 8, flat_o.device, flat_o, flat_lse, torch.float16)
    assert o.dtype is torch.float16 and o.untyped_storage().data_ptr() != \
        flat_o.untyped_storage().data_ptr()


def test_split_cap_gives_a_lone_request_the_whole_gpu(monkeypatch):
    """One request (few rows) may take up to DOT_MAX_SPLITS splits of the tl.dot kernel,
    within what the partial buffers hold; many rows keep MAX_SPLITS; the sm90 kernels keep
    MAX_SPLITS but cute, whose clusters of up to 8 splits write one part each; a forced
    num_splits above the cap is one short error."""
    dot, cute = plans.PLANS["dot"], plans.PLANS["cute"]
    assert launchers.split_cap(dot, 4) == plans.DOT_MAX_SPLITS
    assert launchers.split_cap(dot, 8) == 50  # 24 x 17 // 8 parts, less the tail's
    assert launchers.split_cap(dot, 256) == 16
    assert launchers.split_cap(cute, 4) == 8 * 102 and launchers.split_cap(cute, 256) == 8 * 17
    assert launchers.split_cap(plans.PLANS["gluon-split"], 4) == plans.MAX_SPLITS
    # gluon-wl's partials follow its work list: any row count may force up to DOT_MAX_SPLITS
    assert launchers.split_cap(plans.PLANS["gluon-wl"], 256) == plans.DOT_MAX_SPLITS
    for rows in (1, 3, 4, 8, 15, 16, 17, 100):  # the parts always fit the buffer
        parts = launchers.num_parts(dot, launchers.split_cap(dot, rows))
        assert rows * parts <= max(rows, plans.PARTIAL_ROWS) * (plans.MAX_SPLITS + 1)

    monkeypatch.setattr(plans, "sms", lambda device: 132)  # an H200
    h200 = torch.device("cpu")
    # One request, 8 KV heads, 16-row tiles (dot: 3 programs per SM): 49 splits fill one
    # wave of 396 slots; dot-m16 (5 per SM): 64 (the cap) make 512 of 660, 8 requests 10
    # splits. 32 requests (256 groups, more than the SMs): about 4 programs per SM, 3 splits.
    assert launchers.plan_splits(dot, GQA, 16, 1, h200, extend=False, rows=4) == 49
    m16 = plans.PLANS["dot-m16"]
    assert launchers.plan_splits(m16, GQA, 16, 1, h200, extend=False, rows=4) == 64
    assert launchers.plan_splits(m16, GQA, 16, 8, h200, extend=False, rows=32) == 10
    assert launchers.plan_splits(dot, GQA, 16, 32, h200, extend=False, rows=128) == 3
    assert launchers.plan_splits(dot, GQA, 32, 1, h200, extend=False, rows=8) == 33  # 2 per SM
    # Extend of 6 tokens (24 rows, 2 per SM): 8 requests' 64 groups fill one wave in 4
    # splits (5, about 2 programs per SM, left 1.2 waves); 32 requests take about 2 per SM.
    assert launchers.plan_splits(dot, GQA, 24, 8, h200, extend=True, rows=48) == 4
    assert launchers.plan_splits(dot, GQA, 24, 1, h200, extend=True, rows=6) == 33
    assert launchers.plan_splits(dot, GQA, 24, 32, h200, extend=True, rows=192) == 2
    fp8 = plans.PLANS["dot-fp8"]
    assert launchers.plan_splits(fp8, GQA, 16, 1, h200, extend=False, rows=4, kv_bytes=1) == 33
    # The five-stage few-request plans: dot-m32 and dot-extend 2 programs per SM at 32 rows,
    # dot-fp8-m16 3 at 16.
    for name, rows, extend, kv_bytes, splits in [("dot-m32", 32, False, 2, 33),
                                                 ("dot-extend", 24, True, 2, 33),
                                                 ("dot-fp8-m16", 16, False, 1, 49)]:
        assert launchers.plan_splits(plans.PLANS[name], GQA, rows, 1, h200, extend=extend,
                                     rows=rows // 4, kv_bytes=kv_bytes) == splits
    # dot-fp8 fills one wave wherever it fits one: 32 requests (256 of 264 slots) in 1 split,
    # where dot takes 3; 40 requests (320 programs) do not fit: about 4 per SM.
    assert launchers.plan_splits(fp8, GQA, 32, 32, h200, extend=False, rows=256,
                                 kv_bytes=1) == 1
    assert launchers.plan_splits(dot, GQA, 32, 32, h200, extend=False, rows=256) == 3
    assert launchers.plan_splits(fp8, GQA, 32, 40, h200, extend=False, rows=320,
                                 kv_bytes=1) == 2
    runner = _runner_for(GQA, torch.float32)
    with pytest.raises(InvalidInputError, match=r"num_splits.*at most 50 with plan dot-m16 for 8"):
        b = TritonDecode(runner, 4, 2, num_splits=60)
        b._make_plan(2)
    with pytest.raises(InvalidInputError, match=r"num_splits.*\[1, 256\]"):
        TritonDecode(runner, 4, 2, num_splits=257)


def test_dot_mla_split_cap_fills_the_gpu_from_one_request(monkeypatch):
    """dot-mla (one partial per split, no tail part) takes the split-KV kernel's room rule: one
    MLA request of 16 heads at 32k gets 64 splits in decode (K = 4: one 64-row tile) and in
    extend (E = 6: two row tiles, 128 programs), where MAX_SPLITS gave 16 and 32 programs;
    the parts always fit the partial buffers."""
    mla = plans.PLANS["dot-mla"]
    assert launchers.split_cap(mla, 4) == plans.DOT_MAX_SPLITS
    assert launchers.split_cap(mla, 6) == 64 and launchers.split_cap(mla, 256) == 17
    for rows in (1, 3, 4, 6, 8, 15, 16, 17, 100):
        parts = launchers.num_parts(mla, launchers.split_cap(mla, rows))
        assert rows * parts <= max(rows, plans.PARTIAL_ROWS) * (plans.MAX_SPLITS + 1)

    monkeypatch.setattr(plans, "sms", lambda device: 132)  # an H200
    h200 = torch.device("cpu")
    assert launchers.plan_splits(mla, MLA, 4 * 16, 1, h200, extend=False, rows=4) == 64
    assert launchers.plan_splits(mla, MLA, 6 * 16, 1, h200, extend=True, rows=6) == 64
    assert launchers.plan_splits(mla, MLA, 4 * 16, 32, h200, extend=False, rows=128) == 4


@pytest.mark.parametrize("job", ["decode", "extend"])
def test_dot_mla_many_splits_match_reference(job):
    """One MLA request on dot-mla with 24 forced splits (above MAX_SPLITS) of a 1536-key
    prefix (64 keys a split: every split holds keys), NaN-poisoned partials: the reference's
    numbers."""
    seq_lens = [1536 if job == "decode" else 1539]
    if job == "decode":
        runner, batch = make_decode("mla", torch.float32, topk=2, steps=2, page=16,
                                    seq_lens=seq_lens)
        backend = TritonDecode(runner, 2, 2, plan="dot-mla", num_splits=24)
        run_decode_round(runner, batch, backend, torch.float32,
                         AttentionLayer(layer_id=0, scaling=0.15), "lane")
    else:
        runner, batch = make_extend("mla", torch.float32, page=16, seq_lens=seq_lens,
                                    ext_lens=[3])
        backend = TritonExtend(runner, plan="dot-mla", num_splits=24)
        layer = AttentionLayer(layer_id=1, scaling=0.15)
        backend.init_forward_metadata(batch)
        q, k, v = new_qkv(runner, 3, torch.float32)
        _poison(backend)
        _close(backend.forward(layer, q, k, v), reference_extend(runner, layer, q, batch),
               torch.float32)
    prefix_len, split_len = backend._active.meta[0, 1:3].tolist()
    assert backend._round_plan["num_splits"] == 24 and (prefix_len, split_len) == (1536, 64)


@pytest.mark.parametrize("cls,args", [(TritonDecode, (2, 2)), (TritonExtend, ())])
def test_pdl_is_refused_off_sm90(cls, args):
    """pdl=True needs CUDA sm90+: under the interpreter (or on a CPU) one short error names
    the argument, what it expects and the value; pdl takes booleans or None (the default:
    on where it runs, so off here)."""
    runner = _runner_for(GQA, torch.float32)
    with pytest.raises(InvalidInputError, match=r"^pdl: expected False or None here \(programmatic "
                       r"dependent launch needs CUDA sm90\+; this is the Triton interpreter "
                       r"\(TRITON_INTERPRET\)\), got True$"):
        cls(runner, *args, pdl=True)
    with pytest.raises(InvalidInputError, match=r"^pdl: expected True, False or None, got "
                       r"'yes'$"):
        cls(runner, *args, pdl="yes")
    assert cls(runner, *args, pdl=False)._pdl is False
    assert cls(runner, *args)._pdl is False
    assert plans.pdl_reason(torch.device("cpu"), False) == "a cpu device"


class _Recorded:
    """Stands for a kernel: ``kernel[grid](*args, **kw)`` records its keywords, runs nothing
    (``kws``: every launch's keywords)."""

    def __init__(self, name: str, log: list, kws: list):
        self.name, self.log, self.kws = name, log, kws

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.kws.append(kw)
            self.log.append((self.name, kw.get("PDL", False), kw.get("launch_pdl", False)))
        return launch


def _recorded_launches(monkeypatch, model: str, plan: str, kv_cache_dtype: str = "auto",
                       dtype=torch.float32, kws=None, decode: bool = False):
    """One ``launchers.attention`` call with ``pdl=True`` (one request: 3 new tokens, or
    with ``decode`` 3 lanes at step 1 of 2; 2 splits), the Triton kernels recorded:
    ``[(kernel, PDL, launch_pdl)]`` in launch order (their keywords appended to ``kws``)."""
    from specattn.backends.triton import _attn_kernels
    from specattn.kernels import kv_write, merge

    log: list = []
    kws = [] if kws is None else kws
    for module, name in ((kv_write, "_write_kv_kernel"),
                         (_attn_kernels, "_partial_attn_kernel"),
                         (_attn_kernels, "_mla_partial_kernel"), (merge, "merge_kernel")):
        monkeypatch.setattr(module, name, _Recorded(name, log, kws))
    make = DraftRunner.mla if model == "mla" else DraftRunner.mha
    heads = (4, 32, 16) if model == "mla" else (4, 2, 32)
    runner = make(*heads, num_layers=1, num_slots=64, max_reqs=2, max_context_len=32,
                  dtype=dtype, device=DEV, kv_cache_dtype=kv_cache_dtype)
    shape = plans.AttnShape.of(runner)
    q, k, v = new_qkv(runner, 3, dtype)
    mid_o, mid_lse = launchers.partial_views((3, shape.num_q_heads, 3), shape.d_v, q.device,
                                             None, None)
    meta = torch.zeros(2, 5, dtype=torch.int32)
    steps = 2 if decode else 1
    launchers.attention(q, runner, AttentionLayer(layer_id=0, scaling=0.1), shape, meta,
                        runner.req_to_token, mode=0 if decode else 2, num_groups=1,
                        rows_per_group=3 * shape.group, lanes_per_group=3 if decode else 1,
                        topk=3 if decode else 1, num_steps=steps, step=steps - 1,
                        num_splits=2, plan=plans.PLANS[plan], mid_o=mid_o, mid_lse=mid_lse,
                        hist=torch.arange(3 * steps, dtype=torch.int32).view(3, steps),
                        new_kv=(k, v), pdl=True)
    return log


@pytest.mark.parametrize("model,plan,kv,launches", [
    # The split-KV kernel is a dependent launch after the KV write, which releases it (a
    # round of many requests: more programs than SMs).
    ("mha", "dot", "auto", [("_write_kv_kernel", True, False),
                            ("_partial_attn_kernel", True, True), ("merge_kernel", True, True)]),
    # After torch's FP8 write (and the scales' copies): an ordinary launch that releases
    # the merge.
    ("mha", "dot", "fp8_e4m3", [("_partial_attn_kernel", True, False),
                                ("merge_kernel", True, True)]),
    # dot-mla reads what the launch before it wrote: an ordinary launch.
    ("mla", "dot-mla", "auto", [("_mla_partial_kernel", True, False),
                                ("merge_kernel", True, True)]),
])
def test_pdl_launches(monkeypatch, model, plan, kv, launches):
    """Which launches of a pdl=True call are programmatic dependent launches (launch_pdl)
    and which kernels wait for or release their neighbours (PDL)."""
    monkeypatch.setattr(plans, "sms", lambda device: 1)
    assert _recorded_launches(monkeypatch, model, plan, kv) == launches


def _kernel_fp8_write(monkeypatch) -> list:
    """``launchers.fp8_write`` as on CUDA (the KV write launch stores FP8 codes) with CPU
    torch's conversion flags and division (exact, for a Python number too); returns the
    list of its calls that served."""
    from specattn.kernels import fp8_codes as F
    from specattn.kernels.kv_write import Fp8Write

    served: list = []

    def fp8_write(runner, layer, new_kv, device):
        k = F.write_scale(layer.k_scale, device, F.QUANT_DIV)
        v = k if runner.use_mla_backend else F.write_scale(layer.v_scale, device, F.QUANT_DIV)
        served.append(layer.layer_id)
        return Fp8Write(k[0], v[0], k[1], v[1], F.torch_variant(
            device, launchers.layer_pools(runner, layer.layer_id)[0].dtype))

    monkeypatch.setattr(launchers, "fp8_write", fp8_write)
    return served


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("sms,launches", [
    # Few requests (one group x 2 KV heads, 4 SMs): the split-KV kernel's tail programs
    # store the new KV; the kernel is an ordinary launch that releases the merge.
    (4, [("_partial_attn_kernel", True, False), ("merge_kernel", True, True)]),
    # More programs than SMs: the KV write launch first, which releases the kernel.
    (1, [("_write_kv_kernel", True, False), ("_partial_attn_kernel", True, True),
         ("merge_kernel", True, True)]),
])
def test_decode_and_extend_tail_store_the_new_kv_in_few_request_rounds(monkeypatch, sms,
                                                                        launches, decode):
    """``launchers.tail_stores_kv``: a decode or extend round of few requests is two
    launches, one of many requests three."""
    monkeypatch.setattr(plans, "sms", lambda device: sms)
    kws: list = []
    assert _recorded_launches(monkeypatch, "mha", "dot", decode=decode, kws=kws) == launches
    assert kws[-2].get("NEW_KV", False) is (sms == 4)


@pytest.mark.parametrize("model,plan,launches", [
    # The KV write launch stores the codes and releases the split-KV kernel, as over bf16.
    ("mha", "dot", [("_write_kv_kernel", True, False), ("_partial_attn_kernel", True, True),
                    ("merge_kernel", True, True)]),
    ("mla", "dot-mla", [("_write_kv_kernel", True, False), ("_mla_partial_kernel", True, False),
                        ("merge_kernel", True, True)]),
])
def test_pdl_launches_after_the_fp8_write_launch(monkeypatch, model, plan, launches):
    """A round of many requests (more programs than SMs): the FP8 KV write launch first."""
    _kernel_fp8_write(monkeypatch)
    monkeypatch.setattr(plans, "sms", lambda device: 1)
    assert _recorded_launches(monkeypatch, model, plan, "fp8_e4m3") == launches


@pytest.mark.parametrize("kv,model,kind", [("fp8_e4m3", "mha", "decode"),
                                          ("fp8_e5m2", "mla", "extend")])
def test_kits_fp8_cases_with_the_fp8_write_launch(monkeypatch, kv, model, kind):
    """The conformance kit's FP8 cases (pools bit for bit against ``runner.write_kv``,
    scales changed between rounds) with the KV write launch storing the codes, as on CUDA
    (``_kernel_fp8_write``: CPU torch's division)."""
    from specattn.testing import check_backend

    served = _kernel_fp8_write(monkeypatch)
    report = check_backend("triton", device=DEV, kinds=(kind,), models=(model,),
                           select=f"kv-{kv}", raise_on_failure=False)
    assert report.ok and report.passed >= 2 and served, report


@pytest.mark.parametrize("decode,sms,tail", [(True, 4, True), (True, 1, False),
                                             (False, 4, True), (False, 1, False)])
def test_fp8_decode_tail_stores_the_codes_in_few_request_rounds(monkeypatch, decode, sms,
                                                                 tail):
    """Over FP8 pools whose codes the kernel gives (``fp8_write``), a decode round of few
    requests is two launches as over bf16: the tail programs store the codes (``NEW_KV``
    with ``FP8``, the write's scales and variant); many requests and extend keep the KV
    write launch."""
    _kernel_fp8_write(monkeypatch)
    monkeypatch.setattr(plans, "sms", lambda device: sms)
    kws: list = []
    log = _recorded_launches(monkeypatch, "mha", "dot", "fp8_e4m3", decode=decode, kws=kws)
    assert [name for name, *_ in log].count("_write_kv_kernel") == (0 if tail else 1)
    (kw,) = [kw for kw in kws if "D_PE" in kw]
    assert kw.get("NEW_KV", False) is tail and kw.get("FP8", False) is tail
    if tail:
        assert kw["K_QUANT"] == kw["V_QUANT"] == 2 and kw["E5M2"] is False


@pytest.mark.parametrize("kv,sms", [("fp8_e4m3", 32), ("fp8_e5m2", 32), ("fp8_e4m3", 1)])
def test_kits_fp8_decode_cases_with_the_tail_storing_the_codes(monkeypatch, kv, sms):
    """The kit's FP8 decode cases (pools bit for bit against ``runner.write_kv``, scales
    changed between rounds, graphs) where the tail programs store the codes (a round's
    programs fit 32 SMs) and where the KV write launch does (1 SM)."""
    from specattn.testing import check_backend

    served = _kernel_fp8_write(monkeypatch)
    monkeypatch.setattr(plans, "sms", lambda device: sms)
    report = check_backend("triton", device=DEV, kinds=("decode", "extend"), models=("mha",),
                           select=f"kv-{kv}", raise_on_failure=False)
    assert report.ok and report.passed >= 4 and served, report


def test_pdl_reaches_both_classes_as_a_bench_option():
    """``--option triton:pdl=True`` sets the keyword of the decode and the extend class."""
    from specattn.bench.options import check_options, parse_option
    from specattn.registry import default_registry

    opt = parse_option("triton:pdl=True,plan=dot")
    check_options([opt], default_registry)
    for cls in (TritonDecode, TritonExtend):
        assert opt.fits(cls) and opt.kwargs_for(cls) == {"pdl": True, "plan": "dot"}


@pytest.mark.parametrize("model,plan", [("mha", "dot"), ("mla", "dot-mla")])
@pytest.mark.parametrize("dtype,kv,q_f16", [
    (torch.bfloat16, "fp8_e4m3", True),
    (torch.bfloat16, "fp8_e5m2", True),
    (torch.float16, "fp8_e4m3", False),  # widen is the one conversion already
    (torch.bfloat16, "auto", False),
])
def test_q_f16_for_fp8_pools_under_bf16(monkeypatch, model, plan, dtype, kv, q_f16):
    """``Q_F16``: FP8 pools under a bf16 model, and only those."""
    kws: list = []
    _recorded_launches(monkeypatch, model, plan, kv, dtype, kws)
    (kw,) = [kw for kw in kws if "D_PE" in kw]  # the attention kernel's launch
    assert kw["Q_F16"] is q_f16


@pytest.mark.parametrize("kv,v_cvt", [("fp8_e4m3", True), ("fp8_e5m2", True), ("auto", False)])
def test_value_tiles_widen_by_ptx_over_fp8_pools_where_the_device_has_it(monkeypatch, kv,
                                                                        v_cvt):
    """``V_CVT`` (``tiles.cvt_args``): the split-KV kernel's FP8 value tiles widen by inline
    PTX on a CUDA sm89+ device, never on the interpreter (no PTX there) nor over bf16 pools."""
    from specattn.backends.triton import launchers
    from specattn.kernels import tiles

    assert tiles.cvt_args(torch.device("cpu")) is False
    kws: list = []
    _recorded_launches(monkeypatch, "mha", "dot", kv, torch.bfloat16, kws)
    (kw,) = [kw for kw in kws if "D_PE" in kw]
    assert kw["V_CVT"] is False  # the interpreter
    monkeypatch.setattr(launchers, "cvt_args", lambda device: True)  # as on an H200
    kws = []
    _recorded_launches(monkeypatch, "mha", "dot", kv, torch.bfloat16, kws)
    (kw,) = [kw for kw in kws if "D_PE" in kw]
    assert kw["V_CVT"] is v_cvt


def test_plan_errors_name_the_plan():
    runner = _runner_for(GQA, torch.float32)
    with pytest.raises(InvalidInputError, match=r"plan.*one of dot, dot-m16, dot-m32, dot-extend, dot-fp8, dot-fp8-m16, dot-d256.*'dotx'"):
        TritonDecode(runner, 2, 2, plan="dotx")
    with pytest.raises(InvalidInputError, match=r"plan.*dot-mla: an MLA latent"):
        TritonDecode(runner, 2, 2, plan="dot-mla")
    mla = _runner_for(MLA)
    with pytest.raises(InvalidInputError, match=r"plan.*gluon-wl: not a CUDA device"):
        TritonDecode(mla, 4, 2, plan="gluon-wl")
    with pytest.raises(InvalidInputError, match=r"plan.*cute: shared-prefix draft decode"):
        TritonExtend(mla, plan="cute")
    with pytest.raises(InvalidInputError, match=r"plan.*dot-m16: draft decode only"):
        TritonExtend(runner, plan="dot-m16")
    for name in plans.HEAD_DIM_128_PLANS:  # sized for head dim <= 128: MLA rows refused
        with pytest.raises(InvalidInputError, match=rf"plan.*{name}: MHA/GQA of head dim"):
            TritonDecode(mla, 4, 2, plan=name)
    wide = _runner_for(plans.AttnShape(8, 2, 256, 0, 256, False))
    with pytest.raises(InvalidInputError, match=r"plan.*dot-extend: MHA/GQA of head dim"):
        TritonExtend(wide, plan="dot-extend")
    TritonDecode(runner, 2, 2, plan="dot-m16")  # decode: served
    with pytest.raises(InvalidInputError, match="plan"):
        TritonDecode(runner, 2, 2, plan=3)
    for name, plan in plans.PLANS.items():
        assert plan.name == name and len(plans.Plan.__dataclass_fields__) <= 6


@pytest.mark.parametrize("num_splits", [1, 7, 64])  # 64: few rows (launchers.split_cap)
def test_decode_logit_cap_and_fixed_splits(num_splits):
    runner, batch = make_decode("mha", torch.float32, topk=2, steps=2, page=1,
                                seq_lens=[40, 3], tree_mode="path")
    backend = TritonDecode(runner, 2, 2, tree_mode="path", num_splits=num_splits)
    layer = AttentionLayer(layer_id=0, scaling=0.5, logit_cap=3.0)
    run_decode_round(runner, batch, backend, torch.float32, layer, "path")


def test_decode_zero_length_prefix():
    """seq_lens = 0: only the history contributes (every split of the prefix is empty)."""
    runner, batch = make_decode("mha", torch.float32, topk=2, steps=2, page=1,
                                seq_lens=[0, 19])
    backend = TritonDecode(runner, 2, 2)
    run_decode_round(runner, batch, backend, torch.float32,
                     AttentionLayer(layer_id=0, scaling=0.25), "lane")


def make_extend(model, dtype, *, page, seq_lens, ext_lens):
    bs = len(seq_lens)
    num_slots = sum(seq_lens) + 8
    runner = make_runner(model, dtype, page=page, num_slots=num_slots, max_reqs=bs + 2,
                         max_ctx=max(seq_lens) + page)
    return runner, place_extend_round(runner, seq_lens, ext_lens)


def test_extend_dot_mla_several_row_blocks():
    """fp16 MLA extend on the tl.dot MLA plan with two 64-row blocks (20 tokens x 4 heads)."""
    runner, batch = make_extend("mla", torch.float16, page=1, seq_lens=[36, 28],
                                ext_lens=[20, 2])
    backend = TritonExtend(runner, plan="dot-mla")
    layer = AttentionLayer(layer_id=1, scaling=0.2)
    backend.init_forward_metadata(batch)
    q, k, v = new_qkv(runner, 22, torch.float16)
    _poison(backend)
    out = backend.forward(layer, q, k, v)
    _close(out, reference_extend(runner, layer, q, batch), torch.float16)


@pytest.mark.parametrize("ext_lens", [[3, 3, 3], [1, 3, 2]])
def test_extend_graph_grid_bounded_by_max_extend_len(ext_lens):
    """``max_extend_len`` sizes the graph grid for at most that many rows per request (the
    fixed ``S + 1`` slots of semantics.md): same result as the reference, fewer row blocks."""
    runner, batch = make_extend("mha", torch.float32, page=4, seq_lens=[20, 9, 13],
                                ext_lens=ext_lens)
    n = sum(ext_lens)
    loose, tight = TritonExtend(runner), TritonExtend(runner, max_extend_len=3)
    for backend in (loose, tight):
        backend.init_cuda_graph_state(max_bs=3, max_num_tokens=n)
        backend.init_forward_metadata_capture_cuda_graph(batch)
    assert tight._round_plan["rows_per_group"] < loose._round_plan["rows_per_group"]
    layer = AttentionLayer(layer_id=0, scaling=0.2)
    q, k, v = new_qkv(runner, n, torch.float32)
    _poison(tight)
    _close(tight.forward(layer, q, k, v), reference_extend(runner, layer, q, batch),
           torch.float32)


def test_extend_max_extend_len_is_checked():
    runner, batch = make_extend("mha", torch.float32, page=1, seq_lens=[20, 9], ext_lens=[4, 1])
    backend = TritonExtend(runner, max_extend_len=3)
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=5)
    with pytest.raises(InvalidInputError, match=r"batch.extend_lens.*max_extend_len=3.*4"):
        backend.init_forward_metadata_capture_cuda_graph(batch)
    for bad in (0, True):  # True is no bound (it would cap every request at one token)
        with pytest.raises(InvalidInputError, match="max_extend_len"):
            TritonExtend(runner, max_extend_len=bad)


def test_bad_mode_and_order():
    runner, batch = make_decode("mha", torch.float32, topk=1, steps=1, page=1, seq_lens=[4])
    with pytest.raises(InvalidInputError, match="mode"):
        TritonDecode(runner, 1, 1, mode="cascade")
    backend = TritonDecode(runner, 1, 1)
    with pytest.raises(InvalidInputError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_replay_cuda_graph(batch, 1)


def _check_pool(runner, layer_id: int, slots: torch.Tensor, k, v) -> None:
    """After a forward: the new KV is in the pool at its slots, bit for bit."""
    slots = slots.reshape(-1).long()
    if runner.use_mla_backend:
        torch.testing.assert_close(runner.kv_buffer[layer_id][slots], k, rtol=0, atol=0)
    else:
        torch.testing.assert_close(runner.k_buffer[layer_id][slots], k, rtol=0, atol=0)
        torch.testing.assert_close(runner.v_buffer[layer_id][slots], v, rtol=0, atol=0)


DOT_PLAN_CASES = [
    # model, topk, tree_mode, mode, plan: each tl.dot plan and its KV write (one launch before
    # the split-KV kernel; the MLA kernel's first split); MLA topk 8 = 32 rows
    ("mha", 4, "path", "shared", "dot"),
    ("mha", 4, "lane", "shared", "dot-m16"),
    ("mha", 8, "path", "shared", "dot-m32"),
    ("mha", 4, "lane", "shared", "dot-extend"),
    ("mha", 2, "lane", "per-branch", "dot"),
    ("mha", 4, "lane", "shared", "dot-d256"),
    ("mha", 4, "path", "shared", "dot-wide"),
    ("mla", 8, "lane", "shared", "dot-wide"),
    ("mla", 8, "path", "shared", "dot-mla"),
    ("mla", 2, "lane", "per-branch", "dot-mla"),
]


@pytest.mark.parametrize("model,topk,tree_mode,mode,plan", DOT_PLAN_CASES)
def test_dot_plans_write_and_attend(model, topk, tree_mode, mode, plan):
    dtype, steps = torch.bfloat16, 3
    runner, batch = make_decode(model, dtype, topk=topk, steps=steps, page=4,
                                seq_lens=[26, 37], tree_mode=tree_mode)
    backend = TritonDecode(runner, topk, steps, tree_mode=tree_mode, mode=mode, plan=plan,
                           num_splits=3)
    layer = AttentionLayer(layer_id=1, scaling=0.2)
    backend.init_forward_metadata(batch)
    for step in range(steps):
        if tree_mode == "path" and step > 0:
            batch.parents[step] = torch.randint(0, topk, (2, topk), device=DEV)
        q, k, v = new_qkv(runner, 2 * topk, dtype)
        _poison(backend)
        out = backend.forward(step, layer, q, k, v)
        _close(out, reference_decode(runner, layer, q, batch, step, tree_mode), dtype)
        _check_pool(runner, 1, batch.out_cache_loc[:, :, step], k, v)


@pytest.mark.parametrize("model,plan", [("mha", "dot"), ("mha", "dot-extend"), ("mha", "dot-m32"),
                                        ("mha", "dot-wide"), ("mla", "dot-wide"),
                                        ("mla", "dot-mla")])
def test_extend_dot_plans_write_and_attend(model, plan):
    runner, batch = make_extend(model, torch.bfloat16, page=1, seq_lens=[30, 19],
                                ext_lens=[6, 3])
    backend = TritonExtend(runner, plan=plan)
    layer = AttentionLayer(layer_id=0, scaling=0.2)
    backend.init_forward_metadata(batch)
    q, k, v = new_qkv(runner, 9, torch.bfloat16)
    _poison(backend)
    out = backend.forward(layer, q, k, v)
    _close(out, reference_extend(runner, layer, q, batch), torch.bfloat16)
    _check_pool(runner, 0, batch.out_cache_loc, k, v)


class _SplitKvLaunches:
    """Stands for ``_partial_attn_kernel``: runs it, and counts its launches with and without
    ``NEW_KV`` (``new_kv`` / ``plain``)."""

    def __init__(self, kernel):
        self.kernel, self.new_kv, self.plain = kernel, 0, 0

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if kw.get("NEW_KV", False):
                self.new_kv += 1
            else:
                self.plain += 1
            return self.kernel[grid](*args, **kw)
        return launch


def _count_split_kv_launches(monkeypatch) -> _SplitKvLaunches:
    from specattn.backends.triton import _attn_kernels

    counted = _SplitKvLaunches(_attn_kernels._partial_attn_kernel)
    monkeypatch.setattr(_attn_kernels, "_partial_attn_kernel", counted)
    return counted


@pytest.mark.parametrize("q_heads", [4, 6])  # GQA group 2, and 3: tokens straddling blocks
def test_extend_tail_stores_the_new_kv_of_every_row_block(monkeypatch, q_heads):
    """A few-request extend whose tail programs store the new KV (``NEW_KV``): request 0's 80
    new tokens span 3-4 row blocks of 64 rows (each block stores its own tokens; with group 3
    tokens 21 and 42 straddle two blocks, stored by both), request 1 has 5; ragged prefixes,
    3 prefix splits. The output (NaN-poisoned, as the partials) is the reference's, and the
    pools afterwards hold exactly the new K/V at the new tokens' slots, nothing else
    changed."""
    dtype, seq_lens, ext_lens = torch.bfloat16, [150 + 80, 37 + 5], [80, 5]
    runner = randomize_pools(DraftRunner.mha(
        q_heads, 2, 32, num_layers=2, num_slots=sum(seq_lens) + 8, max_reqs=4,
        max_context_len=max(seq_lens) + 1, dtype=dtype, device=DEV))
    batch = place_extend_round(runner, seq_lens, ext_lens)
    monkeypatch.setattr(plans, "few_groups", lambda groups, device: True)
    counted = _count_split_kv_launches(monkeypatch)
    writes: list = []
    monkeypatch.setattr(launchers, "write_new_kv", lambda *a, **kw: writes.append(a))
    merge = launchers.merge_partials

    def poisoned_merge(mid_o, mid_lse, out, *args, **kw):
        out.fill_(float("nan"))
        return merge(mid_o, mid_lse, out, *args, **kw)

    monkeypatch.setattr(launchers, "merge_partials", poisoned_merge)
    backend = TritonExtend(runner, num_splits=3)
    layer = AttentionLayer(layer_id=1, scaling=0.2)
    backend.init_forward_metadata(batch)
    assert backend._round_plan["rows_per_group"] == 80 * (q_heads // 2)
    assert backend._round_plan["plan"].tile(80 * (q_heads // 2))[0] == 64
    q, k, v = new_qkv(runner, sum(ext_lens), dtype)
    before = [p.clone() for p in runner.k_buffer + runner.v_buffer]
    _poison(backend)
    out = backend.forward(layer, q, k, v)
    assert (counted.new_kv, counted.plain, writes) == (1, 0, [])
    slots = batch.out_cache_loc.long()
    assert slots.unique().numel() == slots.numel()
    want = [p.clone() for p in before]
    want[1][slots], want[3][slots] = k, v  # layer 1's k and v pools
    for i, (got, exp) in enumerate(zip(runner.k_buffer + runner.v_buffer, want)):
        differ = (got.view(torch.int16) != exp.view(torch.int16)).flatten(1).any(1)
        assert not differ.any(), (i, differ.nonzero().flatten().tolist())
    _close(out, reference_extend(runner, layer, q, batch), dtype)  # reads the pools


def test_kits_mha_extend_cases_with_the_tail_storing_every_round(monkeypatch):
    """The conformance kit's MHA extend cases (ragged rounds against the reference, graph
    rounds with padding, the engines' fused / strided / shared-buffer inputs, isolation)
    with the split-KV kernel's tail programs storing the new KV in every round whose pools
    take the new rows' dtype (``tail_stores_kv`` judged as if every round had few requests;
    FP8 pools keep the write launch)."""
    from specattn.testing import check_backend

    tail_stores_kv = launchers.tail_stores_kv
    monkeypatch.setattr(launchers, "tail_stores_kv", lambda kb, vb, new_kv, programs, device:
                        tail_stores_kv(kb, vb, new_kv, 0, device))
    counted = _count_split_kv_launches(monkeypatch)
    report = check_backend("triton", device=DEV, kinds=("extend",), models=("mha",),
                           raise_on_failure=False)
    assert report.ok and report.passed >= 2, report
    assert counted.new_kv >= 10, (counted.new_kv, counted.plain)


@pytest.mark.parametrize("model,plan", [("mha", "dot"), ("mla", "dot-wide"),
                                        ("mla", "dot-mla")])
def test_extend_nan_key_reaches_exactly_its_rows(model, plan):
    """A NaN new key and value (request 0's third token) makes exactly the rows that attend
    to it NaN, as exact attention does: that token's and the later ones of its request; the
    earlier tokens and the other request stay equal to the reference."""
    runner, batch = make_extend(model, torch.float32, page=1, seq_lens=[30, 19],
                                ext_lens=[6, 3])
    backend = TritonExtend(runner, plan=plan)
    layer = AttentionLayer(layer_id=0, scaling=0.2)
    backend.init_forward_metadata(batch)
    q, k, v = new_qkv(runner, 9, torch.float32)
    k[2] = float("nan")
    if v is not None:
        v[2] = float("nan")
    out = backend.forward(layer, q, k, v)
    ref = reference_extend(runner, layer, q, batch)
    bad = ~torch.isfinite(ref).reshape(9, -1).all(-1)
    assert bad.tolist() == [False, False, True, True, True, True, False, False, False]
    assert (~torch.isfinite(out[bad].reshape(int(bad.sum()), -1))).any(-1).all()
    _close(out[~bad], ref[~bad], torch.float32)


# --- FP8 pools ---------------------------------------------------------------------------------

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _widen_kernel(X, Y, N: tl.constexpr, DTYPE: tl.constexpr, PLAIN: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(Y + offs, x.to(DTYPE) if PLAIN else widen(x, DTYPE))


def _widened(x: torch.Tensor, dtype: torch.dtype, plain: bool = False) -> torch.Tensor:
    """``widen(x, dtype)`` (``plain``: Triton's own ``x.to(dtype)``) of every element."""
    y = torch.empty(x.shape, dtype=dtype, device=DEV)
    _widen_kernel[(1,)](x, y, N=x.numel(), DTYPE=TL_DTYPES[dtype], PLAIN=plain)
    return y


def _same_values(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per element: both NaN, or the same bits (so -0 is not 0)."""
    ints = {2: torch.int16, 4: torch.int32}[y.element_size()]
    return (y.isnan() & ref.isnan()) | (y.view(ints) == ref.view(ints))


def _all_codes(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(DEV)


@pytest.mark.parametrize("fp8", list(FP8.values()))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_widen_of_every_codes_fp16_value_is_exact(fp8, dtype):
    """The step after the hardware conversion (codes -> fp16): every code's fp16 value
    becomes the code's value in ``dtype`` bit for bit, NaN stays NaN, -0 and e5m2's
    infinities kept."""
    codes = _all_codes(fp8)
    ref = codes.cpu().to(dtype)
    got = _widened(codes.cpu().to(torch.float16).to(DEV), dtype).cpu()
    assert bool(_same_values(got, ref).all()), (got, ref)
    assert int(ref.isnan().sum()) == (2 if fp8 == torch.float8_e4m3fn else 6)
    assert int(ref.isinf().sum()) == (0 if fp8 == torch.float8_e4m3fn else 2)


@pytest.mark.parametrize("fp8", list(FP8.values()))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_widen_of_every_code_is_exact(fp8, dtype):
    """``widen`` from the codes: torch's value of every code. The CPU interpreter's own
    FP8 conversion (triton 3.9) reads e4m3's NaN codes as +-480 and e5m2's subnormals as
    0 or a neighbour; there ``widen`` agrees with it, and only there (a GPU converts every
    code exactly: ``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2``)."""
    codes = _all_codes(fp8)
    ref = codes.cpu().to(dtype)
    got = _widened(codes, dtype).cpu()
    own = _same_values(_widened(codes, torch.float16, plain=True).cpu(),
                       codes.cpu().to(torch.float16))
    bits = torch.arange(256)
    if DEV == "cpu":
        nan = (bits & 0x7F) == 0x7F
        subnormal = ((bits & 0x7C) == 0) & ((bits & 3) != 0)
        known = nan if fp8 == torch.float8_e4m3fn else subnormal
        assert bool((own | known).all()), bits[~own]  # the interpreter's errors, no others
    else:
        assert bool(own.all()), bits[~own]
    assert bool(_same_values(got, ref)[own].all()), (got[own], ref[own])


def _fp8_runner(model: str, kv: str, *, seq_lens, topk, steps, page, heads=4) -> DraftRunner:
    num_slots, max_ctx = decode_sizes(seq_lens, topk, steps, page)
    kw = dict(num_layers=1, num_slots=num_slots, max_reqs=len(seq_lens) + 2,
              max_context_len=max_ctx, page_size=page, device=DEV, kv_cache_dtype=kv)
    runner = DraftRunner.mha(4, 2, 32, **kw) if model == "mha" else \
        DraftRunner.mla(heads, 32, 16, **kw)
    return randomize_pools(runner)


FP8_LAYER = dict(layer_id=0, scaling=0.2, k_scale=0.37, v_scale=1.9)

FP8_DECODE_CASES = [
    # model, kv, topk, page, heads, plan (None: the table's): MHA picks dot-fp8-m16 (2
    # requests x 2 KV heads: a few-request round on the interpreter's 4 "SMs"), dot-fp8 forced
    # below; MLA picks dot-mla at 64 rows (16 heads x K 4), forced below
    ("mha", "fp8_e4m3", 1, 1, 4, None),
    ("mha", "fp8_e5m2", 4, 16, 4, None),
    ("mla", "fp8_e4m3", 4, 16, 16, None),
    ("mla", "fp8_e5m2", 1, 1, 4, "dot-mla"),
    ("mha", "fp8_e4m3", 4, 1, 4, "dot-fp8"),
]


@pytest.mark.parametrize("model,kv,topk,page,heads,plan", FP8_DECODE_CASES)
def test_fp8_decode_on_the_default_plans(model, kv, topk, page, heads, plan):
    steps, lens = 3, [26, 37]
    runner = _fp8_runner(model, kv, seq_lens=lens, topk=topk, steps=steps, page=page,
                         heads=heads)
    batch = place_decode_round(runner, lens, topk, steps, page, "path")
    backend = TritonDecode(runner, topk, steps, tree_mode="path", plan=plan)
    assert backend.plan.name == (plan or ("dot-fp8-m16" if model == "mha" else "dot-mla"))
    run_decode_round(runner, batch, backend, torch.bfloat16,
                     AttentionLayer(**FP8_LAYER, logit_cap=0.0), "path")


def _fp8_extend(model, kv, page, layer, q_mul=1.0):
    """One extend call over an FP8 pool (bf16 queries times ``q_mul``) against the
    reference."""
    lens, ext = [30, 19], [6, 3]
    runner = _fp8_runner(model, kv, seq_lens=[n + page for n in lens], topk=1, steps=1,
                         page=page)
    batch = place_extend_round(runner, lens, ext)
    plan = "dot-mla" if model == "mla" else None
    backend = TritonExtend(runner, plan=plan)
    backend.init_forward_metadata(batch)
    assert backend._round_plan["plan"].name == (plan or "dot-fp8")
    q, k, v = new_qkv(runner, sum(ext), torch.bfloat16)
    q = (q.float() * q_mul).to(torch.bfloat16)
    _poison(backend)
    _close(backend.forward(layer, q, k, v), reference_extend(runner, layer, q, batch),
           torch.bfloat16)


@pytest.mark.parametrize("model,kv,page", [("mha", "fp8_e4m3", 16), ("mha", "fp8_e5m2", 1),
                                           ("mla", "fp8_e5m2", 16), ("mla", "fp8_e4m3", 1)])
def test_fp8_extend_on_the_default_plans(model, kv, page):
    _fp8_extend(model, kv, page, AttentionLayer(**FP8_LAYER))


# Queries of |q| up to ~4e5 (bf16), past fp16's 65504: the fp16 dot's 2^-8 prescale keeps
# them finite (2^24 is its bound); a small softmax scale keeps the scores O(1).
BIG_Q, BIG_Q_LAYER = 1e5, dict(FP8_LAYER, scaling=2e-6)


@pytest.mark.parametrize("model,kv,topk,plan", [("mha", "fp8_e4m3", 4, None),
                                                ("mla", "fp8_e5m2", 1, "dot-mla")])
def test_fp8_decode_of_queries_past_fp16_range(model, kv, topk, plan):
    steps, lens = 2, [26, 37]
    runner = _fp8_runner(model, kv, seq_lens=lens, topk=topk, steps=steps, page=1)
    batch = place_decode_round(runner, lens, topk, steps, 1, "path")
    backend = TritonDecode(runner, topk, steps, tree_mode="path", plan=plan)
    run_decode_round(runner, batch, backend, torch.bfloat16,
                     AttentionLayer(**BIG_Q_LAYER, logit_cap=0.0), "path", q_mul=BIG_Q)


def test_fp8_extend_of_queries_past_fp16_range():
    """The causal tail (``finite`` / ``poison_rows``) and the MLA rope part, fp16 dots."""
    _fp8_extend("mla", "fp8_e4m3", 16, AttentionLayer(**BIG_Q_LAYER), q_mul=BIG_Q)
