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
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from canopy_broker.core.events import Event, Value
from canopy_broker.core.filters import Filter
from canopy_broker.runtime.framing import (
    B_NOTIFY,
    B_SUBSCRIBED,
    B_UNSUBSCRIBED,
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

__all__ = ["Client", "ClientError", "Notification", "connect"]


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


class _Protocol(FrameProtocol):
    def __init__(self, owner: Client) -> None:
        super().__init__()
        self.owner = owner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.write(control_frame(F_HELLO, self.owner._hello))

    def frame_received(self, frame: list[Any]) -> None:
        self.owner._frame(frame)

    def fail(self, exc: FrameError) -> None:
        self.owner._set_error(ClientError(f"bad data from the broker: {exc}", exc.code))
        super().fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.owner._lost(exc)


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
    """A connection to one broker as one client id; create it with :func:`connect`."""

    max_buffered = 100_000
    """Received notifications held before we stop reading the socket (the broker then sees a
    slow consumer)."""

    def __init__(self, client_id: str | None) -> None:
        self._hello: dict[str, Any] = {
            "v": PROTOCOL_VERSION,
            "role": "client",
            "client_id": client_id,
        }
        self.client_id = client_id or ""
        self.broker = ""
        self.routing = ""
        self.subscriptions: dict[str, Filter] = {}
        self._proto: _Protocol | None = None
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq = 0
        self._sub_counter = 0
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._flush_handle: asyncio.Handle | None = None
        self._waiters: dict[tuple[int, str], asyncio.Future[None]] = {}
        self._inbox: deque[Notification] = deque()
        self._inbox_waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._error: ClientError | None = None
        self.closed = False

    # -- connection --------------------------------------------------------------------------

    async def _open(self, address: str, connect_timeout: float) -> None:
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        _, proto = await asyncio.wait_for(
            loop.create_connection(lambda: _Protocol(self), host, port), connect_timeout
        )
        self._proto = proto
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), connect_timeout)
        except BaseException:
            proto.abort()
            raise

    async def close(self) -> None:
        """Flush what is buffered, close the connection and wait until it is closed."""
        proto = self._proto
        if proto is None:
            return
        if not proto.is_closing():
            self._write_out()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proto.drain(), 5.0)
            proto.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(proto.lost), 5.0)
        if not proto.lost.done():
            proto.abort()
            await proto.lost

    def abort(self) -> None:
        """Drop the connection at once (what a crashing client does)."""
        if self._proto is not None:
            self._proto.abort()

    # -- incoming ----------------------------------------------------------------------------

    def _frame(self, frame: list[Any]) -> None:
        ftype = frame[0]
        if ftype == F_MSGS and len(frame) == 2 and type(frame[1]) is list:
            inbox = self._inbox
            for item in frame[1]:
                code = item[0]
                if code == B_NOTIFY:
                    inbox.append(Notification(item[1], item[2], item[3], item[4], tuple(item[5])))
                elif code in (B_SUBSCRIBED, B_UNSUBSCRIBED):
                    fut = self._waiters.pop((code, item[1]), None)
                    if fut is not None and not fut.done():
                        fut.set_result(None)
                else:
                    raise FrameError(f"unknown message from the broker: {item!r}", "unknown-type")
            if inbox:
                self._wake_inbox()
                if len(inbox) > self.max_buffered and not self._reading_paused:
                    self._reading_paused = True
                    assert self._proto is not None and self._proto.transport is not None
                    self._proto.transport.pause_reading()
        elif ftype == F_HELLO and len(frame) == 2 and isinstance(frame[1], dict):
            hello = frame[1]
            self.client_id = str(hello.get("client_id", self.client_id))
            self.broker = str(hello.get("name", ""))
            self.routing = str(hello.get("routing", ""))
            if not self._ready.done():
                self._ready.set_result(None)
        elif ftype == F_ERROR:
            code = str(frame[1]) if len(frame) > 1 else "error"
            text = str(frame[2]) if len(frame) > 2 else ""
            self._set_error(ClientError(f"broker closed the connection: {code}: {text}", code))
        else:
            raise FrameError(f"unexpected frame from the broker: {frame[:2]!r}", "unknown-type")

    def _set_error(self, err: ClientError) -> None:
        if self._error is None:
            self._error = err

    def _lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is not None and self._error is None:
            self._error = ClientError(f"connection lost: {exc}", "connection-lost")
        err = self._error or ClientError("connection closed", "closed")
        if not self._ready.done():
            self._ready.set_exception(err)
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(err)
        self._waiters.clear()
        self._wake_inbox()

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
                if self._error is not None and self._error.code != "closed":
                    raise self._error
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
        """Read the socket again once the application has drained half the inbox."""
        if self._reading_paused and len(self._inbox) <= self.max_buffered // 2:
            self._reading_paused = False
            if self._proto is not None and self._proto.transport is not None:
                self._proto.transport.resume_reading()

    def notifications(self) -> _Notifications:
        """``async for n in client.notifications()`` until the connection closes."""
        return _Notifications(self)

    # -- outgoing ----------------------------------------------------------------------------

    def _check_open(self) -> _Protocol:
        if self._error is not None:
            raise self._error
        if self._proto is None or self._proto.is_closing():
            raise ClientError("the connection is closed", "closed")
        return self._proto

    def _send(self, msg: bytes) -> None:
        self._out.append(msg)
        self._out_bytes += len(msg)
        if self._out_bytes > 256 * 1024:
            self._write_out()
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._write_out)

    def _write_out(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self._out or self._proto is None:
            return
        msgs, self._out, self._out_bytes = self._out, [], 0
        self._proto.write(b"".join(msgs_frame(chunk) for chunk in batches(msgs)))

    async def flush(self) -> None:
        """Write everything buffered now and wait until the socket takes it."""
        proto = self._check_open()
        self._write_out()
        await proto.drain()

    async def _request(self, code: int, sub_id: str, msg: bytes) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters[(code, sub_id)] = fut
        self._send(msg)
        await fut

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
            await self._request(
                B_SUBSCRIBED, sub_id, orjson.dumps([C_SUBSCRIBE, sub_id, encode_filter(f)])
            )
        except BaseException:
            self.subscriptions.pop(sub_id, None)
            raise
        return sub_id

    async def unsubscribe(self, sub_id: str) -> None:
        self._check_open()
        if sub_id not in self.subscriptions:
            raise ValueError(f"no subscription {sub_id!r}")
        await self._request(B_UNSUBSCRIBED, sub_id, orjson.dumps([C_UNSUBSCRIBE, sub_id]))
        del self.subscriptions[sub_id]

    def publish_nowait(self, attrs: Mapping[str, Value]) -> int:
        """Queue one event for publishing; returns its sequence number (never waits)."""
        self._check_open()
        try:
            checked = check_wire_attributes(attrs)
        except FrameError as exc:
            raise ValueError(str(exc)) from None
        self._seq += 1
        self._send(b"[12,%d," % self._seq + orjson.dumps(checked) + b"]")
        return self._seq

    async def publish(self, attrs: Mapping[str, Value]) -> int:
        """Publish one event; waits only while the broker pushes back. Returns its seq."""
        seq = self.publish_nowait(attrs)
        proto = self._proto
        if proto is not None and proto.writing_paused:
            await proto.drain()
        return seq

    @property
    def last_seq(self) -> int:
        return self._seq


async def connect(
    address: str, client_id: str | None = None, *, connect_timeout: float = 10.0
) -> Client:
    """Connect to a broker at ``HOST:PORT`` as ``client_id`` (the broker picks one if None)."""
    client = Client(client_id)
    await client._open(address, connect_timeout)
    return client
