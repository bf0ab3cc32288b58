"""Restore: after the brokers repaired the tree around a dead one, bring back the declared shape.

Pure: the supervisor (local) and the heal timer (Kubernetes) ask :func:`restore` *what* to do
and carry it out with the shared executor. The answer is one of three:

* **wait** — the survivors are still repairing (a link still names a dead broker, or the live
  links do not yet join the survivors into one tree). Planning from a torn view would "fix" a
  state the brokers are about to change themselves; the next tick asks again.
* **plan** — the survivors form one tree: the plan that takes that tree to the declared shape,
  made by the ordinary planner. A dead broker is simply absent from the live overlay, so it
  comes back as a *new* member through the loss-free elementary steps: a leaf add (a new
  process, a fresh incarnation the neighbours' fences do not refuse), then link exchanges that
  undo the repair's detour. A broker that restarted on its own (a Kubernetes pod re-created
  under the same name) and has no link yet counts as absent too: its leaf add links it.
* **nothing** — the live tree is already the declared one (with managed links: every declared
  broker is in it; which links they have is the proposals' business).

Never does it drop a link and add it again under traffic: each step keeps the overlay a tree
and loses nothing (the executor's guarantees), which is the whole point of restoring by plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from canopy_operator.model.planner import LiveOverlay, Plan, plan
from canopy_operator.model.topology import Edge, OverlaySpec, components, norm


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


def restore(spec: OverlaySpec, alive: Iterable[str], links: Iterable[Edge]) -> Restore:
    """``alive``: brokers whose process runs and answers; ``links``: the links they report
    (each once, either order). See the module docstring for the three answers."""
    up = set(alive)
    edges = {norm(e) for e in links}
    dangling = sorted(e for e in edges if not set(e) <= up)
    if dangling:
        a, b = dangling[0]
        gone = b if a in up else a
        return Restore(wait=f"link {a}-{b} still names {gone}, which is down: repair in progress")
    linked = {b for e in edges for b in e}
    # A lone survivor is a tree of one; otherwise unlinked brokers are (re)joined as leaves.
    members = linked or set(sorted(up)[:1])
    parts = components(members, edges)
    if len(parts) > 1:
        sizes = ", ".join(str(len(p)) for p in sorted(parts, key=len, reverse=True))
        return Restore(
            wait=f"the live brokers form {len(parts)} trees ({sizes}): repair in progress"
        )
    if len(edges) != len(members) - 1:
        return Restore(wait="the live links close a cycle: an exchange is under way")
    absent = tuple(b for b in spec.broker_names if b not in members)
    if spec.links is None and not absent:
        # Managed links: the declared shape is the broker set within maxFanOut, which the
        # repair keeps; the rest is the miner's and the proposals' business, not a restore's.
        return Restore(plan=None)
    the_plan = plan(LiveOverlay(tuple(sorted(members)), tuple(sorted(edges))), spec)
    return Restore(plan=the_plan, absent=absent)


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


def describe(r: Restore, declared: Sequence[str]) -> str:
    """One line for a log or an Event."""
    if r.wait:
        return f"waiting: {r.wait}"
    if not r.needed:
        return f"as declared ({len(declared)} brokers)"
    assert r.plan is not None
    back = f"bring back {', '.join(r.absent)}; " if r.absent else ""
    return f"{back}{len(r.plan.steps)} steps ({len(r.plan.exchanges)} exchanges)"
