"""The demo's trees: the starting overlay, the reshaped one (at least five link exchanges, one
broker added, one removed), and a text picture of a tree."""

from __future__ import annotations

import random
from typing import Any

from canopy_broker.sim.topology import adjacency, path_between, random_tree
from canopy_operator.model.planner import LiveOverlay, plan
from canopy_operator.model.topology import parse_overlay


def draw_tree(names: list[str], edges: list[tuple[str, str]]) -> str:
    """An indented drawing of the tree rooted at the first broker."""
    adj: dict[str, list[str]] = {n: [] for n in names}
    for a, b in edges:
        adj[a].append(b)
        adj[b].append(a)
    lines: list[str] = []

    def walk(node: str, parent: str | None, prefix: str, last: bool, root: bool) -> None:
        lines.append(node if root else f"{prefix}{'└── ' if last else '├── '}{node}")
        children = sorted(c for c in adj[node] if c != parent)
        for i, child in enumerate(children):
            ext = "" if root else ("    " if last else "│   ")
            walk(child, node, prefix + ext, i == len(children) - 1, False)

    walk(names[0], None, "", True, True)
    return "\n".join(lines)


def overlay_manifest(
    name: str, brokers: list[str], links: list[tuple[str, str]], routing: str
) -> dict[str, Any]:
    return {
        "apiVersion": "canopy.dev/v1alpha1",
        "kind": "BrokerOverlay",
        "metadata": {"name": name},
        "spec": {
            "maxFanOut": 3,
            "routing": routing,
            "reconfiguration": {"algorithm": "coordinated", "ordering": "fifo", "maxConcurrent": 2},
            "brokers": [{"name": b} for b in brokers],
            "links": [list(e) for e in links],
        },
    }


def reshaped(
    names: list[str],
    removed: str,
    added: str,
    live: list[tuple[str, str]],
    *,
    rng: random.Random,
    routing: str,
    apart: tuple[str, str] | None = None,
) -> tuple[dict[str, Any], int]:
    """A new tree over the brokers (one removed, one added) that takes at least 5 exchanges
    (and keeps the brokers ``apart`` at least three links apart)."""
    new_names = [b for b in names if b != removed] + [added]
    for _ in range(200):
        order = new_names[:]
        rng.shuffle(order)
        relabel = dict(zip([f"b{i}" for i in range(len(order))], order, strict=True))
        tree = [(relabel[a], relabel[b]) for a, b in random_tree(len(order), rng, max_fanout=3)]
        manifest = overlay_manifest("demo", new_names, tree, routing)
        spec = parse_overlay(manifest)
        p = plan(LiveOverlay(tuple(names), tuple(live)), spec)
        if apart and len(path_between(adjacency(tree), *apart)) < 4:
            continue
        if len(p.exchanges) >= 5:
            return manifest, len(p.exchanges)
    raise RuntimeError("no reshaped tree with 5 exchanges found")


def far_apart(edges: list[tuple[str, str]], exclude: str) -> tuple[str, str]:
    """Two brokers (not ``exclude``) at the ends of the longest path of the tree without it."""
    adj = adjacency(edges)
    names = sorted(b for b in adj if b != exclude)
    return max(
        ((a, b) for a in names for b in names if a < b),
        key=lambda ab: (len(path_between(adj, *ab)), ab),
    )
