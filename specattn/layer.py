"""``AttentionLayer``: one attention layer as a backend sees it (pool index, softmax scale,
soft cap). A module of its own, importing nothing of ``data`` or ``validation``."""

from __future__ import annotations

import math
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
        if (not isinstance(self.layer_id, int) or isinstance(self.layer_id, bool)
                or self.layer_id < 0):
            raise InvalidInputError("layer.layer_id", "an int >= 0", repr(self.layer_id))
        if not (_is_real(self.scaling) and 0 < self.scaling < math.inf):
            raise InvalidInputError("layer.scaling", "a finite float > 0", repr(self.scaling))
        if not (_is_real(self.logit_cap) and 0 <= self.logit_cap < math.inf):
            raise InvalidInputError("layer.logit_cap", "a finite float >= 0 (0 = off)",
                                    repr(self.logit_cap))


def _is_real(x: object) -> bool:
    """An int or float (not a bool, a string or a tensor): the kernels take a Python scalar."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
