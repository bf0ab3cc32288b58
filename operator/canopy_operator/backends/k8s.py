"""The Kubernetes face: kopf handlers for BrokerOverlay and a backend of Pods.

Per overlay the operator keeps a Secret (the brokers' admin token), a headless Service (broker
DNS), the overlay's credentials (unless ``spec.security.tls`` is false: a CA Secret, one TLS
Secret per broker, a client Secret for the overlay's default principal and the client policy
in a ConfigMap, see :meth:`Reconciler.ensure_security`) and one Pod per broker
(``<overlay>-<broker>``, not a StatefulSet: brokers are not interchangeable), all owned by the
overlay so deleting it removes them. A reconcile (create,
update, resume) validates the spec — an invalid spec gets ``Valid=False``, an Event and nothing
else — creates what is missing, asks the brokers which links are live, plans and runs the plan
with the shared :class:`~canopy_operator.executor.Executor`. Progress goes to ``status.plan``
after every step (each step carries ``done``), so a restarted operator resumes the same plan of
the same generation instead of repeating or skipping a step. A timer compares the live brokers
with the declared ones and re-links a broker that came back without its links.

The operator only ever writes ``status`` (merge patches on the status subresource); ``spec``
belongs to its owners (GitOps). Kubernetes is spoken to with a small aiohttp client (merge
patches only), so the same code runs against a cluster and against kmock's emulator.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import secrets
import ssl
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import kopf
import yaml
from prometheus_client import Counter, Gauge, Histogram

from canopy_broker.admin_client import AdminClient, AdminError
from canopy_broker.client.credentials import LOCAL_CLIENT
from canopy_broker.pki import Authority, permissive_policy
from canopy_broker.runtime.placement import ZONE_ANNOTATION, ZONE_LABEL
from canopy_broker.runtime.security import BROKER, CLIENT, Identity, Policy, SecurityError
from canopy_operator.backends.certs import (
    ISSUER_KINDS,
    SCRAPE_NAME,
    CertificatesPendingError,
    CertManager,
    IssuerRef,
    Issuing,
    OwnCa,
    b64,
    secret_bytes,
    verify_context,
)
from canopy_operator.backends.leader import Elector, LeaseConfig, run_as_leader
from canopy_operator.executor import Executor, ProgressStore, StepError, replace_broker
from canopy_operator.model import rollout
from canopy_operator.model.phases import ConditionType, OverlayPhase, ProposalPhase
from canopy_operator.model.planner import (
    Cause,
    LiveOverlay,
    Plan,
    Reconcile,
    decide,
    plan,
    plan_status,
    steps_from_json,
)
from canopy_operator.model.proposals import (
    BOOKKEEPING_PREFIX,
    TERMINAL_PHASES,
    Decision,
    apply_changes,
    from_manifest,
    lifecycle,
)
from canopy_operator.model.restore import (
    describe,
    mutual,
    repairs_under_way,
    reported_links,
    restore,
    status_neighbours,
)
from canopy_operator.model.topology import OverlaySpec, SpecError, norm, parse_overlay, validate

GROUP, VERSION, PLURAL, KIND = "canopy.dev", "v1alpha1", "brokeroverlays", "BrokerOverlay"
PROPOSALS = "topologyproposals"
BROKER_PORT, LINK_PORT, ADMIN_PORT, GATEWAY_PORT, MQTT_PORT = 7000, 7001, 8080, 8081, 8883
"""Clients; overlay links (brokers only: the NetworkPolicy admits the overlay's broker pods);
the admin API, /metrics and probes (the operator and the miner); the HTTP gateway and the MQTT
listener (clients; MQTT over TLS on its usual port)."""
LABEL_OVERLAY, LABEL_BROKER = "canopy.dev/overlay", "canopy.dev/broker"
TEMPLATE_HASH = "canopy.dev/template-hash"
"""Pod annotation: a hash of what the broker runs (image, arguments, resources, mounts). A pod
whose hash is not the one the spec gives now is replaced by the rolling replacement."""
PAUSE_ROLLOUT = "canopy.dev/pause-rollout"
"""BrokerOverlay annotation: "true" holds a rolling replacement after the broker it is on."""
TOKEN_DIR = "/var/run/canopy"  # where the broker image expects its token
TLS_DIR = "/etc/canopy/tls"  # the broker's TLS Secret (ca.crt, tls.crt, tls.key): --tls-dir
POLICY_DIR = "/etc/canopy/policy"  # the client policy ConfigMap (policy.yaml): --policy
POLICY_KEY = "policy.yaml"
PLACEMENT_DIR = "/etc/canopy/placement"  # downward API: the pod's labels and annotations
# ZONE_LABEL (on nodes, and on pods with Kubernetes 1.33+) and ZONE_ANNOTATION (the zone of the
# node a pod is bound to, set by the operator since a pod cannot read its node's labels) are the
# broker's own names for what it reads through the downward API (--placement-dir).
CLIENT_PRINCIPAL = LOCAL_CLIENT  # the principal of the overlay's client Secret (any client id)
DEFAULT_IMAGE = "canopy:0.1.0"  # the Dockerfile's image: broker, CLI and operator

log = logging.getLogger("canopy.operator")

RECONCILE_SECONDS = Histogram(
    "canopy_operator_reconcile_seconds", "Duration of BrokerOverlay reconciles", ["result"]
)
STEPS = Counter("canopy_operator_steps_total", "Plan steps carried out", ["kind", "result"])
PLAN_LENGTH = Gauge("canopy_operator_plan_steps", "Steps of the current plan", ["overlay"])


# -- a minimal Kubernetes REST client ---------------------------------------------------------


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class KubeApi:
    """Get/list/create/merge-patch/delete over HTTP; what the operator needs, nothing more."""

    def __init__(
        self,
        server: str,
        *,
        token: str | None = None,
        ca_path: str | None = None,
        insecure: bool = False,
        user_agent: str = "canopy-operator",
        cert_path: str | None = None,
        key_path: str | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        self._headers = {"User-Agent": user_agent}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._ssl: ssl.SSLContext | bool = True
        if ca_path or cert_path:
            ctx = ssl.create_default_context(cafile=ca_path)
            if insecure:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if cert_path:  # a kubeconfig user with a client certificate
                ctx.load_cert_chain(cert_path, key_path)
            self._ssl = ctx
        elif insecure:
            self._ssl = False
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_connection(cls, info: kopf.ConnectionInfo) -> KubeApi:
        ca = info.ca_path
        return cls(
            info.server,
            token=info.token,
            ca_path=os.fsdecode(ca) if ca else None,
            insecure=bool(info.insecure),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        headers = dict(self._headers)
        if method == "PATCH":
            headers["Content-Type"] = "application/merge-patch+json"
        async with self._session.request(
            method, self.server + path, json=body, headers=headers, ssl=self._ssl
        ) as resp:
            if resp.status >= 400:
                raise KubeError(resp.status, await resp.text())
            return await resp.json(content_type=None)

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = await self.request("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return result

    async def create(self, path: str, body: Mapping[str, Any]) -> bool:
        """True if created, False if it already existed."""
        return await self._unless_conflict("POST", path, body)

    async def patch(self, path: str, body: Mapping[str, Any]) -> None:
        await self.request("PATCH", path, body)

    async def update(self, path: str, body: Mapping[str, Any]) -> bool:
        """A merge patch that carries ``metadata.resourceVersion``, which the API server takes as
        a precondition: False (409) if the object changed since that version was read."""
        return await self._unless_conflict("PATCH", path, body)

    async def _unless_conflict(self, method: str, path: str, body: Mapping[str, Any]) -> bool:
        try:
            await self.request(method, path, body)
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def delete(self, path: str) -> None:
        try:
            await self.request("DELETE", path)
        except KubeError as exc:
            if exc.status != 404:
                raise

    async def items(self, path: str) -> list[dict[str, Any]]:
        data = await self.get(path) or {}
        items: list[dict[str, Any]] = data.get("items") or []
        return items


def overlay_path(namespace: str, name: str = "") -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    return f"{base}/{name}" if name else base


def core_path(namespace: str, plural: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{namespace}/{plural}"
    return f"{base}/{name}" if name else base


# -- the Kubernetes backend -------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoints:
    listen: str  # HOST:PORT clients dial
    admin: str  # HOST:PORT of the admin API
    link: str = ""  # HOST:PORT other brokers dial (default: listen, one shared port)


# (namespace, service, pod) -> where the broker of that pod is reached.
Resolver = Callable[[str, str, str], Endpoints]


def dns_resolver(namespace: str, service: str, pod: str) -> Endpoints:
    host = f"{pod}.{service}.{namespace}.svc"
    return Endpoints(f"{host}:{BROKER_PORT}", f"{host}:{ADMIN_PORT}", f"{host}:{LINK_PORT}")


def pod_name(overlay: str, broker: str) -> str:
    return f"{overlay}-{broker}"


def service_name(overlay: str) -> str:
    return f"{overlay}-brokers"


def secret_name(overlay: str) -> str:
    return f"{overlay}-admin"


def ca_secret_name(overlay: str) -> str:
    return f"{overlay}-ca"


def tls_secret_name(overlay: str, broker: str) -> str:
    return f"{overlay}-{broker}-tls"


def client_secret_name(overlay: str) -> str:
    return f"{overlay}-client"


def policy_name(overlay: str) -> str:
    return f"{overlay}-policy"


def default_policy(overlay: str) -> str:
    """The client policy of an overlay whose spec has none (docs/security.md)."""
    return permissive_policy(
        f"# Who may publish and subscribe what on overlay {overlay} (docs/security.md); set\n"
        f"# spec.security.policy to replace it. The client certificate in Secret "
        f"{client_secret_name(overlay)}\n"
        f"# is principal {CLIENT_PRINCIPAL}: any client id, anything.\n"
    )


@dataclass(frozen=True)
class Security:
    """``spec.security``: TLS on (the default) or off (``--insecure``), the client policy
    (the YAML text mounted as ``--policy``; only with TLS), and the cert-manager issuer of the
    certificates (None: the operator is the overlay's CA)."""

    tls: bool = True
    policy: str = ""
    issuer: IssuerRef | None = None


def issuer_of(raw: object) -> IssuerRef | None:
    """``spec.security.issuerRef`` (cert-manager's own shape), or None."""
    if raw is None:
        return None
    where = "spec.security.issuerRef"
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where} must be a mapping with name and kind")
    unknown = sorted(set(raw) - {"name", "kind", "group"})
    if unknown:
        raise SpecError(f"{where} has unknown keys {unknown}: name, kind and group")
    name, kind = raw.get("name"), raw.get("kind", "Issuer")
    group = raw.get("group", IssuerRef.group)
    if not isinstance(name, str) or not name:
        raise SpecError(f"{where}.name must name a cert-manager Issuer or ClusterIssuer")
    if kind not in ISSUER_KINDS:
        raise SpecError(f"{where}.kind must be Issuer or ClusterIssuer, got {kind!r}")
    if not isinstance(group, str) or not group:
        raise SpecError(f"{where}.group must be an API group, got {group!r}")
    return IssuerRef(name, kind, group)


def security_of(overlay: str, raw_spec: Mapping[str, Any]) -> Security:
    """Read ``spec.security``; raise :class:`SpecError` naming what is wrong (a policy that the
    brokers would refuse is refused here, before any broker runs with it)."""
    raw = raw_spec.get("security")
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise SpecError("spec.security must be a mapping")
    tls = raw.get("tls", True)
    if not isinstance(tls, bool):
        raise SpecError(f"spec.security.tls must be true or false, got {tls!r}")
    issuer = issuer_of(raw.get("issuerRef"))
    if issuer is not None and not tls:
        raise SpecError(
            "spec.security.issuerRef needs TLS: it issues certificates, and tls is false"
        )
    doc = raw.get("policy")
    if doc is None:
        return Security(tls, default_policy(overlay) if tls else "", issuer)
    try:
        Policy.from_dict(doc, source="spec.security.policy")
    except SecurityError as exc:
        raise SpecError(str(exc)) from None
    text = "# spec.security.policy of BrokerOverlay " + overlay + "\n"
    return Security(tls, text + yaml.safe_dump(doc, sort_keys=False) if tls else "", issuer)


def owner_reference(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta.get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned(
    api_version: str,
    kind: str,
    name: str,
    *,
    namespace: str,
    labels: Mapping[str, str],
    owner: Mapping[str, Any],
    **body: Any,
) -> dict[str, Any]:
    """An object of the overlay's: named, labelled, and owned by the BrokerOverlay, so that
    deleting the overlay deletes it (Kubernetes' garbage collector)."""
    meta = {"name": name, "namespace": namespace, "labels": dict(labels)}
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {**meta, "ownerReferences": [dict(owner)]},
        **body,
    }


def pod_manifest(
    spec: OverlaySpec,
    broker: str,
    namespace: str,
    owner: Mapping[str, Any],
    image: str,
    *,
    resources: Mapping[str, Any] | None = None,
    tls: bool = True,
    spread: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """One broker's Pod: stable name, labels (the broker's own too), owner reference, probes,
    anti-affinity, spread over zones and nodes (``spread``: the overlay's
    ``spec.broker.topologySpreadConstraints``; None: :func:`spread_constraints`' default),
    resources (the broker's, else the overlay's ``spec.broker.resources``), and its placement
    through the downward API (node in ``$CANOPY_NODE``, zone in ``--placement-dir``).
    ``tls``: the broker's TLS Secret at ``--tls-dir`` and the policy ConfigMap at ``--policy``
    (its admin API, probes included, speaks HTTPS); else ``--insecure``."""
    overlay = spec.name
    neighbours = sorted({b for e in spec.links or () for b in e if broker in e and b != broker})
    terms: list[dict[str, Any]] = []
    if neighbours:  # neighbours apart: a node failure takes out no link's both ends
        terms.append(
            {
                "weight": 100,
                "podAffinityTerm": {
                    "topologyKey": "kubernetes.io/hostname",
                    "labelSelector": {
                        "matchLabels": {LABEL_OVERLAY: overlay},
                        "matchExpressions": [
                            {"key": LABEL_BROKER, "operator": "In", "values": neighbours}
                        ],
                    },
                },
            }
        )
    terms.append(  # and the overlay spread in general
        {
            "weight": 10,
            "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {LABEL_OVERLAY: overlay}},
            },
        }
    )
    affinity: dict[str, Any] = {
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": terms}
    }
    zone = spec.zone_of().get(broker, "")
    if zone:
        affinity["nodeAffinity"] = {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 50,
                    "preference": {
                        "matchExpressions": [
                            {
                                "key": "topology.kubernetes.io/zone",
                                "operator": "In",
                                "values": [zone],
                            }
                        ]
                    },
                }
            ]
        }
    own = next((dict(b.labels) for b in spec.brokers if b.name == broker), {})
    labels = {
        **own,
        "app.kubernetes.io/name": "canopy-broker",
        "app.kubernetes.io/part-of": "canopy",
        "app.kubernetes.io/managed-by": "canopy-operator",
        LABEL_OVERLAY: overlay,
        LABEL_BROKER: broker,
    }
    scheme = "HTTPS" if tls else "HTTP"  # the kubelet does not verify a probe's certificate
    probe = {"periodSeconds": 5}
    mounts: list[dict[str, Any]] = [
        {"name": "admin-token", "mountPath": TOKEN_DIR},
        {"name": "placement", "mountPath": PLACEMENT_DIR, "readOnly": True},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "admin-token", "secret": {"secretName": secret_name(overlay)}},
        {
            "name": "placement",
            "downwardAPI": {
                "items": [
                    {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                    {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
                ]
            },
        },
    ]
    if tls:
        security = ["--tls-dir", TLS_DIR, "--policy", f"{POLICY_DIR}/{POLICY_KEY}"]
        mounts += [
            {"name": "tls", "mountPath": TLS_DIR, "readOnly": True},
            {"name": "policy", "mountPath": POLICY_DIR, "readOnly": True},
        ]
        volumes += [
            {"name": "tls", "secret": {"secretName": tls_secret_name(overlay, broker)}},
            {"name": "policy", "configMap": {"name": policy_name(overlay)}},
        ]
    else:
        security = ["--insecure"]
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(overlay, broker),
            "namespace": namespace,
            "labels": labels,
            "ownerReferences": [dict(owner)],
        },
        "spec": {
            "hostname": pod_name(overlay, broker),
            "subdomain": service_name(overlay),
            "affinity": affinity,
            "topologySpreadConstraints": spread_constraints(overlay, spread),
            "containers": [
                {
                    "name": "broker",
                    "image": image,
                    "command": ["canopy-broker"],
                    "args": [
                        "serve",
                        "--name",
                        broker,
                        "--listen",
                        f"0.0.0.0:{BROKER_PORT}",
                        "--link-listen",
                        f"0.0.0.0:{LINK_PORT}",
                        "--admin",
                        f"0.0.0.0:{ADMIN_PORT}",
                        "--advertise",
                        dns_resolver(
                            namespace, service_name(overlay), pod_name(overlay, broker)
                        ).link,
                        "--routing",
                        spec.routing,
                        "--token-file",
                        f"{TOKEN_DIR}/token",
                        "--placement-dir",
                        PLACEMENT_DIR,
                        *security,
                        *spec.broker_args(),
                        *(("--gateway", f"0.0.0.0:{GATEWAY_PORT}") if spec.gateway else ()),
                        *(("--mqtt", f"0.0.0.0:{MQTT_PORT}") if spec.mqtt else ()),
                    ],
                    "env": [
                        {
                            "name": "CANOPY_NODE",
                            "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                        }
                    ],
                    "ports": [
                        {"name": "clients", "containerPort": BROKER_PORT},
                        {"name": "link", "containerPort": LINK_PORT},
                        {"name": "admin", "containerPort": ADMIN_PORT},
                        *(
                            [{"name": "gateway", "containerPort": GATEWAY_PORT}]
                            if spec.gateway
                            else []
                        ),
                        *([{"name": "mqtt", "containerPort": MQTT_PORT}] if spec.mqtt else []),
                    ],
                    "readinessProbe": {
                        **probe,
                        "httpGet": {"path": "/readyz", "port": "admin", "scheme": scheme},
                    },
                    "livenessProbe": {
                        **probe,
                        "httpGet": {"path": "/healthz", "port": "admin", "scheme": scheme},
                        "failureThreshold": 6,
                    },
                    "volumeMounts": mounts,
                    "resources": dict(resources or {}),
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
            "volumes": volumes,
        },
    }
    pod["metadata"]["annotations"] = {TEMPLATE_HASH: template_hash(pod)}
    return pod


def spread_constraints(
    overlay: str, given: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """The broker pods' topologySpreadConstraints: ``given`` (``[]``: none), else one broker
    per zone and per node at a time where the cluster allows (maxSkew 1, ScheduleAnyway: a
    small cluster still schedules every broker). A constraint without a labelSelector
    counts the overlay's broker pods (without one it would count none)."""
    if given is None:
        given = [
            {"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway"}
            for key in (ZONE_LABEL, "kubernetes.io/hostname")
        ]
    selector = {"matchLabels": {LABEL_OVERLAY: overlay}}
    return [{**c, "labelSelector": c.get("labelSelector") or selector} for c in given]


def template_hash(pod: Mapping[str, Any]) -> str:
    """What a broker pod runs, hashed: containers, volumes, security context and the spread
    the spec asks for — not its affinity (it follows the declared links, and a reshape must
    not replace brokers)."""
    spec = pod.get("spec") or {}
    what = {
        k: spec.get(k)
        for k in ("containers", "volumes", "securityContext", "topologySpreadConstraints")
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def pod_ready(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


class KubernetesBackend:
    """Implements :class:`canopy_operator.executor.Backend` with one Pod per broker."""

    def __init__(
        self,
        api: KubeApi,
        spec: OverlaySpec,
        namespace: str,
        owner: Mapping[str, Any],
        token: str,
        *,
        image: str = DEFAULT_IMAGE,
        resolver: Resolver = dns_resolver,
        poll: float = 0.2,
        resources: Mapping[str, Mapping[str, Any]] | None = None,
        issuing: Issuing | None = None,
        spread: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """``issuing``: where the brokers' certificates come from (the operator's CA or
        cert-manager); its CA verifies the brokers' admin APIs (HTTPS). None: the overlay runs
        ``--insecure``. ``spread``: the pods' topologySpreadConstraints (None: the default, see
        :func:`pod_manifest`)."""
        self.resources = dict(resources or {})
        self.spread = spread
        self.api, self.spec, self.namespace, self.owner = api, spec, namespace, owner
        self.token, self.image, self.resolver, self.poll = token, image, resolver, poll
        self.issuing = issuing
        self.tls = verify_context(issuing.ca_pem) if issuing is not None else None
        self._admins: dict[str, AdminClient] = {}

    def _pod_path(self, broker: str) -> str:
        return core_path(self.namespace, "pods", pod_name(self.spec.name, broker))

    def endpoints(self, broker: str) -> Endpoints:
        return self.resolver(
            self.namespace, service_name(self.spec.name), pod_name(self.spec.name, broker)
        )

    async def ensure_broker_secret(self, name: str) -> str:
        """The broker's TLS Secret (``canopy://broker/NAME``, for its DNS names too, and the
        name scrapers verify); returns why it was made anew, as :meth:`Issuing.ensure` does."""
        if self.issuing is None:
            return ""
        overlay, pod = self.spec.name, pod_name(self.spec.name, name)
        host = dns_resolver(self.namespace, service_name(overlay), pod).listen.rpartition(":")[0]
        hosts = (
            host,
            f"{host}.cluster.local",
            f"{pod}.{service_name(overlay)}",
            SCRAPE_NAME,
            "localhost",
        )
        labels = {LABEL_OVERLAY: overlay, LABEL_BROKER: name, "app.kubernetes.io/part-of": "canopy"}
        return await self.issuing.ensure(
            tls_secret_name(overlay, name), Identity(BROKER, name), hosts, labels
        )

    def pod(self, name: str) -> dict[str, Any]:
        """The pod broker ``name`` should run in now."""
        return pod_manifest(
            self.spec,
            name,
            self.namespace,
            self.owner,
            self.image,
            resources=self.resources.get(name),
            tls=self.issuing is not None,
            spread=self.spread,
        )

    async def create_broker(self, name: str) -> None:
        await self.ensure_broker_secret(name)  # before its pod: the pod mounts it
        await self.api.create(core_path(self.namespace, "pods"), self.pod(name))

    async def stale(self) -> tuple[list[str], list[str]]:
        """Brokers to replace: (those whose pod runs another template than the spec gives now,
        those on a node being drained — cordoned, ``spec.unschedulable``)."""
        pods = {b: p for b, p in (await self.pods()).items() if b in self.spec.broker_names}
        old = sorted(
            b
            for b, pod in pods.items()
            if ((pod.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_HASH)
            != template_hash(self.pod(b))
        )
        cordoned = await self.cordoned_nodes()
        draining = sorted(
            b for b, pod in pods.items() if (pod.get("spec") or {}).get("nodeName") in cordoned
        )
        return old, draining

    async def _nodes(self, query: str, why: str) -> list[dict[str, Any]]:
        """Nodes (cluster-scoped); none without the right to list them (a namespaced install),
        saying what then does not happen (``why``)."""
        try:
            return await self.api.items(f"/api/v1/nodes{query}")
        except KubeError as exc:
            if exc.status != 403:
                raise
            log.warning("cannot list nodes (403): %s", why)
            return []

    async def cordoned_nodes(self) -> set[str]:
        """Nodes marked unschedulable (``kubectl cordon``/``drain``, node upgrades). Without
        the right to list nodes (a namespaced install), none: drains then wait for an admin."""
        nodes = await self._nodes(
            "?fieldSelector=spec.unschedulable%3Dtrue", "brokers on drained nodes are not moved"
        )
        return {
            str((n.get("metadata") or {}).get("name"))
            for n in nodes
            if (n.get("spec") or {}).get("unschedulable")
        }

    async def annotate_zones(self) -> dict[str, str]:
        """Give each bound broker pod that lacks it the zone of its node (annotation
        ``canopy.dev/zone``), which its broker reads through the downward API and uses to
        order its repair chain and report in telemetry. Returns what was annotated."""
        todo = {
            b: str(spec["nodeName"])
            for b, pod in (await self.pods()).items()
            if (spec := pod.get("spec") or {}).get("nodeName")
            and ZONE_ANNOTATION not in ((pod.get("metadata") or {}).get("annotations") or {})
        }
        if not todo:
            return {}
        zones = {
            str((n.get("metadata") or {}).get("name")): str(labels[ZONE_LABEL])
            for n in await self._nodes("", "brokers are not told their zone")
            if ZONE_LABEL in (labels := (n.get("metadata") or {}).get("labels") or {})
        }
        done: dict[str, str] = {}
        for broker, node in sorted(todo.items()):
            if node in zones:
                await self.api.patch(
                    self._pod_path(broker),
                    {"metadata": {"annotations": {ZONE_ANNOTATION: zones[node]}}},
                )
                done[broker] = zones[node]
        return done

    async def _forget_admin(self, name: str) -> None:
        client = self._admins.pop(name, None)
        if client is not None:
            await client.close()

    async def delete_broker(self, name: str, within: float = 120.0) -> None:
        """Delete the broker's pod and wait until it is gone (its grace period over), so that a
        replacement of the same name can be created right after."""
        await self._forget_admin(name)
        await self.api.delete(self._pod_path(name))
        deadline = time.monotonic() + within
        while await self.api.get(self._pod_path(name)) is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the pod of broker {name} still exists after {within}s")
            await asyncio.sleep(self.poll)
        if self.issuing is not None:  # a removed broker's certificate goes with it
            await self.issuing.remove(tls_secret_name(self.spec.name, name))

    async def wait_ready(self, name: str, within: float) -> None:
        """The pod's Ready condition (the kubelet's readiness probe), then the admin API.

        A broker that does not answer has its admin client dropped, so the next poll resolves
        its address afresh: a restarted broker may listen somewhere else, and a client kept
        from before would knock on the old address until the deadline."""
        deadline = time.monotonic() + within
        while True:
            pod = await self.api.get(self._pod_path(name))
            if pod is not None and pod_ready(pod):
                if await self.admin(name).readyz():
                    return
                await self._forget_admin(name)
            if time.monotonic() > deadline:
                raise TimeoutError(f"broker {name} not ready after {within}s")
            await asyncio.sleep(self.poll)

    def address(self, name: str) -> str:
        return self.endpoints(name).listen

    def link_address(self, name: str) -> str:
        e = self.endpoints(name)
        return e.link or e.listen

    def admin(self, name: str) -> AdminClient:
        client = self._admins.get(name)
        if client is None:
            client = self._admins[name] = AdminClient(
                self.endpoints(name).admin, self.token, tls=self.tls
            )
        return client

    async def pods(self) -> dict[str, dict[str, Any]]:
        """This overlay's broker pods by broker name (label-filtered here as well)."""
        out: dict[str, dict[str, Any]] = {}
        for pod in await self.api.items(core_path(self.namespace, "pods")):
            labels = (pod.get("metadata") or {}).get("labels") or {}
            if labels.get(LABEL_OVERLAY) == self.spec.name and LABEL_BROKER in labels:
                out[str(labels[LABEL_BROKER])] = pod
        return out

    async def statuses(self, brokers: Sequence[str]) -> dict[str, dict[str, Any]]:
        found = await asyncio.gather(*(self.admin(b).status() for b in brokers))
        return dict(zip(brokers, found, strict=True))

    async def neighbours(self, brokers: Sequence[str]) -> dict[str, set[str]]:
        return status_neighbours(await self.statuses(brokers))

    async def close(self) -> None:
        for client in self._admins.values():
            await client.close()
        self._admins.clear()


async def closed(backend: KubernetesBackend) -> None:
    """Close the backend's admin clients even if the caller is being cancelled (kopf cancels a
    handler at exit, and may cancel it again): an interrupted close leaves HTTP sessions open.
    The cancellation is passed on once the close is done."""
    closing = asyncio.ensure_future(backend.close())
    cancelled = False
    while not closing.done():
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def live_tree(neighbours: Mapping[str, set[str]], declared: Sequence[str]) -> LiveOverlay:
    """The live overlay: the largest linked component (or the first declared broker)."""
    links = sorted({norm((a, b)) for a, ns in neighbours.items() for b in ns if b in neighbours})
    adj: dict[str, set[str]] = {}
    for a, b in links:
        adj.setdefault(a, set()).add(b)
        adj.setdefault(b, set()).add(a)
    best: set[str] = set()
    seen: set[str] = set()
    for start in sorted(adj):
        if start in seen:
            continue
        comp, todo = set(), [start]
        while todo:
            x = todo.pop()
            if x not in comp:
                comp.add(x)
                todo.extend(adj[x] - comp)
        seen |= comp
        if len(comp) > len(best):
            best = comp
    if not best:
        first = next((b for b in declared if b in neighbours), None)
        first = first or next(iter(sorted(neighbours)), None)
        return LiveOverlay((first,) if first else (), ())
    return LiveOverlay(
        tuple(sorted(best)), tuple(e for e in links if e[0] in best and e[1] in best)
    )


# -- status helpers -----------------------------------------------------------------------------


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[dict[str, Any]], ctype: str, status: bool, reason: str, message: str = ""
) -> list[dict[str, Any]]:
    value = "True" if status else "False"
    out = [dict(c) for c in conditions if c.get("type") != ctype]
    old = next((c for c in conditions if c.get("type") == ctype), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == value else None
    out.append(
        {
            "type": ctype,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since or now(),
        }
    )
    order = list(ConditionType)
    out.sort(key=lambda c: order.index(c["type"]) if c["type"] in order else 99)
    return out


def post_event(obj: Mapping[str, Any], reason: str, message: str, warning: bool = False) -> None:
    """An Event about ``obj``; kopf posts Events from a queue of its own (best effort), and a
    plain dict body is all it reads."""
    kind = "Warning" if warning else "Normal"
    kopf.event(cast(kopf.Body, obj), type=kind, reason=reason, message=message)
    # The same in the operator's log: with --log-format json it carries the overlay, and the
    # step and reconfiguration ids when a plan's step posts it (canopy_broker.logs).
    meta = obj.get("metadata") or {}
    log.log(
        logging.WARNING if warning else logging.INFO,
        "%s/%s %s: %s",
        meta.get("namespace", ""),
        meta.get("name", ""),
        reason,
        message,
        extra={"event": reason, "overlay": meta.get("name", "")},
    )


def link_network_policy(
    overlay: str, namespace: str, labels: Mapping[str, str], owner: Mapping[str, Any]
) -> dict[str, Any]:
    """The overlay's own NetworkPolicy: its link port admits its own broker pods, nobody else
    (not even another overlay's brokers in the namespace). A chart can't say "the same overlay
    as the target pod", so the operator writes one per overlay; the chart's namespace-wide
    policy, which isolates the pods, admits their admin and client ports. NetworkPolicies add
    up, so together they leave exactly these three ways in."""
    own = {"matchLabels": {LABEL_OVERLAY: overlay}}
    ingress = {"ports": [{"port": LINK_PORT, "protocol": "TCP"}], "from": [{"podSelector": own}]}
    return owned(
        "networking.k8s.io/v1",
        "NetworkPolicy",
        f"{overlay}-links",
        namespace=namespace,
        labels=labels,
        owner=owner,
        spec={"podSelector": own, "policyTypes": ["Ingress"], "ingress": [ingress]},
    )


# -- the operator -----------------------------------------------------------------------------


@dataclass
class OperatorConfig:
    """How the operator reaches Kubernetes and the brokers; tests inject a resolver."""

    server: str | None = None  # None: the in-cluster service account (or kubeconfig)
    token: str | None = None
    insecure: bool = False
    image: str = field(default_factory=lambda: os.environ.get("CANOPY_BROKER_IMAGE", DEFAULT_IMAGE))
    resolver: Resolver = dns_resolver
    ready_within: float = 120.0
    poll: float = 0.2
    heal_interval: float = 30.0
    renew_interval: float = 3600.0  # how often the heal looks at the brokers' certificates
    certificate_wait: float = 60.0  # for cert-manager to issue a Secret, before a retry
    retry_delay: float = 10.0  # before a reconcile that failed (brokers not ready, a step) again
    api: KubeApi | None = None
    stopping: bool = False
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    leader: LeaseConfig | None = None  # leader election (several replicas): the Lease to hold
    # Crash repairs the brokers did on their own, already told as Events (per overlay).
    reported: dict[tuple[str, str], set[tuple[str, ...]]] = field(default_factory=dict)
    renewal_checked: dict[tuple[str, str], float] = field(default_factory=dict)  # monotonic
    # Namespaces where the chart's NetworkPolicy isolates broker pods (admin and client ports):
    # there each overlay gets its own policy admitting its link port from its own brokers only.
    network_policy_namespaces: frozenset[str] = frozenset()

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())


@dataclass(frozen=True)
class Access:
    """How the operator reaches an overlay's brokers: the admin token and, with TLS, where
    their certificates come from (its CA verifies their admin APIs)."""

    token: str
    issuing: Issuing | None = None


class Reconciler:
    """One reconcile of one overlay; writes only its status."""

    def __init__(self, config: OperatorConfig, api: KubeApi, namespace: str, name: str) -> None:
        self.config, self.api, self.namespace, self.name = config, api, namespace, name
        self.obj: dict[str, Any] = {}
        self.conditions: list[dict[str, Any]] = []

    @property
    def path(self) -> str:
        return overlay_path(self.namespace, self.name)

    async def load(self) -> bool:
        obj = await self.api.get(self.path)
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            return False
        self.obj = obj
        self.conditions = list((obj.get("status") or {}).get("conditions") or [])
        return True

    async def status(self, **fields: Any) -> None:
        fields["conditions"] = self.conditions
        await self.api.patch(self.path + "/status", {"status": fields})

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        post_event(self.obj, reason, message, warning)

    @property
    def labels(self) -> dict[str, str]:
        """What the overlay's own objects (not its pods) are labelled with."""
        return {LABEL_OVERLAY: self.name, "app.kubernetes.io/part-of": "canopy"}

    def owned(self, api_version: str, kind: str, name: str, **body: Any) -> dict[str, Any]:
        """An object of this overlay's, in its namespace, with its labels and owned by it."""
        return owned(
            api_version,
            kind,
            name,
            namespace=self.namespace,
            labels=self.labels,
            owner=owner_reference(self.obj),
            **body,
        )

    def condition(self, ctype: str, status: bool, reason: str, message: str = "") -> None:
        self.conditions = set_condition(self.conditions, ctype, status, reason, message)

    def generation(self) -> int:
        return int(self.obj["metadata"].get("generation") or 1)

    def parse(self) -> tuple[OverlaySpec | None, list[str]]:
        manifest = {**self.obj, "kind": self.obj.get("kind") or KIND}
        try:
            spec = parse_overlay(manifest)
            self.security(spec)
        except SpecError as exc:
            return None, [str(exc)]
        return spec, validate(spec)

    async def ensure_security(self, spec: OverlaySpec, security: Security) -> Issuing | None:
        """The overlay's credentials, unless ``spec.security.tls`` is false (None then):

        * ``<overlay>-ca``: the CA (``ca.crt``, ``ca.key``), created once and kept; or, with
          ``spec.security.issuerRef``, cert-manager issues every certificate below instead
          (a ``Certificate`` each, see :mod:`~canopy_operator.backends.certs`);
        * ``<overlay>-client``: a ``kubernetes.io/tls`` Secret for principal ``canopy``
          (``ca.crt``, ``tls.crt``, ``tls.key``): what users and tools connect with;
        * ``<overlay>-policy``: a ConfigMap with the client policy (``spec.security.policy``
          or :func:`default_policy`), mounted by every broker and kept up to date;
        * each broker's own TLS Secret is made with its pod
          (:meth:`KubernetesBackend.create_broker`).
        """
        if not security.tls:
            return None
        owner = owner_reference(self.obj)
        issuing: Issuing
        if security.issuer is not None:
            issuing = CertManager(
                self.api,
                self.namespace,
                owner,
                security.issuer,
                within=self.config.certificate_wait,
                poll=self.config.poll,
            )
        else:
            issuing = OwnCa(self.api, self.namespace, owner, await self._own_ca(spec))
        client = client_secret_name(spec.name)
        done = await issuing.ensure(client, Identity(CLIENT, CLIENT_PRINCIPAL), (), self.labels)
        if done:
            self.event("CertificateRenewed", f"client Secret {client} {done}")
        cm_path = core_path(self.namespace, "configmaps", policy_name(spec.name))
        cm = await self.api.get(cm_path)
        if cm is None:
            await self.api.create(
                core_path(self.namespace, "configmaps"),
                self.owned(
                    "v1",
                    "ConfigMap",
                    policy_name(spec.name),
                    data={POLICY_KEY: security.policy},
                ),
            )
        elif (cm.get("data") or {}).get(POLICY_KEY) != security.policy:
            # The brokers re-read the mounted file when the kubelet refreshes it.
            await self.api.patch(cm_path, {"data": {POLICY_KEY: security.policy}})
        return issuing

    async def _own_ca(self, spec: OverlaySpec) -> Authority:
        """The overlay's CA from Secret ``<overlay>-ca``, made on first use and then kept."""
        ca_path = core_path(self.namespace, "secrets", ca_secret_name(spec.name))
        ca = await self.api.get(ca_path)
        if ca is None:
            made = Authority.create(f"canopy overlay {self.namespace}/{spec.name} CA")
            await self.api.create(
                core_path(self.namespace, "secrets"),
                self.owned(
                    "v1",
                    "Secret",
                    ca_secret_name(spec.name),
                    type="Opaque",
                    data={"ca.crt": b64(made.cert_pem), "ca.key": b64(made.key_pem)},
                ),
            )
            ca = await self.api.get(ca_path)  # whoever created it first: theirs is the CA
        return Authority.from_pem(secret_bytes(ca, "ca.crt"), secret_bytes(ca, "ca.key"))

    async def ensure_objects(self, spec: OverlaySpec) -> Access:
        """Secret (admin token), headless Service and the overlay's credentials; returns what
        the backend reaches the brokers with."""
        sname = secret_name(spec.name)
        secret = await self.api.get(core_path(self.namespace, "secrets", sname))
        if secret is None:
            token = secrets.token_urlsafe(24)
            await self.api.create(
                core_path(self.namespace, "secrets"),
                self.owned(
                    "v1",
                    "Secret",
                    sname,
                    type="Opaque",
                    data={"token": b64(token.encode())},
                ),
            )
            secret = await self.api.get(core_path(self.namespace, "secrets", sname))
        assert secret is not None
        token = base64.b64decode(secret["data"]["token"]).decode()
        await self.api.create(
            core_path(self.namespace, "services"),
            self.owned(
                "v1",
                "Service",
                service_name(spec.name),
                spec={
                    "clusterIP": "None",
                    "publishNotReadyAddresses": True,  # brokers link before they are Ready
                    "selector": {LABEL_OVERLAY: spec.name},
                    "ports": [
                        {"name": "clients", "port": BROKER_PORT},
                        {"name": "link", "port": LINK_PORT},
                        {"name": "admin", "port": ADMIN_PORT},
                        # Headless: DNS names the pods; the port only documents (and gives an
                        # SRV record to) the gateway of brokers that serve one.
                        {"name": "gateway", "port": GATEWAY_PORT},
                        {"name": "mqtt", "port": MQTT_PORT},
                    ],
                },
            ),
        )
        # Voluntary disruptions (kubectl drain, node upgrades, the cluster autoscaler) may evict
        # no broker: the operator moves a broker off a cordoned node itself, loss-free (see
        # roll_stale), after which the drain goes on.
        await self.api.create(
            f"/apis/policy/v1/namespaces/{self.namespace}/poddisruptionbudgets",
            self.owned(
                "policy/v1",
                "PodDisruptionBudget",
                f"{spec.name}-brokers",
                spec={"maxUnavailable": 0, "selector": {"matchLabels": {LABEL_OVERLAY: spec.name}}},
            ),
        )
        if self.namespace in self.config.network_policy_namespaces:
            await self.api.create(
                f"/apis/networking.k8s.io/v1/namespaces/{self.namespace}/networkpolicies",
                link_network_policy(
                    spec.name, self.namespace, self.labels, owner_reference(self.obj)
                ),
            )
        issuing = await self.ensure_security(spec, self.security(spec))
        return Access(token, issuing)

    def security(self, spec: OverlaySpec) -> Security:
        return security_of(spec.name, self.obj.get("spec") or {})

    def backend(self, spec: OverlaySpec, access: Access) -> KubernetesBackend:
        raw = self.obj.get("spec") or {}
        image = str((raw.get("broker") or {}).get("image") or "")
        shared = (raw.get("broker") or {}).get("resources") or {}
        spread = (raw.get("broker") or {}).get("topologySpreadConstraints")
        resources = {
            str(b.get("name")): b.get("resources") or shared
            for b in raw.get("brokers") or []
            if isinstance(b, Mapping)
        }
        return KubernetesBackend(
            self.api,
            spec,
            self.namespace,
            owner_reference(self.obj),
            access.token,
            image=image or self.config.image,
            resolver=self.config.resolver,
            poll=self.config.poll,
            resources=resources,
            issuing=access.issuing,
            spread=spread if isinstance(spread, list) else None,
        )

    async def run(self) -> None:
        if not await self.load():
            return
        generation = self.generation()
        spec, problems = self.parse()
        decision = decide(
            problems or ([] if spec is not None else ["the spec could not be read"]),
            generation,
            self.obj.get("status") or {},
        )
        if decision.cause is Cause.INVALID or spec is None:
            message = "; ".join(decision.problems)
            self.condition(ConditionType.VALID, False, "InvalidSpec", message)
            await self.status(observedGeneration=generation, phase=OverlayPhase.INVALID)
            self.event("InvalidSpec", message, warning=True)
            return
        self.condition(ConditionType.VALID, True, "SpecValid", "the spec describes a valid tree")
        try:
            access = await self.ensure_objects(spec)
        except CertificatesPendingError as exc:  # cert-manager: not issued yet, or unusable
            self.condition(ConditionType.READY, False, "CertificatesPending", str(exc))
            await self.status(observedGeneration=generation)
            self.event("CertificatesPending", str(exc), warning=True)
            raise kopf.TemporaryError(str(exc), delay=self.config.retry_delay) from exc
        backend = self.backend(spec, access)
        try:
            await self._converge(spec, backend, generation, decision)
        finally:
            await closed(backend)

    async def _converge(
        self,
        spec: OverlaySpec,
        backend: KubernetesBackend,
        generation: int,
        decision: Reconcile,
    ) -> None:
        declared = spec.broker_names
        saved = (self.obj.get("status") or {}).get("plan") or {}
        resuming = decision.cause is Cause.RESUME
        if decision.creating:
            await self.status(phase=OverlayPhase.CREATING, observedGeneration=generation)
        pods = await backend.pods()
        # Pods for every declared broker up front (they start in parallel); the plan links them.
        await asyncio.gather(*(backend.create_broker(b) for b in declared if b not in pods))
        running = sorted(set(declared) | set(pods))
        try:
            await asyncio.gather(
                *(backend.wait_ready(b, self.config.ready_within) for b in running)
            )
        except TimeoutError as exc:
            self.condition(ConditionType.DEGRADED, True, "BrokersNotReady", str(exc))
            self.condition(ConditionType.READY, False, "BrokersNotReady", str(exc))
            await self.status(phase=OverlayPhase.DEGRADED)
            raise kopf.TemporaryError(str(exc), delay=self.config.retry_delay) from exc
        neighbours = await backend.neighbours(running)
        live = live_tree(neighbours, declared)
        if resuming:
            steps = decision.steps
            the_plan = Plan(steps, ())
            completed = list(decision.completed)
            self.event(
                "PlanResumed",
                f"resuming generation {generation}: {len(completed)}/{len(steps)} steps were done",
            )
        else:
            the_plan = plan(live, spec)
            completed = []
        total = len(the_plan.steps)
        PLAN_LENGTH.labels(self.name).set(total)
        if total:
            if not resuming:
                self.event(
                    "PlanCreated",
                    f"generation {generation}: {total} steps ({len(the_plan.exchanges)} exchanges)",
                )
            self.condition(ConditionType.RECONFIGURING, True, "PlanRunning", f"{total} steps")
            await self.status(
                phase=OverlayPhase.RECONFIGURING,
                plan=self._plan_status(generation, the_plan, completed),
            )
        started = time.perf_counter()
        executor = Executor(
            backend,
            _StatusStore(self, the_plan),
            spec.name,
            ordering=spec.ordering,
            lease=spec.lease_seconds,
            on_event=self._on_step_event,
            on_degraded=self._on_degraded,
        )
        try:
            await executor.run(
                the_plan, generation, {"generation": generation, "completed": completed}
            )
        except StepError as exc:
            STEPS.labels(exc.step.kind, "failed").inc()
            self.condition(ConditionType.DEGRADED, True, "StepFailed", str(exc))
            self.condition(ConditionType.READY, False, "StepFailed", str(exc))
            await self.status(phase=OverlayPhase.DEGRADED)
            self.event("StepFailed", str(exc), warning=True)
            raise kopf.TemporaryError(str(exc), delay=self.config.retry_delay) from exc
        # Brokers that are neither declared nor part of the live tree (left-overs) go.
        for b in sorted(set(pods) - set(declared)):
            await backend.delete_broker(b)
        live_now = await backend.neighbours(declared)
        links = sorted(reported_links(live_now))
        ready = sum(1 for b in declared if b in live_now)
        self.condition(
            ConditionType.READY, True, "Converged", f"{ready} brokers, {len(links)} links"
        )
        self.condition(ConditionType.RECONFIGURING, False, "Idle")
        self.condition(ConditionType.DEGRADED, False, "AllBrokersReachable")
        fields: dict[str, Any] = {
            "phase": OverlayPhase.READY,
            "observedGeneration": generation,
            "brokersReady": f"{ready}/{len(declared)}",
            "linkCount": len(links),
            "links": [list(e) for e in links],
        }
        if total:
            fields["plan"] = self._plan_status(generation, the_plan, list(range(total)))
            fields["lastReconfiguration"] = {
                "generation": generation,
                "steps": total,
                "exchanges": len(the_plan.exchanges),
                "seconds": round(time.perf_counter() - started, 3),
                "finished": now(),
            }
            self.event("PlanFinished", f"generation {generation}: {total} steps done")
        elif saved.get("generation") != generation:
            fields["plan"] = {"generation": generation, "steps": [], "done": 0, "progress": "0/0"}
        await self.status(**fields)
        # Brokers still running an older template (image, arguments, resources): replaced one
        # at a time, now that the shape is the declared one.
        await roll_stale(self, backend, spec)

    def _plan_status(
        self, generation: int, the_plan: Plan, completed: Sequence[int]
    ) -> dict[str, Any]:
        return plan_status(generation, the_plan, completed)

    def executor(
        self, backend: KubernetesBackend, spec: OverlaySpec, store: ProgressStore, label: str
    ) -> Executor:
        """An executor for a plan of the overlay's own (a restore, a roll-out): its steps told
        as Events, its exchange ids in their own space (``label``)."""
        return Executor(
            backend,
            store,
            spec.name,
            ordering=spec.ordering,
            lease=spec.lease_seconds,
            on_event=self._on_step_event,
            label=label,
        )

    def _on_step_event(self, reason: str, message: str) -> None:
        if reason == "StepDone":  # "step 3: exchange a-b for ..." / "add leaf ..." / ...
            word = message.split(":", 1)[-1].split(maxsplit=1)[0]
            kind = {"add": "add-leaf", "remove": "remove-leaf"}.get(word, word)
            STEPS.labels(kind, "done").inc()
        self.event(reason, message)

    async def _on_degraded(self, reason: str | None) -> None:
        if reason is None:
            self.condition(ConditionType.DEGRADED, False, "AllBrokersReachable")
        else:
            self.condition(ConditionType.DEGRADED, True, "BrokerUnreachable", reason)
            self.event("BrokerUnreachable", reason, warning=True)
        await self.status()


class _StatusStore:
    """The executor's progress, as ``status.plan`` (a merge patch on the status subresource)."""

    def __init__(self, reconciler: Reconciler, the_plan: Plan) -> None:
        self.reconciler, self.plan = reconciler, the_plan

    async def save(self, progress: dict[str, Any]) -> None:
        r = self.reconciler
        await r.status(
            plan=r._plan_status(progress["generation"], self.plan, progress["completed"])
        )


async def roll_stale(r: Reconciler, backend: KubernetesBackend, spec: OverlaySpec) -> bool:
    """The rolling replacement: brokers whose pod runs another template than the spec gives
    now (image, arguments, resources) are replaced one at a time, loss-free
    (:func:`canopy_operator.executor.replace_broker`: out by exchanges with its clients
    migrated, a new pod, back as declared). Held after the current broker by the overlay's
    ``canopy.dev/pause-rollout: "true"`` annotation. Progress is ``status.rollout``; a failed
    step stops it with ``Degraded``/``RolloutFailed`` (the overlay is a tree after every step)
    and the next reconcile or heal goes on from what is live. True when nothing is stale."""
    old, draining = await backend.stale()
    todo = sorted(set(old) | set(draining))
    for b in draining:
        r.event("BrokerOnDrainedNode", f"{b} runs on a node being drained: moving it, loss-free")
    record = dict((r.obj.get("status") or {}).get("rollout") or {})
    if not todo:
        if record.get("current") or record.get("paused"):
            record.update(current=None, paused=False)
            await r.status(rollout=record)
        return True
    count = int(record.get("count", 0)) + 1

    async def live() -> LiveOverlay:
        names = sorted(await backend.pods())
        return live_tree(await backend.neighbours(names), spec.broker_names)

    order = rollout.order((await live()).links, todo)
    if _paused(r.obj):
        if not record.get("paused") or record.get("todo") != order:
            record.update(todo=order, current=None, paused=True)
            await r.status(rollout=record)
            r.event("RolloutPaused", f"{len(order)} brokers to replace; held by {PAUSE_ROLLOUT}")
        return False
    record.update(count=count, todo=order, done=[], current=None, paused=False)
    r.event("RolloutStarted", f"replacing {len(order)} brokers one at a time: {', '.join(order)}")
    r.condition(ConditionType.RECONFIGURING, True, "RollingUpdate", f"0/{len(order)} replaced")
    await r.status(phase=OverlayPhase.RECONFIGURING, rollout=record)
    plans = 0

    async def run_plan(p: Plan) -> None:
        nonlocal plans
        plans += 1
        await r.executor(backend, spec, _NoProgress(), f"u{count}p{plans}").run(p, r.generation())

    for b in order:
        record["progress"] = f"{len(record['done'])}/{len(order)} ({b})"
        fresh = await r.api.get(r.path) or {}
        if _paused(fresh):  # annotated while rolling: hold after the broker just replaced
            record.update(current=None, paused=True)
            r.condition(ConditionType.RECONFIGURING, False, "RolloutPaused", f"held before {b}")
            r.event("RolloutPaused", f"held before {b} by {PAUSE_ROLLOUT}")
            await r.status(phase=OverlayPhase.READY, rollout=record)
            return False
        record["current"] = b
        await r.status(rollout=record)
        try:
            result = await replace_broker(b, spec, live, run_plan)
        except (StepError, ValueError, TimeoutError) as exc:
            r.condition(ConditionType.DEGRADED, True, "RolloutFailed", f"replacing {b}: {exc}")
            r.event("RolloutFailed", f"replacing {b}: {exc}", warning=True)
            await r.status(phase=OverlayPhase.DEGRADED, rollout=record)
            return False
        record["done"].append(b)
        r.event("BrokerReplaced", f"{b} replaced in {result['seconds']}s ({result['steps']} steps)")
        r.condition(
            ConditionType.RECONFIGURING,
            True,
            "RollingUpdate",
            f"{len(record['done'])}/{len(order)} replaced",
        )
        await r.status(rollout=record)
    record.update(current=None, progress=f"{len(order)}/{len(order)}")
    r.condition(ConditionType.RECONFIGURING, False, "Idle")
    r.event("RolloutFinished", f"{len(order)} brokers replaced")
    await r.status(phase=OverlayPhase.READY, rollout=record)
    return True


def _paused(overlay: Mapping[str, Any]) -> bool:
    annotations = (overlay.get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(PAUSE_ROLLOUT, "")).lower() == "true"


class _NoProgress:
    """A roll-out's plans are not resumed step by step: a restarted operator plans the rest of
    the roll-out afresh from what is live (the pods' template hashes say what is left)."""

    async def save(self, progress: dict[str, Any]) -> None:
        return None


REPAIR_REASONS = ("BrokerLost", "TreeRepaired")
"""Reasons of a ``Degraded`` condition the brokers' own repair set (the heal clears them)."""


async def _report_repairs(
    r: Reconciler,
    backend: KubernetesBackend,
    brokers: Sequence[str],
    reported: dict[tuple[str, str], set[tuple[str, ...]]],
) -> bool:
    """The brokers repair the tree around a dead one on their own (paper 001); tell people, as
    Events on the overlay (BrokerLost when a neighbour declared one dead, RepairCompleted when
    its replay is out; each once: the brokers keep their last ten repairs) and as the overlay's
    ``Degraded`` condition (reason BrokerLost, then TreeRepaired). Returns whether a repair is
    still under way."""
    seen = reported.setdefault((r.namespace, r.name), set())

    async def status(b: str) -> dict[str, Any]:
        try:
            async with asyncio.timeout(2.0):
                return await backend.admin(b).status()
        except (aiohttp.ClientError, OSError, AdminError, TimeoutError, LookupError):
            return {}  # down, busy or gone: the rest of the heal deals with it

    statuses = await asyncio.gather(*(status(b) for b in brokers))
    lost: list[str] = []
    repaired: list[str] = []
    for b, st in zip(brokers, statuses, strict=True):
        for rec in st.get("repairs", []):
            dead, at = str(rec.get("dead")), str(rec.get("at"))
            linked = ", ".join(rec.get("linked") or []) or "nobody new"
            if (b, dead, at, "lost") not in seen:
                seen.add((b, dead, at, "lost"))
                lost.append(f"{b} declared {dead} dead; linked to {linked}")
                r.event("BrokerLost", lost[-1], True)
            if "replayed" in rec and (b, dead, at, "done") not in seen:
                seen.add((b, dead, at, "done"))
                repaired.append(f"{b}: tree repaired around {dead}")
                r.event(
                    "RepairCompleted", f"{repaired[-1]}; {rec['replayed']} notifications replayed"
                )
    pending = any(k[3] == "lost" and (*k[:3], "done") not in seen for k in seen)
    if lost or repaired:
        if pending:
            r.condition(ConditionType.DEGRADED, True, "BrokerLost", "; ".join(lost or repaired))
        else:
            r.condition(
                ConditionType.DEGRADED,
                True,
                "TreeRepaired",
                "; ".join(repaired) + "; the lost broker is restored next",
            )
        await r.status()
    return pending


def _repair_condition(r: Reconciler) -> bool:
    return any(
        c.get("type") == ConditionType.DEGRADED
        and c.get("status") == "True"
        and c.get("reason") in REPAIR_REASONS
        for c in r.conditions
    )


async def _renew_certificates(
    r: Reconciler, backend: KubernetesBackend, brokers: Sequence[str], config: OperatorConfig
) -> None:
    """Every ``renew_interval``, re-issue the brokers' certificates that are due (the client
    Secret is looked at with the overlay's other objects, at every heal)."""
    key = (r.namespace, r.name)
    if time.monotonic() - config.renewal_checked.get(key, -float("inf")) < config.renew_interval:
        return
    config.renewal_checked[key] = time.monotonic()
    if backend.issuing is None or not backend.issuing.renews:
        return  # no TLS, or cert-manager renews (and the brokers re-read its files)
    for b in brokers:
        done = await backend.ensure_broker_secret(b)
        if done:
            r.event("CertificateRenewed", f"broker {b}'s TLS Secret {done}")


async def heal(config: OperatorConfig, api: KubeApi, namespace: str, name: str) -> None:
    """Compare the live brokers with the declared ones and bring the declared shape back:
    re-create a missing pod; re-link a broker that restarted before its neighbours declared it
    dead (they still hold its old sessions); and once the brokers' own repair is done, restore
    the declared shape by a plan of loss-free steps (:mod:`canopy_operator.model.restore`, the
    same as the local supervisor's)."""
    r = Reconciler(config, api, namespace, name)
    if not await r.load():
        return
    status = r.obj.get("status") or {}
    if (
        status.get("phase") != OverlayPhase.READY
        or status.get("observedGeneration") != r.generation()
    ):
        return
    spec, problems = r.parse()
    if spec is None or problems:
        return
    backend = r.backend(spec, await r.ensure_objects(spec))
    try:
        pods = await backend.pods()
        with_pods = [b for b in spec.broker_names if b in pods]
        repairing = await _report_repairs(r, backend, with_pods, config.reported)
        missing = [b for b in spec.broker_names if b not in pods]
        for b in missing:
            r.event("BrokerMissing", f"broker {b} has no pod; re-creating it", warning=True)
            await backend.create_broker(b)
        await asyncio.gather(
            *(backend.wait_ready(b, config.ready_within) for b in spec.broker_names)
        )
        await _renew_certificates(r, backend, with_pods, config)
        placed = await backend.annotate_zones()
        if placed:
            r.event(
                "BrokersPlaced",
                "zones from the brokers' nodes: "
                + ", ".join(f"{b} in {z}" for b, z in placed.items()),
            )
        await _relink_restarted(r, backend, spec, await backend.neighbours(spec.broker_names))
        restored = await _restore(r, backend, spec)
        if restored:  # a roll-out a restart of the operator or a failed step left unfinished
            await roll_stale(r, backend, spec)
        if restored and not repairing and _repair_condition(r):
            r.condition(
                ConditionType.DEGRADED,
                False,
                "Recovered",
                "every declared broker is back and the declared shape restored",
            )
            await r.status()
    finally:
        await closed(backend)


async def _relink_restarted(
    r: Reconciler,
    backend: KubernetesBackend,
    spec: OverlaySpec,
    neighbours: Mapping[str, set[str]],
) -> None:
    """A broker that restarted faster than failure detection knows nothing of its links while
    its neighbours still hold the old sessions (a one-sided link), and no repair happens: drop
    the old session at the neighbour (its routing entries go with it), and the restarted end
    dials afresh, both ends exchanging their routing state over the new link. Joining two
    trees so closes no cycle. Links neither end has are the restore's job."""
    _, one_sided = mutual(neighbours)
    declared = {norm(e) for e in spec.links or ()} | {
        norm(e) for e in (r.obj.get("status") or {}).get("links") or []
    }
    for a, b in sorted(one_sided & declared):
        # ``other`` holds the old session; ``side`` (the restarted one) lacks the link.
        other, side = (a, b) if b in neighbours.get(a, set()) else (b, a)
        if neighbours.get(side):
            continue  # not a fresh process: a link being set up or closed, not a restart
        await backend.admin(other).remove_link(side)
        await backend.admin(side).set_peers({other: backend.link_address(other)})
        await backend.admin(side).add_link(other, backend.link_address(other))
        r.event("BrokerRelinked", f"re-linked {side} to {other}")


async def _restore(r: Reconciler, backend: KubernetesBackend, spec: OverlaySpec) -> bool:
    """Run the restore plan if one is due (the heal holds the overlay's lock, so no reconcile
    plans at the same time); True when the live shape is the declared one."""
    statuses = await backend.statuses(spec.broker_names)
    links, one_sided = mutual(status_neighbours(statuses))
    decision = restore(spec, spec.broker_names, links, repairs_under_way(statuses))
    if one_sided or decision.wait:
        return False
    if not decision.needed:
        return True
    assert decision.plan is not None
    record = dict((r.obj.get("status") or {}).get("restore") or {})
    count = int(record.get("count", 0)) + 1
    total = len(decision.plan.steps)
    text = describe(decision, spec.broker_names)
    r.event("RestoreStarted", f"restore {count}: {text}")
    record.update(count=count, running={"steps": total, "done": 0, "what": text})
    await r.status(restore=record)
    started = time.perf_counter()

    class Progress:
        async def save(self, progress: dict[str, Any]) -> None:
            record["running"]["done"] = len(progress["completed"])
            await r.status(restore=record)

    executor = r.executor(backend, spec, Progress(), f"r{count}")
    try:
        await executor.run(decision.plan, r.generation())
    except StepError as exc:
        r.event("RestoreFailed", f"restore {count}: {exc}; tried again", warning=True)
        record.pop("running", None)
        await r.status(restore=record)
        return False
    live = await backend.neighbours(spec.broker_names)
    now_links = sorted(reported_links(live))
    record.pop("running", None)
    record["last"] = {
        "brokers": list(decision.absent),
        "steps": total,
        "exchanges": len(decision.plan.exchanges),
        "seconds": round(time.perf_counter() - started, 3),
        "finished": now(),
    }
    r.event("Restored", f"restore {count}: declared shape back ({text})")
    await r.status(restore=record, links=[list(e) for e in now_links], linkCount=len(now_links))
    return True


# -- TopologyProposals ------------------------------------------------------------------------


def proposal_path(namespace: str, name: str = "") -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PROPOSALS}"
    return f"{base}/{name}" if name else base


class ProposalKeeper:
    """One pass over one TopologyProposal: :func:`~canopy_operator.model.proposals.lifecycle`
    decides,
    this writes the decision into the proposal's status (conditions, an Event per transition)
    and, for an approved proposal of a managed-links overlay, applies it with the planner and
    the shared executor, holding the overlay's lock. Writes only the proposal's status and,
    around an apply, the overlay's."""

    def __init__(self, config: OperatorConfig, api: KubeApi, namespace: str, name: str) -> None:
        self.config, self.api, self.namespace, self.name = config, api, namespace, name
        self.obj: dict[str, Any] = {}

    @property
    def path(self) -> str:
        return proposal_path(self.namespace, self.name)

    @property
    def overlay(self) -> str:
        name = (self.obj.get("spec") or {}).get("overlay")
        return name if isinstance(name, str) else ""

    async def load(self) -> bool:
        obj = await self.api.get(self.path)
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            return False
        self.obj = obj
        return True

    async def load_overlay(self) -> dict[str, Any] | None:
        if not self.overlay:
            return None
        obj = await self.api.get(overlay_path(self.namespace, self.overlay))
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            return None
        return obj

    async def status(self, **fields: Any) -> None:
        await self.api.patch(self.path + "/status", {"status": fields})
        self.obj["status"] = {**(self.obj.get("status") or {}), **fields}

    async def record(self, d: Decision, **extra: Any) -> None:
        """Write ``d`` if it changes anything; an Event when the phase changes."""
        status = self.obj.get("status") or {}
        old = status.get("phase")
        patch_changed = d.patch is not None and d.patch != status.get("patch")
        if (
            d.phase == old
            and d.message == status.get("message")
            and not patch_changed
            and not extra
        ):
            return
        conditions = list(status.get("conditions") or [])
        was: dict[str, Any] = next(
            (c for c in conditions if c.get("type") == ConditionType.APPROVED), {}
        )
        if d.approved is not None and was.get("status") != str(d.approved):
            why = (
                d.reason if d.approved or d.phase == ProposalPhase.REJECTED else "AwaitingApproval"
            )
            conditions = set_condition(
                conditions, ConditionType.APPROVED, d.approved, why, d.message
            )
        applied_reason = (
            d.reason
            if d.phase in (ProposalPhase.APPLIED, ProposalPhase.STALE, ProposalPhase.FAILED)
            else d.phase
        )
        conditions = set_condition(
            conditions,
            ConditionType.APPLIED,
            d.phase == ProposalPhase.APPLIED,
            applied_reason,
            d.message,
        )
        fields: dict[str, Any] = {
            "phase": d.phase,
            "message": d.message,
            "observedGeneration": int((self.obj.get("metadata") or {}).get("generation") or 1),
            "conditions": conditions,
            **extra,
        }
        if d.patch is not None:
            fields["patch"] = dict(d.patch)
        await self.status(**fields)
        if d.phase != old:
            post_event(
                self.obj,
                d.phase,
                d.message,
                warning=d.phase in (ProposalPhase.STALE, ProposalPhase.FAILED),
            )

    async def run(self) -> bool:
        """One pass; True if the overlay's live links changed (other proposals may not fit)."""
        if not await self.load():
            return False
        decision = lifecycle(self.obj, await self.load_overlay())
        await self.record(decision)
        if decision.action != "apply":
            return False
        async with self.config.lock(self.namespace, self.overlay):
            return await self._apply()

    async def _apply(self) -> bool:
        """Apply (or resume applying) this proposal to its managed-links overlay; the caller
        holds the overlay's lock, so no reconcile of the overlay runs meanwhile."""
        if not await self.load():
            return False
        r = Reconciler(self.config, self.api, self.namespace, self.overlay)
        if not await r.load():
            await self.record(lifecycle(self.obj, None))
            return False
        spec, problems = r.parse()
        if spec is None or problems:
            await self.record(
                Decision(
                    ProposalPhase.FAILED, "InvalidOverlay", f"overlay {self.overlay} is invalid"
                )
            )
            return False
        status = self.obj.get("status") or {}
        saved = status.get("plan") or {}
        p = from_manifest(self.obj)
        backend = r.backend(spec, await r.ensure_objects(spec))
        try:
            if status.get("phase") == ProposalPhase.APPLYING and saved.get("steps"):
                the_plan = Plan(steps_from_json(saved["steps"]), ())
                completed = [i for i, s in enumerate(saved["steps"]) if s.get("done")]
                post_event(
                    self.obj,
                    "PlanResumed",
                    f"resuming: {len(completed)}/{len(the_plan.steps)} steps were done",
                )
            else:
                live = live_tree(await backend.neighbours(spec.broker_names), spec.broker_names)
                decision = lifecycle(self.obj, r.obj, live_links=live.links)
                if decision.action != "apply":
                    await self.record(decision)
                    return False
                desired = dataclasses.replace(spec, links=apply_changes(live.links, p.changes))
                the_plan = plan(live, desired)
                completed = []
                n = len(the_plan.steps)
                await self.record(
                    Decision(
                        ProposalPhase.APPLYING, "Applying", f"applying {n} steps to {self.overlay}"
                    ),
                    plan=plan_status(p.generation, the_plan, []),
                )
            r.condition(
                ConditionType.RECONFIGURING,
                True,
                "ProposalApplying",
                f"applying proposal {self.name}",
            )
            await r.status(phase=OverlayPhase.RECONFIGURING)
            r.event("ProposalApplying", f"applying proposal {self.name}")
            await self._execute(
                r=r,
                spec=spec,
                backend=backend,
                generation=p.generation,
                the_plan=the_plan,
                completed=completed,
            )
        finally:
            await closed(backend)
        return True

    async def _execute(
        self,
        *,
        r: Reconciler,
        spec: OverlaySpec,
        backend: KubernetesBackend,
        generation: int,
        the_plan: Plan,
        completed: list[int],
    ) -> None:
        started = time.perf_counter()
        uid = str((self.obj.get("metadata") or {}).get("uid") or "")[:8]
        executor = Executor(
            backend,
            _ProposalStore(self, the_plan),
            f"{self.name}-{uid}",  # exchange ids unique to this proposal object
            ordering=spec.ordering,
            lease=spec.lease_seconds,
            on_event=lambda reason, message: post_event(self.obj, reason, message),
            on_degraded=r._on_degraded,
        )
        failure: StepError | None = None
        try:
            await executor.run(
                the_plan, generation, {"generation": generation, "completed": completed}
            )
        except StepError as exc:
            STEPS.labels(exc.step.kind, "failed").inc()
            failure = exc
        # Every step leaves a tree: what the brokers hold now is the overlay's live tree.
        live_now = await backend.neighbours(spec.broker_names)
        links = sorted(reported_links(live_now))
        seconds = round(time.perf_counter() - started, 3)
        r.condition(ConditionType.RECONFIGURING, False, "Idle")
        fields: dict[str, Any] = {
            "phase": OverlayPhase.READY,
            "linkCount": len(links),
            "links": [list(e) for e in links],
        }
        if failure is None:
            fields["lastReconfiguration"] = {
                "generation": generation,
                "proposal": self.name,
                "steps": len(the_plan.steps),
                "exchanges": len(the_plan.exchanges),
                "seconds": seconds,
                "finished": now(),
            }
        await r.status(**fields)
        if failure is not None:
            await self.record(Decision(ProposalPhase.FAILED, "StepFailed", str(failure)))
            r.event("ProposalFailed", f"proposal {self.name}: {failure}", warning=True)
            return
        message = f"applied {len(the_plan.exchanges)} exchanges to {self.overlay} in {seconds}s"
        await self.record(
            Decision(ProposalPhase.APPLIED, "Applied", message, approved=True),
            plan=plan_status(generation, the_plan, range(len(the_plan.steps))),
        )
        r.event("ProposalApplied", f"proposal {self.name}: {message}")


class _ProposalStore:
    """The executor's progress, as the proposal's ``status.plan``."""

    def __init__(self, keeper: ProposalKeeper, the_plan: Plan) -> None:
        self.keeper, self.plan = keeper, the_plan

    async def save(self, progress: dict[str, Any]) -> None:
        await self.keeper.status(
            plan=plan_status(progress["generation"], self.plan, progress["completed"])
        )


async def keep_proposal(config: OperatorConfig, api: KubeApi, namespace: str, name: str) -> None:
    """Move one proposal along its lifecycle (one pass at a time per proposal)."""
    keeper = ProposalKeeper(config, api, namespace, name)
    async with config.lock(namespace, f"{PROPOSALS}/{name}"):
        changed = await keeper.run()
    if changed:  # the live tree moved: the overlay's other open proposals may no longer fit
        await recheck_proposals(config, api, namespace, keeper.overlay)


async def recheck_proposals(
    config: OperatorConfig, api: KubeApi, namespace: str, overlay: str
) -> None:
    """The overlay changed (or went): every open proposal for it is looked at again, so Stale,
    Applied (GitOps merged it) and waiting approvals are noticed at once. A proposal that
    cannot be handled now is logged; its own handler retries it."""
    for obj in await api.items(proposal_path(namespace)):
        phase = (obj.get("status") or {}).get("phase")
        if (obj.get("spec") or {}).get("overlay") != overlay or phase in TERMINAL_PHASES:
            continue
        name = str(obj["metadata"]["name"])
        try:
            await keep_proposal(config, api, namespace, name)
        except Exception:
            log.exception(
                "proposal %s/%s: re-check after overlay %s changed", namespace, name, overlay
            )


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    """The operator's handlers, bound to ``config`` (a fresh registry per operator run)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        config.stopping = True
        if config.api is not None:
            await config.api.close()
            config.api = None

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = connection_info(config, **kwargs)
        if info is not None and config.api is None:
            config.api = KubeApi.from_connection(info)
        return info

    def api() -> KubeApi:
        assert config.api is not None, "login has not run"
        return config.api

    async def reconcile(namespace: str | None, name: str | None) -> None:
        assert namespace and name
        started = time.perf_counter()
        result = "ok"
        try:
            async with config.lock(namespace, name):
                await Reconciler(config, api(), namespace, name).run()
        except BaseException:
            result = "error"
            raise
        finally:
            RECONCILE_SECONDS.labels(result).observe(time.perf_counter() - started)
        await recheck_proposals(config, api(), namespace, name)

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry)
    async def on_overlay(namespace: str | None, name: str | None, **_: Any) -> None:
        await reconcile(namespace, name)

    @kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, registry=registry)
    async def on_delete(namespace: str | None, name: str | None, body: kopf.Body, **_: Any) -> None:
        """Owner references let the garbage collector remove the overlay's objects; this stops
        the brokers at once (best effort: optional, no finalizer that could block a delete)."""
        assert namespace and name
        config.locks.pop((namespace, name), None)
        await recheck_proposals(config, api(), namespace, name)  # they go Stale
        with contextlib.suppress(KeyError):
            PLAN_LENGTH.remove(name)
        for pod in await api().items(core_path(namespace, "pods")):
            meta = pod.get("metadata") or {}
            if (meta.get("labels") or {}).get(LABEL_OVERLAY) == name and any(
                o.get("uid") == body.metadata.uid for o in meta.get("ownerReferences") or []
            ):
                await api().delete(core_path(namespace, "pods", meta["name"]))

    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        interval=config.heal_interval,
        idle=config.heal_interval,
        registry=registry,
    )
    async def on_timer(namespace: str | None, name: str | None, **kwargs: Any) -> None:
        stopped: kopf.DaemonStopped = kwargs["stopped"]  # kopf gives timers this kwarg too
        assert namespace and name
        lock = config.lock(namespace, name)
        if lock.locked() or config.stopping:  # a reconcile is running; it converges anyway
            return
        async with lock:
            try:
                await _unless_stopped(heal(config, api(), namespace, name), stopped)
            except (
                aiohttp.ClientError,
                OSError,
                AdminError,
                KubeError,
                TimeoutError,
                CertificatesPendingError,
            ) as exc:
                # A broker restarting under the heal (its old address gone, the new one not
                # up yet) is the normal case here, not a fault: the next tick looks again.
                # Raising would make kopf back off for a minute, the heal's whole purpose.
                log.warning("heal of %s/%s deferred to the next tick: %s", namespace, name, exc)

    @kopf.on.resume(GROUP, VERSION, PROPOSALS, registry=registry)
    @kopf.on.create(GROUP, VERSION, PROPOSALS, registry=registry)
    @kopf.on.update(GROUP, VERSION, PROPOSALS, registry=registry)  # approve/reject annotations
    async def on_proposal(namespace: str | None, name: str | None, **_: Any) -> None:
        assert namespace and name
        try:
            await keep_proposal(config, api(), namespace, name)
        except (aiohttp.ClientError, OSError, KubeError) as exc:
            raise kopf.TemporaryError(str(exc), delay=config.retry_delay) from exc

    return registry


async def _unless_stopped(work: Coroutine[Any, Any, None], stopped: kopf.DaemonStopped) -> None:
    """Run ``work`` until it ends or kopf stops the timer that runs it. kopf never cancels a
    timer: on exit it waits a moment (``instant_exit_timeout``) and then leaves it orphaned,
    with its HTTP sessions open. A heal waiting for a broker must give up at once instead."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        task.cancel()  # nothing if it is done
        await asyncio.gather(stop, task, return_exceptions=True)
    if not task.cancelled():
        task.result()  # its exception, if any, is the caller's


def connection_info(config: OperatorConfig, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """How to reach the API server: ``--server`` if given, else the pod's service account,
    else the kubeconfig."""
    if config.server:
        return kopf.ConnectionInfo(
            server=config.server, token=config.token, insecure=config.insecure
        )
    kwargs.setdefault("logger", log)
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


async def run_operator(
    config: OperatorConfig,
    *,
    namespaces: Sequence[str] = (),
    stop_flag: Any = None,
    ready_flag: Any = None,
    hard_exit: bool = True,
    liveness: str | None = None,
) -> None:
    """Run the operator until ``stop_flag`` is set (or a signal, in the main thread).

    ``hard_exit=False`` turns off kopf's last resort (SIGKILL when a stop hangs), which would
    take the whole process with it when the operator runs in a thread of a bigger program."""
    settings = kopf.OperatorSettings()
    if not hard_exit:
        settings.process.ultimate_exiting_timeout = None
    settings.peering.standalone = True
    # Timers are never cancelled by kopf: it waits this long for them to notice ``stopped``
    # (the heal does, and cancels its own work) before it leaves them orphaned.
    settings.background.instant_exit_timeout = 5.0
    # kopf's own bookkeeping in annotations, never in status (the CRD has no field for it) and
    # never in spec. Not under canopy.dev/ itself: kopf ignores every annotation under its own
    # prefix when it looks for changes, and canopy.dev/approve must be seen.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=BOOKKEEPING_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=BOOKKEEPING_PREFIX
    )
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 60
    # Discovery once at start-up; no watches on CRDs or namespaces (least privilege).
    settings.scanning.disabled = True

    async def operate(halt: Any) -> None:
        await kopf.operator(
            registry=build_registry(config),
            settings=settings,
            standalone=True,
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            stop_flag=halt,
            ready_flag=ready_flag,
            liveness_endpoint=liveness,
        )

    if config.leader is None:
        await operate(stop_flag)
        return
    info = connection_info(config)
    if info is None:
        raise RuntimeError("leader election: no way to reach the API server")
    lease_api = KubeApi.from_connection(info)

    def stopping() -> bool:
        return bool(stop_flag is not None and stop_flag.is_set())

    try:
        await run_as_leader(Elector(lease_api, config.leader), operate, stopping, liveness)
    finally:
        await lease_api.close()
