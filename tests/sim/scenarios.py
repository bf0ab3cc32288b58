"""Random workloads for the simulator: trees, clients, subscriptions, publications."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import strategies as st

from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import RoutingMode
from canopy_broker.sim.simulator import CoreFactory, Simulator
from canopy_broker.sim.topology import random_tree
from tests.strategies import events, filters


@dataclass
class Workload:
    n_brokers: int
    seed: int
    mode: RoutingMode
    subscriptions: list[tuple[int, Filter, float]]  # (client index, filter, time)
    publications: list[tuple[int, dict[str, object], float]]
    unsubscribe_fraction: float


@st.composite
def workloads(draw: st.DrawFn, max_brokers: int = 60) -> Workload:
    return Workload(
        n_brokers=draw(st.integers(min_value=2, max_value=max_brokers)),
        seed=draw(st.integers(min_value=0, max_value=2**32 - 1)),
        mode=draw(st.sampled_from(list(RoutingMode))),
        subscriptions=draw(
            st.lists(
                st.tuples(st.integers(0, 200), filters, st.floats(0, 100)), min_size=1, max_size=60
            )
        ),
        publications=draw(
            st.lists(st.tuples(st.integers(0, 200), events, st.floats(0, 400)), max_size=80)
        ),
        unsubscribe_fraction=draw(st.sampled_from([0.0, 0.3])),
    )


def build(w: Workload, core_factory: CoreFactory = BrokerCore) -> Simulator:
    rng = random.Random(w.seed)
    edges = random_tree(w.n_brokers, rng)
    brokers = [f"b{i}" for i in range(w.n_brokers)]
    sim = Simulator(brokers, edges, mode=w.mode, seed=w.seed, core_factory=core_factory)
    n_clients = max(2, w.n_brokers // 2)
    for i in range(n_clients):
        sim.attach(f"c{i}", rng.choice(brokers), at=0.0)
    sub_ids: list[tuple[str, str, float]] = []
    for k, (ci, f, t) in enumerate(w.subscriptions):
        client = f"c{ci % n_clients}"
        sim.subscribe(client, f"s{k}", f, at=t)
        sub_ids.append((client, f"s{k}", t))
    # Publications are scheduled in time order per publisher (the simulator assigns sequence
    # numbers at scheduling time, and a publisher publishes in sequence order).
    for ci, attrs, t in sorted(w.publications, key=lambda p: p[2]):
        sim.publish(f"c{ci % n_clients}", attrs, at=t)  # type: ignore[arg-type]
    for client, sub_id, t in sub_ids:
        if rng.random() < w.unsubscribe_fraction:
            sim.unsubscribe(client, sub_id, at=t + rng.uniform(50, 300))
    return sim
