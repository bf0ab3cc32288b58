"""Sweep the fault simulator over two neighbours dying together (the bridge of crash repair,
docs/architecture.md "Crash repair"): for each seed, a random tree, publishers and subscribers
on every broker, and the two ends of one of its links crashed together (or up to ``--apart``
units apart, detection taking 30). Prints each seed that loses, duplicates, reorders, leaves
the survivors in more than one tree, routes otherwise than the canonical tables, or raises.

Run from the repository's root: ``.venv/bin/python scripts/sim_pairs.py --seeds 0-399 --inner``.
``--strawman``: without the bridge (each side chains along its own dead broker's list alone),
which must fail.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.sim.test_repair import bridging, pair_crash, pair_verdict, strawman


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-99", help="e.g. 0-399")
    parser.add_argument("--apart", type=float, default=0.0, help="the second dies up to this later")
    parser.add_argument("--inner", action="store_true", help="both ends have other neighbours")
    parser.add_argument("--strawman", action="store_true", help="without the bridge")
    args = parser.parse_args(argv)
    lo, _, hi = args.seeds.partition("-")
    factory = strawman if args.strawman else bridging
    started, bad = time.perf_counter(), 0
    seeds = range(int(lo), int(hi or lo) + 1)
    for seed in seeds:
        try:
            sim, dead = pair_crash(seed, factory, inner=args.inner, stagger=args.apart)
            tree, report, problems = pair_verdict(sim, dead)
            ok = tree and report.ok and not problems
            found = {"seed": seed, "dead": sorted(dead), "one_tree": tree, "report": str(report)}
        except Exception as exc:  # a core ProtocolError is a finding
            ok, found = False, {"seed": seed, "error": f"{type(exc).__name__}: {exc}"}
        if not ok:
            bad += 1
            print(json.dumps(found))
    took = time.perf_counter() - started
    print(f"{bad} of {len(seeds)} seeds with a problem ({took:.1f} s)")
    return 1 if bad and not args.strawman else 0


if __name__ == "__main__":
    sys.exit(main())
