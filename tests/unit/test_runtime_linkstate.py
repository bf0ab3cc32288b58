"""The link session's transition tables: legal events move as the table says, every other event
is refused with a clear error before anything changes."""

from __future__ import annotations

import itertools

import pytest

from canopy_broker.runtime.links import Link
from canopy_broker.runtime.linkstate import (
    CLOSURE_TRANSITIONS,
    DETOURABLE,
    PROMOTABLE,
    ROUTE_EVENTS,
    ROUTE_TRANSITIONS,
    SESSION_EVENTS,
    SESSION_TRANSITIONS,
    STANDING_EVENTS,
    STANDING_TRANSITIONS,
    Closure,
    LinkEvent,
    LinkState,
    LinkStateError,
    LinkStates,
    Route,
    Standing,
)

CLOSURE_EVENTS = [e for e in LinkEvent if e not in SESSION_EVENTS | STANDING_EVENTS | ROUTE_EVENTS]


def states_in(session: LinkState = LinkState.NEW, closure: Closure = Closure.OPEN) -> LinkStates:
    st = LinkStates()
    st.session, st.closure = session, closure
    return st


def test_every_state_has_a_row() -> None:
    assert set(SESSION_TRANSITIONS) == set(LinkState)
    assert set(CLOSURE_TRANSITIONS) == set(Closure)


@pytest.mark.parametrize(("state", "event"), list(itertools.product(LinkState, SESSION_EVENTS)))
def test_session_events(state: LinkState, event: LinkEvent) -> None:
    st = states_in(session=state)
    expected = SESSION_TRANSITIONS[state].get(event)
    if expected is None:
        with pytest.raises(LinkStateError, match=f"{event.value!r}.*{state.value!r}"):
            st.fire(event, "b")
        assert st.session is state  # refused before anything changed
    else:
        st.fire(event, "b")
        assert st.session is expected
    assert st.closure is Closure.OPEN


@pytest.mark.parametrize(("closure", "event"), list(itertools.product(Closure, CLOSURE_EVENTS)))
def test_closure_events(closure: Closure, event: LinkEvent) -> None:
    st = states_in(closure=closure)
    expected = CLOSURE_TRANSITIONS[closure].get(event)
    if expected is None:
        with pytest.raises(LinkStateError, match="link to b"):
            st.fire(event, "b")
        assert st.closure is closure
    else:
        st.fire(event, "b")
        assert st.closure is expected
    assert st.session is LinkState.NEW


def test_the_illegal_transitions_that_matter() -> None:
    """A removed link never comes back; a link cannot lose a connection it does not have; a
    closing link is never reopened."""
    for event in (LinkEvent.CONNECTED, LinkEvent.DISCONNECTED, LinkEvent.RESET):
        with pytest.raises(LinkStateError):
            states_in(session=LinkState.REMOVED).fire(event)
    for state in (LinkState.NEW, LinkState.LOST):
        with pytest.raises(LinkStateError):
            states_in(session=state).fire(LinkEvent.DISCONNECTED)
    for closure in (Closure.CLOSING, Closure.BOTH_CLOSED):
        with pytest.raises(LinkStateError):
            states_in(closure=closure).fire(LinkEvent.REOPENED)


async def test_a_link_keeps_its_connection_consistent_with_its_state() -> None:
    link = Link("b", "s1", dialer=True, address=None)
    assert (link.state, link.connected_once, link.removed) == ("connecting", False, False)
    link.connected(object())  # type: ignore[arg-type]
    assert (link.state, link.connected_once, link.up.is_set()) == ("up", True, True)
    link.disconnected()
    assert (link.state, link.conn, link.connected_once) == ("connecting", None, True)
    link.fire(LinkEvent.CORE_CLOSED)
    assert link.closing and not link.peer_closed and link.status()["closing"]
    assert link.remove() is None and link.removed
    with pytest.raises(LinkStateError, match="link to b: event 'connected'"):
        link.connected(object())  # type: ignore[arg-type]
    assert link.conn is None and not link.up.is_set()  # nothing changed
    accepting = Link("a", "s2", dialer=False, address=None)
    assert accepting.state == "down"


@pytest.mark.parametrize(
    ("standing", "session", "event"),
    list(itertools.product(Standing, LinkState, STANDING_EVENTS)),
)
def test_standing_events(standing: Standing, session: LinkState, event: LinkEvent) -> None:
    """A standby link is promoted only while its session is up; an overlay link never is."""
    st = states_in(session=session)
    st.standing = standing
    expected = STANDING_TRANSITIONS[standing].get(event)
    if expected is None or session not in PROMOTABLE:
        with pytest.raises(LinkStateError, match=f"link to b: event {event.value!r}"):
            st.fire(event, "b")
        assert st.standing is standing
    else:
        st.fire(event, "b")
        assert st.standing is expected
    assert (st.session, st.closure) == (session, Closure.OPEN)


@pytest.mark.parametrize(
    ("standing", "route", "event"), list(itertools.product(Standing, Route, ROUTE_EVENTS))
)
def test_route_events(standing: Standing, route: Route, event: LinkEvent) -> None:
    """Only an overlay link is detoured (a standby link carries no link messages), once and for
    good: the exchange the detour serves removes the link."""
    st = states_in(session=LinkState.LOST)  # a failed link: no connection
    st.standing, st.route = standing, route
    if standing not in DETOURABLE:
        with pytest.raises(LinkStateError, match="only an overlay link is detoured"):
            st.fire(event, "b")
        assert st.route is route
    else:
        st.fire(event, "b")
        assert st.route is ROUTE_TRANSITIONS[route][event] is Route.DETOURED
    assert (st.session, st.closure, st.standing) == (LinkState.LOST, Closure.OPEN, standing)


def test_every_standing_has_a_row_and_every_event_one_table() -> None:
    assert set(STANDING_TRANSITIONS) == set(Standing)
    assert set(ROUTE_TRANSITIONS) == set(Route)
    assert not STANDING_EVENTS & SESSION_EVENTS
    assert not ROUTE_EVENTS & (SESSION_EVENTS | STANDING_EVENTS)
    assert set(CLOSURE_EVENTS) == {e for rows in CLOSURE_TRANSITIONS.values() for e in rows}


async def test_a_standby_link_is_promoted_into_an_opened_overlay_link() -> None:
    link = Link("b", "s1", dialer=True, address=None, kind="standby")
    assert link.states.standing is Standing.STANDBY and not link.promoted
    with pytest.raises(LinkStateError, match="only while up"):
        link.promote()  # no connection: a repair would gain nothing from it
    assert link.kind == "standby" and not link.opened
    link.connected(object())  # type: ignore[arg-type]
    link.promote()
    assert (link.kind, link.opened, link.promoted) == ("link", True, True)
    assert link.status()["promoted"]
    link.promote()  # the peer's word after ours: nothing changes
    assert link.promoted
    with pytest.raises(LinkStateError):
        Link("c", "s2", dialer=True, address=None).promote()  # an overlay link from the start
