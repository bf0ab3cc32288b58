"""Indexed event matching.

Each distinct filter is filed under one *access constraint* — the one expected to be most
selective — in an index suited to its operator:

* ``=``: a hash table keyed by (attribute, kind, value): one lookup per event attribute;
* ``prefix`` / ``suffix``: hash tables keyed by the affix; an event value probes only the affix
  lengths that occur, so the cost is independent of the number of filters;
* ``<`` ``<=`` ``>`` ``>=``: sorted threshold arrays; one bisection yields the whole slice of
  filters whose bound the value satisfies;
* ``!=``, ``contains``, ``exists``: per-attribute lists, only consulted when the event carries the
  attribute.

Candidates found this way are then checked against their remaining constraints. Compared with the
counting algorithm this does less bookkeeping per event in Python (no per-constraint counters),
and compared with a scan it never looks at a filter whose access attribute is absent or whose
access value cannot match. :class:`ScanMatcher` is the same interface without an index, kept as the
oracle for tests and the baseline for the benchmark.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar, cast

from canopy_broker.core.events import Kind, Targets, Value, exact_kind
from canopy_broker.core.filters import RANGE_OPS, Constraint, Filter, Op, all_satisfied, as_dict
from canopy_broker.core.tables import ShardedDict

P = TypeVar("P", bound=Hashable)

# Lower rank = preferred access constraint.
_RANK = {
    Op.EQ: 0,
    Op.PREFIX: 1,
    Op.SUFFIX: 1,
    Op.LT: 2,
    Op.LE: 2,
    Op.GT: 2,
    Op.GE: 2,
    Op.CONTAINS: 3,
    Op.NE: 4,
    Op.EXISTS: 5,
}


_UNCHECKED = frozenset({Op.NE, Op.CONTAINS, Op.EXISTS})
"""Access operators filed by attribute only: the index does not check them for an event."""


def access_constraint(f: Filter) -> Constraint | None:
    """The constraint a filter is indexed under (None for the match-all filter)."""
    if not f.constraints:
        return None

    def rank(c: Constraint) -> tuple[int, int]:
        longer_affix_first = -len(c.value) if isinstance(c.value, str) else 0
        return (_RANK[c.op], longer_affix_first)

    return min(f.constraints, key=rank)


class _Sorted:
    """Thresholds kept sorted with their filters alongside (parallel arrays)."""

    __slots__ = ("filters", "values")

    def __init__(self) -> None:
        self.values: list[Value] = []
        self.filters: list[Filter] = []

    def add(self, value: Value, f: Filter) -> None:
        i = bisect_right(self.values, value)
        self.values.insert(i, value)
        self.filters.insert(i, f)

    def remove(self, value: Value, f: Filter) -> None:
        i = bisect_left(self.values, value)
        while self.filters[i] != f:
            i += 1
        del self.values[i]
        del self.filters[i]

    def satisfied_by(self, op: Op, value: Value) -> list[Filter]:
        """The filters whose threshold ``value`` satisfies under ``op``: one bisection."""
        if op is Op.GT:  # bound < value
            return self.filters[: bisect_left(self.values, value)]
        if op is Op.GE:  # bound <= value
            return self.filters[: bisect_right(self.values, value)]
        if op is Op.LT:  # bound > value
            return self.filters[bisect_right(self.values, value) :]
        return self.filters[bisect_left(self.values, value) :]  # LE: bound >= value


class _Bucket:
    """The filters filed under one equality (``symbol = "S"``), split by what is left of them.

    The commonest content-based filter is an equality and one range (``symbol = "S" and
    price < 10``). Those are kept sorted by their threshold, per (attribute, operator, kind)
    of the range, so an event's value finds all that match with one bisection and nothing
    more is checked of them; the other filters (``plain``) are candidates to check."""

    __slots__ = ("plain", "ranged", "size")

    def __init__(self) -> None:
        self.plain: list[Filter] = []
        # Made by the first ranged filter: most buckets have none, and an empty dict each
        # was a tenth of a filter's memory.
        self.ranged: dict[tuple[str, Op, Kind], _Sorted] | None = None
        self.size = 0

    def toggle(self, f: Filter, access: Constraint, add: bool) -> None:
        rest = f.others(access)
        c = rest[0] if len(rest) == 1 else None
        if c is None or c.op not in RANGE_OPS or c.kind is None or c.value is None:
            _toggle(self.plain, f, add)
        else:
            if self.ranged is None:
                self.ranged = {}
            _toggle_sorted(self.ranged, (c.attr, c.op, c.kind), c.value, f, add)
        self.size += 1 if add else -1

    def collect(self, attrs: dict[str, Value], matched: list[Filter], sure: list[Filter]) -> None:
        """Into ``matched`` the ranged filters the event satisfies; into ``sure`` the plain
        ones, whose other constraints are still to check."""
        if self.plain:
            sure.extend(self.plain)
        if not self.ranged:
            return
        for (attr, op, kind), arr in self.ranged.items():
            value = attrs.get(attr)
            if value is not None and exact_kind(value) is kind:
                matched.extend(arr.satisfied_by(op, value))


class IndexedMatcher(Generic[P]):
    """Maps filters to payloads (e.g. destinations) and finds the payloads an event matches."""

    def __init__(self) -> None:
        # The tables that grow with the filters are sharded (core/tables.py): no single
        # subscription pays for rehashing them all.
        # A filter's payloads with their counts; one payload held once is stored as itself
        # (most filters have one subscriber: a dict each was a tenth of a filter's memory).
        self._payloads: ShardedDict[Filter, P | dict[P, int]] = ShardedDict()
        self._always: list[Filter] = []
        self._eq: ShardedDict[tuple[str, Kind, Value], _Bucket | Filter] = ShardedDict()
        self._affix: ShardedDict[tuple[Op, str, str], list[Filter]] = ShardedDict()
        self._affix_lengths: dict[tuple[Op, str], dict[int, int]] = {}
        self._ranges: dict[tuple[Op, str, Kind], _Sorted] = {}
        self._by_attr: dict[str, list[Filter]] = {}
        self._range_keys_by_attr: dict[str, set[tuple[Op, str, Kind]]] = {}
        self._affix_keys_by_attr: dict[str, set[tuple[Op, str]]] = {}

    # -- maintenance -----------------------------------------------------------------------

    def add(self, f: Filter, payload: P) -> None:
        payloads = self._payloads.get(f)
        if payloads is None and f not in self._payloads:  # (a lone None payload is held)
            self._payloads[f] = payload
            self._index(f, add=True)
        elif isinstance(payloads, dict):
            payloads[payload] = payloads.get(payload, 0) + 1
        else:  # the one held stays the key, as a dict keeps its first key (1 then True: 1)
            held = cast(P, payloads)
            self._payloads[f] = {held: 2} if held == payload else {held: 1, payload: 1}

    def remove(self, f: Filter, payload: P) -> None:
        payloads = self._payloads[f]
        if not isinstance(payloads, dict):
            if payloads != payload:
                raise KeyError(payload)
            del self._payloads[f]
            self._index(f, add=False)
            return
        n = payloads[payload] - 1
        if n:
            payloads[payload] = n
        else:
            del payloads[payload]
        if len(payloads) == 1:
            ((lone, count),) = payloads.items()
            if count == 1:
                self._payloads[f] = lone

    def _index(self, f: Filter, *, add: bool) -> None:
        c = access_constraint(f)
        if c is None:
            _toggle(self._always, f, add)
            return
        if add and c.op not in _UNCHECKED:
            f.indexed_by(c)  # the index below only finds it for events that satisfy c
        kind = c.kind
        if c.op is Op.EQ:
            assert kind is not None and c.value is not None
            eq_key = (c.attr, kind, c.value)
            held = self._eq.get(eq_key)
            if isinstance(held, _Bucket):
                held.toggle(f, c, add)
                if not held.size:
                    del self._eq[eq_key]
            elif add and held is not None:  # a second one: a bucket for both (until empty)
                bucket = self._eq[eq_key] = _Bucket()
                bucket.toggle(held, c, True)  # filed under the same value: the same access
                bucket.toggle(f, c, True)
            elif add:
                # The first filter under a value is filed as itself: most values have one
                # filter, and a bucket with its list was a tenth of a filter's memory.
                self._eq[eq_key] = f
            elif held is not None and held == f:
                del self._eq[eq_key]
            else:
                raise ValueError(f"{f} is not filed under {eq_key!r}")
        elif c.op in (Op.PREFIX, Op.SUFFIX):
            assert isinstance(c.value, str)
            _toggle_in(self._affix, (c.op, c.attr, c.value), f, add)
            lengths = self._affix_lengths.setdefault((c.op, c.attr), {})
            n = lengths.get(len(c.value), 0) + (1 if add else -1)
            if n:
                lengths[len(c.value)] = n
            else:
                del lengths[len(c.value)]
            keys = self._affix_keys_by_attr.setdefault(c.attr, set())
            if lengths:
                keys.add((c.op, c.attr))
            else:
                keys.discard((c.op, c.attr))
        elif c.op in RANGE_OPS:
            assert kind is not None and c.value is not None
            key = (c.op, c.attr, kind)
            keys2 = self._range_keys_by_attr.setdefault(c.attr, set())
            if _toggle_sorted(self._ranges, key, c.value, f, add):
                keys2.add(key)
            else:
                keys2.discard(key)
        else:
            _toggle_in(self._by_attr, c.attr, f, add)

    # -- queries ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._payloads)

    def filters(self) -> Iterator[tuple[Filter, Mapping[P, int]]]:
        for f, payloads in self._payloads.items():
            yield f, payloads if isinstance(payloads, dict) else {payloads: 1}

    def payloads(self, f: Filter) -> Iterable[P]:
        """The payloads ``f`` is held for (each once)."""
        payloads = self._payloads[f]
        return payloads if isinstance(payloads, dict) else (payloads,)

    def candidates(self, attrs: Mapping[str, Value]) -> list[Filter]:
        """Filters the event may match: every filter it matches, and none that the index rules
        out (each filter at most once)."""
        matched: list[Filter] = []
        sure: list[Filter] = []
        unsure: list[Filter] = []
        self._collect(as_dict(attrs), matched, sure, unsure)
        return matched + sure + unsure

    def _collect(
        self,
        attrs: dict[str, Value],
        matched: list[Filter],
        sure: list[Filter],
        unsure: list[Filter],
    ) -> None:
        """Candidates in three lists: ``matched`` (the index checked all their constraints),
        ``sure`` (it checked the one they are filed under) and ``unsure`` (filed by attribute
        only: ``!=``, ``contains``, ``exists``).

        Lists, not a generator: compiled, extending a list costs a fraction of resuming a
        generator once per filter, and every caller reads all of it anyway."""
        matched.extend(self._always)
        eq = self._eq
        for attr, value in attrs.items():
            kind = exact_kind(value)  # as satisfied() compares: exact types only
            if kind is None:
                continue
            if eq:
                held = eq.get((attr, kind, value))
                if isinstance(held, _Bucket):
                    held.collect(attrs, matched, sure)
                elif held is not None:  # a lone filter: its other constraints are to check
                    sure.append(held)
            if kind is Kind.STRING and attr in self._affix_keys_by_attr:
                assert isinstance(value, str)
                self._affix_candidates(attr, value, sure)
            range_keys = self._range_keys_by_attr.get(attr)
            if range_keys:
                for key in range_keys:
                    if key[2] is kind:
                        sure.extend(self._ranges[key].satisfied_by(key[0], value))
            rest = self._by_attr.get(attr)
            if rest:
                unsure.extend(rest)

    def _affix_candidates(self, attr: str, value: str, out: list[Filter]) -> None:
        for op, _attr in self._affix_keys_by_attr[attr]:
            lengths = self._affix_lengths[(op, attr)]
            for n in lengths:
                if n > len(value):
                    continue
                affix = value[:n] if op is Op.PREFIX else value[len(value) - n :]
                hit = self._affix.get((op, attr, affix))
                if hit:
                    out.extend(hit)

    def match(self, attrs: Mapping[str, Value]) -> list[Filter]:
        """All stored filters matching the event: of the candidates the index found by a
        constraint it checked, only the other constraints are evaluated."""
        d = as_dict(attrs)
        out: list[Filter] = []
        sure: list[Filter] = []
        unsure: list[Filter] = []
        self._collect(d, out, sure, unsure)
        if sure:
            out.extend([f for f in sure if f.matches_rest(d)])
        if unsure:
            out.extend([f for f in unsure if all_satisfied(f.constraints, d)])
        return out

    def match_payloads(self, attrs: Mapping[str, Value]) -> set[P]:
        out: set[P] = set()
        for f in self.match(attrs):
            out.update(self.payloads(f))
        return out


Dest = str | tuple[str, str]
"""A routing table's matcher payload: a neighbour name, or a local subscription (client, sub_id)."""


