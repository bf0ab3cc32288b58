"""Small cycles through standby links (paper 004) and the repair of a failed link onto one.

Detection is compared with a brute-force enumeration of the cycles of the tree plus its standby
links over random trees: every broker must know exactly the cycles of at most ``bound`` brokers
it is on that use one standby link, and the probes one round costs must stay within the bound the
flood's depths give. A link cut for good under traffic must be repaired by the coordinated
exchange onto a standby link with nothing lost, doubled or reordered and canonical routing
tables; the negative controls (no repair; an uncoordinated drop-and-re-add) must trip the same
checker."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from itertools import pairwise

import pytest

from canopy_broker.core.broker import BrokerCore, ProtocolError
from canopy_broker.core.cycles import (
    closing_budget,
    meet,
    message_bound,
    plan_link_repair,
    tree_budget,
)
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import (
    AddLink,
    CycleFound,
    CycleProbe,
    DetourLink,
    FindCycles,
    FromPeer,
    LinkFailed,
    LinkRepair,
    Lock,
    RepairLink,
    RoutingMode,
    SendToLink,
    SendToPeer,
    StandbyLinks,
)
from canopy_broker.runtime.framing import from_wire, to_wire
from canopy_broker.sim.checker import DeliveryReport, check_deliveries, check_routing
from canopy_broker.sim.simulator import Simulator
from canopy_broker.sim.topology import adjacency, random_tree, tree_path

Edge = tuple[str, str]
EdgeSet = frozenset[frozenset[str]]


def random_standby(edges: list[Edge], n: int, rng: random.Random, count: int) -> list[Edge]:
    """``count`` distinct non-tree pairs at random tree distances (some too far for the bound)."""
    names = [f"b{i}" for i in range(n)]
    tree = {frozenset(e) for e in edges}
    out: set[frozenset[str]] = set()
    while len(out) < count:
        a, b = rng.sample(names, 2)
        if frozenset((a, b)) not in tree:
            out.add(frozenset((a, b)))
    return [tuple(sorted(p)) for p in sorted(out, key=sorted)]  # type: ignore[misc]


def brute_force(edges: list[Edge], standby: list[Edge], bound: int) -> set[EdgeSet]:
    """Every simple cycle of the tree plus standby links with at most ``bound`` brokers and
    exactly one standby link, as edge sets (found by enumerating paths, not by the tree rule)."""
    adj = adjacency([*edges, *standby])
    spare = {frozenset(e) for e in standby}
    found: set[EdgeSet] = set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(adj[path[-1]]):
            if nxt == path[0] and len(path) >= 3:
                cyc = frozenset(frozenset(p) for p in pairwise([*path, nxt]))
                if len(cyc & spare) == 1:
                    found.add(cyc)
            elif nxt not in path and nxt > path[0] and len(path) < bound:
                walk([*path, nxt])

    for start in sorted(adj):
        walk([start])
    return found


def as_edges(cycle: tuple[str, ...]) -> EdgeSet:
    return frozenset(frozenset(p) for p in pairwise([*cycle, cycle[0]]))


def detected(seed: int, bound: int) -> tuple[Simulator, list[Edge], list[Edge]]:
    rng = random.Random(seed)
    n = rng.randint(8, 25)
    edges = random_tree(n, rng)
    standby = random_standby(edges, n, rng, rng.randint(2, 7))
    sim = Simulator([f"b{i}" for i in range(n)], edges, seed=seed)
    sim.set_standby(standby, at=0)
    sim.find_cycles(bound, 1, at=1)
    sim.run()
    return sim, edges, standby


def known(core: BrokerCore) -> set[EdgeSet]:
    return {as_edges(c) for c in core.cycles.known(core.is_neighbour)}


@pytest.mark.parametrize("bound", [3, 4, 5, 6])
@pytest.mark.parametrize("seed", range(8))
def test_each_broker_learns_exactly_the_small_cycles_it_is_on(seed: int, bound: int) -> None:
    sim, edges, standby = detected(seed, bound)
    want = brute_force(edges, standby, bound)
    closed = [tuple(tree_path(edges, *e)) for e in standby]
    longer = {as_edges(c) for c in closed if len(c) > bound}
    for name, core in sim.cores.items():
        mine = {c for c in want if any(name in e for e in c)}
        assert known(core) == mine, name
        assert not known(core) & longer  # nothing longer than the bound is reported
    # Each cycle is reported by one broker and told to its other members: no more.
    assert sim.stats.messages["CycleFound"] == sum(len(c) - 1 for c in want)


def test_the_bound_cuts_exactly_at_s() -> None:
    """A chain b0..b7 with standby links closing cycles of 3..8 brokers: bound 5 finds 3, 4, 5."""
    names = [f"b{i}" for i in range(8)]
    edges = list(pairwise(names))
    standby = [("b0", f"b{k}") for k in range(2, 8)]
    sim = Simulator(names, edges, seed=1)
    sim.set_standby(standby, at=0)
    sim.find_cycles(5, 1, at=1)
    sim.run()
    found = {c for core in sim.cores.values() for c in core.cycles.known(core.is_neighbour)}
    assert sorted(found) == [("b0", "b1", "b2"), ("b0", "b1", "b2", "b3"), tuple(names[:5])]


def expected_probes(edges: list[Edge], standby: list[Edge], bound: int) -> int:
    """What one round must cost by the flood rule, counted centrally: each heart's probe reaches
    the brokers within ``tree_budget`` tree hops; each closing probe crosses its standby link and
    reaches those within ``closing_budget`` of the far end, not through the heart."""
    adj = adjacency(edges)

    def reach(centre: str, radius: int, avoid: str | None) -> int:
        seen = {centre}
        frontier = deque([(centre, 0)])
        while frontier:
            node, d = frontier.popleft()
            if d == radius:
                continue
            for nxt in adj[node]:
                if nxt not in seen and nxt != avoid:
                    seen.add(nxt)
                    frontier.append((nxt, d + 1))
        return len(seen) - 1

    hearts = {min(e) for e in standby}
    total = sum(reach(h, tree_budget(bound), None) for h in hearts)
    return total + sum(1 + reach(v, closing_budget(bound), h) for h, v in standby)


@pytest.mark.parametrize("bound", [4, 6])
@pytest.mark.parametrize("seed", range(6))
def test_one_round_costs_what_the_flood_depths_allow(seed: int, bound: int) -> None:
    sim, edges, standby = detected(seed, bound)
    probes = sim.stats.messages["CycleProbe"]
    assert probes == expected_probes(edges, standby, bound)
    hearts = len({min(e) for e in standby})
    degree = max(len(v) for v in adjacency(edges).values())
    assert probes <= message_bound(hearts, len(standby), bound, degree)


def test_probe_paths_stay_short() -> None:
    """Paths carry at most tree_budget + 1 (tree probe) or closing_budget + 2 names."""
    rng = random.Random(3)
    edges = random_tree(30, rng)
    standby = random_standby(edges, 30, rng, 10)
    sim = Simulator([f"b{i}" for i in range(30)], edges, seed=3, record_traffic=True)
    sim.set_standby(standby, at=0)
    sim.find_cycles(6, 1, at=1)
    sim.run()
    assert sim.traffic is not None
    probes = [m for _, _, _, m in sim.traffic if isinstance(m, CycleProbe)]
    assert probes
    for p in probes:
        # the path as received, with the receiver
        limit = closing_budget(6) + 2 if p.closing else tree_budget(6) + 1
        assert len(p.path) + 1 <= limit


# --------------------------------------------------------------------------- link repair


def parent_links(edges: list[Edge], root: str = "b0") -> dict[str, str | None]:
    adj = adjacency(edges)
    parent: dict[str, str | None] = {root: None}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for nxt in sorted(adj[node]):
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return parent


def grandparent_links(edges: list[Edge]) -> list[Edge]:
    """Paper 003's standby link from each broker to its grandparent (rooted at b0)."""
    parent = parent_links(edges)
    pairs = [(b, parent[p]) for b, p in parent.items() if p is not None]
    return [(min(b, g), max(b, g)) for b, g in pairs if g is not None]


