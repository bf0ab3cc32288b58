"""An event's notification queued to each of its local subscribers: the broker's fan-out loop,
compiled with mypyc (setup.py).

Why a module of its own: once matching was native, the loop that queues one event's
notification to each target was the largest Python cost per notification left in a broker
running flat out (per target: a dict lookup, a bytes concatenation, an append and a check of
whether the client waits for a flush, about 0.4 us interpreted; ten targets per event in the
benchmarks). It works on plain dicts and lists, so the runtime's classes stay interpreted; and
it is pure (no I/O, no event loop), so it is compiled like the core and tested against its
source like the core (tests/unit/test_native.py).

The queues are the clients' own ``pending`` lists (``Client.pending``, flushed and cleared in
place once per loop turn). A queue that was empty wakes its client: the caller marks it for the
next flush. A queue that was not empty is marked already, or waits for its connection to drain,
which marks it again (``Conn.resume_writing``); except that a queue at or above ``high`` (the
broker's high-water mark) wakes its client on every notification, because the flush is also
where a queue that keeps growing is pressed or cut (``Broker._flush``): without that, a
subscriber that stopped reading would grow its queue without bound.
"""

from __future__ import annotations

import json
from typing import Final

from canopy_broker.core.events import Targets

SUB_IDS_KEPT: Final = 4096
"""Encoded sets of subscription ids kept (cleared at once past this: bounded memory)."""

_SUB_IDS: dict[tuple[str, ...], bytes] = {}


def notify_message(body: bytes, sub_ids: tuple[str, ...]) -> bytes:
    """Broker -> client notification from a pre-encoded event body. The subscription ids
    that matched repeat from one notification to the next, so their encoding is kept."""
    tail = _SUB_IDS.get(sub_ids)
    if tail is None:
        if len(_SUB_IDS) >= SUB_IDS_KEPT:
            _SUB_IDS.clear()
        # The standard library's JSON, not orjson: a compiled module imports only what mypyc
        # finds at build time (the build has mypy, not the runtime's dependencies), and this
        # runs once per distinct set of ids.
        tail = b"," + json.dumps(sub_ids, ensure_ascii=False, separators=(",", ":")).encode() + b"]"
        _SUB_IDS[sub_ids] = tail
    return b"[20," + body + tail


def fan_out(
    body: bytes,
    targets: Targets,
    queues: dict[str, list[bytes]],
    woken: list[str],
    high: int,
) -> int:
    """Queue the notification of the event encoded as ``body`` (``encode_event_body``) to
    each of ``targets`` that has a queue; return how many were queued. The ids of the
    clients whose queue was empty, or held ``high`` or more, are appended to ``woken``.

    Consecutive targets with the same subscription ids (clients often name theirs alike)
    share one encoded notification."""
    delivered = 0
    last_ids: tuple[str, ...] | None = None
    note = b""
    for client_id, sub_ids in targets:
        queue = queues.get(client_id)
        if queue is None:
            continue
        if sub_ids != last_ids:
            note = notify_message(body, sub_ids)
            last_ids = sub_ids
        if not queue or len(queue) >= high:
            woken.append(client_id)
        queue.append(note)
        delivered += 1
    return delivered
