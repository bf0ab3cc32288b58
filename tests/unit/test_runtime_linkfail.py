"""Link-failure repair in-process (paper 004 in the runtime): a link cut for good between two live
brokers is told from a death by asking the brokers that would hear the peer, and is exchanged
onto the standby link that closes a small cycle with it, its session detoured out of band until
the exchange closes it.

The overlay is the standby tests' star, hub ``h`` with leaves ``a``, ``c``, ``d``: the standby
links a-c and c-d close the cycles a-h-c and c-h-d. ``h`` cuts its link to ``a``
(:meth:`Broker.cut_link`: the connection aborted, every later one refused but a detour).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from canopy_broker.client import connect
from canopy_broker.core.exchange import Mark
from canopy_broker.core.messages import (
    CycleFound,
    CycleProbe,
    FromLink,
    Go,
    Granted,
    Lock,
    RepairLink,
)
from canopy_broker.runtime.framing import decode_peer_message, encode_generic
from canopy_broker.runtime.links import Link
from canopy_broker.runtime.linkstate import LinkEvent, LinkStateError
from canopy_broker.runtime.server import Broker
from tests.unit.test_runtime_broker import (
    MakeBroker,
    addr,
    collect,
    eventually,
    link,
    make_broker,
    settled,
)
from tests.unit.test_runtime_standby import standby_up, star

pytestmark = pytest.mark.looptime  # timeouts and heartbeats on the loop's clock, faked

__all__ = ["make_broker"]  # the fixture, imported for pytest


@pytest.mark.parametrize(
    "msg",
    [
        CycleProbe(128, "a", ("a", "h"), 1),
        CycleProbe(129, "a", ("a",), 1, closing=True),
        CycleFound(128, ("a", "h", "c")),
        RepairLink("link:a-h:a-c:r128", ("a", "h", "c"), ("a", "h")),
    ],
)
def test_cycle_messages_cross_peer_channels_unchanged(msg: object) -> None:
    assert decode_peer_message(orjson.loads(encode_generic(msg))) == msg


async def test_a_link_is_detoured_only_once_through_its_table() -> None:
    link = Link("p", "s", dialer=True, address=None)
    assert not link.detoured
    link.detour()
    link.detour()  # both ends' cores ask; the second changes nothing
    assert link.detoured and link.status()["detoured"]
    standby = Link("q", "s", dialer=True, address=None, kind="standby")
    with pytest.raises(LinkStateError, match="only an overlay link"):
        standby.fire(LinkEvent.DETOUR)
    assert not standby.detoured


def cycles_known(b: Broker) -> list[list[str]]:
    return [c["cycle"] for c in b.sessions.cycles_status()["known"]]


async def cut_star(make_broker: MakeBroker, **config: Any) -> dict[str, Broker]:
    brokers = await star(make_broker, cycle_period=0.3, **config)
    a, c, _d = (brokers[n] for n in "acd")
    await eventually(lambda: standby_up(a, "c") and standby_up(c, "d"))
    return brokers


async def test_a_cut_link_is_exchanged_onto_the_standby_link(make_broker: MakeBroker) -> None:
    brokers = await cut_star(make_broker)
    a, c, d, h = (brokers[n] for n in "acdh")
    # Every member of the cycle a-h-c learns it (the heart a's probes meet at h).
    await eventually(lambda: all(["a", "h", "c"] in cycles_known(x) for x in (a, h, c)))
    await eventually(lambda: ["c", "h", "d"] in cycles_known(d))  # the heart c's
    sub = await connect(addr(a), client_id="s")
    await sub.subscribe("n >= 0", sub_id="all")
    await eventually(lambda: d.core.routing_table_size() > 0)
    pub = await connect(addr(d), client_id="p")
    n = 0

    async def publish(k: int) -> None:
        nonlocal n
        for _ in range(k):
            n += 1
            pub.publish_nowait({"n": n})
            if n % 20 == 0:
                await pub.flush()
                await asyncio.sleep(0.005)
        await pub.flush()

    await publish(100)
    assert h.cut_link("a")
    await publish(300)  # queued behind the cut at h while the failure is detected
    await eventually(lambda: "a" not in h.links and "h" not in a.links)
    assert set(a.links) == {"c"} and set(h.links) == {"c", "d"}
    assert a.links["c"].promoted  # the standby link, no dial
    await publish(100)
    got = [m.seq for m in await collect(sub, n)]
    assert got == list(range(1, n + 1))  # none lost, duplicated or reordered

    # Both ends told it apart from a death (no fence), detoured the link, one decided.
    for x, peer, witness in ((a, "h", "c"), (h, "a", "c")):
        rec = x.sessions.link_repairs[-1]
        assert rec["peer"] == peer and rec["witness"] == witness and rec["detoured"], rec
        assert rec["closed_at"] is not None and not x.sessions.fenced
    assert a.sessions.link_repairs[-1]["path"] == ["a", "h", "c"]
    assert h.sessions.link_repairs[-1]["xid"] is None  # the other end decides
    text = a.metrics.render().decode()
    assert 'canopy_link_repairs_total{outcome="exchange"} 1.0' in text
    assert "canopy_link_failures_total 1.0" in text and "canopy_peer_failures_total 0.0" in text
    assert "canopy_link_detours_total 1.0" in h.metrics.render().decode()
    assert a.status()["link_repairs"][-1]["xid"] == a.sessions.link_repairs[-1]["xid"]
    await pub.close()
    await sub.close()


async def test_without_cycles_a_cut_link_is_taken_for_a_death(make_broker: MakeBroker) -> None:
    """The control: ``cycle_bound=0`` turns link-failure repair off; the same cut makes each
    end declare the other dead and fence it, as before."""
    brokers = await cut_star(make_broker, cycle_bound=0)
    a, h = brokers["a"], brokers["h"]
    assert h.cut_link("a")
    await eventually(lambda: "a" in h.sessions.fenced and "h" in a.sessions.fenced)
    assert not a.sessions.link_repairs and not h.sessions.link_repairs
    assert a.status()["cycles"]["bound"] == 0 and not cycles_known(a)


async def test_a_silent_peer_nobody_hears_is_dead(make_broker: MakeBroker) -> None:
    """A stopped hub: its leaves ask each other, nobody hears it, so it is dead and fenced."""
    brokers = await cut_star(make_broker)
    a, c, d, h = (brokers[n] for n in "acdh")
    await h.stop(flush_timeout=0.1)
    await eventually(lambda: all("h" in x.sessions.fenced for x in (a, c, d)))
    assert not any(x.sessions.link_repairs for x in (a, c, d))


async def test_without_a_known_cycle_a_cut_link_waits_unfenced(make_broker: MakeBroker) -> None:
    """No detection round runs (``cycle_period=0``), so no cycle is known: the
    cut is still told from a death (c hears both ends), nobody is fenced, nothing is detoured,
    and the link's traffic waits for it; healed, the session resumes and delivers it all."""
    brokers = await star(make_broker, cycle_period=0)
    a, c, d, h = (brokers[n] for n in "acdh")
    await eventually(lambda: standby_up(a, "c") and standby_up(c, "d"))
    sub = await connect(addr(a), client_id="s")
    await sub.subscribe("n >= 0", sub_id="all")
    await eventually(lambda: d.core.routing_table_size() > 0)
    pub = await connect(addr(d), client_id="p")
    assert h.cut_link("a")
    for i in range(1, 101):
        pub.publish_nowait({"n": i})
    await pub.flush()
    await eventually(lambda: bool(a.sessions.link_repairs and h.sessions.link_repairs))
    for x in (a, h):
        rec = x.sessions.link_repairs[-1]
        assert rec["xid"] is None and "no known small cycle" in rec["reason"], rec
        assert not rec["detoured"] and not x.sessions.fenced
        assert 'canopy_link_repairs_total{outcome="none"} 1.0' in x.metrics.render().decode()
    await asyncio.sleep(0.5)  # asked about again after each timeout: still alive, still waiting
    assert "a" in h.links and not h.sessions.fenced and len(h.sessions.link_repairs) == 1
    assert h.heal_link("a")
    got = [m.seq for m in await collect(sub, 100)]
    assert got == list(range(1, 101))
    assert set(h.links) == {"a", "c", "d"} and not h.links["a"].detoured
    await pub.close()
    await sub.close()


