"""Stand-in vendor modules for the glue rows (``flash_mla``, ``tokenspeed_mla``, ``aiter``,
``torch_npu``).

Each ``make()`` returns a fresh ``types.ModuleType`` whose functions have the documented
signature of the vendor API (names and defaults), record every call (bound arguments with
shapes, dtypes and devices), check the arguments against the documented shapes and layouts
(``StandinError`` on a mismatch) and answer with the reference result computed from *the
arguments they were given* (gathering keys through the block table or index list they
received), so a wrong table gives a wrong answer. Tests inject the module with
``monkeypatch.setitem(sys.modules, name, module)``.
"""

from ._common import Call, StandinError, install

__all__ = ["Call", "StandinError", "install"]