def spares_through(edges: list[Edge], standby: list[Edge], cut: Edge, bound: int) -> list[Edge]:
    """The standby links whose cycle contains ``cut`` and has at most ``bound`` brokers,
    shortest cycle first."""
    out = []
    for e in standby:
        path = tree_path(edges, *e)
        if len(path) <= bound and any({a, b} == set(cut) for a, b in pairwise(path)):
            out.append((len(path), e))
    return [e for _, e in sorted(out)]


@dataclass
class Cut:
    sim: Simulator
    edges: list[Edge]
    cut: Edge
    spares: list[Edge]  # standby links a repair may use, shortest cycle first
    start: float  # first publication
    stranded: int  # link messages waiting on the cut link when it was detected


BOUND = 5


def cut_under_traffic(
    seed: int, *, find: bool = True, strawman: bool = False, grandparents: bool = True
) -> Cut:
    """A random tree with grandparent standby links (or, without ``grandparents``, only random
    ones: longer cycles) and one random one; a link on a small cycle is cut for good at 600
    while every broker's publisher sends (401..1199) and detected at 700, then repaired by the
    core (or, ``strawman``, dropped while the standby link is added)."""
    rng = random.Random(seed)
    n = rng.randint(6, 12)
    names = [f"b{i}" for i in range(n)]
    edges = random_tree(n, rng)
    standby = grandparent_links(edges) if grandparents else []
    extra = 1 if grandparents else 4
    standby += [e for e in random_standby(edges, n, rng, extra) if e not in standby]
    while not any(2 < len(tree_path(edges, *e)) <= BOUND for e in standby):
        standby += random_standby(edges, n, rng, 1)
    sim = Simulator(names, edges, seed=seed)
    for i, b in enumerate(names):
        sim.attach(f"s{i}", b, at=0)
        sim.subscribe(f"s{i}", "x", Filter.parse(f"x >= {rng.randrange(3)}"), at=1)
        sim.attach(f"p{i}", b, at=0)
    sim.set_standby(standby, at=0)
    if find:
        sim.find_cycles(BOUND, 1, at=100)
    sim.run(until=400)
    cuttable = [e for e in edges if spares_through(edges, standby, e, BOUND)]
    cut = rng.choice(cuttable)
    spares = spares_through(edges, standby, cut, BOUND)
    start = 401.0
    for k in range(400):
        sim.publish(f"p{k % n}", {"x": k % 3}, at=start + k * 2.0)
    sim.cut_link(*cut, at=600)
    if strawman:
        sim.strawman_exchange(cut, spares[0], at=700)
    else:
        sim.detect_link_failure(*cut, at=700)
    sim.run(until=699)
    stranded = sim.stranded
    sim.run()
    return Cut(sim, edges, cut, spares, start, stranded)


