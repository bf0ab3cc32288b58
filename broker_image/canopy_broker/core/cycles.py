"""Small cycles of the overlay plus its standby links (paper 004), and the link exchange that
repairs a failed link with them.

**What is a cycle here.** The active overlay is a tree; standby links (paper 003,
:mod:`~canopy_broker.core.standby`) are extra connections that carry heartbeats only. Every
standby link u-v closes exactly one cycle with the tree: u, the tree path to v, and back over the
standby link. Those cycles, and only those, are what a link exchange can use (the exchange adds
one link and removes one on the tree path between its ends), so they are what is detected: a
cycle of the augmented graph that needs two standby links is of no use and is never reported. A
*small* cycle has at most ``bound`` brokers (paper 004's s); a longer detour is a poor repair and
is not looked for, which is what keeps the search local and cheap.

**How it is found (paper 004's hearts).** A broker is a *heart* if it is the smaller-named end
of some standby link; then every cycle has a heart on it (paper 004 has to place hearts and
misses small cycles far from them; putting them on the standby links makes detection complete).
In round ``r`` each heart h floods a path-carrying :class:`CycleProbe` over the tree for
``tree_budget(bound)`` hops, and sends one more over each of its standby links to v, which
floods it on over the tree for ``closing_budget(bound)`` hops (it crosses no second standby
link). A probe is forwarded to the tree neighbours not on its path; on a tree each front reaches
each broker at most once, so nothing depends on arrival order. A broker that receives both a
heart's tree probe and one of its closing probes, whose paths meet only at the heart and at
itself, is on the cycle (paper 004: "when a duplicate is received there is a cycle; compare the
id lists to find the members"); of the brokers on it that see both, only the one at the middle
of the tree path reports it, so each cycle is found once. It tells every member
(:class:`CycleFound`). The two budgets add up to ``bound - 1``, the longest tree path a small
cycle has, so a longer cycle's fronts never meet: nothing longer is reported.

**Cost.** A heart's tree probe reaches the brokers within ``tree_budget`` tree hops, once each; a
closing probe those within ``closing_budget`` of the standby link's far end; a found cycle costs
one message per other member. Paths carry at most ``tree_budget + 1`` (tree probe) or
``closing_budget + 2`` (closing probe) names. :func:`message_bound` states it for the tests.

**Rounds.** Cycles change when the tree does, so detection is repeated in numbered rounds (the
runtime triggers them on a timer and after a reshaping). A broker keeps the cycles of the current
round and of the previous one (a round still under way has not told it everything yet), and
uses only those whose links at this broker are still what the cycle says.

**Link-failure repair.** When the link r = x-y fails while both ends are alive, each end looks
for the smallest cycle it knows that contains r (:func:`plan_link_repair`). The exchange that
repairs it removes r and adds the cycle's standby link, so the tree stays a tree and, as any
coordinated exchange (paper 000), loses, duplicates and reorders nothing. Both ends compute the
same plan from the same cycle (both were told it); only one end acts (the initiator itself if it
is an end of r, else the smaller-named end, which asks the initiator with :class:`RepairLink`).

The coordinated exchange does need the removed link: the lock, Granted and Go cross it, each
side's separator crosses it, and black notifications (and what was queued on r when it failed) may
only cross it. A failed link cannot carry them directly, so both ends ask the runtime to *detour* r
(:class:`DetourLink`): r's stream, the unacknowledged backlog first and then everything the core
sends on r, travels in order over an out-of-band connection to the other end, as the
reconfiguration protocols' peer channels already do, until the exchange closes r. The detour
is only for the exchange's duration: it is not provisioned as a data path, and the tree it leaves
behind uses the standby link, which was opened on its own underlay path. Where no small cycle
contains r there is nothing to exchange onto, no detour is asked for, and r's traffic waits for
the link to come back (or for the crash repair, if an end turns out to be dead).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import pairwise

from canopy_broker.core.errors import ProtocolError
from canopy_broker.core.messages import CycleFound, CycleProbe

Cycle = tuple[str, ...]
"""A tree path whose two ends are joined by a standby link, smaller-named end first."""

MAX_PATH = 64  # names a probe may carry: far above any useful bound, a limit on what peers send


def tree_budget(bound: int) -> int:
    """Tree hops of a heart's own probe: the larger half of the longest tree path."""
    return bound // 2


def closing_budget(bound: int) -> int:
    """Tree hops of a probe after it crossed a standby link: the smaller half."""
    return (bound - 1) // 2


