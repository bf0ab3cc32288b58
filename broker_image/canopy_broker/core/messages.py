"""The broker core's vocabulary: wire messages, inputs and effects (all immutable records).

The core is a function from (state, input) to (state, effects). Everything that crosses its
boundary is one of the types here, which keeps the asyncio runtime and the discrete-event
simulator honest: they can only do what an effect tells them and only tell the core what an input
can say.

* **Link messages** travel between brokers over an overlay link (subscription routing and
  notifications).
* **Inputs** are what happened: a link was added or removed, a link or client message arrived.
* **Effects** are what to do: send a message on a link, deliver an event to a local client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar, dataclass_transform

from canopy_broker.core.events import Event, Targets
from canopy_broker.core.filters import Filter

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def message(cls: type[_T]) -> type[_T]:
    """A message, input or effect: a dataclass with slots, immutable to the type checker.

    Why not ``dataclass(frozen=True)``: a frozen dataclass's generated ``__init__`` sets each
    field through ``object.__setattr__``, about 0.6 us for three fields, and every event builds
    several of these (its input, its effects, a link message per hop): more than matching it.
    A plain slots dataclass builds in a fifth of that. Immutability is checked statically
    instead: to mypy (strict on the core) these classes are frozen, so assigning a field is a
    type error. Equal records hash alike, as frozen ones do (a class may define its own
    ``__hash__``, e.g. to cache it)."""
    return dataclass(slots=True, unsafe_hash="__hash__" not in cls.__dict__)(cls)


class RoutingMode(Enum):
    """How subscriptions are propagated (SIENA / Rebeca terminology).

    * ``simple``: every subscription travels to every broker (entries keyed by subscription id);
    * ``identity``: a filter is not forwarded where an identical one already was;
    * ``covering``: a filter is not forwarded where a covering one already was.
    """

    SIMPLE = "simple"
    IDENTITY = "identity"
    COVERING = "covering"


# --------------------------------------------------------------------------- link messages


@message
class RouteKey:
    """What a routing-table entry stores: a filter, tagged with the subscription id in simple
    routing (where identical filters of different subscriptions are kept apart) and with ``""``
    otherwise."""

    filter: Filter
    tag: str = ""
    _hash: int = field(default=0, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.filter, self.tag)))

    def __hash__(self) -> int:
        # A key is hashed a few dozen times per route update (tables, covering index, holder
        # counts): once here instead of a tuple built each time.
        return self._hash

    def sort_key(self) -> tuple[tuple[int, str], str]:
        return (self.filter.sort_key(), self.tag)

    def __str__(self) -> str:
        return f"{self.filter} #{self.tag}" if self.tag else str(self.filter)


@message
class Subscribe:
    """Neighbour asks to receive events matching ``key.filter``."""

    key: RouteKey


@message
class Unsubscribe:
    """Neighbour withdraws an earlier :class:`Subscribe` of the same key."""

    key: RouteKey


@message
class Tag:
    """The colour of a notification while it travels along a reconfiguration cycle.

    Black notifications belong to the old tree and may cross the removed link only; gray ones
    belong to the new tree and may cross the added link only. The tag is dropped when a
    notification leaves the cycle.
    """

    xid: str
    gray: bool


@message
class Publish:
    """A notification travelling over a link (``event.hops`` already counts this link).
    ``replay``: sent again after a crash repair; a broker that has already seen it (by the
    publisher's sequence number) does not deliver it again."""

    event: Event
    tag: Tag | None = None
    replay: bool = False


class Algorithm(Enum):
    """How a link exchange is carried out (see DESIGN.md §4)."""

    COORDINATED = "coordinated"  # paper 000: locks, two phases, colours; exactly once, in order
    PATH = "path"  # paper 002: reconfiguration path; least overhead, no delivery guarantee


class Ordering(Enum):
    """Delivery order a link exchange preserves for notifications crossing the new link."""

    FIFO = "fifo"
    CAUSAL = "causal"


# Link exchange (coordinated algorithm). The cycle is given as a path of broker names from A1
# (the initiator, one end of the added link) to A2 (its other end); the removed link is the pair
# path[k], path[k+1]. Side 1 is path[0..k], side 2 is path[k+1..].


@message
class Lock:
    """Travels A1 → A2 along the path, locking each broker for one exchange."""

    xid: str
    path: tuple[str, ...]
    k: int
    ordering: Ordering = Ordering.FIFO
    lease: float = 30.0  # seconds a broker stays locked without hearing from the exchange
    # A1's try number: a retry reuses the exchange id, so this is what tells a late answer to an
    # abandoned try (A1's lease ran out while the lock travelled) from the answer to this one.
    attempt: int = 0


@message
class LockRefused:
    """Travels back towards A1, releasing what the lock took (busy broker or invalid path)."""

    xid: str
    reason: str
    attempt: int = 0
    # The path itself is broken (a broker on it died): trying the same path again cannot
    # succeed, so A1 gives up at once and its caller re-plans from the live tree.
    final: bool = False
    # The path does not match the overlay (a link it removes is missing, or the link it adds
    # exists): planned from a stale view, it is tried only a few times (MAX_SHAPE_ATTEMPTS),
    # so its caller re-plans within seconds. A busy path (another exchange's lock or frozen
    # link) is not stale: it frees itself, and gets every try. A broker from before this
    # field never sets it: its refusals all get every try, which is safe, only slower.
    stale: bool = False


@message
class Granted:
    """Travels A2 → A1: every broker is locked. It changes nothing on its way: A1 decides."""

    xid: str
    attempt: int = 0


@message
class Go:
    """Travels A1 → A2 once Granted reached A1: the commit point. Phase 1 starts at each broker
    as Go passes it (an R end starts its transfer), so no broker changes anything for a try
    that A1 has given up on. ``a1_list``: A1's neighbour list as it commits (naming A2 from
    then on), for the two brokers that repair around A1 if it dies: its path neighbour and A2.
    A2 hears A1's lists over the new link only, which may not have carried one yet (CI: b0
    killed just after Go reached b5, which linked to nobody while b1 linked to it)."""

    xid: str
    attempt: int = 0
    a1_list: tuple[str, ...] = ()


@message
class Separator:
    """Ends phase 1 of one side: everything a side's R end transferred precedes it."""

    xid: str
    side: int


@message
class Echo:
    """Causal ordering: sent up a side by its R end when that side's separator returns; behind it,
    no black notification of that side travels towards the A end any more."""

    xid: str


@message
class End:
    """Travels from an R end to its A end once the removed link is closed on that side."""

    xid: str
    side: int


@message
class SeparatorSeen:
    """Over the removed link, from an R end that has taken the other R end's separator: all
    that end sent over the link before it is here. An R end closes the link only once it has
    this as well as the other separator. Closed on the separator alone, it could not hear of
    the other R end's death a moment later, with what it had just sent over the link still
    in that end's buffers, never passed on: the hand-over after such a death
    (core.handover) starts at the dead end's neighbours that still have a link to it."""

    xid: str


@message
class Settle:
    """A member of the cycle, ``gone``, is dead, and the sender has rolled its part of try
    ``attempt`` forward (Go had passed it). Walks along the path away from ``gone``, each
    broker settling its part as its lease's end would, up to the path's end (never across the
    added link). Without it the brokers away from the dead one heard nothing of the death and
    stayed locked for the whole lease (see ``exchange.settle``)."""

    xid: str
    attempt: int
    gone: str
    # ``gone``, a cycle member other than an A end, died in phase 1, and what went its way is
    # handed over (see core.handover): the A end this walk reaches holds what crosses the
    # added link until its side's replay (if a broker of its side hands over) and the other
    # A end's have come.
    handover: bool = False
    # ``gone`` is A2, dead before it rolled forward: its last list does not name A1, so the
    # repair around it leaves A1's side out, and the R ends keep the removed link (see
    # exchange.a2_left_a1_out). Said by A2's path neighbour, which heard that list.
    keep: bool = False


# Reconfiguration-path algorithm (paper 002). Head path: R1 → ... → A1; the new link A1 → A2;
# tail path: A2 → ... → R2 (our path lists are A1 ... R1 R2 ... A2, so the head path runs down
# the indices from k to 0 and the tail path from the end down to k + 1).


@message
class RecMsg:
    """Walks the reconfiguration path. On the head path it carries P_add (routes that now point
    towards the new link) and P_del (routes that pointed only at the removed link)."""

    xid: str
    path: tuple[str, ...]
    k: int
    p_add: tuple[RouteKey, ...] = ()
    p_del: tuple[RouteKey, ...] = ()


@message
class CtrlMsg:
    """Head path, back one hop: RECMSG was processed; stop ignoring unsubscriptions."""

    xid: str


@message
class FlushMsg:
    """Tail path, R2 → A2: the old link's routes are withdrawn; reconcile across the new link."""

    xid: str
    path: tuple[str, ...]


@message
class LinkReady:
    """A2 → A1 over the new link: A2 has it; A1 may now advertise over it."""

    xid: str


@message
class Done:
    """Over the added link: the sender's side is finished, and ``keys`` is exactly what it
    advertises over the link from now on (the receiver applies the difference)."""

    xid: str
    keys: tuple[RouteKey, ...] = ()


@message
class KeepRemoved:
    """Over the removed link of exchange ``xid``: the sender keeps the link, as the link of its
    repair around a dead member of the cycle whose chain runs over it (a path of three: the
    dead broker was the neighbour of both R ends once the exchange rolled forward), and
    ``keys`` is exactly what it advertises over the link from now on (the receiver makes what
    it holds from the sender exactly that, as a Done does)."""

    xid: str
    keys: tuple[RouteKey, ...] = ()


# Client migration (make-before-break), used to empty a leaf broker before it is removed.


@message
class Marker:
    """New broker → old broker: ``client``'s subscriptions are in force here; everything this
    broker forwarded before them precedes this marker on the link."""

    client: str


@message
class PublisherGap:
    """Flooded over the tree from the broker ``publisher`` failed over to: what it published
    between ``since`` and ``until`` (epoch seconds) may not have reached this part of the
    overlay. A broker cut off from the overlay acknowledged it, and the publisher no longer
    kept it to send again (docs/architecture.md, "Acknowledgements revoked"). Each broker
    tells its subscribers, so that the loss is not silent."""

    publisher: str
    since: float
    until: float


@message
class Moved:
    """Old broker → new broker: ``client`` published nothing more here."""

    client: str


# Crash repair (paper 001).


@message
class Neighbours:
    """Broker → each neighbour, whenever its set of neighbours or its placement changes: the
    ordered list the neighbours need to repair the overlay around this broker if it dies
    (paper 001's NL_j), in the order of the repair chain, and where the sender runs (its
    ``zone`` and ``node``, "" when unknown), from which its neighbours order their own lists
    so that the standby links a chain implies cross failure domains (paper 003).

    ``lists``: each of the sender's other neighbours' own lists, as the sender last heard them
    (never the receiver's own, which it knows). Two neighbours that die together leave each
    side knowing only its own dead broker's list; with the other's it can bridge the two
    (core.repair.bridge_ends). Older brokers leave the field out, and ignore it."""

    names: tuple[str, ...]
    zone: str = ""
    node: str = ""
    lists: tuple[tuple[str, tuple[str, ...]], ...] = ()


@message
class ReplayEnd:
    """Sent after the replay of the repair around ``dead`` (its retained notifications, then
    those it held): nothing more of that replay follows over this link. An exchange's A end
    whose neighbour on its side, ``dead``, died waits for it from its chain partners before it
    releases its queue of notifications that crossed the added link: newer than what the
    replay brings, released first they made it be dropped as had (simulator: 56 events)."""

    dead: str


@message
class RoutesIn:
    """An A end → down its side, to the broker that hands over what it kept for ``dead``, a
    cycle member dead in phase 1 of exchange ``xid`` (see core.handover): the other side's
    routes are in at the A end, and travel ahead of this on every link, so from here on that
    broker's replay up its side finds its way over the added link. ``route``: the brokers it
    still goes to, this receiver first, the one that hands over last."""

    xid: str
    dead: str
    route: tuple[str, ...]


@message
class HandoverBegin:
    """From an A end over the added link, as it begins to hold for a hand-over around ``dead``
    (see :class:`RoutesIn`): it waits for the other A end's HandoverEnd. An A end that hands
    nothing over for ``dead`` and whose side is through with exchange ``xid`` (it has left it,
    or has End: its side's R end closed the removed link and every broker of its side has
    released) answers with HandoverEnd at once: its side has nothing in flight the old way,
    and no death to hear of (its R end closed the removed link before the other R end died,
    so no verdict or Settle reaches it)."""

    xid: str
    dead: str


@message
class HandoverEnd:
    """The replay of what was kept for ``dead`` (see :class:`RoutesIn`) has passed: up a side
    to its A end (``route`` as in RoutesIn, the A end last), or over the added link to the other
    A end (``route`` is that end alone), which then takes what it held from the link."""

    xid: str
    dead: str
    route: tuple[str, ...]


@message
class RepairSweep:
    """Travels the repair chain of ``dead`` end to end, once in each direction (``forward``:
    from its first broker to its last). Behind it on each link are the routes of every broker
    it passed, so a broker that has seen both sweeps routes to the whole chain exactly."""

    dead: str
    forward: bool


# Cycle detection (paper 004) and link-failure repair. These travel out of band: a probe
# crosses standby links as well as tree links, and a standby link carries no link messages.


@message
class CycleProbe:
    """One hop of a heart's bounded flood in detection round ``round``. ``path`` is every broker
    it visited, the heart first and the sender last; ``budget`` is how many more tree hops it
    may take after this one. ``closing``: it left the heart over a standby link (``path[1]`` is
    that link's other end once the receiver appends itself), so it may cross no other."""

    round: int
    heart: str
    path: tuple[str, ...]
    budget: int
    closing: bool = False


@message
class CycleFound:
    """To every member of a small cycle: the tree path ``cycle`` whose ends are joined by a
    standby link (``cycle[0]``-``cycle[-1]``), found in detection round ``round``."""

    round: int
    cycle: tuple[str, ...]


@message
class RepairLink:
    """An end of a failed link to the initiator ``path[0]`` of the exchange that repairs it:
    start exchange ``xid`` (remove ``remove``, add the standby link ``path[0]``-``path[-1]``)."""

    xid: str
    path: tuple[str, ...]
    remove: tuple[str, str]


LinkMessage = (
    Marker
    | PublisherGap
    | Moved
    | Neighbours
    | RepairSweep
    | ReplayEnd
    | RoutesIn
    | HandoverBegin
    | HandoverEnd
    | Subscribe
    | Unsubscribe
    | Publish
    | Lock
    | LockRefused
    | Granted
    | Go
    | Separator
    | Echo
    | End
    | SeparatorSeen
    | Settle
    | Done
    | KeepRemoved
    | RecMsg
    | CtrlMsg
    | FlushMsg
    | LinkReady
)


# --------------------------------------------------------------------------- out-of-band


@message
class Transfer:
    """R end → A end: the removed link's routing entries (what the A end must hold from a)."""

    xid: str
    keys: tuple[RouteKey, ...]


@message
class Relay:
    """R end → A end: a routing change that arrived over the removed link after the transfer."""

    xid: str
    message: Subscribe | Unsubscribe


@message
class RelayEnd:
    """R end → A end: the removed link will carry no more routing changes."""

    xid: str


PeerMessage = (
    Transfer | Relay | RelayEnd | Separator | RecMsg | CycleProbe | CycleFound | RepairLink
)


# --------------------------------------------------------------------------- inputs


@message
class AddLink:
    """An overlay link to ``peer`` now exists (both ends get this input)."""

    peer: str


@message
class RemoveLink:
    """The overlay link to ``peer`` is gone; routes through it are withdrawn (uncoordinated)."""

    peer: str


@message
class PeerFailed:
    """The failure detector: neighbour ``peer`` has been unreachable for the detection timeout.
    The core drops the link and repairs the tree around the dead broker."""

    peer: str


@message
class LinkFailed:
    """The link to ``peer`` has been down for the link-failure threshold while ``peer`` is
    still alive (reachable out of band). The core repairs it with a link exchange onto a
    standby link that closes a small cycle with it, if it knows one."""

    peer: str


@message
class PeerGone:
    """``peer`` is gone for this process: it declared this broker's process dead (it refused
    it, or answered it, with ``fenced``), or this broker's failure detector declared it dead
    (no connection past the detection time, and no witness hears it). Nothing more will pass
    between them. If it is on the cycle of the exchange this broker is locked in, nothing more
    will come of that exchange either, and it settles now as it would when its lease ran out.
    Waiting for the lease held the overlay split for up to 30 s: after a partition healed
    (review), and when a member was killed during the exchange, which deferred the repair
    around it (chaos soak: 2,539 events lost untold at a subscriber)."""

    peer: str


@message
class StandbyLinks:
    """The standby links this broker keeps open (heartbeats only, no routing traffic): their
    other ends. Replaces the previous set; cycle detection runs over them and the tree."""

    peers: tuple[str, ...]


@message
class PeerFeatures:
    """What a peer broker's software understands, from its hello. ``placement``: neighbour
    lists in chain order with the sender's zone and node. A peer without it (an older version,
    met during a roll-out) sorts the lists it hears by name and refuses fields it does not
    know, so while one is a neighbour this broker announces in name order, without them.
    ``settle``: it understands :class:`Settle` (an older peer would close the link on it);
    ``replay_end``: it understands and sends :class:`ReplayEnd`; ``handover``: it understands
    :class:`RoutesIn`, :class:`HandoverBegin`, :class:`HandoverEnd`, :class:`SeparatorSeen`
    and ``Settle.handover``; ``keep_removed``: it understands :class:`KeepRemoved`."""

    peer: str
    placement: bool
    settle: bool = True
    replay_end: bool = True
    handover: bool = True
    keep_removed: bool = True


@message
class Placed:
    """Where this broker runs, learnt by the runtime (flags, or Kubernetes' downward API once
    the pod is scheduled); "" when unknown. It orders the neighbour list the broker announces
    and travels with it, so neighbours learn it too."""

    zone: str
    node: str


@message
class FindCycles:
    """Start detection round ``round`` for cycles of at most ``bound`` brokers (each a tree
    path closed by one standby link). The runtime sends it on a timer and after reshaping."""

    round: int
    bound: int


@message
class FromLink:
    peer: str
    message: LinkMessage


@message
class FromPeer:
    """An out-of-band message from any broker (not necessarily a neighbour)."""

    peer: str
    message: PeerMessage


@message
class StartExchange:
    """Exchange link ``remove`` for (path[0], path[-1]). The coordinated algorithm starts at A1
    (path[0]); the path algorithm at R1, the end of ``remove`` on A1's side."""

    xid: str
    path: tuple[str, ...]
    remove: tuple[str, str]
    ordering: Ordering = Ordering.FIFO
    lease: float = 30.0
    algorithm: Algorithm = Algorithm.COORDINATED


def validate_path(path: tuple[str, ...], remove: tuple[str, str]) -> int:
    """Return k (R1's index) or raise ``ValueError`` saying what is wrong with the request."""
    if len(set(path)) != len(path):
        raise ValueError(f"cycle path repeats a broker: {list(path)}")
    if len(path) < 3:
        raise ValueError(
            f"cycle path {list(path)} is too short: the added link must differ from the removed one"
        )
    for k in range(len(path) - 1):
        if {path[k], path[k + 1]} == set(remove):
            return k
    raise ValueError(f"removed link {remove[0]}-{remove[1]} is not on the cycle path {list(path)}")


@message
class TimerFired:
    key: str


@message
class ClientAttach:
    client: str


@message
class ClientDetach:
    """A client left (or its connection broke): its subscriptions are withdrawn."""

    client: str


@message
class ClientSubscribe:
    client: str
    sub_id: str
    filter: Filter


@message
class ClientUnsubscribe:
    client: str
    sub_id: str


@message
class ClientPublish:
    """``replay``: the client sends it again after failing over from a broker that died before
    acknowledging it; brokers that already have it (by publisher sequence) do not deliver it
    again, as with a repair's replay."""

    client: str
    event: Event
    replay: bool = False


@message
class ClientResume:
    """A client that lost its broker ``previous`` (``since``: when, on this broker's clock) is
    attached and subscribed here again; ``last`` is the last sequence number it got from each
    publisher. The broker serves what it still holds that the client missed, from ``margin``
    seconds before the loss (what the dead broker had not passed on yet), and says what it
    cannot vouch for (:class:`Resumed`)."""

    client: str
    previous: str
    since: float
    last: tuple[tuple[str, int], ...] = ()
    margin: float = 0.0
    # From when (this broker's clock) the client may lack what was on its way to ``previous``:
    # the loss, or earlier (client/failover.py IN_FLIGHT). The gaps start there; what is
    # served from retention still goes by ``since``. None: ``since``.
    unsure_since: float | None = None


@message
class ClientMigrating:
    """At the new broker, after the client re-attached and re-subscribed with the same ids:
    it is moving here from neighbour ``source``."""

    client: str
    source: str


@message
class ClientMove:
    """At the old broker: the client publishes nothing more here; it moves to ``target``."""

    client: str
    target: str


@message
class ClientPublisherGap:
    """From the client: what it published between ``since`` and ``until`` (epoch seconds) may
    be lost (see :class:`PublisherGap`)."""

    client: str
    since: float
    until: float


Input = (
    AddLink
    | RemoveLink
    | PeerFailed
    | LinkFailed
    | PeerGone
    | StandbyLinks
    | PeerFeatures
    | Placed
    | FindCycles
    | FromLink
    | FromPeer
    | StartExchange
    | TimerFired
    | ClientAttach
    | ClientDetach
    | ClientSubscribe
    | ClientUnsubscribe
    | ClientPublish
    | ClientResume
    | ClientMigrating
    | ClientMove
    | ClientPublisherGap
)


# --------------------------------------------------------------------------- effects


@message
class SendToLink:
    peer: str
    message: LinkMessage


@message
class Deliver:
    """Deliver ``event`` once to each target client; with each, its subscriptions that matched.

    One effect per event, not per client: an event matching ten subscribers is one object to
    build and to dispatch, where ten frozen objects used to cost more than the matching."""

    event: Event
    targets: Targets


@message
class DeliverMarker:
    """Hand the migration marker to ``client``'s connection here (its old one): the client has
    now received on it everything it will not also receive on its new connection."""

    client: str


@message
class SendToPeer:
    """Send out-of-band to any broker (the runtime opens a control connection)."""

    peer: str
    message: PeerMessage


@message
class StartTimer:
    """Call back with :class:`TimerFired` after ``delay`` seconds (same key replaces)."""

    key: str
    delay: float


@message
class OpenLink:
    """A link to ``peer`` now exists in the core (added link of an exchange): connect it.
    ``kept``: the core had it already and keeps it for a new try of the exchange that took
    its lock over (A2, see ``exchange.lock_here``): connect it again only if the peer's core
    closed its end meanwhile (A1 let the old try go) and opened a new one."""

    peer: str
    kept: bool = False


@message
class CloseLink:
    """The core dropped its link to ``peer`` (removed link of an exchange): disconnect it."""

    peer: str


@message
class ExchangeFinished:
    """At the initiator: the exchange completed (``ok``) or was given up (with a reason)."""

    xid: str
    ok: bool
    reason: str = ""
    attempts: int = 1


@message
class Repaired:
    """This broker removed its link to the dead broker ``dead`` and opened ``links`` (its part
    of the chain through the dead broker's neighbours ``chain``); for logs and metrics.
    ``together``: the broker ``dead`` died together with, where this is a bridge over the two
    (``chain`` is then the bridge's, core.repair.bridge_ends)."""

    dead: str
    chain: tuple[str, ...]
    links: tuple[str, ...]
    together: str = ""


@message
class RepairFinished:
    """The repair around ``dead`` is complete here: of ``retained`` notifications (sent to the
    dead broker lately, or routed here while the repair waited for its routes), ``replayed``
    copies went over the new links (``timed_out``: a sweep never came; finished without it)."""

    dead: str
    replayed: int
    retained: int
    timed_out: bool = False


@message
class Gap:
    """Notifications published between ``since`` and ``until`` (the broker's clock) may be
    missing for a resumed client, and why: the application is told, never left to guess."""

    since: float
    until: float
    reason: str


@message
class Resumed:
    """Answer to :class:`ClientResume`: ``served`` notifications came from retention; ``gaps``
    are the intervals this broker cannot vouch for (none: nothing was lost)."""

    client: str
    served: int
    gaps: tuple[Gap, ...] = ()


@message
class DetourLink:
    """The link to ``peer`` failed but its exchange still needs it: carry the link's stream
    (what is unacknowledged, then what follows, in order, as link messages) over an
    out-of-band connection to ``peer`` until :class:`CloseLink` for it."""

    peer: str


@message
class LinkRepair:
    """This end decided how the failed link to ``peer`` is repaired: exchange ``xid`` along
    ``path`` (``path[0]`` starts it), or nothing (empty ``xid``; ``reason`` says why). For the
    driver's bookkeeping, logs and metrics."""

    peer: str
    xid: str
    path: tuple[str, ...]
    reason: str = ""


@message
class TellGap:
    """Tell the local subscribers that ``publisher``'s notifications published between
    ``since`` and ``until`` (epoch seconds) may be missing (a :class:`PublisherGap`)."""

    publisher: str
    since: float
    until: float


Effect = (
    SendToLink
    | Deliver
    | DeliverMarker
    | SendToPeer
    | StartTimer
    | OpenLink
    | CloseLink
    | ExchangeFinished
    | Repaired
    | RepairFinished
    | Resumed
    | DetourLink
    | LinkRepair
    | TellGap
)
