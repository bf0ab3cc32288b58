"""``canopy bench dataplane``'s probe of this machine's wake-ups, on real processes."""

from __future__ import annotations

import os

import pytest

from canopy_broker.bench import wakeup_probe


def test_the_probe_measures_round_trips_to_another_process_and_an_idle_wake_up() -> None:
    before = os.sched_getaffinity(0)
    probe = wakeup_probe(round_trips=200, sleeps=5)
    assert os.sched_getaffinity(0) == before  # held on one core only while it measured
    assert probe["cpus"] == len(before)
    # A round trip is two wake-ups and four system calls: more than a microsecond, and far
    # less than the second a lost byte would take to notice.
    assert probe["round_trip_us"] is not None and 1 < probe["round_trip_us"] < 100_000
    assert probe["idle_wakeup_cpu_us"] is not None and probe["idle_wakeup_cpu_us"] > 0
    if len(before) > 1:
        same = probe["same_core_round_trip_us"]
        assert same is not None and 1 < same < 100_000
    else:
        assert probe["same_core_round_trip_us"] is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to leave one")
def test_on_one_cpu_there_is_no_second_core_to_compare_with() -> None:
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        probe = wakeup_probe(round_trips=50, sleeps=2)
    finally:
        os.sched_setaffinity(0, before)
    assert probe["cpus"] == 1
    assert probe["same_core_round_trip_us"] is None
