"""The deployment documentation says what the chart does: the README's values table lists every
value with its real default, the README's and docs/gitops.md's values examples pass the chart's
schema, and the GitOps health checks know every phase and condition the CRDs define."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.tools import CHART, ROOT, helm, value_keys

README = (ROOT / "README.md").read_text()
GITOPS = (ROOT / "docs" / "gitops.md").read_text()


def kubernetes_section() -> str:
    return README[
        README.index("## On Kubernetes") : README.index(
            "\n## ", README.index("## On Kubernetes") + 1
        )
    ]


def values_table() -> dict[str, Any]:
    """README's "Chart values" table: key -> default (parsed as YAML)."""
    rows = re.findall(r"^\| `([\w.]+)` \| `(.*?)` \| .+ \|$", kubernetes_section(), re.M)
    return {key: yaml.safe_load(default) for key, default in rows}


def yaml_blocks(text: str) -> list[Any]:
    return [yaml.safe_load_all(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]


def docs_of(text: str) -> list[dict[str, Any]]:
    return [d for block in yaml_blocks(text) for d in block if isinstance(d, dict)]


def test_the_values_table_lists_every_value_with_its_default() -> None:
    defaults = value_keys(yaml.safe_load((CHART / "values.yaml").read_text()))
    documented = values_table()
    assert set(documented) == set(defaults), (
        f"undocumented: {sorted(set(defaults) - set(documented))}; "
        f"no such value: {sorted(set(documented) - set(defaults))}"
    )
    wrong = {k: (documented[k], v) for k, v in defaults.items() if documented[k] != v}
    assert not wrong, f"README default differs from values.yaml: {wrong}"


def test_the_readme_walks_the_kubernetes_path() -> None:
    section = kubernetes_section()
    for step in (
        "helm install canopy charts/canopy",
        "kubectl apply -f manifests/examples/overlay-explicit.yaml",
        "kubectl get bo -w",
        "kubectl wait --for=condition=Ready bo/trading",
        "kubectl get tp",
        "kubectl annotate tp NAME canopy.dev/approve=true",
        "kubectl apply -f manifests/install/",
        "docs/gitops.md",
    ):
        assert step in section, step
    for target in ("broker", "operator", "miner"):
        assert f"docker build --target {target}" in section


def example_values() -> list[tuple[str, dict[str, Any]]]:
    """Every values example of the docs: README's values file, Argo CD's valuesObject,
    Flux's HelmRelease values."""
    out = []
    readme_values = [d for d in docs_of(kubernetes_section()) if "image" in d and "kind" not in d]
    out += [("README", d) for d in readme_values]
    for d in docs_of(GITOPS):
        if d.get("kind") == "Application":
            out.append(("Argo CD", d["spec"]["source"]["helm"]["valuesObject"]))
        if d.get("kind") == "HelmRelease":
            out.append(("Flux", d["spec"]["values"]))
    return out


@pytest.mark.parametrize(
    ("where", "values"), example_values(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_the_documented_values_pass_the_chart_schema(
    where: str, values: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = helm("template", "canopy", str(CHART), "--values", str(path))
    assert result.returncode == 0, f"{where}: {result.stderr}"


def test_the_gitops_examples_point_at_the_chart() -> None:
    docs = {d["kind"]: d for d in docs_of(GITOPS) if "kind" in d}
    assert (ROOT / docs["Application"]["spec"]["source"]["path"]).resolve() == CHART
    chart = docs["HelmRelease"]["spec"]["chart"]["spec"]["chart"]
    assert (ROOT / chart).resolve() == CHART
    assert docs["HelmRelease"]["spec"]["install"]["crds"] == "Create"
    assert any(d.get("spec", {}).get("dependsOn") for d in docs_of(GITOPS))


def crd_enum(name: str, *path: str) -> list[str]:
    crd = yaml.safe_load((ROOT / "manifests" / "crds" / name).read_text())
    node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for key in path:
        node = node["properties"][key] if key != "[]" else node["items"]
    return list(node["enum"])


def test_the_argo_health_checks_know_every_phase_and_condition() -> None:
    (config,) = [d for d in docs_of(GITOPS) if d.get("metadata", {}).get("name") == "argocd-cm"]
    checks = config["data"]
    overlay = checks["resource.customizations.health.canopy.dev_BrokerOverlay"]
    proposal = checks["resource.customizations.health.canopy.dev_TopologyProposal"]
    assert "resource.customizations.health.argoproj.io_Application" in checks  # for app of apps
    conditions = crd_enum("brokeroverlays.canopy.dev.yaml", "status", "conditions", "[]", "type")
    for condition in conditions:
        assert f'"{condition}"' in overlay, condition
    for phase in ("Ready", "Invalid", "Degraded"):
        assert f'"{phase}"' in overlay
    assert "observedGeneration" in overlay
    phases = crd_enum("topologyproposals.canopy.dev.yaml", "status", "phase")
    for phase in phases:
        assert phase in proposal, phase
