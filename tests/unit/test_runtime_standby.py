"""Standby links in-process: each broker keeps heartbeat-only connections to the brokers a crash
repair would link it to, and the repair promotes them instead of dialing.

The overlay is a star, hub ``h`` with leaves ``a``, ``c``, ``d``: if ``h`` dies, the chain
through its sorted neighbour list is a-c, c-d, so those are the standby links. ``h`` is stopped
(its links say ``shutdown`` and go quiet, which the leaves' failure detectors take for a death).
"""

from __future__ import annotations

from typing import Any

import pytest

from canopy_broker.client import Client, connect
from canopy_broker.runtime.links import Link
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

__all__ = ["make_broker"]  # the fixture, imported for pytest

pytestmark = pytest.mark.looptime  # timeouts and heartbeats on the loop's clock, faked


async def star(make_broker: MakeBroker, **config: Any) -> dict[str, Broker]:
    hb = config.pop("heartbeats", {})
    brokers = {
        n: await make_broker(n, heartbeat_interval=hb.get(n, 0.1), **config)
        for n in ("h", "a", "c", "d")
    }
    for leaf in ("a", "c", "d"):
        await link(brokers[leaf], brokers["h"])
    await settled(*brokers.values())
    return brokers


def standby_up(b: Broker, peer: str) -> bool:
    sb = b.sessions.standby.get(peer)
    return sb is not None and sb.conn is not None


def last_repair(b: Broker) -> dict[str, Any]:
    return b.sessions.repairs[-1] if b.sessions.repairs else {}


async def delivered_across(source: Broker, sub: Client, n: int) -> None:
    """Publish n events on ``source``; the subscriber ``sub`` gets them all, in order."""
    pub = await connect(addr(source), client_id="p")
    for i in range(1, n + 1):
        pub.publish_nowait({"n": i})
    await pub.flush()
    assert [m.seq for m in await collect(sub, n)] == list(range(1, n + 1))
    await pub.close()
    await sub.close()


async def test_standby_links_follow_the_neighbour_lists(make_broker: MakeBroker) -> None:
    brokers = await star(make_broker)
    a, c, d, h = (brokers[n] for n in "acdh")
    # Exactly the chain links of h's death, dialed by the end whose name sorts first.
    await eventually(lambda: standby_up(a, "c") and standby_up(c, "a"))
    await eventually(lambda: standby_up(c, "d") and standby_up(d, "c"))
    assert set(a.sessions.standby) == {"c"} and a.sessions.standby["c"].dialer
    assert set(c.sessions.standby) == {"a", "d"} and not c.sessions.standby["a"].dialer
    assert set(d.sessions.standby) == {"c"}
    assert not h.sessions.standby  # h's neighbours are leaves: no failure needs a link of h's
    st = c.status()["standby"]
    assert [s["peer"] for s in st] == ["a", "d"] and {s["state"] for s in st} == {"up"}
    await eventually(lambda: all(s["rtt_ms"] is not None for s in c.status()["standby"]))
    assert "a" not in c.links and "c" not in a.core.neighbours  # in no routing table
    assert 'canopy_standby_link_up{peer="a"} 1.0' in c.metrics.render().decode()

    # A standby link nobody wants any more is dropped by its dialer, then by the other end.
    d.remove_link("h")
    await eventually(lambda: "d" not in c.sessions.standby and "c" not in d.sessions.standby)
    assert standby_up(a, "c")


async def test_a_repair_promotes_its_standby_links(make_broker: MakeBroker) -> None:
    brokers = await star(make_broker)
    a, c, d, h = (brokers[n] for n in "acdh")
    await eventually(lambda: standby_up(a, "c") and standby_up(c, "d"))
    conns = {(x.name, p): x.sessions.standby[p].conn for x in (a, c, d) for p in x.sessions.standby}
    sub = await connect(addr(d), client_id="s")
    await sub.subscribe("n >= 0", sub_id="all")
    await eventually(lambda: a.core.routing_table_size() > 0)

    await h.stop(flush_timeout=0.1)
    await eventually(lambda: all(last_repair(x).get("dead") == "h" for x in (a, c, d)))
    assert last_repair(a)["promoted"] == ["c"] and last_repair(a)["dialed"] == []
    assert last_repair(c)["promoted"] == ["a", "d"]
    assert last_repair(d)["promoted"] == ["c"]
    await settled(a, c, d)
    # The same connections carry the overlay links now: no dial, no new hello.
    for (x, p), conn in conns.items():
        lk = brokers[x].links[p]
        assert lk.conn is conn and lk.promoted and lk.connects == 1, (x, p)
    assert "canopy_repair_links_promoted_total 2.0" in c.metrics.render().decode()

    await delivered_across(a, sub, 50)


async def test_without_standby_links_the_repair_dials(make_broker: MakeBroker) -> None:
    """The control: the same failure with ``standby=False`` opens new connections."""
    brokers = await star(make_broker, standby=False)
    a, c, d, h = (brokers[n] for n in "acdh")
    await h.stop(flush_timeout=0.1)
    await eventually(lambda: all(last_repair(x).get("dead") == "h" for x in (a, c, d)))
    assert not a.sessions.standby and not c.sessions.standby
    assert last_repair(c)["dialed"] == ["a", "d"] and last_repair(c)["promoted"] == []
    await settled(a, c, d)
    assert not any(lk.promoted for x in (a, c, d) for lk in x.links.values())


