"""``canopy bench peers``: broker CPU per notification, Canopy next to NATS and Mosquitto.

Why: CPU per delivered notification is what an operator pays for, per broker pod, for as long as
the overlay runs, and the systems users would pick instead are the yardstick (issue 16). One
invocation runs the same paced workload against each broker in turn, on this machine:

* **workload**: 1 publisher -> ``--subscribers`` subscribers; every event matches exactly
  ``--fanout`` of them. Subscriber ``i`` is in group ``i % G`` (``G = subscribers / fanout``)
  and event ``n`` goes to group ``n % G``, expressed as each system would express it: Canopy a
  content-based filter ``g = k`` on an attribute of the event, NATS the subject ``ev.k``,
  Mosquitto the MQTT topic ``ev/k`` at QoS 0. Every event carries the same two values (group,
  sequence number): Canopy's attributes, the others' payload (the same attributes as JSON).
* **pace**: ``--rate`` events/s for ``--duration`` s, sent in a batch every ``--tick`` ms, so
  every system does the same work (a flat-out run would compare how fast the Python clients
  are, not the brokers). The tick matters: with 1 ms ticks most notifications leave a broker
  one per write, and per-write costs dominate every broker's CPU per notification.
* **CPU**: ``utime + stime`` of the broker process from ``/proc/<pid>/stat``, read just before
  the first event is published and as soon as the last expected notification has arrived.
  ``us_per_notification`` = that CPU / notifications delivered, ``user_us`` and ``system_us``
  its two parts (the broker's own code, the kernel's work for it). The clients run in this process
  (one asyncio loop, a system at a time), never in a broker's, so their CPU is not counted.
* **deliveries**: counted by the subscribers; ``expected`` = events published x fan-out;
  ``notif_per_s`` = delivered / (last arrival - first publish).
* **latency**: every event carries the time it was published (``ts``, this process's
  monotonic clock, in Canopy's attributes and in the peers' JSON payload); each subscriber
  takes its notification's latency from it: ``p50_ms`` and ``p99_ms`` over all of them
  (Canopy's) or one in ``LATENCY_SAMPLE`` (the peers'; with rounds, the median round's). It
  is what a CPU figure costs in waiting (``--client-write-interval-ms`` trades one for the
  other), and includes the wait for this process's loop, the same for every system.

The brokers: one ``canopy-broker serve`` with its default settings, ``nats-server`` and
``mosquitto`` (from the system package manager, installed by ``make setup``), each started here
on 127.0.0.1 on a free port and stopped at the end; no system service is used. The clients:
Canopy's client library, nats-py and paho-mqtt (the ``dev`` extra).

* **rounds**: ``--rounds N`` measures every system N times, interleaved, and reports each
  system's median round; the ratios between systems are the medians of the rounds' paired
  ratios. One run per system compares systems measured a minute apart on a machine whose speed
  drifts; pairs from the same round cancel most of that drift.

Progress goes to stderr; with ``--json`` the last stdout line is one JSON object with keys
``canopy``, ``nats`` and ``mosquitto``, each ``{us_per_notification, user_us, system_us,
delivered, expected, notif_per_s, p50_ms, p99_ms}`` (Canopy's also the
``client_write_interval_ms`` it ran with); with ``--rounds`` above 1 the first four are the median
round's, ``delivered`` and ``expected`` are summed over the rounds, and ``rounds`` lists each
round's figures in the order run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import orjson

from canopy_broker import bench_plots
from canopy_broker.bench import (
    Send,
    Sink,
    canopy_sender,
    done,
    percentiles,
    progress,
    publish_paced,
)
from canopy_broker.cli import tune_gc, write_interval_ms
from canopy_broker.client import connect
from canopy_broker.procs import Overlay, process_cpu_split, stop_process
from canopy_broker.progress import showing

if TYPE_CHECKING:
    from paho.mqtt.client import Client as MqttClient

SYSTEMS = ("canopy", "nats", "mosquitto")
T = TypeVar("T")
PATH_ENV = "CANOPY_PEERS_PATH"
"""Where to look for ``nats-server`` and ``mosquitto`` instead of ``$PATH`` and the sbin
directories (Debian puts ``mosquitto`` in /usr/sbin, which a non-root ``$PATH`` may lack)."""
INSTALL_HINT = (
    "install them with `make setup` (scripts/setup.sh installs nats-server, mosquitto and "
    "mosquitto-clients with the system package manager when missing, and nats-py and paho-mqtt "
    "into .venv with the dev extra), then run .venv/bin/canopy bench peers"
)
QUICK = {"subscribers": 10, "fanout": 2, "rate": 1000.0, "duration": 1.0}
FULL = {"subscribers": 50, "fanout": 10, "rate": 5000.0, "duration": 8.0}
STALL_S = 10.0  # no new notification for this long after publishing ends: report what arrived


@dataclass(frozen=True)
class Workload:
    subscribers: int
    fanout: int
    rate: float
    duration: float
    tick: float = 0.001
    canopy_flags: tuple[str, ...] = ()  # extra `canopy-broker serve` flags (Canopy's settings)

    @property
    def groups(self) -> int:
        return self.subscribers // self.fanout

    def describe(self) -> str:
        return (
            f"1 publisher -> {self.subscribers} subscribers, every event matches {self.fanout} "
            f"of them, {self.rate:,.0f} events/s for {self.duration:g} s, published every "
            f"{self.tick * 1000:g} ms"
            + (f"; Canopy's broker with {' '.join(self.canopy_flags)}" if self.canopy_flags else "")
        )


class Numbered:
    """Event numbers 0, 1, 2, ... and the group each goes to (the same for every system)."""

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self._next = itertools.count()

    def next(self) -> tuple[int, int]:
        n = next(self._next)
        return n % self.groups, n

    def attrs(self) -> dict[str, int]:
        """The next event's attributes, stamped with the time it is published (``ts``, ns on
        this process's monotonic clock, which the subscribers read too)."""
        g, n = self.next()
        return {"g": g, "n": n, "ts": time.monotonic_ns()}

    def payload(self) -> tuple[int, bytes]:
        """The next event's group, and its attributes as JSON (the peers' message body)."""
        attrs = self.attrs()
        return attrs["g"], orjson.dumps(attrs)


