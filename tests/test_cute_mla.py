"""The CuTe-DSL MLA decode kernel's host side (CPU; the kernel itself runs only on an sm90
GPU with CuTe-DSL: ``tests/gpu/test_gluon_mla_gpu.py``, variant ``cute``).

- Its config (``cute`` label): the rules ``KernelConfig`` enforces, and a forced config
  refused at construction where the kernel cannot run (here: no CUDA device).
- The split count and cluster shape: at most ``MAX_SPLITS`` splits in clusters of at most
  ``MAX_CLUSTER``, all clusters running at once (the H200's answers: 30 clusters of 4, 66
  of 2), so 32 requests take 4 splits as 2 clusters of 2 each.
- The launcher sends a ``cute`` config and the partial buffers to ``cute_mla.attention`` (a
  stand-in that writes ``torch_ref``'s answer shows the output reaches the caller).
- The merge of several clusters' partials (the Triton merge kernel, interpreted) against
  torch, and ``cute_mla.attention`` refusing bad arguments before any CUDA work.
"""

from __future__ import annotations

import pytest
import torch

from helpers import DEV, decode_sizes, place_decode_round, randn_qkv, require_triton_interpret
from specattn.backends.torch_ref import reference_decode
from specattn.data import AttentionLayer, DraftRunner
from specattn.errors import InvalidInputError
from specattn.kernels.merge import merge_partials

require_triton_interpret()

from specattn.backends.triton import TritonDecode, cute_mla, gluon_mla  # noqa: E402
from specattn.backends.triton import launchers  # noqa: E402
from specattn.backends.triton.launchers import KernelConfig  # noqa: E402
from specattn.bench.options import kernel_config  # noqa: E402

CUTE = "m64 n64 w8 s2 kv-first gluon cute"
H200_CLUSTERS = {1: 132, 2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15}  # session 10


def mla_round(lens, topk=4, steps=3, heads=16, dtype=torch.bfloat16):
    slots, max_ctx = decode_sizes(lens, topk, steps, 1)
    r = DraftRunner.mla(heads, 512, 64, num_layers=1, num_slots=slots, max_reqs=len(lens) + 2,
                        max_context_len=max_ctx, dtype=dtype, device=DEV)
    r.kv_buffer[0].normal_()
    return r, place_decode_round(r, lens, topk, steps, 1, "path")


def test_config_label_and_rules():
    cfg = kernel_config(CUTE)
    assert cfg.cute and cfg.gluon and cfg.label() == CUTE
    base = dict(block_m=64, block_n=64, num_warps=8, num_stages=2, kv_write="first",
                gluon=True, cute=True)
    for bad in (dict(gluon=False), dict(block_n=32), dict(num_stages=3),
                dict(kv_write="kernel"), dict(gluon_worklist=True, fuse_merge=True),
                dict(gluon_ws=True)):
        with pytest.raises(InvalidInputError) as info:
            KernelConfig(**{**base, **bad})
        assert info.value.argument.startswith("config."), info.value
    wl = kernel_config("m64 n64 w8 s2 kv-first gluon wl cute")  # over the work list
    assert wl.cute and wl.gluon_worklist
    fused = kernel_config("m64 n64 w8 s2 kv-first fm gluon cute")
    assert fused.cute and fused.fuse_merge
    with pytest.raises(InvalidInputError, match="fuse_merge only with cute"):
        kernel_config("m64 n64 w8 s2 kv-first fm gluon")


def test_kernel_reads_the_metadata_rows_the_metadata_kernels_write():
    from specattn.backends.triton import _attn_kernels, _cute_mla_kernel

    assert _cute_mla_kernel.META_W == _attn_kernels.META_W


def test_cute_reason():
    r, _ = mla_round([5])
    assert cute_mla.cute_reason(r) == "not a CUDA device"
    fp32, _ = mla_round([5], dtype=torch.float32)
    assert "bf16/fp16" in cute_mla.cute_reason(fp32)
    mha = DraftRunner.mha(4, 2, 32, num_layers=1, num_slots=64, max_reqs=2,
                          max_context_len=32, device=DEV)
    assert cute_mla.cute_reason(mha) == "not an MLA model"
    why = cute_mla.import_reason()
    assert why is None or why.startswith("CuTe-DSL does not import")


