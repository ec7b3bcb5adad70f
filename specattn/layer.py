"""``AttentionLayer``: one attention layer as a backend sees it (pool index, softmax scale,
soft cap, FP8 KV scales). A module of its own, importing nothing of ``data`` or
``validation``."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Union

import torch

from .errors import InvalidInputError
from .fp8 import check_scale

__all__ = ["AttentionLayer"]


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer as a backend sees it: pool index, softmax scale, soft cap, and
    the scales of an FP8 KV pool.

    ``logit_cap > 0`` applies ``cap * tanh(score / cap)`` to ``scaling * q . k``.
    ``k_scale`` / ``v_scale`` (``specattn.fp8``): with an FP8 pool (``kv_cache_dtype``
    ``"fp8_e4m3"`` / ``"fp8_e5m2"``), a stored key is ``code * k_scale`` and a stored value
    ``code * v_scale`` (MLA: ``k_scale`` for the whole latent row); ``forward`` writes the
    new KV divided by them. A Python float, or a one-element device tensor (SGLang's
    ``layer.k_scale``), read on the device: a captured CUDA graph sees a new value at its
    next replay. Pools of the model's dtype ignore them. They take no part in ``==``."""

    layer_id: int
    scaling: float
    logit_cap: float = 0.0
    k_scale: Union[float, torch.Tensor] = field(default=1.0, compare=False)
    v_scale: Union[float, torch.Tensor] = field(default=1.0, compare=False)

    def __post_init__(self) -> None:
        # NumPy scalars (a config's ``np.float32`` scale, an ``np.int64`` index) become
        # Python numbers: the kernels take Python scalars, and a frozen layer is hashed.
        if _is_scalar(self.layer_id, numbers.Integral):
            object.__setattr__(self, "layer_id", int(self.layer_id))
        for name in ("scaling", "logit_cap", "k_scale", "v_scale"):
            if _is_scalar(getattr(self, name), numbers.Real):
                object.__setattr__(self, name, float(getattr(self, name)))
        if not _is_scalar(self.layer_id, int) or self.layer_id < 0:
            raise InvalidInputError("layer.layer_id", "an int >= 0", repr(self.layer_id))
        if not (isinstance(self.scaling, float) and 0 < self.scaling < math.inf):
            raise InvalidInputError("layer.scaling", "a finite float > 0", repr(self.scaling))
        if not (isinstance(self.logit_cap, float) and 0 <= self.logit_cap < math.inf):
            raise InvalidInputError("layer.logit_cap", "a finite float >= 0 (0 = off)",
                                    repr(self.logit_cap))
        check_scale("layer.k_scale", self.k_scale)
        check_scale("layer.v_scale", self.v_scale)


def _is_scalar(x: object, kind: type) -> bool:
    """A number of ``kind`` (Python's or NumPy's, whose ``bool_`` is neither) that is not a
    bool."""
    return isinstance(x, kind) and not isinstance(x, bool)
