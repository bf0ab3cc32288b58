"""Crash repair (paper 001): when a broker dies, its neighbours close the tree again, and
replay what it may have swallowed.

**Neighbour lists.** Every broker tells its neighbours its own neighbour list
(:class:`Neighbours`) whenever that list changes.

**The chain.** When a neighbour is declared dead (the runtime's failure detector,
:class:`PeerFailed`), each of the dead broker's neighbours links to its predecessor and successor
in the dead broker's last list, in the order that broker gave it: the survivors form a chain
through all of the dead broker's former neighbours, so the overlay is one tree again. Every
survivor computes the chain from the same list, so both ends of each new link open it on their
own. Removing the dead link withdraws its routes; each new link advertises what its end holds, as
an added link does.

**Placement.** The order is the announcing broker's choice (:func:`chain_order`), and it decides
which standby links its neighbours keep warm (the chain links of its death). Where the brokers know
their zone and node, the order puts the neighbours outside the announcer's failure domain first and
alternates zones and nodes along the chain, so a standby link's far end is, where the cluster has
one, on another node or zone than the broker that would die (paper 003: the alternate path shares
no underlay element with the one it replaces). Knowing nothing, the order is by name.

**Custody and replay.** Each broker keeps, per neighbour, the notifications it forwarded there in
the last ``window`` (at most ``limit`` of them): the :class:`Retention`. A dead neighbour may have
acknowledged some of them without passing them on, and the ones queued for it after it died never
left. While a repair runs (:class:`RepairRun`), notifications for the new links are *held*; once
the routes over the whole chain are known, the broker sends the retained ones again, marked
``replay``, then the held ones, in order. Routes are known when a :class:`RepairSweep` has come
from each end of the chain: each end sends one along the chain after its own routes, and each
broker passes it on after the routes it added, so behind a sweep on every link are the routes of
everything it passed (links are FIFO). A broker that already has a replayed notification (its
publisher's sequence number is not above the last one it saw) passes it on but does not deliver
it again: that is what makes the replay free of duplicates, and holding new notifications until
the replay is out is what keeps each publisher's order.

Transitions are data (:data:`TRANSITIONS`); an input with no entry is a :class:`ProtocolError`.
The module owns the lists, the chain rule, the retention and the runs; :class:`BrokerCore`
applies the results to the routing state.
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, TypeVar

from canopy_broker.core.errors import ProtocolError
from canopy_broker.core.events import Event
from canopy_broker.core.messages import (
    Effect,
    Neighbours,
    Publish,
    RepairFinished,
    RepairSweep,
    SendToLink,
)

K = TypeVar("K", int, str)
RELAYED_AT_MOST: Final = 256
"""A neighbour's list is passed on (two hops, ``Neighbours.lists``) only up to this many names,
and no more than this many lists are taken from one message: each message carries every other
neighbour's list, so its size grows with the square of the degree (review: a peer's message of
16,000 names took 2 s to read before the names were a set). A broker with more neighbours than
this is not bridged over (its neighbours repair around it as before)."""
Where = tuple[str, str]
"""A broker's (zone, node); "" for what is not known."""
NOWHERE: Final[Where] = ("", "")


def chain_order(
    own: Where, neighbours: Iterable[str], where: Mapping[str, Where]
) -> tuple[str, ...]:
    """The order in which a broker at ``own`` announces ``neighbours`` (placed by ``where``):
    the repair chain of its death, so each neighbour's chain partners are its standby peers.

    Neighbours in another zone than ``own`` come first, then those in its zone on another node,
    then those on its node: whatever takes the announcer down (its node, its zone) takes the
    fewest chain partners with it, and the survivors of a zone failure sit next to each other
    in the chain. Within each group, consecutive brokers (a standby link) are in different
    zones, and in a zone on different nodes, wherever the counts allow it. Unknown placement
    counts as nowhere in particular: with none known the order is by name."""

    def group(n: str) -> int:
        zone, node = where.get(n, NOWHERE)
        if own[1] and node == own[1]:
            return 2
        return 1 if own[0] and zone == own[0] else 0

    def zone(n: str) -> str:
        return where.get(n, NOWHERE)[0]

    def node(n: str) -> str:
        return where.get(n, NOWHERE)[1]

    out: list[str] = []
    for _, members in sorted(_bucket(sorted(set(neighbours)), group).items()):
        by_zone = _bucket(members, zone)
        out.extend(_apart({z: _apart(_bucket(ns, node)) for z, ns in by_zone.items()}))
    return tuple(out)