def test_forced_config_refused_off_its_device(monkeypatch):
    """Where the Gluon guards pass but the CuTe kernel cannot run (here: a CPU), a forced
    ``cute`` config gets an InvalidInputError naming ``config`` at construction."""
    monkeypatch.setattr(gluon_mla, "gluon_reason", lambda runner, interpret=False: None)
    r, _ = mla_round([5, 6])
    with pytest.raises(InvalidInputError, match="CuTe-DSL kernel serves") as info:
        TritonDecode(r, 4, 3, config=kernel_config(CUTE))
    assert info.value.argument == "config" and "not a CUDA device" in str(info.value)


@pytest.fixture
def cute_serves(monkeypatch):
    """The sm90 guards of the Gluon and CuTe kernels pass (here, on a CPU)."""
    monkeypatch.setattr(gluon_mla, "gluon_reason", lambda runner, interpret=False: None)
    monkeypatch.setattr(cute_mla, "cute_reason", lambda runner, interpret=False: None)


@pytest.mark.parametrize("topk,work_list,want", [
    (8, None, CUTE),  # 8 lanes x 16 heads: two row tiles
    (8, False, CUTE),
    (8, True, "m64 n64 w8 s2 kv-first gluon pf wl"),  # the work list stays on request
    (4, None, "m64 n64 w8 s2 kv-first gluon pf wl"),  # one row tile: the work list
    (4, False, "m64 n64 w8 s2 kv-first gluon pf"),
])
def test_default_takes_the_cute_kernel_above_one_row_tile(cute_serves, monkeypatch, caplog,
                                                           topk, work_list, want):
    """Where the sm90 guards pass and CuTe-DSL serves the runner, a request of several
    64-row tiles gets the CuTe kernel by default (its clusters merge on chip); one row tile
    keeps the Gluon work list (faster on ragged batches) and ``work_list=True`` keeps it
    everywhere. The choice is logged once, naming the kernel."""
    monkeypatch.setattr(cute_mla, "_LOGGED", set())
    r, _ = mla_round([5, 6, 7], topk=topk)
    with caplog.at_level("INFO", logger="specattn.backends.triton.cute_mla"):
        for _ in range(2):
            cfg = launchers.gluon_config(r, False, topk, work_list)
    assert cfg.label() == want
    logged = [m for m in caplog.messages if "query rows per request" in m]
    assert len(logged) == (1 if want == CUTE else 0)
    assert not logged or "the CuTe-DSL kernel" in logged[0]


def test_default_without_cute_keeps_the_gluon_split(monkeypatch, caplog):
    """Without CuTe-DSL (here: a CPU), several row tiles get the Gluon split kernel, and the
    log says why the CuTe kernel does not run."""
    monkeypatch.setattr(gluon_mla, "gluon_reason", lambda runner, interpret=False: None)
    monkeypatch.setattr(cute_mla, "_LOGGED", set())
    r, _ = mla_round([5, 6], topk=8)
    with caplog.at_level("INFO", logger="specattn.backends.triton.cute_mla"):
        cfg = launchers.gluon_config(r, False, 8)
    assert cfg.label() == "m64 n64 w8 s2 kv-first gluon pf"
    assert any("Gluon split kernel, not the CuTe-DSL kernel: not a CUDA device" in m
               for m in caplog.messages)


@pytest.fixture
def h200_clusters(monkeypatch):
    monkeypatch.setattr(cute_mla, "max_active_clusters", lambda index, size: H200_CLUSTERS[size])


@pytest.mark.parametrize("programs,limit,want", [
    (32, 4, 4),  # mla-long: 2 clusters of 2 per request (32 clusters of 4 need 2 waves)
    (30, 4, 4), (33, 4, 4), (34, 4, 3), (4, 33, 16), (4, 8, 8), (16, 8, 8), (128, 1, 1),
    (200, 1, 1), (64, 2, 2), (67, 2, 1),
])
def test_splits_keep_the_clusters_in_one_wave(h200_clusters, programs, limit, want):
    device = torch.device("cuda", 0)
    got = cute_mla.plan_splits(programs, device, limit)
    cluster, groups = cute_mla.cluster_shape(got, device=device, programs=programs)
    assert got == want and cluster * groups == got and cluster <= cute_mla.MAX_CLUSTER
    assert got == 1 or programs * groups <= H200_CLUSTERS[cluster]


@pytest.mark.parametrize("splits,programs,want", [
    (4, 32, (2, 2)), (4, 30, (4, 1)), (3, 32, (3, 1)), (16, 4, (8, 2)), (8, 16, (2, 4)),
    (1, 500, (1, 1)),
    (6, 40, (6, 1)),  # nothing fits one wave: the largest cluster that divides the splits
])
def test_cluster_shape(h200_clusters, splits, programs, want):
    assert cute_mla.cluster_shape(splits, programs, torch.device("cuda", 0)) == want


