"""The host work of a CUDA-graph round: ``init_forward_metadata_replay_cuda_graph`` makes no
host synchronisation and launches a fixed number of kernels, whatever the batch size and the
step count (``triton``: one metadata launch, the ``gluon-wl`` work list included), and takes
at most ``HOST_US_MAX`` microseconds of host time (median of ``TIMED_CALLS`` calls after
warm-up, each on an idle device). Marked ``gpu``."""

from __future__ import annotations

import os
import statistics
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import decode_sizes, place_decode_round, place_extend_round  # noqa: E402
from specattn.data import DraftRunner  # noqa: E402

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


def _replay_kernels(model, bs, steps, topk=4, page=16):
    """The CUDA kernels one replay metadata call launches (after a capture-time call), with
    any host synchronisation an error."""
    backend, batch = _captured(model, bs, steps, topk, page)
    backend.init_forward_metadata_replay_cuda_graph(batch, bs)  # compiles, warms caches
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend.init_forward_metadata_replay_cuda_graph(batch, bs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return kernels, backend


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
    us = statistics.median(times) * 1e6
    plan = backend._round_plan["plan"].name
    print(f"{case} ({plan}): replay metadata call {us:.1f} us host time (median of "
          f"{TIMED_CALLS})")
    assert us <= HOST_US_MAX, f"{case} ({plan}): {us:.1f} us > {HOST_US_MAX} us"
