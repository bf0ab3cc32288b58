"""The broker process: the asyncio shell that feeds a :class:`BrokerCore` and carries out its
effects.

Listeners. Production runs two: a *link* port that only brokers of the overlay may use (TLS
with a certificate required, so a stranger is refused at the handshake) and a *client* port
(a certificate or a bearer token); each refuses the other's hello with ``wrong-port``, so a
firewall or NetworkPolicy can admit links from the overlay's own brokers only. Without a link
listener one port serves both, as tests and laptops like; the first frame (the hello) says
which a connection is. The admin API is a third port (admin.py).

The core is called synchronously from ``data_received``, so a TCP read's worth of frames is
decoded and routed without a task switch, and its effects are appended to per-destination queues
that are flushed once per loop iteration (see :mod:`canopy_broker.runtime.links`).

Backpressure. Links are *never* paused for reading: two brokers that both stop reading until the
other drains would deadlock. Instead, while any link's queue of unacknowledged messages is above
``high_water``, the broker pauses reading from the clients that publish, and resumes them once
every queue is below ``low_water``.

Slow consumers (``slow_consumer_policy``). By default (``disconnect``) a client that does not read
fast enough never slows anybody else: its queue of unsent notifications is its own, and once it
passes ``client_hard_cap``, or stays above high water for ``slow_consumer_grace`` seconds, that
client alone is cut off with a ``slow-consumer`` error (it may resume elsewhere, from retention).
With ``backpressure`` a lagging client's queue pauses the publishers too, overlay-wide, as a
link's does (flow control instead of loss for that client), until the same limits cut it off.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import math
import ssl
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from canopy_broker import core_build
from canopy_broker.core.broker import BrokerCore, CoreFailedError, ProtocolError
from canopy_broker.core.events import Event, event_sampled
from canopy_broker.core.messages import (
    CloseLink,
    Deliver,
    DeliverMarker,
    DetourLink,
    Effect,
    ExchangeFinished,
    Input,
    LinkRepair,
    OpenLink,
    Ordering,
    Placed,
    Publish,
    Repaired,
    RepairFinished,
    Resumed,
    RoutingMode,
    SendToLink,
    SendToPeer,
    StartExchange,
    StartTimer,
    TellGap,
    TimerFired,
)
from canopy_broker.runtime.accept import (
    Admission,
    Quiet,
    Serving,
    SourceCounts,
    listen,
    source_of,
)
from canopy_broker.runtime.client_sessions import ClientSessions
from canopy_broker.runtime.config import BrokerConfig
from canopy_broker.runtime.conn import Conn
from canopy_broker.runtime.eventloop import loop_name
from canopy_broker.runtime.framing import (
    B_CUT_OFF,
    B_MARKER,
    F_BYE,
    F_DATA,
    F_ERROR,
    F_HELLO,
    F_MSGS,
    F_PRESSURE,
    FEATURES,
    PROTOCOL_VERSION,
    FrameError,
    FrameProtocol,
    TurnBudget,
    control_frame,
    dumps,
    encode_event_body,
    encode_link_message,
    error_detail,
    join_address,
    loads_frame,
    parse_address,
)
from canopy_broker.runtime.heap import HeapTrim, malloc_trim
from canopy_broker.runtime.link_sessions import LinkSessions
from canopy_broker.runtime.links import Client, Link
from canopy_broker.runtime.metrics import BrokerMetrics, Gauges, LoopWatch
from canopy_broker.runtime.outbox import Outlet, fan_out, flush_outlets
from canopy_broker.runtime.placement import PlacementSource
from canopy_broker.runtime.security import (
    AccessError,
    Policy,
    SecurityError,
    TlsFiles,
    authenticate_client,
    check_link_peer,
    file_stamp,
    transport_identity,
)
from canopy_broker.runtime.tasks import TaskSet
from canopy_broker.runtime.telemetry import Telemetry

__all__ = ["Broker", "BrokerConfig", "ExchangeRecord"]  # BrokerConfig: where callers import it

log = logging.getLogger("canopy.broker")

REFUSAL_CODES = frozenset(
    {"unauthenticated", "wrong-identity", "forbidden", "wrong-port", "too-many-connections"}
)
"""Error codes of security refusals (counted as refusals, not as malformed input)."""

FLUSH_AFTER = 0.002
"""Within one TCP read, flush once the events routed since the last flush took this long
(seconds). A read can hold a thousand events when a broker is behind; routing them all before
writing anything would hold the first notification back for the whole read (over 10 ms), and
flushing after each few events would cost a write per subscriber per few events. Measured
(docs/performance.md, session 5): a flush every 64 events held the one-broker benchmark to
430-460k notifications/s, every 256 events gave 620-630k, as each write carried four times as
much. A bound in time rather than events keeps the wait the same whatever an event costs
(filters, fan-out): the first notification of a read waits at most this, or one event's
routing if that is longer, and a read that fits in it is written whole, at its end, as before.
The clock is read once per event (about 0.1 us, against 10-20 us of routing)."""
TIMER_SLACK = 0.002
"""Write pacing: a client due within this of the timer is written by it. uvloop's timers
count whole milliseconds and may fire before the due time; holding the client again then
made a notification wait two intervals (found by review: 1 to 5 times in 40 at 20 ms)."""
ACK_INTERVAL = 0.05
"""Seconds between publish acknowledgements (see ClientSessions.acknowledge_publishers)."""
ACK_SOON = 0.005
"""Seconds from an occasional publication (the broker's last publish acknowledgement was an
interval ago or more) to the acknowledgement round it brings forward; each round that still
finds something owed doubles the wait, up to :data:`ACK_INTERVAL`. Its next hops acknowledge
it within a link round trip, so its publisher is acknowledged in about that, where the round's
phase alone made it wait 0-50 ms. Steady publishing keeps the interval (a round per event
would cost more than it saves). Other work that wakes a resting broker (link data, heartbeats,
a connection) has the round come this soon only if the last round was an interval ago or more:
a steady stream of link data at an edge broker wakes it per frame."""


@dataclass(slots=True)
class ExchangeRecord:
    """What this broker knows about an exchange it initiated (for ``GET /exchanges/{xid}``)."""

    xid: str
    path: tuple[str, ...]
    remove: tuple[str, str]
    ordering: str
    lease: float = 30.0
    state: str = "running"  # running | finished | failed
    ok: bool | None = None
    reason: str = ""
    attempts: int = 0
    started: float = 0.0
    finished: float | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def to_json(self) -> dict[str, Any]:
        return {
            "xid": self.xid,
            "path": list(self.path),
            "remove": list(self.remove),
            "ordering": self.ordering,
            "lease": self.lease,
            "state": self.state,
            "ok": self.ok,
            "reason": self.reason,
            "attempts": self.attempts,
            "started": self.started,
            "finished": self.finished,
        }


_MARKER = dumps([B_MARKER])


@functools.lru_cache(maxsize=1024)
def is_loopback(source: str) -> bool:
    """Whether a peer's address is this host's loopback (an IPv4-mapped one too)."""
    try:
        address = ipaddress.ip_address(source)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool((mapped or address).is_loopback)


PROBE_ANSWER_MAX = 65_536
"""Bytes a probe's answer may have. An honest one (a hello, with ``heard``: some 40 bytes per
neighbour heard lately) stays far below; a larger one counts as no answer, so it must not be
one a broker with many links could send (it was 4 KB: about 100 links)."""

# The longest stretch a gap may name (POST /gaps): a partition's, at most a day back.
MAX_GAP_S = 86_400.0


class Broker:
    """One broker: core + links + clients + metrics + telemetry; no HTTP (see admin.py)."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.name = config.name
        detection = config.detection_timeout
        self.core = BrokerCore(
            config.name,
            RoutingMode(config.routing),
            announce_neighbours=config.repair,
            retention_window=config.retention_seconds if config.repair else 0.0,
            retention_limit=config.retention_limit,
            retention_bytes=config.retention_bytes,
            repair_timeout=max(10.0, 5 * detection),
            started=asyncio.get_running_loop().time(),
            custody_horizon=detection + config.heartbeat_interval,
        )
        self.tasks = TaskSet(config.name, on_failure=self._task_failed)
        # Why this broker can no longer be trusted (a background task died, or its core hit an
        # internal error); /healthz reports it so a supervisor restarts the process.
        self.failed: str | None = None
        self.fenced_by: str | None = None  # a broker that declared this one dead (fenced_out)
        # Why clients are refused for now (config.hold_clients), None once they are admitted.
        self.clients_held: str | None = None
        self._hold_timer: asyncio.TimerHandle | None = None
        self._hold_until = 0.0  # the loop's time: clients admitted then, linked or not
        self.incarnation = uuid.uuid4().hex[:8]
        self.resume_slack = max(2.0, detection)
        self.max_subscriptions = config.max_subscriptions
        self.queue_slot = config.slot
        self.peers: dict[str, str] = {}  # address book: broker name -> HOST:PORT (links)
        self.client_peers: dict[str, str] = {}  # ... and where their clients connect
        self.exchanges: dict[str, ExchangeRecord] = {}
        self.reconfiguration_messages: dict[str, dict[str, int]] = {}
        # Leaf additions and removals asked for through POST /reconfigurations, by id.
        self.leaf_steps: dict[str, dict[str, Any]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.metrics = BrokerMetrics(self._gauges)
        self.idle = False  # nothing owed to anyone: see _acknowledge() and wake()
        self.loop_watch = LoopWatch(
            self.metrics, size=self.core.routing_table_size, may_rest=self._may_rest
        )
        # The acknowledgement round (_acknowledge): when it is due next (never while idle),
        # the wait it doubles while something stays owed, when it last ran and when it last
        # sent a publish acknowledgement, and the event that tells it of an earlier due time.
        self._round_due = 0.0
        self._round_wait = ACK_INTERVAL
        self._last_round = -math.inf
        self._last_puback = -math.inf
        self._due_sooner = asyncio.Event()
        # Frame handling hands the loop back every 10 ms (heartbeats, timers, other peers).
        self.work_budget = TurnBudget(0.01)
        self.telemetry = Telemetry(
            config.name,
            sample_rate=config.telemetry_sample,
            history=config.history,
            directory=config.telemetry_dir,
        )
        self.started = time.monotonic()
        self.address: tuple[str, int] | None = None  # the client (or shared) listener's
        self.link_address: tuple[str, int] | None = None  # the link listener's, if separate
        self.advertised = ""  # HOST:PORT other brokers dial
        self.client_advertised = ""  # HOST:PORT clients are sent to (failover, drains)
        self.stopping = False
        self._loop = asyncio.get_running_loop()
        self._server: Serving | None = None
        self._link_server: Serving | None = None
        self._conns: set[Conn] = set()
        self._dirty: list[Link] = []  # links to flush; clients wait on their outlets:
        self._outlets: list[Outlet] = []  # runtime/outbox.py (compiled fan-out and flush)
        self._flush_scheduled = False
        # Write pacing (config.client_write_interval): the timer that writes the clients held
        # (each outlet knows when it is due: Outlet.due).
        self._clients_timer: asyncio.TimerHandle | None = None
        self._unflushed = 0  # events routed since the last flush
        self._unflushed_since = 0.0  # when the first of them was (time.perf_counter)
        self._delivered = 0  # notifications queued to clients, not yet in the metrics
        self._over: set[Link | Client] = set()
        self._lagging: set[Client] = set()  # slow consumers under the disconnect policy
        self._sources = SourceCounts(config.max_connections_per_source)  # accepted ones
        # Strangers' connections closed, logged once per code per interval (a flood of idle
        # TLS connections logged a line each, all in the same second).
        self._strangers_told = Quiet()
        self.publishers_paused = False
        self.custody_full = False  # a link's retention is at its limit: publishers wait
        self._warned: set[str] = set()
        self._events = 0
        self._ticker: asyncio.Task[None] | None = None
        self._probing: asyncio.Task[None] | None = None
        self._m_delivered = self.metrics.delivered
        self._m_client_out = self.metrics.client_messages.labels("out")
        self.sessions = LinkSessions(self)
        self.links = self.sessions.links  # the overlay links by peer (one table, shared)
        # Security: TLS contexts (None: plaintext) and the client policy (see security.py).
        # The overlay's material (config.tls) serves links both ways; the client listener may
        # have material of its own (config.client_tls). Each group is reloaded on rotation.
        self.secure = config.tls is not None
        self._tls_groups: list[tuple[TlsFiles, list[ssl.SSLContext]]] = []
        self.tls_server: ssl.SSLContext | None = None  # the client (or shared) listener's
        self.tls_client: ssl.SSLContext | None = None  # for dialing peers
        self.tls_link_server: ssl.SSLContext | None = None  # the link listener's
        if config.tls is not None:
            overlay = [config.tls.client_context()]
            self.tls_client = overlay[0]
            if config.link_port is not None:
                self.tls_link_server = config.tls.server_context(require_certificate=True)
                overlay.append(self.tls_link_server)
            self.tls_server = (config.client_tls or config.tls).server_context()
            if config.client_tls is None:
                overlay.append(self.tls_server)
            else:
                self._tls_groups.append((config.client_tls, [self.tls_server]))
            self._tls_groups.insert(0, (config.tls, overlay))
        self.policy = Policy.load(config.policy_file) if config.policy_file else Policy()
        self._policy_stamp = file_stamp(config.policy_file)
        self._tls_stamps = [files.stamp() for files, _ in self._tls_groups]
        self.client_sessions = ClientSessions(self, self._unacknowledged)
        self.clients = self.client_sessions.clients
        self.placement = PlacementSource(config.zone, config.node, config.placement_dir)
        self.heap = HeapTrim(malloc_trim())
        # Gray notifications' waits at the new link of an exchange, taken from the core.
        self._delays = [0, 0.0, 0.0]  # count, sum, max (seconds)

    # ------------------------------------------------------------------ lifecycle

    async def _listen(
        self, host: str, port: int, listener: str, tls: ssl.SSLContext | None
    ) -> Serving:
        return await listen(
            lambda: self._accepted(listener),
            host,
            port,
            tls=tls,
            admission=Admission(
                handshake_timeout=self.config.handshake_timeout,
                limit=self.config.max_connections_per_source,
                tasks=self.tasks,
                who=self.name,
                exempt=self._uncounted,
                on_accept=self._socket_accepted,
                on_refused=self.metrics.refused.labels("unknown", "too-many-handshakes").inc,
            ),
        )

    def _uncounted(self, source: str) -> bool:
        """This host's own connections are not counted per address (see :meth:`conn_made`)."""
        return is_loopback(source)

    def _socket_accepted(self) -> None:
        """A socket accepted, its TLS handshake (on this loop's CPU) still to come: work, and
        memory the heap trim counts."""
        self.wake()
        self.heap.accepted()

    def _accepted(self, listener: str) -> Conn:
        """A connection accepted, and its TLS handshake done (``runtime.accept``)."""
        self.wake()
        return Conn(self, listener=listener)

    async def start(self) -> None:
        cfg = self.config
        separate = cfg.link_port is not None
        self._server = await self._listen(
            cfg.host, cfg.port, "client" if separate else "", self.tls_server
        )
        sock = self._server.sockets[0].getsockname()
        self.address = (sock[0], sock[1])
        if cfg.link_port is not None:
            self._link_server = await self._listen(
                cfg.link_host or cfg.host, cfg.link_port, "link", self.tls_link_server
            )
            sock = self._link_server.sockets[0].getsockname()
            self.link_address = (sock[0], sock[1])
        self.advertised = cfg.advertise or join_address(sock[0], sock[1])
        # Clients reach the advertised host at the client port (--client-advertise otherwise).
        host = self.advertised.rpartition(":")[0]
        self.client_advertised = cfg.client_advertise or f"{host}:{self.address[1]}"
        self._ticker = self.tasks.spawn(self._tick(), "ticker", forever=True)
        hold = cfg.hold_clients or self.placement.annotated_hold()
        if hold > 0:
            self.clients_held = f"not linked yet, for at most {hold:g} s"
            self._hold_until = self._loop.time() + hold
            self._hold_timer = self._loop.call_at(
                self._hold_until, self._admit_clients, f"no link within {hold:g} s"
            )
        self.loop_watch.start(self._loop)
        self.tasks.spawn(self._acknowledge(), "publish acks", forever=True)
        self._update_placement()
        log.info(
            "broker %s listening on %s:%d%s (%s; core %s, loop %s)",
            self.name,
            *self.address,
            f", links on {self.link_address[0]}:{self.link_address[1]}"
            if self.link_address
            else "",
            "TLS" if self.secure else "PLAINTEXT: no TLS, no authentication",
            core_build(),
            loop_name(self._loop),
        )

    @property
    def ready(self) -> bool:
        return self._server is not None and not self.stopping and self.failed is None

    def linked(self, peer: str) -> None:
        """A link of the tree came up: a broker holding its clients admits them one heartbeat
        later. The neighbour sends its routing table right after its hello, on the same
        connection; a heartbeat later it has arrived, so what a client publishes here then is
        routed to the overlay's subscribers."""
        if self.clients_held is None:
            return
        assert self._hold_timer is not None  # set whenever clients are held
        self._hold_timer.cancel()
        due = min(self._loop.time() + self.config.heartbeat_interval, self._hold_until)
        self._hold_timer = self._loop.call_at(due, self._admit_clients, f"linked to {peer}")

    def _admit_clients(self, why: str) -> None:
        if self.clients_held is None:
            return
        if self._loop.time() < self._hold_until and not any(
            lk.conn is not None for lk in self.sessions.links.values()
        ):  # the link dropped again meanwhile: the next one to come up admits, or the cap
            self._hold_timer = self._loop.call_at(
                self._hold_until, self._admit_clients, "no link that stayed up"
            )
            return
        log.info("%s: admitting clients (%s)", self.name, why)
        self.clients_held = None
        self._hold_timer = None

    @property
    def max_frame(self) -> int:
        return self.config.max_frame

    def fail(self, why: str) -> None:
        """This broker is broken beyond one connection: say so once, loudly, and report it
        unhealthy (a Kubernetes liveness probe or ``canopy up``'s supervisor restarts it)."""
        if self.failed is None:
            self.failed = why
            log.critical("%s: broker failed: %s", self.name, why)
            # Nothing it started will finish now: whoever waits on one is told (the
            # supervisor's executor polled a fenced initiator's "running" exchange for good,
            # holding the overlay's lock: chaos soak).
            for rec in [r for r in self.exchanges.values() if r.state == "running"]:
                reason = f"{self.name} failed before the exchange ended: {why}"
                self._exchange_finished(ExchangeFinished(rec.xid, False, reason, rec.attempts))

    def fenced_out(self, by: str, silent_for: float | None) -> None:
        """``by`` declared this broker dead (paused, or cut off, past failure detection) and
        repaired the overlay without it: this process's routing state is stale and no
        neighbour takes it back. It fails (unhealthy: its supervisor restarts it, to rejoin as
        a new member) and lets its clients go at once, as if it had died, so that they fail
        over to live brokers and resume there: subscribers from retention, told of any gap;
        publishers sending again what was not acknowledged. Kept, they heard nothing more and
        were told nothing (found by review, with a 2 s SIGSTOP). Clients that come back are
        refused while it lasts.

        Each client is told first how long ago this broker left the overlay (``B_CUT_OFF``):
        ``silent_for``, since ``by`` last heard it, or without that the retention horizon. Its
        failover resumes from then: what the new broker holds since is served, and a repair
        since is reported as a gap. From the moment the connection closed instead, what the
        overlay sent on while this broker was paused was missed silently (found by review)."""
        if self.fenced_by is not None:
            return
        self.fenced_by = by
        self.fail(
            f"{by} declared this broker dead and repaired the overlay without it: restart it "
            "to rejoin as a new member"
        )
        cut_off = dumps(
            [B_CUT_OFF, silent_for if silent_for is not None else self.config.retention_seconds]
        )
        clients = list(self.clients.values())
        for client in clients:
            self.client_sessions.send(client, cut_off)
        self._flush(force=True)  # behind what is queued to them, before the connections close
        for client in clients:
            client.conn.close()
        log.error("%s: let %d client(s) go, to fail over to live brokers", self.name, len(clients))
        self.sessions.leave()

    def _task_failed(self, task: str, why: str) -> None:
        self.fail(f"background task {task!r} {why}")

    async def stop(self, flush_timeout: float = 2.0) -> None:
        """Graceful stop: no new connections, flush queues briefly, say goodbye, close all."""
        if self.stopping:
            return
        self.stopping = True
        servers = [s for s in (self._server, self._link_server) if s is not None]
        for server in servers:
            server.close()
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        await self.tasks.stop()
        self.loop_watch.stop()
        if self._clients_timer is not None:
            self._clients_timer.cancel()
            self._clients_timer = None
        self._flush(force=True)  # what write pacing holds too
        deadline = self._loop.time() + flush_timeout
        while self._loop.time() < deadline and self._undelivered():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        for link in self.sessions.all_links():
            if link.conn is not None:
                link.conn.write(control_frame(F_BYE, "shutdown"))
        conns = list(self._conns)
        for conn in conns:
            conn.close()
        if conns:
            _, pending = await asyncio.wait([c.lost for c in conns], timeout=1.0)
            for conn in conns:
                if not conn.lost.done():
                    conn.abort()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for server in servers:
            await server.wait_closed()
        await self.telemetry.flush()
        log.info("broker %s stopped", self.name)

    def _undelivered(self) -> bool:
        if any(lk.conn is not None and lk.out for lk in self.sessions.all_links()):
            return True
        return any(
            c.pending or (c.conn.transport is not None and c.conn.transport.get_write_buffer_size())
            for c in self.clients.values()
        )

    async def _tick(self) -> None:
        """Heartbeats, dead-link detection, slow-consumer grace, telemetry snapshots."""
        cfg = self.config
        next_snapshot = self._loop.time() + cfg.telemetry_interval
        next_probe = self._loop.time() + cfg.probe_interval
        while True:
            await asyncio.sleep(cfg.heartbeat_interval)
            # Measured finely, as any work; nothing here is owed to a client, so the
            # acknowledgement round sleeps on and the watch rests again at its next tick
            # (unless a repair begun below re-kept retained notifications: see the end).
            self.loop_watch.wake()
            now = self._loop.time()
            if cfg.probe_interval > 0 and now >= next_probe and self._probing is None:
                next_probe = now + cfg.probe_interval
                self._probing = self.tasks.spawn(self._probe_peers(), "rtt probes")
            self.sessions.heartbeat(now)
            self._check_conns(now)
            self.heap.tick(now)  # after a burst of connections: their memory back
            self._reload_policy()
            self._reload_tls()
            self._update_placement()
            for client in [*self._over, *self._lagging]:
                if (
                    isinstance(client, Client)
                    and client.over_since is not None
                    and now - client.over_since > cfg.slow_consumer_grace
                ):
                    self._slow_consumer(client, "stayed above high water")
            if now >= next_snapshot:
                next_snapshot = now + cfg.telemetry_interval
                self.telemetry.placement(self.placement.current)  # kept in every window
                for link in self.links.values():
                    st = link.status()
                    self.telemetry.link(
                        link.peer,
                        {
                            k: st[k]
                            for k in (
                                "state",
                                "msgs_in",
                                "msgs_out",
                                "bytes_in",
                                "bytes_out",
                                "rtt_ms",
                            )
                        },
                    )
            self._take_ordering_delays()
            if self.idle and self._holds_custody():
                self.wake()  # a repair begun here re-kept notifications: the round ages them
            await self.telemetry.flush()

    async def _acknowledge(self) -> None:
        """Publish acknowledgements, a few times per link round trip: often enough that a
        publisher holds little for a failover, rarely enough to cost nothing per event. Once
        nothing is owed (every publication acknowledged, nothing retained for crash repair),
        the broker is idle: this loop and the loop watch rest until work arrives (:meth:`wake`),
        and an occasional publication brings the round forward (:meth:`publications`)."""
        sessions = self.client_sessions
        loop = self._loop
        while True:
            while True:  # until the due time (set sooner meanwhile: until that one)
                self._due_sooner.clear()
                due = self._round_due
                try:
                    async with asyncio.timeout_at(None if due == math.inf else due):
                        await self._due_sooner.wait()
                except TimeoutError:
                    break
            sent = sessions.pubacks
            owed = sessions.acknowledge_publishers() if self.clients else False
            now = self._last_round = loop.time()
            if sessions.pubacks > sent:
                self._last_puback = now
            self._age_retention()
            if owed or self._holds_custody():
                self._round_wait = min(ACK_INTERVAL, 2 * self._round_wait)
                self._round_due = now + self._round_wait
            else:
                self.idle = True  # the loop watch rests from its next tick
                self._round_wait = ACK_INTERVAL
                self._round_due = math.inf

    def _round_sooner(self, due: float) -> None:
        if due < self._round_due:
            self._round_due = due
            self._due_sooner.set()

    def publications(self) -> None:
        """A frame brought publications (after :meth:`wake`): if the last publish
        acknowledgement was an interval ago or more, the round comes after :data:`ACK_SOON`."""
        now = self._loop.time()
        if now - self._last_puback >= ACK_INTERVAL and self._round_due > now + ACK_SOON:
            self._round_wait = ACK_SOON
            self._round_sooner(now + ACK_SOON)

    def _holds_custody(self) -> bool:
        """Notifications retained for crash repair (aged by the round), or a full retention
        (publishers held until it has room)."""
        return self.custody_full or any(self.core.retention.by_peer.values())

    def _may_rest(self) -> bool:
        """For the loop watch: nothing owed, and no withdrawal still working turn by turn."""
        return self.idle and not self.client_sessions.withdrawing

    def wake(self) -> None:
        """Work arrived (see :meth:`_acknowledge`): called first thing by whatever brings it:
        a connection accepted, its data and each frame it handles (frames are also handled in
        later turns, or held and released), a connection made or lost, a core timer, an admin
        request. Nothing to do unless :attr:`idle`; the per-read and per-frame callers test
        that themselves, to spare the call."""
        if not self.idle:
            return
        self.idle = False
        self.loop_watch.wake()
        # Soon after a rest (the callback rests again sooner), but no sooner than an interval
        # after the last round: a steady stream of link data wakes an edge broker per frame.
        self._round_sooner(max(self._loop.time() + ACK_SOON, self._last_round + ACK_INTERVAL))

    def _age_retention(self) -> None:
        """Drop retained notifications past their window; publishers wait while a link's
        retention is full of ones younger than the detection horizon."""
        retention = self.core.retention
        if retention.enabled and (retention.by_peer or self.custody_full):
            full = retention.pressing(self._loop.time())
            if full != self.custody_full:
                self.custody_full = full
                if full:
                    log.warning(
                        "%s: a link's retention holds %d notifications or %d bytes younger"
                        " than %.1fs: publishers wait (raise --retention-limit or"
                        " --retention-bytes for more throughput)",
                        self.name,
                        retention.limit,
                        retention.limit_bytes,
                        retention.horizon,
                    )
                self.update_pressure()

    # ------------------------------------------------------------------ connections

    def conn_made(self, conn: Conn) -> None:
        self.wake()
        self._conns.add(conn)
        if conn.dialing:
            assert conn.link is not None
            conn.write(self.sessions.hello_frame(conn.link))
            return
        conn.opened_at = self._loop.time()
        source = source_of(conn.transport)
        if is_loopback(source):
            # This host's own: its gateways' sessions (every MQTT and HTTP gateway client is a
            # client of its broker from here, and the gateways limit them by their own remote
            # addresses); on Kubernetes nothing else shares a pod's loopback. Counted together,
            # a few hundred gateway clients from anywhere locked every new client out (review).
            return
        if self._sources.take(source):
            conn.source = source  # given back when it is lost
            return
        self.metrics.refused.labels("unknown", "too-many-connections").inc()
        self._sources.refused(source, log, self.name)
        conn.fail(
            FrameError(
                f"{self._sources.count(source) + 1} connections from {source} "
                f"(limit {self._sources.limit})",
                "too-many-connections",
            )
        )

    def _check_conns(self, now: float) -> None:
        """Close accepted connections that hold resources without using them: no hello within
        the handshake timeout, or a frame begun and not finished within the frame timeout
        (two bytes of a header, then nothing)."""
        cfg = self.config
        stalled_before = now - cfg.frame_timeout
        for conn in list(self._conns):
            if conn.dialing or conn.is_closing():
                continue
            if conn.reading_paused and not conn.holds("withdrawing"):
                continue  # our doing, not the peer's (its clock restarts on resume)
            if conn.role is None and now - conn.opened_at > cfg.handshake_timeout:
                conn.fail(
                    FrameError(f"no hello within {cfg.handshake_timeout:g}s", "hello-timeout")
                )
            elif conn.partial_since is not None and conn.partial_since < stalled_before:
                conn.fail(
                    FrameError(
                        f"a frame begun {cfg.frame_timeout:g}s ago is still incomplete", "stalled"
                    )
                )

    def conn_failed(self, conn: Conn, exc: FrameError) -> None:
        role = conn.role or "unknown"
        if conn.role == "client" and conn.client is not None:
            # Gone now, not when the connection is: a TLS close waits for the peer's
            # close_notify, and its subscriptions must not outlive the error meanwhile.
            self.client_sessions.detach(conn.client)
        if exc.code in REFUSAL_CODES:  # counted and logged where they were decided
            return
        if exc.code == "joining":  # not an error: the client tries again (admission is logged)
            return
        self.metrics.malformed.labels(role, exc.code).inc()
        if conn.role is None:  # a stranger's (no hello yet): named by its address
            due = self._strangers_told.due(exc.code)
            if due is None:  # a flood: counted, told with the next line
                return
            held, ago = due
            more = f" ({held} more since, {ago:.0f} s ago)" if held else ""
            source = conn.source or source_of(conn.transport)
            log.warning("%s: closing a connection from %s: %s%s", self.name, source, exc, more)
            return
        who = conn.link.peer if conn.link else conn.client.id if conn.client else "?"
        log.warning("%s: closing %s connection (%s): %s", self.name, role, who, exc)

    def conn_lost(self, conn: Conn) -> None:
        self.wake()
        self._conns.discard(conn)
        if conn.source:
            self._sources.give_back(conn.source)
        if conn.role == "client":
            assert conn.client is not None
            self.client_sessions.detach(conn.client)
        elif conn.role in ("link", "peer", "standby"):
            assert conn.link is not None
            self.sessions.lost(conn.link, conn)

    def mark_dirty(self, dest: Link | Client) -> None:
        """``dest`` has something to write (or a decision to take): flush it this loop turn.
        For a client this is a reply or a decision, never held by write pacing: it makes the
        client due now, and asks for a flush even when the client is already waiting for one
        (held, it would otherwise wait for the next event or the timer)."""
        if isinstance(dest, Client):
            outlet = dest.outlet
            outlet.due = 0.0
            if not outlet.dirty:
                outlet.dirty = True
                self._outlets.append(outlet)
        elif not dest.dirty:
            dest.dirty = True
            self._dirty.append(dest)
        else:
            return
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _count_delivered(self) -> None:
        """Into the metrics: once per flush (and scrape), not per event (two counter updates
        per event were a few percent of a broker's CPU)."""
        if self._delivered:
            self._m_delivered.inc(self._delivered)
            self._m_client_out.inc(self._delivered)
            self._delivered = 0

    def _flush(self, force: bool = False, timer: bool = False) -> None:
        """Write what every woken link and client holds, then take the decisions their queues
        ask for: press or release publishers (a queue over high water, or back under low), and
        time or cut a slow consumer. The clients' writes are compiled (``flush_outlets``), which
        hands back only the few clients to decide about: those over ``high`` (or the hard cap,
        while anything is pressed or lagging) and those pressed or lagging already.

        With write pacing (``config.client_write_interval``), each client is written at most
        once per interval, replies to it excepted: one written less than an interval ago stays
        on the dirty list, for a later flush or the timer (``timer``: this is it, see
        :meth:`_paced_flush`); ``force`` writes every client now, as when stopping. Why: on
        loopback and in a VM, most of a notification's CPU is its ``write`` and the client's
        wake-up inside it (docs/performance.md, session 9); one write per several
        notifications pays that once. Links are never held: each hop would add the wait."""
        self._flush_scheduled = False
        self._unflushed = 0
        self._count_delivered()
        high = self.config.high_water
        low = self.config.low_water
        over, lagging = self._over, self._lagging
        outlets, self._outlets = self._outlets, []
        links, self._dirty = self._dirty, []
        if outlets:
            cap = self.config.client_hard_cap
            marked = None
            if over or lagging:
                marked = {c.outlet for c in lagging}
                marked.update(d.outlet for d in over if isinstance(d, Client))
            clients = self.clients
            pace = 0.0 if force or self.stopping else self.config.client_write_interval
            held: list[Outlet] | None = [] if pace > 0.0 else None
            now = self._loop.time() if held is not None else 0.0
            # A timer may fire a little early (uvloop's count whole milliseconds): what is due
            # within TIMER_SLACK of it is due then (held again, it waited an interval more).
            attention = flush_outlets(
                outlets,
                min(high, cap),
                marked,
                now=now + TIMER_SLACK if timer else now,
                pace=pace,
                held=held,
                slot=self.queue_slot,
            )
            if held:
                # Written by a later flush, which the next read brings anyway, or by the timer
                # when none comes: an interval after this first hold (every held client is due
                # by then), or after the timer, at the first one due. A timer at each due time
                # instead would wake the broker once more per write: that costs more CPU here
                # than it saves.
                self._outlets += held  # still marked dirty
                if self._clients_timer is None:
                    when = min(o.due for o in held) if timer else now + pace
                    self._clients_timer = self._loop.call_at(when, self._paced_flush)
            elif held is not None and self._clients_timer is not None:
                self._clients_timer.cancel()
                self._clients_timer = None
            # Every queue over high water or the hard cap comes back: the decisions and the
            # cap below need to look at no other.
            decide = []
            for outlet in attention:
                client = clients.get(outlet.client_id)
                if client is not None and client.outlet is outlet:
                    self._decide(client, client.depth, high, low)
                    decide.append(client)
            if over or lagging:
                cap_bytes = self.config.client_cap_bytes
                for client in decide:
                    queued = client.outlet.pending_bytes
                    if cap_bytes and queued > cap_bytes:
                        self._slow_consumer(client, f"{queued} bytes queued, above {cap_bytes}")
                    elif client.depth > cap:
                        self._slow_consumer(client, f"queue above {cap} messages")
        for link in links:
            link.dirty = False
            depth = link.flush()
            if link.over:
                if depth < low:
                    self.unpressure(link)
            elif depth > high and link.kind == "link" and link.conn is not None:
                self._pressure(link)

    def _paced_flush(self) -> None:
        """Write pacing's timer: the clients held that are due (within ``TIMER_SLACK``) are
        written; the others, held after the first, at the first of their due times."""
        self._clients_timer = None
        self._flush(timer=True)

    def _decide(self, client: Client, depth: int, high: int, low: int) -> None:
        """A client's queue after a flush, where it is ``depth`` long: pressed publishers are
        released once it is under ``low``; over ``high`` it presses them (the backpressure
        policy) or is timed as a slow consumer (disconnect: its own problem, not pressed)."""
        lagging = self._lagging
        if client.over:
            if depth < low:
                self.unpressure(client)
        elif depth > high:
            if self.config.slow_consumer_policy == "backpressure":
                self._pressure(client)
            elif client not in lagging:
                client.over_since = self._loop.time()
                lagging.add(client)
        elif client in lagging and depth < low:
            lagging.discard(client)
            client.over_since = None

    # ------------------------------------------------------------------ backpressure

    def _pressure(self, dest: Link | Client) -> None:
        dest.over = True
        if isinstance(dest, Client):
            dest.over_since = self._loop.time()
        self._over.add(dest)
        self.update_pressure()

    def unpressure(self, dest: Link | Client) -> None:
        if isinstance(dest, Client) and dest in self._lagging:
            self._lagging.discard(dest)
            dest.over_since = None
        if not dest.over:
            return
        dest.over = False
        if isinstance(dest, Client):
            dest.over_since = None
        self._over.discard(dest)
        self.update_pressure()

    def update_pressure(self) -> None:
        """Recompute who must pause, after any change of a queue's state or a neighbour's signal.

        A broker pauses its publishers while one of its own queues is over high water *or* a
        neighbour reports pressure; it reports pressure to neighbour N when it is congested
        itself or another neighbour reported it (split horizon: a tree has no other path back,
        so the signal cannot latch itself on). The effect is an overlay-wide XOFF for publishers
        while any broker is congested, carried by control frames that bypass the data queues;
        links keep being read throughout, so there is no deadlock.
        """
        local = bool(self._over) or self.custody_full
        remote = [lk for lk in self.links.values() if lk.remote_pressure]
        for link in self.links.values():
            want = local or any(r is not link for r in remote)
            if want != link.sent_pressure and link.conn is not None:
                link.sent_pressure = want
                link.conn.write(control_frame(F_PRESSURE, want))
        paused = local or bool(remote)
        if paused == self.publishers_paused:
            return
        self.publishers_paused = paused
        if paused:
            self.metrics.backpressure.inc()
        for client in self.clients.values():
            if client.publisher:
                if paused:
                    client.conn.pause("pressure")
                else:
                    client.conn.resume("pressure")

    def link_acked(self, link: Link) -> None:
        """``link``'s queue shrank (an acknowledgement)."""
        if link.over and link.depth < self.config.low_water:
            self.unpressure(link)
        if self.client_sessions.drain_target is not None and not self.clients:
            self.client_sessions.check_drained()

    def _slow_consumer(self, client: Client, why: str) -> None:
        log.warning("%s: disconnecting slow consumer %s (%s)", self.name, client.id, why)
        self.metrics.slow_consumers.inc()
        client.pending.clear()
        client.outlet.pending_bytes = 0
        self.heap.freed()  # its queue's memory back to the system at the next tick
        self.unpressure(client)
        client.conn.write(control_frame(F_ERROR, "slow-consumer", why))
        client.conn.abort()

    # ------------------------------------------------------------------ frames

    def frame_received(self, conn: Conn, frame: list[Any]) -> list[Any] | None:
        """Handle one frame; a long one may be handed back unfinished (see ``work_budget``)."""
        if self.idle:  # handed back, or held and released, after the round found none owed
            self.wake()
        ftype = frame[0]
        role = conn.role
        if role == "client":
            if ftype == F_MSGS and len(frame) == 2 and type(frame[1]) is list:
                client = conn.client
                assert client is not None
                rest = self.client_sessions.messages(client, frame[1], conn.deadline)
                return None if rest is None else [F_MSGS, rest]
        elif role in {"link", "peer", "standby"}:
            link = conn.link
            assert link is not None
            if link.removed:
                return None
            link.last_heard = self._loop.time()
            if ftype == F_DATA and len(frame) == 3:
                return self.sessions.data(link, frame[1], frame[2], conn.deadline)
            self.sessions.frame(link, conn, ftype, frame)
            return None
        elif ftype == F_HELLO and len(frame) == 2 and isinstance(frame[1], dict):
            if conn.dialing:
                self.sessions.answered(conn, frame[1])
            else:
                self._hello(conn, frame[1])
            return None
        elif ftype == F_ERROR and conn.dialing:
            self.sessions.refused(conn, frame)
            return None
        raise FrameError(
            f"unexpected frame type {ftype!r} for a {role or 'new'} connection", "unknown-type"
        )

    def _hello(self, conn: Conn, hello: dict[str, Any]) -> None:
        if hello.get("v") != PROTOCOL_VERSION:
            raise FrameError(
                f"protocol version {hello.get('v')!r} is not {PROTOCOL_VERSION}", "version"
            )
        role = hello.get("role")
        if not isinstance(role, str):  # [] or {} raised on the role checks (internal error)
            raise FrameError(f"hello role must be a string, got {type(role).__name__}", "bad-hello")
        try:
            self._check_port(conn, role)
            if role == "client":
                cid = hello.get("client_id")
                principal = authenticate_client(
                    conn.identity,
                    hello.get("token"),
                    cid if isinstance(cid, str) else None,
                    self.policy,
                    secure=self.secure,
                )
            elif role in {"link", "peer", "standby", "probe"}:
                # Before the hello touches any state or the peer hears a byte of ours.
                check_link_peer(conn.identity, str(hello.get("name")), secure=self.secure)
        except AccessError as exc:
            raise self.refusal(str(role), conn, exc) from None
        if self.fenced_by is not None:
            # Out of the overlay until restarted (fenced_out): a client is sent elsewhere; a
            # broker is refused with "left", which it takes for no verdict on itself (not
            # "fenced": that could fail the asker for the sake of this one).
            raise FrameError(
                f"{self.name} was declared dead by {self.fenced_by} and is out of the "
                "overlay until it restarts"
                + (": connect to another broker" if role == "client" else ""),
                "fenced" if role == "client" else "left",
            )
        if role == "client":
            if self.clients_held is not None:
                raise FrameError(
                    f"{self.name} has not joined the overlay yet ({self.clients_held}): "
                    "connect to another broker, or again shortly",
                    "joining",
                )
            if self.client_sessions.held_until_withdrawn(conn, hello.get("client_id")):
                conn.hold("withdrawing", [F_HELLO, hello])  # handled again once it is gone
                return
            self.client_sessions.attach(conn, hello, principal)
        elif role in {"link", "peer", "standby"}:
            self.sessions.accept(conn, hello, role)
        elif role == "probe":  # an RTT probe, or a fence check: answer and hang up
            self.sessions.refuse_fenced(str(hello.get("name")), hello)
            self.answer_hello(conn, heard=self.sessions.heard_ago())
            conn.close()
        else:
            raise FrameError(
                f"hello role must be link, peer, standby, probe or client, got {role!r}",
                "bad-hello",
            )

    def _check_port(self, conn: Conn, role: object) -> None:
        """Separate listeners take only their own kind of hello: a client on the link port or
        a broker on the client port is refused, with where it should have gone."""
        if conn.listener == "link" and role == "client":
            where = join_address(*self.address) if self.address else "the client port"
            raise AccessError(
                f"this is broker {self.name}'s link port, for brokers only; "
                f"clients connect to {where}",
                "wrong-port",
            )
        if conn.listener == "client" and role in ("link", "peer", "standby", "probe"):
            raise AccessError(
                f"this is broker {self.name}'s client port; brokers link to {self.advertised}",
                "wrong-port",
            )

    def refusal(self, role: str, conn: FrameProtocol, exc: AccessError) -> FrameError:
        """Count and log what security refused; the error frame closes that connection."""
        self.metrics.refused.labels(role, exc.code).inc()
        log.warning(
            "%s: refused %s from %s: %s",
            self.name,
            role,
            getattr(conn, "source", "") or "a dialed peer",
            exc,
        )
        return FrameError(str(exc), exc.code)

    def _reload_policy(self) -> None:
        """Hot reload: a changed policy file applies to new connections and requests at once
        (connected clients keep the principal they proved; their permissions are looked up
        again). A broken file is reported and the old policy kept."""
        stamp = file_stamp(self.config.policy_file)
        if stamp == self._policy_stamp or self.config.policy_file is None:
            return
        self._policy_stamp = stamp
        try:
            self.policy = Policy.load(self.config.policy_file)
        except SecurityError as exc:
            log.error("%s: policy not reloaded, the previous one stays: %s", self.name, exc)
            return
        self.client_sessions.policy_changed(self.policy)
        log.info("%s: policy reloaded from %s", self.name, self.config.policy_file)

    def _update_placement(self) -> None:
        """Tell the core (which orders and announces the neighbour list by it) and the
        telemetry where this broker runs, when that is first known or changes."""
        placed = self.placement.poll()
        if placed is None:
            return
        log.info("%s: placement: %s", self.name, placed.describe())
        self.telemetry.placement(placed)
        try:
            self.apply(self.core.handle(Placed(placed.zone, placed.node), self.now()))
        except CoreFailedError as exc:
            self.fail(str(exc))

    def reloaded_context(self, files: TlsFiles) -> ssl.SSLContext:
        """A server context for another listener of this process (the admin API, the HTTP
        gateway), loaded again whenever ``files`` are rewritten, like the broker's own."""
        ctx = files.server_context()
        for group, contexts in self._tls_groups:
            if group == files:
                contexts.append(ctx)
                return ctx
        self._tls_groups.append((files, [ctx]))
        self._tls_stamps.append(files.stamp())
        return ctx

    def _reload_tls(self) -> None:
        """Certificate rotation without a restart and without losing a notification: when
        the TLS files change, the live contexts load them (new connections use them), then
        every link connection is dropped once; each link resumes its session on a new
        connection, with the new certificates, and resends what was not acknowledged.
        Clients keep their connections (they are re-keyed when they reconnect). The client
        listener's own material, if it has some, is reloaded on its own."""
        changed = False
        for i, (files, contexts) in enumerate(self._tls_groups):
            stamp = files.stamp()
            if stamp == self._tls_stamps[i]:
                continue
            self._tls_stamps[i] = stamp
            try:
                files.check().reload(*contexts)
            except SecurityError as exc:  # half-written files: the next change is tried again
                log.error("%s: TLS material not reloaded, the previous stays: %s", self.name, exc)
                continue
            if i == 0:
                changed = True
            else:
                self.metrics.tls_reloads.inc()
                log.info("%s: listener TLS material reloaded from %s", self.name, files)
        tls = self.config.tls
        if not changed or tls is None:
            return
        rekeyed = [peer for peer in list(self.links) if self.drop_link_connection(peer)]
        self.metrics.tls_reloads.inc()
        log.info(
            "%s: TLS material reloaded from %s; links re-keyed on new connections: %s",
            self.name,
            tls,
            ", ".join(sorted(rekeyed)) or "none",
        )

    def answer_hello(self, conn: Conn, **fields: object) -> None:
        conn.write(
            control_frame(
                F_HELLO,
                {
                    "v": PROTOCOL_VERSION,
                    "role": "broker",
                    "name": self.name,
                    "incarnation": self.incarnation,
                    "routing": self.core.mode.value,
                    "features": list(FEATURES),
                    **fields,
                },
            )
        )

    # ------------------------------------------------------------------ events and effects

    def route_event(self, inp: Input, event: Event, source_kind: str, source: str) -> None:
        self._events += 1
        if self._events & 31:
            effects = self.core.handle(inp, self._loop.time())
        else:
            t0 = time.perf_counter()
            effects = self.core.handle(inp, self._loop.time())
            self.metrics.matching.observe(time.perf_counter() - t0)
        if effects:
            self.apply(effects)
        rate = self.telemetry.sample_rate
        if rate > 0.0 and event_sampled(event.publisher, event.seq, rate):
            self.telemetry.record_event(event, source_kind, source, effects)
        self._unflushed += 1
        now = time.perf_counter()
        if self._unflushed == 1:
            self._unflushed_since = now
        elif now - self._unflushed_since >= FLUSH_AFTER:
            self._flush()

    def apply(self, effects: list[Effect]) -> None:
        """Carry out effects, encoding each distinct message or event once. None once this
        broker was fenced out: its core's decisions are about an overlay it left."""
        if self.fenced_by is not None:
            return
        last_msg: object = None
        last_bytes = b""
        delivered = 0
        for eff in effects:
            if isinstance(eff, Deliver):  # the most common effect first: one check each
                # Compiled (runtime/outbox.py): encoded once, queued to every target, each
                # outlet not waiting yet put on the dirty list.
                delivered += fan_out(
                    encode_event_body(eff.event),
                    eff.targets,
                    self.client_sessions.outlets,
                    self._outlets,
                )
                if self._outlets and not self._flush_scheduled:
                    self._flush_scheduled = True
                    self._loop.call_soon(self._flush)
            elif isinstance(eff, SendToLink):
                msg = eff.message
                if msg is not last_msg:
                    last_bytes = encode_link_message(msg)
                    last_msg = msg
                    if type(msg) is not Publish:
                        self._count_reconfiguration_message(msg)
                peer = eff.peer
                link = self.links.get(peer)
                if link is None:  # a core bug, not the sender's fault: say so once, carry on
                    if f"link:{peer}" not in self._warned:
                        self._warned.add(f"link:{peer}")
                        log.error("%s: the core sent to %s, which has no link", self.name, peer)
                    continue
                link.out.append(last_bytes)  # Link.queue, inline: the hot path
                link.out_bytes += len(last_bytes)
                if not link.dirty:
                    self.mark_dirty(link)
            elif isinstance(eff, DeliverMarker):
                marked = self.clients.get(eff.client)
                if marked is not None:  # behind every notification already queued to it
                    self.client_sessions.send(marked, _MARKER)
            elif isinstance(eff, SendToPeer):
                self._count_reconfiguration_message(eff.message)
                self.sessions.send_to_peer(eff.peer, eff.message)
            elif isinstance(eff, StartTimer):
                self._start_timer(eff.key, eff.delay)
            elif isinstance(eff, OpenLink):
                self.sessions.open(eff.peer, kept=eff.kept)
            elif isinstance(eff, CloseLink):
                self.sessions.close(eff.peer)
            elif isinstance(eff, ExchangeFinished):
                self._exchange_finished(eff)
            elif isinstance(eff, Repaired):
                self.sessions.repaired(eff.dead, eff.chain, eff.links, eff.together)
            elif isinstance(eff, RepairFinished):
                self.sessions.repair_finished(eff)
            elif isinstance(eff, Resumed):
                self.client_sessions.resumed(eff)
            elif isinstance(eff, DetourLink):
                self.sessions.detour(eff.peer)
            elif isinstance(eff, LinkRepair):
                self.sessions.link_repair(eff)
            elif isinstance(eff, TellGap):
                self._publisher_gap(eff)
            else:
                self._unsupported(eff)
        self._delivered += delivered  # counted into the metrics once per flush

    def _publisher_gap(self, eff: TellGap) -> None:
        """A publisher says part of what it published may be lost (PublisherGap): tell every
        subscriber here. Logged: it is the only trace of that loss in the overlay."""
        reason = (
            f"publisher {eff.publisher}: a broker cut off from the overlay acknowledged what it "
            "published then, and it no longer kept all of it to send again"
        )
        told = self.client_sessions.tell_gap(eff.since, eff.until, reason)
        log.warning(
            "%s: %s may have lost %.1fs of its publications; told %d subscriber(s)",
            self.name,
            eff.publisher,
            eff.until - eff.since,
            told,
        )

    def _unsupported(self, eff: object) -> None:
        """An effect this runtime does not carry out yet (the core grows faster than the
        shell): say so loudly once per type instead of failing the connection that caused it."""
        kind = type(eff).__name__
        if kind not in self._warned:
            self._warned.add(kind)
            log.error("%s: the runtime does not implement %s effects yet; ignored", self.name, kind)

    # ------------------------------------------------------------------ RTT probes

    async def _probe_peers(self) -> None:
        """One RTT probe to every broker of the address book that is not a neighbour (those
        are measured by heartbeats): the miner's underlay distance matrix needs every pair."""
        try:
            targets = [
                (p, a) for p, a in self.peers.items() if p != self.name and p not in self.links
            ]
            results = await asyncio.gather(*(self.probe(a) for _, a in targets))
            for (peer, _), rtt_ms in zip(targets, results, strict=True):
                if rtt_ms is not None:
                    self.telemetry.rtt(peer, rtt_ms, via="probe")
        finally:
            self._probing = None

    async def probe(self, address: str) -> float | None:
        """Round trip of a hello on a fresh connection (so it never queues behind data); None
        when nothing answers within the handshake timeout, or it refuses: a broker that left
        the overlay (``left``) is no live peer, and a repair link to it must not wait for it
        (review: a fenced-out broker's refusals kept a repair link redialing it for 70 s)."""
        answer = await self._probe(address, {})
        return None if answer is None or answer[1][0] == F_ERROR else answer[0]

    async def probe_hello(self, address: str, peer: str) -> dict[str, Any] | None:
        """As :meth:`probe`, for the answer itself: the hello of ``peer`` (with TLS, its
        certificate's: what it says is acted on), whose ``heard`` lists the neighbours it
        hears lately (LinkSessions.heard_ago); None if nothing, or something else, answers."""
        answer = await self._probe(address, {}, peer=peer)
        if answer is None or len(answer[1]) < 2 or answer[1][0] != F_HELLO:
            return None
        hello = answer[1][1]
        return hello if type(hello) is dict else None

    async def fenced_at(self, peer: str, address: str) -> dict[str, Any] | None:
        """Whether the broker at ``address`` declared this process dead: it refuses a probe
        that names this incarnation with ``fenced``. The refusal's detail (``silent_for``: how
        long it had not heard this broker; ``linked``: whether it has a live link), or None
        when it did not fence it or did not answer. Only the other end knows whether it
        repaired the overlay without this one: asked after this broker's own loop stalled
        past failure detection, and while it is cut off from every neighbour
        (LinkSessions.heartbeat)."""
        answer = await self._probe(address, {"incarnation": self.incarnation}, peer=peer)
        reply = answer[1] if answer is not None else []
        if len(reply) > 1 and reply[0] == F_ERROR and reply[1] == "fenced":
            return error_detail(reply)
        return None

    async def _probe(
        self, address: str, extra: dict[str, str], *, peer: str | None = None
    ) -> tuple[float, list[Any]] | None:
        """A probe hello (plus ``extra``) on a fresh connection: the round trip in ms and the
        decoded answer, or None when nothing valid answers within the handshake timeout.
        ``peer``: the answer counts only from that broker's certificate (with TLS), as on a
        link: an answer that fails this broker must not come from any other certificate
        (review: an imposter with another broker's certificate at a dead neighbour's address
        answered ``fenced``)."""
        writer: asyncio.StreamWriter | None = None
        hello = {"v": PROTOCOL_VERSION, "role": "probe", "name": self.name, **extra}
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                reader, writer = await asyncio.open_connection(
                    *parse_address(address), ssl=self.tls_client
                )
                if peer is not None:
                    check_link_peer(transport_identity(writer.transport), peer, secure=self.secure)
                t0 = self._loop.time()
                writer.write(control_frame(F_HELLO, hello))
                length = int.from_bytes(await reader.readexactly(4), "big")
                if length > PROBE_ANSWER_MAX:
                    return None
                reply = loads_frame(await reader.readexactly(length))
                return (self._loop.time() - t0) * 1000.0, reply
        except AccessError as exc:
            log.warning("%s: probe of %s at %s refused: %s", self.name, peer, address, exc)
            return None
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, FrameError):
            return None
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    # ------------------------------------------------------------------ reconfiguration

    def set_peers(self, peers: dict[str, str]) -> None:
        """Merge ``name -> HOST:PORT`` into the address book used for exchange links and
        out-of-band channels (brokers that are not neighbours yet)."""
        for address in peers.values():
            parse_address(address)  # all or nothing
        for name, address in peers.items():
            old = self.peers.get(name)
            self.peers[name] = address
            if old is not None and old != address:  # a restored broker gets a new port
                self.sessions.moved(name)  # before an exchange queues on a stale channel

    def start_exchange(
        self,
        path: list[str],
        remove: tuple[str, str],
        ordering: str = "fifo",
        xid: str | None = None,
        lease: float = 30.0,
    ) -> ExchangeRecord:
        """Start a coordinated link exchange here (this broker must be ``path[0]``).
        Idempotent per ``xid``; raises ValueError for a request the core refuses.

        ``lease``: seconds each broker on the cycle stays locked without hearing from the
        exchange; then it rolls back (before phase 1) or forward (after), so a dead
        participant cannot pin the others."""
        xid = xid or uuid.uuid4().hex[:12]
        rec = self.exchanges.get(xid)
        if rec is not None:
            return rec
        if not lease > 0:
            raise ValueError(f"lease must be a positive number of seconds, got {lease!r}")
        rec = ExchangeRecord(xid, tuple(path), remove, ordering, lease, started=time.time())
        self.exchanges[xid] = rec
        try:
            req = StartExchange(xid, tuple(path), remove, Ordering(ordering), lease)
            self.apply(self.core.handle(req, self.now()))
        except (ProtocolError, ValueError) as exc:
            del self.exchanges[xid]
            raise ValueError(str(exc)) from None
        log.info(
            "%s: exchange %s started: remove %s-%s, cycle %s",
            self.name,
            xid,
            *remove,
            "-".join(path),
            extra={"reconfiguration": xid},
        )
        return rec

    def _count_reconfiguration_message(self, msg: object) -> None:
        """Protocol messages this broker sends for a reconfiguration, by id and type (kept for
        the last 256 reconfigurations; routing (un)subscriptions have no id and are not
        counted here — the metrics count them per link)."""
        xid = getattr(msg, "xid", None)
        if xid is None:
            return
        counts = self.reconfiguration_messages.get(xid)
        if counts is None:
            if len(self.reconfiguration_messages) >= 256:
                del self.reconfiguration_messages[next(iter(self.reconfiguration_messages))]
            counts = self.reconfiguration_messages[xid] = {}
        name = type(msg).__name__
        counts[name] = counts.get(name, 0) + 1

    def _start_timer(self, key: str, delay: float) -> None:
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()  # the same key replaces
        self._timers[key] = self._loop.call_later(delay, self._timer_fired, key)

    def _timer_fired(self, key: str) -> None:
        self.wake()
        self._timers.pop(key, None)
        if self.stopping:
            return
        try:
            self.apply(self.core.handle(TimerFired(key), self.now()))
        except ProtocolError:
            log.exception("%s: timer %s", self.name, key)
        except CoreFailedError as exc:
            self.fail(str(exc))

    def _take_ordering_delays(self) -> None:
        """Move the waits the core recorded for gray notifications at the new link into the
        histogram and the running totals; taking them keeps the core's list from growing for the
        life of the process."""
        delays = self.core.take_ordering_delays()
        if not delays:
            return
        observe = self.metrics.ordering_delay.observe
        for d in delays:
            observe(d)
        stats = self._delays
        stats[0] += len(delays)
        stats[1] += sum(delays)
        stats[2] = max(stats[2], *delays)

    def ordering_delay_status(self) -> dict[str, Any]:
        self._take_ordering_delays()
        count, total, longest = self._delays
        return {
            "count": int(count),
            "mean_ms": round(total / count * 1000.0, 3) if count else None,
            "max_ms": round(longest * 1000.0, 3) if count else None,
        }

    # ------------------------------------------------------------------ links and draining

    def now(self) -> float:
        return self._loop.time()

    def add_link(self, peer: str, address: str) -> Link:
        """Declare a link this broker dials (idempotent: an existing link is returned as is).
        Refused (ValueError) once this broker was fenced out."""
        return self.sessions.add(peer, address)

    def remove_link(self, peer: str) -> bool:
        """Uncoordinated removal: RemoveLink here, BYE to the peer (which does the same)."""
        return self.sessions.remove(peer)

    def lift_fences(self, incarnations: dict[str, str]) -> list[str]:
        """See :meth:`LinkSessions.lift_fences` (a partition healed; the restore asks)."""
        return self.sessions.lift_fences(incarnations)

    def tell_gap(self, since: float, until: float, reason: str, covers: Sequence[str] = ()) -> int:
        """See :meth:`ClientSessions.tell_gap` (the restore joined a split overlay);
        ``covers``: the brokers whose lifted fences this gap tells of, forgotten now.

        A stretch a subscriber was told already is not told to it again (see there)."""
        now = time.time()
        if not now - MAX_GAP_S <= since <= until <= now + 60:
            raise ValueError(
                f"need since <= until, since within the last {MAX_GAP_S:g} s and until not in "
                "the future"
            )
        told = self.client_sessions.tell_gap(since, until, reason)
        for peer in covers:
            self.sessions.lifted_since.pop(peer, None)
            self.sessions.fenced_since.pop(peer, None)  # told: that failure is over here
        log.warning(
            "%s: told %d subscriber(s) that %.1fs may be missing: %s",
            self.name,
            told,
            until - since,
            reason,
        )
        return told

    def _unacknowledged(self) -> int:
        return sum(len(lk.out) for lk in self.links.values())

    @property
    def drain_target(self) -> tuple[str, str] | None:
        return self.client_sessions.drain_target

    def drain(self, target: str, address: str | None = None) -> dict[str, Any]:
        return self.client_sessions.drain(target, address)

    def cancel_drain(self) -> dict[str, Any]:
        return self.client_sessions.cancel_drain()

    def drain_status(self) -> dict[str, Any]:
        return self.client_sessions.drain_status()

    async def wait_drained(self, within: float) -> bool:
        return await self.client_sessions.wait_drained(within)

    def _exchange_finished(self, eff: ExchangeFinished) -> None:
        rec = self.exchanges.get(eff.xid)
        if rec is None:
            rec = self.exchanges[eff.xid] = ExchangeRecord(eff.xid, (), ("", ""), "fifo")
        rec.state = "finished" if eff.ok else "failed"
        rec.ok, rec.reason, rec.attempts = eff.ok, eff.reason, eff.attempts
        rec.finished = time.time()
        rec.done.set()
        self.metrics.exchanges.labels(rec.state).inc()
        if rec.started:
            self.metrics.exchange_seconds.observe(rec.finished - rec.started)
        log.info(
            "%s: exchange %s %s %s",
            self.name,
            eff.xid,
            rec.state,
            eff.reason,
            extra={"reconfiguration": eff.xid, "outcome": rec.state},
        )

    # ------------------------------------------------------------------ views for the admin API

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "routing": self.core.mode.value,
            "core": core_build(),  # "compiled" (mypyc, setup.py) or "pure-python"
            "event_loop": loop_name(self._loop),  # "uvloop" or "asyncio" (runtime/eventloop.py)
            "incarnation": self.incarnation,
            "address": join_address(*self.address) if self.address else None,
            "advertised": self.advertised,
            "client_advertised": self.client_advertised,
            "link_address": join_address(*self.link_address) if self.link_address else None,
            "placement": {"zone": self.placement.current.zone, "node": self.placement.current.node},
            "uptime_s": round(time.monotonic() - self.started, 3),
            "ready": self.ready,
            "clients_held": self.clients_held,
            "neighbours": [self.links[p].status() for p in sorted(self.links)],
            "clients": len(self.clients),
            "queue_depths": {
                "links": {p: lk.depth for p, lk in sorted(self.links.items())},
                # messages waiting, and bytes; the largest queue as high water sees it
                "clients_total": sum(len(c.pending) for c in self.clients.values()),
                "clients_bytes": sum(c.outlet.pending_bytes for c in self.clients.values()),
                "clients_max": max((c.depth for c in self.clients.values()), default=0),
            },
            "publishers_paused": self.publishers_paused,
            "client_write_interval_ms": self.config.client_write_interval * 1000,
            "retention": self._retention_status(),
            "routing_table_size": self.core.routing_table_size(),
            "loop": self.loop_watch.status(),
            "channels": {
                "out": [ch.status() for _, ch in sorted(self.sessions.channels_out.items())],
                "in": [ch.status() for _, ch in sorted(self.sessions.channels_in.items())],
            },
            "exchange": ex.xid if (ex := self.core.exchange) is not None else None,
            "exchange_phase": ex.phase.value if ex is not None else None,
            "pending_exchanges": self.core.pending_exchanges,
            "ordering_delay": self.ordering_delay_status(),
            "drain": self.drain_status(),
            "repairs": list(self.sessions.repairs),
            "standby": [
                {
                    "peer": p,
                    "state": lk.state,
                    "rtt_ms": lk.rtt_ms,
                    "dialer": lk.dialer,
                    "connects": lk.connects,
                }
                for p, lk in sorted(self.sessions.standby.items())
            ],
            "fenced": dict(self.sessions.fenced),
            "fenced_since": dict(self.sessions.fenced_since),
            "lifted_since": dict(self.sessions.lifted_since),
            "resent": {p: list(r) for p, r in self.client_sessions.resent.items()},
            "fenced_by": self.fenced_by,
            "cycles": self.sessions.cycles_status(),
            "link_repairs": list(self.sessions.link_repairs),
            "cut": sorted(self.sessions.cut),
        }

    def _retention_status(self) -> dict[str, Any]:
        r = self.core.retention
        return {
            "depth": r.depth(),
            "young": r.young(self._loop.time()),
            "limit": r.limit if r.enabled else 0,
            "bytes": r.size(),
            "limit_bytes": r.limit_bytes if r.enabled else 0,
            "horizon_s": r.horizon,
            "full": self.custody_full,
        }

    def _gauges(self) -> Gauges:
        self._take_ordering_delays()  # scrape time: the histogram is current when read
        self._count_delivered()
        clients = self.clients.values()
        depths = [c.depth for c in clients]
        return Gauges(
            routing_table_entries=self.core.routing_table_size(),
            clients=len(self.clients),
            publishers_paused=self.publishers_paused,
            link_queue_depth={p: lk.depth for p, lk in self.links.items()},
            link_up={p: lk.conn is not None for p, lk in self.links.items()},
            client_queue_depth_max=max(depths, default=0),
            client_queued_messages=sum(len(c.pending) for c in clients),
            retention_depth=self.core.retention.depth(),
            retention_full=self.custody_full,
            retention_dropped=self.core.retention.dropped,
            replay_duplicates=self.core.replay_duplicates,
            standby_up={p: lk.conn is not None for p, lk in self.sessions.standby.items()},
        )

    def drop_link_connection(self, peer: str) -> bool:
        """Abort a link's TCP connection without removing the link (fault injection for tests
        and operators: the dialing side reconnects and resumes the session)."""
        link = self.links.get(peer)
        if link is None or link.conn is None:
            return False
        link.conn.abort()
        return True

    def cut_link(self, peer: str) -> bool:
        """Fail the link to ``peer`` for good, both brokers alive (fault injection; see
        :meth:`LinkSessions.cut_link`)."""
        return self.sessions.cut_link(peer)

    def heal_link(self, peer: str) -> bool:
        return self.sessions.heal_link(peer)

    async def wait_link_up(self, peer: str, within: float) -> bool:
        link = self.links.get(peer)
        if link is None:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(link.up.wait(), within)
        return link.conn is not None
