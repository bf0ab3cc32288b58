"""Give the heap back to the system after a burst of connections (glibc only).

Each TLS connection costs its TLS state and buffers from its accept on, before it says a word:
about 50 KiB, measured on 4,000 idle connections to a uvloop TLS listener (58 -> 255 MB).
Freed, that memory stays in malloc's heap: with the thresholds the broker sets
(``canopy_broker.cli.tune_allocator``) and with glibc's own, pieces of the heap in use keep the
rest from being returned. A flood of connections that never finish their handshake (closed by
the handshake timeout) left a broker at 770 MB for good. ``malloc_trim(0)`` returns the free
pages (260 -> 70 MB there).

It walks the heap, so it is not run on every close: :class:`HeapTrim` runs it at most once
per :data:`EVERY` seconds, and only after at least :data:`AFTER` connections were accepted
since the last (a flood, or steady churn), never in a steady state, where it would only make
the next large reads grow the heap again.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable

AFTER = 256
"""Connections accepted since the last trim that make the next one worth it."""
EVERY = 10.0
"""Seconds between two trims at the most."""


def malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)`` as a call; None where there is none."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class HeapTrim:
    """Counts accepted connections (:meth:`accepted`) and trims the heap when due
    (:meth:`tick`, from the broker's periodic tick). ``trim``: the call (the broker's is
    :func:`malloc_trim`'s; None: nothing happens)."""

    def __init__(self, trim: Callable[[], object] | None) -> None:
        self._trim = trim
        self.since = 0  # connections accepted since the last trim
        self._last = float("-inf")
        self.trims = 0

    def accepted(self) -> None:
        self.since += 1

    def freed(self) -> None:
        """Much was freed at once (a slow consumer's queue, cut): trim at the next tick that
        may (the queue of a subscriber that read nothing, cut, left the broker 400-500 MB
        above where it started)."""
        self.since = max(self.since, AFTER)

    def tick(self, now: float) -> bool:
        """Trim if due; whether it did."""
        if self._trim is None or self.since < AFTER or now - self._last < EVERY:
            return False
        self._trim()
        self.since, self._last = 0, now
        self.trims += 1
        return True