def deliveries(c: Cut) -> DeliveryReport:
    sim = c.sim
    pubs = [p for p in sim.publications() if p.published_at >= c.start]
    return check_deliveries(sim.subs, pubs, [d for d in sim.deliveries if d.at >= c.start])


@pytest.mark.parametrize(
    ("seed", "grandparents"), [(s, True) for s in range(8)] + [(s, False) for s in range(8, 16)]
)
def test_a_link_cut_for_good_is_exchanged_onto_a_standby_link_losing_nothing(
    seed: int, grandparents: bool
) -> None:
    c = cut_under_traffic(seed, grandparents=grandparents)
    sim = c.sim
    assert c.stranded > 0  # the cut link held traffic when it was declared failed
    (record,) = sim.exchanges.values()
    assert record.ok, record
    assert set(record.remove) == set(c.cut)
    added = tuple(sorted((record.path[0], record.path[-1])))
    shortest = len(tree_path(c.edges, *c.spares[0]))
    assert added in c.spares and len(record.path) == shortest
    # One tree again: the old one with the cut link swapped for the standby link.
    want = {frozenset(e) for e in c.edges} - {frozenset(c.cut)} | {frozenset(added)}
    assert {frozenset(e) for e in sim.edges} == want
    assert sim.stranded == 0
    report = deliveries(c)
    assert report.ok and report.owed > 400, report
    assert check_routing(sim.cores, sim.edges, sim.subscriptions_by_broker()) == []
    # Only one end decided; an end that is not the initiator asked it out of band.
    deciders = [b for _, b, r in sim.link_repairs if r.xid]
    assert len(deciders) == 1
    assert sim.stats.messages["RepairLink"] == (0 if deciders[0] == record.path[0] else 1)


