"""The planner's guarantees, checked by replaying every plan step by step."""

from __future__ import annotations

import itertools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canopy_broker.sim.topology import random_tree
from canopy_operator.model.planner import Cause, LiveOverlay, Plan, decide, plan
from canopy_operator.model.topology import (
    Broker,
    OverlaySpec,
    adjacency,
    components,
    norm,
    tree_path,
    validate,
)


def spec(
    names: list[str], links: list[tuple[str, str]] | None, f: int = 4, conc: int = 3
) -> OverlaySpec:
    return OverlaySpec(
        "t",
        tuple(Broker(n) for n in names),
        None if links is None else tuple(links),
        max_fan_out=f,
        max_concurrent=conc,
    )


def is_tree(nodes: set[str], edges: set[tuple[str, str]]) -> bool:
    if len(edges) != len(nodes) - 1:
        return False
    adj = adjacency(edges)
    seen, stack = {min(nodes)}, [min(nodes)]
    while stack:
        for x in adj[stack.pop()]:
            if x not in seen:
                seen.add(x)
                stack.append(x)
    return seen == nodes


def replay(live: LiveOverlay, p: Plan, f: int) -> tuple[set[str], set[tuple[str, str]], int]:
    """Apply the steps; assert each intermediate is a tree and each exchange's cycle is the
    tree path between the added link's ends and contains the removed link. Returns the final
    brokers, links, and the highest degree excess seen between steps."""
    nodes = set(live.brokers)
    edges = {norm(e) for e in live.links}
    excess = 0
    batches: dict[int, list[set[str]]] = {}
    for step in p.steps:
        touched = step.brokers() | ({step.broker} if step.broker else set())
        assert all(not (touched & other) for other in batches.get(step.batch, []))
        batches.setdefault(step.batch, []).append(touched)
        if step.kind == "add-leaf":
            assert step.broker not in nodes and step.add is not None
            nodes.add(step.broker)  # type: ignore[arg-type]
            edges.add(norm(step.add))
        elif step.kind == "join":  # two trees of a split forest become one: never a cycle
            assert step.add is not None and set(step.add) <= nodes
            assert not any(set(step.add) <= part for part in components(nodes, edges))
            edges.add(norm(step.add))
            continue  # a forest until the last join (checked by the steps after it)
        elif step.kind == "exchange":
            assert step.add is not None and step.remove is not None
            path = tree_path(adjacency(edges), step.add[0], step.add[1])
            assert tuple(path) == step.cycle
            assert norm(step.remove) in {norm(e) for e in itertools.pairwise(path)}
            edges.remove(norm(step.remove))
            edges.add(norm(step.add))
        else:
            assert step.broker in nodes
            assert sum(step.broker in e for e in edges) <= 1, "only leaves are removed"
            edges = {e for e in edges if step.broker not in e}
            nodes.remove(step.broker)  # type: ignore[arg-type]
        assert is_tree(nodes, edges), step
        deg: dict[str, int] = {}
        for a, b in edges:
            deg[a] = deg.get(a, 0) + 1
            deg[b] = deg.get(b, 0) + 1
        excess = max(excess, max(deg.values(), default=0) - f)
    return nodes, edges, excess


@st.composite
def changes(draw: st.DrawFn, max_n: int = 200) -> tuple[LiveOverlay, OverlaySpec]:
    n = draw(st.integers(2, max_n))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    names = [f"b{i}" for i in range(n)]
    t1 = random_tree(n, rng)
    drop = [x for x in names[1:] if rng.random() < draw(st.sampled_from([0.0, 0.1]))]
    new = [f"n{i}" for i in range(draw(st.integers(0, 5)))]
    final_names = [x for x in names if x not in drop] + new
    rng.shuffle(final_names)
    relabel = dict(zip([f"b{i}" for i in range(len(final_names))], final_names, strict=True))
    t2 = [(relabel[a], relabel[b]) for a, b in random_tree(len(final_names), rng)]
    return LiveOverlay(tuple(names), tuple(t1)), spec(sorted(final_names), t2)


@given(changes())
@settings(max_examples=80)
def test_plans_reach_the_desired_tree_through_trees(case: tuple[LiveOverlay, OverlaySpec]) -> None:
    live, desired = case
    assert not validate(desired)
    p = plan(live, desired)
    nodes, edges, excess = replay(live, p, desired.max_fan_out)
    assert nodes == set(desired.broker_names)
    assert edges == {norm(e) for e in desired.links or ()}
    assert set(p.final_links) == edges
    assert excess <= 1  # at most one link above maxFanOut between steps


@given(st.integers(2, 200), st.integers(0, 2**32 - 1))
@settings(max_examples=60)
def test_same_brokers_take_exactly_the_minimum_number_of_exchanges(n: int, seed: int) -> None:
    rng = random.Random(seed)
    names = [f"b{i}" for i in range(n)]
    t1, t2 = random_tree(n, rng), random_tree(n, rng)
    p = plan(LiveOverlay(tuple(names), tuple(t1)), spec(names, t2))
    differing = {norm(e) for e in t1} - {norm(e) for e in t2}
    assert len(p.steps) == len(p.exchanges) == len(differing)
    replay(LiveOverlay(tuple(names), tuple(t1)), p, 4)


