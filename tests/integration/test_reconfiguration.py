"""Issue 3 with real processes: a broker overlay reshaped live under traffic.

Ten broker processes on 127.0.0.1: nine in a random tree, one more added as a leaf mid-run, and
one leaf drained and removed mid-run, its subscribers and a publisher migrating make-before-break
through the client library. Publishers run throughout at over 1,000 events/s while more than 20
random link exchanges run in groups (exchanges computed on the current tree so that they are
valid in either order, started together, each group finished before the next is computed).

Judged centrally, never by asking the brokers: :func:`check_deliveries` over what each
subscriber's application received (subscriptions settled before any of it was published), and
every broker's routing table against :func:`canonical_tables` of the final tree. Every wait is a
polled condition; no sleep stands in for synchronisation.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from canopy_broker.client import Client, connect
from canopy_broker.client.connection import BrokerConnection
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import RoutingMode
from canopy_broker.procs import Overlay
from canopy_broker.sim.checker import (
    DeliveryRecord,
    PubRecord,
    SubRecord,
    canonical_tables,
    check_deliveries,
)
from canopy_broker.sim.topology import random_group, random_tree
from tests.integration.test_overlay import random_event, random_filter

pytestmark = pytest.mark.integration

RATE = 300.0  # events/s per publisher; four publishers
EXCHANGES = 21
MAX_FANOUT = 4


class Run:
    """Records the run in the checker's terms, on one monotonic clock."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.subs: list[SubRecord] = []
        self.pubs: list[PubRecord] = []
        self.deliveries: list[DeliveryRecord] = []
        self.clients: dict[str, Client] = {}
        self.received: dict[str, set[tuple[str, int]]] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.stop = asyncio.Event()

    def now(self) -> float:
        return self.loop.time()

    async def subscriber(
        self, ov: Overlay, name: str, broker: str, filters: list[str], *, dedup: bool = True
    ) -> Client:
        client = await connect(ov[broker].listen, client_id=name, credentials=ov.credentials)
        client.dedup = dedup
        self.clients[name] = client
        self.received[name] = set()
        for i, text in enumerate(filters):
            t = self.now()
            await client.subscribe(text, sub_id=f"f{i}")
            self.subs.append(SubRecord(name, f"f{i}", Filter.parse(text), issued_at=t))
        self.tasks.append(asyncio.create_task(self._drain(name, client)))
        return client

    async def _drain(self, name: str, client: Client) -> None:
        seen = self.received[name]
        while batch := await client.receive(5000):
            t = self.now()
            for n in batch:
                self.deliveries.append(DeliveryRecord(name, n.publisher, n.seq, t))
                seen.add((n.publisher, n.seq))

    def settled(self, t: float) -> None:
        """Every subscription issued so far was established everywhere at ``t``."""
        self.subs = [s.settled(t) if s.issued_at <= t else s for s in self.subs]

    async def publisher(self, ov: Overlay, name: str, broker: str, seed: int) -> Client:
        client = await connect(ov[broker].listen, client_id=name, credentials=ov.credentials)
        self.clients[name] = client
        self.tasks.append(asyncio.create_task(self._publish(name, client, random.Random(seed))))
        return client

    async def _publish(self, name: str, client: Client, rng: random.Random) -> None:
        """Paced at RATE with catch-up, so a slow loop iteration does not lower the rate."""
        start = self.now()
        sent = 0
        while not self.stop.is_set():
            due = int((self.now() - start) * RATE)
            while sent < due:
                attrs = random_event(rng)
                t = self.now()
                seq = client.publish_nowait(attrs)
                self.pubs.append(PubRecord(name, seq, attrs, published_at=t, ended_at=t))
                sent += 1
            await client.flush()
            await asyncio.sleep(0.005)  # pacing, not synchronisation

    def owed(self) -> dict[str, set[tuple[str, int]]]:
        """What each client must receive, by the checker's rule (settled before published)."""
        out: dict[str, set[tuple[str, int]]] = {c: set() for c in self.received}
        for p in self.pubs:
            for s in self.subs:
                if s.settled_at <= p.published_at and s.filter.matches(p.attrs):
                    out[s.client].add((p.publisher, p.seq))
        return out

    async def wait_delivered(self, within: float) -> None:
        owed = self.owed()
        async with asyncio.timeout(within):
            while any(not owed[c] <= self.received[c] for c in owed):  # noqa: ASYNC110
                await asyncio.sleep(0.05)

    async def finish(self) -> None:
        """Stop publishing, close every client, and collect the drain tasks."""
        self.stop.set()
        for client in self.clients.values():
            await client.close()
        await asyncio.gather(*self.tasks)


