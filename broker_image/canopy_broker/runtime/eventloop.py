"""Which event loop a Canopy process runs: uvloop when it is installed, asyncio's otherwise.

Why: in the broker, a notification's cost is half event-loop work (the readiness poll, the
callbacks, one socket write per subscriber per turn through the transport), and uvloop does
that work in C on libuv. Measured with ``canopy bench peers`` (interleaved runs,
docs/performance.md): about 11 % less broker CPU per notification.

**The clock.** uvloop's ``loop.time()`` is libuv's, which counts whole milliseconds, so a
burst of events gets one timestamp. On it, a subscriber failing over from a SIGKILLed broker
missed notifications (two crash tests, every run): the retention sorted what it serves a
resuming client on the timestamp alone and handed a same-millisecond burst over backwards, and
the client dropped all but the newest as old. That sort is fixed (core/repair.py, with a test
of tied timestamps), and both crash tests pass on uvloop's own clock. The loop here still reads
``time.monotonic()``, as asyncio's does: timestamps are compared in more places (custody,
coverage of a resume), and no tie should decide one. Its timers, relative, are libuv's.

The runtime uses only the public asyncio API, so both loops run the same code; the tests run
brokers in-process on asyncio's loop and as processes on this one. ``CANOPY_LOOP=asyncio``
chooses asyncio's loop anyway (to rule the loop out when chasing a problem), and a platform
without uvloop (it is not built for Windows) gets asyncio's silently.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LOOP_ENV", "loop_name", "run"]

T = TypeVar("T")
LOOP_ENV = "CANOPY_LOOP"


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    if os.environ.get(LOOP_ENV, "uvloop") == "asyncio":
        return None
    try:
        import uvloop  # noqa: PLC0415 - optional: absent on platforms it is not built for
    except ImportError:
        return None

    class Loop(uvloop.Loop):
        time = staticmethod(time.monotonic)  # see the module docstring: the clock

    return Loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the chosen loop."""
    factory = _uvloop_factory()
    if factory is None:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: what ``/status`` and the first log line say."""
    return "uvloop" if isinstance(loop, _uvloop_types()) else "asyncio"


def _uvloop_types() -> tuple[type, ...]:
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return ()
    return (uvloop.Loop,)