async def test_data_over_a_promotion_waits_for_this_ends_repair(make_broker: MakeBroker) -> None:
    """a detects h's death well before c (a's heartbeat is 0.1 s, c's 0.2 s): a promotes the
    standby link and sends its routes at once; c takes the promotion but holds that data,
    unread, until its own core opens the link, then handles it in order."""
    brokers = await star(make_broker, heartbeats={"a": 0.1, "c": 0.2, "d": 0.2, "h": 0.1})
    a, c, d, h = (brokers[n] for n in "acdh")
    await eventually(lambda: standby_up(a, "c") and standby_up(c, "d"))
    sub = await connect(addr(c), client_id="s")
    await sub.subscribe("n >= 0", sub_id="all")
    await eventually(lambda: a.core.routing_table_size() > 0)
    conn = a.sessions.standby["c"].conn

    await h.stop(flush_timeout=0.1)

    def held_at_c() -> bool:
        lk = c.links.get("a")
        return (
            lk is not None
            and lk.promoted
            and not lk.established
            and lk.conn is not None
            and lk.conn.held
        )

    await eventually(held_at_c)
    assert last_repair(c).get("dead") != "h"  # c's detector has not fired yet
    await eventually(lambda: last_repair(c).get("dead") == "h")
    assert last_repair(c)["promoted"] == ["a", "d"]
    await settled(a, c, d)
    assert a.links["c"].conn is conn and a.links["c"].connects == 1
    await delivered_across(a, sub, 20)


async def test_a_promotion_is_taken_as_the_dial_an_opened_link_waits_for(
    make_broker: MakeBroker,
) -> None:
    """c's core opens the link to a while c has no standby link to a (here: c forgot it, as if
    its connection had dropped on c's side only), so c's link waits for a's dial (a's name sorts
    first). a's repair promotes its standby link instead of dialing: c takes that connection as
    the dial its link waits for, so nothing is dialed and both records say promoted."""
    brokers = await star(make_broker, heartbeats={"a": 0.2, "c": 0.05, "d": 0.2, "h": 0.05})
    a, c, d, h = (brokers[n] for n in "acdh")
    await eventually(lambda: standby_up(a, "c") and standby_up(c, "a") and standby_up(c, "d"))
    sub = await connect(addr(c), client_id="s")
    await sub.subscribe("n >= 0", sub_id="all")
    await eventually(lambda: a.core.routing_table_size() > 0)
    forgotten = c.sessions.standby.pop("a")
    conn = forgotten.conn

    await h.stop(flush_timeout=0.1)
    await eventually(lambda: "a" in c.links and last_repair(c).get("dead") == "h")
    assert last_repair(a).get("dead") != "h"  # c was first: its link to a waits for a dial
    assert c.links["a"].conn is None and last_repair(c)["dialed"] == ["a"]
    await eventually(lambda: last_repair(a).get("dead") == "h")
    assert last_repair(a)["promoted"] == ["c"]
    await eventually(lambda: c.links["a"].conn is conn)  # the standby connection, taken over
    assert sorted(last_repair(c)["promoted"]) == ["a", "d"] and last_repair(c)["dialed"] == []
    assert forgotten.removed and c.links["a"].connects == 1 and a.links["c"].connects == 1
    await settled(a, c, d)
    await delivered_across(a, sub, 20)


async def test_a_refused_promotion_falls_back_to_a_fresh_session(make_broker: MakeBroker) -> None:
    """b promotes its standby link to a while a already has another instance of the link (one
    it dials): a refuses with ``promotion-refused`` and drops the standby link; b starts the
    link on a fresh session and waits, as an opened link's non-dialing end does; a's dial is
    then taken, so both ends end up on one new connection. Driven through the sessions
    directly (the cores are not asked): the race is too narrow to stage with real failures."""
    a = await make_broker("a", heartbeat_interval=0.2, standby=False)
    b = await make_broker("b", heartbeat_interval=0.2, standby=False)
    a.peers["b"] = addr(b)
    a.sessions._new_link(Link("b", "sb-session", dialer=True, address=None, kind="standby"))
    await eventually(lambda: standby_up(a, "b") and standby_up(b, "a"))

    forgotten = a.sessions.standby.pop("b")  # as if its connection had dropped on a's side
    b.sessions._promote(b.sessions.standby["a"], tell=True)  # b's core opened the link ...
    a.sessions.open("b")  # ... and so did a's, with no standby link: it dials
    promoted = b.links["a"]
    await eventually(lambda: promoted.conn is not None and promoted.session != "sb-session")
    # a's end is up once b's answer to its hello is in (a TLS round trip after b's end).
    await eventually(lambda: "b" in a.links and a.links["b"].conn is not None)
    assert not a.sessions.standby and not b.sessions.standby and forgotten.removed
    assert a.links["b"].session == promoted.session and a.links["b"].conn is not None
    assert promoted.connects == 2  # the standby connection, then a's dial
    assert b.sessions._opened_how["a"] == "dialed"
