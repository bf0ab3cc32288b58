"""Sweep the fault simulator with deaths allowed on a running exchange's path.

The suite's fault planner spares the brokers of an unfinished exchange's path (see
``canopy_broker.sim.faults``): a death there, in some windows, still loses or splits
(docs/reconfiguration.md, "What is left"). This script lifts that rule and counts, seed by
seed, what goes wrong, so that the remaining windows can be measured and, once closed, the rule
lifted in the suite. Each failing seed is printed with its faults and its problems, to be
replayed alone (``--seeds 30``).

    .venv/bin/python scripts/sim_on_paths.py --seeds 0-79 [--json]

Exit code 0 whatever it finds: it measures, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from canopy_broker.sim.faults import DEATHS, Activity, run_with_faults


def seeds(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def one(seed: int) -> dict[str, object]:
    try:
        run = run_with_faults(
            seed, kinds=DEATHS, activities=[Activity.EXCHANGE], rounds=5, on_paths=True
        )
    except Exception as exc:  # a core ProtocolError is a finding, not a crash of the sweep
        return {"seed": seed, "error": f"{type(exc).__name__}: {exc}"}
    r = run.report.survivors
    problems = [p for p in run.problems if "did not finish well" not in p]
    return {
        "seed": seed,
        "lost": len(r.lost),
        "duplicated": len(r.duplicated),
        "reordered": len(r.reordered),
        "problems": problems,
        "faults": [f"{f.kind.name.lower()} {'/'.join(f.victim)} at {f.at:.0f}" for f in run.faults],
        "on_path": sum(any(d.startswith("exchange") for d in f.during) for f in run.faults),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-79", help="e.g. 0-79 or 2,6,30")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    args = parser.parse_args(argv)
    todo = seeds(args.seeds)
    bad: list[dict[str, object]] = []
    started = time.monotonic()
    for i, seed in enumerate(todo, 1):
        res = one(seed)
        wrong = "error" in res or res["lost"] or res["duplicated"] or res["reordered"]
        if wrong or res.get("problems"):
            bad.append(res)
            print(json.dumps(res), flush=True)
        print(f"\r[{i}/{len(todo)}] {len(bad)} with a problem", end="", file=sys.stderr)
    print(file=sys.stderr)
    summary = {
        "seeds": len(todo),
        "with_a_problem": len(bad),
        "errors": sum("error" in b for b in bad),
        "lost": sum(int(str(b.get("lost", 0))) > 0 for b in bad),
        "duplicated": sum(int(str(b.get("duplicated", 0))) > 0 for b in bad),
        "seconds": round(time.monotonic() - started, 1),
    }
    print(
        f"{summary['with_a_problem']} of {summary['seeds']} seeds with a problem: "
        f"{summary['lost']} lost, {summary['duplicated']} duplicated, "
        f"{summary['errors']} raised ({summary['seconds']} s)"
    )
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
