"""``canopy bench day2``'s delivery verdict trips on what it must count (its zeros mean
something), and the command itself delivers everything on a small overlay."""

from __future__ import annotations

import json
from typing import Any

from canopy_broker.client import Notification
from canopy_operator.commands.bench_day2 import Traffic
from tests.cli.test_commands import canopy, last_json


def notes(*seqs: int) -> list[Notification]:
    return [Notification("p", seq, 1, {"n": seq}, ("all",)) for seq in seqs]


async def test_the_verdict_counts_losses_duplicates_and_reorderings() -> None:
    t = Traffic(None, 1.0)  # type: ignore[arg-type]
    t.received = {
        "exact": notes(1, 2, 3, 4, 5),
        "lost": notes(1, 2, 4, 5),
        "doubled": notes(1, 2, 2, 3, 4, 5),
        "swapped": notes(1, 3, 2, 4, 5),
    }
    assert await t.verdict({}, 1, 5) == {"lost": 1, "duplicated": 1, "reordered": 1}
    t.received = {"exact": notes(1, 2, 3, 4, 5)}
    assert await t.verdict({}, 1, 5) == {"lost": 0, "duplicated": 0, "reordered": 0}
    # Only what came after the mark, within first..last, counts.
    assert await t.verdict({"exact": 2}, 3, 5) == {"lost": 0, "duplicated": 0, "reordered": 0}


def test_bench_day2_restores_and_rolls_losing_nothing() -> None:
    result = canopy("bench", "day2", "--brokers", "4", "--rate", "300", "--json", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data: dict[str, Any] = last_json(result.stdout)
    assert data["ok"] is True and data["brokers"] == 4
    for name in ("crash", "roll"):
        r = data[name]
        assert (r["lost"], r["duplicated"], r["reordered"]) == (0, 0, 0), json.dumps(r)
        assert r["published"] > 100 and r["subscribers"] == 3 and r["seconds"] > 0
    assert data["crash"]["repaired_s"] < data["crash"]["seconds"]
