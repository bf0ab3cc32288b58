"""Reconciling one BrokerOverlay (:class:`Reconciler`) and healing it (:func:`heal`).

Per overlay the operator keeps a Secret (the brokers' admin token), a headless Service (broker
DNS), the overlay's credentials (unless ``spec.security.tls`` is false: a CA Secret, one TLS
Secret per broker, a client Secret for the overlay's default principal and the client policy
in a ConfigMap, see :meth:`Reconciler.ensure_security`) and one Pod per broker, all owned by
the overlay so deleting it removes them. A reconcile (create, update, resume) validates the
spec — an invalid spec gets ``Valid=False``, an Event and nothing else — creates what is
missing, asks the brokers which links are live, plans and runs the plan with the shared
:class:`~canopy_operator.executor.Executor`. Progress goes to ``status.plan`` after every step
(each step carries ``done``), so a restarted operator resumes the same plan of the same
generation instead of repeating or skipping a step. The heal, on a timer, compares the live
brokers with the declared ones: it re-creates a lost pod, re-links a broker that came back
without its links, restores the declared shape after the brokers' own crash repair, rolls
stale pods and renews certificates.

The operator only ever writes ``status`` (merge patches on the status subresource); ``spec``
belongs to its owners (GitOps).
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import kopf
from prometheus_client import Counter, Gauge, Histogram

from canopy_broker.admin_client import AdminError
from canopy_broker.pki import Authority
from canopy_broker.runtime.security import CLIENT, Identity
from canopy_operator.backends.certs import (
    CertificatesPendingError,
    CertManager,
    Issuing,
    OwnCa,
    b64,
    secret_bytes,
)
from canopy_operator.backends.k8s import KubernetesBackend, closed, live_tree
from canopy_operator.backends.kube import KIND, KubeApi, core_path, overlay_path
from canopy_operator.backends.leader import LeaseConfig
from canopy_operator.backends.manifests import (
    ADMIN_PORT,
    BROKER_PORT,
    CLIENT_PRINCIPAL,
    DEFAULT_IMAGE,
    GATEWAY_PORT,
    LABEL_OVERLAY,
    LINK_PORT,
    MQTT_PORT,
    PAUSE_ROLLOUT,
    POLICY_KEY,
    Resolver,
    Security,
    ca_secret_name,
    client_secret_name,
    dns_resolver,
    link_network_policy,
    name_problems,
    owned,
    owner_reference,
    policy_name,
    secret_name,
    security_of,
    service_name,
)
from canopy_operator.executor import Executor, ProgressStore, StepError, replace_broker
from canopy_operator.model import rollout
from canopy_operator.model.phases import ConditionType, OverlayPhase
from canopy_operator.model.planner import (
    Cause,
    LiveOverlay,
    Plan,
    Reconcile,
    decide,
    plan,
    plan_status,
)
from canopy_operator.model.restore import (
    ONE_SIDED_STUCK,
    describe,
    down_links,
    mutual,
    repairs_under_way,
    reported_links,
    restore,
    status_neighbours,
    stuck_one_sided,
)
from canopy_operator.model.topology import OverlaySpec, SpecError, norm, parse_overlay, validate

log = logging.getLogger("canopy.operator")


RECONCILE_SECONDS = Histogram(
    "canopy_operator_reconcile_seconds", "Duration of BrokerOverlay reconciles", ["result"]
)
STEPS = Counter("canopy_operator_steps_total", "Plan steps carried out", ["kind", "result"])
PLAN_LENGTH = Gauge("canopy_operator_plan_steps", "Steps of the current plan", ["overlay"])


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


@dataclass
class OperatorConfig:
    """How the operator reaches Kubernetes and the brokers; tests inject a resolver."""

    server: str | None = None  # None: the in-cluster service account, else the kubeconfig
    token: str | None = None
    insecure: bool = False
    kubeconfig: str | None = None  # a kubeconfig (and context) to use instead (not in a pod)
    context: str | None = None
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
    # Links known at one end only, by overlay: [first seen, last seen] (monotonic) by "a-b"
    # (model.restore.stuck_one_sided), so that one stuck for good is ended.
    one_sided: dict[tuple[str, str], dict[str, list[float]]] = field(default_factory=dict)
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
        return spec, name_problems(spec) + validate(spec)

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
            raise await self._certificates_pending(exc, observed=generation) from exc
        backend = self.backend(spec, access)
        try:
            await self._converge(spec, backend, generation, decision)
        except CertificatesPendingError as exc:  # a broker's own, wanted while converging
            # Raised as is, kopf took it for a failure and retried a minute later (CI: the
            # overlay was not Ready within 60 s, cm-c-tls issued a moment late). The plan's
            # progress is saved: the retry resumes it.
            raise await self._certificates_pending(exc) from exc
        finally:
            await closed(backend)

    async def _certificates_pending(
        self, exc: CertificatesPendingError, observed: int | None = None
    ) -> kopf.TemporaryError:
        """Say so (condition, Event) and retry soon: cert-manager has not issued a
        certificate yet, or issued an unusable one. ``observed``: the generation to record
        as observed (before any plan ran for it)."""
        self.condition(ConditionType.READY, False, "CertificatesPending", str(exc))
        await self.status(**({} if observed is None else {"observedGeneration": observed}))
        self.event("CertificatesPending", str(exc), warning=True)
        return kopf.TemporaryError(str(exc), delay=self.config.retry_delay)

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
        held = await backend.annotate_holds()
        if held:
            hold = next(iter(held.values()))
            r.event(
                "ClientHoldChanged",
                f"pods {', '.join(held)} "
                + (f"hold clients for up to {hold} s" if hold else "no longer hold clients")
                + " when their broker starts until it is linked (the overlay's size changed)",
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
    # By restarted broker (``side``, which lacks the links): the neighbours (``other``) that
    # hold its old sessions.
    holders: dict[str, list[str]] = {}
    for a, b in sorted(one_sided & declared):
        other, side = (a, b) if b in neighbours.get(a, set()) else (b, a)
        if not neighbours.get(side):  # else not a fresh process: a link being set up or closed
            holders.setdefault(side, []).append(other)

    async def relink(side: str, other: str) -> None:
        await backend.admin(other).remove_link(side)
        await backend.admin(side).set_peers({other: backend.link_address(other)})
        await backend.admin(side).add_link(other, backend.link_address(other))
        r.event("BrokerRelinked", f"re-linked {side} to {other}")

    # All of a broker's links at once: it admits its clients a heartbeat after the first is
    # up, and one at a time, each up to add_link's wait, its clients' events would have
    # reached only the part of the overlay behind that first link meanwhile.
    for side, others in sorted(holders.items()):
        await asyncio.gather(*(relink(side, other) for other in others))


async def _end_stuck_links(
    r: Reconciler, backend: KubernetesBackend, statuses: Mapping[str, Mapping[str, Any]]
) -> bool:
    """End each link known at one end only for too long, at the end that knows it: the
    restore waits while any link is one-sided, so one stuck for good (a repair's promoted
    link the other end never took) kept it from ever joining the parts and telling their
    subscribers of the gap (chaos soak; ``canopy supervise`` does the same locally). "Too
    long" spans three heals, since the heal is the only one looking. True if one was ended."""
    neighbours = status_neighbours(statuses)
    _, one_sided = mutual(neighbours)
    key = (r.namespace, r.name)
    after = max(ONE_SIDED_STUCK, 3 * r.config.heal_interval)
    seen, stuck = stuck_one_sided(
        one_sided, neighbours, r.config.one_sided.get(key, {}), time.monotonic(), after
    )
    r.config.one_sided[key] = seen
    removed = False
    for holder, other in stuck:
        try:
            await backend.admin(holder).remove_link(other)
        except (AdminError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            # On a running exchange's cycle (409), or the holder stopped answering: the next
            # heal looks again; the rest of this one goes on.
            log.info("link %s-%s not removed at %s: %s", holder, other, holder, exc)
            continue
        removed = True
        r.event(
            "StuckLinkRemoved",
            f"link {holder}-{other} was known at {holder} only for over {after:g}s: removed "
            "there, so that the restore can join the parts",
            warning=True,
        )
    return removed


async def _restore(r: Reconciler, backend: KubernetesBackend, spec: OverlaySpec) -> bool:
    """Run the restore plan if one is due (the heal holds the overlay's lock, so no reconcile
    plans at the same time); True when the live shape is the declared one."""
    statuses = await backend.statuses(spec.broker_names)
    if await _end_stuck_links(r, backend, statuses):
        statuses = await backend.statuses(spec.broker_names)
    links, one_sided = mutual(status_neighbours(statuses))
    decision = restore(spec, spec.broker_names, links, repairs_under_way(statuses))
    if one_sided or down_links(statuses) or decision.wait:  # see down_links
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
