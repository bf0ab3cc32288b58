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
from dataclasses import dataclass, field

from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.events import Event, Value
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import (
    AddLink,
    ClientAttach,
    ClientDetach,
    ClientPublish,
    ClientSubscribe,
    ClientUnsubscribe,
    Deliver,
    Effect,
    FromLink,
    Input,
    Publish,
    RemoveLink,
    RoutingMode,
    SendToLink,
    Subscribe,
    Unsubscribe,
)
from canopy_broker.sim.checker import DeliveryRecord, PubRecord, SubRecord

Edge = tuple[str, str]
CoreFactory = Callable[[str, RoutingMode], BrokerCore]

_CONTROL = (Subscribe, Unsubscribe)
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
    ) -> None:
        self.mode = mode
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
        self._heap: list[tuple[float, int, str, Input]] = []
        self._counter = itertools.count()
        self._channel_clock: dict[tuple[str, str], float] = {}
        self._control_in_flight = 0
        self._unsettled: list[int] = []
        self._issues: dict[int, int] = {}
        self._live_subs: dict[tuple[str, str], _Sub] = {}
        self._next_seq: dict[str, int] = {}
        self._edges: set[frozenset[str]] = set()
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

    def _client_action(self, client: str, at: float | None, inp: Input, record: int = -1) -> None:
        """Schedule ``inp`` to be *issued* by the client at ``at``; it reaches the broker later.

        ``record`` is the index of the subscription record a subscribe settles.
        """
        t = self.now if at is None else at
        self._issues[next(self._counter)] = record
        heapq.heappush(self._heap, (t, next(self._counter) - 1, _CLIENT, inp))

    def _issue(self, key: int, inp: Input) -> None:
        """A client action happens now: count it in flight and send it to the client's broker."""
        record = self._issues.pop(key)
        if isinstance(inp, ClientSubscribe | ClientUnsubscribe | ClientDetach):
            self._control_in_flight += 1
        if record >= 0:
            self._unsettled.append(record)
        assert isinstance(
            inp, ClientAttach | ClientDetach | ClientSubscribe | ClientUnsubscribe | ClientPublish
        )
        client = inp.client
        t = self._fifo_time(("client", client), self.now + self.rng.uniform(*self.client_delay))
        self._schedule(t, self.client_broker[client], inp)

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

    # ------------------------------------------------------------------ the engine

    def _fifo_time(self, channel: tuple[str, str], t: float) -> float:
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
            if broker is _CLIENT:
                self._issue(key, inp)
            else:
                self._apply(broker, inp)
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"simulation did not quiesce within {max_steps} steps")
        if not self._heap and until != math.inf:
            self.now = max(self.now, until)

    def _apply(self, broker: str, inp: Input) -> None:
        self.stats.inputs += 1
        if isinstance(inp, FromLink):
            msg = inp.message
            if isinstance(msg, _CONTROL):
                self._control_in_flight -= 1
            elif isinstance(msg, Publish):
                self._copy_done(msg.event)
            if not self.cores[broker].is_neighbour(inp.peer):
                return  # the link was removed while this message travelled: it is lost
        elif isinstance(inp, ClientSubscribe | ClientUnsubscribe | ClientDetach):
            self._control_in_flight -= 1
        elif isinstance(inp, ClientPublish):
            self._copy_done(inp.event)
        effects = self.cores[broker].handle(inp, self.now)
        self._carry_out(broker, effects)
        if self._control_in_flight == 0 and self._unsettled:
            for index in self._unsettled:
                self.subs[index] = self.subs[index].settled(self.now)
            self._unsettled.clear()

    def _copy_done(self, event: Event) -> None:
        key = (event.publisher, event.seq)
        self.pubs[key] = self.pubs[key].ended(self.now)

    def _carry_out(self, broker: str, effects: list[Effect]) -> None:
        for eff in effects:
            if isinstance(eff, SendToLink):
                msg = eff.message
                self.stats.messages[type(msg).__name__] += 1
                if isinstance(msg, _CONTROL):
                    self._control_in_flight += 1
                t = self._fifo_time(
                    (broker, eff.peer), self.now + self.rng.uniform(*self.link_delay)
                )
                self._schedule(t, eff.peer, FromLink(broker, msg))
            elif isinstance(eff, Deliver):
                e = eff.event
                self.stats.delivery_hops[e.hops] += 1
                self.deliveries.append(DeliveryRecord(eff.client, e.publisher, e.seq, self.now))

    # ------------------------------------------------------------------ results

    def publications(self) -> list[PubRecord]:
        return list(self.pubs.values())

    def subscriptions_by_broker(self) -> dict[str, list[tuple[str, str, Filter]]]:
        """Live subscriptions, grouped by the broker their client is attached to."""
        out: dict[str, list[tuple[str, str, Filter]]] = {b: [] for b in self.cores}
        for (client, sub_id), sub in self._live_subs.items():
            out[sub.broker].append((client, sub_id, self.subs[sub.record_index].filter))
        return out


def random_tree(n: int, rng: random.Random, max_fanout: int = 4, prefix: str = "b") -> list[Edge]:
    """A randomly grown tree over ``n`` brokers whose degrees never exceed ``max_fanout``."""
    names = [f"{prefix}{i}" for i in range(n)]
    degree = dict.fromkeys(names, 0)
    edges: list[Edge] = []
    for i in range(1, n):
        choices = [names[j] for j in range(i) if degree[names[j]] < max_fanout]
        parent = rng.choice(choices)
        degree[parent] += 1
        degree[names[i]] += 1
        edges.append((parent, names[i]))
    return edges
