"""The planner: (live tree, desired spec) → a plan of elementary steps. Pure: no I/O, no clock.

Order of the plan: new brokers join as leaves, then link exchanges, then removed brokers leave as
leaves. Properties it guarantees (and ``tests/operator/test_planner.py`` checks):

* a same-broker change takes exactly |T1 \\ T2| exchanges — the minimum;
* every intermediate state is a tree: each added link is paired with a removed link on the cycle
  it closes in the tree *as it is at that step*;
* the final tree is the desired one (explicit links), or respects ``maxFanOut`` (managed links);
  between steps no broker exceeds ``maxFanOut`` unless no remaining step avoids it, and then by at
  most one link;
* cycles are kept short: additions are taken shortest-cycle first, re-measured as the tree
  changes;
* consecutive steps whose brokers are disjoint form parallel batches of at most
  ``maxConcurrent`` (disjoint cycles commute, so running them together is running them in
  order).

A removed broker that is not a leaf is first hung, in the target, as a leaf on one of its
neighbours that stays; reaching that augmented target takes the exchanges that make it a leaf.
In managed-links mode a new broker joins by the bounded-fan-out rule of paper 001: a walk from a
broker of its zone (if any) that each visited broker accepts with probability (F - degree) / F;
the randomness is seeded from the overlay and broker names, so the plan is reproducible.
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

from canopy_operator.model.phases import OverlayPhase
from canopy_operator.model.topology import Edge, OverlaySpec, adjacency, norm, tree_path

StepKind = Literal["add-leaf", "exchange", "remove-leaf", "join"]


@dataclass(frozen=True)
class Step:
    kind: StepKind
    batch: int
    broker: str | None = None
    remove: Edge | None = None
    add: Edge | None = None
    cycle: tuple[str, ...] = ()
    # A join's: the live brokers of the two sides it joins (their fences of each other are
    # lifted, their subscribers told what they missed while apart).
    members: tuple[str, ...] = ()

    def brokers(self) -> set[str]:
        """Brokers the step touches (for batching)."""
        out = set(self.cycle)
        for e in (self.remove, self.add):
            if e is not None:
                out.update(e)
        return out

    def describe(self, *, full_cycle: bool = False) -> str:
        """One line for people (Events, progress lines, ``canopy plan``)."""
        if self.kind == "add-leaf":
            assert self.add is not None
            return f"add leaf {self.broker} at {self.add[0]}"
        if self.kind == "remove-leaf":
            return f"remove leaf {self.broker}"
        if self.kind == "join":
            assert self.add is not None
            a, b = self.add
            return f"join the parts of {a} and {b} (link {a}-{b})"
        assert self.remove is not None and self.add is not None
        cycle = (
            f"cycle {' → '.join(self.cycle)}, {len(self.cycle)} links"
            if full_cycle
            else f"cycle of {len(self.cycle)}"
        )
        return (
            f"exchange {self.remove[0]}-{self.remove[1]} for {self.add[0]}-{self.add[1]} ({cycle})"
        )

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind}
        if self.broker is not None:
            d["broker"] = self.broker
        if self.remove is not None:
            d["remove"] = list(self.remove)
        if self.add is not None:
            d["add"] = list(self.add)
        if self.cycle:
            d["cycle"] = list(self.cycle)
        if self.members:
            d["members"] = list(self.members)
        d["batch"] = self.batch
        return d


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    final_links: tuple[Edge, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def exchanges(self) -> list[Step]:
        return [s for s in self.steps if s.kind == "exchange"]

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": [s.to_json() for s in self.steps],
            "final_links": [list(e) for e in self.final_links],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class LiveOverlay:
    """What is running: broker names and the links between them (a tree)."""

    brokers: tuple[str, ...]
    links: tuple[Edge, ...]


def plan(live: LiveOverlay, desired: OverlaySpec) -> Plan:
    """Steps that take ``live`` to ``desired`` (validate ``desired`` first)."""
    f = desired.max_fan_out
    adj = adjacency(live.links)
    for b in live.brokers:
        adj.setdefault(b, set())
    present = set(live.brokers)
    want = desired.broker_names
    added = [b for b in want if b not in present]
    removed = sorted(present - set(want))
    notes: list[str] = []
    raw: list[tuple[StepKind, Step]] = []

    if desired.links is None:
        target = _managed_target(live, desired, adj)
    else:
        target = {norm(e) for e in desired.links}
    tadj = adjacency(target)

    # 1. New brokers join as leaves, each on a desired neighbour that is already there.
    pending = list(added)
    while pending:
        for n in list(pending):
            anchors = sorted(
                (x for x in tadj[n] if x in present),
                key=lambda x: (len(adj[x]) > f, len(adj[x]), x),
            )
            if anchors and len(adj[anchors[0]]) > f:
                # Every target neighbour is over the bound already: join elsewhere (an exchange
                # moves it later) rather than push a broker two links over.
                spare = sorted(
                    (x for x in present if len(adj[x]) < f), key=lambda x: (len(adj[x]), x)
                )
                anchors = spare[:1] or anchors
            if anchors:
                break
        else:  # nothing of its target neighbourhood exists yet (e.g. every broker replaced)
            n = pending[0]
            anchors = sorted(present, key=lambda x: (x in removed, len(adj[x]), x))
            notes.append(f"{n} joins at {anchors[0]}, none of its target neighbours existing yet")
        pending.remove(n)
        x = anchors[0]
        raw.append(("add-leaf", Step("add-leaf", 0, broker=n, add=(x, n))))
        adj[n].add(x)
        adj[x].add(n)
        present.add(n)

    # 2. The augmented target: removed brokers hang as leaves on a neighbour that stays.
    augmented = set(target)
    aug_degree: dict[str, int] = {}
    for a, b in augmented:
        aug_degree[a] = aug_degree.get(a, 0) + 1
        aug_degree[b] = aug_degree.get(b, 0) + 1
    hung: set[str] = set()
    queue = deque(r for r in removed if any(x not in removed for x in adj[r]))
    for r in removed:
        if r not in queue:
            queue.append(r)
    while queue:
        r = queue.popleft()

        def load(x: str) -> tuple[bool, int, str]:  # would hanging r here go two over?
            return (aug_degree.get(x, 0) > f, aug_degree.get(x, 0), x)

        staying = sorted((x for x in adj[r] if x not in removed), key=load)
        chained = sorted((x for x in adj[r] if x in hung), key=load)
        roomy = sorted((x for x in present if x != r and (x in hung or x not in removed)), key=load)
        if staying and load(staying[0])[0] and chained and not load(chained[0])[0]:
            anchor = chained[0]  # a full staying neighbour: hang on a leaving one instead
        elif staying and load(staying[0])[0] and roomy and not load(roomy[0])[0]:
            anchor = roomy[0]  # all neighbours full: hang where there is room (one exchange)
        elif staying:
            anchor = staying[0]
        elif chained:
            anchor = chained[0]
        elif any(x in hung or x not in removed for x in present if x != r):
            anchor = min(
                (x for x in present if x != r and (x in hung or x not in removed)),
                key=lambda x: (x in removed, len(adj[x]), x),
            )
        else:
            queue.append(r)
            continue
        augmented.add(norm((r, anchor)))
        aug_degree[anchor] = aug_degree.get(anchor, 0) + 1
        aug_degree[r] = aug_degree.get(r, 0) + 1
        hung.add(r)

    # 3. Exchanges: from the live tree (plus new leaves) to the augmented target.
    current = {norm((a, b)) for a in adj for b in adj[a]}
    raw += [("exchange", s) for s in _exchanges(adj, current, augmented, f)]

    # 4. Removed brokers leave, leaves first.
    left = set(removed)
    while left:
        leaf = min((r for r in left if len(adj[r]) <= 1), key=lambda r: r, default=None)
        if leaf is None:  # cannot happen: the augmented target hangs them as leaves
            raise AssertionError(f"no removable leaf among {sorted(left)}")
        other = next(iter(adj[leaf]), None)
        raw.append(
            (
                "remove-leaf",
                Step("remove-leaf", 0, broker=leaf, remove=(leaf, other) if other else None),
            )
        )
        if other is not None:
            adj[other].discard(leaf)
        del adj[leaf]
        left.discard(leaf)

    final = tuple(sorted({norm((a, b)) for a in adj for b in adj[a]}))
    return Plan(_batches(raw, desired.max_concurrent), final, tuple(notes))


def _exchanges(
    adj: dict[str, set[str]], current: set[Edge], target: set[Edge], f: int
) -> list[Step]:
    """Pair additions with removals so every step leaves a tree; shortest cycles first."""
    to_add = sorted(target - current)
    if len(to_add) != len(current - target):
        raise ValueError("live and target trees differ in size: not the same brokers")
    # Shortest cycle first, measured once up front and again as the tree changes.
    lengths = {a: len(tree_path(adj, *a)) for a in to_add}
    pending = sorted(to_add, key=lambda a: (lengths[a], a))
    demand: Counter[str] = Counter(x for a in pending for x in a)  # additions still to come
    steps: list[Step] = []
    while pending:
        a, path, r = _next_exchange(adj, pending, target, f, demand)
        pending.remove(a)
        demand.subtract(a)
        # The cycle as the broker protocol takes it: from one end of the added link to the other.
        steps.append(Step("exchange", 0, remove=r, add=(path[0], path[-1]), cycle=tuple(path)))
        adj[r[0]].discard(r[1])
        adj[r[1]].discard(r[0])
        adj[a[0]].add(a[1])
        adj[a[1]].add(a[0])
    return steps


SCAN = 32  # candidates examined per step when the shortest would overload a broker


def _next_exchange(
    adj: dict[str, set[str]],
    pending: list[Edge],
    target: set[Edge],
    f: int,
    demand: Mapping[str, int],
) -> tuple[Edge, list[str], Edge]:
    """The next addition, its cycle and the link it replaces: the shortest pending addition
    that keeps every broker within ``f``, else the one that overloads least."""
    best: tuple[int, int] | None = None
    choice: tuple[Edge, list[str], Edge] | None = None
    for rank, a in enumerate(pending[:SCAN]):
        if rank and all(len(adj[x]) < f for x in a) is False and choice is not None:
            continue  # only worth a path search if it could beat what we have
        path = tree_path(adj, a[0], a[1])
        candidates = [norm(e) for e in itertools.pairwise(path) if norm(e) not in target]

        def after(e: Edge, a: Edge = a, path: list[str] = path) -> tuple[int, int, int]:
            # Excess at the new link's ends once ``e`` is gone; then prefer making room at
            # brokers whose pending additions exceed their spare links; then the removal
            # nearest the first end.
            ends = max(len(adj[x]) + 1 - (x in e) - f for x in a)
            room = sum(len(adj[x]) + demand[x] - (x in a) > f for x in e)
            return (ends, -room, path.index(e[0]))

        r = min(candidates, key=after)
        excess = after(r)[0]
        score = (max(excess, 0), rank)
        if best is None or score < best:
            best, choice = score, (a, path, r)
        if excess <= 0:
            break
    assert choice is not None
    return choice


def _batches(raw: list[tuple[StepKind, Step]], max_concurrent: int) -> tuple[Step, ...]:
    """Number consecutive steps of one kind that touch disjoint brokers into shared batches."""
    out: list[Step] = []
    batch = -1
    members: list[set[str]] = []
    kind: StepKind | None = None
    for k, step in raw:
        touched = step.brokers() | ({step.broker} if step.broker else set())
        if k != kind or len(members) >= max_concurrent or any(touched & m for m in members):
            batch += 1
            members = []
            kind = k
        members.append(touched)
        out.append(Step(step.kind, batch, step.broker, step.remove, step.add, step.cycle))
    return tuple(out)


def _managed_target(
    live: LiveOverlay, desired: OverlaySpec, adj: Mapping[str, set[str]]
) -> set[Edge]:
    """Managed links: keep the live links among staying brokers, join new brokers by the
    bounded-fan-out walk, and reconnect the neighbours of removed brokers into a chain."""
    f = desired.max_fan_out
    want = desired.broker_names
    zones = desired.zone_of()
    edges = {norm(e) for e in live.links}
    for r in sorted(set(live.brokers) - set(want)):
        nbrs = sorted({b for e in edges if r in e for b in e if b != r})
        edges = {e for e in edges if r not in e}
        # Removing r splits the tree, one part per neighbour: join the parts again through the
        # broker nearest each neighbour that has a link to spare.
        tree = adjacency(edges)
        for a, b in itertools.pairwise(nbrs):
            edges.add(norm((_roomy_near(tree, a, f), _roomy_near(tree, b, f))))
            tree = adjacency(edges)
    tree = adjacency(edges)
    members = [b for b in want if b in set(live.brokers)]
    for n in want:
        if n in members:
            continue
        if not members:
            members.append(n)
            continue
        x = _join_walk(n, members, tree, zones=zones, f=f, seed=desired.name)
        edges.add(norm((n, x)))
        tree[n].add(x)
        tree[x].add(n)
        members.append(n)
    return edges


def _roomy_near(tree: Mapping[str, set[str]], start: str, f: int) -> str:
    """The broker nearest ``start`` (breadth first) with fewer than ``f`` links."""
    seen, frontier = {start}, [start]
    while frontier:
        for x in sorted(frontier):
            if len(tree.get(x, ())) < f:
                return x
        frontier = [y for x in frontier for y in sorted(tree.get(x, ())) if y not in seen]
        seen.update(frontier)
    return start


def _join_walk(
    n: str,
    members: list[str],
    tree: Mapping[str, set[str]],
    *,
    zones: Mapping[str, str],
    f: int,
    seed: str,
) -> str:
    rng = random.Random(zlib.crc32(f"{seed}/{n}".encode()))
    same_zone = [m for m in members if zones.get(n) and zones.get(m) == zones.get(n)]
    x = rng.choice(sorted(same_zone or members))
    for _ in range(4 * len(members)):
        if rng.random() < (f - len(tree[x])) / f:
            return x
        nbrs = sorted(tree[x])
        if nbrs:
            x = rng.choice(nbrs)
    return min(members, key=lambda m: (len(tree[m]), m))  # a walk this long is bad luck


def degree_excess(edges: Iterable[Edge], f: int) -> int:
    """How far the busiest broker is above the fan-out bound (0 if none is)."""
    deg: dict[str, int] = {}
    for a, b in edges:
        deg[a] = deg.get(a, 0) + 1
        deg[b] = deg.get(b, 0) + 1
    return max((d - f for d in deg.values()), default=0) if deg else 0


# --------------------------------------------------------------------------- plans in status


def plan_status(generation: int, the_plan: Plan, completed: Sequence[int]) -> dict[str, Any]:
    """A plan and its progress as ``status.plan`` (every step carries ``done``)."""
    done = set(completed)
    steps = [{**s.to_json(), "done": i in done} for i, s in enumerate(the_plan.steps)]
    return {
        "generation": generation,
        "steps": steps,
        "done": len(done),
        "progress": f"{len(done)}/{len(steps)}",
    }


def steps_from_json(steps: Sequence[Mapping[str, Any]]) -> tuple[Step, ...]:
    out = []
    for s in steps:
        remove, add = s.get("remove"), s.get("add")
        out.append(
            Step(
                kind=s["kind"],
                batch=int(s.get("batch", 0)),
                broker=s.get("broker"),
                remove=(remove[0], remove[1]) if remove else None,
                add=(add[0], add[1]) if add else None,
                cycle=tuple(s.get("cycle") or ()),
                members=tuple(s.get("members") or ()),
            )
        )
    return tuple(out)


# --------------------------------------------------------------------------- what to do


class Cause(Enum):
    """Why a reconcile does what it does (kopf's ``detect_*_cause`` is the model): decided from
    data alone, carried out by the reconciler."""

    INVALID = "invalid"  # the spec is not a valid tree: touch nothing, say what is wrong
    RESUME = "resume"  # a saved plan of this generation has steps left: finish it as saved
    PLAN = "plan"  # a new generation, or the saved plan is done: plan from the live tree


@dataclass(frozen=True)
class Reconcile:
    """What one reconcile of an overlay will do (see :func:`decide`)."""

    cause: Cause
    problems: tuple[str, ...] = ()
    steps: tuple[Step, ...] = ()  # RESUME: the saved plan
    completed: tuple[int, ...] = ()  # RESUME: the steps it had finished
    creating: bool = False  # the overlay was never converged: its phase becomes Creating


def decide(problems: Sequence[str], generation: int, status: Mapping[str, Any]) -> Reconcile:
    """The reconcile decision from the spec's validation problems, the object's generation and
    its status. A resumed plan is taken as saved, never re-planned: re-planning from a half-done
    live tree could pick other exchanges than the ones already applied."""
    if problems:
        return Reconcile(Cause.INVALID, problems=tuple(problems))
    saved = status.get("plan") or {}
    saved_steps = saved.get("steps") or []
    resuming = saved.get("generation") == generation and not all(s.get("done") for s in saved_steps)
    creating = (
        status.get("phase") in (None, OverlayPhase.PENDING, OverlayPhase.INVALID) and not resuming
    )
    if resuming:
        completed = tuple(i for i, s in enumerate(saved_steps) if s.get("done"))
        return Reconcile(Cause.RESUME, steps=steps_from_json(saved_steps), completed=completed)
    return Reconcile(Cause.PLAN, creating=creating)
