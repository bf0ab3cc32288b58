"""``canopy bench broker``: how one broker scales with the filters it holds (issue 16 item 5).

Why: a broker in a real deployment holds thousands to hundreds of thousands of subscriptions,
nearly all of which do not match a given event. What an operator needs to know is what those
cost: does throughput hold as filters are added, and how much memory does each take?

For each filter count N (``--filters``, default 1,000, 10,000 and 100,000), one fresh
``canopy-broker serve`` (TLS on, custody on: the defaults a deployment runs with), and:

* **filters**: ``--subscribers`` client connections (default 50). Subscriber ``i`` holds the one
  filter that matches its group, ``g = i % G`` (``G = subscribers / fanout``), and its share of
  N - subscribers *background* filters that never match: ``g = G + j and n >= 0``, each a
  different value (content-based filters over the same attribute as the matching ones, so the
  broker's index has to tell them apart, not skip them by attribute).
* **traffic**: one publisher sends ``--rate`` events/s for ``--duration`` s (paced, as ``bench
  peers`` is); every event matches exactly ``--fanout`` subscribers.
* **measured**: notifications delivered per second (delivered / (last arrival - first
  publish)), the broker's CPU per delivered notification (``/proc``: its capacity is one core
  divided by that), the time to install the filters, and the broker's RSS before the filters,
  after them and at the end (so the bytes per filter).

The clients share this process's single core budget with nothing else; the broker has its own
process. At the default rate the publisher, not the broker, is usually the limit, which is why
CPU per notification (the broker's cost, whatever the offered load) is reported beside the rate.

Progress goes to stderr; with ``--json`` the last stdout line is one JSON object: ``points``
(one per N: ``filters``, ``install_s``, ``notif_per_s``, ``us_per_notification``,
``capacity_notif_per_s``, ``rss_mb`` {before, filters, end}, ``bytes_per_filter``,
``delivered``, ``expected``) and ``workload``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from canopy_broker import bench_plots
from canopy_broker.bench import Sink, canopy_sender, done, progress, publish_paced
from canopy_broker.bench_peers import Numbered, Workload, wait_delivered
from canopy_broker.cli import tune_gc
from canopy_broker.client import connect
from canopy_broker.procs import Overlay
from canopy_broker.progress import showing
from canopy_broker.runtime import eventloop

FULL: dict[str, Any] = {
    "filters": "1000,10000,100000",
    "subscribers": 50,
    "fanout": 10,
    "rate": 10000.0,
}
QUICK: dict[str, Any] = {"filters": "200,2000", "subscribers": 10, "fanout": 2, "rate": 1000.0}
DURATION = {"full": 5.0, "quick": 1.0}
BATCH = 500  # subscriptions in flight per subscriber while installing


async def point(n_filters: int, w: Workload) -> dict[str, Any]:
    """One fresh broker holding ``n_filters`` filters under the paced workload."""
    if n_filters < w.subscribers:
        raise ValueError(f"--filters {n_filters}: at least one per subscriber ({w.subscribers})")
    sink = Sink()
    async with Overlay(["b"], extra_args=["--max-subscriptions", str(n_filters)]) as ov:
        broker = ov["b"]
        address = broker.listen
        creds = ov.credentials
        subs = [
            await connect(address, credentials=creds, on_notifications=sink.deliver)
            for _ in range(w.subscribers)
        ]
        pub = await connect(address, client_id="bench-scale-pub", credentials=creds)
        try:
            rss_before = broker.rss_mb()
            progress(f"{n_filters:,} filters: installing over {w.subscribers} subscribers")
            t0 = time.perf_counter()
            background = iter(range(n_filters - w.subscribers))
            per_sub = -(-(n_filters - w.subscribers) // w.subscribers)

            async def install(i: int) -> None:
                c = subs[i]
                await c.subscribe(f"g = {i % w.groups}")
                mine = [j for _, j in zip(range(per_sub), background, strict=False)]
                for k in range(0, len(mine), BATCH):
                    await asyncio.gather(
                        *(
                            c.subscribe(f"g = {w.groups + j} and n >= 0")
                            for j in mine[k : k + BATCH]
                        )
                    )

            await asyncio.gather(*(install(i) for i in range(w.subscribers)))
            install_s = time.perf_counter() - t0
            status = await broker.admin.status()
            held = int(status["routing_table_size"])
            rss_filters = broker.rss_mb()
            progress(
                f"{n_filters:,} filters: installed in {install_s:.1f} s; publishing "
                f"{w.rate:,.0f} events/s for {w.duration:g} s"
            )
            send = canopy_sender(pub, Numbered(w.groups).attrs)
            cpu0, t1 = ov.cpu_seconds(), time.perf_counter()
            published = await publish_paced(w.rate, w.duration, send, w.tick)
            expected = published * w.fanout
            await wait_delivered(sink, expected)
            cpu = ov.cpu_seconds() - cpu0
            rss_end = broker.rss_mb()
        finally:
            for c in [pub, *subs]:
                await c.close()
    us = cpu / max(1, sink.count) * 1e6
    result = {
        "filters": n_filters,
        "routing_table_entries": held,
        "install_s": round(install_s, 3),
        "notif_per_s": round(sink.count / max(1e-9, sink.last_arrival - t1)),
        "us_per_notification": round(us, 3),
        "capacity_notif_per_s": round(1e6 / us) if us else None,
        "rss_mb": {
            "before": round(rss_before, 1),
            "filters": round(rss_filters, 1),
            "end": round(rss_end, 1),
        },
        "bytes_per_filter": round((rss_filters - rss_before) * 2**20 / n_filters),
        "delivered": sink.count,
        "expected": expected,
    }
    progress(
        f"{n_filters:,} filters: {result['notif_per_s']:,} notifications/s, "
        f"{result['us_per_notification']} CPU-us each, RSS {rss_filters:.0f} MiB"
    )
    return result


def report(w: Workload, points: list[dict[str, Any]]) -> str:
    lines = [
        f"one broker (TLS and custody on); workload: {w.describe()}",
        f"{'filters':>8}  {'install s':>9}  {'notif/s':>8}  {'CPU us/notif':>12}  "
        f"{'capacity/core':>13}  {'RSS MiB before/filters/end':>26}  {'B/filter':>8}",
    ]
    for p in points:
        rss = p["rss_mb"]
        lines.append(
            f"{p['filters']:>8,}  {p['install_s']:>9.2f}  {p['notif_per_s']:>8,}  "
            f"{p['us_per_notification']:>12.2f}  {p['capacity_notif_per_s'] or 0:>13,}  "
            f"{rss['before']:>8.0f} / {rss['filters']:>6.0f} / {rss['end']:>6.0f}  "
            f"{p['bytes_per_filter']:>8,}"
        )
    if len(points) > 1:
        a, b = points[0], points[-1]
        lines.append(
            f"from {a['filters']:,} to {b['filters']:,} filters "
            f"({b['filters'] / a['filters']:g}x): CPU per notification "
            f"x{b['us_per_notification'] / max(1e-9, a['us_per_notification']):.2f}, "
            f"RSS x{b['rss_mb']['filters'] / max(1e-9, a['rss_mb']['filters']):.2f}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    parser.add_argument("--quick", action="store_true", help="a small run for tests")
    parser.add_argument(
        "--filters", help=f"comma-separated filter counts (default {FULL['filters']})"
    )
    parser.add_argument("--subscribers", type=int, help=f"default {FULL['subscribers']}")
    parser.add_argument(
        "--fanout", type=int, help=f"must divide --subscribers (default {FULL['fanout']})"
    )
    parser.add_argument("--rate", type=float, help=f"events/s (default {FULL['rate']:g})")
    parser.add_argument("--duration", type=float, help=f"seconds (default {DURATION['full']:g})")
    bench_plots.add_option(parser)
    parser.set_defaults(func=run_args)


def run_args(args: argparse.Namespace) -> int:
    base = QUICK if args.quick else FULL
    try:
        counts = [int(x) for x in str(args.filters or base["filters"]).split(",")]
        w = Workload(
            subscribers=int(args.subscribers or base["subscribers"]),
            fanout=int(args.fanout or base["fanout"]),
            rate=float(args.rate or base["rate"]),
            duration=float(args.duration or DURATION["quick" if args.quick else "full"]),
        )
        if w.fanout < 1 or w.subscribers % w.fanout or min(counts) < w.subscribers:
            raise ValueError(
                "--fanout must divide --subscribers, and every --filters count must be at "
                "least --subscribers"
            )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if bench_plots.refused(args.plot):
        return 2
    tune_gc()

    async def run() -> list[dict[str, Any]]:
        measured = []
        for n in counts:
            measured.append(await point(n, w))
            done(f"{n:,} filters")
        return measured

    with showing("bench broker", len(counts)):
        points = eventloop.run(run())
    print(report(w, points))
    if args.json:
        print(json.dumps({"workload": w.describe(), "points": points}))
    title = f"one broker (TLS and custody on); {w.describe()}"
    drawn = bench_plots.draw(args.plot, lambda path: bench_plots.broker_scale(points, title, path))
    short = [p["filters"] for p in points if p["delivered"] != p["expected"]]
    if short:
        print(f"error: notifications missing at {short} filters", file=sys.stderr)
        return 1
    return drawn
