"""What a client makes of the notifications it reads: :class:`Notification`, and the loop that
turns a frame's notification messages into them; compiled with mypyc (setup.py).

Why compiled: a subscriber reading a busy broker spends most of its time here, once per
notification (a duplicate check, the object built, the inbox appended to): interpreted, about
0.6 µs each, which held the one-broker benchmark's client process at a full core. A native
class is also cheaper to build than a class with ``__slots__`` and an interpreted
``__init__``. The module is pure (no I/O) and stays importable as Python, the reference the
compiled build is tested against (tests/unit/test_native.py).

Why here, in the runtime's wire layer and not in the client package: the client reads with it
as it writes with framing.py and outbox.py, and mypyc type-checks a compiled module's packages
at build time, where the client package's ``__init__`` would pull in orjson, which the build
environment does not have.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, Final

from canopy_broker.core.events import Event, Value

NOTIFY: Final = 20
"""``B_NOTIFY`` of the wire format (runtime/framing.py, which this compiled module cannot
import: it needs orjson, which the build does not have); a test holds the two equal."""


class Notification:
    """One delivered event: envelope, attributes and which of our subscriptions matched.

    Compiled, it cannot be subclassed (nor can it be given other attributes, as with its
    ``__slots__`` interpreted); it pickles and copies as before (``__reduce__``)."""

    __slots__ = ("attrs", "hops", "publisher", "seq", "sub_ids")

    def __init__(
        self, publisher: str, seq: int, hops: int, attrs: dict[str, Value], sub_ids: Iterable[str]
    ) -> None:
        self.publisher = publisher
        self.seq = seq
        self.hops = hops
        self.attrs = attrs
        self.sub_ids: tuple[str, ...] = tuple(sub_ids)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Notification, (self.publisher, self.seq, self.hops, self.attrs, self.sub_ids))

    @property
    def id(self) -> str:
        return f"{self.publisher}:{self.seq}"

    @property
    def event(self) -> Event:
        return Event(self.publisher, self.seq, self.attrs, self.hops)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "publisher": self.publisher,
            "seq": self.seq,
            "hops": self.hops,
            "attrs": self.attrs,
            "sub_ids": list(self.sub_ids),
        }

    def __repr__(self) -> str:
        return f"Notification({self.id}, hops={self.hops}, {self.attrs!r}, subs={self.sub_ids})"


def notification(item: list[Any]) -> Notification:
    """A notification message ``[20, publisher, seq, hops, attrs, [sub_ids]]`` as an object;
    ValueError if it is not one (the caller closes the connection: a broker sent it)."""
    if len(item) != 6:
        raise ValueError(f"a notification has 6 fields, got {item!r}")
    publisher, seq, hops, attrs, sub_ids = item[1], item[2], item[3], item[4], item[5]
    if (
        type(publisher) is not str
        or type(seq) is not int
        or type(hops) is not int
        or type(attrs) is not dict
        or type(sub_ids) is not list
    ):
        raise ValueError(f"malformed notification {item!r}")
    return Notification(publisher, seq, hops, attrs, sub_ids)  # the ids made a tuple there


def take_notifications(
    items: list[Any],
    start: int,
    inbox: deque[Notification],
    last: dict[str, int],
    only_newer: bool,
) -> tuple[int, int]:
    """Append the notification messages of ``items`` from ``start`` on to ``inbox``, up to
    the first other message; return its index (``len(items)`` if none) and how many were
    dropped as duplicates. ``last`` is the highest seq delivered per publisher, updated as it
    goes; with ``only_newer`` (after a migration or failover) a seq at or below it is dropped.
    ValueError names a malformed message (the ones before it are in the inbox already)."""
    dropped = 0
    i = start
    end = len(items)
    while i < end:
        item = items[i]
        if type(item) is not list or not item or item[0] != NOTIFY:
            break
        n = notification(item)
        i += 1
        if only_newer and n.seq <= last.get(n.publisher, 0):
            dropped += 1
            continue
        last[n.publisher] = n.seq  # per notification: a move may start any time
        inbox.append(n)
    return i, dropped