def _bucket(names: Iterable[str], key: Callable[[str], K]) -> dict[K, list[str]]:
    out: dict[K, list[str]] = {}
    for n in names:
        out.setdefault(key(n), []).append(n)
    return out


def _apart(buckets: Mapping[str, Sequence[str]]) -> list[str]:
    """All members of ``buckets`` (each bucket's in its order) with as few neighbours from
    the same bucket as possible: always the next of the fullest bucket other than the last
    one taken (ties by key). This greedy is optimal: the pairs left are those the largest
    bucket forces, ``max(0, 2 * largest - total - 1)``."""
    left = {k: list(v) for k, v in buckets.items() if v}
    out: list[str] = []
    last: str | None = None
    while left:
        order = sorted(left, key=lambda k: (-len(left[k]), k))
        k = next((c for c in order if c != last), order[0])
        out.append(left[k].pop(0))
        if not left[k]:
            del left[k]
        last = k
    return out


def chain_links(dead_neighbours: Sequence[str], me: str) -> tuple[str, ...]:
    """The brokers ``me`` links to when the broker whose neighbours were ``dead_neighbours``
    dies: its predecessor and successor in that list, in the list's order (a chain through all
    of them). Empty if ``me`` is not in the list (it learnt a stale one, or none)."""
    chain = list(dict.fromkeys(dead_neighbours))
    if me not in chain:
        return ()
    i = chain.index(me)
    return tuple(sorted(chain[j] for j in (i - 1, i + 1) if 0 <= j < len(chain)))


def standby_peers(
    me: str, neighbours: Sequence[str], lists: Mapping[str, Sequence[str]]
) -> tuple[str, ...]:
    """The brokers a repair could link ``me`` to, over every single failure of a neighbour:
    for each neighbour N, ``me``'s predecessor and successor in N's last announced list (the
    :func:`chain_links` of N's death), less those ``me`` is linked to already. Known before
    anything fails, so the runtime keeps them as standby links (paper 003) and a repair finds
    its new links open. Symmetric: both ends of a chain link read it from the same list."""
    current = set(neighbours)
    want: set[str] = set()
    for n in current:
        want.update(chain_links(lists.get(n, ()), me))
    want -= current | {me}
    return tuple(sorted(want))


def bridge_ends(
    one: str, one_list: Sequence[str], other: str, other_list: Sequence[str]
) -> tuple[str, ...]:
    """The bridge over two neighbours, ``one`` and ``other``, that died together, given each
    one's last list: the survivors that each repair's chain linked to the other dead broker,
    as one chain. Their links close the tree again.

    Why: each dead broker's neighbours chain up along its list (:func:`chain_links`), and
    that chain runs through the other dead broker, so it falls apart at it: into at most two
    pieces on each side, four in all. Only the survivors next to the other dead broker in a
    chain find out (their link to it never connects: the runtime's probe declares it dead),
    so only they may take new links. Each piece has exactly one of them at an end, so the
    pieces are joined by a chain over those, in an order every one of them computes alike:
    first the list of the dead broker whose name sorts first, then the other's. Each gets at
    most two new links, as in a single repair."""
    first, second = sorted(((one, tuple(one_list)), (other, tuple(other_list))))
    ends: list[str] = []
    for (_, names), (partner, _) in ((first, second), (second, first)):
        chain = list(dict.fromkeys(names))
        if partner in chain:
            i = chain.index(partner)
            ends += [chain[j] for j in (i - 1, i + 1) if 0 <= j < len(chain)]
    return tuple(n for n in dict.fromkeys(ends) if n not in (one, other))


