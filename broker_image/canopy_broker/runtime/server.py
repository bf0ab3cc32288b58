"""The broker process: the asyncio shell that feeds a :class:`BrokerCore` and carries out its
effects.

One listening port serves both overlay links and clients; the first frame (the hello) says which
a connection is. The core is called synchronously from ``data_received``, so a TCP read's worth of
frames is decoded and routed without a task switch, and its effects are appended to per-destination
queues that are flushed once per loop iteration (see :mod:`canopy_broker.runtime.links`).

Backpressure. Links are *never* paused for reading: two brokers that both stop reading until the
other drains would deadlock. Instead, while any outbound queue (a link's unacknowledged messages
or a client's unsent notifications) is above ``high_water``, the broker pauses reading from the
clients that publish, and resumes them once every queue is below ``low_water``. A client whose
queue passes ``client_hard_cap``, or stays above high water for ``slow_consumer_grace`` seconds,
is disconnected as a slow consumer so it cannot hold the overlay hostage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from canopy_broker.core.broker import BrokerCore, CoreFailedError, ProtocolError
from canopy_broker.core.events import Event
from canopy_broker.core.messages import (
    AddLink,
    ClientAttach,
    ClientDetach,
    ClientMigrating,
    ClientMove,
    ClientPublish,
    ClientSubscribe,
    ClientUnsubscribe,
    CloseLink,
    Deliver,
    DeliverMarker,
    Effect,
    ExchangeFinished,
    FromLink,
    FromPeer,
    Input,
    OpenLink,
    Ordering,
    Publish,
    RemoveLink,
    RoutingMode,
    SendToLink,
    SendToPeer,
    StartExchange,
    StartTimer,
    TimerFired,
)
from canopy_broker.runtime.framing import (
    B_MARKER,
    B_MIGRATING,
    B_REDIRECT,
    B_SUBSCRIBED,
    B_UNSUBSCRIBED,
    C_LEAVE,
    C_MIGRATING,
    C_MOVE,
    C_PUBLISH,
    C_SUBSCRIBE,
    C_UNSUBSCRIBE,
    F_ACK,
    F_BYE,
    F_DATA,
    F_ERROR,
    F_HELLO,
    F_MSGS,
    F_PING,
    F_PONG,
    F_PRESSURE,
    MAX_FRAME,
    PROTOCOL_VERSION,
    FrameError,
    check_wire_attributes,
    control_frame,
    decode_filter,
    decode_link_message,
    decode_peer_message,
    dumps,
    encode_event_body,
    encode_generic,
    encode_link_message,
    notify_message,
    parse_address,
)
from canopy_broker.runtime.links import Client, Conn, Link
from canopy_broker.runtime.metrics import BrokerMetrics, Gauges
from canopy_broker.runtime.tasks import TaskSet
from canopy_broker.runtime.telemetry import Telemetry

log = logging.getLogger("canopy.broker")

FLUSH_EVERY = 64
"""Flush after this many routed events even within one TCP read. A read can hold thousands of
events; routing all of them before writing anything would hold the first notification back for
the whole read (tens of ms), while 64 events still make batches of hundreds of messages."""


@dataclass(slots=True)
class BrokerConfig:
    """Everything a broker process is started with (see ``canopy-broker serve --help``)."""

    name: str
    routing: RoutingMode | str = RoutingMode.COVERING
    host: str = "127.0.0.1"
    port: int = 0
    heartbeat_interval: float = 1.0
    dead_after: int = 3
    high_water: int = 20_000
    low_water: int = 5_000
    client_hard_cap: int = 200_000
    slow_consumer_grace: float = 10.0
    max_frame: int = MAX_FRAME
    telemetry_sample: float = 0.01
    history: int = 10_000
    telemetry_dir: str | None = None
    telemetry_interval: float = 10.0
    reconnect_min: float = 0.05
    reconnect_max: float = 2.0
    handshake_timeout: float = 5.0
    advertise: str | None = None  # HOST:PORT peers should dial (default: the listen address)
    probe_interval: float = 10.0  # RTT probes to non-neighbours in the address book (0: off)


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


def _name(value: object, what: str) -> str:
    if type(value) is not str or not value:
        raise FrameError(f"{what} must be a broker name, got {value!r}")
    return value


def _str_field(hello: dict[str, Any], key: str) -> str:
    value = hello.get(key)
    if type(value) is not str or not value:
        raise FrameError(f"hello needs a non-empty string {key!r}", "bad-hello")
    return value


class Broker:
    """One broker: core + links + clients + metrics + telemetry; no HTTP (see admin.py)."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.name = config.name
        self.core = BrokerCore(config.name, RoutingMode(config.routing))
        self.tasks = TaskSet(config.name, on_failure=self._task_failed)
        # Why this broker can no longer be trusted (a background task died, or its core hit an
        # internal error); /healthz reports it so a supervisor restarts the process.
        self.failed: str | None = None
        self.incarnation = uuid.uuid4().hex[:8]
        self.links: dict[str, Link] = {}
        self.channels_out: dict[str, Link] = {}  # out-of-band control channels we dialed
        self.channels_in: dict[str, Link] = {}  # ... and those other brokers dialed
        self.peers: dict[str, str] = {}  # address book: broker name -> HOST:PORT
        self.exchanges: dict[str, ExchangeRecord] = {}
        self.reconfiguration_messages: dict[str, dict[str, int]] = {}
        # Leaf additions and removals asked for through POST /reconfigurations, by id.
        self.leaf_steps: dict[str, dict[str, Any]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.clients: dict[str, Client] = {}
        self.metrics = BrokerMetrics(self._gauges)
        self.telemetry = Telemetry(
            config.name,
            sample_rate=config.telemetry_sample,
            history=config.history,
            directory=config.telemetry_dir,
        )
        self.started = time.monotonic()
        self.address: tuple[str, int] | None = None
        self.advertised = ""
        self.stopping = False
        self._loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self._conns: set[Conn] = set()
        self._removed: dict[str, str] = {}  # peer -> session removed here (answers a late resume)
        self._retired: dict[str, Link] = {}  # closing links displaced by a re-opened one
        self._dirty: list[Link | Client] = []
        self._flush_scheduled = False
        self._unflushed = 0  # events routed since the last flush
        self._over: set[Link | Client] = set()
        self._publishers_paused = False
        self._client_counter = 0
        self._warned: set[str] = set()
        self._events = 0
        self._ticker: asyncio.Task[None] | None = None
        self._probing: asyncio.Task[None] | None = None
        self._m_published = self.metrics.published
        self._m_delivered = self.metrics.delivered
        self._m_client_in = self.metrics.client_messages.labels("in")
        self._m_client_out = self.metrics.client_messages.labels("out")
        # Draining (before a leaf is removed): the neighbour its clients are sent to.
        self.drain_target: tuple[str, str] | None = None  # (name, HOST:PORT)
        self._drained = asyncio.Event()
        # Gray notifications' waits at the new link of an exchange, taken from the core.
        self._delays = [0, 0.0, 0.0]  # count, sum, max (seconds)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._server = await self._loop.create_server(
            lambda: Conn(self), self.config.host, self.config.port, reuse_address=True
        )
        sock = self._server.sockets[0].getsockname()
        self.address = (sock[0], sock[1])
        self.advertised = self.config.advertise or f"{sock[0]}:{sock[1]}"
        self._ticker = self.tasks.spawn(self._tick(), "ticker", forever=True)
        log.info("broker %s listening on %s:%d", self.name, *self.address)

    @property
    def ready(self) -> bool:
        return self._server is not None and not self.stopping and self.failed is None

    @property
    def max_frame(self) -> int:
        return self.config.max_frame

    def fail(self, why: str) -> None:
        """This broker is broken beyond one connection: say so once, loudly, and report it
        unhealthy (a Kubernetes liveness probe or ``canopy up``'s supervisor restarts it)."""
        if self.failed is None:
            self.failed = why
            log.critical("%s: broker failed: %s", self.name, why)

    def _task_failed(self, task: str, why: str) -> None:
        self.fail(f"background task {task!r} {why}")

    async def stop(self, flush_timeout: float = 2.0) -> None:
        """Graceful stop: no new connections, flush queues briefly, say goodbye, close all."""
        if self.stopping:
            return
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        await self.tasks.stop()
        self._flush()
        deadline = self._loop.time() + flush_timeout
        while self._loop.time() < deadline and self._undelivered():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        for link in self._all_links():
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
        if self._server is not None:
            await self._server.wait_closed()
        await self.telemetry.flush()
        log.info("broker %s stopped", self.name)

    def _undelivered(self) -> bool:
        if any(lk.conn is not None and lk.out for lk in self._all_links()):
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
            now = self._loop.time()
            if cfg.probe_interval > 0 and now >= next_probe and self._probing is None:
                next_probe = now + cfg.probe_interval
                self._probing = self.tasks.spawn(self._probe_peers(), "rtt probes")
            for link in self._all_links():
                conn = link.conn
                if conn is None:
                    continue
                if now - link.last_heard > cfg.heartbeat_interval * cfg.dead_after:
                    log.warning(
                        "%s: link to %s missed heartbeats; dropping it", self.name, link.peer
                    )
                    conn.abort()
                    continue
                conn.write(control_frame(F_PING, now, link.rx_seq))
                link.acked_rx = link.rx_seq
            for client in list(self._over):
                if (
                    isinstance(client, Client)
                    and client.over_since is not None
                    and now - client.over_since > cfg.slow_consumer_grace
                ):
                    self._slow_consumer(client, "stayed above high water")
            if now >= next_snapshot:
                next_snapshot = now + cfg.telemetry_interval
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
            await self.telemetry.flush()

    # ------------------------------------------------------------------ connections

    def conn_made(self, conn: Conn) -> None:
        self._conns.add(conn)
        if conn.dialing:
            link = conn.link
            assert link is not None
            conn.write(
                control_frame(
                    F_HELLO,
                    {
                        "v": PROTOCOL_VERSION,
                        "role": link.kind,
                        "name": self.name,
                        "session": link.session,
                        "resume": link.connected_once,
                        "last_rx": link.rx_seq,
                        "opened": link.opened,
                        "address": self.advertised,
                    },
                )
            )

    def conn_failed(self, conn: Conn, exc: FrameError) -> None:
        role = conn.role or "unknown"
        self.metrics.malformed.labels(role, exc.code).inc()
        who = conn.link.peer if conn.link else conn.client.id if conn.client else "?"
        log.warning("%s: closing %s connection (%s): %s", self.name, role, who, exc)

    def conn_lost(self, conn: Conn) -> None:
        self._conns.discard(conn)
        if conn.role == "client":
            client = conn.client
            assert client is not None
            self._detach(client)
        elif conn.role in ("link", "peer"):
            link = conn.link
            assert link is not None
            if link.conn is conn:
                link.conn = None
                link.up.clear()
                link.remote_pressure = link.sent_pressure = False
                if link.over:
                    self._unpressure(link)  # a down link's backlog must not stop the overlay
                else:
                    self._update_pressure()
                log.info("%s: %s to %s is down", self.name, link.kind, link.peer)

    def mark_dirty(self, dest: Link | Client) -> None:
        if not dest.dirty:
            dest.dirty = True
            self._dirty.append(dest)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._unflushed = 0
        dirty, self._dirty = self._dirty, []
        high = self.config.high_water
        low = self.config.low_water
        for dest in dirty:
            dest.dirty = False
            dest.flush()
            if dest.over:
                if dest.depth < low:
                    self._unpressure(dest)
            elif dest.depth > high and (
                isinstance(dest, Client) or (dest.kind == "link" and dest.conn is not None)
            ):
                self._pressure(dest)
        if self._over:
            for dest in dirty:
                if isinstance(dest, Client) and dest.depth > self.config.client_hard_cap:
                    self._slow_consumer(dest, f"queue above {self.config.client_hard_cap}")

    # ------------------------------------------------------------------ backpressure

    def _pressure(self, dest: Link | Client) -> None:
        dest.over = True
        if isinstance(dest, Client):
            dest.over_since = self._loop.time()
        self._over.add(dest)
        self._update_pressure()

    def _unpressure(self, dest: Link | Client) -> None:
        if not dest.over:
            return
        dest.over = False
        if isinstance(dest, Client):
            dest.over_since = None
        self._over.discard(dest)
        self._update_pressure()

    def _update_pressure(self) -> None:
        """Recompute who must pause, after any change of a queue's state or a neighbour's signal.

        A broker pauses its publishers while one of its own queues is over high water *or* a
        neighbour reports pressure; it reports pressure to neighbour N when it is congested
        itself or another neighbour reported it (split horizon: a tree has no other path back,
        so the signal cannot latch itself on). The effect is an overlay-wide XOFF for publishers
        while any broker is congested, carried by control frames that bypass the data queues;
        links keep being read throughout, so there is no deadlock.
        """
        local = bool(self._over)
        remote = [lk for lk in self.links.values() if lk.remote_pressure]
        for link in self.links.values():
            want = local or any(r is not link for r in remote)
            if want != link.sent_pressure and link.conn is not None:
                link.sent_pressure = want
                link.conn.write(control_frame(F_PRESSURE, want))
        paused = local or bool(remote)
        if paused == self._publishers_paused:
            return
        self._publishers_paused = paused
        if paused:
            self.metrics.backpressure.inc()
        for client in self.clients.values():
            if client.publisher:
                if paused:
                    client.conn.pause("pressure")
                else:
                    client.conn.resume("pressure")

    def _acked(self, link: Link, upto: int) -> None:
        link.ack(upto)
        if link.over and link.depth < self.config.low_water:
            self._unpressure(link)
        if link.closing:
            self._maybe_finish_close(link)
        if self.drain_target is not None and not self.clients:
            self._check_drained()

    def _slow_consumer(self, client: Client, why: str) -> None:
        log.warning("%s: disconnecting slow consumer %s (%s)", self.name, client.id, why)
        self.metrics.slow_consumers.inc()
        client.pending.clear()
        self._unpressure(client)
        client.conn.write(control_frame(F_ERROR, "slow-consumer", why))
        client.conn.abort()

    # ------------------------------------------------------------------ frames

    def frame_received(self, conn: Conn, frame: list[Any]) -> list[Any] | None:
        """Handle one frame; a long one may be handed back unfinished (see ``work_budget``)."""
        ftype = frame[0]
        role = conn.role
        if role == "client":
            if ftype == F_MSGS and len(frame) == 2 and type(frame[1]) is list:
                client = conn.client
                assert client is not None
                rest = self._client_msgs(client, frame[1], conn.deadline)
                return None if rest is None else [F_MSGS, rest]
        elif role in {"link", "peer"}:
            link = conn.link
            assert link is not None
            if link.removed:
                return None
            link.last_heard = self._loop.time()
            if ftype == F_DATA and len(frame) == 3:
                return self._link_data(link, frame[1], frame[2], conn.deadline)
            self._link_frame(link, conn, ftype, frame)
            return None
        elif ftype == F_HELLO and len(frame) == 2 and isinstance(frame[1], dict):
            if conn.dialing:
                self._dial_answered(conn, frame[1])
            else:
                self._hello(conn, frame[1])
            return None
        elif ftype == F_ERROR and conn.dialing:
            self._dial_refused(conn, frame)
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
        if role == "client":
            self._client_hello(conn, hello)
        elif role in {"link", "peer"}:
            self._session_hello(conn, hello, role)
        elif role == "probe":  # an RTT probe: answer and hang up
            self._answer_hello(conn)
            conn.close()
        else:
            raise FrameError(
                f"hello role must be link, peer, probe or client, got {role!r}", "bad-hello"
            )

    def _answer_hello(self, conn: Conn, **fields: object) -> None:
        conn.write(
            control_frame(
                F_HELLO,
                {
                    "v": PROTOCOL_VERSION,
                    "role": "broker",
                    "name": self.name,
                    "routing": self.core.mode.value,
                    **fields,
                },
            )
        )

    # ------------------------------------------------------------------ clients

    def _client_hello(self, conn: Conn, hello: dict[str, Any]) -> None:
        cid = hello.get("client_id")
        if cid is None:
            self._client_counter += 1
            cid = f"{self.name}-{self.incarnation}-{self._client_counter}"
        elif type(cid) is not str or not cid:
            raise FrameError(f"client_id must be a non-empty string, got {cid!r}", "bad-hello")
        if cid in self.clients:
            raise FrameError(f"client id {cid!r} is already attached here", "client-id-in-use")
        self._apply(self.core.handle(ClientAttach(cid), self._now()))
        client = Client(cid, conn)
        self.clients[cid] = client
        conn.role = "client"
        conn.client = client
        self._answer_hello(conn, client_id=cid)
        if self.drain_target is not None:
            self._redirect(client, *self.drain_target)

    def _detach(self, client: Client) -> None:
        """The client is gone (left, or its connection broke): withdraw its subscriptions.
        Only the connection that attached it may detach it: a late loss of an older
        connection under the same id must not take the newer one's subscriptions with it."""
        if self.clients.get(client.id) is not client:
            return
        del self.clients[client.id]
        client.pending.clear()
        self._unpressure(client)
        self._apply(self.core.handle(ClientDetach(client.id), self._now()))
        if self.drain_target is not None:
            self._check_drained()

    def _redirect(self, client: Client, target: str, address: str) -> None:
        self._to_client(client, dumps([B_REDIRECT, target, address]))

    def _client_msgs(
        self, client: Client, items: list[Any], deadline: float = math.inf
    ) -> list[Any] | None:
        """Handle a client's messages in order; if ``deadline`` passes, return the ones not
        handled yet (they are handed back on the next loop turn, still in order)."""
        cid = client.id
        published = 0
        handled = 0
        rest: list[Any] | None = None
        for item in items:
            if handled & 15 == 15 and time.perf_counter() >= deadline:
                rest = items[handled:]
                break
            handled += 1
            if type(item) is not list or not item:
                raise FrameError(f"a client message must be a non-empty array, got {item!r}")
            code = item[0]
            if code == C_PUBLISH and len(item) == 3:
                seq = item[1]
                if (
                    type(seq) is not int
                    or seq < 1
                    or (client.last_seq and seq != client.last_seq + 1)
                ):
                    raise FrameError(
                        f"publish seq {seq!r} after {client.last_seq}: seq must grow by one",
                        "sequence",
                    )
                if client.moved:  # it would overtake what it published at its new broker
                    raise FrameError(f"{cid} published here after moving away", "protocol")
                event = Event(cid, seq, check_wire_attributes(item[2]))
                client.last_seq = seq
                published += 1
                self._route_event(ClientPublish(cid, event), event, "client", cid)
            elif code == C_SUBSCRIBE and len(item) == 3:
                sub_id = item[1]
                if type(sub_id) is not str or not sub_id:
                    raise FrameError(f"sub_id must be a non-empty string, got {sub_id!r}")
                f = decode_filter(item[2])
                self._apply(self.core.handle(ClientSubscribe(cid, sub_id, f), self._now()))
                self._to_client(client, dumps([B_SUBSCRIBED, sub_id]))
            elif code == C_UNSUBSCRIBE and len(item) == 2:
                sub_id = item[1]
                if type(sub_id) is not str:
                    raise FrameError(f"sub_id must be a string, got {sub_id!r}")
                self._apply(self.core.handle(ClientUnsubscribe(cid, sub_id), self._now()))
                self._to_client(client, dumps([B_UNSUBSCRIBED, sub_id]))
            elif code == C_MIGRATING and len(item) == 2:
                source = _name(item[1], "source")
                self._apply(self.core.handle(ClientMigrating(cid, source), self._now()))
                self._to_client(client, dumps([B_MIGRATING, source]))
            elif code == C_MOVE and len(item) == 2:
                target = _name(item[1], "target")
                self._apply(self.core.handle(ClientMove(cid, target), self._now()))
                client.moved = True
            elif code == C_LEAVE and len(item) == 1:
                self._detach(client)
                client.conn.close()
                break  # whatever follows in this frame has no client any more
            else:
                raise FrameError(f"unknown client message {item!r}", "unknown-type")
        self._m_client_in.inc(handled)
        if published:
            self._m_published.inc(published)
            if not client.publisher:
                client.publisher = True
                if self._publishers_paused:
                    client.conn.pause("pressure")
        return rest

    def _to_client(self, client: Client, msg: bytes) -> None:
        client.pending.append(msg)
        self.mark_dirty(client)

    # ------------------------------------------------------------------ events and effects

    def _route_event(self, inp: Input, event: Event, source_kind: str, source: str) -> None:
        self._events += 1
        if self._events & 31:
            effects = self.core.handle(inp, self._loop.time())
        else:
            t0 = time.perf_counter()
            effects = self.core.handle(inp, self._loop.time())
            self.metrics.matching.observe(time.perf_counter() - t0)
        if effects:
            self._apply(effects)
        if self.telemetry.sample_rate > 0.0:
            self.telemetry.event(event, source_kind, source, effects)
        self._unflushed += 1
        if self._unflushed >= FLUSH_EVERY:
            self._flush()

    def _apply(self, effects: list[Effect]) -> None:
        """Carry out effects, encoding each distinct message or event once."""
        last_msg: object = None
        last_bytes = b""
        last_event: object = None
        body = b""
        delivered = 0
        for eff in effects:
            if isinstance(eff, SendToLink):
                msg = eff.message
                if msg is not last_msg:
                    last_bytes = encode_link_message(msg)
                    last_msg = msg
                    if type(msg) is not Publish:
                        self._count_reconfiguration_message(msg)
                link = self.links[eff.peer]
                link.out.append(last_bytes)
                if not link.dirty:
                    self.mark_dirty(link)
            elif isinstance(eff, Deliver):
                client = self.clients.get(eff.client)
                if client is None:
                    continue
                event = eff.event
                if event is not last_event:
                    body = encode_event_body(event)
                    last_event = event
                client.pending.append(notify_message(body, eff.sub_ids))
                delivered += 1
                if not client.dirty:
                    self.mark_dirty(client)
            elif isinstance(eff, DeliverMarker):
                marked = self.clients.get(eff.client)
                if marked is not None:  # behind every notification already queued to it
                    self._to_client(marked, _MARKER)
            elif isinstance(eff, SendToPeer):
                self._count_reconfiguration_message(eff.message)
                self._send_to_peer(eff.peer, eff.message)
            elif isinstance(eff, StartTimer):
                self._start_timer(eff.key, eff.delay)
            elif isinstance(eff, OpenLink):
                self._open_link(eff.peer)
            elif isinstance(eff, CloseLink):
                self._close_link(eff.peer)
            elif isinstance(eff, ExchangeFinished):
                self._exchange_finished(eff)
            else:
                self._unsupported(eff)
        if delivered:
            self._m_delivered.inc(delivered)
            self._m_client_out.inc(delivered)

    def _unsupported(self, eff: object) -> None:
        """An effect this runtime does not carry out yet (the core grows faster than the
        shell): say so loudly once per type instead of failing the connection that caused it."""
        kind = type(eff).__name__
        if kind not in self._warned:
            self._warned.add(kind)
            log.error("%s: the runtime does not implement %s effects yet; ignored", self.name, kind)

    # ------------------------------------------------------------------ links: frames

    def _link_frame(self, link: Link, conn: Conn, ftype: object, frame: list[Any]) -> None:
        if ftype == F_ACK and len(frame) == 2 and type(frame[1]) is int:
            self._acked(link, frame[1])
        elif ftype == F_PING and len(frame) == 3 and type(frame[2]) is int:
            self._acked(link, frame[2])
            conn.write(control_frame(F_PONG, frame[1], link.rx_seq))
            link.acked_rx = link.rx_seq
        elif ftype == F_PONG and len(frame) == 3 and type(frame[2]) is int:
            self._acked(link, frame[2])
            if isinstance(frame[1], int | float):
                link.rtt_ms = (self._loop.time() - frame[1]) * 1000.0
                if link.kind == "link":
                    self.telemetry.rtt(link.peer, link.rtt_ms)
        elif ftype == F_PRESSURE and len(frame) == 2 and type(frame[1]) is bool:
            if link.remote_pressure != frame[1]:
                link.remote_pressure = frame[1]
                self._update_pressure()
        elif ftype == F_BYE:
            reason = frame[1] if len(frame) > 1 else "?"
            log.info("%s: %s said goodbye (%s)", self.name, link.peer, reason)
            if reason == "removed":
                self._drop_link(link, bye=None)
            elif reason == "closed":  # the peer's core closed it (a link exchange)
                link.peer_closed = True
                if link.closing or not link.established:
                    self._drop_link(link, bye=None)
                else:
                    conn.close()  # our core closes its end in its own time
            else:
                conn.close()
        elif ftype == F_ERROR:
            log.warning("%s: %s reported an error: %s", self.name, link.peer, frame[1:])
            conn.close()
        else:
            raise FrameError(f"unexpected link frame {frame[:2]!r}", "unknown-type")

    def _link_data(
        self, link: Link, first: object, items: object, deadline: float = math.inf
    ) -> list[Any] | None:
        """Hand a data frame's messages to the core in order; if ``deadline`` passes, return
        the rest as a data frame that starts where this one stopped (acknowledged only once
        handled)."""
        if type(first) is not int or type(items) is not list:
            raise FrameError("data frame must be [1, first_seq, [messages]]")
        skip = link.rx_seq + 1 - first
        if skip < 0:
            raise FrameError(f"sequence gap: expected {link.rx_seq + 1}, got {first}", "sequence")
        if skip:
            items = items[skip:]
        if link.kind == "link" and not link.established and items:
            # An added link the peer's core opened before ours did. The protocol sends nothing
            # over it before this core has it; if something comes anyway, refuse without
            # acknowledging, so the peer resends it after reconnecting.
            raise FrameError(f"data on the link to {link.peer} before it was opened", "not-open")
        peer = link.peer
        handle = self.core.handle
        n = 0
        rest: list[Any] | None = None
        try:
            if link.kind == "peer":
                for item in items:
                    self._apply(handle(FromPeer(peer, decode_peer_message(item)), self._now()))
                    n += 1
            else:
                for item in items:
                    if n & 15 == 15 and time.perf_counter() >= deadline:
                        rest = [F_DATA, link.rx_seq + n + 1, items[n:]]
                        break
                    msg = decode_link_message(item)
                    if type(msg) is Publish:
                        self._route_event(FromLink(peer, msg), msg.event, "link", peer)
                    else:
                        self._apply(handle(FromLink(peer, msg), self._now()))
                    n += 1
        finally:
            link.rx_seq += n
            link.msgs_in += n
            if link.m_msgs_in is not None:
                link.m_msgs_in.inc(n)
            if not link.dirty:
                self.mark_dirty(link)  # to acknowledge
        return rest

    # ------------------------------------------------------------------ links: lifecycle

    def _now(self) -> float:
        return self._loop.time()

    def _table(self, kind: str, dialer: bool) -> dict[str, Link]:
        if kind == "link":
            return self.links
        return self.channels_out if dialer else self.channels_in

    def _all_links(self) -> list[Link]:
        return [
            *self.links.values(),
            *self._retired.values(),
            *self.channels_out.values(),
            *self.channels_in.values(),
        ]

    def _retire(self, link: Link) -> None:
        """Move a closing link out of the way of a new instance of the same link: it keeps
        flushing (and resuming) on its own session until the peer has acknowledged everything,
        then says goodbye as usual."""
        old = self._retired.pop(link.peer, None)
        if old is not None:
            self._drop_link(old, bye="closed")
        del self.links[link.peer]
        self._retired[link.peer] = link

    def _new_link(self, link: Link) -> Link:
        """Register a new link or channel (metrics, table) and start dialing if it is ours."""
        peer, kind, dialer = link.peer, link.kind, link.dialer
        if kind == "link":
            m = self.metrics
            link.m_msgs_in = m.link_messages.labels(peer, "in")
            link.m_msgs_out = m.link_messages.labels(peer, "out")
            link.m_bytes_in = m.link_bytes.labels(peer, "in")
            link.m_bytes_out = m.link_bytes.labels(peer, "out")
            self._removed.pop(peer, None)
        self._table(kind, dialer)[peer] = link
        if dialer:
            link.dial_task = self.tasks.spawn(self._dial_loop(link), f"dial {peer} ({kind})")
        return link

    def add_link(self, peer: str, address: str) -> Link:
        """Declare a link this broker dials (idempotent: an existing link is returned as is)."""
        if peer == self.name:
            raise ValueError("a broker cannot link to itself")
        parse_address(address)
        self.peers[peer] = address
        link = self.links.get(peer)
        if link is not None:
            if link.dialer and link.address != address:
                link.address = address  # a moved peer: the next dial uses the new address
            return link
        return self._new_link(Link(peer, uuid.uuid4().hex, dialer=True, address=address))

    def remove_link(self, peer: str) -> bool:
        """Uncoordinated removal: RemoveLink here, BYE to the peer (which does the same)."""
        link = self.links.get(peer)
        if link is None:
            return False
        self._drop_link(link, bye="removed")
        return True

    def _drop_link(self, link: Link, *, bye: str | None) -> None:
        """Forget a link or channel; tell the core (RemoveLink) if it is a link the core has and
        did not close itself."""
        # The core first: if it refuses (the link is on an exchange's cycle) nothing has changed.
        effects = self.core.handle(RemoveLink(link.peer), self._now()) if link.established else []
        link.established = False
        table = self._table(link.kind, link.dialer)
        if table.get(link.peer) is link:
            del table[link.peer]
        if link.kind == "link" and self._retired.get(link.peer) is link:
            del self._retired[link.peer]
        link.removed = True
        link.farewell = bye
        if link.kind == "link" and bye == "removed":
            self._removed[link.peer] = link.session
        if link.dial_task is not None and link.dial_task is not asyncio.current_task():
            link.dial_task.cancel()
        self._unpressure(link)
        self._apply(effects)
        conn, link.conn = link.conn, None
        link.up.clear()
        if conn is not None:
            if bye:
                conn.write(control_frame(F_BYE, bye))
            conn.close()
        link.out.clear()
        self._update_pressure()
        log.info("%s: %s to %s removed", self.name, link.kind, link.peer)

    def _open_link(self, peer: str) -> None:
        """The core added a link (an exchange's new link, frozen): connect it. The end whose
        name sorts first dials; the other waits for it (or finds it already connected)."""
        link = self.links.get(peer)
        if link is not None:
            if link.established:
                log.error("%s: the core opened a link to %s, which exists", self.name, peer)
                return
            if link.opened and not (link.dialer or link.closing or link.peer_closed):
                link.established = True  # the peer dialed before our core opened the link
                self.mark_dirty(link)
                return
            # What is left of an earlier instance of this link: still flushing what that
            # instance's core queued (closing), or abandoned by the peer. It must not carry the
            # new instance's messages, nor take them down with it when it goes.
            if link.closing and not link.peer_closed:
                self._retire(link)
            else:
                self._drop_link(link, bye=None)
        dialer = self.name < peer
        session = uuid.uuid4().hex if dialer else ""
        link = self._new_link(Link(peer, session, dialer=dialer, address=None, opened=True))
        link.established = True

    def _close_link(self, peer: str) -> None:
        """The core dropped a link (an exchange's removed link, or an added link whose lock was
        refused). Everything already queued on it still goes out; then goodbye."""
        link = self.links.get(peer)
        if link is None:
            return
        link.established = False
        link.closing = True
        self._maybe_finish_close(link)

    def _maybe_finish_close(self, link: Link) -> None:
        if link.closing and (not link.out or link.peer_closed):
            if link.out:
                log.warning(
                    "%s: %d message(s) to %s were never acknowledged",
                    self.name,
                    len(link.out),
                    link.peer,
                )
            self._drop_link(link, bye="closed")

    def _link_up(self, link: Link, conn: Conn, peer_last_rx: object) -> None:
        if type(peer_last_rx) is not int:
            raise FrameError("hello needs an integer last_rx", "bad-hello")
        link.rewind(peer_last_rx)
        old = link.conn
        if old is not None and old is not conn:
            old.role = None  # its late connection_lost must not touch the link
            old.abort()
        link.conn = conn
        conn.link = link
        conn.role = link.kind
        link.last_heard = self._now()
        link.connects += 1
        link.connected_once = True
        if link.kind == "link":
            self.metrics.link_reconnects.labels(link.peer).inc()
            if not link.established and not link.opened:
                link.established = True
                self._apply(self.core.handle(AddLink(link.peer), self._now()))
            link.remote_pressure = link.sent_pressure = False
            self._update_pressure()
        link.up.set()
        self.mark_dirty(link)
        log.info(
            "%s: %s to %s is up (session %s, resend from %d)",
            self.name,
            link.kind,
            link.peer,
            link.session[:8],
            link.sent,
        )

    def _session_hello(self, conn: Conn, hello: dict[str, Any], kind: str) -> None:
        """A peer broker dialed us, for an overlay link or an out-of-band channel."""
        peer = _str_field(hello, "name")
        session = _str_field(hello, "session")
        if peer == self.name:
            raise FrameError("a broker cannot link to itself", "bad-hello")
        address = hello.get("address")
        if isinstance(address, str) and address:
            self.peers.setdefault(peer, address)
        table = self._table(kind, dialer=False)
        link = table.get(peer)
        retired = self._retired.get(peer) if kind == "link" else None
        if retired is not None and retired.session == session:
            link = retired  # the earlier instance of a re-opened link resumes its flushing
        if link is not None and link.session == session:
            self._answer_hello(conn, last_rx=link.rx_seq)
            self._link_up(link, conn, hello.get("last_rx"))
            return
        if hello.get("resume"):
            removed = kind == "link" and self._removed.get(peer) == session
            code = "link-removed" if removed else "unknown-session"
            raise FrameError(f"no {kind} session {session[:8]} with {peer}", code)
        if (
            link is not None
            and link.opened
            and not link.dialer
            and not link.closing
            and (not link.connected_once or (link.established and hello.get("opened")))
        ):
            # The dial our OpenLink was waiting for. Or a new one: the dialer abandoned an
            # earlier session of this link (its lock was refused, and it retried) after our core
            # had opened the link on that session; the core's link is the same, so its queue
            # goes out on the new session from the start.
            link.session = session
            link.base = link.sent = 1
            link.rx_seq = link.acked_rx = 0
            link.connected_once = link.peer_closed = False
        else:
            if link is not None:  # the peer started a new session (restarted, or re-added it)
                log.info("%s: %s opened a new %s session; resetting", self.name, peer, kind)
                self._drop_link(link, bye=None)
            opened = kind == "link" and bool(hello.get("opened"))
            link = self._new_link(
                Link(peer, session, dialer=False, address=None, kind=kind, opened=opened)
            )
            if opened:
                link.established = self.core.is_neighbour(peer)
        self._answer_hello(conn, last_rx=0)
        self._link_up(link, conn, hello.get("last_rx"))

    def _dial_answered(self, conn: Conn, hello: dict[str, Any]) -> None:
        link = conn.link
        assert link is not None
        if link.removed:
            # Dropped while the hello was on its way: the peer has just set up its end, so it
            # must hear the goodbye it would have heard on an established connection.
            if link.farewell:
                conn.write(control_frame(F_BYE, link.farewell))
            conn.close()
            return
        if hello.get("name") != link.peer:
            raise FrameError(f"dialed {link.peer} but {hello.get('name')!r} answered", "wrong-peer")
        self._link_up(link, conn, hello.get("last_rx"))
        if not conn.handshake.done():
            conn.handshake.set_result(None)

    def _dial_refused(self, conn: Conn, frame: list[Any]) -> None:
        link = conn.link
        assert link is not None
        code = frame[1] if len(frame) > 1 else "?"
        log.warning("%s: %s refused the %s: %s", self.name, link.peer, link.kind, frame[1:])
        if code == "link-removed":
            self._drop_link(link, bye=None)
        elif code == "unknown-session":  # the peer lost our session (it restarted): start anew
            if link.established and not link.opened:
                link.established = False
                self._apply(self.core.handle(RemoveLink(link.peer), self._now()))
            link.session = uuid.uuid4().hex
            link.out.clear()
            link.base = link.sent = 1
            link.rx_seq = link.acked_rx = 0
            link.connected_once = False
        conn.close()
        if not conn.handshake.done():
            conn.handshake.set_exception(ConnectionRefusedError(f"{link.peer} refused: {code}"))

    async def _dial_loop(self, link: Link) -> None:
        """Keep the connection up: dial, hello, wait for loss, back off, repeat."""
        delay = self.config.reconnect_min
        while not (link.removed or link.peer_closed or self.stopping):
            address = link.address or self.peers.get(link.peer)
            conn: Conn | None = None
            try:
                if address is None:
                    raise OSError(f"no address known for {link.peer} (POST /peers)")
                host, port = parse_address(address)
                _, dialed = await asyncio.wait_for(
                    self._loop.create_connection(lambda: Conn(self, link), host, port),
                    self.config.handshake_timeout,
                )
                conn = dialed
                await asyncio.wait_for(
                    asyncio.shield(dialed.handshake), self.config.handshake_timeout
                )
                delay = self.config.reconnect_min
                await dialed.lost
            except (OSError, TimeoutError, FrameError, ValueError) as exc:
                log.debug("%s: dialing %s failed: %s", self.name, link.peer, exc)
                if conn is not None:
                    conn.abort()
            if link.removed or link.peer_closed or self.stopping:
                break
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self.config.reconnect_max)

    # ------------------------------------------------------------------ RTT probes

    async def _probe_peers(self) -> None:
        """One RTT probe to every broker of the address book that is not a neighbour (those
        are measured by heartbeats): the miner's underlay distance matrix needs every pair."""
        try:
            targets = [
                (p, a) for p, a in self.peers.items() if p != self.name and p not in self.links
            ]
            results = await asyncio.gather(*(self._probe(a) for _, a in targets))
            for (peer, _), rtt_ms in zip(targets, results, strict=True):
                if rtt_ms is not None:
                    self.telemetry.rtt(peer, rtt_ms, via="probe")
        finally:
            self._probing = None

    async def _probe(self, address: str) -> float | None:
        """Round trip of a hello on a fresh connection (so it never queues behind data)."""
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                reader, writer = await asyncio.open_connection(*parse_address(address))
                t0 = self._loop.time()
                writer.write(
                    control_frame(
                        F_HELLO, {"v": PROTOCOL_VERSION, "role": "probe", "name": self.name}
                    )
                )
                length = int.from_bytes(await reader.readexactly(4), "big")
                if length > 4096:
                    return None
                await reader.readexactly(length)
                return (self._loop.time() - t0) * 1000.0
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
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
        for name, address in peers.items():
            parse_address(address)
            self.peers[name] = address

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
            self._apply(self.core.handle(req, self._now()))
        except (ProtocolError, ValueError) as exc:
            del self.exchanges[xid]
            raise ValueError(str(exc)) from None
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

    def _send_to_peer(self, peer: str, msg: object) -> None:
        ch = self.channels_out.get(peer)
        if ch is None:
            ch = self._new_link(
                Link(peer, uuid.uuid4().hex, dialer=True, address=None, kind="peer")
            )
        ch.out.append(encode_generic(msg))
        self.mark_dirty(ch)

    def _start_timer(self, key: str, delay: float) -> None:
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()  # the same key replaces
        self._timers[key] = self._loop.call_later(delay, self._timer_fired, key)

    def _timer_fired(self, key: str) -> None:
        self._timers.pop(key, None)
        if self.stopping:
            return
        try:
            self._apply(self.core.handle(TimerFired(key), self._now()))
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

    # ------------------------------------------------------------------ draining

    def drain(self, target: str, address: str | None = None) -> dict[str, Any]:
        """Empty this broker of clients before it is removed: every attached client (and any
        that attaches from now on) is asked to migrate to neighbour ``target`` at ``address``
        (default: the address book's). The client library follows on its own; see
        :meth:`drain_status` for when the broker is empty."""
        if not self.core.is_neighbour(target):
            raise ValueError(
                f"{target} is not a neighbour of {self.name}: clients can only move one link"
            )
        address = address or self.peers.get(target)
        if not address:
            raise ValueError(f"no address known for {target}: pass one")
        parse_address(address)
        self.drain_target = (target, address)
        self._drained.clear()
        for client in list(self.clients.values()):
            self._redirect(client, target, address)
        self._check_drained()
        return self.drain_status()

    def cancel_drain(self) -> dict[str, Any]:
        self.drain_target = None
        self._drained.clear()
        return self.drain_status()

    def drain_status(self) -> dict[str, Any]:
        """``drained`` once no client is attached *and* every link has had everything
        acknowledged: the ``Moved`` of the last publisher that left must reach the
        neighbour before the link may be removed, or that neighbour holds the publisher's
        events for ever."""
        unacked = sum(len(lk.out) for lk in self.links.values())
        target = self.drain_target
        return {
            "draining": target is not None,
            "target": target[0] if target else None,
            "address": target[1] if target else None,
            "clients": len(self.clients),
            "unacknowledged": unacked,
            "drained": target is not None and not self.clients and not unacked,
        }

    def _check_drained(self) -> None:
        if self.drain_status()["drained"]:
            self._drained.set()

    async def wait_drained(self, within: float) -> bool:
        """Wait up to ``within`` seconds for :meth:`drain_status` to say drained."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while not self.drain_status()["drained"]:
                    self._drained.clear()
                    await self._drained.wait()
        return bool(self.drain_status()["drained"])

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
        log.info("%s: exchange %s %s %s", self.name, eff.xid, rec.state, eff.reason)

    # ------------------------------------------------------------------ views for the admin API

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "routing": self.core.mode.value,
            "incarnation": self.incarnation,
            "address": f"{self.address[0]}:{self.address[1]}" if self.address else None,
            "advertised": self.advertised,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "ready": self.ready,
            "neighbours": [self.links[p].status() for p in sorted(self.links)],
            "clients": len(self.clients),
            "queue_depths": {
                "links": {p: lk.depth for p, lk in sorted(self.links.items())},
                "clients_total": sum(c.depth for c in self.clients.values()),
                "clients_max": max((c.depth for c in self.clients.values()), default=0),
            },
            "publishers_paused": self._publishers_paused,
            "routing_table_size": self.core.routing_table_size(),
            "channels": {
                "out": [self.channels_out[p].status() for p in sorted(self.channels_out)],
                "in": [self.channels_in[p].status() for p in sorted(self.channels_in)],
            },
            "exchange": ex.xid if (ex := self.core.exchange) is not None else None,
            "pending_exchanges": self.core.pending_exchanges,
            "ordering_delay": self.ordering_delay_status(),
            "drain": self.drain_status(),
        }

    def _gauges(self) -> Gauges:
        self._take_ordering_delays()  # scrape time: the histogram is current when read
        depths = [c.depth for c in self.clients.values()]
        return Gauges(
            routing_table_entries=self.core.routing_table_size(),
            clients=len(self.clients),
            publishers_paused=self._publishers_paused,
            link_queue_depth={p: lk.depth for p, lk in self.links.items()},
            link_up={p: lk.conn is not None for p, lk in self.links.items()},
            client_queue_depth_max=max(depths, default=0),
            client_queue_depth_total=sum(depths),
        )

    def drop_link_connection(self, peer: str) -> bool:
        """Abort a link's TCP connection without removing the link (fault injection for tests
        and operators: the dialing side reconnects and resumes the session)."""
        link = self.links.get(peer)
        if link is None or link.conn is None:
            return False
        link.conn.abort()
        return True

    async def wait_link_up(self, peer: str, within: float) -> bool:
        link = self.links.get(peer)
        if link is None:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(link.up.wait(), within)
        return link.conn is not None
