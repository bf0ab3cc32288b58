"""The Helm chart, by the real helm: lint and template with the default values and with a values
file that turns every option on; every rendered object checked against Kubernetes' schemas (or,
for prometheus-operator kinds, against the schemas in tests/deploy/schemas); values.schema.json
rejects bad values; and what the chart renders agrees with the code it deploys: the operator's
flags, ports and pod labels, the miner's command and RBAC contract, real metric names."""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client.metrics_core import Metric

from canopy_broker.cli import build_parser as broker_parser
from canopy_operator.backends import kube, manifests
from canopy_operator.backends.certs import SCRAPE_NAME
from canopy_operator.cli import build_parser
from canopy_operator.model.topology import parse_overlay
from tests.tools import (
    CHART,
    helm,
    helm_template,
    kinds_without_schema,
    kubernetes_validate,
    rbac_rules,
    value_keys,
)
from tests.unit.test_metric_conventions import families

ALL_ON = CHART / "ci" / "all-on-values.yaml"
LEASE_VERBS = ("get", "create", "patch")
SCHEMAS = Path(__file__).parent / "schemas"
VENDORED = {
    ("monitoring.coreos.com/v1", "PodMonitor"): SCHEMAS
    / "monitoring.coreos.com_v1_podmonitor.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS
    / "monitoring.coreos.com_v1_servicemonitor.json",
}
MINER_RULES = {
    ("canopy.dev", "brokeroverlays", "get"),
    ("canopy.dev", "brokeroverlays", "list"),
    ("canopy.dev", "topologyproposals", "get"),
    ("canopy.dev", "topologyproposals", "list"),
    ("canopy.dev", "topologyproposals", "create"),
    ("canopy.dev", "topologyproposals", "delete"),
    ("", "secrets", "get"),
}
VARIANTS = {
    "defaults": {"values": (), "release": "canopy", "namespace": "canopy-system"},
    "all-on": {"values": (ALL_ON,), "release": "mesh", "namespace": "ops"},
}


def render(variant: str) -> list[dict[str, Any]]:
    v = VARIANTS[variant]
    return helm_template(*v["values"], release=v["release"], namespace=v["namespace"])


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(name) for name in VARIANTS}


