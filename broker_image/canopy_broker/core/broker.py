"""The sans-I/O broker: routing tables, subscription forwarding and event routing.

``BrokerCore.handle(input, now)`` is the only entry point that changes state. It validates the
input first (raising :class:`ProtocolError` without touching state), then applies it and returns
the effects the caller must carry out, in a deterministic order (the simulator relies on that).

Subscription forwarding is kept *canonical*: what this broker advertises to a neighbour N is a
pure function of the routing keys it holds from every other source (local subscriptions and the
other neighbours):

* simple / identity: the set of those keys;
* covering: the maximal ones under a strict *dominance* order (``g`` dominates ``h`` when ``g``
  covers ``h`` and either ``h`` does not cover ``g`` or ``g`` sorts first).

Because the advertised set depends only on the current state and never on arrival order, a
central checker can compute every broker's expected routing table from the tree and the
subscriptions alone, and a reconfiguration can be proven to leave no stale or missing entry.
The set is maintained incrementally; see :meth:`BrokerCore._key_entered` / ``_key_left``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from canopy_broker.core import exchange as coordinated
from canopy_broker.core import path as path_algorithm
from canopy_broker.core.errors import ProtocolError
from canopy_broker.core.events import Event
from canopy_broker.core.exchange import Exchange
from canopy_broker.core.filters import Filter, covers
from canopy_broker.core.matching import IndexedMatcher
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
    CtrlMsg,
    Deliver,
    DeliverMarker,
    Done,
    Echo,
    Effect,
    End,
    FlushMsg,
    FromLink,
    FromPeer,
    Granted,
    Input,
    LinkReady,
    Lock,
    LockRefused,
    Marker,
    Moved,
    PeerMessage,
    Publish,
    RecMsg,
    Relay,
    RemoveLink,
    RouteKey,
    RoutingMode,
    SendToLink,
    SendToPeer,
    Separator,
    StartExchange,
    StartTimer,
    Subscribe,
    Tag,
    TimerFired,
    Unsubscribe,
)

__all__ = ["BrokerCore", "ProtocolError", "RoutingTable", "client_key", "dominates", "maximal"]

# A matcher payload: a neighbour name (str) or a local subscription (client, sub_id).
Dest = str | tuple[str, str]


def dominates(g: RouteKey, h: RouteKey) -> bool:
    """Strict order used by covering routing: ``g`` makes advertising ``h`` unnecessary."""
    if g == h or not covers(g.filter, h.filter):
        return False
    return not covers(h.filter, g.filter) or g.sort_key() < h.sort_key()


def maximal(keys: Iterable[RouteKey], mode: RoutingMode) -> set[RouteKey]:
    """The keys a broker advertises given the keys it holds from other sources."""
    keys = list(dict.fromkeys(keys))
    if mode is not RoutingMode.COVERING:
        return set(keys)
    return {h for h in keys if not any(dominates(g, h) for g in keys)}


def client_key(mode: RoutingMode, client: str, sub_id: str, f: Filter) -> RouteKey:
    """Routing key of a local subscription: tagged with its global id only in simple routing."""
    return RouteKey(f, f"{client}/{sub_id}" if mode is RoutingMode.SIMPLE else "")


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """Snapshot: keys received from each neighbour and each client's subscriptions."""

    links: Mapping[str, frozenset[RouteKey]]
    clients: Mapping[str, Mapping[str, Filter]]
    advertised: Mapping[str, frozenset[RouteKey]]

    def size(self) -> int:
        return sum(map(len, self.links.values())) + sum(map(len, self.clients.values()))

    def to_json(self) -> dict[str, object]:
        def keys(ks: frozenset[RouteKey]) -> list[str]:
            return [str(k) for k in sorted(ks, key=RouteKey.sort_key)]

        return {
            "links": {p: keys(ks) for p, ks in sorted(self.links.items())},
            "advertised": {p: keys(ks) for p, ks in sorted(self.advertised.items())},
            "clients": {
                c: {s: str(f) for s, f in sorted(subs.items())}
                for c, subs in sorted(self.clients.items())
            },
        }