class NeighbourLists:
    """What each neighbour last said its neighbours are, and what this broker last said."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lists: dict[str, tuple[str, ...]] = {}
        self.where: dict[str, Where] = {}  # each neighbour's placement, as it last said
        self.own: Where = NOWHERE
        self.legacy: set[str] = set()  # neighbours that take neither order nor placement
        self._announced: tuple[object, ...] | None = None
        self._told: dict[str, Neighbours] = {}  # what each neighbour last heard from us
        self._pending = False  # a neighbour (behind a frozen link) has not heard the list yet
        # Two hops: each neighbour's account of its other neighbours' lists (Neighbours.lists),
        # and, for a dead neighbour, its list with that account, kept for a bridge
        # (bridge_ends) once its repair has begun (the last 16).
        self.second: dict[str, dict[str, tuple[str, ...]]] = {}
        self.spent: dict[str, dict[str, tuple[str, ...]]] = {}
        self._version = 0  # counts changes to the lists heard: each changes what is told

    def heard(self, peer: str, msg: Neighbours) -> None:
        if self.name not in msg.names or peer in msg.names:
            raise ProtocolError(
                f"{self.name}: {peer}'s neighbour list {list(msg.names)} must name this broker "
                "and not itself"
            )
        # Of the second hop, only what can be a list of a neighbour of ``peer``'s: one of its
        # own, naming ``peer`` and not itself (anything else is stale or wrong: dropped, not
        # refused; a bridge built on it would link brokers that never meet).
        listed = frozenset(msg.names)
        second = {
            n: names
            for n, names in msg.lists[:RELAYED_AT_MOST]
            if n in listed
            and n != self.name
            and len(names) <= RELAYED_AT_MOST
            and peer in names
            and n not in names
        }
        if self.lists.get(peer) != msg.names or self.second.get(peer, {}) != second:
            self._version += 1
        self.lists[peer] = msg.names
        self.where[peer] = (msg.zone, msg.node)
        if second:
            self.second[peer] = second
        else:
            self.second.pop(peer, None)

    def announce(
        self,
        neighbours: Sequence[str],
        out: list[Effect],
        frozen: Callable[[str], bool],
        linked: Collection[str] = (),
    ) -> None:
        """Tell every neighbour the current list (in :func:`chain_order`) and this broker's
        placement if it has not heard them yet. Not over a ``frozen`` link: a reconfiguration's
        new link carries nothing before both its ends have it (the other end would refuse it),
        so the list goes once the link is in use.

        Forgets the lists of brokers that are no longer neighbours, however the link went (an
        exchange removes links without a RemoveLink). Kept, such a list was taken for the
        broker's current one once a repair linked the two again and the broker died before
        it said its new list: this broker chained up with brokers that were no longer that
        broker's neighbours, held notifications for one of them for a sweep that never came,
        and replayed them 10 s later behind newer ones, where they were dropped as had
        (chaos soak: 457 events lost untold at a subscriber). Not those still ``linked``
        and left out of the list for now: the other A end of an exchange, whose list a
        repair needs if it dies before this end lists it (see exchange.defer_settle)."""
        for peer in [p for p in self.lists if p not in neighbours and p not in linked]:
            # The list and placement it said over that link; not ``legacy``, which says
            # what software it runs (a link back over a standby takes no new hello).
            self._drop(peer)
        old = self.legacy.intersection(neighbours)
        names = self.order(neighbours)
        key = (names, self.own, frozenset(old), self._version)
        if key == self._announced and not self._pending:
            return
        if key != self._announced:
            self._announced = key
            self._told = {p: t for p, t in self._told.items() if p in names}
        bare = Neighbours(names)
        heard = [
            (n, self.lists[n])
            for n in names
            if n in self.lists and len(self.lists[n]) <= RELAYED_AT_MOST
        ][:RELAYED_AT_MOST]
        self._pending = False
        for n in names:
            if n in old:
                msg = bare
            else:
                lists = tuple(item for item in heard if item[0] != n)
                msg = Neighbours(names, *self.own, lists=lists)
            if self._told.get(n) == msg:
                continue
            if frozen(n):
                self._pending = True
                continue
            self._told[n] = msg
            out.append(SendToLink(n, msg))

    def order(self, neighbours: Sequence[str]) -> tuple[str, ...]:
        """``neighbours`` as this broker announces them: in chain order, or by name while an
        older broker that would sort them is among them (everybody must read the same chain)."""
        if self.legacy.intersection(neighbours):
            return tuple(sorted(set(neighbours)))
        return chain_order(self.own, neighbours, self.where)

    def heard_with_go(self, peer: str, names: tuple[str, ...], *, newest: bool) -> None:
        """``peer``'s list as an exchange's Go carried it from there (see ``Go.a1_list``):
        ``newest`` where Go came over the link the lists do (nothing it sent before Go is newer),
        else only if no list from it is known (one over another link may be newer)."""
        if self.name not in names or peer in names:
            raise ProtocolError(
                f"{self.name}: {peer}'s list {list(names)} in a Go must name this broker "
                "and not itself"
            )
        if newest or peer not in self.lists:
            if self.lists.get(peer) != names:
                self._version += 1
            self.lists[peer] = names

    def chain_for(
        self, dead: str, *, without: bool = False
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the dead broker's last known neighbours in its order, the ones this broker links
        to); ``without`` this broker, which is not one of them any more."""
        chain = tuple(dict.fromkeys(self.lists.pop(dead, ())))
        self.spent.pop(dead, None)
        self.spent[dead] = self.second.pop(dead, {})
        while len(self.spent) > 16:
            del self.spent[next(iter(self.spent))]
        self._version += 1
        if without:
            chain = tuple(n for n in chain if n != self.name)
        return chain, chain_links(chain, self.name)

    def list_via(self, dead: str, peer: str) -> tuple[str, ...] | None:
        """``peer``'s list as the dead broker ``dead`` last told it here (two hops), if it
        did, and the repair around ``dead`` has begun."""
        return self.spent.get(dead, {}).get(peer)

    def _drop(self, peer: str) -> None:
        listed = self.lists.pop(peer, None) is not None
        if self.second.pop(peer, {}) or listed:
            self._version += 1
        self.where.pop(peer, None)

    def forget(self, peer: str) -> None:
        self._drop(peer)
        self.legacy.discard(peer)


