"""``canopy pub`` and ``canopy sub``: the client library from the shell.

    canopy sub --broker 127.0.0.1:7400 'symbol = "ACME" and price < 10' --count 5 --json
    canopy pub --broker 127.0.0.1:7400 --count 100 --rate 50 'symbol=ACME price=5 urgent=true'
    canopy pub --broker 127.0.0.1:7400 '{"symbol": "ACME", "price": 5}'
    producer | canopy pub --broker 127.0.0.1:7400        # one event per stdin line
    canopy sub --broker 127.0.0.1:7400,127.0.0.1:7401 'n > 0'   # fail over to the second
    canopy sub --overlay .canopy/demo 'n > 0'            # any broker of `canopy up`'s overlay demo

When the broker a client is attached to is lost, the client fails over (to the dead broker's
neighbours first, then the other addresses given) and carries on; what could not be recovered
is reported on stderr as a gap. Each command exits 1 when no broker took over in time.

``add_pubsub_arguments`` registers both on the ``canopy`` command's subparsers (the operator
package owns that command; the implementations live here, next to the client library).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from canopy_broker.client import ClientError, Gap, connect
from canopy_broker.client.credentials import Credentials
from canopy_broker.core.events import Value
from canopy_broker.runtime import eventloop

_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?")


def parse_value(text: str) -> Value:
    """``5`` -> int, ``5.0`` -> float, ``true``/``false`` -> bool, quoted or other -> str."""
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    if text in ("true", "false"):
        return text == "true"
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def parse_event(words: Iterable[str]) -> dict[str, Value]:
    """``['a=1', 'b=x y']`` or ``['{"a": 1}']`` -> attributes; raises ValueError when unclear."""
    words = list(words)
    if len(words) == 1 and words[0].lstrip().startswith("{"):
        obj = json.loads(words[0])
        if not isinstance(obj, dict):
            raise ValueError("a JSON event must be an object")
        return obj
    attrs: dict[str, Value] = {}
    for word in words:
        for part in _split_pairs(word):
            name, sep, value = part.partition("=")
            if not sep or not name:
                raise ValueError(f"expected attr=value, got {part!r}")
            attrs[name] = parse_value(value)
    if not attrs:
        raise ValueError("an event needs at least one attribute")
    return attrs


def _split_pairs(word: str) -> Iterator[str]:
    """Split ``'a=1 b="x y"'`` on spaces outside quotes (one shell word may hold many pairs)."""
    yield from (m.group(0) for m in re.finditer(r'(?:[^\s"\']|"[^"]*"|\'[^\']*\')+', word))


def _report_gap(gap: Gap) -> None:
    print(f"canopy: gap: {gap}", file=sys.stderr, flush=True)


async def run_pub(
    broker: str | list[str],
    events: list[dict[str, Value]] | None,
    *,
    count: int = 1,
    rate: float | None = None,
    client_id: str | None = None,
    stdin: TextIO | None = None,
    out: TextIO = sys.stderr,
    failover_within: float = 5.0,
    ack_timeout: float = 10.0,
    credentials: Credentials | None = None,
) -> int:
    """Publish ``events`` ``count`` times each (or one event per line of ``stdin``), at ``rate``
    events per second if given, then wait until the overlay acknowledged all of them (so a
    broker lost right after the last publish loses nothing). Returns how many were published."""
    client = await connect(
        broker, client_id=client_id, failover_within=failover_within, credentials=credentials
    )
    async with client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        sent = 0
        for attrs in _event_source(events, count, stdin):
            if rate:
                delay = start + sent / rate - loop.time()
                if delay > 0:
                    await client.flush()
                    await asyncio.sleep(delay)
            await client.publish(attrs)
            sent += 1
        acked = await client.wait_acknowledged(ack_timeout)
        moved = f" (after {client.failovers} failover(s))" if client.failovers else ""
        print(
            f"published {sent} event(s) to {client.broker} as {client.client_id}{moved}"
            + ("" if acked else f"; {client.unacknowledged} not acknowledged yet"),
            file=out,
        )
        return sent


def _event_source(
    events: list[dict[str, Value]] | None, count: int, stdin: TextIO | None
) -> Iterator[dict[str, Value]]:
    if events:
        for _ in range(count):
            yield from events
        return
    for line in stdin or sys.stdin:
        if line.strip():
            yield parse_event([line.strip()])


async def run_sub(
    broker: str | list[str],
    filters: list[str],
    *,
    count: int | None = None,
    as_json: bool = False,
    client_id: str | None = None,
    out: TextIO = sys.stdout,
    failover_within: float = 5.0,
    credentials: Credentials | None = None,
) -> int:
    """Subscribe to ``filters`` and print notifications until ``count`` arrived (or forever).
    Failovers and gaps are told on stderr."""
    client = await connect(
        broker,
        client_id=client_id,
        failover_within=failover_within,
        on_gap=_report_gap,
        credentials=credentials,
    )
    async with client:
        for f in filters:
            await client.subscribe(f)
        print(f"subscribed on {client.broker} as {client.client_id}", file=sys.stderr, flush=True)
        seen = 0
        failovers = 0
        while count is None or seen < count:
            batch = await client.receive(1000 if count is None else count - seen)
            if client.failovers != failovers:
                failovers = client.failovers
                print(f"canopy: failed over to {client.broker}", file=sys.stderr, flush=True)
            if not batch:
                break
            for n in batch:
                if as_json:
                    line = json.dumps(n.to_json(), separators=(",", ":"))
                else:
                    line = f"{n.id} hops={n.hops} subs={','.join(n.sub_ids)} {json.dumps(n.attrs)}"
                print(line, file=out)
            out.flush()
            seen += len(batch)
        return seen


def _run(coro: Any) -> int:
    try:
        eventloop.run(coro)
    except (OSError, ValueError, ClientError) as exc:
        print(f"canopy: {exc}", file=sys.stderr)
        return 1
    return 0


def add_pubsub_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``pub`` and ``sub`` on a subparsers object; each sets ``func(args) -> int``."""
    p = sub.add_parser("pub", help="publish events to a broker")
    _add_broker_arguments(p)
    p.add_argument("--client-id", help="publisher id (default: the broker assigns one)")
    p.add_argument("--count", type=int, default=1, help="publish each event this many times")
    p.add_argument("--rate", type=float, help="events per second (default: as fast as possible)")
    p.add_argument(
        "event",
        nargs="*",
        help="attr=value pairs or one JSON object; none: one event per stdin line",
    )
    p.set_defaults(func=_pub_command)

    p.add_argument(
        "--ack-timeout",
        type=float,
        default=10.0,
        help="seconds to wait at the end for the overlay to acknowledge everything (default 10)",
    )
    s = sub.add_parser("sub", help="subscribe and print matching notifications")
    _add_broker_arguments(s)
    s.add_argument("--client-id", help="subscriber id (default: the broker assigns one)")
    s.add_argument("--count", type=int, help="exit after this many notifications")
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    s.add_argument("filter", nargs="+", help="filter text, e.g. 'price < 10 and symbol = \"X\"'")
    s.set_defaults(func=_sub_command)


