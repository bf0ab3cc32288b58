"""The demo's verified delivery report, per subscriber and in total."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from canopy_broker.sim.checker import (
    DeliveryReport,
    PubRecord,
    SubRecord,
)
from canopy_operator.commands.demo.traffic import Subscriber


def summarise(
    args: argparse.Namespace,
    *,
    seed: int,
    subscribers: list[Subscriber],
    pubs: list[PubRecord],
    report: DeliveryReport,
    publish_wall: float,
    entries: int,
    subs: list[SubRecord],
) -> dict[str, Any]:
    owed_by: Counter[str] = Counter(c for c, _, _ in report.lost)
    print()
    print(
        f"{'subscriber':<10} {'broker':<6} {'owed':>6} {'got':>6} {'lost':>5} {'dup':>4} "
        f"{'reord':>5}  filter"
    )
    for s in subscribers:
        owed = sum(1 for p in pubs if any(f.matches(p.attrs) for f in s.filters.values()))
        dup = sum(1 for c, _, _ in report.duplicated if c == s.name)
        reord = sum(1 for c, _, _ in report.reordered if c == s.name)
        print(
            f"{s.name:<10} {s.broker:<6} {owed:>6} {len(s.received):>6} "
            f"{owed_by[s.name]:>5} {dup:>4} {reord:>5}  "
            + " | ".join(str(f) for f in s.filters.values())
        )
    hops: Counter[int] = sum((s.hops for s in subscribers), Counter())
    delivered = sum(hops.values())
    mean_hops = sum(h * c for h, c in hops.items()) / delivered if delivered else 0.0
    print()
    print(
        f"published {len(pubs)} notifications in {publish_wall:.1f}s "
        f"({len(pubs) / publish_wall:.0f}/s); delivered {delivered}; "
        f"mean overlay hops per delivery {mean_hops:.2f}; {entries} routing entries"
    )
    print(f"verified: {report}")
    gaps = [(s.name, g) for s in subscribers if s.client is not None for g in s.client.gaps]
    for name, g in gaps:  # what a client was told it cannot get (none expected in the demo)
        print(f"gap reported to {name}: {g.reason} ({g.since} .. {g.until})")
    return {
        "ok": report.ok and report.owed > 0,
        "seed": seed,
        "brokers": args.brokers,
        "routing": args.routing,
        "published": len(pubs),
        "publish_rate": round(len(pubs) / publish_wall, 1),
        "mean_hops": round(mean_hops, 3),
        "routing_entries": entries,
        "subscriptions": len(subs),
        "gaps": len(gaps),
        **report.summary(),
    }
