"""Background tasks: a task that dies is noticed, named and reported; stopping leaves none."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import pytest

from canopy_broker.admin_client import AdminClient
from canopy_broker.client import connect
from canopy_broker.core.errors import CoreFailedError
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import ClientSubscribe, Input
from canopy_broker.runtime.tasks import TaskSet
from tests.tools import LoopTurns
from tests.unit.test_runtime_admin import Serve, serve
from tests.unit.test_runtime_broker import MakeBroker, make_broker

__all__ = ["make_broker", "serve"]  # fixtures, re-exported for pytest


@pytest.mark.looptime
async def test_a_failed_task_is_logged_by_name_and_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failures: list[tuple[str, str]] = []
    tasks = TaskSet("b1", on_failure=lambda name, why: failures.append((name, why)))

    async def boom() -> None:
        raise RuntimeError("heartbeat broke")

    async def quits() -> None:
        return None

    async def runs() -> None:
        await asyncio.sleep(3600)

    with caplog.at_level(logging.ERROR, logger="canopy.tasks"):
        tasks.spawn(boom(), "ticker")
        tasks.spawn(quits(), "dialer", forever=True)
        tasks.spawn(quits(), "one-shot")
        sleeper = tasks.spawn(runs(), "sleeper", forever=True)
        await asyncio.sleep(0.01)
    assert failures == [
        ("b1: ticker", "failed: RuntimeError: heartbeat broke"),
        ("b1: dialer", "ended, but it should run as long as its owner"),
    ]
    assert "'b1: ticker' failed" in caplog.text and "heartbeat broke" in caplog.text
    assert len(tasks) == 1
    await tasks.stop()
    assert sleeper.cancelled() and len(tasks) == 0 and len(failures) == 2


async def test_a_broker_whose_core_fails_reports_unhealthy(
    make_broker: MakeBroker, serve: Serve
) -> None:
    b = await make_broker("b")
    admin: AdminClient = await serve(b)
    assert await admin.healthz() and await admin.readyz()

    def broken(inp: Input, now: float = 0.0) -> list[object]:
        if isinstance(inp, ClientSubscribe):
            raise CoreFailedError("b: KeyError: 'x' (handling ClientSubscribe)")
        return real(inp, now)  # type: ignore[return-value]

    real = b.core.handle
    b.core.handle = broken  # type: ignore[method-assign]
    client = await connect(b.advertised)
    with pytest.raises(Exception):  # noqa: B017 - the connection is closed on it
        await asyncio.wait_for(client.subscribe(Filter.parse("x = 1")), 5)
    await client.close()
    assert b.failed is not None and "KeyError" in b.failed
    assert not await admin.healthz() and not await admin.readyz()


async def test_a_long_frame_is_handled_over_several_loop_turns(make_broker: MakeBroker) -> None:
    """5,000 subscriptions in one frame: the broker hands the loop back between slices (other
    callbacks run in between), and every subscription is still taken, in order."""
    b = await make_broker("b")
    slices: list[int] = []
    handle = b.client_sessions.messages

    def counting(client: Any, items: list[Any], deadline: float = math.inf) -> list[Any] | None:
        rest = handle(client, items, min(deadline, time.perf_counter() + 0.002))
        slices.append(len(items) - len(rest or ()))
        return rest

    b.client_sessions.messages = counting  # type: ignore[method-assign]
    async with LoopTurns() as ticks, await connect(b.advertised) as c:
        await asyncio.gather(*(c.subscribe(f"k = {i}", f"s{i}") for i in range(5000)))
        subs = b.core.routing.subscriptions(c.client_id)
        assert subs is not None and list(subs) == [f"s{i}" for i in range(5000)]
    assert sum(slices) == 5000 and len(slices) > 3, slices
    assert ticks.count > len(slices)
