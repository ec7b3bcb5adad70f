"""``dsa`` (DeepSeek V3.2 sparse attention; ``nsa`` is its deprecated alias).

The draft step's queries pick the top-2048 prefix tokens with the lightning indexer, then
run MLA over only those slots plus the lane's history. Kernels land with issue #7.
"""

from __future__ import annotations

from ..platforms import is_cuda, is_hip
from ._pending import pending_pair, pending_reason

DSADecode, DSAExtend = pending_pair(
    __name__, "dsa", "DeepSeek V3.2 sparse attention: lightning indexer top-2048, then sparse MLA.",
    pending_reason(7, "the DSA kernels"),
    deprecated_aliases=("nsa",), platforms=is_cuda | is_hip, models=("mla",),
    requires=(("triton", "triton"),), kernel_library="triton (specattn)",
    attrs={"auto_eligible": False, "page_sizes": frozenset({1, 64})})