def start_probes(
    me: str, round_: int, bound: int, tree: Iterable[str], standby: Iterable[str]
) -> list[tuple[str, CycleProbe]]:
    """What a heart sends to start a round: its tree probe to every tree neighbour, and a
    closing probe over each standby link it is the heart of. Nothing if the bound allows no
    cycle (three brokers at least) or this broker is no heart."""
    if bound < 3:
        return []
    out: list[tuple[str, CycleProbe]] = []
    hearted = sorted(v for v in standby if me < v)
    if not hearted:
        return out
    path = (me,)
    if tree_budget(bound) >= 1:
        probe = CycleProbe(round_, me, path, tree_budget(bound) - 1)
        out.extend((n, probe) for n in sorted(tree))
    for v in hearted:
        out.append((v, CycleProbe(round_, me, path, closing_budget(bound), closing=True)))
    return out


def forward(me: str, probe: CycleProbe, tree: Iterable[str]) -> list[tuple[str, CycleProbe]]:
    """Where a probe that arrived here goes next: every tree neighbour not on its path, while it
    has budget. A closing probe arrives over the standby link with its whole budget left: the
    hop across the standby link is not a tree hop."""
    if probe.budget <= 0:
        return []
    path = (*probe.path, me)
    nxt = CycleProbe(probe.round, probe.heart, path, probe.budget - 1, probe.closing)
    return [(n, nxt) for n in sorted(tree) if n not in path]


def meet(me: str, tree_path: tuple[str, ...], closing_path: tuple[str, ...]) -> Cycle | None:
    """The cycle a heart's two fronts close at this broker, if this broker reports it.

    ``tree_path`` runs heart..me over the tree, ``closing_path`` heart, v, ..., me (v the standby
    link's far end), both ending here. They close the cycle heart..me..v only if they share no
    broker but the heart and this one (else this broker hangs off the cycle). The reporter is
    the broker ``ceil(L/2)`` tree hops from the heart on the heart-v tree path of L hops: the
    one both fronts reach when the bound just allows the cycle."""
    if set(tree_path) & set(closing_path) != {tree_path[0], me}:
        return None
    i = len(tree_path) - 1  # tree hops from the heart
    j = len(closing_path) - 2  # tree hops from v
    if i != (i + j + 1) // 2:
        return None
    return (*tree_path, *reversed(closing_path[1:-1]))


def message_bound(hearts: int, standby_links: int, bound: int, max_degree: int) -> int:
    """Most probes one round sends over a tree whose degrees are at most ``max_degree``: each
    heart's flood reaches at most the brokers within ``tree_budget`` hops of it, each closing
    probe one standby hop plus those within ``closing_budget`` of the far end. (Each cycle found
    adds one :class:`CycleFound` per other member, at most ``bound - 1``.)"""

    def ball(radius: int) -> int:  # brokers within ``radius`` hops, the centre excluded
        return sum(max_degree * (max_degree - 1) ** (i - 1) for i in range(1, radius + 1))

    if bound < 3:
        return 0
    return hearts * ball(tree_budget(bound)) + standby_links * (1 + ball(closing_budget(bound)))


def check_probe(sender: str, me: str, probe: CycleProbe) -> None:
    """Refuse a malformed probe (the runtime closes that connection only)."""
    path = probe.path
    if not path or path[-1] != sender or path[0] != probe.heart:
        raise ProtocolError(f"{me}: cycle probe from {sender} with path {list(path)}")
    if len(set(path)) != len(path) or len(path) > MAX_PATH or probe.budget < 0:
        raise ProtocolError(f"{me}: cycle probe with a bad path or budget: {probe}")


def check_cycle(me: str, found: CycleFound) -> None:
    c = found.cycle
    if len(c) < 3 or len(set(c)) != len(c) or len(c) > MAX_PATH or me not in c:
        raise ProtocolError(f"{me}: not a cycle it is on: {list(c)}")