ROUTE_CACHE_ITEMS = 65_536
"""What :class:`RouteMatcher` keeps of routing decisions, counted in filters, neighbours and
targets held (all dropped at once when full): bounded memory, and a drop that frees at most
this much in one go (a few MB at most, freed in about a millisecond), however many filters
events match."""
ROUTE_CACHE_LARGEST = 4_096
"""A decision over more filters, neighbours and targets than this is not kept: an event that
matches that many is rare, and costs more to route than a lookup saves."""

Route = tuple[tuple[str, ...], Targets]
"""Neighbours to forward to (sorted) and local targets (sorted by client)."""


class RouteMatcher(IndexedMatcher[Dest]):
    """The routing table's matcher: one event in, where it goes out.

    Routing an event is the hottest loop of a broker (every event, every matching subscription).
    Doing the whole of it here — match, drop the link it came from, group subscriptions per
    client, sort for a deterministic order — keeps it in the compiled module.

    And it is done once per *set of matched filters*, not per event: events that match the
    same filters (arriving from the same link) go to the same places, and in a running
    overlay most events repeat a few such sets. The decisions are cached by (source, matched
    filters) and the whole cache is dropped on any change to the table — exact, and cheap
    next to the subscribe or unsubscribe that caused it (its size is bounded by what the
    decisions hold, :data:`ROUTE_CACHE_ITEMS`, not by their count: subscribers choose the
    filters and publishers the values, so either could otherwise fill it with huge ones).
    """

    def __init__(self) -> None:
        super().__init__()
        self._routes: dict[tuple[str | Filter | None, ...], Route] = {}
        self._held = 0  # filters, neighbours and targets the cached decisions hold

    def add(self, f: Filter, payload: Dest) -> None:
        if self._routes:
            self._forget()
        super().add(f, payload)

    def remove(self, f: Filter, payload: Dest) -> None:
        if self._routes:
            self._forget()
        super().remove(f, payload)

    def _forget(self) -> None:
        self._routes.clear()
        self._held = 0

    def route(self, attrs: Mapping[str, Value], source: str | None) -> Route:
        """Where an event with ``attrs`` that came from ``source`` goes (see :data:`Route`)."""
        matched = self.match(attrs)
        if not matched:
            return (), ()
        frozen: tuple[str | Filter | None, ...] = ()
        if len(matched) <= ROUTE_CACHE_LARGEST:
            key: list[str | Filter | None] = [source]
            key.extend(matched)
            frozen = tuple(key)
            known = self._routes.get(frozen)
            if known is not None:
                return known
        peers: set[str] = set()
        local: dict[str, list[str]] = {}
        payloads = self._payloads
        for f in matched:
            held = payloads[f]
            dests: Iterable[Dest] = held if isinstance(held, dict) else (held,)
            for d in dests:
                if isinstance(d, str):
                    if d != source:
                        peers.add(d)
                else:
                    subs = local.get(d[0])
                    if subs is None:
                        local[d[0]] = [d[1]]
                    else:
                        subs.append(d[1])
        targets: list[tuple[str, tuple[str, ...]]] = []
        for client in sorted(local):
            subs = local[client]
            targets.append((client, (subs[0],) if len(subs) == 1 else tuple(sorted(subs))))
        found = (tuple(sorted(peers)), tuple(targets))
        size = len(frozen) + len(peers) + len(targets)
        if frozen and size <= ROUTE_CACHE_LARGEST:
            if self._held + size > ROUTE_CACHE_ITEMS:
                self._forget()
            self._routes[frozen] = found
            self._held += size
        return found


