"""The admin HTTP API, served by aiohttp's test server and driven through :class:`AdminClient`."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from canopy_broker.admin_client import AdminClient, AdminError
from canopy_broker.client import Gap, connect
from canopy_broker.core.messages import FromLink, Lock
from canopy_broker.runtime.admin import ROUTES, make_admin_app
from canopy_broker.runtime.client_sessions import merged, untold
from canopy_broker.runtime.config import BrokerConfig
from canopy_broker.runtime.server import Broker
from tests.strategies import json_values
from tests.unit.test_runtime_broker import (
    MakeBroker,
    addr,
    eventually,
    link,
    make_broker,
    record_wakes,
    settled,
    wakes_from_rest,
)

__all__ = ["make_broker"]  # the fixture, re-exported for pytest

TOKEN = "s3cret-token"
Serve = Callable[[Broker], Awaitable[AdminClient]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[TestServer] = []
    clients: list[AdminClient] = []

    async def start(broker: Broker, token: str | None = TOKEN) -> AdminClient:
        server = TestServer(make_admin_app(broker, token))
        await server.start_server()
        servers.append(server)
        client = AdminClient(str(server.make_url("")), token)
        clients.append(client)
        return client

    yield start
    for c in clients:
        await c.close()
    for s in servers:
        await s.close()


async def test_a_request_wakes_a_resting_broker(make_broker: MakeBroker, serve: Serve) -> None:
    """A request is work on the broker's loop: its stalls are measured at the fine tick."""
    b = await make_broker("b")
    admin = await serve(b)
    woken = record_wakes(b)
    await wakes_from_rest(b, woken, admin.status)
    await wakes_from_rest(b, woken, admin.healthz)  # before the token check too


async def test_token_is_required_except_for_probes_and_metrics(
    make_broker: MakeBroker, serve: Serve
) -> None:
    b = await make_broker("b")
    good = await serve(b)
    async with aiohttp.ClientSession() as http:
        for path in ("/status", "/routing", "/telemetry"):
            async with http.get(good.url + path) as resp:
                assert resp.status == 401
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            for wrong in ("Bearer wrong", f"Basic {TOKEN}", TOKEN, f"Bearer{TOKEN}"):
                async with http.get(good.url + path, headers={"Authorization": wrong}) as resp:
                    assert resp.status == 401, wrong
            # The scheme's name is case-insensitive (RFC 9110): curl users write "bearer".
            for scheme in ("bearer", "BEARER"):
                headers = {"Authorization": f"{scheme} {TOKEN}"}
                async with http.get(good.url + path, headers=headers) as resp:
                    assert resp.status == 200, scheme
        for path in ("/healthz", "/readyz", "/metrics"):
            async with http.get(good.url + path) as resp:
                assert resp.status == 200
    assert (await good.status())["name"] == "b"
    async with AdminClient(good.url, "wrong") as bad:
        with pytest.raises(AdminError) as info:
            await bad.routing()
        assert info.value.status == 401


async def test_status_routing_and_metrics(make_broker: MakeBroker, serve: Serve) -> None:
    b = await make_broker("b")
    admin = await serve(b)
    async with await connect(addr(b), "c1") as c:
        await c.subscribe('kind = "x"', sub_id="one")
        st = await admin.status()
        assert st["name"] == "b" and st["routing"] == "covering" and st["clients"] == 1
        assert st["neighbours"] == [] and st["ready"] and st["uptime_s"] >= 0
        assert st["queue_depths"] == {
            "links": {},
            "clients_total": 0,
            "clients_bytes": 0,
            "clients_max": 0,
        }
        routing = await admin.routing()
        assert routing["table"]["clients"] == {"c1": {"one": 'kind = "x"'}}
        assert routing["size"] == 1
        await c.publish({"kind": "x"})
        await c.receive(1)
    text = await admin.metrics()
    for name in (
        "canopy_link_messages_total",
        "canopy_matching_seconds_bucket",
        "canopy_routing_table_entries 0.0",
        "canopy_clients 0.0",
        "canopy_events_published_total 1.0",
        "canopy_notifications_delivered_total 1.0",
        "canopy_slow_consumer_disconnects_total 0.0",
        "canopy_client_queue_depth_max",
        "canopy_publishers_paused 0.0",
    ):
        assert name in text, name
    assert await admin.healthz() and await admin.readyz()


