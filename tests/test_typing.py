"""The public API type-checks: ``mypy`` over the files ``[tool.mypy]`` in pyproject.toml
lists (the modules serving code and backend authors import, and the examples as their
code), so that ``py.typed`` promises what the annotations keep."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_public_api_and_the_examples_type_check(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    res = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Success" in res.stdout


def test_a_user_backend_typed_against_the_api_checks(tmp_path):
    """A backend author's typed module: the hooks' signatures, ``self.batch`` as the round's
    batch, the factory's results narrowed from ``Optional`` (mutation: reading the
    ``Optional`` result unnarrowed is an error)."""
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    good = tmp_path / "user_backend.py"
    good.write_text('''
from typing import Any, Optional

import torch

import specattn


class Mine(specattn.DraftDecodeBackend, name="typed_user_backend"):
    def _attend(self, step: int, layer: specattn.AttentionLayer, q: torch.Tensor,
                k: torch.Tensor, v: Optional[torch.Tensor], **options: Any) -> torch.Tensor:
        lens: torch.Tensor = self.batch.seq_lens
        return q * lens.numel()


def make(factory: specattn.DraftBackendFactory) -> specattn.DraftDecodeBackend:
    decode = factory.create_decode_backend()
    if decode is None:
        raise RuntimeError("no decode backend")
    cls = factory.resolve_decode_backend()
    name: str = "" if cls is None else cls.name
    return decode
''')
    bad = tmp_path / "user_bad.py"
    bad.write_text('''
import specattn


def use(factory: specattn.DraftBackendFactory) -> None:
    factory.create_decode_backend().init_forward_metadata
''')
    cmd = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
           "--ignore-missing-imports", "--follow-imports=silent", "--no-incremental"]
    # The source tree: mypy does not follow an editable install's import hook.
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    ok = subprocess.run(cmd + [str(good)], cwd=tmp_path, capture_output=True, text=True,
                        timeout=300, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    fails = subprocess.run(cmd + [str(bad)], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, env=env)
    assert fails.returncode == 1 and 'Item "None"' in fails.stdout, fails.stdout
