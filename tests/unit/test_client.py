"""The client library's own behaviour: iteration, batching, close, errors."""

from __future__ import annotations

import asyncio
import copy
import math
import pickle
from collections import deque
from typing import Any

import orjson
import pytest

from canopy_broker.client import Client, ClientError, ConnectionLost, Gap, Notification, connect
from canopy_broker.client.connection import BrokerConnection
from canopy_broker.client.credentials import Credentials
from canopy_broker.client.failover import HEARD_EVERY, REMEMBERED
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import ClientSubscribe, ClientUnsubscribe
from canopy_broker.runtime.framing import B_NOTIFY, B_PUBACK, C_PUB_GAP, FrameError
from canopy_broker.runtime.inbox import NOTIFY, take_notifications
from canopy_broker.runtime.outbox import msgs_frame
from tests.tools import LoopTurns
from tests.unit.test_runtime_broker import (
    MakeBroker,
    addr,
    collect,
    eventually,
    link,
    make_broker,
)

pytestmark = pytest.mark.looptime  # timeouts and heartbeats on the loop's clock, faked

__all__ = ["make_broker"]


async def test_async_for_over_notifications_raises_connection_lost_when_the_broker_goes(
    make_broker: MakeBroker,
) -> None:
    """A stream the broker ended is not a stream that is over: once the failover gives up
    (nothing else answers), the loop ends with ConnectionLost naming the broker (a client that
    closes itself ends it quietly)."""
    b = await make_broker("b")
    sub = await connect(addr(b), failover_within=0.3)
    await sub.subscribe(Filter.parse("n < 3"))
    async with await connect(addr(b), "p") as pub:
        for n in range(5):
            pub.publish_nowait({"n": n})
        assert pub.last_seq == 5
    seen: list[Notification] = []
    with pytest.raises(ConnectionLost, match=r"broker b at .* no broker took over within 0.3 s"):
        async for note in sub.notifications():
            seen.append(note)
            if len(seen) == 3:
                await b.stop()
    assert [n.id for n in seen] == ["p:1", "p:2", "p:3"]
    assert seen[0].to_json() == {
        "id": "p:1",
        "publisher": "p",
        "seq": 1,
        "hops": 0,
        "attrs": {"n": 0},
        "sub_ids": ["s1"],
    }
    assert "p:1" in repr(seen[0])
    with pytest.raises(ClientError):
        await sub.publish({"n": 1})
    await sub.close()
    await sub.close()  # idempotent


async def test_many_publishes_are_batched_into_few_frames(make_broker: MakeBroker) -> None:
    b = await make_broker("b")
    frames: list[int] = []
    handle = b.client_sessions.messages

    def counting(client: Any, items: list[Any], deadline: float = math.inf) -> list[Any] | None:
        rest = handle(client, items, deadline)  # a long frame may be handled over two turns
        frames.append(len(items) - len(rest or ()))
        return rest

    b.client_sessions.messages = counting  # type: ignore[method-assign]
    async with await connect(addr(b)) as sub, await connect(addr(b), "p") as pub:
        await sub.subscribe([("i", ">=", 0)])
        for i in range(2000):
            pub.publish_nowait({"i": i})
        await pub.flush()
        got = await collect(sub, 2000)
        assert [n.seq for n in got] == list(range(1, 2001))
    assert sum(frames) == 2001  # one subscribe + 2000 publishes...
    assert len(frames) < 20  # ...in a handful of frames (one per loop tick or 256 KiB)


async def test_connect_failures_are_reported() -> None:
    with pytest.raises(OSError):
        await connect("127.0.0.1:9", connect_timeout=2)
    with pytest.raises(ValueError):
        await connect("no-port")


async def test_a_publish_and_flush_loop_lets_the_rest_of_the_process_run(
    make_broker: MakeBroker,
) -> None:
    """flush() gives the loop a turn even when the socket took everything at once: a
    flat-out publisher must not starve its own process (timers, subscribers, the broker's
    acknowledgements); without that turn the benchmark's publisher once grew to 23 GB."""
    b = await make_broker("b")
    async with await connect(addr(b)) as pub, LoopTurns() as turns:
        await asyncio.sleep(0)
        before = turns.count
        for n in range(50):
            pub.publish_nowait({"n": n})
            await pub.flush()
        assert turns.count - before >= 40, (before, turns.count)


