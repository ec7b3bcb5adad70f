"""``AttentionLayer``: one attention layer as a backend sees it (pool index, softmax scale,
soft cap). Its own module so that ``validation`` can check it without importing ``data``."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidInputError

__all__ = ["AttentionLayer"]


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer as a backend sees it: pool index, softmax scale, soft cap.

    ``logit_cap > 0`` applies ``cap * tanh(score / cap)`` to ``scaling * q . k``."""

    layer_id: int
    scaling: float
    logit_cap: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.layer_id, int) or self.layer_id < 0:
            raise InvalidInputError("layer.layer_id", "an int >= 0", repr(self.layer_id))
        if not self.scaling > 0:
            raise InvalidInputError("layer.scaling", "a float > 0", repr(self.scaling))
        if not self.logit_cap >= 0:
            raise InvalidInputError("layer.logit_cap", "a float >= 0 (0 = off)",
                                    repr(self.logit_cap))
