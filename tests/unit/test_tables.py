"""The sharded tables behave as the built-in set and dict they replace, across the split, and
the routing state and the matcher built on them stay exact past it.

How long a table takes to grow is a benchmark's business (`canopy bench subscriptions`, and
docs/performance.md for the per-update figures); here only the behaviour is checked.
"""

from __future__ import annotations

import random

import pytest

from canopy_broker.core.filters import Filter
from canopy_broker.core.matching import IndexedMatcher, ScanMatcher
from canopy_broker.core.messages import Effect, RouteKey, RoutingMode
from canopy_broker.core.routing import RoutingState, maximal
from canopy_broker.core.tables import SHARDS, SPLIT_AT, ShardedDict, ShardedSet

# Enough distinct keys that every table passes SPLIT_AT, shrinks and grows again.
KEYS = 3 * SPLIT_AT


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sharded_set_is_a_set(seed: int) -> None:
    rng = random.Random(seed)
    table: ShardedSet[int] = ShardedSet()
    model: set[int] = set()
    for step in range(12 * KEYS):
        key = rng.randrange(KEYS)
        # Grow for the first half, then shrink: both directions cross SPLIT_AT.
        if rng.random() < (0.7 if step < 6 * KEYS else 0.3):
            assert table.add(key) is (key not in model)
            model.add(key)
        elif rng.random() < 0.5 and key in model:
            table.remove(key)
            model.remove(key)
        else:
            assert table.discard(key) is (key in model)
            model.discard(key)
        assert (key in table) is (key in model)
        assert len(table) == len(model)
        assert bool(table) is bool(model)
    assert sorted(table) == sorted(model)
    with pytest.raises(KeyError):
        table.remove(-1)


@pytest.mark.parametrize("seed", [1, 2])
def test_sharded_dict_is_a_dict(seed: int) -> None:
    rng = random.Random(seed)
    table: ShardedDict[str, int] = ShardedDict()
    model: dict[str, int] = {}
    for step in range(12 * KEYS):
        key = f"k{rng.randrange(KEYS)}"
        if rng.random() < (0.7 if step < 6 * KEYS else 0.3):
            table[key] = model[key] = step
        elif key in model:
            if rng.random() < 0.5:
                assert table.pop(key) == model.pop(key)
            else:
                del table[key]
                del model[key]
        assert table.get(key) == model.get(key)
        assert table.get(key, -1) == model.get(key, -1)
        assert (key in table) is (key in model)
        assert len(table) == len(model)
    assert sorted(table.items()) == sorted(model.items())
    assert sorted(table) == sorted(model)
    assert sorted(table.values()) == sorted(model.values())
    with pytest.raises(KeyError):
        table["absent"]
    with pytest.raises(KeyError):
        del table["absent"]


def test_a_big_table_splits_and_spreads_its_keys() -> None:
    """Sequential integers hash to themselves: a modulus that shared a factor with Python's own
    table sizes would pile them up; the prime spreads them evenly."""
    ints: ShardedSet[int] = ShardedSet(range(SPLIT_AT))
    assert len(ints._shards) == 1  # small tables stay one plain set
    for i in range(SPLIT_AT, 100 * SHARDS):
        ints.add(i)
    assert len(ints._shards) == SHARDS
    sizes = [len(s) for s in ints._shards]
    assert max(sizes) - min(sizes) <= 1
    keys: ShardedSet[RouteKey] = ShardedSet(RouteKey(Filter.parse(f"k = {i}")) for i in range(6100))
    sizes = [len(s) for s in keys._shards]
    assert len(sizes) == SHARDS and max(sizes) < 2 * 6100 / SHARDS


def _filters(rng: random.Random, n: int) -> list[Filter]:
    """Mostly distinct equality filters (the big tables), with ranges and prefixes that cover
    some of them (the covering questions)."""
    out = []
    for i in range(n):
        shape = rng.random()
        if shape < 0.7:
            out.append(Filter.parse(f"k = {i} and zone = {rng.randrange(4)}"))
        elif shape < 0.85:
            out.append(Filter.parse(f"k >= {rng.randrange(n)} and zone = {rng.randrange(4)}"))
        else:
            out.append(Filter.parse(f'name prefix "n{rng.randrange(50)}"'))
    return out


def test_routing_stays_canonical_past_the_split() -> None:
    """Three neighbours and a client hold thousands of keys, then drop most: what each
    neighbour is told stays exactly the maximal keys held from everywhere else."""
    rng = random.Random(7)
    state = RoutingState(RoutingMode.COVERING)
    out: list[Effect] = []
    peers = ["p0", "p1", "p2"]
    for p in peers:
        state.add_link(p, out)
    state.attach("c")
    from_peer: dict[str, set[RouteKey]] = {p: set() for p in peers}
    local: dict[str, Filter] = {}
    for i, f in enumerate(_filters(rng, KEYS)):
        source = rng.choice([*peers, "c"])
        if source == "c":
            local[f"s{i}"] = f
            state.subscribe("c", f"s{i}", f, out)
        elif RouteKey(f) not in from_peer[source]:
            from_peer[source].add(RouteKey(f))
            state.learn(source, [RouteKey(f)], out)
    for sub_id in rng.sample(sorted(local), len(local) * 2 // 3):
        state.unsubscribe("c", sub_id, out)
        del local[sub_id]
    for p in peers:
        gone = set(rng.sample(sorted(from_peer[p], key=RouteKey.sort_key), len(from_peer[p]) // 2))
        state.forget(p, gone, out)
        from_peer[p] -= gone
    for p in peers:
        assert set(state.held_from(p)) == from_peer[p]
        others = [k for q in peers if q != p for k in from_peer[q]]
        expected = maximal([*others, *(RouteKey(f) for f in local.values())], state.mode)
        assert set(state.advertised_to(p)) == expected
        assert state.wanted_by(p) == expected
    assert state.size() == sum(map(len, from_peer.values())) + len(local)


def test_matcher_agrees_with_a_scan_past_the_split() -> None:
    rng = random.Random(11)
    filters = _filters(rng, KEYS)
    indexed: IndexedMatcher[int] = IndexedMatcher()
    scan: ScanMatcher[int] = ScanMatcher()
    for i, f in enumerate(filters):
        indexed.add(f, i % 500)
        scan.add(f, i % 500)
    for i, f in enumerate(filters):
        if i % 3:
            indexed.remove(f, i % 500)
            scan.remove(f, i % 500)
    sizes = []
    for _ in range(400):
        event = {
            "k": rng.randrange(KEYS),
            "zone": rng.randrange(4),
            "name": f"n{rng.randrange(60)}x",
        }
        got = indexed.match_payloads(event)
        assert got == scan.match_payloads(event)
        sizes.append(len(got))
    assert 0 < min(sizes) < max(sizes) < 500  # not vacuous: results differ between events
