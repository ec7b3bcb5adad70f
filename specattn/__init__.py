"""specattn: attention backends for the draft phase of speculative decoding.

>>> import specattn
>>> factory = specattn.DraftBackendFactory(specattn.SpecConfig(attention_backend="torch_ref"),
...                                        runner, topk=4, num_steps=5)      # doctest: +SKIP
>>> decode = factory.create_decode_backend()                                 # doctest: +SKIP
"""

from __future__ import annotations

import time as _time

# When the package was first imported: the commands (``specattn demo``) count their time from
# here, so the time they print includes importing torch.
_STARTED = _time.perf_counter()

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
