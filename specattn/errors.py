"""Exceptions raised by specattn.

Every class subclasses the builtin a caller would already catch (``ValueError``,
``RuntimeError``, ``TypeError``, ``LookupError``), so code written against the original
factory (which raised plain ``ValueError``) keeps working.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "SpecAttnError",
    "UnknownBackendError",
    "ModelMismatchError",
    "BackendUnavailableError",
    "RegistrationError",
    "DuplicateBackendError",
    "InvalidInputError",
    "CallOrderError",
    "OutOfCapacityError",
    "NotRegisteredError",
]


def shorten(text: str, width: int = 60) -> str:
    """``text`` for a message, cut to ``width`` characters: a value quoted in an error may be
    anything (an unknown name, a whole environment variable), the message stays one line."""
    return text if len(text) <= width else text[:width - 3] + "..."


class SpecAttnError(Exception):
    """Base class of the errors specattn raises on purpose (``docs/api/errors.md`` lists the
    few that keep Python's own types)."""


class UnknownBackendError(SpecAttnError, ValueError):
    """A backend name that no registered class, alias or dispatcher answers to.

    The message begins exactly like the original factory's
    (``EAGLE is not supported in decode attention backend {name}``), then names the closest
    match (``Did you mean 'triton'?``) and lists the valid names. ``only_kind`` is the other
    kind when the name is registered for that kind alone (a decode-only backend asked for
    draft extend): the message then says which configuration field to name it in.
    """

    def __init__(self, message: str, name: object, valid_names: Sequence[str],
                 closest: str | None, only_kind: str | None = None):
        super().__init__(message)
        self.name = name
        self.valid_names = tuple(valid_names)
        self.closest = closest
        self.only_kind = only_kind


class ModelMismatchError(SpecAttnError, ValueError):
    """An MLA-only backend asked for by an MHA model (original factory rule 8)."""


class BackendUnavailableError(SpecAttnError, RuntimeError):
    """A known backend that cannot run here.

    ``reasons`` maps each candidate class (``module.qualname``) to the list of reasons it
    was rejected, so callers can print or inspect them. ``summary`` is the cause in one short
    line, for a person (the message itself names every candidate); it defaults to the
    message.
    """

    def __init__(self, message: str, name: str = "",
                 reasons: Mapping[str, Sequence[str]] | None = None, summary: str = ""):
        super().__init__(message)
        self.name = name
        self.reasons = {k: list(v) for k, v in (reasons or {}).items()}
        self.summary = summary or message


class RegistrationError(SpecAttnError, TypeError):
    """A backend class whose declaration (``name=``, ``aliases=``, ...) is malformed."""


class DuplicateBackendError(RegistrationError):
    """Two classes of one kind claim the same name or alias under overlapping predicates."""


class InvalidInputError(SpecAttnError, ValueError):
    """Bad tensors or metadata passed to a backend: names the argument, the expectation
    and the value that was given."""

    def __init__(self, argument: str, expected: str, got: object):
        super().__init__(f"{argument}: expected {expected}, got {got}")
        self.argument = argument
        self.expected = expected
        self.got = got


class CallOrderError(InvalidInputError, RuntimeError):
    """A method called out of protocol order: a backend's ``forward`` before
    ``init_forward_metadata``, a CUDA-graph capture/replay before ``init_cuda_graph_state``,
    or ``PagedKVAllocator``'s ``alloc_draft`` twice without ``release_draft``. ``argument``
    names the call that has to come first. Also a ``RuntimeError``: code that caught the
    plain ``RuntimeError`` some backends raised for this keeps working."""


class OutOfCapacityError(SpecAttnError, RuntimeError):
    """A ``PagedKVAllocator`` without a free ``req_to_token`` row or enough free KV slots for
    the call (nothing was allocated); ``free_request`` or ``truncate`` some first."""


class NotRegisteredError(SpecAttnError, LookupError):
    """``Registry.unregister`` of a class that registry does not hold."""
