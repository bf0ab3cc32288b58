"""Handing over what went the way of a broker that died in phase 1 of a link exchange.

An exchange removes r = (R1, R2) and adds a = (A1, A2) (see :mod:`~canopy_broker.core.exchange`).
Until a side's separator has passed, what its brokers publish for the other side goes *black*:
down the path to its R end and over r. When a member of the cycle (not an A end) dies then,
what was on its way through it dies with it. Its neighbour towards the A end, call it X, kept
that in custody, but the repair around the dead broker does not bring it all back: the repair
replays to the dead one's *other* neighbours, and after the exchange the other side is reached
over a, up X's side. Worse, X's routes to the other side went with the dead broker, and come
back only once the A ends have exchanged Done: what X routes meanwhile goes nowhere. On real
processes (`canopy bench faults --only exchange --victim b4`, R1 killed): up to a
failure-detection time of notifications, 827 at 1,000 events/s, lost untold by a subscriber on
the far side. If the dead one was an R end, the other R end is an X as well: what it sent over
r for the dead one's side died there too.

So X *hands over*:

* X keeps the dead broker's routes (a ghost, as a repair does) and collects what it routes
  to it, behind what it had kept for it (not what comes from beyond the dead one, over the
  repair's link: that still goes the old way). When its A end has the other side's routes,
  it sends :class:`~canopy_broker.core.messages.RoutesIn` down the path, behind them; once its
  own repair around the dead one is through as well (the other neighbours' replays have come
  and gone on up), X replays the lot up its side, as replays, and sends HandoverEnd after it.
* The Settles from the dead one's two neighbours tell both A ends to hold what they would
  send over a from then on, until their side's X is through (HandoverEnd; at once where no
  broker of their side hands over). Then each sends what it held with X's replay, each
  publisher's in order, as replays, and HandoverEnd over a.
* Each A end also holds what comes over a until its own side's replay and the other A end's
  are through: the other side may have sent newer notifications of a publisher over a before
  the older ones handed over there (or replayed to this side by the repair) came, and taken
  first, they would make the older ones be dropped as had.

A replay is delivered only if it is newer than what the broker had from its publisher, so what
reached the far side before the death, or came both ways, is delivered once.

The state here is one broker's part; :class:`~canopy_broker.core.broker.BrokerCore` carries it
out. Every hold also ends on a timer (a broker further on died too, or runs software without
the feature): what is held is then released; nothing is dropped, though a late replay may be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from canopy_broker.core.events import Event
from canopy_broker.core.exchange import Exchange
from canopy_broker.core.messages import FromLink, Publish
from canopy_broker.core.repair import Phase as RepairPhase
from canopy_broker.core.repair import RepairRun


def in_order(events: Sequence[Event]) -> list[Event]:
    """Each notification once, each publisher's in sequence order (a replay behind a newer one
    of its publisher is dropped as had); across publishers by sequence number, as
    :func:`~canopy_broker.core.repair.merged` orders a repair's replay."""
    seen: set[tuple[str, int]] = set()
    out: list[Event] = []
    for event in events:
        key = (event.publisher, event.seq)
        if key not in seen:
            seen.add(key)
            out.append(event)
    out.sort(key=_event_order)
    return out


def _event_order(event: Event) -> tuple[int, str]:
    return (event.seq, event.publisher)


def route_up(ex: Exchange) -> tuple[str, ...]:
    """From this broker's up neighbour along the path to its side's A end; () at the A end."""
    if ex.is_a:
        return ()
    if ex.side == 1:
        return tuple(reversed(ex.path[: ex.me]))
    return ex.path[ex.me + 1 :]


def route_down(ex: Exchange, x: int) -> tuple[str, ...]:
    """At an A end: from its down neighbour along the path to the broker at ``x`` that hands
    over on this side; () when that is this A end."""
    if ex.side == 1:
        return ex.path[1 : x + 1]
    return tuple(reversed(ex.path[x : ex.last]))


