"""Large notifications through a chain of three brokers: how much memory each broker takes.

A publisher on b1 sends ``--count`` notifications of ``--size`` bytes as fast as it can; a
subscriber on b3 takes them all. The script prints how long that took, how many arrived, and
each broker's peak RSS (sampled every 0.1 s) and RSS at the end. What bounds it: the link
and client queues count bytes (``--queue-bytes``) and custody does (``--retention-bytes``);
docs/broker.md, "Backpressure", has the figures.

    .venv/bin/python scripts/large_notifications.py --count 300 --size 2000000 [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from canopy_broker.client import connect
from canopy_broker.procs import Overlay, rss_mb

BROKERS = ("b1", "b2", "b3")


async def run(count: int, size: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="canopy-large-"))
    async with Overlay(list(BROKERS), [("b1", "b2"), ("b2", "b3")], log_dir=work) as ov:
        sub = await connect(ov["b3"].listen, "sub", credentials=ov.credentials)
        await sub.subscribe("n >= 0")
        await ov.settle()
        got = 0

        async def drain() -> None:
            nonlocal got
            while batch := await sub.receive(1000):
                got += len(batch)

        peak = dict.fromkeys(BROKERS, 0.0)

        async def watch() -> None:
            while True:
                for b in BROKERS:
                    peak[b] = max(peak[b], rss_mb(ov[b].pid))
                await asyncio.sleep(0.1)

        tasks = [asyncio.create_task(drain()), asyncio.create_task(watch())]
        pub = await connect(ov["b1"].listen, "pub", credentials=ov.credentials)
        blob = "x" * size
        start = time.monotonic()
        for n in range(count):
            await pub.publish({"n": n, "blob": blob})
        await pub.wait_acknowledged(120.0)
        while got < count and time.monotonic() - start < 120.0:  # noqa: ASYNC110 - drain fills it
            await asyncio.sleep(0.1)
        took = time.monotonic() - start
        end = {b: rss_mb(ov[b].pid) for b in BROKERS}
        for task in tasks:
            task.cancel()
        await pub.close()
        await sub.close()
    return {
        "count": count,
        "size": size,
        "delivered": got,
        "seconds": round(took, 2),
        "peak_rss_mb": {b: round(v) for b, v in peak.items()},
        "end_rss_mb": {b: round(v) for b, v in end.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--size", type=int, default=2_000_000, help="bytes of each notification")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    r = asyncio.run(run(args.count, args.size))
    print(
        f"{r['delivered']}/{r['count']} notifications of {r['size']:,} bytes delivered in "
        f"{r['seconds']} s; peak RSS {r['peak_rss_mb']} MB, at the end {r['end_rss_mb']} MB"
    )
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
