"""Background tasks started one way: named, watched, and stopped together.

A bare ``asyncio.create_task`` that dies takes its exception with it until the task object is
garbage-collected ("Task exception was never retrieved"), long after the heartbeat or the dialer
it ran has silently stopped. Every background task of the runtime and the client goes through a
:class:`TaskSet` instead, which

* names the task (the name is in every log line about it),
* logs at ERROR, with the traceback, a task that raised, and a task meant to run for as long as
  its owner (``forever=True``) that returned,
* calls the owner back (``on_failure``) so it can react — a broker whose heartbeat loop died is
  not healthy,
* cancels and awaits all of its tasks in :meth:`stop`, so nothing outlives its owner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("canopy.tasks")


class TaskSet:
    """The background tasks of one owner (a broker, a client)."""

    def __init__(self, owner: str, on_failure: Callable[[str, str], None] | None = None) -> None:
        self.owner = owner
        self.on_failure = on_failure
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failures: list[str] = []

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(
        self, coro: Coroutine[Any, Any, T], name: str, *, forever: bool = False
    ) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.owner}: {name}")
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._ended(t, forever))
        return task

    def _ended(self, task: asyncio.Task[Any], forever: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            why = f"failed: {type(exc).__name__}: {exc}"
            log.error("task %r %s", task.get_name(), why, exc_info=exc)
        elif forever:
            why = "ended, but it should run as long as its owner"
            log.error("task %r %s", task.get_name(), why)
        else:
            return
        self.failures.append(f"{task.get_name()} {why}")
        if self.on_failure is not None:
            self.on_failure(task.get_name(), why)

    async def stop(self) -> None:
        """Cancel every task (except the caller, if it is one) and wait for them to end."""
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
