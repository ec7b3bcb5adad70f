"""The command line's argument parser: a usage error is one line."""

from __future__ import annotations

import argparse

__all__ = ["CommandParser"]


class CommandParser(argparse.ArgumentParser):
    """A usage error is one line, the error and where the options are listed: argparse's
    default prints the whole usage first (a dozen lines for ``select``)."""

    def error(self, message: str):  # type: ignore[override]
        hint = "" if "choose from" in message else f" ({self.prog} --help lists the options)"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")