async def test_receive_timeout_returns_empty(make_broker: MakeBroker) -> None:
    b = await make_broker("b")
    async with await connect(addr(b)) as c:
        await c.subscribe("true")
        t0 = asyncio.get_running_loop().time()
        assert await c.receive(10, timeout=0.1) == []
        assert asyncio.get_running_loop().time() - t0 >= 0.09


async def test_publications_are_kept_until_the_next_hop_has_them(make_broker: MakeBroker) -> None:
    """A broker acknowledges a publication once every link it may have gone to acknowledged it
    (so it survives this broker's death): not while a neighbour is unreachable."""
    a = await make_broker("a", heartbeat_interval=1.0)  # z is declared dead after 3 s, not 0.6
    z = await make_broker("z", heartbeat_interval=1.0)
    await link(a, z)
    async with await connect(addr(z)) as far, await connect(addr(a), "p") as pub:
        await far.subscribe("n >= 0")
        await eventually(lambda: bool(a.core.routing_table().links.get("z")))
        for n in range(100):
            pub.publish_nowait({"n": n})
        assert pub.unacknowledged == 100
        assert await pub.wait_acknowledged(5.0)
        assert pub.unacknowledged == 0

        a.drop_link_connection("z")  # z is cut off (its link redials: make it wait)
        a.links["z"].address = "127.0.0.1:9"
        for n in range(10):
            pub.publish_nowait({"n": n})
        assert not await pub.wait_acknowledged(0.5)
        assert pub.unacknowledged == 10  # queued for z, not in its custody yet
        a.links["z"].address = addr(z)
        assert await pub.wait_acknowledged(10.0)
        assert [x.seq for x in await collect(far, 110)] == list(range(1, 111))


