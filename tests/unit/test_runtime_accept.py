"""A TLS listener counts a stranger's address before its handshake (runtime.accept).

Each test runs on asyncio's own loop and on uvloop's (the broker process runs on uvloop), as
the TLS layer is each loop's own code (uvloop starts reading a connection as soon as its
``connection_made`` returns, which a first version of the listener did not allow for).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, cast

import pytest
import uvloop

from canopy_broker.client.credentials import Credentials
from canopy_broker.procs import env_pki
from canopy_broker.runtime import accept
from canopy_broker.runtime.tasks import TaskSet

LOOPS = pytest.mark.parametrize(
    "new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
HOST = "127.0.0.1"


def run(new_loop: Callable[[], asyncio.AbstractEventLoop], main: Coroutine[Any, Any, None]) -> None:
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main)


class Echo(asyncio.Protocol):
    """Says back what it is sent; notes that it was made only once the handshake was done."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert transport.get_extra_info("ssl_object") is not None  # secured before it is seen
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


async def closed_at_once(reader: asyncio.StreamReader) -> bool:
    """Whether the listener ended the connection (reset or closed) within a second: far less
    than a handshake timeout."""
    try:
        async with asyncio.timeout(1.0):
            return await reader.read() == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def listener(
    limit: int, *, exempt: Callable[[str], bool] = accept.never
) -> tuple[asyncio.Server, TaskSet, list[int], int]:
    pki = env_pki()
    assert pki is not None  # tests/conftest.py sets the session's CA
    tasks = TaskSet("test")
    refused: list[int] = []
    server = await accept.listen(
        Echo,
        HOST,
        0,
        tls=pki.broker("gate").server_context(),
        admission=accept.Admission(
            30.0, limit, tasks, "test", exempt=exempt, on_refused=lambda: refused.append(1)
        ),
    )
    return server, tasks, refused, server.sockets[0].getsockname()[1]


async def echoed(port: int, ctx: ssl.SSLContext, payload: bytes) -> bytes:
    """A TLS client that writes as soon as its handshake is done."""
    reader, writer = await asyncio.open_connection(HOST, port, ssl=ctx, server_hostname=HOST)
    writer.write(payload)
    try:
        async with asyncio.timeout(5):
            return await reader.readexactly(len(payload))
    finally:
        writer.close()


@LOOPS
def test_handshakes_in_progress_from_one_address_are_bounded(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """Three sockets that never start their handshake fill the address's place; a fourth is
    closed at once, not after the handshake timeout (30 s here), and is counted. Connections
    whose handshake is done are not counted here (their protocol counts them), and once one
    idle socket goes, an honest client gets through and is answered."""

    async def main() -> None:
        server, tasks, refused, port = await listener(3)
        ctx = Credentials.from_env().ssl_context()
        held = [await asyncio.open_connection(HOST, port, ssl=ctx) for _ in range(3)]
        idle = [await asyncio.open_connection(HOST, port) for _ in range(3)]
        assert not any(await asyncio.gather(*(closed_at_once(r) for r, _ in idle)))  # waiting
        extra, extra_writer = await asyncio.open_connection(HOST, port)
        assert await closed_at_once(extra)
        assert refused == [1]
        extra_writer.close()
        idle[0][1].close()
        async with asyncio.timeout(5):
            while True:  # its place is free once the listener has seen it go
                try:
                    assert await echoed(port, ctx, b"ping" * 1000) == b"ping" * 1000
                    break
                except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
                    await asyncio.sleep(0.05)
        for _, writer in held + idle:
            writer.close()
        server.close()
        await tasks.stop()
        await server.wait_closed()

    run(new_loop, main())


@LOOPS
def test_exempt_addresses_are_not_counted_and_handshakes_end_with_their_listener(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def main() -> None:
        server, tasks, refused, port = await listener(1, exempt=lambda source: True)
        idle = [await asyncio.open_connection(HOST, port) for _ in range(4)]
        assert not any(await asyncio.gather(*(closed_at_once(r) for r, _ in idle)))
        assert not refused and len(tasks) == 4  # four handshakes waiting
        server.close()
        await tasks.stop()  # the broker stopping: each waiting handshake ends, its socket too
        assert all(await asyncio.gather(*(closed_at_once(r) for r, _ in idle)))
        for _, writer in idle:
            writer.close()
        await server.wait_closed()

    run(new_loop, main())


@LOOPS
def test_handshakes_in_progress_on_a_listener_are_bounded_from_every_address_together(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Many addresses (a botnet, an IPv6 client's /64) cannot add up past the listener's own
    bound: here 2, with room for 10 per address."""
    monkeypatch.setattr(accept, "MAX_HANDSHAKES", 2)
    caplog.set_level(logging.WARNING, logger="canopy.accept")

    async def main() -> None:
        server, tasks, refused, port = await listener(10)
        idle = [await asyncio.open_connection(HOST, port) for _ in range(2)]
        assert not any(await asyncio.gather(*(closed_at_once(r) for r, _ in idle)))
        extra, extra_writer = await asyncio.open_connection(HOST, port)
        assert await closed_at_once(extra) and refused == [1]
        assert "refusing TLS handshakes: 2 in progress (the listener's limit)" in caplog.text
        for _, writer in [*idle, (extra, extra_writer)]:
            writer.close()
        server.close()
        await tasks.stop()
        await server.wait_closed()

    run(new_loop, main())


class Failing(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raise RuntimeError("a bug in the listener's protocol")


@LOOPS
def test_a_protocol_failing_on_one_connection_costs_that_connection_only(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """The handshakes run as tasks of their owner (the broker's, whose failed task fails the
    broker): an error of the protocol as the connection begins is logged, nothing more."""

    async def main() -> None:
        pki = env_pki()
        assert pki is not None
        tasks = TaskSet("test", on_failure=lambda task, why: failures.append(why))
        failures: list[str] = []
        server = await accept.listen(
            Failing,
            HOST,
            0,
            tls=pki.broker("gate").server_context(),
            admission=accept.Admission(30.0, 3, tasks, "test"),
        )
        port = server.sockets[0].getsockname()[1]
        ctx = Credentials.from_env().ssl_context()
        for _ in range(2):
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                reader, writer = await asyncio.open_connection(HOST, port, ssl=ctx)
                await closed_at_once(reader)
                writer.close()
        async with asyncio.timeout(5):
            while len(tasks):  # noqa: ASYNC110 - the handshakes end on their own
                await asyncio.sleep(0.01)
        assert not failures and server.is_serving()
        server.close()
        await server.wait_closed()

    run(new_loop, main())


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("::ffff:10.1.2.3", "10.1.2.3"),  # IPv4-mapped: the IPv4 address
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),  # a /64 is one client's
        ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
        ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("::1", "::1"),  # loopback stays itself (the broker does not count it)
        ("127.0.0.1", "127.0.0.1"),
        ("?", "?"),
    ],
)
def test_addresses_are_counted_by_ipv4_address_and_ipv6_prefix(host: str, key: str) -> None:
    assert accept.source_key(host) == key
