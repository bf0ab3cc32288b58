"""CRDs and examples: the CRDs pass Kubernetes' own schema; every example custom resource
validates against its CRD's OpenAPI schema and against the operator's own validator."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from canopy_operator.model.topology import parse_overlay, validate
from tests.tools import kubernetes_validate, yaml_docs

ROOT = Path(__file__).resolve().parents[2]
CRDS = sorted((ROOT / "manifests" / "crds").glob("*.yaml"))
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))


def crd_schema(kind: str) -> dict[str, Any]:
    for path in CRDS:
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]
    raise LookupError(kind)


def examples() -> list[dict[str, Any]]:
    return yaml_docs(EXAMPLES)


@pytest.mark.parametrize("version", ["1.29.0", "1.33.0"])
def test_crds_pass_kubernetes_validate(version: str) -> None:
    result = kubernetes_validate(CRDS, version)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_validate_catches_a_broken_crd(tmp_path: Path) -> None:
    crd = yaml.safe_load(CRDS[0].read_text())
    crd["spec"]["scope"] = 7
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(crd))
    result = kubernetes_validate([bad], "1.33.0")
    assert result.returncode != 0


@pytest.mark.parametrize("doc", examples(), ids=lambda d: d["metadata"]["name"])
def test_examples_match_their_crd_schema(doc: dict[str, Any]) -> None:
    jsonschema.validate(doc, crd_schema(doc["kind"]))
    if doc["kind"] == "BrokerOverlay":
        assert validate(parse_overlay(doc)) == []


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda d: d["spec"].update(routing="fancy"), "routing"),
        (lambda d: d["spec"]["brokers"][0].update(name="Not_A_Label"), "name"),
        (lambda d: d["spec"].update(maxFanOut=1), "maxFanOut"),
        (lambda d: d["spec"]["links"].append(["hub"]), "links"),
        (lambda d: d["spec"].pop("brokers"), "brokers"),
    ],
)
def test_the_schema_rejects_broken_overlays(mutate: Any, where: str) -> None:
    doc = copy.deepcopy(next(d for d in examples() if d["metadata"]["name"] == "trading"))
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate(doc, crd_schema("BrokerOverlay"))
    assert where in str(err.value.path) or where in err.value.message


def test_there_is_an_explicit_a_managed_and_a_proposal_example() -> None:
    docs = examples()
    overlays = [d for d in docs if d["kind"] == "BrokerOverlay"]
    assert any("links" in d["spec"] for d in overlays)
    assert any("links" not in d["spec"] for d in overlays)
    assert any(d["kind"] == "TopologyProposal" for d in docs)
