"""CPU tests of the FlashInfer backends.

- The package imports without FlashInfer; selection picks the MHA/MLA flavour; construction
  on the CPU platform fails with the reason.
- The pure-torch slot-list helpers against Python loops.
- The fused history + merge kernel (Triton interpreter on CPU) against a softmax over prefix
  and history; the graph-mode prefill plan arguments.
- The glue (slot lists, path histories, extend, CUDA-graph bookkeeping) against
  ``torch_ref``, with FlashInfer replaced by a small pure-torch stand-in that follows its
  documented semantics (page-size-1 CSR, bottom-right causal, base-2 LSE, indices read at
  run time). The real kernels are tested on the GPU (``tests/gpu/test_flashinfer_gpu.py``),
  which reuses the case builders below.

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``); this file keeps the ones specific to FlashInfer:
``mode``, plans and wrappers, graph bookkeeping and its errors, the MLA soft-cap refusal, the
history + merge kernel, and the glue at fp32 tolerance (the kit plans FlashInfer at its
declared 16-bit dtypes).
"""

from __future__ import annotations

import math
import subprocess
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from helpers import extend_lengths, fill_slots, poison_pools, randn_qkv
from specattn.backends.flashinfer import (FlashInferDecode, FlashInferExtend,
                                          FlashInferMLADecode, FlashInferMLAExtend)
from specattn.backends.flashinfer._passes import _graph_split_kwargs
from specattn.backends.flashinfer._slots import (KeptCSR, fill_ragged_slots,
                                                 history_positions, host_arange, host_csr,
                                                 host_indptr)
from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from specattn.errors import BackendUnavailableError, InvalidInputError
from specattn.keys import BackendRequest
from specattn.kernels.history_merge import history_merge
from specattn.kernels.prefix_slots import prefix_slots
from specattn.platforms import Platform, use_platform
from specattn.selection import select
from standins import flashinfer as fi_standin

FI_CUDA = Platform("cuda", (9, 0), libraries=frozenset({"flashinfer"}))
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


# --- case builders (also used by the GPU tests) ----------------------------------------------


@dataclass
class DecodeCase:
    runner: DraftRunner
    batch: DraftBatch
    layer: AttentionLayer


def _poisoned_runner(mla: bool, num_slots: int, max_reqs: int, max_ctx: int, page_size: int,
                     dtype: torch.dtype, device, gen: torch.Generator, heads) -> DraftRunner:
    """Pools of NaN except slot 0 (the dummy slot padded lanes use); cases fill real slots."""
    if mla:
        h, rank, rope = heads
        runner = DraftRunner.mla(h, rank, rope, num_layers=2, num_slots=num_slots,
                                 max_reqs=max_reqs, max_context_len=max_ctx,
                                 page_size=page_size, dtype=dtype, device=device)
    else:
        hq, hkv, d = heads
        runner = DraftRunner.mha(hq, hkv, d, num_layers=2, num_slots=num_slots,
                                 max_reqs=max_reqs, max_context_len=max_ctx,
                                 page_size=page_size, dtype=dtype, device=device)
    return poison_pools(runner, gen)


def make_decode_case(*, mla: bool = False, bs: int = 3, topk: int = 2, steps: int = 3,
                     page_size: int = 1, dtype=torch.float32, device="cpu", seed: int = 0,
                     ragged: bool = True, max_len: int = 40, heads=None, scaling=None,
                     logit_cap: float = 0.0, min_len: int = 1) -> DecodeCase:
    """A random draft round: random slots everywhere, NaN in every slot no lane may read."""
    gen = torch.Generator().manual_seed(seed)
    heads = heads or ((4, 64, 16) if mla else (4, 2, 64))
    if ragged:
        seq = torch.randint(min_len, max_len + 1, (bs,), generator=gen)
    else:
        seq = torch.full((bs,), max_len)
    max_reqs = bs + 2
    max_ctx = max_len + topk * steps + 2 * page_size
    n_draft = bs * topk * steps
    num_slots = int(seq.sum()) + n_draft + 17
    runner = _poisoned_runner(mla, num_slots, max_reqs, max_ctx, page_size, dtype, device, gen,
                              heads)
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    rpi = torch.randperm(max_reqs, generator=gen)[:bs]
    r2t = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
    start = 0
    for b in range(bs):
        r2t[rpi[b], :seq[b]] = perm[start:start + seq[b]].to(torch.int32)
        start += int(seq[b])
    fill_slots(runner, perm[:start], gen)
    loc = perm[start:start + n_draft].reshape(bs, topk, steps)
    parents = torch.randint(0, topk, (steps, bs, topk), generator=gen)
    parents[0] = 0
    runner.req_to_token.copy_(r2t.to(device))
    batch = DraftBatch(rpi.to(device), seq.to(device), loc.to(device), parents.to(device))
    if scaling is None:
        width = (heads[1] + heads[2]) if mla else heads[2]
        scaling = 1.0 / math.sqrt(width)
    return DecodeCase(runner, batch, AttentionLayer(1, scaling, logit_cap))