async def test_links_are_added_idempotently_and_removed_on_both_ends(
    make_broker: MakeBroker, serve: Serve
) -> None:
    a = await make_broker("a")
    z = await make_broker("z")
    admin_a, admin_z = await serve(a), await serve(z)
    first = await admin_a.add_link("z", addr(z))
    assert first["created"] and first["up"] and first["link"]["state"] == "up"
    again = await admin_a.add_link("z", addr(z))
    assert not again["created"] and again["up"]
    await settled(a, z)
    [nz] = (await admin_z.status())["neighbours"]
    assert nz["peer"] == "a" and nz["state"] == "up" and not nz["dialer"]
    metrics = await admin_a.metrics()
    assert 'canopy_link_up{peer="z"} 1.0' in metrics
    assert 'canopy_link_bytes_total{direction="out",peer="z"}' in metrics
    assert await admin_a.drop_link_connection("z")
    await eventually(lambda: a.links["z"].connects == 2 and a.links["z"].conn is not None)
    assert await admin_a.remove_link("z")
    await eventually(lambda: not z.links)
    assert not await admin_a.remove_link("z")
    assert not await admin_a.drop_link_connection("z")
    assert (await admin_z.routing())["table"]["links"] == {}


@pytest.mark.parametrize(
    "body",
    [
        {"peer": "x"},
        {"address": "1.2.3.4:5"},
        {"peer": "x", "address": "nope"},
        {"peer": "x", "address": "h:1", "timeout": -1},
        ["not", "an", "object"],
    ],
)
async def test_bad_link_requests_are_400(
    make_broker: MakeBroker, serve: Serve, body: object
) -> None:
    admin = await serve(await make_broker("a"))
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with http.post(admin.url + "/links", json=body, headers=headers) as resp:
            assert resp.status == 400
        async with http.post(admin.url + "/links", data=b"{", headers=headers) as resp:
            assert resp.status == 400


async def test_link_to_self_and_unreachable_peer(make_broker: MakeBroker, serve: Serve) -> None:
    a = await make_broker("a")
    admin = await serve(a)
    with pytest.raises(AdminError) as info:
        await admin.add_link("a", addr(a))
    assert info.value.status == 400
    result = await admin.add_link("ghost", "127.0.0.1:9", wait=0.2)
    assert not result["up"] and result["link"]["state"] == "connecting"
    assert await admin.remove_link("ghost")


async def test_telemetry_pull_with_cursor(make_broker: MakeBroker, serve: Serve) -> None:
    b = await make_broker("b", telemetry_sample=1.0)
    admin = await serve(b)
    async with await connect(addr(b), "p") as p:
        for i in range(5):
            await p.publish({"i": i})
        await p.flush()
        await eventually(lambda: len(b.telemetry.since(0)["records"]) == 5)
    page = await admin.telemetry(since=0, limit=3)
    assert page["schema"] == "canopy.telemetry/v1" and page["broker"] == "b"
    assert [r["event_id"] for r in page["records"]] == ["p:1", "p:2", "p:3"]
    rest = await admin.telemetry(since=page["next"])
    assert [r["event_id"] for r in rest["records"]] == ["p:4", "p:5"]
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with http.get(admin.url + "/telemetry?since=x", headers=headers) as resp:
            assert resp.status == 400


async def test_no_token_means_no_auth(make_broker: MakeBroker, serve: Serve) -> None:
    b = await make_broker("b")
    server = TestServer(make_admin_app(b, None))
    await server.start_server()
    try:
        async with AdminClient(str(server.make_url(""))) as open_admin:
            assert (await open_admin.status())["name"] == "b"
    finally:
        await server.close()


