"""The executor: the one place that acts on a plan. Both faces (Kubernetes, local) use it.

It runs a :class:`~canopy_operator.model.planner.Plan` batch by batch — steps of one batch touch
disjoint brokers and run concurrently — through a small :class:`Backend` (create/delete a broker,
wait until it is ready, its addresses, its admin client) and the brokers' admin API.

**Resumable and idempotent.** Progress (which step indices are done) goes to a
:class:`ProgressStore` after every step — the overlay's ``status`` in Kubernetes, a state file
locally — so a restarted operator continues where it stopped. Every broker call is idempotent:
an exchange's id is derived from the overlay, the plan's generation and the step index, so asking
again returns the same exchange instead of starting a second one; creating a broker that exists,
adding a link that exists, draining a drained broker are no-ops.

**Failures.** An unreachable broker is retried with backoff (the overlay is reported Degraded
meanwhile), unless its process or pod is gone: then the step fails at once, so that whoever runs
the plan (the supervisor, the reconciler) plans again from what is live, which brings the broker
back, instead of retrying for a minute with the overlay's lock held. An exchange the brokers give
up on (lock conflicts beyond their retries, a lease that ran out) fails the step with its reason,
and the plan stops there — the overlay is consistent after every step, so a later reconcile
re-plans from what is live.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from canopy_broker.admin_client import AdminClient, AdminError
from canopy_broker.logs import log_context
from canopy_operator.model.planner import LiveOverlay, Plan, Step, plan
from canopy_operator.model.rollout import without
from canopy_operator.model.topology import Edge, OverlaySpec


class Backend(Protocol):
    """Where brokers live: Kubernetes pods or local processes."""

    async def create_broker(self, name: str) -> None: ...

    async def delete_broker(self, name: str) -> None: ...

    async def wait_ready(self, name: str, within: float) -> None: ...

    def address(self, name: str) -> str:
        """HOST:PORT clients reach the broker at."""
        ...

    def link_address(self, name: str) -> str:
        """HOST:PORT other brokers link to (its link port: brokers only)."""
        ...

    def admin(self, name: str) -> AdminClient: ...

    async def gone(self, name: str) -> bool:
        """Whether broker ``name``'s process (pod) no longer exists: a step that needs it can
        only fail until a plan brings it back, so it is not worth retrying."""
        ...


class ProgressStore(Protocol):
    async def save(self, progress: dict[str, Any]) -> None: ...


class StepError(Exception):
    def __init__(self, index: int, step: Step, reason: str) -> None:
        super().__init__(f"step {index + 1} ({step.kind}) failed: {reason}")
        self.index, self.step, self.reason = index, step, reason


EventSink = Callable[[str, str], None]  # (reason, message), like a Kubernetes Event


@dataclass
class StepResult:
    index: int
    kind: str
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Executor:
    backend: Backend
    store: ProgressStore
    overlay: str
    ordering: str = "fifo"
    lease: float = 30.0
    on_event: EventSink = lambda reason, message: None
    on_degraded: Callable[[str | None], Awaitable[None]] | None = None
    retry_for: float = 60.0
    label: str = ""  # e.g. "r3" for the third restore: its own id space within a generation
    results: list[StepResult] = field(default_factory=list)
    # When the parts a join step ends began to be apart (see _join), by the link it adds.
    _apart: dict[Edge, float | None] = field(default_factory=dict)

    def step_id(self, generation: int, index: int) -> str:
        """The broker-side id of a step: the same on every run of the same plan (so a resumed
        plan finds the exchange it started), never the same for two different plans (so an
        exchange is never taken for another's)."""
        run = f"-{self.label}" if self.label else ""
        return f"{self.overlay}-g{generation}{run}-s{index + 1}"

    async def run(
        self, plan: Plan, generation: int, progress: dict[str, Any] | None = None
    ) -> None:
        """Carry out ``plan``; ``progress`` is what a previous run of the same plan saved."""
        done: set[int] = set()
        if progress and progress.get("generation") == generation:
            done = set(progress.get("completed", []))
        steps = list(enumerate(plan.steps))
        state: dict[str, Any] = {
            "generation": generation,
            "steps": [s.to_json() for s in plan.steps],
            "completed": sorted(done),
        }
        for batch in sorted({s.batch for s in plan.steps}):
            todo = [(i, s) for i, s in steps if s.batch == batch and i not in done]
            if todo:
                await self._run_batch(generation, todo, state, done)

    async def _run_batch(
        self,
        generation: int,
        todo: list[tuple[int, Step]],
        state: dict[str, Any],
        done: set[int],
    ) -> None:
        """Run one batch of independent steps; the first failure cancels the others.

        Cancelling a sibling only stops *watching* it: an exchange a broker has started runs to
        its end there (or is rolled back or forward by its lease), so no lock is left behind.
        The cancelled step is not recorded as completed; the next run of the plan starts it
        again under the same id (``step_id``), which the broker answers with the exchange it
        already ran instead of running it twice. The batch waits for every sibling to end
        before it reports the first failure, so nothing runs on unobserved.
        """
        try:
            async with asyncio.TaskGroup() as group:
                for i, s in todo:
                    group.create_task(
                        self._run_step(generation, i, s, state, done), name=f"step {i + 1}"
                    )
        except BaseExceptionGroup as failed:
            first = failed.exceptions[0]
            for other in failed.exceptions[1:]:
                self.on_event("StepFailed", f"also failed in the same batch: {other}")
            raise first from None

    async def _run_step(
        self, generation: int, i: int, step: Step, state: dict[str, Any], done: set[int]
    ) -> None:
        # Every line logged while this step runs (its Events, the backend's, the supervisor's
        # progress lines) names it, as the brokers' lines about its exchange do
        # (canopy_broker.logs).
        with log_context(
            overlay=self.overlay,
            generation=generation,
            step=i + 1,
            reconfiguration=self.step_id(generation, i),
        ):
            started = time.perf_counter()
            begun = f"step {i + 1}/{len(state['steps'])}: {step.describe()}"
            self.on_event("StepStarted", begun)
            detail = await self._retrying(lambda: self._do(generation, i, step), step, i)
            done.add(i)
            state["completed"] = sorted(done)
            await self.store.save(dict(state))
            seconds = time.perf_counter() - started
            self.results.append(StepResult(i, step.kind, seconds, detail))
            ended = f"step {i + 1}: {step.describe()} in {seconds:.2f}s"
            self.on_event("StepDone", ended)

    async def _retrying(
        self, action: Callable[[], Awaitable[dict[str, Any]]], step: Step, i: int
    ) -> dict[str, Any]:
        clock = asyncio.get_running_loop().time  # the loop's: virtual time in tests
        deadline = clock() + self.retry_for
        delay = 0.2
        degraded = False
        while True:
            try:
                result = await action()
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                if clock() > deadline:
                    raise StepError(i, step, f"broker unreachable: {exc}") from exc
                for name in sorted(needed(step)):
                    try:
                        gone = await self.backend.gone(name)
                    except Exception:  # not known to be gone (the API failed): retried as before
                        gone = False
                    if gone:
                        raise StepError(i, step, f"broker {name} is gone ({exc})") from exc
                if not degraded and self.on_degraded is not None:
                    await self.on_degraded(f"broker unreachable during step {i + 1}: {exc}")
                degraded = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if degraded and self.on_degraded is not None:
                await self.on_degraded(None)
            return result

    async def _do(self, generation: int, i: int, step: Step) -> dict[str, Any]:
        if step.kind == "add-leaf":
            return await self._add_leaf(step)
        if step.kind == "exchange":
            return await self._exchange(self.step_id(generation, i), step, i)
        if step.kind == "join":
            return await self._join(step)
        return await self._remove_leaf(step, i)

    async def _add_leaf(self, step: Step) -> dict[str, Any]:
        assert step.broker is not None and step.add is not None
        new = step.broker
        anchor = step.add[0] if step.add[1] == new else step.add[1]
        await self.backend.create_broker(new)
        await self.backend.wait_ready(new, 30.0)
        admin = self.backend.admin(new)
        # Not left half-added, as a join is not: the new broker would keep dialling, and once
        # the anchor was back (restarted at its address) the link would come up by itself,
        # beside whatever the next plan linked the new broker to: a cycle (chaos seed 28: x0
        # linked to b5 by a join, then to a restarted b3 by its old try; 12,355 notifications
        # duplicated at one subscriber, the restore stuck).
        try:
            result = await admin.add_link(anchor, self.backend.link_address(anchor))
        except asyncio.CancelledError:
            # A sibling step failed (the anchor's death fails those too): the plan is given up.
            with contextlib.suppress(Exception):
                await asyncio.shield(admin.remove_link(anchor))
            raise
        if not result.get("up"):
            if result.get("created"):  # not one that was up before this try (a step run again)
                with contextlib.suppress(AdminError):  # refused: the failure below stands
                    await admin.remove_link(anchor)
            raise aiohttp.ClientError(f"link {new}-{anchor} did not come up")
        return {"broker": new, "attached_to": anchor}

    async def _join(self, step: Step) -> dict[str, Any]:
        """Link two brokers of separate trees (a split left by a correlated failure): the
        link's hello exchanges their routing tables as a leaf's does, and no path existed
        between them, so nothing can arrive twice or out of order. Adding a link that exists
        is a no-op, so a step run again after a restart is harmless."""
        assert step.add is not None
        a, b = step.add
        members = step.members or (a, b)
        statuses = dict(
            zip(
                members,
                await asyncio.gather(*(self.backend.admin(m).status() for m in members)),
                strict=True,
            )
        )
        alive = {m: str(st.get("incarnation") or "") for m, st in statuses.items()}
        # A healed partition: each side declared the other dead and fenced its processes,
        # which are alive. The restore planned this join from every broker answering, no
        # repair under way and no link known at one end only, so no stale process is among
        # them (one paused and repaired around still reports its old links). The brokers keep
        # a lifted fence's time until a gap told covers it, so a retry (by this executor or
        # the next one) still knows since when the sides were apart.
        apart = self._apart.setdefault(step.add, apart_since(statuses, alive))
        lifted = await asyncio.gather(*(self.backend.admin(m).lift_fences(alive) for m in members))
        await self.backend.admin(a).set_peers({b: self.backend.link_address(b)})
        result = await self.backend.admin(a).add_link(b, self.backend.link_address(b))
        if not result.get("up"):
            # Not left half-added: it would connect by itself when the network lets it,
            # joining the sides without a step, so nobody would be told (review).
            await self.backend.admin(a).remove_link(b)
            raise aiohttp.ClientError(f"link {a}-{b} did not come up")
        detail: dict[str, Any] = {"joined": [a, b]}
        if any(lifted):
            detail["fences_lifted"] = {m: ps for m, ps in zip(members, lifted, strict=True) if ps}
        if apart is not None:
            # Nothing crossed between the sides while they were apart: say so to every
            # subscriber, which would otherwise never know (it did not fail over).
            until = time.time()
            reason = (
                f"the overlay was split from {_utc(apart)} until the restore joined it "
                f"({a}-{b}): events published in another part meanwhile were not delivered"
            )
            since = apart
            resent = resent_since(statuses, apart)
            if resent is not None and resent < apart:
                since = resent
                reason += (
                    ", nor those a publisher that failed over meanwhile sent again there, "
                    f"published from {_utc(resent)} on"
                )
            told = await asyncio.gather(
                *(
                    self.backend.admin(m).tell_gap(since, until, reason, covers=members)
                    for m in members
                )
            )
            detail["apart_s"] = round(until - apart, 3)
            detail["subscribers_told"] = sum(told)
        return detail

    async def _exchange(self, xid: str, step: Step, i: int) -> dict[str, Any]:
        assert step.remove is not None
        cycle = list(step.cycle)
        # Out-of-band channels: every broker of the cycle must be able to reach the others.
        book = {b: self.backend.link_address(b) for b in cycle}
        await asyncio.gather(*(self.backend.admin(b).set_peers(book) for b in cycle))
        admin = self.backend.admin(cycle[0])
        rec = await admin.start_exchange(
            cycle, step.remove, ordering=self.ordering, xid=xid, wait=20.0, lease=self.lease
        )
        # A backstop: the brokers end an exchange by their retries (about 4.8 minutes for a
        # busy cycle) or its lease; a record that says "running" for longer than both is not
        # worth waiting on with the overlay's lock held.
        clock = asyncio.get_running_loop().time
        within = 300.0 + 2 * self.lease
        deadline = clock() + within
        while rec.get("state") == "running":
            if clock() > deadline:
                raise StepError(i, step, f"exchange {xid} still running after {within:g}s")
            await asyncio.sleep(0.1)
            rec = await admin.exchange(xid)
        if rec.get("state") != "finished":
            raise StepError(i, step, str(rec.get("reason") or rec))
        return {"xid": xid, "cycle": cycle, "attempts": rec.get("attempts")}

    async def _admitting(self, broker: str, within: float = 60.0) -> None:
        """Until ``broker`` takes clients: a broker just started (a restore brought it back, a
        rolling replacement added it) holds them until its first link has been up a heartbeat.
        Drained to it before, the leaf's clients were turned away ("has not joined the overlay
        yet") and came back only on their own retries (`canopy demo`: a remove-leaf took 5.15 s
        instead of about 0.1). A broker that does not answer is left to the drain's own
        errors; one still holding after ``within`` is drained to anyway."""
        admin = self.backend.admin(broker)
        clock = asyncio.get_running_loop().time
        deadline = clock() + within
        while clock() < deadline:
            try:
                held = (await admin.status()).get("clients_held")
            except (AdminError, aiohttp.ClientError, TimeoutError):
                return
            if held is None:
                return
            await asyncio.sleep(0.1)

    async def _remove_leaf(self, step: Step, i: int) -> dict[str, Any]:
        assert step.broker is not None
        leaf = step.broker
        other = None
        if step.remove is not None:
            other = step.remove[1] if step.remove[0] == leaf else step.remove[0]
        if await self.backend.gone(leaf):  # dead: no clients to move, nobody to drain
            await self.backend.delete_broker(leaf)
            return {"broker": leaf, "clients_moved_to": None}
        admin = self.backend.admin(leaf)
        with contextlib.suppress(AdminError):  # a leaf that is already gone has no clients
            if other is not None:
                await self._admitting(other)
                await admin.set_peers({other: self.backend.link_address(other)})
                deadline = time.monotonic() + 60.0
                while not (await admin.drain(other, self.backend.address(other), wait=5.0)).get(
                    "drained"
                ):
                    if time.monotonic() > deadline:
                        raise StepError(i, step, f"{leaf}'s clients did not leave within 60s")
                await admin.remove_link(other)
        await self.backend.delete_broker(leaf)
        return {"broker": leaf, "clients_moved_to": other}


def needed(step: Step) -> set[str]:
    """The brokers that must be alive for ``step`` to succeed when retried: all it touches but
    the one an add-leaf starts (a retry starts it again) and the one a remove-leaf deletes."""
    out = step.brokers() | set(step.members)
    if step.broker is not None:
        out.discard(step.broker)
    return out


async def replace_broker(
    broker: str,
    spec: OverlaySpec,
    live: Callable[[], Awaitable[LiveOverlay]],
    run_plan: Callable[[Plan], Awaitable[None]],
) -> dict[str, Any]:
    """Replace ``broker`` loss-free (:mod:`canopy_operator.model.rollout`): a plan that takes it
    out (exchanges make it a leaf, its clients migrate to a neighbour, its process or pod is
    deleted), then a plan that brings it back as declared (a new process or pod, started with
    what the backend starts brokers with now). ``live`` reads the live tree; ``run_plan`` runs
    one plan with the caller's executor. Either plan failing leaves a tree, as any plan does."""
    now = await live()
    if len(now.brokers) < 2:
        raise ValueError(f"{broker} is the only broker: its clients have nowhere to go meanwhile")
    out = plan(now, without(spec, now.links, broker))
    started = time.perf_counter()
    await run_plan(out)
    back = plan(await live(), spec)
    await run_plan(back)
    return {
        "broker": broker,
        "steps": len(out.steps) + len(back.steps),
        "exchanges": len(out.exchanges) + len(back.exchanges),
        "seconds": round(time.perf_counter() - started, 3),
    }


def _utc(at: float) -> str:
    """A time in a gap's reason, as every subscriber reads it: "HH:MM:SS UTC"."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(at))


def resent_since(statuses: dict[str, dict[str, Any]], apart: float) -> float | None:
    """The oldest publication that a publisher failing over to one of the sides while they
    were apart (from ``apart`` on) sent again there (status ``resent``: since, when), or None.
    It reached that side only: a publication its broker took but had not passed on when it
    died is sent again at the next broker, and during a split that is one part. Published
    before the split began, it was outside the split's gap, and the other part lost it
    untold (chaos soak: 1-6 events per subscriber)."""
    since = [
        float(at)
        for st in statuses.values()
        for at, when in (st.get("resent") or {}).values()
        if float(when) >= apart
    ]
    return min(since) if since else None


def apart_since(statuses: dict[str, dict[str, Any]], alive: dict[str, str]) -> float | None:
    """When the sides a join ends began to be apart (``statuses``: theirs; ``alive``: their
    incarnations): the earliest time one of them last heard a neighbour it then declared
    dead and has not told a gap for since (``fenced_since``): a live process of the other
    side (a partition), a broker still dead or restarted (brokers dying together can leave a
    split no repair closes), or one in a part not joined yet; or a fence between them lifted
    by an earlier try of the join (``lifted_since``). A broker forgets such a time once a gap
    covering that neighbour was told, or once it linked with that neighbour's new process
    (the failure is over for it). None: nothing to tell."""
    since = [
        float(at) for st in statuses.values() for at in (st.get("fenced_since") or {}).values()
    ]
    since += [
        float(at)
        for st in statuses.values()
        for peer, at in (st.get("lifted_since") or {}).items()
        if peer in alive
    ]
    return min(since) if since else None
