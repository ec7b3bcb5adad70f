"""Shared test setup: Triton interpreter on CPU, Hypothesis profiles, GPU marker, scoped
registries."""

from __future__ import annotations

import os

# Before anything imports Triton kernels: on a machine without CUDA, run them on the
# Triton CPU interpreter so CI exercises every kernel.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False
# pytest-xdist's workers share the machine's cores. torch's default, one thread per core in
# every worker, oversubscribes them, and its OpenMP threads then wait on each other (CPU
# tests of this suite ran up to 8x slower): each worker, and what it starts, takes its share.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, _CORES // _WORKERS))
    if "torch" in globals():
        torch.set_num_threads(max(1, _CORES // _WORKERS))

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        from interpreter_patch_once import install

        install()  # the interpreter patches triton.language once per launch, not per helper

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("ci", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def scoped_registry():
    """A private copy of the default registry, active for the test."""
    from specattn.registry import scoped_registry as _scoped

    with _scoped() as registry:
        yield registry


@pytest.fixture
def empty_registry():
    """An empty registry, active for the test."""
    from specattn.registry import scoped_registry as _scoped

    with _scoped(empty=True) as registry:
        yield registry
