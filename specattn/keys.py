"""``BackendRequest``: the frozen, hashable description of what a backend must serve."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from ._tensor_checks import _is_int
from .errors import InvalidInputError
from .kv_layouts import check_kv_cache_dtype

Kind = Literal["decode", "extend"]
KINDS: tuple[Kind, Kind] = ("decode", "extend")
TREE_MODES: tuple[str, str] = ("lane", "path")

__all__ = ["BackendRequest", "Kind", "KINDS", "TREE_MODES", "a_kind", "check_draft_params",
           "check_kind"]


def a_kind(kind: str) -> str:
    """``"a decode"`` / ``"an extend"``, for messages."""
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def check_kind(kind: object) -> None:
    """``kind`` is ``"decode"`` or ``"extend"``."""
    if kind not in KINDS:
        raise InvalidInputError("kind", "'decode' or 'extend'", repr(kind))


def check_draft_params(topk: object, num_steps: object, tree_mode: object = "lane", *,
                       min_steps: int = 1) -> None:
    """The one check of ``topk`` (an int >= 1), ``num_steps`` (an int >= ``min_steps``) and
    ``tree_mode``. A request or a factory may ask for no draft steps (``min_steps=0``: the
    decode backend is then ``None``); a decode backend serves at least one."""
    if not _is_int(topk) or topk < 1:
        raise InvalidInputError("topk", "an int >= 1", repr(topk))
    if not _is_int(num_steps) or num_steps < min_steps:
        raise InvalidInputError("num_steps", f"an int >= {min_steps}", repr(num_steps))
    if tree_mode not in TREE_MODES:
        raise InvalidInputError("tree_mode", "'lane' or 'path'", repr(tree_mode))


@dataclass(frozen=True)
class BackendRequest:
    """What serving code asks of a backend. Fields left ``None`` are not checked.

    Selection (``resolve_*``) knows only ``kind``, ``mla``, ``topk``, ``num_steps``,
    ``page_size``, ``kv_cache_dtype`` and ``tree_mode``; a backend's constructor completes the
    request from the runner (``dtype``, ``head_dim``) and validates again.
    """

    kind: Kind
    mla: bool = False
    topk: int = 1
    num_steps: int = 2
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    tree_mode: str = "lane"
    dtype: Optional[torch.dtype] = None
    head_dim: Optional[int] = None

    def __post_init__(self) -> None:
        check_kind(self.kind)
        check_draft_params(self.topk, self.num_steps, self.tree_mode, min_steps=0)
        if not _is_int(self.page_size) or self.page_size < 1:
            raise InvalidInputError("page_size", "an int >= 1", repr(self.page_size))
        check_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def model(self) -> str:
        return "mla" if self.mla else "mha"

    def __str__(self) -> str:
        extra = ""
        if self.dtype is not None:
            extra += f", dtype={str(self.dtype).replace('torch.', '')}"
        if self.head_dim is not None:
            extra += f", head_dim={self.head_dim}"
        return (f"{self.kind} {self.model.upper()} topk={self.topk} num_steps={self.num_steps} "
                f"page_size={self.page_size} kv_cache_dtype={self.kv_cache_dtype} "
                f"tree_mode={self.tree_mode}{extra}")