class BrokerCore:
    """Routing state of one broker; see the module docstring for the forwarding rule."""

    def __init__(self, name: str, mode: RoutingMode = RoutingMode.COVERING) -> None:
        self.name = name
        self.mode = mode
        self._from_link: dict[str, set[RouteKey]] = {}
        self._advertised: dict[str, set[RouteKey]] = {}
        self._clients: dict[str, dict[str, Filter]] = {}
        # How many sources (neighbours, local subscriptions) hold each key.
        self._holders: dict[RouteKey, int] = {}
        self._matcher: IndexedMatcher[Dest] = IndexedMatcher()
        # Link exchange: this broker takes part in at most one at a time (the lock).
        self._ex: Exchange | None = None
        self._frozen: set[str] = set()  # links whose advertisements are held back
        self._retired: set[str] = set()  # removed link after phase 2: routing entries dropped
        self._attempts: dict[str, tuple[StartExchange, int]] = {}  # initiator's requests
        # Exchanges this broker left on lease expiry: their late messages are expected.
        self._left: deque[str] = deque(maxlen=64)
        # Path algorithm: (un)subscriptions from a neighbour to ignore while its RECMSG travels.
        self._ignore: dict[str, dict[str, set[RouteKey]]] = {}
        self._now = 0.0
        # Migrating publishers: their publications here wait until the old broker says Moved.
        self._held: dict[str, tuple[str, list[Event]]] = {}
        self._early_moved: set[tuple[str, str]] = set()  # (client, old broker): Moved came first
        self.ordering_delays: list[float] = []  # how long each queued notification waited
        # Per exchange, for the simulator's figures (bounded: the last 64 exchanges).
        self.ordering_delays_by_exchange: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ queries

    @property
    def neighbours(self) -> list[str]:
        return sorted(self._from_link)

    def is_neighbour(self, peer: str) -> bool:
        return peer in self._from_link

    @property
    def exchange(self) -> Exchange | None:
        """The exchange this broker is locked for, if any."""
        return self._ex

    @property
    def pending_exchanges(self) -> list[str]:
        """Exchanges this broker initiated that are not finished (locking or running)."""
        return sorted(self._attempts)

    @property
    def clients(self) -> list[str]:
        return sorted(self._clients)

    def routing_table(self) -> RoutingTable:
        return RoutingTable(
            links={p: frozenset(ks) for p, ks in self._from_link.items()},
            clients={c: dict(subs) for c, subs in self._clients.items()},
            advertised={p: frozenset(ks) for p, ks in self._advertised.items()},
        )

    def routing_table_size(self) -> int:
        return sum(map(len, self._from_link.values())) + sum(map(len, self._clients.values()))

    # ------------------------------------------------------------------ the boundary

    def handle(self, inp: Input, now: float = 0.0) -> list[Effect]:
        """Apply one input; return effects in a deterministic order.

        ``now`` is the caller's clock; the data plane needs none, but the signature is shared with
        the time-dependent parts (reconfiguration leases) so every driver calls it the same way.
        """
        out: list[Effect] = []
        self._now = now
        if isinstance(inp, FromLink):
            self._from_link_msg(inp, out)
        elif isinstance(inp, ClientPublish):
            self._check_client(inp.client)
            if inp.event.publisher != inp.client:
                raise ProtocolError(
                    f"client {inp.client!r} published as {inp.event.publisher!r}; "
                    "a client publishes under its own id"
                )
            held = self._held.get(inp.client)
            if held is not None:
                held[1].append(inp.event)
            else:
                self._route(inp.event, None, out)
        elif isinstance(inp, ClientSubscribe):
            subs = self._check_client(inp.client)
            if inp.sub_id in subs:
                raise ProtocolError(
                    f"client {inp.client!r} already has subscription {inp.sub_id!r}"
                )
            subs[inp.sub_id] = inp.filter
            self._matcher.add(inp.filter, (inp.client, inp.sub_id))
            self._key_added(client_key(self.mode, inp.client, inp.sub_id, inp.filter), None, out)
        elif isinstance(inp, ClientUnsubscribe):
            subs = self._check_client(inp.client)
            if inp.sub_id not in subs:
                raise ProtocolError(f"client {inp.client!r} has no subscription {inp.sub_id!r}")
            self._drop_subscription(inp.client, inp.sub_id, out)
        elif isinstance(inp, ClientAttach):
            if inp.client in self._clients:
                raise ProtocolError(f"client {inp.client!r} is already attached")
            self._clients[inp.client] = {}
        elif isinstance(inp, ClientDetach):
            subs = self._check_client(inp.client)
            for sub_id in list(subs):
                self._drop_subscription(inp.client, sub_id, out)
            del self._clients[inp.client]
            if inp.client in self._held:  # left before the move finished: release its events
                self._release_held(inp.client, out)
        elif isinstance(inp, ClientMigrating):
            self._check_client(inp.client)
            if inp.source not in self._from_link:
                raise ProtocolError(
                    f"{self.name}: {inp.client!r} migrates from {inp.source!r}, "
                    "which is not a neighbour"
                )
            if (inp.client, inp.source) in self._early_moved:
                self._early_moved.discard(
                    (inp.client, inp.source)
                )  # Moved came first: nothing to hold
            else:
                self._held[inp.client] = (inp.source, [])
            out.append(SendToLink(inp.source, Marker(inp.client)))
        elif isinstance(inp, ClientMove):
            self._check_client(inp.client)
            if inp.target not in self._from_link:
                raise ProtocolError(
                    f"{self.name}: {inp.client!r} moves to {inp.target!r}, which is not a neighbour"
                )
            out.append(SendToLink(inp.target, Moved(inp.client)))
        elif isinstance(inp, AddLink):
            self._add_link(inp.peer, out)
        elif isinstance(inp, RemoveLink):
            self._remove_link(inp.peer, out)
        elif isinstance(inp, FromPeer):
            self._from_peer(inp.peer, inp.message, out)
        elif isinstance(inp, StartExchange):
            self._start_exchange(inp, out)
        elif isinstance(inp, TimerFired):
            self._timer(inp.key, out)
        else:  # pragma: no cover - the type checker proves this unreachable
            raise ProtocolError(f"unknown input {inp!r}")
        return out

    def _check_client(self, client: str) -> dict[str, Filter]:
        subs = self._clients.get(client)
        if subs is None:
            raise ProtocolError(f"client {client!r} is not attached")
        return subs

    def _from_link_msg(self, inp: FromLink, out: list[Effect]) -> None:
        table = self._from_link.get(inp.peer)
        if table is None:
            raise ProtocolError(f"{self.name}: message from {inp.peer!r}, which is not a neighbour")
        msg = inp.message
        ex = self._ex
        if ex is not None and inp.peer == ex.a_peer and not ex.queue_released:
            # Everything crossing the new link waits until the old path has drained.
            ex.queue.append((self._now, inp))
            ex.queued_total += 1
            return
        if isinstance(msg, Publish):
            self._route(msg.event, inp.peer, out, msg.tag)
        elif (
            isinstance(msg, Subscribe | Unsubscribe)
            and ex is not None
            and (inp.peer == ex.r_peer and ex.granted)
        ):
            # The removed link is frozen: its routing changes go to this side's A end, and
            # apply here only until phase 2 has dropped the link's entries.
            if inp.peer not in self._retired:
                self._apply_route_msg(table, inp.peer, msg, out)
            self._to_peer(ex.a_end_of_my_side, Relay(ex.xid, msg), out)
        elif isinstance(msg, Subscribe | Unsubscribe):
            if not self._ignored(inp.peer, msg, table):
                self._apply_route_msg(table, inp.peer, msg, out)
        else:
            self._exchange_msg(inp.peer, msg, out)

    def _ignored(self, peer: str, msg: Subscribe | Unsubscribe, table: set[RouteKey]) -> bool:
        """Path algorithm: a route our RECMSG just gave this neighbour must not be undone by a
        withdrawal it sent before it saw the RECMSG (nor added twice)."""
        pending = self._ignore.get(peer)
        if not pending or not any(msg.key in keys for keys in pending.values()):
            return False
        return isinstance(msg, Unsubscribe) or msg.key in table

    def _apply_route_msg(
        self, table: set[RouteKey], peer: str, msg: Subscribe | Unsubscribe, out: list[Effect]
    ) -> None:
        if isinstance(msg, Subscribe):
            if msg.key in table:
                raise ProtocolError(f"{peer!r} subscribed twice to {msg.key}")
            table.add(msg.key)
            self._matcher.add(msg.key.filter, peer)
            self._key_added(msg.key, peer, out)
        else:
            if msg.key not in table:
                raise ProtocolError(f"{peer!r} unsubscribed {msg.key} it never subscribed")
            table.remove(msg.key)
            self._matcher.remove(msg.key.filter, peer)
            self._key_removed(msg.key, peer, out)

    # ------------------------------------------------------------------ events

    def _route(
        self, event: Event, source: str | None, out: list[Effect], tag: Tag | None = None
    ) -> None:
        dests = self._matcher.match_payloads(event.attrs)
        if not dests:
            return
        peers: list[str] = []
        local: dict[str, list[str]] = {}
        for d in dests:
            if isinstance(d, str):
                if d != source:
                    peers.append(d)
            else:
                local.setdefault(d[0], []).append(d[1])
        if peers:
            ex = self._ex
            copy = Publish(event.forwarded())
            if ex is None:
                for peer in sorted(peers):
                    out.append(SendToLink(peer, copy))
            else:
                coordinated.route_on_cycle(
                    self, ex, copy, sorted(peers), out, source=source, tag=tag
                )
        for client in sorted(local):
            out.append(Deliver(client, event, tuple(sorted(local[client]))))

    # ------------------------------------------------------------------ links

    def _add_link(self, peer: str, out: list[Effect]) -> None:
        if peer == self.name:
            raise ProtocolError(f"{self.name}: a broker cannot link to itself")
        if peer in self._from_link:
            raise ProtocolError(f"{self.name}: link to {peer!r} exists already")
        self._from_link[peer] = set()
        adv = maximal(self._holders, self.mode)
        self._advertised[peer] = adv
        for key in sorted(adv, key=RouteKey.sort_key):
            out.append(SendToLink(peer, Subscribe(key)))

    def _remove_link(self, peer: str, out: list[Effect]) -> None:
        table = self._from_link.get(peer)
        if table is None:
            raise ProtocolError(f"{self.name}: no link to {peer!r}")
        if self._ex is not None and peer in self._ex.cycle_peers():
            raise ProtocolError(
                f"{self.name}: link to {peer!r} is on the cycle of exchange {self._ex.xid}"
            )
        del self._advertised[peer]
        del self._from_link[peer]
        # A migrating publisher's old broker is gone: nothing can overtake its held events now.
        for client in [c for c, (source, _) in self._held.items() if source == peer]:
            self._release_held(client, out)
        for key in sorted(table, key=RouteKey.sort_key):
            self._matcher.remove(key.filter, peer)
            self._key_removed(key, None, out)

    # ------------------------------------------------------------------ subscriptions

    def _drop_subscription(self, client: str, sub_id: str, out: list[Effect]) -> None:
        f = self._clients[client].pop(sub_id)
        self._matcher.remove(f, (client, sub_id))
        self._key_removed(client_key(self.mode, client, sub_id, f), None, out)

    def _held_except(self, key: RouteKey, peer: str) -> int:
        """How many sources other than neighbour ``peer`` hold ``key``."""
        return self._holders.get(key, 0) - (key in self._from_link[peer])

    def _key_added(self, key: RouteKey, source: str | None, out: list[Effect]) -> None:
        n = self._holders.get(key, 0)
        self._holders[key] = n + 1
        for peer in self._from_link:
            if peer != source and peer not in self._frozen and self._held_except(key, peer) == 1:
                self._key_entered(peer, key, out)

    def _key_removed(self, key: RouteKey, source: str | None, out: list[Effect]) -> None:
        n = self._holders[key] - 1
        if n:
            self._holders[key] = n
        else:
            del self._holders[key]
        for peer in self._from_link:
            if peer != source and peer not in self._frozen and self._held_except(key, peer) == 0:
                self._key_left(peer, key, out)

    def _key_entered(self, peer: str, key: RouteKey, out: list[Effect]) -> None:
        """``key`` became available for ``peer``: advertise it unless something dominates it."""
        adv = self._advertised[peer]
        if self.mode is RoutingMode.COVERING:
            if any(dominates(g, key) for g in adv):
                return
            obsolete = sorted((h for h in adv if dominates(key, h)), key=RouteKey.sort_key)
            adv.add(key)
            out.append(SendToLink(peer, Subscribe(key)))
            for h in obsolete:
                adv.remove(h)
                out.append(SendToLink(peer, Unsubscribe(h)))
            return
        adv.add(key)
        out.append(SendToLink(peer, Subscribe(key)))

    def _key_left(self, peer: str, key: RouteKey, out: list[Effect]) -> None:
        """``key`` is no longer held for ``peer``: withdraw it and re-advertise what it covered."""
        adv = self._advertised[peer]
        if key not in adv:
            return
        adv.remove(key)
        if self.mode is RoutingMode.COVERING:
            uncovered = [
                h
                for h in self._holders
                if h != key
                and self._held_except(h, peer) > 0
                and h not in adv
                and dominates(key, h)
                and not any(dominates(g, h) for g in adv)
            ]
            for h in sorted(maximal(uncovered, self.mode), key=RouteKey.sort_key):
                adv.add(h)
                out.append(SendToLink(peer, Subscribe(h)))
        out.append(SendToLink(peer, Unsubscribe(key)))

    # ------------------------------------------------------------------ link exchange

    def _to_peer(self, peer: str, msg: PeerMessage, out: list[Effect]) -> None:
        """Out-of-band send; a broker that plays both roles hands the message to itself."""
        if peer == self.name:
            self._from_peer(self.name, msg, out)
        else:
            out.append(SendToPeer(peer, msg))

    def _start_exchange(self, req: StartExchange, out: list[Effect]) -> None:
        if req.algorithm is Algorithm.PATH:
            path_algorithm.start(self, req, out)
        else:
            coordinated.start(self, req, out)

    def _timer(self, key: str, out: list[Effect]) -> None:
        coordinated.timer(self, key, out)

    def _from_peer(self, peer: str, msg: PeerMessage, out: list[Effect]) -> None:
        if isinstance(msg, RecMsg):  # the path algorithm's RECMSG across the new link
            path_algorithm.on_recmsg(self, peer, msg, out)
        else:
            coordinated.from_peer(self, peer, msg, out)

    def _wanted_by(self, peer: str) -> set[RouteKey]:
        """What this broker must advertise to ``peer``: the maximal keys held from elsewhere."""
        return maximal((k for k in self._holders if self._held_except(k, peer) > 0), self.mode)

    def _exchange_msg(self, peer: str, msg: object, out: list[Effect]) -> None:
        if isinstance(msg, Lock):
            coordinated.on_lock(self, peer, msg, out)
            return
        if isinstance(msg, RecMsg):
            path_algorithm.on_recmsg(self, peer, msg, out)
            return
        if isinstance(msg, CtrlMsg):
            self._ignore.get(peer, {}).pop(msg.xid, None)
            return
        if isinstance(msg, FlushMsg):
            path_algorithm.on_flush(self, msg, out)
            return
        if isinstance(msg, LinkReady):
            path_algorithm.on_link_ready(self, peer, out)
            return
        if isinstance(msg, Marker):
            if msg.client in self._clients:  # else the client has already left: nothing to say
                out.append(DeliverMarker(msg.client))
            return
        if isinstance(msg, Moved):
            held = self._held.get(msg.client)
            if held is not None and held[0] == peer:
                self._release_held(msg.client, out)
            elif held is None:
                self._early_moved.add((msg.client, peer))  # ClientMigrating is still on its way
            return
        ex = self._ex
        xid = getattr(msg, "xid", None)
        if isinstance(msg, Done):
            coordinated.apply_done(self, peer, msg, out)
        if ex is None or ex.xid != xid:
            if xid in self._left:
                return  # a late message of an exchange we finished by lease: nothing to do
            raise ProtocolError(
                f"{self.name}: {type(msg).__name__} for exchange {xid} it is not in"
            )
        out.append(StartTimer(f"lease:{ex.xid}", ex.lease))  # the exchange is alive: renew
        if isinstance(msg, LockRefused):
            coordinated.on_refused(self, ex, msg, out)
        elif isinstance(msg, Granted):
            coordinated.on_granted(self, ex, out)
        elif isinstance(msg, Separator):
            coordinated.on_separator(self, ex, msg.side, out)
        elif isinstance(msg, End):
            coordinated.on_end(self, ex, out)
        elif isinstance(msg, Done):
            ex.peer_done = True
            coordinated.maybe_release_a(self, ex, out)
        elif isinstance(msg, Echo):
            coordinated.on_echo(self, ex, out)
        else:  # pragma: no cover
            raise ProtocolError(f"unknown link message {msg!r}")

    def _release_held(self, client: str, out: list[Effect]) -> None:
        """A migrating publisher's publications here may go: the old broker's have passed."""
        _source, events = self._held.pop(client)
        for event in events:
            self._route(event, None, out)

    def take_ordering_delays(self) -> list[float]:
        """Hand over (and forget) the ordering delays measured since the last call."""
        delays, self.ordering_delays = self.ordering_delays, []
        return delays
