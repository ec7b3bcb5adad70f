"""``SpecConfig``: the serving-world fields that decide which backend a draft model gets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .errors import InvalidInputError
from .kv_layouts import check_kv_cache_dtype

__all__ = ["SpecConfig"]


@dataclass(frozen=True)
class SpecConfig:
    """Backend names and cache settings, named as the serving engines name them.

    Name precedence (``docs/selection.md`` rule 2), decided separately for decode and extend:
    ``speculative_draft_attention_backend`` if set, else the mode field, else
    ``attention_backend``. The mode field is ``decode_attention_backend`` for decode; for
    extend it is ``decode_attention_backend`` when ``speculative_attention_mode == "decode"``
    and ``prefill_attention_backend`` otherwise. A name of ``None`` (after precedence) or
    ``"auto"`` lets specattn choose.

    ``page_size`` and ``kv_cache_dtype`` describe the pools; a factory on a ``DraftRunner``
    refuses a runner whose pools differ, and its ``kv_cache_dtype`` ``"auto"`` takes the
    runner's (FP8 pools select a backend that reads them).
    """

    attention_backend: Optional[str] = None
    decode_attention_backend: Optional[str] = None
    prefill_attention_backend: Optional[str] = None
    speculative_draft_attention_backend: Optional[str] = None
    speculative_attention_mode: Literal["prefill", "decode"] = "prefill"
    page_size: int = 1
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.speculative_attention_mode not in ("prefill", "decode"):
            raise InvalidInputError("speculative_attention_mode", "'prefill' or 'decode'",
                                    repr(self.speculative_attention_mode))
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) \
                or self.page_size < 1:
            raise InvalidInputError("page_size", "an int >= 1", repr(self.page_size))
        check_kv_cache_dtype(self.kv_cache_dtype)
        for field in ("attention_backend", "decode_attention_backend",
                      "prefill_attention_backend", "speculative_draft_attention_backend"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(field, "a backend name (str) or None", repr(value))

    def mode_field(self, kind: str) -> str:
        """The config field that names the backend for ``kind`` (rule 2)."""
        if kind == "decode" or self.speculative_attention_mode == "decode":
            return "decode_attention_backend"
        return "prefill_attention_backend"

    def backend_name(self, kind: str) -> Optional[str]:
        """The name ``kind`` asks for, exactly as the original factory reads it: the draft
        override if truthy, else the mode field, and ``attention_backend`` if that is None."""
        name = self.speculative_draft_attention_backend or getattr(self, self.mode_field(kind))
        return self.attention_backend if name is None else name

    def name_trail(self, kind: str) -> list[str]:
        """Human-readable steps of rule 2 for ``kind`` (``"decode"`` or ``"extend"``)."""
        fields = ["speculative_draft_attention_backend", self.mode_field(kind),
                  "attention_backend"]
        steps = []
        for i, f in enumerate(fields):
            value = getattr(self, f)
            is_set = bool(value) if i == 0 else value is not None
            if is_set:
                steps.append(f"{f}={value!r} is set: use it")
                return steps
            steps.append(f"{f} is not set")
        steps.append("no name given: choose automatically ('auto')")
        return steps
