"""`canopy demo`: a local overlay reshaped live under traffic, with a verified delivery report.

The operator's own planner and executor start broker processes on 127.0.0.1 in a random tree
(fan-out ≤ 3); subscribers with content filters attach to different brokers; once their
subscriptions have settled everywhere, publishers stream notifications throughout. Midway, the
overlay is moved to a new tree that takes at least five link exchanges, with one broker added and
one removed (its subscribers and a publisher migrate to its neighbour). Every delivery is judged by
the simulator's checker: each subscriber must receive exactly the notifications its filters match
(computed centrally, not by the brokers), once each, in every publisher's order. Before/after
pictures are written; the exit code says whether everything held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from canopy_operator.commands.demo.phases import demo

__all__ = ["add_arguments", "demo", "run"]


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo", help="local brokers, live traffic, verified delivery report (no cluster needed)"
    )
    p.add_argument("--brokers", type=int, default=10, help="broker processes (default 10)")
    p.add_argument("--subscribers", type=int, default=12)
    p.add_argument("--publishers", type=int, default=3)
    p.add_argument(
        "--duration",
        type=float,
        default=4.0,
        help="seconds of traffic around the reshaping (half before, half after)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("canopy-demo"),
        help="directory for the before/after pictures",
    )
    p.add_argument("--rate", type=int, default=3000, help="notifications/s, all publishers")
    p.add_argument("--routing", choices=["simple", "identity", "covering"], default="covering")
    p.add_argument("--seed", type=int, default=None, help="topology and workload seed")
    p.add_argument(
        "--no-mining",
        dest="mining",
        action="store_false",
        help="skip the self-organisation phase (Spark mining of the demo's telemetry)",
    )
    p.add_argument(
        "--self-organize",
        action="store_true",
        help="apply the best mined proposal live and measure hops before and after",
    )
    p.add_argument(
        "--no-crash",
        dest="crash",
        action="store_false",
        help="skip the faults phase (an inner broker without clients SIGKILLed under traffic, "
        "repaired and restored; two brokers with clients replaced one at a time)",
    )
    p.add_argument("--spark-master", default="local[2]", help="Spark master for the mining")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(demo(args))
    if args.json:
        print(json.dumps(result))
    if not result["ok"]:
        print("DEMO FAILED: deliveries did not match what the filters owe", file=sys.stderr)
        return 1
    return 0
