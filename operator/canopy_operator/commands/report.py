"""`canopy sim report`: the papers' reconfiguration figures, on the papers' own workloads.

Each experiment runs with the set-up its paper describes (every parameter is listed below with the
sentence of the paper it comes from, and the report prints them), over many seeds, and is drawn
with 95% confidence intervals:

1. control messages per link exchange against the length of the reconfiguration cycle,
   coordinated vs path vs strawman (paper 000, Fig. 4);
2. ordering delay against cycle length, FIFO vs causal (paper 000, Fig. 5);
3. overhead saved against the strawman as the tree grows, sparse and dense subscribers, and the
   strawman's own cost per reconfiguration (paper 002, Fig. 5 and Section 5.3);
4. notifications delivered against simultaneous broker failures, with and without standby links
   (paper 003, Fig. 5; :mod:`canopy_operator.commands.standby`, also ``canopy sim standby``).

Then a comparison table sets each number the papers' text gives beside ours with its interval, and
says, for every difference larger than the interval, what differs. Runs are independent, so they
are spread over the machine's cores (``--jobs``); every run also goes through the delivery checker
and its counts are reported next to the costs.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from canopy_broker.core.messages import Ordering, Publish, RoutingMode
from canopy_broker.progress import Progress
from canopy_broker.sim.experiments import ExchangeRun, run_exchanges
from canopy_broker.sim.overhead import measure
from canopy_broker.sim.topology import adjacency, component
from canopy_broker.sim.underlay import mean_ci95
from canopy_operator.commands import standby
from canopy_operator.commands.standby import pm

ALGORITHMS = ("coordinated", "path", "strawman")
Cell = tuple[float, float]  # mean, half-width of the 95% interval

# Paper 002 (Cugola et al.), Section 5.1 and 5.3: each parameter with the sentence it comes from.
PAPER_002: dict[str, tuple[Any, str]] = {
    "brokers": (
        (25, 50, 100, 150, 200),
        "The results we present here are all obtained with tree configurations up to 200 "
        "dispatchers, each connected with at most four others.",
    ),
    "max_fanout": (4, "... each connected with at most four others."),
    "event_chars": (
        9,
        "Events are represented as randomly-generated 9-character strings, where each character "
        "can be any of the (96) printable characters.",
    ),
    "patterns": (
        96,
        "Subscriptions are represented as a single character. An event matches a subscription if "
        "it contains the character specified by the subscription.",
    ),
    "subscriptions_per_subscriber": (
        10,
        "each dispatcher can subscribe to at most s subscriptions drawn randomly from the 96 "
        "available. In our simulations, we chose s=10",
    ),
    "density": (
        {"sparse": 0.2, "dense": 0.8},
        "one with sparse subscribers (20% of the dispatching tree), and one with dense "
        "subscribers (80% of the tree).",
    ),
    "publish_per_dispatcher_per_s": (
        1.0,
        "a relatively low publish rate (f_pub = 0.001, about 1 publish/s) ... Figure 5 shows the "
        "percentage of improvement ... in a configuration with f_pub = 0.001.",
    ),
    "replace_delay_s": (0.1, "we assume that each broken link is replaced by a new one in 0.1s."),
    "reconfigurations": (
        13,
        "Reconfigurations are allowed only in the interval between 3 and 7 seconds ... this "
        "interval is set to the value rho = 0.3s, which yields non-overlapping reconfigurations.",
    ),
    "seeds": (
        30,
        "we ran each configuration 30 times using different seeds ... for each configuration the "
        "same seed was used for comparing the three approaches.",
    ),
    "stable_core": (
        "all brokers",
        "overhead is measured by considering every dispatcher in the network as part of the "
        "stable core ... the only (un)subscription messages exchanged in the system are those "
        "caused by reconfiguration.",
    ),
    "weights": (
        "event 1, (un)subscription 1, RECMSG 2(|Padd|+|Pdel|)/3 + 1/3, CTRLMSG 0.1, FLUSHMSG 0.2",
        "Events were considered as the base for our cost model and were assigned a weight of "
        "1.0. Subscriptions and unsubscriptions were also assigned a cost equal to 1.0. ... "
        "[CTRLMSG] weight was therefore set to 0.1 ... [FLUSHMSG] weight was set to 0.2",
    ),
}

# Paper 000 (Parzyjegla et al.), Section 3.1.
PAPER_000: dict[str, tuple[Any, str]] = {
    "brokers": (
        100,
        "The publish/subscribe infrastructure is then composed of 100 randomly chosen brokers "
        "which form an acyclic overlay network.",
    ),
    "max_link_delay_ms": (
        100,
        "The maximum delay of an overlay link is limited to 100 ms including the time needed by "
        "a broker to process a message.",
    ),
    "publishers": (
        50,
        "The brokers host a total of 500 clients, that are uniformly distributed among them. Each "
        "of the 50 publishers has 9 dedicated subscribers, that receive all of its notifications.",
    ),
    "subscribers_per_publisher": (9, "Each of the 50 publishers has 9 dedicated subscribers"),
    "publish_interval_ms": (
        25,
        "The publication rate follows an exponential distribution such that a publisher is "
        "expected to create a new notification every 25 ms.",
    ),
    "exchanges": (
        100,
        "100 randomly chosen links are exchanged such that the network stays connected and acyclic",
    ),
    "seeds": (
        25,
        "The following experiments were repeated 25 times and arithmetic means as well as 95% "
        "confidence intervals were calculated for every measured value.",
    ),
}

# What the papers' text says of the figures we reproduce (our copies have no legible figures).
CLAIMS = {
    "002_sparse_best": (76.0, "up to 76% less overhead than the strawman (abstract, Section 8)"),
    "002_dense_200": (40.0, "The improvement of 40% provided by our solution in the same setting"),
    "002_straw_dense": (3500.0, "in a dense tree with 200 dispatchers ... on average 3,500"),
    "002_straw_sparse": (5300.0, "while in a sparse tree there are on average 5,300"),
    "002_straw_dense_peak": (8000.0, "(with a peak of 8,000)"),
    "002_straw_sparse_peak": (18000.0, "(with a peak of 18,000)"),
}

# Our choices where the papers are silent, or where we depart from them (said in the report).
CHOICES: dict[str, Any] = {
    "subscriptions": "each subscriber takes a uniform 1..s of the 96 patterns (the paper's 'at "
    "most s'; it does not say how many below s)",
    "tree": "each broker joins a random earlier broker that still has room (fan-out <= 4)",
    "link_delay_002_ms": (1.0, 10.0),
    "link_delay_000_ms": "uniform 1..100 ms per link, FIFO",
    "fanout_000": 4,
    "strawman_gap_000_s": 0.1,
    "rate_scale_000": 0.05,
}
QUICK: dict[str, Any] = {
    "sizes": (20, 40),
    "seeds": 2,
    "reconfigurations": 4,
    "brokers_000": 30,
}


def add_arguments(sim_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sim_sub.add_parser(
        "report", help="regenerate the papers' figures on their workloads (tables, PNG plots)"
    )
    p.add_argument("--out", type=Path, default=Path("out/report"), help="output directory")
    p.add_argument("--quick", action="store_true", help="small sizes and 2 seeds (a smoke run)")
    p.add_argument(
        "--seeds",
        type=int,
        help="seeds per point for papers 000 and 002 (default 10; the papers used 25 and 30)",
    )
    p.add_argument(
        "--sizes", help="paper 002's tree sizes, comma-separated (default 25,50,100,150,200)"
    )
    p.add_argument(
        "--exchanges",
        type=int,
        help="paper 000's link exchanges per run (default: the paper's 100)",
    )
    p.add_argument(
        "--rate-scale",
        type=float,
        help="paper 000's publication rate as a fraction of the paper's 40/s per publisher "
        f"(default {CHOICES['rate_scale_000']}: control messages do not depend on it, the "
        "ordering delay is averaged per queued notification; 1 runs the paper's rate, slowly)",
    )
    p.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="runs in parallel (default: cores)"
    )
    p.add_argument(
        "--replot",
        action="store_true",
        help="redraw the figures and report.md from the runs saved in OUT/report.json",
    )
    p.set_defaults(func=run)


def progress(msg: str) -> None:
    print(f"[report] {msg}", file=sys.stderr, flush=True)


def parameters(args: argparse.Namespace) -> dict[str, Any]:
    """The run's parameters: the papers' values, or the quick ones, with the flags applied; a
    bad flag is refused with a message that names it."""
    quick = bool(args.quick)

    def refuse(msg: str) -> SystemExit:
        return SystemExit(f"canopy sim report: {msg}")

    seeds = args.seeds if args.seeds is not None else QUICK["seeds"] if quick else 10
    if seeds < 2:
        raise refuse("--seeds must be at least 2 (confidence intervals need two)")
    if args.sizes:
        try:
            sizes = tuple(int(x) for x in args.sizes.split(","))
        except ValueError:
            raise refuse(
                f"--sizes takes numbers of brokers like 25,50,100, not {args.sizes!r}"
            ) from None
        if min(sizes) < 6:
            raise refuse("--sizes: a tree needs at least 6 brokers to exchange links in")
    else:
        sizes = QUICK["sizes"] if quick else PAPER_002["brokers"][0]
    exchanges = args.exchanges if args.exchanges is not None else 6 if quick else 100
    if exchanges < 1:
        raise refuse("--exchanges must be at least 1")
    rate_scale = args.rate_scale if args.rate_scale is not None else CHOICES["rate_scale_000"]
    if not 0 < rate_scale <= 1:
        raise refuse(f"--rate-scale must be in (0, 1], got {rate_scale}")
    return {
        "seeds": seeds,
        "p002": {
            "sizes": list(sizes),
            "max_fanout": PAPER_002["max_fanout"][0],
            "event_chars": PAPER_002["event_chars"][0],
            "subscriptions": PAPER_002["subscriptions_per_subscriber"][0],
            "density": PAPER_002["density"][0],
            "publish_per_dispatcher_per_s": PAPER_002["publish_per_dispatcher_per_s"][0],
            "replace_delay_ms": 1000 * PAPER_002["replace_delay_s"][0],
            "reconfigurations": QUICK["reconfigurations"]
            if quick
            else PAPER_002["reconfigurations"][0],
            "spacing_ms": 300.0,
            "link_delay_ms": CHOICES["link_delay_002_ms"],
        },
        "p000": {
            "brokers": QUICK["brokers_000"] if quick else PAPER_000["brokers"][0],
            "exchanges": exchanges,
            "publishers": PAPER_000["publishers"][0],
            "subscribers_per_publisher": PAPER_000["subscribers_per_publisher"][0],
            "publish_interval_ms": PAPER_000["publish_interval_ms"][0],
            "rate_scale": rate_scale,
            "max_link_delay_ms": PAPER_000["max_link_delay_ms"][0],
            "max_fanout": CHOICES["fanout_000"],
            "replace_delay_ms": 1000 * CHOICES["strawman_gap_000_s"],
        },
    }


# ---------------------------------------------------------------- one run (in a worker process)


def overhead(run: ExchangeRun) -> float:
    """Paper 002's weighted cost of everything after the initial subscriptions settled."""
    assert run.sim.traffic is not None
    paths = {x: rec.path for x, rec in run.sim.exchanges.items()}
    since = run.requested_at[0] if run.requested_at else 0.0
    return measure(run.sim.traffic, run.sim.deliveries, run.sim.client_broker, paths, since).total


