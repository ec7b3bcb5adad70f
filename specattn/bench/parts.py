"""``specattn bench --parts``: where the time of one step goes, for any backend.

Per variant (after its check and timing):

- ``host``: the host time of the metadata call of a round (``init_forward_metadata``), and on
  a GPU, for backends with CUDA graphs, of the call before each replay
  (``init_forward_metadata_replay_cuda_graph``); median of several calls, each timed alone
  (``harness.HostTimer``) on an idle device (a synchronisation before it, outside the
  interval);
- ``kernel`` (GPU) / ``op`` (CPU): what one eager step of one layer runs, from
  ``torch.profiler`` over the rotating layers: per kernel, its device time per step and how
  many launches a step makes (CPU: the self time of each torch op). The largest parts are
  listed; the rest is summed as ``(other)``.

No backend internals are read: the parts are whatever the step launches (a prefix pass, a
history + merge kernel, the KV write...), named as the profiler names them.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .harness import HostTimer, Setup, Variant, timed_step_fn

__all__ = ["measure_parts", "profile_parts", "host_us"]

TOP_PARTS = 10


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def host_us(fn: Callable[[], Any], sync: Callable[[], None], reps: int = 10,
            now: Callable[[], float] = time.perf_counter) -> float:
    """Median microseconds of host time of ``fn()`` after one warm-up call; ``sync()`` before
    each call, outside the interval."""
    timer = HostTimer(now)
    fn()
    for _ in range(reps):
        sync()
        timer.call(fn)
    sync()
    return timer.median_ms() * 1e3


def _short_name(key: str) -> str:
    """A kernel's name without its return type and template/argument lists."""
    name = key[5:] if key.startswith("void ") else key
    cut = min((i for i in (name.find("<"), name.find("(")) if i > 0), default=len(name))
    return name[:cut].strip()[:80]


def profile_parts(events, on_gpu: bool, calls: int, top: int = TOP_PARTS,
                  ) -> list[dict[str, Any]]:
    """Parts from ``torch.profiler``'s ``key_averages()`` of ``calls`` step calls: GPU
    kernels (device time) or CPU ops (self time), per call, largest first."""
    totals: dict[str, list[float]] = {}
    for ev in events:
        if on_gpu:
            if str(getattr(ev, "device_type", "")).split(".")[-1] != "CUDA":
                continue
            us = float(ev.device_time_total)
            name = _short_name(ev.key)
        else:
            us = float(ev.self_cpu_time_total)
            name = ev.key
        if us <= 0:
            continue
        slot = totals.setdefault(name, [0.0, 0.0])
        slot[0] += us / calls
        slot[1] += ev.count / calls
    kind = "kernel" if on_gpu else "op"
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    rows = [{"part": n, "kind": kind, "us": us, "calls": c} for n, (us, c) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        rows.append({"part": f"(other: {len(rest)} more)", "kind": kind,
                     "us": sum(us for _, (us, _c) in rest),
                     "calls": sum(c for _, (_u, c) in rest)})
    return rows


def measure_parts(variant: Variant, setup: Setup, clock, reps: int = 3) -> list[dict[str, Any]]:
    """The parts of one variant (see the module doc); raises if the backend does."""
    from torch.profiler import ProfilerActivity, profile

    case, device = setup.case, setup.device
    sync = _sync(device)
    on_gpu = device.type == "cuda"
    backend = variant.make(setup)
    rows = [{"part": "init_forward_metadata", "kind": "host", "calls": 1,
             "us": host_us(lambda: backend.init_forward_metadata(setup.batch), sync)}]
    all_layers = timed_step_fn(backend, setup)
    all_layers()  # compiled and planned before the profile
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(reps):
            all_layers()
        sync()
    rows += profile_parts(prof.key_averages(), on_gpu, reps * len(setup.layers))
    if clock.graphs and variant.graphs:
        graphed = variant.make(setup)
        graphed.init_cuda_graph_state(case.batch, case.lanes)
        graphed.init_forward_metadata_capture_cuda_graph(setup.batch)

        def replay_metadata():
            graphed.init_forward_metadata_replay_cuda_graph(setup.batch, case.batch)

        rows.append({"part": "init_forward_metadata_replay_cuda_graph", "kind": "host",
                     "calls": 1, "us": host_us(replay_metadata, sync)})
    return rows
