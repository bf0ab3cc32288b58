"""The `canopy` command: the user's entry point (demo, clients, simulator, benchmarks).

Subcommands import their modules lazily so that `canopy --help` and light commands start fast
and do not pull in aiohttp or the process machinery they don't use.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from canopy_operator import demo, localcmd, plancmd, simcmd

    parser = argparse.ArgumentParser(
        prog="canopy",
        description="Canopy: a content-based publish/subscribe overlay that reshapes itself live.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_arguments(sub)
    plancmd.add_arguments(sub)
    localcmd.add_arguments(sub)
    simcmd.add_arguments(sub)
    _add_broker_commands(sub)
    return parser


def _add_broker_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Client and benchmark commands that live with the broker package."""
    from canopy_broker import bench, clients_cli

    clients_cli.add_pubsub_arguments(sub)
    p = sub.add_parser("bench", help="benchmarks that print measured figures")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    dataplane = bench_sub.add_parser(
        "dataplane", help="throughput, latency, matching speed-up and memory of real brokers"
    )
    bench.add_arguments(dataplane)
    dataplane.set_defaults(
        func=lambda a: bench.main([*(["--json"] if a.json else []), "--duration", str(a.duration)])
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
