"""Progress of long commands: a bar on a terminal, plain lines everywhere else.

On a terminal people want to see how far a 16-minute report or a roll-out of twenty brokers has
got, and how long is left: a rich progress bar. In a log, a CI job or a pipe a bar is noise, and
every step should stay a line that can be read and grepped later: the same messages, prefixed.
``CANOPY_PROGRESS=lines`` forces lines on a terminal too.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
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


# -- the command's current progress, for helpers deep in it -----------------------------------

_current: Progress | None = None


@contextlib.contextmanager
def showing(prefix: str, total: int) -> Iterator[Progress]:
    """A :class:`Progress` that the module functions below report to while a command runs
    (one command runs at a time in a process), so helpers need not pass it around."""
    global _current  # noqa: PLW0603 - see the docstring
    with Progress(prefix, total) as shown:
        _current = shown
        try:
            yield shown
        finally:
            _current = None


def report(prefix: str, message: str) -> None:
    """Something the command is doing or has found: above the bar, or a ``[prefix]`` line."""
    if _current is not None:
        _current.note(message)
    else:
        print(f"[{prefix}] {message}", file=sys.stderr, flush=True)


def advance(prefix: str, message: str) -> None:
    """One of the command's counted steps is done: the bar advances (or a line)."""
    if _current is not None:
        _current.step(message)
    else:
        report(prefix, message)


def status(prefix: str, message: str) -> None:
    """How the current step is going (a counter that changes every second)."""
    if _current is not None:
        _current.status(message)
    else:
        report(prefix, message)
