"""The executor's batches: one failed step cancels its siblings, waits for them, and leaves
progress that a second run resumes from without repeating a step; a step is retried against a
broker that does not answer, but not against one whose process or pod is gone."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from canopy_operator.executor import Executor, StepError, apart_since, resent_since
from canopy_operator.model.planner import Plan, Step


class Store:
    def __init__(self) -> None:
        self.saved: dict[str, Any] = {}

    async def save(self, progress: dict[str, Any]) -> None:
        self.saved = progress


class ScriptedExecutor(Executor):
    """Steps do what the test says instead of calling brokers."""

    fail_once: set[int]
    log: list[str]

    async def _do(self, generation: int, i: int, step: Step) -> dict[str, Any]:
        self.log.append(f"start {i}")
        try:
            if i in self.fail_once:
                self.fail_once.discard(i)
                await asyncio.sleep(0.01)
                raise StepError(i, step, "the broker refused")
            await asyncio.sleep(3600 if i == 1 else 0)  # loop time: looptime makes it free
        except asyncio.CancelledError:
            self.log.append(f"cancelled {i}")
            raise
        self.log.append(f"done {i}")
        return {}


def plan() -> Plan:
    steps = (
        Step("exchange", 0, remove=("a", "b"), add=("a", "c"), cycle=("a", "b", "c")),
        Step("exchange", 0, remove=("d", "e"), add=("d", "f"), cycle=("d", "e", "f")),
        Step("exchange", 1, remove=("a", "c"), add=("a", "d"), cycle=("a", "c", "d")),
    )
    return Plan(steps, ())


@pytest.mark.looptime
async def test_a_failed_step_cancels_its_siblings_and_a_rerun_resumes() -> None:
    store = Store()
    ex = ScriptedExecutor(backend=None, store=store, overlay="ov")  # type: ignore[arg-type]
    ex.fail_once, ex.log = {0}, []
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(StepError, match="the broker refused"):
        await ex.run(plan(), generation=3)
    assert loop.time() - t0 == pytest.approx(0.01)  # the sibling was cancelled, not waited for
    assert ex.log == ["start 0", "start 1", "cancelled 1"]  # batch 1 never started
    assert store.saved == {}  # nothing completed
    await ex.run(plan(), generation=3, progress=store.saved)
    assert ex.log[3:] == ["start 0", "start 1", "done 0", "done 1", "start 2", "done 2"]
    assert store.saved["completed"] == [0, 1, 2]
    ex.log.clear()
    await ex.run(plan(), generation=3, progress=store.saved)
    assert ex.log == []  # a finished plan runs nothing again


def test_a_join_tells_from_the_oldest_publication_sent_again_while_apart() -> None:
    """A publisher whose broker died sends what it had not had acknowledged again at the next
    broker; during a split that reaches one part only. Published before the split began, it
    was outside the gap the other part was told (chaos soak: 1-6 events lost untold per
    subscriber): the gap reaches back to it. A resend before the split reached both parts."""
    statuses: dict[str, dict[str, Any]] = {
        "b1": {"resent": {"p": [95.5, 101.0]}},  # came at 101, while apart since 100
        "b2": {"resent": {"q": [80.0, 90.0]}},  # before the split: everyone had it
        "b3": {},
    }
    assert resent_since(statuses, 100.0) == 95.5
    assert resent_since(statuses, 102.0) is None
    assert resent_since({"b3": {}}, 0.0) is None


def test_a_join_tells_the_stretch_from_when_the_first_broker_fell_silent() -> None:
    """Where a split's stretch starts: the earliest time one of the sides last heard a
    neighbour it then declared dead and has not told a gap for since, whoever it was (a live
    process of the other side, a broker dead or restarted since, one in a part not joined);
    and a fence lifted by an earlier try of the join, for a broker of the sides."""
    alive = {"b1": "i1", "b2": "i2", "b3": "i3"}
    statuses = {
        "b1": {"fenced": {"b3": "i3"}, "fenced_since": {"b3": 110.0}},
        "b2": {"fenced": {"b3": "restarted"}, "fenced_since": {"b3": 107.0}},
        "b3": {"fenced": {"b1": "i1"}, "fenced_since": {"b1": 105.5}},
    }
    assert apart_since(statuses, alive) == 105.5
    assert apart_since({"b2": statuses["b2"]}, alive) == 107.0
    dead = {"b1": {"fenced": {"b9": "i9"}, "fenced_since": {"b9": 90.0}}}
    assert apart_since({**statuses, **dead}, alive) == 90.0
    assert apart_since({"b1": {}}, alive) is None
    lifted = {"b1": {"lifted_since": {"b3": 100.5, "b8": 10.0}}}  # b8: not one of the sides
    assert apart_since({**statuses, **lifted}, alive) == 100.5


class _Unreachable:
    """An admin client whose broker does not answer."""

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            raise aiohttp.ClientConnectionError("connection refused")

        return call


class _Backend:
    """Brokers that do not answer; ``dead`` ones have no process any more."""

    def __init__(self, dead: set[str]) -> None:
        self.dead = dead
        self.deleted: list[str] = []

    def admin(self, name: str) -> _Unreachable:
        return _Unreachable()

    def link_address(self, name: str) -> str:
        return f"{name}:1"

    address = link_address

    async def gone(self, name: str) -> bool:
        return name in self.dead

    async def delete_broker(self, name: str) -> None:
        self.deleted.append(name)


EXCHANGE = Plan(
    (Step("exchange", 0, remove=("a", "b"), add=("a", "c"), cycle=("a", "b", "c")),), ()
)


@pytest.mark.looptime
@pytest.mark.parametrize(("dead", "within"), [(set(), 60.0), ({"b"}, 0.0), ({"z"}, 60.0)])
async def test_a_step_is_not_retried_against_a_broker_whose_process_is_gone(
    dead: set[str], within: float
) -> None:
    """A broker that does not answer is retried for ``retry_for`` (it may be paused or
    restarting); one whose process is gone fails the step at once, so the supervisor plans
    again (bringing it back) instead of holding the overlay's lock for a minute. A dead broker
    the step does not touch (``z``) changes nothing."""
    ex = Executor(backend=_Backend(dead), store=Store(), overlay="ov")  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(StepError, match="is gone" if within == 0 else "unreachable"):
        await ex.run(EXCHANGE, generation=1)
    assert loop.time() - t0 == pytest.approx(within, abs=6.0)


@pytest.mark.looptime
async def test_a_dead_leaf_is_removed_without_draining_it() -> None:
    backend = _Backend({"c"})
    ex = Executor(backend=backend, store=Store(), overlay="ov")  # type: ignore[arg-type]
    leaf = Plan((Step("remove-leaf", 0, broker="c", remove=("a", "c")),), ())
    await ex.run(leaf, generation=1)
    assert backend.deleted == ["c"]


class _LeafAdmin:
    """The new leaf's admin API: its link to the anchor never comes up (``created``: by this
    call; ``hang``: the call never returns)."""

    def __init__(self, calls: list[str], created: bool, hang: bool) -> None:
        self.calls, self.created, self.hang = calls, created, hang

    async def add_link(self, peer: str, address: str) -> dict[str, Any]:
        self.calls.append(f"add {peer}")
        if self.hang:
            await asyncio.sleep(3600)
        return {"up": False, "created": self.created}

    async def remove_link(self, peer: str) -> bool:
        self.calls.append(f"remove {peer}")
        return True


class _LeafBackend(_Backend):
    def __init__(self, dead: set[str], created: bool = True, hang: bool = False) -> None:
        super().__init__(dead)
        self.calls: list[str] = []
        self.created, self.hang = created, hang

    def admin(self, name: str) -> Any:
        return _LeafAdmin(self.calls, self.created, self.hang) if name == "x" else _Unreachable()

    async def create_broker(self, name: str) -> None:
        self.calls.append(f"create {name}")

    async def wait_ready(self, name: str, within: float) -> None:
        pass


@pytest.mark.looptime
async def test_a_leaf_whose_link_did_not_come_up_is_not_left_dialling() -> None:
    """The anchor died while its new leaf dialled it: the step fails, and the leaf's link
    to it goes first. Left in place, the leaf dialled on; when the supervisor brought the
    anchor back at its address, the old link came up beside the one the next plan gave the
    leaf, and closed a cycle (chaos seed 28: 12,355 duplicates, the restore stuck)."""
    backend = _LeafBackend({"b"})
    ex = Executor(backend=backend, store=Store(), overlay="ov")  # type: ignore[arg-type]
    leaf = Plan((Step("add-leaf", 0, broker="x", add=("b", "x")),), ())
    with pytest.raises(StepError, match="is gone"):
        await ex.run(leaf, generation=1)
    assert backend.calls == ["create x", "add b", "remove b"]
    # A link this try did not create (the step run again, the leaf attached before and its
    # anchor out of reach for a moment) stays: removing it would split the overlay.
    again = _LeafBackend({"b"}, created=False)
    ex = Executor(backend=again, store=Store(), overlay="ov")  # type: ignore[arg-type]
    with pytest.raises(StepError, match="is gone"):
        await ex.run(leaf, generation=1)
    assert again.calls == ["create x", "add b"]


@pytest.mark.looptime
async def test_a_cancelled_add_leaf_does_not_leave_its_link_dialling() -> None:
    """A sibling step failed while the leaf dialled (an anchor's death fails those too): the
    plan is given up, and the leaf's link goes with it."""
    backend = _LeafBackend(set(), hang=True)
    ex = Executor(backend=backend, store=Store(), overlay="ov")  # type: ignore[arg-type]
    leaf = Plan((Step("add-leaf", 0, broker="x", add=("b", "x")),), ())
    run = asyncio.create_task(ex.run(leaf, generation=1))
    await asyncio.sleep(1)
    assert backend.calls == ["create x", "add b"]
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert backend.calls == ["create x", "add b", "remove b"]


class _DrainAdmin:
    """A leaf ``c`` with clients, and its neighbour ``a``, which holds clients (it has just
    been started) for the first ``held`` status calls."""

    def __init__(self, name: str, calls: list[str], held: list[int]) -> None:
        self.name, self.calls, self.held = name, calls, held

    async def status(self) -> dict[str, Any]:
        self.calls.append(f"status {self.name}")
        self.held[0] -= 1
        return {"clients_held": "not linked yet" if self.held[0] >= 0 else None}

    async def set_peers(self, book: dict[str, str]) -> None:
        pass

    async def drain(self, target: str, address: str, *, wait: float) -> dict[str, Any]:
        self.calls.append(f"drain {self.name} to {target}")
        return {"drained": True}

    async def remove_link(self, peer: str) -> bool:
        return True


class _DrainBackend(_Backend):
    def __init__(self, held: int) -> None:
        super().__init__(set())
        self.calls: list[str] = []
        self.held = [held]

    def admin(self, name: str) -> Any:
        return _DrainAdmin(name, self.calls, self.held)


@pytest.mark.looptime
@pytest.mark.parametrize("held", [0, 3])
async def test_a_leaf_is_drained_only_to_a_neighbour_that_takes_clients(held: int) -> None:
    """``a`` was just brought back (a restore, or a replacement): it turns clients away until
    its first link has been up a heartbeat. The leaf's clients are moved to it only then; sent
    before, they were refused and came back on their own retries (`canopy demo`: 5.15 s)."""
    backend = _DrainBackend(held)
    ex = Executor(backend=backend, store=Store(), overlay="ov")  # type: ignore[arg-type]
    leaf = Plan((Step("remove-leaf", 0, broker="c", remove=("a", "c")),), ())
    await ex.run(leaf, generation=1)
    assert backend.calls == [*["status a"] * (held + 1), "drain c to a"]
    assert backend.deleted == ["c"]
