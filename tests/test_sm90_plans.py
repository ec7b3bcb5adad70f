"""The sm90 MLA plans of the ``triton`` backend on the CPU (the kernels themselves run only
on an sm90 GPU: ``tests/gpu/test_sm90_mla_gpu.py``).

- What the plans need (``plans.model_reason`` / ``sm90_reason`` / the Gluon version guard)
  and what ``specattn list`` / ``select`` say about them.
- The table's choice where the sm90 gates pass (stand-ins for them here): ``gluon-wl`` at one
  64-row tile, ``cute`` above (or wherever Gluon cannot run), ``gluon-split`` without
  CuTe-DSL; the choice logged once. FP8 pools: the Gluon plans (``gluon-split`` above one
  tile: ``cute`` reads bf16/fp16 pools only), a ``tl.dot`` plan without Gluon.
- The launchers' contract with each kernel, through stand-ins that write ``torch_ref``'s
  answer the way the kernel does (output or partials, the call's keys into the pool; with an
  FP8 pool torch's codes are in the pool before the launch, and the scale is passed).
- The CuTe kernel's split count and cluster shapes (the H200's cluster limits), the merge of
  several clusters' partials, and its argument checks before any CUDA work.
"""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import DEV, decode_sizes, place_decode_round, randn_qkv, require_triton_interpret
from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.data import AttentionLayer, DraftRunner
from specattn.errors import InvalidInputError
from specattn.fp8 import FP8_KV_DTYPES, quantize
from specattn.kernels.merge import merge_partials

require_triton_interpret()

from specattn.backends.triton import (TritonDecode, cute_mla, gluon_mla, launchers,  # noqa: E402
                                      plans)
from specattn.kernels import fp8_codes as F  # noqa: E402

H200_CLUSTERS = {1: 132, 2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15}  # CUDA's answers


def mla_round(lens, topk=4, steps=3, dtype=torch.bfloat16, heads=16, kv="auto",
              k_scale=1.0):
    slots, max_ctx = decode_sizes(lens, topk, steps, 1)
    r = DraftRunner.mla(heads, 512, 64, num_layers=1, num_slots=slots, max_reqs=len(lens) + 2,
                        max_context_len=max_ctx, dtype=dtype, device=DEV, kv_cache_dtype=kv)
    if r.fp8:
        x = torch.randn(r.kv_buffer[0].shape, generator=torch.Generator().manual_seed(3))
        r.kv_buffer[0].copy_(quantize(x, k_scale, r.kv_buffer[0].dtype))
    else:
        r.kv_buffer[0].normal_()
    return r, place_decode_round(r, lens, topk, steps, 1, "path")


@pytest.fixture
def sm90(monkeypatch):
    """The sm90 gates pass (here, on a CPU): ``sm90(gluon=..., cute=...)`` picks which."""
    def set_gates(gluon: bool = True, cute: bool = True):
        monkeypatch.setattr(plans, "sm90_reason", lambda device, interpret: None)
        monkeypatch.setattr(plans, "gluon_import_reason",
                            lambda: None if gluon else "stand-in: no Gluon")
        monkeypatch.setattr(plans, "cute_import_reason",
                            lambda: None if cute else "stand-in: no CuTe-DSL")
        monkeypatch.setattr(plans, "_LOGGED", set())
    return set_gates


# --- what the plans need ------------------------------------------------------------------

def test_cpu_runs_a_tl_dot_plan_and_logs_why_once(caplog, monkeypatch):
    monkeypatch.setattr(plans, "_LOGGED", set())
    r, batch = mla_round([9, 20])
    backend = TritonDecode(r, 4, 3, tree_mode="path")
    with caplog.at_level(logging.INFO, logger="specattn.backends.triton"):
        backend.init_forward_metadata(batch)
        backend.init_forward_metadata(batch)
        TritonDecode(r, 4, 3).plan
    assert backend.plan.name == "dot-mla"
    lines = [m for m in caplog.messages if "sm90 kernels" in m]
    assert len(lines) == 1 and "not a CUDA device" in lines[0]


@pytest.mark.parametrize("heads,rank,rope,dtype,expect", [
    (16, 512, 64, torch.bfloat16, None),
    (128, 512, 64, torch.float16, None),
    (16, 512, 64, torch.float32, "float32"),
    (16, 256, 64, torch.bfloat16, "latent 256"),
    (16, 512, 32, torch.bfloat16, "rope 32"),
])
def test_model_reason(heads, rank, rope, dtype, expect):
    r = DraftRunner.mla(heads, rank, rope, num_layers=1, num_slots=8, max_reqs=2,
                        max_context_len=8, dtype=dtype, device=DEV)
    why = plans.model_reason(r)
    assert why is None if expect is None else expect in why
    mha = DraftRunner.mha(4, 2, 32, num_layers=1, num_slots=8, max_reqs=2, max_context_len=8,
                          device=DEV)
    assert plans.model_reason(mha) == "not an MLA model"