LATENCY_SAMPLE: Final = 16
"""A peer's subscribers read the stamp of one notification in this many: parsing every
payload made the client process slower, which let Mosquitto's writes batch more, and so
changed the CPU figure being measured (5.2 -> 4.6 us per notification)."""


def received_payload(sink: Sink, payload: bytes | bytearray) -> None:
    """A peer's subscriber got one notification: count it, and for one in
    ``LATENCY_SAMPLE`` its latency from the stamp in the payload when the sink records
    latencies (Canopy's subscribers: ``Sink.deliver``, from attributes decoded anyway)."""
    sink.received(1)
    if sink.record_latency and sink.count % LATENCY_SAMPLE == 0:
        sink.latencies_ns.append(time.monotonic_ns() - int(orjson.loads(payload)["ts"]))


# --------------------------------------------------------------------------- finding the peers


def find_binary(name: str) -> str | None:
    path = os.environ.get(PATH_ENV)
    if path is None:
        path = os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/usr/local/sbin"])
    return shutil.which(name, path=path)


_NEEDS = {
    "nats": ("nats-server", "nats", "nats-py"),
    "mosquitto": ("mosquitto", "paho", "paho-mqtt"),
}


def missing_peers(systems: Sequence[str] = SYSTEMS) -> list[str]:
    """What the peers among ``systems`` need and is not installed, one line each."""
    needs = [_NEEDS[s] for s in systems if s in _NEEDS]
    missing = [f"{b} (program)" for b, _, _ in needs if find_binary(b) is None]
    missing += [
        f"{dist} (Python package)"
        for _, module, dist in needs
        if importlib.util.find_spec(module) is None
    ]
    return missing


