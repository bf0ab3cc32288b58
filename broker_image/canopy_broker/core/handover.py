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
the feature): what is held is then released with the routes there are. What those do not lead
anywhere yet is lost, and a late replay may be dropped as had: the timer is a last resort, not
a path of the protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from canopy_broker.core import exchange as coordinated
from canopy_broker.core.errors import ProtocolError
from canopy_broker.core.events import Event
from canopy_broker.core.exchange import Exchange, Mark
from canopy_broker.core.messages import (
    Effect,
    FromLink,
    HandoverBegin,
    HandoverEnd,
    Publish,
    RoutesIn,
    SendToLink,
    StartTimer,
    Tag,
)
from canopy_broker.core.repair import Phase as RepairPhase
from canopy_broker.core.repair import RepairRun, Retention, event_order, in_order

if TYPE_CHECKING:
    from canopy_broker.core.routing import RoutingState


class Host(Protocol):
    """What the hand-over needs from the broker it runs in (``core.broker.BrokerCore``),
    declared here so that this module depends on an interface: the broker imports it."""

    name: str
    routing: RoutingState
    retention: Retention
    handovers: dict[str, Handover]
    no_handover: set[str]  # peers that would refuse its messages (older software)
    ex: Exchange | None
    now: float
    repair_timeout: float

    def from_link(self, inp: FromLink, out: list[Effect]) -> None: ...

    def replaying(self, run: RepairRun) -> list[str]: ...

    def drop_ghost(self, dead: str, out: list[Effect]) -> None: ...


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
    repair: RepairRun | None = None  # X: its repair around the dead one, once it runs
    repairing: bool = True  # X: a repair around the dead one is to run here (its link stayed)
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
        the dead one has come, and passed on, before X's HandoverEnd. Without a run: whether
        none is to come (settling took the dead one's link, see :func:`no_repair`)."""
        run = self.repair
        if run is None:
            return not self.repairing
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
    return event_order(_event_of(inp))


# --------------------------------------------------------------------------- the protocol
# Functions over a Host; BrokerCore calls them at its verdicts, Settles, Dones and routing.


def begin(host: Host, ex: Exchange, dead: str, out: list[Effect]) -> None:
    """The verdict on ``dead``, a cycle neighbour, in phase 1: if this broker is the one that
    hands over what it kept for it (exchange.hands_over), it starts collecting, and, if it is
    also an A end, holds what crosses the added link. What it kept is read, not taken: the
    repair around the dead one replays it to its chain too."""
    if not coordinated.hands_over(ex, dead) or dead in host.handovers:
        return
    up = route_up(ex)
    if up and up[0] in host.no_handover:
        return  # the way up knows nothing of it: as before, the repair alone
    kept = host.retention.kept_for(dead, host.now)
    beyond = ex.path[2 * ex.path.index(dead) - ex.me]  # the dead one's other path neighbour
    h = Handover(ex.xid, dead, ghost=True, up=up, kept=kept, beyond=beyond)
    if ex.is_a:
        _hold_added_link(host, h, ex, out)
    _start(host, h, ex, out)


def expect(host: Host, ex: Exchange, gone: str, out: list[Effect]) -> None:
    """A Settle told this broker that ``gone`` died in phase 1 and is handed over: if this is
    an A end, it holds what crosses the added link until its side's replay (if a broker of its
    side hands over) and the other A end's are through."""
    if not ex.is_a or not coordinated.handed_over(ex, gone) or gone in host.handovers:
        return
    x = coordinated.hander(ex, gone)
    h = Handover(ex.xid, gone, down=() if x is None else route_down(ex, x), handed=x is None)
    _hold_added_link(host, h, ex, out)
    _start(host, h, ex, out)


def _hold_added_link(host: Host, h: Handover, ex: Exchange, out: list[Effect]) -> None:
    a = ex.a_peer
    assert a is not None
    h.over = a
    h.peer_ends = a not in host.no_handover
    if h.peer_ends:  # it may have no death to hear of: see HandoverBegin
        out.append(SendToLink(a, HandoverBegin(h.xid, h.dead)))


def _start(host: Host, h: Handover, ex: Exchange, out: list[Effect]) -> None:
    host.handovers[h.dead] = h
    # By exchange too: a timer left from an earlier hand-over for a broker of the same name
    # (restarted, dead again) must not end this one early.
    out.append(StartTimer(f"handover:{h.dead}:{h.xid}", host.repair_timeout))
    a = h.over
    if a is not None and (ex.has(Mark.PEER_DONE) or host.routing.held_from(a)):
        _routes_in(host, h, out)  # the transfer brought them


def routes_arrived(host: Host, peer: str, out: list[Effect]) -> None:
    """The other A end's Done is applied: its side's routes are in over the link."""
    for h in list(host.handovers.values()):
        if h.over == peer and not h.routes_in:
            _routes_in(host, h, out)


def _routes_in(host: Host, h: Handover, out: list[Effect]) -> None:
    h.routes_in = True
    if h.down and h.down[0] not in host.no_handover:  # behind the routes, which went first
        out.append(SendToLink(h.down[0], RoutesIn(h.xid, h.dead, h.down)))
    _step(host, h, out)


def _step(host: Host, h: Handover, out: list[Effect]) -> None:
    """Whatever the hand-over can do now: X replays up once its A end has the routes and its
    repair is through; an A end sends over the added link once it has the routes and its
    side's replay, and takes what it held from the link once both replays are in."""
    run = h.repair
    through = (
        not h.ghost or h.handed or h.repair_through(() if run is None else host.replaying(run))
    )
    if h.collecting and not h.is_a and h.routes_in and through:
        _replay_up(host, h, out)
    if h.holds_out and h.routes_in and (h.handed or (h.x_here and through)):
        _send_over(host, h, out)
    if h.inbound_due:
        _take_inbound(host, h, out)
    if h.over_and_done and host.handovers.get(h.dead) is h:
        del host.handovers[h.dead]


def handing(
    host: Host, event: Event, peers: tuple[str, ...], source: str | None
) -> tuple[str, ...]:
    """``event``, from ``source``, is routed to ``peers``: X collects it if it goes to the dead
    one (unless it came from beyond it), and an A end holds it instead of sending it over the
    added link. Returns the peers it still goes to now."""
    for h in host.handovers.values():
        if h.collecting and h.dead in peers and source != h.beyond:
            h.kept.append(event)
        over = h.over
        if over is not None and h.holds_out and over in peers:
            h.held.append(event)
            peers = tuple(p for p in peers if p != over)
    return peers


def holds_in(host: Host, inp: FromLink) -> bool:
    """A publication over the added link, held if an A end's hand-over holds it."""
    for h in host.handovers.values():
        if h.holds_in(inp.peer):
            h.inbound.append(inp)
            return True
    return False


def on_message(
    host: Host, peer: str, msg: RoutesIn | HandoverBegin | HandoverEnd, out: list[Effect]
) -> None:
    """HandoverBegin over the added link; RoutesIn down a side; HandoverEnd up it or over the
    added link. The last two are passed on along ``route``, and at its end are a step of the
    hand-over around ``msg.dead``."""
    if isinstance(msg, HandoverBegin):
        ex = host.ex
        through = ex is None or ex.xid != msg.xid or ex.has(Mark.END)
        if through and msg.dead not in host.handovers and peer not in host.no_handover:
            out.append(SendToLink(peer, HandoverEnd(msg.xid, msg.dead, (peer,))))
        return
    route = msg.route
    # A path never passes a broker twice: a route that does (a peer's bug, or a hostile one)
    # would bounce between two honest brokers, copying itself at every hop.
    if not route or route[0] != host.name or len(set(route)) != len(route):
        raise ProtocolError(f"{host.name}: {type(msg).__name__} routed {list(route)[:8]}")
    if len(route) > 1:
        onward = route[1]
        if host.routing.has_link(onward) and onward not in host.no_handover:
            out.append(SendToLink(onward, type(msg)(msg.xid, msg.dead, route[1:])))
        return
    h = host.handovers.get(msg.dead)
    if h is None or h.xid != msg.xid:
        return  # over already (its timer), or never begun here: nothing waits on it
    if isinstance(msg, RoutesIn):
        if h.ghost and not h.is_a and h.up and peer == h.up[0]:
            h.routes_in = True
    elif peer == h.over:
        h.peer_ended = True
    elif h.down and peer == h.down[0]:
        h.handed = True
    _step(host, h, out)


def repaired(host: Host, dead: str, out: list[Effect]) -> None:
    """The repair around ``dead`` moved on (done, a partner's replay ended, or it went)."""
    h = host.handovers.get(dead)
    if h is not None:
        _step(host, h, out)


def _replay_up(host: Host, h: Handover, out: list[Effect]) -> None:
    """X, its A end having the routes: what it kept goes up, as replays, then HandoverEnd.
    The dead one's routes go now (the new way has them)."""
    up = h.up[0]
    kept, h.kept = in_order(h.kept), []
    h.handed = True
    if host.routing.has_link(up):
        _replay(host, kept, up, None, out)
        out.append(SendToLink(up, HandoverEnd(h.xid, h.dead, h.up)))
    host.drop_ghost(h.dead, out)


def _send_over(host: Host, h: Handover, out: list[Effect]) -> None:
    """Send what X kept (if it is here) and what this A end held over the added link, each
    publisher's in order, as replays; then HandoverEnd."""
    over = h.over
    assert over is not None
    events = h.outgoing()
    h.kept, h.held = [], []
    h.sent = h.handed = True
    if host.routing.has_link(over):
        ex = host.ex
        tag = Tag(h.xid, True) if ex is not None and ex.xid == h.xid else None
        _replay(host, events, over, tag, out)
        if h.peer_ends:
            out.append(SendToLink(over, HandoverEnd(h.xid, h.dead, (over,))))
    if h.ghost:
        host.drop_ghost(h.dead, out)


def _replay(host: Host, events: list[Event], peer: str, tag: Tag | None, out: list[Effect]) -> None:
    """Send ``peer`` those of ``events`` its routes want, as replays, kept in custody."""
    route = host.routing.route
    keep = host.retention.keep if host.retention.enabled else None
    for event in events:
        if peer in route(event.attrs, None)[0]:
            out.append(SendToLink(peer, Publish(event, tag, replay=True)))
            if keep is not None:
                keep(peer, host.now, event)


def _take_inbound(host: Host, h: Handover, out: list[Effect]) -> None:
    """Both replays are in: take what came over the added link meanwhile, each publisher's
    in order, as replays (delivered only if newer than what this broker had)."""
    h.taken_in = True
    for inp in h.take_inbound():
        msg = inp.message
        assert isinstance(msg, Publish)
        if host.routing.has_link(inp.peer):
            again = Publish(msg.event, msg.tag, replay=True)
            host.from_link(FromLink(inp.peer, again), out)


def timer(host: Host, key: str, out: list[Effect]) -> None:
    """A hand-over waited too long (a broker on the way died too, or runs software without
    it): everything still held goes on with the routes there are. What they lead nowhere yet
    (X's routes up, if RoutesIn never came) is lost, untold: the timer is the last resort."""
    dead, _, xid = key.partition(":")
    h = host.handovers.get(dead)
    if h is None or h.xid != xid:
        return
    if h.collecting and not h.is_a:
        _replay_up(host, h, out)
    h.routes_in = h.handed = h.peer_ended = True
    _step(host, h, out)
    host.handovers.pop(dead, None)


def no_repair(host: Host, dead: str, out: list[Effect]) -> None:
    """No repair around ``dead`` runs here (settling closed its link): X need not wait for one."""
    h = host.handovers.get(dead)
    if h is not None and h.repair is None:
        h.repairing = False
        _step(host, h, out)
