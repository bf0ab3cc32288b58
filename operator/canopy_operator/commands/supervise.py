"""`canopy supervise`: the local overlay's supervisor — a dead broker comes back, loss-free.

``canopy up`` starts one per overlay (detached, its pid in ``STATE_DIR/NAME/supervisor.pid``,
its log in ``supervisor.log``); ``canopy down`` stops it before the brokers. Every
``--interval`` seconds it looks at the brokers:

* a broker whose process is gone is **dead**; one that answers ``/healthz`` with 500 has
  **failed** (its event loop hit an internal error) and is killed, so that its neighbours
  fence it and repair around it like around any dead broker;
* while the neighbours repair (paper 001: they chain up along the dead broker's neighbour list
  and replay what it swallowed) it waits — :func:`canopy_operator.model.restore.restore`
  says when the survivors form one tree again;
* then it takes the overlay's lock (the one ``apply`` holds), plans from the survivors' tree to
  the declared shape and runs that plan with the shared executor: a new process for the dead
  broker joins as a leaf (a fresh incarnation, which the neighbours' fences accept), then link
  exchanges undo the repair's detour. Every step is one of the loss-free elementary steps;
  nothing is dropped and re-added under traffic.

* every broker alive but in several trees (a network partition healed: each side repaired
  without the other) is restored too: the plan joins the trees, lifting the fences the sides
  put on each other and telling every subscriber the stretch it missed.

A restore that fails half-way (a broker died again) is retried on the next tick from whatever
is live: the overlay is a tree after every step, and ``restoring`` in ``state.json`` keeps the
supervisor at it until the declared shape is back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from canopy_broker import logs
from canopy_broker.admin_client import AdminError
from canopy_operator.backends.local import BrokerDownError, LocalBackend, StateFileError
from canopy_operator.commands.local import overlay_dir, run_own_plan
from canopy_operator.executor import StepError
from canopy_operator.model.restore import (
    describe,
    down_links,
    mutual,
    repairs_under_way,
    restore,
    split,
    stuck_one_sided,
)
from canopy_operator.model.topology import norm, parse_overlay

log = logging.getLogger("canopy.supervisor")


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "supervise",
        help="run a local overlay's supervisor in the foreground (`canopy up` starts one)",
    )
    p.add_argument("--overlay", help="overlay name (default: the only one in the state dir)")
    p.add_argument("--state-dir", type=Path, default=Path(".canopy"))
    p.add_argument("--interval", type=float, default=0.5, help="seconds between checks")
    logs.add_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    where = overlay_dir(args.state_dir, args.overlay)
    logs.configure("INFO", args.log_format, overlay=where.name)
    asyncio.run(supervise(where, args.interval))
    return 0


async def supervise(where: Path, interval: float) -> None:
    """Tick until SIGTERM/SIGINT or until the overlay is gone (``canopy down``)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("supervising overlay %s (pid %d)", where.name, os.getpid())
    said = [""]

    def say(line: str) -> None:
        """Log a line unless it repeats the last one (a wait is told once, not every tick)."""
        if line != said[0]:
            log.info("%s", line)
        said[0] = line

    while not stop.is_set():
        try:
            backend = LocalBackend(where)
        except StateFileError as exc:
            # Broken by hand or a full disk: told, and read again next tick (it used to end
            # the supervisor, and nothing restored dead brokers any more).
            say(f"cannot read the overlay's state: {exc}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            continue
        try:
            work = asyncio.ensure_future(tick(backend, say))
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not work.done():  # stopped mid-restore: the overlay is a tree after each step
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                if not await work:
                    break
        except Exception:
            log.exception("supervisor tick failed; trying again")
        finally:
            await backend.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
    log.info("supervisor of %s stops", where.name)


async def tick(backend: LocalBackend, say: Callable[[str], None]) -> bool:
    """One look at the overlay, and a restore if one is due; False once the overlay is gone
    (``canopy down`` forgot its brokers)."""
    if not backend.brokers:
        return False
    if not backend.state.get("spec"):
        return True  # the first apply has not finished: nothing is declared yet
    health = await backend.health()
    for name, h in health.items():
        if h["state"] == "failed":
            log.warning("%s reports itself failed (%s); killing it to restore it", name, h["why"])
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(backend.brokers[name]["pid"]), signal.SIGKILL)
    dead = sorted(n for n, h in health.items() if h["state"] in ("dead", "failed"))
    # Declared but not in the state: a roll-out or an apply stopped between taking a broker
    # out and bringing it back (its lock is gone with it, so nobody else will).
    spec = parse_overlay(backend.state["spec"])
    missing = [b for b in spec.broker_names if b not in backend.brokers]
    # All alive but in several trees: a partition healed (each side repaired without the
    # other); the restore joins them.
    neighbours = backend.reported_neighbours(health)
    parted = not dead and split(neighbours)
    # A link known at one end only: being set up or closed, or stuck (restore_once removes
    # it once it has been so for too long, which a restore then mends).
    links, one_sided = mutual(neighbours)
    # One whole tree, but not the declared one: the brokers repaired a failed link by an
    # exchange onto a standby link, and nothing died. The restore puts the declared links
    # back (chaos soak: b5-x0 cut, moved to b3-x0, and left so for good).
    drifted = spec.links is not None and links != set(map(norm, spec.links))
    calm = not dead and not missing and not parted and not one_sided and not drifted
    if calm and not backend.state.get("restoring"):
        if backend.state.get("one_sided"):  # settled: a later one starts its own clock
            async with backend.locked():
                backend.reload()
                backend.state.pop("one_sided", None)
                backend.save()
        return True
    async with backend.locked():
        backend.reload()
        if not backend.brokers:
            return False
        await restore_once(backend, dead + missing, log=say)
    return True


