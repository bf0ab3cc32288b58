"""The indexed matcher agrees with a plain scan, including through removals."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from canopy_broker.core.filters import Constraint, Filter, Kind, Op
from canopy_broker.core.matching import (
    ROUTE_CACHE_ITEMS,
    ROUTE_CACHE_LARGEST,
    Dest,
    IndexedMatcher,
    RouteMatcher,
    ScanMatcher,
    access_constraint,
)
from tests.strategies import NUMBERS, events, filters


@given(
    st.lists(st.tuples(filters, st.sampled_from(["p", "q", "r"])), max_size=40),
    st.lists(st.integers(min_value=0, max_value=39), max_size=20),
    st.lists(events, min_size=1, max_size=20),
)
def test_indexed_equals_scan(
    entries: list[tuple[Filter, str]], removals: list[int], evs: list[dict[str, object]]
) -> None:
    indexed: IndexedMatcher[str] = IndexedMatcher()
    scan: ScanMatcher[str] = ScanMatcher()
    for f, p in entries:
        indexed.add(f, p)
        scan.add(f, p)
    live = list(entries)
    for i in removals:
        if i < len(live):
            f, p = live.pop(i)
            indexed.remove(f, p)
            scan.remove(f, p)
    assert len(indexed) == len(scan)
    for e in evs:
        assert sorted(map(str, indexed.match(e))) == sorted(map(str, scan.match(e)))  # type: ignore[arg-type]
        assert indexed.match_payloads(e) == scan.match_payloads(e)  # type: ignore[arg-type]


# Equality and one range (on another attribute or the same), the shape the index keeps sorted
# under its equality: generic random filters rarely share a bucket, these always do.
_eq_and_range = st.builds(
    lambda eq, attr, op, bound: Filter.of(
        [Constraint("a", Op.EQ, eq), Constraint(attr, op, bound)]
    ),
    st.sampled_from([0, 1, "x"]),
    st.sampled_from(["a", "b"]),
    st.sampled_from([Op.LT, Op.LE, Op.GT, Op.GE]),
    st.sampled_from([*NUMBERS, "a", "b"]),
)


_into_buckets = st.fixed_dictionaries(
    {"a": st.sampled_from([0, 1, "x"])}, optional={"b": st.sampled_from([*NUMBERS, "a", "b"])}
)


@given(
    st.lists(st.one_of(_eq_and_range, filters), max_size=40),
    st.lists(st.integers(min_value=0, max_value=39), max_size=20),
    st.lists(st.one_of(_into_buckets, events), min_size=1, max_size=20),
)
def test_equality_buckets_equal_scan(
    fs: list[Filter], removals: list[int], evs: list[dict[str, object]]
) -> None:
    test_indexed_equals_scan.hypothesis.inner_test(  # type: ignore[attr-defined]
        [(f, "p") for f in fs], removals, evs
    )


_DESTS = st.one_of(
    st.sampled_from(["n1", "n2", "n3"]),  # neighbours
    st.tuples(st.sampled_from(["c1", "c2", "c3"]), st.sampled_from(["s1", "s2", "s3"])),
)


@given(
    st.lists(st.tuples(filters, _DESTS), max_size=40),
    st.lists(st.integers(min_value=0, max_value=39), max_size=10),
    st.lists(events, min_size=1, max_size=20),
    st.sampled_from([None, "n1", "n2"]),
)
def test_routing_an_event_is_the_scan_split_by_destination(
    entries: list[tuple[Filter, Dest]],
    removals: list[int],
    evs: list[dict[str, object]],
    source: str | None,
) -> None:
    """What RouteMatcher.route computes in one pass (compiled, and cached per matched filter
    set) equals the obvious way: scan, drop the source, group each client's matching
    subscriptions, sort everything — before and after the table changes, asked once or twice."""
    route = RouteMatcher()
    scan: ScanMatcher[Dest] = ScanMatcher()
    live: list[tuple[Filter, Dest]] = []
    for f, d in entries:
        if not isinstance(d, str) and any(d == d2 for _, d2 in live):
            continue  # a subscription has one filter
        live.append((f, d))
        route.add(f, d)
        scan.add(f, d)

    def expected(e: dict[str, object]) -> tuple[tuple[str, ...], tuple[object, ...]]:
        dests = scan.match_payloads(e)  # type: ignore[arg-type]
        peers = tuple(sorted(d for d in dests if isinstance(d, str) and d != source))
        local: dict[str, list[str]] = {}
        for d in dests:
            if not isinstance(d, str):
                local.setdefault(d[0], []).append(d[1])
        return peers, tuple((c, tuple(sorted(subs))) for c, subs in sorted(local.items()))

    for e in evs * 2:  # the second time from the cache
        assert route.route(e, source) == expected(e)  # type: ignore[arg-type]
    for i in removals:
        if i < len(live):
            f, d = live.pop(i)
            route.remove(f, d)
            scan.remove(f, d)
            for e in evs:  # a change drops every cached decision it could affect
                assert route.route(e, source) == expected(e)  # type: ignore[arg-type]


_SHARED_FILTERS = [Filter.parse("x = 1"), Filter.parse("x = 1 and y > 2"), Filter.parse("y > 0")]


@given(
    st.lists(
        st.tuples(st.booleans(), st.sampled_from(range(3)), st.sampled_from(["p", "q", "r"])),
        max_size=40,
    )
)
def test_payloads_are_counted_through_every_shape(steps: list[tuple[bool, int, str]]) -> None:
    """A filter held for one payload once stores it alone, for more in a dict: through any
    sequence of adds and removes (the same payload twice, others, back to one), what an event
    matching every filter finds, and what ``filters()`` reports, are the counts held."""
    m: RouteMatcher = RouteMatcher()
    held: Counter[tuple[int, str]] = Counter()
    for add, i, p in steps:
        f = _SHARED_FILTERS[i]
        if add:
            m.add(f, p)
            held[i, p] += 1
        elif held[i, p]:
            m.remove(f, p)
            held[i, p] -= 1
        else:
            with pytest.raises(KeyError):
                m.remove(f, p)
            continue
        live = +held
        assert m.match_payloads({"x": 1, "y": 3}) == {p for _, p in live}
        assert {str(f): dict(ps) for f, ps in m.filters()} == {
            str(f): {p: n for (j, p), n in live.items() if j == i}
            for i, f in enumerate(_SHARED_FILTERS)
            if any(j == i for j, _ in live)
        }
        assert m.route({"x": 1, "y": 3}, None)[0] == tuple(sorted({p for _, p in live}))


def test_payloads_that_are_none_or_equal_across_types_are_kept_as_a_dict_keeps_them() -> None:
    """A payload held once is stored as itself: one that is None must not look like no
    entry, and of equal payloads (1 and True) the first stays, as a dict's key does."""
    f = Filter.parse("x = 1")
    m: IndexedMatcher[object] = IndexedMatcher()
    scan: ScanMatcher[object] = ScanMatcher()
    for p in (None, None, 1, True, 1.0):
        m.add(f, p)
        scan.add(f, p)
        assert m.match({"x": 1}) == [f]  # filed once, however many payloads
        assert m.match_payloads({"x": 1}) == scan.match_payloads({"x": 1})
    assert {type(p) for p in m.match_payloads({"x": 1})} == {type(None), int}
    for p in (None, True, None, 1):
        m.remove(f, p)
        scan.remove(f, p)
        assert m.match_payloads({"x": 1}) == scan.match_payloads({"x": 1})
    assert [type(p) for p in m.match_payloads({"x": 1})] == [int]
    m.remove(f, 1.0)
    assert m.match({"x": 1}) == [] and len(m) == 0
    m.add(f, 1)  # held once, alone; then an equal payload of another type
    m.add(f, True)
    assert [type(p) for p in m.match_payloads({"x": 1})] == [int]