# --------------------------------------------------------------------------- peer brokers


def free_port() -> int:
    """A loopback port free now. nats-server and mosquitto cannot report a port they chose
    (Canopy's brokers can, see procs.py), so there is a small race, caught by the start check."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def peer_broker(argv: list[str], port: int, log: Path) -> AsyncIterator[int]:
    """Run a peer broker; yields its pid once it accepts connections on ``port``."""
    with log.open("wb") as fh:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=fh, stderr=fh
        )
        try:
            async with asyncio.timeout(15):
                while True:
                    if process.returncode is not None:
                        code = process.returncode
                        raise RuntimeError(f"{argv[0]} exited ({code}): {_tail(log)}")
                    try:
                        _, writer = await asyncio.open_connection("127.0.0.1", port)
                    except OSError:
                        await asyncio.sleep(0.05)
                        continue
                    writer.close()
                    await writer.wait_closed()
                    break
            yield process.pid
        finally:
            await stop_process(process, grace=5.0)


def _tail(log: Path) -> str:
    """The end of a broker's log, for the error when it did not start (a tiny read)."""
    return log.read_text(errors="replace")[-2000:]


# --------------------------------------------------------------------------- the three systems
#
# Each yields (broker pids, send) once its subscribers are subscribed and the broker has every
# subscription; the subscribers count into ``sink``. Clients are closed on the way out.

Started = AsyncIterator[tuple[list[int], Send]]


@contextlib.asynccontextmanager
async def canopy(w: Workload, sink: Sink, _tmp: Path) -> Started:
    # Plaintext, as the peers run here: like for like (TLS's own cost: `canopy bench dataplane`
    # against `--insecure`, docs/performance.md).
    async with Overlay(["canopy"], insecure=True, extra_args=w.canopy_flags) as ov:
        address = ov["canopy"].listen
        subs = [
            await connect(address, credentials=ov.credentials, on_notifications=sink.deliver)
            for _ in range(w.subscribers)
        ]
        pub = await connect(address, client_id="bench-peers-pub", credentials=ov.credentials)
        try:
            for i, c in enumerate(subs):
                await c.subscribe(f"g = {i % w.groups}")
            await ov.settle()
            yield [p.pid for p in ov.brokers.values()], canopy_sender(pub, Numbered(w.groups).attrs)
        finally:
            for c in [pub, *subs]:
                await c.close()


@contextlib.asynccontextmanager
async def nats(w: Workload, sink: Sink, tmp: Path) -> Started:
    import nats as nats_py  # noqa: PLC0415 - a dev dependency, checked by missing_peers()

    binary = find_binary("nats-server")
    assert binary is not None
    port = free_port()
    argv = [binary, "-a", "127.0.0.1", "-p", str(port)]
    async with peer_broker(argv, port, tmp / "nats-server.log") as pid:
        url = f"nats://127.0.0.1:{port}"
        clients = []
        try:

            async def on_message(msg: Any) -> None:
                received_payload(sink, msg.data)

            for i in range(w.subscribers):
                nc = await nats_py.connect(url, allow_reconnect=False)
                clients.append(nc)
                await nc.subscribe(f"ev.{i % w.groups}", cb=on_message)
            for nc in clients:
                await nc.flush()  # a PING answered after our SUBs: the server has them all
            pub = await nats_py.connect(url, allow_reconnect=False)
            clients.append(pub)
            numbered = Numbered(w.groups)

            async def send(count: int) -> None:
                # nats-py buffers and its flusher task writes; no per-batch PING round trip.
                for _ in range(count):
                    g, payload = numbered.payload()
                    await pub.publish(f"ev.{g}", payload)

            yield [pid], send
        finally:
            for nc in clients:
                await nc.close()


