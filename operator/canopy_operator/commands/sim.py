"""`canopy sim routing`: run a random workload on the simulator and print verified figures.

This is the quickest way to see the routing modes side by side on hundreds of brokers without
starting a process: the same broker core, seeded link delays, and the exact checker's verdict.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from canopy_broker.core.filters import Constraint, Filter, Op
from canopy_broker.core.messages import Ordering, RoutingMode
from canopy_broker.sim.checker import check_deliveries, check_routing
from canopy_broker.sim.experiments import run_exchanges
from canopy_broker.sim.overhead import measure
from canopy_broker.sim.simulator import Simulator
from canopy_broker.sim.topology import random_tree
from canopy_operator.commands import report, standby

# Paper 002's set-up: 96 one-character patterns, at most 10 per broker.
PATTERNS = [chr(c) for c in range(ord("!"), ord("!") + 96)]


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sim", help="run the discrete-event simulator (no processes)")
    sim_sub = p.add_subparsers(dest="sim_command", required=True)
    r = sim_sub.add_parser(
        "routing", help="random subscriptions and events on a random tree, verified"
    )
    r.add_argument("--brokers", type=int, default=100)
    r.add_argument("--fanout", type=int, default=4)
    r.add_argument(
        "--density",
        choices=["sparse", "dense"],
        default="sparse",
        help="share of brokers with subscribers: 20%% (sparse) or 80%% (dense)",
    )
    r.add_argument("--events", type=int, default=2000)
    r.add_argument("--mode", choices=[m.value for m in RoutingMode] + ["all"], default="all")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--json", action="store_true", help="one JSON object on the last line")
    r.set_defaults(func=run_routing)

    x = sim_sub.add_parser(
        "exchange",
        help="link exchanges under live traffic on paper 002's set-up: overhead, delays, checks",
    )
    x.add_argument("--brokers", type=int, default=100)
    x.add_argument("--exchanges", type=int, default=20, help="exchanges, one after the other")
    x.add_argument(
        "--algorithm", choices=["coordinated", "path", "strawman"], default="coordinated"
    )
    x.add_argument(
        "--density",
        choices=["sparse", "dense"],
        default="sparse",
        help="share of brokers with subscribers: 20%% (sparse) or 80%% (dense)",
    )
    x.add_argument("--ordering", choices=["fifo", "causal"], default="fifo")
    x.add_argument("--seed", type=int, default=1)
    x.add_argument("--json", action="store_true", help="one JSON object on the last line")
    x.set_defaults(func=run_exchange_cmd)

    report.add_arguments(sim_sub)
    standby.add_arguments(sim_sub)

    k = sim_sub.add_parser(
        "soak", help="many seeded runs of concurrent exchanges under traffic; totals verified"
    )
    k.add_argument("--exchanges", type=int, default=10_000, help="stop after this many in total")
    k.add_argument("--seed", type=int, default=0, help="first seed")
    k.add_argument("--json", action="store_true", help="one JSON object on the last line")
    k.set_defaults(func=run_soak)


def simulate(
    n: int, *, fanout: int, density: str, events: int, mode: RoutingMode, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    edges = random_tree(n, rng, max_fanout=fanout)
    brokers = [f"b{i}" for i in range(n)]
    sim = Simulator(brokers, edges, mode=mode, seed=seed)
    share = 0.2 if density == "sparse" else 0.8
    subscribers = rng.sample(brokers, max(1, round(share * n)))
    for i, b in enumerate(subscribers):
        client = f"sub{i}"
        sim.attach(client, b, at=0)
        for k, pattern in enumerate(rng.sample(PATTERNS, rng.randint(1, 10))):
            sim.subscribe(client, f"s{k}", Filter.of([Constraint("p", Op.EQ, pattern)]), at=1)
    publishers = [f"pub{i}" for i in range(min(10, n))]
    for client in publishers:
        sim.attach(client, brokers[rng.randrange(n)], at=0)
    sim.run()  # subscriptions settle first, then notifications flow
    start = sim.now
    for k in range(events):
        sim.publish(
            publishers[k % len(publishers)], {"p": rng.choice(PATTERNS)}, at=start + k * 0.5
        )
    wall = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - wall
    report = check_deliveries(sim.subs, sim.publications(), sim.deliveries)
    problems = check_routing(sim.cores, sim.edges, sim.subscriptions_by_broker())
    hops = sim.stats.delivery_hops
    delivered = sum(hops.values())
    return {
        "mode": mode.value,
        "brokers": n,
        "events": events,
        **report.summary(),
        "routing_tables_canonical": not problems,
        "messages": dict(sim.stats.messages),
        "mean_delivery_hops": (sum(h * c for h, c in hops.items()) / delivered) if delivered else 0,
        "routing_entries": sum(c.routing_table_size() for c in sim.cores.values()),
        "sim_wall_s": round(wall, 3),
    }


def run_routing(args: argparse.Namespace) -> int:
    modes = list(RoutingMode) if args.mode == "all" else [RoutingMode(args.mode)]
    results = []
    for mode in modes:
        print(
            f"[sim] {mode.value}: {args.brokers} brokers, {args.events} events...",
            file=sys.stderr,
            flush=True,
        )
        results.append(
            simulate(
                args.brokers,
                fanout=args.fanout,
                density=args.density,
                events=args.events,
                mode=mode,
                seed=args.seed,
            )
        )
    header = (
        f"{'mode':<9} {'delivered':>9} {'lost':>5} {'dup':>5} {'reord':>5} "
        f"{'sub msgs':>9} {'entries':>8} {'hops':>5} tables"
    )
    print(header)
    for r in results:
        subs = r["messages"].get("Subscribe", 0) + r["messages"].get("Unsubscribe", 0)
        print(
            f"{r['mode']:<9} {r['delivered']:>9} {r['lost']:>5} {r['duplicated']:>5} "
            f"{r['reordered']:>5} {subs:>9} {r['routing_entries']:>8} "
            f"{r['mean_delivery_hops']:>5.2f} "
            f"{'canonical' if r['routing_tables_canonical'] else 'WRONG'}"
        )
    ok = all(
        r["routing_tables_canonical"]
        and not (r["lost"] or r["duplicated"] or r["reordered"] or r["spurious"])
        for r in results
    )
    if args.json:
        print(json.dumps({"ok": ok, "results": results}))
    return 0 if ok else 1


def exchange_experiment(
    n: int, *, exchanges: int, algorithm: str, density: str, ordering: str, seed: int
) -> dict[str, Any]:
    """K exchanges one after the other on paper 002's set-up, with the measured figures."""
    wall = time.perf_counter()
    run = run_exchanges(
        n,
        seed=seed,
        rounds=exchanges,
        group_size=1,
        algorithm=algorithm,  # type: ignore[arg-type]  # argparse restricted the choices
        mode=RoutingMode.IDENTITY,  # paper 002's patterns; the path algorithm needs it
        ordering=Ordering(ordering),
        density=0.2 if density == "sparse" else 0.8,
        churn=0,
        wide_filters=False,
        publishers_subscribe=False,
        publishers=10,
        record_traffic=True,
    )
    wall = time.perf_counter() - wall
    assert run.sim.traffic is not None
    paths = {x: rec.path for x, rec in run.sim.exchanges.items()}
    ov = measure(run.sim.traffic, run.sim.deliveries, run.sim.client_broker, paths, since=200.0)
    delays = [d for core in run.sim.cores.values() for d in core.ordering_delays]
    cycles = [len(spec.path) for spec in run.specs]
    summary = run.report.summary()
    return {
        "algorithm": algorithm,
        "ordering": ordering,
        "brokers": n,
        "density": density,
        "seed": seed,
        "exchanges": len(run.specs),
        "overhead": round(ov.total, 2),
        "overhead_per_exchange": round(ov.total / max(1, len(run.specs)), 2),
        "control_overhead": round(ov.control, 2),
        "misrouted": ov.misrouted,
        "overhead_by_type": ov.to_json()["by_type"],
        "lost": summary["lost"],
        "duplicated": summary["duplicated"],
        "reordered": summary["reordered"],
        "causal_violations": summary["causal"],
        "delivered": summary["delivered"],
        "owed": summary["owed"],
        "mean_ordering_delay": round(sum(delays) / len(delays), 3) if delays else 0.0,
        "max_ordering_delay": round(max(delays), 3) if delays else 0.0,
        "queued_notifications": len(delays),
        "mean_cycle_length": round(sum(cycles) / len(cycles), 3) if cycles else 0.0,
        "max_cycle_length": max(cycles, default=0),
        "routing_tables_canonical": not run.routing_problems,
        "unfinished": run.leftovers,
        "sim_wall_s": round(wall, 2),
    }


