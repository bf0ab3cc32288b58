"""The demo's workload: the filters subscribers pick, the events publishers send, and the
tasks that publish, collect deliveries and report progress."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from canopy_broker.client import Client
from canopy_broker.core.events import Value
from canopy_broker.core.filters import Filter
from canopy_broker.progress import Progress, advance, report, status
from canopy_broker.progress import showing as shown
from canopy_broker.sim.checker import (
    DeliveryRecord,
    PubRecord,
    SubRecord,
)

SYMBOLS = ["ACME", "GLOBEX", "INITECH", "UMBRELLA", "HOOLI", "GRINGOTTS", "STARK", "WAYNE"]

VENUES = ["XNYS", "XNAS", "XLON"]

FILTERS = [
    'symbol = "ACME"',
    'symbol = "ACME" and price < 50',
    "price >= 90",
    'symbol prefix "G" and volume > 500',
    'venue = "XLON" and price < 20',
    'symbol = "HOOLI"',
    "volume > 950",
    'symbol contains "ST" and price > 10',
    'symbol = "WAYNE"',
    'venue != "XNYS" and volume <= 100',
    "urgent = true",
    "price < 5",
]
# One interest shared by two subscribers placed far apart in the tree: the case paper 001's
# self-organisation is for (the miner should propose bringing their brokers together).

GROUP_FILTER = 'symbol = "GLOBEX"'


def showing(phases: int) -> contextlib.AbstractContextManager[Progress]:
    """The demo's progress for its duration: a bar of ``phases`` on a terminal, else lines."""
    return shown("demo", phases)


def progress(msg: str) -> None:
    """Something the demo is doing or has seen (above the bar on a terminal)."""
    report("demo", msg)


def milestone(msg: str) -> None:
    """A phase of the demo is done: the bar advances."""
    advance("demo", msg)


@dataclass
class Subscriber:
    name: str
    broker: str
    filters: dict[str, Filter]
    client: Client | None = None
    received: list[DeliveryRecord] = field(default_factory=list)
    hops: Counter[int] = field(default_factory=Counter)


def make_event(rng: random.Random) -> dict[str, Value]:
    event: dict[str, Value] = {
        "symbol": rng.choice(SYMBOLS),
        "price": round(rng.uniform(1, 100), 2),
        "volume": rng.randint(1, 1000),
        "venue": rng.choice(VENUES),
    }
    if rng.random() < 0.05:
        event["urgent"] = True
    return event


async def collect(sub: Subscriber, stop: asyncio.Event) -> None:
    assert sub.client is not None
    arrival = 0
    while True:
        done = stop.is_set()  # read before receiving: one more pass drains what is buffered
        batch = await sub.client.receive(max_items=2000, timeout=0 if done else 0.1)
        if not batch and (done or sub.client.closed):
            # A closed connection answers at once with nothing: without this, the loop would
            # spin without ever yielding and freeze the whole demo. What it missed is then
            # reported by the delivery check.
            return
        for n in batch:
            arrival += 1
            sub.received.append(DeliveryRecord(sub.name, n.publisher, n.seq, float(arrival)))
            sub.hops[n.hops] += 1


async def publish_until(
    client: Client, rng: random.Random, rate: float, stop: asyncio.Event, log: list[PubRecord]
) -> None:
    start = time.perf_counter()
    sent = 0
    while not stop.is_set():
        due = int(rate * (time.perf_counter() - start)) - sent
        for _ in range(max(due, 0)):
            attrs = make_event(rng)
            seq = client.publish_nowait(attrs)
            log.append(PubRecord(client.client_id, seq, attrs, published_at=1.0, ended_at=1.0))
        sent += max(due, 0)
        await client.flush()
        await asyncio.sleep(0.01)


async def report_progress(subscribers: list[Subscriber], pubs: list[PubRecord], t0: float) -> None:
    while True:
        await asyncio.sleep(1.0)
        got = sum(len(s.received) for s in subscribers)
        status("demo", f"t={time.perf_counter() - t0:4.1f}s published {len(pubs)}, delivered {got}")


async def drain(
    subscribers: list[Subscriber],
    subs: list[SubRecord],
    pubs: list[PubRecord],
    quiet: float = 1.5,
    give_up_after: float = 30.0,
) -> None:
    """Wait until every owed notification arrived, or nothing arrived for ``quiet`` seconds."""
    owed = sum(
        1 for p in pubs for s in subscribers if any(f.matches(p.attrs) for f in s.filters.values())
    )
    deadline = time.perf_counter() + give_up_after
    last, last_change = -1, time.perf_counter()
    while time.perf_counter() < deadline:
        got = sum(len(s.received) for s in subscribers)
        if got >= owed:
            return
        if got != last:
            last, last_change = got, time.perf_counter()
        elif time.perf_counter() - last_change > quiet:
            return
        await asyncio.sleep(0.05)


def hops_of(subscribers: list[Subscriber]) -> Counter[int]:
    return sum((s.hops for s in subscribers), Counter())


def mean_hops_between(early: Counter[int], late: Counter[int]) -> float:
    window = late - early
    n = sum(window.values())
    return sum(h * c for h, c in window.items()) / n if n else 0.0
