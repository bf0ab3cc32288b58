"""The coordinated link exchange, verified in the simulator under live traffic.

Each property below runs the same checker that the strawman must fail
(``test_strawman_trips_the_checker``), so "zero lost, zero duplicated, zero reordered" is a claim
that can be false.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canopy_broker.core.broker import BrokerCore, ProtocolError
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import (
    AddLink,
    ExchangeFinished,
    FromLink,
    Lock,
    LockRefused,
    Ordering,
    RoutingMode,
    SendToLink,
    StartExchange,
    StartTimer,
    TimerFired,
)
from canopy_broker.sim.checker import check_deliveries, check_routing
from canopy_broker.sim.experiments import run_exchanges
from canopy_broker.sim.simulator import Simulator


def chain_sim(n: int, seed: int = 1) -> Simulator:
    names = [f"b{i}" for i in range(n)]
    sim = Simulator(names, list(itertools.pairwise(names)), seed=seed)
    for i, b in enumerate(names):
        sim.attach(f"s{i}", b, at=0)
        sim.subscribe(f"s{i}", "x", Filter.parse(f"x = {i % 3}"), at=1)
        sim.attach(f"p{i}", b, at=0)
    return sim


def publish_throughout(sim: Simulator, start: float, end: float, n: int) -> None:
    t, k = start, 0
    while t < end:
        sim.publish(f"p{k % n}", {"x": k % 3}, at=t)
        t += 0.7
        k += 1


@pytest.mark.parametrize(
    ("path", "remove"),
    [
        (("b0", "b1", "b2", "b3"), ("b1", "b2")),  # a general cycle
        (("b1", "b2", "b3"), ("b1", "b2")),  # A1 is R1
        (("b0", "b1", "b2"), ("b1", "b2")),  # A2 is R2
        (("b4", "b3", "b2", "b1", "b0"), ("b0", "b1")),  # removed link at the far end
    ],
)
def test_single_exchange_under_traffic(path: tuple[str, ...], remove: tuple[str, str]) -> None:
    sim = chain_sim(5)
    sim.run(until=100)
    publish_throughout(sim, 100, 400, 5)
    xid = sim.exchange(path, remove, at=150)
    sim.run()
    rec = sim.exchanges[xid]
    assert rec.ok and rec.attempts == 1
    final = [(f"b{i}", f"b{i + 1}") for i in range(4) if {f"b{i}", f"b{i + 1}"} != set(remove)]
    final.append((path[0], path[-1]))
    assert sorted(map(sorted, sim.edges)) == sorted(map(sorted, final))
    report = check_deliveries(sim.subs, sim.publications(), sim.deliveries)
    assert report.ok and report.owed > 500, str(report)
    assert not check_routing(sim.cores, final, sim.subscriptions_by_broker())
    assert all(c.exchange is None for c in sim.cores.values())


def test_overlapping_exchanges_serialise_through_locks() -> None:
    """Two exchanges that share brokers, requested at the same instant, both complete; at least
    one had to retry after meeting the other's lock."""
    sim = chain_sim(6)
    sim.run(until=100)
    publish_throughout(sim, 100, 900, 6)
    x = sim.exchange(("b0", "b1", "b2", "b3"), ("b1", "b2"), at=150)
    y = sim.exchange(("b5", "b4", "b3", "b2"), ("b4", "b3"), at=150)
    sim.run()
    recs = [sim.exchanges[x], sim.exchanges[y]]
    assert all(r.ok for r in recs)
    assert max(r.attempts for r in recs) > 1
    report = check_deliveries(sim.subs, sim.publications(), sim.deliveries)
    assert report.ok, str(report)