async def test_what_a_fenced_broker_acknowledged_after_it_left_is_sent_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Acknowledged publications are kept ``keep_acked_for`` seconds. Those that a fenced
    broker acknowledged after it left the overlay (it had declared its neighbours dead: its
    custody went nowhere) go back ahead of the unacknowledged, in order, to be sent again at
    the next broker; what is no longer kept is said to be possibly lost."""
    c = Client("p")
    loop = asyncio.get_running_loop()
    c._unacked.extend((seq, b'{"n":%d}' % seq, loop.time()) for seq in range(1, 9))
    c._acknowledged(2)
    await asyncio.sleep(10)
    left = loop.time()
    await asyncio.sleep(1)
    c._acknowledged(4)  # acknowledged after the broker left
    c._revoke_acks(left, "b")
    assert [seq for seq, _, _ in c._unacked] == [3, 4, 5, 6, 7, 8]
    assert [seq for _, seq, _, _ in c._acked] == [1, 2]
    assert "b acknowledged 2 publication(s) after it left" in caplog.text
    assert "no longer kept" not in caplog.text
    await asyncio.sleep(25)  # 1 and 2 were acknowledged 36 s ago: forgotten at the next ack
    c._acknowledged(6)
    assert [seq for _, seq, _, _ in c._acked] == [3, 4, 5, 6]
    c._revoke_acks(left, "b")  # 1 and 2 were acknowledged before it left: nothing lost
    assert "no longer kept" not in caplog.text
    assert c._pub_gap is None
    c._revoke_acks(left - 20, "b")  # it left before 1 and 2 were acknowledged
    assert "no longer kept" in caplog.text
    # ... which the next broker is told, to tell every subscriber (C_PUB_GAP).
    assert c._pub_gap is not None and c._pub_gap[0] == left - 20
    assert c._pub_gap[1] == pytest.approx(left - 10, abs=0.01)  # when 2 was acknowledged
    assert [seq for seq, _, _ in c._unacked] == [3, 4, 5, 6, 7, 8]
    # Without failover nothing would be sent again: nothing is kept.
    alone = Client("q", failover_within=0)
    alone._unacked.extend((seq, b"{}", 0.0) for seq in (1, 2, 3))
    alone._acknowledged(2)
    assert not alone._acked and [seq for seq, _, _ in alone._unacked] == [3]
    # Sent again at the next broker, with how long ago the oldest was published (seq 3 went
    # back among the unacknowledged with its own publication time).
    assert c._resent_for(left + 100) == pytest.approx(100 + 10)
    assert Client("none")._resent_for(5.0) is None


async def test_a_publisher_gap_is_told_to_every_subscriber_of_the_overlay(
    make_broker: MakeBroker,
) -> None:
    """A publisher that failed over from a fenced broker and no longer kept all it had
    acknowledged says so once at its new broker (C_PUB_GAP); the gap is flooded over the
    tree and every subscriber hears it, on every broker. Again on the same attachment, out
    of range, or from a client that did not fail over, is a protocol error that closes that
    connection only."""
    a, b, c = await make_broker("a"), await make_broker("b"), await make_broker("c")
    await link(a, b)
    await link(b, c)
    told: dict[str, list[Gap]] = {"sa": [], "sc": []}
    async with (
        await connect(addr(a), "sa", on_gap=told["sa"].append) as sa,
        await connect(addr(c), "sc", on_gap=told["sc"].append) as sc,
        await connect(addr(b), "p", failover_within=0) as p,
    ):
        await sa.subscribe("n >= 0")
        await sc.subscribe("n >= 0")
        conn = p._conn
        assert conn is not None
        b.client_sessions.clients["p"].resumed = True  # as after its failover's resume
        conn.send(orjson.dumps([C_PUB_GAP, 12.0, 2.0]))
        await eventually(lambda: bool(told["sa"] and told["sc"]))
        for gap in (*told["sa"], *told["sc"]):
            assert "publisher p" in gap.reason
            assert gap.until - gap.since == pytest.approx(10.0, abs=0.1)
        conn.send(orjson.dumps([C_PUB_GAP, 12.0, 2.0]))  # once per attachment
        await _closed_by_broker(p, "told once, after a failover")
        await asyncio.sleep(0.2)
        assert len(told["sa"]) == len(told["sc"]) == 1
        for bad in (
            [C_PUB_GAP, 2.0, 12.0],
            [C_PUB_GAP, 1e9, 0],
            [C_PUB_GAP, "x", 0],
            [C_PUB_GAP, 0, 0],
        ):
            async with await connect(addr(b), "q", failover_within=0) as q:
                assert q._conn is not None
                q._conn.send(orjson.dumps(bad))
                await _closed_by_broker(q, "publisher gap needs")
        async with await connect(addr(b), "r", failover_within=0) as r:  # never failed over
            assert r._conn is not None
            r._conn.send(orjson.dumps([C_PUB_GAP, 12.0, 2.0]))
            await _closed_by_broker(r, "after a failover")
        assert len(told["sa"]) == 1 and not b.failed


async def _closed_by_broker(client: Client, why: str) -> None:
    """Until ``client`` finds its connection closed by the broker for ``why``."""
    with pytest.raises(ClientError, match=why):
        async with asyncio.timeout(5):
            while True:
                await client.publish({"n": 1})
                await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (None, "broker b at here closed the connection (it stopped or died)"),
        (
            ConnectionResetError(104, "Connection reset by peer"),
            "broker b at here closed the connection (it stopped or died: Connection reset by peer)",
        ),
        (
            OSError(113, "No route to host"),
            "connection to broker b at here lost: [Errno 113] No route to host",
        ),
    ],
)
async def test_a_lost_connection_is_named_by_how_it_ended(
    exc: Exception | None, expected: str
) -> None:
    """A broker killed with bytes of the client's still unread resets the connection (the
    usual case under TLS); the user is told the broker closed it, as for a clean close,
    while other errors keep their own text."""

    class Owner:
        credentials = Credentials()

        def _frame(self, conn: BrokerConnection, frame: list[Any]) -> None:
            raise AssertionError(frame)

        def _lost(self, conn: BrokerConnection) -> None:
            pass

    conn = BrokerConnection(Owner(), "c")  # type: ignore[arg-type]
    conn.broker, conn.address = "b", "here"
    conn.connection_lost(exc)
    assert conn.error is not None and str(conn.error) == expected
    with pytest.raises(ClientError):
        conn.ready.result()


def broker_dies_on(b: Any, request: type, sub_id: str) -> None:
    """``b`` drops the client's connection, unanswered, when ``request`` for ``sub_id``
    arrives: to the client, its broker died between the request and the answer."""
    real = b.core.handle

    def handle(inp: Any, now: float = 0.0) -> list[object]:
        if isinstance(inp, request) and inp.sub_id == sub_id:
            b.core.handle = real  # once
            b.clients[inp.client].conn.transport.abort()
            return []
        return real(inp, now)  # type: ignore[no-any-return]

    b.core.handle = handle


@pytest.mark.parametrize("failover", [True, False])
async def test_a_broker_lost_mid_subscribe_is_failed_over_and_the_subscription_stands(
    make_broker: MakeBroker, failover: bool
) -> None:
    """subscribe() waits for the failover, which subscribes everything at the next broker, this
    request too; without a failover it raises ConnectionLost and keeps nothing."""
    a, b = await make_broker("a"), await make_broker("b")
    await link(a, b)
    sub = await connect([addr(a), addr(b)], "s", failover_within=5.0 if failover else 0)
    await sub.subscribe("n = 1", "first")
    broker_dies_on(a, ClientSubscribe, "late")
    if not failover:
        with pytest.raises(ConnectionLost, match="broker a"):
            await sub.subscribe("n = 2", "late")
        assert set(sub.subscriptions) == {"first"}
        await sub.close()
        return
    assert await sub.subscribe("n = 2", "late") == "late"
    assert sub.broker == "b" and sub.failovers == 1 and set(sub.subscriptions) == {"first", "late"}
    broker_dies_on(b, ClientUnsubscribe, "first")
    async with await connect(addr(b), "p") as pub:
        await pub.publish({"n": 2})
        assert [(n.id, n.sub_ids) for n in await collect(sub, 1)] == [("p:1", ("late",))]
        await asyncio.wait_for(sub.unsubscribe("first"), 5)  # b drops it: back to a, again
        assert sub.broker == "a" and set(sub.subscriptions) == {"late"}
    await sub.close()


@pytest.mark.clock_seq
@pytest.mark.parametrize("counted_from_1", [False, True])
async def test_a_publisher_restarted_under_its_id_reaches_a_subscriber_that_failed_over(
    make_broker: MakeBroker, counted_from_1: bool
) -> None:
    """A subscriber that failed over keeps, from each publisher, only what is newer than the
    last it got (what a resume or a repair's replay brings twice). A publisher process that
    restarts under the same client id starts its sequence from the clock by default, above
    its predecessor's, so its events pass. Counted from 1 again (the old default, kept here as
    the case that must trip), every one of them is dropped, silently (review)."""
    a, b = await make_broker("a"), await make_broker("b")
    await link(a, b)
    sub = await connect([addr(a), addr(b)], "s")
    await sub.subscribe("n >= 0")
    await eventually(lambda: bool(b.core.routing_table().links.get("a")))
    first_seq = 1 if counted_from_1 else None
    async with await connect(addr(b), "p", first_seq=first_seq) as pub:
        for n in range(100):
            pub.publish_nowait({"n": n})
        await pub.flush()
        assert [x.attrs["n"] for x in await collect(sub, 100)] == list(range(100))
    await a.stop()  # the subscriber fails over to b
    await eventually(lambda: sub.failovers == 1)
    async with await connect(addr(b), "p", first_seq=first_seq) as again:  # a new process
        for n in range(100, 150):
            again.publish_nowait({"n": n})
        await again.flush()
        if counted_from_1:
            got = await sub.receive(50, timeout=2.0)

            assert got == []
        else:
            assert [x.attrs["n"] for x in await collect(sub, 50)] == list(range(100, 150))
            assert sub.duplicates_dropped == 0
    await sub.close()


async def test_subscribe_many_is_one_round_trip_and_checks_everything_first(
    make_broker: MakeBroker,
) -> None:
    """All requests leave in one write and are acknowledged together; a bad filter or a taken
    id refuses the whole call before anything is sent."""
    a = await make_broker("a")
    sub = await connect(addr(a), "s")
    writes: list[bytes] = []
    conn = sub._conn
    assert conn is not None
    real_write = conn.write
    conn.write = lambda data: (writes.append(data), real_write(data))[1]  # type: ignore[method-assign]
    ids = await sub.subscribe_many([(f"k{i}", f"k = {i}") for i in range(500)] + [(None, "x > 1")])
    assert ids[:500] == [f"k{i}" for i in range(500)] and ids[500] not in ids[:500]
    assert len(writes) == 1, "500 subscriptions in one write, not one round trip each"
    assert a.core.routing_table_size() == 501 and len(sub.subscriptions) == 501
    for bad in ([("new", "k = 1"), ("k3", "k = 3")], [("new", "k = 1"), ("other", "k <> ")]):
        with pytest.raises(ValueError):
            await sub.subscribe_many(bad)
    assert "new" not in sub.subscriptions and a.core.routing_table_size() == 501
    assert await sub.subscribe_many([]) == []
    async with await connect(addr(a), "p") as pub:
        await pub.publish({"k": 7})
        assert [n.sub_ids for n in await collect(sub, 1)] == [("k7",)]
    await sub.close()


async def test_subscribe_many_refused_midway_forgets_what_was_not_acknowledged(
    make_broker: MakeBroker,
) -> None:
    """The broker's per-client limit refuses the third of five and closes the connection: the
    call raises and the client keeps no subscription the broker did not acknowledge (the
    refused one and those after it; the broker's acknowledgements of the first two may or may
    not have left before it closed)."""
    a = await make_broker("a", max_subscriptions=2)
    sub = await connect(addr(a), "s", failover_within=0)
    with pytest.raises(ClientError, match="limit"):
        await sub.subscribe_many([(f"k{i}", f"k = {i}") for i in range(5)])
    assert set(sub.subscriptions) <= {"k0", "k1"}
    await sub.close()


async def test_on_notifications_gets_every_batch_in_order_and_receive_waits_for_the_end(
    make_broker: MakeBroker,
) -> None:
    """With a callback the notifications go to it, in batches, in order, and never to
    receive(), which then only ends with the stream: here with the lost broker's error."""
    b = await make_broker("b")
    batches: list[list[Notification]] = []
    sub = await connect(addr(b), failover_within=0.3, on_notifications=batches.append)
    await sub.subscribe("n >= 0")
    end = asyncio.create_task(sub.receive())
    async with await connect(addr(b), "p") as pub:
        for n in range(300):
            pub.publish_nowait({"n": n})
            if n % 100 == 99:
                await pub.flush()
        await eventually(lambda: sum(map(len, batches)) == 300)
    assert [x.attrs["n"] for batch in batches for x in batch] == list(range(300))
    assert len(batches) > 1 and all(batches)  # one call per arrival, never an empty one
    assert not sub._inbox and not end.done()
    await b.stop()
    with pytest.raises(ConnectionLost):
        await end
    await sub.close()


