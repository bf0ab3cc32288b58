"""Idle sockets against a real broker's TLS port: what they cost it, and how many it closes.

A stranger opens many TCP connections to the client port and never starts a TLS handshake.
Each costs the broker a handshake's state until it is closed (docs/broker.md, "Limits on
what a connection may cost"). This script starts one broker (TLS, its own CA, listening on
every address), opens ``--sockets`` connections to it from this host's first non-loopback
address (the broker does not count its own loopback), and prints the broker's RSS before,
with them open, and after they close, and how many the broker closed within a second.

    .venv/bin/python scripts/handshake_flood.py --sockets 4000 [--json]

Needs a file-descriptor limit above ``--sockets`` (``ulimit -n``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
from pathlib import Path

from canopy_broker.pki import LocalPki
from canopy_broker.procs import rss_mb, spawn_broker


def outside_address() -> str:
    """This host's address towards the outside: the source of a connection to it is then not
    loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # nothing is sent: UDP picks the route's address
        return str(probe.getsockname()[0])


async def closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 0.001) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def flood(sockets: int) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="canopy-flood-"))
    pki = LocalPki(work / "pki").ensure()
    broker = await spawn_broker("flooded", pki=pki, host="0.0.0.0", log_dir=work)
    try:
        address = outside_address()
        port = int(broker.listen.rsplit(":", 1)[1])
        await asyncio.sleep(1.0)
        before = rss_mb(broker.pid)
        opened = [await asyncio.open_connection(address, port) for _ in range(sockets)]
        await asyncio.sleep(1.0)
        with_them = rss_mb(broker.pid)
        refused = sum([await closed(reader) for reader, _ in opened])
        for _, writer in opened:
            writer.close()
        await asyncio.sleep(12.0)  # the heap trim's interval, and a tick
        after = rss_mb(broker.pid)
    finally:
        await broker.stop()
    return {
        "sockets": sockets,
        "closed_within_1s": refused,
        "rss_mb_before": before,
        "rss_mb_with_them": with_them,
        "rss_mb_after": after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sockets", type=int, default=4000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(flood(args.sockets))
    print(
        f"{result['sockets']} idle sockets from one address: {result['closed_within_1s']} closed "
        f"by the broker within 1 s; broker RSS {result['rss_mb_before']:.0f} MB before, "
        f"{result['rss_mb_with_them']:.0f} MB with them open, {result['rss_mb_after']:.0f} MB "
        "after they closed"
    )
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
