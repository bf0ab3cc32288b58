"""`canopy plan CURRENT.yaml DESIRED.yaml [--json]`: what the operator would do, without doing it.

CURRENT describes the running overlay (its ``spec.links`` are the live tree); DESIRED is the
manifest to move to. Both are BrokerOverlay manifests, as for ``kubectl apply``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

from canopy_operator.model.planner import LiveOverlay, plan
from canopy_operator.model.topology import OverlaySpec, SpecError, parse_overlay, validate


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="print the steps that move CURRENT to DESIRED (dry run)")
    p.add_argument("current", type=Path, help="BrokerOverlay manifest of the running overlay")
    p.add_argument("desired", type=Path, help="BrokerOverlay manifest to move to")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    p.set_defaults(func=run)


def load_overlay(path: Path) -> OverlaySpec:
    """Read and validate one manifest; raise SpecError with every problem, naming the file."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError(f"{path}: cannot read YAML: {exc}") from None
    overlays = [d for d in docs if isinstance(d, dict) and d.get("kind") == "BrokerOverlay"]
    if len(overlays) != 1:
        raise SpecError(f"{path}: expected one BrokerOverlay, found {len(overlays)}")
    try:
        spec = parse_overlay(overlays[0])
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None
    problems = validate(spec)
    if problems:
        raise SpecError(f"{path}: invalid BrokerOverlay:\n  - " + "\n  - ".join(problems))
    return spec


def run(args: argparse.Namespace) -> int:
    try:
        current = load_overlay(args.current)
        desired = load_overlay(args.desired)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if current.links is None:
        print(f"error: {args.current}: the running overlay's links must be listed", file=sys.stderr)
        return 2
    t = time.perf_counter()
    p = plan(LiveOverlay(tuple(current.broker_names), current.links), desired)
    wall = time.perf_counter() - t
    for note in p.notes:
        print(f"note: {note}")
    for i, step in enumerate(p.steps, 1):
        print(f"{i:>3}. [batch {step.batch}] {step.describe(full_cycle=True)}")
    n_ex = len(p.exchanges)
    batches = 1 + max((s.batch for s in p.steps), default=-1)
    print(
        f"{len(p.steps)} steps ({n_ex} exchanges) in {batches} batches; "
        f"planned in {wall * 1000:.1f} ms"
    )
    if args.json:
        print(json.dumps({"steps": p.to_json()["steps"]}))
    return 0
