"""The backend choice both demo command lines make and print (`demo.cli`, `demo.smollm2.cli`)."""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from ..base import DraftDecodeBackend, DraftExtendBackend
from ..config import SpecConfig
from ..data import DraftRunner
from ..errors import SpecAttnError
from ..factory import DraftBackendFactory

__all__ = ["select_backends"]


def select_backends(args: argparse.Namespace, runner: DraftRunner, say: Callable[[str], None]
                    ) -> tuple[DraftExtendBackend, Optional[DraftDecodeBackend]]:
    """The draft extend and decode backends ``args.backend`` selects for ``runner``, with
    one line naming them (``--explain``: every step of the selection before it)."""
    factory = DraftBackendFactory(SpecConfig(attention_backend=args.backend,
                                             page_size=args.page_size),
                                  runner, args.topk, args.steps, tree_mode=args.tree_mode)
    if args.explain:
        say(f"selection (attention_backend={args.backend!r}):")
        say(factory.explain_draft_extend_backend().explain())
        say(factory.explain_decode_backend().explain())
    extend, decode = factory.create_draft_extend_backend(), factory.create_decode_backend()
    if extend is None:
        raise SpecAttnError(f"{args.backend!r} has no draft-extend backend; the demo needs "
                            "one (pass another --backend)")
    say(f"-> extend: {type(extend).name} ({type(extend).qualified_name()}); decode: "
        + ("none (num_steps == 1: the extend's top-k is the whole draft)" if decode is None
           else f"{type(decode).name} ({type(decode).qualified_name()})")
        + ("" if args.explain else f" (attention_backend={args.backend!r}; --explain: why)"))
    return extend, decode