class Retention:
    """What this broker forwarded on each link lately: custody for a crash repair, and what a
    client that fails over to this broker is served from. Bounded by ``window`` (in the
    caller's clock) and by ``limit`` notifications per link.

    At the limit, the oldest entry goes only if it is older than ``horizon`` (the failure
    detection time: a neighbour that has had a notification that long and is not declared dead
    has passed it on); otherwise nothing is dropped and :meth:`pressing` says so, and the
    runtime slows the publishers until entries age out. Custody is never given up silently:
    :attr:`dropped` counts what went early.

    A dead neighbour's notifications are handed to its repair (:meth:`take`) but stay readable
    (:meth:`since`) until they age out: a client of the dead broker that comes back here after
    the repair started still needs them."""

    def __init__(
        self,
        window: float,
        limit: int,
        origin: float = 0.0,
        horizon: float | None = None,
        limit_bytes: int = 0,
    ) -> None:
        self.window = window
        self.limit = limit
        # ... and at most about this many bytes per link (0: no such bound), counted as
        # :func:`event_size` does: by count alone, 300 notifications of 2 MB were 600 MB kept
        # per link for the window (the publisher's broker at 685 MB after they were all
        # delivered; an outside review saw a relaying broker at 2.0 GB).
        self.limit_bytes = limit_bytes
        self.bytes_by_peer: dict[str, int] = {}
        self.sizes_by_peer: dict[str, deque[int]] = {}  # each entry's, as ``by_peer``'s
        self._sized: Event | None = None  # the last notification sized, and its size
        self._size = 0
        self.horizon = window if horizon is None else min(horizon, window)
        self.by_peer: dict[str, deque[tuple[float, Event]]] = {}
        self._taken: dict[str, deque[tuple[float, Event]]] = {}
        self.origin = origin  # when this broker started keeping: it holds nothing from before
        self.dropped = 0  # entries dropped at the limit before the window ended (still safe)
        # When the newest of those was forwarded: a resume from before it may miss something,
        # one from after it is served in full.
        self.dropped_until = -math.inf

    @property
    def enabled(self) -> bool:
        return self.window > 0 and self.limit > 0

    def keep(self, peer: str, now: float, event: Event) -> None:
        kept = self.by_peer.get(peer)
        if kept is None:
            kept = self.by_peer[peer] = deque()
            self.sizes_by_peer[peer] = deque()
            self.bytes_by_peer[peer] = 0
        sizes = self.sizes_by_peer[peer]
        if event is self._sized:  # the same notification kept for its next link: sized once
            n = self._size
        else:
            n = self._size = event_size(event)
            self._sized = event
        kept.append((now, event))
        sizes.append(n)
        size = self.bytes_by_peer[peer] + n
        oldest = now - self.window
        while kept[0][0] < oldest:
            kept.popleft()
            size -= sizes.popleft()
        young = now - self.horizon
        limit, limit_bytes = self.limit, self.limit_bytes or sys.maxsize
        while (len(kept) > limit or size > limit_bytes) and kept[0][0] < young:
            when, _ = kept.popleft()
            size -= sizes.popleft()
            self.dropped += 1
            self.dropped_until = max(self.dropped_until, when)
        self.bytes_by_peer[peer] = size
        if self._taken:
            for dead in [p for p, k in self._taken.items() if k[-1][0] < oldest]:
                del self._taken[dead]

    def pressing(self, now: float) -> bool:
        """Some link holds ``limit`` notifications (or ``limit_bytes``) all younger than the
        horizon: dropping any could lose one for good if that neighbour died now. Ages out the
        rest on the way."""
        full = False
        oldest = now - self.window
        limit_bytes = self.limit_bytes or sys.maxsize
        for peer, kept in self.by_peer.items():
            sizes = self.sizes_by_peer[peer]
            size = self.bytes_by_peer[peer]
            while kept and kept[0][0] < oldest:
                kept.popleft()
                size -= sizes.popleft()
            self.bytes_by_peer[peer] = size
            at_limit = len(kept) >= self.limit or size >= limit_bytes
            if at_limit and kept and kept[0][0] >= now - self.horizon:
                full = True
        return full

    def kept_for(self, peer: str, now: float) -> list[Event]:
        """The notifications kept for ``peer`` within the window, oldest first, left kept (the
        repair around it takes them after: see core.handover)."""
        oldest = now - self.window
        return [e for t, e in self.by_peer.get(peer, ()) if t >= oldest]

    def take(self, peer: str, now: float) -> list[Event]:
        """The notifications kept for ``peer`` within the window, oldest first, for its repair;
        no longer kept for the link (it is gone), still readable by :meth:`since`."""
        kept = self.by_peer.pop(peer, None)
        self.bytes_by_peer.pop(peer, None)
        self.sizes_by_peer.pop(peer, None)
        if not kept:
            return []
        self._taken[peer] = kept
        oldest = now - self.window
        return [e for t, e in kept if t >= oldest]

    def since(self, t: float, now: float) -> list[tuple[float, Event]]:
        """Every notification kept since ``t`` (and within the window), once each, oldest
        first, with when it was forwarded: the same notification forwarded on several links
        is one."""
        start = max(t, now - self.window)
        seen: set[tuple[str, int]] = set()
        found: list[tuple[float, Event]] = []
        for kept in (*self.by_peer.values(), *self._taken.values()):
            for when, event in reversed(kept):
                if when < start:
                    break
                key = (event.publisher, event.seq)
                if key not in seen:
                    seen.add(key)
                    found.append((when, event))
        # Oldest first, and a publisher's own in sequence order: several share a timestamp
        # when the clock is coarse (collected newest first per link, a sort on the time alone
        # gave those backwards, and a failed-over client dropped all but the newest as old).
        found.sort(key=lambda te: (te[0], te[1].publisher, te[1].seq))
        return found

    def covers(self, t: float, now: float) -> bool:
        """Everything forwarded since ``t`` is still kept: the window reaches back that far,
        this broker was already keeping then, and nothing forwarded since was dropped early."""
        return (
            self.enabled and t >= now - self.window and t >= self.origin and t > self.dropped_until
        )

    def depth(self) -> int:
        return sum(len(k) for k in self.by_peer.values())

    def size(self) -> int:
        """About how many bytes are kept, over every link (:func:`event_size`)."""
        return sum(self.bytes_by_peer.values())

    def young(self, now: float) -> int:
        """The most notifications any link holds that are younger than the horizon: what
        counts against the limit (older ones may go when it is reached). A bisection, as the
        entries are in forwarding order."""
        cutoff = now - self.horizon
        return max(
            (len(k) - bisect_left(k, cutoff, key=_forwarded_at) for k in self.by_peer.values()),
            default=0,
        )


