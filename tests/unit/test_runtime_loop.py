"""The broker's hold on its event loop: one frame-handling budget per turn for all
connections, and the watch that measures stalls (and keeps bulk growth out of the collector).

Real time on purpose (no looptime): what is measured is how long the loop is held.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from canopy_broker.runtime.framing import FrameProtocol, TurnBudget, frame
from canopy_broker.runtime.metrics import BrokerMetrics, Gauges, LoopWatch


def _gauges() -> Gauges:
    return Gauges(0, 0, False, {}, {}, 0, 0)


async def _until(cond: Callable[[], bool], within: float) -> bool:
    """Poll ``cond`` for at most ``within`` seconds (a late tick on a loaded machine)."""
    deadline = time.perf_counter() + within
    while not cond() and time.perf_counter() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.002)
    return cond()


class Transport(asyncio.Transport):
    """Open, reading or paused; writes nothing."""

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Busy(FrameProtocol):
    """Every frame costs 1 ms of CPU."""

    def __init__(self, budget: TurnBudget) -> None:
        super().__init__()
        self.work_budget = budget
        self.handled = 0
        self.transport = Transport()

    def frame_received(self, frame: list[Any]) -> list[Any] | None:
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        self.handled += 1
        return None


async def test_one_budget_per_turn_for_all_connections() -> None:
    """Two connections with 100 frames each, woken in the same turn: together they hold the
    loop for about one budget (10 ms), each handling at least one frame; the rest waits for the
    next turns, and everything is handled in the end, in order."""
    budget = TurnBudget(0.01)
    conns = [Busy(budget), Busy(budget)]
    for c in conns:
        c.pending.extend([[6, []]] * 100)
    t0 = time.perf_counter()
    for c in conns:
        c._work()
    first_turn = time.perf_counter() - t0
    assert all(c.handled >= 1 for c in conns)
    # Per connection, a budget each, this would be ~20 frames (and 20 ms).
    assert sum(c.handled for c in conns) <= 13, [c.handled for c in conns]
    assert first_turn < 0.015
    for _ in range(1000):
        if not any(c.pending for c in conns):
            break
        await asyncio.sleep(0)
    assert [c.handled for c in conns] == [100, 100]


async def test_the_budget_starts_again_each_turn() -> None:
    loop = asyncio.get_running_loop()
    budget = TurnBudget(5.0)
    first = budget.deadline(loop)
    assert budget.deadline(loop) == first  # the same turn: the same deadline
    await asyncio.sleep(0)
    assert budget.deadline(loop) > first


async def test_loop_watch_tells_a_busy_loop_from_a_starved_one() -> None:
    """A callback that holds the loop on CPU is a stall with CPU; one that holds it waiting
    (as a process does when the machine has no core for it) is a stall without."""
    loop = asyncio.get_running_loop()
    watch = LoopWatch(BrokerMetrics(_gauges))
    watch.start(loop)
    try:
        await asyncio.sleep(0.03)
        time.sleep(0.06)  # noqa: ASYNC251 - held on purpose, not on CPU
        await asyncio.sleep(0.03)
        end = time.perf_counter() + 0.06
        while time.perf_counter() < end:  # held, on CPU
            pass
        await asyncio.sleep(0.03)
    finally:
        watch.stop()
    loops = [(lag, cpu) for _, kind, lag, cpu in watch.stalls if kind == "loop"]
    assert len(loops) >= 2, watch.stalls
    assert any(lag >= 0.05 and cpu < 0.02 for lag, cpu in loops), loops
    assert any(lag >= 0.05 and cpu >= 0.04 for lag, cpu in loops), loops
    assert watch.lag_max >= 0.05
    assert watch.status()["stalls"]
    assert watch._gc not in gc.callbacks


async def test_a_resting_watch_ticks_rarely_and_wakes_for_work() -> None:
    """While its owner may rest the watch is due every ``resting_interval``; :meth:`wake`
    brings the next tick within ``interval``, so a stall right after it is measured in full,
    and the watch rests again at the first tick that finds its owner idle."""
    loop = asyncio.get_running_loop()
    idle = [False]
    watch = LoopWatch(
        BrokerMetrics(_gauges), interval=0.01, resting_interval=0.5, may_rest=lambda: idle[0]
    )
    ticks: list[float] = []
    tick = watch._tick

    def counted() -> None:
        ticks.append(loop.time())
        tick()

    watch._tick = counted  # type: ignore[method-assign]
    watch.start(loop)
    try:
        await asyncio.sleep(0.1)
        assert len(ticks) >= 5 and not watch.resting  # awake: every 10 ms
        idle[0] = True
        # The next tick that is not itself late finds it idle: the next one in 0.5 s.
        assert await _until(lambda: watch.resting, 0.1)
        assert watch.rests == 1
        resting_from = len(ticks)
        await asyncio.sleep(0.3)
        assert len(ticks) == resting_from, "ticked while resting"
        watch.wake()  # work, and the owner is still idle (a heartbeat, say)
        time.sleep(0.06)  # noqa: ASYNC251 - the work holds the loop
        assert await _until(lambda: len(ticks) > resting_from, 0.1), "the wake did not bring a tick"
        assert await _until(lambda: watch.resting, 0.1)  # idle still: resting again (< 0.5 s)
        assert watch.rests == 2
    finally:
        watch.stop()
    loops = [lag for _, kind, lag, _ in watch.stalls if kind == "loop"]
    assert loops and max(loops) >= 0.045, watch.stalls


async def test_a_stall_on_cpu_while_resting_is_the_brokers_own() -> None:
    """Work that starts without a wake is measured at the resting grain, and what it spent on
    CPU is counted as CPU: a resting period's length is not CPU the idle broker could use."""
    loop = asyncio.get_running_loop()
    watch = LoopWatch(
        BrokerMetrics(_gauges), interval=0.01, resting_interval=0.25, may_rest=lambda: True
    )
    watch.start(loop)
    try:
        assert await _until(lambda: watch.resting, 0.2)
        armed = watch._armed
        while watch._armed == armed:  # noqa: ASYNC110 - just after a tick: 250 ms to the next
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:  # held, on CPU, from a timer or a task: no wake
            pass
        await asyncio.sleep(0.02)
    finally:
        watch.stop()
    # The longest loop stall is this one (a descheduled process may add short ones).
    lag, busy = max((lag, cpu) for _, kind, lag, cpu in watch.stalls if kind == "loop")
    assert lag >= 0.1, watch.stalls  # ran until 0.4 s, due at 0.25 s
    assert busy >= 0.8 * lag, watch.stalls  # on CPU: the broker's, not the machine's