def _add_broker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--broker",
        action="append",
        help="HOST:PORT of a broker; several (repeated, or comma-separated) are where to fail "
        "over to (default 127.0.0.1:7400)",
    )
    p.add_argument(
        "--overlay",
        metavar="STATE_DIR/NAME",
        help="use every broker of the local overlay NAME that `canopy up` started with this "
        "state directory (e.g. .canopy/trading)",
    )
    p.add_argument(
        "--failover-within",
        type=float,
        default=5.0,
        help="seconds to look for another broker when ours is lost (0: never; default 5)",
    )
    sec = p.add_argument_group(
        "credentials (default: --overlay's, else $CANOPY_CA/CERT/KEY/TOKEN or $CANOPY_PKI, "
        "else the only overlay under --state-dir)"
    )
    sec.add_argument(
        "--state-dir",
        type=Path,
        default=Path(".canopy"),
        help="where `canopy up` keeps its overlays (default .canopy)",
    )
    sec.add_argument("--ca", type=Path, help="the overlay's CA certificate (PEM)")
    sec.add_argument("--cert", type=Path, help="client certificate (PEM, canopy://client/NAME)")
    sec.add_argument("--key", type=Path, help="the client certificate's key (PEM)")
    sec.add_argument("--token", help="bearer token (with --ca; or $CANOPY_TOKEN)")
    sec.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext, no credentials (only brokers started with --insecure accept it)",
    )


def credentials_of(args: argparse.Namespace) -> Credentials:
    """The client's credentials from the flags (see :func:`_add_broker_arguments`)."""
    if args.insecure:
        print("canopy: INSECURE: plaintext, nothing authenticated or encrypted", file=sys.stderr)
        return Credentials()
    if args.ca or args.cert or args.key or args.token:
        if args.ca is None:
            raise ValueError("--cert, --key and --token need --ca (the overlay's CA)")
        if (args.cert is None) != (args.key is None):
            raise ValueError("--cert and --key go together")
        return Credentials(args.ca, args.cert, args.key, args.token)
    if args.overlay:
        pki = Path(args.overlay) / "pki"
        if pki.is_dir():
            return Credentials.from_pki(pki)
    env = Credentials.from_env()
    if env.secure or env.token:
        return env
    found = sorted(p.parent for p in Path(args.state_dir).glob("*/pki/ca.pem"))
    if len(found) == 1:
        return Credentials.from_pki(found[0])
    where = f"{len(found)} overlays" if found else "no overlay"
    raise ValueError(
        f"no credentials: {where} under {args.state_dir}; pass --overlay STATE_DIR/NAME, "
        "--ca with --cert/--key or --token, or --insecure"
    )


def brokers_of(args: argparse.Namespace) -> list[str]:
    """The addresses from ``--broker`` and ``--overlay`` (``canopy up``'s state file)."""
    addresses = [a for b in args.broker or () for a in b.split(",") if a.strip()]
    if args.overlay:
        state = Path(args.overlay) / "state.json"
        try:
            brokers = json.loads(state.read_text())["brokers"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read the overlay's brokers from {state}: {exc}") from None
        addresses += [str(b["listen"]) for b in brokers.values()]
    return addresses or ["127.0.0.1:7400"]


def _pub_command(args: argparse.Namespace) -> int:
    try:
        events = [parse_event(args.event)] if args.event else None
        brokers = brokers_of(args)
        credentials = credentials_of(args)
    except ValueError as exc:
        print(f"canopy pub: {exc}", file=sys.stderr)
        return 2
    return _run(
        run_pub(
            brokers,
            events,
            count=args.count,
            rate=args.rate,
            client_id=args.client_id,
            failover_within=args.failover_within,
            ack_timeout=args.ack_timeout,
            credentials=credentials,
        )
    )


def _sub_command(args: argparse.Namespace) -> int:
    try:
        brokers = brokers_of(args)
        credentials = credentials_of(args)
    except ValueError as exc:
        print(f"canopy sub: {exc}", file=sys.stderr)
        return 2
    return _run(
        run_sub(
            brokers,
            args.filter,
            count=args.count,
            as_json=args.json,
            client_id=args.client_id,
            failover_within=args.failover_within,
            credentials=credentials,
        )
    )
