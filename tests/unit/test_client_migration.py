"""Client migration: the library's switching logic against a scripted stub broker (every overlap
made on purpose), then against real in-process brokers under traffic, and draining.

The stub lets a test decide exactly what each connection delivers and when the marker comes, so
the make-before-break rules are checked one by one: deliveries of the new connection are held
until the marker, the old one's count until then, afterwards only notifications newer than the
last delivered from their publisher pass; publishes switch connections after the new broker has
registered the move, and ``Moved`` follows the last publish on the old connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from canopy_broker.client import Client, ClientError, Notification, connect
from canopy_broker.core.filters import Filter
from canopy_broker.procs import env_pki
from canopy_broker.runtime.framing import (
    B_MARKER,
    B_MIGRATING,
    B_NOTIFY,
    B_SUBSCRIBED,
    C_LEAVE,
    C_MIGRATING,
    C_MOVE,
    C_PUBLISH,
    C_SUBSCRIBE,
    F_HELLO,
    F_MSGS,
    FrameSplitter,
    control_frame,
)
from canopy_broker.runtime.outbox import msgs_frame
from canopy_broker.runtime.server import Broker
from canopy_broker.sim.checker import DeliveryRecord, PubRecord, SubRecord, check_deliveries
from tests.unit.test_runtime_broker import (
    MakeBroker,
    addr,
    collect,
    eventually,
    link,
    make_broker,
    settled,
)

pytestmark = pytest.mark.looptime  # timeouts and heartbeats on the loop's clock, faked

__all__ = ["make_broker"]


class StubBroker:
    """Speaks just enough of the client protocol: answers the hello and subscriptions (and the
    migration notice when ``ack_migrating``), closes on leave, records every client message, and
    sends whatever the test tells it to on its latest connection."""

    def __init__(self, name: str, *, ack_migrating: bool = True) -> None:
        self.name = name
        self.ack_migrating = ack_migrating
        self.received: list[list[Any]] = []
        self.writer: asyncio.StreamWriter | None = None
        self._server: asyncio.Server | None = None
        self._handlers: list[asyncio.Task[Any]] = []

    async def start(self) -> StubBroker:
        pki = env_pki()  # a stub broker of the session's overlay speaks TLS like a real one
        tls = pki.broker(self.name).server_context() if pki is not None else None
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=tls)
        return self

    @property
    def address(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.append(task)
        self.writer = writer
        splitter = FrameSplitter()
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                for payload in splitter.feed(data):
                    frame = orjson.loads(payload)
                    if frame[0] == F_HELLO:
                        hello = {"v": 1, "role": "broker", "name": self.name, "routing": "x"}
                        writer.write(control_frame(F_HELLO, {**hello, "client_id": "c"}))
                    elif frame[0] == F_MSGS:
                        for item in frame[1]:
                            self.received.append(item)
                            if item[0] == C_SUBSCRIBE:
                                self.send([B_SUBSCRIBED, item[1]])
                            elif item[0] == C_MIGRATING and self.ack_migrating:
                                self.send([B_MIGRATING, item[1]])
                            elif item[0] == C_LEAVE:
                                writer.close()
        writer.close()

    def send(self, *msgs: list[Any]) -> None:
        assert self.writer is not None
        self.writer.write(msgs_frame([orjson.dumps(m) for m in msgs]))

    def notify(self, *seqs: int, publisher: str = "p") -> None:
        self.send(*([B_NOTIFY, publisher, s, 1, {"n": s}, ["f"]] for s in seqs))

    def codes(self) -> list[int]:
        return [m[0] for m in self.received]

    async def stop(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await asyncio.gather(*self._handlers, return_exceptions=True)


Stubs = tuple[StubBroker, StubBroker, Client]


@pytest.fixture
async def stubs() -> AsyncIterator[Stubs]:
    """An old and a new stub broker, and a client on the old one subscribed as ``f``."""
    old = await StubBroker("old").start()
    new = await StubBroker("new").start()
    client = await connect(old.address, "c")
    await client.subscribe("n >= 0", sub_id="f")
    yield old, new, client
    await client.close()
    for stub in (old, new):
        await stub.stop()


def consumer(client: Client, style: str) -> Callable[[int], Awaitable[list[Notification]]]:
    """``take(n)``: the next ``n`` notifications, read with ``receive()`` or, in the
    ``callback`` style, as ``on_notifications`` handed them over."""
    if style == "receive":
        return lambda n: collect(client, n)
    handed: list[Notification] = []
    taken = 0
    client.on_notifications = handed.extend

    async def take(n: int) -> list[Notification]:
        nonlocal taken
        await eventually(lambda: len(handed) >= taken + n)
        taken += n
        return handed[taken - n : taken]

    return take


@pytest.mark.parametrize("style", ["receive", "callback"])
@pytest.mark.parametrize("dedup", [True, False])
async def test_switch_at_the_marker_filters_what_both_connections_carried(
    stubs: Stubs, dedup: bool, style: str
) -> None:
    old, new, client = stubs
    new.ack_migrating = False  # the test answers the migration notice itself
    client.dedup = dedup
    take = consumer(client, style)
    old.notify(1, 2, 3)
    assert [n.seq for n in await take(3)] == [1, 2, 3]
    client.publish_nowait({"n": 100})

    move = asyncio.create_task(client.migrate(new.address, "new"))
    # Same id, same sub id and filter on the new broker, then the migration notice.
    await eventually(lambda: C_MIGRATING in new.codes())
    assert new.received[0] == [C_SUBSCRIBE, "f", [["n", ">=", 0]]]
    assert new.received[1] == [C_MIGRATING, "old"]
    new.notify(2, 3, 4, 5)  # overlaps what the old connection delivers
    await eventually(lambda: client._migration is not None and len(client._migration.held) == 4)
    assert not client._inbox  # held, not delivered
    client.publish_nowait({"n": 101})  # not registered yet: still on the old connection
    await eventually(lambda: old.codes().count(C_PUBLISH) == 2)
    assert C_MOVE not in old.codes()

    new.send([B_MIGRATING, "old"])  # the new broker holds our publications from now on
    await eventually(lambda: C_MOVE in old.codes())
    assert old.received[-1] == [C_MOVE, "new"]  # after both publishes
    client.publish_nowait({"n": 102})
    await eventually(lambda: C_PUBLISH in new.codes())
    assert [m[1] for m in new.received if m[0] == C_PUBLISH] == [3]  # the sequence goes on

    old.notify(4)  # still before the marker: delivered from the old connection
    old.send([B_MARKER])
    old.notify(5)  # after the marker the old connection is only drained
    await move
    assert old.codes()[-1] == C_LEAVE and client.broker == "new" and client.migrations == 1
    new.notify(5, 6)  # 5 again, then new
    got = [1, 2, 3] + [n.seq for n in await take(3 if dedup else 7)]
    if dedup:
        assert got == [1, 2, 3, 4, 5, 6] and client.duplicates_dropped == 4
    else:
        assert got == [1, 2, 3, 4, 2, 3, 4, 5, 5, 6] and client.duplicates_dropped == 0
    # The checker the integration tests use agrees.
    subs = [SubRecord("c", "f", Filter.parse("n >= 0"), issued_at=0, settled_at=0)]
    pubs = [PubRecord("p", s, {"n": s}, published_at=1, ended_at=1) for s in range(1, 7)]
    report = check_deliveries(subs, pubs, [DeliveryRecord("c", "p", s, 2) for s in got])
    assert report.ok is dedup and len(report.duplicated) == (0 if dedup else 4)


async def test_no_marker_switches_anyway_and_says_so(stubs: Stubs) -> None:
    old, new, client = stubs
    old.notify(1)
    await collect(client, 1)
    with pytest.raises(ClientError) as info:
        await client.migrate(new.address, within=0.5)
    assert info.value.code == "marker-timeout"
    assert client.broker == "new" and old.codes()[-2:] == [C_MOVE, C_LEAVE]
    new.notify(1, 2)
    assert [n.seq for n in await collect(client, 1)] == [2]


async def test_losing_the_old_connection_completes_the_switch(stubs: Stubs) -> None:
    old, new, client = stubs
    move = asyncio.create_task(client.migrate(new.address, "new"))
    await eventually(lambda: C_MOVE in old.codes())
    new.notify(1)
    assert old.writer is not None
    old.writer.close()  # the old broker goes away before sending the marker
    await move
    assert [n.seq for n in await collect(client, 1)] == [1] and client.broker == "new"


async def test_a_failed_move_leaves_the_client_where_it_was(make_broker: MakeBroker) -> None:
    a, b, c = [await make_broker(n) for n in "abc"]
    await link(a, b)
    client = await connect(addr(a), "c")
    await client.subscribe("n >= 0", sub_id="f")
    with pytest.raises(ValueError):
        await client.migrate(addr(a), "a")
    with pytest.raises(ClientError) as info:
        await client.migrate(addr(b), "x")
    assert info.value.code == "wrong-broker"
    with pytest.raises(ClientError) as info:  # c is no neighbour of a: the core refuses
        await client.migrate(addr(c), "c")
    assert info.value.code == "protocol"
    await eventually(lambda: "c" not in b.clients and "c" not in c.clients)
    client.publish_nowait({"n": 1})
    [note] = await collect(client, 1)
    assert (note.seq, client.broker, client.migrations) == (1, "a", 0)
    await client.close()


async def test_a_broker_refuses_publishes_after_the_move(make_broker: MakeBroker) -> None:
    a, b = await make_broker("a"), await make_broker("b")
    await link(a, b)
    client = await connect(addr(a), "c")
    assert client._conn is not None
    client._conn.send(orjson.dumps([C_MOVE, "b"]))
    client.publish_nowait({"n": 1})  # would overtake what it publishes at b
    with pytest.raises(ClientError) as info:
        await client.receive(timeout=5)
    assert info.value.code == "protocol" and "after moving away" in str(info.value)
    assert client.closed and "c" not in a.clients
    await client.close()


# --------------------------------------------------------------------------- real brokers


class Recorder:
    """Deliveries and publications in the checker's terms, on the loop's clock."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.subs: list[SubRecord] = []
        self.pubs: list[PubRecord] = []
        self.deliveries: list[DeliveryRecord] = []
        self.stop = asyncio.Event()

    async def drain(self, name: str, client: Client) -> None:
        while batch := await client.receive(1000):
            t = self.loop.time()
            self.deliveries += [DeliveryRecord(name, n.publisher, n.seq, t) for n in batch]

    async def publish(self, name: str, client: Client) -> None:
        rng = random.Random(name)
        while not self.stop.is_set():
            for _ in range(10):
                attrs = {"n": rng.randrange(100)}
                t = self.loop.time()
                self.pubs.append(PubRecord(name, client.publish_nowait(attrs), attrs, t, t))
            await client.flush()
            await asyncio.sleep(0.002)  # pacing, not synchronisation

    def report(self) -> str:
        report = check_deliveries(self.subs, self.pubs, self.deliveries)
        assert report.ok and report.owed > 100, str(report)
        return str(report)