async def test_loop_watch_freezes_after_growth_only() -> None:
    """The routing table grows by ``freeze_every``: what is left after a young collection is
    frozen (out of every later scan). Shrinking and small growth freeze nothing."""
    size = [0]
    watch = LoopWatch(BrokerMetrics(_gauges), size=lambda: size[0], freeze_every=100)
    watch.start(asyncio.get_running_loop())
    frozen_before = gc.get_freeze_count()
    try:
        size[0] = 99
        await asyncio.sleep(0.03)
        assert watch.freezes == 0
        size[0] = 150
        await asyncio.sleep(0.03)
        assert watch.freezes == 1 and gc.get_freeze_count() >= frozen_before
        size[0] = 20  # unsubscribed: growth counts from here
        await asyncio.sleep(0.03)
        size[0] = 110
        await asyncio.sleep(0.03)
        assert watch.freezes == 1
        size[0] = 120
        await asyncio.sleep(0.03)
        assert watch.freezes == 2
    finally:
        watch.stop()
        gc.unfreeze()  # the test process's objects go back to the collector


async def test_a_freeze_is_not_taken_for_a_stall_of_the_next_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The young collection before a freeze runs inside a tick: it is a collection (timed as
    such by the gc callbacks), and the next tick is due an interval after it, not before."""
    collect = gc.collect

    def slow(generation: int = 2) -> int:
        time.sleep(0.1)  # a collection of a large young generation, waiting on memory
        return collect(generation)

    size = [0]
    watch = LoopWatch(BrokerMetrics(_gauges), size=lambda: size[0], freeze_every=100)
    monkeypatch.setattr(gc, "collect", slow)
    watch.start(asyncio.get_running_loop())
    try:
        size[0] = 150
        await asyncio.sleep(0.2)
        assert watch.freezes == 1
    finally:
        watch.stop()
        gc.unfreeze()
    # Taken for the next tick's lag, the collection would be a stall of ~0.09 s; a busy
    # machine's own delays are shorter than half of that.
    assert not [s for s in watch.stalls if s[1] == "loop" and s[2] >= 0.05], watch.stalls


async def test_loop_watch_thaws_once_the_table_stops_growing() -> None:
    """Frozen objects go back to the collector ``thaw_after`` seconds after the last freeze, so
    cycles that died meanwhile (closed connections) are freed; growth postpones it."""
    size = [0]
    watch = LoopWatch(
        BrokerMetrics(_gauges), size=lambda: size[0], freeze_every=100, thaw_after=0.1
    )
    watch.start(asyncio.get_running_loop())
    try:
        size[0] = 100
        await asyncio.sleep(0.05)
        assert watch.freezes == 1 and watch.thaws == 0 and gc.get_freeze_count() > 0
        size[0] = 200  # still growing: frozen again, the thaw waits
        await asyncio.sleep(0.05)
        assert watch.freezes == 2 and watch.thaws == 0
        await asyncio.sleep(0.15)
        assert watch.thaws == 1 and gc.get_freeze_count() == 0
        assert watch.status()["gc_thaws"] == 1
        await asyncio.sleep(0.15)
        assert watch.thaws == 1  # nothing frozen since: nothing to thaw
    finally:
        watch.stop()
        gc.unfreeze()


class Collecting(FrameProtocol):
    """Records the frames it handles; the budget is spent before the first one."""

    def __init__(self) -> None:
        super().__init__()
        self.work_budget = TurnBudget(0.0)
        self.handled: list[list[Any]] = []
        self.handled_at_end = -1

    def frame_received(self, frame: list[Any]) -> list[Any] | None:
        self.handled.append(frame)
        return None

    def connection_ended(self, exc: Exception | None) -> None:
        self.handled_at_end = len(self.handled)
        super().connection_ended(exc)


class TlsTransport(Transport):
    """What a TLS transport does at the peer's close_notify: the protocol hears of the end
    (eof_received) even while its reading is paused, since the record came with the data."""

    def __init__(self, protocol: FrameProtocol) -> None:
        super().__init__()
        self.protocol = protocol
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return object() if name == "sslcontext" else default

    def write(self, data: Any) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def abort(self) -> None:
        self.close()

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)


def _tls_conn() -> Collecting:
    conn = Collecting()
    conn.connection_made(TlsTransport(conn))
    return conn


async def test_what_the_peer_sent_before_closing_is_handled_not_dropped() -> None:
    """A publisher's last frames, then its clean close (TLS: the close_notify arrives with
    them), while this end is busy (each turn's budget spent after one frame): every frame is
    handled, in order, before the loss is reported. (They used to be dropped once the
    transport was closing: a CI run lost half of a publisher's last 300 events so.)"""
    conn = _tls_conn()
    frames = [[6, [i]] for i in range(200)]
    conn.data_received(b"".join(frame(orjson.dumps(f)) for f in frames))
    assert 0 < len(conn.handled) < 200  # the rest is put off to later turns...
    conn.eof_received()  # ...and then the peer's end is read
    await asyncio.wait_for(asyncio.shield(conn.lost), 5)
    assert conn.handled == frames
    assert conn.handled_at_end == 200  # the loss is reported once they are handled


async def test_what_this_end_closed_on_is_not_handled() -> None:
    """Closing (or failing) a connection here ends it: frames read but not handled yet are
    dropped (a peer sent garbage, or was refused), not handled after the fact."""
    conn = _tls_conn()
    conn.data_received(b"".join(frame(orjson.dumps([6, [i]])) for i in range(200)))
    conn.close()
    await asyncio.wait_for(asyncio.shield(conn.lost), 5)
    assert 0 < len(conn.handled) < 200
    assert conn.handled_at_end == len(conn.handled)


async def test_held_frames_are_never_handled_after_the_loss_is_reported() -> None:
    """Frames held (a hello waiting for a withdrawal) when the peer goes are dropped with the
    connection: a release after the loss must not hand them to a session already cleaned up."""
    conn = _tls_conn()
    conn.hold("waiting", [6, ["hello"]])
    conn.data_received(frame(orjson.dumps([6, ["publish"]])))
    conn.connection_lost(None)
    assert conn.lost.done() and conn.handled_at_end == 0
    conn.release("waiting")
    for _ in range(3):
        await asyncio.sleep(0)
    assert conn.handled == []


async def test_after_a_reset_what_was_put_off_is_dropped() -> None:
    """A connection that failed (reset): its client sends what was not acknowledged again
    through its next broker, so handling the put-off rest here too would only race with that."""
    conn = _tls_conn()
    conn.data_received(b"".join(frame(orjson.dumps([6, [i]])) for i in range(200)))
    handled = len(conn.handled)
    conn.connection_lost(ConnectionResetError())
    assert conn.lost.done() and conn.handled_at_end == handled
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(conn.handled) == handled < 200