async def restore_once(
    backend: LocalBackend, dead: list[str], log: Any = print
) -> dict[str, Any] | None:
    """Restore the declared shape if the survivors finished repairing: returns what was done
    (brokers brought back, steps, seconds), or None when it must wait. The caller holds the
    overlay's lock (or is the only one acting, as the demo is)."""
    spec = parse_overlay(backend.state["spec"])
    health = await backend.health()
    if any(h["state"] == "unreachable" for h in health.values()):
        silent = sorted(n for n, h in health.items() if h["state"] == "unreachable")
        log(f"waiting: {', '.join(silent)} does not answer")
        return None
    alive = [n for n, h in health.items() if h["state"] == "up"]
    neighbours = backend.reported_neighbours(health)
    links, one_sided = mutual(neighbours)
    seen, stuck = stuck_one_sided(
        one_sided, neighbours, backend.state.get("one_sided") or {}, time.time()
    )
    if seen != backend.state.get("one_sided"):
        backend.state["one_sided"] = seen
        backend.save()
    for holder, other in stuck:
        log(f"link {holder}-{other} is known at {holder} only for too long: removing it there")
        try:
            await backend.admin(holder).remove_link(other)
        except AdminError as exc:  # e.g. 409: the link is on the cycle of a running exchange
            log(f"{holder} keeps its link to {other} for now: {exc.message}")
        except (aiohttp.ClientError, OSError, TimeoutError):
            pass  # not answering: the next tick looks again
    if one_sided:
        a, b = min(one_sided)
        log(f"waiting: link {a}-{b} is known at one end only (being set up or closed)")
        return None
    statuses = {n: h["status"] for n, h in health.items() if h["state"] == "up"}
    down = down_links(statuses)
    if down:
        a, b = down[0]
        log(f"waiting: link {a}-{b} is down (reconnecting, or cut: its traffic waits in it)")
        return None
    decision = restore(spec, alive, links, repairs_under_way(statuses))
    if decision.wait:
        log(describe(decision, spec.broker_names))
        return None
    if not decision.needed:
        backend.state.pop("restoring", None)
        backend.save()
        return {"brokers": [], "steps": 0, "seconds": 0.0}
    assert decision.plan is not None
    started = time.monotonic()
    backend.state["restoring"] = True
    for name in decision.absent:
        if name in dead or name not in backend.brokers:
            restarts = backend.state.setdefault("restarts", {})
            restarts[name] = int(restarts.get(name, 0)) + 1
    backend.save()
    log(f"restoring: {describe(decision, spec.broker_names)}")
    try:
        await run_own_plan(spec, backend, decision.plan, log)
    except (StepError, BrokerDownError, TimeoutError, RuntimeError) as exc:
        log(f"restore stopped: {exc}; trying again from what is live")
        return None
    seconds = time.monotonic() - started
    backend.state.pop("restoring", None)
    backend.state["last_restore"] = {
        "brokers": list(decision.absent),
        "steps": len(decision.plan.steps),
        "exchanges": len(decision.plan.exchanges),
        "seconds": round(seconds, 3),
        "at": time.time(),
    }
    backend.save()
    log(f"restored the declared shape in {seconds:.2f}s ({len(decision.plan.steps)} steps)")
    return dict(backend.state["last_restore"])
