"""``canopy pub`` / ``canopy sub`` helpers against an in-process broker."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
from pathlib import Path

import pytest

from canopy_broker.clients_cli import (
    add_pubsub_arguments,
    brokers_of,
    parse_event,
    run_pub,
    run_sub,
)
from tests.unit.test_runtime_broker import MakeBroker, addr, eventually, make_broker

__all__ = ["make_broker"]


def test_parse_event_forms() -> None:
    assert parse_event(["symbol=ACME", "price=5", "ratio=0.5", "ok=true", "note='a b'"]) == {
        "symbol": "ACME",
        "price": 5,
        "ratio": 0.5,
        "ok": True,
        "note": "a b",
    }
    assert parse_event(['a=1 b="x y" c=-2e3']) == {"a": 1, "b": "x y", "c": -2000.0}
    assert parse_event(['{"a": 1, "b": false}']) == {"a": 1, "b": False}
    for bad in (["novalue"], ["=1"], [], ["[1]"]):
        with pytest.raises(ValueError):
            parse_event(bad)


def test_commands_register_on_a_subparser(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_pubsub_arguments(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["pub", "--broker", "h:1", "--rate", "5", "a=1"])
    assert (brokers_of(args), args.rate, args.event, args.count) == (["h:1"], 5.0, ["a=1"], 1)
    args = parser.parse_args(["sub", "x > 1", "--count", "3", "--json"])
    assert (args.filter, args.count, args.json) == (["x > 1"], 3, True)
    assert (brokers_of(args), args.failover_within) == (["127.0.0.1:7400"], 5.0)

    # Several brokers to fail over to: repeated, comma-separated, or `canopy up`'s overlay.
    state = {"brokers": {"b0": {"listen": "h:7"}, "b1": {"listen": "h:8"}}}
    (tmp_path / "state.json").write_text(json.dumps(state))
    argv = ["sub", "--broker", "h:1", "--broker", "h:2,h:3", "--overlay", str(tmp_path), "true"]
    assert brokers_of(parser.parse_args(argv)) == ["h:1", "h:2", "h:3", "h:7", "h:8"]
    with pytest.raises(ValueError, match=r"cannot read the overlay's brokers from .*state.json"):
        brokers_of(parser.parse_args(["sub", "--overlay", str(tmp_path / "none"), "true"]))


async def test_pub_and_sub_end_to_end(make_broker: MakeBroker) -> None:
    b = await make_broker("b")
    out = io.StringIO()
    sub = asyncio.create_task(run_sub(addr(b), ["price < 10"], count=2, as_json=True, out=out))
    await eventually(lambda: any(b.core.routing_table().clients.values()))
    log = io.StringIO()
    sent = await run_pub(
        addr(b), [{"price": 5}, {"price": 50}], count=2, rate=200.0, client_id="cli", out=log
    )
    assert sent == 4 and "published 4 event(s) to b as cli" in log.getvalue()
    assert await sub == 2
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [(x["id"], x["attrs"], x["sub_ids"]) for x in lines] == [
        ("cli:1", {"price": 5}, ["s1"]),
        ("cli:3", {"price": 5}, ["s1"]),
    ]


async def test_pub_reads_events_from_stdin(make_broker: MakeBroker) -> None:
    b = await make_broker("b")
    out = io.StringIO()
    sub = asyncio.create_task(run_sub(addr(b), ["true"], count=2, out=out))
    await eventually(lambda: any(b.core.routing_table().clients.values()))
    stdin = io.StringIO('a=1\n\n{"b": "two"}\n')
    assert await run_pub(addr(b), None, stdin=stdin, client_id="p", out=io.StringIO()) == 2
    assert await sub == 2
    first, second = out.getvalue().splitlines()
    assert first.startswith("p:1 hops=0 subs=s1 ") and first.endswith('{"a": 1}')
    assert second.endswith('{"b": "two"}')
