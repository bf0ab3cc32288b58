"""manifests/install: Kubernetes' own schemas accept it, and the operator Deployment runs the
`canopy operator` command with the ServiceAccount the ClusterRole is bound to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from canopy_operator.cli import build_parser
from tests.tools import kubernetes_validate, yaml_docs

ROOT = Path(__file__).resolve().parents[2]
INSTALL = sorted((ROOT / "manifests" / "install").glob("*.yaml"))


def docs() -> list[dict[str, Any]]:
    return yaml_docs(INSTALL)


@pytest.mark.parametrize("version", ["1.29.0", "1.33.0"])
def test_install_manifests_pass_kubernetes_validate(version: str) -> None:
    result = kubernetes_validate(INSTALL, version)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_deployment_runs_canopy_operator_as_the_bound_service_account() -> None:
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs()}
    deploy = by_kind["Deployment", "canopy-operator"]
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["canopy", "operator"]
    args = build_parser().parse_args(["operator", *container["args"]])  # the flags exist
    assert args.metrics_port == 8000 and args.liveness.endswith(":8081/healthz")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    assert not args.leader_election  # one replica by default: nothing to elect
    sa = by_kind["ServiceAccount", pod["serviceAccountName"]]
    binding = by_kind["ClusterRoleBinding", "canopy-operator"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "canopy-system"}
    ]
    assert binding["roleRef"]["name"] == "canopy-operator"
    assert ("ClusterRole", "canopy-operator") in by_kind
    assert all(d["metadata"].get("namespace") in (None, "canopy-system") for d in docs())
