"""Synthetic telemetry with a known shape, for the mining benchmark and scale tests.

The overlay is a random tree of ``brokers`` (fan-out ≤ 4) spread over a few zones. Interests are
topics (a quarter as many as brokers): each broker's subscribers follow one or two chosen at
random, so brokers with the same interests sit anywhere in the tree — the situation
self-organisation is for. One broker in twenty hosts publishers. An event of topic *t*
published at broker *o* travels, under exact content-based routing, the smallest subtree
spanning *o* and the subscribers of *t*; every broker on it writes one ``event`` record (schema
v1, the same fields a broker writes). Those routes are computed once per (origin, topic) on the
driver; Spark then draws the events and writes the records in parallel.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from canopy_broker.sim.topology import adjacency, random_tree
from canopy_operator.mining.source import SCHEMA_V1
from canopy_operator.model.topology import Edge

ZONES = ("zone-a", "zone-b", "zone-c", "zone-d")


@dataclass(frozen=True)
class SyntheticOverlay:
    brokers: list[str]
    links: list[Edge]
    zones: dict[str, str]
    manifest: dict[str, Any]
    routes: int  # distinct (origin, topic) routes
    mean_route: float  # brokers per event


def overlay(n: int, seed: int) -> tuple[list[str], list[Edge], dict[str, str]]:
    rng = random.Random(seed)
    links = random_tree(n, rng, max_fanout=4, prefix="b")
    brokers = [f"b{i}" for i in range(n)]
    zones = {b: rng.choice(ZONES) for b in brokers}
    return brokers, links, zones


def routes(
    brokers: list[str], links: list[Edge], seed: int, topics: int | None = None
) -> list[tuple[int, str, str, str, str, bool]]:
    """Rows ``(route, origin, topic, broker, source, matched)``: one per broker an event of
    that route reaches (``source`` is the neighbour it came from, or ``""`` at the origin)."""
    rng = random.Random(seed + 1)
    adj = adjacency(links)
    n_topics = topics or max(8, len(brokers) // 4)
    follows: dict[int, set[str]] = {t: set() for t in range(n_topics)}
    for b in brokers:
        for t in rng.sample(range(n_topics), rng.randint(1, 2)):
            follows[t].add(b)
    origins = rng.sample(brokers, max(1, len(brokers) // 20))
    rows: list[tuple[int, str, str, str, str, bool]] = []
    route_id = 0
    for o in origins:
        parent = _bfs_parents(adj, o)
        for t in range(n_topics):
            if not follows[t]:
                continue
            for b, src, m in route(parent, o, follows[t]):
                rows.append((route_id, o, f"t{t}", b, src, m))
            route_id += 1
    return rows


def route(
    parent: dict[str, str], origin: str, subscribers: Iterable[str]
) -> list[tuple[str, str, bool]]:
    """``(broker, came_from, matched)`` for every broker an event published at ``origin``
    reaches under exact routing: the smallest subtree spanning the origin and the subscribers.
    ``parent`` points towards ``origin`` (:func:`parents_towards`)."""
    subs = set(subscribers)
    on_route = {origin}
    for sub in subs:  # climb towards the origin until the route is met
        x = sub
        while x not in on_route:
            on_route.add(x)
            x = parent[x]
    return [(b, parent.get(b, ""), b in subs) for b in sorted(on_route)]


def parents_towards(links: Iterable[Edge], root: str) -> dict[str, str]:
    """Each broker's neighbour on its path to ``root``."""
    return _bfs_parents(adjacency(links), root)


def _bfs_parents(adj: dict[str, set[str]], root: str) -> dict[str, str]:
    parent: dict[str, str] = {}
    seen, queue = {root}, deque([root])
    while queue:
        x = queue.popleft()
        for y in adj[x]:
            if y not in seen:
                seen.add(y)
                parent[y] = x
                queue.append(y)
    return parent


def generate(
    spark: SparkSession, out: Path, brokers: int, rows: int, *, seed: int = 1
) -> SyntheticOverlay:
    """Write about ``rows`` telemetry records for an overlay of ``brokers`` under ``out``."""
    names, links, zones = overlay(brokers, seed)
    table = routes(names, links, seed)
    n_routes = table[-1][0] + 1
    mean_route = len(table) / n_routes
    n_events = max(1, int(rows / mean_route))
    # Through a file: Spark reads half a million rows in a blink, Py4J would take a minute.
    # Beside ``out``, not in it: the miner reads every JSON file under ``out``.
    table_file = out.with_name(out.name + ".routes.jsonl")
    out.mkdir(parents=True, exist_ok=True)
    with table_file.open("wb") as fh:
        keys = ("route", "origin", "topic", "broker", "src", "m")
        fh.writelines(orjson.dumps(dict(zip(keys, row, strict=True))) + b"\n" for row in table)
    route_df = F.broadcast(
        spark.read.schema(
            "route int, origin string, topic string, broker string, src string, m boolean"
        ).json(str(table_file))
    )
    events = spark.range(n_events).select(
        F.col("id"),
        (F.abs(F.xxhash64("id", F.lit(seed))) % n_routes).cast("int").alias("route"),
    )
    records = events.join(route_df, "route").select(
        F.lit(SCHEMA_V1).alias("schema"),
        F.lit("event").alias("type"),
        "broker",
        (F.lit(1_795_000_000.0) + F.col("id") / 1000.0).alias("ts"),
        F.col("id").alias("cursor"),
        F.concat(F.lit("e"), F.col("id").cast("string")).alias("event_id"),
        F.concat(F.lit("pub-"), F.col("origin")).alias("publisher"),
        F.col("id").alias("seq"),
        F.lit(0).alias("hops"),
        F.when(F.col("src") == "", "client").otherwise("link").alias("source_kind"),
        F.when(F.col("src") == "", F.concat(F.lit("pub-"), "origin"))
        .otherwise(F.col("src"))
        .alias("source"),
        F.col("m").alias("matched_local"),
        F.col("m").cast("int").alias("deliveries"),
        F.array().cast("array<string>").alias("forwarded_to"),
        F.create_map(F.lit("topic"), F.col("topic")).alias("attrs"),
    )
    rng = random.Random(seed + 2)
    rtt_rows = []
    for b in names:  # a few probes per broker: RTT grows with zone distance, plus noise
        for peer in rng.sample(names, min(8, len(names) - 1)):
            if peer != b:
                base = 0.3 if zones[b] == zones[peer] else 4.0 + ZONES.index(zones[peer])
                rtt_rows.append((b, peer, base * rng.uniform(0.8, 1.3)))
    rtts = spark.createDataFrame(rtt_rows, "broker string, peer string, rtt_ms double").select(
        F.lit(SCHEMA_V1).alias("schema"),
        F.lit("rtt").alias("type"),
        "broker",
        F.lit(1_795_000_000.0).alias("ts"),
        F.lit(0).alias("cursor"),
        "peer",
        "rtt_ms",
        F.lit("probe").alias("via"),
    )
    partitions = max(2, rows // 500_000)
    records.repartition(partitions).write.mode("overwrite").json(str(out / "events"))
    rtts.coalesce(1).write.mode("overwrite").json(str(out / "rtt"))
    manifest = {
        "apiVersion": "canopy.dev/v1alpha1",
        "kind": "BrokerOverlay",
        "metadata": {"name": "synthetic", "generation": 1},
        "spec": {
            "brokers": [{"name": b, "zone": zones[b]} for b in names],
            "links": [list(e) for e in links],
            "maxFanOut": 4,
            "selfOrganization": {"mode": "propose"},
        },
    }
    return SyntheticOverlay(names, links, zones, manifest, n_routes, mean_route)