class _NotAnError(BaseException):
    """What a callback might raise that is not an Exception (e.g. a CancelledError)."""


@pytest.mark.parametrize("error", [RuntimeError, _NotAnError])
async def test_an_exception_in_on_notifications_is_reported_and_the_connection_stays(
    make_broker: MakeBroker, error: type[BaseException]
) -> None:
    """The callback's bug goes to the loop's exception handler, not the connection (even
    when it is no Exception): the notifications after it still arrive, the client did not
    fail over, and it can still publish."""
    b = await make_broker("b")
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    got: list[int] = []

    def callback(batch: list[Notification]) -> None:
        got.extend(int(x.attrs["n"]) for x in batch)
        if got[0] == 0 and len(reported) == 0:
            raise error("application bug")

    try:
        async with await connect(addr(b), "s", on_notifications=callback) as sub:
            await sub.subscribe("n >= 0")
            async with await connect(addr(b), "p") as pub:
                await pub.publish({"n": 0})
                await eventually(lambda: len(reported) == 1)
                await pub.publish({"n": 1})
                await eventually(lambda: got == [0, 1])
            await sub.publish({"n": 2})  # still connected
            await eventually(lambda: got == [0, 1, 2])
            assert sub.failovers == 0
    finally:
        loop.set_exception_handler(None)
    assert isinstance(reported[0]["exception"], error)
    assert "on_notifications of client 's' failed" in reported[0]["message"]


