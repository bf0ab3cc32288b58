"""`canopy demo`: a local overlay under live traffic, with a verified delivery report.

Broker processes start on 127.0.0.1 in a random tree (fan-out ≤ 3); subscribers with content
filters attach to different brokers; once the subscriptions have settled everywhere, publishers on
other brokers stream notifications for a few seconds. Every delivery is then judged by the same
checker the simulator uses: each subscriber must receive exactly the notifications its filters
match (computed centrally, not by the brokers), once each, in every publisher's order. The exit
code says whether that held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from canopy_broker.client import Client, connect
from canopy_broker.core.events import Value
from canopy_broker.core.filters import Filter
from canopy_broker.procs import Overlay
from canopy_broker.sim.checker import (
    DeliveryRecord,
    DeliveryReport,
    PubRecord,
    SubRecord,
    check_deliveries,
)
from canopy_broker.sim.topology import random_tree

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


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo", help="local brokers, live traffic, verified delivery report (no cluster needed)"
    )
    p.add_argument("--brokers", type=int, default=7, help="broker processes (default 7)")
    p.add_argument("--subscribers", type=int, default=12)
    p.add_argument("--publishers", type=int, default=3)
    p.add_argument("--duration", type=float, default=5.0, help="seconds of traffic")
    p.add_argument("--rate", type=int, default=3000, help="notifications/s, all publishers")
    p.add_argument("--routing", choices=["simple", "identity", "covering"], default="covering")
    p.add_argument("--seed", type=int, default=None, help="topology and workload seed")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    p.set_defaults(func=run)


def progress(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


@dataclass
class Subscriber:
    name: str
    broker: str
    filters: dict[str, Filter]
    client: Client | None = None
    received: list[DeliveryRecord] = field(default_factory=list)
    hops: Counter[int] = field(default_factory=Counter)


def draw_tree(names: list[str], edges: list[tuple[str, str]]) -> str:
    """An indented drawing of the tree rooted at the first broker."""
    adj: dict[str, list[str]] = {n: [] for n in names}
    for a, b in edges:
        adj[a].append(b)
        adj[b].append(a)
    lines: list[str] = []

    def walk(node: str, parent: str | None, prefix: str, last: bool, root: bool) -> None:
        lines.append(node if root else f"{prefix}{'└── ' if last else '├── '}{node}")
        children = sorted(c for c in adj[node] if c != parent)
        for i, child in enumerate(children):
            ext = "" if root else ("    " if last else "│   ")
            walk(child, node, prefix + ext, i == len(children) - 1, False)

    walk(names[0], None, "", True, True)
    return "\n".join(lines)


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


async def _collect(sub: Subscriber, stop: asyncio.Event) -> None:
    assert sub.client is not None
    arrival = 0
    while True:
        done = stop.is_set()  # read before receiving: one more pass drains what is buffered
        batch = await sub.client.receive(max_items=2000, timeout=0 if done else 0.1)
        if done and not batch:
            return
        for n in batch:
            arrival += 1
            sub.received.append(DeliveryRecord(sub.name, n.publisher, n.seq, float(arrival)))
            sub.hops[n.hops] += 1


async def _publish(
    client: Client, rng: random.Random, rate: float, duration: float, log: list[PubRecord]
) -> None:
    tick = 0.01
    start = time.perf_counter()
    sent = 0
    while (elapsed := time.perf_counter() - start) < duration:
        due = int(rate * elapsed) - sent
        for _ in range(due):
            attrs = make_event(rng)
            seq = client.publish_nowait(attrs)
            log.append(PubRecord(client.client_id, seq, attrs, published_at=1.0, ended_at=1.0))
        sent += max(due, 0)
        await client.flush()
        await asyncio.sleep(tick)


async def demo(args: argparse.Namespace) -> dict[str, Any]:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    rng = random.Random(seed)
    n = max(2, args.brokers)
    edges = random_tree(n, rng, max_fanout=3)
    names = [f"b{i}" for i in range(n)]
    print(f"Overlay of {n} brokers (seed {seed}, {args.routing} routing):")
    print(draw_tree(names, edges))
    progress(f"starting {n} broker processes on 127.0.0.1 ...")
    async with Overlay(names, edges, routing=args.routing) as overlay:
        subscribers = []
        for i in range(args.subscribers):
            chosen = rng.sample(FILTERS, rng.choice([1, 1, 2]))
            subscribers.append(
                Subscriber(
                    f"sub{i}",
                    rng.choice(names),
                    {f"s{k}": Filter.parse(t) for k, t in enumerate(chosen)},
                )
            )
        pub_brokers = [rng.choice(names) for _ in range(args.publishers)]
        clients: list[Client] = []
        try:
            for s in subscribers:
                s.client = await connect(overlay[s.broker].listen, client_id=s.name)
                clients.append(s.client)
                for sub_id, f in s.filters.items():
                    await s.client.subscribe(str(f), sub_id=sub_id)
            progress("subscriptions sent; waiting until routing has settled on every broker")
            tables = await overlay.settle()
            entries = sum(len(keys) for t in tables for keys in t["table"]["links"].values())
            publishers = []
            for i, b in enumerate(pub_brokers):
                c = await connect(overlay[b].listen, client_id=f"pub{i}")
                clients.append(c)
                publishers.append(c)
            pubs: list[PubRecord] = []
            stop = asyncio.Event()
            collectors = [asyncio.create_task(_collect(s, stop)) for s in subscribers]
            progress(
                f"publishing ~{args.rate}/s from {len(publishers)} publishers for "
                f"{args.duration:.0f}s"
            )
            t0 = time.perf_counter()
            ticker = asyncio.create_task(_ticker(subscribers, pubs, t0))
            per_pub = args.rate / max(1, len(publishers))
            await asyncio.gather(
                *(
                    _publish(c, random.Random(seed + i + 1), per_pub, args.duration, pubs)
                    for i, c in enumerate(publishers)
                )
            )
            publish_wall = time.perf_counter() - t0
            subs_records = [
                SubRecord(s.name, sid, f, issued_at=0.0, settled_at=0.0)
                for s in subscribers
                for sid, f in s.filters.items()
            ]
            await _drain(subscribers, subs_records, pubs)
            ticker.cancel()
            stop.set()
            await asyncio.gather(*collectors, ticker, return_exceptions=True)
        finally:
            for c in clients:
                await c.close()
    report = check_deliveries(subs_records, pubs, [d for s in subscribers for d in s.received])
    return _summarise(
        args,
        seed=seed,
        subscribers=subscribers,
        pubs=pubs,
        report=report,
        publish_wall=publish_wall,
        entries=entries,
        subs=subs_records,
    )


async def _ticker(subscribers: list[Subscriber], pubs: list[PubRecord], t0: float) -> None:
    while True:
        await asyncio.sleep(1.0)
        got = sum(len(s.received) for s in subscribers)
        progress(f"t={time.perf_counter() - t0:4.1f}s published {len(pubs)}, delivered {got}")


async def _drain(
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


def _summarise(
    args: argparse.Namespace,
    *,
    seed: int,
    subscribers: list[Subscriber],
    pubs: list[PubRecord],
    report: DeliveryReport,
    publish_wall: float,
    entries: int,
    subs: list[SubRecord],
) -> dict[str, Any]:
    owed_by: Counter[str] = Counter(c for c, _, _ in report.lost)
    print()
    print(
        f"{'subscriber':<10} {'broker':<6} {'owed':>6} {'got':>6} {'lost':>5} {'dup':>4} "
        f"{'reord':>5}  filter"
    )
    for s in subscribers:
        owed = sum(1 for p in pubs if any(f.matches(p.attrs) for f in s.filters.values()))
        dup = sum(1 for c, _, _ in report.duplicated if c == s.name)
        reord = sum(1 for c, _, _ in report.reordered if c == s.name)
        print(
            f"{s.name:<10} {s.broker:<6} {owed:>6} {len(s.received):>6} "
            f"{owed_by[s.name]:>5} {dup:>4} {reord:>5}  "
            + " | ".join(str(f) for f in s.filters.values())
        )
    hops: Counter[int] = sum((s.hops for s in subscribers), Counter())
    delivered = sum(hops.values())
    mean_hops = sum(h * c for h, c in hops.items()) / delivered if delivered else 0.0
    print()
    print(
        f"published {len(pubs)} notifications in {publish_wall:.1f}s "
        f"({len(pubs) / publish_wall:.0f}/s); delivered {delivered}; "
        f"mean overlay hops per delivery {mean_hops:.2f}; {entries} routing entries"
    )
    print(f"verified: {report}")
    return {
        "ok": report.ok and report.owed > 0,
        "seed": seed,
        "brokers": args.brokers,
        "routing": args.routing,
        "published": len(pubs),
        "publish_rate": round(len(pubs) / publish_wall, 1),
        "mean_hops": round(mean_hops, 3),
        "routing_entries": entries,
        "subscriptions": len(subs),
        **report.summary(),
    }


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(demo(args))
    if args.json:
        print(json.dumps(result))
    if not result["ok"]:
        print("DEMO FAILED: deliveries did not match what the filters owe", file=sys.stderr)
        return 1
    return 0
