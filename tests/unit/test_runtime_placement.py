"""Where a broker runs, as the runtime learns it: flags, and Kubernetes' downward-API files
(rewritten by the kubelet when the operator annotates the pod), passed to the core, which
announces its neighbour list in placement order; and the end of a repair whose chain neighbour
died with the dead broker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from canopy_broker.client import ClientError, connect
from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.messages import (
    AddLink,
    FromLink,
    Input,
    Neighbours,
    PeerFailed,
    PeerFeatures,
    Placed,
    RepairFinished,
    RepairSweep,
    SendToLink,
)
from canopy_broker.runtime import link_sessions, server
from canopy_broker.runtime.framing import decode_link_message, encode_generic
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


def test_the_client_hold_is_read_from_the_pods_annotation(tmp_path: Path) -> None:
    assert PlacementSource(directory=str(tmp_path)).annotated_hold() == 0.0  # no files yet
    assert PlacementSource().annotated_hold() == 0.0  # no downward API at all
    write_downward(tmp_path, {}, {"canopy.dev/hold-clients": "90.0"})
    assert PlacementSource(directory=str(tmp_path)).annotated_hold() == 90.0
    write_downward(tmp_path, {}, {"canopy.dev/hold-clients": "soon"})
    assert PlacementSource(directory=str(tmp_path)).annotated_hold() == 0.0  # said, not used


async def test_a_pod_annotated_to_hold_clients_refuses_them_until_linked(
    make_broker: MakeBroker, tmp_path: Path
) -> None:
    write_downward(tmp_path, {}, {"canopy.dev/hold-clients": "60"})
    a = await make_broker("a")
    b = await make_broker("b", placement_dir=str(tmp_path))
    assert b.clients_held is not None and "60 s" in b.clients_held
    with pytest.raises(ClientError) as refused:
        await connect(
            f"{b.address[0]}:{b.address[1]}", "early", failover_within=0, connect_timeout=0.5
        )
    assert refused.value.code == "joining"
    await link(b, a)
    await eventually(lambda: b.clients_held is None)


async def test_a_broker_picks_up_its_zone_from_the_downward_api_and_tells_its_neighbour(
    make_broker: MakeBroker, tmp_path: Path
) -> None:
    a = await make_broker("a", node="n1", placement_dir=str(tmp_path))
    b = await make_broker("b", zone="z2", node="n2")
    await link(a, b)
    await eventually(lambda: b.core.neighbour_lists.where.get("a") == ("", "n1"))
    assert a.core.neighbour_lists.where["b"] == ("z2", "n2")
    assert not a.core.neighbour_lists.legacy and not b.core.neighbour_lists.legacy  # hellos
    assert not a.core.unsettled and not b.core.unsettled
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


def test_a_neighbour_of_an_older_version_gets_the_list_by_name_and_without_placement() -> None:
    """During a roll-out from a version before placement, an old neighbour would refuse the
    zone and node fields and sort the list it hears: while one is a neighbour, the broker
    announces by name (so every neighbour reads the same chain) and sends it the bare list."""
    core = BrokerCore("n", announce_neighbours=True)
    last: dict[str, object] = {}

    def feed(inp: Input) -> None:
        last.update((e.peer, e.message) for e in core.handle(inp) if isinstance(e, SendToLink))

    feed(Placed("z1", "n1"))
    feed(PeerFeatures("old", placement=False))  # its hello said nothing of placement
    for peer in ("a", "old", "c"):
        feed(AddLink(peer))
    feed(FromLink("a", Neighbours(("n",), "z1", "n1")))  # a shares n's node
    feed(FromLink("c", Neighbours(("n",), "z2", "n3")))
    assert last["old"] == Neighbours(("a", "c", "old"))  # sorted, no placement fields
    assert last["a"] == Neighbours(("a", "c", "old"), "z1", "n1", lists=(("c", ("n",)),))
    assert encode_generic(last["old"]) == b'[3,{"$":"Neighbours","names":["a","c","old"]}]'
    # Rolled to the new version: the chain order comes back.
    out = core.handle(PeerFeatures("old", placement=True))
    names = {e.message.names for e in out if isinstance(e, SendToLink)}  # type: ignore[union-attr]
    assert names == {("old", "c", "a")}  # old (placement unknown) and c apart from n, a last


async def test_a_peer_whose_hello_does_not_say_settle_is_never_sent_one(
    make_broker: MakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Brokers from before the exchange's Settle (a roll-out) would close the link on it: a
    hello without the feature puts the peer among those the core does not send it to. The
    same for a repair's ReplayEnd, which such a peer neither understands nor sends (so it is
    not waited for either)."""
    for module in (link_sessions, server):  # the dialer's hello, the answer: as before
        monkeypatch.setattr(module, "FEATURES", ("placement",))
    a, b = await make_broker("a"), await make_broker("b")
    await link(a, b)
    await eventually(lambda: "b" in a.core.unsettled and "a" in b.core.unsettled)
    assert "b" in a.core.no_replay_end and "a" in b.core.no_replay_end
    assert "b" in a.core.no_handover and "a" in b.core.no_handover
    assert "b" in a.core.no_keep_removed and "a" in b.core.no_keep_removed
    assert not a.core.neighbour_lists.legacy  # placement was said


async def test_a_peer_whose_hello_says_replay_end_is_waited_for(
    make_broker: MakeBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hello with ``replay-end`` and ``handover`` but without ``settle`` (features are told
    one by one)."""
    for module in (link_sessions, server):
        monkeypatch.setattr(module, "FEATURES", ("placement", "replay-end", "handover"))
    a, b = await make_broker("a"), await make_broker("b")
    await link(a, b)
    await eventually(lambda: "b" in a.core.unsettled and "a" in b.core.unsettled)
    assert not a.core.no_replay_end and not b.core.no_replay_end
    assert not a.core.no_handover and not b.core.no_handover
    assert "b" in a.core.no_keep_removed and "a" in b.core.no_keep_removed  # not said either


def test_fields_a_newer_broker_adds_are_ignored_not_refused() -> None:
    frame = [3, {"$": "Neighbours", "names": ["a", "b"], "zone": "z", "rack": "r7"}]
    assert decode_link_message(frame) == Neighbours(("a", "b"), "z", "")