def per_exchange_control(run: ExchangeRun) -> list[tuple[int, int]]:
    """(cycle length, control messages) for each exchange of a one-at-a-time run."""
    assert run.sim.traffic is not None
    bounds = run.requested_at  # ascending: exchanges run one at a time
    counts = [0] * len(run.specs)
    for t, _s, _r, msg in run.sim.traffic:
        if isinstance(msg, Publish) or t < bounds[0]:
            continue
        counts[bisect.bisect_right(bounds, t) - 1] += 1
    return [(len(spec.path), c) for spec, c in zip(run.specs, counts, strict=True)]


def cut_sizes(run: ExchangeRun) -> list[int]:
    """Brokers on the smaller side of each removed link: what a strawman's waves must cover."""
    n, edges, out = len(run.sim.cores), run.initial_edges, []
    for spec in run.specs:
        side = len(component(adjacency(edges), *spec.remove))
        out.append(min(side, n - side))
        edges = spec.apply(edges)
    return out


def run_002(n: int, density: str, seed: int, p: dict[str, Any]) -> dict[str, Any]:
    """One seed of paper 002's Fig. 5 at one size and density: the three algorithms, same plan."""
    cost: dict[str, float] = {}
    delivery: dict[str, dict[str, int]] = {}
    cuts: list[int] = []
    for algorithm in ALGORITHMS:
        run = run_exchanges(
            n,
            seed=seed,
            rounds=p["reconfigurations"],
            group_size=1,
            algorithm=algorithm,  # type: ignore[arg-type]
            mode=RoutingMode.IDENTITY,
            density=p["density"][density],
            churn=0,
            wide_filters=False,
            publishers_subscribe=False,
            publisher_per_broker=True,
            publish_interval=1000.0 / (n * p["publish_per_dispatcher_per_s"]),
            poisson=True,
            patterns=(1, p["subscriptions"]),
            event_chars=p["event_chars"],
            strawman_gap=p["replace_delay_ms"],
            max_fanout=p["max_fanout"],
            link_delay=tuple(p["link_delay_ms"]),
            round_spacing=p["spacing_ms"],
            quiet=p["spacing_ms"],
            record_traffic=True,
            min_side=p.get("min_side", 0),
        )
        cost[algorithm] = overhead(run) / max(1, len(run.specs))
        delivery[algorithm] = run.report.summary()
        if algorithm == "strawman":
            cuts = cut_sizes(run)
    return {
        "n": n,
        "density": density,
        "seed": seed,
        "cost": cost,
        "delivery": delivery,
        "cut": statistics.fmean(cuts) if cuts else 0.0,
        "min_side": p.get("min_side", 0),
    }