@dataclass(eq=False)
class Handover:
    """One broker's part in handing over what was kept for ``dead`` in exchange ``xid``.

    ``ghost``: this broker is X (see :func:`~canopy_broker.core.exchange.hands_over`),
    collecting in ``kept`` what it routes to the dead one, behind what it kept for it;
    ``up``: X's way to its A end (() when X is the A end). ``over``: this broker is an A end
    and that is the added link's other end; ``down``: its way to X (() when X is here, or
    when nobody hands over on this side: then ``handed`` from the start)."""

    xid: str
    dead: str
    ghost: bool = False
    up: tuple[str, ...] = ()
    over: str | None = None
    down: tuple[str, ...] = ()
    peer_ends: bool = False  # the other A end understands HandoverEnd, and will send one
    kept: list[Event] = field(default_factory=list)  # X: for the dead one, oldest first
    held: list[Event] = field(default_factory=list)  # A end: what it would have sent over a
    inbound: list[FromLink] = field(default_factory=list)  # A end: publications from a
    routes_in: bool = False  # A end: it has the other side's routes over a
    handed: bool = False  # X's replay is through (here: sent up, or at its A end: arrived)
    sent: bool = False  # A end: its replay and HandoverEnd went over a
    peer_ended: bool = False  # A end: the other A end's HandoverEnd came
    taken_in: bool = False  # A end: what it held from a is taken
    repair: RepairRun | None = None  # X: its repair around the dead one, if it runs one
    # X: the dead one's other neighbour on the path. What comes from there (over the repair's
    # link) came from beyond the dead one and still goes the old way: not collected.
    beyond: str | None = None

    @property
    def is_a(self) -> bool:
        return self.over is not None

    @property
    def x_here(self) -> bool:
        """This A end is X too: it hands over to itself."""
        return self.ghost and self.over is not None

    @property
    def collecting(self) -> bool:
        """X still collects what it routes to the dead one."""
        return self.ghost and not self.handed

    @property
    def holds_out(self) -> bool:
        """The A end still holds what it would send over the added link."""
        return self.over is not None and not self.sent

    def holds_in(self, peer: str) -> bool:
        """The A end still holds the publications that come over the added link."""
        return peer == self.over and not self.taken_in

    @property
    def inbound_due(self) -> bool:
        """The A end may take what came over the added link: its own side's replay is in
        (older than what its side sent the new way meanwhile), and the other A end's."""
        ended = self.peer_ended or not self.peer_ends
        return self.over is not None and not self.taken_in and self.handed and ended

    @property
    def over_and_done(self) -> bool:
        return not self.collecting and not self.holds_out and (self.over is None or self.taken_in)

    def repair_through(self, replay_ends_from: Sequence[str]) -> bool:
        """X's repair around the dead one is done, and the replay of each chain partner in
        ``replay_ends_from`` (those still linked that send one) has ended: what they had sent
        the dead one has come, and passed on, before X's HandoverEnd. True without a repair
        (the link went as the exchange settled here)."""
        run = self.repair
        if run is None:
            return True
        return run.phase is RepairPhase.DONE and set(replay_ends_from) <= run.replay_ends

    def outgoing(self) -> list[Event]:
        """What the A end sends over a, each once, each publisher's in order: what X kept, if
        X is here, and what it held. X's replay, if X is elsewhere, came in with the held ones,
        behind newer ones of the same publishers that took the new way to this A end."""
        return in_order((*self.kept, *self.held))

    def take_inbound(self) -> list[FromLink]:
        """The publications held from the added link, each once, each publisher's in order:
        the other side's handed-over replay came behind newer ones it had sent before."""
        held, self.inbound = self.inbound, []
        once: dict[tuple[str, int], FromLink] = {}
        for inp in held:
            event = _event_of(inp)
            once.setdefault((event.publisher, event.seq), inp)
        return sorted(once.values(), key=_by_seq)


def _event_of(inp: FromLink) -> Event:
    msg = inp.message
    assert isinstance(msg, Publish)
    return msg.event


def _by_seq(inp: FromLink) -> tuple[int, str]:
    return _event_order(_event_of(inp))