async def test_a_callback_set_later_takes_what_waits_even_when_reading_had_stopped(
    make_broker: MakeBroker,
) -> None:
    """Notifications that filled the inbox (reading paused) before the application set its
    callback are handed over at once, and reading resumes."""
    b = await make_broker("b")
    async with await connect(addr(b), "s") as sub, await connect(addr(b), "p") as pub:
        sub.max_buffered = 50
        await sub.subscribe("n >= 0")
        for n in range(200):
            pub.publish_nowait({"n": n})
        await pub.flush()
        await eventually(lambda: sub._reading_paused)
        got: list[int] = []
        sub.on_notifications = lambda batch: got.extend(int(x.attrs["n"]) for x in batch)
        assert got and not sub._inbox  # at once, not at the next frame
        for n in range(200, 210):
            pub.publish_nowait({"n": n})
        await pub.flush()
        await eventually(lambda: len(got) == 210)
        assert got == list(range(210)) and not sub._reading_paused


async def test_an_async_callback_is_refused_and_a_returned_coroutine_reported(
    make_broker: MakeBroker,
) -> None:
    """A coroutine function would lose every notification (nothing awaits what it returns):
    refused when given. A plain function that returns a coroutine all the same is reported,
    and the coroutine closed (no 'never awaited' warning)."""
    b = await make_broker("b")

    async def coroutine_function(batch: list[Notification]) -> None:
        pass

    with pytest.raises(TypeError, match="plain function"):
        await connect(addr(b), "s", on_notifications=coroutine_function)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:

        def looks_plain(batch: list[Notification]) -> Any:  # what a user may write
            return coroutine_function(batch)

        async with await connect(addr(b), "s", on_notifications=looks_plain) as sub:
            await sub.subscribe("n >= 0")
            await sub.publish({"n": 1})
            await eventually(lambda: bool(reported))
    finally:
        loop.set_exception_handler(None)
    assert "returned a coroutine" in str(reported[0]["exception"])


