"""``canopy bench day2``: what day-2 operations cost on a real local overlay, measured.

An overlay of ``--brokers`` processes (a random tree, seeded; TLS on, as ``canopy up`` runs it)
with its supervisor, a publisher at ``--rate`` events/s and a subscriber (``n >= 0``) on every
broker but one inner broker without clients. Two scenarios, one after the other:

* **crash**: that inner broker is SIGKILLed. Reported: the time from the kill to the repaired
  tree (its neighbours chained up), and to the declared shape restored by the supervisor (a new
  process joined as a leaf, exchanges back).
* **roll**: every broker is replaced one at a time (``canopy roll``'s routine: out by exchanges
  with its clients migrated, back as a new process). Reported: the whole roll-out's duration.

For each, per subscriber: notifications lost, duplicated, reordered (the publisher's sequence
numbers 1..N must arrive once each, in order; all must be 0). Progress goes to stderr; with
``--json`` the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from canopy_broker.bench_faults import drain_into
from canopy_broker.client import Client, Notification, connect
from canopy_broker.sim.topology import random_tree
from canopy_operator.backends.local import LocalBackend
from canopy_operator.commands.local import apply, roll
from canopy_operator.model.restore import reported_links
from canopy_operator.model.topology import norm, parse_overlay


def progress(message: str) -> None:
    print(f"[day2] {message}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--brokers", type=int, default=8)
    p.add_argument("--rate", type=float, default=1000.0, help="events/s from one publisher")
    p.add_argument("--heartbeat", type=float, default=0.2, help="seconds between heartbeats")
    p.add_argument("--dead-after", type=int, default=3, help="heartbeats missed: dead")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    p.set_defaults(func=run_args)


def run_args(args: argparse.Namespace) -> int:
    result = asyncio.run(bench(args))
    for name in ("crash", "roll"):
        r = result[name]
        print(
            f"{name:<6} {r['what']}: {r['seconds']:.2f}s; lost {r['lost']}, duplicated "
            f"{r['duplicated']}, reordered {r['reordered']} over {r['subscribers']} subscribers "
            f"({r['published']} published)"
        )
    if args.json:
        print(json.dumps(result))
    return 0 if result["ok"] else 1


class Traffic:
    """One publisher (``{"n": 1, 2, ...}``, paced) and subscribers that keep what they get."""

    def __init__(self, backend: LocalBackend, rate: float) -> None:
        self.backend, self.rate = backend, rate
        self.clients: list[Client] = []
        self.received: dict[str, list[Notification]] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.stop = asyncio.Event()
        self.last = 0

    async def subscribe(self, broker: str) -> None:
        name = f"canopy/s-{broker}"
        c = await connect(self.backend.address(broker), name, credentials=self.backend.credentials)
        await c.subscribe("n >= 0", sub_id="all")
        self.clients.append(c)
        got = self.received[name] = []
        self.tasks.append(asyncio.create_task(drain_into(c, got)))

    async def publish_from(self, broker: str) -> None:
        pub = await connect(
            self.backend.address(broker), "canopy/pub", credentials=self.backend.credentials
        )
        self.clients.append(pub)

        async def paced() -> None:
            start = time.monotonic()
            while not self.stop.is_set():
                while self.last < int((time.monotonic() - start) * self.rate):
                    self.last += 1
                    pub.publish_nowait({"n": self.last})
                await pub.flush()
                await asyncio.sleep(0.005)
            await pub.flush()

        self.tasks.append(asyncio.create_task(paced()))

    def mark(self) -> dict[str, int]:
        """How much each subscriber had: a scenario checks what arrived after this."""
        return {s: len(r) for s, r in self.received.items()}

    async def verdict(self, since: dict[str, int], first: int, last: int) -> dict[str, int]:
        """Lost, duplicated, reordered among events ``first..last`` (their ``n``, which the
        publisher counts from 1; its sequence numbers start from the clock) for every
        subscriber (waiting up to 20 s for stragglers)."""
        async with asyncio.timeout(20):
            while any(not r or _n(r[-1]) < last for r in self.received.values()):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        lost = dup = reordered = 0
        for sub, got in self.received.items():
            seqs = [_n(n) for n in got[since.get(sub, 0) :] if first <= _n(n) <= last]
            seen = Counter(seqs)
            lost += sum(1 for n in range(first, last + 1) if n not in seen)
            dup += sum(c - 1 for c in seen.values())
            reordered += sum(1 for a, b in itertools.pairwise(seqs) if b < a)
        return {"lost": lost, "duplicated": dup, "reordered": reordered}

    async def close(self) -> None:
        self.stop.set()
        for c in self.clients:
            await c.close()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    n = max(4, args.brokers)
    names = [f"b{i}" for i in range(n)]
    edges = [norm(e) for e in random_tree(n, random.Random(args.seed), max_fanout=3)]
    degree = Counter(b for e in edges for b in e)
    victim = max(names, key=lambda b: (degree[b], b))  # the most connected: the dearest crash
    manifest = {
        "apiVersion": "canopy.dev/v1alpha1",
        "kind": "BrokerOverlay",
        "metadata": {"name": "day2"},
        "spec": {
            "maxFanOut": 3,
            "failureDetection": {
                "heartbeatSeconds": args.heartbeat,
                "deadAfter": args.dead_after,
            },
            "brokers": [{"name": b} for b in names],
            "links": [list(e) for e in edges],
        },
    }
    spec = parse_overlay(manifest)
    state = Path(tempfile.mkdtemp(prefix="canopy-day2-"))
    backend = LocalBackend(state / "day2", broker_args=spec.broker_args())
    traffic = Traffic(backend, args.rate)
    try:
        progress(f"starting {n} brokers (TLS) and their supervisor; {victim} will be killed")
        await apply(spec, manifest, backend, log=lambda _: None)
        backend.start_supervisor(interval=0.2)
        for b in names:
            if b != victim:
                await traffic.subscribe(b)
        await traffic.publish_from(next(b for b in names if b != victim))
        await asyncio.sleep(2.0)
        crash = await crash_scenario(backend, traffic, victim, edges)
        roll_ = await roll_scenario(backend, traffic, spec)
    finally:
        await traffic.close()
        await backend.down()
        shutil.rmtree(state, ignore_errors=True)
    ok = all(r[k] == 0 for r in (crash, roll_) for k in ("lost", "duplicated", "reordered"))
    return {"brokers": n, "rate": args.rate, "crash": crash, "roll": roll_, "ok": ok}


async def crash_scenario(
    backend: LocalBackend, traffic: Traffic, victim: str, declared: list[tuple[str, str]]
) -> dict[str, Any]:
    since, first = traffic.mark(), traffic.last + 1
    progress(f"crash: SIGKILL {victim} (degree {sum(victim in e for e in declared)}) under load")
    killed = time.monotonic()
    os.kill(int(backend.brokers[victim]["pid"]), signal.SIGKILL)
    repaired_s = restored_s = None
    async with asyncio.timeout(120):
        while restored_s is None:
            await asyncio.sleep(0.05)
            probe = LocalBackend(backend.dir)  # the supervisor changes state.json
            try:
                health = await probe.health(within=1.0)
                up = [b for b, h in health.items() if h["state"] == "up"]
                links = reported_links(probe.reported_neighbours(health))
            finally:
                await probe.close()
            if repaired_s is None and links and not any(victim in e for e in links):
                repaired_s = time.monotonic() - killed
                progress(f"crash: repaired {repaired_s:.2f}s after the kill")
            old_pid = backend.brokers[victim]["pid"]
            restarted = victim in up and probe.brokers[victim]["pid"] != old_pid
            if repaired_s is not None and restarted and links == set(declared):
                restored_s = time.monotonic() - killed
    backend.reload()
    await backend.close()  # its admin clients knew the dead process
    progress(f"crash: declared shape restored {restored_s:.2f}s after the kill")
    await asyncio.sleep(1.0)
    counts = await traffic.verdict(since, first, traffic.last)
    return {
        "what": f"SIGKILL of {victim}, kill to declared shape restored",
        "seconds": round(restored_s, 3),
        "repaired_s": round(repaired_s or 0.0, 3),
        "published": traffic.last - first + 1,
        "subscribers": len(traffic.received),
        **counts,
    }


async def roll_scenario(backend: LocalBackend, traffic: Traffic, spec: Any) -> dict[str, Any]:
    since, first = traffic.mark(), traffic.last + 1
    progress(f"roll: replacing all {len(backend.brokers)} brokers one at a time under load")
    started = time.monotonic()
    async with backend.locked():  # the supervisor waits meanwhile
        backend.reload()
        await roll(spec, backend, sorted(backend.brokers), log=progress)
    seconds = time.monotonic() - started
    await asyncio.sleep(1.0)
    counts = await traffic.verdict(since, first, traffic.last)
    return {
        "what": f"rolling replacement of {len(backend.brokers)} brokers",
        "seconds": round(seconds, 3),
        "published": traffic.last - first + 1,
        "subscribers": len(traffic.received),
        **counts,
    }


def _n(notification: Notification) -> int:
    n = notification.attrs.get("n")
    return n if type(n) is int else 0
