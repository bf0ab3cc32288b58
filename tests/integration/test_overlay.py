"""Real broker processes on 127.0.0.1: exact delivery over a tree, faults, garbage, shutdown.

The expected deliveries are computed centrally from the filters (``Filter.matches``), never by
asking the brokers, and subscriptions are allowed to settle (every link up, every queue
acknowledged, routing tables unchanged) before anything is published.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from canopy_broker.client import Client, Notification, connect
from canopy_broker.core.events import Value, is_sampled
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import RoutingMode
from canopy_broker.procs import Overlay, wait_settled
from canopy_broker.sim.checker import canonical_tables

pytestmark = pytest.mark.integration

NAMES = ["b1", "b2", "b3", "b4", "b5", "b6"]
EDGES = [("b1", "b2"), ("b1", "b3"), ("b2", "b4"), ("b2", "b5"), ("b3", "b6")]  # (dialer, peer)
SYMBOLS = ["ACME", "BOLT", "CRUX", "DYNE", "EPIC"]


@pytest.fixture
async def overlay(tmp_path: Path) -> AsyncIterator[Overlay]:
    async with Overlay(NAMES, EDGES, log_dir=tmp_path) as ov:
        yield ov


class Subscriber:
    """A client with its filters and everything it received (drained by a background task)."""

    def __init__(self, name: str, broker: str, filters: dict[str, str]) -> None:
        self.name = name
        self.broker = broker
        self.filters = {sid: Filter.parse(text) for sid, text in filters.items()}
        self.client: Client | None = None
        self.received: list[Notification] = []
        self.task: asyncio.Task[None] | None = None

    async def start(self, ov: Overlay) -> None:
        self.client = await connect(ov[self.broker].listen, client_id=self.name)
        for sid, f in self.filters.items():
            await self.client.subscribe(f, sub_id=sid)
        self.task = asyncio.create_task(self._drain(self.client))

    async def _drain(self, client: Client) -> None:
        while batch := await client.receive(5000):
            self.received.extend(batch)

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.task is not None:
            await self.task

    def expected(
        self, published: dict[str, list[dict[str, Value]]]
    ) -> list[tuple[str, int, tuple[str, ...]]]:
        """(publisher, seq, matching sub ids) for every event this subscriber must get."""
        out = []
        for pub, events in published.items():
            for seq, attrs in enumerate(events, start=1):
                subs = tuple(sorted(s for s, f in self.filters.items() if f.matches(attrs)))
                if subs:
                    out.append((pub, seq, subs))
        return out


def random_filter(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return f'symbol = "{rng.choice(SYMBOLS)}" and price < {rng.randint(10, 90)}'
    if kind == 1:
        return f"price >= {rng.randint(0, 80)} and price < {rng.randint(50, 100)}"
    if kind == 2:
        return f'side = "buy" and symbol prefix "{rng.choice(SYMBOLS)[0]}"'
    return f"qty > {rng.randint(0, 900)}"


def random_event(rng: random.Random) -> dict[str, Value]:
    return {
        "symbol": rng.choice(SYMBOLS),
        "price": round(rng.uniform(0, 100), 2),
        "side": rng.choice(["buy", "sell"]),
        "qty": rng.randint(1, 1000),
    }


def check_exact(sub: Subscriber, published: dict[str, list[dict[str, Value]]]) -> None:
    """Every matching event exactly once, with the right sub ids, in per-publisher order."""
    got = [(n.publisher, n.seq, n.sub_ids) for n in sub.received]
    want = sub.expected(published)
    assert len(got) == len(set(got)), f"{sub.name}: duplicates"
    assert sorted(got) == sorted(want), f"{sub.name}: wrong set of notifications"
    for pub in published:
        seqs = [s for p, s, _ in got if p == pub]
        assert seqs == sorted(seqs), f"{sub.name}: {pub}'s notifications out of order"
    for n in sub.received:
        assert n.attrs == published[n.publisher][n.seq - 1]


async def wait_for_counts(subs: list[Subscriber], published: dict[str, Any], within: float) -> None:
    async with asyncio.timeout(within):
        while any(len(s.received) < len(s.expected(published)) for s in subs):  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_tree_delivers_exactly_once_in_order_despite_faults(overlay: Overlay) -> None:
    rng = random.Random(2024)
    subs = [
        Subscriber(
            f"sub{i}",
            NAMES[i % len(NAMES)],
            {f"f{j}": random_filter(rng) for j in range(rng.randint(1, 3))},
        )
        for i in range(10)
    ]
    leaver = Subscriber("leaver", "b5", {"all": "true"})
    for s in [*subs, leaver]:
        await s.start(overlay)
    pubs = {
        name: await connect(overlay[b].listen, client_id=name)
        for name, b in (("pubA", "b4"), ("pubB", "b6"), ("pubC", "b1"))
    }
    await overlay.settle()

    published: dict[str, list[dict[str, Value]]] = {p: [] for p in pubs}
    for round_ in range(8):
        for name, client in pubs.items():
            for _ in range(60):
                attrs = random_event(rng)
                client.publish_nowait(attrs)
                published[name].append(attrs)
            await client.flush()
        if round_ == 3:  # mid-stream faults, with traffic in flight
            assert leaver.client is not None
            leaver.client.abort()  # a subscriber crashes
            assert await overlay["b2"].admin.drop_link_connection("b4")  # dialer's end
            assert await overlay["b6"].admin.drop_link_connection("b3")  # acceptor's end

    await wait_for_counts(subs, published, within=60)
    tables = await overlay.settle()
    for s in subs:
        check_exact(s, published)
    by_name = {t["broker"]: t for t in tables}
    assert "leaver" not in by_name["b5"]["table"]["clients"]
    status = await overlay["b2"].admin.status()
    b4 = next(n for n in status["neighbours"] if n["peer"] == "b4")
    assert b4["connects"] >= 2 and b4["state"] == "up"
    for client in pubs.values():
        await client.close()
    for s in [*subs, leaver]:
        await s.stop()
    for s in subs:  # nothing arrived late, after the checks
        check_exact(s, published)


async def test_garbage_closes_only_that_connection(overlay: Overlay) -> None:
    sub = Subscriber("watcher", "b3", {"x": "n >= 0"})
    await sub.start(overlay)
    await overlay.settle()
    host, port = overlay["b3"].listen.rsplit(":", 1)
    rng = random.Random(5)
    for garbage in (
        rng.randbytes(64),
        b"\x7f\xff\xff\xff" + rng.randbytes(100),
        b"\x00\x00\x00\x02{]",
    ):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(garbage)
        async with asyncio.timeout(10):
            await reader.read()  # the broker closes this connection...
        writer.close()
        await writer.wait_closed()
    async with await connect(overlay["b6"].listen, client_id="p") as pub:
        for n in range(20):
            pub.publish_nowait({"n": n})
    await wait_for_counts([sub], {"p": [{"n": n} for n in range(20)]}, within=20)
    metrics = await overlay["b3"].admin.metrics()
    assert "canopy_malformed_frames_total" in metrics  # ...and counts it; it still serves others
    await sub.stop()
    check_exact(sub, {"p": [{"n": n} for n in range(20)]})


async def test_sigterm_stops_gracefully_and_peers_notice(tmp_path: Path) -> None:
    async with Overlay(["x", "y"], [("x", "y")], log_dir=tmp_path) as ov:
        proc = ov["y"].process
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await proc.wait() == 0
        async with asyncio.timeout(15):
            while (await ov["x"].admin.status())["neighbours"][0]["state"] == "up":  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    assert "stopped" in (tmp_path / "y.log").read_text()


async def test_telemetry_is_consistent_across_brokers_and_written_to_disk(tmp_path: Path) -> None:
    tdir = tmp_path / "telemetry"
    args = ["--telemetry-sample", "0.3", "--telemetry-dir", str(tdir)]
    async with Overlay(
        ["t1", "t2", "t3"], [("t1", "t2"), ("t2", "t3")], log_dir=tmp_path, extra_args=args
    ) as ov:
        sub = Subscriber("s", "t3", {"a": "i >= 0"})
        await sub.start(ov)
        await ov.settle()
        async with await connect(ov["t1"].listen, client_id="tp") as pub:
            for i in range(300):
                pub.publish_nowait({"i": i})
        published = {"tp": [{"i": i} for i in range(300)]}
        await wait_for_counts([sub], published, within=30)
        await wait_settled(ov.brokers.values())
        pulled = {n: (await ov[n].admin.telemetry())["records"] for n in ("t1", "t2", "t3")}
        await sub.stop()
    expected = {f"tp:{s}" for s in range(1, 301) if is_sampled(f"tp:{s}", 0.3)}
    for name, records in pulled.items():
        events = [r for r in records if r["type"] == "event"]
        assert {r["event_id"] for r in events} == expected, name
        hops = {r["hops"] for r in events}
        assert hops == {{"t1": 0, "t2": 1, "t3": 2}[name]}
    assert all(r["matched_local"] for r in pulled["t3"] if r["type"] == "event")
    assert not any(r["matched_local"] for r in pulled["t1"] if r["type"] == "event")
    # Graceful stop flushed the JSON lines into broker=/date=/hour= partitions.
    for name in ("t1", "t2", "t3"):
        parts = list(tdir.glob(f"broker={name}/date=*/hour=*/part-*.jsonl"))
        assert parts, name
        on_disk = [json.loads(line) for p in parts for line in p.read_text().splitlines()]
        assert {r["event_id"] for r in on_disk if r["type"] == "event"} == expected


def test_the_checker_catches_loss_duplicates_and_reordering() -> None:
    """Negative control: check_exact must fail on broken deliveries, or it proves nothing."""
    published: dict[str, list[dict[str, Value]]] = {"p": [{"n": n} for n in range(4)]}
    good = [Notification("p", s, 1, {"n": s - 1}, ("a",)) for s in range(1, 5)]
    broken = {
        "loss": good[:3],
        "duplicate": [*good, good[0]],
        "reorder": [good[1], good[0], *good[2:]],
        "wrong sub ids": [Notification("p", 1, 1, {"n": 0}, ("b",)), *good[1:]],
    }
    sub = Subscriber("s", "b1", {"a": "n >= 0"})
    sub.received = good
    check_exact(sub, published)
    for what, received in broken.items():
        sub.received = received
        with pytest.raises(AssertionError):
            check_exact(sub, published)
        assert what


async def test_coordinated_exchange_between_processes_under_traffic(overlay: Overlay) -> None:
    """Exchange (b2, b1) for (b4, b6) while publishers run: nothing lost, duplicated or
    reordered, and every routing table then equals a fresh overlay's of the final tree."""
    rng = random.Random(99)
    subs = [
        Subscriber(f"xs{i}", NAMES[i % len(NAMES)], {"f": random_filter(rng), "g": "qty > 500"})
        for i in range(6)
    ]
    for s in subs:
        await s.start(overlay)
    pubs = {
        n: await connect(overlay[b].listen, client_id=n) for n, b in (("p5", "b5"), ("p6", "b6"))
    }
    await overlay.settle()
    published: dict[str, list[dict[str, Value]]] = {p: [] for p in pubs}
    stop = asyncio.Event()

    async def publish(name: str, client: Client) -> None:
        while not stop.is_set():
            for _ in range(20):
                attrs = random_event(rng)
                client.publish_nowait(attrs)
                published[name].append(attrs)
            await client.flush()
            await asyncio.sleep(0.005)

    tasks = [asyncio.create_task(publish(n, c)) for n, c in pubs.items()]
    await asyncio.sleep(0.2)
    before = sum(map(len, published.values()))
    result = await overlay.exchange(["b4", "b2", "b1", "b3", "b6"], ("b2", "b1"), within=60)
    assert sum(map(len, published.values())) > before  # traffic flowed during the exchange
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*tasks)
    await wait_for_counts(subs, published, within=60)
    tables = await overlay.settle()
    for s in subs:
        check_exact(s, published)
    assert result["ok"] and result["attempts"] >= 1
    # Routing tables equal the canonical ones of the final tree.
    final = [("b1", "b3"), ("b2", "b4"), ("b2", "b5"), ("b3", "b6"), ("b4", "b6")]
    local = {
        b: [(s.name, sid, f) for s in subs if s.broker == b for sid, f in s.filters.items()]
        for b in NAMES
    }
    want = canonical_tables(final, local, RoutingMode.COVERING)
    for t in tables:
        have = {peer: sorted(keys) for peer, keys in t["table"]["links"].items()}
        expect = {peer: sorted(map(str, keys)) for peer, keys in want[t["broker"]].items()}
        assert have == expect, t["broker"]
    for client in pubs.values():
        await client.close()
    for s in subs:
        await s.stop()
