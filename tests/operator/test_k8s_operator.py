"""The kopf operator for real against kmock's Kubernetes emulator, with real broker processes."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime
import os
import shutil
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import yaml
from cryptography import x509
from prometheus_client import REGISTRY

from canopy_broker.admin_client import AdminClient
from canopy_broker.client import ClientError, Credentials, connect
from canopy_broker.pki import Authority
from canopy_broker.runtime.security import BROKER, Identity
from canopy_broker.sim.checker import check_deliveries
from canopy_operator.backends.certs import SCRAPE_NAME, needs_renewal, secret_bytes
from canopy_operator.backends.kube import KubeApi, overlay_path
from canopy_operator.backends.leader import LeaseConfig
from canopy_operator.backends.manifests import LABEL_OVERLAY, LINK_PORT, PAUSE_ROLLOUT
from canopy_operator.model.topology import norm
from tests.integration.test_reconfiguration import Run, converged
from tests.integration.test_security import answer_or_nothing
from tests.operator.k8s_harness import (
    NS,
    BrokerView,
    CanopyEmulator,
    Gate,
    Kubelet,
    OperatorThread,
    condition,
    declare_resources,
    deliveries,
    get_overlay,
    kubeconfig,
    live_traffic,
    make_config,
    objects,
    overlay_manifest,
    server_url,
    until,
)
from tests.tools import rbac_rules

pytestmark = [pytest.mark.integration, pytest.mark.kmock(cls=CanopyEmulator)]


class Cluster:
    def __init__(self, emulator: kmock.KubernetesEmulator, kubelet: Kubelet, api: KubeApi):
        self.emulator, self.kubelet, self.api = emulator, kubelet, api
        self.operator: OperatorThread | None = None

    def start_operator(self, **settings: Any) -> OperatorThread:
        config = dataclasses.replace(make_config(self.emulator, self.kubelet), **settings)
        self.operator = OperatorThread(config).start()
        return self.operator

    async def stop_operator(self) -> None:
        if self.operator is not None:
            op, self.operator = self.operator, None
            await op.stop()

    async def apply(self, body: dict[str, Any]) -> None:
        await self.api.create(overlay_path(NS), body)

    async def overlay(self, name: str) -> dict[str, Any]:
        return await get_overlay(self.api, name)

    async def ready_in(self, namespace: str, name: str) -> bool:
        obj = await self.api.get(overlay_path(namespace, name)) or {}
        return (obj.get("status") or {}).get("phase") == "Ready"

    async def ready(self, name: str, generation: int = 1, within: float = 30.0) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            obj = await self.overlay(name)
            st = obj.get("status") or {}
            ok = st.get("phase") == "Ready" and st.get("observedGeneration") == generation
            return obj if ok else None

        return await until(check, within, f"{name} Ready at generation {generation}")


@pytest.fixture
async def cluster(kmock: kmock.KubernetesEmulator, tmp_path: Path) -> AsyncIterator[Cluster]:
    declare_resources(kmock)
    api = KubeApi(server_url(kmock), user_agent="canopy-tests")
    async with Kubelet(kmock, tmp_path) as kubelet:
        c = Cluster(kmock, kubelet, api)
        try:
            yield c
        finally:
            await c.stop_operator()
            await api.close()


ROOT = Path(__file__).resolve().parents[2]
VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create"}
VERBS |= {"UPDATE": "patch", "DELETE": "delete"}


def verbs_used(
    emulator: kmock.KubernetesEmulator, agents: tuple[str, ...] = ("kopf", "canopy-operator")
) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) of every request kopf or the operator (or the
    given ``agents``, by User-Agent prefix) made."""
    used = set()
    for r in emulator._requests:  # kmock keeps every request it served
        agent = r.headers.get("User-Agent", "")
        if r.resource is None or r.resource.plural is None or not agent.startswith(agents):
            continue
        plural = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        used.add((r.resource.group or "", plural, VERBS[r.action.name]))
    return used


def verbs_granted(manifest: str = "manifests/install/rbac.yaml") -> set[tuple[str, str, str]]:
    docs = list(yaml.safe_load_all((ROOT / manifest).read_text()))
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    return rbac_rules(role)


def without_proposals(verbs: set[tuple[str, str, str]]) -> set[tuple[str, str, str]]:
    """Less what proposals and cert-manager Certificates need (their tests check those)."""
    return {v for v in verbs if not v[1].startswith("topologyproposals") and v[1] != "certificates"}


