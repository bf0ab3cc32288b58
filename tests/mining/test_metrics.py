"""Associativity, traffic and distances on a fixture small enough to compute by hand.

The tree (zones in brackets)::

        a[z1]
       /     \\
    b[z1]    c[z2]
     |        |
    d[z1]    e[z2]

* E1-E4 published at d, matched at d and e (similar interests, four links apart);
* E5-E6 published at b, matched at b and a;
* E7 published at c, matched at e only.
"""

from __future__ import annotations

import pytest
from pyspark.sql import SparkSession

from canopy_operator.mining import metrics
from canopy_operator.mining.source import read_telemetry
from canopy_operator.model.topology import parse_overlay
from tests.mining.telemetry import event_records, rtt, write

LINKS = [("a", "b"), ("a", "c"), ("b", "d"), ("c", "e")]
ZONES = {"a": "z1", "b": "z1", "d": "z1", "c": "z2", "e": "z2"}


def fixture_records() -> list[dict[str, object]]:
    recs = []
    for i in range(1, 5):
        recs += event_records(LINKS, f"E{i}", "d", ["d", "e"])
    for i in (5, 6):
        recs += event_records(LINKS, f"E{i}", "b", ["b", "a"])
    recs += event_records(LINKS, "E7", "c", ["e"])
    recs += [rtt("d", "e", 2.0), rtt("d", "e", 4.0), rtt("e", "d", 3.0)]
    recs += [rtt("b", "c", 5.0), rtt("a", "c", 7.0, via="heartbeat")]
    return recs


def overlay_manifest(**spec: object) -> dict[str, object]:
    return {
        "apiVersion": "canopy.dev/v1alpha1",
        "kind": "BrokerOverlay",
        "metadata": {"name": "hand", "generation": 3},
        "spec": {
            "brokers": [{"name": b, "zone": z} for b, z in sorted(ZONES.items())],
            "links": [list(e) for e in LINKS],
            **spec,
        },
    }


SPEC = parse_overlay(overlay_manifest())


@pytest.fixture(scope="module")
def telemetry(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = write(tmp_path_factory.mktemp("tel"), fixture_records())
    return read_telemetry(spark, root, SPEC.broker_names)


def test_associativity_raw_and_normalised(telemetry) -> None:  # type: ignore[no-untyped-def]
    rows = {(r["a"], r["b"]): r.asDict() for r in metrics.associativity(telemetry.events).collect()}
    assert set(rows) == {("a", "b"), ("d", "e")}  # only pairs with common matched events
    de = rows[("d", "e")]
    assert (de["common"], de["matched_a"], de["matched_b"]) == (4, 4, 5)
    assert de["as_ab"] == pytest.approx(1.0)  # all of d's matches are e's too
    assert de["as_ba"] == pytest.approx(0.8)  # four of e's five are d's
    assert de["link_as"] == pytest.approx(1.8)
    ab = rows[("a", "b")]
    assert (ab["common"], ab["as_ab"], ab["as_ba"]) == (2, 1.0, 1.0)


def test_associativity_over_current_links(spark: SparkSession, telemetry) -> None:  # type: ignore[no-untyped-def]
    pairs = metrics.associativity(telemetry.events)
    per_link = metrics.link_associativity(pairs, metrics.links_frame(spark, LINKS))
    assert per_link == {
        ("a", "b"): (1.0, 1.0),
        ("a", "c"): (0.0, 0.0),
        ("b", "d"): (0.0, 0.0),
        ("c", "e"): (0.0, 0.0),
    }
    per_broker = metrics.broker_associativity(per_link, SPEC.broker_names)
    assert per_broker == {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0, "e": 0.0}
    assert sum(per_broker.values()) == 2.0  # the overlay's total AS


def test_hops_deliveries_and_pure_forwarders(telemetry) -> None:  # type: ignore[no-untyped-def]
    t = metrics.traffic(telemetry.events)
    # E1-E4 cross 4 links each, E5-E7 one each; b, a and c forward E1-E4 without a match.
    assert (t.events, t.link_arrivals, t.deliveries, t.pure_forwards) == (7, 19, 13, 12)
    assert t.hops_per_event == pytest.approx(19 / 7)
    assert t.hops_per_delivery == pytest.approx(19 / 13)
    assert t.pure_forwarder_rate == pytest.approx(12 / 19)
    rates = {r["broker"]: r.asDict() for r in metrics.broker_rates(telemetry.events).collect()}
    assert rates["a"]["pure_forwards"] == 4 and rates["a"]["matched"] == 2
    assert rates["d"]["arrived"] == 0 and rates["e"]["arrived"] == 5


def test_link_traffic_counts_sampled_events_per_link(telemetry) -> None:  # type: ignore[no-untyped-def]
    rows = {
        (r["a"], r["b"]): r["sampled_events"] for r in metrics.link_traffic(telemetry).collect()
    }
    assert rows == {("b", "d"): 4, ("a", "b"): 6, ("a", "c"): 4, ("c", "e"): 5}


def test_distance_matrix_medians_zones_and_unknowns(spark: SparkSession, telemetry) -> None:  # type: ignore[no-untyped-def]
    measured, by_zone = metrics.distances(spark, telemetry.rtts, ZONES)
    got = {(r["a"], r["b"]): (r["distance_ms"], r["samples"]) for r in measured.collect()}
    # both directions of d-e pool into one median; a-c came from heartbeats
    assert got == {("d", "e"): (3.0, 3), ("b", "c"): (5.0, 1), ("a", "c"): (7.0, 1)}
    assert {(r["z1"], r["z2"]): r["zone_ms"] for r in by_zone.collect()} == {("z1", "z2"): 5.0}
    names = sorted(ZONES)
    pairs = spark.createDataFrame(
        [(x, y) for x in names for y in names if x < y], "a string, b string"
    )
    full = {
        (r["a"], r["b"]): (r["distance_ms"], r["distance_from"])
        for r in metrics.with_distance(spark, pairs, measured, by_zone, ZONES).collect()
    }
    assert full[("d", "e")] == (3.0, "rtt")
    assert full[("a", "e")] == (5.0, "zone")  # never measured: the z1-z2 median
    assert full[("a", "b")] == (None, None)  # z1-z1 never measured: unknown
    assert full[("c", "e")] == (None, None)


def test_the_fixture_is_what_the_docstring_says() -> None:
    """7 events leave 5+5+5+5 (d-b-a-c-e) + 2+2 (b-a) + 2 (c-e) = 26 event records."""
    assert sum(1 for r in fixture_records() if r["type"] == "event") == 26


def test_the_median_of_an_even_number_of_samples_is_the_middle(
    spark: SparkSession, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = write(
        tmp_path_factory.mktemp("even"),
        [*event_records(LINKS, "E1", "d", ["e"]), rtt("d", "e", 2.0), rtt("e", "d", 4.0)],
    )
    tel = read_telemetry(spark, root, SPEC.broker_names)
    measured, _ = metrics.distances(spark, tel.rtts, ZONES)
    assert [(r["distance_ms"], r["samples"]) for r in measured.collect()] == [(3.0, 2)]
