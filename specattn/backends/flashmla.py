"""``flashmla``: FlashMLA's ``flash_mla_with_kvcache`` (page size 64). Draft extend is not
provided (original behaviour): the factory logs a warning and returns ``None``. Glue lands
with issue #7.
"""

from __future__ import annotations

from ..platforms import any_platform, cuda_capability
from ..registry import Dispatcher, Route, default_registry
from ._pending import PendingDecode, pending_reason

EXTEND_WARNING = "flashmla prefill backend is not yet supported for draft extend."


class FlashMLADecode(PendingDecode, name="flashmla", platforms=cuda_capability(9, 10),
                     models=("mla",), requires=(("flash_mla", "flash-mla"),),
                     kernel_library="flash_mla", priority={"cuda": 65}):
    page_sizes = frozenset({64})
    pending = pending_reason(7, "the FlashMLA glue")


default_registry.add_dispatcher(Dispatcher(
    "flashmla", "extend", (Route(any_platform, None),),
    note="draft extend is not provided for flashmla (original behaviour)",
    warning=EXTEND_WARNING))