class PahoOnAsyncio:
    """Runs paho-mqtt clients on this asyncio loop through paho's external-loop hooks.

    Why: paho's own ``loop_start()`` runs a thread per client, and 51 threads fighting over the
    GIL would make the client side, not the broker, the bottleneck; on the loop, the MQTT
    clients share one thread as the Canopy and NATS clients do."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.clients: list[MqttClient] = []
        self._misc: asyncio.Task[None] | None = None

    async def connect(
        self,
        port: int,
        client_id: str,
        on_message: Callable[[bytes | bytearray], None] | None = None,
    ) -> MqttClient:
        from paho.mqtt import client as mqtt  # noqa: PLC0415 - a dev dependency
        from paho.mqtt.enums import CallbackAPIVersion  # noqa: PLC0415

        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
        loop = self.loop
        c.on_socket_open = lambda cl, _u, sock: loop.add_reader(sock, cl.loop_read)
        c.on_socket_close = lambda _c, _u, sock: _discard(loop.remove_reader(sock))
        c.on_socket_register_write = lambda cl, _u, sock: loop.add_writer(sock, cl.loop_write)
        c.on_socket_unregister_write = lambda _c, _u, sock: _discard(loop.remove_writer(sock))
        if on_message is not None:
            c.on_message = lambda _c, _u, m: on_message(m.payload)
        answered: asyncio.Future[Any] = loop.create_future()
        c.on_connect = lambda _c, _u, _f, code, _p: _settle(answered, code)
        c.connect("127.0.0.1", port, keepalive=60)  # loopback: returns at once
        self.clients.append(c)
        if self._misc is None:
            self._misc = asyncio.create_task(self._keepalive())
        code = await asyncio.wait_for(answered, 10)
        if code.is_failure:
            raise RuntimeError(f"mosquitto refused {client_id}: {code}")
        return c

    async def subscribe(self, c: MqttClient, topic: str) -> None:
        acked: asyncio.Future[Any] = self.loop.create_future()
        c.on_subscribe = lambda _c, _u, _mid, codes, _p: _settle(acked, codes)
        c.subscribe(topic, qos=0)
        codes = await asyncio.wait_for(acked, 10)
        if any(code.is_failure for code in codes):
            raise RuntimeError(f"mosquitto refused the subscription to {topic}: {codes}")

    async def _keepalive(self) -> None:
        """paho's periodic duties (keep-alive pings) that its own loop would do."""
        while True:
            await asyncio.sleep(1)
            for c in self.clients:
                c.loop_misc()

    async def close(self) -> None:
        """Disconnect every client cleanly (DISCONNECT written, socket closed by paho)."""
        gone = [self.loop.create_future() for _ in self.clients]
        for c, fut in zip(self.clients, gone, strict=True):
            c.on_disconnect = lambda _c, _u, _f, _rc, _p, fut=fut: _settle(fut, None)
            c.disconnect()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*gone), 5)
        if self._misc is not None:
            self._misc.cancel()
            await asyncio.gather(self._misc, return_exceptions=True)


def _discard(_: object) -> None:
    """paho's socket callbacks return None; the loop's remove_reader/writer return a bool."""


