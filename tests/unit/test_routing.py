"""The routing state: the covering index is sound, the canonical advertisement is kept exactly,
and inserting a subscription does not look at more keys as the table grows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canopy_broker.core import routing
from canopy_broker.core.errors import ProtocolError
from canopy_broker.core.events import Kind
from canopy_broker.core.filters import Filter, cover_profile, covers
from canopy_broker.core.messages import (
    Effect,
    RouteKey,
    RoutingMode,
    SendToLink,
    Subscribe,
    Unsubscribe,
)
from canopy_broker.core.routing import CoverIndex, RoutingState, dominates, maximal
from tests.strategies import constraints, filters

# Filters with more than three constraints, so closed intervals and boolean '!=' pins show up.
wide_filters = st.lists(constraints(), max_size=5).map(Filter.of)


@settings(max_examples=3000, deadline=None)
@given(wide_filters, wide_filters)
def test_cover_profile_states_necessary_conditions(g: Filter, h: Filter) -> None:
    """What the index relies on: if g covers a satisfiable h, h has every attribute and every
    pin of g."""
    if not covers(g, h):
        return
    pg, ph = cover_profile(g), cover_profile(h)
    if not ph.satisfiable:
        return
    assert set(pg.attrs) <= set(ph.attrs), (str(g), str(h))
    assert set(pg.pins) <= set(ph.pins), (str(g), str(h), pg.pins, ph.pins)


def test_pins_include_closed_intervals_and_boolean_inequality() -> None:
    assert cover_profile(Filter.parse("a >= 2 and a <= 2 and b != true")).pins == (
        ("a", Kind.NUMBER.value, 2),
        ("b", Kind.BOOL.value, False),
    )
    assert cover_profile(Filter.parse("a > 1 and a < 3")).pins == ()
    assert not cover_profile(Filter.parse("a = 1 and a = 2")).satisfiable


keys = st.lists(filters.map(RouteKey), max_size=25, unique=True)


@settings(max_examples=300, deadline=None)
@given(keys, filters.map(RouteKey))
def test_index_candidates_are_supersets(held: list[RouteKey], probe: RouteKey) -> None:
    index = CoverIndex(held)
    assert {g for g in held if covers(g.filter, probe.filter)} <= set(index.coverers(probe))
    assert {h for h in held if covers(probe.filter, h.filter)} <= set(index.covered(probe))
    assert index.dominated(probe) == any(dominates(g, probe) for g in held)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), filters.map(RouteKey)), max_size=60), filters.map(RouteKey)
)
def test_index_answers_stay_sound_as_keys_come_and_go(
    steps: list[tuple[bool, RouteKey]], probe: RouteKey
) -> None:
    """Buckets change shape as they fill and empty (one key, a set, back to one key): after any
    sequence of adds and discards the answers still cover what is held, and only that."""
    index = CoverIndex()
    held: set[RouteKey] = set()
    for add, key in steps:
        if add:
            index.add(key)
            held.add(key)
        else:
            index.discard(key)
            held.discard(key)
        assert set(index) == held
        for p in (probe, key):
            found = set(index.coverers(p))
            assert {g for g in held if covers(g.filter, p.filter)} <= found <= held
            found = set(index.covered(p))
            assert {h for h in held if covers(p.filter, h.filter)} <= found <= held
            assert index.dominated(p) == any(dominates(g, p) for g in held)


@settings(max_examples=300, deadline=None)
@given(keys)
def test_maximal_matches_the_definition(held: list[RouteKey]) -> None:
    brute = {h for h in held if not any(dominates(g, h) for g in held)}
    assert maximal(held, RoutingMode.COVERING) == brute


ops = st.lists(st.tuples(st.sampled_from(["c1", "c2", "n1"]), st.booleans(), filters), max_size=40)


@pytest.mark.parametrize("mode", list(RoutingMode))
@settings(max_examples=150, deadline=None)
@given(steps=ops)
def test_advertisements_stay_canonical(
    mode: RoutingMode, steps: list[tuple[str, bool, Filter]]
) -> None:
    """After any sequence of (un)subscriptions from clients and a neighbour, what the state
    believes it advertised to each neighbour is what it sent, and equals ``wanted_by``."""
    state = RoutingState(mode)
    out: list[Effect] = []
    for peer in ("n1", "n2"):
        state.add_link(peer, out)
    for client in ("c1", "c2"):
        state.attach(client)
    subs: dict[tuple[str, str], Filter] = {}
    for n, (source, add, f) in enumerate(steps):
        if source == "n1":
            key = RouteKey(f)
            if add and key not in state.held_from("n1"):
                state.apply("n1", Subscribe(key), out)
            elif not add and key in state.held_from("n1"):
                state.apply("n1", Unsubscribe(key), out)
        elif add:
            subs[source, str(n)] = f
            state.subscribe(source, str(n), f, out)
        elif subs:
            (client, sub_id), _ = subs.popitem()
            state.unsubscribe(client, sub_id, out)
    for peer in ("n1", "n2"):
        sent: set[RouteKey] = set()
        for effect in out:
            if isinstance(effect, SendToLink) and effect.peer == peer:
                msg = effect.message
                assert isinstance(msg, Subscribe | Unsubscribe)
                if isinstance(msg, Subscribe):
                    assert msg.key not in sent, "advertised twice"
                    sent.add(msg.key)
                else:
                    sent.remove(msg.key)
        assert sent == set(state.advertised_to(peer)) == state.wanted_by(peer)


def test_refused_route_updates_change_nothing() -> None:
    state = RoutingState()
    out: list[Effect] = []
    state.add_link("n1", out)
    key = RouteKey(Filter.parse("x = 1"))
    state.apply("n1", Subscribe(key), out)
    before = state.snapshot()
    for bad in (Subscribe(key), Unsubscribe(RouteKey(Filter.parse("x = 2")))):
        with pytest.raises(ProtocolError):
            state.apply("n1", bad, out)
    with pytest.raises(ProtocolError, match="not a neighbour"):
        state.apply("n9", Subscribe(key), out)
    assert state.snapshot() == before


def _inserts_cost(n: int, monkeypatch: pytest.MonkeyPatch) -> float:
    """Covering tests per subscription while the n-th batch of 100 goes in: with equality
    filters the index hands back only keys sharing the value, whatever n is."""
    calls = 0
    real = routing.dominates

    def counting(g: RouteKey, h: RouteKey) -> bool:
        nonlocal calls
        calls += 1
        return real(g, h)

    state = RoutingState(RoutingMode.COVERING)
    out: list[Effect] = []
    for peer in ("n1", "n2", "n3"):
        state.add_link(peer, out)
    state.attach("c")
    for i in range(n):
        state.subscribe("c", f"s{i}", Filter.parse(f"k = {i}"), out)
    state.subscribe("c", "wide", Filter.parse("k > 5 and k < 7"), out)
    monkeypatch.setattr(routing, "dominates", counting)
    for i in range(n, n + 100):
        state.subscribe("c", f"s{i}", Filter.parse(f"k = {i}"), out)
    for i in range(n, n + 100):
        state.unsubscribe("c", f"s{i}", out)
    monkeypatch.setattr(routing, "dominates", real)
    return calls / 200


def test_subscription_cost_does_not_grow_with_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    small, large = _inserts_cost(100, monkeypatch), _inserts_cost(5000, monkeypatch)
    assert large <= small + 1, (small, large)
