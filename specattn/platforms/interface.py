"""``Platform``: what specattn knows about the machine, as one frozen value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from ..errors import InvalidInputError
from ._probes import module_available

DeviceType = Literal["cuda", "hip", "npu", "musa", "xpu", "cpu"]
DEVICE_TYPES: tuple[str, ...] = ("cuda", "hip", "npu", "musa", "xpu", "cpu")

__all__ = ["Platform", "DeviceType", "DEVICE_TYPES"]


@dataclass(frozen=True)
class Platform:
    """The accelerator (or CPU) selection decisions are made for.

    Attributes
    ----------
    device:
        ``"cuda" | "hip" | "npu" | "musa" | "xpu" | "cpu"``.
    capability:
        ``(major, minor)`` compute capability for CUDA (and MUSA/HIP when known), else ``None``.
    cpu_has_amx:
        Whether the host CPU has Intel AMX tiles.
    libraries:
        Importable vendor libraries (module names such as ``"flashinfer"``,
        ``"flash_attn.cute"``). ``None`` (the default) means "probe this process with
        ``importlib.util.find_spec``", which never imports the library. Tests pass an explicit
        set so the answer does not depend on the machine.
    triton_interpret:
        ``TRITON_INTERPRET=1`` was set: Triton kernels run on the CPU interpreter.
    device_name:
        Free text for humans (``"NVIDIA H200"``); never used for decisions.
    """

    device: DeviceType = "cpu"
    capability: Optional[tuple[int, int]] = None
    cpu_has_amx: bool = False
    libraries: Optional[frozenset[str]] = None
    triton_interpret: bool = False
    device_name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.device not in DEVICE_TYPES:
            raise InvalidInputError("device", f"one of {DEVICE_TYPES}", repr(self.device))
        if self.capability is not None:
            cap = tuple(self.capability)
            if len(cap) != 2 or not all(isinstance(x, int) for x in cap):
                raise InvalidInputError("capability", "(major, minor) ints or None",
                                        repr(self.capability))
            object.__setattr__(self, "capability", cap)
        if self.libraries is not None:
            object.__setattr__(self, "libraries", frozenset(self.libraries))

    def has_library(self, module: str) -> bool:
        """Whether ``module`` can be imported here (never imports it)."""
        if self.libraries is not None:
            return module in self.libraries
        return module_available(module)

    @property
    def capability_str(self) -> str:
        return "" if self.capability is None else f"{self.capability[0]}.{self.capability[1]}"

    def __str__(self) -> str:
        parts: list[str] = [self.device]
        if self.capability is not None:
            parts.append(self.capability_str)
        if self.device == "cpu":
            parts.append("with AMX" if self.cpu_has_amx else "without AMX")
            if self.triton_interpret:
                parts.append("TRITON_INTERPRET=1")
        text = " ".join(parts)
        return f"{text} ({self.device_name})" if self.device_name else text
