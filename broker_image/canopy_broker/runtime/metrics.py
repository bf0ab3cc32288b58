"""Prometheus metrics of one broker, in a registry of its own.

One :class:`CollectorRegistry` per broker instance (not the process-global default) so tests can
run several brokers in one process without "duplicated timeseries" errors. Counters are bumped on
the hot path once per *frame* (not per message) where possible; gauges that describe current state
(queue depths, routing table size, clients) are read from the broker at scrape time by a custom
collector, so nothing has to keep them up to date.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Gauges:
    """What the scrape-time collector reads from the broker."""

    routing_table_entries: int
    clients: int
    publishers_paused: bool
    link_queue_depth: dict[str, int]
    link_up: dict[str, bool]
    client_queue_depth_max: int
    client_queued_messages: int
    retention_depth: int = 0
    retention_full: bool = False
    retention_dropped: int = 0
    replay_duplicates: int = 0
    standby_up: dict[str, bool] = field(default_factory=dict)


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], Gauges]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        g = self._read()
        yield GaugeMetricFamily(
            "canopy_routing_table_entries",
            "Routing-table entries: keys from neighbours plus local subscriptions",
            value=g.routing_table_entries,
        )
        yield GaugeMetricFamily("canopy_clients", "Attached clients", value=g.clients)
        yield GaugeMetricFamily(
            "canopy_publishers_paused",
            "1 while reading from client publishers is paused by backpressure",
            value=int(g.publishers_paused),
        )
        depth = GaugeMetricFamily(
            "canopy_link_queue_depth",
            "Messages queued or unacknowledged on a link, or its bytes in slots of "
            "--queue-bytes / high water if more (the count high water is checked against)",
            labels=["peer"],
        )
        up = GaugeMetricFamily(
            "canopy_link_up", "1 while the link's connection is up", labels=["peer"]
        )
        for peer, n in sorted(g.link_queue_depth.items()):
            depth.add_metric([peer], n)
            up.add_metric([peer], int(g.link_up.get(peer, False)))
        yield depth
        yield up
        yield GaugeMetricFamily(
            "canopy_client_queue_depth_max",
            "Largest client outbound queue (messages waiting for a paused socket, or its bytes "
            "in slots if more)",
            value=g.client_queue_depth_max,
        )
        yield GaugeMetricFamily(
            "canopy_client_queued_messages",
            "Messages waiting in all client outbound queues (a gauge: no _total suffix)",
            value=g.client_queued_messages,
        )
        yield GaugeMetricFamily(
            "canopy_retention_depth",
            "Notifications kept for crash repair (forwarded on a link within the window)",
            value=g.retention_depth,
        )
        yield GaugeMetricFamily(
            "canopy_retention_full",
            "1 while a link's retention is at --retention-limit or --retention-bytes with "
            "entries younger than the failure detection time (publishers are slowed until "
            "they age out)",
            value=int(g.retention_full),
        )
        yield CounterMetricFamily(
            "canopy_retention_dropped",
            "Retained notifications dropped at --retention-limit or --retention-bytes, all older "
            "than the failure detection time (custody no longer needed for them)",
            value=g.retention_dropped,
        )
        yield CounterMetricFamily(
            "canopy_replay_duplicates",
            "Replayed notifications this broker already had (passed on, not delivered again)",
            value=g.replay_duplicates,
        )
        standby = GaugeMetricFamily(
            "canopy_standby_link_up",
            "Standby links (kept for a crash repair, heartbeats only) by peer: 1 while connected",
            labels=["peer"],
        )
        for peer, is_up in sorted(g.standby_up.items()):
            standby.add_metric([peer], int(is_up))
        yield standby


class BrokerMetrics:
    """All metrics of one broker; see docs/broker.md for the list."""

    def __init__(self, read_gauges: Callable[[], Gauges]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.link_messages = Counter(
            "canopy_link_messages",
            "Link messages (publish, subscribe, unsubscribe) by peer and direction",
            ["peer", "direction"],
            registry=r,
        )
        self.link_bytes = Counter(
            "canopy_link_bytes",
            "Frame bytes on links by peer and direction",
            ["peer", "direction"],
            registry=r,
        )
        self.link_reconnects = Counter(
            "canopy_link_connects",
            "Link connections established (first and reconnects)",
            ["peer"],
            registry=r,
        )
        self.client_messages = Counter(
            "canopy_client_messages", "Client messages by direction", ["direction"], registry=r
        )
        self.published = Counter(
            "canopy_events_published", "Events published by local clients", registry=r
        )
        self.delivered = Counter(
            "canopy_notifications_delivered", "Notifications queued to local clients", registry=r
        )
        self.matching = Histogram(
            "canopy_matching_seconds",
            "Time to route one event through the core (matching included); sampled 1 in 32",
            buckets=(2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 2e-2),
            registry=r,
        )
        self.slow_consumers = Counter(
            "canopy_slow_consumer_disconnects",
            "Clients disconnected because their outbound queue exceeded the hard cap",
            registry=r,
        )
        self.malformed = Counter(
            "canopy_malformed_frames",
            "Connections closed for malformed or illegal input, by role and error code",
            ["role", "code"],
            registry=r,
        )
        self.refused = Counter(
            "canopy_security_refusals",
            "Connections and requests security refused (no or wrong identity, forbidden id, "
            "subscription or publication, too many connections from one address), by role "
            "and code",
            ["role", "code"],
            registry=r,
        )
        self.tls_reloads = Counter(
            "canopy_tls_reloads",
            "Rotated TLS material loaded without a restart (links re-keyed on new connections)",
            registry=r,
        )
        self.peer_failures = Counter(
            "canopy_peer_failures",
            "Neighbours declared dead by the failure detector (their link dropped and fenced)",
            registry=r,
        )
        self.replayed = Counter(
            "canopy_replayed_notifications",
            "Notifications sent again over new links after a crash repair",
            registry=r,
        )
        self.repairs = Counter(
            "canopy_repair_links",
            "Links opened to repair the tree around a dead neighbour (paper 001's chain)",
            registry=r,
        )
        self.link_failures = Counter(
            "canopy_link_failures",
            "Links down past the detection timeout whose peer another of its neighbours still "
            "hears (a link failure, not a death: LinkFailed instead of PeerFailed)",
            registry=r,
        )
        self.link_repairs = Counter(
            "canopy_link_repairs",
            "Link-failure repairs decided here (paper 004), by outcome: exchange (onto a standby "
            "link closing a small cycle with the failed link) or none (no known cycle: it waits)",
            ["outcome"],
            registry=r,
        )
        self.detours = Counter(
            "canopy_link_detours",
            "Failed links whose session the core had carried out of band until its exchange "
            "closed them (DetourLink)",
            registry=r,
        )
        self.standby_promotions = Counter(
            "canopy_standby_promotions",
            "Standby links promoted to overlay links (by this end's repair or the peer's)",
            registry=r,
        )
        self.repair_links_promoted = Counter(
            "canopy_repair_links_promoted",
            "Repair links (of canopy_repair_links) carried by a promoted standby link, no dial",
            registry=r,
        )
        self.backpressure = Counter(
            "canopy_publisher_pauses", "Times reading from publishers was paused", registry=r
        )
        self.exchanges = Counter(
            "canopy_exchanges",
            "Link exchanges this broker initiated, by result (finished | failed)",
            ["result"],
            registry=r,
        )
        self.exchange_seconds = Histogram(
            "canopy_exchange_seconds",
            "Duration of the link exchanges this broker initiated (request to finish)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.ordering_delay = Histogram(
            "canopy_ordering_delay_seconds",
            "How long gray notifications waited at the new link of a link exchange before "
            "delivery order allowed them on (FIFO-publisher or causal)",
            buckets=(1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 5),
            registry=r,
        )
        self.loop_lag = Histogram(
            "canopy_event_loop_lag_seconds",
            "How late the event loop ran a callback due every 10 ms (every 250 ms while the "
            "broker is idle): how long nothing else (heartbeats, other clients) could run",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.gc_pause = Histogram(
            "canopy_gc_pause_seconds",
            "Collections of Python's cycle collector (any generation), by duration",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        r.register(_StateCollector(read_gauges))

    def render(self) -> bytes:
        return generate_latest(self.registry)


STALL = 0.01
"""A loop lag or a collection this long (seconds) is remembered as a stall."""


class LoopWatch:
    """Measures the broker's own responsiveness: event-loop lag and garbage-collection pauses.

    A callback due every ``interval`` notes how late it ran; the lateness is how long the loop
    was busy with something else, i.e. how long heartbeats and every other connection waited.
    Measured inside the broker because a probe from outside adds its own loop and the network
    to the figure. Each stall also records the CPU time the process used meanwhile: a stall
    with little CPU is the machine's doing (the process waited for a core), not the broker's
    work. Collections of the cycle collector are timed too, to tell a stall the collector
    caused from one the broker's own work did. The last ``keep`` stalls (lag or pause of at
    least :data:`STALL`) are kept with their wall-clock time for ``/status``.

    While the broker has nothing to do (``may_rest()`` at a tick) the callback is due every
    ``resting_interval`` instead; whatever brings or starts work calls :meth:`wake` first,
    which brings the next tick back within ``interval``. A stall is work, so it is measured at
    the fine interval all the same, and an idle broker wakes a few times a second rather than a
    hundred. Work that starts without a wake is measured at ``resting_interval``'s grain: an
    in-process gateway's parsing before its request reaches the broker, outgoing TLS
    handshakes (dials, RTT probes), an admin request's code after an ``await``, a repair a
    probe begins. The CPU a stall is credited with assumes the rest of a resting period was
    idle (at most one ``interval`` of it is deducted): such work there can be counted in.

    It also keeps bulk growth out of the collector's way. A collection scans every object in
    the generations it collects, and the routing state of 100k subscriptions is millions of
    objects: left to the collector, installing them stalled brokers 150-300 ms of CPU per
    young collection, and a full one of the whole table costs about 0.6 s. So whenever
    ``size()`` (the routing table) has grown by ``freeze_every`` entries since the last time,
    the young generations are collected (their garbage freed, a few ms) and everything left is
    frozen (``gc.freeze``: moved where no collection looks, in constant time). The price: a
    cycle that was alive then and dies later (a connection closed since, say) is not freed while
    frozen. So once the table has stopped growing for ``thaw_after`` seconds, everything is
    unfrozen (``gc.unfreeze``): the collector sees it all again and its next full collection
    frees what died meanwhile, one pause after a bulk install rather than one per thousand
    entries. Repeated connect-subscribe-leave cannot pile up garbage for longer than that.
    """

    def __init__(
        self,
        metrics: BrokerMetrics,
        *,
        interval: float = 0.01,
        resting_interval: float = 0.25,
        may_rest: Callable[[], bool] | None = None,
        keep: int = 256,
        size: Callable[[], int] | None = None,
        freeze_every: int = 1000,
        thaw_after: float = 600.0,
    ) -> None:
        self.metrics = metrics
        self.interval = interval
        self.resting_interval = resting_interval
        self.may_rest = may_rest  # asked at each tick: the owner has nothing to do
        self.resting = False  # see wake()
        self.rests = 0  # times it began to rest (``/status``: a request wakes it, so not this)
        self.size = size
        self.freeze_every = freeze_every
        self.frozen_at = size() if size is not None else 0
        self.freezes = 0
        self.thaw_after = thaw_after
        self.thaws = 0
        self._frozen_since: float | None = None  # loop time of our last freeze, until a thaw
        self.lag_max = 0.0
        self.busy_max = 0.0  # the CPU part of the longest stall in CPU
        self.gc_pause_max = 0.0
        # (wall-clock time, "loop" | "gc0" | "gc1" | "gc2", seconds, CPU seconds)
        self.stalls: deque[tuple[float, str, float, float]] = deque(maxlen=keep)
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._armed = 0.0  # when the pending tick was scheduled (the loop's clock)
        self._cpu = 0.0  # process CPU time then
        self._gc_started: tuple[float, float] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._arm(loop.time(), time.process_time())
        gc.callbacks.append(self._gc)

    def wake(self) -> None:
        """Work arrived (called by whoever receives it or starts it, first thing): the next
        tick within ``interval`` of now, so that a stall this work causes is measured as finely
        as any other. The watch rests again at the first tick that finds ``may_rest()``."""
        if not self.resting:
            return
        self.resting = False
        now = self._loop.time()
        if self._handle is not None and self._due > now + self.interval:
            self._handle.cancel()
            self._arm(now, time.process_time())

    def _arm(self, now: float, cpu: float) -> None:
        self._armed = now
        self._cpu = cpu
        self._due = now + (self.resting_interval if self.resting else self.interval)
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)

    def _tick(self) -> None:
        now = self._loop.time()
        cpu = time.process_time()
        lag = max(0.0, now - self._due)
        self.metrics.loop_lag.observe(lag)
        self.lag_max = max(self.lag_max, lag)
        if lag >= STALL:
            # The CPU used beyond what the period itself may have used (at most one fine
            # interval: resting, the broker had nothing to do): what the stall spent on CPU.
            period = min(self._due - self._armed, self.interval)
            busy = min(lag, max(0.0, cpu - self._cpu - period))
            self.busy_max = max(self.busy_max, busy)
            self.stalls.append((time.time(), "loop", lag, busy))
        if self.size is not None and self._freeze_or_thaw(now, self.size()):
            # The collection is this tick's (timed as a gc pause), not the next one's lag.
            now, cpu = self._loop.time(), time.process_time()
        resting = lag < STALL and self.may_rest is not None and self.may_rest()
        if resting and not self.resting:
            self.rests += 1
        self.resting = resting
        self._arm(now, cpu)

    def _freeze_or_thaw(self, now: float, size: int) -> bool:
        """Freeze after ``freeze_every`` entries of growth, thaw ``thaw_after`` seconds after
        the last freeze; True when it collected (and so took time of this tick)."""
        if size - self.frozen_at >= self.freeze_every:
            gc.collect(1)
            gc.freeze()
            self.frozen_at = size
            self.freezes += 1
            self._frozen_since = now
            return True
        self.frozen_at = min(self.frozen_at, size)  # shrank: growth counts from here
        if self._frozen_since is not None and now - self._frozen_since >= self.thaw_after:
            gc.unfreeze()
            self._frozen_since = None
            self.thaws += 1
        return False

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = (time.perf_counter(), time.process_time())
            return
        if self._gc_started is None:
            return
        took = time.perf_counter() - self._gc_started[0]
        cpu = time.process_time() - self._gc_started[1]
        self._gc_started = None
        self.metrics.gc_pause.observe(took)
        self.gc_pause_max = max(self.gc_pause_max, took)
        if took >= STALL:
            self.stalls.append((time.time(), f"gc{info.get('generation', '?')}", took, cpu))

    def status(self) -> dict[str, object]:
        return {
            "lag_max_s": round(self.lag_max, 4),
            "busy_max_s": round(self.busy_max, 4),
            "gc_pause_max_s": round(self.gc_pause_max, 4),
            "gc_freezes": self.freezes,
            "gc_thaws": self.thaws,
            "rests": self.rests,
            "stalls": [
                [round(t, 3), kind, round(d, 4), round(c, 4)] for t, kind, d, c in self.stalls
            ],
        }
