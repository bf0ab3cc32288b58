"""Async client library for Canopy brokers.

    async with await connect("127.0.0.1:7400") as c:
        sub = await c.subscribe('symbol = "ACME" and price < 10')
        await c.publish({"symbol": "ACME", "price": 5})
        async for n in c.notifications():
            print(n.publisher, n.seq, n.attrs, n.sub_ids)

Publishes are batched: :meth:`Client.publish` appends the encoded message to a buffer that is
written as one frame at the end of the current event-loop iteration (or at once when it grows
large), so a tight publish loop costs one ``write()`` per few hundred events while a single
publish still goes out without a timer delay. :meth:`Client.flush` forces the write and waits for
the socket to accept it. When the broker applies backpressure (it stops reading from publishers),
the socket's buffer fills and ``publish`` waits; ``publish_nowait`` never waits.

Filters are parsed here before anything is sent, so a typo raises :class:`FilterError` at the call
instead of costing the connection (the broker closes connections that send invalid filters).

**Migration** (make-before-break, docs/broker.md): :meth:`Client.migrate` moves the client to a
neighbouring broker without losing, duplicating or reordering a notification, and a draining
broker's redirect makes the library do it on its own. While it runs the client holds two
connections: the old one keeps delivering until the broker's *marker* arrives on it, the new one's
deliveries are held until then; from the marker on, a notification passes only if its sequence
number is above the last one delivered from its publisher (each connection is FIFO per publisher,
so that removes exactly the notifications both connections carried).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from canopy_broker.core.events import Event, Value
from canopy_broker.core.filters import Filter
from canopy_broker.runtime.framing import (
    B_MARKER,
    B_MIGRATING,
    B_NOTIFY,
    B_REDIRECT,
    B_SUBSCRIBED,
    B_UNSUBSCRIBED,
    C_LEAVE,
    C_MIGRATING,
    C_MOVE,
    C_SUBSCRIBE,
    C_UNSUBSCRIBE,
    F_ERROR,
    F_HELLO,
    F_MSGS,
    PROTOCOL_VERSION,
    AsyncClosing,
    FrameError,
    FrameProtocol,
    batches,
    check_wire_attributes,
    control_frame,
    decode_filter,
    encode_filter,
    msgs_frame,
    parse_address,
)
from canopy_broker.runtime.tasks import TaskSet

__all__ = ["Client", "ClientError", "Notification", "connect"]

log = logging.getLogger("canopy.client")


class ClientError(Exception):
    """The broker refused something or the connection ended abnormally."""

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


class Notification:
    """One delivered event: envelope, attributes and which of our subscriptions matched."""

    __slots__ = ("attrs", "hops", "publisher", "seq", "sub_ids")

    def __init__(
        self, publisher: str, seq: int, hops: int, attrs: dict[str, Value], sub_ids: tuple[str, ...]
    ) -> None:
        self.publisher = publisher
        self.seq = seq
        self.hops = hops
        self.attrs = attrs
        self.sub_ids = sub_ids

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


def _subscribe_message(sub_id: str, f: Filter) -> bytes:
    return orjson.dumps([C_SUBSCRIBE, sub_id, encode_filter(f)])


class _Conn(FrameProtocol):
    """One connection of a :class:`Client` to one broker, with its own write buffer and request
    waiters. A client has one, or two while it migrates; frames go to the owner tagged with the
    connection they came from, which is how the owner tells old deliveries from new ones."""

    def __init__(self, owner: Client, client_id: str | None) -> None:
        super().__init__()
        self.owner = owner
        self.hello: dict[str, Any] = {
            "v": PROTOCOL_VERSION,
            "role": "client",
            "client_id": client_id,
        }
        self.address = ""
        self.broker = ""
        self.routing = ""
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters: dict[tuple[int, str], asyncio.Future[None]] = {}
        self.error: ClientError | None = None
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.flush_handle: asyncio.Handle | None = None
        self.redirect: tuple[str, str] | None = None  # (target, address) the broker asked for

    @classmethod
    async def open(cls, owner: Client, address: str, client_id: str | None, within: float) -> _Conn:
        """Connect and wait for the broker's hello (or its refusal)."""
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: cls(owner, client_id), host, port), within
        )
        conn.address = address
        try:
            await asyncio.wait_for(asyncio.shield(conn.ready), within)
        except BaseException:
            conn.abort()
            raise
        return conn

    # -- asyncio callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.write(control_frame(F_HELLO, self.hello))

    def frame_received(self, frame: list[Any]) -> None:
        self.owner._frame(self, frame)

    def fail(self, exc: FrameError) -> None:
        self.set_error(ClientError(f"bad data from the broker: {exc}", exc.code))
        super().fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if exc is not None:
            self.set_error(ClientError(f"connection lost: {exc}", "connection-lost"))
        err = self.error or ClientError("connection closed", "closed")
        if not self.ready.done():
            self.ready.set_exception(err)
            self.ready.exception()  # retrieved: open() may have given up on it already
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_exception(err)
        self.waiters.clear()
        self.owner._lost(self)

    # -- state -------------------------------------------------------------------------------

    def set_error(self, err: ClientError) -> None:
        if self.error is None:
            self.error = err

    def hello_received(self, hello: dict[str, Any]) -> None:
        self.broker = str(hello.get("name", ""))
        self.routing = str(hello.get("routing", ""))
        if not self.ready.done():
            self.ready.set_result(None)

    def answered(self, code: int, key: str) -> None:
        fut = self.waiters.pop((code, key), None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    # -- outgoing ----------------------------------------------------------------------------

    def send(self, msg: bytes) -> None:
        self.out.append(msg)
        self.out_bytes += len(msg)
        if self.out_bytes > 256 * 1024:
            self.write_out()
        elif self.flush_handle is None:
            self.flush_handle = asyncio.get_running_loop().call_soon(self.write_out)

    def write_out(self) -> None:
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        if not self.out:
            return
        msgs, self.out, self.out_bytes = self.out, [], 0
        self.write(b"".join(msgs_frame(chunk) for chunk in batches(msgs)))

    async def request(self, code: int, key: str, msg: bytes) -> None:
        """Send ``msg`` and wait for the broker's answer ``[code, key]``."""
        if self.error is not None:
            raise self.error
        fut = asyncio.get_running_loop().create_future()
        self.waiters[(code, key)] = fut
        self.send(msg)
        await fut

    async def close_gracefully(self, within: float = 5.0) -> None:
        """Flush what is buffered, close, and wait until the connection is gone."""
        if not self.is_closing():
            self.write_out()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drain(), within)
            self.close()
        await self.wait_lost(within)

    async def leave(self, within: float = 5.0) -> None:
        """Ask the broker to detach us and wait until it has closed the connection, so that
        once this returns the broker no longer counts us (a draining broker waits for that)."""
        if not self.is_closing():
            self.send(orjson.dumps([C_LEAVE]))
            self.write_out()
        await self.wait_lost(within)

    async def wait_lost(self, within: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.lost), within)
        if not self.lost.done():
            self.abort()
            await self.lost