@given(
    n=st.integers(min_value=4, max_value=60),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    mode=st.sampled_from(list(RoutingMode)),
    group_size=st.integers(min_value=1, max_value=3),
    rounds=st.integers(min_value=1, max_value=4),
)
@settings(max_examples=25)
def test_random_concurrent_exchanges_lose_nothing(
    n: int, seed: int, mode: RoutingMode, group_size: int, rounds: int
) -> None:
    run = run_exchanges(n, seed=seed, rounds=rounds, group_size=group_size, mode=mode)
    assert run.report.ok, str(run.report)
    assert not run.routing_problems, run.routing_problems[:3]
    assert not run.leftovers, run.leftovers


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_strawman_trips_the_checker(seed: int) -> None:
    """The negative control: the same exchanges done uncoordinated lose or duplicate."""
    run = run_exchanges(30, seed=seed, rounds=4, group_size=2, algorithm="strawman")
    s = run.report.summary()
    assert s["lost"] + s["duplicated"] + s["reordered"] > 0, str(run.report)


def test_coordinated_passes_where_the_strawman_fails() -> None:
    for seed in (0, 1, 2, 3):
        run = run_exchanges(30, seed=seed, rounds=4, group_size=2)
        assert run.ok, (seed, str(run.report), run.routing_problems[:2], run.leftovers)


def test_invalid_requests_are_refused_at_the_boundary() -> None:
    core = BrokerCore("b0")
    core.handle(AddLink("b1"))
    with pytest.raises(ProtocolError, match="not on the cycle path"):
        core.handle(StartExchange("x", ("b0", "b1", "b2"), ("b5", "b6")))
    with pytest.raises(ProtocolError, match="too short"):
        core.handle(StartExchange("x", ("b0", "b1"), ("b0", "b1")))
    with pytest.raises(ProtocolError, match="must start at"):
        core.handle(StartExchange("x", ("b1", "b0", "b2"), ("b0", "b2")))
    with pytest.raises(ProtocolError, match="repeats"):
        core.handle(StartExchange("x", ("b0", "b1", "b0"), ("b0", "b1")))


def test_a_busy_broker_refuses_and_the_initiator_backs_off() -> None:
    core = BrokerCore("b1")
    for peer in ("b0", "b2", "b9"):
        core.handle(AddLink(peer))
    core.handle(FromLink("b0", Lock("x1", ("b0", "b1", "b2"), 1)))
    assert core.exchange is not None and core.exchange.xid == "x1"
    out = core.handle(FromLink("b9", Lock("x2", ("b9", "b1", "b2"), 1)))
    assert out == [SendToLink("b9", LockRefused("x2", "b1 is locked by exchange x1"))]
    init = BrokerCore("b9")
    init.handle(AddLink("b1"))
    init.handle(StartExchange("x2", ("b9", "b1", "b2"), ("b1", "b2")))
    retry = init.handle(FromLink("b1", LockRefused("x2", "busy")))
    assert init.exchange is None and not init.is_neighbour("b2")
    assert len(retry) == 2 and isinstance(retry[1], StartTimer)  # close new link, back off


def test_initiator_gives_up_after_bounded_attempts() -> None:
    init = BrokerCore("b9")
    init.handle(AddLink("b1"))
    init.handle(StartExchange("x2", ("b9", "b1", "b2"), ("b1", "b2")))
    results = []
    for _ in range(200):
        out = init.handle(FromLink("b1", LockRefused("x2", "busy")))
        results += [e for e in out if isinstance(e, ExchangeFinished)]
        if results:
            break
        init.handle(TimerFired("lock:x2"))
    assert results and not results[0].ok and "gave up" in results[0].reason


def test_causal_mode_keeps_causal_order_where_fifo_mode_does_not() -> None:
    """Publishers here also subscribe, so notifications depend on each other across publishers.
    FIFO mode is allowed to break such dependencies at the new link, and does in some of these
    seeded runs (the causal checker's negative control); causal mode must not — and both must
    stay exactly-once and FIFO."""
    violated = []
    for seed in range(8):
        fifo = run_exchanges(30, seed=seed, rounds=4, group_size=2, publish_interval=0.5)
        assert fifo.ok, str(fifo.report)
        if fifo.report.causal:
            violated.append(seed)
    assert violated, "no seed showed a causal violation under FIFO: the check proves nothing"
    for seed in violated:
        causal = run_exchanges(
            30, seed=seed, rounds=4, group_size=2, publish_interval=0.5, ordering=Ordering.CAUSAL
        )
        assert causal.ok and causal.report.causal_ok, (seed, causal.report.summary())