def decode_inputs(case: DecodeCase, gen: torch.Generator):
    """Random ``q, k, v`` for one step (MLA: ``v = None``)."""
    return randn_qkv(case.runner, case.batch.batch_size * case.batch.topk, gen)


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite output (a read of a poisoned slot?)"
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item() + 1e-6
    assert err <= TOL[dtype] * max(scale, 1.0), f"max abs err {err} (ref scale {scale})"


def run_decode_round(backend, case: DecodeCase, seed: int, steps=None, check=True):
    """Init metadata, run each step, compare with torch_ref; returns the outputs."""
    gen = torch.Generator().manual_seed(seed)
    backend.init_forward_metadata(case.batch)
    outs = []
    for step in range(case.batch.num_steps if steps is None else steps):
        q, k, v = decode_inputs(case, gen)
        out = backend.forward(step, case.layer, q, k, v)
        if check:
            ref = reference_decode(case.runner, case.layer, q, case.batch, step,
                                   backend.tree_mode)
            assert_close_rel(out, ref, case.runner.dtype)
        outs.append(out)
    return outs


def next_round(case: DecodeCase) -> DecodeCase:
    """Another round over the same pools: requests reordered, prefixes shortened, draft
    slots shuffled across lanes and steps."""
    b = case.batch
    order = torch.arange(b.batch_size - 1, -1, -1, device=b.seq_lens.device)
    seq = (b.seq_lens[order] - 1).clamp(min=0)
    flat = b.out_cache_loc.reshape(-1)
    perm = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(5))
    loc = flat[perm.to(flat.device)].reshape(b.out_cache_loc.shape)
    parents = b.parents.flip(1).contiguous() if b.parents is not None else None
    batch = DraftBatch(b.req_pool_indices[order], seq, loc, parents)
    return DecodeCase(case.runner, batch, case.layer)


def make_extend_case(*, mla: bool = False, bs: int = 3, dtype=torch.float32, device="cpu",
                     seed: int = 0, max_len: int = 40, max_ext: int = 5, heads=None,
                     ragged: bool = True, page_size: int = 1):
    gen = torch.Generator().manual_seed(seed)
    heads = heads or ((4, 64, 16) if mla else (4, 2, 64))
    ext, seq = extend_lengths(bs, max_len, max_ext, ragged, gen)
    max_reqs, max_ctx = bs + 1, int(seq.max()) + page_size
    num_slots = int(seq.sum()) + 9
    runner = _poisoned_runner(mla, num_slots, max_reqs, max_ctx, page_size, dtype, device, gen,
                              heads)
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    rpi = torch.randperm(max_reqs, generator=gen)[:bs]
    r2t = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
    start, new = 0, []
    for b in range(bs):
        r2t[rpi[b], :seq[b]] = perm[start:start + seq[b]].to(torch.int32)
        prefix = int(seq[b] - ext[b])
        fill_slots(runner, perm[start:start + prefix], gen)
        new.append(perm[start + prefix:start + seq[b]])
        start += int(seq[b])
    runner.req_to_token.copy_(r2t.to(device))
    batch = DraftExtendBatch(rpi.to(device), seq.to(device), ext.to(device),
                             torch.cat(new).to(device))
    width = (heads[1] + heads[2]) if mla else heads[2]
    return DecodeCase(runner, batch, AttentionLayer(0, 1.0 / math.sqrt(width)))


