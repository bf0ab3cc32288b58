"""The states of a link session and the transitions between them, as data.

Modelled on h11's ``_state.py``: the states, the events and the allowed transitions are tables in
one module, and :class:`LinkStates` refuses an event that has no entry for the current state with
a :class:`LinkStateError` *before* anything changes, so a bug in the runtime shows up as a clear
error (which costs the connection that triggered it) instead of a link in a state nobody planned.

A link has two independent parts of state, each with its own table:

* the **session** (:class:`LinkState`): ``NEW`` (no session on both ends yet; the next hello
  creates it), ``UP`` (connected), ``LOST`` (the session exists but its connection is gone; the
  next hello resumes it), ``REMOVED`` (forgotten, never redialled);
* the **closure** (:class:`Closure`) of an overlay link by the reconfiguration protocols:
  ``OPEN``, ``CLOSING`` (our core closed it: flush what it queued, then say goodbye),
  ``PEER_CLOSED`` (the peer's core closed it: never redial), ``BOTH_CLOSED``.

* the **standing** (:class:`Standing`) of the link: ``ACTIVE`` (an overlay link or a channel
  from the start), ``STANDBY`` (a standby link: pre-opened to a broker a crash repair would link
  this one to, heartbeats and hellos only, in no routing table) and ``PROMOTED`` (a standby link
  the core's repair took over as an overlay link, on the same connection and session). A standby
  link is promoted only while its session is ``UP``: promotion is what saves the repair a dial
  and a hello, so a standby link without a connection is not promoted (the repair dials).

* the **route** (:class:`Route`) of an overlay link's session: ``DIRECT`` (its own connection)
  or ``DETOURED`` (the link failed while its peer is alive, and the core's link-failure repair
  asked for a detour: the session, its sequence numbers and retransmit buffer, resumes on an
  out-of-band connection, one the link's failure does not block, until the repair's exchange
  closes the link). A detour is never undone: the exchange removes the link.

What the admin API shows as a link's ``state`` (``up``, ``connecting`` or ``down``) and
``closing`` is derived from these (:attr:`LinkStates.public_state`), with the same names as
before.

Not state in this sense, and so not here: whether the *core* knows the link (``established``,
a mirror of the core's table), and the outbox's flags (dirty, over high water, pressure).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Final, TypeVar


class LinkState(Enum):
    NEW = "new"
    UP = "up"
    LOST = "lost"
    REMOVED = "removed"


class Closure(Enum):
    OPEN = "open"
    CLOSING = "closing"
    PEER_CLOSED = "peer-closed"
    BOTH_CLOSED = "both-closed"


class Standing(Enum):
    ACTIVE = "active"
    STANDBY = "standby"
    PROMOTED = "promoted"


class Route(Enum):
    DIRECT = "direct"
    DETOURED = "detoured"


class LinkEvent(Enum):
    # session events
    CONNECTED = "connected"  # a hello completed on a connection (the first, or a resume)
    DISCONNECTED = "disconnected"  # the session's connection is gone
    RESET = "reset"  # the session is abandoned for a new one (the peer lost it, or redialled)
    REMOVE = "remove"  # the link is forgotten
    # closure events
    CORE_CLOSED = "core-closed"  # our core dropped the link (CloseLink)
    PEER_CLOSED = "peer-closed"  # the peer said goodbye "closed"
    REOPENED = "reopened"  # the peer redialled a link our core (still) has open
    # standing events
    PROMOTE = "promote"  # a repair takes the standby link over as an overlay link
    # route events
    DETOUR = "detour"  # the core's link-failure repair: carry the session out of band


SESSION_TRANSITIONS: Final[dict[LinkState, dict[LinkEvent, LinkState]]] = {
    LinkState.NEW: {
        LinkEvent.CONNECTED: LinkState.UP,
        LinkEvent.RESET: LinkState.NEW,
        LinkEvent.REMOVE: LinkState.REMOVED,
    },
    LinkState.UP: {
        LinkEvent.CONNECTED: LinkState.UP,  # a new connection of the session replaces the old
        LinkEvent.DISCONNECTED: LinkState.LOST,
        LinkEvent.RESET: LinkState.NEW,  # a redial on a new session; its hello follows at once
        LinkEvent.REMOVE: LinkState.REMOVED,
    },
    LinkState.LOST: {
        LinkEvent.CONNECTED: LinkState.UP,
        LinkEvent.RESET: LinkState.NEW,
        LinkEvent.REMOVE: LinkState.REMOVED,
    },
    LinkState.REMOVED: {
        LinkEvent.REMOVE: LinkState.REMOVED,  # dropping twice is harmless; anything else is not
    },
}

CLOSURE_TRANSITIONS: Final[dict[Closure, dict[LinkEvent, Closure]]] = {
    Closure.OPEN: {
        LinkEvent.CORE_CLOSED: Closure.CLOSING,
        LinkEvent.PEER_CLOSED: Closure.PEER_CLOSED,
        LinkEvent.REOPENED: Closure.OPEN,
    },
    Closure.CLOSING: {
        LinkEvent.CORE_CLOSED: Closure.CLOSING,
        LinkEvent.PEER_CLOSED: Closure.BOTH_CLOSED,
    },
    Closure.PEER_CLOSED: {
        LinkEvent.CORE_CLOSED: Closure.BOTH_CLOSED,
        LinkEvent.PEER_CLOSED: Closure.PEER_CLOSED,
        LinkEvent.REOPENED: Closure.OPEN,
    },
    Closure.BOTH_CLOSED: {
        LinkEvent.CORE_CLOSED: Closure.BOTH_CLOSED,
        LinkEvent.PEER_CLOSED: Closure.BOTH_CLOSED,
    },
}

STANDING_TRANSITIONS: Final[dict[Standing, dict[LinkEvent, Standing]]] = {
    Standing.ACTIVE: {},  # an overlay link or channel is never promoted
    Standing.STANDBY: {LinkEvent.PROMOTE: Standing.PROMOTED},
    # Both ends promote on their own (each when its core opens the link, or on the other's
    # word): the second promotion of the same link changes nothing.
    Standing.PROMOTED: {LinkEvent.PROMOTE: Standing.PROMOTED},
}

ROUTE_TRANSITIONS: Final[dict[Route, dict[LinkEvent, Route]]] = {
    Route.DIRECT: {LinkEvent.DETOUR: Route.DETOURED},
    # Both ends' cores ask (each on its own detection); asking again changes nothing.
    Route.DETOURED: {LinkEvent.DETOUR: Route.DETOURED},
}

DETOURABLE: Final = frozenset({Standing.ACTIVE, Standing.PROMOTED})
"""Standings of a link that may be detoured: overlay links only (a standby link carries no
link messages, so there is nothing to detour)."""

PROMOTABLE: Final = frozenset({LinkState.UP})
"""Session states in which a standby link may be promoted: it must have its connection."""

GUARDED: Final[dict[LinkEvent, tuple[str, Any, str, frozenset[Any], str]]] = {
    LinkEvent.PROMOTE: (
        "standing",
        STANDING_TRANSITIONS,
        "session",
        PROMOTABLE,
        "a standby link is promoted only while up",
    ),
    LinkEvent.DETOUR: (
        "route",
        ROUTE_TRANSITIONS,
        "standing",
        DETOURABLE,
        "only an overlay link is detoured",
    ),
}
"""Events of the standing and the route: (the part they change, its table, the part that must
allow them, the states it must be in, why)."""

STANDING_EVENTS: Final = frozenset({LinkEvent.PROMOTE})
ROUTE_EVENTS: Final = frozenset({LinkEvent.DETOUR})

SESSION_EVENTS: Final = frozenset(
    {LinkEvent.CONNECTED, LinkEvent.DISCONNECTED, LinkEvent.RESET, LinkEvent.REMOVE}
)


class LinkStateError(Exception):
    """An event the transition table does not allow in the link's current state."""


