"""Leader election against an in-memory Lease store that checks resourceVersion as the API
server does: who gets the Lease, when it counts as expired (on the candidate's clock), that a
race has one winner, and that a leader who cannot renew stops."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from canopy_operator.backends import leader
from canopy_operator.backends.leader import (
    Elector,
    LeaseConfig,
    LostLeadershipError,
    run_as_leader,
)

PATH = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/op"


class Store:
    """Lease objects with resourceVersion conflicts (409 as False), like the API server."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.down = False

    async def get(self, path: str) -> dict[str, Any] | None:
        if self.down:
            raise OSError("API server unreachable")
        obj = self.objects.get(path)
        return copy.deepcopy(obj) if obj else None

    async def create(self, path: str, body: dict[str, Any]) -> bool:
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            return False
        return self._put(full, body)

    async def update(self, path: str, body: dict[str, Any]) -> bool:
        if self.down:
            raise OSError("API server unreachable")
        have = self.objects.get(path)
        if (
            have is None
            or body["metadata"].get("resourceVersion") != (have["metadata"]["resourceVersion"])
        ):
            return False
        return self._put(path, body)

    def _put(self, path: str, body: dict[str, Any]) -> bool:
        self.version += 1
        obj = copy.deepcopy(body)
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.objects[path] = obj
        return True

    def holder(self) -> Any:
        return self.objects[PATH]["spec"]["holderIdentity"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(leader.time, "monotonic", c)
    return c


def elector(store: Store, who: str, duration: float = 10.0) -> Elector:
    return Elector(store, LeaseConfig("ns", "op", who, duration))  # type: ignore[arg-type]


async def test_the_first_takes_it_and_a_second_waits_until_it_is_stale(clock: Clock) -> None:
    store = Store()
    a, b = elector(store, "a"), elector(store, "b")
    assert await a.try_acquire() and store.holder() == "a"
    assert not await b.try_acquire()  # held, and renewed as far as b has seen
    clock.now += 9.0
    assert not await b.try_acquire()  # not yet a whole duration without a change
    assert await a.try_acquire()  # a renews: b's count starts again
    clock.now += 9.0
    assert not await b.try_acquire()
    clock.now += 10.5  # a fell silent for longer than the duration, on b's clock
    assert await b.try_acquire() and store.holder() == "b"
    assert store.objects[PATH]["spec"]["leaseTransitions"] == 1


async def test_two_racing_for_a_stale_lease_have_one_winner(clock: Clock) -> None:
    store = Store()
    assert await elector(store, "old").try_acquire()
    b, c = elector(store, "b"), elector(store, "c")
    assert not await b.try_acquire() and not await c.try_acquire()
    clock.now += 11.0
    # Both read the same version; the API server takes the first write only.
    lease = await store.get(PATH)
    body_b, body_c = b._body(lease, 1), c._body(lease, 1)
    assert await store.update(PATH, body_b)
    assert not await store.update(PATH, body_c)
    assert store.holder() == "b"


async def test_a_released_lease_is_taken_at_once(clock: Clock) -> None:
    store = Store()
    a, b = elector(store, "a"), elector(store, "b")
    assert await a.try_acquire()
    await a.release()
    assert store.holder() is None
    assert await b.try_acquire() and store.holder() == "b"


async def test_a_leader_that_cannot_renew_stops_its_work() -> None:
    """Real time, with a 0.3 s lease: the API goes away, the work is told to halt, and
    run_as_leader raises once it has."""
    store = Store()
    e = elector(store, "a", duration=0.3)
    halted = asyncio.Event()

    async def work(halt: asyncio.Event) -> None:
        store.down = True  # the API server becomes unreachable once we lead
        await halt.wait()
        halted.set()

    with pytest.raises(LostLeadershipError, match="could not renew"):
        async with asyncio.timeout(5):
            await run_as_leader(e, work, lambda: False)
    assert halted.is_set()


async def test_a_leader_displaced_by_another_stops() -> None:
    store = Store()
    e = elector(store, "a", duration=0.3)

    async def work(halt: asyncio.Event) -> None:
        lease = await store.get(PATH)
        assert lease is not None
        store._put(PATH, {**lease, "spec": {**lease["spec"], "holderIdentity": "intruder"}})
        await halt.wait()

    with pytest.raises(LostLeadershipError, match="intruder holds"):
        async with asyncio.timeout(5):
            await run_as_leader(e, work, lambda: False)