class ScanMatcher(Generic[P]):
    """Same interface, no index: test oracle and benchmark baseline."""

    def __init__(self) -> None:
        self._payloads: dict[Filter, dict[P, int]] = {}

    def add(self, f: Filter, payload: P) -> None:
        payloads = self._payloads.setdefault(f, {})
        payloads[payload] = payloads.get(payload, 0) + 1

    def remove(self, f: Filter, payload: P) -> None:
        payloads = self._payloads[f]
        payloads[payload] -= 1
        if not payloads[payload]:
            del payloads[payload]
        if not payloads:
            del self._payloads[f]

    def __len__(self) -> int:
        return len(self._payloads)

    def match(self, attrs: Mapping[str, Value]) -> list[Filter]:
        return [f for f in self._payloads if f.matches(attrs)]

    def match_payloads(self, attrs: Mapping[str, Value]) -> set[P]:
        out: set[P] = set()
        for f, payloads in self._payloads.items():
            if f.matches(attrs):
                out.update(payloads)
        return out


def _toggle_sorted(table: dict[_K, _Sorted], key: _K, value: Value, f: Filter, add: bool) -> bool:
    """Add ``f`` under threshold ``value`` to (or remove it from) ``table[key]``, which is
    created when needed and deleted once empty; whether it still holds any."""
    arr = table.get(key)
    if arr is None:
        arr = table[key] = _Sorted()
    if add:
        arr.add(value, f)
    else:
        arr.remove(value, f)
        if not arr.values:
            del table[key]
            return False
    return True


def _toggle(items: list[Filter], f: Filter, add: bool) -> None:
    if add:
        items.append(f)
    else:
        items.remove(f)


def _toggle_in(
    table: dict[_K, list[Filter]] | ShardedDict[_K, list[Filter]], key: _K, f: Filter, add: bool
) -> None:
    if add:
        items = table.get(key)
        if items is None:
            table[key] = [f]
        else:
            items.append(f)
        return
    items = table[key]
    items.remove(f)
    if not items:
        del table[key]


_K = TypeVar("_K", bound=Hashable)
