"""``canopy bench chaos``: its judgement trips on each thing it must count (its zeros mean
something), and a short run of real processes under kills comes out clean."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

from canopy_broker.client import Gap
from canopy_operator.commands.bench_chaos import Chaos, Counts, judge, verdict
from tests.cli.test_commands import canopy, last_json


def wants_even(attrs: Any) -> bool:
    return bool(attrs["n"] % 2 == 0)


BOOK = {seq: (float(seq), {"n": seq}) for seq in range(1, 13)}  # published at t = seq


def test_the_judgement_counts_each_kind_of_fault() -> None:
    exact = judge(BOOK, [2, 4, 6, 8, 10, 12], wants_even, [])
    assert (exact.expected, exact.got, exact.hard) == (6, 6, False)
    bad = judge(BOOK, [2, 6, 4, 4, 3, 99], wants_even, [])
    assert (bad.duplicated, bad.reordered, bad.spurious) == (1, 2, 2)  # 3: odd; 99: never
    assert bad.lost_untold == 3 and bad.untold_at == [8.0, 10.0, 12.0] and bad.hard


def test_a_loss_inside_a_gap_is_told_and_one_at_its_edge_is_told_with_slack() -> None:
    gap = Gap(since=7.5, until=9.2, reason="split", broker="b1", previous="b0")
    c = judge(BOOK, [2, 4, 6, 12], wants_even, [gap])
    assert (c.lost_told, c.lost_told_slack, c.lost_untold) == (1, 1, 0)  # 8 in, 10 within 1 s
    assert c.told == 2 and not c.hard


def test_what_no_broker_acknowledged_or_came_after_giving_up_is_not_owed() -> None:
    c = judge(BOOK, [2, 4, 6], wants_even, [], gave_up_at=10.5, unacknowledged=[8])
    assert c.expected == 5 and c.lost_after_giving_up == 2 and c.lost_untold == 0  # 10, 12


def test_the_verdict_names_the_worst_outcome() -> None:
    def sub(failed: bool, **counts: int) -> dict[str, Any]:
        return {"failed": failed, "counts": Counts(**counts)}

    assert verdict({"a": sub(False), "b": sub(True, lost_told=5)}, False) == "CLEAN"
    assert verdict({"a": sub(False, lost_told=1)}, False) == "TOLD-LOSS-AT-NONFAILED"
    assert verdict({"a": sub(True, lost_untold=1)}, True) == "HARD+STUCK"
    assert verdict({"a": sub(False, duplicated=1)}, False) == "HARD"


def test_bad_arguments_are_refused_with_the_reason() -> None:
    result = canopy("bench", "chaos", "--kinds", "kill,meteor", "--publishers", "9", "--rate", "0")
    assert result.returncode == 2 and "unknown fault kind(s) ['meteor']" in result.stderr
    assert "--publishers must be between 1 and --brokers" in result.stderr
    assert "--rate must be above 0" in result.stderr


def test_a_short_run_under_kills_is_clean() -> None:
    """Five brokers with their supervisor, two publishers and four subscribers; a broker
    SIGKILLed every 3-4 s for 8 s. Everything is owed to the subscribers whose broker nothing
    happened to; the others are told what they may lack."""
    result = canopy(
        "bench",
        "chaos",
        *("--seed", "5", "--brokers", "5", "--duration", "8", "--kinds", "kill"),
        *("--gap-min", "3", "--gap-max", "4", "--publishers", "2", "--subscribers", "4"),
        *("--rate", "200", "--json"),
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data: dict[str, Any] = last_json(result.stdout)
    assert data["verdict"] == "CLEAN", result.stdout
    assert re.fullmatch(r"\d\d:\d\d:\d\d,\d{3}", data["started"])  # as the logs write time
    assert data["faults"]["kill"] >= 2 and data["settled"]["settled"] is True
    assert all(n > 500 for n in data["published"].values())
    for sub in data["subscribers"].values():
        counts = sub["counts"]
        assert counts["lost_untold"] == counts["duplicated"] == counts["reordered"] == 0
        assert counts["expected"] > 100
        # Whose notifications it lacked, apart: they add up to the totals.
        apart = [p["counts"] for p in sub["by_publisher"].values()]
        assert set(sub["by_publisher"]) <= set(data["published"])
        for key in ("lost_told", "lost_told_slack", "lost_after_giving_up"):
            assert sum(c[key] for c in apart) == counts[key], (key, sub)
    assert "VERDICT CLEAN" in result.stdout


def test_the_result_names_whose_notifications_a_subscriber_lacked() -> None:
    """``by_publisher`` keeps each publisher's counts apart (only those with something to
    say), adding up to the subscriber's totals: a HARD run's losses name their publisher."""
    books = {"p0": {s: (float(s), {"n": s, "sym": "X", "price": 1}) for s in range(1, 13)}}
    books["p1"] = dict(books["p0"])
    chaos = SimpleNamespace(
        pubs={"p0": SimpleNamespace(client_id="c0"), "p1": SimpleNamespace(client_id="c1")},
        subs={"s0": SimpleNamespace(failovers=0)},
        received={"s0": [("c0", s) for s in range(1, 13)] + [("c1", s) for s in range(1, 9)]},
        sub_filter={"s0": 0},
        books=books,
        gaps={"s0": []},
        gave_up_at={},
        home={"s0": "b0"},
        on_failed={},
        t0=0.0,
    )
    out = Chaos.judged(chaos, {"p0": [], "p1": []})  # type: ignore[arg-type]
    s0 = out["s0"]
    assert s0["counts"].lost_untold == 4
    assert set(s0["by_publisher"]) == {"p1"}  # p0's stream was exact
    assert s0["by_publisher"]["p1"]["counts"].lost_untold == 4
    assert s0["by_publisher"]["p1"]["untold_at"] == [9.0, 10.0, 11.0, 12.0]
