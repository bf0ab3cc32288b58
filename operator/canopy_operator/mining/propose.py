"""From measured associativity to ranked link exchanges (paper 001's self-organisation rule).

1. **Candidates** (a DataFrame window, one per broker B): the broker B' that B is most
   associated with (largest ``AS(B')_B``), not already B's neighbour, within the network distance
   ``d`` when one is set (pairs of unknown distance are then left out).
2. **The exchange**: add ``(B, B')``, remove the least-associated link on the tree path between
   them (the cycle the new link closes), kept only if the total associativity rises (the added
   link's associativity exceeds the removed one's) and no broker ends above the fan-out bound.
3. **Replay**: the sampled events are replayed on each candidate tree — with exact
   content-based routing an event crosses exactly the links of the smallest subtree spanning its
   publisher's broker and the brokers where it matched, so the hops and pure forwarders it would
   cost on any tree follow from those *terminals*. In DataFrames: for a tree rooted anywhere, a
   link (child c, its parent) is crossed iff c's subtree holds some but not all of the event's
   terminals; a join of terminals with (node, ancestor-link) rows and two aggregations count it.
   Events with the same terminal set are replayed once, weighted.
4. **Ranking**: by predicted hops per event; the top K that are valid together from the current
   tree (each one's removed link still on its cycle after the better ones are applied) become
   proposals, each with its own evidence against the current tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql import Window
from pyspark.sql import functions as F

from canopy_operator.model.topology import Edge, adjacency, norm, tree_path

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


@dataclass(frozen=True)
class Replayed:
    """Predicted cost of the sampled events on one tree."""

    hops_per_event: float
    pure_forwarder_rate: float


@dataclass
class Candidate:
    """One exchange: remove ``remove``, add ``add`` (the broker ``broker`` asked for it)."""

    broker: str
    add: Edge
    remove: Edge
    add_as: float  # link associativity (both directions summed) of the added link
    remove_as: float
    distance_ms: float | None
    distance_from: str | None
    cycle: tuple[str, ...] = ()
    replayed: Replayed | None = None

    @property
    def gain_as(self) -> float:
        return self.add_as - self.remove_as

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "broker": self.broker,
            "remove": list(self.remove),
            "add": list(self.add),
            "associativity_added": round(self.add_as, 4),
            "associativity_removed": round(self.remove_as, 4),
            "distance_ms": None if self.distance_ms is None else round(self.distance_ms, 3),
            "distance_from": self.distance_from,
            "cycle": list(self.cycle),
        }
        if self.replayed is not None:
            d["hops_per_event"] = round(self.replayed.hops_per_event, 4)
            d["pure_forwarder_rate"] = round(self.replayed.pure_forwarder_rate, 4)
        return d


def best_partners(
    pairs_with_distance: DataFrame, links: Iterable[Edge], max_distance: float | None
) -> list[dict[str, Any]]:
    """Per broker B, its most associated non-neighbour within ``max_distance`` (the paper's
    B'); rows ``broker, partner, towards`` (AS(B')_B), ``link_as, distance_ms, distance_from``.
    """
    p = pairs_with_distance
    cols = ["link_as", "distance_ms", "distance_from"]
    directed = p.select(
        F.col("a").alias("broker"),
        F.col("b").alias("partner"),
        F.col("as_ab").alias("towards"),
        *cols,
    ).unionByName(
        p.select(
            F.col("b").alias("broker"),
            F.col("a").alias("partner"),
            F.col("as_ba").alias("towards"),
            *cols,
        )
    )
    spark = p.sparkSession
    adjacent = spark.createDataFrame(
        [e for a, b in (norm(x) for x in links) for e in ((a, b), (b, a))] or [("", "")],
        "broker string, partner string",
    )
    eligible = directed.join(adjacent, ["broker", "partner"], "left_anti").where(
        F.col("towards") > 0
    )
    if max_distance is not None:
        eligible = eligible.where(
            F.col("distance_ms").isNotNull() & (F.col("distance_ms") <= max_distance)
        )
    best = Window.partitionBy("broker").orderBy(
        F.col("towards").desc(), F.col("link_as").desc(), F.col("partner")
    )
    rows = eligible.withColumn("rank", F.row_number().over(best)).where("rank = 1").drop("rank")
    return [r.asDict() for r in rows.orderBy("broker").collect()]


def exchanges(
    partners: Sequence[Mapping[str, Any]],
    links: Iterable[Edge],
    link_as: Mapping[Edge, tuple[float, float]],
    max_fan_out: int,
    link_load: Mapping[Edge, int] | None = None,
) -> tuple[list[Candidate], dict[str, int]]:
    """The paper's rule applied to each broker's best partner (pure; no Spark): the removed
    link, and the checks. Returns the kept candidates (unique exchanges) and why others went.

    Links of equal associativity (often several carry none) are told apart by ``link_load``,
    the sampled events that crossed them: the least used goes, which disturbs least traffic.
    ``link_as`` holds each link ``(a, b)``'s ``(AS(b)_a, AS(a)_b)``.

    As in the paper, the broker asking must gain (its own associativity ``AS(B)`` rises: what it
    loses if the removed link is its own is less than ``AS(B')_B``) and the overlay must gain
    (the total rises: the added link's associativity exceeds the removed one's)."""
    load = link_load or {}
    sym = {e: ab + ba for e, (ab, ba) in link_as.items()}

    def towards(x: str, e: Edge) -> float:
        ab, ba = link_as.get(e, (0.0, 0.0))
        return ab if e[0] == x else ba

    edges = [norm(e) for e in links]
    adj = adjacency(edges)
    dropped: dict[str, int] = {}
    out: dict[tuple[Edge, Edge], Candidate] = {}
    for row in partners:
        b, bp = str(row["broker"]), str(row["partner"])
        if b not in adj or bp not in adj:
            dropped["not_in_tree"] = dropped.get("not_in_tree", 0) + 1
            continue
        path = tree_path(adj, b, bp)
        on_path = [norm((x, y)) for x, y in itertools.pairwise(path)]
        remove = min(on_path, key=lambda e: (sym.get(e, 0.0), load.get(e, 0), e))
        add = norm((b, bp))
        cand = Candidate(
            broker=b,
            add=add,
            remove=remove,
            add_as=float(row["link_as"]),
            remove_as=sym.get(remove, 0.0),
            distance_ms=None if row.get("distance_ms") is None else float(row["distance_ms"]),
            distance_from=row.get("distance_from"),
            cycle=tuple(path),
        )
        own_loss = towards(b, remove) if b in remove else 0.0
        if cand.gain_as <= 0 or float(row["towards"]) <= own_loss:
            dropped["associativity_not_higher"] = dropped.get("associativity_not_higher", 0) + 1
            continue
        if not fan_out_holds(adj, remove, add, max_fan_out):
            dropped["fan_out"] = dropped.get("fan_out", 0) + 1
            continue
        key = (remove, add)
        if key not in out or out[key].broker > b:
            out[key] = cand
    return sorted(out.values(), key=lambda c: (-c.gain_as, c.add, c.remove)), dropped


def fan_out_holds(adj: Mapping[str, set[str]], remove: Edge, add: Edge, max_fan_out: int) -> bool:
    for x in add:
        degree = len(adj.get(x, ())) + 1 - (1 if x in remove else 0)
        if degree > max_fan_out:
            return False
    return True


def apply_exchange(edges: Iterable[Edge], remove: Edge, add: Edge) -> list[Edge] | None:
    """``edges`` with the exchange applied, or None when it is not valid there (the removed
    link is gone, the added one exists, or the removed link is not on the added one's cycle)."""
    current = {norm(e) for e in edges}
    remove, add = norm(remove), norm(add)
    if remove not in current or add in current:
        return None
    path = tree_path(adjacency(current), add[0], add[1])
    if remove not in {norm((x, y)) for x, y in itertools.pairwise(path)}:
        return None
    return sorted((current - {remove}) | {add})


def choose(
    ranked: Sequence[Candidate], links: Iterable[Edge], k: int, max_fan_out: int
) -> tuple[list[Candidate], list[Edge]]:
    """The best ``k`` candidates that are valid together, applied best first; and the tree with
    all of them applied."""
    tree = sorted(norm(e) for e in links)
    chosen: list[Candidate] = []
    for cand in ranked:
        if len(chosen) >= k:
            break
        if not fan_out_holds(adjacency(tree), cand.remove, cand.add, max_fan_out):
            continue
        after = apply_exchange(tree, cand.remove, cand.add)
        if after is None:
            continue
        chosen.append(cand)
        tree = after
    return chosen, tree


# -- replay -----------------------------------------------------------------------------------


def terminal_sets(
    events: DataFrame, max_sets: int | None = None
) -> tuple[DataFrame, dict[str, int]]:
    """Distinct terminal sets of the sampled events, exploded: ``sig, node, size, weight``.

    An event's terminals are its publisher's broker (the record that came from a client) and
    every broker where it matched. Events without the publisher's record (its broker's history
    was cut short) cannot be replayed and are counted as ``partial``. Events with the same
    terminals cost the same on every tree, so each set is replayed once with its event count as
    weight; beyond ``max_sets`` sets a consistent sample of them (by hash) is replayed — a ratio
    estimate of the per-event figures.
    """
    origin = (
        events.where(F.col("source_kind") == "client")
        .groupBy("event_id")
        .agg(F.min("broker").alias("broker"))
    )
    n_total = events.select("event_id").distinct().count()
    matched = events.where("matched").select("event_id", "broker")
    terms = (
        origin.unionByName(matched.join(origin.select("event_id"), "event_id", "left_semi"))
        .groupBy("event_id")
        .agg(F.array_sort(F.collect_set("broker")).alias("nodes"))
    )
    sigs = (
        terms.groupBy("nodes")
        .agg(F.count("*").alias("weight"))
        .withColumn("sig", F.xxhash64(F.concat_ws(",", "nodes")))
        .cache()
    )
    counts = sigs.agg(F.count("*").alias("sets"), F.sum("weight").alias("events")).first()
    n_sets = int(counts["sets"] or 0) if counts else 0
    n_origin = int(counts["events"] or 0) if counts else 0
    n_replayed = n_sets
    if max_sets and n_sets > max_sets:
        share = int(max_sets / n_sets * 1_000_000)
        sigs = sigs.where((F.abs(F.col("sig")) % 1_000_000) < share)
        n_replayed = sigs.count()
    exploded = sigs.select(
        "sig", F.size("nodes").alias("size"), "weight", F.explode("nodes").alias("node")
    )
    stats = {
        "events": n_total,
        "replayable": n_origin,
        "partial": n_total - n_origin,
        "terminal_sets": n_sets,
        "terminal_sets_replayed": n_replayed,
    }
    return exploded, stats


def ancestor_rows(tree_id: int, links: Iterable[Edge]) -> list[tuple[int, str, str]]:
    """``(tree, node, c)`` for every link (c, parent of c) on the path from node to the root
    (the tree's centre): node lies below that link."""
    adj = adjacency(links)
    if not adj:
        return []
    root = _centre(adj)
    parent: dict[str, str] = {}
    order = [root]
    seen = {root}
    for x in order:  # breadth first; appending while iterating walks the whole tree
        for y in sorted(adj[x]):
            if y not in seen:
                seen.add(y)
                parent[y] = x
                order.append(y)
    rows: list[tuple[int, str, str]] = []
    for node in order:
        c = node
        while c != root:
            rows.append((tree_id, node, c))
            c = parent[c]
    return rows


def _centre(adj: Mapping[str, set[str]]) -> str:
    """A middle broker of the tree's longest path: rooting there keeps ancestor chains short."""

    def farthest(start: str) -> list[str]:
        parent = {start: start}
        order = [start]
        for x in order:
            for y in sorted(adj[x]):
                if y not in parent:
                    parent[y] = x
                    order.append(y)
        path = [order[-1]]
        while path[-1] != start:
            path.append(parent[path[-1]])
        return path

    longest = farthest(farthest(min(adj))[0])
    return longest[len(longest) // 2]


def replay(spark: SparkSession, sets: DataFrame, trees: Sequence[Iterable[Edge]]) -> list[Replayed]:
    """Predicted hops per event and pure-forwarder rate of ``sets`` on each tree (one job)."""
    rows = [r for i, t in enumerate(trees) for r in ancestor_rows(i, t)]
    anc = spark.createDataFrame(rows, "tree int, node string, edge string")
    total_weight = sets.select("sig", "weight").dropDuplicates(["sig"]).agg(F.sum("weight")).first()
    weight_sum = float((total_weight[0] if total_weight else 0) or 0)
    crossed = (
        sets.join(F.broadcast(anc), "node")
        .groupBy("tree", "sig", "edge")
        .agg(
            F.count("*").alias("below"), F.first("size").alias("size"), F.first("weight").alias("w")
        )
        .where(F.col("below") < F.col("size"))
        .groupBy("tree", "sig")
        .agg(F.count("*").alias("hops"), F.first("size").alias("size"), F.first("w").alias("w"))
        .groupBy("tree")
        .agg(
            F.sum(F.col("w") * F.col("hops")).alias("hops"),
            F.sum(F.col("w") * (F.col("hops") + 1 - F.col("size"))).alias("pure"),
        )
        .collect()
    )
    by_tree = {int(r["tree"]): (float(r["hops"]), float(r["pure"])) for r in crossed}
    out = []
    for i in range(len(trees)):
        hops, pure = by_tree.get(i, (0.0, 0.0))
        out.append(
            Replayed(
                hops_per_event=hops / weight_sum if weight_sum else 0.0,
                pure_forwarder_rate=pure / hops if hops else 0.0,
            )
        )
    return out