async def test_a_link_waited_for_is_a_death_once_its_peer_fenced_this_end(
    make_broker: MakeBroker,
) -> None:
    """Both ends of the cut take it for a link failure (c hears both) and wait. Then ``a``
    fences ``h``'s process, as its detector does when it comes out the other way (in a
    partition, the witnesses it reached can be cut off too). ``h``, the end that does not
    dial, asks ``a`` itself each time it asks the witnesses, hears ``fenced``, and takes ``a``
    for dead too. Before, it waited for the link for ever: a link known at one end only, which
    no restore gets past (review: a partition during an exchange). ``a``, dialing again once
    the cut heals, is refused as fenced in turn and, with no other live link, fails."""
    brokers = await star(make_broker, cycle_period=0)
    a, c, d, h = (brokers[n] for n in "acdh")
    await eventually(lambda: standby_up(a, "c") and standby_up(c, "d"))
    assert h.cut_link("a")
    await eventually(lambda: bool(a.sessions.link_repairs and h.sessions.link_repairs))
    assert not h.sessions.fenced and "a" in h.links
    a.sessions.fenced["h"] = h.incarnation
    await eventually(lambda: "a" in h.sessions.fenced and "a" not in h.links)
    assert h.sessions.fenced["a"] == a.incarnation and "a" in h.sessions.fenced_since
    assert h.fenced_by is None and set(h.links) == {"c", "d"}
    assert h.sessions.repairs and h.sessions.repairs[-1]["dead"] == "a"
    assert a.fenced_by is None  # its dials meet the cut, not the fence
    assert h.heal_link("a")
    await eventually(lambda: a.fenced_by == "h")
    assert c.fenced_by is None and d.fenced_by is None