def _settle(fut: asyncio.Future[Any], value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def mosquitto_config(port: int) -> str:
    """Mosquitto's defaults but for the listener and one limit: QoS 0 messages beyond
    ``max_queued_messages`` (1000) per client are dropped, not queued, whenever a subscriber
    momentarily falls behind; 0 lifts the limit, as NATS's and Canopy's queues are large."""
    return (
        f"listener {port} 127.0.0.1\n"
        "allow_anonymous true\n"
        "persistence false\n"
        "max_queued_messages 0\n"
        "log_dest stderr\n"
        "log_type error\n"
        "log_type warning\n"
    )


@contextlib.asynccontextmanager
async def mosquitto(w: Workload, sink: Sink, tmp: Path) -> Started:
    binary = find_binary("mosquitto")
    assert binary is not None
    port = free_port()
    conf = tmp / "mosquitto.conf"
    conf.write_text(mosquitto_config(port))
    async with peer_broker([binary, "-c", str(conf)], port, tmp / "mosquitto.log") as pid:
        paho = PahoOnAsyncio()
        try:
            count_one = lambda payload: received_payload(sink, payload)  # noqa: E731 - one for all
            for i in range(w.subscribers):
                c = await paho.connect(port, f"bench-sub-{i}", count_one)
                await paho.subscribe(c, f"ev/{i % w.groups}")
            pub = await paho.connect(port, "bench-pub")
            numbered = Numbered(w.groups)

            async def send(count: int) -> None:
                # paho queues each packet; the loop's writer callback writes them out.
                for _ in range(count):
                    g, payload = numbered.payload()
                    pub.publish(f"ev/{g}", payload, qos=0)

            yield [pid], send
        finally:
            await paho.close()


PEERS: dict[str, Callable[[Workload, Sink, Path], contextlib.AbstractAsyncContextManager[Any]]]
PEERS = {"canopy": canopy, "nats": nats, "mosquitto": mosquitto}


# --------------------------------------------------------------------------- measuring


async def wait_delivered(sink: Sink, expected: int, stall: float = STALL_S) -> None:
    """Return as soon as ``expected`` notifications arrived (so the CPU window ends there), or
    once none has arrived for ``stall`` seconds (something was lost: report what arrived)."""
    last, since = sink.count, time.perf_counter()
    while sink.count < expected:
        await asyncio.sleep(0.005)
        if sink.count != last:
            last, since = sink.count, time.perf_counter()
        elif time.perf_counter() - since > stall:
            return


async def measure(name: str, w: Workload, tmp: Path) -> dict[str, Any]:
    sink = Sink()
    progress(f"{name}: starting the broker, {w.subscribers} subscribers and the publisher")
    async with PEERS[name](w, sink, tmp) as (pids, send):
        progress(f"{name}: publishing {w.rate:,.0f} events/s for {w.duration:g} s")
        sink.record_latency = True
        (user0, sys0), t0 = process_cpu_split(pids), time.perf_counter()
        published = await publish_paced(w.rate, w.duration, send, w.tick)
        expected = published * w.fanout
        await wait_delivered(sink, expected)
        user1, sys1 = process_cpu_split(pids)
        delivered = sink.count
    per = 1e6 / max(1, delivered)
    latency = percentiles(sink.latencies_ns)
    result = {
        "us_per_notification": round((user1 - user0 + sys1 - sys0) * per, 3),
        "user_us": round((user1 - user0) * per, 3),
        "system_us": round((sys1 - sys0) * per, 3),
        "delivered": delivered,
        "expected": expected,
        "notif_per_s": round(delivered / max(1e-9, sink.last_arrival - t0)),
        "p50_ms": round(latency["p50_ms"], 3),
        "p99_ms": round(latency["p99_ms"], 3),
    }
    progress(
        f"{name}: {result['us_per_notification']} CPU-us per notification, "
        f"{delivered:,} of {expected:,} delivered"
    )
    return result


async def run(
    w: Workload, systems: Sequence[str] = SYSTEMS, rounds: int = 1
) -> dict[str, dict[str, Any]]:
    """Measure each system ``rounds`` times, interleaved (round ``r`` starts ``r`` systems
    further along, so no system always runs first, nor always last): a machine whose speed
    drifts, as this VM's does by a third within an hour, then slows every system's rounds
    alike, and the rounds' paired ratios cancel the drift (see :func:`summary`)."""
    with tempfile.TemporaryDirectory(prefix="canopy-bench-peers-") as tmp:
        measured: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
        for r in range(rounds):
            k = r % len(systems)
            for name in [*systems[k:], *systems[:k]]:
                m = await measure(name, w, Path(tmp))
                measured[name].append(m)
                done(f"{name}: {m['us_per_notification']:.1f} us per notification")
        return {name: summary(ms) for name, ms in measured.items()}


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's result: its only round, or over several the median round (by CPU per
    notification; the lower one of an even count), whose figures stay consistent with each
    other (user + system = total), with ``delivered`` and ``expected`` summed over every
    round and each round under ``rounds``, in the order run."""
    if len(rounds) == 1:
        return rounds[0]
    median = _lower_middle(sorted(rounds, key=lambda m: m["us_per_notification"]))
    return {
        **median,
        "delivered": sum(m["delivered"] for m in rounds),
        "expected": sum(m["expected"] for m in rounds),
        "rounds": rounds,
    }


def paired_ratio(r: dict[str, dict[str, Any]], name: str, other: str) -> float:
    """CPU per notification of ``name`` over ``other``'s: the median of the rounds' ratios when
    there are rounds (each round's two systems ran minutes apart at most; the lower middle one
    of an even count, as :func:`summary` takes), else the ratio."""
    if other not in r or name not in r:
        return math.nan
    ratios: list[float] = sorted(
        x["us_per_notification"] / y["us_per_notification"]
        for x, y in zip(_rounds(r[name]), _rounds(r[other]), strict=True)
        if y["us_per_notification"] > 0
    )
    return _lower_middle(ratios) if ratios else math.nan


def _rounds(m: dict[str, Any]) -> list[dict[str, Any]]:
    """A system's rounds: those under ``rounds``, or the one run it is."""
    rounds: list[dict[str, Any]] = m.get("rounds", [m])
    return rounds


