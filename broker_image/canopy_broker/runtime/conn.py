"""One TCP connection of the broker (accepted or dialed), speaking frames.

Until the hello it has no role; afterwards it belongs to a :class:`~.links.Link` (role ``link``
or ``peer``) or a :class:`~.links.Client` (role ``client``). It does nothing on its own: every
event goes to its :class:`ConnOwner` (the broker), which this module knows only through that
small interface, so connections sit below the broker process and never import it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from canopy_broker.core.broker import CoreFailedError, ProtocolError
from canopy_broker.runtime.framing import FrameError, FrameProtocol, TurnBudget
from canopy_broker.runtime.links import Client, Link
from canopy_broker.runtime.linkstate import LinkStateError
from canopy_broker.runtime.security import Identity, transport_identity

log = logging.getLogger("canopy.broker")


class ConnOwner(Protocol):
    """What a connection needs from the broker process that owns it.

    Declared here so that connections and sessions sit *below* the broker process
    (``runtime.server``) and never import it; the broker implements this interface.
    """

    @property
    def max_frame(self) -> int: ...

    @property
    def work_budget(self) -> TurnBudget: ...

    @property
    def idle(self) -> bool: ...

    def wake(self) -> None: ...

    def conn_made(self, conn: Conn) -> None: ...

    def frame_received(self, conn: Conn, frame: list[Any]) -> list[Any] | None: ...

    def conn_failed(self, conn: Conn, exc: FrameError) -> None: ...

    def conn_lost(self, conn: Conn) -> None: ...

    def mark_dirty(self, dest: Link | Client) -> None: ...

    def fail(self, why: str) -> None: ...


def _outcome_seen(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


class Conn(FrameProtocol):
    """A framed connection owned by a broker process; routes frames to it by role."""

    def __init__(self, broker: ConnOwner, dial: Link | None = None, listener: str = "") -> None:
        super().__init__(broker.max_frame)
        self.broker = broker
        self.work_budget = broker.work_budget  # one per broker, shared by its connections
        # Which port accepted it: "" (the one shared port), "client" or "link" (separate
        # listeners: each takes only its own kind of hello).
        self.listener = listener
        self.role: str | None = None  # "link" | "client" once the hello is done
        self.link: Link | None = dial
        self.client: Client | None = None
        self.dialing = dial is not None
        self.opened_at = 0.0  # accepted: when (the loop's clock), for the hello timeout
        self.source = ""  # accepted: the remote address, once counted for the per-source limit
        self.handshake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # A dialer that gave up (its hello timed out, the broker stops) no longer awaits the
        # outcome; the failure is logged where the connection fails, so mark it seen here.
        self.handshake.add_done_callback(_outcome_seen)
        self.identity: Identity | None = None  # what the peer's TLS certificate proved

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.identity = transport_identity(transport)  # asyncio calls this after the handshake
        self.broker.conn_made(self)

    def data_received(self, data: bytes) -> None:
        if self.broker.idle:
            self.broker.wake()
        link = self.link
        if link is not None and self.role == "link":
            link.bytes_in += len(data)
            if link.m_bytes_in is not None:
                link.m_bytes_in.inc(len(data))
        super().data_received(data)

    def frame_received(self, frame: list[Any]) -> list[Any] | None:
        try:
            return self.broker.frame_received(self, frame)
        except ProtocolError as exc:
            raise FrameError(str(exc), "protocol") from None
        except LinkStateError as exc:  # a runtime bug: it costs this connection, not the broker
            log.error("link state: %s", exc)
            raise FrameError(str(exc), "internal") from None
        except CoreFailedError as exc:
            self.broker.fail(str(exc))
            raise FrameError("the broker failed internally; see its log", "internal") from None

    def fail(self, exc: FrameError) -> None:
        self.broker.conn_failed(self, exc)
        super().fail(exc)
        if self.dialing and not self.handshake.done():
            self.handshake.set_exception(exc)

    def connection_ended(self, exc: Exception | None) -> None:
        super().connection_ended(exc)
        if self.dialing and not self.handshake.done():
            self.handshake.set_exception(ConnectionError("connection closed during the hello"))
        self.broker.conn_lost(self)

    def resume_writing(self) -> None:
        super().resume_writing()
        dest = self.link if self.role == "link" else self.client
        if dest is not None:
            self.broker.mark_dirty(dest)
