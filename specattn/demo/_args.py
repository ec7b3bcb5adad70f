"""Argument types shared by the demo command lines (``demo.cli`` and ``demo.smollm2.cli``)."""

from __future__ import annotations

import argparse

__all__ = ["positive", "non_negative"]


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value
