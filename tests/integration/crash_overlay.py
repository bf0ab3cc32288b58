"""The overlay of issue 12's report, started as real broker processes, and what the crash tests
do with it: subscribers on four brokers, draining into lists, and the live edges seen in the
brokers' status."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

from canopy_broker.client import Client, Gap, Notification, connect
from canopy_broker.procs import BrokerProc, spawn_broker

# The overlay: b3 is the inner broker whose death cut b4, b5 and b6 off for good.
NAMES = ["b0", "b1", "b2", "b3", "b4", "b5", "b6"]
EDGES = [("b0", "b1"), ("b1", "b2"), ("b1", "b3"), ("b3", "b4"), ("b3", "b5"), ("b5", "b6")]
SUBSCRIBERS = {"s0": "b0", "s2": "b2", "s4": "b4", "s6": "b6"}
FILTER = "n >= 0"
HEARTBEAT = ("--heartbeat", "0.2", "--dead-after", "3")  # declared dead 0.6 s after the loss
# The tree once b3 is dead and repaired: b3's neighbours b1, b4, b5 chain up (b1-b4, b4-b5).
REPAIRED = {("b0", "b1"), ("b1", "b2"), ("b1", "b4"), ("b4", "b5"), ("b5", "b6")}


async def start(
    tmp_path: Path, *extra: str, own: dict[str, tuple[str, ...]] | None = None
) -> dict[str, BrokerProc]:
    """The brokers, linked by ``add_link`` only: nobody is given the others' addresses, so the
    repair links are dialed with addresses the brokers told each other (F_PEERS). ``own``:
    arguments for some brokers only (their placement, say)."""
    procs = await asyncio.gather(
        *(
            spawn_broker(
                n, log_dir=tmp_path, extra_args=(*HEARTBEAT, *extra, *(own or {}).get(n, ()))
            )
            for n in NAMES
        )
    )
    brokers = {p.name: p for p in procs}
    for a, b in EDGES:
        result = await brokers[a].admin.add_link(b, brokers[b].link_address, wait=10)
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


class Publisher:
    """Publishes ``{"n": 1, 2, ...}`` at about 1,000 events/s until stopped, noting when each
    went out (to count what was published while the tree was torn)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.published: list[tuple[int, float]] = []  # (seq, time.monotonic())
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            for _ in range(10):
                n += 1
                self.client.publish_nowait({"n": n})
                self.published.append((n, time.monotonic()))
            await self.client.flush()
            await asyncio.sleep(0.01)  # ~1,000 events/s

    async def stop(self) -> int:
        """Stop; the last sequence number published."""
        self._stop.set()
        await self._task
        await self.client.flush()
        return self.published[-1][0]

    def between(self, start: float, end: float) -> int:
        return sum(1 for _, when in self.published if start <= when <= end)


async def kill_under_traffic(
    brokers: dict[str, BrokerProc], pub: Client, victim: str = "b3"
) -> tuple[Publisher, float, float]:
    """Start publishing on ``pub``, SIGKILL ``victim`` a second later (removed from
    ``brokers``); the publisher, and when it was killed: (time.monotonic(), time.time())."""
    publisher = Publisher(pub)
    await asyncio.sleep(1.0)
    proc = brokers.pop(victim)
    killed = time.monotonic(), time.time()
    proc.kill()
    await proc.stop()
    return publisher, *killed


async def wait_repaired(brokers: dict[str, BrokerProc], within: float = 15.0) -> None:
    """Until the survivors' links are those of the repaired tree."""

    async def repaired() -> bool:
        return live_edges({n: await b.admin.status() for n, b in brokers.items()}) == REPAIRED

    async with asyncio.timeout(within):
        while not await repaired():  # noqa: ASYNC110 - polling other processes
            await asyncio.sleep(0.05)


async def repair_records(
    brokers: dict[str, BrokerProc], dead: str, within: float = 15.0
) -> dict[str, dict[str, Any]]:
    """Each of the dead broker's neighbours' record of its repair, once complete there."""
    chain = {"b3": ("b1", "b4", "b5")}[dead]
    async with asyncio.timeout(within):
        while True:
            recs = {n: (await brokers[n].admin.status())["repairs"] for n in chain}
            last = {n: r[-1] for n, r in recs.items() if r and r[-1]["dead"] == dead}
            if len(last) == len(chain) and all("complete_at" in r for r in last.values()):
                return last
            await asyncio.sleep(0.02)


