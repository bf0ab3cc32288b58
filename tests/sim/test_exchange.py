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
from canopy_broker.core.exchange import MAX_LOCK_ATTEMPTS, MAX_SHAPE_ATTEMPTS
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import (
    AddLink,
    Algorithm,
    CloseLink,
    ExchangeFinished,
    FromLink,
    Lock,
    LockRefused,
    Neighbours,
    Ordering,
    PeerFailed,
    RepairSweep,
    RoutingMode,
    SendToLink,
    StartExchange,
    StartTimer,
    TimerFired,
)
from canopy_broker.sim.checker import PubRecord, SubRecord, check_deliveries, check_routing
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
    assert CloseLink("b2") in retry  # the new link it had opened is dropped
    assert any(isinstance(e, StartTimer) and e.key == "lock:x2" for e in retry)  # back off


@pytest.mark.parametrize(
    ("stale", "reason", "tries"),
    [
        (False, "b1 is locked by exchange x9", MAX_LOCK_ATTEMPTS),
        (True, "b1 has no link to b2", MAX_SHAPE_ATTEMPTS),
        # From a broker before the field (a roll-out): its text says so.
        (False, "b1 has no link to b2", MAX_SHAPE_ATTEMPTS),
        (False, "b1 is already linked to b9", MAX_SHAPE_ATTEMPTS),
    ],
)
def test_initiator_gives_up_after_bounded_attempts(stale: bool, reason: str, tries: int) -> None:
    """A busy path gets every try (it frees itself); one refused as not matching the overlay
    (planned from a stale view) only a few, so that its caller plans again within seconds.
    Stale or not is a field of the refusal; a broker from before the field (during a
    roll-out) drops it as it passes a refusal on, and its text still says."""
    init = BrokerCore("b9")
    init.handle(AddLink("b1"))
    init.handle(StartExchange("x2", ("b9", "b1", "b2"), ("b1", "b2")))
    results = []
    for attempt in range(200):  # each retry is a new try: the refusal answers that one
        refusal = LockRefused("x2", reason, attempt, stale=stale)
        out = init.handle(FromLink("b1", refusal))
        results += [e for e in out if isinstance(e, ExchangeFinished)]
        if results:
            break
        init.handle(TimerFired("lock:x2"))
    assert results and not results[0].ok and f"gave up after {tries} " in results[0].reason


def test_a_lock_along_a_missing_link_is_refused_as_stale_and_a_locked_broker_as_busy() -> None:
    core = BrokerCore("b1")
    core.handle(AddLink("b0"))
    out = core.handle(FromLink("b0", Lock("x1", ("b0", "b1", "b2"), 1)))
    assert out == [SendToLink("b0", LockRefused("x1", "b1 has no link to b2", stale=True))]
    for peer in ("b2", "b9"):
        core.handle(AddLink(peer))
    core.handle(FromLink("b9", Lock("x2", ("b9", "b1", "b2"), 1)))
    out = core.handle(FromLink("b0", Lock("x3", ("b0", "b1", "b2"), 1)))
    assert out == [SendToLink("b0", LockRefused("x3", "b1 is locked by exchange x2"))]


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


def live_view(sim: Simulator, dead: set[str]) -> tuple[list[SubRecord], list[PubRecord]]:
    """Subscriptions of clients on live brokers, and publications from them."""
    alive = {c for c, b in sim.client_broker.items() if b not in dead}
    subs = [s for s in sim.subs if s.client in alive]
    pubs = [p for p in sim.publications() if p.publisher in alive]
    return subs, pubs


def test_lease_rolls_back_a_lock_whose_last_broker_died() -> None:
    """A2 dies before the lock reaches it: the brokers that locked release themselves when the
    lease runs out, the initiator gives up, and a later exchange over them succeeds."""
    sim = chain_sim(5)
    sim.run(until=100)
    sim.crash("b3", at=100)
    x = sim.exchange(("b0", "b1", "b2", "b3"), ("b1", "b2"), at=101, lease=0.5)
    sim.run()
    rec = sim.exchanges[x]
    assert rec.ok is False and "gave up" in rec.reason
    for name in ("b0", "b1", "b2"):
        core = sim.cores[name]
        assert core.exchange is None and not core.is_neighbour("b3" if name == "b0" else "zz")
    y = sim.exchange(("b0", "b1", "b2"), ("b1", "b2"), at=sim.now + 1)
    publish_from = sim.now + 200
    for k in range(200):
        sim.publish(f"p{k % 3}", {"x": k % 3}, at=publish_from + k)
    sim.run()
    assert sim.exchanges[y].ok
    subs, pubs = live_view(sim, {"b3", "b4"})
    later = [p for p in pubs if p.published_at >= publish_from]
    report = check_deliveries(subs, later, [d for d in sim.deliveries if d.at >= publish_from])
    assert report.ok and report.owed > 100, str(report)


def test_lease_rolls_forward_when_an_r_end_dies_mid_exchange() -> None:
    """R2 dies after phase 1 began: the survivors finish their parts when the lease runs out,
    the new link stays, and traffic between the sides flows over it."""
    sim = chain_sim(5)
    sim.run(until=100)
    x = sim.exchange(("b0", "b1", "b2", "b3"), ("b1", "b2"), at=100, lease=0.5)
    # Granted passes R2 (b2) about 3 link delays after the lock starts; die just after.
    sim.run(until=100)
    while not sim.cores["b2"].exchange or not sim.cores["b2"].exchange.granted:
        sim.run(until=sim.now + 0.5)
    sim.crash("b2", at=sim.now)
    sim.run()
    rec = sim.exchanges[x]
    assert rec.ok is False and "rolled forward" in rec.reason
    for name in ("b0", "b1", "b3", "b4"):
        assert sim.cores[name].exchange is None
    assert sim.cores["b0"].is_neighbour("b3") and not sim.cores["b1"].is_neighbour("b2")
    start = sim.now + 100
    for k in range(300):
        sim.publish(("p0", "p1", "p3", "p4")[k % 4], {"x": k % 3}, at=start + k)
    sim.run()
    subs, pubs = live_view(sim, {"b2"})
    later = [p for p in pubs if p.published_at >= start]
    report = check_deliveries(subs, later, [d for d in sim.deliveries if d.at >= start])
    assert report.ok and report.owed > 200, str(report)


