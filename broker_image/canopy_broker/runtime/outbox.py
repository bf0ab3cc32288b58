"""A broker's way out to its clients: the fan-out that queues an event's notification to each
local subscriber, and the flush that writes each woken client's queue as one frame; compiled
with mypyc (setup.py), as are the frames they build.

Why a module of its own: once matching was native, these loops were the largest Python cost per
notification left in a broker (``canopy bench peers`` delivers one notification per write, so
each notification passes through both): per target a dict lookup, an append and a wake-up; per
client woken a frame built and written. In-process, 0.63-1.06 us of Python per notification
interpreted, 0.37-0.74 compiled (docs/performance.md, session 6). They work on
:class:`Outlet` (a native class: its fields are C struct slots) and plain lists, dicts and
bytes, so the runtime's other classes stay interpreted; they are pure apart from the one
``transport.write`` per client, and tested against their own source like the core
(tests/unit/test_native.py).

Each client's :class:`Outlet` holds its queue (``Client.pending`` is the same list, cleared in
place). A notification queued to an outlet that does not wait for a flush yet puts it on the
broker's dirty list; the flush writes every outlet on it once, and hands back to the broker the
few whose queue needs a decision (over a limit, or already marked over high water or lagging):
pressing, releasing or cutting a slow consumer is the broker's (``Broker._flush``).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Final

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


class Outlet:
    """One attached client's outbound side: the messages queued to it (encoded), the connection
    they are written to, and whether it is on the broker's dirty list already."""

    def __init__(self, client_id: str, conn: Any) -> None:
        self.client_id = client_id
        # The runtime's FrameProtocol (interpreted, so Any here): ``writing_paused`` and its
        # ``transport``, read by flush_outlets.
        self.conn = conn
        self.pending: list[bytes] = []
        # Their bytes, as queued by the fan-out (replies add theirs): a queue is over high water
        # by its bytes too (``flush_outlets``' ``slot``), or 250 notifications of 2 MB to a
        # subscriber that read nothing held 500 MB, far under a mark of 20,000.
        self.pending_bytes = 0
        self.dirty = False
        # Write pacing (``flush_outlets``' ``pace``): the loop time before which this client is
        # not written again; 0.0 when a reply to it is waiting (replies are never held).
        self.due = 0.0


def fan_out(
    body: bytes,
    targets: Targets,
    outlets: dict[str, Outlet],
    dirty: list[Outlet],
) -> int:
    """Queue the notification of the event encoded as ``body`` (``encode_event_body``) to
    each of ``targets`` that has an outlet; return how many were queued. Each outlet that was
    not waiting for a flush yet is marked and appended to ``dirty``.

    Consecutive targets with the same subscription ids (clients often name theirs alike)
    share one encoded notification."""
    delivered = 0
    last_ids: tuple[str, ...] | None = None
    note = b""
    for client_id, sub_ids in targets:
        outlet = outlets.get(client_id)
        if outlet is None:
            continue
        if sub_ids != last_ids:
            note = notify_message(body, sub_ids)
            last_ids = sub_ids
        outlet.pending.append(note)
        outlet.pending_bytes += len(note)
        if not outlet.dirty:
            outlet.dirty = True
            dirty.append(outlet)
        delivered += 1
    return delivered


def flush_outlets(
    dirty: list[Outlet],
    limit: int,
    marked: set[Outlet] | None,
    *,
    now: float = 0.0,
    pace: float = 0.0,
    held: list[Outlet] | None = None,
    slot: int = 0,
) -> list[Outlet]:
    """Write what each of ``dirty`` holds as F_MSGS frame(s), unless its connection is paused
    for writing (or closing: the queue is then dropped with the connection); unmark them all.
    Return those whose queue still holds more than ``limit`` messages, or more than ``limit``
    times ``slot`` bytes (0: bytes not counted), or that are in ``marked``: the broker decides
    about them (pressure, a lagging or slow consumer).

    Write pacing, when ``pace`` > 0 and ``held`` is given: an outlet whose ``due`` is after
    ``now`` (written less than ``pace`` ago, and no reply waiting) is not written but put on
    ``held``, still marked dirty; one that is written is due again ``pace`` after ``now``.
    Each client is paced on its own: a quiet one is never held back by a busy one.

    The transport is written directly (what ``FrameProtocol.write`` does, without its call):
    this runs once per client per loop turn, and most flushes are one notification."""
    attention: list[Outlet] = []
    for outlet in dirty:
        if held is not None:
            if now < outlet.due:
                held.append(outlet)
                continue
            outlet.due = now + pace
        outlet.dirty = False
        msgs = outlet.pending
        if msgs:
            conn = outlet.conn
            if not conn.writing_paused:
                data = msgs_frames(msgs)
                msgs.clear()  # in place: Client.pending is the same list
                outlet.pending_bytes = 0
                transport = conn.transport
                if transport is not None and not transport.is_closing():
                    try:
                        transport.write(data)
                    except Exception:  # that connection broke, not the flush:
                        with contextlib.suppress(Exception):  # it goes, the others are written
                            transport.abort()
        if (
            len(msgs) > limit
            or (slot > 0 and outlet.pending_bytes > limit * slot)
            or (marked is not None and outlet in marked)
        ):
            attention.append(outlet)
    return attention


# --------------------------------------------------------------------------- frames
#
# A frame is a 4-byte big-endian length and a payload (runtime/framing.py describes the wire
# format); these build frames from messages encoded already, by joining bytes. Here because the
# flush above builds them; framing.py re-exports them.

BATCH_BYTES: Final = 256 * 1024
"""Writers start a new frame once a batch reaches this many bytes (well under ``MAX_FRAME``)."""

HEADER: Final = 4


def frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its length."""
    return len(payload).to_bytes(HEADER, "big") + payload


def join_array(prefix: bytes, items: list[bytes]) -> bytes:
    """``prefix`` + a JSON array of already-encoded items + ``]``, e.g. ``b"[6,"`` for F_MSGS."""
    return prefix + b"[" + b",".join(items) + b"]]"


def msgs_frame(msgs: list[bytes]) -> bytes:
    return frame(join_array(b"[6,", msgs))


def msgs_frames(msgs: list[bytes]) -> bytes:
    """Queued messages (a client's notifications, or a client library's publishes) as F_MSGS
    frames of about :data:`BATCH_BYTES` each: usually one, built with a single join (the split
    only when the queue is long)."""
    if len(msgs) == 1:
        return msg_frame(msgs[0])
    body = b",".join(msgs)
    if len(body) > BATCH_BYTES:
        return b"".join([msgs_frame(chunk) for chunk in batches(msgs)])
    return frame(b"[6,[" + body + b"]]")


def msg_frame(msg: bytes) -> bytes:
    """``msgs_frame([msg])`` in one step: a subscriber's flush is usually one notification."""
    return frame(b"[6,[" + msg + b"]]")


def batches(msgs: list[bytes], limit: int = BATCH_BYTES) -> list[list[bytes]]:
    """Split encoded messages into runs of about ``limit`` bytes each (at least one message)."""
    if sum(map(len, msgs)) + len(msgs) <= limit:  # the common case, at C speed
        return [msgs]
    out: list[list[bytes]] = []
    cur: list[bytes] = []
    size = 0
    for m in msgs:
        if cur and size + len(m) > limit:
            out.append(cur)
            cur = []
            size = 0
        cur.append(m)
        size += len(m) + 1
    if cur:
        out.append(cur)
    return out
