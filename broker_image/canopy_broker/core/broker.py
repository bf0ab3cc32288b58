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

from canopy_broker.core import path as path_algorithm
from canopy_broker.core.errors import ProtocolError
from canopy_broker.core.events import Event
from canopy_broker.core.exchange import Exchange, backoff, validate_path
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
    CloseLink,
    CtrlMsg,
    Deliver,
    DeliverMarker,
    Done,
    Echo,
    Effect,
    End,
    ExchangeFinished,
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
    OpenLink,
    Ordering,
    PeerMessage,
    Publish,
    RecMsg,
    Relay,
    RelayEnd,
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
    Transfer,
    Unsubscribe,
)

MAX_LOCK_ATTEMPTS = 60

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

    def _held_set_except(self, peer: str) -> set[RouteKey]:
        """What identity/simple routing advertises to ``peer``: every key held from elsewhere."""
        return {key for key in self._holders if self._held_except(key, peer) > 0}

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
                self._route_on_cycle(ex, copy, sorted(peers), out, source=source, tag=tag)
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

    def _route_on_cycle(
        self,
        ex: Exchange,
        copy: Publish,
        peers: list[str],
        out: list[Effect],
        *,
        source: str | None,
        tag: Tag | None,
    ) -> None:
        """Forward a notification on a reconfiguration cycle: colour it, and let black copies
        cross only the removed link and gray copies only the added one."""
        if tag is not None and tag.xid == ex.xid:
            gray = tag.gray
        elif source is not None and source in ex.cycle_peers():
            # Untagged from a cycle neighbour: sent before it locked (old tree, black) — except
            # at an A end that has seen End, whose down neighbour has released: new tree.
            gray = ex.end_seen and source == ex.down
        else:
            gray = ex.gray
        tagged = Publish(copy.event, Tag(ex.xid, gray))
        for peer in peers:
            if peer == ex.r_peer:
                if not gray:
                    out.append(SendToLink(peer, tagged))
            elif peer == ex.a_peer:
                if gray:
                    out.append(SendToLink(peer, tagged))
            elif peer in (ex.up, ex.down):
                out.append(SendToLink(peer, tagged))
            else:
                out.append(SendToLink(peer, copy))

    def _to_peer(self, peer: str, msg: PeerMessage, out: list[Effect]) -> None:
        """Out-of-band send; a broker that plays both roles hands the message to itself."""
        if peer == self.name:
            self._from_peer(self.name, msg, out)
        else:
            out.append(SendToPeer(peer, msg))

    def _start_exchange(self, req: StartExchange, out: list[Effect]) -> None:
        if req.algorithm is Algorithm.PATH:
            path_algorithm.start(self, req, out)
            return
        if req.xid in self._attempts:
            return  # idempotent: the same request is already being carried out
        try:
            validate_path(req.path, req.remove)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        if req.path[0] != self.name:
            raise ProtocolError(f"{self.name}: exchange {req.xid} must start at {req.path[0]}")
        self._attempts[req.xid] = (req, 0)
        self._try_lock(req.xid, out)

    def _try_lock(self, xid: str, out: list[Effect]) -> None:
        req, _ = self._attempts[xid]
        k = validate_path(req.path, req.remove)
        problem = self._lock_problem(req.path, 0, req.xid)
        if problem is None:
            lock = Lock(req.xid, req.path, k, req.ordering, req.lease)
            self._lock_here(lock, 0, out)
            out.append(SendToLink(req.path[1], lock))
        else:
            self._retry_later(xid, problem, out)

    def _retry_later(self, xid: str, reason: str, out: list[Effect]) -> None:
        req, attempt = self._attempts[xid]
        attempt += 1
        if attempt >= MAX_LOCK_ATTEMPTS:
            del self._attempts[xid]
            out.append(
                ExchangeFinished(xid, False, f"gave up after {attempt} attempts: {reason}", attempt)
            )
            return
        self._attempts[xid] = (req, attempt)
        out.append(StartTimer(f"lock:{xid}", backoff(xid, attempt)))

    def _timer(self, key: str, out: list[Effect]) -> None:
        kind, _, xid = key.partition(":")
        if kind == "lock" and xid in self._attempts and (self._ex is None or self._ex.xid != xid):
            self._try_lock(xid, out)
        elif kind == "lease" and self._ex is not None and self._ex.xid == xid:
            self._lease_expired(self._ex, out)

    def _lease_expired(self, ex: Exchange, out: list[Effect]) -> None:
        """Nothing heard from the exchange for a whole lease: a participant or the initiator is
        gone. Before phase 1 nothing has changed, so roll back; after it the new link may carry
        traffic, so roll forward — finish this broker's part without the missing messages."""
        if not ex.granted:
            self._undo_lock(ex, out)
            if ex.me == 0:
                self._retry_later(ex.xid, "lease expired while locking", out)
            return
        ex.by_lease = True
        r = ex.r_peer
        if r is not None and r in self._from_link:
            if not ex.phase2_done:
                self._phase2(ex, out)
            ex.other_sep_seen = True
            self._close_removed_link(ex, out)
        if ex.is_a and not ex.own_done:
            ex.other_sep_seen = ex.relay_end = ex.echo_seen = ex.end_seen = True
            self._maybe_release_queue(ex, out)
            self._maybe_finish_a(ex, out)
        if self._ex is not ex:
            return  # finishing our part completed the exchange after all
        self._ex = None
        self._left.append(ex.xid)
        if ex.me == 0:
            _req, attempt = self._attempts.pop(ex.xid)
            reason = "lease expired after phase 1 began: rolled forward"
            out.append(ExchangeFinished(ex.xid, False, reason, attempt + 1))

    def _lock_problem(self, path: tuple[str, ...], i: int, xid: str) -> str | None:
        """Why this broker cannot lock for the exchange at position ``i`` (None if it can)."""
        if self._ex is not None:
            return f"{self.name} is locked by exchange {self._ex.xid}"
        if i < len(path) - 1 and (
            path[i + 1] not in self._from_link or path[i + 1] in self._frozen
        ):
            return f"{self.name} has no link to {path[i + 1]}"
        if i in (0, len(path) - 1):
            other = path[-1] if i == 0 else path[0]
            if other in self._from_link:
                return f"{self.name} is already linked to {other}"
        return None

    def _lock_here(self, lock: Lock, i: int, out: list[Effect]) -> None:
        ex = Exchange(lock.xid, lock.path, lock.k, i, lock.ordering, lock.lease)
        self._ex = ex
        out.append(StartTimer(f"lease:{ex.xid}", ex.lease))
        a = ex.a_peer
        if a is not None:  # an A end: the added link exists from now on, frozen
            self._from_link[a] = set()
            self._advertised[a] = set()
            self._frozen.add(a)
            out.append(OpenLink(a))

    def _release(self, out: list[Effect]) -> None:
        """Leave the exchange (normal end, or a refused lock before anything changed)."""
        ex = self._ex
        assert ex is not None
        self._ex = None
        if ex.me == 0 and ex.own_done:
            _req, attempt = self._attempts.pop(ex.xid)
            reason = "lease expired after phase 1 began: rolled forward" if ex.by_lease else ""
            out.append(ExchangeFinished(ex.xid, not ex.by_lease, reason, attempt + 1))

    def _exchange_msg(self, peer: str, msg: object, out: list[Effect]) -> None:
        if isinstance(msg, Lock):
            self._on_lock(peer, msg, out)
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
            self._apply_done(peer, msg, out)
        if ex is None or ex.xid != xid:
            if xid in self._left:
                return  # a late message of an exchange we finished by lease: nothing to do
            raise ProtocolError(
                f"{self.name}: {type(msg).__name__} for exchange {xid} it is not in"
            )
        out.append(StartTimer(f"lease:{ex.xid}", ex.lease))  # the exchange is alive: renew
        if isinstance(msg, LockRefused):
            self._on_refused(ex, msg, out)
        elif isinstance(msg, Granted):
            self._on_granted(ex, out)
        elif isinstance(msg, Separator):
            self._on_separator(ex, msg.side, out)
        elif isinstance(msg, End):
            self._on_end(ex, out)
        elif isinstance(msg, Done):
            ex.peer_done = True
            self._maybe_release_a(ex, out)
        elif isinstance(msg, Echo):
            self._on_echo(ex, out)
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

    def _apply_done(self, peer: str, msg: Done, out: list[Effect]) -> None:
        """The other side's advertisement, complete: apply what differs from what we hold."""
        table = self._from_link[peer]
        keys = set(msg.keys)
        for key in sorted(keys - table, key=RouteKey.sort_key):
            self._apply_route_msg(table, peer, Subscribe(key), out)
        for key in sorted(table - keys, key=RouteKey.sort_key):
            self._apply_route_msg(table, peer, Unsubscribe(key), out)

    def _on_lock(self, peer: str, msg: Lock, out: list[Effect]) -> None:
        path = msg.path
        if self.name not in path:
            raise ProtocolError(f"{self.name}: lock {msg.xid} for a path it is not on")
        i = path.index(self.name)
        if i == 0 or path[i - 1] != peer:
            raise ProtocolError(
                f"{self.name}: lock {msg.xid} arrived from {peer}, not path[{i - 1}]"
            )
        problem = self._lock_problem(path, i, msg.xid)
        if problem is not None:
            out.append(SendToLink(peer, LockRefused(msg.xid, problem)))
            return
        self._lock_here(msg, i, out)
        if i == len(path) - 1:
            assert self._ex is not None
            self._on_granted(self._ex, out)  # the last lock grants: phase 1 starts here
        else:
            out.append(SendToLink(path[i + 1], msg))

    def _undo_lock(self, ex: Exchange, out: list[Effect]) -> None:
        """Leave an exchange that never started phase 1 (only an A end has changed anything)."""
        a = ex.a_peer
        if a is not None and a in self._frozen:
            del self._from_link[a]
            del self._advertised[a]
            self._frozen.discard(a)
            out.append(CloseLink(a))
        self._ex = None

    def _on_refused(self, ex: Exchange, msg: LockRefused, out: list[Effect]) -> None:
        if ex.granted:
            raise ProtocolError(f"{self.name}: lock of {ex.xid} refused after it was granted")
        self._undo_lock(ex, out)
        if ex.me == 0:
            self._retry_later(ex.xid, msg.reason, out)
        else:
            out.append(SendToLink(ex.path[ex.me - 1], msg))

    def _on_granted(self, ex: Exchange, out: list[Effect]) -> None:
        ex.granted = True
        if ex.is_r:
            r = ex.r_peer
            assert r is not None
            self._frozen.add(r)
            transfer = Transfer(ex.xid, tuple(sorted(self._from_link[r], key=RouteKey.sort_key)))
            self._to_peer(ex.a_end_of_my_side, transfer, out)
            self._to_peer(ex.a_end_of_my_side, Separator(ex.xid, ex.side), out)
        if ex.me > 0:
            out.append(SendToLink(ex.path[ex.me - 1], Granted(ex.xid)))

    def _from_peer(self, peer: str, msg: PeerMessage, out: list[Effect]) -> None:
        if isinstance(msg, RecMsg):  # the path algorithm's RECMSG across the new link
            path_algorithm.on_recmsg(self, peer, msg, out)
            return
        ex = self._ex
        if ex is None or ex.xid != msg.xid or not ex.is_a:
            if msg.xid in self._left:
                return  # late: we finished this exchange by lease
            raise ProtocolError(
                f"{self.name}: {type(msg).__name__} for exchange {msg.xid} it is not an A end of"
            )
        a = ex.a_peer
        assert a is not None
        out.append(StartTimer(f"lease:{ex.xid}", ex.lease))  # the exchange is alive: renew
        table = self._from_link[a]
        if isinstance(msg, Transfer):
            for key in msg.keys:
                self._apply_route_msg(table, a, Subscribe(key), out)
        elif isinstance(msg, Relay):
            self._apply_route_msg(table, a, msg.message, out)
        elif isinstance(msg, RelayEnd):
            ex.relay_end = True
            self._maybe_release_queue(ex, out)
        elif isinstance(msg, Separator):
            self._on_separator(ex, msg.side, out)
        else:  # pragma: no cover
            raise ProtocolError(f"unknown peer message {msg!r}")

    def _on_separator(self, ex: Exchange, side: int, out: list[Effect]) -> None:
        if side == ex.side:
            # Our side's separator walks down to our R end: everything the transfer changed
            # is in place above us, so notifications entering here may take the new link.
            ex.gray = True
            if ex.is_r:
                self._phase2(ex, out)
                if ex.ordering is Ordering.CAUSAL:
                    self._on_echo(ex, out)
                r = ex.r_peer
                assert r is not None
                out.append(SendToLink(r, Separator(ex.xid, side)))
                self._maybe_finish_r(ex, out)
            else:
                out.append(SendToLink(ex.down, Separator(ex.xid, side)))
            return
        # The other side's separator walks up to our A end: no black message from that side
        # follows it.
        ex.other_sep_seen = True
        if ex.is_r:
            self._to_peer(ex.a_end_of_my_side, RelayEnd(ex.xid), out)
        if ex.is_a:
            self._maybe_release_queue(ex, out)
        else:
            out.append(SendToLink(ex.up, Separator(ex.xid, side)))
        if ex.is_r:
            self._maybe_finish_r(ex, out)

    def _phase2(self, ex: Exchange, out: list[Effect]) -> None:
        """Drop the removed link's routing entries; the withdrawals travel up this side only."""
        r = ex.r_peer
        assert r is not None
        ex.phase2_done = True
        table = self._from_link[r]
        self._retired.add(r)
        for key in sorted(table, key=RouteKey.sort_key):
            table.remove(key)
            self._matcher.remove(key.filter, r)
            self._key_removed(key, r, out)

    def _close_removed_link(self, ex: Exchange, out: list[Effect]) -> None:
        r = ex.r_peer
        assert r is not None
        del self._from_link[r]
        del self._advertised[r]
        self._frozen.discard(r)
        self._retired.discard(r)
        out.append(CloseLink(r))

    def _maybe_finish_r(self, ex: Exchange, out: list[Effect]) -> None:
        if not (ex.phase2_done and ex.other_sep_seen):
            return
        self._close_removed_link(ex, out)
        if ex.is_a:
            self._on_end(ex, out)
        else:
            out.append(SendToLink(ex.up, End(ex.xid, ex.side)))
            self._release(out)

    def _on_end(self, ex: Exchange, out: list[Effect]) -> None:
        if not ex.is_a:
            out.append(SendToLink(ex.up, End(ex.xid, ex.side)))
            self._release(out)
            return
        ex.end_seen = True
        self._maybe_finish_a(ex, out)

    def _on_echo(self, ex: Exchange, out: list[Effect]) -> None:
        if ex.is_a:
            ex.echo_seen = True
            self._maybe_release_queue(ex, out)
        else:
            out.append(SendToLink(ex.up, Echo(ex.xid)))

    def _maybe_release_queue(self, ex: Exchange, out: list[Effect]) -> None:
        causal_ready = ex.echo_seen or ex.ordering is not Ordering.CAUSAL
        if ex.queue_released or not (ex.other_sep_seen and ex.relay_end and causal_ready):
            return
        ex.queue_released = True
        queued, ex.queue = ex.queue, []
        for queued_at, inp in queued:
            if isinstance(inp.message, Publish):
                self.ordering_delays.append(self._now - queued_at)
                by_xid = self.ordering_delays_by_exchange
                if ex.xid not in by_xid and len(by_xid) >= 64:
                    del by_xid[next(iter(by_xid))]
                by_xid.setdefault(ex.xid, []).append(self._now - queued_at)
            self._from_link_msg(inp, out)
            if self._ex is not ex:  # a queued Done finished the exchange
                break
        self._maybe_finish_a(ex, out)

    def _maybe_finish_a(self, ex: Exchange, out: list[Effect]) -> None:
        if self._ex is not ex or ex.own_done or not (ex.end_seen and ex.queue_released):
            return
        a = ex.a_peer
        assert a is not None
        # Unfreeze the added link: tell the other side exactly what this side advertises; it
        # holds the old advertisement (from its R end's transfer) and applies the difference.
        self._frozen.discard(a)
        held = [key for key in self._holders if self._held_except(key, a) > 0]
        want = maximal(held, self.mode)
        self._advertised[a] = want
        out.append(SendToLink(a, Done(ex.xid, tuple(sorted(want, key=RouteKey.sort_key)))))
        ex.own_done = True
        self._maybe_release_a(ex, out)

    def _maybe_release_a(self, ex: Exchange, out: list[Effect]) -> None:
        if ex.own_done and ex.peer_done:
            self._release(out)
