"""A deterministic discrete-event simulator for many broker cores in one process.

The *same* :class:`~canopy_broker.core.broker.BrokerCore` that runs in a broker process runs here;
only the I/O is simulated. Each directed overlay link is a FIFO channel whose messages take a
seeded random delay (a later message never overtakes an earlier one on the same link), and each
client talks to its broker over a FIFO channel too. Given the same seed, a run is reproducible to
the message.

Besides deliveries, the simulator records what the checker needs to decide which deliveries were
*owed*: when each subscription had settled (no subscription control message anywhere in flight
after it was issued), when it was withdrawn, and the life of each notification (publish until the
last copy was handled).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.events import Event, Value
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import (
    AddLink,
    Algorithm,
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
    DetourLink,
    Done,
    Effect,
    ExchangeFinished,
    FindCycles,
    FromLink,
    FromPeer,
    Input,
    LinkFailed,
    LinkRepair,
    OpenLink,
    Ordering,
    PeerFailed,
    Publish,
    Relay,
    RemoveLink,
    Repaired,
    RepairFinished,
    RoutingMode,
    SendToLink,
    SendToPeer,
    StandbyLinks,
    StartExchange,
    StartTimer,
    Subscribe,
    TimerFired,
    Transfer,
    Unsubscribe,
    validate_path,
)
from canopy_broker.sim.checker import DeliveryRecord, PubRecord, SubRecord

__all__ = ["ExchangeRecord", "SimStats", "Simulator"]

Edge = tuple[str, str]
CoreFactory = Callable[[str, RoutingMode], BrokerCore]

# Messages that carry routing state: while one travels, some subscription is not settled.
_CONTROL = (Subscribe, Unsubscribe, Transfer, Relay, Done)
_CLIENT = "\0client"  # heap target meaning "a client issues this input now"


@dataclass
class SimStats:
    """Message counts: link traversals by message type, and hop counts of deliveries."""

    messages: Counter[str] = field(default_factory=Counter)
    delivery_hops: Counter[int] = field(default_factory=Counter)
    inputs: int = 0

    @property
    def link_messages(self) -> int:
        return sum(self.messages.values())


@dataclass
class _Sub:
    record_index: int
    broker: str


@dataclass(frozen=True)
class _Migrate:
    client: str
    target: str


@dataclass(frozen=True)
class _RemoveLeaf:
    leaf: str


@dataclass(frozen=True)
class _BrokerFault:
    """Something that happens to one broker: it dies (``crash``), its neighbours declare it
    dead (``detect``), a pause ends (``resume``) or outlasts detection (``fence``)."""

    what: Literal["crash", "detect", "resume", "fence"]
    broker: str


@dataclass(frozen=True)
class _Cut:
    """Connections are down for ``duration``: one overlay link (``link``; the two brokers' other
    connections stay up) or, without it, every connection between ``side`` and the rest."""

    side: frozenset[str]
    duration: float
    link: frozenset[str] | None = None

    def crosses(self, sender: str, receiver: str, oob: bool) -> bool:
        if self.link is not None:
            return not oob and self.link == {sender, receiver}
        return (sender in self.side) != (receiver in self.side)


@dataclass(frozen=True)
class _Pause:
    broker: str
    duration: float


@dataclass(frozen=True)
class _LinkFault:
    """Link ``link`` is cut for good (``sever``), or both ends' detectors declare it failed
    (``detect``)."""

    what: Literal["sever", "detect"]
    link: frozenset[str]


_Fault = _BrokerFault | _Cut | _Pause | _LinkFault
_Orchestration = _Migrate | _RemoveLeaf | _Fault


@dataclass
class _Migration:
    """A client moving between brokers, as its client library sees it: deliveries from the old
    broker count until the marker, those from the new one are held until then; afterwards only
    notifications newer than the last one delivered from their publisher pass (each connection
    is FIFO per publisher, so that removes exactly the duplicates)."""

    old: str
    new: str
    marker: bool = False
    held: list[DeliveryRecord] = field(default_factory=list)


@dataclass
class ExchangeRecord:
    """One requested link exchange and how it ended (times in simulated time)."""

    xid: str
    path: tuple[str, ...]
    remove: tuple[str, str]
    requested_at: float
    finished_at: float | None = None
    ok: bool | None = None
    reason: str = ""
    attempts: int = 0

    @property
    def cycle_length(self) -> int:
        return len(self.path)


class Simulator:
    """Runs broker cores over a tree with seeded per-link FIFO delays.

    Schedule client actions with :meth:`attach`, :meth:`subscribe`, :meth:`unsubscribe` and
    :meth:`publish` (each at an absolute time, default: now), link changes with
    :meth:`add_link` / :meth:`remove_link`, then :meth:`run` to quiescence.
    """

    def __init__(
        self,
        brokers: Iterable[str],
        edges: Iterable[Edge],
        *,
        mode: RoutingMode = RoutingMode.COVERING,
        seed: int = 0,
        link_delay: tuple[float, float] = (1.0, 10.0),
        client_delay: tuple[float, float] = (0.1, 1.0),
        core_factory: CoreFactory = BrokerCore,
        timer_scale: float = 100.0,
        record_traffic: bool = False,
        detection_time: float = 60.0,
    ) -> None:
        self.mode = mode
        # How long a silent neighbour takes to be declared dead (see :meth:`pause`).
        self.detection_time = detection_time
        # Timers are given in seconds by the core; the simulator's clock unit is a link delay
        # of 1-10 (think milliseconds), so a 0.05 s backoff becomes 5 units.
        self.timer_scale = timer_scale
        self._heap_key = -1
        self.rng = random.Random(seed)
        self.link_delay = link_delay
        self.client_delay = client_delay
        self.cores: dict[str, BrokerCore] = {b: core_factory(b, mode) for b in brokers}
        self.now = 0.0
        self.stats = SimStats()
        self.subs: list[SubRecord] = []
        self.pubs: dict[tuple[str, int], PubRecord] = {}
        self.deliveries: list[DeliveryRecord] = []
        self.client_broker: dict[str, str] = {}
        self._heap: list[tuple[float, int, str, Input | _Orchestration]] = []
        self._counter = itertools.count()
        self._channel_clock: dict[tuple[str, ...], float] = {}
        self._control_in_flight = 0
        # Subscriptions waiting to settle, with the exchanges they overlapped: a subscription
        # issued while an exchange runs is established only once that exchange has finished.
        self._unsettled: list[tuple[int, set[str]]] = []
        self._issues: dict[int, tuple[int, str | None]] = {}
        self._record_of: dict[tuple[str, str], int] = {}
        self._migrations: dict[str, _Migration] = {}
        self._last_seq: dict[str, dict[str, int]] = {}
        self._leaving: dict[str, str] = {}  # leaf being removed -> its neighbour
        self._on_the_wire: dict[tuple[str, str], int] = {}  # link messages sent, not yet handled
        self.removed: set[str] = set()
        self.crashed: set[str] = set()
        # Faults: connections down until some time, paused brokers with the inputs held for
        # them, the clients of brokers that died, and the repairs not yet complete (by dead
        # broker: the neighbours still repairing; a subscription issued meanwhile is established
        # only once the repair is done, as with an exchange).
        self._cuts: list[tuple[_Cut, float]] = []
        # Links cut for good: what was sent on them waits (per direction, in order) until the
        # sender's end detours the link over an out-of-band connection (DetourLink).
        self._severed: set[frozenset[str]] = set()
        self._stranded: dict[tuple[str, str], list[FromLink]] = {}
        self._detoured: set[tuple[str, str]] = set()
        self.link_repairs: list[tuple[float, str, LinkRepair]] = []  # (when, broker, decision)
        self._paused: dict[str, list[tuple[int, Input]]] = {}
        self.victims: set[str] = set()
        self._repairing: dict[str, set[str]] = {}
        self.repaired: dict[str, float] = {}  # dead broker -> when its repair was complete
        self._core_factory = core_factory
        self._active_exchanges: set[str] = set()
        self._late_detection: dict[str, dict[str, float]] = {}  # see detect_failure
        self.exchanges: dict[str, ExchangeRecord] = {}
        self._timers: dict[tuple[str, str], int] = {}
        # Causality: each client's vector clock (what it has seen and published).
        self._vc: dict[str, dict[str, int]] = {}
        # Optional traffic log: (time, sender, receiver, message) for every link/peer message.
        self.traffic: list[tuple[float, str, str, object]] | None = [] if record_traffic else None
        self._live_subs: dict[tuple[str, str], _Sub] = {}
        self._next_seq: dict[str, int] = {}
        self._edges: set[frozenset[str]] = set()
        # When each end last opened and closed its end of a link, as (end, other end); and
        # the messages that reached an end whose core has not opened the link yet.
        self._opened_at: dict[tuple[str, str], float] = {}
        self._closed_at: dict[tuple[str, str], float] = {}
        self._unopened: dict[tuple[str, str], list[FromLink]] = {}
        # (sender, receiver) channels whose sender died with messages the receiver had not
        # opened the link for: lost, and so is whatever of the sender's follows on them.
        self._lost_with_sender: set[tuple[str, str]] = set()
        for a, b in edges:
            self._link_now(a, b)

    # ------------------------------------------------------------------ topology

    @property
    def edges(self) -> list[Edge]:
        return sorted(tuple(sorted(e)) for e in self._edges)  # type: ignore[misc]

    def _link_now(self, a: str, b: str) -> None:
        """Create a link at once, both ends (used for the initial tree)."""
        self._edges.add(frozenset((a, b)))
        for x, y in ((a, b), (b, a)):
            self._apply(x, AddLink(y))

    def add_link(self, a: str, b: str, at: float | None = None) -> None:
        """Both ends learn of a new link at time ``at`` (uncoordinated)."""
        t = self.now if at is None else at
        self._edges.add(frozenset((a, b)))
        self._schedule(t, a, AddLink(b))
        self._schedule(t, b, AddLink(a))

    def remove_link(self, a: str, b: str, at: float | None = None) -> None:
        """Both ends drop the link at time ``at``; messages still in flight on it are lost."""
        t = self.now if at is None else at
        self._edges.discard(frozenset((a, b)))
        self._schedule(t, a, RemoveLink(b))
        self._schedule(t, b, RemoveLink(a))

    # ------------------------------------------------------------------ clients

    def _client_action(
        self,
        client: str,
        at: float | None,
        inp: Input | _Orchestration,
        record: int = -1,
        broker: str | None = None,
    ) -> None:
        """Schedule ``inp`` to be *issued* by the client at ``at``; it reaches the broker later.

        ``record`` is the index of the subscription record a subscribe settles; ``broker`` is the
        connection it goes over (default: the client's current broker when it is issued).
        """
        t = self.now if at is None else at
        key = next(self._counter)
        self._issues[key] = (record, broker)
        heapq.heappush(self._heap, (t, key, _CLIENT, inp))

    def _issue(self, key: int, inp: Input | _Orchestration) -> None:
        """A client action happens now: count it in flight and send it to the client's broker."""
        record, broker = self._issues.pop(key)
        if isinstance(inp, _Migrate):
            self._start_migration(inp.client, inp.target)
            return
        if isinstance(inp, _RemoveLeaf):
            self._start_leaf_removal(inp.leaf)
            return
        if isinstance(inp, _Fault):
            self._fault(inp)
            return
        if isinstance(inp, ClientPublish):
            vc = self._vc.setdefault(inp.client, {})
            vc[inp.client] = inp.event.seq
            k = (inp.event.publisher, inp.event.seq)
            self.pubs[k] = replace(self.pubs[k], vc=dict(vc))
        if isinstance(inp, ClientSubscribe | ClientUnsubscribe | ClientDetach):
            self._control_in_flight += 1
        if record >= 0:
            self._unsettled.append((record, self._ongoing()))
        assert isinstance(
            inp,
            ClientAttach
            | ClientDetach
            | ClientSubscribe
            | ClientUnsubscribe
            | ClientPublish
            | ClientMigrating
            | ClientMove,
        )
        client = inp.client
        target = broker or self.client_broker[client]
        t = self._fifo_time(
            ("client", client, target), self.now + self.rng.uniform(*self.client_delay)
        )
        self._schedule(t, target, inp)

    def attach(self, client: str, broker: str, at: float | None = None) -> None:
        self.client_broker[client] = broker
        self._client_action(client, at, ClientAttach(client))

    def detach(self, client: str, at: float | None = None) -> None:
        t = self.now if at is None else at
        for (c, sub_id), sub in list(self._live_subs.items()):
            if c == client:
                self.subs[sub.record_index] = self.subs[sub.record_index].withdrawn(t)
                del self._live_subs[(c, sub_id)]
        self._client_action(client, at, ClientDetach(client))

    def subscribe(self, client: str, sub_id: str, f: Filter, at: float | None = None) -> None:
        t = self.now if at is None else at
        index = len(self.subs)
        self.subs.append(SubRecord(client, sub_id, f, issued_at=t))
        self._record_of[(client, sub_id)] = index
        self._live_subs[(client, sub_id)] = _Sub(index, self.client_broker[client])
        self._client_action(client, at, ClientSubscribe(client, sub_id, f), record=index)

    def unsubscribe(self, client: str, sub_id: str, at: float | None = None) -> None:
        t = self.now if at is None else at
        sub = self._live_subs.pop((client, sub_id))
        self.subs[sub.record_index] = self.subs[sub.record_index].withdrawn(t)
        self._client_action(client, at, ClientUnsubscribe(client, sub_id))

    def publish(self, client: str, attrs: Mapping[str, Value], at: float | None = None) -> Event:
        """Schedule a publication; call in publish order per client (it assigns the sequence)."""
        t = self.now if at is None else at
        seq = self._next_seq.get(client, 0) + 1
        self._next_seq[client] = seq
        event = Event(client, seq, dict(attrs))
        self.pubs[(client, seq)] = PubRecord(client, seq, event.attrs, published_at=t, ended_at=t)
        self._client_action(client, at, ClientPublish(client, event))
        return event

    # ------------------------------------------------------------------ reconfiguration

    def exchange(
        self,
        path: tuple[str, ...] | list[str],
        remove: tuple[str, str],
        at: float | None = None,
        *,
        xid: str | None = None,
        ordering: Ordering = Ordering.FIFO,
        lease: float = 30.0,
        algorithm: Algorithm = Algorithm.COORDINATED,
    ) -> str:
        """Ask path[0] to exchange ``remove`` for (path[0], path[-1]) with the coordinated
        algorithm, at time ``at``. Returns the exchange id."""
        xid = xid or f"x{len(self.exchanges) + 1}"
        req = StartExchange(xid, tuple(path), remove, ordering, lease, algorithm)
        t = self.now if at is None else at
        self.exchanges[xid] = ExchangeRecord(xid, tuple(path), remove, requested_at=t)
        heapq.heappush(self._heap, (t, next(self._counter), _CLIENT, req))
        return xid

    def _ongoing(self) -> set[str]:
        """Exchanges and repairs running now (a subscription issued meanwhile waits for them)."""
        return self._active_exchanges | {f"repair:{dead}" for dead in self._repairing}

    def _request_exchange(self, req: StartExchange) -> None:
        self._active_exchanges.add(req.xid)
        for _, overlapped in self._unsettled:
            overlapped.add(req.xid)
        initiator = req.path[0]
        if req.algorithm is Algorithm.PATH:
            initiator = req.path[validate_path(req.path, req.remove)]
        self._apply(initiator, req)

    def strawman_exchange(
        self,
        remove: tuple[str, str],
        add: tuple[str, str],
        at: float | None = None,
        gap: float = 0.0,
    ) -> None:
        """The uncoordinated baseline: drop r, and add a ``gap`` later, at both ends.

        Routing messages and notifications in flight on r are lost; the ends withdraw and
        re-advertise their routes (unsubscribe/resubscribe). With ``gap`` = 0 the two waves race
        and partly cancel; paper 002 replaces the broken link 0.1 s later, so its unsubscription
        wave has mostly run its course before the subscriptions start.
        """
        t = self.now if at is None else at
        self.remove_link(*remove, at=t)
        self.add_link(*add, at=t + gap)

    @property
    def finished(self) -> bool:
        """No exchange is still locking or running."""
        return not self._active_exchanges

    @property
    def repairing(self) -> set[str]:
        """Dead brokers whose repair is not complete (or not yet detected)."""
        return set(self._repairing)

    @property
    def paused(self) -> set[str]:
        return set(self._paused)

    @property
    def leaving(self) -> set[str]:
        """Leaves being removed (their clients migrating away), with the neighbour they leave."""
        return set(self._leaving) | set(self._leaving.values())

    @property
    def migrating(self) -> set[str]:
        """Clients whose migration has not switched yet (the old broker's marker is due)."""
        return {c for c, m in self._migrations.items() if not m.marker}

    # ------------------------------------------------------------------ the engine

    def _fifo_time(self, channel: tuple[str, ...], t: float) -> float:
        t = max(t, self._channel_clock.get(channel, -math.inf))
        self._channel_clock[channel] = t
        return t

    def _schedule(self, t: float, broker: str, inp: Input) -> None:
        heapq.heappush(self._heap, (t, next(self._counter), broker, inp))

    def run(self, until: float = math.inf, max_steps: int = 50_000_000) -> None:
        """Process inputs in time order until none are left (or ``until``)."""
        steps = 0
        while self._heap and self._heap[0][0] <= until:
            t, key, broker, inp = heapq.heappop(self._heap)
            self.now = t
            self._heap_key = key
            if broker is _CLIENT:
                if isinstance(inp, StartExchange):
                    self._request_exchange(inp)
                else:
                    self._issue(key, inp)
            elif broker in self._paused:
                assert not isinstance(inp, _Orchestration)
                self._paused[broker].append((key, inp))  # in its socket buffers, unread
            else:
                assert not isinstance(inp, _Orchestration)
                self._apply(broker, inp)
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"simulation did not quiesce within {max_steps} steps")
        if until != math.inf:
            self.now = max(self.now, until)  # time passes even when nothing happens

    def _waits_for_open(self, sender: str, receiver: str) -> bool:
        """Whether a message over the link ``sender``-``receiver`` waits for the receiver's core
        to open its end: the sender's core opened the link after the receiver last closed its
        end, and still has it. The runtime holds such data (a promoted standby link) or refuses
        it unacknowledged, to be sent again (a dialed one), until the core opens the link: a
        repair link one end opens after the other, say. Before this, the simulator lost it,
        and both ends had to open a repair link at the same moment."""
        if receiver in self.crashed or sender in self.crashed:
            return False
        if self.cores[receiver].is_neighbour(sender):
            return False
        opened = self._opened_at.get((sender, receiver))
        return (
            opened is not None
            and opened >= self._closed_at.get((receiver, sender), -math.inf)
            and self.cores[sender].is_neighbour(receiver)
        )

    def _link_end(self, broker: str, peer: str, *, opened: bool) -> None:
        """``broker``'s core opened or closed its end of the link to ``peer``: what waited for
        the one goes in now, and what the other had sent to it is handed over again (to be
        taken now, or lost with the link)."""
        (self._opened_at if opened else self._closed_at)[(broker, peer)] = self.now
        key = (peer, broker) if opened else (broker, peer)
        for inp in self._unopened.pop(key, ()):
            self._schedule(self.now, key[1], inp)

    def _apply(self, broker: str, inp: Input) -> None:
        self.stats.inputs += 1
        if isinstance(inp, PeerFailed) and self.cores[broker].declared_dead(inp.peer):
            return  # a probe's verdict after the detector's (see _probe): said once
        if isinstance(inp, PeerFailed) and not self.cores[broker].routing.has_link(inp.peer):
            # The core has no such link any more (a walk repaired it first, see the core's
            # Settle handling): as the runtime's detector, nothing to repair; the link is gone.
            self._edges.discard(frozenset((broker, inp.peer)))
            self._link_end(broker, inp.peer, opened=False)
            self._repaired_at(broker, inp.peer)
            return
        if isinstance(inp, FromLink) and self._waits_for_open(inp.peer, broker):
            self._unopened.setdefault((inp.peer, broker), []).append(inp)
            return  # still on its way, as far as the counts go
        if isinstance(inp, FromLink):
            self._on_the_wire[(inp.peer, broker)] -= 1
            msg = inp.message
            if isinstance(msg, _CONTROL):
                self._control_in_flight -= 1
            elif isinstance(msg, Publish):
                self._copy_done(msg.event)
            if not self.cores[broker].is_neighbour(inp.peer):
                return  # the link was removed while this message travelled: it is lost
            if (inp.peer, broker) in self._lost_with_sender:
                return  # behind messages lost with their dead sender (see _dies)
        elif isinstance(inp, ClientSubscribe | ClientUnsubscribe | ClientDetach):
            self._control_in_flight -= 1
            self._withdrawal_takes_effect(inp)
        elif isinstance(inp, ClientPublish):
            self._copy_done(inp.event)
        elif isinstance(inp, FromPeer) and isinstance(inp.message, _CONTROL):
            self._control_in_flight -= 1
        elif isinstance(inp, PeerFailed):
            self._edges.discard(frozenset((broker, inp.peer)))
        elif isinstance(inp, TimerFired):
            if self._timers.get((broker, inp.key)) != self._heap_key:
                return  # superseded by a later StartTimer with the same key
            del self._timers[(broker, inp.key)]
        if broker in self.crashed:
            return  # a dead process: whatever reaches it is lost
        core = self.cores[broker]
        ex = core.exchange
        queued = {id(q): q for _, q in ex.queue} if ex is not None and ex.queue else {}
        effects = core.handle(inp, self.now)
        if isinstance(inp, PeerFailed) and not any(isinstance(e, Repaired) for e in effects):
            # No repair here: the link went with the exchange it was added by (an A end whose
            # other end died, or a settle that rolled it back).
            self._repaired_at(broker, inp.peer)
        if queued:
            # Notifications that waited in the new link's ordering queue live until released.
            still = {id(q) for _, q in ex.queue} if ex is not None else set()
            for key, q in queued.items():
                if key not in still and isinstance(q.message, Publish):
                    self._copy_done(q.message.event)
        self._carry_out(broker, effects)
        if isinstance(inp, AddLink):
            self._link_end(broker, inp.peer, opened=True)
        elif isinstance(inp, RemoveLink | PeerFailed):
            self._link_end(broker, inp.peer, opened=False)
        if isinstance(inp, ClientDetach) and broker in self._leaving:
            self._maybe_remove_leaf(broker)
        elif isinstance(inp, FromLink) and inp.peer in self._leaving:
            self._maybe_remove_leaf(inp.peer)
        if self._control_in_flight == 0 and self._unsettled:
            waiting = []
            ongoing = self._ongoing()
            for index, overlapped in self._unsettled:
                if overlapped & ongoing:
                    waiting.append((index, overlapped))
                else:
                    self.subs[index] = self.subs[index].settled(self.now)
            self._unsettled = waiting

    def _withdrawal_takes_effect(
        self, inp: ClientSubscribe | ClientUnsubscribe | ClientDetach
    ) -> None:
        if isinstance(inp, ClientUnsubscribe):
            index = self._record_of[(inp.client, inp.sub_id)]
            self.subs[index] = self.subs[index].gone(self.now)
        elif isinstance(inp, ClientDetach):
            m = self._migrations.get(inp.client)
            if m is not None and m.old != self.client_broker[inp.client]:
                return  # the old connection of a migrated client: its subscriptions live on
            for (client, _), index in self._record_of.items():
                if client == inp.client:
                    self.subs[index] = self.subs[index].gone(self.now)

    # ------------------------------------------------------------------ leaves and migration

    def add_broker(self, name: str) -> None:
        """A new broker process, not linked to anything yet."""
        self.cores[name] = self._core_factory(name, self.mode)

    def add_leaf(self, name: str, attach_to: str, at: float | None = None) -> None:
        """Add-leaf: a new broker joins with one link; its neighbour hands it the routes."""
        self.add_broker(name)
        self.add_link(name, attach_to, at=at)

    def migrate(self, client: str, target: str, at: float | None = None) -> None:
        """Move a client to neighbouring broker ``target`` (make-before-break)."""
        self._client_action(client, at, _Migrate(client, target))

    def crash(self, broker: str, at: float | None = None) -> None:
        """The broker's process dies at ``at``: it handles nothing from then on."""
        self._client_action("\0sim", at, _BrokerFault("crash", broker))

    def detect_failure(self, dead: str, at: float, late: Mapping[str, float] | None = None) -> None:
        """The failure detector fires at ``at`` at every neighbour of ``dead`` (the same moment
        everywhere, unless ``late`` holds a later one for a neighbour: its detector is slower,
        as on real processes, where they differ by tens of milliseconds; a repair link one end
        opens before the other holds what comes over it until the other does, see
        _waits_for_open). The neighbours are those whose core has a live link to ``dead`` at
        that moment."""
        if late:
            self._late_detection[dead] = dict(late)
        self._client_action("\0sim", at, _BrokerFault("detect", dead))

    def drop_link(self, a: str, b: str, duration: float, at: float | None = None) -> None:
        """Link (a, b)'s connection breaks at ``at`` and is re-established ``duration`` later.

        In the runtime a link's session outlives its connection: each end keeps what it sent
        until acknowledged and resends it on reconnect, and the receiver drops what it had
        already taken. So nothing is lost and the order holds; what the drop does is *delay*
        the link's traffic, both ways: messages in flight and those sent meanwhile arrive after
        the reconnect, in order. Out-of-band channels between the two are other connections
        and stay up. (A drop longer than the detection time makes each end declare the other
        dead: a link failure with both ends alive, which the crash repair does not handle.)"""
        self._client_action("\0sim", at, _Cut(frozenset((a,)), duration, frozenset((a, b))))

    def cut_link(
        self, a: str, b: str, at: float | None = None, *, detect_after: float | None = None
    ) -> None:
        """Link (a, b)'s connection breaks at ``at`` and never comes back; both brokers stay
        alive and their out-of-band connections stay up.

        As with :meth:`drop_link`, each end keeps what it sent on the link and anything it sends
        later, in order: that traffic is *stranded*, not lost. It moves only when an end's core
        asks to detour the link (:class:`DetourLink`, from the link-failure repair): from then
        on that direction's stream, stranded backlog first, travels FIFO over an out-of-band
        channel, as the runtime would resend a link session's unacknowledged frames over a
        peer connection, until the exchange closes the link. ``detect_after``: both ends'
        link-failure detectors fire that long after the cut (:class:`LinkFailed`)."""
        t = self.now if at is None else at
        link = frozenset((a, b))
        self._client_action("\0sim", t, _LinkFault("sever", link))
        if detect_after is not None:
            self.detect_link_failure(a, b, at=t + detect_after)

    def detect_link_failure(self, a: str, b: str, at: float) -> None:
        """Both ends of link (a, b) are told at ``at`` that it failed with the far end alive."""
        self._client_action("\0sim", at, _LinkFault("detect", frozenset((a, b))))

    def set_standby(self, links: Iterable[Edge], at: float | None = None) -> None:
        """The standby links each broker keeps (both ends learn theirs; replaces the old set)."""
        partners: dict[str, set[str]] = {b: set() for b in self.cores}
        for a, b in links:
            partners[a].add(b)
            partners[b].add(a)
        t = self.now if at is None else at
        for b, peers in sorted(partners.items()):
            self._schedule(t, b, StandbyLinks(tuple(sorted(peers))))

    def find_cycles(self, bound: int, round_: int, at: float | None = None) -> None:
        """Detection round ``round_`` of small cycles (at most ``bound`` brokers) at every
        live broker at ``at``."""
        t = self.now if at is None else at
        for b in sorted(self.cores):
            if b not in self.removed and b not in self.crashed:
                self._schedule(t, b, FindCycles(round_, bound))

    def partition(self, side: Iterable[str], duration: float, at: float | None = None) -> None:
        """Every connection between the brokers of ``side`` and the others (overlay links, links
        opened meanwhile, out-of-band channels) breaks at ``at`` for ``duration``: a link drop
        of all of them at once (see :meth:`drop_link`); clients keep their brokers."""
        self._client_action("\0sim", at, _Cut(frozenset(side), duration))

    def pause(self, broker: str, duration: float, at: float | None = None) -> None:
        """The broker's process stops at ``at`` for ``duration`` (SIGSTOP, a long GC, a VM
        migration): it reads nothing and its timers do not run, but what is sent to it waits
        in its buffers and is handled, in order, when it resumes; it sends nothing meanwhile.

        A pause longer than :attr:`detection_time` is a death to the overlay: the neighbours
        declare it dead at ``at + detection_time``, repair around it and fence its process
        (the runtime refuses a fenced incarnation when it comes back). So from that moment the
        simulator treats it as crashed: what it holds and would do on waking reaches nobody
        on the overlay, and its clients are victims, like a crashed broker's."""
        self._client_action("\0sim", at, _Pause(broker, duration))

    def _fault(self, fault: _Fault) -> None:
        """A fault happens now (see the public methods for what each models and why)."""
        if isinstance(fault, _Cut):
            self._cut_now(fault)
        elif isinstance(fault, _LinkFault):
            self._link_fault(fault)
        elif isinstance(fault, _Pause):
            self._paused.setdefault(fault.broker, [])
            fenced = fault.duration > self.detection_time
            end = self.detection_time if fenced else fault.duration
            then = _BrokerFault("fence" if fenced else "resume", fault.broker)
            self._client_action("\0sim", self.now + end, then)
        elif fault.what == "crash":
            self._dies(fault.broker)
        elif fault.what == "detect":
            self._detect_now(fault.broker)
        elif fault.what == "fence":
            self._dies(fault.broker)
            self._detect_now(fault.broker)
            self._wake(fault.broker)  # what it held is dropped: it is dead to the overlay
        else:
            self._wake(fault.broker)

    def _dies(self, broker: str) -> None:
        """The broker is dead to the overlay from now on; its clients (attached, or migrating
        to or from it) become victims, and a repair is owed until its neighbours finish it."""
        self.crashed.add(broker)
        for key in [k for k in self._unopened if broker in k]:  # lost with it
            if key[0] == broker:
                # The runtime refused them (the receiver's core had not opened the link), and
                # nobody will send them again; a link session is FIFO, so what the dead sender
                # sent after them cannot be taken either. Delivered after the open, the later
                # messages lost only the earlier ones: a repair's sweep came in without the
                # routes sent ahead of it, and its replay left out what those routes led to.
                self._lost_with_sender.add(key)
            for inp in self._unopened.pop(key):
                self._schedule(self.now, key[1], inp)
        for client, b in self.client_broker.items():
            m = self._migrations.get(client)
            if b == broker or (m is not None and not m.marker and broker in (m.old, m.new)):
                self.victims.add(client)
            if m is not None and not m.marker and broker == m.new and m.old not in self.crashed:
                # The client library gives up waiting for the marker and leaves the old
                # broker (then fails over from the dead one): its subscriptions there go.
                self._issue_now(client, ClientDetach(client), m.old)
        for dead in [d for d, waiting in self._repairing.items() if broker in waiting]:
            self._repaired_at(broker, dead)  # it will not finish its part: it died during it
        self._repairing[broker] = set()
        token = f"repair:{broker}"
        for _, overlapped in self._unsettled:
            overlapped.add(token)

    def _detect_now(self, dead: str) -> None:
        neighbours = sorted(
            b for b, core in self.cores.items() if b not in self.crashed and core.is_neighbour(dead)
        )
        waiting = self._repairing.setdefault(dead, set())
        waiting.update(neighbours)
        late = self._late_detection.pop(dead, {})
        for b in neighbours:
            self._schedule(self.now + late.get(b, 0.0), b, PeerFailed(dead))
        if not waiting:  # nobody to repair (it had no links left)
            self._repair_complete(dead)

    def _repair_complete(self, dead: str) -> None:
        del self._repairing[dead]
        self.repaired[dead] = self.now

    def _wake(self, broker: str) -> None:
        """Hand a paused broker what it was sent meanwhile, in the order it arrived."""
        for key, inp in self._paused.pop(broker, []):
            new_key = next(self._counter)
            if isinstance(inp, TimerFired) and self._timers.get((broker, inp.key)) == key:
                self._timers[(broker, inp.key)] = new_key
            heapq.heappush(self._heap, (self.now, new_key, broker, inp))

    def _cut_now(self, cut: _Cut) -> None:
        """The connections go down: what is in flight on them arrives after they are back."""
        until = self.now + cut.duration
        self._cuts = [(c, u) for c, u in self._cuts if u > self.now]
        self._cuts.append((cut, until))
        moved: list[tuple[float, int, str, FromLink | FromPeer]] = []
        kept: list[tuple[float, int, str, Input | _Orchestration]] = []
        for entry in self._heap:
            t, key, broker, inp = entry
            oob = isinstance(inp, FromPeer)
            if (
                isinstance(inp, FromLink | FromPeer)
                and t >= self.now
                and cut.crosses(inp.peer, broker, oob)
            ):
                moved.append((t, key, broker, inp))
            else:
                kept.append(entry)
        if not moved:
            return
        heapq.heapify(kept)
        self._heap = kept
        for _t, _key, broker, inp in sorted(moved, key=lambda m: m[:2]):  # arrival order
            oob = isinstance(inp, FromPeer)
            channel = ("oob", inp.peer, broker) if oob else (inp.peer, broker)
            t = self._fifo_time(channel, until + self.rng.uniform(*self.link_delay))
            self._schedule(t, broker, inp)

    def _link_fault(self, fault: _LinkFault) -> None:
        a, b = sorted(fault.link)
        if fault.what == "detect":
            for x, y in ((a, b), (b, a)):
                if x not in self.crashed and self.cores[x].is_neighbour(y):
                    self._schedule(self.now, x, LinkFailed(y))
            return
        self._severed.add(fault.link)
        kept: list[tuple[float, int, str, Input | _Orchestration]] = []
        moved: list[tuple[float, int, str, FromLink]] = []
        for entry in self._heap:
            t, key, broker, inp = entry
            if isinstance(inp, FromLink) and frozenset((inp.peer, broker)) == fault.link:
                moved.append((t, key, broker, inp))
            else:
                kept.append(entry)
        heapq.heapify(kept)
        self._heap = kept
        for _t, _key, broker, inp in sorted(moved, key=lambda m: m[:2]):  # arrival order
            self._stranded.setdefault((inp.peer, broker), []).append(inp)

    def _detour(self, sender: str, receiver: str) -> None:
        """The sender's end detours its direction of a severed link: its backlog leaves now."""
        if frozenset((sender, receiver)) not in self._severed:
            return  # the link is not cut in this run (the detector's call): nothing to move
        self._detoured.add((sender, receiver))
        for inp in self._stranded.pop((sender, receiver), []):
            self._schedule(self._send_time(sender, receiver, oob=True, detour=True), receiver, inp)

    @property
    def stranded(self) -> int:
        """Link messages waiting on links cut for good (never delivered if none is detoured)."""
        return sum(map(len, self._stranded.values()))

    def _send_time(self, sender: str, receiver: str, *, oob: bool, detour: bool = False) -> float:
        """When a message sent now arrives: a link delay after now, or after the connection
        is back if it is down (FIFO per channel either way)."""
        start = self.now
        for cut, until in self._cuts:
            if until > start and cut.crosses(sender, receiver, oob):
                start = until
        channel = ("oob", sender, receiver) if oob else (sender, receiver)
        if detour:
            channel = ("detour", sender, receiver)
        return self._fifo_time(channel, start + self.rng.uniform(*self.link_delay))

    def victim_clients(self) -> set[str]:
        """Clients of brokers that died (crashed, or fenced after a long pause): the delivery
        guarantee does not cover them; the checker reports them apart."""
        return self.victims | {c for c, b in self.client_broker.items() if b in self.crashed}

    def remove_leaf(self, leaf: str, at: float | None = None) -> None:
        """Remove-leaf: migrate the leaf's clients to its neighbour, then drop the link."""
        self._client_action("\0sim", at, _RemoveLeaf(leaf))

    def _start_migration(self, client: str, target: str) -> None:
        old = self.client_broker[client]
        self._migrations[client] = _Migration(old, target)
        self.client_broker[client] = target  # what it does from now on goes to the new broker
        mine = [(sid, s) for (c, sid), s in self._live_subs.items() if c == client]
        self._issue_now(client, ClientAttach(client), target)
        for sub_id, s in mine:
            s.broker = target
            f = self.subs[s.record_index].filter
            self._issue_now(client, ClientSubscribe(client, sub_id, f), target)
        self._issue_now(client, ClientMigrating(client, old), target)
        self._issue_now(client, ClientMove(client, target), old)

    def _issue_now(self, client: str, inp: Input, broker: str) -> None:
        key = next(self._counter)
        self._issues[key] = (-1, broker)
        self._issue(key, inp)

    def _through_migration(self, m: _Migration, broker: str, rec: DeliveryRecord) -> bool:
        """Whether the migrating client's library passes this delivery to the application."""
        if broker == m.old:
            return not m.marker  # after the switch the old connection is only drained
        if not m.marker:
            m.held.append(rec)
            return False
        return self._newer(rec)

    def _newer(self, rec: DeliveryRecord) -> bool:
        return rec.seq > self._last_seq.get(rec.client, {}).get(rec.publisher, 0)

    def _marker_arrives(self, client: str, broker: str) -> None:
        m = self._migrations[client]
        if broker != m.old or m.marker:
            return
        m.marker = True
        for rec in m.held:
            if self._newer(rec):
                self._record_delivery(DeliveryRecord(rec.client, rec.publisher, rec.seq, self.now))
        m.held.clear()
        # Switched: the client closes its old connection.
        self._issue_now(client, ClientDetach(client), m.old)

    def _start_leaf_removal(self, leaf: str) -> None:
        neighbours = self.cores[leaf].neighbours
        if len(neighbours) != 1:
            raise RuntimeError(f"{leaf} is not a leaf: neighbours {neighbours}")
        self._leaving[leaf] = neighbours[0]
        clients = [c for c, b in self.client_broker.items() if b == leaf]
        for client in clients:
            self._start_migration(client, neighbours[0])
        self._maybe_remove_leaf(leaf)

    def _maybe_remove_leaf(self, leaf: str) -> None:
        """Unlink a drained leaf once it has no clients and nothing it sent is still on the
        way (a migrating publisher's Moved must arrive before the link goes)."""
        other = self._leaving.get(leaf)
        if (
            other is not None
            and not self.cores[leaf].clients
            and not self._on_the_wire.get((leaf, other))
        ):
            del self._leaving[leaf]
            self.removed.add(leaf)
            self.remove_link(leaf, other)

    def _record_delivery(self, d: DeliveryRecord) -> None:
        """The client's application received ``d``: log it and advance the client's clocks."""
        self.deliveries.append(d)
        last = self._last_seq.setdefault(d.client, {})
        last[d.publisher] = max(d.seq, last.get(d.publisher, 0))
        seen = self.pubs[(d.publisher, d.seq)].vc
        if seen:
            vc = self._vc.setdefault(d.client, {})
            for q, n in seen.items():
                if n > vc.get(q, 0):
                    vc[q] = n

    def _copy_done(self, event: Event) -> None:
        key = (event.publisher, event.seq)
        self.pubs[key] = self.pubs[key].ended(self.now)

    def _carry_out(self, broker: str, effects: list[Effect]) -> None:
        for eff in effects:
            if self.traffic is not None and isinstance(eff, SendToLink | SendToPeer):
                self.traffic.append((self.now, broker, eff.peer, eff.message))
            if isinstance(eff, SendToLink):
                msg = eff.message
                self.stats.messages[type(msg).__name__] += 1
                if isinstance(msg, _CONTROL):
                    self._control_in_flight += 1
                self._on_the_wire[(broker, eff.peer)] = (
                    self._on_the_wire.get((broker, eff.peer), 0) + 1
                )
                direction = (broker, eff.peer)
                if frozenset(direction) not in self._severed:
                    t = self._send_time(broker, eff.peer, oob=False)
                elif direction in self._detoured:
                    t = self._send_time(broker, eff.peer, oob=True, detour=True)
                else:
                    self._stranded.setdefault(direction, []).append(FromLink(broker, msg))
                    continue
                self._schedule(t, eff.peer, FromLink(broker, msg))
            elif isinstance(eff, Deliver):
                e = eff.event
                for client, _subs in eff.targets:
                    self.stats.delivery_hops[e.hops] += 1
                    delivery = DeliveryRecord(client, e.publisher, e.seq, self.now)
                    m = self._migrations.get(client)
                    if m is None or self._through_migration(m, broker, delivery):
                        self._record_delivery(delivery)
            elif isinstance(eff, SendToPeer):
                msg2 = eff.message
                self.stats.messages[type(msg2).__name__] += 1
                if isinstance(msg2, _CONTROL):
                    self._control_in_flight += 1
                t = self._send_time(broker, eff.peer, oob=True)
                self._schedule(t, eff.peer, FromPeer(broker, msg2))
            elif isinstance(eff, StartTimer):
                key = next(self._counter)
                self._timers[(broker, eff.key)] = key
                heapq.heappush(
                    self._heap,
                    (self.now + eff.delay * self.timer_scale, key, broker, TimerFired(eff.key)),
                )
            elif isinstance(eff, OpenLink):
                self._edges.add(frozenset((broker, eff.peer)))
                self._link_end(broker, eff.peer, opened=True)
            elif isinstance(eff, CloseLink):
                self._edges.discard(frozenset((broker, eff.peer)))
                self._link_end(broker, eff.peer, opened=False)
            elif isinstance(eff, DeliverMarker):
                self._marker_arrives(eff.client, broker)
            elif isinstance(eff, DetourLink):
                self._detour(broker, eff.peer)
            elif isinstance(eff, LinkRepair):
                self._link_repair(broker, eff)
            elif isinstance(eff, ExchangeFinished):
                rec = self.exchanges[eff.xid]
                rec.finished_at, rec.ok, rec.reason = self.now, eff.ok, eff.reason
                rec.attempts = eff.attempts
                self._active_exchanges.discard(eff.xid)
            elif isinstance(eff, RepairFinished):
                self._repaired_at(broker, eff.dead)
            elif isinstance(eff, Repaired):
                for peer in eff.links:
                    if peer in self.crashed:
                        self._probe(broker, peer)

    def _probe(self, broker: str, dead: str) -> None:
        """A repair at ``broker`` opened a link to ``dead``, which has crashed: the link never
        connects, and the runtime probes such a link once it has been without a connection
        for the detection time, and declares ``dead`` dead (LinkSessions.repaired and
        _probe_unconnected; not other links a core opens). The failure
        detector fires only at the dead broker's neighbours at its time, so a repair that
        links to a broker that died with the one it repairs around learns it this way."""
        self._schedule(self.now + self.detection_time, broker, PeerFailed(dead))

    def _repaired_at(self, broker: str, dead: str) -> None:
        """``broker``'s part of the repair around ``dead`` is done (or it had none)."""
        waiting = self._repairing.get(dead)
        if waiting is not None:
            waiting.discard(broker)
            if not waiting:
                self._repair_complete(dead)

    def _link_repair(self, broker: str, eff: LinkRepair) -> None:
        """A failed link's end decided its repair: an exchange is owed from now on (as one the
        simulator was asked for), so subscriptions issued meanwhile wait for it."""
        self.link_repairs.append((self.now, broker, eff))
        if not eff.xid or eff.xid in self.exchanges:
            return
        k = validate_path(eff.path, (broker, eff.peer))
        remove = (eff.path[k], eff.path[k + 1])
        self.exchanges[eff.xid] = ExchangeRecord(eff.xid, eff.path, remove, requested_at=self.now)
        self._active_exchanges.add(eff.xid)
        for _, overlapped in self._unsettled:
            overlapped.add(eff.xid)

    # ------------------------------------------------------------------ results

    def publications(self) -> list[PubRecord]:
        return list(self.pubs.values())

    def subscriptions_by_broker(self) -> dict[str, list[tuple[str, str, Filter]]]:
        """Live subscriptions, grouped by the broker their client is attached to."""
        out: dict[str, list[tuple[str, str, Filter]]] = {
            b: [] for b in self.cores if b not in self.removed
        }
        for (client, sub_id), sub in self._live_subs.items():
            out[sub.broker].append((client, sub_id, self.subs[sub.record_index].filter))
        return out
