"""The scripts under ``examples/`` run and exit 0 (one as a fresh subprocess, the rest in
process through ``runpy`` with their registrations kept in a scoped registry)."""

from __future__ import annotations

import ast
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, argv: list[str], monkeypatch) -> int:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name)] + argv)
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return exc.value.code


def test_serving_loop_as_a_script():
    env = dict(os.environ, PYTHONPATH=str(EXAMPLES.parent) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(EXAMPLES / "serving_loop.py"), "--rounds", "2"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"extend backend '\w+', decode backend '\w+'", proc.stdout)
    assert len(re.findall(r"^round \d: extended \d+ tokens", proc.stdout, re.M)) == 2


@pytest.mark.parametrize("argv", [["--tree-mode", "lane", "--backend", "torch_ref"],
                                  ["--rounds", "1"]])
def test_serving_loop(argv, monkeypatch, capsys, scoped_registry):
    assert run_example("serving_loop.py", argv, monkeypatch) == 0
    out = capsys.readouterr().out
    if "torch_ref" in argv:
        assert "extend backend 'torch_ref', decode backend 'torch_ref'" in out
    rounds = re.findall(r"best paths (\[\[.*\]\]), accepted (\[.*\])", out)
    assert len(rounds) == (1 if "--rounds" in argv else 3)
    for paths, accepted in rounds:
        paths, accepted = ast.literal_eval(paths), ast.literal_eval(accepted)
        assert len(paths) == 3 and all(len(p) == 4 for p in paths)  # B paths of S tokens
        assert all(0 <= a <= 4 for a in accepted)


def test_custom_backend(monkeypatch, capsys, scoped_registry):
    assert run_example("custom_backend.py", [], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "'mine' is an alias of 'my_ref'" in out
    assert "selected MyDecode / MyExtend" in out and "finite: True" in out
    assert "supports topk <= 8, got 16" in out
    # The example's classes registered only in the scoped registry.
    from specattn.registry import default_registry

    assert "my_ref" in scoped_registry.all_names("decode")
    assert "my_ref" not in default_registry.all_names("decode")


@pytest.mark.parametrize("argv", [[], ["--backend", "triton", "--rounds", "2"]])
def test_graph_round(argv, monkeypatch, capsys):
    """The graph protocol of a serving engine (capture once, replay call + replay per
    round, a padded round between full ones) gives torch_ref's outputs."""
    assert run_example("graph_round.py", argv, monkeypatch) == 0
    out = capsys.readouterr().out
    if "triton" in argv:
        assert "decode backend 'triton'" in out
    rounds = re.findall(r"^round \d: (\d) of 2 requests, lengths \[([\d, ]+)\]", out, re.M)
    assert [int(n) for n, _ in rounds] == [2, 1, 2][:len(rounds)]
    assert len(rounds) == (2 if "--rounds" in argv else 3)
    assert "replays match torch_ref" in out
