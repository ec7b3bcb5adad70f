"""Tensor checks shared by ``specattn.validation`` (batches, forward arguments, a backend's
extra inputs) and ``specattn.data`` (a runner checks its own pools): type, dtype, rank, device,
shape and a unit last stride. Each failure raises ``InvalidInputError`` naming the argument,
the expectation and the value. Also ``debug_checks_enabled`` (``SPECATTN_DEBUG_CHECKS=1``:
check tensor values on a device too). Depends on ``specattn.errors`` alone."""

from __future__ import annotations

import os
from typing import Optional, TypeGuard

import torch

from .errors import InvalidInputError

__all__ = ["INDEX_DTYPES", "ACT_DTYPES", "check_tensor", "debug_checks_enabled"]

INDEX_DTYPES = (torch.int32, torch.int64)
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def debug_checks_enabled() -> bool:
    """``SPECATTN_DEBUG_CHECKS`` is set (not ``0``): checks that read tensor values run on a
    device too, at the cost of a host sync."""
    return os.environ.get("SPECATTN_DEBUG_CHECKS", "0") not in ("", "0")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as messages name dtypes."""
    return str(dtype).replace("torch.", "")


def _is_int(x: object) -> TypeGuard[int]:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def _tensor(name: str, t: object, *, dtypes: tuple, ndim: int,
            device: Optional[torch.device] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        names = "/".join(dtype_name(d) for d in dtypes)
        raise InvalidInputError(name, f"dtype {names}", dtype_name(t.dtype))
    if t.dim() != ndim:
        raise InvalidInputError(name, f"a {ndim}-D tensor", f"shape {tuple(t.shape)}")
    if device is not None and not _same_device(t.device, device):
        raise InvalidInputError(name, f"a tensor on {device}", f"a tensor on {t.device}")
    return t


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _shape(name: str, t: torch.Tensor, expected: tuple) -> None:
    if len(t.shape) != len(expected) or any(
            e is not None and n != e for n, e in zip(t.shape, expected)):
        want = tuple("*" if e is None else e for e in expected)
        raise InvalidInputError(name, f"shape {want}".replace("'", ""),
                                f"shape {tuple(t.shape)}")


def _last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise InvalidInputError(name, "unit stride in the last dimension",
                                f"strides {tuple(t.stride())}")


def check_tensor(name: str, t: object, *, dtypes: tuple, shape: tuple,
                 device: Optional[torch.device] = None, unit_last_stride: bool = True,
                 ) -> torch.Tensor:
    """A backend's extra input (index keys, sinks, ...): a tensor of one of ``dtypes`` and
    ``shape`` (``None`` entries: any size) on ``device``, with a unit last stride."""
    t = _tensor(name, t, dtypes=dtypes, ndim=len(shape), device=device)
    _shape(name, t, shape)
    if unit_last_stride:
        _last_dim_contiguous(name, t)
    return t
