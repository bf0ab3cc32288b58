"""The overlay of issue 12's report, started as real broker processes, and what the crash tests
do with it: subscribers on four brokers, draining into lists, and the live edges seen in the
brokers' status."""

from __future__ import annotations

import asyncio
from pathlib import Path

from canopy_broker.client import Client, Notification, connect
from canopy_broker.procs import BrokerProc, spawn_broker

# The overlay: b3 is the inner broker whose death cut b4, b5 and b6 off for good.
NAMES = ["b0", "b1", "b2", "b3", "b4", "b5", "b6"]
EDGES = [("b0", "b1"), ("b1", "b2"), ("b1", "b3"), ("b3", "b4"), ("b3", "b5"), ("b5", "b6")]
SUBSCRIBERS = {"s0": "b0", "s2": "b2", "s4": "b4", "s6": "b6"}
FILTER = "n >= 0"
HEARTBEAT = ("--heartbeat", "0.2", "--dead-after", "3")  # declared dead 0.6 s after the loss


async def start(tmp_path: Path, *extra: str) -> dict[str, BrokerProc]:
    """The brokers, linked by ``add_link`` only: nobody is given the others' addresses, so the
    repair links are dialed with addresses the brokers told each other (F_PEERS)."""
    procs = await asyncio.gather(
        *(spawn_broker(n, log_dir=tmp_path, extra_args=(*HEARTBEAT, *extra)) for n in NAMES)
    )
    brokers = {p.name: p for p in procs}
    for a, b in EDGES:
        result = await brokers[a].admin.add_link(b, brokers[b].listen, wait=10)
        assert result["up"], (a, b)
    return brokers


async def drain(client: Client, into: list[Notification]) -> None:
    while batch := await client.receive(1000):
        into.extend(batch)


async def subscribe_all(
    brokers: dict[str, BrokerProc],
) -> tuple[dict[str, Client], dict[str, list[Notification]], list[asyncio.Task[None]]]:
    received: dict[str, list[Notification]] = {s: [] for s in SUBSCRIBERS}
    clients: dict[str, Client] = {}
    drains = []
    for sub, b in SUBSCRIBERS.items():
        clients[sub] = c = await connect(brokers[b].listen, client_id=sub)
        await c.subscribe(FILTER, sub_id="all")
        drains.append(asyncio.create_task(drain(c, received[sub])))
    return clients, received, drains


async def close_all(clients: list[Client], drains: list[asyncio.Task[None]]) -> None:
    for c in clients:
        await c.close()
    for d in drains:
        await d


def live_edges(statuses: dict[str, dict[str, object]]) -> set[tuple[str, str]]:
    edges = set()
    for name, st in statuses.items():
        for n in st["neighbours"]:  # type: ignore[attr-defined]
            edges.add(tuple(sorted((name, n["peer"]))))
    return edges  # type: ignore[return-value]