async def test_address_book_and_exchanges(make_broker: MakeBroker, serve: Serve) -> None:
    a, b, c = [await make_broker(n) for n in "abc"]
    admin = await serve(a)
    book = await admin.set_peers({"b": addr(b), "c": addr(c)})
    assert book == {"b": addr(b), "c": addr(c)} == await admin.peers()
    for broker in (b, c):
        broker.set_peers({"a": addr(a), "b": addr(b), "c": addr(c)})
    await link(a, b)
    await link(b, c)
    done = await admin.start_exchange(["a", "b", "c"], ("b", "c"), xid="ex1", wait=20, lease=5)
    assert (done["state"], done["ok"], done["xid"], done["lease"]) == ("finished", True, "ex1", 5)
    assert (await admin.exchange("ex1"))["state"] == "finished"
    assert 'canopy_exchanges_total{result="finished"} 1.0' in await admin.metrics()
    again = await admin.start_exchange(["a", "b", "c"], ("b", "c"), xid="ex1")
    assert again["state"] == "finished"  # idempotent per xid
    await eventually(lambda: sorted(a.links) == ["b", "c"] and "c" not in b.links)
    with pytest.raises(AdminError) as info:
        await admin.exchange("nope")
    assert info.value.status == 404
    for bad in (
        {"path": ["a", "c"], "remove": ["a", "b"]},  # not a tree path
        {"path": "a,b", "remove": ["a", "b"]},
        {"path": ["a", "b", "c"], "remove": ["b"]},
        {"path": ["a", "b", "c"], "remove": ["b", "c"], "ordering": "chaotic"},
        {"path": ["a", "b", "c"], "remove": ["b", "c"], "wait": -1},
        {"path": ["a", "b", "c"], "remove": ["b", "c"], "lease": 0},
        {"path": ["a", "b", "c"], "remove": ["b", "c"], "lease": True},
        {"path": ["a", "b", "c"], "remove": ["b", "c"], "lease": "30"},
    ):
        with pytest.raises(AdminError) as info:
            await admin._request("POST", "/exchanges", json=bad)
        assert info.value.status == 400, bad
    with pytest.raises(AdminError):
        await admin.set_peers({"x": "no-port"})


async def test_drain_sends_clients_to_the_neighbour(make_broker: MakeBroker, serve: Serve) -> None:
    leaf, hub = await make_broker("leaf"), await make_broker("hub")
    await link(leaf, hub)
    admin = await serve(leaf)
    assert (await admin.drain_status())["draining"] is False
    for bad in ({"target": "other"}, {"target": ""}, {"target": "hub", "wait": "soon"}):
        with pytest.raises(AdminError) as info:
            await admin._request("POST", "/drain", json=bad)
        assert info.value.status == 400, bad
    async with await connect(addr(leaf), "mover") as mover:
        await mover.subscribe("n > 1")
        done = await admin.drain("hub", wait=10)  # the address comes from the address book
        assert done == {
            "draining": True,
            "target": "hub",
            "address": addr(hub),
            "clients": 0,
            "withdrawing": 0,
            "unacknowledged": 0,
            "drained": True,
        }
        assert mover.broker == "hub" and "mover" in hub.core.clients
        assert (await admin.status())["drain"]["drained"]
        assert (await admin.cancel_drain())["draining"] is False