# --------------------------------------------------------------------------- reading notifications


def _note(publisher: str, seq: int) -> list[Any]:
    return [B_NOTIFY, publisher, seq, 1, {"n": seq}, ["s1", "s2"]]


def test_take_notifications_reads_a_run_up_to_the_next_other_message_and_drops_duplicates() -> None:
    """The client's compiled reading loop: notifications from ``start`` up to the first other
    message go into the inbox in order, ``last`` follows each publisher's seq, and with
    ``only_newer`` (after a move) a seq already delivered is dropped and counted."""
    assert NOTIFY == B_NOTIFY  # the compiled module's copy of the wire code
    items = [_note("p", 1), _note("q", 5), _note("p", 2), [B_PUBACK, 3], _note("p", 3)]
    inbox: deque[Notification] = deque()
    last: dict[str, int] = {}
    assert take_notifications(items, 0, inbox, last, False) == (3, 0)
    assert [(n.publisher, n.seq, n.hops, n.attrs, n.sub_ids) for n in inbox] == [
        ("p", 1, 1, {"n": 1}, ("s1", "s2")),
        ("q", 5, 1, {"n": 5}, ("s1", "s2")),
        ("p", 2, 1, {"n": 2}, ("s1", "s2")),
    ]
    assert last == {"p": 2, "q": 5}
    assert take_notifications(items, 4, inbox, last, False) == (5, 0)  # from index 4 on
    assert take_notifications(items, 3, inbox, last, False) == (3, 0)  # not a notification
    again = [_note("p", 2), _note("p", 4), _note("q", 5), _note("q", 6)]
    inbox.clear()
    assert take_notifications(again, 0, inbox, last, True) == (4, 2)
    assert [n.id for n in inbox] == ["p:4", "q:6"] and last == {"p": 4, "q": 6}
    inbox.clear()
    assert take_notifications(again, 0, inbox, last, False) == (4, 0)  # no move: all of them
    assert [n.id for n in inbox] == ["p:2", "p:4", "q:5", "q:6"]


