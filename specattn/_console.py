"""Terminal output of the commands: one ``rich`` console per stream, tables, progress bars.

``rich`` is imported here only, and only when a command prints; the library itself never
needs it. Tables wrap cells at spaces (a number is never split) and are as wide as the
terminal (``COLUMNS`` when set, else 120 columns when the output is not a terminal).
"""

from __future__ import annotations

import shutil
import sys
from typing import TYPE_CHECKING, Optional, TextIO

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

__all__ = ["make_console", "make_table", "print_unpadded", "ItemProgress", "DEFAULT_WIDTH"]

DEFAULT_WIDTH = 120


def make_console(file: Optional[TextIO] = None, width: Optional[int] = None) -> "Console":
    """A console on ``file`` (default stdout): no colour guessing, no markup in our text."""
    from rich.console import Console

    file = sys.stdout if file is None else file
    if width is None:
        width = max(shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns, 80)
    return Console(file=file, width=width, highlight=False, markup=False, emoji=False,
                   soft_wrap=False)


def make_table(*columns: str, no_wrap: tuple[str, ...] = (),
               truncate: tuple[str, ...] = ()) -> "Table":
    """A borderless table with a header row; ``no_wrap`` columns are never wrapped;
    ``truncate`` columns are cut with an ellipsis at the terminal's edge (one line a row)."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold",
                  collapse_padding=True)
    for name in columns:
        table.add_column(name, no_wrap=name in no_wrap or name in truncate,
                         overflow="ellipsis" if name in truncate else "fold")
    return table


def print_unpadded(console: "Console", table: "Table") -> None:
    """Print ``table`` on ``console`` without the spaces that pad every line to the table's
    width (a pipe or a log gets the text, not a rectangle of blanks)."""
    with console.capture() as captured:
        console.print(table)
    console.file.write("\n".join(line.rstrip() for line in captured.get().split("\n")))
    console.file.flush()


class ItemProgress:
    """A progress bar over ``total`` items on ``file`` (default stderr).

    On a terminal, a ``rich`` bar redrawn in place (description, bar, count, elapsed time,
    the item running); elsewhere (a log, a pipe), one plain line per item as it starts.
    Use as a context manager; ``start(label)`` before an item, ``advance()`` after it."""

    def __init__(self, total: int, description: str = "", file: Optional[TextIO] = None
                 ) -> None:
        self.total, self.description = max(total, 0), description
        self.console = make_console(sys.stderr if file is None else file)
        self.done = 0
        self._bar: Optional["Progress"] = None
        self._task = None

    def __enter__(self) -> "ItemProgress":
        if self.console.is_terminal:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[item]}"), console=self.console)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total, item="")
        return self

    def start(self, label: str) -> None:
        """Show ``label`` as the item now running."""
        if self._bar is not None:
            self._bar.update(self._task, item=label)
        else:
            self.console.print(f"[{self.done + 1}/{self.total}] {label}")

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.update(self._task, item="done")
            self._bar.stop()