def test_the_initiator_may_be_neither_end_of_the_failed_link() -> None:
    """b0-b1-b2-b3 with standby b0-b3: cutting b1-b2 makes b1 ask b0 to exchange."""
    names = ["b0", "b1", "b2", "b3"]
    edges: list[Edge] = [("b0", "b1"), ("b1", "b2"), ("b2", "b3")]
    sim = Simulator(names, edges, seed=2)
    for i, b in enumerate(names):
        sim.attach(f"s{i}", b, at=0)
        sim.subscribe(f"s{i}", "x", Filter.parse("x >= 0"), at=1)
        sim.attach(f"p{i}", b, at=0)
    sim.set_standby([("b0", "b3")], at=0)
    sim.find_cycles(4, 1, at=100)
    sim.run(until=400)
    for k in range(200):
        sim.publish(f"p{k % 4}", {"x": k}, at=401 + k)
    sim.cut_link("b1", "b2", at=450, detect_after=50)
    sim.run()
    assert sim.stats.messages["RepairLink"] == 1
    (record,) = sim.exchanges.values()
    assert record.ok and record.path == ("b0", "b1", "b2", "b3")
    assert sim.edges == [("b0", "b1"), ("b0", "b3"), ("b2", "b3")]
    c = Cut(sim, edges, ("b1", "b2"), [("b0", "b3")], 401.0, 0)
    report = deliveries(c)
    assert report.ok and report.owed == 800, report
    assert check_routing(sim.cores, sim.edges, sim.subscriptions_by_broker()) == []


@pytest.mark.parametrize("seed", [3, 11, 14])
def test_later_rounds_find_the_cycles_of_the_repaired_tree(seed: int) -> None:
    """After the repair the used standby link is a tree link: the next rounds find the new
    tree's cycles. A cycle one round stopped finding lingers (unused) for one more round."""
    c = cut_under_traffic(seed, grandparents=False)
    sim = c.sim
    (record,) = sim.exchanges.values()
    assert record.ok
    standby = sorted({p for core in sim.cores.values() for p in _standby_links(core)})
    new_tree = sim.edges
    want = brute_force(new_tree, [e for e in standby if e not in new_tree], BOUND)
    for round_ in (2, 3):
        sim.find_cycles(BOUND, round_)
        sim.run()
        for name, core in sim.cores.items():
            mine = {cyc for cyc in want if any(name in e for e in cyc)}
            if round_ == 2:
                assert known(core) >= mine, name
            else:
                assert known(core) == mine, name
    # No broker plans a repair over a link that is gone: the ends of the cut link know no
    # cycle through it any more.
    a, b = c.cut
    assert plan_link_repair(a, b, sim.cores[a].cycles.known(sim.cores[a].is_neighbour)) is None


def _standby_links(core: BrokerCore) -> list[Edge]:
    return [(min(core.name, p), max(core.name, p)) for p in core.cycles.standby]


@pytest.mark.parametrize("seed", range(4))
def test_negative_control_without_cycles_the_far_side_starves(seed: int) -> None:
    c = cut_under_traffic(seed, find=False)
    sim = c.sim
    assert not sim.exchanges
    assert all(not r.xid and r.reason for _, _, r in sim.link_repairs)
    assert sim.stranded > 0
    report = deliveries(c)
    assert not report.ok and report.lost, report


@pytest.mark.parametrize("seed", range(4))
def test_negative_control_drop_and_re_add_loses_notifications(seed: int) -> None:
    c = cut_under_traffic(seed, strawman=True)
    report = deliveries(c)
    assert c.stranded > 0
    assert not report.ok and report.lost, report


# --------------------------------------------------------------------------- the pure parts


