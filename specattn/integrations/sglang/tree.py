"""``path`` tree mode inside SGLang: the parents EAGLE's draft loop computes, handed on.

SGLang's ``draft_forward`` picks each step's tokens with ``select_top_k_tokens``; from step 1
on, its third tree output is ``topk_cs_index + (K*K*(i-1) + K)`` where ``topk_cs_index // K``
is the lane (at step ``i - 1``) each new token descends from. The plugin wraps that function
(an AROUND hook, only in ``path`` mode) and copies those lanes, in place, into the parents
tensor of the draft round being run, before step ``i``'s forward. The copy is a device op, so
a captured CUDA graph replays it too.
"""

from __future__ import annotations

from typing import Any, Optional

from .adapter import DecodeAdapter

__all__ = ["SELECT_TOP_K_TARGET", "activate", "around_select_top_k_tokens"]

SELECT_TOP_K_TARGET = "sglang.srt.speculative.spec_utils.select_top_k_tokens"

_active: Optional[DecodeAdapter] = None


def activate(adapter: Optional[DecodeAdapter]) -> None:
    """The draft round whose parents the next ``select_top_k_tokens`` calls fill."""
    global _active
    _active = adapter


def around_select_top_k_tokens(original, i: int, topk_p, topk_index, hidden_states, scores,
                               topk: int, *args: Any, **kwargs: Any):
    out = original(i, topk_p, topk_index, hidden_states, scores, topk, *args, **kwargs)
    if _active is not None and i >= 1:
        offset = topk * topk * (i - 1) + topk
        _active.record_parents(i, (out[3][2] - offset) // topk)
    return out
