"""The broker's HTTP ports (the admin API, the HTTP gateway) as strangers may reach them.

aiohttp gives each connection as long as its keep-alive timeout (an hour by default) to send a
complete request head, and takes as many connections as the process has file descriptors. A
client that sends a header line every few seconds ("slowloris") therefore held its connection
for the hour, and one address could open thousands: measured, 3,000 such connections held for
as long as they were fed, about 12 KB each, up to the broker's file-descriptor limit, past
which the broker could accept nobody, native clients and links included.

:class:`BoundedSite` is aiohttp's ``TCPSite`` with two limits, the ones the broker's own
listener and the MQTT gateway already have:

* **per address**: at most ``per_source`` connections open from one remote address; one more
  is closed as soon as it is accepted, before aiohttp sees it;
* **in time**: :data:`HEAD_TIMEOUT` seconds for the TLS handshake, and as long to send each
  request head, counted from the connection or from the end of the previous response
  (aiohttp's keep-alive timer, which closes a connection whose next request head is not
  complete by then; a request being handled, such as a stream, is not cut).

Over TLS, the address is counted before the handshake too (:mod:`runtime.accept`): at most
``per_source`` handshakes in progress from one address, apart from the open connections.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from canopy_broker.runtime.accept import Admission, SourceCounts, listen, source_of
from canopy_broker.runtime.tasks import TaskSet

log = logging.getLogger("canopy.http")

HEAD_TIMEOUT = 20.0  # > aiohttp's client keep-alive (15 s): clients close idle connections first
MAX_PER_SOURCE = 128  # HTTP connections at once from one remote address


def runner(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """An ``AppRunner`` whose connections get :data:`HEAD_TIMEOUT` for each request head."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=HEAD_TIMEOUT, **kwargs)


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind a check of its remote address."""

    def __init__(self, inner: asyncio.Protocol, counts: SourceCounts) -> None:
        self._inner = inner
        self._counts = counts
        self._source: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        source = source_of(transport)
        if not self._counts.take(source):
            self._counts.refused(source, log, "http")
            transport.close()  # nothing written yet: closed at once
            return
        self._source = source
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._source is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._source is not None else None

    def pause_writing(self) -> None:
        if self._source is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._source is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._source is None:
            return
        self._counts.give_back(self._source)
        self._inner.connection_lost(exc)


class BoundedSite(web.BaseSite):
    """A TCP site of ``runner`` that takes at most ``per_source`` connections per address."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        ssl_context: Any = None,
        per_source: int = MAX_PER_SOURCE,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host, self._port = host, port
        self.counts = SourceCounts(per_source)
        self.handshakes = TaskSet("http")

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        counts = self.counts
        self._server = await listen(
            lambda: _Counted(server(), counts),
            self._host,
            self._port,
            tls=self._ssl_context,
            # the head's time, not asyncio's 60 s
            admission=Admission(HEAD_TIMEOUT, counts.limit, self.handshakes, "http"),
        )

    async def stop(self) -> None:
        await super().stop()
        await self.handshakes.stop()
