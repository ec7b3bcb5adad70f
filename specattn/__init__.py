"""specattn: attention backends for the draft phase of speculative decoding.

>>> import specattn
>>> factory = specattn.DraftBackendFactory(specattn.SpecConfig(attention_backend="torch_ref"),
...                                        runner, topk=4, num_steps=5)      # doctest: +SKIP
>>> decode = factory.create_decode_backend()                                 # doctest: +SKIP
"""

from __future__ import annotations

import os as _os
import time as _time


def _seconds_since_exec() -> float:
    """How long this process ran before importing specattn (Linux: from ``/proc``; 0
    elsewhere). Over 2 s it is not Python starting up but the shell that forked the process
    and ran other commands before exec-ing this one (``sh -c 'sleep 5; specattn demo'``):
    then 0, the import's own time."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / _os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0
    return age if 0.0 <= age <= 2.0 else 0.0


# When this process started, on the ``time.perf_counter()`` clock: the commands
# (``specattn demo``) count the total they print from here, so it includes starting Python
# and importing torch.
_STARTED = _time.perf_counter() - _seconds_since_exec()

from importlib import metadata as _metadata

from .base import DraftBackend, DraftDecodeBackend, DraftExtendBackend
from .config import SpecConfig
from .data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from .errors import (
    BackendUnavailableError,
    DuplicateBackendError,
    InvalidInputError,
    ModelMismatchError,
    RegistrationError,
    SpecAttnError,
    UnknownBackendError,
)
from .factory import DraftBackendFactory
from .keys import BackendRequest
from .kv_layouts import KV_CACHE_DTYPES
from .listing import BackendInfo, list_backends
from .registry import Registry, default_registry, scoped_registry
from .selection import Selection, select
from . import backends  # noqa: E402,F401  (registers the built-in backends)

try:  # one version source: pyproject.toml, through the installed metadata
    __version__ = _metadata.version("specattn")
except _metadata.PackageNotFoundError:  # imported from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "AttentionLayer", "BackendInfo", "BackendRequest", "BackendUnavailableError",
    "DraftBackend", "DraftBackendFactory", "DraftBatch", "DraftDecodeBackend",
    "DraftExtendBackend", "DraftExtendBatch", "DraftRunner", "DuplicateBackendError",
    "InvalidInputError", "KV_CACHE_DTYPES", "ModelMismatchError", "Registry", "RegistrationError", "Selection",
    "SpecAttnError", "SpecConfig", "UnknownBackendError", "default_registry",
    "list_backends", "scoped_registry", "select", "__version__",
]
