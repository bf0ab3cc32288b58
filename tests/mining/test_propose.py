"""Which exchange the miner proposes, and why — on the hand-computed fixture of test_metrics."""

from __future__ import annotations

import random

import pytest
from pyspark.sql import SparkSession

from canopy_broker.sim.topology import random_tree
from canopy_operator.mining import metrics, propose
from canopy_operator.mining.job import MiningResult, Settings, mine
from canopy_operator.mining.source import read_telemetry
from canopy_operator.model import proposals
from canopy_operator.model.topology import parse_overlay
from tests.mining.telemetry import event_records, write
from tests.mining.test_metrics import LINKS, SPEC, fixture_records, overlay_manifest


@pytest.fixture(scope="module")
def result(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> MiningResult:
    root = write(tmp_path_factory.mktemp("tel"), fixture_records())
    return mine(spark, root, SPEC, LINKS)


def test_the_far_apart_pair_gets_linked_and_the_weakest_path_link_goes(
    result: MiningResult,
) -> None:
    # d's most associated broker is e (AS(e)_d = 1.0), four links away. On the path d-b-a-c-e
    # the links b-d, a-c, c-e carry no associativity (a-b carries 2.0); of those, b-d and a-c
    # carried the fewest sampled events (4; c-e carried 5), and a-c comes first by name.
    # e asks for the same exchange (AS(d)_e = 0.8): one candidate.
    assert [(c.remove, c.add, c.broker) for c in result.candidates] == [
        (("a", "c"), ("d", "e"), "d")
    ]
    (chosen,) = result.chosen
    assert chosen.cycle == ("d", "b", "a", "c", "e")
    ev = result.evidence(chosen)
    assert ev["associativityBefore"] == 2.0 and ev["associativityAfter"] == 3.8
    # replayed on the current tree it costs what was measured: 19 hops for 7 events
    assert ev["hopsPerEventBefore"] == pytest.approx(19 / 7, abs=1e-4)
    assert result.before.hops_per_event == pytest.approx(result.traffic.hops_per_event)
    assert result.before.pure_forwarder_rate == pytest.approx(result.traffic.pure_forwarder_rate)
    # on a-b-d-e-c every event crosses one link and nobody forwards in vain
    assert ev["hopsPerEventAfter"] == 1.0 and ev["pureForwarderRateAfter"] == 0.0
    assert ev["expectedGain"] == "-63.2% hops/event"


def test_proposals_are_valid_topology_proposal_objects(result: MiningResult) -> None:
    (p,) = result.proposals(namespace="prod")
    manifest = proposals.to_manifest(p)
    assert manifest["kind"] == "TopologyProposal"
    assert manifest["spec"]["overlay"] == "hand" and manifest["spec"]["generation"] == 3
    assert manifest["spec"]["changes"] == [{"remove": ["a", "c"], "add": ["d", "e"]}]
    assert proposals.from_manifest(manifest).changes == p.changes
    after = proposals.apply_changes(LINKS, p.changes)
    assert sorted(after) == [("a", "b"), ("b", "d"), ("c", "e"), ("d", "e")]


def test_max_distance_leaves_the_far_broker_out(spark: SparkSession, tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = write(tmp_path, fixture_records())
    far = mine(spark, root, SPEC, LINKS, Settings(max_distance=2.5))  # d-e is 3.0 ms
    assert far.candidates == [] and far.chosen == []
    near = mine(spark, root, SPEC, LINKS, Settings(max_distance=3.0))
    assert [c.add for c in near.chosen] == [("d", "e")]


def test_no_proposal_when_associativity_would_not_rise(spark: SparkSession, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Interests already together: d and e share events, and so does every link on the way.
    links = [("d", "b"), ("b", "a"), ("a", "c"), ("c", "e")]
    recs = []
    for i in range(4):
        recs += event_records(links, f"X{i}", "d", ["d", "b", "a", "c", "e"])
    spec = parse_overlay(overlay_manifest(links=[list(e) for e in links]))
    res = mine(spark, write(tmp_path, recs), spec, links)
    assert res.chosen == []
    assert res.dropped.get("associativity_not_higher", 0) >= 1


# -- pure parts (no Spark) --------------------------------------------------------------------


def test_fan_out_bound_drops_a_candidate() -> None:
    links = [("a", "x"), ("a", "y"), ("a", "z"), ("a", "b"), ("b", "c")]
    row = {
        "broker": "c",
        "partner": "a",
        "towards": 0.8,
        "link_as": 1.0,
        "distance_ms": 1.0,
        "distance_from": "rtt",
    }
    # the path c-b-a: the weakest link is b-c (0.0), so a would gain a fifth link
    kept, dropped = propose.exchanges([row], links, {("a", "b"): (0.25, 0.25)}, max_fan_out=4)
    assert kept == [] and dropped == {"fan_out": 1}
    # removing a-b instead (weaker) keeps a at four links: allowed
    kept, _ = propose.exchanges([row], links, {("b", "c"): (0.45, 0.45)}, max_fan_out=4)
    assert [(c.remove, c.add) for c in kept] == [(("a", "b"), ("a", "c"))]


def test_the_asking_broker_must_gain_too() -> None:
    """Paper 001: B's own associativity must rise, not only the total. c asks for a (AS(a)_c =
    0.3); the weakest link on the path is c's own link to b, which c values at 0.5 (b does
    not value it): the total would rise (1.0 > 0.5), c's own associativity would fall."""
    links = [("a", "b"), ("b", "c")]
    row = {"broker": "c", "partner": "a", "towards": 0.3, "link_as": 1.0}
    directed = {("a", "b"): (0.6, 0.6), ("b", "c"): (0.0, 0.5)}
    kept, dropped = propose.exchanges([row], links, directed, max_fan_out=4)
    assert kept == [] and dropped == {"associativity_not_higher": 1}
    kept, _ = propose.exchanges([{**row, "towards": 0.7}], links, directed, max_fan_out=4)
    assert [(c.remove, c.add) for c in kept] == [(("b", "c"), ("a", "c"))]


def test_choose_keeps_only_exchanges_valid_together() -> None:
    links = [("a", "b"), ("b", "c"), ("c", "d")]

    def cand(remove: tuple[str, str], add: tuple[str, str]) -> propose.Candidate:
        return propose.Candidate("x", add, remove, 1.0, 0.0, None, None)

    first = cand(("b", "c"), ("a", "d"))
    clash = cand(("b", "c"), ("a", "c"))  # its removed link is gone once `first` is applied
    second = cand(("a", "b"), ("b", "c"))  # on b-a-d-c, a-b is on the cycle of b-c
    chosen, tree = propose.choose([first, clash, second], links, k=3, max_fan_out=4)
    assert chosen == [first, second]
    assert tree == [("a", "d"), ("b", "c"), ("c", "d")]


def test_ancestor_rows_root_at_the_centre() -> None:
    chain = [("a", "b"), ("b", "c"), ("c", "d"), ("d", "e")]
    rows = propose.ancestor_rows(0, chain)
    # rooted at c: a sits below links a-b and b-c, identified by their lower ends a and b
    assert sorted((n, e) for _, n, e in rows if n == "a") == [("a", "a"), ("a", "b")]
    assert not [r for r in rows if r[1] == "c"]
    assert len(rows) == 6  # depths 2+1+0+1+2


def test_replay_matches_routing_on_random_trees(spark: SparkSession, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On the tree it was measured on, replay predicts exactly the measured hops and pure
    forwarders (so the replay's model of routing is the brokers'); on another tree it differs."""
    rng = random.Random(7)
    links = random_tree(30, rng, max_fanout=3)
    brokers = sorted({b for e in links for b in e})
    recs = []
    for i in range(60):
        origin = rng.choice(brokers)
        recs += event_records(links, f"R{i}", origin, rng.sample(brokers, rng.randint(1, 6)))
    spec = parse_overlay(
        {
            "kind": "BrokerOverlay",
            "metadata": {"name": "rnd"},
            "spec": {"brokers": [{"name": b} for b in brokers], "links": [list(e) for e in links]},
        }
    )
    tel = read_telemetry(spark, write(tmp_path, recs), brokers)
    measured = metrics.traffic(tel.events)
    sets, stats = propose.terminal_sets(tel.events)
    assert stats["replayable"] == 60 and stats["partial"] == 0
    other = random_tree(30, random.Random(8), max_fanout=3)
    same, different = propose.replay(spark, sets, [links, other])
    assert same.hops_per_event == pytest.approx(measured.hops_per_event)
    assert same.pure_forwarder_rate == pytest.approx(measured.pure_forwarder_rate)
    assert different.hops_per_event != pytest.approx(measured.hops_per_event)
    assert spec.links is not None