def test_candidates_skip_filters_that_cannot_match() -> None:
    """The index is an index: an event only looks at filters its attributes can satisfy."""
    m: IndexedMatcher[int] = IndexedMatcher()
    for i in range(1000):
        m.add(Filter.parse(f'symbol = "S{i}" and price < {i}'), i)
    m.add(Filter.parse('name prefix "ab"'), -1)
    cands = list(m.candidates({"symbol": "S7", "price": 3, "name": "abc"}))
    assert len(cands) == 2
    assert m.match_payloads({"symbol": "S7", "price": 3, "name": "abc"}) == {7, -1}


def test_an_equality_with_one_range_is_found_by_bisection() -> None:
    """``symbol = S and price < P``, the commonest shape, is kept sorted by P under its
    equality: an event's candidates are exactly the filters it matches, none to check one by
    one, through removals and next to filters of other shapes in the same bucket."""
    m: IndexedMatcher[int] = IndexedMatcher()
    for i in range(1000):
        m.add(Filter.parse(f'symbol = "S" and price < {i}'), i)
    m.add(Filter.parse('symbol = "S" and price < 2000 and size > 5'), -1)  # two more: checked
    m.add(Filter.parse('symbol = "S" and price < "z"'), -2)  # a range over strings
    event = {"symbol": "S", "price": 500}
    assert len(m.candidates(event)) == 499 + 1  # price < 501 .. 999, and the checked one
    assert m.match_payloads(event) == set(range(501, 1000))
    for i in range(501, 1000, 2):
        m.remove(Filter.parse(f'symbol = "S" and price < {i}'), i)
    assert m.match_payloads(event) == set(range(502, 1000, 2))
    assert m.match_payloads({"symbol": "S", "price": "a"}) == {-2}
    assert m.match_payloads({"symbol": "S", "price": 1999, "size": 6}) == {-1}


