"""Ascend NPU rows through ``torch_npu``: ``ascend`` and the NPU flavour of ``dsv4``.
Glue lands with issue #7."""

from __future__ import annotations

from ..platforms import is_npu
from ._pending import pending_pair, pending_reason

_PENDING = pending_reason(7, "the torch_npu glue")
_NPU = (("torch_npu", "torch-npu"),)

AscendDecode, AscendExtend = pending_pair(
    __name__, "ascend", "Ascend NPU attention through torch_npu's fused attention ops.",
    _PENDING, platforms=is_npu, requires=_NPU, kernel_library="torch_npu",
    priority={"npu": 70})
DSV4NpuDecode, DSV4NpuExtend = pending_pair(
    __name__, "dsv4", "DeepSeek V4 draft attention, Ascend flavour (torch_npu).", _PENDING,
    flavour="npu", platforms=is_npu, requires=_NPU, kernel_library="torch_npu",
    attrs={"auto_eligible": False})
