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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from canopy_broker.core.events import Event
from canopy_broker.core.filters import Filter, covers
from canopy_broker.core.matching import IndexedMatcher
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
    RouteKey,
    RoutingMode,
    SendToLink,
    Subscribe,
    Unsubscribe,
)


class ProtocolError(Exception):
    """An input the core cannot accept in its current state (the state is left unchanged)."""


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

    # ------------------------------------------------------------------ queries

    @property
    def neighbours(self) -> list[str]:
        return sorted(self._from_link)

    def is_neighbour(self, peer: str) -> bool:
        return peer in self._from_link

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
        if isinstance(inp, FromLink):
            self._from_link_msg(inp, out)
        elif isinstance(inp, ClientPublish):
            self._check_client(inp.client)
            if inp.event.publisher != inp.client:
                raise ProtocolError(
                    f"client {inp.client!r} published as {inp.event.publisher!r}; "
                    "a client publishes under its own id"
                )
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
        elif isinstance(inp, AddLink):
            self._add_link(inp.peer, out)
        elif isinstance(inp, RemoveLink):
            self._remove_link(inp.peer, out)
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
        if isinstance(msg, Publish):
            self._route(msg.event, inp.peer, out)
        elif isinstance(msg, Subscribe):
            if msg.key in table:
                raise ProtocolError(f"{inp.peer!r} subscribed twice to {msg.key}")
            table.add(msg.key)
            self._matcher.add(msg.key.filter, inp.peer)
            self._key_added(msg.key, inp.peer, out)
        elif isinstance(msg, Unsubscribe):
            if msg.key not in table:
                raise ProtocolError(f"{inp.peer!r} unsubscribed {msg.key} it never subscribed")
            table.remove(msg.key)
            self._matcher.remove(msg.key.filter, inp.peer)
            self._key_removed(msg.key, inp.peer, out)
        else:  # pragma: no cover
            raise ProtocolError(f"unknown link message {msg!r}")

    # ------------------------------------------------------------------ events

    def _route(self, event: Event, source: str | None, out: list[Effect]) -> None:
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
            copy = Publish(event.forwarded())
            for peer in sorted(peers):
                out.append(SendToLink(peer, copy))
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
        del self._advertised[peer]
        del self._from_link[peer]
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
            if peer != source and self._held_except(key, peer) == 1:
                self._key_entered(peer, key, out)

    def _key_removed(self, key: RouteKey, source: str | None, out: list[Effect]) -> None:
        n = self._holders[key] - 1
        if n:
            self._holders[key] = n
        else:
            del self._holders[key]
        for peer in self._from_link:
            if peer != source and self._held_except(key, peer) == 0:
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
