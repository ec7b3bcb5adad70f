"""The FlashAttention-family stand-ins as one ``sys.modules`` table, and a context manager
that swaps modules in and restores what was there (tests and the conformance environments
share both)."""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Iterable, Iterator

from . import fa_cute, fa_interface, fa_mate

ALL = ("flash_attn.cute", "flash_attn_interface", "mate")


def flash_attn_modules(names: Iterable[str] = ALL) -> dict[str, types.ModuleType]:
    """``sys.modules`` entries for ``names`` (``flash_attn.cute`` brings its parent)."""
    parent = types.ModuleType("flash_attn")
    parent.cute = fa_cute
    table = {"flash_attn.cute": fa_cute, "flash_attn_interface": fa_interface, "mate": fa_mate}
    out = {name: table[name] for name in names}
    if "flash_attn.cute" in out:
        out["flash_attn"] = parent
    return out


@contextlib.contextmanager
def swapped_modules(table: dict[str, types.ModuleType]) -> Iterator[None]:
    """``sys.modules`` holds ``table``'s entries inside the block, its old entries after."""
    saved = {name: sys.modules.get(name) for name in table}
    sys.modules.update(table)
    try:
        yield
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
