"""SGLang's own EAGLE draft loop on the GPU with SGLang's Triton backend and with specattn's
through the plugin: ``tools/sglang_gpu.py --quick`` (MHA and MLA, topk 1 and 4, page 1 and
16 / 64; eager and through ``EAGLEDraftCudaGraphRunner``; ``lane``, ``auto`` and ``path``)
must pass every case with no import-only stand-in called. Marked ``gpu``; skipped with the
reason without SGLang 0.5.23 (``tools/sglang_wheels.sh`` and ``tools/gpu.sh sglang`` install
it on the GPU host, docs/sglang.md)."""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _missing() -> str:
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not importable (tools/gpu.sh sglang installs it from .whl/)"
    version = importlib.metadata.version("sglang")
    return "" if version == "0.5.23" else f"the harness pins SGLang 0.5.23, found {version}"


def test_quick_subset_passes(tmp_path):
    if _missing():
        pytest.skip(_missing())
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "sglang_gpu.py"),
                          "--out", str(tmp_path), "--quick"], capture_output=True, text=True,
                         timeout=600)
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    failed = [r for r in rows if r["status"] not in ("ok", "upstream", "unsupported")]
    assert res.returncode == 0 and rows and not failed, (failed, res.stdout[-2000:],
                                                         res.stderr[-2000:])
    assert {r["mode"] for r in rows} >= {"stock", "lane", "auto", "path"}
    assert {r["run"] for r in rows} == {"eager", "graph"}
    assert "calls of them: none" in (tmp_path / "results.md").read_text()
