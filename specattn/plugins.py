"""Third-party backends through the entry-point group ``specattn.backends``.

A plugin package declares, in its ``pyproject.toml``::

    [project.entry-points."specattn.backends"]
    mybackend = "my_package.specattn_backend"

The target module (or a callable, called with no arguments) defines backend subclasses, which
register themselves on import. Plugins load once per process, lazily, on the first registry
query (``list_backends``, the factory). A plugin that fails to load is logged and skipped.
``SPECATTN_DISABLE_PLUGIN_AUTOLOAD=1`` turns autoloading off; ``SPECATTN_PLUGINS=a,b`` loads
only the named entry points.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading

from ._logging import get_logger
from .registry import default_registry, use_registry

log = get_logger("plugins")

ENTRY_POINT_GROUP = "specattn.backends"
DISABLE_ENV = "SPECATTN_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_ENV = "SPECATTN_PLUGINS"

_lock = threading.Lock()
_loaded = False
loaded_plugins: dict[str, str] = {}  # entry-point name -> "ok" or the error text

__all__ = ["load_plugins", "ENTRY_POINT_GROUP", "DISABLE_ENV", "ALLOW_ENV", "loaded_plugins"]


def load_plugins(force: bool = False) -> dict[str, str]:
    """Import every ``specattn.backends`` entry point once; returns name -> status."""
    global _loaded
    with _lock:
        if _loaded and not force:
            return dict(loaded_plugins)
        _loaded = True
        if os.environ.get(DISABLE_ENV, "0") not in ("", "0") and not force:
            log.debug("plugin autoload disabled by %s", DISABLE_ENV)
            return {}
        allow = {n.strip() for n in os.environ.get(ALLOW_ENV, "").split(",") if n.strip()}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allow and ep.name not in allow:
                continue
            if ep.name in loaded_plugins and loaded_plugins[ep.name] == "ok":
                continue
            try:
                # Plugins always register globally, even when a test scope is active.
                with use_registry(default_registry):
                    target = ep.load()
                    if callable(target):
                        target()
                loaded_plugins[ep.name] = "ok"
                log.info("loaded specattn plugin %r (%s)", ep.name, ep.value)
            except Exception as exc:  # a broken plugin must not break selection
                loaded_plugins[ep.name] = f"{type(exc).__name__}: {exc}"
                log.warning("specattn plugin %r (%s) failed to load and is skipped: %s",
                            ep.name, ep.value, exc)
        return dict(loaded_plugins)
