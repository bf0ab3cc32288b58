"""Topology pictures: Graphviz when its ``dot`` is installed (PNG/SVG), otherwise a tree laid
out by depth from its most central broker with matplotlib; ``.dot`` writes the DOT text."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from canopy_operator.model.topology import Edge, adjacency


def layout(names: Iterable[str], edges: Iterable[Edge]) -> dict[str, tuple[float, float]]:
    adj = adjacency(edges)
    nodes = sorted(set(names) | set(adj))
    if not nodes:
        return {}

    def eccentricity(root: str) -> int:
        depth, frontier, seen = 0, [root], {root}
        while frontier:
            nxt = [y for x in frontier for y in adj[x] if y not in seen]
            seen.update(nxt)
            frontier = nxt
            depth += bool(nxt)
        return depth

    root = min(nodes, key=lambda n: (eccentricity(n), n))
    pos: dict[str, tuple[float, float]] = {}
    counter = [0.0]

    def place(node: str, parent: str | None, depth: int) -> float:
        children = sorted(c for c in adj[node] if c != parent)
        if not children:
            x = counter[0]
            counter[0] += 1.0
        else:
            xs = [place(c, node, depth + 1) for c in children]
            x = sum(xs) / len(xs)
        pos[node] = (x, -float(depth))
        return x

    place(root, None, 0)
    for n in nodes:  # brokers without links yet
        if n not in pos:
            pos[n] = (counter[0], 0.0)
            counter[0] += 1.0
    return pos


def to_dot(
    names: Iterable[str],
    edges: Iterable[Edge],
    title: str = "overlay",
    highlight: Iterable[Edge] = (),
) -> str:
    bold = {(min(e), max(e)) for e in highlight}
    lines = [f'graph "{title}" {{', f'  label="{title}";', "  node [shape=circle, fontsize=10];"]
    lines += [f'  "{n}";' for n in sorted(set(names))]
    for a, b in sorted((min(e), max(e)) for e in edges):
        style = " [color=red, penwidth=2.5]" if (a, b) in bold else ""
        lines.append(f'  "{a}" -- "{b}"{style};')
    return "\n".join([*lines, "}"]) + "\n"


def draw(
    names: Iterable[str],
    edges: Iterable[Edge],
    out: Path,
    title: str = "",
    highlight: Iterable[Edge] = (),
) -> Path:
    """Write the tree to ``out`` (.png, .svg or .dot); ``highlight`` edges are drawn bold."""
    names = list(names)
    edges = [(min(e), max(e)) for e in edges]
    dot = to_dot(names, edges, title or "overlay", highlight)
    if out.suffix == ".dot":
        out.write_text(dot)
        return out
    graphviz = shutil.which("dot")
    if graphviz is not None and out.suffix in (".png", ".svg"):
        subprocess.run(
            [graphviz, f"-T{out.suffix[1:]}", "-o", str(out)], input=dot, text=True, check=True
        )
        return out
    import matplotlib  # noqa: PLC0415 - optional dependency, only for pictures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    pos = layout(names, edges)
    bold = {(min(e), max(e)) for e in highlight}
    width = max(4.0, 0.9 * (1 + max((x for x, _ in pos.values()), default=0)))
    height = max(3.0, 1.1 * (1 - min((y for _, y in pos.values()), default=0)))
    fig, ax = plt.subplots(figsize=(min(width, 24), min(height, 16)))
    for a, b in edges:
        (xa, ya), (xb, yb) = pos[a], pos[b]
        thick = (a, b) in bold
        ax.plot(
            [xa, xb],
            [ya, yb],
            color="tab:red" if thick else "0.4",
            linewidth=2.5 if thick else 1.0,
            zorder=1,
        )
    for n, (x, y) in pos.items():
        ax.scatter([x], [y], s=600, color="white", edgecolors="tab:blue", zorder=2)
        ax.annotate(n, (x, y), ha="center", va="center", fontsize=7, zorder=3)
    ax.set_title(title)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