@pytest.mark.parametrize("kv", list(FP8_KV_DTYPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_reason_of_fp8_pools(kv, dtype):
    """The Gluon kernels read FP8 pools (``fp8=True``), the CuTe-DSL kernel does not."""
    r = DraftRunner.mla(16, 512, 64, num_layers=1, num_slots=8, max_reqs=2,
                        max_context_len=8, dtype=dtype, device=DEV, kv_cache_dtype=kv)
    assert plans.model_reason(r) is None and plans.model_reason(r, fp8=True) is None
    assert "CuTe-DSL kernel reads bf16/fp16 pools only" in plans.model_reason(r, fp8=False)
    r32 = DraftRunner.mla(16, 512, 64, num_layers=1, num_slots=8, max_reqs=2,
                          max_context_len=8, dtype=torch.float32, device=DEV, kv_cache_dtype=kv)
    assert "float32" in plans.model_reason(r32)


@pytest.mark.parametrize("cap,expect", [((8, 0), "8.0: the sm90 kernels need Hopper"), ((10, 0), "10.0"),
                                        ((9, 0), None)])
def test_sm90_reason(monkeypatch, cap, expect):
    monkeypatch.setattr(plans, "_capability", lambda index: cap)
    monkeypatch.setattr(torch.version, "hip", None)
    why = plans.sm90_reason(torch.device("cuda", 0), interpret=False)
    assert why is None if expect is None else expect in why
    assert plans.sm90_reason(torch.device("cuda", 0), True) == "not a CUDA device"
    assert plans.sm90_reason(torch.device("cpu"), False) == "not a CUDA device"


@pytest.mark.parametrize("version,ok", [("3.6.0", True), ("3.6.1", True), ("3.60.0", False),
                                        ("3.5.1", False), ("3.9.0", False)])
def test_gluon_version_guard(monkeypatch, version, ok):
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    why = plans.gluon_import_reason.__wrapped__()
    if ok:  # then Gluon's Hopper ops must import: only triton 3.6 has this API
        assert why is None or "do not import" in why
    else:
        assert f"triton {version}" in why


@pytest.mark.parametrize("device,cap,interp,version,cute,expect", [
    ("cuda", (9, 0), False, "3.6.0", False, "plan gluon-wl up to 64 query rows per request, "
     "gluon-split (cute needs CuTe-DSL"),
    ("cuda", (9, 0), False, "3.6.0", True, "plan gluon-wl up to 64 query rows per request, "
     "cute above"),
    ("cuda", (9, 0), False, "3.6.0", True, "bf16/fp16 or FP8 pools, FP8 above: gluon-split"),
    ("cuda", (9, 0), False, "3.6.0", False, "rank 512 + rope 64, bf16/fp16 or FP8 pools)"),
    ("cuda", (9, 0), False, "3.9.0", True, "rank 512 + rope 64, bf16/fp16 pools)"),
    ("cuda", (9, 0), False, "3.9.0", True, "plan cute up to 64 query rows per request, cute"),
    ("cuda", (9, 0), False, "3.9.0", False, "dot-wide / dot-mla (sm90 kernels off: triton 3.9"),
    ("cuda", (8, 0), False, "3.6.0", True, "sm80, needs sm90"),
    ("cpu", None, True, "3.6.0", True, "not a CUDA device"),
])
def test_platform_note(monkeypatch, device, cap, interp, version, cute, expect):
    monkeypatch.setattr(plans, "_version", lambda package: version)
    monkeypatch.setattr(plans, "_found", lambda module: cute)
    assert expect in plans.platform_note(device, cap, interp)


def test_list_and_select_name_the_plans():
    from specattn.keys import BackendRequest
    from specattn.platforms import Platform
    from specattn.selection import select

    note = TritonDecode.runtime_note(Platform(device="cuda", capability=(9, 0)))
    assert note.startswith("MLA draft decode: plan")
    sel = select("decode", "triton", BackendRequest(kind="decode", mla=True, topk=4,
                                                   num_steps=3),
                 Platform(device="cuda", capability=(8, 0), libraries=frozenset({"triton"})))
    assert "plans dot-wide / dot-mla (sm90 kernels off: sm80" in sel.explain()
    # An MHA request gets no note about the MLA plans (its plan is the tl.dot table's).
    sel = select("decode", "triton", BackendRequest(kind="decode", topk=4, num_steps=3),
                 Platform(device="cuda", capability=(8, 0), libraries=frozenset({"triton"})))
    assert "MLA" not in sel.explain()


# --- the table's choice where the gates pass ------------------------------------------------

@pytest.mark.parametrize("topk,gluon,cute,want", [
    (4, True, True, "gluon-wl"),      # 4 lanes x 16 heads: one 64-row tile
    (1, True, True, "gluon-wl"),
    (8, True, True, "cute"),          # two row tiles
    (8, True, False, "gluon-split"),  # ... without CuTe-DSL
    (4, False, True, "cute"),         # Gluon off (another Triton): CuTe-DSL all the same
    (8, False, True, "cute"),
    (4, False, False, "dot-mla"),
    (2, False, False, "dot-wide"),
])
def test_choice_where_the_gates_pass(sm90, topk, gluon, cute, want):
    sm90(gluon=gluon, cute=cute)
    r, _ = mla_round([5, 6, 7], topk=topk)
    assert TritonDecode(r, topk, 3).plan.name == want
    assert TritonDecode(r, topk, 3, mode="per-branch").plan.kernel not in plans.SM90_KERNELS


@pytest.mark.parametrize("kv", list(FP8_KV_DTYPES))
@pytest.mark.parametrize("topk,heads,gluon,cute,want", [
    (4, 16, True, True, "gluon-wl"),      # one 64-row tile: as bf16
    (1, 16, True, True, "gluon-wl"),
    (8, 16, True, True, "gluon-split"),   # two row tiles: cute reads bf16/fp16 pools only
    (8, 16, True, False, "gluon-split"),
    (1, 128, True, True, "gluon-split"),
    (4, 16, False, True, "dot-mla"),      # no Gluon: the tl.dot plans, not cute
    (8, 16, False, True, "dot-mla"),
    (2, 16, False, True, "dot-wide"),
])
def test_fp8_choice_where_the_gates_pass(sm90, kv, topk, heads, gluon, cute, want):
    sm90(gluon=gluon, cute=cute)
    r, _ = mla_round([5, 6, 7], topk=topk, heads=heads, kv=kv)
    assert TritonDecode(r, topk, 3).plan.name == want
    assert TritonDecode(r, topk, 3, mode="per-branch").plan.kernel not in plans.SM90_KERNELS


def test_fp8_forced_plans(sm90):
    """An FP8 pool takes either Gluon plan when forced; ``cute`` is refused with why."""
    sm90()
    r, _ = mla_round([5, 6], topk=8, kv="fp8_e5m2")
    for name in ("gluon-wl", "gluon-split", "dot-mla"):
        assert TritonDecode(r, 8, 3, plan=name).plan.name == name
    with pytest.raises(InvalidInputError, match="reads bf16/fp16 pools only") as info:
        TritonDecode(r, 8, 3, plan="cute")
    assert info.value.argument == "plan"


@pytest.mark.parametrize("kv,cute,why", [
    ("fp8_e4m3", True, "CuTe-DSL kernel reads bf16/fp16 pools only"),
    ("auto", False, "stand-in: no CuTe-DSL"),
])
def test_gluon_split_over_cute_is_logged_once_with_the_reason(sm90, caplog, kv, cute, why):
    """Above one row tile, where ``cute`` does not serve (an FP8 pool, no CuTe-DSL), the
    plan is ``gluon-split``, logged once with the reason."""
    sm90(cute=cute)
    r, _ = mla_round([5, 6], topk=8, kv=kv)
    with caplog.at_level("INFO", logger="specattn.backends.triton.plans"):
        for _ in range(2):
            assert TritonDecode(r, 8, 3).plan.name == "gluon-split"
    lines = [m for m in caplog.messages if "plan gluon-split, not cute" in m]
    assert len(lines) == 1 and why in lines[0]


def test_split_counts_of_the_gluon_plans(sm90):
    """The Gluon split kernel aims at one program per SM (row tiles x B x splits); the work
    list takes one program per SM over all row tiles and at least one per request."""
    sm90()
    r, _ = mla_round([5, 6, 7], topk=8)
    # 8 lanes x 16 heads = 2 row tiles x 3 requests = 6 programs; the interpreter's "SM
    # count" is 4: one wave -> 1 split.
    assert TritonDecode(r, 8, 3, plan="gluon-split")._make_plan(3)["num_splits"] == 1
    # The work list: 2 row tiles of 4 "SMs" -> 2 programs each, at least one per request.
    assert TritonDecode(r, 8, 3, plan="gluon-wl")._make_plan(3)["num_splits"] == 3
    assert TritonDecode(r, 8, 3, plan="gluon-wl")._make_plan(1)["num_splits"] == 2


def test_forced_sm90_plans_refused_where_they_cannot_run(sm90):
    sm90()
    from specattn.backends.triton import TritonExtend

    r, _ = mla_round([5, 6], topk=4)
    assert TritonDecode(r, 4, 3, plan="gluon-split").plan.name == "gluon-split"
    mha = DraftRunner.mha(4, 2, 32, num_layers=1, num_slots=64, max_reqs=2,
                          max_context_len=32, device=DEV)
    for make, why in ((lambda: TritonDecode(mha, 2, 3, plan="gluon-wl"), "not an MLA model"),
                      (lambda: TritonDecode(r, 4, 3, mode="per-branch", plan="gluon-wl"),
                       "shared-prefix draft decode"),
                      (lambda: TritonExtend(r, topk=4, num_steps=3, plan="cute"),
                       "shared-prefix draft decode")):
        with pytest.raises(InvalidInputError, match=why) as info:
            make()
        assert info.value.argument == "plan"


def test_soak_skips_cases_a_forced_plan_does_not_fit():
    """With ``--option triton:plan=gluon-wl``, a round whose backend refuses the plan (MHA,
    extend; on a CPU every round, since the Gluon kernels need sm90) is skipped and counted,
    not reported as a crash."""
    from specattn.testing.soak import soak

    result = soak("triton", rounds=6, seed=11, graph_every=0, max_len=20,
                  decode_options={"plan": "gluon-wl"}, extend_options={"plan": "gluon-wl"},
                  log=lambda *a: None)
    assert result.failures == [] and result.skipped == result.rounds == 6


# --- the launchers' contract with each kernel ----------------------------------------------

def stand_in_steps(r, batch, backend, calls, layer=None):
    """Three path-mode steps of ``backend`` (its kernel replaced by a stand-in that records
    into ``calls``) with NaN-poisoned partials: each step's keys reach the pool (FP8: their
    codes) and its output matches ``torch_ref``; yields each step's last call."""
    bs, topk = batch.out_cache_loc.shape[:2]
    gen = torch.Generator().manual_seed(0)
    layer = layer or AttentionLayer(0, 576 ** -0.5)
    for step in range(3):
        if step:
            batch.parents[step] = torch.randint(0, topk, (bs, topk), generator=gen)
        q, k, _ = randn_qkv(r, bs * topk, gen)
        backend._active.mid_o.fill_(float("nan"))
        backend._active.mid_lse.fill_(float("nan"))
        out = backend.forward(step, layer, q, k, None)
        stored = r.kv_buffer[0][batch.out_cache_loc[:, :, step].reshape(-1).long()]
        want = quantize(k, layer.k_scale, stored.dtype) if r.fp8 else k
        assert torch.equal(stored.view(torch.uint8) if r.fp8 else stored,
                           want.view(torch.uint8) if r.fp8 else want)
        ref = reference_decode(r, layer, q, batch, step, "path")
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        yield calls[-1]


class _GluonStandIn:
    """A kernel module whose ``_gluon_mla_kernel[grid](...)`` writes ``torch_ref``'s answer
    the way the Gluon split kernel does (output, or equal partials with arbitrary LSEs; the
    call's keys into the pool), recording each launch; a path-mode decode, or an extend
    (``MODE`` 2: ``Hist`` holds the new tokens' slots)."""

    def __init__(self, runner, batch):
        self.runner, self.batch, self.launches = runner, batch, []
        self._gluon_mla_kernel = self

    def __getitem__(self, grid):
        def launch(Q, KV, Kin, MidO, MidLse, Out, R2T, Meta, Hist, Par, KScale, WScale, step,
                   scale, cap, *strides_and_ints, **const):
            self.launches.append((grid, const))
            if const.get("STORE_FP8"):  # the kernel stores the codes (fp8_codes' own)
                codes = F.Codes(const["E5M2"], const["SATURATE"], const["SIGNED_NAN"])
                KV[Hist[:, step].long()] = F.quantize(Kin, WScale, const["W_QUANT"],
                                                      codes).view(KV.dtype)
            if const["FP8"]:  # the call's codes are in the pool; the kernel reads them there
                k_scale = KScale
                assert torch.equal(KV[Hist[:, step].long()].view(torch.uint8),
                                   quantize(Kin, KScale, KV.dtype).view(torch.uint8))
            else:
                k_scale = 1.0
                KV[Hist[:, step].long()] = Kin
            layer = AttentionLayer(0, scale, cap, k_scale=k_scale)
            ref = reference_extend(self.runner, layer, Q, self.batch) if const["MODE"] == 2 \
                else reference_decode(self.runner, layer, Q, self.batch, step, "path")
            if const["DIRECT_OUT"]:
                Out.copy_(ref)
            else:
                splits = grid[2]
                MidO[:, :, :splits] = ref.float()[:, :, None, :]
                MidLse[:, :, :splits] = torch.randn(MidLse[:, :, :splits].shape)
        return launch


@pytest.mark.parametrize("num_splits", [1, 3])
def test_gluon_split_launch_contract(sm90, monkeypatch, num_splits):
    sm90()
    r, batch = mla_round([7, 18], topk=2, steps=3)
    stand_in = _GluonStandIn(r, batch)
    monkeypatch.setattr(gluon_mla, "kernel_module", lambda: stand_in)
    backend = TritonDecode(r, 2, 3, tree_mode="path", num_splits=num_splits, plan="gluon-split")
    backend.init_forward_metadata(batch)
    assert backend._round_plan["num_splits"] == num_splits
    for grid, const in stand_in_steps(r, batch, backend, stand_in.launches):
        assert grid == (1, 2, num_splits)  # 2 lanes x 16 heads: one 64-row tile
        assert const["MODE"] == 1 and const["H"] == 16 and const["num_warps"] == 8
        assert const["DIRECT_OUT"] == (num_splits == 1)
        assert (const["BLOCK_N"], const["NUM_STAGES"]) == (64, 2) and not const["FP8"]


@pytest.mark.parametrize("kv", list(FP8_KV_DTYPES))
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("kernel_writes", [False, True])
def test_gluon_split_launch_contract_fp8(sm90, monkeypatch, kv, num_splits, kernel_writes):
    """FP8: the call's keys are quantized into the pool, by torch before the launch or, where
    the kernels' codes are the device torch's (``fp8_write``, as on CUDA), by the kernel
    (``STORE_FP8``, the write's scale and variant), bit for bit torch's either way; the
    layer's ``k_scale`` is a one-element float32 tensor (a float or a tensor); the kernel's
    answer is the attention of the dequantized pool."""
    sm90()
    if kernel_writes:
        monkeypatch.setattr(launchers, "fp8_write", _cpu_fp8_write)
    r, batch = mla_round([7, 18], topk=2, steps=3, kv=kv, k_scale=0.37)
    stand_in = _GluonStandIn(r, batch)
    monkeypatch.setattr(gluon_mla, "kernel_module", lambda: stand_in)
    backend = TritonDecode(r, 2, 3, tree_mode="path", num_splits=num_splits, plan="gluon-split")
    backend.init_forward_metadata(batch)
    for k_scale in (0.37, torch.tensor([0.37])):
        stand_in.launches.clear()
        layer = AttentionLayer(0, 576 ** -0.5, k_scale=k_scale)
        for grid, const in stand_in_steps(r, batch, backend, stand_in.launches, layer=layer):
            assert grid == (1, 2, num_splits) and const["FP8"]
            assert const["DIRECT_OUT"] == (num_splits == 1)
            assert const.get("STORE_FP8", False) is kernel_writes


def _cpu_fp8_write(runner, layer, new_kv, device):
    """``launchers.fp8_write`` as on CUDA, with CPU torch's division (a scale of either kind
    divides)."""
    from specattn.kernels.kv_write import Fp8Write

    k = F.write_scale(layer.k_scale, device, F.QUANT_DIV)
    return Fp8Write(k[0], k[0], k[1], k[1], F.torch_variant(
        device, runner.kv_buffer[layer.layer_id].dtype))


class _CuteStandIn:
    """``cute_mla.attention`` as the kernel behaves: the call's keys into the pool and
    ``torch_ref``'s answer in ``out``; records each call's keywords."""

    def __init__(self, runner, batch):
        self.runner, self.batch, self.calls = runner, batch, []

    def __call__(self, q, kv, k_new, out, req_to_token, meta, hist, parents, **kw):
        self.calls.append(kw)
        mid_o, mid_lse = kw["mid_o"], kw["mid_lse"]
        _, groups = cute_mla.cluster_shape(kw["num_splits"], kw["batch"], q.device,
                                           mid_o.shape[2])
        assert mid_o.shape == (q.shape[0], q.shape[1], groups, 512) and mid_o.is_contiguous()
        assert mid_lse.shape == (q.shape[0], q.shape[1], groups)
        kv[hist[:, kw["step"]].long()] = k_new
        layer = AttentionLayer(0, kw["sm_scale"], kw["logit_cap"])
        out.copy_(reference_decode(self.runner, layer, q, self.batch, kw["step"], "path"))


def test_cute_launch_contract(sm90, monkeypatch, h200_clusters):
    sm90()
    r, batch = mla_round([7, 18], topk=2)
    stand_in = _CuteStandIn(r, batch)
    monkeypatch.setattr(cute_mla, "attention", stand_in)
    backend = TritonDecode(r, 2, 3, tree_mode="path", num_splits=16, plan="cute")
    backend.init_forward_metadata(batch)
    assert backend._round_plan["num_splits"] == 16
    for call in stand_in_steps(r, batch, backend, stand_in.calls):
        assert call["num_splits"] == 16 and call["mode"] == 1
        assert call["mid_o"].shape[2] == 2  # 2 clusters of 8 per request
        assert call["batch"] == 2 and call["topk"] == 2 and call["num_steps"] == 3


def test_kernels_read_the_metadata_rows_the_metadata_kernels_write():
    from specattn.backends.triton import _attn_kernels, _cute_mla_kernel

    assert _cute_mla_kernel.META_W == _attn_kernels.META_W


# --- the CuTe kernel's splits, clusters, merge and checks -----------------------------------

@pytest.fixture
def h200_clusters(monkeypatch):
    monkeypatch.setattr(cute_mla, "max_active_clusters", lambda index, size: H200_CLUSTERS[size])
    monkeypatch.setattr(cute_mla, "device_index", lambda device: 0)  # CPU tensors stand in


@pytest.mark.parametrize("programs,limit,max_groups,want", [
    (32, 4, 17, 4),  # mla-long: 2 clusters of 2 per request (32 clusters of 4 need 2 waves)
    (30, 4, 17, 4), (33, 4, 17, 4), (34, 4, 17, 3), (4, 8, 17, 8), (16, 8, 17, 8),
    (128, 1, 17, 1), (200, 1, 17, 1), (64, 2, 17, 2), (67, 2, 17, 1),
    (4, 33, 17, 32),  # 4 requests: 16 clusters of 2 each
    (1, 132, 68, 132),  # one request: 66 clusters of 2, a CTA per SM
    (1, 132, 12, 96),  # at most 12 partials: 12 clusters of 8
])
def test_splits_keep_the_clusters_in_one_wave(h200_clusters, programs, limit, max_groups,
                                              want):
    device = torch.device("cuda", 0)
    got = cute_mla.plan_splits(programs, device, limit, max_groups)
    cluster, groups = cute_mla.cluster_shape(got, programs, device, max_groups)
    assert got == want and cluster * groups == got and cluster <= cute_mla.MAX_CLUSTER
    assert groups <= max_groups
    assert got == 1 or programs * groups <= H200_CLUSTERS[cluster]


@pytest.mark.parametrize("splits,programs,max_groups,want", [
    (4, 32, 17, (2, 2)), (4, 30, 17, (4, 1)), (3, 32, 17, (3, 1)), (16, 4, 17, (8, 2)),
    (8, 16, 17, (2, 4)), (1, 500, 17, (1, 1)),
    (6, 40, 17, (6, 1)),  # nothing fits one wave: the largest cluster that divides the splits
    (120, 1, 68, (8, 15)), (132, 1, 68, (2, 66)),
    (132, 1, 30, (6, 22)),  # not one wave, but the fewest partials
    (127, 1, 68, None),  # a prime: 127 clusters of 1, more than the partials
])
def test_cluster_shape(h200_clusters, splits, programs, max_groups, want):
    assert cute_mla.cluster_shape(splits, programs, torch.device("cuda", 0), max_groups) \
        == want


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_merge_of_the_clusters_partials(groups):
    """``out = sum_g softmax_g(lse) partial_g`` (natural log; an empty partial has LSE -inf),
    the partials past ``groups`` in the buffer not read (NaN there)."""
    gen = torch.Generator().manual_seed(groups)
    rows, heads = 6, 16
    mid_o = torch.full((rows, heads, groups + 1, 512), float("nan"))
    mid_lse = torch.full((rows, heads, groups + 1), float("nan"))
    mid_o[:, :, :groups] = torch.randn(rows, heads, groups, 512, generator=gen)
    mid_lse[:, :, :groups] = torch.randn(rows, heads, groups, generator=gen) * 3
    mid_lse[1, 2, 0] = float("-inf")  # an empty partial
    mid_o[1, 2, 0] = 0.0
    out = torch.full((rows, heads, 512), float("nan"), dtype=torch.bfloat16)
    merge_partials(mid_o, mid_lse, out, groups)  # what cute_mla launches for them
    w = torch.softmax(mid_lse[:, :, :groups].double(), dim=-1)
    want = (w.unsqueeze(-1) * mid_o[:, :, :groups].double()).sum(2)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=1e-2)


def _args(rows=8, heads=16, slots=40):
    q = torch.zeros(rows, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(slots, 576, dtype=torch.bfloat16)
    return dict(q=q, kv=kv, k_new=torch.zeros(rows, 576, dtype=torch.bfloat16),
                out=torch.empty(rows, heads, 512, dtype=torch.bfloat16),
                req_to_token=torch.zeros(4, 64, dtype=torch.int32),
                meta=torch.zeros(2, 5, dtype=torch.int32),
                hist=torch.zeros(rows, 3, dtype=torch.int32), parents=None)


def _refused_argument(change: dict, num_splits: int) -> str:
    """The argument ``cute_mla.attention`` names when refusing a call with ``change``."""
    kw = dict(_args(), mode=0, batch=2, topk=4, num_steps=3, step=0, num_splits=num_splits,
              sm_scale=0.04, logit_cap=0.0)
    kw.update(change)
    with pytest.raises(InvalidInputError) as info:
        cute_mla.attention(**kw)
    return info.value.argument


@pytest.mark.parametrize("change,argument", [
    (dict(num_splits=17), "num_splits"),
    (dict(num_splits=0), "num_splits"),
    (dict(q=torch.zeros(8, 16, 580, dtype=torch.bfloat16)[:, :, :576]), "q"),
    (dict(kv=torch.zeros(40, 577, dtype=torch.bfloat16)[:, 1:]), "kv"),
    (dict(hist=torch.zeros(3, 8, dtype=torch.int32).T), "hist"),
    (dict(mode=1), "parents"),
    (dict(out=torch.empty(8, 16, 514, dtype=torch.bfloat16)[:, :, :512]), "out"),
])
def test_attention_refuses_bad_arguments_before_any_cuda_work(change, argument):
    assert _refused_argument(change, num_splits=2) == argument


@pytest.mark.parametrize("change,argument", [
    (dict(), "mid_o"),
    (dict(mid_o=torch.zeros(8, 16, 1, 512)), "mid_o"),
    (dict(mid_o=torch.zeros(8, 16, 2, 512, dtype=torch.bfloat16)), "mid_o"),
    (dict(mid_o=torch.zeros(8, 16, 2, 512)), "mid_lse"),
    (dict(mid_o=torch.zeros(8, 16, 2, 512), mid_lse=torch.zeros(8, 16, 3)[:, :, ::2]),
     "mid_lse"),
    (dict(mid_o=torch.zeros(8, 16, 2, 514)[..., 2:]), "mid_o"),  # rows not 16-byte aligned
])
def test_attention_refuses_missing_partials_with_several_clusters(monkeypatch, change,
                                                                  argument):
    """Splits in more than one cluster per row tile write partials: buffers for them."""
    monkeypatch.setattr(cute_mla, "cluster_shape",
                        lambda splits, programs, device, max_groups: (2, 2))
    assert _refused_argument(change, num_splits=4) == argument


# --- MLA extend: gluon-split ---------------------------------------------------------------

def mla_extend_round(lens, ext, heads=16, kv="auto", k_scale=1.0):
    """An MLA runner and an extend batch (``ext[b]`` new tokens closing request ``b``'s
    ``lens[b]`` keys), the pool random (FP8: torch's codes)."""
    from helpers import place_extend_round

    r = DraftRunner.mla(heads, 512, 64, num_layers=1, num_slots=sum(lens) + 64,
                        max_reqs=len(lens) + 2, max_context_len=max(lens) + 8,
                        dtype=torch.bfloat16, device=DEV, kv_cache_dtype=kv)
    x = torch.randn(r.kv_buffer[0].shape, generator=torch.Generator().manual_seed(5))
    r.kv_buffer[0].copy_(quantize(x, k_scale, r.kv_buffer[0].dtype) if r.fp8 else x)
    return r, place_extend_round(r, lens, ext)


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("gluon,want", [(True, "gluon-split"), (False, "dot-mla")])
def test_extend_choice_where_the_gates_pass(sm90, kv, gluon, want):
    """MLA extend on sm90: ``gluon-split`` (bf16/fp16 and FP8 pools), a ``tl.dot`` plan
    without Gluon; ``gluon-wl`` and ``cute`` serve decode only."""
    from specattn.backends.triton import TritonExtend

    sm90(gluon=gluon)
    r, _ = mla_extend_round([40, 90], [6, 6], kv=kv)
    assert TritonExtend(r)._plan_for(2, 12, 6)["plan"].name == want
    if gluon:
        assert TritonExtend(r, plan="gluon-split")._plan_for(2, 12, 6)["plan"].name == \
            "gluon-split"
        for name in ("gluon-wl", "cute"):
            with pytest.raises(InvalidInputError, match="shared-prefix draft decode only"):
                TritonExtend(r, plan=name)


def test_extend_split_counts_of_gluon_split(sm90, monkeypatch):
    """One request's extend fills the SMs with prefix splits up to the partial buffers' room
    (``split_cap``'s rule for few rows), where decode keeps ``MAX_SPLITS``."""
    from specattn.backends.triton import TritonExtend, launchers

    sm90()
    monkeypatch.setattr(plans, "sms", lambda device: 132)
    split = plans.PLANS["gluon-split"]
    assert launchers.split_cap(split, 8) == plans.MAX_SPLITS
    assert launchers.split_cap(split, 8, extend=True) == 51  # 24 x 17 // 8
    r, _ = mla_extend_round([2000], [6])
    # 6 tokens x 16 heads: 2 row tiles; 132 // 2 = 66 splits, capped at DOT_MAX_SPLITS
    # (24 x 17 // 6 = 68 parts fit).
    assert TritonExtend(r)._plan_for(1, 6, 6)["num_splits"] == plans.DOT_MAX_SPLITS


@pytest.mark.parametrize("kv,kernel_writes", [("auto", False), ("fp8_e5m2", False),
                                               ("fp8_e5m2", True)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gluon_split_extend_launch_contract(sm90, monkeypatch, kv, kernel_writes, num_splits):
    """The extend launch: grid (row tiles of max E x H, B, splits), ``MODE`` 2, the new
    tokens' slots as ``Hist [T, 1]``, the new keys in ``Kin`` (FP8: their codes stored by
    torch, or by the kernel where its codes are the device torch's); the output matches
    ``torch_ref`` (partials NaN-poisoned first)."""
    from specattn.backends.torch_ref import reference_extend as ref_extend
    from specattn.backends.triton import TritonExtend

    sm90()
    if kernel_writes:
        monkeypatch.setattr(launchers, "fp8_write", _cpu_fp8_write)
    r, batch = mla_extend_round([30, 75], [5, 3], kv=kv, k_scale=0.37)
    stand_in = _GluonStandIn(r, batch)
    monkeypatch.setattr(gluon_mla, "kernel_module", lambda: stand_in)
    backend = TritonExtend(r, num_splits=num_splits)
    layer = AttentionLayer(0, 576 ** -0.5, k_scale=0.37)
    backend.init_forward_metadata(batch)
    backend._active.mid_o.fill_(float("nan"))
    backend._active.mid_lse.fill_(float("nan"))
    gen = torch.Generator().manual_seed(2)
    q, k, _ = randn_qkv(r, 8, gen)
    out = backend.forward(layer, q, k, None)
    (grid, const), = stand_in.launches
    assert grid == (2, 2, num_splits)  # 5 tokens x 16 heads: two 64-row tiles
    assert const["MODE"] == 2 and const["FP8"] == (kv != "auto")
    assert const.get("STORE_FP8", False) is kernel_writes
    assert const["DIRECT_OUT"] == (num_splits == 1)
    stored = r.kv_buffer[0][batch.out_cache_loc.long()]
    want = quantize(k, 0.37, stored.dtype) if r.fp8 else k
    assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8))
    torch.testing.assert_close(out.float(), ref_extend(r, layer, q, batch).float(),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("plan", ["gluon-wl", "gluon-split"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_gluon_launches_chained_by_pdl(sm90, monkeypatch, plan, kv):
    """With ``pdl`` (sm90: on by default) the Gluon kernel releases its merge, which is a
    programmatic dependent launch; the kernel is never one itself: it stores the call's keys
    (over an FP8 pool the codes, ``write``, where the device torch's codes are the
    kernels'), and everything it reads may come from the launch before. Off, nothing is
    chained."""
    from specattn.backends.triton import launchers

    sm90()
    r, batch = mla_round([700, 1800], topk=4, steps=3, kv=kv, k_scale=0.5)
    calls = []
    monkeypatch.setattr(launchers.gluon_mla, "attention",
                        lambda *a, **kw: calls.append(("kernel", kw["pdl"],
                                                       kw["write"] is not None)))
    monkeypatch.setattr(launchers.worklist, "merge",
                        lambda *a, pdl=False, **kw: calls.append(("merge", pdl)))
    monkeypatch.setattr(launchers, "merge_partials",
                        lambda *a, pdl=False, **kw: calls.append(("merge", pdl)))
    # The kernels' FP8 codes as on CUDA (here torch's write would store them).
    monkeypatch.setattr(launchers, "fp8_write", lambda *a: object())
    monkeypatch.setattr(launchers, "write_new_kv",
                        lambda *a, pdl=False, **kw: calls.append(("write", pdl)) or True)
    layer = AttentionLayer(0, 576 ** -0.5, k_scale=0.5)
    q, k, _ = randn_qkv(r, 8, torch.Generator().manual_seed(1))
    for pdl in (True, False):
        backend = TritonDecode(r, 4, 3, tree_mode="path", plan=plan, num_splits=3)
        backend._pdl = pdl  # what `pdl=None` gives on an sm90 GPU, or `pdl=False`
        backend.init_forward_metadata(batch)
        calls.clear()
        backend.forward(0, layer, q, k, None)
        fp8 = kv != "auto"
        assert calls == [("kernel", pdl, fp8), ("merge", pdl)], (pdl, calls)
