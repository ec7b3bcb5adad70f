"""The sm90 MLA plans of the ``triton`` backend (``gluon-wl``, ``gluon-split``, ``cute``, and
the default table's choice) against ``torch_ref``: K 1/2/4/8, H 16/128, page 1/64,
lane/path, ragged, prefixes from 0, logit cap, bf16/fp16, direct output (one split) and
merged splits; CUDA-graph capture/replay of padded batches; a 100-batch random stress loop
(in 4 tests, so xdist workers compile side by side). Outputs and partials are NaN-poisoned
before each call. Every test asserts an sm90 kernel ran (``SPECATTN_SM90_PLANS``:
comma-separated variants to run; default all; ``cute`` only where CuTe-DSL imports).

FP8 pools (``fp8_e4m3`` / ``fp8_e5m2``, ``k_scale`` != 1 as a float or a device tensor) on
the Gluon plans (``default``, ``gluon-wl``, ``gluon-split``; ``cute`` reads bf16/fp16 pools
only): against ``torch_ref`` over the dequantized pool, with the pool checked to hold
torch's codes of each step's keys; a sibling lane unharmed by a NaN code in a lane's
history; a captured graph replayed after its scale tensor changed. Marked ``gpu``."""

from __future__ import annotations

import os
import random
import sys
import zlib

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import (check_replayed_lanes, close, decode_sizes, place_decode_round,  # noqa: E402
                     randn_qkv)
from specattn.backends.torch_ref import reference_decode  # noqa: E402
from specattn.data import AttentionLayer, DraftRunner  # noqa: E402
from specattn.fp8 import quantize, read_rows, write_rows  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _variants() -> list:
    """``default`` (the table's choice: ``gluon-wl`` at one 64-row tile, ``cute`` above) and
    each sm90 plan forced."""
    every = ["default", "gluon-wl", "gluon-split", "cute"]
    names = os.environ.get("SPECATTN_SM90_PLANS")
    return names.split(",") if names else every


VARIANT_NAMES = _variants() if torch.cuda.is_available() else ["default"]


def _require(variant):
    from specattn.backends.triton.plans import cute_import_reason

    if variant == "cute" and cute_import_reason() is not None:
        pytest.skip(cute_import_reason())


def make_round(dtype, heads, topk, steps, page, lens, tree_mode):
    """An MLA runner (random pool) and a decode round laid out by ``metadata``."""
    slots, max_ctx = decode_sizes(lens, topk, steps, page)
    r = DraftRunner.mla(heads, 512, 64, num_layers=1, num_slots=slots, max_reqs=len(lens) + 3,
                        max_context_len=max_ctx, page_size=page, dtype=dtype, device=DEV)
    r.kv_buffer[0].normal_()
    return r, place_decode_round(r, lens, topk, steps, page, tree_mode)


def make_backend(r, topk, steps, tree_mode, variant, num_splits=None):
    from specattn.backends.triton import TritonDecode

    _require(variant)
    return TritonDecode(r, topk, steps, tree_mode=tree_mode, num_splits=num_splits,
                        plan=None if variant == "default" else variant)


def _sm90(backend) -> bool:
    from specattn.backends.triton.plans import SM90_KERNELS

    return backend.plan.kernel in SM90_KERNELS


def poisoned_forward(backend, step, layer, q, k):
    """``forward`` with NaN in the partials and in the memory the output will reuse."""
    bait = torch.full((q.shape[0], q.shape[1], 512), float("nan"), dtype=q.dtype,
                      device=DEV)
    del bait  # the caching allocator hands this block to the output next
    backend._active.mid_o.fill_(float("nan"))
    backend._active.mid_lse.fill_(float("nan"))
    return backend.forward(step, layer, q, k, None)