def merged(first: Sequence[Event], second: Sequence[Event]) -> list[Event]:
    """The notifications of two replays as one: each once, each publisher's in sequence
    order (a receiver takes a replayed notification at or below the last it saw from that
    publisher for one it had: one replayed behind a later one of its publisher would be
    dropped as such). Across publishers the order is by sequence number, which starts from
    each publisher's clock when it started and grows by one per publication: not publishing
    order, which nothing downstream relies on for a replay (each publisher's is kept).
    Either empty: the other as it is."""
    if not first or not second:
        return list(first or second)
    return in_order((*first, *second))


def in_order(events: Sequence[Event]) -> list[Event]:
    """``events`` each once, in the order :func:`merged` gives a replay: by sequence number,
    so each publisher's in its own order (a replay behind a newer one of its publisher is
    dropped as had)."""
    seen: set[tuple[str, int]] = set()
    out: list[Event] = []
    for event in events:
        key = (event.publisher, event.seq)
        if key not in seen:
            seen.add(key)
            out.append(event)
    out.sort(key=event_order)
    return out


def event_order(event: Event) -> tuple[int, str]:
    return (event.seq, event.publisher)


def event_size(event: Event) -> int:
    """About how many bytes ``event`` holds: what its strings hold, 8 for any other value,
    and an object's overhead per attribute. An estimate for bounds, not an account: a string
    of N characters is N bytes or more; the event's encoding (what a link's queue counts) is
    about as large."""
    n = 64 + len(event.publisher)
    for key, value in event.attrs.items():
        n += 48 + len(key) + (len(value) if isinstance(value, str) else 8)
    return n


