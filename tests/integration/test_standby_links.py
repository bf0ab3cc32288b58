"""Standby links on real processes (paper 003 with paper 001's chain): before anything fails,
b3's neighbours b1, b4, b5 keep heartbeat-only connections b1-b4 and b4-b5 (the chain b3's
death would need); after a SIGKILL of b3 under ~1,000 events/s, the repair promotes them into
overlay links instead of dialing, and the subscribers not on b3 get every event once, in order.

Run with ``--no-standby`` too, as the control: the same kill, the same checks, the repair links
dialed. Both print the time from the kill to the repair complete on all of b3's neighbours
(routes known over the whole chain and the retained notifications replayed), so the two can be
compared on the same scenario.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from canopy_broker.client import connect
from canopy_broker.procs import wait_settled
from tests.integration.crash_overlay import (
    assert_all_delivered,
    close_all,
    kill_under_traffic,
    repair_records,
    start,
    subscribe_all,
    wait_repaired,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("standby", [True, False], ids=["standby", "no-standby"])
async def test_a_repair_promotes_the_standby_links(tmp_path: Path, standby: bool) -> None:
    brokers = await start(tmp_path, *(() if standby else ("--no-standby",)))
    try:
        clients, received, drains = await subscribe_all(brokers)
        pub = await connect(brokers["b0"].listen, client_id="p")
        await wait_settled(brokers.values())

        async def standby_links() -> set[tuple[str, str]]:
            found = set()
            for n, b in brokers.items():
                for s in (await b.admin.status())["standby"]:
                    if s["state"] == "up":
                        found.add(tuple(sorted((n, s["peer"]))))
            return found  # type: ignore[return-value]

        # The chain links of every single failure of the tree b0-b1, b1-b2, b1-b3, b3-b4,
        # b3-b5, b5-b6: b1's death links b0-b2-b3, b3's b1-b4-b5, b5's b3-b6.
        want = {("b0", "b2"), ("b2", "b3"), ("b1", "b4"), ("b4", "b5"), ("b3", "b6")}
        async with asyncio.timeout(10):
            while await standby_links() != (want if standby else set()):  # noqa: ASYNC110
                await asyncio.sleep(0.05)

        publisher, _, killed_wall = await kill_under_traffic(brokers, pub)
        records = await repair_records(brokers, "b3")
        detected_s = max(r["at"] for r in records.values()) - killed_wall
        complete_s = max(r["complete_at"] for r in records.values()) - killed_wall
        await wait_repaired(brokers)
        await wait_settled(brokers.values())
        await asyncio.sleep(0.5)
        last = await publisher.stop()
        await assert_all_delivered(received, last)

        # The repair links' connections, and the dialed links' data refused before the other
        # end's core had opened them (each refusal costs a reconnect).
        connects, refused = 0, 0
        for n, peer in (("b1", "b4"), ("b4", "b1"), ("b4", "b5"), ("b5", "b4")):
            st = await brokers[n].admin.status()
            connects += next(x["connects"] for x in st["neighbours"] if x["peer"] == peer)
        for n in ("b1", "b4", "b5"):
            for line in (await brokers[n].admin.metrics()).splitlines():
                if line.startswith("canopy_malformed_frames_total") and "not-open" in line:
                    refused += int(float(line.split()[-1]))
        promoted = {n: r["promoted"] for n, r in records.items()}
        dialed = {n: r["dialed"] for n, r in records.items()}
        if standby:
            assert promoted == {"b1": ["b4"], "b4": ["b1", "b5"], "b5": ["b4"]}, records
            assert not any(dialed.values()), records
            metrics = await brokers["b4"].admin.metrics()
            assert "canopy_repair_links_promoted_total 2.0" in metrics
            for n, peer in (("b1", "b4"), ("b4", "b1"), ("b4", "b5"), ("b5", "b4")):
                lk = next(
                    x for x in (await brokers[n].admin.status())["neighbours"] if x["peer"] == peer
                )
                assert lk["promoted"] and lk["connects"] == 1, (n, lk)  # no new connection
        else:
            assert dialed == {"b1": ["b4"], "b4": ["b1", "b5"], "b5": ["b4"]}, records
            assert not any(promoted.values()), records
        print(
            f"{'standby' if standby else 'no-standby'}: kill -> repair complete on b1, b4, b5 "
            f"{complete_s * 1000:.0f} ms = last detection {detected_s * 1000:.0f} ms + "
            f"{(complete_s - detected_s) * 1000:.1f} ms of repair (detection timeout 600 ms, "
            f"heartbeat 200 ms); promoted {promoted}, dialed {dialed}; {connects} connection(s) "
            f"at the 4 repair link ends, {refused} early data refused; "
            f"{last} events, none lost, duplicated or reordered"
        )
        await close_all([pub, *clients.values()], drains)
    finally:
        await asyncio.gather(*(b.stop() for b in brokers.values()))
