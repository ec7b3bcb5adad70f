"""The CuTe-DSL probes for issue #19's next MLA kernel, on an sm90 GPU against torch:
``tools/cute_cluster_probe.py`` (a 4-CTA cluster merges four partials through distributed
shared memory) and ``tools/cute_mla_tile_probe.py`` (one key tile's S = Q K^T with N 64 and
P V with V read in place from the key buffer). Need CuTe-DSL (the FA4 part of the offline
bundle). Marked ``gpu``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")


def _run_probe(name: str) -> str:
    pytest.importorskip("cutlass.cute", reason="CuTe-DSL is not installed (FA4 bundle)")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("wgmma and thread-block clusters need sm90")
    run = subprocess.run([sys.executable, os.path.join(TOOLS, name), "--run"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return run.stdout


def test_cluster_merge_matches_torch():
    out = _run_probe("cute_cluster_probe.py")
    assert "mapa: 4" in out and "ran: max error" in out, out


def test_mla_tile_matches_torch():
    out = _run_probe("cute_mla_tile_probe.py")
    assert "m64n64k16: 36" in out and "ran: relative max error" in out, out
