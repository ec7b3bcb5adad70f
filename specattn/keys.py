"""``BackendRequest``: the frozen, hashable description of what a backend must serve."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from .errors import InvalidInputError

Kind = Literal["decode", "extend"]
KINDS: tuple[str, str] = ("decode", "extend")
TREE_MODES: tuple[str, str] = ("lane", "path")

__all__ = ["BackendRequest", "Kind", "KINDS", "TREE_MODES"]


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
        if self.kind not in KINDS:
            raise InvalidInputError("kind", "'decode' or 'extend'", repr(self.kind))
        if self.tree_mode not in TREE_MODES:
            raise InvalidInputError("tree_mode", "'lane' or 'path'", repr(self.tree_mode))
        for name in ("topk", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInputError(name, "an int >= 1", repr(value))
        if not isinstance(self.num_steps, int) or self.num_steps < 0:
            raise InvalidInputError("num_steps", "an int >= 0", repr(self.num_steps))

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
