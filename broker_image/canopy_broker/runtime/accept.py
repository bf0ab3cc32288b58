"""What a listener spends on a stranger before it knows anything of it: counted per address.

Every listener of the broker process (the broker's client and link ports, the admin API and
HTTP gateway, the MQTT gateway) takes at most so many connections from one remote address
(:class:`SourceCounts`). A TLS listener made with ``create_server(ssl=...)`` hands a connection
over only once its handshake is done, so that count came too late: the handshake's state (an
SSL object and its buffers, about 50 KiB) was spent on every accepted socket for up to the
handshake timeout, however many one address opened. A flood of idle sockets from one address
took a broker from 58 to 255 MB (an outside review: 770 MB).

A TLS listener is therefore a :class:`Listener`: its own accept loop on the listening socket,
which counts the address of each accepted socket *before* anything else (at most ``limit``
handshakes in progress from one address; one more is closed at once, having cost a file
descriptor for a moment) and only then gives the socket to the event loop with TLS
(``loop.connect_accepted_socket``, the same TLS layer ``create_server`` uses). A connection
whose handshake is done is counted again by its own protocol, as an open connection; the two
counts are apart, so an address holds at most ``limit`` of each.

Why not ``start_tls`` on a plain server's connection: uvloop starts reading a connection as
soon as its ``connection_made`` returns, so the ClientHello could reach the plain protocol
before ``start_tls`` took the connection over, and the handshake then waited for it forever
(found by this module's tests).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import math
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

from canopy_broker.runtime.tasks import TaskSet

log = logging.getLogger("canopy.accept")


def source_key(host: str) -> str:
    """What an address is counted as: itself for IPv4 (and an IPv4-mapped IPv6 address), its
    /64 for any other IPv6 address but loopback (one client holds a whole /64, and each
    address of it would otherwise have the limit), and as given if it is not an address."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if not ip.is_loopback:
            return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def source_of(transport: asyncio.BaseTransport | None) -> str:
    """The remote address a transport is from, as :class:`SourceCounts` counts it (see
    :func:`source_key`; "?" without one)."""
    peer = transport.get_extra_info("peername") if transport is not None else None
    return source_key(str(peer[0])) if isinstance(peer, tuple) and peer else "?"


class SourceCounts:
    """What is open from each remote address (connections, streams), at most ``limit`` each:
    a listener takes one before it spends anything on a stranger, and gives it back when that
    ends. Shared by the broker's listeners and its gateways, which each count their own.

    Refusals are told in the log at most once per address per :attr:`TELL_EVERY` seconds
    (:meth:`refused`): a stranger retrying in a loop got one warning line per attempt, a
    flood of the log from one address."""

    TELL_EVERY = 10.0
    KEEP_TOLD = 4096  # addresses told about, past which the stale ones are forgotten

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}
        # when last told, refused since, and where to tell the rest
        self._told: dict[str, tuple[float, int, logging.Logger, str, str]] = {}

    def count(self, source: str) -> int:
        return self._open.get(source, 0)

    def take(self, source: str) -> bool:
        """One more from ``source``; False, and nothing counted, when it has ``limit`` open."""
        n = self._open.get(source, 0)
        if n >= self.limit:
            return False
        self._open[source] = n + 1
        return True

    def refused(
        self, source: str, logger: logging.Logger, who: str, what: str = "connection(s)"
    ) -> None:
        """After a refused :meth:`take`: log it, with those not logged yet, unless ``source``
        was told about less than :attr:`TELL_EVERY` s ago (a caller retrying in a loop would
        write a line per attempt); the rest are told when ``source`` has nothing open left.
        Kept only while ``source`` has ``what`` open, so bounded by the addresses at their
        limit."""
        self._forget_old()
        now = time.monotonic()
        told, since, *_ = self._told.get(source, (-self.TELL_EVERY, 0))
        if now - told < self.TELL_EVERY:
            self._told[source] = (told, since + 1, logger, who, what)
            return
        self._told[source] = (now, 0, logger, who, what)
        logger.warning(
            "%s: refused %d %s from %s: %d open (the limit)",
            who,
            since + 1,
            what,
            source,
            self.limit,
        )

    def give_back(self, source: str) -> None:
        left = self._open.pop(source, 0) - 1
        if left > 0:
            self._open[source] = left
            return
        told = self._told.get(source)
        if told is None or time.monotonic() - told[0] < self.TELL_EVERY:
            # Kept while it is recent, so that an address that fills its place and lets go
            # in a loop is told once per interval, not twice per loop (review); the oldest
            # go when there are many (:meth:`_forget_old`).
            return
        del self._told[source]
        if told[1]:  # the rest of a burst, told when it is over
            _, since, logger, who, what = told
            logger.warning("%s: refused %d more %s from %s", who, since, what, source)

    def _forget_old(self) -> None:
        """Forget what was told about addresses with nothing open, long enough ago (their
        untold rest is then lost to the log; the metrics count every refusal)."""
        if len(self._told) < self.KEEP_TOLD:
            return
        stale = time.monotonic() - self.TELL_EVERY
        for source in [s for s, t in self._told.items() if t[0] < stale and s not in self._open]:
            del self._told[source]


