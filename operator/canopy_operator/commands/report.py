"""`canopy sim report`: the papers' reconfiguration figures, regenerated from our simulator.

Three experiments, each drawn as a PNG and tabulated in ``report.md`` (and ``report.json``):

1. control messages per exchange against the length of the reconfiguration cycle, coordinated
   vs path vs strawman (paper 000, Fig. 4);
2. ordering delay against cycle length, FIFO vs causal (paper 000, Fig. 5);
3. overhead improvement over the strawman against the number of brokers, sparse and dense
   subscribers (paper 002, Fig. 5);
4. notifications delivered against simultaneous broker failures, with and without standby
   links (paper 003, Fig. 5; :mod:`canopy_operator.commands.standby`, also run on its own by
   ``canopy sim standby``).

Exchanges run one at a time here, so every control message sent between one exchange's request and
the next one's belongs to it. All runs also go through the delivery checker; the table reports
its counts next to the costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from canopy_broker.core.messages import Ordering, Publish, RoutingMode
from canopy_broker.sim.experiments import ExchangeRun, run_exchanges
from canopy_broker.sim.overhead import measure
from canopy_operator.commands import standby

ALGORITHMS = ("coordinated", "path", "strawman")


def add_arguments(sim_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sim_sub.add_parser("report", help="regenerate the papers' figures (tables and PNG plots)")
    p.add_argument("--out", type=Path, default=Path("out/report"), help="output directory")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run, ~20 s)")
    p.add_argument("--seeds", type=int, default=2, help="seeds per configuration")
    p.set_defaults(func=run)


def progress(msg: str) -> None:
    print(f"[report] {msg}", file=sys.stderr, flush=True)


def paper_run(
    n: int,
    *,
    algorithm: str,
    density: str,
    seed: int,
    exchanges: int,
    ordering: Ordering = Ordering.FIFO,
) -> ExchangeRun:
    return run_exchanges(
        n,
        seed=seed,
        rounds=exchanges,
        group_size=1,
        algorithm=algorithm,  # type: ignore[arg-type]
        mode=RoutingMode.IDENTITY,
        ordering=ordering,
        density=0.2 if density == "sparse" else 0.8,
        churn=0,
        wide_filters=False,
        publishers_subscribe=ordering is Ordering.CAUSAL,
        publishers=10,
        record_traffic=True,
    )


def per_exchange_control(run: ExchangeRun) -> list[tuple[int, int]]:
    """(cycle length, control messages) for each exchange of a one-at-a-time run."""
    assert run.sim.traffic is not None
    bounds = [*run.requested_at, float("inf")]
    counts = [0] * len(run.specs)
    for t, _s, _r, msg in run.sim.traffic:
        if isinstance(msg, Publish) or t < bounds[0]:
            continue
        i = next(j for j in range(len(run.specs)) if bounds[j] <= t < bounds[j + 1])
        counts[i] += 1
    return [(len(spec.path), c) for spec, c in zip(run.specs, counts, strict=True)]


def overhead(run: ExchangeRun) -> float:
    assert run.sim.traffic is not None
    paths = {x: rec.path for x, rec in run.sim.exchanges.items()}
    return measure(run.sim.traffic, run.sim.deliveries, run.sim.client_broker, paths, 200.0).total


def experiment_control(sizes: list[int], seeds: int, exchanges: int) -> dict[str, Any]:
    by_len: dict[str, dict[int, list[int]]] = {a: defaultdict(list) for a in ALGORITHMS}
    checks: dict[str, dict[str, int]] = {}
    for algorithm in ALGORITHMS:
        totals: dict[str, int] = defaultdict(int)
        for n in sizes:
            for seed in range(seeds):
                progress(f"control vs cycle: {algorithm}, {n} brokers, seed {seed}")
                run = paper_run(
                    n, algorithm=algorithm, density="sparse", seed=seed, exchanges=exchanges
                )
                for length, count in per_exchange_control(run):
                    by_len[algorithm][length].append(count)
                for k, v in run.report.summary().items():
                    totals[k] += v
        checks[algorithm] = dict(totals)
    table = {
        a: {length: statistics.mean(v) for length, v in sorted(rows.items())}
        for a, rows in by_len.items()
    }
    return {"mean_control_messages_by_cycle_length": table, "delivery": checks}


def experiment_ordering(sizes: list[int], seeds: int, exchanges: int) -> dict[str, Any]:
    table: dict[str, dict[int, float]] = {}
    violations: dict[str, int] = {}
    for ordering in (Ordering.FIFO, Ordering.CAUSAL):
        rows: dict[int, list[float]] = defaultdict(list)
        causal = 0
        for n in sizes:
            for seed in range(seeds):
                progress(f"ordering delay: {ordering.value}, {n} brokers, seed {seed}")
                run = paper_run(
                    n,
                    algorithm="coordinated",
                    density="dense",
                    seed=seed,
                    exchanges=exchanges,
                    ordering=ordering,
                )
                causal += len(run.report.causal)
                paths = {x: len(rec.path) for x, rec in run.sim.exchanges.items()}
                for core in run.sim.cores.values():
                    for xid, delays in core.ordering_delays_by_exchange.items():
                        rows[paths[xid]].extend(delays)
        table[ordering.value] = {k: statistics.mean(v) for k, v in sorted(rows.items()) if v}
        violations[ordering.value] = causal
    return {"mean_ordering_delay_by_cycle_length": table, "causal_violations": violations}


def experiment_scaling(sizes: list[int], seeds: int, exchanges: int) -> dict[str, Any]:
    result: dict[str, dict[str, dict[int, float]]] = {}
    for density in ("sparse", "dense"):
        cost: dict[str, dict[int, list[float]]] = {a: defaultdict(list) for a in ALGORITHMS}
        for n in sizes:
            for seed in range(seeds):
                for algorithm in ALGORITHMS:
                    progress(f"overhead vs size: {density}, {algorithm}, {n} brokers, seed {seed}")
                    run = paper_run(
                        n, algorithm=algorithm, density=density, seed=seed, exchanges=exchanges
                    )
                    cost[algorithm][n].append(overhead(run))
        result[density] = {
            a: {
                n: 100.0 * (1 - statistics.mean(cost[a][n]) / statistics.mean(cost["strawman"][n]))
                for n in sizes
            }
            for a in ("coordinated", "path")
        }
        result[density]["strawman_overhead"] = {
            n: statistics.mean(cost["strawman"][n]) for n in sizes
        }
    return {"improvement_over_strawman_percent": result}


Series = dict[str, tuple[dict[Any, float], str]]  # label -> ({x: y}, line style)


def line_chart(path: Path, series: Series, *, xlabel: str, ylabel: str, title: str) -> Path:
    """One PNG with a line per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (rows, style) in series.items():
        xs = sorted(rows)
        ax.plot(xs, [rows[x] for x in xs], style, marker="o", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot(data: dict[str, Any], out: Path) -> list[Path]:
    cycle = "reconfiguration cycle length (links)"
    control = data["control"]["mean_control_messages_by_cycle_length"]
    delay = data["ordering"]["mean_ordering_delay_by_cycle_length"]
    scaling = data["scaling"]["improvement_over_strawman_percent"]
    return [
        line_chart(
            out / "control_vs_cycle.png",
            {a: (rows, "-") for a, rows in control.items()},
            xlabel=cycle,
            ylabel="control messages per exchange",
            title="Control messages vs cycle length (cf. paper 000, Fig. 4)",
        ),
        line_chart(
            out / "ordering_delay_vs_cycle.png",
            {o: (rows, "-") for o, rows in delay.items()},
            xlabel=cycle,
            ylabel="mean queueing delay (sim time; link delay 1-10)",
            title="Ordering delay vs cycle length (cf. paper 000, Fig. 5)",
        ),
        line_chart(
            out / "improvement_vs_brokers.png",
            {
                f"{a}, {density}": (rows[a], "-" if density == "sparse" else "--")
                for density, rows in scaling.items()
                for a in ("coordinated", "path")
            },
            xlabel="brokers",
            ylabel="overhead reduction vs strawman (%)",
            title="Improvement over the strawman (cf. paper 002, Fig. 5)",
        ),
    ]


def markdown(data: dict[str, Any]) -> str:
    lines = ["# Reconfiguration report", "", f"Parameters: `{json.dumps(data['parameters'])}`", ""]
    ctl = data["control"]["mean_control_messages_by_cycle_length"]
    lengths = sorted({k for rows in ctl.values() for k in rows})
    lines += [
        "## Control messages per exchange by cycle length",
        "",
        "| cycle length | " + " | ".join(ALGORITHMS) + " |",
        "|---|" + "---|" * len(ALGORITHMS),
    ]
    for length in lengths:
        cells = [f"{ctl[a][length]:.1f}" if length in ctl[a] else "" for a in ALGORITHMS]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    lines += ["", "Delivery check over these runs:", ""]
    for a, s in data["control"]["delivery"].items():
        lines.append(f"* {a}: {s}")
    od = data["ordering"]["mean_ordering_delay_by_cycle_length"]
    lengths = sorted({k for rows in od.values() for k in rows})
    lines += [
        "",
        "## Ordering delay by cycle length (coordinated)",
        "",
        "| cycle length | fifo | causal |",
        "|---|---|---|",
    ]
    for length in lengths:
        cells = [f"{od[o][length]:.1f}" if length in od[o] else "" for o in ("fifo", "causal")]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    lines += ["", f"Causal violations: {data['ordering']['causal_violations']}", ""]
    sc = data["scaling"]["improvement_over_strawman_percent"]
    lines += [
        "## Overhead reduction against the strawman (%)",
        "",
        "| brokers | coordinated sparse | path sparse | coordinated dense | path dense |",
        "|---|---|---|---|---|",
    ]
    for n in sorted(sc["sparse"]["coordinated"]):
        lines.append(
            f"| {n} | {sc['sparse']['coordinated'][n]:.0f} | {sc['sparse']['path'][n]:.0f} | "
            f"{sc['dense']['coordinated'][n]:.0f} | {sc['dense']['path'][n]:.0f} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "canopy sim report draws with matplotlib: pip install 'canopy[report]'", file=sys.stderr
        )
        return 2
    if args.quick:
        sizes_cycle, sizes_scale, exchanges, seeds = [30], [20, 40], 6, 1
    else:
        sizes_cycle, sizes_scale, exchanges, seeds = (
            [100, 200],
            [25, 50, 100, 150, 200],
            20,
            args.seeds,
        )
    wall = time.perf_counter()
    data: dict[str, Any] = {
        "parameters": {
            "cycle_sizes": sizes_cycle,
            "scaling_sizes": sizes_scale,
            "exchanges_per_run": exchanges,
            "seeds": seeds,
        },
        "control": experiment_control(sizes_cycle, seeds, exchanges),
        "ordering": experiment_ordering(sizes_cycle, seeds, exchanges),
        "scaling": experiment_scaling(sizes_scale, seeds, exchanges),
    }
    fig5 = standby.experiment(standby.parameters(args.quick, None, None), progress)
    data["wall_s"] = round(time.perf_counter() - wall, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    files = [*plot(data, args.out), standby.plot(fig5, args.out)]
    (args.out / "report.md").write_text(markdown(data))
    standby.write_section(args.out / "report.md", standby.section(fig5))
    (args.out / standby.DATA).write_text(json.dumps(fig5, indent=1))
    (args.out / "report.json").write_text(json.dumps(data, indent=1, default=str))
    print(markdown(data))
    print("written: " + ", ".join(str(f) for f in [*files, args.out / "report.md"]))
    return 0
