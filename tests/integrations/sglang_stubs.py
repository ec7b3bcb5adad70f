"""Import-only stand-ins for the packages SGLang's test kit pulls in but never uses here
(``torchvision``, HF ``datasets``): ``specattn.integrations.sglang.stubs``, installed only
when the real package is missing."""

from __future__ import annotations

from specattn.integrations.sglang import stubs

__all__ = ["install"]


def install() -> None:
    stubs.install(stubs.CPU_PACKAGES)
