"""``canopy bench dataplane``'s probe of this machine's wake-ups, on real processes."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from canopy_broker.bench import LagWatch, wakeup_probe


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


async def test_the_lag_watch_sees_the_loop_blocked_and_nothing_when_it_is_not() -> None:
    """The benchmark's own loop lag, reported beside each latency: a loop blocked 80 ms is
    seen as a lag of about that; one left alone shows far less."""
    with LagWatch() as quiet:
        await asyncio.sleep(0.1)
    assert quiet.lags and quiet.longest < 0.05, quiet.lags
    with LagWatch() as blocked:
        await asyncio.sleep(0.02)
        time.sleep(0.08)  # noqa: ASYNC251 - what a burst of notifications does to this process
        await asyncio.sleep(0.02)
    assert blocked.over(0.07) == 1 and blocked.longest < 0.5, blocked.lags
