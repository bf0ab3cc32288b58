"""What the operator asks Kubernetes for, as data: the names, ports, labels and mounts of an
overlay's objects, the broker Pod and the per-overlay link NetworkPolicy, and the security
settings a spec asks for. Pure functions of the spec: nothing here speaks to the API, so the
chart tests and the Pod's template hash use the very same code as the operator.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from canopy_broker.client.credentials import LOCAL_CLIENT
from canopy_broker.pki import permissive_policy
from canopy_broker.runtime.placement import HOLD_ANNOTATION, ZONE_LABEL
from canopy_broker.runtime.security import Policy, SecurityError
from canopy_operator.backends.certs import (
    ISSUER_KINDS,
    IssuerRef,
)
from canopy_operator.backends.kube import GROUP, KIND, VERSION
from canopy_operator.model.topology import OverlaySpec, SpecError

BROKER_PORT, LINK_PORT, ADMIN_PORT, GATEWAY_PORT, MQTT_PORT = 7000, 7001, 8080, 8081, 8883
"""Clients; overlay links (brokers only: the NetworkPolicy admits the overlay's broker pods);
the admin API, /metrics and probes (the operator and the miner); the HTTP gateway and the MQTT
listener (clients; MQTT over TLS on its usual port)."""
LABEL_OVERLAY, LABEL_BROKER = "canopy.dev/overlay", "canopy.dev/broker"
TEMPLATE_HASH = "canopy.dev/template-hash"
"""Pod annotation: a hash of what the broker runs (image, arguments, resources, mounts). A pod
whose hash is not the one the spec gives now is replaced by the rolling replacement."""
POD_CLIENT_HOLD = 90.0
"""Seconds a broker pod of an overlay of more than one broker refuses clients unless linked
before (HOLD_ANNOTATION): more than the operator's default heal interval (30 s), within which it
links a container restarted in place."""
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


SERVICE_SUFFIX = "-brokers"
MAX_OVERLAY_NAME = 63 - len(SERVICE_SUFFIX)


def service_name(overlay: str) -> str:
    return f"{overlay}{SERVICE_SUFFIX}"


def name_problems(spec: OverlaySpec) -> list[str]:
    """What the API server would refuse in the objects named after ``spec``: its Service
    (NAME-brokers) is a DNS-1035 label, each pod's host name (NAME-BROKER) a DNS label. Before
    this check the operator made the rest and the Service or a pod was refused. Kubernetes
    only: a local overlay has neither, and one made under such a name runs on."""
    name, problems = spec.name, []
    if not name[:1].isalpha():
        problems.append(
            f"metadata.name {name!r} must begin with a letter (its Service, "
            f"{service_name(name)}, is a DNS-1035 label)"
        )
    if len(name) > MAX_OVERLAY_NAME:
        problems.append(
            f"metadata.name {name!r} has {len(name)} characters, at most {MAX_OVERLAY_NAME} "
            f"(its Service, NAME{SERVICE_SUFFIX}, has at most 63)"
        )
    for broker in spec.broker_names:
        host = pod_name(name, broker)
        if len(host) > 63:
            problems.append(
                f"broker name {broker!r} is too long for overlay {name!r}: its pod's host name "
                f"{host} has {len(host)} characters, at most 63"
            )
    return problems


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
    pod["metadata"]["annotations"] = {
        TEMPLATE_HASH: template_hash(pod),
        # A new process (a new pod, or its container restarted in place, at the same address)
        # refuses clients until linked: unlinked, it acknowledged publications and routed them
        # to nobody. The operator links it within a heal interval or two.
        **({HOLD_ANNOTATION: hold} if (hold := client_hold(spec)) is not None else {}),
    }
    return pod


def client_hold(spec: OverlaySpec) -> str | None:
    """The :data:`HOLD_ANNOTATION` a broker pod of ``spec`` carries (None: none). A lone broker
    has no link to wait for; any other does. Not part of the template hash: growing an
    overlay from one broker to two changes it on the running pods
    (:meth:`~canopy_operator.backends.k8s.KubernetesBackend.annotate_holds`), which replaces
    nothing."""
    return repr(POD_CLIENT_HOLD) if len(spec.brokers) > 1 else None


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