def run_exchange_cmd(args: argparse.Namespace) -> int:
    print(
        f"[sim] {args.algorithm}: {args.exchanges} exchanges on {args.brokers} brokers "
        f"({args.density}, seed {args.seed})...",
        file=sys.stderr,
        flush=True,
    )
    r = exchange_experiment(
        args.brokers,
        exchanges=args.exchanges,
        algorithm=args.algorithm,
        density=args.density,
        ordering=args.ordering,
        seed=args.seed,
    )
    print(f"algorithm            {r['algorithm']} ({r['ordering']})")
    print(
        f"exchanges            {r['exchanges']}, cycle length mean {r['mean_cycle_length']} "
        f"max {r['max_cycle_length']} (links on the cycle)"
    )
    print(f"overhead (weighted)  {r['overhead']} total, {r['overhead_per_exchange']} per exchange")
    print(f"  control messages   {r['control_overhead']}  {r['overhead_by_type']}")
    print(f"  misrouted events   {r['misrouted']}")
    print(
        f"delivery             {r['delivered']} delivered of {r['owed']} owed; lost {r['lost']}, "
        f"duplicated {r['duplicated']}, reordered {r['reordered']}, "
        f"causal violations {r['causal_violations']}"
    )
    print(
        f"ordering delay       mean {r['mean_ordering_delay']} max {r['max_ordering_delay']} "
        f"(sim time units; link delay 1-10) over {r['queued_notifications']} queued"
    )
    print(f"routing tables       {'canonical' if r['routing_tables_canonical'] else 'WRONG'}")
    if args.json:
        print(json.dumps(r))
    clean = not (r["lost"] or r["duplicated"] or r["reordered"] or r["unfinished"])
    if args.algorithm != "coordinated":
        return 0  # no delivery guarantee: the losses are part of the figures, not a failure
    return 0 if clean and r["routing_tables_canonical"] else 1


