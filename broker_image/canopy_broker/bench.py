"""``canopy bench dataplane``: measured throughput, latency, matching speed-up and memory.

Everything printed is measured on this run; nothing is a constant. The scenarios:

* **matching**: 10k filters (``symbol = S and price < P`` over 1000 symbols, plus range-only and
  prefix filters) in :class:`IndexedMatcher` vs :class:`ScanMatcher`, same events, in-process.
* **single broker**: one broker process, one publisher client, 50 subscriber clients with 20
  filters each (1k filters), symbols drawn so that an event matches ~10 filters. The publisher
  runs flat out under the broker's backpressure; the figure is notifications *received* by the
  subscribers per second. Beside it: the brokers' CPU per event, what they delivered per
  CPU-second they used (one core's worth of broker), and the CPU of this process (publisher
  and subscribers share one core: at 100 % it is the client side that set the rate).
* **chain of 3**: brokers b1-b2-b3, the publisher on b1, the same subscribers on b3.
* **latency**: the publisher paced at half the measured maximum event rate (single broker and
  chain); latency = receive time - publish time stamped into the event (``time.monotonic_ns``,
  one clock for all processes on this machine).
* **RSS**: ``VmRSS`` of each broker process at the end.

Progress goes to stderr; with ``--json`` the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from canopy_broker import bench_plots
from canopy_broker import progress as shown
from canopy_broker.cli import tune_gc, write_interval_ms
from canopy_broker.client import Client, Notification, connect
from canopy_broker.core.events import Value
from canopy_broker.core.filters import Constraint, Filter, Op
from canopy_broker.core.matching import IndexedMatcher, ScanMatcher
from canopy_broker.procs import Overlay
from canopy_broker.runtime import eventloop

N_SUBSCRIBERS = 50
FILTERS_PER_SUBSCRIBER = 20
HOT_SYMBOLS = 50  # data-plane scenarios: 1000 filters over 50 symbols -> ~10 matches per event


def progress(msg: str) -> None:
    """What a benchmark is doing (above its progress bar on a terminal, else a line)."""
    shown.report("bench", msg)


def done(msg: str) -> None:
    """One of a benchmark's counted points is measured: its bar advances."""
    shown.advance("bench", msg)


# --------------------------------------------------------------------------- this machine


