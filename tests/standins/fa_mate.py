"""Stand-in for ``mate``, the MUSA port of the FlashAttention API (FA3-style)."""

from __future__ import annotations

from .fa_fa3api import make_flash_attn_with_kvcache
from .fa_reference import Recorder

RECORDER = Recorder()
flash_attn_with_kvcache = make_flash_attn_with_kvcache("mate", RECORDER)
