"""The case the papers care about, with real brokers: two subscribers with the same interest at
the two ends of a chain. Mining their telemetry must propose linking them, and applying the
proposal live must lower the hops per delivered notification that the *clients* measure —
without losing, duplicating or reordering a notification while the exchange runs."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from canopy_broker.client import Client, connect
from canopy_broker.core.filters import Filter
from canopy_broker.sim.checker import DeliveryRecord, PubRecord, SubRecord, check_deliveries
from canopy_operator.backends.local import LocalBackend
from canopy_operator.commands.local import apply
from canopy_operator.commands.selforg import TELEMETRY_ARGS, apply_proposal, mine_overlay
from canopy_operator.model.topology import parse_overlay

CHAIN = [f"b{i}" for i in range(6)]
FILTERS = {
    "far0": ("b0", 'symbol = "ACME"'),
    "far5": ("b5", 'symbol = "ACME"'),
    "mid": ("b2", 'symbol = "X"'),
}


def manifest() -> dict[str, object]:
    return {
        "apiVersion": "canopy.dev/v1alpha1",
        "kind": "BrokerOverlay",
        "metadata": {"name": "chain"},
        "spec": {
            "maxFanOut": 3,
            "brokers": [{"name": b} for b in CHAIN],
            "links": [[a, b] for a, b in itertools.pairwise(CHAIN)],
        },
    }


async def _publish(client: Client, n: int, rng: random.Random, log: list[PubRecord]) -> None:
    for i in range(n):
        attrs = {"symbol": "ACME" if rng.random() < 0.8 else "X", "n": i}
        seq = client.publish_nowait(attrs)
        log.append(PubRecord(client.client_id, seq, attrs, published_at=1.0, ended_at=1.0))
        if i % 20 == 19:
            await client.flush()
            await asyncio.sleep(0.02)
    await client.flush()


async def _drain(
    subs: dict[str, Client], got: dict[str, list[tuple[str, int, int]]], want: int
) -> None:
    deadline = time.monotonic() + 20
    while sum(len(v) for v in got.values()) < want and time.monotonic() < deadline:
        for name, c in subs.items():
            for n in await c.receive(max_items=1000, timeout=0.05):
                got[name].append((n.publisher, n.seq, n.hops))


def _owed(pubs: list[PubRecord]) -> int:
    return sum(
        1 for p in pubs for _, text in FILTERS.values() if Filter.parse(text).matches(p.attrs)
    )


def _mean_hops(rows: list[tuple[str, int, int]]) -> float:
    return sum(h for _, _, h in rows) / len(rows)


async def test_linking_similar_interests_lowers_measured_hops(
    spark: SparkSession, tmp_path: Path
) -> None:
    backend = LocalBackend(tmp_path / "chain", broker_args=TELEMETRY_ARGS)
    clients: list[Client] = []
    try:
        m = manifest()
        await apply(parse_overlay(m), m, backend, log=lambda _m: None)
        subs = {}
        for name, (broker, text) in FILTERS.items():
            c = await connect(
                backend.address(broker), client_id=name, credentials=backend.credentials
            )
            await c.subscribe(text, sub_id="s")
            subs[name] = c
            clients.append(c)
        pub = await connect(backend.address("b0"), client_id="pub", credentials=backend.credentials)
        clients.append(pub)
        await asyncio.sleep(1.0)  # subscriptions reach every broker
        rng = random.Random(3)
        pubs: list[PubRecord] = []
        got: dict[str, list[tuple[str, int, int]]] = {n: [] for n in subs}

        await _publish(pub, 400, rng, pubs)
        await _drain(subs, got, _owed(pubs))
        first = {n: len(v) for n, v in got.items()}
        before = [r for rows in got.values() for r in rows]

        result = await mine_overlay(backend, m, spark)
        # the replay's model of routing is the brokers': on the live tree it predicts what
        # they measured
        assert result.before.hops_per_event == pytest.approx(
            result.traffic.hops_per_event, rel=0.02
        )
        assert result.chosen, f"no proposal: {result.dropped}"
        best = result.proposals()[0]
        # b0 and b5 share every ACME event: the new link joins them
        assert best.changes[0][1] == ("b0", "b5")
        assert result.evidence(result.chosen[0])["hopsPerEventAfter"] < result.before.hops_per_event

        # apply it live while the publisher keeps publishing
        publishing = asyncio.create_task(_publish(pub, 400, rng, pubs))
        _, the_plan, _, _ = await apply_proposal(backend, m, best)
        await publishing
        assert len(the_plan.exchanges) == 1
        await _drain(subs, got, _owed(pubs))  # what was published during the exchange
        mark = {n: len(v) for n, v in got.items()}
        await _publish(pub, 400, rng, pubs)
        await _drain(subs, got, _owed(pubs))
        after = [r for n, rows in got.items() for r in rows[mark[n] :]]
    finally:
        for c in clients:
            await c.close()
        await backend.down()

    report = check_deliveries(
        [
            SubRecord(n, "s", Filter.parse(t), issued_at=0.0, settled_at=0.0)
            for n, (_, t) in FILTERS.items()
        ],
        pubs,
        [
            DeliveryRecord(n, p, s, float(i))
            for n, rows in got.items()
            for i, (p, s, _) in enumerate(rows)
        ],
    )
    assert report.ok, report
    assert report.owed == _owed(pubs)
    # the far subscriber's notifications crossed 5 links before, and one link after
    assert {h for _, _, h in got["far5"][: first["far5"]]} == {5}
    assert {h for _, _, h in got["far5"][mark["far5"] :]} == {1}
    assert _mean_hops(after) < _mean_hops(before)