async def test_moving_there_and_back_under_traffic_is_exact(make_broker: MakeBroker) -> None:
    """A subscriber that also publishes moves a -> b -> a while a publisher on c keeps going.
    Moving back at once also shows that the old connection's detach (leave) is done when
    migrate returns, so the broker never confuses it with the new one under the same id."""
    a, b, c = [await make_broker(n) for n in "abc"]
    await link(a, b)
    await link(b, c)
    rec = Recorder()
    mover = await connect(addr(a), "mover")
    await mover.subscribe("n < 60", sub_id="f")
    rec.subs.append(SubRecord("mover", "f", Filter.parse("n < 60"), 0.0, rec.loop.time()))
    watcher = await connect(addr(c), "watcher")
    await watcher.subscribe("n >= 30", sub_id="g")
    rec.subs.append(SubRecord("watcher", "g", Filter.parse("n >= 30"), 0.0, rec.loop.time()))
    await settled(a, b, c)
    rec.subs = [s.settled(rec.loop.time()) for s in rec.subs]
    pub = await connect(addr(c), "pub")
    tasks = [
        asyncio.create_task(rec.drain("mover", mover)),
        asyncio.create_task(rec.drain("watcher", watcher)),
        asyncio.create_task(rec.publish("pub", pub)),
        asyncio.create_task(rec.publish("mover", mover)),
    ]
    await eventually(lambda: len(rec.pubs) > 200)
    await mover.migrate(addr(b), "b")
    assert "mover" not in a.clients and "mover" in b.clients
    await mover.migrate(addr(a), "a")
    assert "mover" not in b.clients and "mover" in a.clients and mover.migrations == 2
    n = len(rec.pubs)
    await eventually(lambda: len(rec.pubs) > n + 200)
    rec.stop.set()
    await asyncio.gather(*tasks[2:])
    for cl in (pub, mover):
        await cl.flush()
    await settled(a, b, c)
    await eventually(lambda: b.core.routing_table().clients == {})
    for cl in (pub, mover, watcher):
        await cl.close()
    await asyncio.gather(*tasks[:2])
    rec.report()