def local_subscriptions(run: Run, brokers: list[str]) -> dict[str, list[tuple[str, str, Filter]]]:
    """The (client, sub_id, filter) triples of each broker, from where each client is now."""
    out: dict[str, list[tuple[str, str, Filter]]] = {b: [] for b in brokers}
    for s in run.subs:
        broker = run.clients[s.client].broker
        if broker in out:
            out[broker].append((s.client, s.sub_id, s.filter))
    return out


async def routing_problems(ov: Overlay, run: Run) -> list[str]:
    """Differences between every broker's routing table and a fresh overlay's of the tree."""
    want = canonical_tables(
        ov.edges, local_subscriptions(run, list(ov.brokers)), RoutingMode.COVERING
    )
    tables = await asyncio.gather(*(p.admin.routing() for p in ov.brokers.values()))
    problems = []
    for t in tables:
        name = t["broker"]
        have = {peer: sorted(keys) for peer, keys in t["table"]["links"].items()}
        expect = {peer: sorted(map(str, keys)) for peer, keys in want[name].items()}
        if have != expect:
            problems.append(f"{name}: {have} != {expect}")
        clients = {(c, sid) for c, subs in t["table"]["clients"].items() for sid in subs}
        if clients != {(c, sid) for c, sid, _ in local_subscriptions(run, [name])[name]}:
            problems.append(f"{name}: local subscriptions {sorted(clients)}")
    return problems


async def converged(ov: Overlay, run: Run, within: float = 20.0) -> float:
    """Poll until every routing table is canonical; returns when (the settling time)."""
    async with asyncio.timeout(within):
        while await routing_problems(ov, run):  # noqa: ASYNC110 - polling other processes
            await asyncio.sleep(0.05)
    return run.now()


async def test_live_reshaping_loses_duplicates_and_reorders_nothing(tmp_path: Path) -> None:
    rng = random.Random(31)
    core = [f"b{i}" for i in range(8)]
    edges = [*random_tree(8, rng, max_fanout=MAX_FANOUT - 1), ("b8", rng.choice(core))]
    async with Overlay([*core, "b8"], edges, log_dir=tmp_path) as ov:
        run = Run()
        # Subscribers with content filters on most brokers; two of them (and a publisher) on
        # the leaf b8 that will be removed.
        placement = ["b8", "b8", *core, *rng.sample(core, 3)]
        for i, broker in enumerate(placement):
            texts = [random_filter(rng) for _ in range(rng.randint(1, 2))]
            await run.subscriber(ov, f"s{i}", broker, ["qty > 400", *texts] if i < 2 else texts)
        run.settled(await converged(ov, run))
        for i, broker in enumerate(["b8", *rng.sample(core, 3)]):
            await run.publisher(ov, f"p{i}", broker, seed=i)
        started = run.now()

        exchanges = 0
        sizes = []
        leaf_added = leaf_removed = False
        heir = ""
        removed_at = 0.0
        while exchanges < EXCHANGES:
            leaf = "b8" if "b8" in ov.brokers else None
            group = [
                x
                for x in random_group(ov.edges, rng, 3, max_fanout=MAX_FANOUT)
                if leaf is None or leaf not in x.add or leaf in x.remove  # b8 stays a leaf
            ]
            await asyncio.gather(*(ov.exchange(x.path, x.remove, within=30) for x in group))
            exchanges += len(group)
            sizes.append(len(group))
            if exchanges >= 6 and not leaf_added:  # add-leaf, and a subscriber on it
                attach = next(b for b in core if len(ov.neighbours(b)) < MAX_FANOUT)
                await ov.add_leaf("b9", attach)
                await run.subscriber(ov, "s-new", "b9", ['side = "sell"', random_filter(rng)])
                run.settled(await converged(ov, run))
                leaf_added = True
            elif exchanges >= 12 and not leaf_removed:  # remove-leaf: its clients migrate
                (heir,) = ov.neighbours("b8")
                await ov.remove_leaf("b8")
                removed_at = run.now()
                leaf_removed = True

        await asyncio.sleep(0.2)  # traffic after the last change, not synchronisation
        run.stop.set()
        elapsed = run.now() - started
        await asyncio.gather(*(run.clients[p].flush() for p in ("p0", "p1", "p2", "p3")))
        await run.wait_delivered(within=30)
        await ov.settle()
        problems = await routing_problems(ov, run)
        moved = {c: run.clients[c].broker for c in ("s0", "s1", "p0")}
        migrations = {c: run.clients[c].migrations for c in ("s0", "s1", "p0")}
        await run.finish()

    assert not problems, "\n".join(problems)
    report = check_deliveries(run.subs, run.pubs, run.deliveries)
    assert report.ok, str(report)
    assert report.owed > 5000, str(report)
    assert len(run.pubs) / elapsed >= 1000, f"{len(run.pubs) / elapsed:.0f} events/s"
    assert exchanges >= 20 and sum(n > 1 for n in sizes) >= 2, sizes  # some ran concurrently
    assert set(moved.values()) == {heir} and set(migrations.values()) == {1}
    # After the removal the migrated subscribers kept receiving, the migrated publisher kept
    # being received, and the new leaf's subscriber received too.
    late = [d for d in run.deliveries if d.at > removed_at]
    assert {"s0", "s1", "s-new"} <= {d.client for d in late}
    assert "p0" in {d.publisher for d in late}


