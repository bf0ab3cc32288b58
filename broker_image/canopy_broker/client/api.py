"""The client: one client id attached to the overlay, publishing and subscribing.

Connection handling is :mod:`.connection`'s, moving between brokers :mod:`.migration`'s; this
module holds what the application calls and the routing of received frames.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import orjson

from canopy_broker.client.connection import BrokerConnection, subscribe_message
from canopy_broker.client.credentials import Credentials
from canopy_broker.client.failover import FailingOver, Gap
from canopy_broker.client.migration import Migrating, Migration
from canopy_broker.client.notification import (
    ClientError,
    ConnectionLostError,
    NotificationStream,
)
from canopy_broker.core.events import Value
from canopy_broker.core.filters import Filter
from canopy_broker.runtime.framing import (
    B_CUT_OFF,
    B_GAP,
    B_MARKER,
    B_MIGRATING,
    B_NOTIFY,
    B_PUBACK,
    B_REDIRECT,
    B_RESUMED,
    B_SUBSCRIBED,
    B_UNSUBSCRIBED,
    C_UNSUBSCRIBE,
    F_ERROR,
    F_HELLO,
    F_MSGS,
    AsyncClosing,
    FrameError,
    check_wire_attributes,
    decode_filter,
)
from canopy_broker.runtime.inbox import Notification, notification, take_notifications
from canopy_broker.runtime.tasks import TaskSet

FilterLike = str | Filter | Sequence[Sequence[object]]
"""A filter as text, parsed, or in the structured form ``[[attr, op, value], ...]``."""

NotificationCallback = Callable[[list[Notification]], None]
"""``on_notifications``: called with each batch of received notifications, oldest first."""


class Client(FailingOver, Migrating, AsyncClosing):
    """A client of the overlay under one client id; create it with :func:`connect`.

    It is attached to one broker at a time, except while it migrates (:meth:`migrate`); if
    that broker is lost it fails over to another (:mod:`.failover`).
    """

    max_buffered = 100_000
    """Received notifications held before we stop reading the socket (the broker then sees a
    slow consumer)."""

    max_unacked = 100_000
    """Publications kept until a broker acknowledges them (they are sent again after a
    failover); :meth:`publish` waits while this many are outstanding."""

    keep_acked_for = 30.0
    """Seconds an acknowledged publication is still kept (at most ``max_unacked`` of them):
    a broker that turns out to have been cut off from the overlay (fenced) acknowledged what
    it could not pass on, and what it acknowledged since it left (from ``CUT_OFF_MARGIN``,
    a second, before the time it told) is sent again after the failover (see
    :mod:`.failover`). 0, or failover off (``failover_within`` 0): not kept."""

    def __init__(
        self,
        client_id: str | None,
        *,
        follow_redirects: bool = True,
        addresses: Sequence[str] = (),
        failover_within: float = 5.0,
        on_gap: Callable[[Gap], None] | None = None,
        credentials: Credentials | None = None,
        on_notifications: NotificationCallback | None = None,
        first_seq: int | None = None,
    ) -> None:
        self.client_id = client_id or ""
        self._on_notifications: NotificationCallback | None = None
        self.credentials = Credentials.from_env() if credentials is None else credentials
        self.follow_redirects = follow_redirects
        self.addresses = list(addresses)
        self.failover_within = failover_within
        self.on_gap = on_gap
        self.gaps: list[Gap] = []
        self.failovers = 0
        self._failover: asyncio.Task[None] | None = None
        self._failover_error: ClientError | None = None
        # (seq, attributes as JSON, when published: the loop's clock)
        self._unacked: deque[tuple[int, bytes, float]] = deque()
        # (when acknowledged, seq, attributes, when published)
        self._acked: deque[tuple[float, int, bytes, float]] = deque()
        self._acked_forgotten = -math.inf  # when the newest publication no longer kept was acked
        self._pub_gap: tuple[float, float] | None = None
        self._acks_waiter: asyncio.Future[None] | None = None
        self.subscriptions: dict[str, Filter] = {}
        self.migrations = 0  # completed moves
        self.duplicates_dropped = 0  # notifications both connections carried, dropped once
        self.migration_error: BaseException | None = None  # of the last redirect-driven move
        self._conn: BrokerConnection | None = None
        self._migration: Migration | None = None
        self._migrated = False  # a switch happened: the last-seq filter is in force from now on
        self._last_seq: dict[str, int] = {}  # per publisher, the last seq delivered
        self._heard_at: dict[str, tuple[float, float]] = {}  # see FailingOver._note_heard
        self._heard_seq: dict[str, int] = {}
        self._heard_checked = -math.inf
        self._last_frame_at = -math.inf
        self._lock = asyncio.Lock()  # migrations and subscription changes, one at a time
        self._redirect: asyncio.Task[None] | None = None
        self._tasks = TaskSet(f"client {client_id or '(unnamed)'}")
        self._seq = check_first_seq(first_seq if first_seq is not None else clock_seq()) - 1
        self._sub_counter = 0
        self._inbox: deque[Notification] = deque()
        self._inbox_waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._closing = False
        self.on_notifications = on_notifications

    async def _open(self, address: str, connect_timeout: float) -> None:
        self._conn = await BrokerConnection.open(
            self, address, self.client_id or None, connect_timeout
        )
        self.client_id = self.client_id or self._conn.hello["client_id"] or ""
        self._maybe_follow()  # a draining broker redirects right after its hello

    @property
    def broker(self) -> str:
        """Name of the broker the client is attached to (publishes go there)."""
        return self._conn.broker if self._conn is not None else ""

    @property
    def routing(self) -> str:
        return self._conn.routing if self._conn is not None else ""

    @property
    def address(self) -> str:
        return self._conn.address if self._conn is not None else ""

    @property
    def closed(self) -> bool:
        """The connection is gone and no migration or failover can replace it."""
        conn = self._conn
        return conn is None or (
            conn.lost.done() and self._migration is None and not self.failing_over
        )

    def _lost(self, conn: BrokerConnection) -> None:
        Migrating._lost(self, conn)
        self._maybe_fail_over(conn)
        self._wake_publishers()  # one waiting for acks learns of the end (or of the failover)

    @property
    def migrating(self) -> bool:
        return self._migration is not None

    async def close(self) -> None:
        """Flush what is buffered, close the connection(s) and wait until they are closed."""
        self._closing = True
        self._redirect = None
        await self._tasks.stop()
        m = self._migration
        if m is not None:  # a move awaited by the application itself: end it here
            if not m.switched.done():
                self._switch(m)
            await m.old.close_gracefully()
            await m.new.close_gracefully()
        if self._conn is not None:
            await self._conn.close_gracefully()
        self._wake_inbox()  # a receive() waiting through a failover that close() ended

    def abort(self) -> None:
        """Drop the connection(s) at once (what a crashing client does)."""
        m = self._migration
        for conn in (self._conn, *((m.old, m.new) if m else ())):
            if conn is not None:
                conn.abort()

    def _frame(self, conn: BrokerConnection, frame: list[Any]) -> None:
        ftype = frame[0]
        if ftype == F_MSGS and len(frame) == 2 and type(frame[1]) is list:
            # Who was heard by the previous frame, dated then (this one's, at the next look).
            self._note_heard(self._last_frame_at)
            self._last_frame_at = asyncio.get_running_loop().time()
            m = self._migration
            if m is None:
                mode = "deliver" if conn is self._conn else "drop"
            elif conn is m.old:
                mode = "drop" if m.switched.done() else "deliver"
            elif conn is m.new:
                mode = "deliver" if m.switched.done() else "hold"
            else:
                mode = "drop"
            inbox = self._inbox
            last = self._last_seq
            only_newer = bool(self._migrated and self.dedup)  # a bool for the compiled loop
            items: list[Any] = frame[1]
            i, end = 0, len(items)
            while i < end:
                item = items[i]
                if type(item) is not list or not item:
                    raise FrameError(f"a message from the broker must be an array: {item!r}")
                code = item[0]
                try:
                    if code == B_NOTIFY and mode == "deliver":
                        # Compiled (runtime/inbox.py): the run of notifications up to the next
                        # other message, deduplicated into the inbox.
                        i, dropped = take_notifications(items, i, inbox, last, only_newer)
                        self.duplicates_dropped += dropped
                        continue
                    i += 1
                    if code == B_NOTIFY:
                        if mode == "hold":
                            assert m is not None
                            m.held.append(notification(item))
                        continue
                except ValueError as exc:
                    raise FrameError(str(exc)) from None
                if code in (B_SUBSCRIBED, B_UNSUBSCRIBED, B_MIGRATING):
                    conn.answered(code, item[1])
                elif code == B_MARKER:
                    if m is not None and conn is m.old and not m.switched.done():
                        self._switch(m)
                        mode = "drop"  # the old connection is only drained from here on
                elif code == B_PUBACK:
                    self._acknowledged(item[1])
                elif code == B_RESUMED:
                    self._resumed(conn, item[1], item[2])
                elif code == B_REDIRECT:
                    self._redirected(conn, item[1], item[2])
                elif code == B_CUT_OFF and len(item) == 2:
                    conn.cut_off(item[1])
                elif code == B_GAP and len(item) == 4:
                    self._told_gap(conn, item[1], item[2], item[3])
                else:
                    raise FrameError(f"unknown message from the broker: {item!r}", "unknown-type")
            if inbox:
                self._wake_inbox()
                if len(inbox) > self.max_buffered and not self._reading_paused:
                    self._reading_paused = True
                    for c in self._conns():
                        if c.transport is not None and not c.is_closing():
                            c.transport.pause_reading()
        elif ftype == F_HELLO and len(frame) == 2 and isinstance(frame[1], dict):
            if frame[1].get("client_id") and conn.hello["client_id"] is None:
                conn.hello["client_id"] = str(frame[1]["client_id"])
            conn.hello_received(frame[1])
        elif ftype == F_ERROR:
            code = str(frame[1]) if len(frame) > 1 else "error"
            text = str(frame[2]) if len(frame) > 2 else ""
            conn.set_error(ClientError(f"broker closed the connection: {code}: {text}", code))
        else:
            raise FrameError(f"unexpected frame from the broker: {frame[:2]!r}", "unknown-type")

    def _conns(self) -> list[BrokerConnection]:
        m = self._migration
        conns = [m.old, m.new] if m is not None else []
        if self._conn is not None and self._conn not in conns:
            conns.append(self._conn)
        return conns

    @property
    def on_notifications(self) -> NotificationCallback | None:
        """Called with each batch of notifications as it arrives, instead of queueing them for
        :meth:`receive` (see :func:`connect`). Setting it hands over at once what is already
        waiting (and reads the socket again if a full inbox had stopped it)."""
        return self._on_notifications

    @on_notifications.setter
    def on_notifications(self, callback: NotificationCallback | None) -> None:
        if callback is not None and inspect.iscoroutinefunction(callback):
            raise TypeError(
                "on_notifications must be a plain function: it is called from the read path, "
                "where nothing would await a coroutine (start a task from it for async work, "
                "or use receive())"
            )
        self._on_notifications = callback
        self._wake_inbox()  # hands over what already waits, if there is a callback

    def _wake_inbox(self) -> None:
        """Notifications were added to the inbox (or the stream may have ended): hand them to
        ``on_notifications`` if set, and wake a waiting :meth:`receive`."""
        if self._on_notifications is not None and self._inbox:
            self._hand_over(self._on_notifications)
        w = self._inbox_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _hand_over(self, callback: NotificationCallback) -> None:
        """Everything in the inbox to ``callback``, as one batch, in order of arrival. What the
        callback raises (short of KeyboardInterrupt or SystemExit) goes to the event loop's
        exception handler, as an exception in any loop callback does: it is the application's
        bug, not the connection's, so the connection stays up and the batch counts as
        delivered. So does a coroutine returned by mistake (it is closed: nothing awaits it)."""
        batch = list(self._inbox)
        self._inbox.clear()
        problem: BaseException | None = None
        try:
            # Typed to return None, so that mypy flags an async function given here; this
            # checks what it did return all the same. (A string: cast() would otherwise build
            # the generic alias on every batch.)
            result = cast("Callable[[list[Notification]], object]", callback)(batch)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            problem = exc
        else:
            if asyncio.iscoroutine(result):
                result.close()
                problem = TypeError("on_notifications returned a coroutine, which nothing awaits")
        if problem is not None:
            asyncio.get_running_loop().call_exception_handler(
                {
                    "message": f"on_notifications of client {self.client_id!r} failed on a "
                    f"batch of {len(batch)} (they count as delivered)",
                    "exception": problem,
                }
            )
        self._resume_reading()

    async def receive(
        self,
        max_items: int = 1000,
        timeout: float | None = None,  # noqa: ASYNC109 - a poll-style API, like Queue.get
    ) -> list[Notification]:
        """Up to ``max_items`` notifications, waiting for at least one; ``[]`` when the
        connection closed cleanly or ``timeout`` seconds passed. Raises :class:`ClientError` if
        the broker closed the connection with an error (e.g. slow consumer).

        With ``on_notifications`` set, notifications go to the callback and never here: this
        then only waits for the end of the stream (``[]`` on a clean close, or the error)."""
        inbox = self._inbox
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not inbox:
            if self.closed:
                err = self._failover_error or (self._conn.error if self._conn else None)
                if err is not None and err.code != "closed":
                    raise err
                return []
            self._resume_reading()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return []
            self._inbox_waiter = loop.create_future()
            try:
                await asyncio.wait_for(self._inbox_waiter, remaining)
            except TimeoutError:
                return []
            finally:
                self._inbox_waiter = None
        out = [inbox.popleft() for _ in range(min(max_items, len(inbox)))]
        self._resume_reading()
        return out

    def _resume_reading(self) -> None:
        """Read the socket(s) again once the application has drained half the inbox."""
        if self._reading_paused and len(self._inbox) <= self.max_buffered // 2:
            self._reading_paused = False
            for c in self._conns():
                if c.transport is not None and not c.is_closing():
                    c.transport.resume_reading()

    def notifications(self) -> NotificationStream:
        """``async for n in client.notifications()`` until the connection closes."""
        return NotificationStream(self.receive)

    def _check_open(self) -> BrokerConnection:
        if self._failover_error is not None:
            raise self._failover_error
        conn = self._conn
        if conn is not None and conn.error is not None:
            raise conn.error
        if conn is None or conn.is_closing():
            raise ClientError("the connection is closed", "closed")
        return conn

    async def _open_now(self) -> BrokerConnection:
        """The connection, once a failover under way (or about to start: asyncio reports a
        loss a loop turn after the close) has found one; else why there is none."""
        if self._being_lost() and self._conn is not None:
            await asyncio.shield(self._conn.lost)  # resolved as the loss is handled
        if self.failing_over:
            assert self._failover is not None
            await asyncio.shield(self._failover)
        return self._check_open()

    async def flush(self) -> None:
        """Write everything buffered now and wait until the socket takes it; and give the
        event loop a turn even when the socket took it at once.

        Without that turn, a loop of ``publish_nowait`` and ``flush`` against a broker that
        keeps up never yields: nothing else in the process runs (its timers, its subscribers,
        the broker's acknowledgements), and what waits for an acknowledgement grows without
        bound. The benchmark's flat-out publisher did exactly that once its subscribers were
        cut as slow consumers (the process grew to 23 GB, CI on a clean clone)."""
        conn = await self._open_now()
        conn.write_out()
        await conn.drain()
        await asyncio.sleep(0)

    # -- acknowledgements of what we published ----------------------------------------------

    def _acknowledged(self, seq: object) -> None:
        if type(seq) is not int:
            raise FrameError(f"publish ack must be a sequence number, got {seq!r}", "malformed")
        unacked = self._unacked
        if self.keep_acked_for <= 0 or self.failover_within <= 0:
            while unacked and unacked[0][0] <= seq:
                unacked.popleft()
        else:
            now = asyncio.get_running_loop().time()
            acked = self._acked
            while unacked and unacked[0][0] <= seq:
                seq_body = unacked.popleft()
                acked.append((now, seq_body[0], seq_body[1], seq_body[2]))
            horizon = now - self.keep_acked_for
            while acked and (acked[0][0] < horizon or len(acked) > self.max_unacked):
                self._acked_forgotten = acked.popleft()[0]
        self._wake_publishers()

    def _wake_publishers(self) -> None:
        w = self._acks_waiter
        if w is not None and not w.done():
            w.set_result(None)

    @property
    def unacknowledged(self) -> int:
        """Publications no broker has acknowledged yet (kept, to send again on a failover)."""
        return len(self._unacked)

    @property
    def unacknowledged_seqs(self) -> list[int]:
        """The sequence numbers of those publications, oldest first: what an application
        that gives up on this client may have to publish again by other means."""
        return [seq for seq, _, _ in self._unacked]

    @property
    def failover_error(self) -> ClientError | None:
        """Why the client stopped looking for another broker (none took it within
        ``failover_within``), or None: it is connected, or still looking."""
        return self._failover_error

    async def _acks_progress(self) -> None:
        """Until the next acknowledgement, or the end of a failover."""
        self._acks_waiter = w = asyncio.get_running_loop().create_future()
        try:
            await w
        finally:
            self._acks_waiter = None

    async def wait_acknowledged(self, timeout: float = 10.0) -> bool:  # noqa: ASYNC109
        """Wait until every publication is acknowledged (it survives the loss of our broker);
        False if ``timeout`` seconds passed first."""
        await self.flush()
        try:
            async with asyncio.timeout(timeout):
                while self._unacked:
                    self._check_open()
                    await self._acks_progress()
        except TimeoutError:
            return False
        return True

    async def subscribe(self, filter: FilterLike, sub_id: str | None = None) -> str:
        """Subscribe; returns the subscription id once the broker has registered it.

        ``filter``: text (``'price < 10 and symbol = "ACME"'``), a :class:`Filter`, or the
        structured form ``[[attr, op, value], ...]``.
        """
        (sid,) = await self.subscribe_many([(sub_id, filter)])
        return sid

    async def subscribe_many(
        self, subscriptions: Iterable[tuple[str | None, FilterLike]]
    ) -> list[str]:
        """Subscribe to each ``(sub_id, filter)`` (``sub_id`` None: one is chosen); returns the
        ids once the broker has registered every one.

        All are sent at once and acknowledged together, instead of one round trip each:
        installing thousands of subscriptions is then bounded by the overlay, not by the
        latency of a connection. Every filter is checked before any is sent (a ``ValueError``
        sends nothing). If the broker refuses one, those it did not acknowledge are forgotten
        and the error is raised.
        """
        await self._open_now()
        wanted: dict[str, Filter] = {}
        for given, filter in subscriptions:
            f = self._filter(filter)
            sub_id = self._free_sub_id(wanted) if given is None else given
            if sub_id in self.subscriptions or sub_id in wanted:
                raise ValueError(f"subscription id {sub_id!r} is in use")
            wanted[sub_id] = f
        if not wanted:
            return []
        self.subscriptions.update(wanted)
        waits: dict[str, asyncio.Future[None]] = {}
        try:
            try:
                async with self._lock:  # a migration re-subscribes from this dict: not meanwhile
                    conn = self._check_open()
                    for sid, f in wanted.items():
                        waits[sid] = conn.expect(B_SUBSCRIBED, sid)
                        conn.send(subscribe_message(sid, f))
                    await asyncio.gather(*waits.values())
            except ConnectionLostError:
                # The broker went before it answered. The failover re-subscribes everything in
                # self.subscriptions at the broker that takes over, these included: once it
                # is done the subscriptions stand there.
                await self._open_now()
        except BaseException:
            for sid in wanted:
                fut = waits.get(sid)
                if fut is None or not fut.done() or fut.cancelled() or fut.exception():
                    self.subscriptions.pop(sid, None)
            raise
        return list(wanted)

    @staticmethod
    def _filter(filter: FilterLike) -> Filter:
        if isinstance(filter, Filter):
            return filter
        try:
            return decode_filter(filter if isinstance(filter, str) else [list(c) for c in filter])
        except FrameError as exc:
            raise ValueError(str(exc)) from None

    def _free_sub_id(self, taken: Mapping[str, Filter]) -> str:
        while True:
            self._sub_counter += 1
            sub_id = f"s{self._sub_counter}"
            if sub_id not in self.subscriptions and sub_id not in taken:
                return sub_id

    async def unsubscribe(self, sub_id: str) -> None:
        await self._open_now()
        if sub_id not in self.subscriptions:
            raise ValueError(f"no subscription {sub_id!r}")
        msg = orjson.dumps([C_UNSUBSCRIBE, sub_id])
        while True:
            try:
                async with self._lock:
                    await self._check_open().request(B_UNSUBSCRIBED, sub_id, msg)
                    del self.subscriptions[sub_id]
                    return
            except ConnectionLostError:
                # The failover re-subscribes it at the next broker (it is still ours until an
                # answer says otherwise): ask that broker again.
                await self._open_now()

    def _being_lost(self) -> bool:
        """The broker closed the connection and its loss is not handled yet (asyncio reports
        it a loop turn later): a failover is about to start, so publications are kept for it
        rather than refused. Not when the broker said why (an error), nor when we closed."""
        conn = self._conn
        return (
            conn is not None
            and conn.error is None
            and conn.is_closing()
            and not conn.ending
            and not self._closing
            and self.failover_within > 0
        )

    def publish_nowait(self, attrs: Mapping[str, Value]) -> int:
        """Queue one event for publishing; returns its sequence number (never waits). While
        the client fails over it is only kept, and sent once another broker took over."""
        failing_over = self.failing_over or self._being_lost()
        conn = None if failing_over else self._check_open()
        try:
            checked = check_wire_attributes(attrs)
        except FrameError as exc:
            raise ValueError(str(exc)) from None
        self._seq += 1
        # A copy of the exact size, since it may be kept (unacknowledged, then acknowledged):
        # orjson's result keeps the room it was built in, about 4 KB, so 100,000 kept cost
        # 400 MB rather than 12 (review).
        body = bytes(memoryview(orjson.dumps(checked)))
        if failing_over or self._conn is None or self._conn.acks:
            self._unacked.append((self._seq, body, asyncio.get_running_loop().time()))
        if conn is not None:
            conn.send(b"[12,%d," % self._seq + body + b"]")
        return self._seq

    async def publish(self, attrs: Mapping[str, Value]) -> int:
        """Publish one event; waits while the broker pushes back, and while ``max_unacked``
        publications wait for an acknowledgement. Returns its seq."""
        seq = self.publish_nowait(attrs)
        while len(self._unacked) >= self.max_unacked:
            await self._acks_progress()
            if not (self.failing_over or self._being_lost()):
                self._check_open()
        conn = self._conn
        if conn is not None and conn.writing_paused:
            await conn.drain()
        return seq

    @property
    def last_seq(self) -> int:
        return self._seq


MAX_SEQ = 2**63 - 1
"""The largest sequence number the broker takes (a signed 64-bit integer, as on the wire)."""
JOINING_RETRY = 0.25  # s between rounds of the addresses while every one says "joining"


def clock_seq() -> int:
    """Where a client's sequence numbers start by default: the wall clock, in microseconds.

    ``publisher:seq`` names an event, and a subscriber that failed over keeps only what is newer
    than the last it got from each publisher (the duplicates a resume or a repair's replay
    brings), and the brokers' replays go by the same name. A process that restarted under the
    same client id and counted from 1 again had its events taken for ones already seen and
    dropped, silently, until it passed its predecessor's count (review: 570 lost at a
    subscriber whose broker nobody touched; a broker's retention even served the old events
    first to one that failed over). Started
    from the clock, a new process starts above everything the last one published, as long as
    that one published under a million a second on average, and the clock did not go back."""
    return time.time_ns() // 1000


def check_first_seq(seq: int) -> int:
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        raise ValueError(f"first_seq must be an integer from 1 to {MAX_SEQ}, got {seq!r}")
    return seq


async def connect(
    address: str | Sequence[str],
    client_id: str | None = None,
    *,
    connect_timeout: float = 10.0,
    follow_redirects: bool = True,
    failover_within: float = 5.0,
    on_gap: Callable[[Gap], None] | None = None,
    credentials: Credentials | None = None,
    on_notifications: NotificationCallback | None = None,
    first_seq: int | None = None,
) -> Client:
    """Connect to a broker at ``HOST:PORT`` as ``client_id`` (the broker picks one if None).

    ``address`` may be several (a list, or one string with commas): the first that answers
    is used, the others are where to fail over to. A broker that says it is joining the
    overlay (new or restarted, about to be linked) is passed over, and the addresses are
    tried again until one takes the client or ``connect_timeout`` has passed.
    ``failover_within``: how long to look for another broker when ours is lost before
    raising :class:`ConnectionLost` (0: never fail over); ``on_gap`` is called with each
    :class:`Gap` a failover could not fill.
    ``follow_redirects``: migrate on its own when the broker drains (the default).
    ``credentials``: the CA and a client certificate or token (default: from the environment,
    see :mod:`canopy_broker.client.credentials`).

    ``on_notifications``: a plain function (not ``async``) called with each batch of
    notifications (a list, oldest first) as it is read, from the event loop, instead of
    queueing them for :meth:`~Client.receive`: the style of paho's ``on_message`` (nats-py's
    ``cb`` is a coroutine run in a task; this is not), and the cheapest way to consume (no
    task switch per batch; a process receiving on many connections spends about a third less
    CPU). Migration, failover and duplicate suppression apply as for :meth:`~Client.receive`;
    it may also be called from within ``close()`` and ``migrate()`` (what a move held is
    handed over at its switch). It must not block, and it is the application's flow control:
    with a callback nothing queues in the client, so the socket is never paused for a full
    inbox, and a callback that stores into an unbounded queue of its own grows without bound
    (the broker's slow-consumer protection sees only a client that reads). What it raises goes
    to the loop's exception handler; the connection stays up.

    ``first_seq``: the sequence number of the first publication. By default
    :func:`clock_seq`, so that a process that restarts under the same client id carries on
    above its predecessor; an application that keeps its own count gives it here."""
    addresses = parse_addresses(address)
    client = Client(
        client_id,
        follow_redirects=follow_redirects,
        addresses=addresses,
        failover_within=failover_within,
        on_gap=on_gap,
        credentials=credentials,
        on_notifications=on_notifications,
        first_seq=first_seq,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + connect_timeout
    again = False  # the first round gives every address the whole connect_timeout, as before
    while True:
        errors: list[str] = []
        joining = False
        for addr in addresses:
            try:
                within = max(0.1, deadline - loop.time()) if again else connect_timeout
                await client._open(addr, within)
            except (OSError, TimeoutError, ClientError) as exc:
                # A refusal is the application's to fix (credentials, its id), unless it says
                # that broker is out of the overlay (fenced) or not in it yet (joining: new or
                # restarted, about to be linked): the next address may be a live one.
                code = exc.code if isinstance(exc, ClientError) else None
                if isinstance(exc, ClientError) and code not in ("fenced", "joining"):
                    raise
                joining = joining or code == "joining"
                errors.append(f"{addr}: {exc or type(exc).__name__}")
                last = exc
                continue
            return client
        if joining and loop.time() + JOINING_RETRY < deadline:
            await asyncio.sleep(JOINING_RETRY)  # one is about to be linked: all again shortly
            again = True
            continue
        if len(addresses) == 1:
            raise last
        raise ConnectionLostError(f"no broker answered ({'; '.join(errors)})") from last


def parse_addresses(address: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2,c:3"]`` -> ``["a:1", "b:2", "c:3"]`` (order kept)."""
    items = [address] if isinstance(address, str) else list(address)
    out = [a.strip() for item in items for a in item.split(",") if a.strip()]
    if not out:
        raise ValueError("no broker address given")
    return list(dict.fromkeys(out))
