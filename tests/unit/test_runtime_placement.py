"""Where a broker runs, as the runtime learns it: flags, and Kubernetes' downward-API files
(rewritten by the kubelet when the operator annotates the pod), passed to the core, which
announces its neighbour list in placement order; and the end of a repair whose chain neighbour
died with the dead broker."""

from __future__ import annotations

import os
from pathlib import Path

from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.messages import (
    AddLink,
    FromLink,
    Neighbours,
    PeerFailed,
    RepairFinished,
    RepairSweep,
    SendToLink,
)
from canopy_broker.runtime.placement import Placement, PlacementSource, parse_downward
from tests.unit.test_runtime_broker import MakeBroker, eventually, link, make_broker

__all__ = ["make_broker"]  # the fixture, imported for pytest


def write_downward(directory: Path, labels: dict[str, str], annotations: dict[str, str]) -> None:
    """As the kubelet does: whole files replaced, ``key="value"`` per line."""
    for name, values in (("labels", labels), ("annotations", annotations)):
        tmp = directory / f".{name}.tmp"
        tmp.write_text("".join(f'{k}="{v}"\n' for k, v in values.items()), encoding="utf-8")
        os.replace(tmp, directory / name)


def test_parse_downward_reads_quoted_values_and_skips_junk() -> None:
    text = 'app="canopy"\ncanopy.dev/zone="eu-1a"\nnot a line\nweird="a\\"b"\n=x\n'
    assert parse_downward(text) == {"app": "canopy", "canopy.dev/zone": "eu-1a", "weird": 'a"b'}


def test_the_zone_comes_from_the_label_else_the_annotation_and_changes_are_reported(
    tmp_path: Path,
) -> None:
    src = PlacementSource(node="n1", directory=str(tmp_path))
    assert src.poll() == Placement("", "n1")  # no files yet: the node is known
    assert src.poll() is None
    write_downward(tmp_path, {"app": "x"}, {"canopy.dev/zone": "z-annotated"})
    assert src.poll() == Placement("z-annotated", "n1")
    write_downward(
        tmp_path, {"topology.kubernetes.io/zone": "z-label"}, {"canopy.dev/zone": "z-annotated"}
    )
    assert src.poll() == Placement("z-label", "n1")  # the node's own label wins
    assert src.poll() is None
    fixed = PlacementSource(zone="z-flag", directory=str(tmp_path))
    assert fixed.poll() == Placement("z-flag", "")  # --zone overrides the files


async def test_a_broker_picks_up_its_zone_from_the_downward_api_and_tells_its_neighbour(
    make_broker: MakeBroker, tmp_path: Path
) -> None:
    a = await make_broker("a", node="n1", placement_dir=str(tmp_path))
    b = await make_broker("b", zone="z2", node="n2")
    await link(a, b)
    await eventually(lambda: b.core.neighbour_lists.where.get("a") == ("", "n1"))
    assert a.core.neighbour_lists.where["b"] == ("z2", "n2")
    write_downward(tmp_path, {}, {"canopy.dev/zone": "z1"})
    await eventually(lambda: b.core.neighbour_lists.where.get("a") == ("z1", "n1"))
    assert a.status()["placement"] == {"zone": "z1", "node": "n1"}
    kinds = [r for r in a.telemetry.since(0)["records"] if r["type"] == "placement"]
    assert [(r["zone"], r["node"]) for r in kinds][-1] == ("z1", "n1")


def test_a_repair_ends_at_a_survivor_when_its_chain_neighbour_died_too() -> None:
    """x dies with its neighbour w (one node): b is between a and w in x's chain. Once w is
    declared dead as well, b is the chain's end: it sends the backward sweep itself and, with
    a's forward sweep, its repair of x completes without waiting for its timer."""
    core = BrokerCore("b", announce_neighbours=True, retention_window=10.0)
    core.handle(AddLink("x"))
    core.handle(FromLink("x", Neighbours(("a", "b", "w"))))
    core.handle(PeerFailed("x"))
    assert core.repairs["x"].next == "w"
    out = core.handle(PeerFailed("w"))
    assert SendToLink("a", RepairSweep("x", forward=False)) in out
    done = core.handle(FromLink("a", RepairSweep("x", forward=True)))
    assert any(isinstance(e, RepairFinished) and e.dead == "x" and not e.timed_out for e in done)
    assert "w" not in core.neighbours and "x" not in core.neighbours