@pytest.mark.parametrize(
    "bad",
    [
        [B_NOTIFY, "p", 1, 1, {}],  # a field short
        [B_NOTIFY, 7, 1, 1, {}, []],  # publisher not a string
        [B_NOTIFY, "p", "1", 1, {}, []],  # seq not an int
        [B_NOTIFY, "p", 1.0, 1, {}, []],
        [B_NOTIFY, "p", 1, None, {}, []],  # hops
        [B_NOTIFY, "p", 1, 1, [], []],  # attributes not an object
        [B_NOTIFY, "p", 1, 1, {}, "s1"],  # sub ids not an array
    ],
)
def test_a_malformed_notification_is_refused_by_name(bad: list[Any]) -> None:
    inbox: deque[Notification] = deque()
    with pytest.raises(ValueError, match="notification"):
        take_notifications([_note("p", 1), bad], 0, inbox, {}, False)
    assert [n.id for n in inbox] == ["p:1"]  # what came before it was read


async def test_a_malformed_notification_costs_the_connection_not_the_client(
    make_broker: MakeBroker,
) -> None:
    """A frame from the broker with a malformed notification closes that connection with a
    message naming it (the client's failover takes over), like any other malformed frame."""
    b = await make_broker("b")
    async with await connect(addr(b), "s") as sub:
        conn = sub._conn
        assert conn is not None
        conn.data_received(msgs_frame([orjson.dumps([B_NOTIFY, "p", "one", 0, {}, ["x"]])]))
        assert conn.is_closing()


def test_a_notification_pickles_copies_and_takes_its_sub_ids_as_any_sequence() -> None:
    """What users did with the interpreted class (tests/unit/test_native checks both builds
    alike): pickling, copying, building one with a list of subscription ids."""
    n = Notification("p", 3, 1, {"a": [1, 2]}, ["s1", "s2"])
    assert n.sub_ids == ("s1", "s2") and n.id == "p:3"
    for other in (pickle.loads(pickle.dumps(n)), copy.copy(n), copy.deepcopy(n)):
        assert other is not n
        assert (other.publisher, other.seq, other.hops, other.attrs, other.sub_ids) == (
            "p",
            3,
            1,
            {"a": [1, 2]},
            ("s1", "s2"),
        )
    with pytest.raises(AttributeError):
        n.extra = 1  # type: ignore[attr-defined]


async def test_dedup_set_to_any_truthy_value_still_reads_after_a_move(
    make_broker: MakeBroker,
) -> None:
    """``Client.dedup`` is documented as a switch; the compiled reading loop takes a bool, so
    the client passes one whatever the application set (an int raised TypeError there)."""
    b = await make_broker("b")
    async with await connect(addr(b), "s") as sub:
        conn = sub._conn
        assert conn is not None
        sub._migrated = True  # as after a move: duplicates are dropped from here on
        for dedup in (1, 0, None):
            sub.dedup = dedup  # type: ignore[assignment]
            seq = 10 + (dedup or 0) if dedup is not None else 20
            conn.data_received(msgs_frame([orjson.dumps([B_NOTIFY, "p", seq, 0, {}, ["x"]])]))
            assert not conn.is_closing(), dedup
        got = await sub.receive(10, timeout=1)
        assert [n.seq for n in got] == [11, 10, 20]


async def test_a_gap_from_the_broker_is_checked_and_made_printable() -> None:
    """What a broker says about a gap reaches the application and the log: seconds ago in
    order (until not before since), within reason, and printable text of bounded length."""
    c = Client("s")
    conn = BrokerConnection(c, "here")
    conn.broker = "b"
    c._told_gap(conn, 12.5, 2.5, "split\x1b[31m\nred" + "x" * 1000)
    (gap,) = c.gaps
    assert gap.until - gap.since == pytest.approx(10.0)
    assert gap.reason.startswith("split?[31m?red") and len(gap.reason) == 500
    for since, until in ((2.0, 12.0), (True, 0), (1e26, 0), (float("nan"), 0), ("1", 0)):
        with pytest.raises(FrameError):
            c._told_gap(conn, since, until, "x")
    assert len(c.gaps) == 1