def run_000(seed: int, p: dict[str, Any]) -> dict[str, Any]:
    """One seed of paper 000's Figs. 4 and 5: the same exchanges under each algorithm/ordering."""
    delay_max = float(p["max_link_delay_ms"])
    per_publisher = p["publish_interval_ms"] / p["rate_scale"]
    out: dict[str, Any] = {"seed": seed, "control": {}, "delay": {}, "delivery": {}}
    for label, algorithm, ordering in (
        ("coordinated", "coordinated", Ordering.FIFO),
        ("causal", "coordinated", Ordering.CAUSAL),
        ("path", "path", Ordering.FIFO),
        ("strawman", "strawman", Ordering.FIFO),
    ):
        run = run_exchanges(
            p["brokers"],
            seed=seed,
            rounds=p["exchanges"],
            group_size=1,
            algorithm=algorithm,  # type: ignore[arg-type]
            mode=RoutingMode.IDENTITY,
            ordering=ordering,
            churn=0,
            wide_filters=False,
            publishers=p["publishers"],
            dedicated=p["subscribers_per_publisher"],
            publishers_subscribe=False,
            publish_interval=per_publisher / p["publishers"],
            poisson=True,
            link_delay=(1.0, delay_max),
            max_fanout=p["max_fanout"],
            strawman_gap=p["replace_delay_ms"],
            settle=30 * delay_max,
            quiet=20 * delay_max,
            round_spacing=6 * delay_max,
            timer_scale=1000.0,  # one clock unit is a millisecond here
            record_traffic=label != "causal",
        )
        out["delivery"][label] = run.report.summary()
        if label != "causal":
            out["control"][label] = per_exchange_control(run)
        if algorithm == "coordinated":
            lengths = {x: len(rec.path) for x, rec in run.sim.exchanges.items()}
            queued: dict[str, list[float]] = defaultdict(list)
            for core in run.sim.cores.values():
                for xid, delays in core.ordering_delays_by_exchange.items():
                    queued[xid].extend(delays)
            # Paper 000: "the mean time an affected notification is queued", per exchange.
            out["delay"]["fifo" if ordering is Ordering.FIFO else "causal"] = [
                (lengths[x], statistics.fmean(v)) for x, v in queued.items() if v
            ]
    return out