def _lower_middle(ordered: Sequence[T]) -> T:
    """The median of a sorted, non-empty sequence: the lower middle one of an even count."""
    return ordered[(len(ordered) - 1) // 2]


def report(w: Workload, r: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"workload: {w.describe()}",
        f"{'system':<10}  {'CPU us/notification':>19}  {'(user + system)':>15}  {'x NATS':>6}  "
        f"{'x Mosquitto':>11}  {'delivered / expected':>21}  {'notifications/s':>15}  "
        f"{'p50 / p99 ms':>13}",
    ]
    for name, m in r.items():
        split = f"({m['user_us']:.2f} + {m['system_us']:.2f})"
        lines.append(
            f"{name:<10}  {m['us_per_notification']:>19.2f}  {split:>15}  "
            f"{_times(paired_ratio(r, name, 'nats')):>6}  "
            f"{_times(paired_ratio(r, name, 'mosquitto')):>11}"
            f"  {m['delivered']:>10,} / {m['expected']:<8,}  {m['notif_per_s']:>15,}  "
            f"{_latency(m):>13}"
        )
    rounds = max(len(_rounds(m)) for m in r.values())
    if rounds > 1:
        lines.append(
            f"{rounds} rounds, interleaved: each figure is the system's median round, each ratio "
            "the median of the rounds' paired ratios; per round (us/notification):"
        )
        for name, m in r.items():
            per = "  ".join(f"{x['us_per_notification']:.2f}" for x in _rounds(m))
            lines.append(f"  {name:<10}  {per}")
    return "\n".join(lines)


def _latency(m: dict[str, Any]) -> str:
    """p50 / p99 for the table ("-" from a result without them)."""
    if "p50_ms" not in m:
        return "-"
    return f"{m['p50_ms']:.2f} / {m['p99_ms']:.2f}"


def _times(ratio: float) -> str:
    """A ratio for the table; "-" where there is none (that system was not run)."""
    return "-" if math.isnan(ratio) else f"{ratio:.2f}x"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    bench_plots.add_option(parser)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small run for tests: "
        + ", ".join(f"{k} {v:g}" for k, v in QUICK.items())
        + " (flags given explicitly still win)",
    )
    parser.add_argument("--subscribers", type=int, help=f"default {FULL['subscribers']}")
    parser.add_argument(
        "--fanout",
        type=int,
        help=f"subscribers each event reaches; must divide --subscribers (default "
        f"{FULL['fanout']})",
    )
    parser.add_argument("--rate", type=float, help=f"events/s (default {FULL['rate']:g})")
    parser.add_argument(
        "--duration", type=float, help=f"seconds of publishing (default {FULL['duration']:g})"
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated, of " + ", ".join(SYSTEMS) + " (default all; one alone to compare "
        "Canopy with itself under different settings, e.g. CANOPY_LOOP)",
    )
    parser.add_argument(
        "--tick",
        type=float,
        default=1.0,
        help="ms between the publisher's batches (default 1: about rate/1000 events per batch); "
        "larger ticks let every broker batch its writes, which changes CPU per notification",
    )
    parser.add_argument(
        "--client-write-interval-ms",
        type=write_interval_ms,
        default=0.0,
        metavar="MS",
        help="run Canopy's broker with this write pacing (`canopy-broker serve "
        "--client-write-interval-ms`; default 0, the broker's default)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every system this many times, interleaved, and report the median round "
        "and the median of the rounds' paired ratios (default 1; 3 or 5 on a machine whose "
        "speed drifts)",
    )


def workload(args: argparse.Namespace) -> Workload:
    """The flags given, else the ``--quick`` or full defaults; ValueError names a bad one."""
    base = QUICK if args.quick else FULL
    values = {k: getattr(args, k) if getattr(args, k) is not None else base[k] for k in FULL}
    w = Workload(
        subscribers=int(values["subscribers"]),
        fanout=int(values["fanout"]),
        rate=float(values["rate"]),
        duration=float(values["duration"]),
        tick=args.tick / 1000,
        canopy_flags=(
            ("--client-write-interval-ms", f"{args.client_write_interval_ms:g}")
            if args.client_write_interval_ms
            else ()
        ),
    )
    if w.fanout < 1 or w.subscribers < w.fanout or w.subscribers % w.fanout:
        raise ValueError(
            f"--fanout {w.fanout} must be at least 1 and divide --subscribers {w.subscribers} "
            "(each event goes to one group of fan-out subscribers)"
        )
    if w.rate <= 0 or w.duration <= 0 or w.tick <= 0:
        raise ValueError("--rate, --duration and --tick must be positive")
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds} must be at least 1")
    return w