def _forwarded_at(entry: tuple[float, Event]) -> float:
    return entry[0]


class Phase(Enum):
    WAITING = "waiting"  # for the sweeps: routes over the chain are not all known yet
    DONE = "done"


class Step(Enum):
    SWEEP_FROM_PREVIOUS = "sweep from the previous broker of the chain"
    SWEEP_FROM_NEXT = "sweep from the next broker of the chain"
    SWEEP_OVER_BRIDGE = "sweep over a bridge link"
    TIMEOUT = "no sweep in time"


TRANSITIONS: Final[dict[Phase, dict[Step, Phase]]] = {
    Phase.WAITING: {
        # DONE once a sweep came from every partner (see complete)
        Step.SWEEP_FROM_PREVIOUS: Phase.WAITING,
        Step.SWEEP_FROM_NEXT: Phase.WAITING,
        Step.SWEEP_OVER_BRIDGE: Phase.WAITING,
        Step.TIMEOUT: Phase.DONE,
    },
    # A finished run still passes late sweeps on (the others need them) but changes nothing.
    Phase.DONE: {
        Step.SWEEP_FROM_PREVIOUS: Phase.DONE,
        Step.SWEEP_FROM_NEXT: Phase.DONE,
        Step.SWEEP_OVER_BRIDGE: Phase.DONE,
    },
}