def test_a_path_slower_than_the_lease_changes_nothing_anywhere() -> None:
    """Every link takes 40 units and the lease is 100: Granted can never be back at A1 within
    half a lease, so A1 never commits. No broker may begin phase 1 for a try A1 has let go (it
    used to happen where Granted passed an R end), so the exchange fails having changed nothing:
    the old tree routes exactly, and traffic throughout loses, doubles and reorders nothing."""
    names = [f"b{i}" for i in range(5)]
    edges = list(itertools.pairwise(names))
    sim = Simulator(names, edges, seed=3, link_delay=(40.0, 40.0))
    for i, b in enumerate(names):
        sim.attach(f"s{i}", b, at=0)
        sim.subscribe(f"s{i}", "x", Filter.parse(f"x = {i % 3}"), at=1)
        sim.attach(f"p{i}", b, at=0)
    sim.run(until=1000)
    x = sim.exchange(("b0", "b1", "b2", "b3"), ("b1", "b2"), at=1000, lease=1.0)
    publish_throughout(sim, 1000, 6000, 5)
    sim.run()
    rec = sim.exchanges[x]
    assert rec.ok is False and "within half the lease" in rec.reason, rec.reason
    assert all(core.exchange is None for core in sim.cores.values())
    assert not check_routing(sim.cores, edges, sim.subscriptions_by_broker())
    report = check_deliveries(sim.subs, list(sim.pubs.values()), sim.deliveries)
    assert report.ok and report.owed > 1000, str(report)


@pytest.mark.parametrize("mode", [RoutingMode.IDENTITY, RoutingMode.SIMPLE])
def test_path_algorithm_leaves_canonical_tables_and_reports_its_losses(mode: RoutingMode) -> None:
    """Paper 002's algorithm rewrites routes in place along the reconfiguration path; it must
    end with exactly the canonical tables. It does not guarantee delivery: its losses are
    measured (and here shown to exist, so the figure is not vacuous), never hidden."""
    lost = 0
    for seed in range(4):
        run = run_exchanges(30, seed=seed, rounds=5, group_size=1, algorithm="path", mode=mode)
        assert not run.routing_problems, run.routing_problems[:3]
        assert not run.leftovers, run.leftovers
        s = run.report.summary()
        assert s["spurious"] == 0
        lost += s["lost"] + s["duplicated"]
    assert lost > 0


@pytest.mark.parametrize(
    ("path", "remove"),
    [
        (("b1", "b2", "b3"), ("b1", "b2")),  # A1 is R1: empty head path
        (("b0", "b1", "b2"), ("b1", "b2")),  # A2 is R2: empty tail path
        (("b0", "b1", "b2", "b3"), ("b1", "b2")),
    ],
)
def test_path_algorithm_on_short_paths(path: tuple[str, ...], remove: tuple[str, str]) -> None:
    names = [f"b{i}" for i in range(5)]
    sim = Simulator(names, list(itertools.pairwise(names)), mode=RoutingMode.IDENTITY, seed=2)
    for i, b in enumerate(names):
        sim.attach(f"s{i}", b, at=0)
        sim.subscribe(f"s{i}", "x", Filter.parse(f"x = {i % 3}"), at=1)
    sim.run(until=100)
    x = sim.exchange(path, remove, at=100, algorithm=Algorithm.PATH)
    sim.run()
    assert sim.exchanges[x].ok
    final = [e for e in itertools.pairwise(names) if set(e) != set(remove)] + [(path[0], path[-1])]
    assert not check_routing(sim.cores, final, sim.subscriptions_by_broker())


def test_path_algorithm_refuses_covering_routing() -> None:
    core = BrokerCore("b1", RoutingMode.COVERING)
    core.handle(AddLink("b2"))
    with pytest.raises(ProtocolError, match="identity or simple routing"):
        core.handle(StartExchange("x", ("b0", "b1", "b2"), ("b1", "b2"), algorithm=Algorithm.PATH))


def test_a_broker_repairing_around_a_dead_one_refuses_locks_until_its_routes_are_in() -> None:
    """b4 repairs around b0 (chain b1-b4), holding what it routes towards b1 until b1's
    sweep comes. An exchange that reshaped the tree meanwhile let newer notifications reach
    b1 by another path, and the held ones, replayed after, were dropped there as had (chaos
    soak: 457 lost untold). The lock is refused as busy, and taken once the repair is done."""
    core = BrokerCore("b4", announce_neighbours=True)
    for peer in ("b0", "b1", "b2"):
        core.handle(AddLink(peer))
    core.handle(FromLink("b0", Neighbours(("b1", "b4"))))
    core.handle(PeerFailed("b0"))
    assert core.repair_holding == "b0"
    out = core.handle(FromLink("b2", Lock("x1", ("b2", "b4", "b1"), 1)))
    assert out == [SendToLink("b2", LockRefused("x1", "b4 is repairing around b0"))]
    core.handle(FromLink("b1", RepairSweep("b0", forward=True)))
    assert core.repair_holding is None
    out = core.handle(FromLink("b2", Lock("x1", ("b2", "b4", "b1"), 1)))
    assert core.exchange is not None and core.exchange.xid == "x1", out