def values_file(tmp_path: Path, values: Mapping[str, Any], name: str = "values.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(dict(values)))
    return path


def one(docs: Sequence[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} rendered"
    return found[0]


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) applied to labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def broker_pod(namespace: str) -> dict[str, Any]:
    """A broker pod exactly as the operator creates it."""
    spec = parse_overlay(
        {
            "apiVersion": f"{kube.GROUP}/{kube.VERSION}",
            "kind": kube.KIND,
            "metadata": {"name": "trading"},
            "spec": {"brokers": [{"name": "hub"}, {"name": "edge"}], "links": [["hub", "edge"]]},
        }
    )
    owner = {"apiVersion": "canopy.dev/v1alpha1", "kind": kube.KIND, "name": "trading", "uid": "1"}
    return manifests.pod_manifest(spec, "hub", namespace, owner, "canopy-broker:0.1.0")


def pod_templates(docs: Sequence[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for d in docs:
        if d["kind"] == "Deployment":
            out.append((d["metadata"]["name"], d["spec"]["template"]))
        elif d["kind"] == "CronJob":
            out.append((d["metadata"]["name"], d["spec"]["jobTemplate"]["spec"]["template"]))
    return out


# -- helm lint, kubernetes-validate, vendored schemas -------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_is_clean(variant: str) -> None:
    flags = [a for v in VARIANTS[variant]["values"] for a in ("--values", str(v))]
    result = helm("lint", "--strict", str(CHART), *flags)
    assert result.returncode == 0, result.stdout + result.stderr


def validate_rendered(docs: Sequence[dict[str, Any]], version: str, tmp_path: Path) -> None:
    """kubernetes-validate --strict for built-in kinds; the kinds it has no schema for must
    have a vendored one, and validate against it: nothing is skipped silently."""
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = kubernetes_validate([path], version)
    assert result.returncode == 0, result.stdout + result.stderr
    skipped = kinds_without_schema(result)
    assert skipped <= set(VENDORED), f"no schema anywhere for {skipped - set(VENDORED)}"
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in skipped:
            schema = json.loads(VENDORED[key].read_text())
            jsonschema.Draft7Validator(schema).validate(doc)


@pytest.mark.parametrize("version", ["1.29.0", "1.33.0"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_rendered_object_passes_its_schema(
    rendered: dict[str, list[dict[str, Any]]], variant: str, version: str, tmp_path: Path
) -> None:
    validate_rendered(rendered[variant], version, tmp_path)


@pytest.mark.parametrize("version", ["1.29.0", "1.33.0"])
def test_the_broker_pod_passes_its_schema_and_its_program_takes_its_flags(
    version: str, tmp_path: Path
) -> None:
    """The pod the operator creates for a broker (spread constraints, downward API, probes) is
    a valid Pod, and ``canopy-broker serve`` accepts its arguments, placement ones included."""
    pod = broker_pod("trading")
    validate_rendered([pod], version, tmp_path)
    (container,) = pod["spec"]["containers"]
    args = broker_parser().parse_args(container["args"])
    assert args.placement_dir == manifests.PLACEMENT_DIR
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "placement"]
    assert {i["fieldRef"]["fieldPath"] for i in volume["downwardAPI"]["items"]} == {
        "metadata.labels",
        "metadata.annotations",
    }


def test_the_gateway_is_a_flag_and_a_named_port_when_the_spec_asks_for_it() -> None:
    plain = broker_pod("trading")
    assert "--gateway" not in plain["spec"]["containers"][0]["args"]
    assert "--mqtt" not in plain["spec"]["containers"][0]["args"]
    spec = parse_overlay(
        {
            "kind": kube.KIND,
            "metadata": {"name": "trading"},
            "spec": {"brokers": [{"name": "hub"}], "gateway": {"enabled": True, "mqtt": True}},
        }
    )
    (container,) = manifests.pod_manifest(spec, "hub", "ns", {}, "img")["spec"]["containers"]
    args = broker_parser().parse_args(container["args"])
    assert args.gateway == f"0.0.0.0:{manifests.GATEWAY_PORT}"
    assert {"name": "gateway", "containerPort": manifests.GATEWAY_PORT} in container["ports"]
    assert args.mqtt == f"0.0.0.0:{manifests.MQTT_PORT}"
    assert {"name": "mqtt", "containerPort": manifests.MQTT_PORT} in container["ports"]


def test_spread_constraints_default_to_zones_and_nodes_and_are_the_specs_when_given() -> None:
    default = manifests.spread_constraints("o", None)
    assert [(c["topologyKey"], c["whenUnsatisfiable"]) for c in default] == [
        ("topology.kubernetes.io/zone", "ScheduleAnyway"),
        ("kubernetes.io/hostname", "ScheduleAnyway"),
    ]
    assert all(
        c["labelSelector"] == {"matchLabels": {manifests.LABEL_OVERLAY: "o"}} for c in default
    )
    assert manifests.spread_constraints("o", []) == []
    strict = {"maxSkew": 2, "topologyKey": "rack", "whenUnsatisfiable": "DoNotSchedule"}
    (given,) = manifests.spread_constraints("o", [strict])
    assert given == {**strict, "labelSelector": {"matchLabels": {manifests.LABEL_OVERLAY: "o"}}}
    # Asking for another spread is a template change: the brokers are rolled onto it.
    pod = broker_pod("trading")
    other = copy.deepcopy(pod)
    other["spec"]["topologySpreadConstraints"] = [given]
    assert manifests.template_hash(pod) != manifests.template_hash(other)
    moved = copy.deepcopy(pod)
    moved["spec"]["affinity"] = {}
    assert manifests.template_hash(pod) == manifests.template_hash(
        moved
    )  # affinity follows the links


def test_the_validation_catches_broken_objects(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Negative controls: a misspelt field of a built-in kind and of a PodMonitor both fail,
    and so does a custom kind nobody has a schema for."""
    docs = rendered["all-on"]
    deployment = copy.deepcopy(one(docs, "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(AssertionError):
        validate_rendered([deployment], "1.33.0", tmp_path)
    monitor = copy.deepcopy(one(docs, "PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "10s"
    with pytest.raises(jsonschema.ValidationError):
        validate_rendered([monitor], "1.33.0", tmp_path)
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    with pytest.raises(AssertionError, match="no schema"):
        validate_rendered([unknown], "1.33.0", tmp_path)


def test_the_all_on_values_set_every_option(rendered: dict[str, list[dict[str, Any]]]) -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    all_on = yaml.safe_load(ALL_ON.read_text())
    # Renaming everything would only test Helm's truncation; pull policy etc. are plain strings.
    not_set = {"nameOverride", "fullnameOverride"}
    set_keys = set(value_keys(all_on))
    missing = {
        p
        for p in set(value_keys(defaults)) - not_set
        if not p.startswith(("image.broker", "image.operator"))  # image.miner stands for them
        and p not in set_keys
        and not any(q.startswith(p + ".") for q in set_keys)
    }
    assert not missing, f"ci/all-on-values.yaml leaves these at their defaults: {sorted(missing)}"
    kinds = {d["kind"] for d in rendered["all-on"]}
    assert kinds >= {
        "CustomResourceDefinition",
        "Deployment",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "CronJob",
        "ConfigMap",
        "NetworkPolicy",
        "PodMonitor",
        "ServiceMonitor",
    }


# -- values.schema.json -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"operator": {"metrics": {"prot": 9000}}}, "prot"),
        ({"miner": {"sparkMaster": "local[x]"}}, "sparkMaster"),
        ({"miner": {"sparkMaster": "k8s://https://kubernetes.default.svc"}}, "executorImage"),
        ({"miner": {"schedule": "every hour"}}, "schedule"),
        ({"miner": {"historyLimit": "lots"}}, "historyLimit"),
        ({"miner": {"sparkConf": {"ui.enabled": "false"}}}, "sparkConf"),
        ({"overlayNamespaces": ["Not_A_Namespace"]}, "overlayNamespaces"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"networkPolicy": {"adminPort": {"from": [{"pods": {}}]}}}, "from"),
        ({"monitoring": {"podMonitor": {"interval": "30 seconds"}}}, "interval"),
        ({"operator": {"resources": {"limits": {"memory": "lots"}}}}, "memory"),
        ({"unknownTopLevel": True}, "unknownTopLevel"),
    ],
)
def test_the_values_schema_rejects_bad_values(
    values: dict[str, Any], where: str, tmp_path: Path
) -> None:
    bad = values_file(tmp_path, values)
    result = helm("template", "canopy", str(CHART), "--values", str(bad))
    assert result.returncode != 0, f"helm accepted {values}"
    assert "schema" in result.stderr and where in result.stderr, result.stderr


# -- the operator -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_operator_runs_its_real_flags(
    rendered: dict[str, list[dict[str, Any]]], variant: str
) -> None:
    docs = rendered[variant]
    deployment = one(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["canopy", "operator"]
    args = build_parser().parse_args(["operator", *container["args"]])
    if variant == "all-on":  # two replicas: only the Lease holder acts
        assert deployment["spec"]["replicas"] == 2 and args.leader_election
        assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
        assert args.lease_duration == 20 and args.lease_name == deployment["metadata"]["name"]
        fields = {e["name"]: e.get("valueFrom") for e in container["env"]}
        assert fields["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert fields["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        role = one(docs, "Role", f"{deployment['metadata']['name']}-leader")
        assert rbac_rules(role) == {("coordination.k8s.io", "leases", v) for v in LEASE_VERBS}
        assert role["metadata"]["namespace"] == deployment["metadata"]["namespace"]
        binding = one(docs, "RoleBinding", role["metadata"]["name"])
        assert (
            binding["subjects"][0]["name"]
            == (deployment["spec"]["template"]["spec"]["serviceAccountName"])
        )
    else:  # one replica, never two at once
        assert deployment["spec"]["replicas"] == 1 and not args.leader_election
        assert deployment["spec"]["strategy"]["type"] == "Recreate"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.metrics_port == ports["metrics"]
    assert args.liveness == f"http://0.0.0.0:{ports['health']}/healthz"
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    overlay_namespaces = yaml.safe_load(ALL_ON.read_text())["overlayNamespaces"]
    assert args.namespace == (overlay_namespaces if variant == "all-on" else [])
    env = {e["name"]: e.get("value") for e in container["env"]}
    image = container["image"]
    assert env["CANOPY_BROKER_IMAGE"] == image.replace("canopy-operator:", "canopy-broker:")
    service = one(docs, "Service")
    assert selects({"matchLabels": service["spec"]["selector"]}, deployment["metadata"]["labels"])
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_images_come_from_one_registry_and_tag(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["all-on"]
    (operator,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert operator["image"] == "registry.example.com/canopy/canopy-operator:0.1.0-rc.1"
    cronjob = one(docs, "CronJob")
    (miner,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert miner["image"] == "registry.example.com/canopy/canopy-miner:0.1.0-rc.2"
    (operator,) = one(rendered["defaults"], "Deployment")["spec"]["template"]["spec"]["containers"]
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert operator["image"] == f"canopy-operator:{app_version}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_is_locked_down(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    templates = pod_templates(rendered[variant])
    assert {name.rsplit("-", 1)[-1] for name, _ in templates} == {"operator", "miner"}
    for name, template in templates:
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        mounts = {}
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], name
            mounts |= {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], f"{name}: /tmp is not writable"


# -- the miner ----------------------------------------------------------------------------------


def miner_pod(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]  # type: ignore[no-any-return]


def test_the_mining_cronjob_by_default(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["defaults"]
    cron = one(docs, "CronJob")["spec"]
    assert cron["concurrencyPolicy"] == "Forbid"
    assert cron["startingDeadlineSeconds"] > 0
    assert cron["successfulJobsHistoryLimit"] >= 1 and cron["failedJobsHistoryLimit"] >= 1
    pod = miner_pod(docs)["spec"]
    assert pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["command"] == ["canopy", "mine"]
    assert c["args"] == ["--cluster", "--spark-master", "local[*]", "--history-limit", "10"]
    env = {e["name"]: e for e in c["env"]}
    assert env["SPARK_LOCAL_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["HOME"]["value"] == "/tmp"
    conf_dir = env["SPARK_CONF_DIR"]["value"]
    conf_volume = next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == conf_dir)
    config_map = next(v["configMap"]["name"] for v in pod["volumes"] if v["name"] == conf_volume)
    conf = one(docs, "ConfigMap", config_map)["data"]["spark-defaults.conf"]
    settings = dict(line.split(" ", 1) for line in conf.splitlines())
    assert settings["spark.ui.enabled"] == "false"
    assert settings["spark.local.dir"].startswith("/tmp/")
    assert pod["serviceAccountName"] == "canopy-miner"
    assert not [d for d in docs if d["kind"] == "Role"]  # no Spark-on-Kubernetes role


def test_the_miner_cronjob_with_every_option(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["all-on"]
    (c,) = miner_pod(docs)["spec"]["containers"]
    assert c["args"] == [
        "--cluster",
        "--spark-master",
        "k8s://https://kubernetes.default.svc",
        "--history-limit",
        "25",
        "--namespace",
        "trading",
        "--namespace",
        "sensors",
        "--top",
        "5",
    ]
    conf = one(docs, "ConfigMap", "mesh-canopy-miner-spark")["data"]["spark-defaults.conf"]
    settings = dict(line.split(" ", 1) for line in conf.splitlines())
    assert (
        settings["spark.kubernetes.container.image"] == "registry.example.com/spark:4.0.0-python3"
    )
    assert settings["spark.kubernetes.namespace"] == "ops"
    assert (
        settings["spark.kubernetes.authenticate.driver.serviceAccountName"] == "mesh-canopy-miner"
    )
    assert settings["spark.ui.enabled"] == "true"
    spark_role = one(docs, "Role", "mesh-canopy-miner-spark")
    assert spark_role["metadata"]["namespace"] == "ops"
    assert {r for _, r, _ in rbac_rules(spark_role)} == {"pods", "configmaps"}


def test_the_miner_command_parses_with_the_real_canopy_mine(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    parser = build_parser()
    for variant in VARIANTS:
        (c,) = miner_pod(rendered[variant])["spec"]["containers"]
        parser.parse_args(["mine", *c["args"]])


def test_a_disabled_miner_renders_nothing_of_it(tmp_path: Path) -> None:
    docs = helm_template(values_file(tmp_path, {"miner": {"enabled": False}}))
    assert not [d for d in docs if "miner" in d["metadata"]["name"]]


@pytest.mark.parametrize("name", ["release", "fullnameOverride"])
def test_every_name_fits_with_the_longest_release_name_helm_takes(
    tmp_path: Path, name: str
) -> None:
    """Helm takes release names of up to 53 characters; a 40-character one rendered a Service
    of 64 (``-operator-metrics``) and a CronJob of 53 (``-miner``), which the API server would
    refuse (63 and 52 at most), and so did a long ``fullnameOverride``."""
    long = "r" * 53
    if name == "release":
        docs = helm_template(ALL_ON, release=long)
    else:
        docs = helm_template(ALL_ON, values_file(tmp_path, {"fullnameOverride": "f" * 46}))
    for doc in docs:
        limit = 52 if doc["kind"] == "CronJob" else 63
        assert len(doc["metadata"]["name"]) <= limit, (doc["kind"], doc["metadata"]["name"])
    assert any(len(d["metadata"]["name"]) == 63 for d in docs)  # the longest fits exactly


# -- RBAC ---------------------------------------------------------------------------------------


def test_rbac_is_exactly_the_contract_cluster_wide(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["defaults"]
    assert rbac_rules(one(docs, "ClusterRole", "canopy-miner")) == MINER_RULES
    for name in ("canopy-operator", "canopy-miner"):
        binding = one(docs, "ClusterRoleBinding", name)
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": name,
        }
        (subject,) = binding["subjects"]
        sa = one(docs, "ServiceAccount", subject["name"])
        assert subject["namespace"] == sa["metadata"]["namespace"] == "canopy-system"
    (operator,) = pod_templates([one(docs, "Deployment")])
    assert operator[1]["spec"]["serviceAccountName"] == "canopy-operator"


def test_rbac_is_namespaced_when_overlay_namespaces_are_listed(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["all-on"]
    assert not [d for d in docs if d["kind"].startswith("Cluster")]
    defaults = rendered["defaults"]
    operator_rules = rbac_rules(one(defaults, "ClusterRole", "canopy-operator"))
    for ns in ("trading", "sensors"):
        roles = {
            d["metadata"]["name"]: d
            for d in docs
            if d["kind"] == "Role" and d["metadata"]["namespace"] == ns
        }
        assert rbac_rules(roles["mesh-canopy-operator"]) == operator_rules
        assert rbac_rules(roles["mesh-canopy-miner"]) == MINER_RULES
        for d in docs:
            if d["kind"] == "RoleBinding" and d["metadata"]["namespace"] == ns:
                (subject,) = d["subjects"]
                assert subject["namespace"] == "ops"
    subjects = {
        (d["roleRef"]["name"], d["subjects"][0]["name"]) for d in docs if d["kind"] == "RoleBinding"
    }
    assert ("mesh-canopy-operator", "canopy-operator-sa") in subjects
    assert ("mesh-canopy-miner", "mesh-canopy-miner") in subjects


# -- NetworkPolicy ------------------------------------------------------------------------------


def peer_admits(
    peer: Mapping[str, Any], policy_ns: str, pod: Mapping[str, Any], ns_labels: Mapping[str, str]
) -> bool:
    meta = pod["metadata"]
    if "ipBlock" in peer:
        return False  # pods are not addressed by IP here
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], ns_labels):
            return False
    elif meta["namespace"] != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], meta["labels"])


def admits(policy: Mapping[str, Any], pod: Mapping[str, Any], port: int) -> bool:
    """Whether one NetworkPolicy lets ``pod`` reach ``port`` of the pods it selects."""
    ns = pod["metadata"]["namespace"]
    ns_labels = {"kubernetes.io/metadata.name": ns, **pod.get("namespaceLabels", {})}
    for rule in policy["spec"].get("ingress") or []:
        if port not in [p["port"] for p in rule.get("ports") or [{"port": port}]]:
            continue
        peers = rule.get("from")
        if not peers or any(  # no "from", or an empty one: every source
            peer_admits(p, policy["metadata"]["namespace"], pod, ns_labels) for p in peers
        ):
            return True
    return False


def pod_in(
    namespace: str, labels: Mapping[str, str], ns_labels: Mapping[str, str] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {"namespace": namespace, "labels": dict(labels)},
        "namespaceLabels": dict(ns_labels or {}),
    }


def link_policies(docs: Sequence[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """The policies the operator the chart runs writes for overlay "trading" in ``namespace``
    (none unless the chart told it that namespace is isolated)."""
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    told = {args[i + 1] for i, a in enumerate(args) if a == "--network-policy-namespace"}
    if namespace not in told:
        return []
    labels = {manifests.LABEL_OVERLAY: "trading"}
    return [manifests.link_network_policy("trading", namespace, labels, {"name": "trading"})]


def test_network_policy_admits_the_admin_port_only_from_operator_and_miner(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["all-on"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert {p["metadata"]["namespace"] for p in policies} == {"trading", "sensors", "edge"}
    operator = pod_in("ops", one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"])
    miner = pod_in("ops", miner_pod(docs)["metadata"]["labels"])
    prometheus = pod_in("monitoring", {"app.kubernetes.io/name": "prometheus"})
    client = pod_in("apps", {"app": "trader"}, {"canopy.dev/clients": "true"})
    stranger = pod_in("apps", {"app": "curious"})
    for policy in policies:
        ns = policy["metadata"]["namespace"]
        broker = broker_pod(ns)
        assert selects(policy["spec"]["podSelector"], broker["metadata"]["labels"])
        assert not selects(policy["spec"]["podSelector"], operator["metadata"]["labels"])
        neighbour = pod_in(ns, broker["metadata"]["labels"])
        other_overlay = pod_in(
            ns, {**broker["metadata"]["labels"], manifests.LABEL_OVERLAY: "other"}
        )
        admin, overlay, link = manifests.ADMIN_PORT, manifests.BROKER_PORT, manifests.LINK_PORT
        assert {p["containerPort"] for p in broker["spec"]["containers"][0]["ports"]} == {
            admin,
            overlay,
            link,
        }
        assert admits(policy, operator, admin) and admits(policy, miner, admin)
        assert admits(policy, prometheus, admin)  # networkPolicy.adminPort.from
        assert not admits(policy, neighbour, admin)
        assert not admits(policy, client, admin) and not admits(policy, stranger, admin)
        assert admits(policy, client, overlay)
        assert not admits(policy, stranger, overlay)  # overlayPort.allowFromAnywhere: false
        assert not admits(policy, neighbour, overlay)  # brokers link on the link port
        gateway = manifests.GATEWAY_PORT  # the HTTP gateway's clients, as the overlay port's
        assert admits(policy, client, gateway) and not admits(policy, stranger, gateway)
        mqtt = manifests.MQTT_PORT  # MQTT clients likewise
        assert admits(policy, client, mqtt) and not admits(policy, stranger, mqtt)
        assert not admits(policy, operator, 9999)
        # The link port: the overlay's own brokers only, through the operator's policy.
        together = [policy, *link_policies(docs, ns)]
        assert selects(together[-1]["spec"]["podSelector"], broker["metadata"]["labels"])
        assert any(admits(p, neighbour, link) for p in together)
        for outsider in (other_overlay, operator, client, stranger):
            assert not any(admits(p, outsider, link) for p in together)


def test_network_policy_defaults(tmp_path: Path) -> None:
    assert not [d for d in helm_template() if d["kind"] == "NetworkPolicy"]
    values = {"overlayNamespaces": ["trading"], "miner": {"enabled": False}}
    docs = helm_template(values_file(tmp_path, values))
    policy = one(docs, "NetworkPolicy")
    operator = pod_in(
        "canopy-system", one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    )
    would_be_miner = pod_in(
        "canopy-system",
        {"app.kubernetes.io/name": "canopy-miner", "app.kubernetes.io/instance": "canopy"},
    )
    stranger = pod_in("apps", {"app": "curious"})
    assert admits(policy, operator, manifests.ADMIN_PORT)
    assert not admits(policy, would_be_miner, manifests.ADMIN_PORT)  # the miner is off
    assert not admits(policy, stranger, manifests.ADMIN_PORT)
    assert admits(policy, stranger, manifests.BROKER_PORT)  # clients from anywhere by default
    assert not admits(policy, stranger, manifests.LINK_PORT)
    (link,) = link_policies(docs, "trading")
    assert not admits(link, stranger, manifests.LINK_PORT)
    # Nothing isolated, nothing written: the operator would isolate pods no policy admits.
    assert not link_policies(helm_template(), "default")


def test_no_client_peers_admits_no_client(tmp_path: Path) -> None:
    """An empty "from" admits every source in Kubernetes: no peers must mean no rule."""
    values = {
        "overlayNamespaces": ["trading"],
        "networkPolicy": {"overlayPort": {"allowFromAnywhere": False, "from": []}},
    }
    policy = one(helm_template(values_file(tmp_path, values)), "NetworkPolicy")
    assert not admits(policy, pod_in("apps", {"app": "curious"}), manifests.BROKER_PORT)


# -- monitoring ---------------------------------------------------------------------------------


def prometheus_label(name: str) -> str:
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


def test_the_monitors_scrape_what_the_code_serves(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["all-on"]
    pod_monitor = one(docs, "PodMonitor")["spec"]
    broker = broker_pod("trading")
    assert selects(pod_monitor["selector"], broker["metadata"]["labels"])
    assert pod_monitor["namespaceSelector"] == {"matchNames": ["trading", "sensors"]}
    (endpoint,) = pod_monitor["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in broker["spec"]["containers"][0]["ports"]}
    assert ports[endpoint["port"]] == manifests.ADMIN_PORT and endpoint["path"] == "/metrics"
    # The brokers' admin port speaks HTTPS (security on by default), as their probes know.
    probe = broker["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    assert endpoint["scheme"] == probe["scheme"].lower() == "https"
    # Verified against the CA named, and the name every broker certificate carries.
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "corp-ca", "key": "tls.crt"}},
        "serverName": SCRAPE_NAME,
    }
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert relabel == {
        "overlay": [prometheus_label(manifests.LABEL_OVERLAY)],
        "broker": [prometheus_label(manifests.LABEL_BROKER)],
    }
    service_monitor = one(docs, "ServiceMonitor")["spec"]
    service = one(docs, "Service")
    assert selects(service_monitor["selector"], service["metadata"]["labels"])
    assert service_monitor["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    defaults = rendered["defaults"]
    assert not [d for d in defaults if d["apiVersion"].startswith("monitoring.coreos.com")]


def test_without_a_ca_the_scrape_is_not_verified(tmp_path: Path) -> None:
    values = {"monitoring": {"podMonitor": {"enabled": True}}}
    pod_monitor = one(helm_template(values_file(tmp_path, values)), "PodMonitor")
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["tlsConfig"] == {"insecureSkipVerify": True}


def exported(families: Sequence[Metric]) -> dict[str, set[str]]:
    """Sample names a scrape shows for these metric families -> their label names."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    out: dict[str, set[str]] = {}
    for family in families:
        for suffix in suffixes.get(family.type, [""]):
            out[family.name + suffix] = set()
    return out


def canopy_metrics() -> dict[str, set[str]]:
    return exported(families())


def dashboard_names(dashboard: Mapping[str, Any]) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v.get("definition", "") for v in dashboard["templating"]["list"]]
    return {n for e in exprs for n in re.findall(r"\bcanopy_[a-z_]+\b", e)}


def test_the_dashboard_shows_real_metrics(rendered: dict[str, list[dict[str, Any]]]) -> None:
    config_map = one(rendered["all-on"], "ConfigMap", "mesh-canopy-dashboard")
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["canopy.json"])
    assert dashboard["uid"] == "canopy-overview"
    names = dashboard_names(dashboard)
    unknown = names - set(canopy_metrics())
    assert not unknown, f"the dashboard queries metrics nobody exports: {sorted(unknown)}"
    # Every broker and operator metric has a panel (counters by their _total name).
    shown = {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for n in names}
    metric_families = {
        n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        for n in canopy_metrics()
    }
    assert metric_families <= shown, f"no panel for {sorted(metric_families - shown)}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_dashboard_check_catches_an_invented_metric() -> None:
    fake = {"panels": [{"targets": [{"expr": "rate(canopy_invented_total[5m])"}]}]}
    fake["templating"] = {"list": []}  # type: ignore[dict-item]
    assert dashboard_names(fake) - set(canopy_metrics()) == {"canopy_invented_total"}


# -- NOTES.txt ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def notes_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart with a throw-away template that renders NOTES.txt through `tpl`
    (helm template does not render NOTES.txt; `helm install` prints it)."""
    chart = tmp_path_factory.mktemp("notes") / "chart"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ tpl (.Files.Get "notes.txt") . | quote }}}\n'
    )
    return chart


def test_notes_tell_what_to_do_next_and_what_is_missing(notes_chart: Path, tmp_path: Path) -> None:
    def notes(values: Mapping[str, Any]) -> str:
        docs = helm_template(values_file(tmp_path, values), chart=notes_chart)
        return str(one(docs, "ConfigMap", "notes")["data"]["notes"])

    text = notes({})
    assert "kubectl get bo -w" in text and "canopy.dev/approve=true" in text
    assert "no NetworkPolicy was rendered" in text
    text = notes({"overlayNamespaces": ["a"], "monitoring": {"podMonitor": {"enabled": True}}})
    assert "guards the broker pods in: a" in text
    assert "WARNING" in text and "adminPort.from" in text
    assert "WARNING" not in notes(yaml.safe_load(ALL_ON.read_text()))
    assert "no TopologyProposals will be filed" in notes({"miner": {"enabled": False}})


def test_broker_pods_of_a_larger_overlay_hold_clients_by_annotation_not_by_argument() -> None:
    """A new broker process refuses clients until linked (a container restarted in place
    keeps its pod's address, and the Service takes it once its process answers). Told by a
    pod annotation, read through the downward API, so that it is no part of the template
    hash: an overlay growing from one broker to two does not replace its first."""

    def pod(names: list[str]) -> dict[str, Any]:
        links = [[names[0], n] for n in names[1:]]
        spec = parse_overlay(
            {
                "apiVersion": f"{kube.GROUP}/{kube.VERSION}",
                "kind": kube.KIND,
                "metadata": {"name": "o"},
                "spec": {"brokers": [{"name": n} for n in names], "links": links},
            }
        )
        return manifests.pod_manifest(spec, "hub", "ns", {}, "img")

    alone, pair = pod(["hub"]), pod(["hub", "edge"])
    hold = "canopy.dev/hold-clients"
    assert hold not in alone["metadata"]["annotations"]
    assert float(pair["metadata"]["annotations"][hold]) > 30  # above the default heal interval
    same = manifests.TEMPLATE_HASH
    assert alone["metadata"]["annotations"][same] == pair["metadata"]["annotations"][same]
    (container,) = pair["spec"]["containers"]
    assert broker_parser().parse_args(container["args"]).placement_dir == manifests.PLACEMENT_DIR
