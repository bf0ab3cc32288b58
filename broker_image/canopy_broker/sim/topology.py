"""Tree helpers for experiments: random trees, tree paths, random valid link exchanges.

Pure functions over edge lists; the randomness is always a ``random.Random`` the caller seeds.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Edge = tuple[str, str]


def random_tree(n: int, rng: random.Random, max_fanout: int = 4, prefix: str = "b") -> list[Edge]:
    """A randomly grown tree over ``n`` brokers whose degrees never exceed ``max_fanout``."""
    names = [f"{prefix}{i}" for i in range(n)]
    degree = dict.fromkeys(names, 0)
    edges: list[Edge] = []
    for i in range(1, n):
        choices = [names[j] for j in range(i) if degree[names[j]] < max_fanout]
        parent = rng.choice(choices)
        degree[parent] += 1
        degree[names[i]] += 1
        edges.append((parent, names[i]))
    return edges


def adjacency(edges: Iterable[Edge]) -> dict[str, set[str]]:
    adj: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        adj[a].add(b)
        adj[b].add(a)
    return adj


def tree_path(edges: Iterable[Edge], src: str, dst: str) -> list[str]:
    """The unique path from ``src`` to ``dst`` in a tree given as edges."""
    return path_between(adjacency(edges), src, dst)


def path_between(adj: Mapping[str, set[str]], src: str, dst: str) -> list[str]:
    """The path from ``src`` to ``dst`` in a tree given as adjacency sets (breadth first, so
    only the part of the tree nearer than ``dst`` is visited)."""
    if src == dst:
        return [src]
    parent: dict[str, str] = {src: src}
    frontier = [src]
    while frontier and dst not in parent:
        nxt_frontier = []
        for node in frontier:
            for nxt in adj[node]:
                if nxt not in parent:
                    parent[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    if dst not in parent:
        raise ValueError(f"{dst} is not connected to {src}")
    path = [dst]
    while path[-1] != src:
        path.append(parent[path[-1]])
    return path[::-1]


def norm(e: Iterable[str]) -> Edge:
    """A link with its ends in a canonical order (links are undirected)."""
    a, b = e
    return (a, b) if a <= b else (b, a)


@dataclass(frozen=True)
class ExchangeSpec:
    """Remove ``remove`` and add (path[0], path[-1]); ``path`` is the cycle in the tree."""

    path: tuple[str, ...]
    remove: Edge

    @property
    def add(self) -> Edge:
        return (self.path[0], self.path[-1])

    def path_edges(self) -> set[Edge]:
        return {norm((a, b)) for a, b in zip(self.path, self.path[1:], strict=False)}

    def apply(self, edges: Iterable[Edge]) -> list[Edge]:
        out = [e for e in edges if norm(e) != norm(self.remove)]
        return [*out, self.add]


def random_exchange(
    edges: list[Edge],
    rng: random.Random,
    max_fanout: int | None = None,
    max_cycle: int = 0,
    min_side: int = 0,
) -> ExchangeSpec | None:
    """A random valid exchange on the tree (None if none was found in a few tries).

    ``min_side``: only remove links that leave at least that many brokers on either side (most
    links of a randomly grown tree cut off a leaf or two; this draws among the inner ones)."""
    adj = adjacency(edges)
    for _ in range(50):
        r = rng.choice(edges)
        side1 = component(adj, r[0], r[1])
        side2 = set(adj) - side1
        if min(len(side1), len(side2)) < min_side:
            continue
        a1 = rng.choice(sorted(side1))
        a2 = rng.choice(sorted(side2))
        if norm((a1, a2)) == norm(r) or a2 in adj[a1]:
            continue
        if max_fanout is not None and (len(adj[a1]) >= max_fanout or len(adj[a2]) >= max_fanout):
            continue
        path = tree_path(edges, a1, a2)
        if max_cycle and len(path) > max_cycle:
            continue
        return ExchangeSpec(tuple(path), norm(r))
    return None


def component(adj: dict[str, set[str]], start: str, cut: str) -> set[str]:
    """The brokers on ``start``'s side of the link ``start``-``cut`` (as if it were removed)."""
    seen = {start}
    stack = [start]
    while stack:
        node = stack.pop()
        for nxt in adj[node]:
            if nxt not in seen and not (node == start and nxt == cut):
                seen.add(nxt)
                stack.append(nxt)
    return seen


def compatible(x: ExchangeSpec, y: ExchangeSpec) -> bool:
    """Whether two exchanges computed on the same tree can run in either order."""
    return (
        norm(x.remove) not in y.path_edges()
        and norm(y.remove) not in x.path_edges()
        and norm(x.add) != norm(y.add)
        and norm(x.remove) != norm(y.remove)
    )


def random_group(
    edges: list[Edge],
    rng: random.Random,
    size: int,
    max_fanout: int | None = None,
    min_side: int = 0,
) -> list[ExchangeSpec]:
    """Up to ``size`` mutually compatible exchanges on one tree (they may share brokers)."""
    group: list[ExchangeSpec] = []
    for _ in range(size * 5):
        if len(group) == size:
            break
        x = random_exchange(edges, rng, max_fanout, min_side=min_side)
        if x is not None and all(compatible(x, y) for y in group):
            group.append(x)
    return group