@dataclass(eq=False)  # identity: a run is one process, hashed as such
class RepairRun:
    """This broker's part in the repair around ``dead``.

    Its *partners* are the brokers it linked to for it: its neighbours in the chain
    (``previous``, ``next``) and, where two neighbours died together, its neighbours on the
    bridge between the pieces of their chains (``bridges``, see :func:`bridge_ends`). The new
    links form a tree, and the sweeps cross it as an echo does: a broker sends its sweep to a
    partner once one came from every other partner (an end of a chain at once, a middle one
    passes it on), so the sweep it sends travels behind the routes of everything on its side;
    it has the routes of the whole tree once one came from every partner."""

    dead: str
    previous: str | None  # this broker's neighbours in the chain (None at an end)
    next: str | None
    retained: list[Event]  # sent to the dead broker lately, then routed here meanwhile
    phase: Phase = Phase.WAITING
    bridges: tuple[str, ...] = ()
    chain: tuple[str, ...] = ()  # the dead broker's list the chain was read from
    also_dead: tuple[str, ...] = ()  # the dead partners a bridge stands in for
    # Each bridge partner's, the dead partner it stands in for: the name the sweeps and the
    # ReplayEnd take over that link. A broker on the far side runs its repair around that
    # one (or bridges over it too), so the name finds its run there.
    bridged_for: dict[str, str] = field(default_factory=dict)
    heard: set[str] = field(default_factory=set)  # partners whose sweep came
    told: set[str] = field(default_factory=set)  # partners sent this broker's sweep
    finished_at: float | None = None
    replay_ends: set[str] = field(default_factory=set)  # chain partners whose ReplayEnd came
    replay_ends_sent: set[str] = field(default_factory=set)  # chain partners told ReplayEnd
    # Links besides the chain's that the replay may take: the way to an exchange's removed
    # link, kept because the chain left this broker out (exchange.a2_dead_unlisted).
    replay_also: tuple[str, ...] = ()

    @property
    def partners(self) -> tuple[str, ...]:
        return tuple(p for p in (self.previous, self.next, *self.bridges) if p is not None)

    def step(self, step: Step, who: str) -> None:
        nxt = TRANSITIONS[self.phase].get(step)
        if nxt is None:
            raise ProtocolError(f"repair of {self.dead}: {step.value} from {who} in {self.phase}")
        self.phase = nxt

    @property
    def complete(self) -> bool:
        return self.phase is Phase.WAITING and self.heard.issuperset(self.partners)

    def sweeps_due(self) -> list[Effect]:
        """The sweeps this broker owes now: to each partner not told yet whose others have all
        sent theirs (at an end of a chain, the one partner at once)."""
        out: list[Effect] = []
        partners = self.partners
        for q in partners:
            if q not in self.told and all(p in self.heard for p in partners if p != q):
                self.told.add(q)
                sweep = RepairSweep(self.name_for(q), forward=q != self.previous)
                out.append(SendToLink(q, sweep))
        return out

    def name_for(self, partner: str) -> str:
        """The dead broker's name this run's messages to ``partner`` go under."""
        return self.bridged_for.get(partner, self.dead)

    def end_died(self, peer: str) -> list[Effect]:
        """``peer``, this broker's partner, died too before its sweep came (a node or zone
        failure takes several brokers at once), or its link was withdrawn: this broker is that
        end of the chain now, and sends what the dead end's sweep would have let it send, so
        the repair completes on the survivors instead of waiting for its timer."""
        if self.phase is not Phase.WAITING:
            return []
        self._drop_partner(peer)
        return self.sweeps_due()

    def _drop_partner(self, peer: str) -> None:
        if peer == self.next:
            self.next = None
        if peer == self.previous:
            self.previous = None
        self.bridges = tuple(b for b in self.bridges if b != peer)
        self.heard.discard(peer)

    def bridge(self, dead: str, partners: Sequence[str]) -> list[Effect]:
        """Chain partner ``dead`` died with the broker this repair is around, before its link
        ever connected: this broker links to ``partners`` on the bridge over the two instead
        (:func:`bridge_ends`), and sends whatever sweeps that allows."""
        self._drop_partner(dead)
        self.also_dead = (*self.also_dead, dead)
        self.bridges = tuple(dict.fromkeys((*self.bridges, *partners)))
        for p in partners:
            self.bridged_for.setdefault(p, dead)
        return self.sweeps_due()

    def on_sweep(self, peer: str, sweep: RepairSweep, out: list[Effect]) -> None:
        """Pass the sweep on, after everything this broker sent before (see the class). Its
        direction is not checked: a bridge partner on the far side may see this broker as
        its previous or next in a chain of its own, whichever way this one sees it."""
        if peer == self.previous:
            self.step(Step.SWEEP_FROM_PREVIOUS, peer)
        elif peer == self.next:
            self.step(Step.SWEEP_FROM_NEXT, peer)
        elif peer in self.bridges:
            self.step(Step.SWEEP_OVER_BRIDGE, peer)
        else:
            raise ProtocolError(f"sweep of {sweep.dead} from {peer}, not a partner of this repair")
        self.heard.add(peer)
        out.extend(self.sweeps_due())

    def finish(
        self,
        route: Callable[[Event], list[str]],
        out: list[Effect],
        *,
        now: float,
        timed_out: bool = False,
        skip: Collection[str] = (),
    ) -> None:
        """Replay the retained notifications, in the order they came, over the new links their
        routes now lead to (not to ``skip``: chain ends another repair replays to); from here
        on the new links carry traffic as any link does."""
        self.phase = Phase.DONE
        self.finished_at = now
        chain = {*self.partners, *self.replay_also} - set(skip)
        replayed = 0
        for event in self.retained:
            for peer in sorted(chain.intersection(route(event))):
                out.append(SendToLink(peer, Publish(event, replay=True)))
                replayed += 1
        held = len(self.retained)
        self.retained = []
        out.append(RepairFinished(self.dead, replayed, held, timed_out))
        out.extend(RepairFinished(d, 0, 0, timed_out) for d in self.also_dead)