def run_round(r, batch, backend, layer, tree_mode, gen, check_steps=None):
    """One eager round on an sm90 plan: each step's keys are in the pool (an FP8 pool:
    torch's codes of them), its outputs match ``torch_ref`` at ``check_steps``."""
    bs, topk, steps = batch.out_cache_loc.shape
    backend.init_forward_metadata(batch)
    assert _sm90(backend), backend.plan
    pool = r.kv_buffer[0]
    for step in range(steps):
        if tree_mode == "path" and step:
            batch.parents[step] = torch.randint(0, topk, (bs, topk), device=DEV)
        q, k, _ = randn_qkv(r, bs * topk, gen)
        out = poisoned_forward(backend, step, layer, q, k)
        slots = batch.out_cache_loc[:, :, step].reshape(-1).long()
        got = read_rows(pool, slots)
        if pool.dtype != k.dtype:  # FP8: compare codes as bytes (NaN codes included)
            codes = quantize(k, layer.k_scale, pool.dtype)
            got, k = got.view(torch.uint8), codes.view(torch.uint8)
        assert torch.equal(got, k), "the step's keys are not in the pool"
        if check_steps is None or step in check_steps:
            close(out, reference_decode(r, layer, q, batch, step, tree_mode), r.dtype)


CASES = [
    # dtype, H, lens, K, S, P, tree_mode, logit_cap, num_splits
    (torch.bfloat16, 16, "ragged:4:4096", 4, 5, 1, "path", 30.0, None),
    (torch.bfloat16, 16, "uniform:4:4096", 4, 5, 64, "lane", 0.0, None),
    (torch.float16, 16, "ragged:3:2048", 1, 3, 1, "lane", 0.0, None),
    (torch.bfloat16, 16, "ragged:3:1500", 2, 4, 64, "path", 0.0, None),
    (torch.bfloat16, 16, "ragged:2:1024", 8, 3, 1, "path", 0.0, None),
    (torch.bfloat16, 128, "ragged:2:1024", 2, 3, 1, "lane", 0.0, None),
    (torch.float16, 128, "ragged:2:700", 1, 2, 64, "path", 0.0, None),
    (torch.bfloat16, 16, "short", 4, 3, 1, "path", 0.0, None),
    (torch.bfloat16, 16, "short", 8, 2, 64, "lane", 30.0, 16),
    (torch.bfloat16, 16, "ragged:3:3000", 4, 3, 1, "lane", 0.0, 1),
    (torch.float16, 128, "ragged:3:3000", 2, 3, 1, "path", 0.0, 16),
]


def lengths(spec: str) -> list[int]:
    if spec == "short":
        return [0, 1, 2, 63, 64, 65]
    kind, b, L = spec.split(":")
    b, L = int(b), int(L)
    return [random.randint(L // 2, 3 * L // 2) if kind == "ragged" else L for _ in range(b)]


@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("dtype,H,lens,K,S,P,tree_mode,cap,num_splits", CASES)
def test_decode_vs_reference(variant, dtype, H, lens, K, S, P, tree_mode, cap, num_splits):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((H, lens, K, S, P)).encode()))
    r, batch = make_round(dtype, H, K, S, P, lengths(lens), tree_mode)
    backend = make_backend(r, K, S, tree_mode, variant, num_splits)
    big = lens.endswith("4096")
    run_round(r, batch, backend, AttentionLayer(0, 576 ** -0.5, cap), tree_mode, gen,
              check_steps={0, S - 1} if big else None)
    if variant == "default":  # the work list where a request's rows fit one 64-row tile
        assert (backend.plan.name == "gluon-wl") == (K * H <= 64), backend.plan


