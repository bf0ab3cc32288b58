"""Data-plane routing verified in the simulator: exact delivery and canonical routing tables.

Every check here is also run against a deliberately broken router (see ``test_checker_trips``),
so a passing property test means something.
"""

from __future__ import annotations

import random

from hypothesis import given, settings

from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import RoutingMode
from canopy_broker.sim.checker import check_deliveries, check_routing
from canopy_broker.sim.simulator import Simulator
from canopy_broker.sim.topology import random_tree
from tests.sim.scenarios import Workload, build, workloads


def run_and_check(w: Workload) -> Simulator:
    sim = build(w)
    sim.run()
    report = check_deliveries(sim.subs, sim.publications(), sim.deliveries)
    assert report.ok, (str(report), report.lost[:5], report.duplicated[:5], report.spurious[:5])
    problems = check_routing(sim.cores, sim.edges, sim.subscriptions_by_broker())
    assert not problems, problems[:5]
    return sim


@given(workloads())
@settings(max_examples=60)
def test_random_trees_deliver_exactly_once_in_order_with_canonical_tables(w: Workload) -> None:
    run_and_check(w)


def test_a_workload_that_owes_many_notifications() -> None:
    """Guard against a vacuous property: the default workload shape really owes deliveries."""
    rng = random.Random(7)
    n = 40
    edges = random_tree(n, rng)
    for mode in RoutingMode:
        sim = Simulator([f"b{i}" for i in range(n)], edges, mode=mode, seed=7)
        for i in range(30):
            sim.attach(f"c{i}", f"b{rng.randrange(n)}", at=0)
        for i in range(30):
            sim.subscribe(f"c{i}", "s", Filter.parse(f"x < {i % 7} and y exists"), at=1)
            sim.subscribe(f"c{i}", "t", Filter.parse(f"x < {i % 5}"), at=2)
        for k in range(200):
            sim.publish(f"c{k % 3}", {"x": k % 9, "y": "v"}, at=300 + k)
        for i in range(0, 30, 2):
            sim.unsubscribe(f"c{i}", "t", at=320)
        sim.run()
        report = check_deliveries(sim.subs, sim.publications(), sim.deliveries)
        assert report.ok, str(report)
        assert report.owed > 1500, report.summary()
        assert not check_routing(sim.cores, sim.edges, sim.subscriptions_by_broker())


def test_covering_uses_fewer_messages_than_simple() -> None:
    rng = random.Random(3)
    edges = random_tree(30, rng)
    counts = {}
    for mode in RoutingMode:
        sim = Simulator([f"b{i}" for i in range(30)], edges, mode=mode, seed=3)
        for i in range(30):
            sim.attach(f"c{i}", f"b{i}", at=0)
            sim.subscribe(f"c{i}", "s", Filter.parse(f"x < {i}"), at=1)
            sim.subscribe(f"c{i}", "t", Filter.parse(f"x < {i}"), at=2)
        sim.run()
        counts[mode] = sim.stats.messages["Subscribe"]
    assert counts[RoutingMode.COVERING] < counts[RoutingMode.IDENTITY] < counts[RoutingMode.SIMPLE]


def test_same_seed_same_run() -> None:
    rng = random.Random(0)
    texts = ["x > 3", 'x <= 5 and y = "a"', 'y prefix "b"', "x >= 0", 'y != "a"']
    w = Workload(
        n_brokers=15,
        seed=7,
        mode=RoutingMode.COVERING,
        subscriptions=[(i, Filter.parse(rng.choice(texts)), rng.uniform(0, 50)) for i in range(12)],
        publications=[
            (
                rng.randrange(8),
                {"x": rng.randrange(10), "y": rng.choice("abc")},
                rng.uniform(60, 300),
            )
            for _ in range(40)
        ],
        unsubscribe_fraction=0.3,
    )
    runs = []
    for _ in range(2):
        sim = build(w)
        sim.run()
        runs.append((sim.deliveries, dict(sim.stats.messages)))
    assert runs[0][0], "the workload delivers nothing: the comparison would be empty"
    assert runs[0] == runs[1]