def test_forced_split_count_capped(monkeypatch):
    assert launchers.cap_splits(kernel_config(CUTE), 40) == cute_mla.MAX_SPLITS
    assert launchers.cap_splits(kernel_config("m64 n64 w8 s2 kv-first gluon"), 40) == 40


@pytest.mark.parametrize("groups", [2, 3, 4])
def test_merge_of_the_clusters_partials(groups):
    """``out = sum_g softmax_g(lse) partial_g`` (natural log; an empty partial has LSE -inf),
    the partials past ``groups`` in the buffer not read (NaN there). Every row has a
    non-empty partial: the last split's holds at least the lane's own new key."""
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


def _three_path_steps(r, batch, backend, seed):
    """Three path-mode steps through ``backend`` with NaN-poisoned partials: each step's keys
    reach the pool and its output matches ``torch_ref``."""
    gen = torch.Generator().manual_seed(seed)
    layer = AttentionLayer(0, 576 ** -0.5)
    bs, topk = batch.out_cache_loc.shape[:2]
    for step in range(3):
        if step:
            batch.parents[step] = torch.randint(0, topk, (bs, topk), generator=gen)
        q, k, _ = randn_qkv(r, bs * topk, gen)
        backend._active.mid_o.fill_(float("nan"))  # partials are written before read
        out = backend.forward(step, layer, q, k, None)
        assert torch.equal(r.kv_buffer[0][batch.out_cache_loc[:, :, step].reshape(-1).long()],
                           k)
        ref = reference_decode(r, layer, q, batch, step, "path")
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


class _StandIn:
    """``cute_mla.attention`` as the kernel behaves: the call's keys into the pool (when
    ``write_new``) and ``torch_ref``'s answer in ``out``; records each call's keywords."""

    def __init__(self, runner, batch):
        self.runner, self.batch, self.calls = runner, batch, []

    def __call__(self, q, kv, k_new, out, req_to_token, meta, hist, parents, **kw):
        self.calls.append(kw)
        counter = kw["counter"]
        assert counter is None or (counter.dtype == torch.int32 and not counter.any())
        splits, mid_o, mid_lse = kw["num_splits"], kw["mid_o"], kw["mid_lse"]
        assert mid_o.shape == (q.shape[0], q.shape[1], splits, 512) and mid_o.is_contiguous()
        assert mid_lse.shape == (q.shape[0], q.shape[1], splits)
        if kw["write_new"]:
            kv[hist[:, kw["step"]].long()] = k_new
        layer = AttentionLayer(0, kw["sm_scale"], kw["logit_cap"])
        out.copy_(reference_decode(self.runner, layer, q, self.batch, kw["step"], "path"))


@pytest.mark.parametrize("label", [CUTE, "m64 n64 w8 s2 kv-first fm gluon cute"])
def test_launcher_sends_the_cute_config_to_its_kernel(cute_serves, monkeypatch, label):
    r, batch = mla_round([7, 18], topk=2)
    stand_in = _StandIn(r, batch)
    monkeypatch.setattr(cute_mla, "attention", stand_in)
    backend = TritonDecode(r, 2, 3, tree_mode="path", num_splits=16, config=kernel_config(label))
    backend.init_forward_metadata(batch)
    assert backend._round_plan["num_splits"] == cute_mla.MAX_SPLITS
    _three_path_steps(r, batch, backend, seed=0)
    call = stand_in.calls[-1]
    assert call["num_splits"] == 16 and call["mode"] == 1 and call["write_new"]
    assert call["batch"] == 2 and call["topk"] == 2 and call["num_steps"] == 3
    # With fuse_merge the arrival counters: zeros, one per request, row tile, cluster rank.
    counter = call["counter"]
    assert (counter is not None) == ("fm" in label.split())
    assert counter is None or counter.numel() >= 2 * 1 * cute_mla.MAX_CLUSTER