async def test_a_repair_link_whose_far_end_hears_the_dead_broker_is_withdrawn_at_once(
    make_broker: MakeBroker,
) -> None:
    """A partition in small: the star plus ``e`` on ``a``, and the cut h-a is a death at both
    ends (no standby links, no cycles), {a, e} | {h, c, d}. ``a`` repairs around ``h`` by
    linking to ``c`` (next in the chain a-c-d), which still hears ``h`` (alive on its side)
    and refuses the link's data (``not-open``), saying so; ``h`` repairs around ``a`` by
    linking to ``e``, likewise. Each withdraws its link at once and its repair ends, long
    before its timer (made 1,000 s here): the restore can join the sides as soon as the
    network lets it. Before, the links stayed until the timers ran out."""
    config: dict[str, Any] = {"cycle_bound": 0, "standby": False}
    brokers = await star(make_broker, **config)
    a, c, d, h = (brokers[n] for n in "acdh")
    e = await make_broker("e", heartbeat_interval=0.1, **config)
    await link(e, a)
    await settled(a, e)
    await eventually(lambda: set(h.core.neighbour_lists.lists.get("a", ())) == {"h", "e"})
    for x in (a, h):
        x.core.repair_timeout = 1000.0
    assert h.cut_link("a")
    await eventually(lambda: "h" in a.sessions.fenced and "a" in h.sessions.fenced)
    for x, dead, far in ((a, "h", "c"), (h, "a", "e")):
        rec = x.sessions.repairs[-1]
        assert rec["dead"] == dead and rec["linked"] == [far]
        await eventually(lambda rec=rec: "complete_at" in rec, within=30.0)
        assert rec["withdrawn"] == [far] and far not in x.links
    assert set(a.links) == {"e"} and set(h.links) == {"c", "d"}
    # The far ends dropped their shells on the goodbye; nobody else was declared dead, and
    # each side goes on as a tree.
    await eventually(lambda: "a" not in c.links and "h" not in e.links)
    assert not any(x.sessions.fenced for x in (c, d, e))
    assert all(x.fenced_by is None for x in (a, c, d, e, h))


