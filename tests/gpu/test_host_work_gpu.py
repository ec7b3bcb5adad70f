"""The host work of a CUDA-graph round: ``init_forward_metadata_replay_cuda_graph`` makes no
host synchronisation and launches a fixed number of kernels, whatever the batch size and the
step count (``triton``: one metadata launch, the ``gluon-wl`` work list included; ``fa4``:
one table launch), and takes at most ``HOST_US_MAX`` microseconds of host time (median of
``TIMED_CALLS`` calls after warm-up, each on an idle device). ``fa4``: the tables a kept
replay writes (the compiled kernel launched directly) are the torch fill's, bit for bit.
The ``fa4`` tests need FlashAttention-4 (``flash_attn.cute``). Marked ``gpu``."""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import (decode_sizes, place_decode_round, place_extend_round,  # noqa: E402
                     replay_device_work)
from specattn.base import _FixedRound  # noqa: E402
from specattn.data import DraftBatch, DraftRunner  # noqa: E402
from specattn.platforms._probes import module_available  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
HOST_US_MAX = 40.0
WARM_UP_CALLS, TIMED_CALLS = 20, 200


def _runner(model, lens, topk, steps, page):
    slots, ctx = decode_sizes(lens, topk, steps, page)
    if model == "mla":
        r = DraftRunner.mla(16, 512, 64, num_layers=1, num_slots=slots, max_reqs=len(lens) + 2,
                            max_context_len=ctx, page_size=page, dtype=torch.bfloat16,
                            device=DEV)
    else:
        r = DraftRunner.mha(32, 8, 128, num_layers=1, num_slots=slots, max_reqs=len(lens) + 2,
                            max_context_len=ctx, page_size=page, dtype=torch.bfloat16,
                            device=DEV)
    return r, place_decode_round(r, lens, topk, steps, page, "lane")


def _captured(model, bs, steps, topk=4, page=16, lens=None):
    """A ``triton`` backend after a capture at ``bs`` requests, and the batch to replay
    (``model`` ``"extend"``: an MHA draft extend of ``steps + 1`` tokens per request)."""
    from specattn.backends.triton import TritonDecode, TritonExtend

    lens = lens or [300 + 50 * i for i in range(bs)]
    if model == "extend":
        r, _ = _runner("mha", lens, 1, steps, page)
        ext = [steps + 1] * bs
        batch = place_extend_round(r, lens, ext)
        backend = TritonExtend(r, topk=1, num_steps=steps, max_extend_len=steps + 1)
        backend.init_cuda_graph_state(bs, sum(ext))
    else:
        r, batch = _runner(model, lens, topk, steps, page)
        backend = TritonDecode(r, topk, steps)
        backend.init_cuda_graph_state(bs, bs * topk)
    backend.init_forward_metadata_capture_cuda_graph(batch)
    return backend, batch


