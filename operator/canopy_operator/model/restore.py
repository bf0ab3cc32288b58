"""Restore: after the brokers repaired the tree around a dead one, bring back the declared shape.

Pure: the supervisor (local) and the heal timer (Kubernetes) ask :func:`restore` *what* to do
and carry it out with the shared executor. The answer is one of three:

* **wait** — the survivors are still repairing (a link still names a dead broker, a broker
  reports a repair under way, or the live links close a cycle). Planning from a torn view would
  "fix" a state the brokers are about to change themselves; the next tick asks again.
* **plan**, from several trees — the repairs are over and the survivors are still split: a
  correlated failure (a node or zone lost with several brokers) took a repair chain's link
  partner too, so the chain could not close. Waiting would wait for ever; the plan first *joins*
  the parts, one link from each smaller part to what is joined so far (a declared link where one
  crosses, else between the least loaded brokers), which keeps the overlay a forest and then a
  tree. Across parts nothing was delivered while they were apart (each join tells the
  subscribers of the two sides the stretch); inside each part nothing changes. A live broker
  without a link is a part of its own (all alone after the failures around it, or restarted).
* **plan** — the survivors form one tree: the plan that takes that tree to the declared shape,
  made by the ordinary planner. A dead broker is simply absent from the live overlay, so it
  comes back as a *new* member through the loss-free elementary steps: a leaf add (a new
  process, a fresh incarnation the neighbours' fences do not refuse), then link exchanges that
  undo the repair's detour. A broker that restarted on its own (a Kubernetes pod re-created
  under the same name) and has no link yet is brought back too (``absent``), by a join.
* **nothing** — the live tree is already the declared one (with managed links: every declared
  broker is in it; which links they have is the proposals' business).

Never does it drop a link and add it again under traffic: each step keeps the overlay a tree
and loses nothing (the executor's guarantees), which is the whole point of restoring by plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from canopy_operator.model.planner import LiveOverlay, Plan, Step, plan
from canopy_operator.model.topology import Edge, OverlaySpec, adjacency, components, norm


@dataclass(frozen=True)
class Restore:
    """What to do now: ``wait`` (a reason) or run ``plan`` (``None`` when there is nothing to
    do). ``absent``: declared brokers that are dead or unlinked, which the plan brings back."""

    plan: Plan | None = None
    wait: str = ""
    absent: tuple[str, ...] = field(default_factory=tuple)

    @property
    def needed(self) -> bool:
        return self.plan is not None and bool(self.plan.steps)


def restore(
    spec: OverlaySpec, alive: Iterable[str], links: Iterable[Edge], repairing: Iterable[str]
) -> Restore:
    """``alive``: brokers whose process runs and answers; ``links``: the links they report
    (each once, either order); ``repairing``: brokers that report a repair not finished yet
    (:func:`repairs_under_way`). See the module docstring for the answers."""
    up = set(alive)
    edges = {norm(e) for e in links}
    dangling = sorted(e for e in edges if not set(e) <= up)
    if dangling:
        a, b = dangling[0]
        gone = b if a in up else a
        return Restore(wait=f"link {a}-{b} still names {gone}, which is down: repair in progress")
    linked = {b for e in edges for b in e}
    # A live broker without a link is a tree of one, joined like any part: one left alone by
    # a failure around it (its neighbours and their repair partners died) has subscribers
    # that missed everything meanwhile, and only a join tells them (review: added back as a
    # leaf, it told nobody). A freshly restarted process joins the same way; there is
    # nothing to tell for it. So also with no link anywhere: every live broker is a tree,
    # and the others are joined to the first (review: after a partition during an exchange
    # ended with every broker unlinked, a live one added as a leaf told its subscriber
    # nothing of 9,570 events per publisher missed).
    members = up
    busy = sorted(set(repairing) & up)
    parts = components(members, edges)
    if len(parts) > 1 and busy:
        sizes = ", ".join(str(len(p)) for p in sorted(parts, key=len, reverse=True))
        return Restore(
            wait=f"the live brokers form {len(parts)} trees ({sizes}): repair in progress "
            f"at {', '.join(busy)}"
        )
    if sum(len(p) - 1 for p in parts) != len(edges):
        return Restore(wait="the live links close a cycle: an exchange is under way")
    joins = _joins(parts, edges, spec)
    edges |= {j.add for j in joins if j.add is not None}
    # Brought back into the overlay: the dead, and the live ones without a link (joined),
    # but the one the others are joined to when no broker has a link.
    kept = linked or set(sorted(up)[:1])
    absent = tuple(b for b in spec.broker_names if b not in kept)
    if spec.links is None and not absent:
        # Managed links: the declared shape is the broker set within maxFanOut, which the
        # repair keeps; the rest is the miner's and the proposals' business, not a restore's.
        # But one overlay it is: a split (a partition healed) is joined.
        if not joins:
            return Restore(plan=None)
        note = f"the live brokers were split in {len(parts)} trees: joined"
        return Restore(plan=Plan(joins, tuple(sorted(edges)), (note,)))
    the_plan = plan(LiveOverlay(tuple(sorted(members)), tuple(sorted(edges))), spec)
    if joins:
        later = tuple(replace(st, batch=st.batch + len(joins)) for st in the_plan.steps)
        notes = (f"the survivors were split in {len(parts)} trees: joined first", *the_plan.notes)
        the_plan = Plan((*joins, *later), the_plan.final_links, notes)
    return Restore(plan=the_plan, absent=absent)


def _joins(parts: list[set[str]], edges: set[Edge], spec: OverlaySpec) -> tuple[Step, ...]:
    """One link per part beyond the largest, joining it to what is joined so far: a declared
    link that crosses if there is one (fewer exchanges after), else the pair of least loaded
    brokers (no broker pushed over maxFanOut if it can be helped). One step per batch: each
    join changes the loads the next one is chosen by."""
    if len(parts) < 2:
        return ()
    remaining = sorted(parts, key=lambda p: (-len(p), min(p)))
    joined = set(remaining.pop(0))
    degree = {b: len(ns) for b, ns in adjacency(edges).items()}
    declared = {norm(e) for e in spec.links or ()}
    f = spec.max_fan_out
    out: list[Step] = []

    def crossings(part: set[str]) -> list[Edge]:
        return sorted(
            e
            for e in declared
            if (e[0] in part and e[1] in joined) or (e[1] in part and e[0] in joined)
        )

    while remaining:
        # The next part: the first (largest, then by name) a declared link joins to what is
        # joined so far, else the first. Every broker unlinked (all restarted, or all left
        # alone) so follows the declared tree, leaving no exchange to do after the joins.
        part = remaining.pop(next((i for i, p in enumerate(remaining) if crossings(p)), 0))
        crossing = crossings(part)

        def load(pair: tuple[str, str]) -> tuple[bool, int, str, str]:
            a, b = pair
            da, db = degree.get(a, 0), degree.get(b, 0)
            return (max(da, db) >= f, da + db, *norm(pair))

        pairs = crossing or [(a, b) for a in sorted(part) for b in sorted(joined)]
        a, b = min(pairs, key=load)
        link = norm((a, b))
        # Its members: the two sides it joins (what is joined so far, and this part).
        out.append(Step("join", len(out), add=link, members=tuple(sorted(joined | part))))
        degree[a], degree[b] = degree.get(a, 0) + 1, degree.get(b, 0) + 1
        joined |= part
    return tuple(out)


def status_neighbours(statuses: Mapping[str, Mapping[str, Any]]) -> dict[str, set[str]]:
    """What each broker reports as its neighbours in its ``/status``: links its core has
    (``established``), closing ones left out. A closing link is on its way out: counting it
    would show a cycle or a link that is gone. A link its core does not have is a connection
    waiting for the core to open it, such as a repair link dialed by a broker that saw a death
    this one did not (a partition): counted at both ends, it made the restore plan from one
    tree that was two, and run exchanges that never ended (review)."""
    return {name: {str(x["peer"]) for x in tree_links(status)} for name, status in statuses.items()}


def tree_links(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The entries of one ``/status``'s neighbours that are links of the tree, as
    :func:`status_neighbours` counts them: established, not closing."""
    return [
        x
        for x in status.get("neighbours") or ()
        if not x.get("closing") and x.get("established", True)
    ]


