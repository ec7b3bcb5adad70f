"""The package logger and once-only warnings."""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger("specattn")

_seen: set[tuple[str, str]] = set()


def get_logger(name: str) -> logging.Logger:
    """``specattn.<name>`` logger."""
    return logging.getLogger(f"specattn.{name}")


def warn_once(log: logging.Logger, message: str) -> None:
    """Log ``message`` at WARNING level the first time it is seen in this process."""
    key = (log.name, message)
    if key not in _seen:
        _seen.add(key)
        log.warning(message)



def deprecation_once(message: str, stacklevel: int = 3) -> None:
    """Emit ``DeprecationWarning(message)`` once per process."""
    key = ("DeprecationWarning", message)
    if key not in _seen:
        _seen.add(key)
        warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


def reset_once_registry() -> None:
    """Forget which once-only messages were emitted (tests use this)."""
    _seen.clear()