def run_soak(args: argparse.Namespace) -> int:
    """Seeds in a row, each a random tree (10-60 brokers) with 40 rounds of up to 4 concurrent,
    possibly overlapping exchanges, routing modes and orderings taking turns; stops when the
    total reaches ``--exchanges``. Every run is judged by the checker; the totals are printed."""
    modes = list(RoutingMode)
    totals: dict[str, Any] = {
        "runs": 0,
        "exchanges": 0,
        "lock_retries": 0,
        "delivered": 0,
        "owed": 0,
        "lost": 0,
        "duplicated": 0,
        "reordered": 0,
        "spurious": 0,
        "causal_violations_in_causal_mode": 0,
        "non_canonical_runs": 0,
        "unfinished_exchanges": 0,
        "failed_seeds": [],
    }
    wall = time.perf_counter()
    seed = args.seed
    while totals["exchanges"] < args.exchanges:
        rng = random.Random(seed)
        n = rng.randint(10, 60)
        mode = modes[seed % len(modes)]
        ordering = Ordering.CAUSAL if seed % 2 else Ordering.FIFO
        run = run_exchanges(
            n,
            seed=seed,
            rounds=40,
            group_size=4,
            mode=mode,
            ordering=ordering,
            publish_interval=6.0,
            publishers=3,
            churn=2,
        )
        s = run.report.summary()
        totals["runs"] += 1
        totals["exchanges"] += len(run.specs)
        totals["lock_retries"] += sum(r.attempts - 1 for r in run.sim.exchanges.values() if r.ok)
        for key in ("delivered", "owed", "lost", "duplicated", "reordered", "spurious"):
            totals[key] += s[key]
        if ordering is Ordering.CAUSAL:
            totals["causal_violations_in_causal_mode"] += s["causal"]
        totals["non_canonical_runs"] += bool(run.routing_problems)
        totals["unfinished_exchanges"] += len(run.leftovers)
        bad = not run.ok or (ordering is Ordering.CAUSAL and not run.report.causal_ok)
        if bad:
            totals["failed_seeds"].append(seed)
        print(
            f"[soak] seed {seed}: {n} brokers, {mode.value}/{ordering.value}, "
            f"{len(run.specs)} exchanges -> {'FAIL' if bad else 'ok'}; "
            f"total {totals['exchanges']}/{args.exchanges} "
            f"({time.perf_counter() - wall:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
        seed += 1
    totals["wall_s"] = round(time.perf_counter() - wall, 1)
    for key, value in totals.items():
        print(f"{key:<34} {value}")
    if args.json:
        print(json.dumps(totals))
    return 1 if totals["failed_seeds"] else 0