def test_no_change_no_steps_and_batches_respect_max_concurrent() -> None:
    names = [f"b{i}" for i in range(8)]
    chain = list(itertools.pairwise(names))
    assert plan(LiveOverlay(tuple(names), tuple(chain)), spec(names, chain)).steps == ()
    star = [("b0", x) for x in names[1:4]] + [("b1", x) for x in names[4:]]
    p = plan(LiveOverlay(tuple(names), tuple(chain)), spec(names, star, f=5, conc=2))
    sizes: dict[int, int] = {}
    for s in p.steps:
        sizes[s.batch] = sizes.get(s.batch, 0) + 1
    assert max(sizes.values()) <= 2


def test_inner_broker_removal_makes_it_a_leaf_first() -> None:
    names = ["a", "b", "c", "d"]
    live = LiveOverlay(tuple(names), (("a", "b"), ("b", "c"), ("b", "d")))
    p = plan(live, spec(["a", "c", "d"], [("a", "c"), ("c", "d")]))
    kinds = [s.kind for s in p.steps]
    assert kinds[-1] == "remove-leaf" and p.steps[-1].broker == "b"
    assert kinds.count("exchange") == 2
    replay(live, p, 4)


@given(st.integers(2, 120), st.integers(0, 2**32 - 1), st.integers(0, 6))
@settings(max_examples=40)
def test_managed_links_join_within_fan_out(n: int, seed: int, joins: int) -> None:
    rng = random.Random(seed)
    names = [f"b{i}" for i in range(n)]
    live = LiveOverlay(tuple(names), tuple(random_tree(n, rng, max_fanout=3)))
    gone = [x for x in names if rng.random() < 0.1]
    want = [x for x in names if x not in gone] + [f"j{i}" for i in range(joins)]
    if not want:
        return
    desired = spec(want, None, f=4)
    p = plan(live, desired)
    nodes, _edges, excess = replay(live, p, 4)
    assert nodes == set(want) and excess <= 1


def test_planning_a_1000_broker_change_is_fast() -> None:
    """Measured, not asserted tightly: the figure goes to the report; the bound is generous."""
    rng = random.Random(1)
    names = [f"b{i}" for i in range(1000)]
    t1, t2 = random_tree(1000, rng), random_tree(1000, rng)
    t = time.perf_counter()
    p = plan(LiveOverlay(tuple(names), tuple(t1)), spec(names, t2))
    wall = time.perf_counter() - t
    print(f"planned {len(p.steps)} exchanges for 1000 brokers in {wall:.3f} s")
    assert len(p.exchanges) == len({norm(e) for e in t1} - {norm(e) for e in t2})


@pytest.mark.parametrize(
    ("problems", "status", "cause", "creating"),
    [
        (["links do not form a tree"], {}, Cause.INVALID, False),
        ([], {}, Cause.PLAN, True),  # never converged: Creating
        ([], {"phase": "Invalid"}, Cause.PLAN, True),
        ([], {"phase": "Ready", "plan": {"generation": 4, "steps": []}}, Cause.PLAN, False),
        (  # the saved plan of this generation is done: plan again from the live tree
            [],
            {
                "phase": "Ready",
                "plan": {"generation": 5, "steps": [{"kind": "add-leaf", "done": True}]},
            },
            Cause.PLAN,
            False,
        ),
        (  # an older generation's unfinished plan is not resumed
            [],
            {"phase": "Degraded", "plan": {"generation": 4, "steps": [{"kind": "add-leaf"}]}},
            Cause.PLAN,
            False,
        ),
    ],
)
def test_reconcile_decision_table(
    problems: list[str], status: dict[str, object], cause: Cause, creating: bool
) -> None:
    d = decide(problems, 5, status)
    assert (d.cause, d.creating) == (cause, creating)
    assert d.problems == tuple(problems)


def test_an_unfinished_plan_of_this_generation_is_resumed_as_saved() -> None:
    steps = [
        {"kind": "add-leaf", "batch": 0, "broker": "d", "add": ["c", "d"], "done": True},
        {
            "kind": "exchange",
            "batch": 1,
            "remove": ["a", "b"],
            "add": ["a", "d"],
            "cycle": ["a", "b", "c", "d"],
            "done": False,
        },
    ]
    d = decide([], 5, {"phase": "Reconfiguring", "plan": {"generation": 5, "steps": steps}})
    assert d.cause is Cause.RESUME and not d.creating
    assert d.completed == (0,)
    assert [s.kind for s in d.steps] == ["add-leaf", "exchange"]
    assert d.steps[1].cycle == ("a", "b", "c", "d") and d.steps[1].remove == ("a", "b")
