"""The demo's scenario, phase by phase: start, subscribe and settle, traffic, reshape live,
self-organisation (mining), a crash, and the verified report."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from canopy_broker.admin_client import AdminError
from canopy_broker.client import Client, connect
from canopy_broker.core.filters import Filter
from canopy_broker.sim.checker import (
    PubRecord,
    SubRecord,
    check_deliveries,
)
from canopy_broker.sim.topology import random_tree
from canopy_operator.backends.local import LocalBackend
from canopy_operator.commands.demo.shapes import draw_tree, far_apart, overlay_manifest, reshaped
from canopy_operator.commands.demo.summary import summarise
from canopy_operator.commands.demo.traffic import (
    FILTERS,
    GROUP_FILTER,
    Subscriber,
    collect,
    drain,
    hops_of,
    mean_hops_between,
    milestone,
    progress,
    publish_until,
    report_progress,
    showing,
)
from canopy_operator.commands.local import apply, roll
from canopy_operator.commands.selforg import (
    TELEMETRY_ARGS,
    apply_proposal,
    describe,
    measure_overlay,
    mine_overlay,
    start_spark,
)
from canopy_operator.commands.supervise import restore_once
from canopy_operator.draw import draw
from canopy_operator.mining.errors import MiningInputError
from canopy_operator.model.topology import parse_overlay


async def settle(backend: LocalBackend, within: float = 30.0) -> int:
    """Wait until every link is up and idle and routing tables stop changing."""
    previous: list[Any] | None = None
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        names = sorted(backend.brokers)
        statuses = [await backend.admin(n).status() for n in names]
        tables = [(await backend.admin(n).routing())["table"] for n in names]
        quiet = all(
            x["state"] == "up" and x["queue_depth"] == 0 for s in statuses for x in s["neighbours"]
        )
        if quiet and tables == previous:
            return sum(len(keys) for t in tables for keys in t["links"].values())
        previous = tables if quiet else None
        await asyncio.sleep(0.05)
    raise TimeoutError("routing did not settle")


async def protocol_messages(backend: LocalBackend, xids: list[Any]) -> dict[str, int]:
    """Reconfiguration protocol messages every live broker sent for these exchanges."""
    total: Counter[str] = Counter()
    for name in sorted(backend.brokers):
        for xid in xids:
            if not xid:
                continue
            with contextlib.suppress(AdminError):
                rec = await backend.admin(name).reconfiguration(xid)
                total.update(rec.get("messages_sent_here", {}))
    return dict(total)


async def demo(args: argparse.Namespace) -> dict[str, Any]:
    """The whole demo, with a progress bar of its phases on a terminal (lines elsewhere)."""
    phases = 5 + bool(args.mining) + 2 * bool(args.crash)
    with showing(phases):
        return await _demo(args)


async def _demo(args: argparse.Namespace) -> dict[str, Any]:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    rng = random.Random(seed)
    n = max(4, args.brokers)
    names = [f"b{i}" for i in range(n)]
    edges = random_tree(n, rng, max_fanout=3)
    out_dir: Path = args.out
    print(f"Overlay of {n} brokers (seed {seed}, {args.routing} routing):")
    print(draw_tree(names, edges))
    state = Path(tempfile.mkdtemp(prefix="canopy-demo-"))
    backend = LocalBackend(state / "demo", routing=args.routing, broker_args=TELEMETRY_ARGS)
    clients: list[Client] = []
    steps_report: list[dict[str, Any]] = []
    try:
        progress(f"starting {n} broker processes with the operator's planner and executor ...")
        manifest1 = overlay_manifest("demo", names, edges, args.routing)
        await apply(parse_overlay(manifest1), manifest1, backend, log=progress)
        milestone(f"{n} brokers up")
        victim = rng.choice(names[1:])  # leaves the overlay later, with its clients
        added = f"b{n}"
        subscribers = []
        far = far_apart(edges, exclude=victim)
        # A broker without clients, inner if the tree has one to spare: crashed at the end.
        degree = Counter(b for e in edges for b in e)
        spares = [b for b in names[1:] if b != victim and b not in far and degree[b] >= 2]
        spare = spares[0] if spares else None  # no draw: the seeded workload stays as it was
        placeable = [b for b in names if b != spare]
        for i in range(args.subscribers):
            chosen = rng.sample(FILTERS, rng.choice([1, 1, 2]))
            broker = victim if i < 2 else rng.choice(placeable)
            if i in (2, 3):  # one interest, two brokers far apart: what self-organisation fixes
                chosen, broker = [GROUP_FILTER], far[i - 2]
            subscribers.append(
                Subscriber(
                    f"sub{i}", broker, {f"s{k}": Filter.parse(t) for k, t in enumerate(chosen)}
                )
            )
        for s in subscribers:
            s.client = await connect(
                backend.address(s.broker), client_id=s.name, credentials=backend.credentials
            )
            clients.append(s.client)
            for sub_id, f in s.filters.items():
                await s.client.subscribe(str(f), sub_id=sub_id)
        progress("subscriptions sent; waiting until routing has settled on every broker")
        entries = await settle(backend)
        milestone(f"{len(subscribers)} subscribers' routes settled ({entries} entries)")
        pub_brokers = [victim] + [rng.choice(placeable) for _ in range(args.publishers - 1)]
        publishers = []
        for i, b in enumerate(pub_brokers):
            c = await connect(
                backend.address(b), client_id=f"pub{i}", credentials=backend.credentials
            )
            clients.append(c)
            publishers.append(c)
        pubs: list[PubRecord] = []
        stop, stop_pub = asyncio.Event(), asyncio.Event()
        collectors = [asyncio.create_task(collect(s, stop)) for s in subscribers]
        t0 = time.perf_counter()
        ticker = asyncio.create_task(report_progress(subscribers, pubs, t0))
        per_pub = args.rate / max(1, len(publishers))
        publishing = [
            asyncio.create_task(
                publish_until(c, random.Random(seed + i + 1), per_pub, stop_pub, pubs)
            )
            for i, c in enumerate(publishers)
        ]
        milestone(f"publishing ~{args.rate}/s from {len(publishers)} publishers")
        await asyncio.sleep(args.duration / 2)
        live = await backend.live_links()
        manifest2, n_ex = reshaped(
            names, victim, added, live, rng=rng, routing=args.routing, apart=far
        )
        draw(names, live, out_dir / "before.png", title="before")
        progress(
            f"applying a new shape: {n_ex} link exchanges, add {added}, remove {victim} "
            f"(its clients migrate) — traffic keeps flowing"
        )
        p, executor, apply_wall = await apply(
            parse_overlay(manifest2), manifest2, backend, log=progress
        )
        after = await backend.live_links()
        reshaped_at = time.time()
        milestone(f"reshaped live in {apply_wall:.2f}s")
        draw(sorted(backend.brokers), after, out_dir / "after.png", title="after")
        control = await protocol_messages(backend, [r.detail.get("xid") for r in executor.results])
        steps_report = [
            {"step": r.index + 1, "kind": r.kind, "seconds": round(r.seconds, 3), **r.detail}
            for r in sorted(executor.results, key=lambda r: r.index)
        ]
        await asyncio.sleep(args.duration / 2)
        selforg = None
        if args.mining:
            try:
                selforg = await self_organise(
                    args, backend, manifest2, subscribers, since=reshaped_at
                )
            except (MiningInputError, RuntimeError) as exc:  # e.g. no Java, nothing sampled
                print(f"self-organisation skipped: {exc}", file=sys.stderr)
                selforg = {"skipped": str(exc)}
            milestone("self-organisation done")
        crash = rolled = None
        if args.crash:
            busy = {s.broker for s in subscribers} | set(pub_brokers)
            crash = await crash_phase(backend, busy, prefer=spare)
            milestone("crash repaired")
            rolled = await roll_phase(backend, busy & set(backend.brokers))
            milestone("rolling replacement done")
            await asyncio.sleep(1.0)  # traffic over the replaced brokers
        stop_pub.set()
        await asyncio.gather(*publishing)
        publish_wall = time.perf_counter() - t0
        subs_records = [
            SubRecord(s.name, sid, f, issued_at=0.0, settled_at=0.0)
            for s in subscribers
            for sid, f in s.filters.items()
        ]
        await drain(subscribers, subs_records, pubs)
        milestone("every notification collected")
        ticker.cancel()
        stop.set()
        await asyncio.gather(*collectors, ticker, return_exceptions=True)
        final_links = [list(e) for e in after]
        wanted = sorted(sorted(e) for e in manifest2["spec"]["links"])
        shape_ok = sorted(sorted(e) for e in after) == wanted
    finally:
        for c in clients:
            await c.close()
        await backend.down()
        shutil.rmtree(state, ignore_errors=True)
    report = check_deliveries(subs_records, pubs, [d for s in subscribers for d in s.received])
    result = summarise(
        args,
        seed=seed,
        subscribers=subscribers,
        pubs=pubs,
        report=report,
        publish_wall=publish_wall,
        entries=entries,
        subs=subs_records,
    )
    for row in steps_report:
        print(
            f"  step {row['step']:>2} {row['kind']:<11} {row['seconds']:>6.3f}s "
            + " ".join(f"{k}={v}" for k, v in row.items() if k not in ("step", "kind", "seconds"))
        )
    print(
        f"reshaped live in {apply_wall:.2f}s: {len(p.exchanges)} exchanges, 1 broker added, "
        f"1 removed; final links {'as declared' if shape_ok else 'DIFFER from the manifest'}; "
        f"pictures: {out_dir / 'before.png'}, {out_dir / 'after.png'}"
    )
    print(
        f"reconfiguration protocol messages (all brokers): {sum(control.values())} "
        + ", ".join(f"{k} {v}" for k, v in sorted(control.items()))
    )
    if crash is not None:
        print(
            f"crashed {crash['broker']} (SIGKILL, no clients on it) under traffic: repaired in "
            f"{crash['repaired_s']:.2f}s "
            + (
                "with new links " + ", ".join(f"{a}-{b}" for a, b in crash["new_links"])
                if crash["new_links"]
                else "with no new link (it was a leaf: the rest was still one tree)"
            )
            + f", declared shape restored {crash['restored_s']:.2f}s after the kill"
            + "; the delivery check above covers everything published meanwhile"
        )
    if rolled is not None:
        print(
            f"rolling replacement of {', '.join(rolled['brokers'])} (clients migrated, new "
            f"processes) under traffic in {rolled['seconds']:.2f}s, {rolled['steps']} steps; "
            "covered by the delivery check too"
        )
    result.update(
        control_messages=sum(control.values()),
        control_messages_by_type=control,
        exchanges=len(p.exchanges),
        brokers_added=1,
        brokers_removed=1,
        reshape_seconds=round(apply_wall, 3),
        self_organization=selforg,
        crash=crash,
        rolling_replacement=rolled,
        steps=steps_report,
        final_links=final_links,
    )
    result["ok"] = result["ok"] and shape_ok
    return result


async def crash_phase(
    backend: LocalBackend, busy: set[str], prefer: str | None
) -> dict[str, Any] | None:
    """SIGKILL an inner broker that has no clients, under traffic: its neighbours detect it,
    repair the tree around it and replay what it swallowed; the delivery check that follows
    covers every notification published meanwhile."""
    live = await backend.live_links()
    degree: Counter[str] = Counter(b for e in live for b in e)
    # Clients move during the demo (the removed broker's went to a neighbour, maybe the spare):
    # ask each broker whether it has any now, not only where they started.
    serving = {b for b in degree if (await backend.admin(b).status()).get("clients")}
    free = sorted(degree, key=lambda b: (degree[b] < 2, b != prefer, b))
    free = [b for b in free if b not in busy and b not in serving]
    if not free:
        progress("crash: every broker has clients; skipped")
        return None
    victim = free[0]  # inner if one is free of clients (the spare kept for this), else a leaf
    neighbours = sorted(b for e in live for b in e if victim in e and b != victim)
    progress(
        f"crash: SIGKILL {victim} (neighbours {', '.join(neighbours)}) — traffic keeps flowing"
    )
    killed = time.monotonic()
    os.kill(int(backend.brokers[victim]["pid"]), signal.SIGKILL)
    others = [b for b in backend.brokers if b != victim]
    repaired_s = None
    async with asyncio.timeout(60):
        while repaired_s is None:
            links: set[tuple[str, str]] = set()
            for b in others:
                status = await backend.admin(b).status()
                for n in status["neighbours"]:
                    x, y = sorted((b, str(n["peer"])))
                    links.add((x, y))
            left = {e for e in live if victim not in e}
            one_tree = len(links) == len(others) - 1  # over the survivors, without the victim
            if left <= links and one_tree and not any(victim in e for e in links):
                repaired_s = time.monotonic() - killed
                break
            await asyncio.sleep(0.05)
    added = sorted(links - {e for e in live})
    progress(
        f"crash: repaired {repaired_s:.2f}s after the kill; new links "
        + (", ".join(f"{a}-{b}" for a, b in added) or "none (a leaf)")
    )
    await asyncio.sleep(1.0)  # traffic over the repaired tree
    # What `canopy up`'s supervisor does: bring the dead broker back in the declared shape.
    restored = None
    async with asyncio.timeout(60):
        while restored is None:
            restored = await restore_once(backend, [victim], log=progress)
            if restored is None:
                await asyncio.sleep(0.2)
    restored_s = time.monotonic() - killed
    progress(
        f"crash: {victim} restored in the declared shape {restored_s:.2f}s after the kill "
        f"({restored['steps']} steps, {restored['exchanges']} exchanges)"
    )
    return {
        "broker": victim,
        "repaired_s": round(repaired_s, 3),
        "new_links": added,
        "restored_s": round(restored_s, 3),
        "restore_steps": restored["steps"],
    }


async def roll_phase(backend: LocalBackend, busy: set[str]) -> dict[str, Any]:
    """A rolling replacement of two brokers with clients, under traffic: each goes out by
    exchanges with its clients migrated, and comes back as a new process."""
    links = await backend.live_links()
    degree: Counter[str] = Counter(b for e in links for b in e)
    targets = sorted(busy, key=lambda b: (-degree[b], b))[:2]  # an inner one if any
    progress(f"rolling replacement of {', '.join(targets)} (they have clients) under traffic")
    spec = parse_overlay(backend.state["spec"])
    started = time.monotonic()
    results = await roll(spec, backend, targets, log=progress)
    return {
        "brokers": [r["broker"] for r in results],
        "seconds": round(time.monotonic() - started, 3),
        "steps": sum(r["steps"] for r in results),
    }


async def self_organise(
    args: argparse.Namespace,
    backend: LocalBackend,
    manifest: dict[str, Any],
    subscribers: list[Subscriber],
    *,
    since: float,
) -> dict[str, Any]:
    """Mine the telemetry of the traffic since the reshaping; print the proposals; with
    ``--self-organize`` apply the best one live and measure the hops again."""
    progress("self-organisation: mining the brokers' telemetry on Spark (local mode) ...")
    spark = await asyncio.to_thread(start_spark, args.spark_master)
    window_start = hops_of(subscribers)
    result = await mine_overlay(backend, manifest, spark, since_ts=since, progress=progress)
    clients_before = mean_hops_between(window_start, hops_of(subscribers))
    proposals = result.proposals()
    print()
    print("Self-organisation (paper 001): the miner's view of the live overlay")
    for line in describe(result, {i: p.name or "" for i, p in enumerate(proposals)}):
        print(f"  {line}")
    report: dict[str, Any] = {
        "measured_before": result.traffic.to_json(),
        "associativity_before": round(result.total_as, 4),
        "proposals": [
            {"name": p.name, "changes": [[list(r), list(a)] for r, a in p.changes], **p.evidence}
            for p in proposals
        ],
        "applied": None,
    }
    if not args.self_organize:
        print("  (run with --self-organize to apply the best proposal live)")
        return report
    if not proposals:
        print("  nothing to apply: no exchange would lower the hops")
        return report
    best = proposals[0]
    progress(f"applying proposal {best.name} live — traffic keeps flowing")
    target, the_plan, _, wall = await apply_proposal(backend, manifest, best, progress=progress)
    applied_at, window_start = time.time(), hops_of(subscribers)
    await asyncio.sleep(max(2.0, args.duration / 2))
    clients_after = mean_hops_between(window_start, hops_of(subscribers))
    after = await measure_overlay(backend, target, spark, since_ts=applied_at)
    links = await backend.live_links()
    draw(
        sorted(backend.brokers),
        links,
        args.out / "self-organized.png",
        title=f"self-organized: {best.name} applied (added link in red)",
        highlight=[a for _, a in best.changes],
    )
    before = result.traffic
    print(
        f"  applied {best.name} in {wall:.2f}s ({len(the_plan.exchanges)} exchange): "
        f"hops per notification {before.hops_per_delivery:.3f} → {after.hops_per_delivery:.3f}, "
        f"hops per event {before.hops_per_event:.3f} → {after.hops_per_event:.3f}, "
        f"pure-forwarder rate {before.pure_forwarder_rate:.1%} → "
        f"{after.pure_forwarder_rate:.1%} (telemetry); mean hops per delivery seen by the "
        f"subscribers {clients_before:.3f} → {clients_after:.3f}; picture: "
        f"{args.out / 'self-organized.png'}"
    )
    report["applied"] = {
        "proposal": best.name,
        "seconds": round(wall, 3),
        "measured_after": after.to_json(),
        "client_hops_before": round(clients_before, 4),
        "client_hops_after": round(clients_after, 4),
        "links": [list(e) for e in links],
    }
    return report
