"""Link-failure repair on real processes (paper 004; issue 12 item 6): in the crash tests'
overlay of seven brokers, under ~1,000 events/s, b3 cuts its link to b1 for good while both live
(``POST /links/b1/cut``: the connection aborted, b1's dials refused but a detour). b1 and b3 ask
the brokers that would hear the other (b4 hears b3, b2 hears b1): alive, so it is a link
failure. The link's session is detoured out of band, and the exchange onto the standby link of
the smallest cycle through b1-b3 (b1-b3-b4, closed by the standby link b1-b4) replaces it: one
tree again, every subscriber gets every event once and in order, nobody is fenced.

The control, ``--cycle-bound 0``: link-failure repair off, the same cut is taken for a death at
both ends (each fences the other), as before this change.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest

from canopy_broker.client import connect
from canopy_broker.procs import BrokerProc, wait_settled
from tests.integration.crash_overlay import (
    EDGES,
    Publisher,
    assert_all_delivered,
    close_all,
    live_edges,
    start,
    subscribe_all,
)

pytestmark = pytest.mark.integration


def through(cycle: list[str], a: str, b: str) -> bool:
    return any({x, y} == {a, b} for x, y in itertools.pairwise(cycle))


async def knows_cycle_through(broker: BrokerProc, a: str, b: str) -> bool:
    known = (await broker.admin.status())["cycles"]["known"]
    return any(through(c["cycle"], a, b) for c in known)


async def test_a_cut_link_is_exchanged_onto_a_standby_link(tmp_path: Path) -> None:
    brokers = await start(tmp_path, "--cycle-period", "0.5")
    try:
        clients, received, drains = await subscribe_all(brokers)
        pub = await connect(brokers["b0"].listen, client_id="p")
        await wait_settled(brokers.values())
        async with asyncio.timeout(15):
            while not (  # noqa: ASYNC110 - polling other processes
                await knows_cycle_through(brokers["b1"], "b1", "b3")
                and await knows_cycle_through(brokers["b3"], "b1", "b3")
            ):
                await asyncio.sleep(0.05)

        publisher = Publisher(pub)
        await asyncio.sleep(1.0)
        cut_wall = time.time()
        assert await brokers["b3"].admin.cut_link("b1")

        async def records() -> dict[str, dict[str, object]]:
            out = {}
            for n in ("b1", "b3"):
                recs = (await brokers[n].admin.status())["link_repairs"]
                if recs and recs[-1]["closed_at"] is not None:
                    out[n] = recs[-1]
            return out

        async with asyncio.timeout(20):
            while len(recs := await records()) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        path = recs["b1"]["path"]
        assert isinstance(path, list) and path[0] == "b1", recs  # b1 decides and starts it
        added = tuple(sorted((path[0], path[-1])))
        want = (set(EDGES) - {("b1", "b3")}) | {added}
        async with asyncio.timeout(10):
            while (  # noqa: ASYNC110
                live_edges({n: await b.admin.status() for n, b in brokers.items()}) != want
            ):
                await asyncio.sleep(0.05)
        await wait_settled(brokers.values())
        await asyncio.sleep(0.5)
        last = await publisher.stop()
        await assert_all_delivered(received, last)

        statuses = {n: await b.admin.status() for n, b in brokers.items()}
        assert not any(st["fenced"] for st in statuses.values())
        ends = [statuses[n]["neighbours"] for n in added]
        assert all(lk["promoted"] for nb in ends for lk in nb if lk["peer"] in added), ends
        metrics = await brokers["b1"].admin.metrics()
        assert 'canopy_link_repairs_total{outcome="exchange"} 1.0' in metrics
        assert "canopy_peer_failures_total 0.0" in metrics
        failed = {n: float(r["failed_at"]) - cut_wall for n, r in recs.items()}  # type: ignore[arg-type]
        detour = {n: float(r["detour_up_at"] or 0) - cut_wall for n, r in recs.items()}  # type: ignore[arg-type]
        closed = {n: float(r["closed_at"]) - cut_wall for n, r in recs.items()}  # type: ignore[arg-type]
        print(
            f"cut b1-b3 -> link failure told at b1 {failed['b1'] * 1000:.0f} ms, "
            f"b3 {failed['b3'] * 1000:.0f} ms (witnesses {recs['b1']['witness']}, "
            f"{recs['b3']['witness']}); detour up {max(detour.values()) * 1000:.0f} ms; "
            f"failed link closed (exchange {recs['b1']['xid']} onto {added}) "
            f"{max(closed.values()) * 1000:.0f} ms after the cut (detection timeout 600 ms); "
            f"{last} events, none lost, duplicated or reordered"
        )
        await close_all([pub, *clients.values()], drains)
    finally:
        await asyncio.gather(*(b.stop() for b in brokers.values()))


async def test_without_cycles_a_cut_link_is_taken_for_a_death(tmp_path: Path) -> None:
    brokers = await start(tmp_path, "--cycle-bound", "0")
    try:
        await wait_settled(brokers.values())
        assert await brokers["b3"].admin.cut_link("b1")
        async with asyncio.timeout(15):
            while True:
                fenced = {n: (await brokers[n].admin.status())["fenced"] for n in ("b1", "b3")}
                if "b3" in fenced["b1"] and "b1" in fenced["b3"]:
                    break
                await asyncio.sleep(0.05)
        for n in ("b1", "b3"):
            st = await brokers[n].admin.status()
            assert not st["link_repairs"] and st["cycles"]["bound"] == 0
    finally:
        await asyncio.gather(*(b.stop() for b in brokers.values()))