async def test_fences_are_lifted_only_for_the_process_named(
    make_broker: MakeBroker, serve: Serve
) -> None:
    """A healed partition's join lifts fences on live processes: the fence of another
    incarnation of the same broker (a restarted one, or a stale one) stays."""
    b = await make_broker("b")
    admin = await serve(b)
    b.sessions.fenced.update({"x": "inc-x", "y": "inc-y"})
    b.sessions.fenced_since.update({"x": 100.0, "y": 200.0})
    assert (await admin.status())["fenced_since"] == {"x": 100.0, "y": 200.0}
    assert await admin.lift_fences({"x": "inc-x", "y": "another", "z": "inc-z"}) == ["x"]
    assert b.sessions.fenced == {"y": "inc-y"} and b.sessions.fenced_since == {"y": 200.0}
    # Since when stays known until a gap told covers it (a retried join must still tell).
    assert (await admin.status())["lifted_since"] == {"x": 100.0}
    now = time.time()
    await admin.tell_gap(now - 5, now, "the overlay was split", covers=["y"])
    assert b.sessions.lifted_since == {"x": 100.0}
    await admin.tell_gap(now - 5, now, "the overlay was split", covers=["x", "y"])
    assert b.sessions.lifted_since == {}
    with pytest.raises(AdminError) as info:
        await admin._request(
            "POST", "/gaps", json={"since": 1, "until": 2, "reason": "x", "covers": "x"}
        )
    assert info.value.status == 400
    assert await admin.lift_fences({"x": "inc-x"}) == []  # idempotent
    for bad in ({}, {"incarnations": ["x"]}, {"incarnations": {"x": 1}}):
        with pytest.raises(AdminError) as info:
            await admin._request("POST", "/fences/lift", json=bad)
        assert info.value.status == 400, bad
    b.fenced_by = "a"  # it left the overlay: nothing of it is to be taken back
    with pytest.raises(AdminError) as info:
        await admin.lift_fences({"y": "inc-y"})
    assert info.value.status == 400 and "restart it" in str(info.value)
    assert b.sessions.fenced == {"y": "inc-y"}


async def test_a_gap_is_told_to_the_subscribers_staying_on_the_broker(
    make_broker: MakeBroker, serve: Serve
) -> None:
    b = await make_broker("b")
    admin = await serve(b)
    told: list[Gap] = []
    async with (
        await connect(addr(b), "sub", on_gap=told.append) as sub,
        await connect(addr(b), "pub") as pub,
    ):
        await sub.subscribe("n > 1")
        await pub.publish({"n": 0})  # attached, publishing, no subscription: not told
        now = time.time()
        assert await admin.tell_gap(now - 12.0, now - 2.0, "the overlay was split") == 1
        await eventually(lambda: bool(told))
        (gap,) = told
        assert gap.broker == gap.previous == "b" and gap.reason == "the overlay was split"
        assert gap.until - gap.since == pytest.approx(10.0, abs=0.05)
        assert asyncio.get_running_loop().time() - gap.until == pytest.approx(2.0, abs=0.5)
        assert "b says notifications of 10.0 s may be missing" in str(gap)
        assert sub.gaps == [gap] and pub.gaps == []
        for bad in (
            {"since": now, "until": now - 1, "reason": "x"},  # backwards
            {"since": now, "until": now + 3600, "reason": "x"},  # in the future
            {"since": "then", "until": now, "reason": "x"},
            {"since": True, "until": now, "reason": "x"},
            {"since": 10**400, "until": now, "reason": "x"},  # too large for a float: was a 500
            {"since": -1.7e308, "until": now, "reason": "x"},  # before the last day
            {"since": now - 1, "until": now, "reason": ""},
            {"since": now - 1, "until": now},
        ):
            with pytest.raises(AdminError) as info:
                await admin._request("POST", "/gaps", json=bad)
            assert info.value.status == 400, bad
        assert len(told) == 1
        # Told once: a later gap over the same stretch (a retried join, a third part's join)
        # tells only what the first did not cover, before it and after it; one wholly told
        # already, nothing.
        assert await admin.tell_gap(now - 14.0, now - 1.0, "again") == 1
        await eventually(lambda: len(told) == 3)
        before, after = sorted(told[1:], key=lambda g: g.since)
        assert before.until - before.since == pytest.approx(2.0, abs=0.05)
        assert after.until - after.since == pytest.approx(1.0, abs=0.05)
        assert before.until == pytest.approx(told[0].since, abs=0.05)
        assert after.since == pytest.approx(told[0].until, abs=0.05)
        assert await admin.tell_gap(now - 8.0, now - 3.0, "inside") == 0
        await asyncio.sleep(0.2)
        assert len(told) == 3 and len(sub.gaps) == 3
        # Per subscriber: one that attached since (failing over, reconnecting) was told
        # nothing yet, and hears the whole stretch.
        late_told: list[Gap] = []
        async with await connect(addr(b), "late", on_gap=late_told.append) as late:
            await late.subscribe("n > 1")
            assert await admin.tell_gap(now - 14.0, now - 1.0, "again") == 1
            await eventually(lambda: bool(late_told))
            assert late_told[0].until - late_told[0].since == pytest.approx(13.0, abs=0.05)
            await asyncio.sleep(0.2)
            assert len(told) == 3 and len(late_told) == 1