async def test_draining_moves_every_client_to_the_neighbour(make_broker: MakeBroker) -> None:
    leaf, hub = await make_broker("leaf"), await make_broker("hub")
    await link(leaf, hub)
    rec = Recorder()
    subs = {name: await connect(addr(leaf), name) for name in ("s1", "s2")}
    for name, client in subs.items():
        await client.subscribe("n >= 0", sub_id="all")
        rec.subs.append(SubRecord(name, "all", Filter.parse("n >= 0"), 0.0, 0.0))
    stubborn = await connect(addr(leaf), "stubborn", follow_redirects=False)
    pubs = {
        "p-leaf": await connect(addr(leaf), "p-leaf"),
        "p-hub": await connect(addr(hub), "p-hub"),
    }
    await settled(leaf, hub)
    tasks = [asyncio.create_task(rec.drain(n, c)) for n, c in subs.items()]
    tasks += [asyncio.create_task(rec.publish(n, c)) for n, c in pubs.items()]
    await eventually(lambda: len(rec.pubs) > 100)

    with pytest.raises(ValueError):
        leaf.drain("nowhere")
    status = leaf.drain("hub")
    assert status["draining"] and status["target"] == "hub" and status["address"] == addr(hub)
    await eventually(lambda: sorted(leaf.clients) == ["stubborn"])
    assert not await leaf.wait_drained(0.05)  # one client does not follow redirects
    late = await connect(addr(leaf), "late")  # attaching while draining: sent on at once
    await stubborn.close()
    assert await leaf.wait_drained(10), leaf.drain_status()
    assert late.broker == "hub" and all(c.broker == "hub" for c in (*subs.values(), *pubs.values()))
    assert leaf.status()["drain"] == {**status, "clients": 0, "unacknowledged": 0, "drained": True}
    assert not leaf.cancel_drain()["draining"]

    rec.stop.set()
    await asyncio.gather(*tasks[2:])
    for cl in (*pubs.values(), *subs.values(), late):
        await cl.flush()
    await settled(leaf, hub)
    for cl in (*pubs.values(), *subs.values(), late):
        await cl.close()
    await asyncio.gather(*tasks[:2])
    rec.report()


async def test_status_reports_ordering_delays(make_broker: MakeBroker) -> None:
    b: Broker = await make_broker("b")
    b.core.ordering_delays.extend([0.002, 0.004])
    assert b.status()["ordering_delay"] == {"count": 2, "mean_ms": 3.0, "max_ms": 4.0}
    assert not b.core.ordering_delays  # taken, so the core's list does not grow for ever
    assert "canopy_ordering_delay_seconds_count 2.0" in b.metrics.render().decode()
