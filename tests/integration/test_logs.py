"""Structured logs (--log-format json): every line of a broker process is one JSON object with
its overlay and broker, and the lines about a link exchange carry the exchange's id, the same id
the operator's lines about that plan step carry (canopy_broker.logs.log_context)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from canopy_broker import logs
from canopy_broker.logs import log_context
from canopy_broker.procs import spawn_broker


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """The root logger configured as a process would be, into a buffer; put back afterwards
    (pytest's own handlers included)."""
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    out = io.StringIO()
    logs.configure("INFO", "json", overlay="trading", broker=None)
    root.handlers[0].setStream(out)  # type: ignore[attr-defined]
    try:
        yield out
    finally:
        root.handlers[:] = saved
        root.setLevel(level)


def parsed(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_context_and_extra_fields_go_on_each_line(json_lines: io.StringIO) -> None:
    log = logging.getLogger("canopy.test")
    log.info("outside")
    with log_context(step=2, reconfiguration="trading-g3-s2"):
        log.warning("inside %s", "a step", extra={"peer": "b1"})
        with log_context(step=3):
            log.info("nested")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    outside, inside, nested, failed = parsed(json_lines)
    assert outside["msg"] == "outside" and outside["overlay"] == "trading"
    assert "broker" not in outside and "step" not in outside  # nothing invented
    keys = ("level", "logger", "msg", "step", "reconfiguration", "peer")
    assert {k: inside[k] for k in keys} == {
        "level": "WARNING",
        "logger": "canopy.test",
        "msg": "inside a step",
        "step": 2,
        "reconfiguration": "trading-g3-s2",
        "peer": "b1",
    }
    assert str(inside["ts"]).endswith("+00:00")  # ISO 8601, UTC
    assert nested["step"] == 3 and nested["reconfiguration"] == "trading-g3-s2"
    assert "RuntimeError: boom" in str(failed["exc_info"]) and "step" not in failed


def test_an_unknown_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="log format must be one of text, json, got 'xml'"):
        logs.formatter("xml")


@pytest.mark.integration
async def test_a_broker_process_logs_json_with_its_identity_and_exchange_ids(
    tmp_path: Path,
) -> None:
    args = ("--log-format", "json", "--overlay", "trading")
    a, b, c = [await spawn_broker(n, log_dir=tmp_path, extra_args=args) for n in ("a", "b", "c")]
    try:
        book = {p.name: p.link_address for p in (a, b, c)}
        for x in (a, b, c):
            await x.admin.set_peers(book)
        assert (await a.admin.add_link("b", b.link_address))["up"]
        assert (await b.admin.add_link("c", c.link_address))["up"]
        rec = await a.admin.start_exchange(
            ["a", "b", "c"], ("b", "c"), xid="trading-g1-s1", wait=20.0
        )
        assert rec["state"] == "finished", rec
    finally:
        for x in (a, b, c):
            await x.stop()
    lines = {
        p.name: [json.loads(line) for line in (tmp_path / f"{p.name}.log").read_text().splitlines()]
        for p in (a, b, c)
    }
    for name, got in lines.items():
        assert got and all(r["broker"] == name and r["overlay"] == "trading" for r in got)
        assert {"ts", "level", "logger", "msg"} <= set(got[0])
    about = [r for r in lines["a"] if r.get("reconfiguration") == "trading-g1-s1"]
    assert [r.get("outcome") for r in about] == [None, "finished"], about
    assert "started: remove b-c, cycle a-b-c" in str(about[0]["msg"])