_POSTS = [path for method, path, _ in ROUTES if method == "POST"]


@given(
    path=st.sampled_from(_POSTS),
    body=json_values,
    raw=st.one_of(st.none(), st.binary(max_size=40)),
)
@settings(max_examples=120)
def test_any_admin_request_body_is_answered_without_a_server_error(
    path: str, body: object, raw: bytes | None
) -> None:
    """Fuzz: whatever JSON (or bytes) is posted to any admin endpoint, the answer is a 2xx or
    a 4xx naming the problem, never a 500, and the broker keeps serving."""

    async def post() -> None:
        broker = Broker(BrokerConfig(name="b"))
        await broker.start()
        server = TestServer(make_admin_app(broker, TOKEN))
        await server.start_server()
        try:
            url = str(server.make_url(path.replace("{peer}", "x")))
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with aiohttp.ClientSession() as http:
                data = raw if raw is not None else json.dumps(body).encode()
                async with http.post(url, data=data, headers=headers) as resp:
                    assert resp.status < 500, (path, body, await resp.text())
                    if resp.status >= 400:
                        assert (await resp.json()).get("error")
                async with http.get(str(server.make_url("/readyz"))) as resp:
                    assert resp.status == 200
        finally:
            await server.close()
            await broker.stop(flush_timeout=0.1)

    asyncio.run(post())


@given(
    told=st.lists(st.tuples(st.integers(0, 100), st.integers(1, 20)), max_size=6),
    since=st.integers(0, 120),
    length=st.integers(0, 40),
)
def test_a_gap_tells_exactly_what_was_not_told_before(
    told: list[tuple[int, int]], since: int, length: int
) -> None:
    """The stretches a broker tells: together with what it told before they cover the new
    gap, and none of them overlaps what it told before, nor another."""
    stretches: list[tuple[float, float]] = []
    for a, n in told:
        stretches = merged(stretches, float(a), float(a + n))
    until = since + length
    parts = untold(stretches, float(since), float(until))
    covered = set()
    for a, b in [*stretches, *parts]:
        covered |= {x + 0.5 for x in range(int(a), int(b))}
    assert {x + 0.5 for x in range(since, until)} <= covered
    for a, b in parts:
        assert since <= a < b <= until
        assert all(b <= c or a >= d for c, d in stretches)
    assert all(b <= c for (_, b), (c, _) in itertools.pairwise(parts))


async def test_removing_a_link_on_a_running_exchanges_cycle_is_409(
    make_broker: MakeBroker, serve: Serve
) -> None:
    """The core refuses (the link is on the cycle of an exchange this broker is locked in)
    and nothing changes: the caller gets 409 and the reason, not a server error."""
    a, z, q = await make_broker("a"), await make_broker("z"), await make_broker("q")
    admin_a = await serve(a)
    assert (await admin_a.add_link("z", addr(z)))["up"]
    assert (await admin_a.add_link("q", addr(q)))["up"]
    a.core.handle(FromLink("z", Lock("x1", ("z", "a", "q"), 1)), a.now())  # locks a
    assert a.core.exchange is not None
    with pytest.raises(AdminError) as refused:
        await admin_a.remove_link("z")
    assert refused.value.status == 409, refused.value
    assert "on the cycle of exchange x1" in str(refused.value)
    assert "z" in a.links


async def test_a_broker_reports_failed_only_when_it_says_so(
    make_broker: MakeBroker, serve: Serve
) -> None:
    """What the local backend kills and starts anew: a broker whose /healthz answers 500. A
    broker that does not answer (paused, busy, gone) is not reported failed: restarting it
    would lose what it holds and mend nothing."""
    b = await make_broker("b")
    admin = await serve(b)
    assert not await admin.reports_failed()
    b.fail("a test")
    assert await admin.reports_failed()
    nobody = AdminClient("127.0.0.1:1", TOKEN)
    try:
        assert not await nobody.reports_failed()
    finally:
        await nobody.close()
