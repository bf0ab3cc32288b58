"""The broker's HTTP ports against strangers: a bound per remote address, a deadline for each
request head, and refusals told in the log without flooding it (:mod:`runtime.httpsite`,
:class:`runtime.accept.SourceCounts`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from canopy_broker.runtime import accept, httpsite


@contextlib.asynccontextmanager
async def _serving(per_source: int) -> AsyncIterator[tuple[int, asyncio.Event]]:
    """A site with one quick route and one that answers only when the event is set: its port
    and that event."""
    release = asyncio.Event()

    async def quick(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow(_request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/quick", quick)
    app.router.add_get("/slow", slow)
    runner = httpsite.runner(app)
    await runner.setup()
    try:
        await httpsite.BoundedSite(runner, "127.0.0.1", 0, per_source=per_source).start()
        yield runner.addresses[0][1], release
    finally:
        await runner.cleanup()


async def _closed(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the server closes this connection within ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            return await reader.read() == b""
    except TimeoutError:
        return False


async def _get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    try:
        return await reader.read()
    finally:
        writer.close()


async def test_one_address_gets_at_most_its_bound_of_connections() -> None:
    async with _serving(per_source=3) as (port, _):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for _, w in held:
            w.write(b"GET /quick HTTP/1.1\r\nHost: x\r\n")  # a head begun, never finished
        extra_r, extra_w = await asyncio.open_connection("127.0.0.1", port)
        assert await _closed(extra_r, within=2.0)  # the fourth: closed as soon as accepted
        extra_w.close()
        assert not any([await _closed(r, within=0.2) for r, _ in held])
        held[0][1].close()  # one ends: its place is free again
        async with asyncio.timeout(5):
            while b"200 OK" not in await _get(port, "/quick"):  # noqa: ASYNC110 - a server
                await asyncio.sleep(0.05)
        for _, w in held[1:]:
            w.close()


async def test_a_request_head_has_a_deadline_a_request_being_handled_has_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(httpsite, "HEAD_TIMEOUT", 0.5)
    async with _serving(per_source=10) as (port, release):
        slowloris_r, slowloris_w = await asyncio.open_connection("127.0.0.1", port)
        slowloris_w.write(b"GET /quick HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # a header line now and then does not extend the deadline
            await asyncio.sleep(0.2)
            slowloris_w.write(b"X-Drip: 1\r\n")
        assert await _closed(slowloris_r, within=2.0)
        slowloris_w.close()

        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)  # never says a word
        assert await _closed(idle_r, within=2.0)
        idle_w.close()

        # The case that must not trip: a whole request within the deadline is answered, and
        # one handled for longer than the deadline is not cut.
        assert b"200 OK" in await _get(port, "/quick")
        answer = asyncio.create_task(_get(port, "/slow"))
        await asyncio.sleep(1.5)
        assert not answer.done()
        release.set()
        assert (await answer).endswith(b"late")


async def test_refusals_are_told_once_per_address_per_interval(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stranger retrying in a loop got a warning line per attempt: now one line per
    address per interval, then how many were refused since."""
    now = [100.0]
    monkeypatch.setattr(accept.time, "monotonic", lambda: now[0])
    async with _serving(per_source=1) as (port, _):
        _, held = await asyncio.open_connection("127.0.0.1", port)
        with caplog.at_level(logging.WARNING, logger="canopy.http"):
            for _ in range(20):
                r, w = await asyncio.open_connection("127.0.0.1", port)
                assert await _closed(r, within=2.0)
                w.close()
            now[0] += accept.SourceCounts.TELL_EVERY
            r, w = await asyncio.open_connection("127.0.0.1", port)
            assert await _closed(r, within=2.0)
            w.close()
        told = [r.getMessage() for r in caplog.records if r.name == "canopy.http"]
        assert told == [
            f"http: refused {n} connection(s) from 127.0.0.1: 1 open (the limit)" for n in (1, 20)
        ]
        held.close()


def test_source_counts_tell_an_address_once_per_interval_and_then_the_rest(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An address that fills its place and lets go in a loop is told once per interval (it
    was twice per loop); the rest of its refusals is told once it has nothing open after the
    interval, and then it is forgotten."""
    now = [100.0]
    monkeypatch.setattr(accept.time, "monotonic", lambda: now[0])
    log = logging.getLogger("canopy.test")
    counts = accept.SourceCounts(1)
    with caplog.at_level(logging.WARNING, logger="canopy.test"):
        for _ in range(3):  # fill, be refused, let go: three times within the interval
            assert counts.take("a") and not counts.take("a")
            counts.refused("a", log, "t")
            counts.give_back("a")
        now[0] += accept.SourceCounts.TELL_EVERY
        assert counts.take("a")
        counts.give_back("a")  # after the interval, nothing open: the rest told, forgotten
        assert counts.take("a") and not counts.take("a")
        counts.refused("a", log, "t")  # told again at once
    assert [r.getMessage() for r in caplog.records] == [
        "t: refused 1 connection(s) from a: 1 open (the limit)",
        "t: refused 2 more connection(s) from a",
        "t: refused 1 connection(s) from a: 1 open (the limit)",
    ]
