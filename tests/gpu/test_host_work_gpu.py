"""The host work of a CUDA-graph round: ``init_forward_metadata_replay_cuda_graph`` makes no
host synchronisation and launches a fixed number of kernels, whatever the batch size and the
step count (``triton``: one metadata launch, two with the ``gluon-wl`` work list). Marked
``gpu``."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import decode_sizes, place_decode_round  # noqa: E402
from specattn.data import DraftRunner  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"


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


def _replay_kernels(model, bs, steps, topk=4, page=16):
    """The CUDA kernels one replay metadata call launches (after a capture-time call), with
    any host synchronisation an error."""
    from specattn.backends.triton import TritonDecode

    r, batch = _runner(model, [300 + 50 * i for i in range(bs)], topk, steps, page)
    backend = TritonDecode(r, topk, steps)
    backend.init_cuda_graph_state(bs, bs * topk)
    backend.init_forward_metadata_capture_cuda_graph(batch)
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
    return kernels, backend.plan.name


@pytest.mark.parametrize("model", ["mha", "mla"])
def test_triton_replay_metadata_is_a_fixed_launch_count_without_sync(model):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    small, plan = _replay_kernels(model, bs=1, steps=2)
    large, _ = _replay_kernels(model, bs=8, steps=5)
    want = 2 if plan == "gluon-wl" else 1
    assert len(small) == len(large) == want, (plan, small, large)
