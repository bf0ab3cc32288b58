"""Topology pictures: DOT text always; PNG through Graphviz when installed, else matplotlib."""

from __future__ import annotations

from pathlib import Path

from canopy_operator.draw import draw, layout, to_dot


def test_dot_names_every_broker_and_link_and_highlights() -> None:
    dot = to_dot(["a", "b", "c", "d"], [("b", "a"), ("b", "c")], "t", highlight=[("a", "b")])
    assert '"d";' in dot  # a broker without links is still drawn
    assert '"a" -- "b" [color=red' in dot and '"b" -- "c";' in dot


def test_pictures_are_written(tmp_path: Path) -> None:
    edges = [("b0", "b1"), ("b1", "b2"), ("b1", "b3")]
    png = draw(["b0", "b1", "b2", "b3"], edges, tmp_path / "t.png", title="t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "graph" in draw(["b0"], [], tmp_path / "t.dot").read_text()


def test_layout_puts_the_most_central_broker_on_top() -> None:
    pos = layout(["a", "b", "c", "d", "e"], [("a", "b"), ("b", "c"), ("c", "d"), ("d", "e")])
    assert max(pos, key=lambda n: pos[n][1]) == "c"