@dataclass
class _Round:
    """One round's probes seen here, per heart: its tree probe's path (at most one: a tree) and
    the paths of its closing probes (at most one per standby link)."""

    number: int
    started: bool = False
    tree: dict[str, tuple[str, ...]] = field(default_factory=dict)
    closing: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)
    found: dict[Cycle, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LinkRepairPlan:
    """How failed link ``remove`` is repaired: exchange ``xid`` along ``path`` (the tree path of
    the chosen cycle, oriented so that ``path[0]`` starts it), asked for by ``decider``."""

    xid: str
    path: tuple[str, ...]
    remove: tuple[str, str]
    decider: str

    @property
    def initiator(self) -> str:
        return self.path[0]


class CycleTable:
    """A broker's part in cycle detection: its standby links, the round under way, and the
    cycles it is on (this round's and the previous one's)."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.standby: frozenset[str] = frozenset()
        self.current = _Round(0)
        self.previous: dict[Cycle, int] = {}

    def set_standby(self, peers: Iterable[str]) -> None:
        peers = frozenset(peers)
        if self.me in peers:
            raise ProtocolError(f"{self.me}: a broker cannot keep a standby link to itself")
        self.standby = peers

    def _advance(self, number: int) -> bool:
        """Move to round ``number`` if it is newer; False if it is older (a stale probe)."""
        if number < self.current.number:
            return False
        if number > self.current.number:
            self.previous = self.current.found
            self.current = _Round(number)
        return True

    def start(self, round_: int, bound: int, tree: Iterable[str]) -> list[tuple[str, CycleProbe]]:
        """A new round (``FindCycles``): the probes this broker starts, if it is a heart."""
        if not self._advance(round_) or self.current.started:
            raise ProtocolError(
                f"{self.me}: cycle round {round_} started already (now {self.current.number})"
            )
        self.current.started = True
        tree = list(tree)
        return start_probes(self.me, round_, bound, tree, self.standby - set(tree))

    def on_probe(
        self, sender: str, probe: CycleProbe, tree: Iterable[str]
    ) -> tuple[list[tuple[str, CycleProbe]], list[tuple[str, CycleFound]]]:
        """A probe arrived: where it goes on, and who is told of a cycle it closes here."""
        me = self.me
        check_probe(sender, me, probe)
        tree = list(tree)
        first_hop = len(probe.path) == 1
        if probe.closing and first_hop:  # over the standby link, from its heart
            legit = sender in self.standby and sender not in tree and sender < me
        else:
            legit = sender in tree
        if me in probe.path or not legit or not self._advance(probe.round):
            return [], []  # the topology or the round moved on while it travelled
        rnd = self.current
        full = (*probe.path, me)
        pairs: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
        if probe.closing:
            rnd.closing.setdefault(probe.heart, []).append(full)
            other = rnd.tree.get(probe.heart)
            if other is not None:
                pairs.append((other, full))
        else:
            rnd.tree[probe.heart] = full
            pairs.extend((full, closing) for closing in rnd.closing.get(probe.heart, []))
        tell: list[tuple[str, CycleFound]] = []
        for tree_path, closing_path in pairs:
            cycle = meet(me, tree_path, closing_path)
            if cycle is not None:
                rnd.found[cycle] = rnd.number
                msg = CycleFound(rnd.number, cycle)
                tell.extend((m, msg) for m in sorted(cycle) if m != me)
        return forward(me, probe, tree), tell

    def on_found(self, found: CycleFound) -> None:
        check_cycle(self.me, found)
        if self._advance(found.round):
            self.current.found[found.cycle] = found.round

    def known(self, is_link: Callable[[str], bool]) -> dict[Cycle, int]:
        """The cycles this broker is on, by round, whose links at this broker are still as the
        cycle says: its tree links are links, its standby link is still a standby link."""
        out: dict[Cycle, int] = {}
        for cycle, rnd in [*self.previous.items(), *self.current.found.items()]:
            if self._still_valid(cycle, is_link):
                out[cycle] = rnd
        return out

    def _still_valid(self, cycle: Cycle, is_link: Callable[[str], bool]) -> bool:
        i = cycle.index(self.me)
        last = len(cycle) - 1
        for j in (i - 1, i + 1):
            if 0 <= j <= last and not is_link(cycle[j]):
                return False
        if i in (0, last):
            other = cycle[last - i]
            return other in self.standby and not is_link(other)
        return True


def plan_link_repair(
    me: str, peer: str, cycles: dict[Cycle, int] | Iterable[Cycle]
) -> LinkRepairPlan | None:
    """The exchange that repairs the failed link ``me``-``peer``: onto the standby link of the
    shortest known cycle that contains it (ties: the smallest by names, so both ends choose the
    same), oriented so that an end of the failed link starts it if it can, asked for by one end
    only. None if no known cycle contains the link."""
    rounds = dict(cycles) if isinstance(cycles, dict) else dict.fromkeys(cycles, 0)
    failed = frozenset((me, peer))
    candidates = [c for c in rounds if any(frozenset(p) == failed for p in pairwise(c))]
    if not candidates:
        return None
    cycle = min(candidates, key=lambda c: (len(c), c))
    ends = (cycle[0], cycle[-1])
    if ends[0] in failed:
        path = cycle
    elif ends[1] in failed:
        path = tuple(reversed(cycle))
    else:
        path = cycle if ends[0] < ends[1] else tuple(reversed(cycle))
    x, y = sorted(failed)
    decider = path[0] if path[0] in failed else x
    xid = f"link:{x}-{y}:{ends[0]}-{ends[1]}:r{rounds[cycle]}"
    k = next(i for i in range(len(path) - 1) if frozenset(path[i : i + 2]) == failed)
    return LinkRepairPlan(xid, path, (path[k], path[k + 1]), decider)