def test_plan_orients_the_exchange_and_picks_one_decider() -> None:
    # Triangle b0-b1-b2 (tree b0-b1, b1-b2; standby b0-b2).
    tri = ("b0", "b1", "b2")
    p = plan_link_repair("b1", "b2", {tri: 3})
    q = plan_link_repair("b2", "b1", {tri: 3})
    assert p == q and p is not None
    assert p.path == ("b2", "b1", "b0") and p.remove == ("b2", "b1") and p.decider == "b2"
    assert p.xid.endswith(":r3")
    # The shortest cycle wins; the chosen initiator is an end of the failed link if it can be.
    long = ("b1", "b2", "b3", "b4")
    assert plan_link_repair("b2", "b3", [long, ("b2", "b3", "b5")]).path == (  # type: ignore[union-attr]
        "b2",
        "b3",
        "b5",
    )
    mid = plan_link_repair("b3", "b2", [long])
    assert mid is not None and mid.path == long and mid.decider == "b2"
    assert plan_link_repair("b1", "b3", [long]) is None


def test_meet_reports_only_at_the_middle_of_the_cycle() -> None:
    # Tree path h=a, b, c, d, e=v (L = 4 hops); the middle is c (2 hops from each).
    assert meet("c", ("a", "b", "c"), ("a", "e", "d", "c")) == ("a", "b", "c", "d", "e")
    assert meet("d", ("a", "b", "c", "d"), ("a", "e", "d")) is None  # not the reporter
    # A broker hanging off the cycle (x below c) sees both fronts: not on the cycle.
    assert meet("x", ("a", "b", "c", "x"), ("a", "e", "d", "c", "x")) is None


def test_core_inputs_and_bad_probes() -> None:
    core = BrokerCore("b1", RoutingMode.COVERING)
    core.handle(AddLink("b0"))
    core.handle(AddLink("b2"))
    core.handle(StandbyLinks(("b3",)))
    out = core.handle(FindCycles(1, 4))
    sent = {(e.peer, e.message.closing) for e in out if isinstance(e, SendToPeer)}  # type: ignore[union-attr]
    assert sent == {("b0", False), ("b2", False), ("b3", True)}
    with pytest.raises(ProtocolError):
        core.handle(FindCycles(1, 4))  # the same round twice
    with pytest.raises(ProtocolError):  # the path does not end at the sender
        core.handle(FromPeer("b0", CycleProbe(1, "b9", ("b9", "b8"), 1)))
    with pytest.raises(ProtocolError):
        core.handle(FromPeer("b0", CycleFound(1, ("b0", "b2", "b5"))))  # not on it
    with pytest.raises(ProtocolError):
        core.handle(LinkFailed("b7"))
    # A failed link with no known cycle: no detour, nothing started, the reason said.
    out = core.handle(LinkFailed("b0"))
    assert [type(e) for e in out] == [LinkRepair] and not out[0].xid  # type: ignore[union-attr]
    # Told of the triangle b1-b2-b3 (standby b1-b3): b1 is an end of the failed link b1-b2
    # and of the standby link, so it detours the link and starts the exchange itself.
    core.handle(FromPeer("b2", CycleFound(2, ("b1", "b2", "b3"))))
    out = core.handle(LinkFailed("b2"))
    assert isinstance(out[0], DetourLink) and isinstance(out[1], LinkRepair)
    assert out[1].path == ("b1", "b2", "b3")
    assert SendToLink("b2", Lock(out[1].xid, ("b1", "b2", "b3"), 0)) in out  # over the detour
    # The other end of a failed link only detours it.
    other = BrokerCore("b2", RoutingMode.COVERING)
    other.handle(AddLink("b1"))
    other.handle(AddLink("b3"))
    other.handle(FromPeer("b1", CycleFound(2, ("b1", "b2", "b3"))))
    assert other.handle(LinkFailed("b1")) == [DetourLink("b1")]


def test_new_messages_survive_the_wire() -> None:
    for msg in (
        CycleProbe(3, "b0", ("b0", "b1"), 2, closing=True),
        CycleFound(3, ("b0", "b1", "b2")),
        RepairLink("link:b1-b2:b0-b2:r3", ("b0", "b1", "b2"), ("b1", "b2")),
    ):
        assert from_wire(to_wire(msg)) == msg
