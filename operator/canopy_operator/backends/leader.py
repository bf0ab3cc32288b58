"""Leader election with a coordination.k8s.io Lease: two operator replicas never act at once.

The operator acts on brokers (plans, restores, roll-outs); two replicas doing that at once would
plan from the same live tree twice. So a replica acts only while it holds the overlay operator's
Lease (``--leader-election``), the way client-go's leader election and controller-runtime do:

* **Acquire.** The Lease is free if it has no holder, or if its ``renewTime`` has not changed
  for ``leaseDurationSeconds`` *as seen by this replica* (its own monotonic clock: two nodes'
  clocks never have to agree). A free Lease is taken with a write that carries the
  ``resourceVersion`` read, so of two replicas racing for it the API server lets one win.
* **Hold.** The holder renews every third of the duration. If it cannot renew for a whole
  duration (API server unreachable, its write refused because another took over) it has lost
  the lease: the operator stops, and the process exits so that its pod restarts as a candidate.
  The new leader resumes from what the overlays' status and the live brokers say (the executor
  is resumable; restores and roll-outs re-plan from what is live).

Nothing here knows about overlays: :func:`run_as_leader` wraps any coroutine.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

log = logging.getLogger("canopy.operator")


class LeaseApi(Protocol):
    async def get(self, path: str) -> dict[str, Any] | None: ...

    async def create(self, path: str, body: dict[str, Any]) -> bool: ...

    async def update(self, path: str, body: dict[str, Any]) -> bool: ...


class LostLeadershipError(Exception):
    """This replica could not renew the Lease for a whole lease duration."""


@dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    duration: float = 15.0

    @property
    def path(self) -> str:
        ns = self.namespace
        return f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{self.name}"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    """Acquires, then keeps, the Lease for ``config.identity``."""

    def __init__(self, api: LeaseApi, config: LeaseConfig) -> None:
        self.api, self.config = api, config
        self._seen: tuple[Any, Any] | None = None  # (holder, renewTime) last read
        self._seen_at = 0.0  # when it last changed, on this replica's clock

    def _observe(self, spec: dict[str, Any]) -> None:
        key = (spec.get("holderIdentity"), spec.get("renewTime"))
        if key != self._seen:
            self._seen, self._seen_at = key, time.monotonic()

    def _body(self, lease: dict[str, Any] | None, transitions: int) -> dict[str, Any]:
        now = _now()
        metadata: dict[str, Any] = {"name": self.config.name, "namespace": self.config.namespace}
        if lease is not None:
            metadata["resourceVersion"] = (lease.get("metadata") or {}).get("resourceVersion")
        spec = {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": max(1, round(self.config.duration)),
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }
        if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == (
            self.config.identity
        ):
            spec["acquireTime"] = (lease.get("spec") or {}).get("acquireTime") or now
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": spec,
        }

    async def try_acquire(self) -> bool:
        """One attempt: True if this replica holds the Lease now."""
        lease = await self.api.get(self.config.path)
        if lease is None:
            path = self.config.path.rsplit("/", 1)[0]
            return await self.api.create(path, self._body(None, 0))
        spec = lease.get("spec") or {}
        self._observe(spec)
        holder = spec.get("holderIdentity")
        expired = time.monotonic() - self._seen_at > self.config.duration
        if holder and holder != self.config.identity and not expired:
            return False
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder != self.config.identity:
            transitions += 1
            log.info(
                "lease %s: %s takes it over from %s",
                self.config.name,
                self.config.identity,
                holder or "nobody",
            )
        return await self.api.update(self.config.path, self._body(lease, transitions))

    async def acquire(self, stopping: Callable[[], bool]) -> bool:
        """Until this replica holds the Lease (True) or ``stopping()`` (False)."""
        log.info("lease %s: %s waits to lead", self.config.name, self.config.identity)
        while not stopping():
            try:
                if await self.try_acquire():
                    log.info("lease %s: %s leads", self.config.name, self.config.identity)
                    return True
            except Exception as exc:
                log.warning("lease %s: %s", self.config.name, exc)
            await asyncio.sleep(self.config.duration / 5)
        return False

    async def release(self) -> None:
        """Give the Lease up (best effort) if this replica holds it."""
        with contextlib.suppress(Exception):
            lease = await self.api.get(self.config.path)
            if ((lease or {}).get("spec") or {}).get("holderIdentity") == self.config.identity:
                body = self._body(lease, _transitions(lease))
                body["spec"]["holderIdentity"] = None
                await self.api.update(self.config.path, body)
                log.info("lease %s: %s released it", self.config.name, self.config.identity)

    async def keep(self) -> None:
        """Renew until cancelled; raises :class:`LostLeadershipError` once renewing has failed for
        a whole lease duration (or another replica holds it)."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.config.duration / 3)
            try:
                lease = await self.api.get(self.config.path)
                holder = ((lease or {}).get("spec") or {}).get("holderIdentity")
                if lease is not None and holder != self.config.identity:
                    raise LostLeadershipError(f"{holder} holds lease {self.config.name} now")
                if await self.api.update(self.config.path, self._body(lease, _transitions(lease))):
                    last_ok = time.monotonic()
            except LostLeadershipError:
                raise
            except Exception as exc:
                log.warning("lease %s: renewing failed: %s", self.config.name, exc)
            if time.monotonic() - last_ok > self.config.duration:
                raise LostLeadershipError(
                    f"could not renew lease {self.config.name} for {self.config.duration:g}s"
                )


def _transitions(lease: dict[str, Any] | None) -> int:
    return int(((lease or {}).get("spec") or {}).get("leaseTransitions") or 0)


@contextlib.asynccontextmanager
async def standby_health(url: str | None) -> AsyncIterator[None]:
    """While a replica waits for the Lease, something must answer its liveness probe (kopf's
    endpoint only exists once kopf runs): a ``200 standby`` at the same URL, closed before the
    leader's kopf takes the port."""
    if not url:
        yield
        return
    parts = urllib.parse.urlsplit(url)
    app = web.Application()

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="standby: waiting for the lease\n")

    app.router.add_get(parts.path or "/", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, parts.hostname, parts.port).start()
        yield
    finally:
        await runner.cleanup()


async def run_as_leader(
    elector: Elector,
    work: Callable[[asyncio.Event], Awaitable[None]],
    stopping: Callable[[], bool],
    liveness: str | None = None,
) -> None:
    """Wait for the Lease (answering ``liveness`` meanwhile), then run ``work(halt)``. ``halt``
    is set when ``stopping()`` turns true (the caller's stop, checked every 0.1 s: it may be a
    flag set from another thread) or the Lease is lost; the work must then stop, and
    :class:`LostLeadershipError` is raised once it has."""
    async with standby_health(liveness):
        acquired = await elector.acquire(stopping)
    if not acquired:
        return
    halt = asyncio.Event()
    lost: list[LostLeadershipError] = []

    async def keeper() -> None:
        try:
            await elector.keep()
        except LostLeadershipError as exc:
            log.error("lease %s: leadership lost: %s; stopping", elector.config.name, exc)
            lost.append(exc)
            halt.set()

    async def relay() -> None:
        while not stopping():  # noqa: ASYNC110 - a flag other threads set
            await asyncio.sleep(0.1)
        halt.set()

    sides = [asyncio.create_task(keeper(), name="lease keeper"), asyncio.create_task(relay())]
    try:
        await work(halt)
    finally:
        for task in sides:
            task.cancel()
        await asyncio.gather(*sides, return_exceptions=True)
    if lost:
        raise lost[0]
    await elector.release()  # a clean stop: the next replica need not wait a lease duration