def _host_us(backend, batch, bs) -> float:
    """Median host time in us of the replay metadata call (``TIMED_CALLS`` calls after
    ``WARM_UP_CALLS``, each on an idle device), which launches the kept compiled kernel."""
    for _ in range(WARM_UP_CALLS):
        backend.init_forward_metadata_replay_cuda_graph(batch, bs)
    assert backend._launch.direct, "the replay does not launch the kept compiled kernel"
    times = []
    for _ in range(TIMED_CALLS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        backend.init_forward_metadata_replay_cuda_graph(batch, bs)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _replay_kernels(model, bs, steps, topk=4, page=16):
    """The CUDA kernels one replay metadata call launches (``helpers.replay_device_work``)."""
    backend, batch = _captured(model, bs, steps, topk, page)
    return replay_device_work(backend, batch, bs), backend


@pytest.mark.parametrize("model", ["mha", "mla", "extend"])
def test_triton_replay_metadata_is_a_fixed_launch_count_without_sync(model):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    small, _ = _replay_kernels(model, bs=1, steps=2)
    large, backend = _replay_kernels(model, bs=8, steps=5)
    assert len(small) == len(large) == 1, (backend._round_plan["plan"].name, small, large)


# (model, batch size, topk, steps, page): the standard cases' shapes (gqa-long, mla-long,
# extend) at a 512-token prefix (the host work does not depend on the prefix length).
HOST_CASES = {"gqa-long": ("mha", 32, 8, 5, 1), "mla-long": ("mla", 32, 4, 5, 1),
              "extend": ("extend", 32, 1, 5, 1)}


@pytest.mark.parametrize("case", list(HOST_CASES))
def test_triton_replay_metadata_host_time(case):
    """Median host time of the replay metadata call at most ``HOST_US_MAX`` us, through the
    kept compiled kernel (``kernel_launch``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, bs, topk, steps, page = HOST_CASES[case]
    backend, batch = _captured(model, bs, steps, topk, page, lens=[512] * bs)
    us = _host_us(backend, batch, bs)
    plan = backend._round_plan["plan"].name
    print(f"{case} ({plan}): replay metadata call {us:.1f} us host time (median of "
          f"{TIMED_CALLS})")
    assert us <= HOST_US_MAX, f"{case} ({plan}): {us:.1f} us > {HOST_US_MAX} us"


# --- fa4 ---------------------------------------------------------------------------------------

def _needs_fa4() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not module_available("flash_attn.cute"):
        pytest.skip("needs flash-attn-4 (pip install -e '.[fa]')")


def _fa4_captured(kind, bs, topk, steps, page, prefix=512, tree_mode="lane"):
    """An ``fa4`` backend (``mode="auto"``) after a capture at ``bs`` requests of ``prefix``
    tokens, and the batch to replay (``kind`` ``"extend"``: ``steps + 1`` new tokens per
    request)."""
    from specattn.backends.flash_attn import FA4Decode, FA4Extend

    lens = [prefix] * bs
    if kind == "extend":
        r, _ = _runner("mha", lens, 1, steps, page)
        batch = place_extend_round(r, lens, [steps + 1] * bs)
        backend = FA4Extend(r, topk=1, num_steps=steps)
        backend.init_cuda_graph_state(bs, bs * (steps + 1))
    else:
        r, _ = _runner("mha", lens, topk, steps, page)
        batch = place_decode_round(r, lens, topk, steps, page, tree_mode)
        backend = FA4Decode(r, topk, steps, tree_mode=tree_mode)
        backend.init_cuda_graph_state(bs, bs * topk)
    backend.init_forward_metadata_capture_cuda_graph(batch)
    return backend, batch


# (kind, batch size, topk, steps, page, prefix): the MHA standard and serving cases' shapes
# (the prefix at 512 tokens where the route does not depend on it: the host work does not).
FA4_HOST_CASES = {
    "gqa-long": ("decode", 32, 8, 5, 1, 512), "gqa-chain": ("decode", 64, 1, 4, 1, 512),
    "gqa-paged": ("decode", 32, 4, 5, 16, 512), "gqa-small": ("decode", 4, 4, 5, 1, 512),
    "gqa-b1-32k": ("decode", 1, 4, 5, 1, 32768), "gqa-b1-k8": ("decode", 1, 8, 5, 1, 4096),
    "gqa-b8-p16": ("decode", 8, 4, 5, 16, 4096), "extend": ("extend", 32, 1, 5, 1, 512),
    "gqa-b8-p16-extend": ("extend", 8, 1, 5, 16, 4096),
}


@pytest.mark.parametrize("case", ["gqa-long", "gqa-chain", "gqa-b1-32k", "extend"])
def test_fa4_replay_metadata_is_one_launch_without_sync(case):
    """One launch at (B 1, S 2) and at the case's size, with host synchronisation an
    error."""
    _needs_fa4()
    kind, bs, topk, steps, page, prefix = FA4_HOST_CASES[case]
    counts = []
    for size, n_steps in ((1, 2), (bs, steps)):
        backend, batch = _fa4_captured(kind, size, topk, n_steps, page, prefix)
        counts.append(replay_device_work(backend, batch, size))
    assert [len(c) for c in counts] == [1, 1], counts


@pytest.mark.parametrize("case", list(FA4_HOST_CASES))
def test_fa4_replay_metadata_host_time(case):
    """Median host time of the ``fa4`` replay metadata call at most ``HOST_US_MAX`` us,
    through the kept compiled kernel (``kernel_launch``)."""
    _needs_fa4()
    kind, bs, topk, steps, page, prefix = FA4_HOST_CASES[case]
    backend, batch = _fa4_captured(kind, bs, topk, steps, page, prefix)
    us = _host_us(backend, batch, bs)
    route = getattr(backend, "_route", ("extend",))
    print(f"fa4 {case} {route}: replay metadata call {us:.1f} us host time (median of "
          f"{TIMED_CALLS})")
    assert us <= HOST_US_MAX, f"fa4 {case} {route}: {us:.1f} us > {HOST_US_MAX} us"


@pytest.mark.parametrize("topk,page,tree_mode,options", [
    (4, 16, "lane", {}), (4, 1, "path", {"split_prefix": 4}), (1, 16, "lane", {}),
    (4, 1, "lane", {"mode": "per-branch"})])
def test_fa4_kept_replay_tables_match_the_torch_fill(topk, page, tree_mode, options):
    """Replays into a graph captured at 3 requests (lane mode: 2 requests, padded; path
    mode: 3, the captured ``parents`` refilled), through the kept compiled kernel: the
    tables and the fixed views are what the torch fill and padding write."""
    _needs_fa4()
    from test_flash_attn import make_case_on, make_decode_case

    from specattn.backends.flash_attn import FA4Decode

    steps = 4
    case = make_decode_case(bs=3, topk=topk, steps=steps, page_size=page, device="cuda",
                            seed=5, max_len=300, heads=(32, 8, 128))
    b = case.batch
    parents = b.parents if tree_mode == "path" else None
    backend = FA4Decode(case.runner, topk, steps, tree_mode=tree_mode, **options)
    backend.init_cuda_graph_state(4, 4 * topk)
    backend.init_forward_metadata_capture_cuda_graph(
        DraftBatch(b.req_pool_indices, b.seq_lens, b.out_cache_loc, parents))
    raw = 3 if parents is not None else 2
    for seed in range(3):
        o = make_case_on(case, seed).batch
        if parents is not None:
            parents.copy_(o.parents)
        batch = DraftBatch(o.req_pool_indices[:raw].clone(), o.seq_lens[:raw].clone(),
                           o.out_cache_loc[:raw].clone(), parents)
        backend.init_forward_metadata_replay_cuda_graph(batch, 3)
        assert len(backend._replays) == 1 + (raw != 3)
        if seed:
            assert backend._launch.direct
        torch.cuda.synchronize()
        padded = _FixedRound(4, (4, topk, steps), "cuda", with_requests=True).round(
            batch, 3, 1)
        got = backend._active
        want = copy.copy(got)  # the torch fill over a copy of the launch's buffers
        for name, t in vars(got).items():
            if isinstance(t, torch.Tensor):
                setattr(want, name, t.clone())
        backend._fill(want, backend._route, padded)
        for name, t in vars(got).items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, getattr(want, name)), name
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
            assert torch.equal(getattr(backend.batch, name), getattr(padded, name)), name
