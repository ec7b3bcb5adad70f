"""Stand-in for FlashAttention-3's ``flash_attn_interface`` (hopper/ build)."""

from __future__ import annotations

from .fa_fa3api import make_flash_attn_with_kvcache
from .fa_reference import Recorder

RECORDER = Recorder()
flash_attn_with_kvcache = make_flash_attn_with_kvcache("fa3", RECORDER)