@dataclass
class _Migration:
    """A move in progress: deliveries from ``old`` count until its marker, those from ``new``
    are held until then."""

    old: _Conn
    new: _Conn
    switched: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    held: list[Notification] = field(default_factory=list)


class _Notifications:
    """Async iterator over a client's notifications (a class, not an async generator, so that
    breaking out of ``async for`` leaves nothing to finalise)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def __aiter__(self) -> _Notifications:
        return self

    async def __anext__(self) -> Notification:
        batch = await self._client.receive(max_items=1)
        if not batch:
            raise StopAsyncIteration
        return batch[0]


class Client(AsyncClosing):
    """A client of the overlay under one client id; create it with :func:`connect`.

    It is attached to one broker at a time, except while it migrates (:meth:`migrate`).
    """

    max_buffered = 100_000
    """Received notifications held before we stop reading the socket (the broker then sees a
    slow consumer)."""

    dedup = True
    """Drop notifications not newer than the last one delivered from their publisher once a
    migration has switched connections. Only a negative control turns this off: without it the
    notifications both connections carried are delivered twice."""

    def __init__(self, client_id: str | None, *, follow_redirects: bool = True) -> None:
        self.client_id = client_id or ""
        self.follow_redirects = follow_redirects
        self.subscriptions: dict[str, Filter] = {}
        self.migrations = 0  # completed moves
        self.duplicates_dropped = 0  # notifications both connections carried, dropped once
        self.migration_error: BaseException | None = None  # of the last redirect-driven move
        self._conn: _Conn | None = None
        self._migration: _Migration | None = None
        self._migrated = False  # a switch happened: the last-seq filter is in force from now on
        self._last_seq: dict[str, int] = {}  # per publisher, the last seq delivered
        self._lock = asyncio.Lock()  # migrations and subscription changes, one at a time
        self._redirect: asyncio.Task[None] | None = None
        self._tasks = TaskSet(f"client {client_id or '(unnamed)'}")
        self._seq = 0
        self._sub_counter = 0
        self._inbox: deque[Notification] = deque()
        self._inbox_waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._closing = False

    # -- connection --------------------------------------------------------------------------

    async def _open(self, address: str, connect_timeout: float) -> None:
        self._conn = await _Conn.open(self, address, self.client_id or None, connect_timeout)
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
        """The connection is gone and no migration can replace it."""
        conn = self._conn
        return conn is None or (conn.lost.done() and self._migration is None)

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

    def abort(self) -> None:
        """Drop the connection(s) at once (what a crashing client does)."""
        m = self._migration
        for conn in (self._conn, *((m.old, m.new) if m else ())):
            if conn is not None:
                conn.abort()

    # -- incoming ----------------------------------------------------------------------------

    def _frame(self, conn: _Conn, frame: list[Any]) -> None:
        ftype = frame[0]
        if ftype == F_MSGS and len(frame) == 2 and type(frame[1]) is list:
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
            only_newer = self._migrated and self.dedup
            for item in frame[1]:
                code = item[0]
                if code == B_NOTIFY:
                    if mode == "deliver":
                        publisher, seq = item[1], item[2]
                        if only_newer and seq <= last.get(publisher, 0):
                            self.duplicates_dropped += 1
                            continue
                        last[publisher] = seq  # per notification: a move may start any time
                        inbox.append(Notification(publisher, seq, item[3], item[4], tuple(item[5])))
                    elif mode == "hold":
                        assert m is not None
                        m.held.append(Notification(item[1], item[2], item[3], item[4], (*item[5],)))
                elif code in (B_SUBSCRIBED, B_UNSUBSCRIBED, B_MIGRATING):
                    conn.answered(code, item[1])
                elif code == B_MARKER:
                    if m is not None and conn is m.old and not m.switched.done():
                        self._switch(m)
                        mode = "drop"  # the old connection is only drained from here on
                elif code == B_REDIRECT:
                    self._redirected(conn, item[1], item[2])
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

    def _conns(self) -> list[_Conn]:
        m = self._migration
        conns = [m.old, m.new] if m is not None else []
        if self._conn is not None and self._conn not in conns:
            conns.append(self._conn)
        return conns

    def _switch(self, m: _Migration) -> None:
        """The marker (or the end of the old connection): from now on the new connection
        delivers, and only what is newer than the last delivery from each publisher."""
        self._migrated = True
        m.switched.set_result(None)
        last = self._last_seq
        for n in m.held:
            if n.seq <= last.get(n.publisher, 0) and self.dedup:
                self.duplicates_dropped += 1
                continue
            last[n.publisher] = n.seq
            self._inbox.append(n)
        m.held.clear()
        self._wake_inbox()

    def _lost(self, conn: _Conn) -> None:
        m = self._migration
        if m is not None and conn is m.old and not m.switched.done():
            # The old broker is gone or dropped us: nothing more will come from it, and what it
            # had not delivered is lost with it. The new connection takes over.
            self._switch(m)
        self._wake_inbox()

    def _redirected(self, conn: _Conn, target: object, address: object) -> None:
        """A draining broker asks us to move to its neighbour ``target``. Kept on the
        connection it came on: it may come before :func:`connect` returns, or on the new
        connection while a migration is still under way, and it is followed once that
        connection is the client's."""
        if isinstance(target, str) and isinstance(address, str):
            conn.redirect = (target, address)
            self._maybe_follow()

    def _maybe_follow(self) -> None:
        conn = self._conn
        if (
            conn is None
            or conn.redirect is None
            or not self.follow_redirects
            or self._closing
            or self._migration is not None
            or (self._redirect is not None and not self._redirect.done())
        ):
            return
        self._redirect = self._tasks.spawn(self._follow(), "follow redirect")

    async def _follow(self) -> None:
        while (conn := self._conn) is not None and conn.redirect is not None:
            target, address = conn.redirect
            conn.redirect = None
            try:
                await self.migrate(address, target)
            except Exception as exc:  # reported on the client; the application decides
                self.migration_error = exc
                log.warning(
                    "%s: could not follow a redirect to %s: %s", self.client_id, target, exc
                )
                return

    def _wake_inbox(self) -> None:
        w = self._inbox_waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def receive(
        self,
        max_items: int = 1000,
        timeout: float | None = None,  # noqa: ASYNC109 - a poll-style API, like Queue.get
    ) -> list[Notification]:
        """Up to ``max_items`` notifications, waiting for at least one; ``[]`` when the
        connection closed cleanly or ``timeout`` seconds passed. Raises :class:`ClientError` if
        the broker closed the connection with an error (e.g. slow consumer)."""
        inbox = self._inbox
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not inbox:
            if self.closed:
                err = self._conn.error if self._conn is not None else None
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

    def notifications(self) -> _Notifications:
        """``async for n in client.notifications()`` until the connection closes."""
        return _Notifications(self)

    # -- outgoing ----------------------------------------------------------------------------

    def _check_open(self) -> _Conn:
        conn = self._conn
        if conn is not None and conn.error is not None:
            raise conn.error
        if conn is None or conn.is_closing():
            raise ClientError("the connection is closed", "closed")
        return conn

    async def flush(self) -> None:
        """Write everything buffered now and wait until the socket takes it."""
        conn = self._check_open()
        conn.write_out()
        await conn.drain()

    async def subscribe(
        self, filter: str | Filter | Sequence[Sequence[object]], sub_id: str | None = None
    ) -> str:
        """Subscribe; returns the subscription id once the broker has registered it.

        ``filter``: text (``'price < 10 and symbol = "ACME"'``), a :class:`Filter`, or the
        structured form ``[[attr, op, value], ...]``.
        """
        self._check_open()
        if isinstance(filter, Filter):
            f = filter
        else:
            try:
                f = decode_filter(filter if isinstance(filter, str) else [list(c) for c in filter])
            except FrameError as exc:
                raise ValueError(str(exc)) from None
        if sub_id is None:
            self._sub_counter += 1
            sub_id = f"s{self._sub_counter}"
            while sub_id in self.subscriptions:
                self._sub_counter += 1
                sub_id = f"s{self._sub_counter}"
        if sub_id in self.subscriptions:
            raise ValueError(f"subscription id {sub_id!r} is in use")
        self.subscriptions[sub_id] = f
        try:
            async with self._lock:  # a migration re-subscribes from this dict: not meanwhile
                await self._check_open().request(
                    B_SUBSCRIBED, sub_id, _subscribe_message(sub_id, f)
                )
        except BaseException:
            self.subscriptions.pop(sub_id, None)
            raise
        return sub_id

    async def unsubscribe(self, sub_id: str) -> None:
        self._check_open()
        if sub_id not in self.subscriptions:
            raise ValueError(f"no subscription {sub_id!r}")
        async with self._lock:
            msg = orjson.dumps([C_UNSUBSCRIBE, sub_id])
            await self._check_open().request(B_UNSUBSCRIBED, sub_id, msg)
            del self.subscriptions[sub_id]

    def publish_nowait(self, attrs: Mapping[str, Value]) -> int:
        """Queue one event for publishing; returns its sequence number (never waits)."""
        conn = self._check_open()
        try:
            checked = check_wire_attributes(attrs)
        except FrameError as exc:
            raise ValueError(str(exc)) from None
        self._seq += 1
        conn.send(b"[12,%d," % self._seq + orjson.dumps(checked) + b"]")
        return self._seq

    async def publish(self, attrs: Mapping[str, Value]) -> int:
        """Publish one event; waits only while the broker pushes back. Returns its seq."""
        seq = self.publish_nowait(attrs)
        conn = self._conn
        if conn is not None and conn.writing_paused:
            await conn.drain()
        return seq

    @property
    def last_seq(self) -> int:
        return self._seq

    # -- migration ---------------------------------------------------------------------------

    async def _resubscribe(self, new: _Conn) -> None:
        """Step 1 of :meth:`migrate`: the same subscription ids and filters on ``new``."""
        await asyncio.gather(
            *(
                new.request(B_SUBSCRIBED, sid, _subscribe_message(sid, f))
                for sid, f in self.subscriptions.items()
            )
        )

    async def migrate(
        self,
        address: str,
        broker: str | None = None,
        *,
        within: float = 30.0,
    ) -> None:
        """Move to the broker at ``address`` (named ``broker``, if given, which is checked), a
        neighbour of the current one, without losing, duplicating or reordering anything.

        1. Connect to the new broker under the same client id and re-subscribe with the same
           subscription ids and filters (identical routing keys: nothing new propagates past
           the new broker). Its deliveries are held.
        2. Tell it we migrate from the old broker and wait for its answer: from then on it
           holds our publications until the old broker says ``Moved``, and it has sent the
           marker down the link to the old broker.
        3. Switch publishing to the new connection and tell the old broker we move (after
           everything we published there, so ``Moved`` follows all of it).
        4. At the marker on the old connection, deliver what the new one held and everything
           after it, if newer than the last delivery from its publisher; then leave the old
           broker.

        Failures before step 3 leave the client where it was. If the marker does not arrive
        within ``within`` seconds the client switches anyway and raises :class:`ClientError` (code
        ``marker-timeout``): duplicates are still filtered, but notifications may be missing.
        """
        async with self._lock:
            old = self._check_open()
            if broker is not None and broker == old.broker:
                raise ValueError(f"already attached to {broker}")
            new = await _Conn.open(self, address, self.client_id, within)
            m = _Migration(old, new)
            self._migration = m
            announced = False
            try:
                if broker is not None and new.broker != broker:
                    raise ClientError(f"{address} is {new.broker}, not {broker}", "wrong-broker")
                async with asyncio.timeout(within):
                    await self._resubscribe(new)
                    if not old.is_closing():
                        msg = orjson.dumps([C_MIGRATING, old.broker])
                        await new.request(B_MIGRATING, old.broker, msg)
                        announced = True
                if old.is_closing() and announced:
                    # Too late to say Moved: the new broker would hold our publications for
                    # ever. Leaving it releases them; the client ends closed, as it would have
                    # without the move.
                    raise ClientError(
                        f"the connection to {old.broker} was lost during the move",
                        "connection-lost",
                    )
            except BaseException:
                self._migration = None
                await new.close_gracefully()
                raise
            try:
                if announced:  # after everything published on the old connection: Moved
                    old.send(orjson.dumps([C_MOVE, new.broker]))
                    old.write_out()
                elif not m.switched.done():
                    self._switch(m)  # the old connection died first: a plain re-attach
                self._conn = new
                try:
                    await asyncio.wait_for(asyncio.shield(m.switched), within)
                except TimeoutError:
                    self._switch(m)
                    raise ClientError(
                        f"no marker from {old.broker} within {within}s: switched anyway, "
                        "notifications may be missing",
                        "marker-timeout",
                    ) from None
                finally:
                    await old.leave()
            finally:
                if not m.switched.done():
                    self._switch(m)
                self._migration = None
                self._wake_inbox()
                self._maybe_follow()  # the new broker may be draining too
            self.migrations += 1


async def connect(
    address: str,
    client_id: str | None = None,
    *,
    connect_timeout: float = 10.0,
    follow_redirects: bool = True,
) -> Client:
    """Connect to a broker at ``HOST:PORT`` as ``client_id`` (the broker picks one if None).

    ``follow_redirects``: migrate on its own when the broker drains (the default)."""
    client = Client(client_id, follow_redirects=follow_redirects)
    await client._open(address, connect_timeout)
    return client
