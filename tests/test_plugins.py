"""Third-party backends through the ``specattn.backends`` entry-point group.

The dummy plugin package (``tests/plugins/specattn_dummy_plugin``) is pip-installed once
into a temporary target directory; each check runs in a subprocess with that directory on
``PYTHONPATH``, so this process's registry is never touched.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specattn import plugins

PLUGIN_SRC = Path(__file__).parent / "plugins" / "specattn_dummy_plugin"

_PROBE = r"""
import json, logging, sys, warnings
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from types import SimpleNamespace
import specattn
from specattn.platforms import Platform
from specattn.registry import default_registry

out = {"before": "dummy_plugin" in default_registry.names("decode")}
rows = specattn.list_backends(pattern="dummy*")
out["rows"] = sorted([r.name, r.kind, list(r.aliases), r.runs_here] for r in rows)
out["status"] = specattn.plugins.load_plugins()
out["again"] = specattn.plugins.load_plugins()
import importlib
mod = sys.modules.get("specattn_dummy_plugin")
out["imports"] = getattr(mod, "IMPORT_COUNT", 0)
answers = {}
for name in ("dummy_plugin", "dummy"):
    factory = specattn.DraftBackendFactory(
        specattn.SpecConfig(attention_backend=name), SimpleNamespace(use_mla_backend=False),
        topk=2, num_steps=3, platform=Platform("cpu", libraries=frozenset()))
    try:
        answers[name] = [factory.resolve_decode_backend().qualified_name(),
                         factory.resolve_draft_extend_backend().qualified_name()]
    except Exception as exc:
        answers[name] = type(exc).__name__
out["answers"] = answers
auto = specattn.DraftBackendFactory(specattn.SpecConfig(), SimpleNamespace(use_mla_backend=False),
                                    1, 3, platform=Platform("cpu", libraries=frozenset()))
out["auto"] = auto.resolve_decode_backend().name
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """The dummy plugin, installed (once per session) into a private target directory."""
    work = tmp_path_factory.mktemp("plugin")
    src = work / "src"
    shutil.copytree(PLUGIN_SRC, src)  # build in a copy: no build/ or egg-info in the repo
    target = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(target), str(src)],
                   check=True, capture_output=True, text=True)
    return target


def probe(plugin_path, **env):
    paths = [str(plugin_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                  if p]
    environ = {k: v for k, v in os.environ.items()
               if k not in ("SPECATTN_PLUGINS", "SPECATTN_DISABLE_PLUGIN_AUTOLOAD")}
    environ.update(PYTHONPATH=os.pathsep.join(paths), **env)
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          env=environ)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc.stderr


@pytest.fixture(scope="module")
def default_probe(plugin_path):
    return probe(plugin_path)


def test_plugin_is_found_through_its_entry_point(default_probe):
    out, _ = default_probe
    assert out["before"] is False  # loaded lazily, on the first registry query
    assert out["rows"] == [["dummy_plugin", "decode", ["dummy"], True],
                           ["dummy_plugin", "extend", ["dummy"], True]]
    assert out["answers"]["dummy_plugin"] == ["specattn_dummy_plugin.DummyDecode",
                                              "specattn_dummy_plugin.DummyExtend"]
    assert out["answers"]["dummy"] == out["answers"]["dummy_plugin"]
    assert out["auto"] != "dummy_plugin"  # auto_eligible = False
    assert out["status"]["dummy"] == "ok"
    assert out["again"] == out["status"] and out["imports"] == 1  # loaded once


def test_broken_plugin_is_logged_and_skipped(default_probe):
    out, stderr = default_probe
    assert out["status"]["broken"].startswith("RuntimeError: specattn_dummy_broken fails")
    assert "specattn plugin 'broken'" in stderr and "skipped" in stderr
    assert out["answers"]["dummy_plugin"] != "UnknownBackendError"


def test_autoload_can_be_disabled(plugin_path):
    out, _ = probe(plugin_path, SPECATTN_DISABLE_PLUGIN_AUTOLOAD="1")
    assert out["rows"] == [] and out["status"] == {}
    assert out["answers"] == {"dummy_plugin": "UnknownBackendError",
                              "dummy": "UnknownBackendError"}


def test_allow_list_loads_only_the_named_plugins(plugin_path):
    out, stderr = probe(plugin_path, SPECATTN_PLUGINS="dummy")
    assert out["status"] == {"dummy": "ok"}
    assert "broken" not in stderr
    out, _ = probe(plugin_path, SPECATTN_PLUGINS="broken")
    assert set(out["status"]) == {"broken"} and out["rows"] == []


# --- in process, with fake entry points (no registration happens) ------------------------------

class _FakeEntryPoint:
    def __init__(self, name, target):
        self.name, self.value, self._target = name, f"fake:{name}", target

    def load(self):
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


@pytest.fixture
def fresh_plugin_state(monkeypatch):
    monkeypatch.setattr(plugins, "_loaded", False)
    monkeypatch.setattr(plugins, "loaded_plugins", {})
    monkeypatch.delenv(plugins.DISABLE_ENV, raising=False)
    monkeypatch.delenv(plugins.ALLOW_ENV, raising=False)
    return monkeypatch


def test_callable_targets_are_called_once_and_failures_isolated(fresh_plugin_state, caplog):
    calls = []
    eps = [_FakeEntryPoint("good", lambda: calls.append(1)),
           _FakeEntryPoint("bad", ImportError("no module named nowhere")),
           _FakeEntryPoint("raises", lambda: 1 / 0)]
    fresh_plugin_state.setattr(importlib.metadata, "entry_points",
                               lambda group: eps if group == plugins.ENTRY_POINT_GROUP else [])
    with caplog.at_level(logging.WARNING, logger="specattn.plugins"):
        status = plugins.load_plugins()
        assert plugins.load_plugins() == status
    assert calls == [1]
    assert status["good"] == "ok"
    assert status["bad"] == "ImportError: no module named nowhere"
    assert status["raises"].startswith("ZeroDivisionError")
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "'bad'" in logged and "'raises'" in logged and "'good'" not in logged