def _echo(port: int, round_trips: int) -> None:
    """The other end of :func:`wakeup_probe` (a spawned process): sends back each byte."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(round_trips):
            s.sendall(s.recv(1))


def _round_trips(cores: set[int] | None, round_trips: int) -> float:
    """Median round trip (µs) of one byte to a fresh process and back over loopback TCP, both
    held on ``cores`` when given (else wherever the scheduler puts them)."""
    before = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)  # the spawned process inherits it
    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            child = multiprocessing.get_context("spawn").Process(
                target=_echo, args=(server.getsockname()[1], round_trips), daemon=True
            )
            child.start()
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                took = []
                for _ in range(round_trips):
                    t0 = time.perf_counter_ns()
                    conn.sendall(b"x")
                    if not conn.recv(1):
                        raise RuntimeError("the echo process went away")
                    took.append(time.perf_counter_ns() - t0)
            child.join(10)
    finally:
        os.sched_setaffinity(0, before)
    return statistics.median(took) / 1e3


def wakeup_probe(round_trips: int = 2000, sleeps: int = 50) -> dict[str, float | None]:
    """What a hop costs on this machine before any broker code runs. A notification on the
    chain wakes four processes in turn (b1, b2, b3, the subscriber), each of them woken by
    the one before through a loopback socket, so latency there is bounded below by this
    machine's wake-ups, not by Canopy; on a virtual machine they can cost far more than on
    bare metal. Measured: the median round trip of one byte between two processes (two
    wake-ups) where the scheduler places them and with both held on one core, and the CPU a
    process is charged for waking from a 10 ms sleep (what an idle timer costs)."""
    cpus = sorted(os.sched_getaffinity(0))
    free = _round_trips(None, round_trips)
    same = _round_trips({cpus[0]}, round_trips) if len(cpus) > 1 else None
    c0 = time.process_time()
    for _ in range(sleeps):
        time.sleep(0.01)
    return {
        "round_trip_us": free,
        "same_core_round_trip_us": same,
        "idle_wakeup_cpu_us": (time.process_time() - c0) / sleeps * 1e6,
        "cpus": float(len(cpus)),
    }


# --------------------------------------------------------------------------- matching


def matching_workload(
    n_filters: int, rng: random.Random
) -> tuple[list[Filter], list[dict[str, Value]]]:
    """90% ``symbol = S and price < P``, 5% ``price > a and volume < b``, 5% symbol prefixes."""
    symbols = [f"S{i:04d}" for i in range(1000)]
    filters: list[Filter] = []
    for i in range(n_filters):
        r = i % 20
        if r < 18:
            f = Filter.of(
                [
                    Constraint("symbol", Op.EQ, rng.choice(symbols)),
                    Constraint("price", Op.LT, rng.randint(1, 100)),
                ]
            )
        elif r == 18:
            f = Filter.of(
                [
                    Constraint("price", Op.GT, rng.randint(90, 100)),
                    Constraint("volume", Op.LT, rng.randint(1, 1000)),
                ]
            )
        else:
            f = Filter.of(
                [
                    Constraint("symbol", Op.PREFIX, rng.choice(symbols)[:4]),
                    Constraint("price", Op.GT, rng.randint(50, 100)),
                ]
            )
        filters.append(f)
    events: list[dict[str, Value]] = [
        {
            "symbol": rng.choice(symbols),
            "price": round(rng.uniform(0, 100), 2),
            "volume": rng.randint(1, 10_000),
            "venue": rng.choice(["XNAS", "XNYS", "BATS"]),
        }
        for _ in range(2000)
    ]
    return filters, events


def bench_matching(n_filters: int = 10_000, seed: int = 7) -> dict[str, float]:
    rng = random.Random(seed)
    filters, events = matching_workload(n_filters, rng)
    indexed: IndexedMatcher[int] = IndexedMatcher()
    scan: ScanMatcher[int] = ScanMatcher()
    for i, f in enumerate(filters):
        indexed.add(f, i)
        scan.add(f, i)

    def per_event(
        matcher: IndexedMatcher[int] | ScanMatcher[int], evs: list[dict[str, Value]]
    ) -> float:
        t0 = time.perf_counter()
        for e in evs:
            matcher.match_payloads(e)
        return (time.perf_counter() - t0) / len(evs)

    # Same answers, or the speed-up means nothing.
    for e in events[:50]:
        assert indexed.match_payloads(e) == scan.match_payloads(e)
    t_indexed = per_event(indexed, events)
    t_scan = per_event(scan, events[:100])
    return {
        "filters": float(len(filters)),
        "indexed_us_per_event": t_indexed * 1e6,
        "scan_us_per_event": t_scan * 1e6,
        "speedup": t_scan / t_indexed,
    }


# --------------------------------------------------------------------------- serialisers


def bench_serialisers(n_msgs: int = 1000, rounds: int = 200) -> dict[str, dict[str, float]]:
    """Encode/decode a data frame of ``n_msgs`` publish messages with each candidate codec.

    The numbers behind the choice of orjson (docs/broker.md). msgpack is a dev dependency only,
    so it is skipped when absent; pickle is measured for reference but never used (unsafe).
    """
    import pickle  # noqa: PLC0415 - measured only, never used on the wire

    import orjson  # noqa: PLC0415

    rng = random.Random(3)
    batch = [
        [
            0,
            "pub-1",
            i,
            1,
            {
                "symbol": f"S{rng.randrange(1000):04d}",
                "price": rng.random() * 100,
                "volume": rng.randint(1, 10_000),
                "venue": "XNAS",
                "flag": True,
            },
        ]
        for i in range(n_msgs)
    ]
    frame_obj = [1, 1, batch]
    codecs: dict[str, tuple[Any, Any]] = {
        "orjson": (orjson.dumps, orjson.loads),
        "pickle": (lambda o: pickle.dumps(o, protocol=5), pickle.loads),
    }
    try:
        import msgpack  # noqa: PLC0415
    except ImportError:
        pass
    else:
        codecs["msgpack"] = (msgpack.packb, msgpack.unpackb)
    out: dict[str, dict[str, float]] = {}
    for name, (enc, dec) in codecs.items():
        blob = enc(frame_obj)
        t0 = time.perf_counter()
        for _ in range(rounds):
            enc(frame_obj)
        t1 = time.perf_counter()
        for _ in range(rounds):
            dec(blob)
        t2 = time.perf_counter()
        per = rounds * n_msgs
        out[name] = {
            "encode_ns_per_msg": (t1 - t0) / per * 1e9,
            "decode_ns_per_msg": (t2 - t1) / per * 1e9,
            "bytes_per_msg": len(blob) / n_msgs,
        }
    return out


# --------------------------------------------------------------------------- data plane


def subscriber_filters(rng: random.Random) -> list[list[str]]:
    return [
        [
            f'symbol = "H{rng.randrange(HOT_SYMBOLS):02d}" and price < {rng.randint(1, 100)}'
            for _ in range(FILTERS_PER_SUBSCRIBER)
        ]
        for _ in range(N_SUBSCRIBERS)
    ]


class Sink:
    """Counts what the subscribers receive and, when asked, the latency of each notification."""

    def __init__(self) -> None:
        self.count = 0
        self.last_arrival = 0.0
        self.latencies_ns: list[int] = []
        self.record_latency = False

    def received(self, count: int) -> None:
        """``count`` notifications arrived now (also the callback of other systems' clients)."""
        self.count += count
        self.last_arrival = time.perf_counter()

    def deliver(self, batch: list[Notification]) -> None:
        """A Canopy subscriber's ``on_notifications``: the callback style, as the peers'
        clients are driven too (a task per subscriber waiting in ``receive()`` cost the
        benchmark's process a third of its CPU in task switches)."""
        self.received(len(batch))
        if self.record_latency:
            now = time.monotonic_ns()
            self.latencies_ns.extend(now - int(n.attrs["ts"]) for n in batch)


def _tick(rng: random.Random) -> dict[str, Value]:
    """One market-data event, stamped with the publish time for the latency measurement."""
    return {
        "symbol": f"H{rng.randrange(HOT_SYMBOLS):02d}",
        "price": rng.randrange(100),
        "ts": time.monotonic_ns(),
    }


async def _publish_flat_out(pub: Client, stop: asyncio.Event, rng: random.Random) -> int:
    sent = 0
    while not stop.is_set():
        for _ in range(200):
            pub.publish_nowait(_tick(rng))
        sent += 200
        await pub.flush()
    return sent


Send = Callable[[int], Awaitable[None]]
"""``send(k)``: publish the next ``k`` events (``k`` may be 0) and hand them to the socket."""


def canopy_sender(pub: Client, event: Callable[[], Mapping[str, Value]]) -> Send:
    """A :data:`Send` for a Canopy publisher: ``event()`` makes each event."""

    async def send(count: int) -> None:
        for _ in range(count):
            pub.publish_nowait(event())
        await pub.flush()

    return send


async def publish_paced(rate: float, duration: float, send: Send, tick: float = 0.001) -> int:
    """Publish ``rate`` events/s for ``duration`` s: about every ``tick`` s, send the events
    due by then (a late wake-up sends a larger batch, so the average rate holds), and at the
    end whatever is still due, so that exactly ``int(rate * duration)`` events are sent.
    Returns that number."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent = 0
    while (now := loop.time()) - start < duration:
        due = max(sent, int((now - start) * rate))
        await send(due - sent)
        sent = due
        await asyncio.sleep(tick)
    total = max(sent, int(rate * duration))
    await send(total - sent)
    return total


async def _settle_clients(overlay: Overlay) -> None:
    await overlay.settle(within=60)


async def run_dataplane(
    overlay: Overlay,
    pub_broker: str,
    sub_broker: str,
    duration: float,
    label: str,
    *,
    loads: Sequence[float] = (0.5,),
) -> dict[str, Any]:
    """Max throughput, then latency at each of ``loads`` (fractions of the max event rate;
    the issue's figure is at 0.5), on an already running overlay."""
    rng = random.Random(11)
    creds = overlay.credentials
    sink = Sink()
    subs = [
        await connect(overlay[sub_broker].listen, credentials=creds, on_notifications=sink.deliver)
        for _ in range(N_SUBSCRIBERS)
    ]
    pub = await connect(
        overlay[pub_broker].listen, client_id=f"bench-pub-{label}", credentials=creds
    )
    try:
        for c, texts in zip(subs, subscriber_filters(rng), strict=True):
            await asyncio.gather(*(c.subscribe(t) for t in texts))
        await _settle_clients(overlay)

        progress(f"{label}: publishing flat out for {duration:.1f}s")
        # Rate = everything delivered / (last arrival - first publish): counting a window while
        # publishing would credit backlog drained from before the window (or miss backlog left
        # after it), since brokers buffer up to their high-water marks.
        stop = asyncio.Event()
        cpu0, own0 = overlay.cpu_seconds(), time.process_time()
        c0, p0, t0 = sink.count, pub.last_seq, time.perf_counter()
        publisher = asyncio.create_task(_publish_flat_out(pub, stop, rng))
        await asyncio.sleep(duration)
        stop.set()
        await publisher
        await _quiesce(sink, pub)
        c1, p1, t1 = sink.count, pub.last_seq, sink.last_arrival
        broker_cpu = overlay.cpu_seconds() - cpu0
        # This process (the publisher and every subscriber) on one core: at 100 % it, not
        # the brokers, set the rate measured, and the brokers' capacity says what they had.
        client_cpu_pct = (time.process_time() - own0) / max(1e-9, t1 - t0) * 100
        cpu_per_event_us = broker_cpu / max(1, p1 - p0) * 1e6
        notif_rate = (c1 - c0) / (t1 - t0)
        event_rate = (p1 - p0) / (t1 - t0)
        fanout = (c1 - c0) / max(1, p1 - p0)
        capacity = (c1 - c0) / max(1e-9, broker_cpu)
        progress(
            f"{label}: {notif_rate:,.0f} notifications/s ({event_rate:,.0f} events/s "
            f"published, {fanout:.1f} notifications per event; brokers used "
            f"{cpu_per_event_us:.0f} CPU-us per event, {capacity:,.0f} notifications per "
            f"broker CPU-second; the client process used {client_cpu_pct:.0f} % of a core)"
        )

        latency = []
        for load in loads:
            rate = event_rate * load
            await _steady(overlay, rate)
            progress(
                f"{label}: latency at {load:.0%} load ({rate:,.0f} events/s) for {duration:.1f}s"
            )
            sink.latencies_ns.clear()
            sink.record_latency = True
            since, lags = time.time(), LagWatch()
            with lags:
                await publish_paced(rate, duration, canopy_sender(pub, lambda: _tick(rng)))
                await _quiesce(sink, pub)
            sink.record_latency = False
            stalls = await overlay.stalls(since)
            point = {
                "load": load,
                "events_per_s": round(rate),
                **percentiles(sink.latencies_ns),
                "broker_stalls": stalls["stalls"],
                "broker_longest_stall_ms": round(stalls["longest_stall_s"] * 1000, 1),
                "broker_longest_stall_cpu_ms": round(stalls["longest_stall_cpu_s"] * 1000, 1),
                "client_lags_over_10ms": lags.over(0.010),
                "client_longest_lag_ms": round(lags.longest * 1000, 1),
            }
            latency.append(point)
            progress(
                f"{label}: latency p50 {point['p50_ms']:.2f} ms, p99 {point['p99_ms']:.2f} ms, "
                f"p99.9 {point['p999_ms']:.2f} ms over {point['samples']} notifications; "
                f"brokers' loops stalled {stalls['stalls']} times 10 ms or more (longest "
                f"{point['broker_longest_stall_ms']:.0f} ms, {stalls['longest_stall_broker']}, "
                f"{point['broker_longest_stall_cpu_ms']:.0f} ms of it on CPU); this process's "
                f"{point['client_lags_over_10ms']} times (longest "
                f"{point['client_longest_lag_ms']:.0f} ms)"
            )
        half = min(latency, key=lambda p: abs(p["load"] - 0.5))
        return {
            "notif_per_s": notif_rate,
            "events_per_s": event_rate,
            "fanout": fanout,
            "broker_cpu_us_per_event": cpu_per_event_us,
            "notif_per_broker_cpu_s": capacity,
            "client_cpu_pct": client_cpu_pct,
            "p50_ms": half["p50_ms"],
            "p99_ms": half["p99_ms"],
            "p999_ms": half["p999_ms"],
            "latency_load": half["load"],
            "latency_samples": float(half["samples"]),
            "latency": latency,
        }
    finally:
        await pub.close()
        for c in subs:
            await c.close()


class LagWatch:
    """This process's own event-loop lag while in its ``with`` block (a callback due every
    5 ms): latency the benchmark's client process added, told apart from the overlay's. The
    publisher and every subscriber share this loop, so a notification that arrived while it
    lagged waited for it."""

    PERIOD = 0.005

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def longest(self) -> float:
        return max(self.lags, default=0.0)

    def over(self, seconds: float) -> int:
        return sum(1 for lag in self.lags if lag >= seconds)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.PERIOD
            await asyncio.sleep(self.PERIOD)
            self.lags.append(max(0.0, loop.time() - due))

    def __enter__(self) -> LagWatch:
        self._task = asyncio.create_task(self._watch())
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


def percentiles(latencies_ns: Sequence[int]) -> dict[str, Any]:
    """p50, p99 and p99.9 in ms (NaN without samples) and the sample count."""
    lat = sorted(latencies_ns)

    def at(q: float) -> float:
        return lat[min(len(lat) - 1, int(len(lat) * q))] / 1e6 if lat else float("nan")

    return {"p50_ms": at(0.5), "p99_ms": at(0.99), "p999_ms": at(0.999), "samples": len(lat)}


async def _quiesce(sink: Sink, pub: Client, quiet: float = 0.3) -> None:
    """Wait until every event ``pub`` sent is in the overlay's custody (acknowledged) and no
    notification arrived for ``quiet`` seconds. Acknowledged first: a broker that holds its
    publishers back (backpressure, a full retention) leaves events unread in the publisher's
    socket, and a pause of the arrivals would otherwise pass for the end."""
    if not await pub.wait_acknowledged(timeout=120.0):
        raise RuntimeError(f"{pub.unacknowledged} events unacknowledged after 120 s")
    last = -1
    while sink.count != last:
        last = sink.count
        await asyncio.sleep(quiet)


async def _steady(overlay: Overlay, rate: float, within: float = 30.0) -> None:
    """Wait until no broker holds its publishers back and every link's retention has room for
    what ``rate`` events/s will add to it within the horizon. Flat out, a chain fills its
    retention (each notification is kept a while, up to a limit per link, so that a crashed
    broker's traffic can be repaired) and publishers wait until entries are older than the
    horizon: a latency phase started before would measure that wait (seconds), not the
    overlay at this load."""

    def has_room(r: dict[str, Any]) -> bool:
        # A rate that fills the retention by itself needs all of it: the horizon passed.
        limit, young = int(r["limit"]), int(r["young"])
        return young + min(limit, 1.2 * rate * float(r["horizon_s"])) <= limit

    waiting: list[str] = []
    try:
        async with asyncio.timeout(within):
            while True:
                waiting = [
                    f"{name} ({'publishers paused' if s['publishers_paused'] else s['retention']})"
                    for name, s in (await overlay.statuses()).items()
                    if s["publishers_paused"] or not has_room(s["retention"])
                ]
                if not waiting:
                    return
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise RuntimeError(
            f"after {within:g} s these brokers still hold publishers or lack retention room for "
            f"{rate:,.0f} events/s: {', '.join(waiting)}"
        ) from None


async def handshake_ms(overlay: Overlay, broker: str, n: int = 50) -> float:
    """Mean time of a client connection (TCP, TLS when on, hello and answer), one at a time."""
    t0 = time.perf_counter()
    for i in range(n):
        c = await connect(
            overlay[broker].listen, client_id=f"bench-hs-{i}", credentials=overlay.credentials
        )
        await c.close()
    return (time.perf_counter() - t0) * 1000.0 / n


async def run(
    duration: float = 4.0,
    insecure: bool = False,
    loads: Sequence[float] = (0.5,),
    write_interval_ms: float = 0.0,
) -> dict[str, Any]:
    """``insecure``: plaintext brokers and clients (to measure what TLS costs);
    ``write_interval_ms``: the brokers' write pacing (``--client-write-interval-ms``)."""
    broker_args = ["--telemetry-sample", "0.01"]
    if write_interval_ms:
        broker_args += ["--client-write-interval-ms", f"{write_interval_ms:g}"]
    t_start = time.perf_counter()
    progress("matching: 10k filters, indexed vs scan")
    m = bench_matching()
    done(
        f"matching: indexed {m['indexed_us_per_event']:.1f} us/event, speed-up {m['speedup']:.0f}x"
    )
    progress(
        f"matching: indexed {m['indexed_us_per_event']:.1f} us/event, scan "
        f"{m['scan_us_per_event']:.0f} us/event, speed-up {m['speedup']:.0f}x"
    )

    codecs = bench_serialisers()
    done("serialisers")
    machine = wakeup_probe()
    progress(
        f"this machine: a process-to-process round trip {machine['round_trip_us']:.0f} us, "
        + _machine_said(machine)
    )
    progress(
        "serialisers (encode ns/msg, decode ns/msg, bytes/msg): "
        + "; ".join(
            f"{k} {v['encode_ns_per_msg']:.0f}, {v['decode_ns_per_msg']:.0f}, "
            f"{v['bytes_per_msg']:.0f}"
            for k, v in codecs.items()
        )
    )

    progress("starting 1 broker")
    async with Overlay(["solo"], [], extra_args=broker_args, insecure=insecure) as ov:
        single = await run_dataplane(ov, "solo", "solo", duration, "single broker", loads=loads)
        pacing = (await ov.statuses())["solo"]["client_write_interval_ms"]  # as the broker says
        rss = {"solo": ov["solo"].rss_mb()}
        connect_ms = await handshake_ms(ov, "solo")
        progress(f"connecting a client: {connect_ms:.2f} ms (TLS {'off' if insecure else 'on'})")
    done("single broker")
    progress("starting a chain of 3 brokers")
    async with Overlay(
        ["b1", "b2", "b3"],
        [("b1", "b2"), ("b2", "b3")],
        extra_args=broker_args,
        insecure=insecure,
    ) as ov:
        chain = await run_dataplane(ov, "b1", "b3", duration, "chain of 3", loads=loads)
        rss.update({n: ov[n].rss_mb() for n in ("b1", "b2", "b3")})
    done("chain of 3")
    result: dict[str, Any] = {
        "single_broker_notif_per_s": round(single["notif_per_s"]),
        "chain3_notif_per_s": round(chain["notif_per_s"]),
        "p99_latency_ms": round(single["p99_ms"], 3),
        "matching_speedup_10k": round(m["speedup"], 1),
        "broker_rss_mb": round(max(rss.values()), 1),
        "tls": not insecure,
        "client_write_interval_ms": pacing,
        "client_connect_ms": round(connect_ms, 3),
        "detail": {
            "single": single,
            "chain3": chain,
            "matching": m,
            "serialisers": codecs,
            "machine": machine,
            "rss_mb": rss,
            "subscribers": N_SUBSCRIBERS,
            "filters": N_SUBSCRIBERS * FILTERS_PER_SUBSCRIBER,
            "wall_s": round(time.perf_counter() - t_start, 1),
        },
    }
    return result


def report(r: dict[str, Any]) -> str:
    d = r["detail"]
    s, c = d["single"], d["chain3"]
    rows = [
        (
            "notifications/s, 1 broker (1 pub -> 50 subs, 1k filters)",
            f"{r['single_broker_notif_per_s']:,}",
            ">= 100,000",
            f"{s['events_per_s']:,.0f} events/s x {s['fanout']:.1f}",
        ),
        (
            "notifications/s, chain of 3 brokers",
            f"{r['chain3_notif_per_s']:,}",
            ">= 50,000",
            f"{c['events_per_s']:,.0f} events/s x {c['fanout']:.1f}",
        ),
        (
            "broker CPU per event, 1 broker / chain of 3 (sum)",
            f"{s['broker_cpu_us_per_event']:.0f} / {c['broker_cpu_us_per_event']:.0f} us",
            "",
            "does not depend on other load on the machine",
        ),
        (
            "notifications per broker CPU-second, 1 broker",
            f"{s['notif_per_broker_cpu_s']:,.0f}",
            ">= 500,000",
            f"what one core of broker delivers; the client process was at "
            f"{s['client_cpu_pct']:.0f} % of a core",
        ),
        *(
            (
                f"latency at {p['load']:.0%} load, {where}, p50 / p99 / p99.9 ms",
                f"{p['p50_ms']:.2f} / {p['p99_ms']:.2f} / {p['p999_ms']:.2f}",
                "p99 <= 5" if p["load"] == 0.5 and where == "chain of 3" else "",
                f"{p['events_per_s']:,} events/s; loops stalled >= 10 ms: brokers "
                f"{p['broker_stalls']} (longest {p['broker_longest_stall_ms']:.0f} ms, "
                f"{p['broker_longest_stall_cpu_ms']:.0f} on CPU), client process "
                f"{p['client_lags_over_10ms']} (longest {p['client_longest_lag_ms']:.0f} ms)",
            )
            for where, x in (("1 broker", s), ("chain of 3", c))
            for p in x["latency"]
        ),
        (
            "this machine: process-to-process round trip, us",
            f"{d['machine']['round_trip_us']:.0f}",
            "",
            "two wake-ups over loopback TCP, " + _machine_said(d["machine"]),
        ),
        (
            "matching speed-up, 10k filters (indexed vs scan)",
            f"{r['matching_speedup_10k']:.0f}x",
            ">= 20x",
            f"{d['matching']['indexed_us_per_event']:.1f} vs "
            f"{d['matching']['scan_us_per_event']:.0f} us/event",
        ),
        (
            "broker RSS, MiB (max over brokers)",
            f"{r['broker_rss_mb']:.1f}",
            "",
            ", ".join(f"{k} {v:.0f}" for k, v in d["rss_mb"].items()),
        ),
        (
            "connecting a client (TCP, TLS, hello), ms",
            f"{r['client_connect_ms']:.2f}",
            "",
            "TLS on (certificates)" if r["tls"] else "TLS off (--insecure)",
        ),
    ]
    w = max(len(a) for a, *_ in rows)
    lines = [f"{'measure':<{w}}  {'measured':>14}  {'target':>10}  detail"]
    lines += [f"{a:<{w}}  {b:>14}  {t:>10}  {x}" for a, b, t, x in rows]
    pacing = r.get("client_write_interval_ms", 0.0)
    lines.append(
        f"(wall time {d['wall_s']} s; brokers' writes to clients "
        + (f"paced at {pacing:g} ms)" if pacing else "not paced: written every loop turn)")
    )
    return "\n".join(lines)


def _machine_said(machine: dict[str, Any]) -> str:
    """The probe's other figures (:func:`wakeup_probe`), for the progress line and the table."""
    same = machine["same_core_round_trip_us"]
    return (
        f"on one core: {'n/a, one CPU' if same is None else f'{same:.0f} us'}; waking from an "
        f"idle sleep costs {machine['idle_wakeup_cpu_us']:.0f} us of CPU"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    parser.add_argument(
        "--duration",
        type=float,
        default=4.0,
        help="seconds per measured phase (default 4; total stays under 60 s)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext brokers and clients (compare with the default, TLS, for its cost)",
    )
    parser.add_argument(
        "--client-write-interval-ms",
        type=write_interval_ms,
        default=0.0,
        metavar="MS",
        help="the brokers' write pacing (`canopy-broker serve --client-write-interval-ms`; "
        "default 0, the brokers' default): what it saves in CPU, what it costs in latency",
    )
    parser.add_argument(
        "--loads",
        default="0.5",
        help="comma-separated fractions of the measured maximum event rate to measure latency "
        "at, each for --duration s (default 0.5: the issue's half load)",
    )
    bench_plots.add_option(parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="canopy bench dataplane", description=__doc__)
    add_arguments(parser)
    return run_args(parser.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    """Run with the flags of :func:`add_arguments` (``canopy bench dataplane`` calls this with
    its own parse, so every flag reaches the run without being spelled twice)."""
    try:
        loads = [float(x) for x in args.loads.split(",")]
        if not all(0 < x <= 1 for x in loads):
            raise ValueError
    except ValueError:
        print(f"error: --loads must be fractions in (0, 1], got {args.loads!r}", file=sys.stderr)
        return 2
    if bench_plots.refused(args.plot):
        return 2
    tune_gc()  # the subscribers here are measured too: same GC settings as the brokers
    with shown.showing("bench dataplane", 4):  # matching, serialisers, 1 broker, chain of 3
        result = eventloop.run(
            run(
                args.duration,
                insecure=args.insecure,
                loads=loads,
                write_interval_ms=args.client_write_interval_ms,
            )
        )
    print(report(result))
    if args.json:
        print(json.dumps(result))
    return bench_plots.draw(args.plot, lambda path: bench_plots.dataplane(result, path))


if __name__ == "__main__":
    sys.exit(main())