class Quiet:
    """When a line about ``key`` may be logged: at most once per :attr:`TELL_EVERY` seconds,
    saying how many were held back since. For floods that would write a line each (strangers
    closed for silence, a listener at its limit); :class:`SourceCounts` keeps its own, per
    address, with the rest told when the address lets go."""

    TELL_EVERY = SourceCounts.TELL_EVERY

    def __init__(self) -> None:
        self._told: dict[str, tuple[float, int]] = {}  # when last told, held back since

    def due(self, key: str) -> tuple[int, float] | None:
        """None: keep quiet (this one is counted); else how many were held back since the
        last line about ``key``, and how long ago that was (0 and inf the first time)."""
        now = time.monotonic()
        told, held = self._told.get(key, (-math.inf, 0))
        if now - told < self.TELL_EVERY:
            self._told[key] = (told, held + 1)
            return None
        self._told[key] = (now, 0)
        return held, now - told


def never(source: str) -> bool:
    """No address is exempt from the count."""
    return False


ACCEPT_BACKLOG = 1024  # the kernel's queue of connections not accepted yet (a reconnect storm)
RETRY_ACCEPT = 1.0  # seconds without accepting after the process ran out of descriptors
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""accept()'s errors that pause the listener (asyncio's set); any other is one connection's."""
HANDSHAKES_PER_SOURCE = 64
"""TLS handshakes in progress from one address at most (or the listener's own limit per address,
if lower). A handshake takes milliseconds: 64 at once is a reconnect storm of thousands a
second from one address, while a flood of idle sockets from it costs at most about 3 MB."""
MAX_HANDSHAKES = 4096
"""TLS handshakes in progress on one listener, from every counted address together (about
200 MB): many addresses (a botnet, IPv6 /64s) cannot add up past it. It takes 64 addresses
renewing their sockets every handshake timeout to fill it (at 1,024 and 256 per address,
four did, and locked every other stranger out: outside review)."""


@dataclass(frozen=True)
class Admission:
    """What a listener allows a stranger, and whom it tells.

    At most ``limit`` handshakes in progress per address, each for ``handshake_timeout``
    seconds; ``exempt`` names addresses not counted (the broker's own loopback: its gateways'
    sessions); ``on_accept`` hears of every accepted socket (the broker's heap trim counts
    them), ``on_refused`` of each one closed for its address. The handshakes run as tasks of
    ``tasks``, stopped with their owner, which also closes their sockets; ``who`` names the
    listener in the log."""

    handshake_timeout: float
    limit: int
    tasks: TaskSet
    who: str
    exempt: Callable[[str], bool] = never
    on_accept: Callable[[], None] | None = None
    on_refused: Callable[[], None] | None = None


