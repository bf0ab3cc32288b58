"""Pictures of the benchmarks' results, for ``--plot FILE``: latency against load, CPU per
notification side by side, what an insertion costs across an install, throughput and memory
against filters. These are curves and comparisons people read at a glance and would rather see
than a table.

Each picture is drawn from the very result the table and the JSON line print, after they are
printed, so it never shows a figure the run did not measure, and a picture that fails loses no
figure. Each drawing function returns what the figure holds, read back from it (:func:`_read`:
lines, bars with their bases, dots, goal marks, tick labels), which the tests compare with the
result. A goal (docs/performance.md) is drawn as a dashed red mark over the figures it is about
and only there: the chain's latency goal over the chain's curves' range, each throughput goal
over its own bar, the 30 s install goal over the 100k install; the 500,000 notifications/s goal
is bench dataplane's flat-out load's, not bench broker's paced one.

matplotlib is the ``report`` extra (``make setup`` installs it). It is imported here only, and
only to draw, so a broker never loads it. :func:`check_target` runs before a benchmark starts:
a missing matplotlib, an unknown file type, a directory, or a file that cannot be written is
refused at once, not after minutes of measuring.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

SUFFIXES = (".png", ".svg", ".pdf")
Drawn = list[dict[str, Any]]
"""Per panel, what it holds: ``lines`` and ``dots`` (label -> points), ``bars`` (label -> (x,
height, base) per bar), ``goals`` (label -> (x from, x to, y) per mark), ``xticks`` (labels)."""
GOAL_STYLE: dict[str, Any] = {"color": "tab:red", "linestyles": "--", "linewidth": 1.2}


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


def check_target(path: str) -> str | None:
    """Why ``path`` cannot take a picture (a message naming the problem), or None. Whether it
    can be written is found by opening it for appending (a file this creates is removed)."""
    target = Path(path)
    if target.suffix.lower() not in SUFFIXES:
        return f"--plot {path}: the file must end in {', '.join(SUFFIXES)}"
    if not target.parent.is_dir():
        return f"--plot {path}: there is no directory {target.parent}"
    if target.is_dir():
        return f"--plot {path}: that is a directory"
    existed = target.exists()
    try:
        with target.open("ab"):
            pass
    except OSError as exc:
        return f"--plot {path}: cannot write it ({exc.strerror or exc})"
    if not existed:
        with contextlib.suppress(OSError):
            target.unlink()
    try:
        import matplotlib  # noqa: F401, PLC0415 - optional dependency, only for pictures
    except ImportError:
        return "--plot needs matplotlib: pip install 'canopy[report]' (make setup installs it)"
    return None


def draw(path: str | None, picture: Callable[[str], object]) -> int:
    """After the figures are printed: ``picture(path)``, said on stderr; 1 if it failed (the
    message says why), else 0 (also without ``--plot``)."""
    if path is None:
        return 0
    try:
        picture(path)
    except Exception as exc:  # a picture failing loses no figure: they are printed already
        print(f"error: --plot {path}: the picture could not be drawn: {exc}", file=sys.stderr)
        return 1
    print(f"drew {path}", file=sys.stderr)
    return 0


def _pyplot() -> Any:
    import matplotlib  # noqa: PLC0415 - optional dependency, only for pictures

    matplotlib.use("Agg")  # files only: no display, whatever the environment says
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _save(fig: Any, path: str) -> Drawn:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    drawn = _read(fig)
    _pyplot().close(fig)
    return drawn


def _read(fig: Any) -> Drawn:
    """What each panel of ``fig`` holds, read from its artists (see :data:`Drawn`)."""
    import numpy as np  # noqa: PLC0415 - comes with matplotlib
    from matplotlib.collections import LineCollection, PathCollection  # noqa: PLC0415

    panels = []
    for ax in fig.axes:
        bars = {
            c.get_label(): [
                (float(p.get_x() + p.get_width() / 2), float(p.get_height()), float(p.get_y()))
                for p in c.patches
            ]
            for c in ax.containers
        }
        goals = {
            c.get_label(): [
                (float(seg[0][0]), float(seg[1][0]), float(seg[0][1])) for seg in c.get_segments()
            ]
            for c in ax.collections
            if isinstance(c, LineCollection)
        }
        dots = {
            c.get_label(): [(float(x), float(y)) for x, y in np.asarray(c.get_offsets())]
            for c in ax.collections
            if isinstance(c, PathCollection)
        }
        lines = {
            ln.get_label(): [
                (float(x), float(y))
                for x, y in zip(np.asarray(ln.get_xdata()), np.asarray(ln.get_ydata()), strict=True)
            ]
            for ln in ax.get_lines()
        }
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        panels.append({"lines": lines, "bars": bars, "dots": dots, "goals": goals, "xticks": ticks})
    return panels


def _goal(ax: Any, y: float, x0: float, x1: float, label: str) -> None:
    """A goal: a dashed red mark at ``y`` over ``x0`` .. ``x1`` (the figures it is about)."""
    ax.hlines([y], x0, x1, label=label, **GOAL_STYLE)


def _thousands(ax: Any) -> None:
    """Counts on the y axis as 500,000 rather than 5e5."""
    from matplotlib.ticker import StrMethodFormatter  # noqa: PLC0415 - see _pyplot

    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))


def _headroom(ax: Any, top: float) -> None:
    """From 0 to a fifth above ``top``: the highest point, its label and the legend fit."""
    ax.set_ylim(0, 1.2 * top if top > 0 else 1)


# --------------------------------------------------------------------------- bench dataplane


def dataplane(result: Mapping[str, Any], path: str) -> Drawn:
    """Latency percentiles against the event rate for one broker and the chain of 3 (the
    rates are the loads asked for, as fractions of each one's measured maximum), and the
    throughput figures, each beside the goal the table gives it."""
    plt = _pyplot()
    d = result["detail"]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11.5, 4.4), width_ratios=(3, 2))
    top = 0.0
    for where, key, color in (
        ("1 broker", "single", "tab:blue"),
        ("chain of 3", "chain3", "tab:orange"),
    ):
        points = d[key]["latency"]
        rates = [p["events_per_s"] for p in points]
        for pct, style in (("p50", ":"), ("p99", "-"), ("p999", "--")):
            values = [p[f"{pct}_ms"] for p in points]
            top = max(top, *values)
            name = "p99.9" if pct == "p999" else pct
            lat.plot(
                rates, values, marker="o", color=color, linestyle=style, label=f"{where} {name}"
            )
    chain = [p["events_per_s"] for p in d["chain3"]["latency"]]
    _goal(lat, 5.0, min(chain), max(chain), "goal: chain of 3, p99 <= 5 ms at half load")
    lat.set_xlabel("events/s (fractions of each one's measured maximum)")
    lat.set_ylabel("latency, ms (publisher to subscriber)")
    _headroom(lat, top)
    lat.legend(fontsize=7, ncols=2, loc="upper left")
    trip = d.get("machine", {}).get("round_trip_us")
    lat.set_title(
        "latency against load"
        + (f" (this machine: a process-to-process round trip {trip:.0f} us)" if trip else ""),
        fontsize=9,
    )
    s, c = d["single"], d["chain3"]
    bars = (  # what, measured, the table's target
        ("1 broker\nend to end", s["notif_per_s"], 100_000),
        ("1 broker\nper broker CPU-s", s["notif_per_broker_cpu_s"], 500_000),
        ("chain of 3\nend to end", c["notif_per_s"], 50_000),
    )
    xs = range(len(bars))
    thr.bar(xs, [v for _, v, _ in bars], color="tab:green", label="notifications/s")
    for x, (_, _, target) in zip(xs, bars, strict=True):
        _goal(thr, target, x - 0.45, x + 0.45, "goal (the table's target)" if x == 0 else "")
    thr.set_xticks(xs, [name for name, _, _ in bars], fontsize=8)
    thr.set_ylabel("notifications/s")
    _headroom(thr, max(max(v, t) for _, v, t in bars))
    _thousands(thr)
    thr.legend(fontsize=7, loc="upper right")
    tls = "on" if result["tls"] else "off"
    thr.set_title(f"throughput ({d['filters']:,} filters, TLS {tls})", fontsize=9)
    return _save(fig, path)


# --------------------------------------------------------------------------- bench peers


def peers(
    result: Mapping[str, Mapping[str, Any]],
    ratios: Mapping[str, tuple[float, float]],
    workload: str,
    path: str,
) -> Drawn:
    """Each system's broker CPU per notification (the median round, split into its own code and
    the kernel's work for it), every round as a dot, and the goal: at most 1.5x NATS's.
    ``ratios``: each system's paired ratios to NATS and to Mosquitto (NaN where absent). Under
    each name, its latency (p50 / p99) when measured, and Canopy's write pacing when on."""
    plt = _pyplot()
    names = list(result)
    xs = list(range(len(names)))
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    user = [result[n]["user_us"] for n in names]
    system = [result[n]["system_us"] for n in names]
    ax.bar(xs, user, color="tab:blue", label="user (the broker's code)")
    ax.bar(xs, system, bottom=user, color="tab:gray", label="system (the kernel, for it)")
    top = 0.0
    for x, n in zip(xs, names, strict=True):
        rounds = [r["us_per_notification"] for r in result[n].get("rounds", [result[n]])]
        top = max(top, *rounds)
        ax.scatter([x] * len(rounds), rounds, color="black", s=12, zorder=3, label=f"{n} rounds")
    if "nats" in result:
        goal = 1.5 * result["nats"]["us_per_notification"]
        top = max(top, goal)
        _goal(ax, goal, -0.45, len(names) - 0.55, "goal: at most 1.5x NATS's median round")
    labels = []
    for n in names:
        m = result[n]
        to_nats, to_mosquitto = ratios[n]
        said = [
            f"{r:.2f}x {peer}"
            for r, peer in ((to_nats, "NATS"), (to_mosquitto, "Mosquitto"))
            if n.lower() != peer.lower() and not math.isnan(r)
        ]
        if "p50_ms" in m:  # what the CPU figure costs in waiting
            said.append(f"p50 {m['p50_ms']:.1f} / p99 {m['p99_ms']:.1f} ms")
        paced = m.get("client_write_interval_ms")
        name = f"{n}, paced {paced:g} ms" if paced else n
        labels.append("\n".join([name, *said]))
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("broker CPU per delivered notification, us")
    _headroom(ax, top)
    ax.set_title("\n".join(textwrap.wrap(workload, 120)), fontsize=8)  # flags make it long
    handles, texts = ax.get_legend_handles_labels()  # the rounds' dots need no entry each
    keep = [i for i, t in enumerate(texts) if not t.endswith(" rounds")]
    ax.legend([handles[i] for i in keep], [texts[i] for i in keep], fontsize=7, loc="upper right")
    return _save(fig, path)


# --------------------------------------------------------------------------- bench subscriptions


def subscriptions(result: Mapping[str, Any], path: str) -> Drawn:
    """What an insertion costs across each install (flat is the goal), how long each install
    took (the goal: 100k in 30 s), and the longest event-loop stall of every phase (the goal:
    none over 50 ms on CPU)."""
    plt = _pyplot()
    installs = result["install"]
    fig, (cost, took, stalls) = plt.subplots(1, 3, figsize=(13.5, 4.2))
    top = 0.0
    for r in installs:
        tenths = r.get("cpu_us_per_insert_by_tenth")
        if tenths:
            top = max(top, *tenths)
            done = [10 * (t + 1) for t in range(len(tenths))]
            cost.plot(done, tenths, marker="o", label=f"N = {r['subscriptions']:,}")
    cost.set_xlabel("% of the install done")
    cost.set_ylabel("CPU per subscription per broker, us")
    _headroom(cost, top)
    cost.set_title(
        f"insertion cost ({result['brokers']} brokers, {result['routing']} routing)", fontsize=9
    )
    if top:
        cost.legend(fontsize=7)
    width = 0.4
    xs = list(range(len(installs)))
    took.bar(
        [x - width / 2 for x in xs],
        [r["acknowledged_s"] for r in installs],
        width=width,
        label="acknowledged",
    )
    took.bar(
        [x + width / 2 for x in xs],
        [r["installed_everywhere_s"] for r in installs],
        width=width,
        label="in every table",
    )
    top = max(r["installed_everywhere_s"] for r in installs)
    for x, r in zip(xs, installs, strict=True):
        if r["subscriptions"] == 100_000:  # the goal's size: drawn over that install alone
            _goal(took, 30.0, x - 0.45, x + 0.45, "goal: 100k in at most 30 s")
            top = max(top, 30.0)
    took.set_xticks(xs, [f"{r['subscriptions']:,}" for r in installs])
    took.set_xlabel("subscriptions installed (each adds to the tables)")
    took.set_ylabel("seconds")
    _headroom(took, top)
    took.legend(fontsize=7, loc="upper left")
    measured = [*installs, result["churn"], result["leave"]]
    xs = list(range(len(measured)))
    walls = [1000 * m["longest_stall_s"] for m in measured]
    cpus = [1000 * m["longest_stall_cpu_s"] for m in measured]
    stalls.bar(
        [x - width / 2 for x in xs], walls, width=width, color="tab:gray", label="longest stall"
    )
    stalls.bar(
        [x + width / 2 for x in xs], cpus, width=width, color="tab:purple", label="of it on CPU"
    )
    _goal(stalls, 50.0, -0.45, len(xs) - 0.55, "goal: no stall over 50 ms on CPU")
    stalls.set_xticks(
        xs, [*(f"install\n{r['subscriptions']:,}" for r in installs), "churn", "leave"], fontsize=8
    )
    stalls.set_ylabel("event-loop stall, ms (any broker)")
    _headroom(stalls, max(50.0, *walls))
    stalls.legend(fontsize=7, loc="upper left")
    return _save(fig, path)


# --------------------------------------------------------------------------- bench broker


def broker_scale(points: Sequence[Mapping[str, Any]], workload: str, path: str) -> Drawn:
    """One broker against the number of filters it holds: notifications per broker CPU-second
    (its capacity on one core, under this paced load), and its resident memory."""
    plt = _pyplot()
    filters = [p["filters"] for p in points]
    fig, (cap, mem) = plt.subplots(1, 2, figsize=(10, 4.2))
    capacity = [p["capacity_notif_per_s"] or 0 for p in points]
    cap.plot(filters, capacity, marker="o", label="notifications per broker CPU-second")
    # No goal mark: the 500,000/s goal is for bench dataplane's flat-out load, where a write
    # carries many notifications; this paced load writes about one per subscriber per event.
    cap.set_ylabel("notifications per broker CPU-second (this load)")
    _thousands(cap)
    _headroom(cap, max(capacity))
    rss: tuple[tuple[str, str, dict[str, Any]], ...] = (
        ("RSS holding the filters", "filters", {"color": "tab:orange"}),
        ("RSS before", "before", {"color": "0.6", "linestyle": ":"}),
    )
    for label, key, style in rss:
        mem.plot(filters, [p["rss_mb"][key] for p in points], marker="o", label=label, **style)
    last = len(points) - 1
    for i, p in enumerate(points):  # the last one's label to its left, inside the panel
        mem.annotate(
            f"{p['bytes_per_filter']:,} B/filter",
            (p["filters"], p["rss_mb"]["filters"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(-6, 6) if i == last else (6, -10),
            ha="right" if i == last else "left",
        )
    mem.set_ylabel("broker RSS, MiB")
    _headroom(mem, max(p["rss_mb"]["filters"] for p in points))
    for ax in (cap, mem):
        ax.set_xscale("log")
        ax.set_xticks(filters, [f"{n:,}" for n in filters])
        ax.minorticks_off()
        ax.set_xlabel("filters held by the broker")
    cap.legend(fontsize=7, loc="lower left")
    mem.legend(fontsize=7, loc="upper left")
    fig.suptitle(workload, fontsize=8)
    return _save(fig, path)