# ---------------------------------------------------------------- running and summarising


def run_all(
    tasks: list[tuple[Callable[..., dict[str, Any]], tuple[Any, ...]]], jobs: int
) -> list[dict[str, Any]]:
    """Run every task (in ``jobs`` processes), showing progress and an estimate of time left."""
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    with Progress("report", len(tasks)) as shown:

        def done(r: dict[str, Any]) -> None:
            results.append(r)
            elapsed = time.perf_counter() - start
            left = elapsed / len(results) * (len(tasks) - len(results))
            what = f"{r['n']} brokers, {r['density']}" if "n" in r else "paper 000"
            shown.step(f"{what}, seed {r['seed']}; {elapsed:.0f} s so far, ~{left:.0f} s left")

        if jobs <= 1:
            for fn, a in tasks:
                done(fn(*a))
            return results
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            futures: list[Future[dict[str, Any]]] = [pool.submit(fn, *a) for fn, a in tasks]
            for f in as_completed(futures):
                done(f.result())
    return results


def _cells(rows: dict[Any, list[float]], least: int = 2) -> dict[Any, Cell]:
    return {k: mean_ci95(v) for k, v in sorted(rows.items()) if len(v) >= least}


def line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares slope, the half-width of its 95% interval, and the intercept."""
    slope, half = slope_ci95(points)
    if math.isnan(slope):
        return (slope, half, math.nan)
    mx = statistics.fmean(x for x, _ in points)
    return (slope, half, statistics.fmean(y for _, y in points) - slope * mx)


def slope_ci95(points: Sequence[tuple[float, float]]) -> Cell:
    """Least-squares slope and the half-width of its 95% interval (normal approximation)."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    if len(xs) < 3 or len(set(xs)) < 2:
        return (math.nan, math.nan)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    se = math.sqrt(resid / (len(xs) - 2) / sxx)
    return (b, 1.96 * se)