S = TypeVar("S", LinkState, Closure, Standing, Route)


def _step(
    table: dict[S, dict[LinkEvent, S]], state: S, event: LinkEvent, peer: str, what: str
) -> S:
    nxt = table[state].get(event)
    if nxt is None:
        raise LinkStateError(
            f"link to {peer}: event {event.value!r} is not allowed in {what} state {state.value!r}"
        )
    return nxt


class LinkStates:
    """The session, closure, standing and route of one link; changed only by :meth:`fire`."""

    __slots__ = ("closure", "route", "session", "standing")

    def __init__(self, standing: Standing = Standing.ACTIVE) -> None:
        self.session = LinkState.NEW
        self.closure = Closure.OPEN
        self.standing = standing
        self.route = Route.DIRECT

    def fire(self, event: LinkEvent, peer: str = "?") -> None:
        """Apply ``event``, or raise :class:`LinkStateError` and change nothing."""
        if event in SESSION_EVENTS:
            self.session = _step(SESSION_TRANSITIONS, self.session, event, peer, "session")
        elif event in GUARDED:
            part, table, needs, allowed, why = GUARDED[event]
            nxt = _step(table, getattr(self, part), event, peer, part)
            have = getattr(self, needs)
            if have not in allowed:
                raise LinkStateError(
                    f"link to {peer}: event {event.value!r} is not allowed in {needs} "
                    f"{have.value!r} ({why})"
                )
            setattr(self, part, nxt)
        else:
            self.closure = _step(CLOSURE_TRANSITIONS, self.closure, event, peer, "closure")

    @property
    def closing(self) -> bool:
        return self.closure in (Closure.CLOSING, Closure.BOTH_CLOSED)

    @property
    def peer_closed(self) -> bool:
        return self.closure in (Closure.PEER_CLOSED, Closure.BOTH_CLOSED)

    def public_state(self, dialer: bool) -> str:
        """The admin API's name: ``up``, else ``connecting`` on the dialing end, ``down``."""
        if self.session is LinkState.UP:
            return "up"
        return "connecting" if dialer else "down"
