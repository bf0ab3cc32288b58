"""Routing state: what a broker holds from each source and what it advertises to each neighbour.

This module owns the subscription tables that every protocol edits — ordinary subscription
forwarding, the coordinated link exchange and the reconfiguration-path algorithm — behind one
public interface, so the protocols depend on the routing state and not on each other or on the
broker's insides.

Subscription forwarding is kept *canonical*: what a broker advertises to a neighbour N is a pure
function of the routing keys it holds from every other source (local subscriptions and the other
neighbours):

* simple / identity: the set of those keys;
* covering: the maximal ones under a strict *dominance* order (``g`` dominates ``h`` when ``g``
  covers ``h`` and either ``h`` does not cover ``g`` or ``g`` sorts first).

Because the advertised set depends only on the current state and never on arrival order, a
central checker can compute every broker's expected routing table from the tree and the
subscriptions alone, and a reconfiguration can be proven to leave no stale or missing entry.

**Cost.** The set is maintained incrementally, and every covering question ("is this key
dominated by something already advertised?", "which advertised keys does it make obsolete?",
"what did a withdrawn key cover?") goes through a :class:`CoverIndex`, which narrows the
candidates by the necessary conditions of :func:`~canopy_broker.core.filters.cover_profile`
before the exact test runs. For filters that fix some attribute to a value (``topic = "x"``,
``k = 17``) a question touches only the keys sharing that value, so inserting or removing a
subscription costs the same at 1,000 or 100,000 subscriptions; filters that fix nothing (pure
ranges on one attribute) share a per-attribute bucket, and cost grows with that bucket.

**Freezing.** A *frozen* neighbour gets no advertisement while the reconfiguration protocols
rewrite tables around it; they reconcile it explicitly when they unfreeze it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from canopy_broker.core.errors import ProtocolError
from canopy_broker.core.events import Value
from canopy_broker.core.filters import Filter, Slot, cover_profile, covers
from canopy_broker.core.matching import Dest, Route, RouteMatcher
from canopy_broker.core.messages import (
    Effect,
    RouteKey,
    RoutingMode,
    SendToLink,
    Subscribe,
    Unsubscribe,
)
from canopy_broker.core.tables import SPLIT_AT, ShardedDict, ShardedSet

__all__ = [
    "CoverIndex",
    "Dest",
    "RoutingState",
    "RoutingTable",
    "client_key",
    "dominates",
    "maximal",
]


def dominates(g: RouteKey, h: RouteKey) -> bool:
    """Strict order used by covering routing: ``g`` makes advertising ``h`` unnecessary."""
    if g == h or not covers(g.filter, h.filter):
        return False
    return not covers(h.filter, g.filter) or g.sort_key() < h.sort_key()


def _sorted(keys: Iterable[RouteKey]) -> list[RouteKey]:
    return sorted(keys, key=RouteKey.sort_key)


def maximal(keys: Iterable[RouteKey], mode: RoutingMode) -> set[RouteKey]:
    """The keys a broker advertises given the keys it holds from other sources."""
    unique = list(dict.fromkeys(keys))
    if mode is not RoutingMode.COVERING:
        return set(unique)
    index = CoverIndex(unique)
    return {h for h in unique if not index.dominated(h)}


def client_key(mode: RoutingMode, client: str, sub_id: str, f: Filter) -> RouteKey:
    """Routing key of a local subscription: tagged with its global id only in simple routing."""
    return RouteKey(f, f"{client}/{sub_id}" if mode is RoutingMode.SIMPLE else "")


# --------------------------------------------------------------------------- the covering index

_EMPTY: frozenset[RouteKey] = frozenset()
# A bucket holding one key is that key: most buckets do (a pin's value is usually one filter's
# alone), and a set per key cost 216 bytes each, a third of a filter's memory in the tables.
_Bucket = RouteKey | set[RouteKey] | ShardedSet[RouteKey]


def _keys_of(bucket: _Bucket) -> Collection[RouteKey]:
    return (bucket,) if isinstance(bucket, RouteKey) else bucket


class CoverIndex:
    """A set of routing keys that answers covering questions without a scan.

    ``coverers(h)`` yields every key that may cover ``h`` and ``covered(g)`` every key ``g`` may
    cover (supersets: callers confirm with :func:`dominates`). Each key sits in a few buckets
    (slots): one *cover* slot (its anchor) for the first question, and one slot per pin and per
    attribute for the second. Unindexed (``indexed=False``) it is a plain set, for the routing
    modes that never ask.
    """

    __slots__ = ("_buckets", "_indexed", "_keys", "_unsat")

    def __init__(self, keys: Iterable[RouteKey] = (), *, indexed: bool = True) -> None:
        self._keys: ShardedSet[RouteKey] = ShardedSet()
        self._indexed = indexed
        # Most buckets hold a key or two; the few that grow large become sharded.
        self._buckets: ShardedDict[Slot, _Bucket] = ShardedDict()
        self._unsat: set[RouteKey] = set()
        for key in keys:
            self.add(key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[RouteKey]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def keys(self) -> Collection[RouteKey]:
        return self._keys

    def add(self, key: RouteKey) -> None:
        if self._keys.add(key) and self._indexed:
            self._file(key, add=True)

    def discard(self, key: RouteKey) -> None:
        if self._keys.discard(key) and self._indexed:
            self._file(key, add=False)

    def _file(self, key: RouteKey, *, add: bool) -> None:
        p = cover_profile(key.filter)
        if not p.satisfiable:
            (self._unsat.add if add else self._unsat.discard)(key)
        buckets = self._buckets
        for slot in p.filed:
            bucket = buckets.get(slot)
            if add:
                if bucket is None:
                    buckets[slot] = key
                elif isinstance(bucket, RouteKey):
                    buckets[slot] = {bucket, key}
                else:
                    bucket.add(key)
                    if type(bucket) is set and len(bucket) > SPLIT_AT:
                        buckets[slot] = ShardedSet(bucket)
            elif isinstance(bucket, RouteKey):
                # Its one key: _file runs only for a key the index held, and a key's slots
                # are distinct, so the lone key here is this one.
                assert bucket is key or bucket == key, (bucket, key)
                del buckets[slot]
            elif bucket is not None:
                bucket.discard(key)
                if not bucket:
                    del buckets[slot]
                elif type(bucket) is set and len(bucket) == 1:  # (a ShardedSet's len is a sum)
                    buckets[slot] = next(iter(bucket))

    def coverers(self, h: RouteKey) -> Iterable[RouteKey]:
        """Keys that may cover ``h``."""
        if not self._indexed:
            return self._keys
        p = cover_profile(h.filter)
        if not p.satisfiable:
            return self._keys  # everything covers an unsatisfiable filter
        get = self._buckets.get
        found: list[RouteKey] = []
        for slot in p.probe:
            bucket = get(slot)
            if bucket is None:
                continue
            if isinstance(bucket, RouteKey):
                found.append(bucket)
            else:
                found.extend(bucket)
        return found

    def covered(self, g: RouteKey) -> Iterable[RouteKey]:
        """Keys that ``g`` may cover: those sharing all its pins and attributes, and every
        unsatisfiable one."""
        if not self._indexed:
            return self._keys
        p = cover_profile(g.filter)
        if not p.narrow:
            return self._keys  # the match-all filter covers everything
        get = self._buckets.get
        smallest = min(
            (_EMPTY if (b := get(s)) is None else _keys_of(b) for s in p.narrow), key=len
        )
        return [*smallest, *self._unsat] if self._unsat else smallest

    def dominated(self, h: RouteKey) -> bool:
        """Whether some key here dominates ``h``."""
        return any(dominates(g, h) for g in self.coverers(h))


# --------------------------------------------------------------------------- snapshots


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
            return [str(k) for k in _sorted(ks)]

        return {
            "links": {p: keys(ks) for p, ks in sorted(self.links.items())},
            "advertised": {p: keys(ks) for p, ks in sorted(self.advertised.items())},
            "clients": {
                c: {s: str(f) for s, f in sorted(subs.items())}
                for c, subs in sorted(self.clients.items())
            },
        }


# --------------------------------------------------------------------------- the state


class RoutingState:
    """Subscription tables of one broker, with the canonical forwarding rule built in.

    Every method that changes a table appends the advertisements the change causes to ``out``
    (as :class:`SendToLink` effects) in a deterministic order. Methods that can refuse an input
    check it first and raise :class:`ProtocolError` with nothing changed.
    """

    def __init__(self, mode: RoutingMode = RoutingMode.COVERING) -> None:
        self.mode = mode
        self._covering = mode is RoutingMode.COVERING
        # The tables that grow with the subscriptions are sharded (core/tables.py) so that no
        # single update pays for rehashing all of them.
        # Keys held from each neighbour, each mapped to itself: a withdrawal arrives as an equal
        # but new object, and the stored one is what the rest of the state uses (its filter
        # carries the memoised cover profile; lookups then hit on identity).
        self._from: dict[str, ShardedDict[RouteKey, RouteKey]] = {}
        self._adv: dict[str, CoverIndex] = {}
        self._clients: ShardedDict[str, dict[str, Filter]] = ShardedDict()
        # How many sources (neighbours, local subscriptions) hold each key, and those keys
        # indexed for the covering questions.
        self._holders: ShardedDict[RouteKey, int] = ShardedDict()
        self._held = CoverIndex(indexed=self._covering)
        self._matcher = RouteMatcher()
        self._frozen: set[str] = set()

    # ------------------------------------------------------------------ queries

    @property
    def neighbours(self) -> list[str]:
        return sorted(self._from)

    def has_link(self, peer: str) -> bool:
        return peer in self._from

    def is_frozen(self, peer: str) -> bool:
        return peer in self._frozen

    def held_from(self, peer: str) -> Collection[RouteKey]:
        """The keys received from neighbour ``peer`` (read-only view)."""
        return self._from[peer]

    def advertised_to(self, peer: str) -> Collection[RouteKey]:
        return self._adv[peer].keys

    @property
    def clients(self) -> list[str]:
        return sorted(self._clients)

    def subscriptions(self, client: str) -> Mapping[str, Filter] | None:
        return self._clients.get(client)

    def route(self, attrs: Mapping[str, Value], source: str | None) -> Route:
        """Where an event with ``attrs`` goes: neighbours (sorted, not ``source``) and local
        (client, subscription ids) targets, sorted by client."""
        return self._matcher.route(attrs, source)

    def snapshot(self) -> RoutingTable:
        return RoutingTable(
            links={p: frozenset(ks) for p, ks in self._from.items()},
            clients={c: dict(subs) for c, subs in self._clients.items()},
            advertised={p: frozenset(ks) for p, ks in self._adv.items()},
        )

    def size(self) -> int:
        return sum(map(len, self._from.values())) + sum(map(len, self._clients.values()))

    def wanted_by(self, peer: str) -> set[RouteKey]:
        """What this broker must advertise to ``peer``: the maximal keys held from elsewhere."""
        held = [k for k in self._holders if self._held_except(k, peer) > 0]
        if not self._covering:
            return set(held)
        return {
            h
            for h in held
            if not any(
                self._held_except(g, peer) > 0 and dominates(g, h) for g in self._held.coverers(h)
            )
        }

    # ------------------------------------------------------------------ links

    def add_link(self, peer: str, out: list[Effect]) -> None:
        """A new ordinary link: advertise everything this broker holds."""
        if peer in self._from:
            raise ProtocolError(f"link to {peer!r} exists already")
        adv = maximal(self._holders, self.mode)
        self._from[peer] = ShardedDict()
        self._adv[peer] = CoverIndex(adv, indexed=self._covering)
        out.extend(SendToLink(peer, Subscribe(key)) for key in _sorted(adv))

    def open_frozen(self, peer: str, believed: Iterable[RouteKey] = ()) -> None:
        """A new link held back by a reconfiguration: nothing is advertised over it until it is
        reconciled; ``believed`` is what the other end already thinks it has from us."""
        if peer in self._from:
            raise ProtocolError(f"link to {peer!r} exists already")
        self._from[peer] = ShardedDict()
        self._adv[peer] = CoverIndex(believed, indexed=self._covering)
        self._frozen.add(peer)

    def remove_link(self, peer: str, out: list[Effect]) -> None:
        """The link is gone: whatever it still held is withdrawn the ordinary way."""
        table = self._from.get(peer)
        if table is None:
            raise ProtocolError(f"no link to {peer!r}")
        del self._adv[peer]
        del self._from[peer]
        self._frozen.discard(peer)
        for key in _sorted(table):
            self._matcher.remove(key.filter, peer)
            self._key_removed(key, None, out)

    def freeze(self, peer: str) -> None:
        self._frozen.add(peer)

    @contextmanager
    def held_back(self, *peers: str) -> Iterator[None]:
        """Rewrite tables without advertising to ``peers``; their frozen state is restored after."""
        was = {p for p in peers if p in self._frozen}
        self._frozen.update(peers)
        try:
            yield
        finally:
            self._frozen -= set(peers) - was

    def set_advertised(self, peer: str, keys: Iterable[RouteKey]) -> None:
        """Record what ``peer`` now holds from us (the protocol told it another way)."""
        self._adv[peer] = CoverIndex(keys, indexed=self._covering)

    def unfreeze(self, peer: str) -> set[RouteKey]:
        """Unfreeze ``peer`` and record the canonical advertisement as sent; the caller tells the
        peer (the exchange's Done carries the whole set). Returns that set."""
        self._frozen.discard(peer)
        want = self.wanted_by(peer)
        self.set_advertised(peer, want)
        return want

    def reconcile(self, peer: str, out: list[Effect]) -> None:
        """Unfreeze ``peer`` and advertise exactly the difference to what it holds from us."""
        have = set(self._adv[peer])
        want = self.unfreeze(peer)
        out.extend(SendToLink(peer, Subscribe(key)) for key in _sorted(want - have))
        out.extend(SendToLink(peer, Unsubscribe(key)) for key in _sorted(have - want))

    # ------------------------------------------------------------------ route updates

    def check(self, peer: str, msg: Subscribe | Unsubscribe) -> None:
        """Raise unless ``msg`` from ``peer`` can be applied."""
        table = self._from.get(peer)
        if table is None:
            raise ProtocolError(f"route update from {peer!r}, which is not a neighbour")
        if isinstance(msg, Subscribe) and msg.key in table:
            raise ProtocolError(f"{peer!r} subscribed twice to {msg.key}")
        if isinstance(msg, Unsubscribe) and msg.key not in table:
            raise ProtocolError(f"{peer!r} unsubscribed {msg.key} it never subscribed")

    def apply(self, peer: str, msg: Subscribe | Unsubscribe, out: list[Effect]) -> None:
        """A neighbour's (un)subscription."""
        self.check(peer, msg)
        table = self._from[peer]
        key = msg.key
        if isinstance(msg, Subscribe):
            table[key] = key
            self._matcher.add(key.filter, peer)
            self._key_added(key, peer, out)
        else:
            key = table.pop(key)
            self._matcher.remove(key.filter, peer)
            self._key_removed(key, peer, out)

    def learn(self, peer: str, keys: Iterable[RouteKey], out: list[Effect]) -> None:
        """Add keys to what ``peer`` holds, skipping those it already has."""
        table = self._from[peer]
        for key in _sorted({k for k in keys if k not in table}):
            self.apply(peer, Subscribe(key), out)

    def forget(self, peer: str, keys: Iterable[RouteKey], out: list[Effect]) -> None:
        """Drop keys from what ``peer`` holds; ``peer`` itself is not told (it knows)."""
        table = self._from[peer]
        for key in _sorted({table[k] for k in keys if k in table}):
            table.pop(key)
            self._matcher.remove(key.filter, peer)
            self._key_removed(key, peer, out)

    def sync_from(self, peer: str, keys: Iterable[RouteKey], out: list[Effect]) -> None:
        """Make what ``peer`` holds exactly ``keys`` (the exchange's Done)."""
        want = set(keys)
        table = self._from[peer]
        self.learn(peer, want, out)
        for key in _sorted([k for k in table if k not in want]):
            self.apply(peer, Unsubscribe(key), out)

    # ------------------------------------------------------------------ local clients

    def has_client(self, client: str) -> bool:
        return client in self._clients

    def attach(self, client: str) -> None:
        if client in self._clients:
            raise ProtocolError(f"client {client!r} is already attached")
        self._clients[client] = {}

    def _subs(self, client: str) -> dict[str, Filter]:
        subs = self._clients.get(client)
        if subs is None:
            raise ProtocolError(f"client {client!r} is not attached")
        return subs

    def check_client(self, client: str) -> None:
        self._subs(client)

    def subscribe(self, client: str, sub_id: str, f: Filter, out: list[Effect]) -> None:
        subs = self._subs(client)
        if sub_id in subs:
            raise ProtocolError(f"client {client!r} already has subscription {sub_id!r}")
        subs[sub_id] = f
        self._matcher.add(f, (client, sub_id))
        self._key_added(client_key(self.mode, client, sub_id, f), None, out)

    def unsubscribe(self, client: str, sub_id: str, out: list[Effect]) -> None:
        subs = self._subs(client)
        if sub_id not in subs:
            raise ProtocolError(f"client {client!r} has no subscription {sub_id!r}")
        f = subs.pop(sub_id)
        self._matcher.remove(f, (client, sub_id))
        self._key_removed(client_key(self.mode, client, sub_id, f), None, out)

    def detach(self, client: str, out: list[Effect]) -> None:
        subs = self._subs(client)
        for sub_id in list(subs):
            self.unsubscribe(client, sub_id, out)
        del self._clients[client]

    # ------------------------------------------------------------------ the forwarding rule

    def _held_except(self, key: RouteKey, peer: str) -> int:
        """How many sources other than neighbour ``peer`` hold ``key``."""
        return self._holders.get(key, 0) - (key in self._from[peer])

    def _key_added(self, key: RouteKey, source: str | None, out: list[Effect]) -> None:
        n = self._holders.get(key, 0)
        self._holders[key] = n + 1
        if not n:
            self._held.add(key)
        for peer in self._from:
            if peer != source and peer not in self._frozen and self._held_except(key, peer) == 1:
                self._key_entered(peer, key, out)

    def _key_removed(self, key: RouteKey, source: str | None, out: list[Effect]) -> None:
        n = self._holders[key] - 1
        if n:
            self._holders[key] = n
        else:
            del self._holders[key]
            self._held.discard(key)
        for peer in self._from:
            if peer != source and peer not in self._frozen and self._held_except(key, peer) == 0:
                self._key_left(peer, key, out)

    def _key_entered(self, peer: str, key: RouteKey, out: list[Effect]) -> None:
        """``key`` became available for ``peer``: advertise it unless something dominates it."""
        adv = self._adv[peer]
        if self._covering:
            if adv.dominated(key):
                return
            obsolete = _sorted(h for h in adv.covered(key) if dominates(key, h))
            adv.add(key)
            out.append(SendToLink(peer, Subscribe(key)))
            for h in obsolete:
                adv.discard(h)
                out.append(SendToLink(peer, Unsubscribe(h)))
            return
        adv.add(key)
        out.append(SendToLink(peer, Subscribe(key)))

    def _key_left(self, peer: str, key: RouteKey, out: list[Effect]) -> None:
        """``key`` is no longer held for ``peer``: withdraw it and re-advertise what it covered."""
        adv = self._adv[peer]
        if key not in adv:
            return
        adv.discard(key)
        if self._covering:
            uncovered = [
                h
                for h in self._held.covered(key)
                if h != key
                and h not in adv
                and self._held_except(h, peer) > 0
                and dominates(key, h)
                and not adv.dominated(h)
            ]
            for h in _sorted(maximal(uncovered, self.mode)):
                adv.add(h)
                out.append(SendToLink(peer, Subscribe(h)))
        out.append(SendToLink(peer, Unsubscribe(key)))
