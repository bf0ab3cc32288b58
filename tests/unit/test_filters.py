"""Filters: the text syntax, matching semantics, and covering (sound and transitive)."""

from __future__ import annotations

import contextlib
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canopy_broker.core import filters as module
from canopy_broker.core.events import event_sampled, is_sampled
from canopy_broker.core.filters import MATCH_ALL, Constraint, Filter, FilterError, Op, covers
from tests.strategies import ATTRS, NUMBERS, STRINGS, all_events, events, filters

UNIVERSE = all_events()


def test_parse_all_operators_and_roundtrip() -> None:
    text = (
        'symbol = "ACME" and price < 10 and price >= 2.5 and venue != "X" and flag = true '
        'and name prefix "ab" and name suffix "yz" and name contains "m" and tag exists '
        "and qty <= 100 and qty > -3"
    )
    f = Filter.parse(text)
    assert len(f.constraints) == 11
    assert Filter.parse(str(f)) == f
    assert Filter.parse("true") is MATCH_ALL
    assert Filter.parse("*") == MATCH_ALL
    assert Filter.parse("x == 'it''s'".replace("''", "\\'")).constraints[0].value == "it's"


def test_constraint_order_and_duplicates_do_not_matter() -> None:
    assert Filter.parse("a = 1 and b = 2") == Filter.parse("b = 2 and a = 1 and a = 1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty filter"),
        ("price <", "expected a value"),
        ("price ~ 3", "unexpected character '~' at column 7"),
        ("and x = 1", "expected an attribute name at column 1"),
        ("x = 1 or y = 2", "expected 'and' at column 7"),
        ("x prefix 3", "'prefix' on 'x' needs a string value"),
        ("x < true", "cannot compare booleans"),
        ("x = ", "expected a value"),
        ("x exists 3", "expected 'and' at column 10"),
        ('x = "open', "unexpected character"),
        ("x = 1e999", "too large"),
    ],
)
def test_parse_errors_say_what_and_where(text: str, message: str) -> None:
    with pytest.raises(FilterError, match=message.replace("(", r"\(")):
        Filter.parse(text)


def test_kinds_never_mix() -> None:
    assert not Filter.parse("x < 10").matches({"x": "5"})
    assert not Filter.parse("x = 1").matches({"x": True})
    assert not Filter.parse("x = true").matches({"x": 1})
    assert Filter.parse("x = 1").matches({"x": 1.0})
    assert Filter.parse("x exists").matches({"x": False})
    assert not Filter.parse("x != 1").matches({})


def _reference(c: Constraint, attrs: dict[str, object]) -> bool:
    """The filter semantics written out plainly, independent of the compiled dispatch in
    ``satisfied``: absent never matches; a value of another kind never matches (bool is not
    a number); otherwise compare as Python does."""
    if c.attr not in attrs:
        return False
    v = attrs[c.attr]
    if c.op is Op.EXISTS:
        return True
    kind = {bool: "bool", int: "number", float: "number", str: "string"}[type(v)]
    if kind != c.kind.value:  # type: ignore[union-attr]
        return False
    x, y = cast(Any, v), cast(Any, c.value)
    return {
        Op.EQ: lambda: x == y,
        Op.NE: lambda: x != y,
        Op.LT: lambda: x < y,
        Op.LE: lambda: x <= y,
        Op.GT: lambda: x > y,
        Op.GE: lambda: x >= y,
        Op.PREFIX: lambda: x.startswith(y),
        Op.SUFFIX: lambda: x.endswith(y),
        Op.CONTAINS: lambda: y in x,
    }[c.op]()


@given(filters, events)
def test_matching_agrees_with_the_plain_semantics(f: Filter, e: dict[str, object]) -> None:
    """``matches`` (and ``matches_rest`` past any constraint the event satisfies, which is
    what an index guarantees) answer as the plain reference does, for every operator and
    kind; the scan matcher, the oracle of the indexed one, is built on ``matches``."""
    expected = all(_reference(c, e) for c in f.constraints)
    assert f.matches(e) == expected  # type: ignore[arg-type]
    for c in f.constraints:
        g = Filter.of(f.constraints)  # a fresh object: the memo is per filter object
        g.indexed_by(c)
        if _reference(c, e):
            assert g.matches_rest(e) == expected  # type: ignore[arg-type]


def test_the_reference_semantics_can_fail() -> None:
    """The reference is not vacuous: it tells matching from non-matching events."""
    f = Filter.parse('x < 3 and y prefix "ab"')
    assert all(_reference(c, {"x": 1, "y": "abc"}) for c in f.constraints)
    assert not all(_reference(c, {"x": 1, "y": "b"}) for c in f.constraints)
    assert not _reference(Constraint("x", Op.EQ, 1), {"x": True})


def test_covering_examples() -> None:
    def c(a: str, b: str) -> bool:
        return covers(Filter.parse(a), Filter.parse(b))

    assert c("price < 20", 'price < 10 and symbol = "A"')
    assert not c('price < 10 and symbol = "A"', "price < 20")
    assert c("x > 1", "x >= 2")
    assert not c("x > 1", "x >= 1")
    assert c("x != 5", "x > 5")
    assert c("x != 5", "x >= 5 and x != 5")
    assert c("x = 3", "x >= 3 and x <= 3")
    assert c('s prefix "a"', 's prefix "ab"')
    assert c('s contains "b"', 's suffix "ab"')
    assert c('s != "zz"', 's prefix "a"')
    assert c('s < "b"', 's = "abc"')
    assert c("x exists", "x < 3")
    assert not c("x exists", "y < 3")
    assert c("true", "x = 1")
    assert c("y = 1", "x = 1 and x = 2")  # nothing matches the covered filter
    assert c("x = true", "x != false")