class Listener(asyncio.AbstractServer):
    """A TLS listener that counts each address before its handshake (:class:`Admission`).

    ``factory`` makes the listener's own protocol for a connection; its ``connection_made``
    comes once the handshake is done."""

    def __init__(
        self,
        sockets: list[socket.socket],
        factory: Callable[[], asyncio.BaseProtocol],
        tls: ssl.SSLContext,
        admission: Admission,
    ) -> None:
        self._sockets = sockets
        self.factory = factory
        self.tls = tls
        self.admission = admission
        self.counts = SourceCounts(min(admission.limit, HANDSHAKES_PER_SOURCE))
        self.in_progress = 0  # counted handshakes under way, from every address
        self._quiet = Quiet()  # when the listener's limit was last logged
        self._loop = asyncio.get_running_loop()
        self._serving = False

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._sockets)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        self._serve()

    def _serve(self) -> None:
        self._serving = True
        for sock in self._sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def close(self) -> None:
        """No more accepting; the handshakes under way end with their task set."""
        if not self._sockets:
            return
        for sock in self._sockets:
            self._loop.remove_reader(sock.fileno())
            sock.close()
        self._sockets = []
        self._serving = False

    async def wait_closed(self) -> None:
        return None  # nothing outlives close() but the handshakes, which ``tasks`` own

    async def serve_forever(self) -> None:
        if not self._serving:
            self._serve()
        while self._serving:  # noqa: ASYNC110 - an unused part of asyncio's server interface
            await asyncio.sleep(1.0)

    def _accept(self, listening: socket.socket) -> None:
        for _ in range(ACCEPT_BACKLOG):  # as many as are queued, as asyncio's accept does
            try:
                sock, _peer = listening.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in OUT_OF_RESOURCES:  # a connection's own error: the next one
                    log.debug("%s: accept failed: %s", self.admission.who, exc)
                    continue
                log.error(  # out of descriptors or memory: pause, as asyncio does
                    "%s: cannot accept connections (%s); trying again in %g s",
                    self.admission.who,
                    exc,
                    RETRY_ACCEPT,
                )
                self._loop.remove_reader(listening.fileno())
                self._loop.call_later(RETRY_ACCEPT, self._resume, listening)
                return
            self.admit(sock)

    def _resume(self, listening: socket.socket) -> None:
        if self._serving and listening in self._sockets:
            self._loop.add_reader(listening.fileno(), self._accept, listening)

    def admit(self, sock: socket.socket) -> None:
        """A socket accepted: its handshake starts if its address has room (and the listener:
        :data:`MAX_HANDSHAKES` in progress from everywhere), else it is closed at once."""
        admission = self.admission
        if admission.on_accept is not None:
            admission.on_accept()
        try:
            source = source_key(str(sock.getpeername()[0]))
            sock.setblocking(False)
            # As a listener's transports have it (a socket handed over is not given it: small
            # TLS records then waited for Nagle's algorithm, and a failover test timed out).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # gone already
            sock.close()
            return
        counted = not admission.exempt(source)
        if counted and self.in_progress >= MAX_HANDSHAKES:
            if self._quiet.due("full") is not None:  # a line per 10 s at most
                log.warning(
                    "%s: refusing TLS handshakes: %d in progress (the listener's limit)",
                    admission.who,
                    self.in_progress,
                )
            self._refuse(sock)
            return
        if counted and not self.counts.take(source):
            self.counts.refused(source, log, admission.who, "TLS handshake(s)")
            self._refuse(sock)
            return
        if counted:
            self.in_progress += 1
        admission.tasks.spawn(
            self._handshake(sock, source if counted else None), f"TLS handshake of {source}"
        )

    def _refuse(self, sock: socket.socket) -> None:
        if self.admission.on_refused is not None:
            self.admission.on_refused()
        sock.close()

    async def _handshake(self, sock: socket.socket, source: str | None) -> None:
        try:
            timeout = self.admission.handshake_timeout
            await self._loop.connect_accepted_socket(
                self.factory, sock, ssl=self.tls, ssl_handshake_timeout=timeout
            )
        except OSError as exc:  # refused, reset, timed out (ssl.SSLError is an OSError)
            log.debug("%s: TLS handshake with %s failed: %s", self.admission.who, source, exc)
        except Exception:  # the listener's protocol failed on one connection: that one only
            log.exception("%s: a connection from %s failed as it began", self.admission.who, source)
        finally:  # the loop has closed the socket if the handshake failed or was cancelled
            if source is not None:
                self.counts.give_back(source)
                self.in_progress -= 1


Serving = asyncio.Server | Listener
"""What :func:`listen` gives: asyncio's server, or a TLS :class:`Listener`."""


async def bound(host: str | None, port: int) -> list[socket.socket]:
    """Listening sockets on ``host:port``: one per address the name resolves to, as
    ``create_server`` makes them (address reuse; IPv6 sockets for IPv6 only; a family the
    kernel lacks skipped, if another is there)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, *_, address in dict.fromkeys(infos):
            try:
                sock = socket.create_server(address, family=family, backlog=ACCEPT_BACKLOG)
            except OSError as exc:
                if exc.errno == errno.EAFNOSUPPORT and len(infos) > 1:
                    continue
                # as create_server says it (the supervisor and its tests read this line)
                raise OSError(
                    exc.errno,
                    f"error while attempting to bind on address {address!r}: "
                    f"{(exc.strerror or str(exc)).lower()}",
                ) from None
            sock.setblocking(False)
            sockets.append(sock)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    if not sockets:
        raise OSError(errno.EAFNOSUPPORT, f"no address family of {host!r} is supported here")
    return sockets


async def listen(
    factory: Callable[[], asyncio.BaseProtocol],
    host: str | None,
    port: int,
    *,
    tls: ssl.SSLContext | None,
    admission: Admission,
) -> Serving:
    """A listener on ``host:port`` making ``factory``'s protocol for each connection: over TLS
    (``tls``) a :class:`Listener`, else asyncio's own (the protocol counts its address before
    it spends anything; ``admission`` then only hears of each accept)."""
    if tls is not None:
        listener = Listener(await bound(host, port), factory, tls, admission)
        listener._serve()
        return listener
    accepted = admission.on_accept

    def counted() -> asyncio.BaseProtocol:
        if accepted is not None:
            accepted()
        return factory()

    loop = asyncio.get_running_loop()
    return await loop.create_server(counted, host, port, reuse_address=True)
