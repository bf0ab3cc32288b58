"""Crash repair on real processes (paper 001): an inner broker is SIGKILLed under traffic, its
neighbours link into a chain, routing converges to the canonical tables of the new tree, and
every event published after the repair reaches every subscriber not attached to the dead broker,
once and in order. A paused broker that comes back is fenced: it cannot resume its old links.

Nothing is lost for the subscribers not on the dead broker, not even what was published between
the kill and the repair: each broker keeps what it forwarded lately (custody) and replays it
over the new links; the negative control turns repair off and must starve the far side.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from canopy_broker.client import Client, ClientError, ConnectionLost, connect
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import RoutingMode
from canopy_broker.procs import BrokerProc, spawn_broker, wait_settled
from canopy_broker.sim.checker import canonical_tables
from tests.integration.crash_overlay import (
    EDGES,
    FILTER,
    HEARTBEAT,
    SUBSCRIBERS,
    Publisher,
    assert_all_delivered,
    assert_streams,
    attach_clients,
    close_all,
    kill_under_traffic,
    live_edges,
    publish_steadily,
    start,
    subscribe_all,
    verdict,
    wait_repaired,
)

pytestmark = pytest.mark.integration


async def test_an_inner_broker_killed_under_traffic_is_repaired_around(tmp_path: Path) -> None:
    brokers = await start(tmp_path)
    try:
        clients, received, drains = await subscribe_all(brokers)
        pub = await connect(brokers["b0"].listen, client_id="p")
        await wait_settled(brokers.values())

        publisher, killed_at, _ = await kill_under_traffic(brokers, pub)

        # The survivors b1, b4, b5 (b3's neighbours) chain up: b1-b4, b4-b5.
        await wait_repaired(brokers)
        repair_s = time.monotonic() - killed_at
        tables = await wait_settled(brokers.values())
        settled_at = time.monotonic()
        await asyncio.sleep(1.0)
        last = await publisher.stop()

        # Routing is exactly what the new tree needs (checked against the canonical tables).
        edges = [e for e in EDGES if "b3" not in e] + [("b1", "b4"), ("b4", "b5")]
        local = {b: [(s, "all", Filter.parse(FILTER))] for s, b in SUBSCRIBERS.items() if b != "b3"}
        want = canonical_tables(edges, local, RoutingMode.COVERING)
        for t in tables:
            have = {peer: sorted(keys) for peer, keys in t["table"]["links"].items()}
            expect = {peer: sorted(map(str, keys)) for peer, keys in want[t["broker"]].items()}
            assert have == expect, t["broker"]

        window = publisher.between(killed_at, settled_at)
        assert window > 100
        # Every subscriber not on the dead broker gets everything, once, in order: also what
        # b3 swallowed and what was published while the tree was torn (custody and replay).
        await assert_all_delivered(received, last)
        print(
            f"repaired {repair_s:.2f}s after the kill (detection timeout 0.6 s); "
            f"{window} events published meanwhile, none lost"
        )

        metrics = await brokers["b1"].admin.metrics()
        assert "canopy_peer_failures_total 1.0" in metrics
        status = await brokers["b4"].admin.status()
        assert status["repairs"][-1]["dead"] == "b3"
        assert status["repairs"][-1]["chain"] == ["b1", "b4", "b5"]
        await close_all([pub, *clients.values()], drains)
    finally:
        await asyncio.gather(*(b.stop() for b in brokers.values()))


@pytest.mark.parametrize("how", ["killed", "paused"])
async def test_two_neighbours_dead_together_are_bridged_and_nothing_is_lost(
    tmp_path: Path, how: str
) -> None:
    """b1 and b3, neighbours, are SIGKILLed together under traffic both ways (a node taking
    both), or SIGSTOPped together for 3 s (past detection: dead to the overlay, then fenced).
    b1's chain (b0, b2, b3) runs through b3 and b3's (b1, b4, b5) through b1: alone, each
    falls apart there and the overlay stays split into {b0, b2} and {b4, b5, b6} until a
    restore. b2 and b4, whose repair links to the other dead broker never connect, find it
    dead by probing and link to each other instead (the bridge, from the lists each dead
    broker told of the other), dialing with addresses told two hops on. Every subscriber has
    every event of both publishers, once and in order, including what the two swallowed.

    Paused, the two heard each other again over their old connection when they woke, and
    told the survivors so when refusing a repair link's data: the survivors took the pair
    for a healed partition and withdrew the links the bridge needed (an outside attack: the
    overlay split until the restore, 2,000-7,400 events lost, told, at every survivor). A
    broker that has just woken from a stall past detection now says it hears nobody."""
    brokers = await start(tmp_path)
    victims: list[BrokerProc] = []
    try:
        clients, received, drains = await subscribe_all(brokers)
        p0 = await connect(brokers["b0"].listen, client_id="p0")
        p6 = await connect(brokers["b6"].listen, client_id="p6")
        await wait_settled(brokers.values())
        publishers = {"p0": Publisher(p0), "p6": Publisher(p6)}
        await asyncio.sleep(1.0)
        killed_at, killed_wall = time.monotonic(), time.time()
        victims = [brokers.pop("b1"), brokers.pop("b3")]
        if how == "killed":
            for v in victims:
                v.kill()
            await asyncio.gather(*(v.stop() for v in victims))
        else:
            for v in victims:
                os.kill(v.pid, signal.SIGSTOP)
            await asyncio.sleep(3.0)
            for v in victims:
                os.kill(v.pid, signal.SIGCONT)  # fenced now: each finds out and fails
        bridged = {("b0", "b2"), ("b2", "b4"), ("b4", "b5"), ("b5", "b6")}
        edges: set[tuple[str, str]] = set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(15):
                while edges != bridged:
                    edges = live_edges({n: await b.admin.status() for n, b in brokers.items()})
                    await asyncio.sleep(0.05)
        assert edges == bridged, f"not bridged: the survivors' links are {sorted(edges)}"
        repair_s = time.monotonic() - killed_at
        await wait_settled(brokers.values())
        await asyncio.sleep(1.0)
        last = {p: await pub.stop() for p, pub in publishers.items()}
        async with asyncio.timeout(20):
            while any(  # noqa: ASYNC110
                [n.seq for n in got if n.publisher == p][-1:] != [end]
                for got in received.values()
                for p, end in last.items()
            ):
                await asyncio.sleep(0.05)
        for sub, got in received.items():
            for p, end in last.items():
                missed, exact = verdict(got, end, p)
                assert not missed, f"{sub} missed {len(missed)} of {p}'s: {missed[:10]}"
                assert exact, f"{sub}: {p}'s duplicated or reordered"
        records = (await brokers["b2"].admin.status())["repairs"]
        bridge = [r for r in records if r["dead"] == "b3" and r.get("died_with") == "b1"]
        assert bridge and bridge[-1]["linked"] == ["b4"], records
        # Complete on the sweeps, not by the repair timer (10 s): nothing withdrawn.
        within = 5 if how == "killed" else 9  # paused: the probe of a silent process is slower
        assert bridge[-1]["complete_at"] - killed_wall < within, bridge[-1]
        assert "withdrawn" not in bridge[-1], bridge[-1]
        print(f"{how}: bridged {repair_s:.2f}s after; {last} published, none lost")
        await close_all([p0, p6, *clients.values()], drains)
    finally:
        await asyncio.gather(*(b.stop() for b in [*brokers.values(), *victims]))


async def test_without_repair_the_same_kill_cuts_the_far_side_off(tmp_path: Path) -> None:
    """Negative control: with ``--no-repair`` nothing closes the tree, and the delivery check
    that passes above must see the subscribers behind b3 starve."""
    brokers = await start(tmp_path, "--no-repair")
    try:
        clients, received, drains = await subscribe_all(brokers)
        pub = await connect(brokers["b0"].listen, client_id="p")
        await wait_settled(brokers.values())
        victim = brokers.pop("b3")
        victim.kill()
        await victim.stop()
        await asyncio.sleep(2.0)  # more than three detection timeouts
        for n in range(1, 201):
            pub.publish_nowait({"n": n})
        await pub.flush()
        async with asyncio.timeout(10):
            while len(received["s2"]) < 200:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        assert [n.seq for n in received["s0"]] == list(range(1, 201))
        assert not received["s4"] and not received["s6"]  # cut off for good
        statuses = {n: await b.admin.status() for n, b in brokers.items()}
        assert ("b1", "b4") not in live_edges(statuses)
        await close_all([pub, *clients.values()], drains)
    finally:
        await asyncio.gather(*(b.stop() for b in brokers.values()))


async def test_a_paused_broker_that_comes_back_is_fenced(tmp_path: Path) -> None:
    """b1 stops (SIGSTOP) long enough to be declared dead; its neighbours repair around it.
    When it resumes, its old sessions are refused: it drops its links instead of bringing stale
    routing state back, and says why in its log."""
    names = ["a", "b1", "c", "d"]
    procs = await asyncio.gather(
        *(spawn_broker(n, log_dir=tmp_path, extra_args=HEARTBEAT) for n in names)
    )
    brokers = {p.name: p for p in procs}
    try:
        for x in ("a", "c", "d"):  # b1 dials all three: it would resume them when it wakes
            result = await brokers["b1"].admin.add_link(x, brokers[x].link_address, wait=10)
            assert result["up"]
        await wait_settled(brokers.values())
        os.kill(brokers["b1"].pid, signal.SIGSTOP)
        try:

            async def chained() -> bool:
                live = live_edges({n: await brokers[n].admin.status() for n in ("a", "c", "d")})
                return live == {("a", "c"), ("c", "d")}

            async with asyncio.timeout(15):
                while not await chained():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        finally:
            os.kill(brokers["b1"].pid, signal.SIGCONT)

        async def isolated() -> bool:
            st = await brokers["b1"].admin.status()
            return not st["neighbours"]

        async with asyncio.timeout(15):
            while not await isolated():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        survivors = [brokers[n] for n in ("a", "c", "d")]
        await wait_settled(survivors)
        live = live_edges({n: await brokers[n].admin.status() for n in ("a", "c", "d")})
        assert live == {("a", "c"), ("c", "d")}  # nobody took the stale broker back
        log = await asyncio.to_thread(Path(str(brokers["b1"].log_path)).read_text)
        assert "declared this broker dead" in log, log[-2000:]
        fenced = (await brokers["a"].admin.status())["fenced"]
        assert set(fenced) == {"b1"}
    finally:
        await asyncio.gather(*(b.stop() for b in brokers.values()))


async def test_the_clients_of_a_fenced_broker_fail_over_and_nothing_is_lost_untold(
    tmp_path: Path,
) -> None:
    """b2, between b1 and b3, is paused (SIGSTOP) past failure detection: b1 and b3 declare it
    dead and link up around it. When it resumes, b3 refuses its old session (fenced). b2 then
    fails (its /healthz asks to be restarted, to rejoin as a new member) and lets its clients
    go at once, telling them how long ago it left the overlay: its subscriber fails over to a
    live broker and resumes from then, and its publisher sends again there what was not
    acknowledged. The subscribers elsewhere get every publisher's events once and in order;
    b2's subscriber gets them in order, and is told of a gap for anything it misses.

    Before, b2's clients stayed on the isolated b2, which served them nothing more and told
    them nothing; then, resuming from the moment b2 closed the connection, the subscriber
    missed silently what the overlay sent on while b2 was paused (p3's events, here, when it
    failed over to b1: the review's case)."""
    names = ["b1", "b2", "b3"]
    procs = await asyncio.gather(
        *(spawn_broker(n, log_dir=tmp_path, extra_args=HEARTBEAT) for n in names)
    )
    brokers = {p.name: p for p in procs}
    clients: list[Client] = []
    try:
        for a, b in (("b1", "b2"), ("b2", "b3")):  # b2 dials b3: it hears of the fence there
            result = await brokers[a].admin.add_link(b, brokers[b].link_address, wait=10)
            assert result["up"], (a, b)
        clients, received, gaps, pubs = await attach_clients(brokers)
        await wait_settled(brokers.values())
        stop = asyncio.Event()
        published: dict[str, list[int]] = {p: [] for p in pubs}
        publishing = [
            asyncio.create_task(publish_steadily(pub, stop, published[p]))
            for p, pub in pubs.items()
        ]
        await asyncio.sleep(1.0)
        os.kill(brokers["b2"].pid, signal.SIGSTOP)
        await asyncio.sleep(2.0)  # detection is 0.6 s: b1 and b3 repair around it meanwhile
        os.kill(brokers["b2"].pid, signal.SIGCONT)
        await asyncio.sleep(3.0)
        stop.set()
        await asyncio.gather(*publishing)
        for pub in pubs.values():
            assert await pub.wait_acknowledged(10.0)
        await assert_streams(received, published, gaps, failed_over="s2")
        assert gaps["s1"] == gaps["s3"] == [], gaps
        s2 = clients[1]
        assert s2.failovers == 1 and s2.broker in {"b1", "b3"}
        assert pubs["p2"].failovers == 1 and pubs["p2"].broker in {"b1", "b3"}
        assert not await brokers["b2"].admin.healthz()  # restart it to rejoin
        # Until then it refuses clients, and a client given it first goes on to the next.
        with pytest.raises(ClientError, match="was declared dead by") as refused:
            await connect(brokers["b2"].listen, failover_within=0)
        assert refused.value.code == "fenced"
        late = await connect([brokers["b2"].listen, brokers["b1"].listen])
        clients.append(late)
        assert late.broker == "b1"
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                await c.close()
        await asyncio.gather(*(b.stop() for b in brokers.values()))


@pytest.mark.parametrize("fault", ["paused", "parted", "parted-short-memory"])
async def test_two_brokers_one_fenced_restarts_and_its_clients_join_the_other(
    tmp_path: Path, fault: str
) -> None:
    """b1 dials b2, so b2 dials nobody and is never refused: it has to ask.

    ``paused``: b2 is stopped (SIGSTOP) 2 s, and b1 declares it dead. b2, its own loop
    stalled past detection, asks b1 at once whether it was fenced, and fails: its clients
    fail over to b1, its publisher sending again what was not acknowledged. Nothing of b2's
    publisher is lost. Before, b2 stayed up alone: b1's subscriber missed 11,040 of its
    events, each acknowledged, none reported (review).

    ``parted``: the link is cut past detection. Each declares the other dead, and each, cut
    off from every neighbour, asks the other whether it did the same. Only b2 (the name
    sorting last) fails, so that one side keeps its clients. Before, both stayed up, alone,
    for good. What b2's publisher sent while the two were parted was acknowledged by b2 (its
    only next hop was declared dead) and never reached b1: b2 tells its clients when it left
    the overlay, and the publisher sends again what b2 acknowledged since (before, b1's
    subscriber missed 790 of them, unreported). Nothing of p2's is lost at b1.

    ``parted-short-memory``: the same, with p2 keeping only 300 acknowledged publications
    (``max_unacked``; a publisher flat out on a broker cut off outruns any bound). What it
    no longer kept is lost at b1, and s1 must be told: p2 says so at b1 (C_PUB_GAP), which
    tells every subscriber of the overlay. Before, only p2's log said so."""
    procs = await asyncio.gather(
        *(spawn_broker(n, log_dir=tmp_path, extra_args=HEARTBEAT) for n in ("b1", "b2"))
    )
    brokers = {p.name: p for p in procs}
    clients: list[Client] = []
    try:
        assert (await brokers["b1"].admin.add_link("b2", brokers["b2"].link_address, wait=10))["up"]
        clients, received, gaps, pubs = await attach_clients(brokers)
        p1, p2 = pubs["p1"], pubs["p2"]
        if fault == "parted-short-memory":
            p2.max_unacked = 300
        await wait_settled(brokers.values())
        stop = asyncio.Event()
        published: dict[str, list[int]] = {"p1": [], "p2": []}
        publishing = [
            asyncio.create_task(publish_steadily(pub, stop, published[p]))
            for p, pub in (("p1", p1), ("p2", p2))
        ]
        await asyncio.sleep(0.5)
        if fault == "paused":
            os.kill(brokers["b2"].pid, signal.SIGSTOP)
            await asyncio.sleep(2.0)  # detection is 0.6 s
            os.kill(brokers["b2"].pid, signal.SIGCONT)
        else:
            assert await brokers["b1"].admin.cut_link("b2")
        async with asyncio.timeout(15):
            while p2.failovers == 0:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        if fault.startswith("parted"):
            assert await brokers["b1"].admin.heal_link("b2")
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.gather(*publishing)
        for pub in (p1, p2):
            assert await pub.wait_acknowledged(10.0)
        assert await brokers["b1"].admin.healthz()
        assert not await brokers["b2"].admin.healthz()
        assert [c.broker for c in clients] == ["b1", "b1", "b1", "b1"]
        told = ("s1",) if fault == "parted-short-memory" else ()
        await assert_streams(received, published, gaps, failed_over="s2", also_told=told)
        if told:
            assert any("publisher p2" in g.reason for g in gaps["s1"]), gaps["s1"]
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                await c.close()
        await asyncio.gather(*(b.stop() for b in brokers.values()))


async def test_a_subscriber_whose_broker_dies_is_told_so(tmp_path: Path) -> None:
    """The stream of a subscriber whose broker dies, with no other broker to fail over to,
    does not end as if it were over: once the failover gives up the client raises
    ConnectionLost naming the broker, and ``canopy sub`` exits 1 saying so. A client that
    closes itself still ends its stream quietly."""
    leaf = await spawn_broker("leaf", log_dir=tmp_path)
    other = await spawn_broker("other", log_dir=tmp_path)
    sub = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "canopy_operator.cli",
        "sub",
        "--broker",
        leaf.listen,
        "--failover-within",
        "1",
        FILTER,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    client = await connect(leaf.listen, client_id="lib", failover_within=1.0)
    quiet = await connect(other.listen, client_id="quiet")
    try:
        await client.subscribe(FILTER)
        async with asyncio.timeout(20):
            # Both clients attached and subscribed: killed between the CLI's hello and its
            # subscription, the CLI's own subscribe request would fail with the connection
            # (not the failover) and say so instead.
            while (await leaf.admin.status())["routing_table_size"] < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        leaf.kill()
        await leaf.stop()
        with pytest.raises(ConnectionLost, match=r"broker leaf at .* closed the connection"):
            async with asyncio.timeout(10):
                await client.receive()
        async with asyncio.timeout(20):
            _, err = await sub.communicate()
        assert sub.returncode == 1, err
        assert b"broker leaf at" in err and b"closed the connection" in err, err
        assert b"no broker took over within 1 s" in err, err
        await quiet.close()
        assert await quiet.receive() == []  # closed by the application: a quiet end
        await client.close()
    finally:
        await quiet.close()  # before its broker stops: no failover is started in teardown
        await client.close()
        if sub.returncode is None:
            sub.kill()
            await sub.wait()
        await other.stop()
        await leaf.stop()
