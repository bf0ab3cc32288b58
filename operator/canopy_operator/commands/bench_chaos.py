"""``canopy bench chaos``: a local overlay under seeded, combined faults, judged per subscriber.

What the unit, simulator and integration tests cannot show is how the pieces behave together
when faults overlap: a broker SIGKILLed while its neighbour is paused, two neighbours killed at
once, a link cut and healed during a reshape, a restore running while a second crash is
repaired. This command runs what a user would (``canopy up`` with its supervisor, ``canopy
apply`` for reshapes, ``canopy status``), under live traffic, with faults drawn from a seeded
random schedule, then checks every subscriber's stream against what was published:

* **untold loss**: a notification it should have had that it neither got nor was told may be
  missing (a gap). The guarantee allows none, anywhere.
* **duplicates**, **reorders** (per publisher), **spurious** (not matching, or never
  published): none allowed.
* **told loss at a subscriber nothing happened to** (its broker never failed): the overlay
  was split (two neighbours died together, so the repair's chain was broken) until the restore
  joined it. Reported, not an error: the design tells, it cannot replay across a split.
* Told loss at a subscriber whose broker failed is what failover promises.

Verdicts: CLEAN, TOLD-LOSS-AT-NONFAILED, HARD (any of the first two items) and +STUCK when the
overlay did not settle back to the declared shape, a publisher's publications were not all
acknowledged at the end, or a client gave up failing over (no broker took it within
``--failover-within``). Exit status 1 for HARD or STUCK; 2 for bad arguments, or ERROR: the
harness itself failed, and there is no verdict. The overlay's state directory (broker and
supervisor logs, the fault schedule, the full result) is kept when the verdict is not CLEAN, or
always with ``--keep``; the last stdout line is a JSON object with ``--json``. A loss within
a second of a gap's edge counts as told (the gap's times are a broker's, the publish times
this process's) but is reported apart (``lost_told_slack``).

The same seed draws the same schedule; timing on real processes is not the same twice, so a
seed reproduces the faults, not necessarily the outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from canopy_broker.admin_client import AdminClient
from canopy_broker.client import Client, Gap, Notification, connect
from canopy_broker.core.events import Value
from canopy_broker.procs import process_alive
from canopy_broker.sim.topology import random_tree
from canopy_operator.backends.local import LocalBackend

OVERLAY = "chaos"
SYMBOLS = ("AAPL", "BMW", "CSCO", "DELL")
Attrs = Mapping[str, Any]
FILTERS: tuple[tuple[str, Callable[[Attrs], bool]], ...] = (
    ("n >= 0", lambda a: a["n"] >= 0),
    ('sym = "AAPL"', lambda a: a["sym"] == "AAPL"),
    ("price < 50", lambda a: a["price"] < 50),
    ('sym = "BMW" and price >= 20', lambda a: a["sym"] == "BMW" and a["price"] >= 20),
    ('sym prefix "C"', lambda a: a["sym"].startswith("C")),
    ("price >= 30 and price < 80", lambda a: 30 <= a["price"] < 80),
    ('sym != "DELL"', lambda a: a["sym"] != "DELL"),
)
"""Each subscriber's filter (in turn) with the same test in Python, to know what it is owed."""
WEIGHTS = {
    "kill": 3,
    "pause": 3,
    "kill_pair": 1,
    "kill_while_paused": 1,
    "pause_pair": 1,
    "cut": 2,
    "drop": 1,
    "reshape": 1,
}
"""The fault kinds and how often each is drawn: single failures most, combined ones less."""
SLACK = 1.0
"""Seconds around a gap within which a loss counts as told, but noted apart: the gap's
times are measured by a broker, the publish times by this process."""


