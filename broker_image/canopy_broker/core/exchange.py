"""Per-broker state of one coordinated link exchange, and where this broker sits on the cycle.

The exchange removes r = (R1, R2) and adds a = (A1, A2). Its *cycle* is given as the tree path
``path = [A1, ..., R1, R2, ..., A2]``; ``k`` is R1's index. Side 1 is ``path[0..k]`` and side 2
is ``path[k+1..]``. On each side, *down* points towards the removed link and *up* towards the
added one (for A1 and A2, up is the added link itself; for R1 and R2, down is the removed link).

How the protocol runs (each step is a message handled by ``BrokerCore``):

1. **Lock** travels A1 → A2 over tree links; each broker joins only one exchange at a time and
   turns *black*. A busy broker (or a hop that is not a link) sends **LockRefused** back, which
   releases every broker on the way; A1 retries with randomised exponential backoff. A2, the last
   to lock, answers **Granted**, which travels back to A1 and changes nothing on its way. A1 and
   A2 add the new link when they lock, *frozen*: no routing advertisement crosses it until the end.
   **The commit point is A1's.** With Granted in hand within half a lease of its lock (so that
   every broker's lease, renewed as Granted passed, outlasts Go's way back), A1 sends **Go**
   A1 → A2; if Granted is not back by then, A1 lets the try go and retries, and the brokers,
   which changed nothing, release themselves by lease or are taken over by the new try. (Phase
   1 used to begin where Granted passed, so on a path slower than the lease, a try A1 had
   abandoned could already have begun near A2, and been rolled forward there alone.)
2. **Phase 1.** When Go passes an R end, that R end freezes the removed link too, and sends
   its A end (out of band) a **Transfer**: the routing keys it holds from r — exactly what the A
   end must hold from a in the new tree. Later routing changes arriving over r are **Relay**-ed. A
   **Separator** follows the transfer. The A end installs the keys as if received over a, which
   propagates them down its side of the cycle by ordinary covering/identity forwarding.
3. The separator walks its side down to its R end, turning each broker *gray*, crosses r, and
   walks the other side up to the other A end, where it is absorbed. When it returns to its R end,
   that end starts **phase 2**: it drops r's routing entries, which withdraws them up its side.
   An R end that has done phase 2, received the other side's separator and the other R end's
   **SeparatorSeen** (it has this end's separator, and all that came before it) closes r, says
   **RelayEnd** to its A end and sends **End** up its side; each broker releases its lock as End
   passes.
4. Notifications carry a colour (:class:`~canopy_broker.core.messages.Tag`) on the cycle: black
   ones cross r only, gray ones cross a only, so each takes exactly one of the two paths. A
   message takes the colour of the broker where it enters the cycle; an untagged message from a
   cycle neighbour was sent before that neighbour locked, so it is black. Gray notifications that
   cross a are queued at the far A end until the other side's separator has arrived there (no
   black notification of that publisher can still overtake them) — FIFO-publisher order. For
   causal order the queue also waits for an **Echo** of the A end's own separator, sent up by its
   R end: then no black notification of its own side is still on its way to the A end either.
5. An A end that has End, RelayEnd and the other separator unfreezes a and sends **Done** with
   the complete set it advertises over a; the other A end, which holds the old advertisement of
   this side (its R end's transfer), applies the difference. With Done from both sides the
   exchange is finished; A1 reports it.

Routing changes made by subscribers *during* an exchange propagate normally inside each side; they
cross between the sides when the exchange completes (step 5), which is when they are established.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from canopy_broker.core.errors import ProtocolError
from canopy_broker.core.messages import (
    CloseLink,
    Done,
    Echo,
    Effect,
    End,
    ExchangeFinished,
    FromLink,
    Go,
    Granted,
    KeepRemoved,
    Lock,
    LockRefused,
    OpenLink,
    Ordering,
    PeerMessage,
    Publish,
    Relay,
    RelayEnd,
    RouteKey,
    SendToLink,
    Separator,
    SeparatorSeen,
    Settle,
    StartExchange,
    StartTimer,
    Tag,
    Transfer,
    validate_path,
)

if TYPE_CHECKING:
    from canopy_broker.core.routing import RoutingState

MAX_LOCK_ATTEMPTS = 60  # a busy cycle: about 4.8 minutes of backoff in all
# A cycle that does not match the overlay (a link it removes is not there, the one it adds
# is): the plan was made from a view a repair has changed since, and waiting will not
# mend it. A few tries (about 1.5 s, for a link a repair is about to make or undo), then
# give up, so that the plan is made again from the overlay as it is. Before, the exchange
# tried for 4.8 minutes while the supervisor waited on it, holding the overlay's lock:
# nothing was restored and a split was never told (review: 22,452 events lost untold).
MAX_SHAPE_ATTEMPTS = 5
# What a stale refusal says (lock_problem); a broker from before LockRefused.stale is known by
# the same words.
NO_LINK = "has no link to"
LINKED_ALREADY = "is already linked to"


class BrokerCore(Protocol):
    """What the exchange needs from the broker it runs in (``core.broker.BrokerCore``).

    Declared here so the protocol depends on an interface, not on the broker module: the broker
    imports this module, never the other way round.
    """

    name: str
    routing: RoutingState
    ex: Exchange | None  # the exchange this broker is locked for (at most one)
    attempts: dict[str, tuple[StartExchange, int]]  # at A1: requests not finished, and tries
    left: deque[str]  # exchanges this broker left on lease expiry: late messages are expected
    # At A1: exchanges it rolled forward by a settle before R1 had taken Go, and their added
    # link's other end (see :func:`other_a_end_rolled_back`).
    unconfirmed: dict[str, tuple[str, int]]
    unsettled: set[str]  # peers that would refuse a Settle (older software)
    no_handover: set[str]  # peers without the hand-over (no SeparatorSeen, Settle.handover)
    no_keep_removed: set[str]  # peers that would refuse a KeepRemoved (older software)
    kept: dict[str, str]  # exchanges whose removed link this broker kept, and its other end
    repair_timeout: float  # the longest a drain waits (see _drains)
    deduped: set[str]  # links whose publications are taken as replays (see _end_bridge)
    now: float

    def to_peer(self, peer: str, msg: PeerMessage, out: list[Effect]) -> None: ...

    def from_link(self, inp: FromLink, out: list[Effect]) -> None: ...

    def record_ordering_delay(self, xid: str, delay: float) -> None: ...

    def own_list(self) -> tuple[str, ...]: ...

    def heard_with_go(self, peer: str, names: tuple[str, ...], *, newest: bool) -> None: ...

    def leave_exchange(self, ex: Exchange, *, by_lease: bool) -> None: ...

    def expect_handover(self, ex: Exchange, gone: str, out: list[Effect]) -> None: ...

    def heard_list(self, peer: str) -> tuple[str, ...]: ...

    @property
    def repair_holding(self) -> str | None: ...

    def repair_uses(self, peer: str) -> bool: ...

    def adopt_added_link(self, ex: Exchange, out: list[Effect]) -> None: ...


class Phase(Enum):
    """Where one broker stands in one exchange (it leaves the exchange after ``CLOSING``)."""

    LOCKED = "locked"  # lock taken; waiting for Go (or a refusal)
    LOCKED_GRAY = "locked-gray"  # own side's separator passed before Go reached here
    BLACK = "black"  # phase 1: notifications entering here keep the old tree
    GRAY = "gray"  # own side's separator passed: notifications entering here take the new link
    CLOSING = "closing"  # an A end that sent Done; waiting for the other A end's Done


class Step(Enum):
    """The inputs an exchange reacts to, named for the transition table."""

    GRANTED = "Granted"
    GO = "Go"  # A1's commit, or its Go passing
    REFUSED = "LockRefused"
    OWN_SEPARATOR = "own Separator"  # over a link, from the A end's direction
    SEPARATOR_TO_A = "own Separator out of band"  # at an A end, from its R end
    OTHER_SEPARATOR = "other side's Separator"
    SEPARATOR_SEEN = "SeparatorSeen"  # at an R end, over the removed link
    TRANSFER = "Transfer"
    RELAY = "Relay"
    RELAY_END = "RelayEnd"
    ECHO = "Echo"
    END = "End"
    DONE = "Done"
    SEND_DONE = "sending Done"


class Mark(Enum):
    """Facts an exchange collects on its way, each at most once, in orders that vary."""

    GRANTED = "Granted passed"
    OTHER_SEPARATOR = "other side's separator seen"
    SEPARATOR_SEEN = "the other R end has this one's separator"
    RELAY_END = "RelayEnd seen"
    END = "End seen"
    ECHO = "Echo seen"
    PEER_DONE = "the other A end's Done seen"
    PHASE2 = "phase 2 done"  # R end: the removed link's entries are dropped
    QUEUE_RELEASED = "queue released"  # A end: the added link's arrivals may be processed
    BY_LEASE = "finished by lease"
    DRAINING = "settled; the removed link closes on the other R end's separator"
    KEPT = "this R end keeps the removed link: its repair's chain runs over it (KeepRemoved)"
    KEPT_THERE = "the other R end keeps the removed link (its KeepRemoved came)"


_L, _LG, _B, _G, _C = Phase.LOCKED, Phase.LOCKED_GRAY, Phase.BLACK, Phase.GRAY, Phase.CLOSING
TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    (_L, Step.GRANTED): _L,  # passed on towards A1; nothing changes until Go
    (_L, Step.GO): _B,
    (_L, Step.REFUSED): _L,  # and the broker leaves the exchange
    # R2 sends Go on up side 2 over links and its separator out of band to A2, which walks it
    # down side 2: the separator can overtake Go there.
    (_L, Step.SEPARATOR_TO_A): _LG,
    (_L, Step.OWN_SEPARATOR): _LG,
    (_LG, Step.GO): _G,
    (_B, Step.SEPARATOR_TO_A): _G,
    (_B, Step.OWN_SEPARATOR): _G,
    **{(ph, Step.OTHER_SEPARATOR): ph for ph in (_B, _G)},
    **{(ph, st): ph for ph in (_L, _B) for st in (Step.TRANSFER,)},
    **{(ph, st): ph for ph in (_L, _LG, _B, _G) for st in (Step.RELAY, Step.RELAY_END)},
    **{(_G, st): _G for st in (Step.ECHO, Step.END, Step.DONE, Step.SEPARATOR_SEEN)},
    (_G, Step.SEND_DONE): _C,
    (_C, Step.DONE): _C,
}
"""Which input each phase accepts and the phase it leads to; anything else is a protocol error,
raised before the input changes anything (h11's ``_state.py`` is the model)."""

# Inputs that record a fact, which a correct peer sends once.
_MARKS = {
    Step.GRANTED: Mark.GRANTED,
    Step.OTHER_SEPARATOR: Mark.OTHER_SEPARATOR,
    Step.RELAY_END: Mark.RELAY_END,
    Step.ECHO: Mark.ECHO,
    Step.END: Mark.END,
    Step.SEPARATOR_SEEN: Mark.SEPARATOR_SEEN,
    Step.DONE: Mark.PEER_DONE,
}


@dataclass
class Exchange:
    xid: str
    path: tuple[str, ...]
    k: int
    me: int
    ordering: Ordering = Ordering.FIFO
    lease: float = 30.0
    phase: Phase = Phase.LOCKED
    marks: set[Mark] = field(default_factory=set)
    queue: list[tuple[float, FromLink]] = field(default_factory=list)
    queued_total: int = 0
    attempt: int = 0  # A1's try this lock belongs to (see Lock.attempt)
    # A1 died after Go, away from the removed link (see defer_settle). At A2: A1, and what
    # arrives over the links of the repair around it, held until the removed link has done.
    bridge: str | None = None
    bridge_peers: set[str] = field(default_factory=set)
    bridged: list[FromLink] = field(default_factory=list)
    # A dead cycle neighbour whose repair this broker settles after (see defer_settle), and
    # whether after its chain partners' ReplayEnd too (not at A1's other path neighbour).
    after_repair: str | None = None
    after_replay: bool = False
    # At A2: A1, declared dead before Go reached this broker (see a1_dead_before_go).
    a1_dead: bool = False
    # At A1: A2, declared dead before its list named this broker (see a2_dead_unlisted).
    a2_dead: bool = False
    # At A1, before R1 took Go: the dead broker whose repair's sweep to the other A end waits
    # (see BrokerCore.adopt_added_link): the added link is that repair's link, and whether the
    # other end rolled back (then it is a repair link like any) is not known yet.
    sweep_held: str | None = None

    def expect(self, step: Step) -> Phase:
        """The phase ``step`` leads to; raises (changing nothing) if it is not allowed now."""
        nxt = TRANSITIONS.get((self.phase, step))
        mark = _MARKS.get(step)
        if nxt is None or (mark is not None and mark in self.marks):
            again = " again" if nxt is not None else ""
            raise ProtocolError(
                f"exchange {self.xid}: {step.value}{again} is not expected in phase "
                f"{self.phase.value} (position {self.me} of {list(self.path)})"
            )
        return nxt

    def fire(self, step: Step) -> None:
        """Take the transition for ``step`` (after :meth:`expect` accepted it)."""
        self.phase = self.expect(step)
        mark = _MARKS.get(step)
        if mark is not None:
            self.marks.add(mark)

    def has(self, mark: Mark) -> bool:
        return mark in self.marks

    @property
    def granted(self) -> bool:
        """Whether phase 1 has begun here: A1 committed and its Go has passed."""
        return self.phase not in (Phase.LOCKED, Phase.LOCKED_GRAY)

    @property
    def promised(self) -> bool:
        """Whether this broker can no longer let the try go: phase 1 has begun here, or
        Granted passed here towards A1, which commits on it (a refusal sent back after it
        would meet brokers that Go has turned black already)."""
        return self.rolls_forward or Mark.GRANTED in self.marks

    @property
    def gray(self) -> bool:
        return self.phase in (Phase.LOCKED_GRAY, Phase.GRAY, Phase.CLOSING)

    @property
    def rolls_forward(self) -> bool:
        """Whether this broker would finish the exchange rather than undo it, were it to settle
        now (its lease, a cycle member's death, a Settle): phase 1 has begun here, or the
        separator passed. It also decides when an A end lists the added link and an R end
        stops listing the removed one."""
        return self.granted or self.gray

    @property
    def queue_released(self) -> bool:
        return Mark.QUEUE_RELEASED in self.marks

    @property
    def last(self) -> int:
        return len(self.path) - 1

    @property
    def side(self) -> int:
        return 1 if self.me <= self.k else 2

    @property
    def is_a(self) -> bool:
        return self.me in (0, self.last)

    @property
    def is_r(self) -> bool:
        return self.me in (self.k, self.k + 1)

    @property
    def a_peer(self) -> str | None:
        """The other end of the added link, if this broker is an A end."""
        if self.me == 0:
            return self.path[-1]
        if self.me == self.last:
            return self.path[0]
        return None

    @property
    def r_peer(self) -> str | None:
        """The other end of the removed link, if this broker is an R end."""
        if self.me == self.k:
            return self.path[self.k + 1]
        if self.me == self.k + 1:
            return self.path[self.k]
        return None

    @property
    def down(self) -> str:
        """Next broker towards the removed link (over it, for an R end)."""
        return self.path[self.me + 1] if self.side == 1 else self.path[self.me - 1]

    @property
    def up(self) -> str:
        """Next broker towards the added link (over it, for an A end)."""
        if self.is_a:
            a = self.a_peer
            assert a is not None
            return a
        return self.path[self.me - 1] if self.side == 1 else self.path[self.me + 1]

    @property
    def a_end_of_my_side(self) -> str:
        return self.path[0] if self.side == 1 else self.path[-1]

    @property
    def r_end_of_my_side(self) -> str:
        return self.path[self.k] if self.side == 1 else self.path[self.k + 1]

    @property
    def waits_on(self) -> tuple[str, ...]:
        """The dead broker whose repair this broker's part of the exchange waits on, if any
        (see :func:`defer_settle`)."""
        return tuple(d for d in (self.bridge, self.after_repair) if d is not None)

    def cycle_peers(self) -> tuple[str, str]:
        return (self.up, self.down)

    @property
    def retired(self) -> str | None:
        """The removed link once phase 2 dropped its entries here (its routing changes are only
        relayed from then on)."""
        return self.r_peer if Mark.PHASE2 in self.marks else None


def backoff(xid: str, attempt: int, base: float = 0.05, cap: float = 5.0) -> float:
    """Randomised exponential backoff without a random source: the jitter is a hash of the
    exchange id and the attempt, so runs stay reproducible while colliding exchanges (which have
    different ids) spread out."""
    jitter = zlib.crc32(f"{xid}#{attempt}".encode()) / 0x1_0000_0000
    return float(min(cap, base * (2 ** min(attempt, 16))) * (0.5 + jitter))


# --------------------------------------------------------------------------- the protocol
# Functions over a BrokerCore's routing state; BrokerCore.handle() dispatches to them.


def is_gray(ex: Exchange, source: str | None, tag: Tag | None) -> bool:
    """The colour a notification from ``source`` (None: a client of this broker) takes here:
    gray ones belong to the new tree and cross only the added link, black ones the old tree
    and the removed link."""
    if tag is not None and tag.xid == ex.xid:
        return tag.gray
    if source is not None and source in ex.cycle_peers():
        # Untagged from a cycle neighbour: sent before it locked (old tree, black) — except
        # at an A end that has seen End, whose down neighbour has released: new tree.
        return ex.has(Mark.END) and source == ex.down
    return ex.gray


def handed_over(ex: Exchange, gone: str) -> bool:
    """Whether the death of ``gone`` is handed over (core.handover): it is on the path and not
    an A end (an A end's death is bridged or repaired around, see :func:`defer_settle`), and
    phase 1 has begun here (before it the exchange rolls back, and the old way stays)."""
    return gone in ex.path and gone not in (ex.path[0], ex.path[-1]) and ex.rolls_forward


def _handers(ex: Exchange, gone: str) -> tuple[int, ...]:
    """Where on the path the brokers are that hand over for ``gone`` (core.handover): the dead
    one's neighbour towards the A end on its own side, and, if it is an R end, the other R end.
    What went to ``gone`` from them went black, towards the removed link (and below it), and
    has only the added link left to reach the other side by."""
    i = ex.path.index(gone)
    up = i - 1 if i <= ex.k else i + 1
    return (up, 2 * ex.k + 1 - i) if i in (ex.k, ex.k + 1) else (up,)


def hands_over(ex: Exchange, gone: str) -> bool:
    """Whether this broker hands over what it kept for ``gone`` (see :func:`_handers`)."""
    return handed_over(ex, gone) and ex.me in _handers(ex, gone)


def hander(ex: Exchange, gone: str) -> int | None:
    """At an A end: where on the path the broker is that hands over for ``gone`` on this side,
    or None when nobody does on this side (``gone`` was a middle broker of the other side)."""
    mine = [x for x in _handers(ex, gone) if (x <= ex.k) == (ex.side == 1)]
    return mine[0] if mine else None


def route_on_cycle(
    ex: Exchange,
    copy: Publish,
    peers: Sequence[str],
    out: list[Effect],
    *,
    source: str | None,
    tag: Tag | None,
) -> None:
    """Forward a notification on a reconfiguration cycle: colour it, and let black copies
    cross only the removed link and gray copies only the added one."""
    gray = is_gray(ex, source, tag)
    tagged = Publish(copy.event, Tag(ex.xid, gray), replay=copy.replay)
    for peer in peers:
        if peer == ex.r_peer:
            if not gray or ex.has(Mark.KEPT):  # kept: a link of the new tree too
                out.append(SendToLink(peer, tagged))
        elif peer == ex.a_peer:
            if gray:
                out.append(SendToLink(peer, tagged))
        elif peer in (ex.up, ex.down):
            out.append(SendToLink(peer, tagged))
        else:
            out.append(SendToLink(peer, copy))


def start(core: BrokerCore, req: StartExchange, out: list[Effect]) -> None:
    """At A1: a new exchange request (idempotent by id); lock the cycle."""
    if req.xid in core.attempts:
        return  # idempotent: the same request is already being carried out
    try:
        validate_path(req.path, req.remove)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    if req.path[0] != core.name:
        raise ProtocolError(f"{core.name}: exchange {req.xid} must start at {req.path[0]}")
    core.attempts[req.xid] = (req, 0)
    try_lock(core, req.xid, out)


def try_lock(core: BrokerCore, xid: str, out: list[Effect]) -> None:
    req, attempt = core.attempts[xid]
    k = validate_path(req.path, req.remove)
    problem = lock_problem(core, req.path, 0)
    if problem is None:
        lock = Lock(req.xid, req.path, k, req.ordering, req.lease, attempt)
        lock_here(core, lock, 0, out)
        out.append(SendToLink(req.path[1], lock))
    else:
        retry_later(core, xid, *problem, out)


def give_up(core: BrokerCore, xid: str, reason: str, out: list[Effect]) -> None:
    """At A1: the exchange failed for good before it changed anything."""
    _req, attempt = core.attempts.pop(xid)
    out.append(ExchangeFinished(xid, False, reason, attempt + 1))


def retry_later(core: BrokerCore, xid: str, reason: str, stale: bool, out: list[Effect]) -> None:
    """Try again after a backoff; ``stale``: the cycle does not match the overlay (see
    :data:`MAX_SHAPE_ATTEMPTS`)."""
    req, attempt = core.attempts[xid]
    attempt += 1
    if attempt >= (MAX_SHAPE_ATTEMPTS if stale else MAX_LOCK_ATTEMPTS):
        give_up(core, xid, f"gave up after {attempt} attempts: {reason}", out)
        return
    core.attempts[xid] = (req, attempt)
    out.append(StartTimer(f"lock:{xid}", backoff(xid, attempt)))


def timer(core: BrokerCore, key: str, out: list[Effect]) -> None:
    kind, _, xid = key.partition(":")
    ex = core.ex
    if kind == "lock" and xid in core.attempts and (ex is None or ex.xid != xid):
        try_lock(core, xid, out)
    elif kind in ("lease", "drain") and ex is not None and ex.xid == xid:
        lease_expired(core, ex, out)  # a drain ends as the lease would (see _drains)
    elif kind == "commit" and ex is not None and ex.xid == xid and ex.me == 0 and not ex.granted:
        # Go would reach the far brokers about as long again after Granted came back, and their
        # leases (renewed as Granted passed them) might end first: they would roll back while
        # the near ones rolled forward. Let this try go; nothing has changed anywhere yet.
        undo_lock(core, ex, out, by_lease=True)
        retry_later(core, xid, "Granted did not come back within half the lease", False, out)


def lease_expired(
    core: BrokerCore, ex: Exchange, out: list[Effect], gone: str | None = None
) -> None:
    """Nothing heard from the exchange for a whole lease: a participant or the initiator is
    gone. Before phase 1 nothing has changed, so roll back; after it the new link may carry
    traffic, so roll forward — finish this broker's part without the missing messages.
    ``gone``: it is a member's death that settles this part, not the lease (see
    :func:`_drains`)."""
    _finish_part(core, ex, out, gone)
    _end_bridge(core, ex, out)


def _finish_part(
    core: BrokerCore, ex: Exchange, out: list[Effect], gone: str | None = None
) -> None:
    if not ex.rolls_forward:
        a = ex.a_peer
        if gone is not None and ex.me == ex.last and a is not None and core.routing.has_link(a):
            # A death cut Go off before it got here; A1 may have sent it (Granted passed
            # here), and rolled forward, keeping its end of the added link (see
            # other_a_end_rolled_back). Ahead of the close, so that it comes first.
            why = f"{gone} died before Go reached {core.name}: it rolled back"
            out.append(SendToLink(a, LockRefused(ex.xid, why, ex.attempt, final=True)))
        undo_lock(core, ex, out, by_lease=True)
        if ex.me == 0:
            retry_later(core, ex.xid, "lease expired while locking", False, out)
        return
    if ex.me == 0 and not (ex.gray or ex.k == 0) and ex.a_peer is not None:
        core.unconfirmed[ex.xid] = (ex.a_peer, ex.attempt)  # R1 took no Go that reached here
        while len(core.unconfirmed) > 64:
            del core.unconfirmed[next(iter(core.unconfirmed))]
    ex.marks.add(Mark.BY_LEASE)
    r = ex.r_peer
    if r is not None and core.routing.has_link(r):
        if not ex.has(Mark.PHASE2):
            phase2(core, ex, out)
        if _drains(core, ex, gone, out):
            return  # on the other R end's separator (on_separator), or the lease
        ex.marks.add(Mark.OTHER_SEPARATOR)
        close_removed_link(core, ex, out)
    if ex.is_a and ex.phase is not Phase.CLOSING:
        ex.phase = Phase.GRAY
        ex.marks |= {Mark.OTHER_SEPARATOR, Mark.RELAY_END, Mark.ECHO, Mark.END}
        maybe_release_queue(core, ex, out)
        maybe_finish_a(core, ex, out)
    if core.ex is not ex:
        return  # finishing our part completed the exchange after all
    core.leave_exchange(ex, by_lease=True)
    if ex.me == 0:
        _req, attempt = core.attempts.pop(ex.xid)
        reason = "lease expired after phase 1 began: rolled forward"
        out.append(ExchangeFinished(ex.xid, False, reason, attempt + 1))


def _drains(core: BrokerCore, ex: Exchange, gone: str | None, out: list[Effect]) -> bool:
    """Whether this R end, settling because ``gone`` died (not the other R end, which lives),
    keeps the removed link open until the other R end's separator has come over it.

    The other R end may still be sending black notifications over the link: its side's
    separator has not come (the death cut this side off before it, or before Go reached the
    far side). Closed at once, the link dropped them on arrival, untold (simulator: b4, between
    R2 and A2, dead after Granted passed it and before Go came: 22 events of A1's side lost at
    A2's side). When this end's Settle walks on over the link (the death was on its side),
    the other R end settles on it, and drains too; when the Settle came over the link, the
    other end drains already. Each sends the other its own separator, if it has not yet:
    nothing black follows it from there. So each closes once it has the other's, or after a
    repair timeout (the other end rolled back: Go never reached it). Not on the lease (nothing
    is left to come then), nor towards an older peer, which sends no separator on settling."""
    r = ex.r_peer
    if gone is None or r is None or gone == r or r in core.no_handover:
        return False
    if not ex.has(Mark.DRAINING):
        ex.marks.add(Mark.DRAINING)
        # What still comes over the link is black, and the tree here is the new one already:
        # passed on untagged, it went round through the added link to the side it came from,
        # and was delivered there twice (simulator: 15). As replays, each broker delivers it
        # only if newer than what it had.
        core.deduped.add(r)
        if not ex.gray:  # an R end passes its own side's separator over the link as it turns
            out.append(SendToLink(r, Separator(ex.xid, ex.side)))
        # The other end may never send one: it rolled back (Go did not reach it), and keeps
        # the link. What was on its way over the link has come within a repair timeout.
        out.append(StartTimer(f"drain:{ex.xid}", core.repair_timeout))
    return not ex.has(Mark.OTHER_SEPARATOR)


def settle(
    core: BrokerCore,
    ex: Exchange,
    gone: str,
    away_from: str,
    out: list[Effect],
    *,
    handover: bool = False,
    keep: bool = False,
) -> None:
    """``gone``, a member of the cycle, is dead (this broker's detector or its fence said so, or
    a :class:`Settle` came from ``away_from``): settle this broker's part now, as at the
    lease's end, and, when that rolls it forward, tell the next broker away from ``away_from``
    first (the Settle goes out ahead of the removed link's close).

    Only a roll forward walks on. Go passed every broker the walk reaches before this one (it
    runs from A1 towards A2 and the walk follows it, or it passed them on its way here), or on
    side 2 the separator that can overtake it did, so each rolls forward too, as its lease
    would have made it. A roll back is left to the lease and the
    final refusal: a Settle walking back towards A1 could meet Granted on its way and roll back
    brokers that A1's Go is about to begin.

    Before it, the brokers away from the dead one stayed locked for the whole lease (30 s by
    default): no acknowledgement for their publishers, the removed link known at one end only,
    the supervisor's restore waiting on them. Worse, with R1 dead, R2 and the A ends still
    locked took what the other side published for black (sent before the sender locked), which
    crosses only the removed link, gone with R1: in the simulator, everything from side 2 to
    side 1 from the death to the lease's end was lost.

    A roll back walks on too where Go can no longer come: the dead broker is before this one
    on the path (Go runs through it, and one it passed on before it died is here first), and
    the walk comes from there (see :func:`_go_cut_off`).

    ``handover``: the walk says that what went the way of ``gone`` (a cycle member other than
    an A end, dead in phase 1) is handed over (core.handover); so does this broker's walk if
    it is one of the dead one's two neighbours. Passed on to every peer that understands it,
    up to the A end, which holds for it."""
    if away_from == gone:
        keep = a2_left_a1_out(core, ex, gone)
    keep = keep and ex.k == 0 and gone == ex.path[-1]  # as a2_left_a1_out: from a walk, checked
    if keep and keeps_removed(core, ex):
        keep_removed(core, ex, out)  # ahead of the walk over it: the other R end keeps it too
    if ex.rolls_forward or _go_cut_off(ex, gone, away_from):
        tell = handover or (away_from == gone and handed_over(ex, gone))
        _walk_on(core, ex, gone, _away(ex, away_from), out, handover=tell, keep=keep)
    lease_expired(core, ex, out, gone)


def a2_left_a1_out(core: BrokerCore, ex: Exchange, gone: str) -> bool:
    """Whether this broker, A2's neighbour on the path, rolling forward, finds that A2 died
    before it rolled forward itself: A2's last list does not name A1 (it names the added link
    only from its roll-forward on, see BrokerCore._unlisted). Then the repair around A2 leaves
    A1 out; A1's added link went with A2, and the R ends, which roll forward as Go reaches
    them, closed the removed link: A1's side was cut off until a restore (simulator: 2,470
    events lost on a path of three, 7,180 on the chain b0-...-b5 exchanging b0-b1 for b0-b5).
    The walk this broker starts says so (``Settle.keep``), and the R ends keep the removed
    link instead (:func:`keep_removed`); A1 waits for that walk before it repairs around A2
    (:func:`a2_dead_unlisted`), so that what it sent A2 is replayed over the kept link.

    Only where A1 is R1 (k = 0): A1 then turns the link over itself, and its replay goes out
    ahead of anything newer. With brokers between A1 and R1, what they sent towards A2 went
    through A1, while what they send once R1 has the kept link's routes goes straight to it,
    ahead of A1's replay, which is then dropped as had (simulator: 340-510 events lost); the
    overlay splits there as before, until a restore (docs/reconfiguration.md)."""
    return (
        ex.rolls_forward
        and ex.k == 0
        and gone == ex.path[-1]
        and ex.me == ex.last - 1
        and ex.path[0] not in core.heard_list(gone)
    )


def _go_cut_off(ex: Exchange, gone: str, away_from: str) -> bool:
    """Whether Go can no longer reach this broker, which has not begun phase 1: ``gone`` is
    before it on the path, and what says so comes from that side (its own verdict on its
    neighbour there, or a walk from it). Then nobody on from here can be committed any more,
    and they all roll back now. They used to wait for their lease (30 s by default) when A1
    died while it locked the path, its publishers unacknowledged meanwhile (`canopy bench
    faults --only exchange`: 1 kill of 16, 30 s)."""
    me = ex.me
    return me > 0 and away_from == ex.path[me - 1] and ex.path.index(gone) < me


def go_implied(
    core: BrokerCore, ex: Exchange, gone: str, away_from: str, out: list[Effect]
) -> None:
    """At A2, not in phase 1, when a death before it on the path means Go can no longer come
    (see :func:`_go_cut_off`): if A1 has committed, phase 1 begins here as if Go had come, so
    that this end rolls forward with A1's side instead of taking the added link away under it.
    A1 lists the added link (and sends that list over it, and with Go) only from its commit
    on, so A1's list naming this broker says it committed. Only for a death at R2 or beyond:
    Go then got past R1, which closes the removed link; one before R1 rolls everything back,
    and A1 with it (:func:`other_a_end_rolled_back`).

    Rolled back, A2 dropped the added link while R1 closed the removed one: A1's side was
    cut off until a restore (simulator: 12,300 events lost on the chain b0-...-b5 with R2
    dead, 47 in the fault simulator's seed 43). (Found and first written by a helper's review
    of the fault simulator's seeds 30 and 43.)"""
    if (
        ex.me == ex.last
        and not ex.rolls_forward
        and ex.promised
        and _go_cut_off(ex, gone, away_from)
        and ex.path.index(gone) > ex.k  # R2 or beyond: Go reaches R1 (it closes r)
        and core.name in core.heard_list(ex.path[0])
    ):
        go(core, ex, out)


def _walk_on(
    core: BrokerCore,
    ex: Exchange,
    gone: str,
    onward: str | None,
    out: list[Effect],
    *,
    handover: bool = False,
    keep: bool = False,
) -> None:
    if (
        onward is not None
        and onward != gone  # the walk from an A end that lost the other: its last hop
        and onward not in core.unsettled
        and core.routing.has_link(onward)
    ):
        tell = handover and onward not in core.no_handover
        keep = keep and onward not in core.no_keep_removed
        out.append(SendToLink(onward, Settle(ex.xid, ex.attempt, gone, handover=tell, keep=keep)))


def defer_settle(ex: Exchange, gone: str) -> bool:
    """Whether this broker's own verdict that ``gone``, its neighbour on the cycle, died waits
    instead of settling now (phase 1 has begun here). It settles once the repair around
    ``gone`` is through (:meth:`BrokerCore._finish_repair`).

    **An A end's neighbour on its side.** The repair replays what its chain partners had sent
    to the dead broker: older than what the A end holds in its queue (notifications that
    crossed the added link). Released as the A end settled, the queue came first, and the
    replay after it was dropped as had (simulator: b1 killed in phase 1 of an exchange on
    b0-…-b5, 56 events lost). So the A end waits for its chain partners' :class:`ReplayEnd`.
    Only the A ends: a middle broker or an R end that waited kept the removed link open while
    replays came in over the repair's links, and they crossed it as well as the added link
    (simulator: 240 duplicates with a broker between R2 and A2 dead).

    **A1's death.** If ``gone`` is A1 and the removed link does not touch it, the removed link
    is the only way between the two sides until the repair around A1 links A1's other path
    neighbour P with A2. Settled at once, whichever of the two heard first started the walk
    that closes the removed link, its R1 withdrew the routes over it from P's side, and the
    events published there before the repair's routes came round went nowhere, untold: A2 (R2)
    declared b0 dead 26-150 ms before b1 in 3 of 16 kills on `canopy up` and in CI, 14-70
    events lost. Instead P settles once its repair's routes are in (not its replay: A2's comes
    only after the walk), and its Settle walks to R1 behind them, so every broker it passes can
    reach A2's side the new way before R1 withdraws the old one. A2 *bridges*: it keeps the
    removed link and takes what comes over it, and holds what comes over its repair links
    (``bridged``) until that walk reaches it, behind the last of what R1 sent over the removed
    link; then it settles and takes the held ones as replays (see :func:`_end_bridge`).

    Not when this broker already waits on another repair (the second death settles it now),
    nor when A2 has had End (the removed link is gone: nothing to bridge)."""
    if not ex.rolls_forward or ex.waits_on:
        return False
    if gone == ex.path[0] and ex.k > 0 and ex.me in (1, ex.last):  # A1, off the removed link
        if ex.me == 1:
            ex.after_repair = gone
        elif ex.has(Mark.END):
            return False
        else:
            ex.bridge = gone
        return True
    if ex.is_a and gone == ex.down:  # an A end's neighbour on its own side
        ex.after_repair, ex.after_replay = gone, True
        return True
    return False


def a1_dead_before_go(ex: Exchange, gone: str) -> bool:
    """Whether this broker's verdict that ``gone`` died waits for Go: this is A2, ``gone`` is
    A1 (off the removed link), and phase 1 has not begun here. Go runs along the path, not
    over the added link, so A1's death does not tell A2 that Go will not come: A1 may have
    passed it on first. Rolled back at once, A2 kept the removed link while R1, which Go had
    reached, rolled forward and closed it, and the events A2's side was owed until the repair
    around A1 came round were lost (simulator: about 200 per kill, A2's view of its links
    left wrong). So the verdict waits (``ex.a1_dead``): Go makes it the death after Go that
    :func:`defer_settle` bridges, and a walk that rolls the path back (where Go never came,
    see :func:`_go_cut_off`) or the lease takes the added link away, and A1 with it (it was
    this broker's neighbour over that link only). Nothing crosses the link meanwhile."""
    if ex.me == ex.last and gone == ex.path[0] and ex.k > 0 and not ex.rolls_forward:
        ex.a1_dead = True
        return True
    return False


def a2_dead_unlisted(core: BrokerCore, ex: Exchange, gone: str) -> bool:
    """Whether A1's verdict that ``gone``, A2, died waits for the walk from its path (see
    :func:`a2_left_a1_out`): A1 has committed, and no list of A2's named it yet, so A2 may have
    died before it rolled forward. Settled at once, A1's own walk (which knows nothing of
    A2's list) reached the R ends first, and they closed the removed link; repaired at once,
    A1 replayed what it had sent A2 before the kept link's routes reached it, into nothing.
    The walk from A2's path neighbour comes behind those routes. The caller times the wait
    (a repair timeout), after which the verdict goes ahead as before."""
    if (
        ex.me == ex.k == 0
        and gone == ex.path[-1]
        and ex.rolls_forward
        and not ex.a2_dead
        and core.name not in core.heard_list(gone)
    ):
        ex.a2_dead = True
        return True
    return False


def _end_bridge(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    """A2 settled while it bridged (see :func:`defer_settle`): take what its repair links
    brought meanwhile, and from now on take their publications as replays, delivered only if
    newer than what this broker had from that publisher. Copies that took the new way while a
    broker of A1's side still had both ways (from the repair's routes until R1's withdrawal
    reached it) can arrive after the walk, which they do not run behind (simulator: 7
    duplicates). A link brings each publisher's events in order, and the old way carried a
    prefix of them, so a copy that is not newer came the old way too: nothing is lost."""
    held, ex.bridged, ex.bridge = ex.bridged, [], None
    core.deduped |= ex.bridge_peers
    for inp in held:
        if core.routing.has_link(inp.peer):  # else it went meanwhile, and is repaired around
            core.from_link(inp, out)


def _away(ex: Exchange, source: str) -> str | None:
    """The next broker of the path away from ``source`` (a neighbour on the cycle), never
    across the added link: None at the path's end."""
    path, i = ex.path, ex.me
    before = path[i - 1] if i > 0 else None
    after = path[i + 1] if i + 1 < len(path) else None
    if source == before or (i == 0 and source == path[-1]):  # A1 lost A2: into the path
        return after
    if source == after or (i == len(path) - 1 and source == path[0]):  # A2 lost A1
        return before
    return None


def on_settle(core: BrokerCore, peer: str, msg: Settle, out: list[Effect]) -> None:
    """A path neighbour settled its part of an exchange after a member died (see
    :func:`settle`). A Settle of an exchange or try this broker no longer holds is late. One
    that finds phase 1 not begun here rolls it back if the dead broker is before this one and
    the walk comes from there (Go can no longer come, see :func:`_go_cut_off`); any other is
    left to the lease."""
    ex = core.ex
    if ex is None or ex.xid != msg.xid or ex.attempt != msg.attempt:
        return
    path, me = ex.path, ex.me
    if peer not in path or abs(path.index(peer) - me) != 1:
        raise ProtocolError(f"{core.name}: Settle of {ex.xid} from {peer}, not a path neighbour")
    # The dead member is behind the sender, as the walk goes (or, for a walk an A end began
    # when it lost the other, that other A end at the path's far end): a Settle naming anybody
    # else is not one a death started, and must not settle the rest of the path early.
    up = path.index(peer) < me
    dead = path.index(msg.gone) if msg.gone in path else None
    behind = dead is not None and (
        (up and (dead < me or dead == len(path) - 1)) or (not up and (dead > me or dead == 0))
    )
    if not behind or msg.gone == core.name:
        raise ProtocolError(f"{core.name}: Settle of {ex.xid} from {peer} names {msg.gone!r}")
    go_implied(core, ex, msg.gone, peer, out)
    if ex.rolls_forward or _go_cut_off(ex, msg.gone, peer):
        if msg.handover and ex.rolls_forward:
            core.expect_handover(ex, msg.gone, out)  # before the settling releases its queue
        settle(core, ex, msg.gone, peer, out, handover=msg.handover, keep=msg.keep)


def lock_problem(
    core: BrokerCore, path: tuple[str, ...], i: int, *, renewed: bool = False
) -> tuple[str, bool] | None:
    """Why this broker cannot lock for the exchange at position ``i`` (None if it can), and
    whether that is because the path does not match the overlay (stale) rather than busy.
    ``renewed``: a new try of the exchange this broker was locked for takes its place; A2
    still has the added link, frozen, from the old try."""
    routing = core.routing
    if core.ex is not None:
        return f"{core.name} is locked by exchange {core.ex.xid}", False
    holding = core.repair_holding
    if holding is not None:
        # A crash repair waits for its routes, holding what this broker routes towards its
        # chain. Reshaped meanwhile, the tree let newer notifications reach a chain neighbour
        # by another path; the held ones, replayed after, were dropped there as had (chaos
        # soak: an exchange moved b1 to b2 while b4 held b1's share; 457 lost untold). Busy:
        # the repair ends within its timer, and the exchange is tried again.
        return f"{core.name} is repairing around {holding}", False
    if i < len(path) - 1:
        nxt = path[i + 1]
        if not routing.has_link(nxt):
            return f"{core.name} {NO_LINK} {nxt}", True
        if routing.is_frozen(nxt):
            return f"{core.name}'s link to {nxt} is held by another exchange", False
    if i in (0, len(path) - 1):
        other = path[-1] if i == 0 else path[0]
        if routing.has_link(other) and not (renewed and routing.is_frozen(other)):
            return f"{core.name} {LINKED_ALREADY} {other}", True
    return None


def lock_here(core: BrokerCore, lock: Lock, i: int, out: list[Effect]) -> None:
    ex = Exchange(
        lock.xid,
        lock.path,
        lock.k,
        i,
        lock.ordering,
        lock.lease,
        attempt=lock.attempt,
    )
    core.ex = ex
    out.append(StartTimer(f"lease:{ex.xid}", ex.lease))
    if i == 0:
        out.append(StartTimer(f"commit:{ex.xid}", ex.lease / 2))
    a = ex.a_peer
    if a is None:
        return
    if not core.routing.has_link(a):  # an A end: the added link from now on, frozen
        core.routing.open_frozen(a)
        out.append(OpenLink(a))
        return
    # A2 kept it from the try this one renews (see on_lock): nothing crosses it before phase 1,
    # so it serves the new try as it is. Closed and opened again in one turn, it was closed
    # under the new try: A1 had opened its end again (promoting a standby link, or dialing)
    # before the new Lock came round the path, and this end had taken that connection for the
    # old try's link. Told goodbye, A1 never dialed again; the exchange ran to its end without
    # the link, and the two sides stayed apart until both leases ran out (CI, b1 and b2 of
    # test_an_inner_broker_and_a_leaf_killed_while_exchanges_run: 30 s). The runtime is told
    # all the same: if A1 closed its end of the old try's connection, this end must connect
    # afresh (when it is the one that dials, nobody else will).
    out.append(OpenLink(a, kept=True))


def release(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    """Leave the exchange (normal end)."""
    core.leave_exchange(ex, by_lease=False)
    if ex.me == 0 and ex.phase is Phase.CLOSING:
        _req, attempt = core.attempts.pop(ex.xid)
        by_lease = ex.has(Mark.BY_LEASE)
        reason = "lease expired after phase 1 began: rolled forward" if by_lease else ""
        out.append(ExchangeFinished(ex.xid, not by_lease, reason, attempt + 1))


def on_done(core: BrokerCore, peer: str, ex: Exchange, msg: Done, out: list[Effect]) -> None:
    """The other side's advertisement, complete: apply what differs from what we hold."""
    if peer != ex.a_peer:
        raise ProtocolError(f"{core.name}: Done of {ex.xid} from {peer}, not over the added link")
    ex.fire(Step.DONE)
    core.routing.sync_from(peer, msg.keys, out)
    maybe_release_a(core, ex, out)


def on_lock(core: BrokerCore, peer: str, msg: Lock, out: list[Effect]) -> None:
    path = msg.path
    if core.name not in path:
        raise ProtocolError(f"{core.name}: lock {msg.xid} for a path it is not on")
    i = path.index(core.name)
    if i == 0 or path[i - 1] != peer:
        raise ProtocolError(f"{core.name}: lock {msg.xid} arrived from {peer}, not path[{i - 1}]")
    held = core.ex
    renewed = (
        held
        if held is not None
        and held.xid == msg.xid
        and held.attempt < msg.attempt
        and not held.granted
        else None
    )
    if renewed is not None:
        # A1 gave up on the try that locked us and tries again: the old lock changed nothing
        # yet (never granted), so the new one takes its place. A2 keeps the added link (see
        # :func:`lock_here`).
        core.leave_exchange(renewed, by_lease=False)
    problem = lock_problem(core, path, i, renewed=renewed is not None)
    if problem is not None:
        if renewed is not None:
            _close_added_link(core, renewed, out)
        reason, stale = problem
        out.append(SendToLink(peer, LockRefused(msg.xid, reason, msg.attempt, stale=stale)))
        return
    lock_here(core, msg, i, out)
    if i == len(path) - 1:
        assert core.ex is not None
        on_granted(core, core.ex, out)  # the last lock grants
    else:
        out.append(SendToLink(path[i + 1], msg))


def undo_lock(core: BrokerCore, ex: Exchange, out: list[Effect], *, by_lease: bool = False) -> None:
    """Leave an exchange that never started phase 1 (only an A end has changed anything);
    ``by_lease``: on the lease's word, so late answers to this try are expected and dropped."""
    _close_added_link(core, ex, out)
    core.leave_exchange(ex, by_lease=by_lease)


def _close_added_link(
    core: BrokerCore, ex: Exchange, out: list[Effect], *, frozen: bool = True
) -> None:
    """Drop the added link (``frozen``: only while nothing has crossed it yet)."""
    a = ex.a_peer
    routing = core.routing
    if a is not None and routing.has_link(a) and (routing.is_frozen(a) or not frozen):
        routing.remove_link(a, out)
        out.append(CloseLink(a))


def abandon_lock(
    core: BrokerCore, ex: Exchange, dead: str, out: list[Effect], *, final: bool = True
) -> None:
    """A neighbour of this broker died while it held an ungranted lock. Nothing has changed
    here but the lock (and an A end's frozen link), so the try is given up as a refusal would
    give it up — at once, rather than at the lease's end — and the repair can run now.
    ``final`` (the dead broker was on the cycle): the path has lost a broker, so A1 reports the
    exchange failed instead of retrying it, and its caller re-plans from the live tree. Not
    final (it was off the cycle): this broker's repair is busy, and A1 tries again after a
    backoff. Answers to the try that still come are dropped (see ``Lock.attempt``)."""
    reason = f"{dead} died on the path" if final else f"{core.name} is repairing around {dead}"
    if final and _go_cut_off(ex, dead, dead):
        _walk_on(core, ex, dead, _away(ex, dead), out)
    undo_lock(core, ex, out, by_lease=True)
    if ex.me == 0:
        if final:
            give_up(core, ex.xid, reason, out)
        else:
            retry_later(core, ex.xid, reason, False, out)
    elif ex.path[ex.me - 1] != dead:
        refusal = LockRefused(ex.xid, reason, ex.attempt, final=final)
        out.append(SendToLink(ex.path[ex.me - 1], refusal))


def other_a_end_rolled_back(
    core: BrokerCore, peer: str, msg: LockRefused, out: list[Effect]
) -> bool:
    """A final refusal over the added link, from its other end: A2 rolled back, a death on
    the path having cut Go off before it (see :func:`_finish_part`). Returns whether it is
    that, and done with.

    A1 may have committed (sent Go) and rolled its side forward meanwhile, keeping its end of
    the added link: the link was known at one end only until the supervisor's restore (on real
    processes, `canopy bench faults --only exchange`: 1-3 kills in 16 at 6-9 ms). If R1 has
    not taken Go (its transfer and separator are not here; with A1 as R1, it has), no broker
    of the path has turned anything: R1 and everything beyond the death rolled back, the
    removed link stays, and nothing crossed the added one. So A1 rolls back too, and drops
    it. If R1 has taken Go, the far side of the death should not have rolled back, and
    nothing here can mend that: the link stays, as before. Nor when a repair has taken the
    link up meanwhile (the dead one's neighbours were A1 and A2), unless it held its sweep for
    this (``sweep_held``): then the link stays, as that repair's."""
    ex = core.ex
    if ex is not None and ex.xid == msg.xid and ex.me == 0 and peer == ex.a_peer:
        if msg.attempt != ex.attempt:
            return True  # an old try's
        if not ex.granted:
            # Before the commit: it came over the added link ahead of Granted, still on its
            # way along the path. Given up as by lease, so that Granted is dropped when it
            # comes, not refused as a protocol error (review).
            undo_lock(core, ex, out, by_lease=True)
            give_up(core, ex.xid, msg.reason, out)
            return True
        if ex.gray or ex.k == 0:
            return True
        if ex.sweep_held is not None:
            core.adopt_added_link(ex, out)  # the repair around R1 links the two A ends
        elif core.repair_uses(peer):
            return True
        else:
            _close_added_link(core, ex, out, frozen=False)
            core.leave_exchange(ex, by_lease=True)
        give_up(core, ex.xid, msg.reason, out)
        return True
    if core.unconfirmed.get(msg.xid) != (peer, msg.attempt):
        return False  # not this try's end of the link (a link can be kept across tries)
    del core.unconfirmed[msg.xid]
    if core.routing.has_link(peer) and not core.repair_uses(peer):
        core.routing.remove_link(peer, out)
        out.append(CloseLink(peer))
    return True


def on_refused(core: BrokerCore, ex: Exchange, msg: LockRefused, out: list[Effect]) -> None:
    if ex.granted:
        raise ProtocolError(f"{core.name}: lock of {ex.xid} refused after it was granted")
    ex.fire(Step.REFUSED)
    undo_lock(core, ex, out)
    if ex.me == 0 and msg.final:
        give_up(core, ex.xid, msg.reason, out)
    elif ex.me == 0:
        # A broker from before the field, on the path, drops it as it passes the refusal on:
        # its text still says.
        stale = msg.stale or NO_LINK in msg.reason or LINKED_ALREADY in msg.reason
        retry_later(core, ex.xid, msg.reason, stale, out)
    else:
        out.append(SendToLink(ex.path[ex.me - 1], msg))


def on_granted(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    """Granted passes towards A1, changing nothing; at A1 it is the moment to commit or not."""
    ex.fire(Step.GRANTED)
    if ex.me > 0:
        out.append(SendToLink(ex.path[ex.me - 1], Granted(ex.xid, ex.attempt)))
    else:  # A1, within half the lease of its lock (else its "commit" timer let the try go)
        go(core, ex, out)


def go(core: BrokerCore, ex: Exchange, out: list[Effect], a1_list: tuple[str, ...] = ()) -> None:
    """A1's commit, or its Go passing: phase 1 starts here. A1's list rides along (see
    ``Go.a1_list``); A1's path neighbour and A2 take it (checked before anything changes)."""
    if a1_list and (ex.me == ex.last or (ex.me == 1 and ex.k > 0)):  # not across the removed link
        core.heard_with_go(ex.path[0], a1_list, newest=ex.me == 1)
    ex.fire(Step.GO)
    if ex.me == 0:
        a1_list = core.own_list()  # with A2 in it from now on
    # Go goes on before this broker's own phase-1 work, so the broker after it has begun phase
    # 1 before anything of phase 1 (e.g. this R end's separator over r) reaches it.
    if ex.me < ex.last:
        out.append(SendToLink(ex.path[ex.me + 1], Go(ex.xid, ex.attempt, a1_list)))
    if ex.is_r:
        r = ex.r_peer
        assert r is not None
        core.routing.freeze(r)
        keys = tuple(sorted(core.routing.held_from(r), key=RouteKey.sort_key))
        core.to_peer(ex.a_end_of_my_side, Transfer(ex.xid, keys), out)
        core.to_peer(ex.a_end_of_my_side, Separator(ex.xid, ex.side), out)


def from_peer(
    core: BrokerCore, peer: str, msg: Transfer | Relay | RelayEnd | Separator, out: list[Effect]
) -> None:
    """Out-of-band messages to an A end: the transfer, relays, RelayEnd, its separator."""
    ex = core.ex
    if ex is None or ex.xid != msg.xid or not ex.is_a:
        if msg.xid in core.left:
            return  # late: we finished this exchange by lease
        raise ProtocolError(
            f"{core.name}: {type(msg).__name__} for exchange {msg.xid} it is not an A end of"
        )
    if peer != ex.r_end_of_my_side:
        raise ProtocolError(
            f"{core.name}: {type(msg).__name__} of {ex.xid} from {peer}, "
            f"not from this side's R end {ex.r_end_of_my_side}"
        )
    a = ex.a_peer
    assert a is not None
    routing = core.routing
    if isinstance(msg, Transfer):
        ex.expect(Step.TRANSFER)
        if len(set(msg.keys)) != len(msg.keys) or routing.held_from(a):
            raise ProtocolError(f"{core.name}: transfer of {ex.xid} repeats keys or came twice")
        out.append(StartTimer(f"lease:{ex.xid}", ex.lease))  # the exchange is alive: renew
        routing.learn(a, msg.keys, out)
    elif isinstance(msg, Relay):
        ex.expect(Step.RELAY)
        routing.check(a, msg.message)
        out.append(StartTimer(f"lease:{ex.xid}", ex.lease))
        routing.apply(a, msg.message, out)
    elif isinstance(msg, RelayEnd):
        ex.fire(Step.RELAY_END)
        out.append(StartTimer(f"lease:{ex.xid}", ex.lease))
        maybe_release_queue(core, ex, out)
    elif isinstance(msg, Separator):
        if msg.side != ex.side:
            raise ProtocolError(f"{core.name}: the other side's separator came out of band")
        ex.expect(Step.SEPARATOR_TO_A)
        out.append(StartTimer(f"lease:{ex.xid}", ex.lease))
        on_separator(core, ex, msg.side, out, Step.SEPARATOR_TO_A)
    else:  # pragma: no cover
        raise ProtocolError(f"unknown peer message {msg!r}")


def on_separator(
    core: BrokerCore,
    ex: Exchange,
    side: int,
    out: list[Effect],
    step: Step = Step.OWN_SEPARATOR,
) -> None:
    if side == ex.side:
        # Our side's separator walks down to our R end: everything the transfer changed
        # is in place above us, so notifications entering here may take the new link.
        ex.fire(step)
        if ex.has(Mark.DRAINING):
            return  # settled: this end's separator crossed the removed link as it did
        if ex.is_r:
            phase2(core, ex, out)
            if ex.ordering is Ordering.CAUSAL:
                on_echo(core, ex, out)
            r = ex.r_peer
            assert r is not None
            out.append(SendToLink(r, Separator(ex.xid, side)))
            maybe_finish_r(core, ex, out)
        else:
            out.append(SendToLink(ex.down, Separator(ex.xid, side)))
        return
    # The other side's separator walks up to our A end: no black message from that side
    # follows it.
    ex.fire(Step.OTHER_SEPARATOR)
    if ex.has(Mark.DRAINING):
        # Settled: the walk told this side's brokers, and the other R end closes on this
        # end's separator, not on a SeparatorSeen. The link has done its part.
        lease_expired(core, ex, out)
        return
    if ex.is_r:
        core.to_peer(ex.a_end_of_my_side, RelayEnd(ex.xid), out)
        r = ex.r_peer
        assert r is not None
        if r not in core.no_handover:  # it closes the link on this (see SeparatorSeen)
            out.append(SendToLink(r, SeparatorSeen(ex.xid)))
    if ex.is_a:
        maybe_release_queue(core, ex, out)
    else:
        out.append(SendToLink(ex.up, Separator(ex.xid, side)))
    if ex.is_r:
        maybe_finish_r(core, ex, out)


def phase2(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    """Drop the removed link's routing entries; the withdrawals travel up this side only."""
    r = ex.r_peer
    assert r is not None
    ex.marks.add(Mark.PHASE2)
    if ex.has(Mark.KEPT) or ex.has(Mark.KEPT_THERE):
        return  # what it holds from the other R end is what that end's KeepRemoved said
    routing = core.routing
    routing.forget(r, set(routing.held_from(r)), out)


def close_removed_link(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    r = ex.r_peer
    assert r is not None
    core.deduped.discard(r)  # it drained (see _drains)
    if ex.has(Mark.KEPT_THERE) and not ex.has(Mark.KEPT):
        # The other end keeps it, and this end's repair has not begun (or never will: its
        # verdict differs): a link of the tree at the other end is one here too, not a
        # frozen one that never advertises again.
        keep_removed(core, ex, out)
    if ex.has(Mark.KEPT):
        return  # a repair's link now (see keep_removed): its part in the exchange is done
    core.routing.remove_link(r, out)  # its entries are gone since phase 2: nothing to withdraw
    out.append(CloseLink(r))


def keeps_removed(core: BrokerCore, ex: Exchange) -> bool:
    """Whether this R end, rolling forward, can keep the removed link (the caller knows it
    should: the repair it begins has the other R end as a chain partner, or a walk said
    ``keep``): the other R end understands :class:`KeepRemoved`, and the link is still there,
    held by the exchange (frozen: not kept already).

    That happens on a path of three only: the dead broker was a neighbour of both R ends in
    the tree the exchange leaves (A1, with A2 the other R end; or A2, with A1 the other). The
    repair chain around it links them, and finds them linked already, over the removed link,
    which the exchange then closed: the overlay was split in two until a restore (fault
    simulator: 217 events lost in seed 55 of the sweep over deaths on an exchange's path;
    2,472 in a test). Both ends read the chain from the dead broker's last list, which came
    to both with Go, so both keep it."""
    r = ex.r_peer
    return (
        r is not None
        and ex.rolls_forward
        and r not in core.no_keep_removed
        and core.routing.has_link(r)
        and core.routing.is_frozen(r)
        # Not once the other end may have closed it: it closes on this end's separator with
        # its own separator seen here (this end has sent both, then). Kept here, the link
        # was known at this end only. Before that, this end's KeepRemoved reaches the other
        # ahead of what it waits for, and the other keeps it too (close_removed_link).
        and not (ex.has(Mark.PHASE2) and ex.has(Mark.OTHER_SEPARATOR))
    )


def keep_removed(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    """Keep the removed link (see :func:`keeps_removed`) as a repair keeps a link it opens:
    advertise over it all this end holds from elsewhere, in a :class:`KeepRemoved` that tells
    the other end to hold exactly that, whatever phase 2 left there. The repair's sweep goes
    behind it. The exchange goes on (its separators still order what crossed the two links),
    but neither phase 2 nor its end takes the link away."""
    r = ex.r_peer
    assert r is not None
    ex.marks.add(Mark.KEPT)
    core.kept[ex.xid] = r  # a late KeepRemoved from it is still taken (on_keep_removed)
    while len(core.kept) > 64:
        del core.kept[next(iter(core.kept))]
    want = core.routing.unfreeze(r)
    out.append(SendToLink(r, KeepRemoved(ex.xid, tuple(sorted(want, key=RouteKey.sort_key)))))


def on_keep_removed(core: BrokerCore, peer: str, msg: KeepRemoved, out: list[Effect]) -> None:
    """The other R end keeps the removed link (see :func:`keep_removed`): hold exactly what it
    advertises, and let neither phase 2 nor the exchange's end take that, or the link, away.
    This end keeps the link too once its own repair around the dead broker begins; until then
    it stays frozen here (nothing of this end's is advertised over it)."""
    ex = core.ex
    if ex is not None and ex.xid == msg.xid and peer == ex.r_peer and ex.rolls_forward:
        ex.marks.add(Mark.KEPT_THERE)  # Go crossed the link ahead of it: rolling forward here
    elif core.kept.get(msg.xid) != peer:
        if msg.xid in core.left:
            return  # late, for a link this end closed as the exchange ended: nothing to keep
        # Only the other R end of this exchange, rolled forward, keeps the removed link: from
        # anyone else it would make this end keep a link the exchange replaced, a cycle.
        raise ProtocolError(
            f"{core.name}: KeepRemoved of {msg.xid} from {peer}, not the other end of a link "
            "this broker's exchange removes"
        )
    core.routing.sync_from(peer, msg.keys, out)


def maybe_finish_r(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    """Close the removed link once this end's separator has crossed it both ways: the other
    R end has it (SeparatorSeen; a peer without the hand-over feature sends none) and its own
    has come. Until then this end hears of the other's death, and hands over what it sent
    over the link that the other end may not have passed on (core.handover)."""
    r = ex.r_peer
    seen = ex.has(Mark.SEPARATOR_SEEN) or r in core.no_handover
    if not (ex.has(Mark.PHASE2) and ex.has(Mark.OTHER_SEPARATOR) and seen):
        return
    close_removed_link(core, ex, out)
    if ex.is_a:
        ex.fire(Step.END)  # this broker is its own side's R end: End is here already
        maybe_finish_a(core, ex, out)
    else:
        out.append(SendToLink(ex.up, End(ex.xid, ex.side)))
        release(core, ex, out)


def on_end(core: BrokerCore, ex: Exchange, side: int, out: list[Effect]) -> None:
    if side != ex.side:
        raise ProtocolError(f"{core.name}: End of {ex.xid} for side {side} on side {ex.side}")
    ex.fire(Step.END)
    if not ex.is_a:
        out.append(SendToLink(ex.up, End(ex.xid, ex.side)))
        release(core, ex, out)
        return
    maybe_finish_a(core, ex, out)


def on_echo(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    if not ex.is_a:  # passed on: an A end is where it counts
        ex.expect(Step.ECHO)
        out.append(SendToLink(ex.up, Echo(ex.xid)))
        return
    ex.fire(Step.ECHO)
    maybe_release_queue(core, ex, out)


def maybe_release_queue(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    causal_ready = ex.has(Mark.ECHO) or ex.ordering is not Ordering.CAUSAL
    ready = ex.has(Mark.OTHER_SEPARATOR) and ex.has(Mark.RELAY_END) and causal_ready
    if ex.queue_released or not ready:
        return
    ex.marks.add(Mark.QUEUE_RELEASED)
    queued, ex.queue = ex.queue, []
    for queued_at, inp in queued:
        if isinstance(inp.message, Publish):
            core.record_ordering_delay(ex.xid, core.now - queued_at)
        core.from_link(inp, out)
        if core.ex is not ex:  # a queued Done finished the exchange
            break
    maybe_finish_a(core, ex, out)


def maybe_finish_a(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    if core.ex is not ex or ex.phase is Phase.CLOSING:
        return
    if not (ex.has(Mark.END) and ex.queue_released):
        return
    if ex.bridge is not None or not core.routing.has_link(ex.up):
        # The other A end is dead: nothing to reconcile over the link; finish as by lease
        # (which comes back here, and leaves the exchange after). Its link may be gone
        # already, when this end was also an R end and drained first (see _drains).
        if not ex.has(Mark.BY_LEASE):
            lease_expired(core, ex, out)
        return
    a = ex.a_peer
    assert a is not None
    # Unfreeze the added link: tell the other side exactly what this side advertises; it
    # holds the old advertisement (from its R end's transfer) and applies the difference.
    ex.fire(Step.SEND_DONE)
    want = core.routing.unfreeze(a)
    out.append(SendToLink(a, Done(ex.xid, tuple(sorted(want, key=RouteKey.sort_key)))))
    maybe_release_a(core, ex, out)


def maybe_release_a(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    if ex.phase is Phase.CLOSING and ex.has(Mark.PEER_DONE):
        release(core, ex, out)
