"""Faults at random moments, also while the overlay reconfigures (issue 12, item 7).

One run (:func:`run_with_faults`): a random tree of brokers that repair crashes (neighbour lists
announced, custody on), a subscriber and a publisher on every broker, publications throughout,
and *rounds*. Each round starts an *activity* — a coordinated link exchange, an add-leaf, a
remove-leaf, a client migration, or nothing — and at a random moment of the round, often while
the activity runs, :class:`FaultPlanner` injects a fault: a crash, a link drop, a short pause, a
pause long enough for the neighbours to declare the broker dead (it is fenced), or a partition;
after a death, sometimes a second fault while the overlay detects and repairs it.
The planner decides *at the fault's moment*, on the simulator's state then, so that it can aim
at what is running and stay out of what the core does not support. After the last round the
publishers stop, the simulation runs to quiescence, and the run is judged: deliveries by
:func:`~canopy_broker.sim.checker.check_faults` (0 lost, duplicated, reordered for clients not
attached to a dead broker; the dead brokers' clients are reported apart), routing tables against
the final tree, and every exchange and repair finished.

**What the schedule leaves out, and why** (combinations the core does not support today; a
test that lifted a rule would fail for the reason given):

* *A death on the cycle of a running exchange.* The brokers next to the dead one settle their
  part first and then repair (``PeerFailed`` in the core), and the rest of the cycle follows
  (Settle), and what went the dead one's way is handed over. Deaths in the windows left
  (docs/reconfiguration.md, "What is left": between Granted and Go, when the two ends of the
  added link decide differently, or a settled R end closes the removed link under the other's
  traffic) still lose or split; ``tests/sim/test_faults.py`` covers the closed ones one by one.
  So no broker on the path of an unfinished exchange dies here (``on_paths=True`` lifts this;
  ``scripts/sim_on_paths.py`` sweeps seeds that way), and no exchange starts while a repair
  runs (its plan would be computed on a tree that is not one).
* *One death at a time.* The chain repair closes the tree around one dead broker; the next
  death waits until that repair is complete (paper 003's simultaneous failures are elsewhere).
* *A death right after the victim's links changed.* Its neighbours must agree on its neighbour
  list to build the same chain; a list still on its way (an exchange or leaf change that just
  touched the victim) would split the tree. The planner picks a victim whose neighbours all
  hold its current list.
* *A pause that overlaps a repair.* A paused neighbour of the dead broker would open its part of
  the chain late, and the simulator does not model the runtime's refusal of data on a repair link
  until both ends opened it (it drops such data). So no pause while a repair runs and no death
  while a broker is paused.
* *Deaths during a reconfiguration-path exchange (paper 002).* That algorithm has no lease to
  end it if a broker on its path dies, and no delivery guarantee of its own (DESIGN.md §4):
  under faults its runs are held to canonical routing tables, finished exchanges and no
  spurious delivery only, with link drops, pauses and partitions.
* *A link drop or partition that outlasts the detection time.* Both ends are alive and each
  would declare the other dead: a link failure, repaired by paper 004's exchange onto a standby
  link (issue 12 item 6), not by the crash repair; ``Simulator.cut_link`` and
  tests/sim/test_cycles.py cover it. Drops and partitions here stay shorter.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import Algorithm, RoutingMode
from canopy_broker.core.repair import Phase as RepairPhase
from canopy_broker.sim.checker import FaultReport, check_faults, check_routing
from canopy_broker.sim.simulator import CoreFactory, Simulator
from canopy_broker.sim.topology import adjacency, random_exchange, random_tree

RETENTION_WINDOW = 400.0  # > detection + the longest link outage + a link delay


def custody_core(name: str, mode: RoutingMode) -> BrokerCore:
    """A broker as the runtime configures it for repair: lists announced, custody kept."""
    return BrokerCore(name, mode, announce_neighbours=True, retention_window=RETENTION_WINDOW)


def no_custody_core(name: str, mode: RoutingMode) -> BrokerCore:
    """The negative control: repair without retention, so nothing is replayed."""
    return BrokerCore(name, mode, announce_neighbours=True)


class FaultKind(Enum):
    CRASH = "crash"
    LINK_DROP = "link drop"
    PAUSE = "pause"
    FENCED_PAUSE = "pause past detection"
    PARTITION = "partition"


class Activity(Enum):
    EXCHANGE = "exchange"
    ADD_LEAF = "add leaf"
    REMOVE_LEAF = "remove leaf"
    MIGRATION = "migration"
    NONE = "none"


DEATHS = (FaultKind.CRASH, FaultKind.FENCED_PAUSE)


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``victim`` is a broker, a link's two ends, or a partition's side;
    ``during`` names what was running at that moment (exchanges, migrations, ...)."""

    kind: FaultKind
    at: float
    victim: tuple[str, ...]
    duration: float
    during: tuple[str, ...]