def progress(message: str) -> None:
    print(f"[chaos] {message}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=1, help="draws the tree, clients and faults")
    p.add_argument("--brokers", type=int, default=7)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of faults")
    p.add_argument("--rate", type=float, default=450.0, help="events/s over all publishers")
    p.add_argument("--publishers", type=int, default=3)
    p.add_argument("--subscribers", type=int, default=7)
    p.add_argument("--heartbeat", type=float, default=0.25, help="seconds between heartbeats")
    p.add_argument("--dead-after", type=int, default=3, help="heartbeats missed: dead")
    p.add_argument("--failover-within", type=float, default=30.0)
    p.add_argument("--gap-min", type=float, default=2.0, help="seconds between faults, least")
    p.add_argument("--gap-max", type=float, default=6.0, help="seconds between faults, most")
    p.add_argument("--settle", type=float, default=120.0, help="seconds to get back in shape")
    p.add_argument(
        "--kinds",
        default=",".join(WEIGHTS),
        help=f"comma-separated fault kinds (default: all of {', '.join(WEIGHTS)})",
    )
    p.add_argument("--state-dir", type=Path, help="where the overlay runs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the state directory even if CLEAN")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    p.set_defaults(func=run_args)


def problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the arguments (nothing: an empty list)."""
    found = []
    unknown = sorted(set(args.kinds.split(",")) - set(WEIGHTS))
    if unknown:
        found.append(f"unknown fault kind(s) {unknown} (known: {', '.join(WEIGHTS)})")
    if args.brokers < 4:
        found.append("--brokers must be at least 4")
    if not 1 <= args.publishers <= args.brokers:
        found.append("--publishers must be between 1 and --brokers")
    if args.subscribers < 1:
        found.append("--subscribers must be at least 1")
    for name in ("rate", "duration", "settle", "heartbeat", "failover_within", "gap_min"):
        if not getattr(args, name) > 0:
            found.append(f"--{name.replace('_', '-')} must be above 0")
    if args.gap_max < args.gap_min:
        found.append("--gap-max must be at least --gap-min")
    if args.dead_after < 1:
        found.append("--dead-after must be at least 1")
    return found


def run_args(args: argparse.Namespace) -> int:
    wrong = problems(args)
    if wrong:
        for problem in wrong:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    result = asyncio.run(bench(args))
    for line in summary(result):
        print(line)
    if args.json:
        print(json.dumps(result, default=str))
    if result["verdict"] == "ERROR":
        return 2
    return 1 if result["verdict"].startswith("HARD") or "STUCK" in result["verdict"] else 0


# --------------------------------------------------------------------------- the judgement


@dataclass
class Counts:
    """What one subscriber got of one publisher's notifications, against what it was owed."""

    expected: int = 0
    got: int = 0
    lost_untold: int = 0
    lost_told: int = 0
    lost_told_slack: int = 0
    lost_after_giving_up: int = 0  # published after the client gave up failing over
    duplicated: int = 0
    reordered: int = 0
    spurious: int = 0
    untold_at: list[float] = field(default_factory=list)  # publish times (first 20)

    def add(self, other: Counts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.untold_at = self.untold_at[:20]

    @property
    def hard(self) -> bool:
        return bool(self.lost_untold or self.duplicated or self.reordered or self.spurious)

    @property
    def told(self) -> int:
        return self.lost_told + self.lost_told_slack


def judge(
    book: Mapping[int, tuple[float, Attrs]],
    seqs: Sequence[int],
    wants: Callable[[Attrs], bool],
    gaps: Iterable[Gap],
    *,
    gave_up_at: float = float("inf"),
    unacknowledged: Iterable[int] = (),
) -> Counts:
    """One subscriber's stream from one publisher (``seqs``, in arrival order) against what
    the publisher published (``book``: seq -> (publish time, attributes)). A publication
    never acknowledged is not owed (the publisher was told it may not have got through); one
    published after the client gave up failing over is counted apart."""
    gaps = list(gaps)
    skip = set(unacknowledged)
    owed = {s for s, (_, attrs) in book.items() if wants(attrs) and s not in skip}
    got = set(seqs)
    c = Counts(expected=len(owed), got=len(got))
    c.duplicated = len(seqs) - len(got)
    c.reordered = sum(1 for a, b in itertools.pairwise(seqs) if b < a)
    c.spurious = sum(1 for s in got if s not in book or not wants(book[s][1]))
    for s in sorted(owed - got):
        at = book[s][0]
        if at >= gave_up_at - SLACK:
            c.lost_after_giving_up += 1
        elif any(g.since <= at <= g.until for g in gaps):
            c.lost_told += 1
        elif any(g.since - SLACK <= at <= g.until + SLACK for g in gaps):
            c.lost_told_slack += 1
        else:
            c.lost_untold += 1
            if len(c.untold_at) < 20:
                c.untold_at.append(at)
    return c


def verdict(subscribers: Mapping[str, Mapping[str, Any]], stuck: bool) -> str:
    hard = any(s["counts"].hard for s in subscribers.values())
    told_nf = any(not s["failed"] and s["counts"].told for s in subscribers.values())
    word = "HARD" if hard else "TOLD-LOSS-AT-NONFAILED" if told_nf else "CLEAN"
    return word + ("+STUCK" if stuck else "")


# --------------------------------------------------------------------------- the run


def manifest(names: Sequence[str], edges: Iterable[tuple[str, str]], args: Any) -> str:
    brokers = ", ".join(f"{{name: {n}}}" for n in names)
    links = ", ".join(f"[{a}, {b}]" for a, b in edges)
    return (
        "apiVersion: canopy.dev/v1alpha1\nkind: BrokerOverlay\n"
        f"metadata: {{name: {OVERLAY}}}\nspec:\n  maxFanOut: 3\n"
        f"  failureDetection: {{heartbeatSeconds: {args.heartbeat}, "
        f"deadAfter: {args.dead_after}}}\n"
        f"  brokers: [{brokers}]\n  links: [{links}]\n"
    )


async def canopy(*args: str, within: float = 180.0) -> tuple[int, str, str]:
    """A ``canopy`` command in a process of its own, as a user runs it: its exit status and
    output. Raises TimeoutError (the process killed) if it runs longer than ``within``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "canopy_operator.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(within):
            out, err = await proc.communicate()
    except BaseException:  # a timeout, or this run cancelled: it must not go on without us
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


class Chaos:
    """One run: the overlay, the clients, the fault schedule and what each subscriber got."""

    def __init__(self, args: argparse.Namespace, state: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.attrs_rng = random.Random(args.seed * 7919 + 1)
        self.state = state
        self.where = state / OVERLAY
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.wall0 = time.time()
        self.names = [f"b{i}" for i in range(args.brokers)]
        self.declared = list(self.names)
        self.extra = ["x0", "x1"]  # brokers a reshape may add
        self.faults: list[dict[str, Any]] = []
        self.paused: dict[int, str] = {}
        self.cuts: list[tuple[str, int, str]] = []  # (broker, its pid, peer)
        self.pids: set[int] = set()
        self.reshaping: asyncio.Task[None] | None = None
        self.background: set[asyncio.Task[None]] = set()
        self.subs: dict[str, Client] = {}
        self.pubs: dict[str, Client] = {}
        self.sub_filter: dict[str, int] = {}
        self.home: dict[str, str] = {}
        self.received: dict[str, list[tuple[str, int]]] = {}
        self.gaps: dict[str, list[Gap]] = {}
        self.on_failed: dict[str, list[str]] = {}
        self.gave_up_at: dict[str, float] = {}
        self.books: dict[str, dict[int, tuple[float, Attrs]]] = {}
        self.pub_errors: dict[str, str] = {}
        self.backend: LocalBackend | None = None  # once `canopy up` made the overlay

    def now(self) -> float:
        return round(self.loop.time() - self.t0, 3)

    def note(self, kind: str, **what: Any) -> None:
        record = {"t": self.now(), "log_time": _log_time(time.time()), "kind": kind, **what}
        self.faults.append(record)
        progress(f"{record['t']:7.2f}s {kind} {what}")

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def state_now(self) -> LocalBackend:
        """The overlay's state as ``state.json`` says now (the supervisor rewrites it as it
        restarts brokers, on new ports)."""
        assert self.backend is not None, "the overlay is not up"
        for _ in range(20):
            try:
                self.backend.reload()
                break
            except ValueError:  # caught half-written
                time.sleep(0.05)
        return self.backend

    def admin(self, name: str) -> AdminClient:
        """A new admin client each time: a restarted broker listens on a new port."""
        state = self.state_now()
        return AdminClient(state.brokers[name]["admin"], state.state["token"], tls=state.admin_tls)

    def live(self) -> dict[str, dict[str, Any]]:
        """The brokers running now and not paused."""
        brokers = self.state_now().brokers
        self.pids.update(int(b["pid"]) for b in brokers.values())
        return {
            n: b
            for n, b in brokers.items()
            if process_alive(int(b["pid"])) and int(b["pid"]) not in self.paused
        }

    # -- setup and traffic

    async def up(self) -> None:
        edges = random_tree(len(self.names), self.rng, 3)
        (self.state / "m0.yaml").write_text(manifest(self.names, edges, self.args))
        code, out, err = await canopy(
            "up", str(self.state / "m0.yaml"), "--state-dir", str(self.state)
        )
        if code != 0:
            raise RuntimeError(f"canopy up failed: {out}{err}")
        self.backend = LocalBackend(self.where)
        progress(f"up: {len(self.names)} brokers, links {edges}")

    async def connect_clients(self) -> None:
        live = self.live()
        run = f"chaos{self.args.seed}-{int(time.time())}"
        creds = self.state_now().credentials
        for i in range(self.args.subscribers):
            sid = f"s{i}"
            self.home[sid] = home = self.rng.choice(self.names)
            got = self.received[sid] = []
            self.gaps[sid] = []

            def keep(batch: list[Notification], got: list[tuple[str, int]] = got) -> None:
                got.extend((n.publisher, n.seq) for n in batch)

            c = await connect(
                live[home]["listen"],
                f"canopy/{run}-{sid}",
                credentials=creds,
                on_gap=self.gaps[sid].append,
                on_notifications=keep,
                failover_within=self.args.failover_within,
            )
            self.sub_filter[sid] = i % len(FILTERS)
            await c.subscribe(FILTERS[self.sub_filter[sid]][0], sub_id="f")
            self.subs[sid] = c
        for j, home in enumerate(self.rng.sample(self.names, self.args.publishers)):
            pid = f"p{j}"
            self.home[pid] = home
            self.pubs[pid] = await connect(
                live[home]["listen"],
                f"canopy/{run}-{pid}",
                credentials=creds,
                failover_within=self.args.failover_within,
            )
            self.books[pid] = {}
        progress(f"clients: {', '.join(f'{c} on {b}' for c, b in self.home.items())}")
        await asyncio.sleep(1.0)  # the subscriptions reach every broker

    async def publish(self, pid: str, stop: asyncio.Event) -> None:
        c, book = self.pubs[pid], self.books[pid]
        rate, n, start = self.args.rate / len(self.pubs), 0, self.loop.time()
        try:
            while not stop.is_set():
                while n < int((self.loop.time() - start) * rate) and not stop.is_set():
                    n += 1
                    attrs: dict[str, Value] = {
                        "n": n,
                        "sym": self.attrs_rng.choice(SYMBOLS),
                        "price": self.attrs_rng.randrange(100),
                    }
                    # Booked before it is sent: publish() sends it, then may wait (and
                    # raise, if the client gives up failing over), and a notification
                    # subscribers got but the book lacked would count as spurious.
                    seq = c.last_seq + 1
                    book[seq] = (self.loop.time(), attrs)
                    try:
                        await c.publish(attrs)
                    finally:
                        if c.last_seq < seq:  # refused before it was sent
                            del book[seq]
                with contextlib.suppress(Exception):
                    await c.flush()
                await asyncio.sleep(0.01)
        except Exception as exc:  # the client gave up failing over: its verdict says so
            self.pub_errors[pid] = repr(exc)
            self.note("publisher-error", publisher=pid, error=repr(exc))

    async def watch_failovers(self) -> None:
        """When each subscriber began the failover it gave up on (what it was not owed)."""
        began: dict[str, float] = {}
        while True:
            for sid, c in self.subs.items():
                if c.failing_over:
                    began.setdefault(sid, self.loop.time())
                elif sid in began:
                    at = began.pop(sid)
                    if c.failover_error is not None:
                        self.gave_up_at[sid] = at
            await asyncio.sleep(0.05)

    # -- faults

    def mark_failed(self, brokers: set[str], kind: str) -> None:
        for sid, c in self.subs.items():
            with contextlib.suppress(Exception):
                if c.broker in brokers:
                    self.on_failed.setdefault(sid, []).append(f"{kind}:{c.broker}@{self.now()}")

    async def pause(self, name: str, pid: int, seconds: float) -> None:
        self.paused[pid] = name
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(seconds)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self.paused.pop(pid, None)
        self.note("cont", broker=name)

    async def neighbours(self, name: str) -> list[str]:
        admin = self.admin(name)
        try:
            async with asyncio.timeout(3):
                status = await admin.status()
        except Exception:  # one that does not answer offers no neighbour to draw
            return []
        finally:
            await admin.close()
        return [n["peer"] for n in status["neighbours"] if n.get("state") == "up"]

    async def one_fault(self, kind: str) -> None:
        live = self.live()
        if len(live) < 3:
            self.note("skip", reason=f"only {len(live)} brokers live")
            return
        names = sorted(live)
        v = self.rng.choice(names)
        pid = int(live[v]["pid"])
        if kind in ("kill", "pause"):
            self.mark_failed({v}, kind)
            if kind == "kill":
                self.note("kill", broker=v)
                os.kill(pid, signal.SIGKILL)
            else:
                seconds = round(self.rng.uniform(0.2, 3.0), 2)
                self.note("pause", broker=v, seconds=seconds)
                self.spawn(self.pause(v, pid, seconds))
            return
        if kind == "reshape":
            self.reshape()
            return
        near = [n for n in await self.neighbours(v) if n in live]
        if not near:
            self.note("skip", reason=f"{v} has no live neighbour")
            return
        w = self.rng.choice(near)
        wpid = int(live[w]["pid"])
        if kind == "kill_pair":
            self.mark_failed({v, w}, kind)
            self.note(kind, brokers=[v, w])
            os.kill(pid, signal.SIGKILL)
            os.kill(wpid, signal.SIGKILL)
        elif kind == "kill_while_paused":
            seconds = round(self.rng.uniform(0.5, 3.0), 2)
            self.mark_failed({v, w}, kind)
            self.note(kind, paused=v, killed=w, seconds=seconds)
            self.spawn(self.pause(v, pid, seconds))
            await asyncio.sleep(self.rng.uniform(0.0, 0.5))
            os.kill(wpid, signal.SIGKILL)
        elif kind == "pause_pair":
            s1, s2 = (round(self.rng.uniform(0.2, 2.5), 2) for _ in range(2))
            self.mark_failed({v, w}, kind)
            self.note(kind, brokers=[v, w], seconds=[s1, s2])
            self.spawn(self.pause(v, pid, s1))
            self.spawn(self.pause(w, wpid, s2))
        else:  # cut (healed later) or drop (the connection only: it reconnects)
            admin = self.admin(v)
            try:
                if kind == "cut":
                    ok = await admin.cut_link(w)
                    heal = round(self.rng.uniform(1.0, 8.0), 2)
                    self.note("cut", broker=v, peer=w, ok=ok, heal_after=heal)
                    self.cuts.append((v, pid, w))
                    self.spawn(self.heal_later(v, pid, w, heal))
                else:
                    self.note("drop", broker=v, peer=w, ok=await admin.drop_link_connection(w))
            finally:
                await admin.close()

    def reshape(self) -> None:
        """A new declared shape (a broker added or removed, or relinked), applied by ``canopy
        apply`` while the faults go on."""
        if self.reshaping is not None and not self.reshaping.done():
            self.note("skip", reason="the last reshape is still being applied")
            return
        names = list(self.declared)
        draw = self.rng.random()
        if draw < 0.3 and any(x not in names for x in self.extra):
            names.append(next(x for x in self.extra if x not in names))
            what = f"add {names[-1]}"
        elif draw < 0.55 and len(names) > 6:
            gone = self.rng.choice(names)
            names.remove(gone)
            what = f"remove {gone}"
        else:
            what = "relink"
        order = sorted(names)
        edges = [
            (order[int(a[1:])], order[int(b[1:])]) for a, b in random_tree(len(order), self.rng, 3)
        ]
        self.declared = names
        path = self.state / f"m{len(self.faults)}.yaml"
        path.write_text(manifest(names, edges, self.args))
        self.note("reshape", what=what, links=edges)
        self.reshaping = asyncio.ensure_future(self.apply(path))

    async def apply(self, path: Path) -> None:
        try:
            code, _, err = await canopy(
                "apply", str(path), "--state-dir", str(self.state), "--json", within=240
            )
        except TimeoutError:
            code, err = -1, "canopy apply took over 240 s"
        self.note("applied", manifest=path.name, code=code, err=err.strip()[-300:])

    async def heal_later(self, v: str, pid: int, w: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self.heal(v, pid, w)

    async def heal(self, v: str, pid: int, w: str) -> None:
        if (v, pid, w) not in self.cuts:
            return
        self.cuts.remove((v, pid, w))
        if not process_alive(pid):
            self.note("heal-skipped", broker=v, peer=w, reason="the process is gone")
            return
        admin = self.admin(v)
        try:
            self.note("heal", broker=v, peer=w, ok=await admin.heal_link(w))
        except Exception as exc:  # noted: the run goes on
            self.note("heal-failed", broker=v, peer=w, error=repr(exc))
        finally:
            await admin.close()

    async def inject(self, stop: asyncio.Event) -> None:
        kinds = self.args.kinds.split(",")
        weights = [WEIGHTS[k] for k in kinds]
        await asyncio.sleep(self.rng.uniform(1.0, 3.0))
        while not stop.is_set():
            kind = self.rng.choices(kinds, weights)[0]
            try:
                await self.one_fault(kind)
            except Exception as exc:  # a fault that could not be made is noted, not fatal
                self.note("fault-error", fault=kind, error=repr(exc))
            with contextlib.suppress(TimeoutError):
                gap = self.rng.uniform(self.args.gap_min, self.args.gap_max)
                await asyncio.wait_for(stop.wait(), gap)

    # -- the end

    async def settle(self) -> dict[str, Any]:
        """Until ``canopy status`` says healthy, not restoring, and in the declared shape;
        if it never does, what it said last, and how its links differ from the declared."""
        deadline = self.loop.time() + self.args.settle
        status: dict[str, Any] = {}
        extra: set[tuple[str, ...]] = set()
        absent: set[tuple[str, ...]] = set()
        while self.loop.time() < deadline:
            with contextlib.suppress(ValueError, IndexError, TimeoutError):
                _, out, _ = await canopy(
                    "status", "--state-dir", str(self.state), "--json", within=60
                )
                status = json.loads(out.strip().splitlines()[-1])
            declared_manifest = self.state_now().state.get("spec") or {}  # the last applied
            spec = declared_manifest.get("spec") or {}
            links = {tuple(sorted(e)) for e in status.get("links", [])}
            declared = {tuple(sorted(e)) for e in spec.get("links", links)}
            extra, absent = links - declared, declared - links
            if status.get("healthy") and not status.get("restoring") and not extra | absent:
                took = self.args.settle - (deadline - self.loop.time())
                return {"settled": True, "after_s": round(took, 1)}
            await asyncio.sleep(1.0)
        return {
            "settled": False,
            "healthy": status.get("healthy"),
            "restoring": status.get("restoring"),
            "problems": status.get("problems"),
            "links_not_declared": sorted(extra),
            "declared_links_missing": sorted(absent),
        }

    async def wait_delivered(self, within: float) -> None:
        """Until every subscriber has each publisher's last notification owed to it, or nothing
        arrived for 8 s."""
        last_owed = {
            (sid, pid): max(s for s, (_, a) in book.items() if FILTERS[self.sub_filter[sid]][1](a))
            for sid in self.subs
            for pid, book in self.books.items()
            if any(FILTERS[self.sub_filter[sid]][1](a) for _, a in book.values())
        }
        ids = {pid: c.client_id for pid, c in self.pubs.items()}
        deadline, before, quiet = self.loop.time() + within, -1, self.loop.time()
        while self.loop.time() < deadline:
            if all(
                any(p == ids[pid] and s >= last for p, s in self.received[sid][-2000:])
                for (sid, pid), last in last_owed.items()
            ):
                await asyncio.sleep(1.0)  # late duplicates would still show
                return
            total = sum(len(r) for r in self.received.values())
            if total != before:
                before, quiet = total, self.loop.time()
            elif self.loop.time() - quiet > 8:
                return
            await asyncio.sleep(0.2)

    def judged(self, unacked: Mapping[str, list[int]]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        ids = {c.client_id: pid for pid, c in self.pubs.items()}
        for sid, c in self.subs.items():
            by_pub: dict[str, list[int]] = {pid: [] for pid in self.pubs}
            spurious = 0
            for publisher, seq in self.received[sid]:
                if publisher in ids:
                    by_pub[ids[publisher]].append(seq)
                else:
                    spurious += 1
            wants = FILTERS[self.sub_filter[sid]][1]
            total, per = Counts(spurious=spurious), {}
            for pid, seqs in by_pub.items():
                per[pid] = judge(
                    self.books[pid],
                    seqs,
                    wants,
                    self.gaps[sid],
                    gave_up_at=self.gave_up_at.get(sid, float("inf")),
                    unacknowledged=unacked[pid],
                )
                total.add(per[pid])
            out[sid] = {
                "home": self.home[sid],
                "filter": FILTERS[self.sub_filter[sid]][0],
                "failovers": c.failovers,
                "failed": bool(self.on_failed.get(sid)) or c.failovers > 0,
                "on_failed": self.on_failed.get(sid, []),
                "counts": total,
                "untold_at": [round(t - self.t0, 3) for t in total.untold_at],
                # Each publisher whose notifications this subscriber lacked or had twice, apart:
                # the totals alone did not say whose (a helper tracing a HARD run had to infer
                # the publisher from the times).
                "by_publisher": {
                    pid: {
                        "counts": cnt,
                        "untold_at": [round(t - self.t0, 3) for t in cnt.untold_at],
                    }
                    for pid, cnt in per.items()
                    if cnt.hard or cnt.told or cnt.lost_after_giving_up
                },
                "gaps": [
                    {
                        "since": round(g.since - self.t0, 3),
                        "until": round(g.until - self.t0, 3),
                        "broker": g.broker,
                        "reason": g.reason,
                    }
                    for g in self.gaps[sid]
                ],
            }
        return out

    async def main(self) -> dict[str, Any]:
        await self.up()
        await self.connect_clients()
        self.spawn(self.watch_failovers())
        stop_publishing, stop_faults = asyncio.Event(), asyncio.Event()
        publishing = [asyncio.ensure_future(self.publish(p, stop_publishing)) for p in self.pubs]
        self.background.update(publishing)  # cancelled by down() if this run is
        await asyncio.sleep(2.0)
        injecting = asyncio.ensure_future(self.inject(stop_faults))
        self.background.add(injecting)
        await asyncio.sleep(self.args.duration)
        stop_faults.set()
        await injecting
        self.note("faults-stopped")
        await asyncio.sleep(3.2)  # the pauses end
        for cut in list(self.cuts):
            await self.heal(*cut)
        if self.reshaping is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self.reshaping), 240)
        settled = await self.settle()
        self.note("settled", **settled)
        await asyncio.sleep(3.0)  # traffic over the restored tree
        stop_publishing.set()
        await asyncio.gather(*publishing)
        acked: dict[str, bool] = {}
        for pid, c in self.pubs.items():
            try:
                acked[pid] = await c.wait_acknowledged(30.0)
            except Exception:  # gave up failing over: not acknowledged
                acked[pid] = False
        unacked = {pid: c.unacknowledged_seqs for pid, c in self.pubs.items()}
        await self.wait_delivered(30.0)
        subscribers = self.judged(unacked)
        # A subscriber that gave up failing over went without a broker for failover_within:
        # what it missed after is not counted as lost, so the run is not clean either.
        stuck = not settled["settled"] or not all(acked.values()) or bool(self.gave_up_at)
        return {
            "seed": self.args.seed,
            "started": _log_time(self.wall0),  # t = 0 of faults.json and untold_at, as in the logs
            "verdict": verdict(subscribers, stuck),
            "faults": dict(
                sorted(Counter(f["kind"] for f in self.faults if f["kind"] in WEIGHTS).items())
            ),
            "settled": settled,
            "acknowledged": acked,
            "published": {pid: len(book) for pid, book in self.books.items()},
            "publisher_errors": self.pub_errors,
            "subscribers": subscribers,
        }

    async def down(self) -> None:
        for pid in list(self.paused):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for task in [*self.background, *([self.reshaping] if self.reshaping else [])]:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        for c in [*self.pubs.values(), *self.subs.values()]:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await c.close()
        if self.backend is not None:  # every process of the run, before `down` forgets them
            with contextlib.suppress(Exception):
                self.live()
                supervisor = self.backend.supervisor_pid()
                if supervisor is not None:
                    self.pids.add(supervisor)
        with contextlib.suppress(Exception):
            await canopy("down", "--state-dir", str(self.state), within=60)
        for pid in self.pids:  # whatever `down` missed (a broker restarted meanwhile)
            if process_alive(pid) and _is_canopy(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.backend is not None:
            await self.backend.close()


def _is_canopy(pid: int) -> bool:
    """Whether ``pid`` still runs a Canopy process (not another that took the number over)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"canopy_broker" in command or b"canopy_operator" in command


def _log_time(at: float) -> str:
    """A time as the brokers' logs write it (local time), to find a moment of the run there."""
    return time.strftime("%H:%M:%S", time.localtime(at)) + f",{int(at % 1 * 1000):03d}"


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="canopy-chaos-"))
    state.mkdir(parents=True, exist_ok=True)
    chaos = Chaos(args, state)
    try:
        result = await chaos.main()
    except Exception as exc:  # the harness, not the overlay: no verdict
        result = {"seed": args.seed, "verdict": "ERROR", "error": repr(exc)}
        progress(f"the run failed: {exc!r}")
    finally:
        (state / "faults.json").write_text(json.dumps(chaos.faults, indent=1))
        await chaos.down()
    clean = result["verdict"] == "CLEAN"
    if clean and not args.keep and args.state_dir is None:
        shutil.rmtree(state, ignore_errors=True)
    else:
        (state / "result.json").write_text(json.dumps(result, indent=1, default=_plain))
        result["kept"] = str(state)
    return json.loads(json.dumps(result, default=_plain))  # type: ignore[no-any-return]


def _plain(obj: object) -> object:
    if isinstance(obj, Counts):
        return {k: v for k, v in vars(obj).items() if k != "untold_at"}
    return str(obj)


def summary(result: Mapping[str, Any]) -> list[str]:
    lines = [f"seed {result['seed']}: faults {result.get('faults', {})}"]
    if "error" in result:
        lines.append(f"the run failed: {result['error']}")
    for sid, s in result.get("subscribers", {}).items():
        c = s["counts"]
        lines.append(
            f"{sid} (home {s['home']}, {s['failovers']} failovers): owed {c['expected']}, "
            f"lost untold {c['lost_untold']}, told {c['lost_told'] + c['lost_told_slack']}, "
            f"after giving up {c['lost_after_giving_up']}, duplicated {c['duplicated']}, "
            f"reordered {c['reordered']}, spurious {c['spurious']}"
        )
    if "kept" in result:
        lines.append(f"logs, fault schedule and result kept in {result['kept']}")
    lines.append(f"VERDICT {result['verdict']}")
    return lines
