"""The proposal model (pure): names, manifests, applying changes, export, duplicates, pruning and
the lifecycle decision, transition by transition."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from canopy_operator.cli import main
from canopy_operator.model.proposals import (
    EVIDENCE_KEYS,
    Decision,
    Proposal,
    ProposalError,
    apply_changes,
    exported_overlay,
    from_manifest,
    lifecycle,
    open_duplicates,
    proposal_name,
    to_manifest,
    to_prune,
)
from canopy_operator.model.topology import norm, parse_overlay, validate

ROOT = Path(__file__).resolve().parents[2]
# hub ─ east ─ south, hub ─ west ─ edge-1, hub ─ north  (manifests/examples/overlay-explicit.yaml)
TRADING = [
    ("hub", "east"),
    ("hub", "west"),
    ("hub", "north"),
    ("east", "south"),
    ("west", "edge-1"),
]
MOVE_NORTH = ((("hub", "north"), ("west", "north")),)
EVIDENCE = {
    "associativityBefore": 0.41,
    "associativityAfter": 0.58,
    "hopsPerEventBefore": 2.9,
    "hopsPerEventAfter": 2.4,
    "pureForwarderRateBefore": 0.22,
    "pureForwarderRateAfter": 0.15,
    "expectedGain": "-17% hops/event",
}


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "manifests/crds/topologyproposals.canopy.dev.yaml").read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def example_overlay() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(
        (ROOT / "manifests/examples/overlay-explicit.yaml").read_text()
    )
    return doc


# -- apply_changes ----------------------------------------------------------------------------


def test_apply_changes_exchanges_links_in_order() -> None:
    after = apply_changes(TRADING, MOVE_NORTH)
    assert set(after) == {norm(e) for e in TRADING if e != ("hub", "north")} | {("north", "west")}
    assert after == tuple(sorted(after))
    # Two steps, the second relying on the first; link ends in any order.
    two = ((("north", "hub"), ("north", "west")), (("west", "edge-1"), ("north", "edge-1")))
    assert ("edge-1", "north") in apply_changes(TRADING, two)
    assert ("edge-1", "west") not in apply_changes(TRADING, two)


def test_apply_changes_names_a_removed_link_that_is_not_there() -> None:
    with pytest.raises(ProposalError, match="link east-north is not in the overlay"):
        apply_changes(TRADING, ((("north", "east"), ("west", "north")),))
    # ... also when an earlier change of the same proposal removed it.
    twice = (MOVE_NORTH[0], (("hub", "north"), ("south", "north")))
    with pytest.raises(ProposalError, match=r"change 2 .*hub-north is not in the overlay"):
        apply_changes(TRADING, twice)


def test_apply_changes_refuses_a_step_that_would_not_leave_a_tree() -> None:
    # east-west closes the cycle east-hub-west; removing hub-north instead disconnects north.
    with pytest.raises(ProposalError, match=r"would not leave a tree.*east - hub - west"):
        apply_changes(TRADING, ((("hub", "north"), ("east", "west")),))
    with pytest.raises(ProposalError, match="there already"):
        apply_changes(TRADING, ((("hub", "north"), ("hub", "east")),))
    with pytest.raises(ProposalError, match="broker nowhere is not in the overlay"):
        apply_changes(TRADING, ((("hub", "north"), ("nowhere", "north")),))


# -- names and manifests ----------------------------------------------------------------------


def test_proposal_name_is_deterministic_and_ignores_link_orientation() -> None:
    name = proposal_name("trading", MOVE_NORTH)
    assert name == proposal_name("trading", ((("north", "hub"), ("north", "west")),))
    assert name.startswith("trading-") and len(name) == len("trading-") + 10
    assert name != proposal_name("sensors", MOVE_NORTH)
    assert name != proposal_name("trading", ((("hub", "north"), ("south", "north")),))
    assert Proposal("trading", 1, MOVE_NORTH, {}).name == name  # the default name
    assert Proposal("trading", 1, MOVE_NORTH, {}, name="mine").name == "mine"


def test_to_manifest_and_from_manifest_round_trip_and_match_the_crd() -> None:
    p = Proposal("trading", 3, MOVE_NORTH, EVIDENCE, namespace="prod")
    m = to_manifest(p)
    assert m["metadata"] == {
        "name": proposal_name("trading", MOVE_NORTH),
        "namespace": "prod",
        "labels": {"canopy.dev/overlay": "trading"},
    }
    assert m["spec"]["changes"] == [{"remove": ["hub", "north"], "add": ["west", "north"]}]
    assert set(m["spec"]["evidence"]) == set(EVIDENCE_KEYS)
    jsonschema.validate(m, crd_schema())
    assert from_manifest(m) == p
    assert from_manifest(yaml.safe_load(yaml.safe_dump(m))) == p
    # The example in manifests/ reads too.
    example = yaml.safe_load((ROOT / "manifests/examples/proposal.yaml").read_text())
    ex = from_manifest(example)
    assert ex.name == "trading-1" and ex.changes == MOVE_NORTH and ex.generation == 1


def valid_manifest() -> dict[str, Any]:
    return to_manifest(Proposal("trading", 1, MOVE_NORTH, EVIDENCE))


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("kind",), "BrokerOverlay", "kind must be TopologyProposal"),
        (("spec",), None, "spec is required"),
        (("spec", "overlay"), "", "spec.overlay"),
        (("spec", "generation"), "1", "spec.generation"),
        (("spec", "generation"), True, "spec.generation"),
        (("spec", "generation"), -1, "spec.generation"),
        (("spec", "changes"), [], "spec.changes must be a non-empty list"),
        (("spec", "changes"), [["hub", "north"]], r"spec.changes\[0\] must be a mapping"),
        (("spec", "changes"), [{"remove": ["hub"], "add": ["a", "b"]}], "changes.0..remove"),
        (("spec", "changes"), [{"remove": ["a", "b"]}], r"changes\[0\].add"),
        (("spec", "changes"), [{"remove": ["a", "a"], "add": ["a", "b"]}], "to itself"),
        (("spec", "changes"), [{"remove": ["a", 1], "add": ["a", "b"]}], "pair of broker"),
        (("spec", "evidence"), [], "spec.evidence must be a mapping"),
        (("spec", "evidence"), {"expectedGain": None}, "evidence.expectedGain"),
    ],
)
def test_from_manifest_names_what_is_malformed(
    path: tuple[str, ...], value: Any, message: str
) -> None:
    obj = valid_manifest()
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ProposalError, match=message):
        from_manifest(obj)


# -- export -----------------------------------------------------------------------------------


def test_exported_overlay_replaces_the_link_in_place_and_strips_server_fields() -> None:
    overlay = example_overlay()
    overlay["metadata"].update(
        namespace="default",
        uid="1234",
        resourceVersion="99",
        generation=1,
        creationTimestamp="2026-01-01T00:00:00Z",
        managedFields=[{"manager": "kubectl"}],
        annotations={
            "kubectl.kubernetes.io/last-applied-configuration": "{}",
            "operator.canopy.dev/last-handled-configuration": "{}",
            "canopy.dev/kopf-managed": "yes",
            "team": "markets",
        },
        finalizers=["canopy.dev/operator"],
    )
    overlay["status"] = {"phase": "Ready"}
    before = copy.deepcopy(overlay)
    out = exported_overlay(overlay, Proposal("trading", 1, MOVE_NORTH, {}))
    assert overlay == before  # not modified
    assert out["metadata"] == {
        "name": "trading",
        "namespace": "default",
        "annotations": {"team": "markets"},
    }
    assert "status" not in out and out["kind"] == "BrokerOverlay"
    want = [list(e) for e in TRADING]
    want[2] = ["west", "north"]  # in the place of hub-north: a one-line diff
    assert out["spec"]["links"] == want
    assert {k: v for k, v in out["spec"].items() if k != "links"} == {
        k: v for k, v in before["spec"].items() if k != "links"
    }
    assert validate(parse_overlay(out)) == []


def test_exported_overlay_refuses_another_overlay_managed_links_and_invalid_changes() -> None:
    with pytest.raises(ProposalError, match="is for overlay 'sensors', not 'trading'"):
        exported_overlay(example_overlay(), Proposal("sensors", 1, MOVE_NORTH, {}))
    managed = example_overlay()
    del managed["spec"]["links"]
    with pytest.raises(ProposalError, match="managed links"):
        exported_overlay(managed, Proposal("trading", 1, MOVE_NORTH, {}))
    gone = Proposal("trading", 1, ((("hub", "south"), ("west", "south")),), {})
    with pytest.raises(ProposalError, match="hub-south is not in the overlay"):
        exported_overlay(example_overlay(), gone)


# -- duplicates and pruning -------------------------------------------------------------------


def stored(
    p: Proposal, phase: str | None = None, created: str = "2026-01-01T00:00:00Z"
) -> dict[str, Any]:
    obj = to_manifest(p)
    obj["metadata"]["creationTimestamp"] = created
    if phase:
        obj["status"] = {"phase": phase}
    return obj


def test_open_duplicates_sees_only_open_proposals_with_the_same_changes() -> None:
    p = Proposal("trading", 2, MOVE_NORTH, EVIDENCE, namespace="prod")
    flipped = Proposal("trading", 1, ((("north", "hub"), ("north", "west")),), {}, name="old")
    for phase in (None, "Proposed", "Approved", "Applying"):
        assert open_duplicates([stored(flipped, phase)], p), phase
    for phase in ("Applied", "Rejected", "Stale", "Failed"):
        assert not open_duplicates([stored(flipped, phase)], p), phase
    other_changes = Proposal("trading", 2, ((("hub", "north"), ("south", "north")),), {})
    other_overlay = Proposal("sensors", 2, MOVE_NORTH, {})
    elsewhere = Proposal("trading", 2, MOVE_NORTH, {}, namespace="staging")
    malformed = {"kind": "TopologyProposal", "metadata": {"name": "x"}, "spec": {}}
    assert not open_duplicates(
        [stored(other_changes), stored(other_overlay), stored(elsewhere), malformed], p
    )
    assert not open_duplicates([], p)


def test_to_prune_keeps_the_newest_terminal_proposals_of_each_overlay() -> None:
    def make(overlay: str, i: int, phase: str) -> dict[str, Any]:
        p = Proposal(overlay, 1, MOVE_NORTH, {}, name=f"{overlay}-{i}")
        return stored(p, phase, created=f"2026-01-0{i}T00:00:00Z")

    existing = [
        make("trading", 1, "Applied"),
        make("trading", 2, "Stale"),
        make("trading", 3, "Proposed"),  # open: never pruned
        make("trading", 4, "Rejected"),
        make("trading", 5, "Failed"),
        make("sensors", 1, "Stale"),
        make("sensors", 2, "Approved"),
    ]
    assert to_prune(existing, 2) == ["trading-2", "trading-1"]
    assert to_prune(existing, 0) == [
        "sensors-1",
        "trading-5",
        "trading-4",
        "trading-2",
        "trading-1",
    ]
    assert to_prune(existing, 10) == []
    with pytest.raises(ValueError, match="history_limit"):
        to_prune(existing, -1)


# -- the lifecycle decision -------------------------------------------------------------------

MANAGED_LINKS = [("a", "b"), ("b", "c"), ("c", "d")]
SWAP = ((("b", "c"), ("a", "c")),)  # a-b, a-c, c-d


def overlay(
    *,
    explicit: bool = False,
    mode: str = "propose",
    generation: int = 1,
    phase: str = "Ready",
    observed: int | None = None,
    links: list[tuple[str, str]] | None = None,
    fan_out: int = 3,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "brokers": [{"name": b} for b in "abcd"],
        "maxFanOut": fan_out,
        "selfOrganization": {"mode": mode},
    }
    live = links if links is not None else MANAGED_LINKS
    if explicit:
        spec["links"] = [list(e) for e in live]
    return {
        "apiVersion": "canopy.dev/v1alpha1",
        "kind": "BrokerOverlay",
        "metadata": {"name": "demo", "namespace": "ns", "generation": generation},
        "spec": spec,
        "status": {
            "phase": phase,
            "observedGeneration": generation if observed is None else observed,
            "links": [list(e) for e in live],
        },
    }


def proposal(
    phase: str | None = None,
    *,
    annotations: dict[str, str] | None = None,
    generation: int = 1,
    changes: Any = SWAP,
    patch: dict[str, Any] | None = None,
) -> dict[str, Any]:
    obj = to_manifest(Proposal("demo", generation, changes, {}, namespace="ns"))
    if annotations:
        obj["metadata"]["annotations"] = annotations
    status: dict[str, Any] = {}
    if phase:
        status["phase"] = phase
        status["message"] = f"was {phase}"
    if patch is not None:
        status["patch"] = patch
    if status:
        obj["status"] = status
    return obj


APPROVE = {"canopy.dev/approve": "true"}
MERGED = [("a", "b"), ("a", "c"), ("c", "d")]  # SWAP applied
EXPLICIT_PATCH = {"brokers": [], "links": [list(e) for e in MERGED]}

CASES: list[tuple[str, dict[str, Any], dict[str, Any] | None, dict[str, Any]]] = [
    # (what, proposal, overlay, expected fields of the Decision)
    ("new, propose mode", proposal(), overlay(), {"phase": "Proposed", "action": "none"}),
    ("no phase, mode off", proposal(), overlay(mode="off"), {"phase": "Proposed"}),
    (
        "approved by annotation, managed",
        proposal("Proposed", annotations=APPROVE),
        overlay(),
        {"phase": "Approved", "action": "apply", "reason": "ApprovedByAnnotation"},
    ),
    (
        "auto mode approves and applies",
        proposal(),
        overlay(mode="auto"),
        {"phase": "Approved", "action": "apply", "reason": "ApprovedAutomatically"},
    ),
    (
        "approved but mode off: not applied",
        proposal("Proposed", annotations=APPROVE),
        overlay(mode="off"),
        {"phase": "Approved", "action": "none", "reason": "SelfOrganizationOff"},
    ),
    (
        "approved, overlay still reconfiguring: wait",
        proposal("Approved", annotations=APPROVE),
        overlay(phase="Reconfiguring"),
        {"phase": "Approved", "action": "none"},
    ),
    (
        "approved, overlay not observed at its generation yet: wait",
        proposal("Approved", annotations=APPROVE),
        overlay(observed=0),
        {"phase": "Approved", "action": "none"},
    ),
    (
        "managed overlay without live links yet: wait",
        proposal(),
        {**overlay(phase="Creating"), "status": {"phase": "Creating"}},
        {"phase": "Proposed", "reason": "WaitingForOverlay"},
    ),
    (
        "Applying resumes, whatever else changed",
        proposal("Applying", annotations={"canopy.dev/reject": "true"}, generation=7),
        overlay(),
        {"phase": "Applying", "action": "apply"},
    ),
    (
        "Applying, overlay deleted",
        proposal("Applying"),
        None,
        {"phase": "Failed", "reason": "OverlayNotFound"},
    ),
    (
        "reject annotation",
        proposal("Proposed", annotations={"canopy.dev/reject": "true"}),
        overlay(),
        {"phase": "Rejected", "approved": False},
    ),
    (
        "approve=false rejects",
        proposal(annotations={"canopy.dev/approve": "false"}),
        overlay(mode="auto"),
        {"phase": "Rejected"},
    ),
    (
        "reject wins over approve",
        proposal("Approved", annotations={**APPROVE, "canopy.dev/reject": "yes"}),
        overlay(explicit=True),
        {"phase": "Rejected"},
    ),
    (
        "overlay generation moved on",
        proposal("Proposed", annotations=APPROVE),
        overlay(generation=2),
        {"phase": "Stale", "reason": "GenerationChanged"},
    ),
    ("overlay gone", proposal(), None, {"phase": "Stale", "reason": "OverlayNotFound"}),
    (
        "removed link no longer live",
        proposal("Proposed", annotations=APPROVE),
        overlay(links=[("a", "b"), ("a", "c"), ("c", "d")]),
        {"phase": "Stale", "reason": "ChangesInvalid"},
    ),
    (
        "result over maxFanOut",
        proposal(changes=((("c", "d"), ("a", "d")),)),
        overlay(links=[("a", "b"), ("a", "c"), ("c", "d")], fan_out=2),
        {"phase": "Stale", "reason": "ChangesInvalid"},
    ),
    (
        "explicit links, approved: export, never apply",
        proposal("Proposed", annotations=APPROVE),
        overlay(explicit=True),
        {"phase": "Approved", "action": "none", "patch": EXPLICIT_PATCH},
    ),
    (
        "explicit links, auto mode: exported too",
        proposal(),
        overlay(explicit=True, mode="auto"),
        {"phase": "Approved", "action": "none", "patch": EXPLICIT_PATCH},
    ),
    (
        "explicit links, merged by GitOps (generation moved on): Applied",
        proposal("Approved", annotations=APPROVE, patch=EXPLICIT_PATCH),
        overlay(explicit=True, generation=2, links=[("a", "b"), ("c", "d"), ("a", "c")]),
        {"phase": "Applied", "reason": "Merged"},
    ),
    (
        "explicit links, something else merged: Stale",
        proposal("Approved", annotations=APPROVE, patch=EXPLICIT_PATCH),
        overlay(explicit=True, generation=2, links=[("a", "b"), ("b", "c"), ("b", "d")]),
        {"phase": "Stale", "reason": "GenerationChanged"},
    ),
    *[
        (f"{phase} is terminal", proposal(phase, annotations=APPROVE), overlay(), {"phase": phase})
        for phase in ("Applied", "Rejected", "Stale", "Failed")
    ],
    (
        "malformed proposal fails",
        {**proposal(), "spec": {"overlay": "demo", "generation": 1, "changes": []}},
        overlay(),
        {"phase": "Failed", "reason": "InvalidProposal"},
    ),
]


@pytest.mark.parametrize(("what", "prop", "ovl", "want"), CASES, ids=[c[0] for c in CASES])
def test_lifecycle_decides_each_transition(
    what: str, prop: dict[str, Any], ovl: dict[str, Any] | None, want: dict[str, Any]
) -> None:
    decision = lifecycle(prop, ovl)
    assert isinstance(decision, Decision)
    for key, value in want.items():
        got = getattr(decision, key)
        if key == "patch":
            assert got is not None and got["links"] == value["links"], what
        else:
            assert got == value, (what, decision)
    assert decision.message, what
    if decision.phase in ("Proposed", "Approved", "Applying"):
        assert decision.action == ("apply" if want.get("action") == "apply" else decision.action)


def test_lifecycle_messages_say_what_to_do() -> None:
    off = lifecycle(proposal("Proposed", annotations=APPROVE), overlay(mode="off"))
    assert "not applied" in off.message and "mode off" in off.message
    waiting = lifecycle(proposal(), overlay())
    assert "canopy.dev/approve=true" in waiting.message
    name = proposal_name("demo", SWAP)
    exported = lifecycle(proposal(annotations=APPROVE), overlay(explicit=True))
    assert f"canopy proposal export {name}" in exported.message
    assert exported.patch is not None and exported.patch["selfOrganization"] == {"mode": "propose"}
    gone = lifecycle(proposal(), overlay(links=[("a", "b"), ("a", "c"), ("c", "d")]))
    assert "b-c is not in the overlay" in gone.message
    stale = lifecycle(proposal(generation=1), overlay(generation=3))
    assert "generation 3" in stale.message and "generation 1" in stale.message
    # A terminal phase keeps its message (nothing to write).
    assert lifecycle(proposal("Stale"), overlay()).message == "was Stale"


def test_lifecycle_uses_the_live_links_it_is_given() -> None:
    # status.links say b-c is there, the brokers say otherwise: the brokers win.
    d = lifecycle(
        proposal(annotations=APPROVE), overlay(), live_links=[("a", "b"), ("a", "c"), ("c", "d")]
    )
    assert d.phase == "Stale" and "b-c" in d.message
    d = lifecycle(proposal(annotations=APPROVE), overlay(), live_links=MANAGED_LINKS)
    assert d.action == "apply"


# -- canopy proposal export | list (files) ----------------------------------------------------


def canopy(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


EXAMPLES = ROOT / "manifests" / "examples"


def test_export_prints_the_overlay_with_the_proposal_applied(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = canopy(
        capsys,
        "proposal",
        "export",
        str(EXAMPLES / "proposal.yaml"),
        "--overlay",
        str(EXAMPLES / "overlay-explicit.yaml"),
    )
    assert code == 0, err
    manifest = yaml.safe_load(out)
    assert manifest == exported_overlay(example_overlay(), from_manifest(example_proposal()))
    assert ["west", "north"] in manifest["spec"]["links"]
    assert ["hub", "north"] not in manifest["spec"]["links"]
    # JSON in (as the miner may write it), a file out.
    src = tmp_path / "p.json"
    src.write_text(json.dumps(example_proposal()))
    dest = tmp_path / "trading.yaml"
    to_file = ["proposal", "export", str(src), "--overlay", str(EXAMPLES / "overlay-explicit.yaml")]
    code, out, err = canopy(capsys, *to_file, "-o", str(dest))
    assert code == 0 and out == "", err
    assert yaml.safe_load(dest.read_text()) == manifest
    nowhere = tmp_path / "no" / "such" / "dir.yaml"  # an error that says so, not a traceback
    code, out, err = canopy(capsys, *to_file, "-o", str(nowhere))
    assert code == 2 and f"cannot write {nowhere}: No such file or directory" in err, err


def example_proposal() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "proposal.yaml").read_text())
    return doc


@pytest.mark.parametrize(
    ("edit", "overlay_file", "message"),
    [
        (None, None, "--overlay FILE is required"),
        (None, "overlay-managed.yaml", "is for overlay 'trading', not 'sensors'"),
        ({"remove": ["hub", "south"], "add": ["west", "south"]}, None, "hub-south is not in"),
        ({"remove": ["hub", "north"], "add": ["east", "west"]}, None, "would not leave a tree"),
        ("missing", None, "no such file"),
    ],
)
def test_export_errors_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    edit: Any,
    overlay_file: str | None,
    message: str,
) -> None:
    proposal = example_proposal()
    src = tmp_path / "p.yaml"
    if isinstance(edit, dict):
        proposal["spec"]["changes"] = [edit]
        overlay_file = overlay_file or "overlay-explicit.yaml"
    if edit != "missing":
        src.write_text(yaml.safe_dump(proposal))
    args = ["proposal", "export", str(src)]
    if overlay_file:
        args += ["--overlay", str(EXAMPLES / overlay_file)]
    code, out, err = canopy(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err, err


def test_list_shows_the_proposals_of_a_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "proposals").mkdir()
    for p in (
        Proposal("trading", 1, MOVE_NORTH, EVIDENCE),
        Proposal("sensors", 4, ((("s-1", "s-2"), ("s-1", "s-3")),), {}),
    ):
        (tmp_path / "proposals" / f"{p.name}.yaml").write_text(yaml.safe_dump(to_manifest(p)))
    (tmp_path / "overlay.yaml").write_text((EXAMPLES / "overlay-explicit.yaml").read_text())
    code, out, err = canopy(capsys, "proposal", "list", str(tmp_path))
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "OVERLAY", "GEN", "PHASE", "GAIN", "CHANGES"]
    assert len(rows) == 2
    assert rows[1].split()[:4] == [proposal_name("trading", MOVE_NORTH), "trading", "1", "-"]
    assert "hub-north => west-north" in rows[1]
    code, out, _ = canopy(capsys, "proposal", "list", str(tmp_path), "-o", "json")
    listed = json.loads(out)
    assert code == 0 and listed["kind"] == "List" and len(listed["items"]) == 2
    code, out, _ = canopy(capsys, "proposal", "list", str(tmp_path), "-o", "yaml")
    assert yaml.safe_load(out)["items"] == listed["items"]
    assert canopy(capsys, "proposal", "list", str(tmp_path / "nowhere"))[0] == 2
    # One file that cannot be read is named, and the others are still listed (exit 1).
    (tmp_path / "proposals" / "broken.yaml").write_text("kind: [unclosed")
    code, out, err = canopy(capsys, "proposal", "list", str(tmp_path))
    assert code == 1 and len(out.splitlines()) == 3, out
    assert "warning: skipped" in err and "broken.yaml" in err
