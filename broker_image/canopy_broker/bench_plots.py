"""Pictures of the benchmarks' results, for ``--plot FILE``: latency against load, CPU per
notification side by side, what an insertion costs across an install, throughput and memory
against filters. These are curves and comparisons people read at a glance and would rather see
than a table.

Each picture is drawn from the very result the table and the JSON line print, after the run, so
it never shows a figure the run did not measure; each drawing function returns the series it
drew (label -> x values, y values), which the tests compare with the result. The performance
goals (docs/performance.md) are drawn as dashed lines beside the figures they are about, and
only there: the 500,000 notifications/s goal is for bench dataplane's flat-out load, not for
bench broker's paced one.

matplotlib is the ``report`` extra (``make setup`` installs it). It is imported here only, and
only to draw, so a broker never loads it. :func:`check_target` runs before a benchmark starts:
a missing matplotlib, an unknown file type or a missing directory is refused at once, not after
minutes of measuring.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SUFFIXES = (".png", ".svg", ".pdf")
Series = dict[str, tuple[list[float], list[float]]]
GOAL_STYLE: dict[str, Any] = {"color": "tab:red", "linestyle": "--", "linewidth": 1.0}


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the result to FILE (.png, .svg or .pdf; needs matplotlib)",
    )


def refused(path: str | None) -> bool:
    """Before a run: say why ``--plot path`` cannot be drawn (on stderr) and return True."""
    why = None if path is None else check_target(path)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
    return why is not None


def drew(path: str) -> None:
    print(f"drew {path}", file=sys.stderr)


def check_target(path: str) -> str | None:
    """Why ``path`` cannot take a picture (a message naming the problem), or None."""
    target = Path(path)
    if target.suffix.lower() not in SUFFIXES:
        return f"--plot {path}: the file must end in {', '.join(SUFFIXES)}"
    if not target.parent.is_dir():
        return f"--plot {path}: there is no directory {target.parent}"
    try:
        import matplotlib  # noqa: F401, PLC0415 - optional dependency, only for pictures
    except ImportError:
        return "--plot needs matplotlib: pip install 'canopy[report]' (make setup installs it)"
    return None


def _pyplot() -> Any:
    import matplotlib  # noqa: PLC0415 - optional dependency, only for pictures

    matplotlib.use("Agg")  # files only: no display, whatever the environment says
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _save(fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def _thousands(ax: Any) -> None:
    """Counts on the y axis as 500,000 rather than 5e5."""
    from matplotlib.ticker import StrMethodFormatter  # noqa: PLC0415 - see _pyplot

    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))


def _line(
    ax: Any, drawn: Series, label: str, xs: Sequence[float], ys: Sequence[float], **kw: Any
) -> None:
    ax.plot(xs, ys, marker="o", label=label, **kw)
    drawn[label] = (list(xs), list(ys))


def _bars(
    ax: Any, drawn: Series, label: str, xs: Sequence[float], ys: Sequence[float], **kw: Any
) -> Any:
    bars = ax.bar(xs, ys, label=label, **kw)
    drawn[label] = (list(xs), list(ys))
    return bars


# --------------------------------------------------------------------------- bench dataplane


def dataplane(result: Mapping[str, Any], path: str) -> Series:
    """Latency percentiles against the event rate for one broker and the chain of 3 (the
    rates are the loads asked for, as fractions of each one's measured maximum), and the
    throughput figures beside their goal."""
    plt = _pyplot()
    d = result["detail"]
    drawn: Series = {}
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=(3, 2))
    for where, key, color in (
        ("1 broker", "single", "tab:blue"),
        ("chain of 3", "chain3", "tab:orange"),
    ):
        points = d[key]["latency"]
        rates = [p["events_per_s"] for p in points]
        for pct, style in (("p50", ":"), ("p99", "-"), ("p999", "--")):
            name = "p99.9" if pct == "p999" else pct
            _line(
                lat,
                drawn,
                f"{where} {name}",
                rates,
                [p[f"{pct}_ms"] for p in points],
                color=color,
                linestyle=style,
            )
    lat.axhline(5.0, **GOAL_STYLE, label="goal: chain p99 <= 5 ms at half load")
    lat.set_xlabel("events/s (fractions of each one's measured maximum)")
    lat.set_ylabel("latency, ms (publisher to subscriber)")
    lat.set_ylim(bottom=0)
    lat.legend(fontsize=7, ncols=2)
    machine = d.get("machine", {})
    trip = machine.get("round_trip_us")
    lat.set_title(
        "latency against load"
        + (f" (this machine: a process-to-process round trip {trip:.0f} us)" if trip else ""),
        fontsize=9,
    )
    s, c = d["single"], d["chain3"]
    labels = ["1 broker\nend to end", "1 broker\nper broker CPU-s", "chain of 3\nend to end"]
    values = [s["notif_per_s"], s["notif_per_broker_cpu_s"], c["notif_per_s"]]
    _bars(thr, drawn, "notifications/s", list(range(len(values))), values, color="tab:green")
    thr.set_xticks(range(len(values)), labels, fontsize=8)
    thr.axhline(500_000, **GOAL_STYLE, label="goal: one broker >= 500,000/s")
    thr.set_ylabel("notifications/s")
    _thousands(thr)
    thr.legend(fontsize=7)
    tls = "on" if result["tls"] else "off"
    thr.set_title(f"throughput ({d['filters']:,} filters, TLS {tls})", fontsize=9)
    _save(fig, path)
    return drawn


# --------------------------------------------------------------------------- bench peers


def peers(
    result: Mapping[str, Mapping[str, Any]],
    ratios: Mapping[str, tuple[float, float]],
    workload: str,
    path: str,
) -> Series:
    """Each system's broker CPU per notification (the median round, split into its own code and
    the kernel's work for it), every round as a dot, and the goal: at most 1.5x NATS's.
    ``ratios``: each system's paired ratios to NATS and to Mosquitto (NaN where absent)."""
    plt = _pyplot()
    drawn: Series = {}
    names = list(result)
    xs = list(range(len(names)))
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    user = [result[n]["user_us"] for n in names]
    system = [result[n]["system_us"] for n in names]
    _bars(ax, drawn, "user (the broker's code)", xs, user, color="tab:blue")
    _bars(ax, drawn, "system (the kernel, for it)", xs, system, bottom=user, color="tab:gray")
    for x, n in zip(xs, names, strict=True):
        rounds = [r["us_per_notification"] for r in result[n].get("rounds", [result[n]])]
        ax.scatter([x] * len(rounds), rounds, color="black", s=12, zorder=3)
        drawn[f"{n} rounds"] = ([float(x)] * len(rounds), rounds)
    if "nats" in result:
        ax.axhline(
            1.5 * result["nats"]["us_per_notification"],
            **GOAL_STYLE,
            label="goal: at most 1.5x NATS",
        )
    labels = []
    for n in names:
        to_nats, to_mosquitto = ratios[n]
        said = [
            f"{r:.2f}x {peer}"
            for r, peer in ((to_nats, "NATS"), (to_mosquitto, "Mosquitto"))
            if n.lower() != peer.lower() and not math.isnan(r)
        ]
        labels.append("\n".join([n, *said]))
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("broker CPU per delivered notification, us")
    ax.set_title(workload, fontsize=8)
    ax.legend(fontsize=7)
    _save(fig, path)
    return drawn


# --------------------------------------------------------------------------- bench subscriptions


def subscriptions(result: Mapping[str, Any], path: str) -> Series:
    """What an insertion costs across each install (flat is the goal), how long each install
    took beside the goal of 100k in 30 s, and the longest event-loop stall of every phase
    beside the goal of 50 ms."""
    plt = _pyplot()
    drawn: Series = {}
    installs = result["install"]
    fig, (cost, took, stalls) = plt.subplots(1, 3, figsize=(13, 4.0))
    for r in installs:
        tenths = r.get("cpu_us_per_insert_by_tenth")
        if tenths:
            _line(
                cost,
                drawn,
                f"N = {r['subscriptions']:,}",
                [10 * (t + 1) for t in range(len(tenths))],
                tenths,
            )
    cost.set_xlabel("% of the install done")
    cost.set_ylabel("CPU per subscription per broker, us")
    cost.set_ylim(bottom=0)
    cost.set_title(
        f"insertion cost ({result['brokers']} brokers, {result['routing']} routing)", fontsize=9
    )
    if drawn:
        cost.legend(fontsize=7)
    xs = list(range(len(installs)))
    names = [f"{r['subscriptions']:,}" for r in installs]
    width = 0.4
    _bars(
        took,
        drawn,
        "acknowledged",
        [x - width / 2 for x in xs],
        [r["acknowledged_s"] for r in installs],
        width=width,
    )
    _bars(
        took,
        drawn,
        "in every table",
        [x + width / 2 for x in xs],
        [r["installed_everywhere_s"] for r in installs],
        width=width,
    )
    took.axhline(30.0, **GOAL_STYLE, label="goal: 100k in at most 30 s")
    took.set_xticks(xs, names)
    took.set_xlabel("subscriptions installed (each adds to the tables)")
    took.set_ylabel("seconds")
    took.legend(fontsize=7)
    phases = [*(f"install\n{n}" for n in names), "churn", "leave"]
    measured = [*installs, result["churn"], result["leave"]]
    xs = list(range(len(phases)))
    _bars(
        stalls,
        drawn,
        "longest stall",
        [x - width / 2 for x in xs],
        [1000 * m["longest_stall_s"] for m in measured],
        width=width,
        color="tab:gray",
    )
    _bars(
        stalls,
        drawn,
        "of it on CPU",
        [x + width / 2 for x in xs],
        [1000 * m["longest_stall_cpu_s"] for m in measured],
        width=width,
        color="tab:purple",
    )
    stalls.axhline(50.0, **GOAL_STYLE, label="goal: no stall over 50 ms")
    stalls.set_xticks(xs, phases, fontsize=8)
    stalls.set_ylabel("event-loop stall, ms (any broker)")
    stalls.legend(fontsize=7)
    _save(fig, path)
    return drawn


# --------------------------------------------------------------------------- bench broker


def broker_scale(points: Sequence[Mapping[str, Any]], workload: str, path: str) -> Series:
    """One broker against the number of filters it holds: notifications per broker CPU-second
    (its capacity on one core, under this paced load), and its resident memory."""
    plt = _pyplot()
    drawn: Series = {}
    filters = [p["filters"] for p in points]
    fig, (cap, mem) = plt.subplots(1, 2, figsize=(10, 4.0))
    _line(
        cap,
        drawn,
        "notifications per broker CPU-second",
        filters,
        [p["capacity_notif_per_s"] or 0 for p in points],
    )
    # No goal line: the 500,000/s goal is for bench dataplane's flat-out load, where a write
    # carries many notifications; this paced load writes about one per subscriber per event.
    cap.set_ylabel("notifications per broker CPU-second (this load)")
    _thousands(cap)
    mem.set_ylabel("broker RSS, MiB")
    rss: tuple[tuple[str, str, dict[str, Any]], ...] = (
        ("RSS holding the filters", "filters", {"color": "tab:orange"}),
        ("RSS before", "before", {"color": "0.6", "linestyle": ":"}),
    )
    for label, key, style in rss:
        _line(mem, drawn, label, filters, [p["rss_mb"][key] for p in points], **style)
    for p in points:
        mem.annotate(
            f"{p['bytes_per_filter']:,} B/filter",
            (p["filters"], p["rss_mb"]["filters"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, -10),
        )
    for ax in (cap, mem):
        ax.set_xscale("log")
        ax.set_xticks(filters, [f"{n:,}" for n in filters])
        ax.minorticks_off()
        ax.set_xlabel("filters held by the broker")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(workload, fontsize=8)
    _save(fig, path)
    return drawn