def test_a_value_with_one_filter_files_it_without_a_bucket() -> None:
    """Most equality values have one filter (``k = <id>``): it is filed as itself, a second
    one under the value makes a bucket for both, and what is found is the same throughout."""
    m: IndexedMatcher[str] = IndexedMatcher()
    lone, ranged = Filter.parse("k = 1"), Filter.parse("k = 1 and j < 3")
    m.add(ranged, "q")
    assert m._eq.get(("k", Kind.NUMBER, 1)) is ranged
    assert m.match_payloads({"k": 1, "j": 2}) == {"q"}
    assert m.match_payloads({"k": 1, "j": 3}) == set()  # its range is checked all the same
    m.add(lone, "p")
    assert type(m._eq.get(("k", Kind.NUMBER, 1))).__name__ == "_Bucket"
    assert m.match_payloads({"k": 1, "j": 2}) == {"p", "q"}
    m.remove(ranged, "q")
    assert m.match_payloads({"k": 1, "j": 2}) == {"p"}
    m.remove(lone, "p")
    assert len(m._eq) == 0 and len(m) == 0
    m.add(lone, "p")
    m.remove(Filter.parse("k = 1"), "p")  # an equal filter, not the same object
    assert len(m._eq) == 0 and m.match_payloads({"k": 1}) == set()


def test_access_constraint_prefers_equality() -> None:
    f = Filter.parse('a exists and b != 2 and c < 3 and d = "x"')
    c = access_constraint(f)
    assert c is not None and c.attr == "d"
    assert access_constraint(Filter()) is None


def test_the_route_cache_is_bounded_by_what_its_decisions_hold() -> None:
    """Subscribers choose filters and publishers values: events that each match a different
    large set must not grow the cache past ROUTE_CACHE_ITEMS (1,024 such decisions once held
    over a GB), and a decision over more than ROUTE_CACHE_LARGEST is not kept at all."""
    m = RouteMatcher()
    fresh = RouteMatcher()
    for i in range(1500):
        for r in (m, fresh):
            r.add(Filter.parse(f"price < {i}"), (f"c{i}", "s"))
    for p in range(0, 1500, 5):  # 300 decisions of up to 3,000 items each
        assert m.route({"price": p}, None) == fresh.route({"price": p}, None)
        assert 0 < m._held <= ROUTE_CACHE_ITEMS
    held = sum(len(k) + len(v[0]) + len(v[1]) for k, v in m._routes.items())
    assert held == m._held
    big = RouteMatcher()
    for i in range(ROUTE_CACHE_LARGEST):
        big.add(Filter.parse(f"price < {i + 10}"), (f"c{i}", "s"))
    (peers, targets) = big.route({"price": 1}, None)
    assert len(targets) == ROUTE_CACHE_LARGEST and not peers
    assert big._held == 0 and not big._routes


class _Str(str):
    pass


class _Float(float):
    pass


def test_subclass_values_match_as_validation_makes_them_and_never_half_way() -> None:
    """Validation keeps a subclass value (a str subclass, numpy's floats, IntEnum) as its
    exact base type, so it matches like that type; a value that skipped validation matches
    nothing, in the index exactly as in a plain scan (the index once found such values by
    isinstance while the checks compared exact types)."""
    from canopy_broker.core.events import check_attributes  # noqa: PLC0415 - this test only

    filters = [
        Filter.parse('x = "a"'),
        Filter.parse('x = "a" and y < 5'),
        Filter.parse('x prefix "a"'),
        Filter.parse("y < 5"),
    ]
    indexed: IndexedMatcher[int] = IndexedMatcher()
    scan: ScanMatcher[int] = ScanMatcher()
    for i, f in enumerate(filters):
        indexed.add(f, i)
        scan.add(f, i)
    raw = {"x": _Str("a"), "y": _Float(3.0)}
    assert indexed.match_payloads(raw) == scan.match_payloads(raw) == set()  # type: ignore[arg-type]
    valid = check_attributes(raw)
    assert type(valid["x"]) is str and type(valid["y"]) is float
    assert indexed.match_payloads(valid) == scan.match_payloads(valid) == {0, 1, 2, 3}