def run_args(args: argparse.Namespace) -> int:
    try:
        w = workload(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    systems = [s.strip() for s in str(args.systems).split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems:
        print(f"error: --systems takes some of {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    missing = missing_peers(systems)
    if missing:
        print(f"error: missing {', '.join(missing)}: {INSTALL_HINT}", file=sys.stderr)
        return 2
    if bench_plots.refused(args.plot):
        return 2
    tune_gc()  # the clients must keep up at the full rate: same GC settings as the brokers
    with showing("bench peers", len(systems) * args.rounds):
        # The clients of all three systems share this process; on asyncio's loop, whatever
        # CANOPY_LOOP says for the brokers: a faster client loop made Mosquitto's broker
        # cheaper per notification (3.8-4.1 vs 5.0-5.6 us), so the harness stays fixed.
        result = asyncio.run(run(w, systems, args.rounds))
    if "canopy" in result:  # which Canopy was measured
        result["canopy"]["client_write_interval_ms"] = args.client_write_interval_ms
    print(report(w, result))
    if args.json:
        print(json.dumps(result))
    ratios = {
        n: (paired_ratio(result, n, "nats"), paired_ratio(result, n, "mosquitto")) for n in result
    }
    drawn = bench_plots.draw(
        args.plot, lambda path: bench_plots.peers(result, ratios, w.describe(), path)
    )
    lost = [n for n, m in result.items() if not delivered_all(m)]
    if lost:
        print(f"error: not every notification delivered by {', '.join(lost)}", file=sys.stderr)
        return 1
    return drawn


def delivered_all(m: dict[str, Any]) -> bool:
    """Every round delivered exactly what it owed (summed counts could hide a loss in one round
    behind a duplicate in another)."""
    return all(r["delivered"] == r["expected"] for r in _rounds(m))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="canopy bench peers", description=__doc__)
    add_arguments(parser)
    return run_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
