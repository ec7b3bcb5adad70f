"""``tools/cute_cluster_probe.py`` on an sm90 GPU: a 4-CTA cluster merges four partials
through distributed shared memory, checked against torch (issue #19's route to an on-chip
merge of split partials). Needs CuTe-DSL (the FA4 part of the offline bundle). Marked
``gpu``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "cute_cluster_probe.py")


def test_cluster_merge_matches_torch():
    pytest.importorskip("cutlass.cute", reason="CuTe-DSL is not installed (FA4 bundle)")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread-block clusters need sm90")
    run = subprocess.run([sys.executable, TOOL, "--run"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "mapa: 4" in run.stdout and "ran: max error" in run.stdout, run.stdout
