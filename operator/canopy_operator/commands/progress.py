"""Progress of long commands: a bar on a terminal, plain lines everywhere else.

On a terminal people want to see how far a 16-minute report or a roll-out of twenty brokers has
got, and how long is left: a rich progress bar. In a log, a CI job or a pipe a bar is noise, and
every step should stay a line that can be read and grepped later: the same messages, prefixed.
``CANOPY_PROGRESS=lines`` forces lines on a terminal too.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import IO, Any


def on_terminal(stream: IO[str]) -> bool:
    return (
        stream.isatty()
        and os.environ.get("TERM") != "dumb"
        and os.environ.get("CANOPY_PROGRESS") != "lines"
    )


class Progress:
    """``total`` counted steps under ``prefix``; :meth:`step` after each, :meth:`note` for a
    message that is not a step."""

    def __init__(self, prefix: str, total: int, *, stream: IO[str] | None = None) -> None:
        self.prefix, self.total, self.done = prefix, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if on_terminal(self.stream):
            from rich.console import Console  # noqa: PLC0415  (only on a terminal)
            from rich.progress import (  # noqa: PLC0415
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as Bar  # noqa: PLC0415

            self._bar = Bar(
                TextColumn(f"[bold]{self.prefix}[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("left"),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=Console(file=self.stream),
            )
            self._bar.start()
            self._task = self._bar.add_task("", total=self.total)
        return self

    def step(self, message: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=message)
        else:
            self._line(f"{self.done}/{self.total} {message}")

    def status(self, message: str) -> None:
        """How the current step is going (a counter that changes every second): the bar's
        description on a terminal, a line elsewhere."""
        if self._bar is not None:
            self._bar.update(self._task, description=message)
        else:
            self._line(message)

    def note(self, message: str) -> None:
        if self._bar is not None:
            self._bar.console.print(f"[{self.prefix}] {message}", markup=False, highlight=False)
        else:
            self._line(message)

    def _line(self, message: str) -> None:
        print(f"[{self.prefix}] {message}", file=self.stream, flush=True)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