@pytest.mark.parametrize(
    "heard",
    [
        None,
        [],
        "h",
        {"h": 0.2},
        {"h": [float("nan"), 10.0]},
        {"h": [-1.0, 10.0]},
        {"h": [True, 10.0]},
        {"h": ["0.2", 10.0]},
        {"h": [0.2]},
        {"h": [0.2, 10.0, 1.0]},
        {"h": [0.2, float("inf")]},
        {"h": {"ago": 0.2}},
        {"h": [1e308, 10.0]},
        {"x": [0.2, 10.0]},
        # Heard, but over a connection up for 1 s only: since after b lost h. A paused h,
        # awake again, about to be fenced out; the far end's repair will need the link.
        {"h": [0.2, 1.0]},
    ],
)
async def test_what_a_far_end_says_it_heard_withdraws_nothing_unless_it_makes_sense(
    make_broker: MakeBroker, heard: object
) -> None:
    """The ``heard`` of a ``not-open`` refusal or a probe's answer comes from another
    process: anything but two numbers of seconds for the broker repaired around, heard
    recently over a connection up since before this broker lost it, is no reason to withdraw
    a repair link (and no reason to fail)."""
    b = await make_broker("b")
    repair = Link("c", "s", dialer=True, address=None)
    b.sessions.links["c"] = repair
    b.sessions._fenced_heard["h"] = b.now() - 5.0
    rec: dict[str, Any] = {"dead": "h", "chain": ["b", "c"], "linked": ["c"]}
    b.sessions.repairs.append(rec)
    b.sessions._alive_there(repair, heard)
    assert "withdrawn" not in rec and b.sessions.links["c"] is repair
    assert b.failed is None and b.fenced_by is None
    # The control: heard 4.8 s after b lost it, over a connection up since before then.
    b.sessions._alive_there(repair, {"h": [0.2, 10.0]})
    assert rec["withdrawn"] == ["c"] and "c" not in b.sessions.links


async def test_a_death_on_a_running_exchanges_cycle_settles_it_and_repairs_at_once(
    make_broker: MakeBroker,
) -> None:
    """a is in phase 1 of an exchange over z-a-q when its detector declares z dead. The
    verdict is as strong as a fence: the exchange settles now (as at its lease's end) and
    the repair around z starts at once. Deferred until the lease ran out, a member killed
    during an exchange kept the overlay split for 30 s (chaos soak: 2,539 events lost untold
    at a subscriber whose own broker then died before the join)."""
    a, z, q = await make_broker("a"), await make_broker("z"), await make_broker("q")
    await link(a, z)
    await link(a, q)
    await settled(a, z, q)
    for peer, msg in (
        ("z", Lock("x1", ("z", "a", "q"), 1)),
        ("q", Granted("x1")),
        ("z", Go("x1")),
    ):
        a.core.handle(FromLink(peer, msg), a.now())  # its effects are not sent: a test of a
    for msg in (Lock("x1", ("z", "a", "q"), 1), Go("x1")):  # and q, as Go left it (R2)
        q.core.handle(FromLink("a", msg), q.now())
    assert a.core.exchange is not None and a.core.exchange.granted
    a.sessions._declare_dead(a.sessions.links["z"], 1.0)
    assert a.core.exchange is None or a.core.exchange.has(Mark.BY_LEASE)  # settled
    assert "z" in a.core.repairs and "z" in a.sessions.fenced  # repaired around, fenced
    assert "z" not in a.sessions._deferred
    # Settled, a (an R end here) closes the removed link to q once q's separator is in: q
    # settles on the Settle a sent it first, and sends its own. The close then waits for q's
    # acknowledgement. Let it end before the brokers stop.
    async with asyncio.timeout(5):
        while "q" in a.sessions.links or a.core.exchange is not None:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert q.core.exchange is None