async def publish_steadily(pub: Client, stop: asyncio.Event, published: list[int]) -> None:
    """About 1,000 events/s in bursts of 10, through failovers (publish waits as it must)."""
    n = 0
    while not stop.is_set():
        for _ in range(10):
            n += 1
            await pub.publish({"n": n})
            published.append(n)
        await asyncio.sleep(0.01)


async def kill(brokers: dict[str, BrokerProc], name: str, *, frozen_for: float = 0.0) -> None:
    """SIGKILL ``name`` (removed from ``brokers``); ``frozen_for``: SIGSTOP it that long first,
    so that what its clients send meanwhile is in its socket buffers, taken by the kernel and
    never by the broker."""
    victim = brokers.pop(name)
    if frozen_for:
        os.kill(victim.pid, signal.SIGSTOP)
        await asyncio.sleep(frozen_for)
    victim.kill()
    await victim.stop()


def verdict(
    got: list[Notification], last: int, publisher: str | None = None
) -> tuple[list[int], bool]:
    """(missed sequence numbers, exactly 1..last once and in order) for ``publisher``'s
    notifications (None: all of them, which must then be one publisher's)."""
    seqs = [n.seq for n in got if publisher is None or n.publisher == publisher]
    missed = sorted(set(range(1, last + 1)) - set(seqs))
    return missed, seqs == list(range(1, last + 1))


async def wait_for_last(received: dict[str, list[Notification]], last: int) -> None:
    """Until every subscriber's latest notification is ``last`` or later (20 s at most)."""
    async with asyncio.timeout(20):
        while any(not r or r[-1].seq < last for r in received.values()):  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def assert_all_delivered(received: dict[str, list[Notification]], last: int) -> None:
    """Every subscriber gets 1..last once and in order (waiting for stragglers first)."""
    await wait_for_last(received, last)
    for sub, got in received.items():
        missed, exact = verdict(got, last)
        assert not missed, f"{sub} missed {len(missed)}: {missed[:10]}..."
        assert exact, f"{sub}: duplicated or reordered"


async def assert_streams(
    received: dict[str, list[Notification]],
    published: dict[str, list[int]],
    gaps: dict[str, list[Gap]],
    *,
    failed_over: str,
    first: dict[str, int] | None = None,
    also_told: tuple[str, ...] = (),
) -> None:
    """Wait until every subscriber has each publisher's last event, then check every stream:
    in order and without duplicates; nothing missed from ``first[publisher]`` (1 by default)
    on, except by the subscriber that ``failed_over`` (and those ``also_told``), which is told
    of anything it missed."""
    last = {p: seqs[-1] for p, seqs in published.items()}
    async with asyncio.timeout(20):
        while any(  # noqa: ASYNC110
            [n.seq for n in got if n.publisher == p][-1:] != [last[p]]
            for got in received.values()
            for p in last
        ):
            await asyncio.sleep(0.05)
    for sub, got in received.items():
        for p, end in last.items():
            seqs = [n.seq for n in got if n.publisher == p]
            assert seqs == sorted(set(seqs)), f"{sub} from {p}: duplicated or reordered"
            missed = sorted(set(range((first or {}).get(p, 1), end + 1)) - set(seqs))
            if sub != failed_over and sub not in also_told:
                assert not missed, f"{sub} from {p}: missed {len(missed)}: {missed[:10]}"
            elif missed:  # anything it missed, it is told of
                assert gaps[sub], f"{sub} missed {len(missed)} from {p} untold: {missed[:10]}"


async def attach_clients(
    brokers: dict[str, BrokerProc],
) -> tuple[list[Client], dict[str, list[Notification]], dict[str, list[Gap]], dict[str, Client]]:
    """On each broker ``bN``: subscriber ``sN`` to everything, gaps recorded, and publisher
    ``pN``. Returns every client, what each subscriber receives, its gaps, the publishers."""
    clients: list[Client] = []
    received: dict[str, list[Notification]] = {}
    gaps: dict[str, list[Gap]] = {}
    for n, broker in brokers.items():
        sid = f"s{n[1:]}"
        received[sid], gaps[sid] = [], []
        c = await connect(
            broker.listen,
            client_id=sid,
            on_gap=gaps[sid].append,
            on_notifications=received[sid].extend,
        )
        await c.subscribe(FILTER)
        clients.append(c)
    pubs = {f"p{n[1:]}": await connect(b.listen, client_id=f"p{n[1:]}") for n, b in brokers.items()}
    return [*clients, *pubs.values()], received, gaps, pubs