class _WorkListStandIn:
    """``cute_mla.attention`` over the work list as the kernel's contract says: a request with
    one segment written directly; the others' segments into slot ``p + b`` of ``mid_o
    [slots, rows, 512]`` (row ``lane * H + head`` of the request) with any LSE, then
    ``worklist.merge``. Every partial is the reference here, so the merge returns it."""

    def __init__(self, runner, batch, programs):
        self.runner, self.batch, self.programs, self.calls = runner, batch, programs, []

    def __call__(self, q, kv, k_new, out, req_to_token, meta, hist, parents, **kw):
        from specattn.backends.triton import worklist

        self.calls.append(kw)
        work, programs, topk = kw["work"], kw["programs"], kw["topk"]
        assert programs == self.programs and work.dtype == torch.int32
        mid_o, mid_lse = kw["mid_o"], kw["mid_lse"]
        bs, heads = kw["batch"], q.shape[1]
        assert mid_o.shape[0] >= programs + bs and mid_o.shape[2] == 512
        if kw["write_new"]:
            kv[hist[:, kw["step"]].long()] = k_new
        layer = AttentionLayer(0, kw["sm_scale"], kw["logit_cap"])
        ref = reference_decode(self.runner, layer, q, self.batch, kw["step"], "path")
        chunk, first = int(work[0]), work[1:1 + programs].tolist()
        starts = work[1 + programs:2 + programs + bs].tolist()
        for b in range(bs):
            rows = ref[b * topk:(b + 1) * topk].reshape(topk * heads, 512).float()
            if starts[b + 1] - starts[b] <= chunk:  # the only segment: the output
                out[b * topk:(b + 1) * topk] = ref[b * topk:(b + 1) * topk]
                continue
            for p in (p for p in range(programs) if first[p] == b):
                mid_o[p + b, :rows.shape[0]] = rows
                mid_lse[p + b, :rows.shape[0]] = torch.randn(rows.shape[0])
        worklist.merge(mid_o, mid_lse, out, work, programs, topk)


def test_launcher_sends_the_work_list_to_the_cute_kernel(cute_serves, monkeypatch):
    """``... gluon wl cute``: the round's work list (programs from ``work_list_shape``) and
    its partial slots reach ``cute_mla.attention``; a long request is split over several
    programs and merged, short ones are written directly."""
    monkeypatch.setattr(cute_mla, "work_list_shape", lambda row_tiles, batch, device: (2, 5))
    r, batch = mla_round([7, 300, 18], topk=2)
    stand_in = _WorkListStandIn(r, batch, 5)
    monkeypatch.setattr(cute_mla, "attention", stand_in)
    cfg = kernel_config("m64 n64 w8 s2 kv-first gluon wl cute")
    assert cfg.cute and cfg.gluon_worklist
    backend = TritonDecode(r, 2, 3, tree_mode="path", config=cfg)
    backend.init_forward_metadata(batch)
    assert backend._round_plan["num_splits"] == 5
    _three_path_steps(r, batch, backend, seed=1)
    work = stand_in.calls[-1]["work"]
    chunk, starts = int(work[0]), work[6:10].tolist()
    assert [e - s > chunk for s, e in zip(starts, starts[1:])] == [False, True, False]
    with pytest.raises(InvalidInputError, match="num_splits"):
        TritonDecode(r, 2, 3, config=cfg, num_splits=4)
    with pytest.raises(InvalidInputError, match="config.cute"):
        kernel_config("m64 n64 w8 s2 kv-first fm gluon wl cute")


def test_work_list_launch_takes_more_programs_than_splits(cute_serves, monkeypatch):
    """Over the work list the launcher's ``num_splits`` is the program count (66 per row
    tile on the H200, past ``MAX_SPLITS``): ``cute_mla.attention`` launches it (session 14's
    first H200 run refused it). The real checks run; the compile, the launch and the merge
    are recorded."""
    from specattn.backends.triton import worklist

    programs = cute_mla.MAX_SPLITS + 50
    monkeypatch.setattr(cute_mla, "work_list_shape",
                        lambda row_tiles, batch, device: (2, programs))
    compiled, launched, merged = [], [], []
    monkeypatch.setattr(cute_mla, "_compiled", lambda *a, **kw: compiled.append(kw) or "fn")
    monkeypatch.setattr(cute_mla, "_run", lambda fn, tensors, ints, *rest: launched.append(ints))
    monkeypatch.setattr(worklist, "merge", lambda *a: merged.append(a[4]))
    r, batch = mla_round([7, 300, 18], topk=2)
    backend = TritonDecode(r, 2, 3, tree_mode="path",
                           config=kernel_config("m64 n64 w8 s2 kv-first gluon wl cute"))
    backend.init_forward_metadata(batch)
    q, k, _ = randn_qkv(r, 3 * 2, torch.Generator().manual_seed(0))
    backend.forward(0, AttentionLayer(0, 576 ** -0.5), q, k, None)
    assert compiled == [{"work_list": True}]
    assert [ints[2] for ints in launched] == [programs] and merged == [programs]