@pytest.mark.looptime
async def test_a_failover_gap_starts_when_a_recently_active_publisher_was_last_heard() -> None:
    """p was heard until 2 s before the loss (its notifications were held upstream while
    repairs ran), q until the loss; r last spoke 20 s before (longer ago than anything stays
    in flight). The gaps the next broker tells start from the hearing before p's last (that
    one, after a second's silence, may have been held up itself), less the look's precision:
    what p published after its last notification may have been on its way to the lost
    broker. They started at the loss, and such notifications were covered by no gap (chaos
    soak)."""
    c = Client("s")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    c._last_seq["r"] = 1
    c._note_heard(loop.time())
    await asyncio.sleep(20.0)
    c._last_seq["p"] = c._last_seq["q"] = 1
    c._note_heard(loop.time())
    await asyncio.sleep(1.0)
    c._last_seq["p"] = 2  # p's last, at t0 + 21
    c._note_heard(loop.time())
    for n in range(3, 11):  # q on, every quarter second, until the loss
        await asyncio.sleep(0.25)
        c._last_seq["q"] = n
        c._note_heard(loop.time())
    lost_at = loop.time()  # t0 + 23
    assert c._gap_from(lost_at) == pytest.approx(t0 + 20 - HEARD_EVERY)
    assert Client("fresh")._gap_from(lost_at) == lost_at  # nothing heard: from the loss
    # Heard just before a quiet stretch, with no frame after it to prompt a look: dated by
    # its frame's arrival, not by the look the failover makes 6 s later.
    quiet = Client("quiet")
    quiet._note_heard(loop.time())
    quiet._last_seq["p"] = 5
    quiet._last_frame_at = loop.time()  # the frame that brought p's 5
    heard = loop.time()
    await asyncio.sleep(6.0)
    assert quiet._gap_from(loop.time()) == pytest.approx(heard - HEARD_EVERY)
    c._last_seq.clear()
    c._note_heard(loop.time() + 1)
    assert c._heard_at == {} and c._heard_seq == {}  # forgotten with the publishers


def test_a_failover_gap_covers_what_was_published_after_a_held_up_notification() -> None:
    """p is heard every quarter second until t = 10; its next notifications were held up on
    the way (a paused broker) and arrive in a burst at 11.5, published at 10-10.1; its
    broker dies at 12 with what p published after them. The gap starts at p's hearing
    before the burst (10), not at the burst's arrival (11.5): what was published from 10.1
    on and lost fell before the gap (chaos soak: 9 + 21 events lost untold)."""
    c = Client("s")
    t, n = 8.0, 0
    while t <= 10.0:
        n += 1
        c._last_seq["p"] = n
        c._note_heard(t)
        t += HEARD_EVERY
    c._last_seq["p"] = n + 5  # the burst
    c._note_heard(11.5)
    assert c._gap_from(12.0) == pytest.approx(10.0 - HEARD_EVERY)


def test_a_subscriber_forgets_the_publishers_heard_longest_ago_past_a_bound() -> None:
    """A subscriber that outlives many short-lived publishers keeps an entry for the
    REMEMBERED heard most recently: one per publisher ever heard grew without bound, was sent
    whole at each resume and looked through every quarter second. Below the bound nothing is
    forgotten, however long ago (a forgotten publisher counts as never heard at a resume)."""
    c = Client("s")
    c._last_seq["quiet"] = 7
    c._note_heard(0.0)
    for n in range(REMEMBERED - 1):
        c._last_seq[f"p{n}"] = 1
    c._note_heard(3600.0)  # an hour later: at the bound, all kept
    assert len(c._last_seq) == REMEMBERED and c._last_seq["quiet"] == 7
    c._last_seq["one-more"] = 1
    c._note_heard(3601.0)
    assert len(c._last_seq) == len(c._heard_at) == len(c._heard_seq) == REMEMBERED * 9 // 10
    assert "quiet" not in c._last_seq and c._last_seq["one-more"] == 1