class WideOverlapClient(Client):
    """Holds the migration open until the new connection has buffered notifications that the
    old one also carries, so the two connections certainly overlap."""

    async def _resubscribe(self, new: BrokerConnection) -> None:
        await super()._resubscribe(new)
        async with asyncio.timeout(20):
            while self._migration is not None and len(self._migration.held) < 50:  # noqa: ASYNC110
                await asyncio.sleep(0.01)


async def overlapping_migration(log_dir: Path, *, dedup: bool) -> tuple[Run, int]:
    """A subscriber on leaf L moves to N while a publisher on N publishes: the checker's
    report and how many notifications the client dropped as duplicates."""
    async with Overlay(["L", "N"], [("L", "N")], log_dir=log_dir) as ov:
        run = Run()
        client = WideOverlapClient("mover")
        await client._open(ov["L"].listen, 10)
        client.dedup = dedup
        run.clients["mover"] = client
        run.received["mover"] = set()
        await client.subscribe("qty > 0", sub_id="all")
        run.subs.append(SubRecord("mover", "all", Filter.parse("qty > 0"), issued_at=run.now()))
        run.tasks.append(asyncio.create_task(run._drain("mover", client)))
        run.settled(await converged(ov, run))
        await run.publisher(ov, "pub", "N", seed=1)
        await client.migrate(ov["N"].listen, "N")
        after = len(run.pubs) + 200
        while len(run.pubs) < after:  # noqa: ASYNC110 - some traffic after the move
            await asyncio.sleep(0.01)
        run.stop.set()
        await run.clients["pub"].flush()
        await run.wait_delivered(within=20)
        await ov.settle()
        await run.finish()
    return run, client.duplicates_dropped


async def test_migration_without_dedup_trips_the_checker(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Negative control: the same checker finds the duplicates when the client does not
    filter by last sequence number, and none when it does."""
    run, dropped = await overlapping_migration(tmp_path_factory.mktemp("on"), dedup=True)
    report = check_deliveries(run.subs, run.pubs, run.deliveries)
    assert report.ok and dropped >= 50, (str(report), dropped)
    run, dropped = await overlapping_migration(tmp_path_factory.mktemp("off"), dedup=False)
    report = check_deliveries(run.subs, run.pubs, run.deliveries)
    assert dropped == 0 and len(report.duplicated) >= 50, str(report)
    assert not (report.lost or report.reordered), str(report)
