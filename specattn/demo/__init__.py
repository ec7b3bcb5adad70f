"""``specattn demo``: a tiny EAGLE draft model run end to end through specattn backends.

``model`` (random-weight transformer, GQA or absorbed MLA, RoPE), ``eagle`` (draft rounds and
tree bookkeeping), ``render`` (text output), ``cli`` (options and the run).
"""

from __future__ import annotations

from .cli import cli_main

__all__ = ["cli_main"]
