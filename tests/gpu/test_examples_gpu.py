"""``examples/graph_round.py`` on a CUDA GPU: draft decode rounds captured in one CUDA graph
and replayed (a full round, a round of one request padded to two, a full one), each checked
against ``torch_ref`` by the example itself, with each graph-capable backend that runs here.
Marked ``gpu`` (skipped without CUDA)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from specattn.platforms._probes import module_available

pytestmark = pytest.mark.gpu
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLE = os.path.join(ROOT, "examples", "graph_round.py")


@pytest.mark.parametrize("backend,module", [("triton", "triton"),
                                            ("flashinfer", "flashinfer")])
def test_graph_round_replays_match_torch_ref(backend, module):
    if not module_available(module):
        pytest.skip(f"{module} is not installed here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, EXAMPLE, "--backend", backend], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"decode backend '{backend}', captured CUDA graph" in proc.stdout
    assert len(re.findall(r"^round \d: ", proc.stdout, re.M)) == 3
    assert "replays match torch_ref" in proc.stdout
