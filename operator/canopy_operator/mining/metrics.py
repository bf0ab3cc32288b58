"""The measured state of an overlay, computed from telemetry with DataFrame joins.

Definitions (paper 001, in our words; docs/mining.md has the worked example):

* ``M_i``: the sampled events that matched a local subscription at broker *i*. Because every
  broker samples by the same hash of the event id, ``M_i ∩ M_j`` is meaningful.
* associativity of *i* towards *j*: ``AS(j)_i = |M_i ∩ M_j| / |M_i|`` — the share of *i*'s
  matched events that *j* also matched (raw count ``|M_i ∩ M_j|`` is kept too). It is not
  symmetric; a link's associativity is the sum of both directions.
* a broker's associativity ``AS(B)``: the sum over its current neighbours *n* of ``AS(n)_B``; the
  overlay's total ``AS``: the sum over brokers (= the sum of link associativities).
* hops per event: overlay links an event crossed (records that arrived over a link), per event;
  per delivered notification: the same divided by local deliveries.
* pure-forwarder rate: of the brokers an event reached over a link, the share that matched
  nothing locally and only passed it on (a useless TCP hop, the thing self-organisation removes).
* distance between two brokers: the median RTT of the probes and heartbeats between them; a pair
  never measured gets the median of measured pairs between the same two zones, else unknown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql import functions as F

from canopy_operator.model.topology import Edge, norm

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from canopy_operator.mining.source import Telemetry


@dataclass(frozen=True)
class Traffic:
    """Overlay-wide figures measured from the sampled events."""

    events: int
    link_arrivals: int
    deliveries: int
    pure_forwards: int

    @property
    def hops_per_event(self) -> float:
        return self.link_arrivals / self.events if self.events else 0.0

    @property
    def hops_per_delivery(self) -> float:
        return self.link_arrivals / self.deliveries if self.deliveries else 0.0

    @property
    def pure_forwarder_rate(self) -> float:
        return self.pure_forwards / self.link_arrivals if self.link_arrivals else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "link_arrivals": self.link_arrivals,
            "deliveries": self.deliveries,
            "pure_forwards": self.pure_forwards,
            "hops_per_event": round(self.hops_per_event, 4),
            "hops_per_delivery": round(self.hops_per_delivery, 4),
            "pure_forwarder_rate": round(self.pure_forwarder_rate, 4),
        }


def associativity(events: DataFrame) -> DataFrame:
    """Every broker pair ``a < b`` with common matched events: ``a, b, common, matched_a,
    matched_b, as_ab`` (= AS(b)_a), ``as_ba`` (= AS(a)_b), ``link_as`` (their sum)."""
    matched = events.where("matched").select("broker", "event_id")
    sizes = matched.groupBy("broker").agg(F.count("*").alias("m"))
    x, y = matched.alias("x"), matched.alias("y")
    common = (
        x.join(y, F.col("x.event_id") == F.col("y.event_id"))
        .where(F.col("x.broker") < F.col("y.broker"))
        .groupBy(F.col("x.broker").alias("a"), F.col("y.broker").alias("b"))
        .agg(F.count("*").alias("common"))
    )
    sa, sb = sizes.alias("sa"), sizes.alias("sb")
    return (
        common.join(sa, F.col("a") == F.col("sa.broker"))
        .join(sb, F.col("b") == F.col("sb.broker"))
        .select(
            "a",
            "b",
            "common",
            F.col("sa.m").alias("matched_a"),
            F.col("sb.m").alias("matched_b"),
            (F.col("common") / F.col("sa.m")).alias("as_ab"),
            (F.col("common") / F.col("sb.m")).alias("as_ba"),
        )
        .withColumn("link_as", F.col("as_ab") + F.col("as_ba"))
    )


def links_frame(spark: SparkSession, links: Iterable[Edge]) -> DataFrame:
    return spark.createDataFrame([norm(e) for e in links], "a string, b string")


def link_associativity(pairs: DataFrame, links: DataFrame) -> dict[Edge, tuple[float, float]]:
    """For each current link ``(a, b)``: ``(AS(b)_a, AS(a)_b)`` (zero when nothing in common)."""
    rows = (
        links.join(pairs, ["a", "b"], "left")
        .select("a", "b", F.coalesce("as_ab", F.lit(0.0)), F.coalesce("as_ba", F.lit(0.0)))
        .collect()
    )
    return {(r[0], r[1]): (float(r[2]), float(r[3])) for r in rows}


def broker_associativity(
    per_link: Mapping[Edge, tuple[float, float]], brokers: Iterable[str]
) -> dict[str, float]:
    """``AS(B)``: the sum over B's links of its associativity towards the neighbour."""
    out = dict.fromkeys(brokers, 0.0)
    for (a, b), (ab, ba) in per_link.items():
        out[a] = out.get(a, 0.0) + ab
        out[b] = out.get(b, 0.0) + ba
    return out