def capture_steps(backend, layer, qs):
    """Run the S steps once on a side stream (compiling outside the capture), then capture
    them in one CUDA graph: ``(graph, outs)``."""
    S = len(qs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in range(S):
            backend.forward(step, layer, *qs[step], None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    outs = [None] * S
    with torch.cuda.graph(graph):
        for step in range(S):
            outs[step] = backend.forward(step, layer, *qs[step], None)
    return graph, outs


def replay_new_round(r, batch, backend, r2, b2, real, max_bs, qs, outs, graph, gen,
                     tree_mode):
    """Copy another runner's round (``r2``, ``b2``: ``real`` requests) into the captured
    runner and batch, padded to ``max_bs``, with new q/k (and parents), NaN-poisoned
    outputs; replay the graph."""
    dtype = qs[0][0].dtype
    K = batch.out_cache_loc.shape[1]
    r.req_to_token.zero_()
    r.req_to_token[:r2.max_reqs, :r2.max_context_len] = r2.req_to_token
    r.kv_buffer[0].view(torch.uint8)[:r2.num_slots] = r2.kv_buffer[0].view(torch.uint8)
    batch.seq_lens.fill_(backend.get_cuda_graph_seq_len_fill_value())
    batch.seq_lens[:real] = b2.seq_lens
    batch.req_pool_indices.zero_()
    batch.req_pool_indices[:real] = b2.req_pool_indices
    batch.out_cache_loc.fill_(r.num_slots - 1)  # padded lanes: a slot no real lane reads
    batch.out_cache_loc[:real] = b2.out_cache_loc
    backend.init_forward_metadata_replay_cuda_graph(batch, max_bs)
    for q, k in qs:
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        k.copy_(torch.randn(k.shape, generator=gen).to(dtype))
    if tree_mode == "path":
        batch.parents.copy_(torch.randint(0, K, batch.parents.shape, device=DEV))
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("tree_mode", ["lane", "path"])
def test_cuda_graph_capture_replay_padded(variant, tree_mode):
    """Capture every step at bs=8; replay with new lengths, rows, slots (and parents) for
    5 real requests padded to 8; the real lanes match torch_ref."""
    dtype, K, S, max_bs = torch.bfloat16, 4, 4, 8
    gen = torch.Generator().manual_seed(7)
    r, batch = make_round(dtype, 16, K, S, 1, [1600] * max_bs, tree_mode)
    backend = make_backend(r, K, S, tree_mode, variant)
    backend.init_cuda_graph_state(max_bs, max_bs * K)
    layer = AttentionLayer(0, 576 ** -0.5)
    qs = [randn_qkv(r, max_bs * K, gen)[:2] for _ in range(S)]
    backend.init_forward_metadata_capture_cuda_graph(batch)
    assert _sm90(backend), backend.plan
    graph, outs = capture_steps(backend, layer, qs)
    # A new round: 5 real requests (another runner's layout copied in), padded to 8.
    real = 5
    r2, b2 = make_round(dtype, 16, K, S, 1, [random.randint(1, 1300) for _ in range(real)],
                        tree_mode)
    replay_new_round(r, batch, backend, r2, b2, real, max_bs, qs, outs, graph, gen, tree_mode)
    check_replayed_lanes(r, layer, batch, real, qs, outs, tree_mode, dtype)


STRESS_CHUNKS = 4  # the 100 batches in 4 tests, so that xdist workers compile side by side


def _stress_batches():
    """The 100 random batches (drawn in order from one seed, whichever chunk runs)."""
    rng = random.Random(1234)
    batches = []
    for it in range(100):
        dtype = torch.bfloat16 if it % 2 else torch.float16
        H = 128 if it % 5 == 0 else 16
        K, S, P = rng.choice([1, 2, 4, 8]), rng.choice([2, 3, 5]), rng.choice([1, 16, 64])
        tree_mode = rng.choice(["lane", "path"])
        lens = [rng.randint(0, 2500) for _ in range(rng.randint(1, 12 if H == 16 else 3))]
        batches.append((it, dtype, H, K, S, P, tree_mode, lens,
                        rng.choice([None, None, 1, 3, 16]), rng.choice([0.0, 20.0]),
                        rng.randrange(S)))
    return batches


@pytest.mark.slow  # minutes: gpu.sh check runs it in its own step
@pytest.mark.parametrize("chunk", range(STRESS_CHUNKS))
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_random_stress_100_batches(variant, chunk):
    """Random K, S, P, H, dtype, tree mode, batch and lengths (from 0), on each plan. Each
    chunk runs a quarter of the 100 batches."""
    for it, dtype, H, K, S, P, tree_mode, lens, splits, cap, step in \
            _stress_batches()[chunk::STRESS_CHUNKS]:
        gen = torch.Generator().manual_seed(1234 + it)
        r, batch = make_round(dtype, H, K, S, P, lens, tree_mode)
        backend = make_backend(r, K, S, tree_mode, variant, splits)
        run_round(r, batch, backend, AttentionLayer(0, 576 ** -0.5, cap), tree_mode, gen,
                  check_steps={step})


# --- FP8 pools: the Gluon plans ---------------------------------------------------------------

FP8_VARIANT_NAMES = [v for v in VARIANT_NAMES if v != "cute"]


def make_fp8_round(dtype, heads, topk, steps, page, lens, tree_mode, kv, k_scale):
    """An MLA runner with an FP8 pool of ``quantize(randn, k_scale)`` codes and a round."""
    slots, max_ctx = decode_sizes(lens, topk, steps, page)
    r = DraftRunner.mla(heads, 512, 64, num_layers=1, num_slots=slots, max_reqs=len(lens) + 3,
                        max_context_len=max_ctx, page_size=page, dtype=dtype, device=DEV,
                        kv_cache_dtype=kv)
    x = torch.randn(r.kv_buffer[0].shape, device=DEV)
    r.kv_buffer[0].view(torch.uint8).copy_(
        quantize(x, _host(k_scale), r.kv_buffer[0].dtype).view(torch.uint8))
    return r, place_decode_round(r, lens, topk, steps, page, tree_mode)


def _host(scale):
    return float(scale) if isinstance(scale, torch.Tensor) else scale


def _fp8_scale(spec: str):
    """``"0.37"``: a Python float; ``"t1.9"``: a one-element device tensor."""
    if spec.startswith("t"):
        return torch.tensor([float(spec[1:])], dtype=torch.float32, device=DEV)
    return float(spec)


def _kernels():
    from specattn.backends.triton.plans import Kernel

    return Kernel


FP8_CASES = [
    # dtype, H, lens, K, S, P, tree_mode, logit_cap, num_splits, kv, k_scale
    (torch.bfloat16, 16, "ragged:4:4096", 4, 4, 1, "path", 0.0, None, "fp8_e4m3", "0.37"),
    (torch.bfloat16, 16, "short", 4, 3, 64, "lane", 30.0, None, "fp8_e5m2", "t1.9"),
    (torch.float16, 16, "ragged:3:2048", 1, 3, 1, "lane", 0.0, None, "fp8_e4m3", "t0.37"),
    (torch.float16, 16, "short", 1, 4, 64, "path", 20.0, 3, "fp8_e5m2", "0.37"),
    (torch.bfloat16, 16, "ragged:2:1024", 8, 3, 1, "path", 0.0, None, "fp8_e5m2", "0.37"),
    (torch.bfloat16, 16, "short", 8, 2, 64, "lane", 0.0, 16, "fp8_e4m3", "t1.9"),
    (torch.bfloat16, 128, "ragged:2:1024", 1, 3, 64, "lane", 0.0, None, "fp8_e4m3", "1.9"),
    (torch.float16, 128, "ragged:3:3000", 2, 3, 1, "path", 0.0, 16, "fp8_e5m2", "t0.37"),
    (torch.bfloat16, 16, "ragged:3:3000", 4, 3, 1, "lane", 0.0, 1, "fp8_e5m2", "1.9"),
    (torch.float16, 128, "short", 1, 2, 1, "path", 0.0, None, "fp8_e4m3", "0.37"),
]


@pytest.mark.parametrize("variant", FP8_VARIANT_NAMES)
@pytest.mark.parametrize("dtype,H,lens,K,S,P,tree_mode,cap,num_splits,kv,scale", FP8_CASES)
def test_fp8_decode_vs_reference(variant, dtype, H, lens, K, S, P, tree_mode, cap, num_splits,
                                 kv, scale):
    """The Gluon plans over an FP8 pool against ``torch_ref`` over the dequantized pool."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((H, lens, K, S, P, kv)).encode()))
    k_scale = _fp8_scale(scale)
    r, batch = make_fp8_round(dtype, H, K, S, P, lengths(lens), tree_mode, kv, k_scale)
    backend = make_backend(r, K, S, tree_mode, variant, num_splits)
    layer = AttentionLayer(0, 576 ** -0.5, cap, k_scale=k_scale)
    run_round(r, batch, backend, layer, tree_mode, gen,
              check_steps={0, S - 1} if lens.endswith("4096") else None)
    if variant == "default":  # cute reads bf16/fp16 pools only: gluon-split above a tile
        assert backend.plan.name == ("gluon-wl" if K * H <= 64 else "gluon-split"), \
            backend.plan


@pytest.mark.parametrize("variant", FP8_VARIANT_NAMES)
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_nan_code_in_a_lane_history_stays_in_that_lane(variant, kv):
    """A NaN code (0x7F) in lane 0's step-0 key: at step 1 the sibling lanes, which do not
    see it, match ``torch_ref`` and hold no NaN (the lane that sees it is not checked)."""
    dtype, K, S = torch.bfloat16, 4, 2
    gen = torch.Generator().manual_seed(11)
    r, batch = make_fp8_round(dtype, 16, K, S, 1, [700, 90], "lane", kv, 0.37)
    backend = make_backend(r, K, S, "lane", variant)
    layer = AttentionLayer(0, 576 ** -0.5, k_scale=0.37)
    backend.init_forward_metadata(batch)
    q, k, _ = randn_qkv(r, 2 * K, gen)
    backend.forward(0, layer, q, k, None)
    bad = batch.out_cache_loc[0, 0, 0].reshape(1).long()
    write_rows(r.kv_buffer[0], bad, torch.full((1, 576), 0x7F, dtype=torch.uint8, device=DEV)
               .view(r.kv_buffer[0].dtype))
    q, k, _ = randn_qkv(r, 2 * K, gen)
    out = poisoned_forward(backend, 1, layer, q, k)
    ref = reference_decode(r, layer, q, batch, 1, "lane")
    siblings = [z for z in range(2 * K) if z != 0]
    close(out[siblings], ref[siblings], dtype)


@pytest.mark.parametrize("variant", FP8_VARIANT_NAMES)
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("tree_mode", ["lane", "path"])
def test_fp8_cuda_graph_replay_after_a_scale_change(variant, kv, tree_mode):
    """Capture every step at bs=8 with ``k_scale`` a device tensor (0.37); replay a new
    round of 5 real requests padded to 8 whose pool was quantized with 1.9 after setting
    the tensor to 1.9: the replay writes and reads with the new scale."""
    dtype, K, S, max_bs = torch.bfloat16, 4, 3, 8
    gen = torch.Generator().manual_seed(5)
    k_scale = torch.tensor([0.37], dtype=torch.float32, device=DEV)
    r, batch = make_fp8_round(dtype, 16, K, S, 1, [1600] * max_bs, tree_mode, kv, 0.37)
    backend = make_backend(r, K, S, tree_mode, variant)
    backend.init_cuda_graph_state(max_bs, max_bs * K)
    layer = AttentionLayer(0, 576 ** -0.5, k_scale=k_scale)
    qs = [randn_qkv(r, max_bs * K, gen)[:2] for _ in range(S)]
    backend.init_forward_metadata_capture_cuda_graph(batch)
    assert backend.plan.kernel in (_kernels().GLUON_WL, _kernels().GLUON_SPLIT), backend.plan
    graph, outs = capture_steps(backend, layer, qs)
    real = 5
    r2, b2 = make_fp8_round(dtype, 16, K, S, 1, [random.randint(0, 1300) for _ in range(real)],
                            tree_mode, kv, 1.9)
    k_scale.fill_(1.9)
    replay_new_round(r, batch, backend, r2, b2, real, max_bs, qs, outs, graph, gen, tree_mode)
    slots = batch.out_cache_loc[:real, :, S - 1].reshape(-1).long()
    want = quantize(qs[S - 1][1][:real * K], k_scale, r.kv_buffer[0].dtype)
    assert torch.equal(read_rows(r.kv_buffer[0], slots).view(torch.uint8),
                       want.view(torch.uint8)), "the replay did not store the new scale's codes"
    check_replayed_lanes(r, layer, batch, real, qs, outs, tree_mode, dtype)


# --- extend: gluon-split ------------------------------------------------------------------

def make_extend(dtype, H, lens, ext, page, kv="auto", k_scale=1.0, seed=0):
    """An MLA runner (random pool; FP8: torch's codes) and an extend batch whose requests
    hold whole pages in random order, request ``b``'s last ``ext[b]`` keys its new tokens."""
    from specattn.data import DraftExtendBatch

    gen = torch.Generator().manual_seed(seed)
    need = [-(-L // page) for L in lens]
    pages = sum(need) + 1
    r = DraftRunner.mla(H, 512, 64, num_layers=1, num_slots=pages * page,
                        max_reqs=len(lens) + 2, max_context_len=max(lens) + page,
                        page_size=page, dtype=dtype, device=DEV, kv_cache_dtype=kv)
    x = torch.randn(r.kv_buffer[0].shape, generator=gen).to(DEV)
    r.kv_buffer[0].copy_(quantize(x, k_scale, r.kv_buffer[0].dtype) if r.fp8 else x)
    order = (torch.randperm(pages - 1, generator=gen) + 1).tolist()  # page 0 unused
    rpi = torch.randperm(r.max_reqs, generator=gen)[:len(lens)]
    new, used = [], 0
    for b, L in enumerate(lens):
        own = torch.tensor(order[used:used + need[b]])
        used += need[b]
        pos = torch.arange(L)
        row = own[pos // page] * page + pos % page
        r.req_to_token[int(rpi[b]), :L] = row.to(torch.int32).to(DEV)
        new.append(row[L - ext[b]:])
    batch = DraftExtendBatch(rpi.to(DEV), torch.tensor(lens, device=DEV),
                             torch.tensor(ext, device=DEV), torch.cat(new).to(DEV))
    return r, batch


EXTEND_CASES = [
    # dtype, H, lens, new tokens, P, logit_cap, num_splits, kv, k_scale
    (torch.bfloat16, 16, [32768], [6], 1, 0.0, None, "auto", 1.0),
    (torch.bfloat16, 16, [4096] * 8, [6] * 8, 64, 0.0, None, "auto", 1.0),
    (torch.float16, 16, [900, 7, 2500, 64], [1, 5, 8, 3], 1, 30.0, None, "auto", 1.0),
    (torch.bfloat16, 128, [1500, 300], [2, 4], 64, 0.0, 3, "auto", 1.0),
    (torch.bfloat16, 16, [3000, 40], [6, 6], 1, 0.0, 1, "auto", 1.0),
    (torch.bfloat16, 16, [32768], [6], 64, 0.0, None, "fp8_e4m3", 0.37),
    (torch.float16, 16, [1200, 65, 3000], [4, 1, 7], 1, 0.0, None, "fp8_e5m2", 1.9),
    (torch.bfloat16, 128, [700, 2100], [3, 1], 64, 20.0, None, "fp8_e4m3", 1.9),
]


@pytest.mark.parametrize("dtype,H,lens,ext,P,cap,num_splits,kv,k_scale", EXTEND_CASES)
def test_extend_vs_reference(dtype, H, lens, ext, P, cap, num_splits, kv, k_scale):
    """``gluon-split``'s extend (the table's MLA extend plan on sm90): the new keys in the
    pool (FP8: torch's codes), the output against ``torch_ref`` with NaN-poisoned partials;
    batch 1 at 32k keys, ragged batches with a one-token request, 128 heads."""
    from specattn.backends.torch_ref import reference_extend
    from specattn.backends.triton import TritonExtend

    r, batch = make_extend(dtype, H, lens, ext, P, kv, k_scale, seed=len(lens) + P)
    backend = TritonExtend(r, num_splits=num_splits)
    backend.init_forward_metadata(batch)
    assert backend._round_plan["plan"].name == "gluon-split"
    layer = AttentionLayer(0, 576 ** -0.5, cap, k_scale=k_scale)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):  # a second call on the same metadata
        q, k, _ = randn_qkv(r, sum(ext), gen)
        backend._active.mid_o.fill_(float("nan"))
        backend._active.mid_lse.fill_(float("nan"))
        out = backend.forward(layer, q, k, None)
        got = read_rows(r.kv_buffer[0], batch.out_cache_loc.long())
        want = quantize(k, k_scale, got.dtype) if r.fp8 else k
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        close(out, reference_extend(r, layer, q, batch), dtype)
