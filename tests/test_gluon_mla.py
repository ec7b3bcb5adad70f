"""The Gluon MLA decode kernel's guards and the launcher's choice (CPU; the kernel itself runs
only on an sm90 GPU: ``tests/gpu/test_gluon_mla_gpu.py``).

- Off the GPU (and for FP8 pools, other dtypes or latent shapes, other Triton versions,
  non-sm90 devices, per-branch mode) the ``triton`` backend runs the ``tl.dot`` kernel and
  logs why once; what ``specattn list`` / ``select`` say.
- Where the guards pass, the plan picks the Gluon config (64-row tiles, one program per SM)
  and ``forward`` launches it with the contract ``gluon_mla.attention`` documents: a stand-in
  kernel that writes ``torch_ref``'s answer shows the direct (one split) and merged (several)
  outputs reach the caller, and the call's keys reach the pool.
"""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import DEV, decode_sizes, place_decode_round, randn_qkv, require_triton_interpret
from specattn.backends.torch_ref import reference_decode
from specattn.data import AttentionLayer, DraftRunner

require_triton_interpret()

from specattn.backends.triton import TritonDecode, gluon_mla  # noqa: E402
from specattn.backends.triton.launchers import KernelConfig  # noqa: E402


def mla_round(lens, topk=4, steps=3, dtype=torch.bfloat16, heads=16, kv_cache_dtype="auto"):
    slots, max_ctx = decode_sizes(lens, topk, steps, 1)
    r = DraftRunner.mla(heads, 512, 64, num_layers=1, num_slots=slots, max_reqs=len(lens) + 2,
                        max_context_len=max_ctx, dtype=dtype, device=DEV,
                        kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype == "auto":
        r.kv_buffer[0].normal_()
    return r, place_decode_round(r, lens, topk, steps, 1, "path")


def test_cpu_runs_tl_dot_and_logs_why(caplog, monkeypatch):
    monkeypatch.setattr(gluon_mla, "_LOGGED", set())
    r, batch = mla_round([9, 20])
    backend = TritonDecode(r, 4, 3, tree_mode="path")
    with caplog.at_level(logging.INFO, logger="specattn.backends.triton"):
        backend.init_forward_metadata(batch)
        backend.init_forward_metadata(batch)
    assert not backend._round_plan["cfg"].gluon
    lines = [m.getMessage() for m in caplog.records if "Gluon" in m.getMessage()]
    assert len(lines) == 1 and "not a CUDA device" in lines[0]


@pytest.mark.parametrize("args,expect", [
    ((16, 512, 64, 512, torch.bfloat16, False), None),
    ((128, 512, 64, 512, torch.float16, False), None),
    ((16, 512, 64, 512, torch.bfloat16, True), "FP8"),
    ((16, 512, 64, 512, torch.float32, False), "float32"),
    ((16, 256, 64, 256, torch.bfloat16, False), "latent 256"),
    ((16, 512, 32, 512, torch.bfloat16, False), "rope 32"),
])
def test_shape_reason(args, expect):
    why = gluon_mla.shape_reason(*args)
    assert why is None if expect is None else expect in why


def test_gluon_reason_fp8_pool():
    r, _ = mla_round([9], kv_cache_dtype="fp8_ds_mla")
    assert "FP8" in gluon_mla.gluon_reason(r)


@pytest.mark.parametrize("cap,kernels,expect", [
    ((8, 0), (object(), ""), "needs sm90"),
    ((10, 0), (object(), ""), "needs sm90"),
    ((9, 0), (None, "triton 3.9.0: the Gluon MLA kernel was run with"), "triton 3.9.0"),
    ((9, 0), (object(), ""), None),
])
def test_device_reason(monkeypatch, cap, kernels, expect):
    monkeypatch.setattr(gluon_mla, "_capability", lambda index: cap)
    monkeypatch.setattr(gluon_mla, "_kernels", lambda: kernels)
    monkeypatch.setattr(torch.version, "hip", None)
    why = gluon_mla.device_reason(torch.device("cuda", 0), interpret=False)
    assert why is None if expect is None else expect in why
    assert "CPU interpreter" in gluon_mla.device_reason(torch.device("cuda", 0), True)
    assert "CUDA" in gluon_mla.device_reason(torch.device("cpu"), False)


@pytest.mark.parametrize("version,ok", [("3.6.0", True), ("3.6.1", True), ("3.60.0", False),
                                        ("3.5.1", False), ("3.9.0", False)])
def test_version_guard(monkeypatch, version, ok):
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    mod, why = gluon_mla._import_gluon()
    if ok:  # then Gluon's Hopper ops must import: only triton 3.6 has this API
        assert why == "" or "do not import" in why
    else:
        assert mod is None and f"triton {version}" in why


@pytest.mark.parametrize("device,cap,interp,version,expect", [
    ("cuda", (9, 0), False, "3.6.0", "Gluon wgmma kernel"),
    ("cuda", (9, 0), False, "3.6.0", "work list up to 64 query rows per request"),
    ("cuda", (9, 0), False, "3.6.0", "a fixed prefix split above (the CuTe-DSL kernel"),
    ("cuda", (9, 0), False, "3.9.0", "tl.dot kernel (Gluon kernel off: triton 3.9.0"),
    ("cuda", (8, 0), False, "3.6.0", "sm80, needs sm90"),
    ("cpu", None, True, "3.6.0", "not a CUDA device"),
    ("cuda", (9, 0), False, None, "triton not installed"),
])
def test_platform_note(device, cap, interp, version, expect):
    assert expect in gluon_mla.platform_note(device, cap, interp, version)


def test_platform_note_with_cute_dsl():
    note = gluon_mla.platform_note("cuda", (9, 0), False, "3.6.0", cute_installed=True)
    assert "above, the CuTe-DSL kernel" in note and "fixed prefix split" not in note


def test_list_and_select_say_which_kernel():
    from specattn.platforms import Platform

    note = TritonDecode.runtime_note(Platform(device="cuda", capability=(9, 0)))
    assert note.startswith("MLA draft decode: ")
    from specattn.keys import BackendRequest
    from specattn.selection import select

    sel = select("decode", "triton", BackendRequest(kind="decode", mla=True, topk=4,
                                                   num_steps=3),
                 Platform(device="cuda", capability=(8, 0), libraries=frozenset({"triton"})))
    assert "tl.dot kernel (Gluon kernel off: sm80" in sel.explain()


def stand_in_steps(r, batch, backend, stand_in):
    """Three path-mode steps of ``backend`` (its Gluon kernel replaced by ``stand_in``) with
    NaN-poisoned partials: each step's keys reach the pool and its output matches
    ``torch_ref``; yields each step's last launch ``(grid, constexprs)``."""
    bs, topk = batch.out_cache_loc.shape[:2]
    gen = torch.Generator().manual_seed(0)
    layer = AttentionLayer(0, 576 ** -0.5)
    for step in range(3):
        if step:
            batch.parents[step] = torch.randint(0, topk, (bs, topk), generator=gen)
        q, k, _ = randn_qkv(r, bs * topk, gen)
        backend._active.mid_o.fill_(float("nan"))
        backend._active.mid_lse.fill_(float("nan"))
        out = backend.forward(step, layer, q, k, None)
        assert torch.equal(r.kv_buffer[0][batch.out_cache_loc[:, :, step].reshape(-1).long()], k)
        ref = reference_decode(r, layer, q, batch, step, "path")
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        yield stand_in.launches[-1]


class _StandIn:
    """A kernel module whose ``_gluon_mla_kernel[grid](...)`` writes ``torch_ref``'s answer
    the way the Gluon kernel does (output, or equal partials with arbitrary LSEs; the call's
    keys into the pool when ``WRITE_NEW``), recording each launch."""

    def __init__(self, runner, batch, tree_mode):
        self.runner, self.batch, self.tree_mode, self.launches = runner, batch, tree_mode, []
        self._gluon_mla_kernel = self

    def __getitem__(self, grid):
        def launch(Q, KV, Kin, MidO, MidLse, Out, R2T, Meta, Hist, Par, step, scale, cap,
                   *strides_and_ints, **const):
            self.launches.append((grid, const))
            if const["WRITE_NEW"]:
                KV[Hist[:, step].long()] = Kin
            ref = reference_decode(self.runner, AttentionLayer(0, scale, cap), Q, self.batch,
                                   step, self.tree_mode)
            if const["DIRECT_OUT"]:
                Out.copy_(ref)
            else:
                splits = grid[2]
                MidO[:, :, :splits] = ref.float()[:, :, None, :]
                MidLse[:, :, :splits] = torch.randn(MidLse[:, :, :splits].shape)
        return launch


@pytest.mark.parametrize("num_splits,kv_write", [(1, "first"), (3, "first"), (2, "kernel")])
def test_launcher_contract_with_a_stand_in_kernel(monkeypatch, num_splits, kv_write):
    r, batch = mla_round([7, 18], topk=2, steps=3)
    stand_in = _StandIn(r, batch, "path")
    monkeypatch.setattr(gluon_mla, "gluon_reason", lambda runner, interpret=False: None)
    monkeypatch.setattr(gluon_mla, "_kernels", lambda: (stand_in, ""))
    cfg = None if kv_write == "first" else KernelConfig(64, 64, 8, 2, kv_write=kv_write,
                                                        gluon=True)
    # The split-per-request kernel (at 2 x 16 rows the default is the work list).
    backend = TritonDecode(r, 2, 3, tree_mode="path", num_splits=num_splits, config=cfg,
                           work_list=False)
    backend.init_forward_metadata(batch)
    plan = backend._round_plan
    assert plan["cfg"].gluon and plan["cfg"].block_m == 64 and plan["num_splits"] == num_splits
    for grid, const in stand_in_steps(r, batch, backend, stand_in):
        assert grid == (1, 2, num_splits)  # 2 lanes x 16 heads: one 64-row tile
        assert const["MODE"] == 1 and const["H"] == 16 and const["num_warps"] == 8
        assert const["WRITE_NEW"] == (kv_write == "first")
        assert const["DIRECT_OUT"] == (num_splits == 1)


def test_choice_logic(monkeypatch):
    """The Gluon config only for shared-prefix MLA decode where the guards pass; its split
    count aims at one program per SM (``num_row_tiles * B * splits``); with the work list
    (the default at one row tile per request), one program per SM over all row tiles and at
    least one per request."""
    monkeypatch.setattr(gluon_mla, "gluon_reason", lambda runner, interpret=False: None)
    r, _ = mla_round([5, 6, 7], topk=8)
    plan = TritonDecode(r, 8, 3)._make_plan(3)
    assert plan["cfg"].gluon and plan["cfg"].label().endswith("gluon pf")
    # 8 lanes x 16 heads = 2 row tiles x 3 requests = 6 programs; the interpreter's "SM
    # count" is 4: one wave -> 1 split.
    assert plan["num_splits"] == 1
    # The work list: 2 row tiles of 4 "SMs" -> 2 programs each, at least one per request.
    wl = KernelConfig(64, 64, 8, 2, kv_write="first", gluon=True, gluon_worklist=True)
    assert TritonDecode(r, 8, 3, config=wl)._make_plan(3)["num_splits"] == 3
    assert TritonDecode(r, 8, 3, config=wl)._make_plan(1)["num_splits"] == 2
    # The default picks the work list where a request's K * H rows fit one 64-row tile.
    for topk, wl in ((1, True), (4, True), (8, False)):
        assert TritonDecode(r, topk, 3)._make_plan(3)["cfg"].gluon_worklist == wl
        assert not TritonDecode(r, topk, 3, work_list=False)._make_plan(3)["cfg"].gluon_worklist
        assert TritonDecode(r, topk, 3, work_list=True)._make_plan(3)["cfg"].gluon_worklist
    assert not TritonDecode(r, 8, 3, mode="per-branch")._make_plan(3)["cfg"].gluon
    mha = DraftRunner.mha(4, 2, 32, num_layers=1, num_slots=64, max_reqs=2,
                          max_context_len=32, device=DEV)
    assert not TritonDecode(mha, 2, 3)._make_plan(2)["cfg"].gluon
    with pytest.raises(Exception, match="config.gluon"):
        KernelConfig(64, 64, 8, 2, gluon=True, mla_v3=True)
    with pytest.raises(Exception, match="config.gluon"):
        KernelConfig(64, 64, 8, 2, mla_v3=True, gluon_prefetch=True)
    # The warp-specialized kernel: even stage counts (half per warpgroup), 32/64-key tiles.
    assert KernelConfig(64, 64, 8, 2, gluon=True, gluon_ws=True).label().endswith("gluon ws")
    for bad in (dict(num_stages=3), dict(block_n=16), dict(gluon_overlap=True)):
        fields = dict(block_m=64, block_n=64, num_warps=8, num_stages=2, gluon=True,
                      gluon_ws=True)
        with pytest.raises(Exception, match="config.gluon_ws"):
            KernelConfig(**{**fields, **bad})


def test_forced_config_refused_where_its_kernel_cannot_run(monkeypatch):
    """A forced Gluon (or mla_v3) config is checked at construction: MHA, extend and
    per-branch mode get an InvalidInputError naming ``config`` (the H200 soak met a compiler
    error on MHA and a refusal at the first extend forward)."""
    from specattn.backends.triton import TritonExtend
    from specattn.errors import InvalidInputError

    monkeypatch.setattr(gluon_mla, "gluon_reason", lambda runner, interpret=False:
                        None if runner.use_mla_backend else "stand-in: not served")
    cfg = KernelConfig(64, 64, 8, 2, kv_write="first", gluon=True, gluon_prefetch=True)
    r, _ = mla_round([5, 6], topk=4)
    assert TritonDecode(r, 4, 3, config=cfg)._make_plan(2)["cfg"] == cfg
    mha = DraftRunner.mha(4, 2, 32, num_layers=1, num_slots=64, max_reqs=2,
                          max_context_len=32, device=DEV)
    for make, why in ((lambda: TritonDecode(mha, 2, 3, config=cfg), "stand-in: not served"),
                      (lambda: TritonDecode(r, 4, 3, mode="per-branch", config=cfg),
                       "shared-prefix draft decode"),
                      (lambda: TritonExtend(r, topk=4, num_steps=3, config=cfg),
                       "shared-prefix draft decode")):
        with pytest.raises(InvalidInputError, match=why) as info:
            make()
        assert info.value.argument == "config" and "gluon" in str(info.value)
    with pytest.raises(InvalidInputError, match="mla_v3"):
        TritonDecode(mha, 2, 3, config=KernelConfig(64, 64, 8, 3, mla_v3=True))
    with pytest.raises(InvalidInputError, match="KernelConfig"):
        TritonDecode(r, 4, 3, config="m64 n64 w8 s2")


def test_soak_skips_cases_a_forced_option_does_not_fit(monkeypatch):
    """With ``--option triton:config=... gluon``, a round whose backend refuses the option
    (MHA, extend; on a CPU every round, since the Gluon kernel needs sm90) is skipped and
    counted, not reported as a crash."""
    from specattn.testing.soak import soak

    cfg = KernelConfig(64, 64, 8, 2, kv_write="first", gluon=True, gluon_prefetch=True)
    result = soak("triton", rounds=6, seed=11, graph_every=0, max_len=20,
                  decode_options={"config": cfg}, extend_options={"config": cfg},
                  log=lambda *a: None)
    # On CPU the Gluon kernel serves nothing: every round is skipped, none fails.
    assert result.failures == [] and result.skipped == result.rounds == 6


def test_issue_19_bench_cases():
    """mla-k1 / mla-small / mla-wide(-p64) as the issue defines them; mla-wide reports
    TFLOP/s against the matmul rate (73.1 GFLOP per step at B 32, L 4096, K 2, H 128)."""
    from specattn.bench import cases as C
    from specattn.bench.run import tflops_note

    got = {c.name: c for c in C.STANDARD_CASES}
    assert (got["mla-k1"].topk, got["mla-k1"].batch, got["mla-k1"].prefix) == (1, 32, 4096)
    assert (got["mla-small"].batch, got["mla-small"].prefix, got["mla-small"].topk) == \
        (4, 1024, 4)
    wide = got["mla-wide"]
    assert wide.shape == (128, 512, 64) and wide.topk == 2 and wide.compute_bound
    assert got["mla-wide-p64"].page_size == 64 and not got["mla-long"].compute_bound
    lens = wide.lengths()
    assert wide.flops(lens) == 128 * 2 * (32 * 4096 + 32 * 3) * (2 * 576 + 2 * 512)
    note = tflops_note(wide, lens, 0.2, 700.0)[0]
    assert note.startswith("365 TFLOP/s (52% of the bf16 matmul rate 700 TFLOP/s")
    assert tflops_note(got["mla-long"], lens, 0.2, 700.0) == []


def test_gpu_suite_harness_builds_every_variant():
    """The GPU suite's variants (``tests/gpu/test_gluon_mla_gpu.py``) resolve on the CPU and
    its split override handles each: the ``default`` variant (no config) keeps a case's split
    count, the CuTe work list drops it, the others keep it. Session 14's version read
    ``config.cute`` of the default's None and failed every ``default`` case on the H200 (found
    in session 15's run)."""
    import importlib
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))
    try:
        suite = importlib.import_module("test_gluon_mla_gpu")
    finally:
        sys.path.pop(0)
    variants = suite._variants()
    assert variants["default"] is None and "cute-wl" in variants
    for name, config in variants.items():
        expected = None if name == "cute-wl" else 4
        assert suite.split_override(config, 4) == expected, name
        assert suite.split_override(config, None) is None, name
