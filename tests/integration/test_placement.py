"""Underlay-aware standby links on real processes (paper 003 through paper 001's chain): brokers
told their zone and node order their neighbour lists so that the standby links a repair would
promote cross failure domains. Then a whole node fails — two brokers SIGKILLed at once, b3 and
the leaf b4 beside it — under ~1,000 events/s: the placement-aware chain b1-b5-b4 still joins
the survivors b1 and b5 over a standby link, and the subscribers on b0, b2 and b6 get every
event once, in order.

Without placement the chain by name, b1-b4-b5, goes through the other dead broker. Before
session 26 b1 and b5 then never linked and b6 was cut off from the publisher (this test's
control then). Now b1 and b5 find b4 dead too (their repair links to it never connect) and
bridge over both (core.repair.bridge_ends): the same survivors' tree, later (the probe), and
over a dialed link instead of a promoted standby one. The delivery checker's own control
(that it sees losses) is in tests/sim and test_crash_repair.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from canopy_broker.client import connect
from canopy_broker.procs import BrokerProc, wait_settled
from tests.integration.crash_overlay import (
    SUBSCRIBERS,
    Publisher,
    kill,
    live_edges,
    start,
    subscribe_all,
    verdict,
    wait_for_last,
)

pytestmark = pytest.mark.integration

# b3 and its leaf b4 share node n3 (zone a); b3's other neighbours are in zones b and c.
PLACEMENT = {
    "b0": ("b", "n0"),
    "b1": ("b", "n1"),
    "b2": ("c", "n2"),
    "b3": ("a", "n3"),
    "b4": ("a", "n3"),
    "b5": ("c", "n5"),
    "b6": ("b", "n6"),
}
PLACED = {b: ("--zone", z, "--node", n) for b, (z, n) in PLACEMENT.items()}
# The chain links of every single failure. b3 announces b1, b5 (other zones), then b4 (its own
# node): b1-b5 and b5-b4. By name it would be b1-b4 and b4-b5.
STANDBY_PLACED = {("b0", "b2"), ("b2", "b3"), ("b1", "b5"), ("b4", "b5"), ("b3", "b6")}
STANDBY_BY_NAME = {("b0", "b2"), ("b2", "b3"), ("b1", "b4"), ("b4", "b5"), ("b3", "b6")}
SURVIVORS_TREE = {("b0", "b1"), ("b1", "b2"), ("b1", "b5"), ("b5", "b6")}


async def standby_links(brokers: dict[str, BrokerProc]) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for n, b in brokers.items():
        for s in (await b.admin.status())["standby"]:
            if s["state"] == "up":
                a, c = sorted((n, s["peer"]))
                found.add((a, c))
    return found


async def wait_standby(brokers: dict[str, BrokerProc], want: set[tuple[str, str]]) -> None:
    async with asyncio.timeout(10):
        while await standby_links(brokers) != want:  # noqa: ASYNC110 - other processes
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("placed", [True, False], ids=["placed", "by-name"])
async def test_a_node_failure_keeps_the_survivors_linked_with_or_without_placement(
    tmp_path: Path, placed: bool
) -> None:
    brokers = await start(tmp_path, own=PLACED if placed else None)
    try:
        if placed:
            st = await brokers["b3"].admin.status()
            assert st["placement"] == {"zone": "a", "node": "n3"}
            tel = await brokers["b3"].admin.telemetry(0)
            where = [r for r in tel["records"] if r["type"] == "placement"]
            assert where and (where[-1]["zone"], where[-1]["node"]) == ("a", "n3"), where
        await wait_standby(brokers, STANDBY_PLACED if placed else STANDBY_BY_NAME)

        clients, received, drains = await subscribe_all(brokers)
        pub = await connect(brokers["b0"].listen, client_id="p")
        await wait_settled(brokers.values())
        publisher = Publisher(pub)
        await asyncio.sleep(1.0)
        await asyncio.gather(kill(brokers, "b3"), kill(brokers, "b4"))  # node n3 goes
        survivors = {s: r for s, r in received.items() if SUBSCRIBERS[s] in brokers}

        async with asyncio.timeout(30):
            while (  # noqa: ASYNC110 - other processes
                live_edges({n: await b.admin.status() for n, b in brokers.items()})
                != SURVIVORS_TREE
            ):
                await asyncio.sleep(0.05)
        await wait_settled(brokers.values())
        await asyncio.sleep(0.5)
        last = await publisher.stop()
        await wait_for_last(survivors, last)
        for sub, got in survivors.items():
            missed, exact = verdict(got, last)
            assert not missed and exact, f"{sub}: missed {len(missed)}, exact {exact}"
        repair = (await brokers["b1"].admin.status())["repairs"]
        if placed:  # b1's chain partner is b5: its standby link is promoted at once
            assert any(r["dead"] == "b3" and r["promoted"] == ["b5"] for r in repair), repair
        else:  # b1's chain partner b4 is dead too: the bridge over b3 and b4 links b5
            assert any(r["dead"] == "b4" and r["linked"] == ["b5"] for r in repair), repair
        how = "placed" if placed else "by name, bridged"
        print(f"node n3 (b3, b4) killed ({how}): {last} events, none lost, duplicated or reordered")
        for c in [pub, *clients.values()]:
            await c.close()
        await asyncio.gather(*drains, return_exceptions=True)  # s4's ended with its broker
    finally:
        await asyncio.gather(*(b.stop() for b in brokers.values()))
