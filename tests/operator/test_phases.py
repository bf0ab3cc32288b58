"""The words the operator writes into ``status`` are the CRDs' words: the phase enums list
exactly the CRDs' phase enums, and each member serialises as the plain word (JSON and YAML)."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import yaml

from canopy_operator.model.phases import ConditionType, OverlayPhase, ProposalPhase

CRDS = Path(__file__).resolve().parents[2] / "manifests" / "crds"


def _crd_phases(name: str) -> list[str]:
    crd = yaml.safe_load((CRDS / name).read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return list(schema["properties"]["status"]["properties"]["phase"]["enum"])


def test_the_phase_enums_are_the_crds() -> None:
    assert sorted(_crd_phases("brokeroverlays.canopy.dev.yaml")) == sorted(OverlayPhase)
    assert sorted(_crd_phases("topologyproposals.canopy.dev.yaml")) == sorted(ProposalPhase)


def test_members_serialise_as_the_plain_word() -> None:
    assert OverlayPhase.READY == "Ready" and f"{ProposalPhase.STALE}" == "Stale"
    assert json.dumps({"type": ConditionType.VALID}) == '{"type": "Valid"}'
    assert orjson.dumps({"phase": OverlayPhase.DEGRADED}) == b'{"phase":"Degraded"}'
    # safe_dump refuses str subclasses; anything written as YAML goes through str() first
    assert yaml.safe_dump({"phase": str(ProposalPhase.APPLIED)}) == "phase: Applied\n"