def traffic(events: DataFrame) -> Traffic:
    """Hops, deliveries and pure forwards of the sampled events, overlay-wide (one pass)."""
    arrived = F.col("source_kind") == "link"
    row = events.agg(
        F.countDistinct("event_id").alias("events"),
        F.sum(arrived.cast("long")).alias("arrivals"),
        F.sum("deliveries").alias("deliveries"),
        F.sum((arrived & ~F.col("matched")).cast("long")).alias("pure"),
    ).first()
    assert row is not None
    return Traffic(
        events=int(row["events"] or 0),
        link_arrivals=int(row["arrivals"] or 0),
        deliveries=int(row["deliveries"] or 0),
        pure_forwards=int(row["pure"] or 0),
    )


def broker_rates(events: DataFrame) -> DataFrame:
    """Per broker: events seen, matched, arrived over a link, passed on as a pure forwarder."""
    arrived = F.col("source_kind") == "link"
    return events.groupBy("broker").agg(
        F.count("*").alias("seen"),
        F.sum(F.col("matched").cast("long")).alias("matched"),
        F.sum(arrived.cast("long")).alias("arrived"),
        F.sum((arrived & ~F.col("matched")).cast("long")).alias("pure_forwards"),
    )


def link_traffic(telemetry: Telemetry) -> DataFrame:
    """Per overlay link ``a < b``: sampled events that crossed it (either way) and, where the
    brokers reported counters, the messages sent each way."""
    crossed = (
        telemetry.events.where((F.col("source_kind") == "link") & F.col("source").isNotNull())
        .select(
            F.least("broker", "source").alias("a"),
            F.greatest("broker", "source").alias("b"),
        )
        .groupBy("a", "b")
        .agg(F.count("*").alias("sampled_events"))
    )
    sent = (
        telemetry.links.select(
            F.least("broker", "peer").alias("a"),
            F.greatest("broker", "peer").alias("b"),
            F.coalesce("msgs_out", F.lit(0)).alias("out"),
        )
        .groupBy("a", "b")
        .agg(F.sum("out").alias("messages"))
    )
    return crossed.join(sent, ["a", "b"], "full_outer").fillna(0)


def _zones_of(spark: SparkSession, zones: Mapping[str, str], side: str) -> DataFrame:
    """Broker → zone as columns ``<side>, zone_<side>`` (for joins on a pair's end)."""
    rows = [(b, z) for b, z in zones.items() if z] or [("", "")]
    return spark.createDataFrame(rows, f"{side} string, zone_{side} string")


def _zone_pair(frame: DataFrame) -> DataFrame:
    return frame.withColumn("z1", F.least("zone_a", "zone_b")).withColumn(
        "z2", F.greatest("zone_a", "zone_b")
    )


def distances(
    spark: SparkSession, rtts: DataFrame, zones: Mapping[str, str]
) -> tuple[DataFrame, DataFrame]:
    """(measured, by_zone): the median RTT per broker pair ``a < b`` (ms, with the sample
    count), and the median of those medians per zone pair ``z1 <= z2`` (for pairs never
    measured)."""
    measured = (
        rtts.where(F.col("broker") != F.col("peer"))
        .select(
            F.least("broker", "peer").alias("a"),
            F.greatest("broker", "peer").alias("b"),
            "rtt_ms",
        )
        .groupBy("a", "b")
        .agg(
            F.median("rtt_ms").alias("distance_ms"),
            F.count("*").alias("samples"),
        )
    )
    by_zone = (
        _zone_pair(
            measured.join(_zones_of(spark, zones, "a"), "a").join(_zones_of(spark, zones, "b"), "b")
        )
        .groupBy("z1", "z2")
        .agg(F.median("distance_ms").alias("zone_ms"))
    )
    return measured, by_zone


def with_distance(
    spark: SparkSession,
    pairs: DataFrame,
    measured: DataFrame,
    by_zone: DataFrame,
    zones: Mapping[str, str],
) -> DataFrame:
    """``pairs`` (columns ``a < b``) with ``distance_ms`` and ``distance_from`` (``rtt``,
    ``zone``, or null when unknown)."""
    joined = _zone_pair(
        pairs.join(measured.select("a", "b", "distance_ms"), ["a", "b"], "left")
        .join(_zones_of(spark, zones, "a"), "a", "left")
        .join(_zones_of(spark, zones, "b"), "b", "left")
    ).join(by_zone, ["z1", "z2"], "left")
    known = F.col("distance_ms").isNotNull()
    return (
        joined.withColumn(
            "distance_from",
            F.when(known, F.lit("rtt")).when(F.col("zone_ms").isNotNull(), F.lit("zone")),
        )
        .withColumn("distance_ms", F.coalesce("distance_ms", "zone_ms"))
        .drop("z1", "z2", "zone_a", "zone_b", "zone_ms")
    )
