"""``tokenspeed_mla``: dense paged MLA through the tokenspeed-mla CuTe-DSL kernels
(Blackwell only). Glue lands with issue #7."""

from __future__ import annotations

from ..platforms import cuda_capability
from ._pending import pending_pair, pending_reason

TokenspeedMLADecode, TokenspeedMLAExtend = pending_pair(
    __name__, "tokenspeed_mla", "Dense paged MLA through the tokenspeed-mla CuTe-DSL kernels.",
    pending_reason(7, "the tokenspeed-mla glue"), platforms=cuda_capability(10),
    models=("mla",), mla_required_name="tokenspeed_mla",
    requires=(("tokenspeed_mla", "tokenspeed-mla"),), kernel_library="tokenspeed-mla",
    priority={"cuda": 60}, attrs={"page_sizes": frozenset({32, 64})})
