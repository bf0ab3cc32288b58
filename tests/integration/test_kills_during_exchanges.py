"""Issue 12, item 7 on real processes: in an overlay of 8 brokers under 1,000 events/s, while
link exchanges run back and forth, an inner broker and then a leaf are SIGKILLed. Everybody not
attached to a victim gets every notification once and in order; the victims' clients fail over
(the subscriber to a neighbour, the publisher sending again what was not acknowledged) and, from
where they are, miss nothing either."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from canopy_broker.client import Client, Gap, Notification, connect
from canopy_broker.procs import Overlay
from tests.integration.crash_overlay import drain, kill, verdict

pytestmark = pytest.mark.integration

NAMES = [f"b{i}" for i in range(8)]
# b3 (inner: b1, b4, b5) and b7 (a leaf under b6) die; the exchanges swap b1-b2 and b0-b2.
EDGES = [("b0", "b1"), ("b1", "b2"), ("b1", "b3"), ("b3", "b4"), ("b3", "b5"), ("b5", "b6")]
EDGES.append(("b6", "b7"))
ARGS = ("--heartbeat", "0.2", "--dead-after", "3")


async def publish(pub: Client, stop: asyncio.Event, count: list[int], burst: int) -> None:
    """``burst`` events every 10 ms, through the failover of the publisher's broker."""
    while not stop.is_set():
        for _ in range(burst):
            count[0] = await pub.publish({"n": count[0] + 1})
        await asyncio.sleep(0.01)


async def exchanges(ov: Overlay, stop: asyncio.Event, done: list[str]) -> None:
    """b1-b2 <-> b0-b2, again and again (the cycle b0-b1-b2 has no victim on it)."""
    while not stop.is_set():
        await ov.exchange(["b0", "b1", "b2"], ("b1", "b2"))
        await ov.exchange(["b1", "b0", "b2"], ("b0", "b2"))
        done.append("x2")


async def test_an_inner_broker_and_a_leaf_killed_while_exchanges_run(tmp_path: Path) -> None:
    async with Overlay(NAMES, EDGES, log_dir=tmp_path, extra_args=ARGS) as ov:
        received: dict[str, list[Notification]] = {}
        clients: list[Client] = []
        tasks: list[asyncio.Task[None]] = []
        gaps: list[Gap] = []
        for b in NAMES:
            c = await connect(ov[b].listen, client_id=f"s{b[1:]}", on_gap=gaps.append)
            await c.subscribe("n >= 0", sub_id="all")
            received[c.client_id] = []
            clients.append(c)
            tasks.append(asyncio.create_task(drain(c, received[c.client_id])))
        pubs = {b: await connect(ov[b].listen, client_id=f"p{b[1:]}") for b in ("b0", "b3", "b7")}
        await ov.settle()

        stop = asyncio.Event()
        counts = {b: [0] for b in pubs}
        bursts = {"b0": 10, "b3": 3, "b7": 3}  # ~1,000 events/s from b0, ~300/s from each victim
        publishers = [
            asyncio.create_task(publish(pubs[b], stop, counts[b], bursts[b])) for b in pubs
        ]
        swaps: list[str] = []
        exchanger = asyncio.create_task(exchanges(ov, stop, swaps))
        await asyncio.sleep(1.5)
        await kill(ov.brokers, "b3")
        await asyncio.sleep(2.0)
        await kill(ov.brokers, "b7")
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*publishers)
        await exchanger
        for p in pubs.values():
            assert await p.wait_acknowledged(10.0), p.client_id
        last = {f"p{b[1:]}": counts[b][0] for b in pubs}
        assert last["p0"] > 3000 and swaps, (last, swaps)

        def missing() -> int:
            return sum(
                len(verdict(got, n, p)[0]) for got in received.values() for p, n in last.items()
            )

        async def everyone_has_everything() -> None:
            while missing():  # noqa: ASYNC110 - polling what other processes delivered
                await asyncio.sleep(0.1)

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(20):
                await everyone_has_everything()
        report = {
            (sub, p): verdict(got, n, p) for sub, got in received.items() for p, n in last.items()
        }
        bad = {
            k: (len(missed), exact) for k, (missed, exact) in report.items() if missed or not exact
        }
        assert not bad, f"(lost, exactly once in order) per (subscriber, publisher): {bad}"
        orphans = [c for c in clients if c.client_id in ("s3", "s7")]
        assert [c.failovers for c in orphans] == [1, 1]
        assert {c.broker for c in orphans} <= {"b1", "b4", "b5", "b6"}
        assert pubs["b3"].failovers == pubs["b7"].failovers == 1
        assert gaps == [], [str(g) for g in gaps]

        for c in [*clients, *pubs.values()]:
            await c.close()
        for t in tasks:
            await t