@pytest.mark.parametrize("seed", range(20))
def test_work_list_shares_cover_every_key_once(seed):
    """The CTAs' shares of the work list's segments (the kernel's arithmetic, mirrored in
    ``work_list_shares``) cover each request's prefix and its history keys exactly once, and
    one CTA per request holds its first unit (it stores the call's keys)."""
    import random

    rng = random.Random(seed)
    bs = rng.randint(1, 12)
    lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 5000)]) for _ in range(bs)]
    tail_units = rng.randint(1, 3)
    tails = [rng.randint(1, tail_units * 64) for _ in range(bs)]
    cluster = rng.choice([1, 2, 3, 4, 8])
    programs = rng.randint(bs, bs + 40)
    shares = cute_mla.work_list_shares(lens, tails, tail_units, cluster, programs)
    for b in range(bs):
        prefix, tail = [0] * lens[b], [0] * tails[b]
        for start, end, t_lo, t_hi, _ in shares[b]:
            for i in range(start, max(end, start)):
                prefix[i] += 1
            for i in range(t_lo, t_hi):
                tail[i] += 1
        assert prefix == [1] * lens[b] and tail == [1] * tails[b], (b, shares[b])
        assert sum(first for *_, first in shares[b]) == 1


@pytest.mark.parametrize("row_tiles,batch,want", [
    (1, 32, (2, 66)),  # mla-long: all 132 SMs, clusters of 2 (30 clusters of 4 are too few)
    (1, 4, (2, 66)),
    (2, 32, (2, 33)),  # mla-long-k8
    (4, 32, (1, 33)),  # mla-wide: clusters of one
    (1, 200, (1, 200)),  # more requests than SMs: one program each
])
def test_work_list_shape(h200_clusters, row_tiles, batch, want):
    assert cute_mla.work_list_shape(row_tiles, batch, torch.device("cuda", 0)) == want


def test_work_list_arguments_refused_before_any_cuda_work(h200_clusters, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kw = dict(_args(), mode=0, batch=2, topk=4, num_steps=3, step=0, num_splits=1,
              sm_scale=0.04, logit_cap=0.0, write_new=True)
    good = dict(work=torch.zeros(2 + 66 + 2, dtype=torch.int32), programs=66,
                mid_o=torch.zeros(68, 64, 512), mid_lse=torch.zeros(68, 64))
    for change, argument in ((dict(programs=8), "programs"),
                             (dict(work=torch.zeros(10, dtype=torch.int32)), "work"),
                             (dict(mid_o=torch.zeros(60, 64, 512)), "mid_o"),
                             (dict(mid_lse=None), "mid_lse"),
                             (dict(diag=6), "work")):
        with pytest.raises(InvalidInputError) as info:
            cute_mla.attention(**{**kw, **good, **change})
        assert info.value.argument == argument


def _args(rows=8, heads=16, slots=40):
    q = torch.zeros(rows, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(slots, 576, dtype=torch.bfloat16)
    return dict(q=q, kv=kv, k_new=torch.zeros(rows, 576, dtype=torch.bfloat16),
                out=torch.empty(rows, heads, 512, dtype=torch.bfloat16),
                req_to_token=torch.zeros(4, 64, dtype=torch.int32),
                meta=torch.zeros(2, 5, dtype=torch.int32),
                hist=torch.zeros(rows, 3, dtype=torch.int32), parents=None)


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


def _refused_argument(change: dict, num_splits: int) -> str:
    """The argument ``cute_mla.attention`` names when refusing a call with ``change``."""
    kw = dict(_args(), mode=0, batch=2, topk=4, num_steps=3, step=0, num_splits=num_splits,
              sm_scale=0.04, logit_cap=0.0, write_new=True)
    kw.update(change)
    with pytest.raises(InvalidInputError) as info:
        cute_mla.attention(**kw)
    return info.value.argument


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
    monkeypatch.setattr(cute_mla, "cluster_shape", lambda splits, programs, device: (2, 2))
    assert _refused_argument(change, num_splits=4) == argument


@pytest.mark.parametrize("counter", [torch.zeros(3, dtype=torch.int32),
                                     torch.zeros(16, dtype=torch.int64),
                                     torch.zeros(16, 2, dtype=torch.int32)[:, 0]])
def test_attention_refuses_bad_counters_for_the_fused_merge(monkeypatch, counter):
    """Fused merge of two groups in clusters of 2, 2 requests: 4 int32 counters at least."""
    monkeypatch.setattr(cute_mla, "cluster_shape", lambda splits, programs, device: (2, 2))
    partials = dict(mid_o=torch.zeros(8, 16, 2, 512), mid_lse=torch.zeros(8, 16, 2))
    assert _refused_argument(dict(partials, counter=counter), num_splits=4) == "counter"
