"""``canopy bench mining``: the Spark job's wall time on synthetic telemetry of a given size.

The telemetry is generated first (by Spark, cached under ``--data-dir`` so repeated runs measure
the job, not the generator) as the brokers write it, JSON lines; with ``--format parquet`` (the
default) it is compacted to Parquet once, as ``canopy mine --compact`` does with closed hours
(cached beside it, timed as ``compact_s``). Then the whole job runs as ``canopy mine`` would:
read and classify the records, associativity of every broker pair, distances, candidates,
replay, ranking. ``wall_s`` is that job; the session start, the generation and the compaction
are reported apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import yaml

from canopy_operator.mining import synth
from canopy_operator.mining.job import Settings, describe, mine
from canopy_operator.mining.session import spark_session
from canopy_operator.mining.source import PARQUET_DIR, compact_telemetry
from canopy_operator.model.topology import parse_overlay


def run(args: argparse.Namespace) -> int:
    def say(msg: str) -> None:
        print(f"[bench mining] {msg}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    spark = spark_session(args.master, app="canopy-bench-mining", driver_memory=args.driver_memory)
    session_s = time.perf_counter() - started
    say(f"Spark {spark.version} on {args.master} in {session_s:.1f} s")

    data = args.data_dir / f"n{args.brokers}-r{args.rows}-s{args.seed}"
    marker = data / "overlay.yaml"
    generate_s = 0.0
    if not marker.exists():
        say(f"generating ~{args.rows:,} records for {args.brokers} brokers into {data}")
        t = time.perf_counter()
        made = synth.generate(spark, data, args.brokers, args.rows, seed=args.seed)
        generate_s = time.perf_counter() - t
        marker.write_text(yaml.safe_dump(made.manifest, sort_keys=False))
        say(
            f"generated in {generate_s:.1f} s ({made.routes:,} routes, "
            f"{made.mean_route:.1f} brokers per event)"
        )
    else:
        say(f"reusing {data}")
    manifest = yaml.safe_load(marker.read_text())
    spec = parse_overlay(manifest)
    assert spec.links is not None
    compact_s = 0.0
    source = data
    if args.format == "parquet":
        source = data.with_name(data.name + "-parquet")
        if not (source / PARQUET_DIR).is_dir():
            say(f"compacting the JSON lines into Parquet under {source}")
            t = time.perf_counter()
            files = compact_telemetry(spark, data, into=source, everything=True)
            compact_s = time.perf_counter() - t
            say(f"compacted {files} files in {compact_s:.1f} s")
        else:
            say(f"reusing {source}")

    t = time.perf_counter()
    result = mine(spark, source, spec, spec.links, Settings(), progress=say)
    wall = time.perf_counter() - t
    for line in describe(result):
        print(line)
    rows = result.records
    figures: dict[str, Any] = {
        "rows": rows,
        "brokers": args.brokers,
        "wall_s": round(wall, 2),
        "rows_per_s": round(rows / wall) if wall else 0,
        "master": args.master,
        "session_s": round(session_s, 2),
        "generate_s": round(generate_s, 2),
        "format": args.format,
        "compact_s": round(compact_s, 2),
        "stages_s": {k: round(v, 2) for k, v in result.timings.items()},
        "pairs": result.pairs,
        "proposals": len(result.chosen),
    }
    print(
        f"mined {rows:,} rows ({args.format}) of {args.brokers} brokers in {wall:.1f} s "
        f"({figures['rows_per_s']:,} rows/s) on {args.master}; stages "
        + ", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items())
    )
    if args.json:
        print(json.dumps(figures))
    return 0
