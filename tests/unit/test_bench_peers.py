"""``canopy bench peers``'s arithmetic over rounds (the runs themselves: tests/cli)."""

from __future__ import annotations

import math
import time
from typing import Any

import orjson

from canopy_broker.bench import Sink
from canopy_broker.bench_peers import (
    LATENCY_SAMPLE,
    Numbered,
    Workload,
    delivered_all,
    paired_ratio,
    received_payload,
    report,
    summary,
)


def _round(us: float, user: float, delivered: int = 10) -> dict[str, Any]:
    return {
        "us_per_notification": us,
        "user_us": user,
        "system_us": round(us - user, 3),
        "delivered": delivered,
        "expected": 10,
        "notif_per_s": int(us * 100),
    }


def test_one_round_is_its_own_summary() -> None:
    only = _round(5.0, 2.0)
    assert summary([only]) is only


def test_the_summary_is_the_median_round_whole_not_a_mix_of_rounds() -> None:
    rounds = [_round(9.0, 1.0), _round(5.0, 2.0), _round(6.0, 4.0, delivered=9)]
    s = summary(rounds)
    # the median round by CPU per notification is the 6.0 one: its user and system parts go
    # with it (the median of the user parts alone would be 2.0, which no round had with 6.0)
    assert (s["us_per_notification"], s["user_us"], s["system_us"]) == (6.0, 4.0, 2.0)
    assert (s["delivered"], s["expected"]) == (29, 30)  # a lost one in any round shows
    assert s["rounds"] == rounds
    # an even count takes the lower of the two middle rounds
    assert summary(rounds[:2])["us_per_notification"] == 5.0


def test_ratios_pair_the_rounds_so_a_drifting_machine_cancels_out() -> None:
    # The machine slows down 2x from round to round; canopy is 0.9x nats in every round.
    nats = [_round(4.0, 1.0), _round(8.0, 2.0), _round(16.0, 4.0)]
    canopy = [_round(3.6, 1.0), _round(7.2, 2.0), _round(14.4, 4.0)]
    r = {"canopy": summary(canopy), "nats": summary(nats)}
    assert math.isclose(paired_ratio(r, "canopy", "nats"), 0.9)
    # Rounds whose medians fall in different rounds: nats's median round is the third (8.0),
    # canopy's the first (9.0), so medians alone say 1.125x; per round canopy was 2.25x, 0.75x
    # and 0.875x nats, and the pairing reports the middle one of those.
    r = {
        "canopy": summary([_round(9.0, 1.0), _round(12.0, 1.0), _round(7.0, 1.0)]),
        "nats": summary([_round(4.0, 1.0), _round(16.0, 1.0), _round(8.0, 1.0)]),
    }
    assert r["canopy"]["us_per_notification"] / r["nats"]["us_per_notification"] == 1.125
    assert math.isclose(paired_ratio(r, "canopy", "nats"), 0.875)
    assert math.isnan(paired_ratio(r, "canopy", "mosquitto"))  # not measured
    single = {"canopy": _round(6.0, 3.0), "nats": _round(4.0, 1.0)}
    assert paired_ratio(single, "canopy", "nats") == 1.5


def test_a_loss_in_one_round_is_not_hidden_by_a_duplicate_in_another() -> None:
    rounds = [_round(5.0, 2.0, delivered=11), _round(6.0, 2.0, delivered=9), _round(7.0, 2.0)]
    s = summary(rounds)
    assert s["delivered"] == s["expected"] == 30  # the sums agree...
    assert not delivered_all(s)  # ...the rounds do not
    assert delivered_all(summary([_round(5.0, 2.0), _round(6.0, 2.0)]))
    assert not delivered_all(_round(5.0, 2.0, delivered=9))  # a single run


def test_the_table_shows_no_ratio_to_a_system_not_run_and_names_canopy_s_settings() -> None:
    w = Workload(50, 10, 5000.0, 8.0, canopy_flags=("--client-write-interval-ms", "2"))
    canopy = {**_round(6.0, 3.0), "p50_ms": 0.5, "p99_ms": 2.25}
    table = report(w, {"canopy": canopy, "mosquitto": _round(5.0, 1.0)})
    assert "with --client-write-interval-ms 2" in table.splitlines()[0]
    canopy_row = next(line for line in table.splitlines() if line.startswith("canopy"))
    assert "nan" not in table
    assert canopy_row.split()[5:7] == ["-", "1.20x"]  # x NATS: not run; x Mosquitto: 6 / 5
    assert canopy_row.endswith("0.50 / 2.25")
    assert next(line for line in table.splitlines() if line.startswith("mosquitto")).endswith("-")


def test_a_peer_s_notification_is_counted_and_its_latency_taken_from_its_stamp() -> None:
    sink = Sink()
    numbered = Numbered(groups=5)
    group, payload = numbered.payload()
    assert group == 0 and orjson.loads(payload)["n"] == 0
    received_payload(sink, payload)  # not recording yet: counted only
    assert (sink.count, sink.latencies_ns) == (1, [])
    sink.record_latency = True
    for _ in range(LATENCY_SAMPLE * 3 - 1):
        _, payload = numbered.payload()
        received_payload(sink, payload)
    stamp = orjson.loads(payload)["ts"]  # the last one's, the third sampled
    assert sink.count == LATENCY_SAMPLE * 3
    assert len(sink.latencies_ns) == 3  # one in LATENCY_SAMPLE: the others are not parsed
    assert 0 <= sink.latencies_ns[-1] <= time.monotonic_ns() - stamp
