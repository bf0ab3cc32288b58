"""``canopy bench subscriptions``: how subscription load scales in a real overlay.

Brokers are real processes on 127.0.0.1 (covering routing), linked as a binary tree of
``--brokers`` brokers. Measured, each for N in ``--counts``:

* **install**: ``--clients`` clients on the deepest leaf send N subscriptions ``k = i``
  (distinct values, so none covers another and every broker must hold all N), ``--batch`` in
  flight at a time, each client sending its share of a batch at once
  (:meth:`Client.subscribe_many`); the figure is the time until every broker's routing table
  holds them (polled through the admin API); the brokers' CPU per subscription per broker
  meanwhile (flat from one N to the next when insertion cost does not grow with the table:
  the tables hold the earlier runs' subscriptions too), and the same in each tenth of the
  install (from the first tenth to the last, the growth within one table); and the time per
  1,000 for the first
  and the last 1,000 acknowledgements (which also grows as the other brokers, busy with the
  earlier ones, take their share of the machine's cores);
* **longest stall**: every broker times its own event loop (a callback due every 10 ms; the
  lateness is how long nothing else could run, heartbeats included) and its full garbage
  collections, and reports the stalls in ``/status``; the figure is the longest of any broker
  during the install (and during the churn);
* **churn**: with the table full, a publisher on the root sends ``--rate`` events/s while another
  client subscribes and unsubscribes as fast as acknowledgements come back for ``--churn-seconds``;
  a steady subscriber counts what it received against what was published (must be all);
* **leave**: the subscribing clients close, each holding thousands of subscriptions; the
  figure is the time until no broker holds any of them, and the longest stall meanwhile.

Progress goes to stderr; with ``--json`` the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

from canopy_broker import bench_plots
from canopy_broker import progress as shown
from canopy_broker.client import Client, connect
from canopy_broker.procs import Overlay
from canopy_broker.runtime import eventloop


def progress(msg: str) -> None:
    shown.report("bench subscriptions", msg)


def tree(n: int) -> tuple[list[str], list[tuple[str, str]]]:
    names = [f"b{i}" for i in range(n)]
    return names, [(names[(i - 1) // 2], names[i]) for i in range(1, n)]


def _said(stalls: dict[str, Any]) -> str:
    return (
        f"longest event-loop stall {stalls['longest_stall_s'] * 1000:.0f} ms "
        f"({stalls['longest_stall_broker'] or 'none over 10 ms'}; "
        f"{stalls['longest_stall_cpu_s'] * 1000:.0f} ms of it on CPU), longest on CPU "
        f"{stalls['longest_busy_stall_s'] * 1000:.0f} ms, longest GC "
        f"{stalls['longest_gc_pause_s'] * 1000:.0f} ms"
    )


async def _table_sizes(overlay: Overlay) -> dict[str, int]:
    return {name: int(s["routing_table_size"]) for name, s in (await overlay.statuses()).items()}


async def install(
    overlay: Overlay, clients: Sequence[Client], n: int, batch: int, offset: int
) -> dict[str, Any]:
    """Subscriptions ``offset .. offset + n``, spread over ``clients``; they stay (the next N
    adds to them, so the table keeps growing across runs). Several clients, because one client
    library connection carries one subscription request at a time (each waits for its
    acknowledgement), which would measure round trips rather than the overlay."""
    base = {name: size for name, size in (await _table_sizes(overlay)).items()}
    acked: list[float] = []
    cpu_at: list[float] = []  # the brokers' CPU at each batch's acknowledgement
    since = time.time()
    cpu0 = overlay.cpu_seconds()
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        ids = range(offset + start, offset + min(n, start + batch))
        await asyncio.gather(
            *(
                client.subscribe_many((f"s{i}", f"k = {i}") for i in ids[j :: len(clients)])
                for j, client in enumerate(clients)
            )
        )
        acked.append(time.perf_counter())
        cpu_at.append(overlay.cpu_seconds())
        if len(acked) % max(1, 10_000 // batch) == 0:
            progress(f"N={n:,}: {start + batch:,} acknowledged")
    t_ack = time.perf_counter() - t0
    while True:
        sizes = await _table_sizes(overlay)
        if all(sizes[b] - base[b] >= n for b in sizes):
            break
        if time.perf_counter() - t0 > 900:
            short = {b: sizes[b] - base[b] for b in sizes if sizes[b] - base[b] < n}
            raise RuntimeError(f"after 900 s these brokers still miss entries: {short}")
        await asyncio.sleep(0.05)
    t_all = time.perf_counter() - t0
    # What an insertion costs a broker: every broker holds every one of them.
    cpu_us = (overlay.cpu_seconds() - cpu0) / (n * len(overlay.brokers)) * 1e6
    stalls = await overlay.stalls(since)
    per_batch = [b - a for a, b in zip([t0, *acked], acked, strict=False)]
    k = max(1, 1000 // batch)
    first, last = sum(per_batch[:k]), sum(per_batch[-k:])
    tenths = _tenths([cpu0, *cpu_at], n, batch, len(overlay.brokers))
    # What the routing state costs in memory: every broker now holds the tables so far.
    rss = {name: round(overlay[name].rss_mb(), 1) for name in overlay.brokers}
    largest = max(rss, key=rss.__getitem__)
    result = {
        "subscriptions": n,
        "acknowledged_s": round(t_ack, 3),
        "installed_everywhere_s": round(t_all, 3),
        "first_1k_s": round(first, 4),
        "last_1k_s": round(last, 4),
        "cpu_us_per_insert": round(cpu_us, 2),
        **({"cpu_us_per_insert_by_tenth": tenths} if tenths else {}),
        "rss_mb": rss,
        **stalls,
    }
    growth = f" (by tenth: {tenths[0]:.1f} -> {tenths[-1]:.1f})" if tenths else ""
    progress(
        f"N={n:,}: acknowledged in {t_ack:.2f}s, in every routing table after {t_all:.2f}s; "
        f"first 1k {first:.3f}s, last 1k {last:.3f}s; {cpu_us:.1f} CPU-us per subscription "
        f"per broker{growth}; broker RSS up to {rss[largest]:.0f} MiB ({largest}); "
        f"{_said(stalls)}"
    )
    return result


def _tenths(cpu_at: Sequence[float], n: int, batch: int, brokers: int) -> list[float]:
    """CPU per subscription per broker in each tenth of an install, from the brokers' CPU at
    every batch's acknowledgement (``cpu_at[0]``: before the first): whether insertion gets
    dearer as the tables fill, within one run and one table, where comparing runs of
    different sizes mixes in their other differences. Work the far brokers still do for a
    tenth when its last batch is acknowledged counts in the next one. Empty below ten
    batches."""
    batches = len(cpu_at) - 1
    if batches < 10:
        return []
    out = []
    for t in range(10):
        lo, hi = batches * t // 10, batches * (t + 1) // 10
        subs = min(n, hi * batch) - lo * batch
        out.append(round((cpu_at[hi] - cpu_at[lo]) / (subs * brokers) * 1e6, 2))
    return out


async def leave(overlay: Overlay, clients: Sequence[Client]) -> dict[str, Any]:
    """Every subscribing client closes at once; its broker withdraws what it held and the
    withdrawals travel the tree (the tables were empty before the install)."""
    held = sum(len(c.subscriptions) for c in clients)
    since = time.time()
    t0 = time.perf_counter()
    await asyncio.gather(*(c.close() for c in clients))
    while any((await _table_sizes(overlay)).values()):
        if time.perf_counter() - t0 > 900:
            raise RuntimeError(
                f"after 900 s tables still hold entries: {await _table_sizes(overlay)}"
            )
        await asyncio.sleep(0.05)
    took = time.perf_counter() - t0
    stalls = await overlay.stalls(since)
    progress(f"leave: {held:,} withdrawn from every routing table in {took:.2f}s; {_said(stalls)}")
    return {"subscriptions": held, "withdrawn_everywhere_s": round(took, 3), **stalls}


async def churn(
    overlay: Overlay, root: str, other: str, rate: float, seconds: float
) -> dict[str, Any]:
    pub = await connect(
        overlay[root].listen, client_id="bench-churn-pub", credentials=overlay.credentials
    )
    steady = await connect(
        overlay[other].listen, client_id="bench-churn-steady", credentials=overlay.credentials
    )
    churner = await connect(
        overlay[other].listen, client_id="bench-churn-sub", credentials=overlay.credentials
    )
    received = 0

    async def drain(c: Client) -> None:
        nonlocal received
        async for _ in c.notifications():
            received += 1

    try:
        await steady.subscribe("tick exists")
        await asyncio.sleep(0.5)
        drainer = asyncio.create_task(drain(steady))
        stop = asyncio.Event()
        pairs = 0

        async def flap() -> None:
            nonlocal pairs
            while not stop.is_set():
                sid = await churner.subscribe(f"tick = {pairs % 50} and k = -1")
                await churner.unsubscribe(sid)
                pairs += 1

        flapper = asyncio.create_task(flap())
        published = 0
        t0 = time.perf_counter()
        while (now := time.perf_counter() - t0) < seconds:
            due = int(now * rate)
            while published < due:
                published += 1
                await pub.publish({"tick": published})
            await asyncio.sleep(0.002)
        stop.set()
        await flapper
        took = time.perf_counter() - t0
        deadline = time.perf_counter() + 10
        while received < published and time.perf_counter() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # a count, not an event: poll it with a deadline
        drainer.cancel()
        await asyncio.gather(drainer, return_exceptions=True)
        result = {
            "churn_pairs_per_s": round(pairs / took, 1),
            "events_per_s": round(published / took, 1),
            "published": published,
            "received_by_steady_subscriber": received,
        }
        progress(
            f"churn: {pairs / took:,.0f} subscribe+unsubscribe pairs/s while publishing "
            f"{published / took:,.0f} events/s; steady subscriber got {received}/{published}"
        )
        return result
    finally:
        for c in (pub, steady, churner):
            await c.close()


async def run(
    brokers: int,
    counts: Sequence[int],
    batch: int,
    rate: float,
    churn_seconds: float,
    *,
    n_clients: int = 20,
) -> dict[str, Any]:
    names, edges = tree(brokers)
    leaf = names[-1]
    progress(f"starting {brokers} brokers (binary tree), subscriptions enter at {leaf}")
    async with Overlay(names, edges, routing="covering") as overlay:
        results = []
        offset = 0
        clients = [
            await connect(
                overlay[leaf].listen, client_id=f"bench-subs-{i}", credentials=overlay.credentials
            )
            for i in range(n_clients)
        ]
        for n in counts:
            results.append(await install(overlay, clients, n, batch, offset))
            offset += n
            shown.advance("bench subscriptions", f"{n:,} installed")
        since = time.time()
        churned = await churn(overlay, names[0], names[-2], rate, churn_seconds)
        stalls = await overlay.stalls(since)
        churned.update(stalls)
        progress(f"churn: {_said(stalls)}")
        shown.advance("bench subscriptions", "churn")
        # Before the brokers stop: a stopping broker would make them fail over.
        left = await leave(overlay, clients)
        shown.advance("bench subscriptions", "leave")
    return {
        "brokers": brokers,
        "clients": n_clients,
        "routing": "covering",
        "install": results,
        "churn": churned,
        "leave": left,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--brokers", type=int, default=10)
    parser.add_argument("--counts", default="10000,100000", help="comma-separated N values")
    parser.add_argument("--batch", type=int, default=2000, help="subscriptions in flight")
    parser.add_argument("--clients", type=int, default=20, help="subscribing connections")
    parser.add_argument("--rate", type=float, default=1000.0, help="events/s during churn")
    parser.add_argument("--churn-seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    bench_plots.add_option(parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="canopy bench subscriptions", description=__doc__)
    add_arguments(parser)
    return run_args(parser.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    """Run with arguments parsed by :func:`add_arguments` (``canopy bench subscriptions``)."""
    counts = [int(c) for c in str(args.counts).split(",") if c.strip()]
    if bench_plots.refused(args.plot):
        return 2
    with shown.showing("bench subscriptions", len(counts) + 2):
        result = eventloop.run(
            run(
                args.brokers,
                counts,
                args.batch,
                args.rate,
                args.churn_seconds,
                n_clients=args.clients,
            )
        )
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return bench_plots.draw(args.plot, lambda path: bench_plots.subscriptions(result, path))
