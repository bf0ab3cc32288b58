"""Link-exchange experiments on the simulator: live traffic, churn, concurrent exchanges.

One run: a random tree, subscribers with one-character patterns (the set-up of paper 002),
publishers publishing throughout, and *rounds* of link exchanges. Each round is a group of exchanges
computed on the tree the previous rounds lead to; exchanges in a group may share brokers (their
locks then serialise them) but are valid in either order. Rounds are spaced in time, not waited
for, so a round may start while the previous one still runs — its locks then retry until the links
they need exist. Subscriptions change during the run as well.

The result carries the simulator (for the checker), the expected final tree and per-exchange
records. The same function runs the strawman, which does the same exchanges uncoordinated.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from canopy_broker.core.filters import Constraint, Filter, Op
from canopy_broker.core.messages import Algorithm, Ordering, RoutingMode
from canopy_broker.sim.checker import DeliveryReport, check_deliveries, check_routing
from canopy_broker.sim.simulator import Simulator
from canopy_broker.sim.topology import Edge, ExchangeSpec, norm, random_group, random_tree

PATTERNS = [chr(c) for c in range(ord("!"), ord("!") + 96)]
AlgorithmName = Literal["coordinated", "path", "strawman"]


@dataclass
class ExchangeRun:
    sim: Simulator
    final_edges: list[Edge]
    specs: list[ExchangeSpec]
    report: DeliveryReport
    routing_problems: list[str]
    leftovers: list[str] = field(default_factory=list)
    requested_at: list[float] = field(default_factory=list)  # per spec, in order
    initial_edges: list[Edge] = field(default_factory=list)  # the tree before the first exchange

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.routing_problems and not self.leftovers


def pattern_filter(p: str, *, contains: bool = False) -> Filter:
    return Filter.of([Constraint("p", Op.CONTAINS if contains else Op.EQ, p)])


def run_exchanges(
    n: int,
    *,
    seed: int,
    rounds: int = 5,
    group_size: int = 2,
    algorithm: AlgorithmName = "coordinated",
    mode: RoutingMode = RoutingMode.COVERING,
    ordering: Ordering = Ordering.FIFO,
    density: float = 0.5,
    publishers: int = 4,
    publish_interval: float = 2.0,
    round_spacing: float = 150.0,
    churn: int = 5,
    max_fanout: int = 4,
    wide_filters: bool = True,
    record_traffic: bool = False,
    publishers_subscribe: bool = True,
    patterns: tuple[int, int] = (1, 10),
    event_chars: int = 0,
    publisher_per_broker: bool = False,
    strawman_gap: float = 0.0,
    dedicated: int = 0,
    link_delay: tuple[float, float] = (1.0, 10.0),
    poisson: bool = False,
    settle: float = 200.0,
    quiet: float = 100.0,
    timer_scale: float = 100.0,
    min_side: int = 0,
) -> ExchangeRun:
    """One run; the defaults are the test workload, the extra knobs reproduce the papers'.

    ``patterns`` is the inclusive range of one-character patterns each subscriber takes.
    ``event_chars`` = 0 publishes events naming one pattern (``p = c``); k > 0 publishes k-character
    strings matched by ``p contains c``, as paper 002 does (an event then matches several patterns).
    ``publisher_per_broker`` puts one publisher on every broker (paper 002: every dispatcher
    publishes). ``strawman_gap`` is how long the strawman leaves the tree cut before the new link
    appears (paper 002: 0.1 s = 100 units). ``dedicated`` > 0 replaces the pattern subscribers by
    paper 000's workload: each publisher has that many subscribers, on random brokers, that take
    all of its notifications and nothing else. ``poisson`` draws the gaps between publications
    from an exponential distribution (mean ``publish_interval``) instead of a uniform one.
    ``settle`` is when the first round may start (the initial subscriptions must have spread) and
    ``quiet`` the least time between one round's request and the next: with slow links both
    must grow, or one exchange's messages would be counted in the next one's window.
    ``timer_scale`` is clock units per second of the cores' timers (1000 when a unit is a ms).
    ``min_side`` > 0 removes only links that leave at least that many brokers on either side.
    """
    rng = random.Random(seed)
    edges = random_tree(n, rng, max_fanout=max_fanout)
    brokers = [f"b{i}" for i in range(n)]
    sim = Simulator(
        brokers,
        edges,
        mode=mode,
        seed=seed,
        record_traffic=record_traffic,
        link_delay=link_delay,
        timer_scale=timer_scale,
    )

    subs: list[tuple[str, str]] = []
    subscribers = [] if dedicated else rng.sample(brokers, max(1, round(density * n)))
    for i, b in enumerate(subscribers):
        client = f"s{i}"
        sim.attach(client, b, at=0)
        for k, pattern in enumerate(rng.sample(PATTERNS, rng.randint(*patterns))):
            sim.subscribe(client, f"f{k}", pattern_filter(pattern, contains=event_chars > 0), at=1)
            subs.append((client, f"f{k}"))
        if wide_filters and rng.random() < 0.2:  # something for covering to chew on
            wide = Filter.of([Constraint("p", Op.GE, rng.choice(PATTERNS))])
            sim.subscribe(client, "wide", wide, at=1)
            subs.append((client, "wide"))
    if publisher_per_broker:
        publishers = n
    pubs = [f"p{i}" for i in range(publishers)]
    for i, p in enumerate(pubs):
        # Publishers also subscribe, so what they publish may causally follow what they saw.
        sim.attach(p, brokers[i] if publisher_per_broker else rng.choice(brokers), at=0)
        for j in range(dedicated):
            client = f"s{i}.{j}"
            sim.attach(client, rng.choice(brokers), at=0)
            sim.subscribe(client, "all", Filter.of([Constraint("src", Op.EQ, p)]), at=1)
            subs.append((client, "all"))
        if publishers_subscribe:
            for k, pattern in enumerate(rng.sample(PATTERNS, 20)):
                sim.subscribe(p, f"f{k}", pattern_filter(pattern), at=1)

    start = settle
    sim.run(until=start)  # the initial subscriptions settle
    clock = start

    def publish_until(t_end: float) -> None:
        nonlocal clock
        while clock < t_end:
            if dedicated:
                pub = rng.choice(pubs)
                sim.publish(pub, {"src": pub}, at=clock)
            elif event_chars:
                text = "".join(rng.choices(PATTERNS, k=event_chars))
                sim.publish(rng.choice(pubs), {"p": text}, at=clock)
            else:
                sim.publish(rng.choice(pubs), {"p": rng.choice(PATTERNS)}, at=clock)
            if poisson:
                clock += rng.expovariate(1.0 / publish_interval)
            else:
                clock += publish_interval * rng.uniform(0.5, 1.5)

    # The exchanges are planned up front with their own random source, so that every algorithm
    # run with the same seed performs the same exchanges at the same offsets.
    plan_rng = random.Random(seed * 7919 + 1)
    plan: list[list[tuple[ExchangeSpec, float]]] = []
    current = list(edges)
    for _ in range(rounds):
        group = random_group(current, plan_rng, group_size, max_fanout, min_side)
        plan.append([(spec, plan_rng.uniform(0, 30)) for spec in group])
        for spec in group:
            current = spec.apply(current)

    specs: list[ExchangeSpec] = []
    requested_at: list[float] = []
    live_subs = list(subs)
    for r, group_plan in enumerate(plan):
        base = max(sim.now, clock) + 20
        xids = []
        for spec, offset in group_plan:
            at = base + offset
            if algorithm != "strawman":
                xids.append(
                    sim.exchange(
                        spec.path,
                        spec.remove,
                        at=at,
                        ordering=ordering,
                        algorithm=Algorithm(algorithm),
                    )
                )
            else:
                sim.strawman_exchange(spec.remove, spec.add, at=at, gap=strawman_gap)
            specs.append(spec)
            requested_at.append(at)
        renewed = []
        for i in range(min(churn, len(live_subs))):
            client, sub_id = live_subs.pop(rng.randrange(len(live_subs)))
            at = base + rng.uniform(0, 60)
            sim.unsubscribe(client, sub_id, at=at)
            again = (client, f"{sub_id}.{r}.{i}")
            sim.subscribe(*again, pattern_filter(rng.choice(PATTERNS)), at=at + rng.uniform(5, 60))
            renewed.append(again)
        live_subs += renewed
        # Rounds are computed on the tree the previous round leads to, so the next one waits;
        # publishers keep publishing meanwhile.
        while True:
            horizon = max(sim.now, clock) + round_spacing / 3
            publish_until(horizon)
            sim.run(until=horizon)
            if sim.now > base + quiet and all(sim.exchanges[x].finished_at for x in xids):
                break
    publish_until(clock + 100)
    sim.run()
    report = check_deliveries(sim.subs, sim.publications(), sim.deliveries)
    problems = check_routing(sim.cores, current, sim.subscriptions_by_broker())
    if sorted(map(norm, sim.edges)) != sorted(map(norm, current)):
        problems.append(f"links {sorted(sim.edges)} differ from the expected tree")
    leftovers = [
        f"{name}: still in exchange {core.exchange.xid}"
        for name, core in sim.cores.items()
        if core.exchange is not None
    ]
    leftovers += [
        f"exchange {rec.xid} did not finish: {rec.reason or 'no result'}"
        for rec in sim.exchanges.values()
        if not rec.ok
    ]
    return ExchangeRun(sim, current, specs, report, problems, leftovers, requested_at, edges)
