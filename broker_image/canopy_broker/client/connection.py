"""One connection of a client to one broker: the hello, the write buffer, requests and answers.

A :class:`BrokerConnection` knows its client only as a :class:`ConnectionOwner` (where frames and
the loss of the connection go), so this module sits below the client class and the migration.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any, Protocol

import orjson

from canopy_broker.client.credentials import Credentials
from canopy_broker.client.notification import ClientError, ConnectionLostError
from canopy_broker.core.filters import Filter
from canopy_broker.runtime.framing import (
    C_LEAVE,
    C_SUBSCRIBE,
    F_HELLO,
    PROTOCOL_VERSION,
    FrameError,
    FrameProtocol,
    control_frame,
    encode_filter,
    parse_address,
)
from canopy_broker.runtime.framing import seconds as framing_seconds
from canopy_broker.runtime.outbox import msgs_frames


class ConnectionOwner(Protocol):
    """Where a :class:`BrokerConnection` sends what it receives (implemented by the client)."""

    def _frame(self, conn: BrokerConnection, frame: list[Any]) -> None: ...

    def _lost(self, conn: BrokerConnection) -> None: ...

    @property
    def credentials(self) -> Credentials: ...


def subscribe_message(sub_id: str, f: Filter) -> bytes:
    return orjson.dumps([C_SUBSCRIBE, sub_id, encode_filter(f)])


class BrokerConnection(FrameProtocol):
    """One connection of a :class:`Client` to one broker, with its own write buffer and request
    waiters. A client has one, or two while it migrates; frames go to the owner tagged with the
    connection they came from, which is how the owner tells old deliveries from new ones."""

    def __init__(self, owner: ConnectionOwner, client_id: str | None) -> None:
        super().__init__()
        self.owner = owner
        self.hello: dict[str, Any] = {
            "v": PROTOCOL_VERSION,
            "role": "client",
            "client_id": client_id,
        }
        token = owner.credentials.token
        if token:  # only ever sent inside TLS (see open)
            self.hello["token"] = token
        self.address = ""
        self.broker = ""
        self.routing = ""
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters: dict[tuple[int, str], asyncio.Future[None]] = {}
        self.error: ClientError | None = None
        self.ending = False  # this side is closing it: its end is not a lost connection
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.flush_handle: asyncio.Handle | None = None
        self.redirect: tuple[str, str] | None = None  # (target, address) the broker asked for
        self.answer: dict[str, Any] = {}  # the broker's hello
        self.acks = False  # the broker acknowledges publications (its hello says so)
        self.resuming_from = ""  # a failover's connection: the broker it replaces
        # The broker left the overlay this many seconds before it closed this connection
        # (B_CUT_OFF): a failover resumes from then, not from the close.
        self.cut_off_for = 0.0

    @classmethod
    async def open(
        cls, owner: ConnectionOwner, address: str, client_id: str | None, within: float
    ) -> BrokerConnection:
        """Connect and wait for the broker's hello (or its refusal)."""
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        creds = owner.credentials
        tls = creds.ssl_context()
        if tls is None and creds.token:
            raise ClientError("a bearer token is sent over TLS only: give the CA too", "insecure")
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: cls(owner, client_id), host, port, ssl=tls), within
            )
        except ssl.SSLError as exc:
            raise ClientError(
                f"TLS with {address} failed ({exc.reason or exc}): is it a broker of the "
                "overlay whose CA you gave, and does it speak TLS?",
                "tls",
            ) from None
        conn.address = address
        try:
            await asyncio.wait_for(asyncio.shield(conn.ready), within)
        except ConnectionLostError as exc:
            conn.abort()
            if tls is None:  # what a TLS broker does to a plaintext hello
                raise ConnectionLostError(
                    f"{exc}, before answering our plaintext hello: if it speaks TLS, connect "
                    "with the overlay's credentials (not --insecure)"
                ) from None
            raise
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

    def connection_ended(self, exc: Exception | None) -> None:
        super().connection_ended(exc)
        if self.cut_off_for and not self.ending:
            # What the close means, for a client that does not fail over: it would read
            # "closed the connection (it stopped or died)" and not know why.
            self.set_error(
                ConnectionLostError(
                    f"{self.who} was declared dead by its neighbours and left the overlay "
                    f"{self.cut_off_for:.1f}s ago (fenced); it let its clients go: connect "
                    "to another broker"
                )
            )
        elif isinstance(exc, (ConnectionResetError, BrokenPipeError)) and not self.ending:
            # A broker that is killed with bytes of ours unread resets the connection instead
            # of closing it (TLS makes that the usual case): to the user it is the same event.
            self.set_error(
                ConnectionLostError(
                    f"{self.who} closed the connection (it stopped or died: {exc.strerror})"
                )
            )
        elif exc is not None:
            self.set_error(ConnectionLostError(f"connection to {self.who} lost: {exc}"))
        elif not self.ending:
            self.set_error(
                ConnectionLostError(f"{self.who} closed the connection (it stopped or died)")
            )
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

    @property
    def who(self) -> str:
        return f"broker {self.broker} at {self.address}" if self.broker else self.address

    def abort(self) -> None:
        self.ending = True
        super().abort()

    def set_error(self, err: ClientError) -> None:
        if self.error is None:
            self.error = err

    def cut_off(self, seconds: object) -> None:
        """The broker says it left the overlay ``seconds`` ago and will close this connection
        (it was declared dead: fenced). Only a plain, sane number is taken."""
        cut = framing_seconds(seconds)
        if cut is None:
            raise FrameError(f"a cut-off must be seconds, got {seconds!r}")
        self.cut_off_for = cut

    def hello_received(self, hello: dict[str, Any]) -> None:
        self.answer = hello
        self.acks = bool(hello.get("acks"))
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
        self.write(msgs_frames(msgs))

    async def request(self, code: int, key: str, msg: bytes) -> None:
        """Send ``msg`` and wait for the broker's answer ``[code, key]``."""
        fut = self.expect(code, key)
        self.send(msg)
        await fut

    def expect(self, code: int, key: str) -> asyncio.Future[None]:
        """A future that the broker's answer ``[code, key]`` completes (or the loss of the
        connection fails); register it before sending what it answers."""
        if self.error is not None:
            raise self.error
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters[(code, key)] = fut
        return fut

    async def close_gracefully(self, within: float = 5.0) -> None:
        """Flush what is buffered, close, and wait until the connection is gone."""
        self.ending = True
        if not self.is_closing():
            self.write_out()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drain(), within)
            self.close()
        await self.wait_lost(within)

    async def leave(self, within: float = 5.0) -> None:
        """Ask the broker to detach us and wait until it has closed the connection, so that
        once this returns the broker no longer counts us (a draining broker waits for that)."""
        self.ending = True
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