def extend_inputs(case: DecodeCase, gen: torch.Generator):
    return randn_qkv(case.runner, int(case.batch.extend_lens.sum()), gen)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FlashInfer replaced by the stand-in, on a fake sm90 platform with the library."""
    fi = fi_standin.make()
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    from specattn.backends.flashinfer import _passes, _prefill_plan, _replan

    # The stand-in computes in float32, so the glue is checked at fp32 tolerance too.
    for cls in (FlashInferDecode, FlashInferExtend, FlashInferMLADecode, FlashInferMLAExtend):
        monkeypatch.setattr(cls, "dtypes", cls.dtypes + (torch.float32,))
    monkeypatch.setattr(_passes, "_WORKSPACE_BYTES", 16)
    monkeypatch.setattr(_passes, "_WORKSPACES", {})
    # The stand-in's FA2 planner counts fi_standin.SMS SMs (the CPU has none).
    monkeypatch.setattr(_prefill_plan, "sm_count", lambda device: fi_standin.SMS)
    monkeypatch.setattr(_replan, "sm_count", lambda device: fi_standin.SMS)
    with use_platform(FI_CUDA):
        yield fi


# --- import, selection, availability ----------------------------------------------------------


def test_imports_without_flashinfer():
    code = ("import sys, specattn.backends, specattn.backends.flashinfer as m; "
            "assert 'flashinfer' not in sys.modules; print(m.FlashInferDecode.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "flashinfer"


@pytest.mark.parametrize("kind, mla, cls", [
    ("decode", False, FlashInferDecode), ("decode", True, FlashInferMLADecode),
    ("extend", False, FlashInferExtend), ("extend", True, FlashInferMLAExtend)])
def test_selection_picks_flavour(kind, mla, cls):
    request = BackendRequest(kind=kind, mla=mla, topk=4, num_steps=3)
    assert select(kind, "flashinfer", request, FI_CUDA).backend is cls


def test_selection_without_library_names_package():
    request = BackendRequest(kind="decode", topk=4, num_steps=3)
    with pytest.raises(BackendUnavailableError, match="flashinfer-python"):
        select("decode", "flashinfer", request, Platform("cuda", (9, 0), libraries=frozenset()))


@pytest.mark.parametrize("cls", [FlashInferDecode, FlashInferMLADecode])
def test_construct_on_cpu_raises(cls):
    case = make_decode_case(mla=cls is FlashInferMLADecode)
    with use_platform(Platform("cpu", libraries=frozenset({"flashinfer"}))):
        with pytest.raises(BackendUnavailableError, match="needs CUDA"):
            cls(case.runner, 2, 3)


def test_unknown_mode_rejected(fake_flashinfer):
    case = make_decode_case()
    with pytest.raises(InvalidInputError, match="mode"):
        FlashInferDecode(case.runner, 2, 3, mode="cascade")


@pytest.mark.parametrize("d,v", [(64, 32), (32, 32)])
def test_values_under_64_wide_are_refused(fake_flashinfer, d, v):
    """FlashInfer's prefill kernels have no tile for values under 64 wide (on the H200 the
    call failed with "Invalid configuration"): both kinds refuse the runner at
    construction, naming the widths."""
    runner = DraftRunner.mha(4, 2, d, v, num_layers=1, num_slots=8, max_reqs=2,
                             max_context_len=4, dtype=torch.bfloat16, device="cpu")
    for make in (lambda: FlashInferDecode(runner, 2, 3), lambda: FlashInferExtend(runner)):
        with pytest.raises(BackendUnavailableError,
                           match=rf"at least 64 wide; the model has v_head_dim {v} "
                                 rf"\(head_dim {d}\)"):
            make()


# --- slot-list helpers ------------------------------------------------------------------------


def test_host_indptr():
    assert host_indptr(torch.tensor([3, 0, 2])).tolist() == [0, 3, 3, 5]
    assert host_indptr(torch.tensor([3])).dtype == torch.int32
    assert host_arange(3, 4).tolist() == [0, 4, 8, 12]
    csr = host_csr(host_arange(3, 2), torch.tensor([5, 1, 7]), 2)
    assert csr.kv_indptr.tolist() == [0, 5, 6, 13] and csr.kv_lens.tolist() == [5, 1, 7]
    assert csr.kv_lens.dtype == torch.int32 and (csr.total, csr.max_q) == (13, 2)


@pytest.mark.parametrize("m", [0, 1, 5, KeptCSR.LIST_SUMS, KeptCSR.LIST_SUMS + 1, 40])
def test_kept_csr_fill_matches_host_csr(m):
    """A kept CSR (Python sums up to ``LIST_SUMS`` sequences, numpy's above) holds what
    ``host_csr`` builds, round after round in the same buffers, with query lengths or a
    given query indptr."""
    gen = torch.Generator().manual_seed(m)
    with_qo, given = KeptCSR(m, with_qo=True), KeptCSR(m)
    fields = ("qo_indptr", "kv_indptr", "kv_lens", "total", "max_q", "rows", "max_kv")
    for _ in range(2):
        kv = torch.randint(1, 5000, (m,), generator=gen)
        q = torch.randint(1, 9, (m,), generator=gen)
        max_q = int(q.max()) if m else 0
        want = host_csr(host_indptr(q), kv, max_q)
        for got in (with_qo.fill(kv.numpy(), qo_lens=q.numpy()),
                    given.fill(kv.numpy(), qo_indptr=want.qo_indptr, max_q=max_q)):
            for name in fields:
                a, b = getattr(got, name), getattr(want, name)
                assert (a.tolist() == b.tolist() and a.dtype == torch.int32) if \
                    isinstance(b, torch.Tensor) else a == b, (name, a, b)


@pytest.mark.parametrize("padded, many", [(0, False), (2, False), (3, True)])
def test_prefix_slots_kernel_matches_fill_ragged_slots(padded, many):
    """The one-launch prefix slot list (Triton interpreter) equals ``fill_ragged_slots``
    (slots clamped into the pool), through strided index tensors, also past one block of
    lengths (``many``: 70 requests); with ``fixed`` it also copies the batch into the fixed
    buffers, the requests past it padded (row 0, length 1, slot 0); with ``csr`` it writes
    the list's ``kv_indptr`` and lengths (as ``host_csr``), with ``qo`` the query indptr of
    strided extend lengths (padding requests: none); nothing is written past ``total``."""
    gen = torch.Generator().manual_seed(3)
    r2t = torch.randint(-5, 1100, (6, 700), generator=gen, dtype=torch.int32)
    rows = torch.tensor([[4, 9], [1, 9], [5, 9], [0, 9]])[:, 0]  # stride 2
    lens = torch.tensor([[3, 0], [600, 0], [0, 0], [700, 0]])[:, 0]
    if many:
        rows = torch.randint(0, 6, (70,), generator=gen)
        lens = torch.randint(0, 40, (70,), generator=gen)
    raw = rows.shape[0]
    loc = torch.randint(0, 1000, (raw, 3, 5), generator=gen)
    bs = raw + padded
    all_rows = torch.cat([rows, torch.zeros(padded, dtype=rows.dtype)])
    all_lens = torch.cat([lens, torch.ones(padded, dtype=lens.dtype)])
    total = int(all_lens.sum())
    want = torch.full((total + 8,), -1, dtype=torch.int32)
    fill_ragged_slots(want, total, r2t, all_rows, all_lens, num_slots=1000)
    got = torch.full((total + 8,), -1, dtype=torch.int32)
    fixed = None
    if padded:
        fixed = (torch.full((bs,), -1), torch.full((bs,), -1), torch.full((bs, 3, 5), -1))
    csr = (torch.full((bs + 1,), -1, dtype=torch.int32), torch.full((bs,), -1, dtype=torch.int32))
    ext = torch.randint(0, 9, (raw, 3), generator=gen)[:, 1]  # stride 3
    qo = torch.full((bs + 1,), -1, dtype=torch.int32)
    prefix_slots(got, total, int(all_lens.max()), r2t, rows, lens, 1000, bs=bs,
                 fixed=fixed, loc=loc if padded else None, csr=csr, qo=(ext, qo))
    assert torch.equal(got, want)
    host = host_csr(host_arange(bs, 1), all_lens, 1)
    assert torch.equal(csr[0], host.kv_indptr) and torch.equal(csr[1], host.kv_lens)
    assert torch.equal(qo, host_indptr(torch.cat([ext, torch.zeros(padded, dtype=ext.dtype)])))
    if padded:
        assert fixed[0].tolist() == rows.tolist() + [0] * padded
        assert fixed[1].tolist() == lens.tolist() + [1] * padded
        assert torch.equal(fixed[2][:raw], loc) and not fixed[2][raw:].any()
    short = torch.full((total,), -1, dtype=torch.int32)  # a host total below the lengths
    prefix_slots(short, 10, int(all_lens.max()), r2t, rows, lens, 1000)
    assert torch.equal(short[:10], want[:10]) and (short[10:] == -1).all()


@pytest.mark.parametrize("many", [False, True])
def test_prefix_slots_copies_an_extends_new_token_slots(many):
    """With ``ext_loc`` (an extend graph round) the launch also copies the caller's
    new-token slots (strided) into the fixed buffer, request-major, past one block of
    lengths too (``many``), every position of a long request's tiles; never more than the
    caller's tokens (lengths on the device that sum past them write nothing beyond)."""
    gen = torch.Generator().manual_seed(5)
    r2t = torch.randint(0, 1000, (6, 700), generator=gen, dtype=torch.int32)
    rows = torch.tensor([4, 1, 5, 0])
    lens = torch.tensor([3, 600, 1, 700])
    ext = torch.tensor([2, 520, 1, 3])  # 520 new tokens: past one 512-position tile
    if many:
        rows = torch.randint(0, 6, (70,), generator=gen)
        lens = torch.randint(1, 40, (70,), generator=gen)
        ext = torch.minimum(torch.randint(1, 6, (70,), generator=gen), lens)
    bs, tokens = rows.shape[0], int(ext.sum())
    total = int(lens.sum())
    loc = torch.randint(0, 1000, (tokens, 2), generator=gen)[:, 0]  # stride 2
    csr = (torch.zeros(bs + 1, dtype=torch.int32), torch.zeros(bs, dtype=torch.int32))
    qo = torch.zeros(bs + 1, dtype=torch.int32)
    fixed = torch.full((tokens + 5,), -1)
    out = torch.full((total,), -1, dtype=torch.int32)
    prefix_slots(out, total, int(lens.max()), r2t, rows, lens, 1000, csr=csr, qo=(ext, qo),
                 ext_loc=(loc, fixed[:tokens]))
    assert torch.equal(fixed[:tokens], loc) and (fixed[tokens:] == -1).all()
    fixed.fill_(-1)
    prefix_slots(out, total, int(lens.max()), r2t, rows, lens, 1000, csr=csr, qo=(ext, qo),
                 ext_loc=(loc[:tokens - 2], fixed[:tokens - 2]))
    assert torch.equal(fixed[:tokens - 2], loc[:tokens - 2]) and (fixed[tokens - 2:] == -1).all()


def test_prefix_slots_kept_launch_serves_rounds_of_other_lengths():
    """With ``kept``, one launch per signature and grid: the tile count is rounded to a power
    of two, so rounds whose longest prefix needs 2 tiles (600, 1000 positions) share one kept
    launch, one of 3 tiles (1100) takes the 4-tile one; every list equals
    ``fill_ragged_slots``."""
    gen = torch.Generator().manual_seed(8)
    r2t = torch.randint(0, 1100, (4, 1200), generator=gen, dtype=torch.int32)
    rows = torch.tensor([2, 0, 3])
    out = torch.full((3000,), -1, dtype=torch.int32)
    kept: dict = {}
    launches = []
    for lens in ([600, 3, 40], [1000, 7, 900], [5, 1100, 2]):
        lens = torch.tensor(lens)
        total = int(lens.sum())
        want = torch.full((3000,), -1, dtype=torch.int32)
        fill_ragged_slots(want, total, r2t, rows, lens, num_slots=1000)
        out.fill_(-1)
        prefix_slots(out, total, int(lens.max()), r2t, rows.clone(), lens, 1000, kept=kept)
        assert torch.equal(out, want)
        launches.append(list(kept.values()))
    assert len(launches[0]) == 1 and launches[1] == launches[0]
    assert len(launches[2]) == 2 and launches[2][0] is launches[0][0]
    assert {k[4] for k in kept} == {2, 4}  # the grid's tiles


@pytest.mark.parametrize("with_history", [False, True])
def test_fill_ragged_slots_matches_loop(with_history):
    gen = torch.Generator().manual_seed(1)
    r2t = torch.randint(0, 1000, (6, 20), generator=gen, dtype=torch.int32)
    rows = torch.tensor([4, 1, 1, 0, 5])
    plen = torch.tensor([3, 0, 20, 7, 1])
    hist = torch.randint(0, 1000, (5, 2), generator=gen) if with_history else None
    expect = []
    for m in range(5):
        expect += r2t[rows[m], :plen[m]].tolist()
        expect += hist[m].tolist() if with_history else []
    out = torch.full((len(expect) + 4,), -1, dtype=torch.int32)
    got = fill_ragged_slots(out, len(expect), r2t, rows, plen, hist)
    assert got.tolist() == expect
    assert out[len(expect):].tolist() == [-1] * 4  # nothing past total
    if with_history:
        pos = history_positions(plen, 2)
        assert out[pos].tolist() == hist.reshape(-1).tolist()


def test_graph_prefill_plan_arguments(monkeypatch):
    """Graph-mode prefill plans: ``uniform_q_len`` when the rows per sequence are fixed;
    split-KV off only once ``seqs x H_kv`` fills the SMs (H200: 132)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: types.SimpleNamespace(multi_processor_count=132))
    gpu = types.SimpleNamespace(device="cuda", num_kv_heads=8)
    assert _graph_split_kwargs(gpu, 8, 32) == {"uniform_q_len": 8, "disable_split_kv": True}
    assert _graph_split_kwargs(gpu, 4, 16) == {"uniform_q_len": 4}  # 128 CTAs < 132 SMs
    assert _graph_split_kwargs(gpu, None, 17) == {"disable_split_kv": True}
    cpu = types.SimpleNamespace(device="cpu", num_kv_heads=8)
    assert _graph_split_kwargs(cpu, 3, 100) == {"uniform_q_len": 3}


# --- glue against torch_ref (stand-in kernels) -----------------------------------------------


@pytest.mark.parametrize("topk, mode, tree_mode, page_size", [
    (1, "shared", "lane", 1), (3, "shared", "lane", 1), (3, "shared", "path", 16),
    (3, "per-branch", "lane", 16), (3, "per-branch", "path", 1), (1, "shared", "path", 16)])
def test_decode_mha_matches_reference(fake_flashinfer, topk, mode, tree_mode, page_size):
    case = make_decode_case(topk=topk, page_size=page_size, seed=topk + page_size)
    backend = FlashInferDecode(case.runner, topk, 3, tree_mode=tree_mode, mode=mode)
    run_decode_round(backend, case, seed=7)
    # A second round on the same object re-plans from fresh metadata.
    run_decode_round(backend, next_round(case), seed=8, steps=2)


def test_decode_mha_learns_scale_and_soft_cap_from_the_layer(fake_flashinfer):
    case = make_decode_case(topk=2, dtype=torch.bfloat16, logit_cap=5.0, scaling=0.3)
    backend = FlashInferDecode(case.runner, 2, 3)
    run_decode_round(backend, case, seed=3)
    assert backend.params == (0.3, 5.0)  # learned from the layer and re-planned


@pytest.mark.parametrize("topk, tree_mode", [(1, "lane"), (3, "path"), (2, "lane")])
def test_decode_mla_matches_reference(fake_flashinfer, topk, tree_mode):
    case = make_decode_case(mla=True, topk=topk, seed=topk)
    backend = FlashInferMLADecode(case.runner, topk, 3, tree_mode=tree_mode)
    run_decode_round(backend, case, seed=5)


def test_decode_mla_rejects_soft_cap(fake_flashinfer):
    case = make_decode_case(mla=True, logit_cap=3.0)
    backend = FlashInferMLADecode(case.runner, 2, 3)
    backend.init_forward_metadata(case.batch)
    q, k, _ = decode_inputs(case, torch.Generator().manual_seed(0))
    with pytest.raises(InvalidInputError, match="logit_cap"):
        backend.forward(0, case.layer, q, k, None)


@pytest.mark.parametrize("mla", [False, True])
def test_extend_matches_reference(fake_flashinfer, mla):
    for seed, ragged in ((0, True), (1, False)):
        case = make_extend_case(mla=mla, seed=seed, ragged=ragged)
        cls = FlashInferMLAExtend if mla else FlashInferExtend
        backend = cls(case.runner)
        backend.init_forward_metadata(case.batch)
        q, k, v = extend_inputs(case, torch.Generator().manual_seed(seed))
        out = backend.forward(case.layer, q, k, v)
        assert_close_rel(out, reference_extend(case.runner, case.layer, q, case.batch),
                         case.runner.dtype)


@pytest.mark.parametrize("mla", [False, True])
def test_extend_graph_buffers_replay(fake_flashinfer, mla):
    """Extend under the graph protocol: capture plans a graph-mode pass on fixed buffers;
    a replay with another split of the same tokens reuses it and matches torch_ref; an
    uncaptured batch size and a batch over the buffers are refused."""
    cls = FlashInferMLAExtend if mla else FlashInferExtend
    case = make_extend_case(mla=mla, seed=3, ragged=True)
    backend = cls(case.runner)
    b = case.batch
    tokens = int(b.extend_lens.sum())
    backend.init_cuda_graph_state(max_bs=b.batch_size, max_num_tokens=tokens)
    backend.init_forward_metadata_capture_cuda_graph(b)
    p = backend._graphs[b.batch_size]
    assert p.wrapper.use_cuda_graph
    order = torch.arange(b.batch_size - 1, -1, -1)
    starts = torch.cumsum(b.extend_lens, 0) - b.extend_lens
    loc = torch.cat([b.out_cache_loc[starts[i]:starts[i] + b.extend_lens[i]] for i in order])
    other = DraftExtendBatch(b.req_pool_indices[order], b.seq_lens[order],
                             b.extend_lens[order], loc)
    backend.init_forward_metadata_replay_cuda_graph(other, b.batch_size)
    assert backend._graphs[b.batch_size] is p and backend._pass is p
    q, k, v = extend_inputs(case, torch.Generator().manual_seed(9))
    out = backend.forward(case.layer, q, k, v)
    assert_close_rel(out, reference_extend(case.runner, case.layer, q, other),
                     case.runner.dtype)
    half = DraftExtendBatch(b.req_pool_indices[:1], b.seq_lens[:1], b.extend_lens[:1],
                            b.out_cache_loc[:int(b.extend_lens[0])])
    with pytest.raises(InvalidInputError, match="captured"):
        backend.init_forward_metadata_replay_cuda_graph(half, 1)
    backend.init_cuda_graph_state(max_bs=1, max_num_tokens=1)
    with pytest.raises(InvalidInputError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_capture_cuda_graph(b)


@pytest.mark.parametrize("mla, topk, tree_mode", [(False, 3, "path"), (False, 1, "lane"),
                                                  (True, 2, "lane")])
def test_graph_buffers_replay_with_padding(fake_flashinfer, mla, topk, tree_mode):
    """Capture at bs=4, replay with 3 real requests padded to 4: real lanes match."""
    cls = FlashInferMLADecode if mla else FlashInferDecode
    case = make_decode_case(mla=mla, bs=4, topk=topk, seed=11)
    backend = cls(case.runner, topk, 3, tree_mode=tree_mode)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * topk)
    backend.init_forward_metadata_capture_cuda_graph(case.batch)
    rnd = backend._graphs[4]
    wrappers = [p.wrapper for p in ([rnd.prefix] if rnd.prefix else []) + rnd.steps[:2]]
    assert all(w.use_cuda_graph for w in wrappers)
    if rnd.prefix is not None and not mla:  # the prefix tile fits K rows per request
        assert rnd.prefix.wrapper.uniform_q_len == topk
    # Replay: a fresh 3-request batch over the same pools; path mode reads the parents
    # tensor given at capture, into which the replay batch's parents are copied.
    b = case.batch
    parents = torch.randint(0, topk, (3, 3, topk), generator=torch.Generator().manual_seed(4))
    small = DraftBatch(b.req_pool_indices[[2, 0, 3]], b.seq_lens[[2, 0, 3]],
                       b.out_cache_loc[[2, 0, 3]], parents)
    backend.init_forward_metadata_replay_cuda_graph(small, 4)
    assert backend._graphs[4] is rnd and all(w is p.wrapper for w, p in zip(
        wrappers, ([rnd.prefix] if rnd.prefix else []) + rnd.steps[:2]))
    gen = torch.Generator().manual_seed(2)
    for step in range(2):
        q, k, v = decode_inputs(case, gen)
        out = backend.forward(step, case.layer, q, k, v)
        real = DraftBatch(small.req_pool_indices, small.seq_lens, small.out_cache_loc,
                          parents)
        ref = reference_decode(case.runner, case.layer, q[:3 * topk], real, step, tree_mode)
        assert_close_rel(out[:3 * topk], ref, case.runner.dtype)
    with pytest.raises(InvalidInputError, match="captured batch size"):
        backend.init_forward_metadata_replay_cuda_graph(small, 3)


@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("mla", [False, True])
def test_shared_mode_plans_prefix_once_per_round(fake_flashinfer, mla, topk):
    """Shared mode: one FlashInfer plan per round (the prefix pass), whatever the number of
    steps, lanes (``K`` 1 included) or batch size; the history needs no pass of its own; the
    eager plan gives no graph hint."""
    case = make_decode_case(mla=mla, topk=topk, seed=21)
    cls = FlashInferMLADecode if mla else FlashInferDecode
    backend = cls(case.runner, topk, 3)
    run_decode_round(backend, case, seed=1, steps=2)
    run_decode_round(backend, next_round(case), seed=2, steps=1)
    rnd = backend._eager
    assert rnd.steps == [] and rnd.prefix.wrapper.plans == 2
    if not mla:
        assert rnd.prefix.wrapper.uniform_q_len is None
    b = case.batch
    smaller = DraftBatch(b.req_pool_indices[:2], b.seq_lens[:2], b.out_cache_loc[:2],
                         b.parents[:, :2])
    run_decode_round(backend, DecodeCase(case.runner, smaller, case.layer), seed=3, steps=1)
    assert rnd.prefix.wrapper.plans == 3


# --- the fused history + merge kernel (Triton; the interpreter on CPU) -------------------------


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_history_merge_reads_fp8_codes_with_the_scales(fp8):
    """FP8 pools: history keys ``code * k_scale`` (folded into ``scale``), values
    ``code * v_scale``; the prefix state is given in values."""
    gen = torch.Generator().manual_seed(7)
    lanes, hq, hkv, d, n, slots, plen = 4, 4, 2, 16, 3, 24, 5
    ks, vs = 0.37, 1.9
    q = torch.randn(lanes, hq, d, generator=gen).bfloat16()
    k_pool = (torch.randn(slots, hkv, d, generator=gen) / ks).to(fp8)
    v_pool = (torch.randn(slots, hkv, d, generator=gen) / vs).to(fp8)
    hist = torch.randperm(slots, generator=gen)[:lanes * n].reshape(lanes, n)
    pk, pv = torch.randn(lanes, plen, hkv, d, generator=gen), torch.randn(lanes, plen, hkv, d,
                                                                          generator=gen)
    o_p, lse_p, want = torch.zeros(lanes, hq, d, dtype=torch.bfloat16), torch.zeros(lanes, hq), []
    for i in range(lanes):
        o, lse_p[i] = _attend_rows(q[i], pk[i], pv[i], 0.3, 0.0)
        o_p[i] = o.bfloat16()
        k_all = torch.cat([pk[i], k_pool[hist[i]].float() * ks])
        v_all = torch.cat([pv[i], v_pool[hist[i]].float() * vs])
        want.append(_attend_rows(q[i], k_all, v_all, 0.3, 0.0)[0])
    out = history_merge(q, k_pool, v_pool, hist, o_p, lse_p, 0.3 * ks, 0.0, v_scale=vs)
    assert_close_rel(out, torch.stack(want).bfloat16(), torch.bfloat16)


@pytest.mark.parametrize("tensor_scales", [False, True], ids=["floats", "device-tensors"])
@pytest.mark.parametrize("topk", [1, 2], ids=["one-pass", "shared-prefix"])
def test_fp8_scales_go_to_flashinfer_as_floats_or_into_the_query(fake_flashinfer, monkeypatch,
                                                                 tensor_scales, topk):
    """FlashInfer reads ``k_scale`` / ``v_scale`` on the host: Python floats are its run
    arguments; device tensors never reach it (folded into q and the output instead)."""
    from specattn.fp8 import scale_rows
    from specattn.testing.rounds import ModelShape, RoundMaker, random_qkv

    calls = []
    original = fi_standin.FakePrefill.run

    def run(self, q, kv, **kw):
        calls.append((q.clone(), kw))
        return original(self, q, kv, **kw)

    monkeypatch.setattr(fi_standin.FakePrefill, "run", run)
    ks, vs = (torch.tensor([0.37]), torch.tensor([1.9])) if tensor_scales else (0.37, 1.9)
    gen = torch.Generator().manual_seed(3)
    maker = RoundMaker(ModelShape("mha", (4, 2, 64)), torch.bfloat16, torch.device("cpu"), 1,
                       40, 4, gen, kv_cache_dtype="fp8_e4m3", k_scale=ks, v_scale=vs)
    rnd = maker.decode([9, 17, 3], topk, 3)
    backend = FlashInferDecode(maker.runner, topk, 3)
    backend.init_forward_metadata(rnd.batch)
    layer = AttentionLayer(0, 0.25, k_scale=ks, v_scale=vs)
    q, k, v = random_qkv(maker.runner, rnd.lanes, gen)
    out = backend.forward(0, layer, q, k, v)
    (q_seen, kw), = calls
    kw.pop("return_lse", None)  # the shared-prefix pass asks for its LSE
    if tensor_scales:
        assert kw == {"k_scale": 1.0, "v_scale": 1.0}
        assert torch.equal(q_seen, scale_rows(q, ks))
    else:
        assert kw == {"k_scale": 0.37, "v_scale": 1.9} and torch.equal(q_seen, q)
    ref = reference_decode(maker.runner, layer, q, rnd.batch, 0)
    assert_close_rel(out, ref, torch.bfloat16)


def _attend_rows(q, k, v, scale, cap):
    """q: [H, D]; k: [n, H_kv, D]; v: [n, H_kv, Dv] -> (o [H, Dv], lse base 2 [H]) in fp32."""
    group = q.shape[0] // k.shape[1]
    s = torch.einsum("hd,nhd->hn", q.float(), k.float().repeat_interleave(group, 1)) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    o = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v.float().repeat_interleave(group, 1))
    return o, torch.logsumexp(s, -1) / math.log(2)


@pytest.mark.parametrize("dtype, heads, d, dv, cap, plen", [
    (torch.float32, (4, 2), 16, 16, 0.0, 5), (torch.float32, (8, 1), 24, 16, 3.0, 7),
    (torch.bfloat16, (3, 3), 8, 8, 0.0, 4), (torch.float16, (4, 1), 80, 64, 0.0, 6),
    (torch.float32, (2, 2), 16, 16, 0.0, 0)], ids=["gqa", "mla-like-cap", "bf16-mha",
                                                   "fp16-tail", "empty-prefix"])
@pytest.mark.parametrize("new_kv", [False, True], ids=["pool", "new-kv"])
def test_history_merge_matches_softmax_over_prefix_and_history(dtype, heads, d, dv, cap, plen,
                                                               new_kv):
    """One softmax over a prefix (given as its o and base-2 LSE) plus history slots read
    through strided views; NaN in every pool slot no lane reads. ``new_kv``: the last slot's
    K/V come from the call (NaN in the pool before) and the kernel stores them there."""
    gen = torch.Generator().manual_seed(plen + d)
    (hq, hkv), lanes, n, slots = heads, 5, 3, 40
    q = torch.randn(lanes, hq, d, generator=gen).to(dtype)
    pool = torch.full((slots, hkv, d + dv), float("nan"), dtype=dtype)
    hist = torch.randperm(slots - 1, generator=gen)[:lanes * (n + 1)].reshape(lanes, n + 1) + 1
    hist = hist[:, :n]  # a strided view, as the glue passes it
    pool[hist.reshape(-1)] = torch.randn(lanes * n, hkv, d + dv, generator=gen).to(dtype)
    k_pool, v_pool = pool[..., :d], pool[..., d:]
    pk = torch.randn(lanes, plen, hkv, d, generator=gen).to(dtype)
    pv = torch.randn(lanes, plen, hkv, dv, generator=gen).to(dtype)
    o_p = torch.zeros(lanes, hq, dv, dtype=dtype)
    lse_p = torch.full((lanes, hq), float("-inf"))
    want = []
    for i in range(lanes):
        if plen:
            o, lse = _attend_rows(q[i], pk[i], pv[i], 0.3, cap)
            o_p[i], lse_p[i] = o.to(dtype), lse
        k_all = torch.cat([pk[i], k_pool[hist[i]]])
        v_all = torch.cat([pv[i], v_pool[hist[i]]])
        want.append(_attend_rows(q[i], k_all, v_all, 0.3, cap)[0])
    kv_new = None
    if new_kv:
        kv_new = pool[hist[:, -1]].clone()
        pool[hist[:, -1]] = float("nan")
    out = history_merge(q, k_pool, v_pool, hist, o_p, lse_p, 0.3, cap,
                        *((kv_new[..., :d], kv_new[..., d:]) if new_kv else ()))
    assert_close_rel(out, torch.stack(want).to(dtype), dtype)
    if new_kv:
        torch.testing.assert_close(pool[hist[:, -1]], kv_new, rtol=0, atol=0)