@given(filters, filters)
@settings(max_examples=600)
def test_covering_is_sound(f1: Filter, f2: Filter) -> None:
    """If covers() says so, no event of the universe matches f2 but not f1."""
    if covers(f1, f2):
        for e in UNIVERSE:
            assert not (f2.matches(e) and not f1.matches(e)), (str(f1), str(f2), e)  # type: ignore[arg-type]


@given(filters, filters, filters)
@settings(max_examples=600)
def test_covering_is_transitive(f1: Filter, f2: Filter, f3: Filter) -> None:
    """Covering routing keeps only maximal filters; that is only safe for a transitive relation."""
    if covers(f1, f2) and covers(f2, f3):
        assert covers(f1, f3), (str(f1), str(f2), str(f3))


@given(filters)
def test_covering_is_reflexive_and_text_roundtrips(f: Filter) -> None:
    assert covers(f, f)
    assert Filter.parse(str(f)) == f


def test_covering_is_exact_for_single_constraints() -> None:
    """For every pair of single constraints over the pools, covers() == semantic inclusion."""
    singles = [Constraint("a", Op.EXISTS)]
    for op in (Op.EQ, Op.NE, Op.LT, Op.LE, Op.GT, Op.GE):
        singles += [Constraint("a", op, v) for v in [*NUMBERS, *STRINGS]]
    for op in (Op.PREFIX, Op.SUFFIX, Op.CONTAINS):
        singles += [Constraint("a", op, v) for v in STRINGS if v]
    singles += [Constraint("a", op, v) for op in (Op.EQ, Op.NE) for v in (True, False)]
    assert ATTRS[0] == "a"
    universe = [e for e in UNIVERSE if set(e) <= {"a"}]
    inexact = []
    for c1 in singles:
        for c2 in singles:
            f1, f2 = Filter.of([c1]), Filter.of([c2])
            semantic = all(f1.matches(e) or not f2.matches(e) for e in universe)  # type: ignore[arg-type]
            if covers(f1, f2) != semantic:
                inexact.append((str(c1), str(c2), semantic))
    # The universe's string pool is finite, so semantic inclusion can hold "by accident" for
    # range/affix pairs (no pool string lies between two bounds); those are the only allowed
    # misses, and a claimed cover is never wrong (soundness above).
    assert all(semantic for *_, semantic in inexact)
    assert not [p for p in inexact if not p[0].startswith("a ") or " exists" in p[0]]


@given(st.text(max_size=30))
def test_parser_never_crashes_on_garbage(text: str) -> None:
    with contextlib.suppress(FilterError):
        Filter.parse(text)


def test_booleans_are_not_numbers_in_identity() -> None:
    assert Filter.parse("a = true") != Filter.parse("a = 1")
    assert not covers(Filter.parse("a = true"), Filter.parse("a = 1"))
    assert len(Filter.parse("a = true and a = 1").constraints) == 2


@given(
    st.text(max_size=12),
    st.integers(min_value=1, max_value=2**40),
    st.sampled_from([0.0, 0.01, 0.3, 0.5, 0.99, 1.0]),
)
def test_the_brokers_sampling_shortcut_decides_as_the_event_id_does(
    publisher: str, seq: int, rate: float
) -> None:
    """Telemetry asks event_sampled(publisher, seq) for every event routed; the miner and the
    tests reason with is_sampled("publisher:seq"): the same events must be kept."""
    assert event_sampled(publisher, seq, rate) == is_sampled(f"{publisher}:{seq}", rate)
    assert event_sampled(publisher, seq, 0.5) == is_sampled(f"{publisher}:{seq}", 0.5)


def test_shared_names_are_bounded_by_count_and_length() -> None:
    """Slots and tuples made of attribute names are shared between filters, through a cache
    that users fill (they choose the names): long names stay out of it, and when it is full it
    starts again rather than keep growing or stop sharing."""
    long_name = "a" * (module._SHARED_LONGEST + 1)
    before = len(module._SHARED)
    f = Filter.parse(f"{long_name} exists")
    module.cover_profile(f)
    assert len(module._SHARED) == before  # nothing of it kept
    # Short names: shared, so two filters on the same attributes hold one tuple of names.
    g, h = Filter.parse("zz = 1 and yy > 2"), Filter.parse("yy < 9 and zz = 3")
    assert g.attrs == h.attrs and g.attrs is h.attrs
    assert module.cover_profile(g).narrow != module.cover_profile(h).narrow  # pins differ
    for i in range(module._SHARED_MAX + 10):
        module._shared(("probe", "", f"n{i}"), 3)
        assert len(module._SHARED) <= module._SHARED_MAX
    assert module._shared(("probe", "", "n1"), 3) == ("probe", "", "n1")


def test_a_cover_profile_holds_each_pin_once() -> None:
    """A profile is kept on every routed filter, so what it holds is memory per subscription:
    its pin, and the slots made of it, are one object wherever they appear (compiled, a tuple
    typed with a fixed length was re-boxed into a new tuple at every store: three copies of
    each pin per filter), and slots made of names alone are shared between filters."""
    p = module.cover_profile(Filter.parse("k = 17 and j > 2"))
    q = module.cover_profile(Filter.parse("k = 18 and j > 3"))
    pin = p.pins[0]
    assert p.anchor is p.filed[0] is p.probe[1]
    assert p.anchor[2] is pin
    assert p.filed[1] is pin and p.narrow is p.pins  # a pin is its own slot
    assert p.attrs is q.attrs
    assert [s for s in p.filed if s[0] == "attr"] == [s for s in q.filed if s[0] == "attr"]
    assert all(a is b for a, b in zip(p.filed[2:], q.filed[2:], strict=True))
    assert all(a is b for a, b in zip(p.probe[2:], q.probe[2:], strict=True))