def summarise_002(results: list[dict[str, Any]], sizes: Sequence[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for density in ("sparse", "dense"):
        rs = [r for r in results if r["density"] == density]
        by_n = {n: [r for r in rs if r["n"] == n] for n in sizes}
        improve = {
            a: {
                n: mean_ci95([100 * (1 - r["cost"][a] / r["cost"]["strawman"]) for r in runs])
                for n, runs in by_n.items()
            }
            for a in ("coordinated", "path")
        }
        straw = {n: [r["cost"]["strawman"] for r in runs] for n, runs in by_n.items()}
        out[density] = {
            "improvement_percent": improve,
            "strawman_per_reconfiguration": {n: mean_ci95(v) for n, v in straw.items()},
            "strawman_peak": {n: max(v) for n, v in straw.items()},
            "cut_side": {n: mean_ci95([r["cut"] for r in runs]) for n, runs in by_n.items()},
            "cost": {
                a: {n: mean_ci95([r["cost"][a] for r in runs]) for n, runs in by_n.items()}
                for a in ALGORITHMS
            },
        }
    out["delivery"] = _sum_delivery(r["delivery"] for r in results)
    return out


def _sum_delivery(rows: Any) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in rows:
        for label, summary in row.items():
            for k, v in summary.items():
                total[label][k] += v
    return {k: dict(v) for k, v in total.items()}


def summarise_000(results: list[dict[str, Any]]) -> dict[str, Any]:
    control: dict[str, dict[int, list[float]]] = {a: defaultdict(list) for a in ALGORITHMS}
    ratio_short: list[float] = []
    ratio_long: list[float] = []
    for r in results:
        for a in ALGORITHMS:
            for length, count in r["control"][a]:
                control[a][length].append(count)
        # The same exchanges run under each algorithm (same seed): pair them.
        for (length, c), (_, s) in zip(
            r["control"]["coordinated"], r["control"]["strawman"], strict=True
        ):
            if s:
                (ratio_short if length <= 6 else ratio_long if length >= 12 else []).append(c / s)
    delay: dict[str, dict[int, list[float]]] = {o: defaultdict(list) for o in ("fifo", "causal")}
    points: dict[str, list[tuple[float, float]]] = {"fifo": [], "causal": []}
    for r in results:
        for o in ("fifo", "causal"):
            for length, d in r["delay"].get(o, []):
                delay[o][length].append(d)
                points[o].append((length, d))
    fifo_all = [d for _, d in points["fifo"]]
    causal_all = [d for _, d in points["causal"]]
    return {
        "control": {a: _cells(rows, least=5) for a, rows in control.items()},
        "coordinated_over_strawman": {
            "short (<= 6 links)": mean_ci95(ratio_short) if ratio_short else (math.nan, math.nan),
            "long (>= 12 links)": mean_ci95(ratio_long) if ratio_long else (math.nan, math.nan),
        },
        "delay": {o: _cells(rows, least=5) for o, rows in delay.items()},
        "delay_slope": {o: slope_ci95(pts) for o, pts in points.items()},
        "control_line": {
            a: line_fit([(k, c) for r in results for k, c in r["control"][a]])
            for a in ("coordinated", "strawman")
        },
        "delay_mean": {
            "fifo": mean_ci95(fifo_all) if len(fifo_all) > 1 else (math.nan, math.nan),
            "causal": mean_ci95(causal_all) if len(causal_all) > 1 else (math.nan, math.nan),
        },
        "delivery": _sum_delivery(r["delivery"] for r in results),
    }


# ---------------------------------------------------------------- comparison with the papers


def differs(paper: float, ours: Cell) -> bool:
    """Is the paper's value outside our 95% interval? (The test of every comparison row.)"""
    mean, half = ours
    return not (mean - half <= paper <= mean + half)


def _fig4_gap(line: dict[str, Sequence[float]]) -> str:
    """Why our coordinated exchange is not cheaper than the strawman on long cycles."""
    (sc, hc, ic), (ss, hs, is_) = line["coordinated"], line["strawman"]
    cross = (is_ - ic) / (sc - ss) if sc > ss else math.inf
    return (
        "Not beyond our interval for long cycles. Algorithm: our coordinated exchange starts "
        f"lower but grows faster, {sc:.1f} ± {hc:.1f} messages per link of the cycle against the "
        f"strawman's {ss:.1f} ± {hs:.1f} (least-squares lines over every exchange), so the lines "
        f"meet near {cross:.0f} links and on cycles of 12 links or more the two are close: the "
        "coordination itself (lock, grant, two separators, End) walks the whole cycle on top of "
        "the routes that must change, and is paid per link. The paper's text says its exchange "
        "stays cheaper on long cycles; its figure's values are not in our copy, so we cannot "
        "compare the slopes themselves."
    )


def comparisons(
    d002: dict[str, Any], d000: dict[str, Any], sizes: Sequence[int]
) -> list[dict[str, str]]:
    """Rows of the table: figure, point, the paper's value, ours, and a sentence on the gap."""
    top = max(sizes)
    rows: list[dict[str, str]] = []
    sparse, dense = d002["sparse"], d002["dense"]
    best_n = max(sizes, key=lambda n: sparse["improvement_percent"]["path"][n][0])
    cut_s, cut_d = sparse["cut_side"][top][0], dense["cut_side"][top][0]
    per_run = {
        k: d002[k]["strawman_per_reconfiguration"][top][0] * d002.get("reconfigurations", 13)
        for k in ("sparse", "dense")
    }
    tree_gap = (
        f"Experiment: a strawman reconfiguration costs about two messages per broker on the side "
        f"of the removed link that loses its routes, per pattern subscribed only on the other "
        f"side, so it grows with the size of the subtree a removed link cuts off; the paper does "
        f"not say how its trees were grown. In our trees (each broker joins a random earlier one "
        f"with room) a random link cuts off on average {cut_s:.0f} brokers (sparse runs, {top} "
        f"brokers), most often a leaf region, while the path algorithm's cost follows the path's "
        f"length instead."
    )

    def tested(density: str, metric: str | int, paper: float) -> str:
        """What the same runs give when only inner links are removed: closer to the paper?"""
        inner = d002.get("inner")
        if not inner:
            return ""
        ours = d002[density]
        if metric == "straw":
            was, now = (
                ours["strawman_per_reconfiguration"][top],
                inner[density]["strawman_per_reconfiguration"][top],
            )
            what, fmt = "the strawman costs", "{:,.0f}"
        else:
            was = ours["improvement_percent"]["path"][metric]
            now = inner[density]["improvement_percent"]["path"][top]
            what, fmt = "path saves (%)", "{:.0f}"
        closer = abs(now[0] - paper) < abs(was[0] - paper)
        if (was[0] - paper) * (now[0] - paper) < 0:
            verdict = (
                "the paper's value lies between the two, so which links are removed spans the "
                "whole gap."
            )
        elif closer:
            verdict = "closer to the paper's value, so which links are removed explains part of it."
        else:
            verdict = "no closer to the paper's value, so the link choice does not explain it."
        return (
            f" Tested: the same {density} runs at {top} brokers removing only links that cut off "
            f"at least {inner['min_side']} brokers: {what} {pm(now, fmt)}; {verdict}"
        )

    scope = (
        f"The paper does not say whether this figure is per reconfiguration or for a run's 13 "
        f"reconfigurations; per run ours is about {per_run['sparse']:,.0f} (sparse) and "
        f"{per_run['dense']:,.0f} (dense)."
    )

    def row(
        key: str, figure: str, point: str, ours: Cell, why: str, *, fmt: str = "{:.0f}"
    ) -> None:
        paper, text = CLAIMS[key]
        gap = differs(paper, ours)
        rows.append(
            {
                "figure": figure,
                "point": point,
                "paper": f"{fmt.format(paper)} (\u201c{text}\u201d)",
                "ours": pm(ours, fmt),
                "note": why if gap else "Within our interval.",
            }
        )

    row(
        "002_sparse_best",
        "002 Fig. 5 top (sparse)",
        f"path vs strawman, best size ({best_n})",
        sparse["improvement_percent"]["path"][best_n],
        tree_gap + tested("sparse", best_n, CLAIMS["002_sparse_best"][0]),
    )
    row(
        "002_dense_200",
        "002 Fig. 5 bottom (dense)",
        f"path vs strawman, {top} brokers",
        dense["improvement_percent"]["path"][top],
        tree_gap.replace(f"{cut_s:.0f} brokers (sparse", f"{cut_d:.0f} brokers (dense")
        + tested("dense", top, CLAIMS["002_dense_200"][0]),
    )
    row(
        "002_straw_sparse",
        "002 Sec. 5.3",
        f"strawman messages per reconfiguration, sparse, {top}",
        sparse["strawman_per_reconfiguration"][top],
        tree_gap + tested("sparse", "straw", CLAIMS["002_straw_sparse"][0]) + " " + scope,
        fmt="{:,.0f}",
    )
    row(
        "002_straw_dense",
        "002 Sec. 5.3",
        f"strawman messages per reconfiguration, dense, {top}",
        dense["strawman_per_reconfiguration"][top],
        tree_gap.replace(f"{cut_s:.0f} brokers (sparse", f"{cut_d:.0f} brokers (dense")
        + tested("dense", "straw", CLAIMS["002_straw_dense"][0])
        + " "
        + scope,
        fmt="{:,.0f}",
    )
    for density, key in (("sparse", "002_straw_sparse_peak"), ("dense", "002_straw_dense_peak")):
        peak = float(d002[density]["strawman_peak"][top])
        row(
            key,
            "002 Sec. 5.3",
            f"strawman peak, {density}, {top} (our highest per-run mean)",
            (peak, 0.0),
            "Same cause as the mean; a peak over seeds has no interval, and ours is the highest "
            "mean over one run's reconfigurations, the paper's possibly a single one.",
            fmt="{:,.0f}",
        )
    # Paper 000: the text states trends, not values.
    ratios = d000["coordinated_over_strawman"]
    short, long_ = ratios["short (<= 6 links)"], ratios["long (>= 12 links)"]
    holds = short[0] + short[1] < 1 and long_[0] + long_[1] < 1 and short[0] < long_[0]
    rows.append(
        {
            "figure": "000 Fig. 4",
            "point": "coordinated / strawman control messages, short (<= 6) and long (>= 12) "
            "cycles",
            "paper": "below 1, lowest for short cycles (\u201cit clearly outperforms the strawman "
            "approach especially for small cycle lengths ... even remains more efficient for "
            "larger reconfigurations\u201d); no values in the text",
            "ours": f"short {short[0]:.2f} ± {short[1]:.2f}; long {long_[0]:.2f} ± {long_[1]:.2f}",
            "note": "Agrees: below 1 beyond the interval at both ends, lower for short cycles."
            if holds
            else _fig4_gap(d000["control_line"]),
        }
    )
    fs, cs = d000["delay_slope"]["fifo"], d000["delay_slope"]["causal"]
    fm, cm = d000["delay_mean"]["fifo"], d000["delay_mean"]["causal"]
    linear = fs[0] - fs[1] > 0 and cs[0] - cs[1] > 0
    costlier = cm[0] - cm[1] > fm[0] + fm[1]
    rows.append(
        {
            "figure": "000 Fig. 5",
            "point": "ordering delay: slope per link of cycle (ms), FIFO and causal",
            "paper": "positive, linear (\u201cThe delay increases linearly with the length of the "
            "reconfiguration cycle\u201d); no values in the text",
            "ours": f"FIFO {fs[0]:.1f} ± {fs[1]:.1f}; causal {cs[0]:.1f} ± {cs[1]:.1f}",
            "note": "Agrees: both slopes positive beyond the interval."
            if linear
            else "A slope is not positive beyond the interval: the per-length table shows where.",
        }
    )
    rows.append(
        {
            "figure": "000 Fig. 5",
            "point": "ordering delay, mean over all exchanges (ms): FIFO vs causal",
            "paper": "causal above FIFO (\u201cCausal ordering is more expensive\u201d)",
            "ours": f"FIFO {fm[0]:.0f} ± {fm[1]:.0f}; causal {cm[0]:.0f} ± {cm[1]:.0f}",
            "note": "Agrees, beyond the intervals."
            if costlier
            else "The intervals overlap: causal is not shown costlier here.",
        }
    )
    return rows


# ---------------------------------------------------------------- drawing


def _errorbars(
    ax: Any, rows: dict[Any, Sequence[float]], style: str, label: str, dx: float = 0.0
) -> None:
    """Means with their 95% intervals; ``dx`` shifts the points so that neighbours stay legible."""
    xs = sorted(rows, key=float)
    ax.errorbar(
        [float(x) + dx for x in xs],
        [rows[x][0] for x in xs],
        yerr=[rows[x][1] for x in xs],
        fmt=style,
        capsize=3,
        markersize=4,
        label=label,
    )


def plot(data: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    seeds = data["parameters"]["seeds"]
    d000, d002 = data["p000"], data["p002"]
    cycle = "reconfiguration cycle length (links)"
    for name, rows, ylabel, title, styles in (
        (
            "control_vs_cycle.png",
            d000["control"],
            "control messages per exchange",
            "Control messages vs cycle length (cf. paper 000, Fig. 4)",
            {"coordinated": "o-", "path": "s-", "strawman": "^--"},
        ),
        (
            "ordering_delay_vs_cycle.png",
            d000["delay"],
            "mean queueing delay per exchange (ms)",
            "Ordering delay vs cycle length (cf. paper 000, Fig. 5)",
            {"fifo": "o-", "causal": "s-"},
        ),
    ):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for label, style in styles.items():
            _errorbars(ax, rows[label], style, label)
        ax.set(xlabel=cycle, ylabel=ylabel, title=f"{title}\n{seeds} seeds, 95% CI")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        files.append(out / name)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for ax, density in zip(axes[:2], ("sparse", "dense"), strict=True):
        for a, style in (("coordinated", "o-"), ("path", "s-")):
            _errorbars(ax, d002[density]["improvement_percent"][a], style, a)
        if "inner" in d002:  # the same runs at the largest size, inner links only
            for a, style in (("coordinated", "o"), ("path", "s")):
                rows = d002["inner"][density]["improvement_percent"][a]
                _errorbars(ax, rows, style, f"{a}, inner links only", dx=4)
        paper = CLAIMS["002_sparse_best" if density == "sparse" else "002_dense_200"][0]
        ax.axhline(paper, color="grey", ls=":", label=f"paper: {paper:.0f}% (text)")
        ax.set(
            xlabel="brokers",
            ylabel="overhead saved vs strawman (%)",
            title=f"{density} subscribers (cf. paper 002, Fig. 5)",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    for density, style in (("sparse", "o-"), ("dense", "s--")):
        _errorbars(ax, d002[density]["strawman_per_reconfiguration"], style, f"ours, {density}")
    if "inner" in d002:
        for density, style in (("sparse", "o"), ("dense", "s")):
            rows = d002["inner"][density]["strawman_per_reconfiguration"]
            _errorbars(ax, rows, style, f"ours, {density}, inner links only", dx=4)
    for key, marker in (("002_straw_sparse", "o"), ("002_straw_dense", "s")):
        ax.plot([200], [CLAIMS[key][0]], marker, color="black", fillstyle="none", markersize=9)
    ax.plot([], [], "o", color="black", fillstyle="none", label="paper (text), 200 brokers")
    ax.set(
        xlabel="brokers",
        ylabel="weighted messages per reconfiguration",
        title="strawman's cost (cf. paper 002, Sec. 5.3)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"Paper 002's workload, {seeds} seeds per point, 95% CI", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "improvement_vs_brokers.png", dpi=120)
    plt.close(fig)
    files.append(out / "improvement_vs_brokers.png")
    return files


# ---------------------------------------------------------------- report.md


def _parameter_rows(paper: dict[str, tuple[Any, str]], ours: dict[str, Any]) -> list[str]:
    lines = ["| parameter | ours | the paper |", "|---|---|---|"]
    for key, (value, sentence) in paper.items():
        used = ours.get(key, value)
        if isinstance(used, dict):
            used = ", ".join(f"{k} {v}" for k, v in used.items())
        elif isinstance(used, list | tuple):
            used = ", ".join(map(str, used))
        lines.append(f"| {key} | {used} | \u201c{sentence}\u201d |")
    return lines


def markdown(data: dict[str, Any]) -> str:
    p = data["parameters"]
    p0, p2 = p["p000"], p["p002"]
    d0, d2 = data["p000"], data["p002"]
    seeds = p["seeds"]
    lines = [
        "# Reconfiguration report",
        "",
        f"Regenerate: `canopy sim report --out docs/report` ({data['wall_s']:.0f} s here on 2 "
        f"cores; `--quick` for a smoke run). {seeds} seeds per point; means with 95% confidence "
        "intervals (Student's t over the seeds, or over the exchanges where a point pools "
        "exchanges). All numbers below are measured by that command; none is typed in.",
        "",
        "## Comparison with the papers",
        "",
        "Every number the papers' text gives for a figure we reproduce, beside ours. Our copies "
        "of the papers are their text: the figures' images did not survive, so where the text "
        "states a trend rather than a value, the row tests the trend.",
        "",
        "| figure | point | paper | ours (95% CI) | difference |",
        "|---|---|---|---|---|",
    ]
    for r in data["comparison"]:
        lines.append(f"| {r['figure']} | {r['point']} | {r['paper']} | {r['ours']} | {r['note']} |")
    lines += [
        "",
        "The paper 003 rows are in their own section at the end (written by `canopy sim "
        "standby`, which this command runs).",
        "",
        "## Paper 002, Fig. 5: overhead saved against the strawman",
        "",
        "![improvement vs brokers](improvement_vs_brokers.png)",
        "",
        *_parameter_rows(
            PAPER_002,
            {
                "brokers": p2["sizes"],
                "seeds": seeds,
                "reconfigurations": p2["reconfigurations"],
                "subscriptions_per_subscriber": f"1..{p2['subscriptions']} (uniform)",
            },
        ),
        f"| tree | {CHOICES['tree']} | not said |",
        f"| link delay | uniform {p2['link_delay_ms'][0]:g}..{p2['link_delay_ms'][1]:g} ms, FIFO "
        "| not said (OMNeT++, application level only) |",
        "",
        "The workload: every broker hosts one publisher publishing 9-character strings as a "
        "Poisson process at the paper's rate; subscribers (a share of the brokers) subscribe "
        "with `p contains c` for one-character patterns `c`; identity routing (the paper's "
        "subscription forwarding, one route per pattern and direction); reconfigurations one at "
        "a time, at least 0.3 s apart; the same seed draws the same tree, subscriptions and "
        "exchanges for the three algorithms. *Path* is paper 002's algorithm, *coordinated* "
        "paper 000's (which also keeps every notification), *strawman* drops the link and "
        "adds the new one 0.1 s later. Cost: paper 002's weighted hops of every (un)subscription, "
        "reconfiguration message and misrouted event after the first exchange starts.",
        "",
        "| brokers | density | coordinated saved % | path saved % | strawman msgs/reconf. | "
        "path msgs/reconf. | cut-off side (brokers) |",
        "|---|---|---|---|---|---|---|",
    ]
    for density in ("sparse", "dense"):
        d = d2[density]
        for n in p2["sizes"]:
            lines.append(
                f"| {n} | {density} | {pm(d['improvement_percent']['coordinated'][n])} | "
                f"{pm(d['improvement_percent']['path'][n])} | "
                f"{pm(d['strawman_per_reconfiguration'][n], '{:,.0f}')} | "
                f"{pm(d['cost']['path'][n], '{:,.0f}')} | {pm(d['cut_side'][n])} |"
            )
    lines += [
        "",
        "Delivery check over these runs (the strawman and path lose notifications "
        "by design; neither paper 002 algorithm claims otherwise):",
        "",
    ]
    lines += [f"* {a}: {s}" for a, s in d2["delivery"].items()]
    lines += [
        "",
        "## Paper 000, Figs. 4 and 5: control messages and ordering delay per exchange",
        "",
        "![control vs cycle](control_vs_cycle.png)",
        "",
        "![ordering delay vs cycle](ordering_delay_vs_cycle.png)",
        "",
        *_parameter_rows(
            PAPER_000,
            {
                "brokers": p0["brokers"],
                "exchanges": p0["exchanges"],
                "seeds": seeds,
                "publish_interval_ms": f"{p0['publish_interval_ms'] / p0['rate_scale']:g} "
                f"(the paper's 25 ms at rate scale {p0['rate_scale']:g})",
            },
        ),
        f"| fan-out | {p0['max_fanout']} | not said (we keep paper 002's) |",
        "| link delay | uniform 1..100 ms, FIFO | only the maximum is said (transit-stub "
        "underlay of 10,000 nodes) |",
        f"| strawman gap | {p0['replace_delay_ms']:g} ms | not said (paper 002's 0.1 s) |",
        "",
        "The rate: at the paper's 40 notifications/s from each of 50 publishers a run of 100 "
        "exchanges is some millions of simulated deliveries per algorithm and seed, out of our "
        "30-minute budget; control messages do not depend on the rate, and the ordering delay is "
        "a mean per queued notification, so the scale costs samples, not bias "
        "(`--rate-scale 1` runs the paper's rate).",
        "",
        "| cycle length | coordinated | path | strawman | FIFO delay (ms) | causal delay (ms) |",
        "|---|---|---|---|---|---|",
    ]
    ctl, dl = d0["control"], d0["delay"]
    lengths = sorted({k for rows in (*ctl.values(), *dl.values()) for k in rows}, key=int)
    for k in lengths:
        cells = [pm(ctl[a].get(k, ())) for a in ALGORITHMS]
        cells += [pm(dl[o].get(k, ())) for o in ("fifo", "causal")]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", "Points with fewer than 5 exchanges are left out. Delivery check:", ""]
    lines += [f"* {a}: {s}" for a, s in d0["delivery"].items()]
    return "\n".join(lines) + "\n"


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "canopy sim report draws with matplotlib: pip install 'canopy[report]'", file=sys.stderr
        )
        return 2
    wall = time.perf_counter()
    if args.replot:
        saved = json.loads((args.out / "report.json").read_text())
        params, results = saved["parameters"], saved["runs"]
        fig5 = json.loads((args.out / standby.DATA).read_text())
        wall -= saved["wall_s"]
    else:
        params = parameters(args)
        seeds, p0, p2 = params["seeds"], params["p000"], params["p002"]
        # Paper 000's runs are the longest: first, so that the cores finish together.
        tasks: list[tuple[Callable[..., dict[str, Any]], tuple[Any, ...]]] = [
            (run_000, (seed, p0)) for seed in range(seeds)
        ]
        tasks += [
            (run_002, (n, density, seed, p2))
            for n in sorted(p2["sizes"], reverse=True)
            for seed in range(seeds)
            for density in ("sparse", "dense")
        ]
        # The test of our explanation for the strawman's lower cost: the same runs at the
        # largest size, removing only links that cut off at least a tenth of the tree.
        inner = {**p2, "min_side": max(2, max(p2["sizes"]) // 10)}
        tasks += [
            (run_002, (max(p2["sizes"]), density, seed, inner))
            for seed in range(seeds)
            for density in ("sparse", "dense")
        ]
        progress(f"{len(tasks)} runs on {args.jobs} processes")
        results = run_all(tasks, args.jobs)
        fig5 = standby.experiment(standby.parameters(args.quick, None, None), progress)
    data = summarise(params, results)
    data["wall_s"] = round(time.perf_counter() - wall, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    files = [*plot(data, args.out), standby.plot(fig5, args.out)]
    (args.out / "report.md").write_text(markdown(data))
    standby.write_section(args.out / "report.md", standby.section(fig5))
    (args.out / standby.DATA).write_text(json.dumps(fig5, indent=1))
    (args.out / "report.json").write_text(json.dumps(_jsonable({**data, "runs": results})))
    print(markdown(data))
    print("written: " + ", ".join(str(f) for f in [*files, args.out / "report.md"]))
    return 0


def summarise(params: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything the figures and the report show, from the raw per-run results."""
    sizes = [int(n) for n in params["p002"]["sizes"]]
    d002 = summarise_002([r for r in results if "n" in r and not r.get("min_side")], sizes)
    d002["reconfigurations"] = params["p002"]["reconfigurations"]
    inner = [r for r in results if r.get("min_side")]
    if inner:
        d002["inner"] = summarise_002(inner, [max(sizes)])
        d002["inner"]["min_side"] = inner[0]["min_side"]
    d000 = summarise_000([r for r in results if "n" not in r])
    return {
        "parameters": params,
        "p002": d002,
        "p000": d000,
        "comparison": comparisons(d002, d000, sizes),
    }