class FaultPlanner:
    """Chooses a fault kind, a victim and a duration, at random but within what the core
    supports (see the module docstring); the moment is the caller's."""

    def __init__(
        self, rng: random.Random, kinds: Sequence[FaultKind], *, on_paths: bool = False
    ) -> None:
        """``on_paths``: deaths may also strike the path of a running exchange, which the
        schedule otherwise leaves out (see the module docstring; ``scripts/sim_on_paths.py``
        sweeps seeds that way and counts what goes wrong)."""
        self.rng = rng
        self.kinds = list(kinds)
        self.on_paths = on_paths

    def pick(self, sim: Simulator) -> Fault | None:
        kinds = list(self.kinds)
        self.rng.shuffle(kinds)
        for kind in kinds:  # the first kind that has a victim now
            victims = self.victims(sim, kind)
            if victims:
                victim = self.rng.choice(victims)
                return Fault(kind, sim.now, victim, self.duration(sim, kind), running(sim))
        return None

    def duration(self, sim: Simulator, kind: FaultKind) -> float:
        d = sim.detection_time
        if kind is FaultKind.FENCED_PAUSE:
            return self.rng.uniform(1.2 * d, 3 * d)
        return 0.0 if kind is FaultKind.CRASH else self.rng.uniform(0.05 * d, 0.8 * d)

    def victims(self, sim: Simulator, kind: FaultKind) -> list[tuple[str, ...]]:
        live = live_brokers(sim)
        edges = [e for e in sim.edges if set(e) <= set(live)]
        if kind in DEATHS:
            if sim.repairing or sim.paused or len(live) <= 3:  # keep survivors to judge
                return []
            return [(b,) for b in live if can_die(sim, b, on_paths=self.on_paths)]
        if kind is FaultKind.PAUSE:
            return [] if sim.repairing else [(b,) for b in live if b not in sim.paused]
        if kind is FaultKind.LINK_DROP:
            return [tuple(e) for e in edges]
        k = self.rng.randint(1, max(1, min(3, len(live) // 2)))
        return [tuple(sorted(self.rng.sample(live, k)))] if len(live) > 1 else []


def live_brokers(sim: Simulator) -> list[str]:
    return sorted(b for b in sim.cores if b not in sim.crashed and b not in sim.removed)


def running(sim: Simulator) -> tuple[str, ...]:
    """What is under way now, as the fault's ``during``."""
    out = [f"exchange {r.xid}" for r in sim.exchanges.values() if r.finished_at is None]
    out += [f"migration of {c}" for c in sorted(sim.migrating)]
    out += [f"leaf change at {b}" for b in sorted(sim.leaving)]
    out += [f"repair around {b}" for b in sorted(sim.repairing)]
    return tuple(out)


def can_die(sim: Simulator, broker: str, *, on_paths: bool = False) -> bool:
    """Whether ``broker`` may die now (see the module docstring's list; ``on_paths``: also on
    the path of a running exchange)."""
    if broker in sim.leaving:
        return False
    if not on_paths and any(
        rec.finished_at is None and broker in rec.path for rec in sim.exchanges.values()
    ):
        return False
    core = sim.cores[broker]
    mine = {n for n in core.neighbours if core.is_neighbour(n)}
    return all(
        sim.cores[n].is_neighbour(broker)
        and set(sim.cores[n].neighbour_lists.lists.get(broker, ())) == mine
        for n in mine
    )


def inject(sim: Simulator, fault: Fault) -> None:
    """Carry out ``fault`` now; a crash's neighbours detect it ``detection_time`` later."""
    if fault.kind is FaultKind.CRASH:
        sim.crash(fault.victim[0])
        sim.detect_failure(fault.victim[0], at=sim.now + sim.detection_time)
    elif fault.kind in (FaultKind.PAUSE, FaultKind.FENCED_PAUSE):
        sim.pause(fault.victim[0], fault.duration)
    elif fault.kind is FaultKind.LINK_DROP:
        a, b = fault.victim
        sim.drop_link(a, b, fault.duration)
    else:
        sim.partition(fault.victim, fault.duration)


@dataclass
class FaultRun:
    sim: Simulator
    faults: list[Fault]
    activities: list[tuple[float, Activity, str]]
    report: FaultReport
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.problems

    def __str__(self) -> str:
        lines = [str(self.report), *self.problems[:10]]
        lines += [f"  {f.at:.0f} {f.kind.value} {f.victim} during {f.during}" for f in self.faults]
        return "\n".join(lines)


def start_activity(
    sim: Simulator,
    rng: random.Random,
    activity: Activity,
    index: int,
    algorithm: Algorithm = Algorithm.COORDINATED,
) -> str | None:
    """Start ``activity`` now if the overlay allows it; returns what was started."""
    live = live_brokers(sim)
    structural = not sim.finished or sim.repairing or sim.leaving or sim.paused
    adj = adjacency(sim.edges)
    if activity is Activity.EXCHANGE and not structural:
        spec = random_exchange(sim.edges, rng, max_fanout=5)
        if spec is not None:
            xid = sim.exchange(spec.path, spec.remove, algorithm=algorithm)
            return f"{xid} {spec.remove} -> {spec.add}"
    elif activity is Activity.ADD_LEAF and not structural:
        leaf, parent = f"n{index}", rng.choice(live)
        sim.add_leaf(leaf, parent)
        sim.attach(f"s{leaf}", leaf, at=sim.now + 1)
        sim.subscribe(f"s{leaf}", "x", Filter.parse(f"x = {rng.randrange(4)}"), at=sim.now + 2)
        return f"{leaf} at {parent}"
    elif activity is Activity.REMOVE_LEAF and not structural:
        leaves = [b for b in live if len(adj[b]) == 1 and len(live) > 3]
        if leaves:
            leaf = rng.choice(leaves)
            sim.remove_leaf(leaf)
            return leaf
    elif activity is Activity.MIGRATION:
        busy = sim.migrating | sim.victim_clients()
        clients = [c for c, b in sorted(sim.client_broker.items()) if c not in busy and b in live]
        rng.shuffle(clients)
        for client in clients:
            b = sim.client_broker[client]
            targets = sorted(
                t
                for t in adj[b]
                if t in live and t not in sim.leaving and sim.cores[b].is_neighbour(t)
            )
            if targets and b not in sim.leaving and b not in sim.paused:
                target = rng.choice(targets)
                sim.migrate(client, target)
                return f"{client} {b} -> {target}"
    return None


def run_with_faults(
    seed: int,
    *,
    brokers: int = 10,
    rounds: int = 6,
    kinds: Sequence[FaultKind] = tuple(FaultKind),
    activities: Sequence[Activity] = tuple(Activity),
    core_factory: CoreFactory = custody_core,
    mode: RoutingMode = RoutingMode.COVERING,
    algorithm: Algorithm = Algorithm.COORDINATED,
    round_length: float = 300.0,
    publish_interval: float = 2.0,
    fault_chance: float = 0.9,
    on_paths: bool = False,
) -> FaultRun:
    """One seeded run (see the module docstring; ``on_paths``: see :class:`FaultPlanner`)."""
    rng = random.Random(seed)
    names = [f"b{i}" for i in range(brokers)]
    tree = random_tree(brokers, rng)
    sim = Simulator(names, tree, mode=mode, seed=seed, core_factory=core_factory)
    for b in names:
        sim.attach(f"s{b}", b, at=0)
        sim.subscribe(f"s{b}", "x", Filter.parse(f"x = {rng.randrange(4)}"), at=1)
        if rng.random() < 0.3:  # something for covering to do
            sim.subscribe(f"s{b}", "wide", Filter.parse(f"x < {rng.randrange(1, 4)}"), at=1)
        sim.attach(f"p{b}", b, at=0)
    start = 200.0
    end = start + rounds * round_length
    t, k = start, 0
    while t < end:
        sim.publish(f"p{rng.choice(names)}", {"x": k % 4}, at=t)
        t += publish_interval * rng.uniform(0.5, 1.5)
        k += 1
    planner = FaultPlanner(rng, kinds, on_paths=on_paths)
    faults: list[Fault] = []
    done: list[tuple[float, Activity, str]] = []
    for r in range(rounds):
        base = start + r * round_length
        sim.run(until=base)
        activity = rng.choice(list(activities))
        what = start_activity(sim, rng, activity, r, algorithm)
        if what is not None:
            done.append((sim.now, activity, what))
        if rng.random() < fault_chance:
            # Half the faults come within a few link delays of the activity's start, while
            # it surely runs (a migration takes a few delays); the others anywhere early on.
            soon = rng.random() < 0.5
            sim.run(until=base + rng.uniform(0, 25 if soon else round_length / 2))
            fault = planner.pick(sim)
            if fault is not None:
                inject(sim, fault)
                faults.append(fault)
            if fault is not None and fault.kind in DEATHS and rng.random() < 0.5:
                # A second fault while the overlay is detecting or repairing the death.
                sim.run(until=sim.now + rng.uniform(0, sim.detection_time + 20))
                second = planner.pick(sim)
                if second is not None:
                    inject(sim, second)
                    faults.append(second)
    sim.run()
    return FaultRun(sim, faults, done, judge_deliveries(sim), judge_overlay(sim))


def judge_deliveries(sim: Simulator) -> FaultReport:
    return check_faults(sim.subs, sim.publications(), sim.deliveries, sim.victim_clients())


def _has_cycle(edges: Iterable[tuple[str, str]]) -> bool:
    parent: dict[str, str] = {}

    def root(b: str) -> str:
        while parent.get(b, b) != b:
            b = parent[b]
        return b

    for x, y in edges:
        rx, ry = root(x), root(y)
        if rx == ry:
            return True
        parent[rx] = ry
    return False


def judge_overlay(sim: Simulator) -> list[str]:
    """The overlay after the run: one tree over the live brokers, routing tables equal to the
    canonical ones, every exchange finished well, every repair complete."""
    live = live_brokers(sim)
    problems: list[str] = []
    edges = sim.edges
    reach: set[str] = set()
    adj = adjacency(edges)
    todo = live[:1]
    while todo:
        b = todo.pop()
        if b not in reach:
            reach.add(b)
            todo += sorted(adj[b])
    cores = {b: c for b, c in sim.cores.items() if b not in sim.crashed}
    if len(edges) != len(live) - 1 or reach != set(live):
        problems.append(f"not one tree over the live brokers {live}: {edges}")
    if not _has_cycle(edges):  # canonical tables are a forest's (over a cycle, never ending)
        subs = {b: s for b, s in sim.subscriptions_by_broker().items() if b not in sim.crashed}
        problems += check_routing(cores, edges, subs)
    problems += [
        f"exchange {r.xid} did not finish well: {r.reason or 'no result'}"
        for r in sim.exchanges.values()
        if not r.ok
    ]
    problems += [f"repair around {d} not complete" for d in sorted(sim.repairing)]
    problems += [
        f"{b}: repair around {d} still {run.phase.value}"
        for b, c in cores.items()
        for d, run in c.repairs.items()
        if run.phase is not RepairPhase.DONE
    ]
    return problems
