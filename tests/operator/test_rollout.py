"""Rolling replacement, without brokers: the intermediate shape, the order, which brokers are
stale, and replace_broker's two plans replayed step by step (every state a tree, the broker
out as a leaf with its clients' destination, back in its declared place)."""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from canopy_broker.sim.topology import random_tree
from canopy_operator.executor import replace_broker
from canopy_operator.model import rollout
from canopy_operator.model.planner import LiveOverlay, Plan
from canopy_operator.model.topology import norm, validate
from tests.operator.test_planner import replay, spec

NAMES = ["hub", "east", "west", "north", "south", "edge-1"]
LINKS = [("hub", "east"), ("hub", "west"), ("hub", "north"), ("east", "south")]
LINKS += [("west", "edge-1")]


def test_without_chains_the_neighbours_where_the_broker_was() -> None:
    out = rollout.without(spec(NAMES, LINKS, f=3), LINKS, "hub")
    assert out.broker_names == ["east", "west", "north", "south", "edge-1"]
    assert out.links is not None
    assert set(out.links) == {("east", "south"), ("edge-1", "west")} | {
        ("east", "north"),
        ("north", "west"),
    }
    assert not validate(out)  # a valid tree over the others
    managed = rollout.without(spec(NAMES, None), LINKS, "hub")
    assert managed.links is None and "hub" not in managed.broker_names


def test_stale_brokers_are_those_started_otherwise_or_unknown() -> None:
    wanted = ["covering", "--retention", "20.0"]
    configs = {"a": wanted, "b": ["covering", "--retention", "15.0"], "c": None}
    assert rollout.stale(configs, lambda _b: wanted) == ["b", "c"]


def test_leaves_go_first() -> None:
    assert rollout.order(LINKS, NAMES) == ["edge-1", "north", "south", "east", "west", "hub"]


async def run_replacement(names: list[str], links: list[tuple[str, str]], broker: str) -> None:
    declared = spec(names, links, f=len(names))
    state = {"live": LiveOverlay(tuple(names), tuple(links))}
    plans: list[Plan] = []

    async def live() -> LiveOverlay:
        return state["live"]

    async def run_plan(p: Plan) -> None:
        nodes, edges, _ = replay(state["live"], p, len(names))  # asserts a tree at every step
        plans.append(p)
        state["live"] = LiveOverlay(tuple(sorted(nodes)), tuple(sorted(edges)))

    result = await replace_broker(broker, declared, live, run_plan)
    out, back = plans
    kinds_out = [s.kind for s in out.steps]
    assert kinds_out[-1] == "remove-leaf" and out.steps[-1].broker == broker, kinds_out
    assert set(kinds_out[:-1]) <= {"exchange"}  # made a leaf by exchanges only
    assert out.steps[-1].remove is not None  # its clients have a neighbour to go to
    assert back.steps[0].kind == "add-leaf" and back.steps[0].broker == broker
    assert {s.kind for s in back.steps[1:]} <= {"exchange"}
    assert set(state["live"].links) == {norm(e) for e in links}  # as declared again
    assert result["steps"] == len(out.steps) + len(back.steps)


async def test_replacing_an_inner_broker_takes_it_out_as_a_leaf_and_back() -> None:
    await run_replacement(NAMES, LINKS, "hub")


async def test_replacing_a_leaf_needs_no_exchange() -> None:
    await run_replacement(NAMES, LINKS, "edge-1")


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 12), seed=st.integers(0, 10_000), pick=st.integers(0, 11))
def test_any_broker_of_any_tree_is_replaced_by_tree_preserving_steps(
    n: int, seed: int, pick: int
) -> None:
    links = [norm(e) for e in random_tree(n, random.Random(seed), max_fanout=n)]
    names = [f"b{i}" for i in range(n)]
    asyncio.run(run_replacement(names, links, names[pick % n]))