def undeclared(value: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """Fields a real API server would prune: not declared in the CRD's structural schema."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        out = [f"{where}.{k}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                out += undeclared(v, props[k], f"{where}.{k}")
        return out
    if isinstance(value, list):
        return [
            x
            for i, v in enumerate(value)
            for x in undeclared(v, schema.get("items") or {}, f"{where}[{i}]")
        ]
    return []


def status_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "manifests/crds/brokeroverlays.canopy.dev.yaml").read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["status"]


def events(emulator: kmock.KubernetesEmulator, reason: str | None = None) -> list[dict[str, Any]]:
    return [e for e in objects(emulator, "events") if reason is None or e.get("reason") == reason]


async def test_creating_an_overlay_creates_its_objects_and_links(cluster: Cluster) -> None:
    cluster.start_operator()
    links = [("a", "b"), ("b", "c"), ("b", "d")]
    body = overlay_manifest("demo", ["a", "b", "c", "d"], links)
    small = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    big = {"requests": {"cpu": "1", "memory": "512Mi"}}
    body["spec"]["broker"] = {"image": "registry.example/canopy:1.2", "resources": small}
    body["spec"]["brokers"][1].update(zone="zone-b", labels={"tier": "core"}, resources=big)
    await cluster.apply(body)
    obj = await cluster.ready("demo")
    uid = obj["metadata"]["uid"]
    st = obj["status"]
    assert st["brokersReady"] == "4/4"
    assert sorted(map(tuple, st["links"])) == sorted(links)
    assert st["linkCount"] == 3
    assert condition(obj, "Valid")["status"] == "True"
    assert condition(obj, "Ready")["status"] == "True"
    assert condition(obj, "Reconfiguring")["status"] == "False"
    assert condition(obj, "Degraded")["status"] == "False"

    pods = {p["metadata"]["name"]: p for p in objects(cluster.emulator, "pods")}
    assert sorted(pods) == ["demo-a", "demo-b", "demo-c", "demo-d"]
    for name, pod in pods.items():
        (owner,) = pod["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["kind"] == "BrokerOverlay" and owner["controller"]
        assert pod["metadata"]["labels"]["canopy.dev/broker"] == name.removeprefix("demo-")
        c = pod["spec"]["containers"][0]
        assert c["args"][:2] == ["serve", "--name"] and "--token-file" in c["args"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["image"] == "registry.example/canopy:1.2"
        assert c["resources"] == (big if name == "demo-b" else small)
    assert pods["demo-b"]["metadata"]["labels"]["tier"] == "core"
    zone = pods["demo-b"]["spec"]["affinity"]["nodeAffinity"]
    term = zone["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"]
    assert term["matchExpressions"][0]["values"] == ["zone-b"]
    anti = pods["demo-b"]["spec"]["affinity"]["podAntiAffinity"]
    terms = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    near = terms[0]["podAffinityTerm"]["labelSelector"]["matchExpressions"][0]["values"]
    assert near == ["a", "c", "d"]  # b's neighbours are kept off b's node

    (svc,) = objects(cluster.emulator, "services")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["metadata"]["ownerReferences"][0]["uid"] == uid
    secrets = {x["metadata"]["name"]: x for x in objects(cluster.emulator, "secrets")}
    tls = [f"demo-{b}-tls" for b in "abcd"]
    assert sorted(secrets) == sorted(["demo-admin", "demo-ca", "demo-client", *tls])
    for secret in secrets.values():
        assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
    assert secrets["demo-admin"]["data"]["token"]
    (policy,) = objects(cluster.emulator, "configmaps")
    assert policy["metadata"]["ownerReferences"][0]["uid"] == uid

    # The brokers themselves hold the declared tree.
    for pod, proc in cluster.kubelet.procs.items():
        status = await proc.admin.status()
        mine = pod.removeprefix("demo-")
        peers = sorted(n["peer"] for n in status["neighbours"])
        assert peers == sorted(b for e in links for b in e if mine in e and b != mine)
    await until(lambda: events(cluster.emulator, "PlanFinished"), 10, "PlanFinished")
    assert "spec" in obj and obj["spec"]["links"] == [list(e) for e in links]  # untouched


async def test_an_invalid_spec_gets_valid_false_and_nothing_is_created(cluster: Cluster) -> None:
    cluster.start_operator()
    bad = overlay_manifest("bad", ["a", "b", "c"], [("a", "b"), ("b", "c"), ("c", "a")])
    await cluster.apply(bad)

    async def invalid() -> dict[str, Any] | None:
        obj = await cluster.overlay("bad")
        return obj if (obj.get("status") or {}).get("phase") == "Invalid" else None

    obj = await until(invalid, 20, "phase Invalid")
    valid = condition(obj, "Valid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert "cycle" in valid["message"] and "a" in valid["message"]
    await until(lambda: events(cluster.emulator, "InvalidSpec"), 10, "an InvalidSpec event")
    (event,) = events(cluster.emulator, "InvalidSpec")
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "bad"
    assert objects(cluster.emulator, "pods") == []
    assert objects(cluster.emulator, "secrets") == []
    assert objects(cluster.emulator, "services") == []


async def test_brokers_run_tls_with_the_overlays_own_ca(cluster: Cluster) -> None:
    """Security is on by default (issue 14): the operator makes the overlay's CA, a TLS Secret
    per broker and a client Secret; the pods mount theirs at --tls-dir; the brokers' admin API
    is HTTPS (the operator verified it against the CA to converge), their links are TLS, and
    only clients with the overlay's certificates get in."""
    cluster.start_operator()
    await cluster.apply(overlay_manifest("sec", ["a", "b"], [("a", "b")]))
    obj = await cluster.ready("sec")
    uid = obj["metadata"]["uid"]
    secrets = {x["metadata"]["name"]: x for x in objects(cluster.emulator, "secrets")}
    ca_pem = secret_bytes(secrets["sec-ca"], "ca.crt")
    assert secret_bytes(secrets["sec-ca"], "ca.key")
    ca = x509.load_pem_x509_certificate(ca_pem)
    for name, uri in (
        ("sec-a-tls", "canopy://broker/a"),
        ("sec-b-tls", "canopy://broker/b"),
        ("sec-client", "canopy://client/canopy"),
    ):
        secret = secrets[name]
        assert secret["type"] == "kubernetes.io/tls"
        assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
        assert secret_bytes(secret, "ca.crt") == ca_pem and secret_bytes(secret, "tls.key")
        cert = x509.load_pem_x509_certificate(secret_bytes(secret, "tls.crt"))
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [uri]
        if uri.startswith("canopy://broker/"):  # what Prometheus verifies (chart: caSecret)
            assert SCRAPE_NAME in san.get_values_for_type(x509.DNSName)
    for pod in objects(cluster.emulator, "pods"):
        (c,) = pod["spec"]["containers"]
        args = c["args"]
        assert "--insecure" not in args
        assert args[args.index("--tls-dir") + 1] == "/etc/canopy/tls"
        assert args[args.index("--policy") + 1] == "/etc/canopy/policy/policy.yaml"
        broker = pod["metadata"]["labels"]["canopy.dev/broker"]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == f"sec-{broker}-tls"
        assert volumes["policy"]["configMap"]["name"] == "sec-policy"
        assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"

    procs = [cluster.kubelet.procs["sec-a"], cluster.kubelet.procs["sec-b"]]
    for proc in procs:
        assert proc.admin.url.startswith("https://")
        assert [n["peer"] for n in (await proc.admin.status())["neighbours"]]  # linked
        async with AdminClient(proc.admin_address, proc.token) as plain:  # http: no answer
            with pytest.raises(aiohttp.ClientError):
                await plain.status()
    a, b = (p.listen for p in procs)
    creds = cluster.kubelet.credentials("sec")
    assert await answer_or_nothing(None, a) == b""  # plaintext: dropped by TLS
    with pytest.raises(ClientError, match="unauthenticated"):  # the CA alone proves nothing
        await connect(a, "nobody", credentials=Credentials(creds.ca), failover_within=0)
    sub = await connect(b, "dash", credentials=creds)
    pub = await connect(a, "feed", credentials=creds)
    try:
        await sub.subscribe("n > 0", sub_id="s")

        async def delivered() -> list[Any]:
            await pub.publish({"n": 1})
            return list(await sub.receive(max_items=100, timeout=0.2))

        got = await until(delivered, 20, "a notification across the TLS link")
        assert got[0].publisher == "feed"
    finally:
        await sub.close()
        await pub.close()


async def test_certificates_due_for_renewal_are_issued_anew(cluster: Cluster) -> None:
    """A broker certificate in the last third of its validity is issued anew by the heal, with
    an Event; the others are left as they are. (The broker re-reads rewritten files and resumes
    its links on new connections: tests/unit/test_security.py.)"""
    cluster.start_operator(renew_interval=0.2)
    await cluster.apply(overlay_manifest("ren", ["a", "b"], [("a", "b")]))
    await cluster.ready("ren")
    secrets = {x["metadata"]["name"]: x for x in objects(cluster.emulator, "secrets")}
    ca = Authority.from_pem(
        secret_bytes(secrets["ren-ca"], "ca.crt"), secret_bytes(secrets["ren-ca"], "ca.key")
    )
    b_before = secret_bytes(secrets["ren-b-tls"], "tls.crt")
    assert not needs_renewal(b_before)
    due, key = ca.issue(Identity(BROKER, "a"), days=0)  # expiring now
    assert needs_renewal(due)
    path = f"/api/v1/namespaces/{NS}/secrets/ren-a-tls"
    # One patch, not delete + create: the heal must never see the Secret missing (it would
    # create a fresh one, with no renewal to tell).
    data = {"tls.crt": base64.b64encode(due).decode(), "tls.key": base64.b64encode(key).decode()}
    await cluster.api.patch(path, {"data": data})

    async def renewed() -> bytes | None:
        secret = await cluster.api.get(path)
        cert = secret_bytes(secret, "tls.crt")
        return cert if cert and cert != due else None

    fresh = await until(renewed, 20, "the due certificate to be issued anew")
    cert = x509.load_pem_x509_certificate(fresh)
    cert.verify_directly_issued_by(ca.cert)
    assert not needs_renewal(fresh) and cert.not_valid_after_utc - cert.not_valid_before_utc > (
        datetime.timedelta(days=300)
    )
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["canopy://broker/a"]

    async def told() -> list[str] | None:  # the Event follows the new Secret
        said = [e["message"] for e in events(cluster.emulator, "CertificateRenewed")]
        return said or None

    said = await until(told, 20, "a CertificateRenewed Event")
    assert any("broker a" in m for m in said) and not any("broker b" in m for m in said)
    assert (
        secret_bytes(await cluster.api.get(f"/api/v1/namespaces/{NS}/secrets/ren-b-tls"), "tls.crt")
        == b_before
    )


def test_needs_renewal_in_the_last_third_of_the_validity() -> None:
    ca = Authority.create()
    cert, _ = ca.issue(Identity(BROKER, "x"), days=30)
    start = datetime.datetime.now(datetime.UTC)
    assert not needs_renewal(cert, start + datetime.timedelta(days=19))
    assert needs_renewal(cert, start + datetime.timedelta(days=21))
    assert needs_renewal(b"not a certificate")


async def test_security_off_runs_the_brokers_insecure(cluster: Cluster) -> None:
    """``spec.security.tls: false``: plaintext brokers (--insecure), no certificates; a policy
    the brokers would refuse makes the spec invalid before anything runs."""
    cluster.start_operator()
    await cluster.apply(
        overlay_manifest("bad", ["x"], None, security={"policy": {"principals": "nobody"}})
    )
    await cluster.apply(overlay_manifest("open", ["a", "b"], [("a", "b")], security={"tls": False}))
    await cluster.ready("open")
    assert [x["metadata"]["name"] for x in objects(cluster.emulator, "secrets")] == ["open-admin"]
    assert objects(cluster.emulator, "configmaps") == []
    for pod in objects(cluster.emulator, "pods"):
        (c,) = pod["spec"]["containers"]
        assert "--insecure" in c["args"] and "--tls-dir" not in c["args"]
        assert c["livenessProbe"]["httpGet"]["scheme"] == "HTTP"
        assert [v["name"] for v in pod["spec"]["volumes"]] == [
            "admin-token",
            "placement",
        ]  # no TLS Secret
    proc = cluster.kubelet.procs["open-a"]
    assert proc.admin.url.startswith("http://")
    client = await connect(proc.listen, "anyone", credentials=Credentials())  # plaintext
    await client.close()

    async def invalid() -> dict[str, Any] | None:
        obj = await cluster.overlay("bad")
        return obj if (obj.get("status") or {}).get("phase") == "Invalid" else None

    message = condition(await until(invalid, 20, "bad Invalid"), "Valid")["message"]
    assert "spec.security.policy" in message and "principals" in message
    assert not [p for p in objects(cluster.emulator, "pods") if "bad" in p["metadata"]["name"]]


def history(emulator: kmock.KubernetesEmulator, name: str) -> list[dict[str, Any]]:
    """Every version of the overlay the API server stored, oldest first."""
    for (resource, _ns, oname), obj in list(emulator.objects.items()):
        if resource.plural == "brokeroverlays" and oname == name:
            return [v.raw for v in obj.history if v is not None]
    return []


POLICY = {
    "default": "deny",
    "principals": [
        {"name": "canopy", "clients": ["*"]},
        {"name": "dashboard", "subscribe": ["kind = 'temp'"], "publish": []},
    ],
}
CHAIN = [("a", "b"), ("b", "c"), ("c", "d"), ("d", "e")]
# Drop e, add f, re-wire a..d: 3 exchanges, an add-leaf and a remove-leaf.
RESHAPED = [("a", "c"), ("a", "d"), ("b", "d"), ("d", "f")]


async def test_changing_the_spec_runs_the_plan_on_real_brokers(cluster: Cluster) -> None:
    cluster.start_operator(network_policy_namespaces=frozenset({NS}))  # as the chart says
    await cluster.apply(overlay_manifest("demo", ["a", "b", "c", "d", "e"], CHAIN))
    await cluster.ready("demo")
    # The scheduler binds a to a node of zone-1: the heal tells its pod (and so its broker).
    await cluster.api.create(
        "/api/v1/nodes",
        {"metadata": {"name": "node-1", "labels": {"topology.kubernetes.io/zone": "zone-1"}}},
    )
    await cluster.api.patch(
        f"/api/v1/namespaces/{NS}/pods/demo-a", {"spec": {"nodeName": "node-1"}}
    )

    def zone_of_a() -> str | None:
        (pod,) = [p for p in objects(cluster.emulator, "pods") if p["metadata"]["name"] == "demo-a"]
        return (pod["metadata"].get("annotations") or {}).get("canopy.dev/zone")

    assert await until(zone_of_a, 20, "a's pod annotated with its zone") == "zone-1"
    new_spec = overlay_manifest("demo", ["a", "b", "c", "d", "f"], RESHAPED)["spec"]
    new_spec["security"] = {"policy": POLICY}  # and a client policy of its own
    await cluster.api.patch(overlay_path(NS, "demo"), {"spec": new_spec})
    obj = await cluster.ready("demo", generation=2)
    (policy,) = objects(cluster.emulator, "configmaps")
    assert yaml.safe_load(policy["data"]["policy.yaml"]) == POLICY
    # The overlay's link port admits its own brokers only (tests/deploy checks the semantics).
    (links,) = objects(cluster.emulator, "networkpolicies")
    assert links["metadata"]["name"] == "demo-links"
    assert links["metadata"]["ownerReferences"][0]["name"] == "demo"
    (rule,) = links["spec"]["ingress"]
    assert rule["ports"] == [{"port": LINK_PORT, "protocol": "TCP"}]
    assert "demo-e-tls" not in {x["metadata"]["name"] for x in objects(cluster.emulator, "secrets")}

    st = obj["status"]
    assert sorted(map(tuple, st["links"])) == sorted(RESHAPED)
    assert st["brokersReady"] == "5/5" and st["linkCount"] == 4
    steps = st["plan"]["steps"]
    kinds = [s["kind"] for s in steps]
    assert kinds.count("exchange") == 3 and kinds.count("add-leaf") == 1
    assert kinds.count("remove-leaf") == 1
    assert all(s["done"] for s in steps) and st["plan"]["progress"] == f"{len(steps)}/{len(steps)}"
    assert st["plan"]["generation"] == 2 and st["lastReconfiguration"]["exchanges"] == 3

    # The status showed the plan's progress step by step while it ran.
    seen = [
        (v.get("status") or {}).get("plan", {}).get("progress")
        for v in history(cluster.emulator, "demo")
        if ((v.get("status") or {}).get("plan") or {}).get("generation") == 2
    ]
    assert [f"{i}/{len(steps)}" for i in range(len(steps) + 1)] == sorted(
        set(filter(None, seen)), key=lambda p: int(p.split("/")[0])
    )
    reconfiguring = [
        v
        for v in history(cluster.emulator, "demo")
        if v.get("status", {}).get("phase") == "Reconfiguring"
    ]
    assert reconfiguring and condition(reconfiguring[-1], "Reconfiguring")["status"] == "True"

    # The brokers hold the new tree; e's pod and process are gone, f runs.
    pods = sorted(p["metadata"]["name"] for p in objects(cluster.emulator, "pods"))
    assert pods == ["demo-a", "demo-b", "demo-c", "demo-d", "demo-f"]
    await until(lambda: "demo-e" not in cluster.kubelet.procs, 10, "e's process stopped")
    for pod, proc in cluster.kubelet.procs.items():
        mine = pod.removeprefix("demo-")
        peers = sorted(n["peer"] for n in (await proc.admin.status())["neighbours"])
        assert peers == sorted(b for e in RESHAPED for b in e if mine in e and b != mine)
    await until(lambda: events(cluster.emulator, "PlanFinished")[1:], 10, "2 PlanFinished")
    done = [e["message"] for e in events(cluster.emulator, "StepDone")]
    assert len(done) == 4 + len(steps)  # 4 add-leaf steps at creation, then this plan

    # Everything the operator wrote into status is declared in the CRD (nothing gets pruned).
    for version in history(cluster.emulator, "demo"):
        assert not undeclared(version.get("status") or {}, status_schema(), "status")

    # Operator metrics (the process-wide registry /metrics serves).
    assert REGISTRY.get_sample_value("canopy_operator_plan_steps", {"overlay": "demo"}) == 5
    done = {"kind": "exchange", "result": "done"}
    assert (REGISTRY.get_sample_value("canopy_operator_steps_total", done) or 0) >= 3
    ok = {"result": "ok"}
    assert (REGISTRY.get_sample_value("canopy_operator_reconcile_seconds_count", ok) or 0) >= 2

    # Least privilege: the ClusterRole grants exactly what the operator used, no more (what
    # only proposals need is checked by test_k8s_proposals.py, which files some).
    assert without_proposals(verbs_used(cluster.emulator)) == without_proposals(verbs_granted())


STAR = [("a", "b"), ("a", "c"), ("a", "d"), ("d", "e"), ("d", "f")]
# Four exchanges, run one at a time.
REWIRED = [("b", "c"), ("c", "d"), ("d", "e"), ("e", "f"), ("f", "a")]


async def test_a_restarted_operator_resumes_the_plan_and_nothing_is_lost(
    cluster: Cluster,
) -> None:
    names = ["a", "b", "c", "d", "e", "f"]
    cluster.start_operator()
    await cluster.apply(overlay_manifest("demo", names, STAR))
    await cluster.ready("demo")

    view = BrokerView(cluster.kubelet, "demo", STAR)
    run = await live_traffic(view, names, ["b", "f"], seed=7)

    def second_step_saved(patch: dict[str, Any]) -> bool:
        plan = patch.get("status", {}).get("plan") or {}
        return bool(plan.get("generation") == 2 and plan.get("done") == 2)

    # The API server holds the answer to the save after step 2; meanwhile the operator dies.
    gate = cluster.emulator.gate = Gate(second_step_saved)
    new_spec = overlay_manifest("demo", names, REWIRED)["spec"]
    await cluster.api.patch(overlay_path(NS, "demo"), {"spec": new_spec})
    await asyncio.wait_for(gate.reached.wait(), 30)
    await cluster.stop_operator()  # kopf gives the stuck handler 5 s, then cancels it
    gate.opened.set()
    saved = (await cluster.overlay("demo"))["status"]["plan"]
    total = len(saved["steps"])
    assert total == 4 and saved["done"] == 2, saved

    cluster.start_operator()
    obj = await cluster.ready("demo", generation=2, within=40)
    st = obj["status"]
    assert sorted(map(tuple, st["links"])) == sorted(norm(e) for e in REWIRED)
    assert st["plan"]["progress"] == "4/4" and all(s["done"] for s in st["plan"]["steps"])

    def finished_2() -> bool:  # the last Event of the plan: the ones before it are posted
        return any("generation 2" in e["message"] for e in events(cluster.emulator, "PlanFinished"))

    await until(finished_2, 10, "PlanFinished of generation 2")
    assert events(cluster.emulator, "PlanResumed")
    # No step ran twice: the resumed operator skipped the two saved as done and ran the rest.
    # (Events are best effort: those still queued in the first operator died with it.)
    started = [e["message"] for e in events(cluster.emulator, "StepStarted")]
    started = [m.split(":")[0] for m in started if "exchange" in m]
    assert len(started) == len(set(started)) and {"step 3/4", "step 4/4"} <= set(started)
    done = [e["message"] for e in events(cluster.emulator, "StepDone")]
    done = [m.split(":")[0] for m in done if "exchange" in m]
    assert len(done) == len(set(done)) and {"step 3", "step 4"} <= set(done)
    assert "step 2" not in done  # its save was held; the operator died before the Event

    # Traffic flowed throughout: nothing lost, duplicated or reordered.
    report = await deliveries(view, run, [norm(e) for e in REWIRED])
    assert report.ok, str(report)
    assert report.owed > 500, str(report)


async def kubectl(cluster: Cluster, tmp_path: Path, *args: str) -> str:
    """The real kubectl against the emulator (it runs in this event loop: no blocking)."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    proc = await asyncio.create_subprocess_exec(
        "kubectl",
        "--server",
        server_url(cluster.emulator),
        "--cache-dir",
        str(tmp_path / "kube-cache"),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {err.decode()}"
    return out.decode()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs the kubectl client")
async def test_kubectl_applies_the_examples_and_shows_the_printer_columns(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start_operator()
    out = await kubectl(
        cluster, tmp_path, "apply", "--validate=false", "-f", str(ROOT / "manifests/examples")
    )
    assert "brokeroverlay.canopy.dev/trading created" in out, out
    assert "topologyproposal.canopy.dev/trading-1 created" in out, out
    for name in ("trading", "sensors"):
        await until(lambda n=name: cluster.ready_in("default", n), 40, f"{name} Ready")
    table = await kubectl(cluster, tmp_path, "get", "brokeroverlays", "-n", "default")
    header, *rows = [line.split() for line in table.strip().splitlines()]
    assert header == ["NAME", "PHASE", "READY", "LINKS", "PROGRESS", "AGE"], table
    by_name = {r[0]: r[1:] for r in rows}
    assert by_name["trading"][:3] == ["Ready", "6/6", "5"], table
    assert by_name["sensors"][:3] == ["Ready", "8/8", "7"], table
    assert by_name["trading"][3] == "5/5" and by_name["sensors"][3] == "7/7", table  # joins
    # The short name from discovery, one object (a Table of one row).
    short = await kubectl(cluster, tmp_path, "get", "bo", "trading", "-n", "default")
    assert short.split()[6:10] == ["trading", "Ready", "6/6", "5"], short
    proposals = await kubectl(cluster, tmp_path, "get", "topologyproposals", "-n", "default")
    assert proposals.split()[:4] == ["NAME", "OVERLAY", "PHASE", "GAIN"], proposals


async def four_brokers(cluster: Cluster) -> BrokerView:
    """The operator started, and the overlay ``demo`` of a, b, c, d (b inner) ready."""
    cluster.start_operator()
    await cluster.apply(overlay_manifest("demo", ["a", "b", "c", "d"], FOUR))
    await cluster.ready("demo")
    return BrokerView(cluster.kubelet, "demo", FOUR)


async def delivered_everything(run: Run, at_least: int) -> None:
    """Stop the publisher ``p``; everything owed arrived, once and in order."""
    run.stop.set()
    await run.clients["p"].flush()
    await run.wait_delivered(within=20)
    await run.finish()
    report = check_deliveries(run.subs, run.pubs, run.deliveries)
    assert report.ok and report.owed > at_least, str(report)


FOUR = [("a", "b"), ("b", "c"), ("b", "d")]


async def test_a_restarted_broker_is_relinked_and_gets_its_routing_state_back(
    cluster: Cluster,
) -> None:
    # A restart faster than failure detection: the neighbours wait for b instead of repairing
    # the tree around it (tests/integration/test_crash_repair.py covers the repair).
    cluster.kubelet.broker_args = ("--dead-after", "60")
    view = await four_brokers(cluster)
    run = Run()
    await run.subscriber(view, "s-c", "c", ['side = "buy"'])
    await run.subscriber(view, "s-d", "d", ["qty > 10"])
    await converged(view, run)  # type: ignore[arg-type]

    await cluster.kubelet.restart("demo-b")  # the inner broker dies; its pod restarts it

    async def relinked() -> bool:
        status = await view["b"].admin.status()
        return sorted(n["peer"] for n in status["neighbours"] if n.get("up", True)) == [
            "a",
            "c",
            "d",
        ]

    await until(relinked, 20, "b re-linked to a, c and d")
    t = await converged(view, run)  # type: ignore[arg-type]  # routing tables canonical again
    run.settled(t)
    await run.publisher(view, "p", "a", seed=1)  # type: ignore[arg-type]
    await until(lambda: len(run.pubs) > 200, 20, "some traffic")
    await delivered_everything(run, 20)
    await until(lambda: events(cluster.emulator, "BrokerRelinked"), 10, "BrokerRelinked")


async def test_a_broker_back_after_a_repair_gets_the_declared_shape_back(cluster: Cluster) -> None:
    """b dies and stays down long enough for a, c and d to repair the tree around it (a chain
    a-c-d). When its pod's broker comes back, the heal restores the declared shape by a plan:
    b joins as a leaf, then exchanges move the repair's links back to b. Re-adding b's declared
    links one by one would close a cycle; at no time is there one."""
    links = [("a", "b"), ("b", "c"), ("b", "d")]
    cluster.kubelet.broker_args = ("--heartbeat", "0.2", "--dead-after", "3")
    cluster.start_operator()
    await cluster.apply(overlay_manifest("demo", ["a", "b", "c", "d"], links))
    await cluster.ready("demo")
    view = BrokerView(cluster.kubelet, "demo", links)

    async def live() -> set[tuple[str, str]]:
        edges = set()
        for name in "abcd":
            with contextlib.suppress(Exception):
                status = await view[name].admin.status()
                for n in status["neighbours"]:
                    x, y = sorted((name, str(n["peer"])))
                    edges.add((x, y))
        return edges

    restarted = asyncio.create_task(cluster.kubelet.restart("demo-b", after=3.0))

    async def chained() -> bool:
        return {("a", "c"), ("c", "d")} <= await live()

    async def degraded_by(*reasons: str) -> bool:
        obj = await cluster.api.get(overlay_path(NS, "demo"))
        conds = ((obj or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Degraded" and c["reason"] in reasons for c in conds)

    await until(chained, 20, "a, c and d repaired the tree around b")
    # The condition tells it too: lost (or already repaired), later recovered.
    await until(lambda: degraded_by("BrokerLost", "TreeRepaired"), 10, "a repair condition")
    await restarted

    async def relinked() -> set[tuple[str, str]] | None:
        edges = await live()
        return edges if any("b" in e for e in edges) else None

    await until(relinked, 20, "b linked again")
    declared = {("a", "b"), ("b", "c"), ("b", "d")}

    async def restored() -> bool:
        edges = await live()
        assert len(edges) <= 4, edges  # a tree of 4, or one exchange's added link
        return edges == declared

    await until(restored, 30, "the declared shape back")
    await asyncio.sleep(1.5)  # more heals: nothing changes any more
    assert await live() == declared
    started = [e["message"] for e in events(cluster.emulator, "RestoreStarted")]
    assert any("bring back b" in m and "exchanges" in m for m in started), started
    assert events(cluster.emulator, "Restored")
    obj = await cluster.api.get(overlay_path(NS, "demo"))
    record = obj["status"]["restore"]  # type: ignore[index]
    assert record["count"] >= 1 and record["last"]["brokers"] == ["b"], record
    # The repair itself was told as Events: who declared b dead, and when the replay was out.
    lost = [e["message"] for e in events(cluster.emulator, "BrokerLost")]
    assert any("declared b dead" in m for m in lost), lost
    assert events(cluster.emulator, "RepairCompleted")
    await until(lambda: degraded_by("Recovered"), 10, "Degraded=False, Recovered")


async def test_a_template_change_is_rolled_out_one_broker_at_a_time_losing_nothing(
    cluster: Cluster,
) -> None:
    """A change of the brokers' resources changes their pod template: every broker is replaced
    in turn (out by exchanges, its clients migrated, a new pod, back as declared) while traffic
    flows; the subscribers, those on replaced brokers included, miss nothing. A pause
    annotation holds the roll-out until it is removed."""
    view = await four_brokers(cluster)
    run = Run()
    await run.subscriber(view, "s-c", "c", ['side = "buy"'])
    await run.subscriber(view, "s-b", "b", ["qty > 10"])
    await run.subscriber(view, "s-d", "d", ["qty > 10", 'side = "sell"'])
    run.settled(await converged(view, run))  # type: ignore[arg-type]
    await run.publisher(view, "p", "a", seed=3)  # type: ignore[arg-type]
    await until(lambda: len(run.pubs) > 100, 20, "some traffic")

    path = overlay_path(NS, "demo")
    await cluster.api.patch(path, {"metadata": {"annotations": {PAUSE_ROLLOUT: "true"}}})
    cpu = {"requests": {"cpu": "150m"}}
    await cluster.api.patch(path, {"spec": {"broker": {"resources": cpu}}})

    async def rollout(**want: Any) -> dict[str, Any] | None:
        obj = await cluster.overlay("demo")
        record = (obj.get("status") or {}).get("rollout") or {}
        return record if all(record.get(k) == v for k, v in want.items()) else None

    held = await until(lambda: rollout(paused=True), 20, "the roll-out held by the annotation")
    assert sorted(held["todo"]) == ["a", "b", "c", "d"]
    assert all(cluster.kubelet.started.count(f"demo-{b}") == 1 for b in "abcd")
    await cluster.api.patch(path, {"metadata": {"annotations": {PAUSE_ROLLOUT: None}}})

    async def finished() -> dict[str, Any] | None:
        record = await rollout(current=None, paused=False, count=1)
        return record if record and len(record["done"]) == 4 else None

    done = await until(finished, 90, "rolled out")
    assert done["done"] == done["todo"] and sorted(done["done"]) == ["a", "b", "c", "d"]
    assert done["progress"] == "4/4"
    shown = {
        (v.get("status") or {}).get("rollout", {}).get("progress")
        for v in history(cluster.emulator, "demo")
    }
    # What `kubectl get bo -o wide` showed, broker by broker (leaves first, by name).
    assert {"0/4 (a)", "1/4 (c)", "2/4 (d)", "3/4 (b)", "4/4"} <= shown, shown
    assert done["todo"][-1] == "b"  # the inner broker last: leaves need no exchange
    for b in "abcd":
        assert cluster.kubelet.started.count(f"demo-{b}") == 2, b  # a new pod each
    pods = {p["metadata"]["name"]: p for p in objects(cluster.emulator, "pods")}
    for b in "abcd":
        assert pods[f"demo-{b}"]["spec"]["containers"][0]["resources"] == cpu
    published = len(run.pubs)
    await until(lambda: len(run.pubs) > published + 100, 20, "traffic after the roll-out")
    await delivered_everything(run, 100)
    assert len(events(cluster.emulator, "BrokerReplaced")) == 4
    assert events(cluster.emulator, "RolloutPaused") and events(cluster.emulator, "RolloutFinished")
    obj = await cluster.ready("demo", generation=2)
    assert sorted(map(tuple, obj["status"]["links"])) == FOUR


async def test_a_broker_on_a_drained_node_is_moved_off_it_losing_nothing(
    cluster: Cluster,
) -> None:
    """The overlay's PodDisruptionBudget lets no broker be evicted; when a broker's node is
    cordoned (the first thing ``kubectl drain`` does), the operator moves the broker itself: out
    by exchanges with its clients migrated, a new pod (which the scheduler puts elsewhere),
    back as declared. Its subscriber and everybody else miss nothing; the drain can go on."""
    view = await four_brokers(cluster)
    (pdb,) = objects(cluster.emulator, "poddisruptionbudgets")
    assert pdb["spec"] == {
        "maxUnavailable": 0,
        "selector": {"matchLabels": {LABEL_OVERLAY: "demo"}},
    }
    run = Run()
    await run.subscriber(view, "s-b", "b", ["qty > 10"])
    await run.subscriber(view, "s-d", "d", ['side = "buy"'])
    run.settled(await converged(view, run))  # type: ignore[arg-type]
    await run.publisher(view, "p", "a", seed=5)  # type: ignore[arg-type]
    await until(lambda: len(run.pubs) > 100, 20, "some traffic")

    # The scheduler had put b on node-1; node-1 is cordoned for maintenance.
    await cluster.api.patch(
        f"/api/v1/namespaces/{NS}/pods/demo-b", {"spec": {"nodeName": "node-1"}}
    )
    await cluster.api.create("/api/v1/nodes", {"metadata": {"name": "node-2"}, "spec": {}})
    await cluster.api.create(
        "/api/v1/nodes", {"metadata": {"name": "node-1"}, "spec": {"unschedulable": True}}
    )
    await until(lambda: cluster.kubelet.started.count("demo-b") == 2, 60, "b in a new pod")
    moved = [e["message"] for e in events(cluster.emulator, "BrokerOnDrainedNode")]
    assert moved and "b runs on a node being drained" in moved[0], moved
    assert all(cluster.kubelet.started.count(f"demo-{x}") == 1 for x in "acd")
    await until(lambda: events(cluster.emulator, "RolloutFinished"), 30, "b back as declared")
    published = len(run.pubs)
    await until(lambda: len(run.pubs) > published + 100, 20, "traffic after the move")
    await delivered_everything(run, 100)
    obj = await cluster.overlay("demo")
    assert sorted(map(tuple, obj["status"]["links"])) == FOUR


async def test_two_operator_replicas_never_act_at_once(cluster: Cluster) -> None:
    """With leader election only the replica holding the Lease runs its handlers (the other's
    kopf has not even logged in); when the leader stops, the other takes the Lease over once it
    has not been renewed for a lease duration, and carries on with the next change."""
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/canopy-operator"

    def replica(identity: str) -> OperatorThread:
        config = make_config(cluster.emulator, cluster.kubelet)
        config.leader = LeaseConfig(NS, "canopy-operator", identity, duration=2.0)
        return OperatorThread(config)

    async def holder() -> str | None:
        lease = await cluster.api.get(lease_path)
        return ((lease or {}).get("spec") or {}).get("holderIdentity")

    first, second = replica("op-a").start(), replica("op-b")
    stopped: list[OperatorThread] = []
    try:
        await until(lambda: holder_is(holder, "op-a"), 20, "op-a leads")
        second.start()
        await cluster.apply(overlay_manifest("demo", ["a", "b", "c"], [("a", "b"), ("b", "c")]))
        await cluster.ready("demo")
        await asyncio.sleep(3.0)  # longer than a lease duration: op-a keeps renewing it
        assert await holder() == "op-a"
        assert second.config.api is None  # op-b's kopf never started: it acted on nothing
        await first.stop()
        stopped.append(first)
        await until(lambda: holder_is(holder, "op-b"), 20, "op-b takes over")
        lease = await cluster.api.get(lease_path)
        assert lease is not None and lease["spec"]["leaseTransitions"] == 1
        new = overlay_manifest("demo", ["a", "b", "c"], [("a", "b"), ("a", "c")])["spec"]
        await cluster.api.patch(overlay_path(NS, "demo"), {"spec": new})
        obj = await cluster.ready("demo", generation=2)
        assert sorted(map(tuple, obj["status"]["links"])) == [("a", "b"), ("a", "c")]
    finally:
        for op in (first, second):
            if op not in stopped and op._thread.is_alive():
                await op.stop()


async def holder_is(holder: Any, identity: str) -> bool:
    return bool(await holder() == identity)


async def test_deleting_the_overlay_stops_its_brokers(cluster: Cluster) -> None:
    cluster.start_operator()
    await cluster.apply(overlay_manifest("demo", ["a", "b"], [("a", "b")]))
    await cluster.ready("demo")
    assert len(cluster.kubelet.procs) == 2
    await cluster.api.delete(overlay_path(NS, "demo"))
    await until(lambda: not objects(cluster.emulator, "pods"), 20, "the pods deleted")
    await until(lambda: not cluster.kubelet.procs, 20, "the broker processes stopped")


async def test_an_invalid_update_leaves_the_running_overlay_as_it_was(cluster: Cluster) -> None:
    links = [("a", "b"), ("b", "c")]
    cluster.start_operator()
    await cluster.apply(overlay_manifest("demo", ["a", "b", "c"], links))
    await cluster.ready("demo")
    pids = {pod: proc.pid for pod, proc in cluster.kubelet.procs.items()}
    # A link to an undeclared broker and fan-out: invalid.
    bad = overlay_manifest("demo", ["a", "b", "c"], [("a", "b"), ("b", "x")])["spec"]
    await cluster.api.patch(overlay_path(NS, "demo"), {"spec": bad})

    async def invalid() -> dict[str, Any] | None:
        obj = await cluster.overlay("demo")
        return obj if condition(obj, "Valid").get("status") == "False" else None

    obj = await until(invalid, 20, "Valid=False")
    assert "x" in condition(obj, "Valid")["message"]
    assert obj["status"]["phase"] == "Invalid" and obj["status"]["observedGeneration"] == 2
    assert sorted(map(tuple, obj["status"]["links"])) == links  # what still runs
    assert {pod: proc.pid for pod, proc in cluster.kubelet.procs.items()} == pids
    for pod, proc in cluster.kubelet.procs.items():
        mine = pod.removeprefix("demo-")
        peers = sorted(n["peer"] for n in (await proc.admin.status())["neighbours"])
        assert peers == sorted(b for e in links for b in e if mine in e and b != mine)

    # Fixed again: the operator carries on from the live overlay.
    good = overlay_manifest("demo", ["a", "b", "c"], [("a", "b"), ("a", "c")])["spec"]
    await cluster.api.patch(overlay_path(NS, "demo"), {"spec": good})
    obj = await cluster.ready("demo", generation=3)
    assert sorted(map(tuple, obj["status"]["links"])) == [("a", "b"), ("a", "c")]
    assert condition(obj, "Valid")["status"] == "True"


async def test_an_unreachable_broker_sets_degraded_and_the_plan_waits(cluster: Cluster) -> None:
    links = [("a", "b"), ("b", "c")]
    cluster.start_operator()
    await cluster.apply(overlay_manifest("demo", ["a", "b", "c"], links))
    await cluster.ready("demo")
    await cluster.stop_operator()
    config = make_config(cluster.emulator, cluster.kubelet)
    config.ready_within, config.retry_delay = 1.0, 0.5
    cluster.operator = OperatorThread(config).start()

    cluster.kubelet.cut_off.add("demo-c")
    new = overlay_manifest("demo", ["a", "b", "c"], [("a", "b"), ("a", "c")])["spec"]
    await cluster.api.patch(overlay_path(NS, "demo"), {"spec": new})

    async def degraded() -> dict[str, Any] | None:
        obj = await cluster.overlay("demo")
        return obj if condition(obj, "Degraded").get("status") == "True" else None

    obj = await until(degraded, 20, "Degraded=True")
    assert condition(obj, "Degraded")["reason"] == "BrokersNotReady"
    assert "c" in condition(obj, "Degraded")["message"]
    assert obj["status"]["phase"] == "Degraded"
    assert condition(obj, "Ready")["status"] == "False"
    assert sorted(map(tuple, obj["status"]["links"])) == links  # nothing was changed

    cluster.kubelet.cut_off.clear()  # reachable again: the retried reconcile finishes the job
    obj = await cluster.ready("demo", generation=2)
    assert sorted(map(tuple, obj["status"]["links"])) == [("a", "b"), ("a", "c")]
    assert condition(obj, "Degraded")["status"] == "False"


async def test_a_deleted_broker_pod_is_recreated_and_relinked(cluster: Cluster) -> None:
    links = [("a", "b"), ("b", "c")]
    cluster.start_operator()
    await cluster.apply(overlay_manifest("demo", ["a", "b", "c"], links))
    await cluster.ready("demo")
    await cluster.api.delete(f"/api/v1/namespaces/{NS}/pods/demo-c")

    await until(lambda: events(cluster.emulator, "BrokerMissing"), 20, "the missing broker noticed")

    async def relinked() -> bool:
        proc = cluster.kubelet.procs.get("demo-c")
        if proc is None or cluster.kubelet.started.count("demo-c") < 2:
            return False
        peers = [n["peer"] for n in (await proc.admin.status())["neighbours"]]
        return peers == ["b"]

    await until(relinked, 20, "c's new pod re-linked to b")
    pod = next(p for p in objects(cluster.emulator, "pods") if p["metadata"]["name"] == "demo-c")
    assert pod["metadata"]["ownerReferences"][0]["name"] == "demo"


HUB = [("h", "a"), ("h", "b"), ("h", "c")]


async def test_brokers_learn_their_zone_from_their_node_and_keep_standby_links_across_zones(
    cluster: Cluster,
) -> None:
    """Broker pods spread over zones and nodes by default; once the scheduler has bound them,
    the operator annotates each pod with its node's zone, the kubelet's downward-API files carry
    it into the broker, and the brokers order their repair chains by it: the hub h (zone-1)
    announces c (zone-2) before a and b (its own zone), so a's standby links go to c and b
    where, by name, they would go to b only."""
    cluster.start_operator()
    await cluster.apply(overlay_manifest("demo", ["h", "a", "b", "c"], HUB))
    obj = await cluster.ready("demo")
    assert sorted(map(tuple, obj["status"]["links"])) == sorted(map(norm, HUB))
    pods = {
        p["metadata"]["labels"]["canopy.dev/broker"]: p for p in objects(cluster.emulator, "pods")
    }
    assert [c["topologyKey"] for c in pods["a"]["spec"]["topologySpreadConstraints"]] == [
        "topology.kubernetes.io/zone",
        "kubernetes.io/hostname",
    ]
    view = BrokerView(cluster.kubelet, "demo", HUB)

    async def standby(broker: str) -> set[str]:
        st = await view[broker].admin.status()
        return {s["peer"] for s in st["standby"] if s["state"] == "up"}

    await until(lambda: _equal(standby("a"), {"b"}), 20, "standby links by name")

    # The scheduler binds the pods; the nodes carry their zones.
    zone = {"h": "zone-1", "a": "zone-1", "b": "zone-1", "c": "zone-2"}
    for b, z in zone.items():
        await cluster.api.create(
            "/api/v1/nodes",
            {"metadata": {"name": f"node-{b}", "labels": {"topology.kubernetes.io/zone": z}}},
        )
        await cluster.api.patch(
            f"/api/v1/namespaces/{NS}/pods/demo-{b}", {"spec": {"nodeName": f"node-{b}"}}
        )

    async def placed() -> bool:
        for b, z in zone.items():
            if (await view[b].admin.status())["placement"]["zone"] != z:
                return False
        return True

    await until(placed, 30, "every broker told its zone")
    annotated = {
        p["metadata"]["labels"]["canopy.dev/broker"]: p["metadata"]["annotations"][
            "canopy.dev/zone"
        ]
        for p in objects(cluster.emulator, "pods")
    }
    assert annotated == zone
    assert events(cluster.emulator, "BrokersPlaced")
    await until(lambda: _equal(standby("a"), {"b", "c"}), 20, "standby links across zones")
    assert await standby("c") == {"a"}
    assert all(cluster.kubelet.started.count(f"demo-{b}") == 1 for b in zone)  # no restart


async def _equal(value: Awaitable[set[str]], want: set[str]) -> bool:
    return await value == want


async def test_the_operator_logs_in_like_kubectl_with_an_exec_plugin(
    cluster: Cluster, tmp_path: Path
) -> None:
    """No ``--server``: the official client's loaders read ``--kubeconfig``/``--context``, here a
    user whose token comes from an exec credential plugin (as on EKS, GKE, AKS). The plugin runs,
    and kopf's requests and the operator's own carry its token; the overlay becomes Ready."""
    config = kubeconfig(tmp_path, server_url(cluster.emulator))
    cluster.start_operator(server=None, kubeconfig=str(config), context="exec")
    await cluster.apply(overlay_manifest("kc", ["a", "b"], [("a", "b")]))
    await cluster.ready("kc")
    assert (tmp_path / "plugin-ran").exists()
    seen = {
        (r.headers.get("User-Agent", "").split("/")[0], r.headers.get("Authorization"))
        for r in cluster.emulator._requests
        if r.headers.get("User-Agent", "").startswith(("kopf", "canopy-operator"))
    }
    assert {agent for agent, _ in seen} == {"kopf", "canopy-operator"}
    assert {auth for _, auth in seen} == {"Bearer from-the-plugin"}
