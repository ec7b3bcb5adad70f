"""Logger names follow the modules, so ``logging.getLogger("specattn.backends")`` (or any
parent package) configures every backend's messages."""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import sys

import specattn
import specattn.backends

# The walk imports the SGLang adapter, whose SGLang imports need the same stand-ins the SGLang
# tests install (torchvision; else this test passes only after those tests' conftest ran).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "integrations"))
import sglang_stubs  # noqa: E402

sglang_stubs.install()


def _module_loggers(package) -> dict[str, logging.Logger]:
    found = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.endswith("__main__"):  # runs the command
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, logging.Logger):
                found[info.name] = value
    return found


def test_every_backend_logger_is_under_specattn_backends():
    loggers = _module_loggers(specattn.backends)
    assert len(loggers) >= 5
    for module, logger in loggers.items():
        assert logger.name.startswith("specattn.backends."), (module, logger.name)


def test_every_package_logger_is_under_specattn():
    for module, logger in _module_loggers(specattn).items():
        assert logger.name == "specattn" or logger.name.startswith("specattn."), module