def repairs_under_way(statuses: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The brokers whose ``/status`` lists a crash repair that has not completed (its sweep
    has not come back, nor its timer run out): while one runs, a split is not final."""
    return sorted(
        name
        for name, status in statuses.items()
        if any(
            isinstance(r, Mapping) and "complete_at" not in r for r in status.get("repairs") or ()
        )
    )


def reported_links(neighbours: Mapping[str, Iterable[str]]) -> set[Edge]:
    """Every link some broker reports (``neighbours``: what each broker that answered
    reports), each once."""
    return {norm((a, b)) for a, ns in neighbours.items() for b in ns}


def mutual(neighbours: Mapping[str, Iterable[str]]) -> tuple[set[Edge], set[Edge]]:
    """The links both ends report, and those only one end does (``neighbours``: what each
    broker that answered reports). A one-sided link is a session the other end no longer has:
    it restarted, or it is closing the link; never plan from it."""
    said = reported_links(neighbours)
    both = {
        e for e in said if e[1] in neighbours.get(e[0], ()) and e[0] in neighbours.get(e[1], ())
    }
    return both, said - both


def down_links(statuses: Mapping[str, Mapping[str, Any]]) -> list[Edge]:
    """The tree's links (as :func:`status_neighbours` counts them) that an end reports not
    connected (``state`` other than ``up``): reconnecting, or cut with both ends alive (a
    link failure no cycle repairs: its traffic waits in the link's session, in order, until
    it heals). A plan must not exchange such a link away: the traffic it holds arrives after
    the heal, behind what went round by the new links, and is dropped as had (chaos soak:
    the restore exchanged a cut link away, 2,487 events lost untold at two subscribers)."""
    down: set[Edge] = set()
    for name, status in statuses.items():
        for x in tree_links(status):
            if x.get("state", "up") != "up":
                down.add(norm((name, str(x["peer"]))))
    return sorted(down)


ONE_SIDED_STUCK = 10.0
"""Seconds a link may stay known at one end only before it is taken for stuck, not for being
set up or closed (which take a heartbeat or two)."""


def stuck_one_sided(
    one_sided: Iterable[Edge],
    neighbours: Mapping[str, Iterable[str]],
    seen_before: Mapping[str, Sequence[float]],
    now: float,
    after: float = ONE_SIDED_STUCK,
) -> tuple[dict[str, list[float]], list[tuple[str, str]]]:
    """Which one-sided links have been so for longer than ``after`` seconds: (each one-sided
    link's ``[first seen, last seen]``, by ``"a-b"``, to keep for the next look; and the
    (holder, other end) of those stuck, for the holder to remove). A repair's promoted link
    that the other end never took was reported by one end only for good, and the restore,
    waiting for it to settle, never ran: nothing was restored and a split was never told
    (review: 21,075 events lost untold). Removed, the overlay is in parts the restore joins,
    telling every subscriber of the gap.

    Only between brokers that both answered (``neighbours`` has both): a link to a broker
    that does not answer is a repair's to end. A link last seen more than ``after / 2`` s ago
    (nobody looked meanwhile) starts a new episode rather than continuing the old one."""
    seen: dict[str, list[float]] = {}
    stuck = []
    for a, b in sorted(one_sided):
        if a not in neighbours or b not in neighbours:
            continue
        key = f"{a}-{b}"
        first, last = [*(seen_before.get(key) or ()), now, now][:2]
        if now - last > after / 2:
            first = now
        seen[key] = [first, now]
        if now - first >= after:
            holder = a if b in neighbours.get(a, ()) else b
            stuck.append((holder, b if holder == a else a))
    return seen, stuck


def split(neighbours: Mapping[str, Iterable[str]]) -> bool:
    """Whether the brokers that answered (``neighbours``: what each reports) form several
    trees, every link known at both ends: a split no repair will close (a partition that
    healed, each side repaired without the other), which the restore joins. Not while a link
    is known at one end only (being set up or closed)."""
    links, one_sided = mutual(neighbours)
    return not one_sided and len(components(set(neighbours), links)) > 1


def describe(r: Restore, declared: Sequence[str]) -> str:
    """One line for a log or an Event."""
    if r.wait:
        return f"waiting: {r.wait}"
    if not r.needed:
        return f"as declared ({len(declared)} brokers)"
    assert r.plan is not None
    back = f"bring back {', '.join(r.absent)}; " if r.absent else ""
    return f"{back}{len(r.plan.steps)} steps ({len(r.plan.exchanges)} exchanges)"
