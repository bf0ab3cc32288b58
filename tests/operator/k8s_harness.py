"""Test harness for the Kubernetes face: kmock's emulator as the API server, the real operator in
a thread of its own, and a test "kubelet" that runs a real broker process for every broker Pod.

* :class:`CanopyEmulator` adds what an API server does and kmock leaves out: ``uid``,
  ``resourceVersion``, ``creationTimestamp`` and ``generation`` on create, a new
  ``resourceVersion`` on every change and a new ``generation`` when ``spec`` changes, and list
  responses that ``kubectl`` accepts (``kind: <Kind>List``, JSON watch streams).
* :class:`OperatorThread` runs :func:`canopy_operator.backends.handlers.run_operator` in its own
  thread and event loop (kopf cancels every task of its loop when it stops, so it cannot share
  the test's).
  Stopping it mid-plan is, for the brokers, an operator that died.
* :class:`Kubelet` plays the kubelet: a Pod object appears -> a real ``canopy-broker`` process
  with the overlay's token from the Secret and what the pod mounts: its TLS Secret's files
  (``--tls-dir``) and the policy ConfigMap (``--policy``), or ``--insecure`` if the pod says
  so; the Pod marked Ready; the resolver maps the pod to that process's loopback addresses. A
  deleted Pod stops its process. :meth:`Kubelet.credentials` are the overlay's client Secret's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import itertools
import json
import random
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import kmock
import yaml
from cryptography.hazmat.primitives import serialization
from kmock._internal import rendering

from canopy_broker.client import Credentials
from canopy_broker.pki import Authority
from canopy_broker.procs import BrokerProc, spawn_broker
from canopy_broker.sim.checker import DeliveryReport, check_deliveries
from canopy_operator.backends.certs import secret_bytes
from canopy_operator.backends.handlers import run_operator
from canopy_operator.backends.kube import KubeApi
from canopy_operator.backends.manifests import (
    LABEL_BROKER,
    LABEL_OVERLAY,
    Endpoints,
    client_secret_name,
    secret_name,
)
from canopy_operator.backends.reconciler import OperatorConfig
from tests.integration.test_overlay import random_filter
from tests.integration.test_reconfiguration import Run, converged

T = TypeVar("T")
NS = "canopy"
_versions = itertools.count(1000)


class Gate:
    """Holds the answer to the first status patch that ``predicate`` picks, after applying it,
    until :attr:`opened` is set: the operator is then stuck at a known point of its plan."""

    def __init__(self, predicate: Callable[[dict[str, Any]], bool]) -> None:
        self.predicate = predicate
        self.reached = asyncio.Event()
        self.opened = asyncio.Event()


class CanopyEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with the bookkeeping fields a real API server keeps."""

    gate: Gate | None = None

    async def _handle(self, request: rendering.Request) -> Any:
        response = await self._handle_k8s(request)
        gate = self.gate
        data = request.data
        held = gate is not None and request.subresource == "status" and isinstance(data, dict)
        if gate is not None and held and not gate.reached.is_set() and gate.predicate(data):
            gate.reached.set()
            await gate.opened.wait()
        return response

    async def _handle_k8s(self, request: rendering.Request) -> Any:
        data = request.data
        schema = STATUS_SCHEMAS.get((request.resource.plural if request.resource else None) or "")
        if schema is not None and isinstance(data, dict) and isinstance(data.get("status"), dict):
            # A real API server prunes what the CRD's structural schema does not declare: an
            # operator writing an undeclared status field would see it kept here and lost on a
            # cluster (status.rollout was, and `kubectl get bo -o wide` showed no roll-out).
            data["status"] = pruned(data["status"], schema)
        if request.resource is not None and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if request.action == kmock.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):  # as kopf's Events do
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault(
                    "creationTimestamp",
                    datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                )
                meta.setdefault("generation", 1)
                meta["resourceVersion"] = str(next(_versions))
            elif request.action == kmock.action.UPDATE and request.name is not None:
                meta["resourceVersion"] = str(next(_versions))
                key = (request.resource, request.namespace, request.name)
                if "spec" in data and request.subresource is None and key in self.objects:
                    current = self.objects[key]
                    if not current.deleted:
                        gen = int(current.get("metadata", {}).get("generation") or 1)
                        meta["generation"] = gen + 1
        return await super()._handle(request)

    async def _serve_fetch(self, request: rendering.Request) -> Any:
        result = await super()._serve_fetch(request)
        if wants_table(request):
            return as_table(request, [result])
        return result

    async def _serve_list(self, request: rendering.Request) -> Any:
        result = dict(await super()._serve_list(request))
        if wants_table(request):
            return as_table(request, result["items"])
        kinds = {
            info.kind
            for res, info in self.resources.items()
            if request.resource is not None and res == request.resource and info.kind
        }
        assert request.resource is not None
        group, version = request.resource.group, request.resource.version
        result["apiVersion"] = f"{group}/{version}" if group else str(version)
        result["kind"] = f"{next(iter(kinds), 'Object')}List"
        result["metadata"] = {"resourceVersion": str(next(_versions))}
        return result


CRDS = Path(__file__).resolve().parents[2] / "manifests" / "crds"


def _status_schemas() -> dict[str, dict[str, Any]]:
    """Each of Canopy's CRDs' status schema, by plural."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        out[crd["spec"]["names"]["plural"]] = schema["properties"]["status"]
    return out


def pruned(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` less what a real API server would prune: fields of an object that its
    structural schema does not declare (unless it preserves unknown fields)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        return {k: pruned(v, props[k]) for k, v in value.items() if k in props}
    if isinstance(value, list):
        return [pruned(v, schema.get("items") or {}) for v in value]
    return value


STATUS_SCHEMAS = _status_schemas()


def printer_columns() -> dict[str, list[dict[str, Any]]]:
    """additionalPrinterColumns of our CRDs, by plural (what the API server renders from)."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        (version,) = crd["spec"]["versions"]
        out[crd["spec"]["names"]["plural"]] = version.get("additionalPrinterColumns", [])
    return out


def wants_table(request: rendering.Request) -> bool:
    return "as=Table" in request.headers.get("Accept", "")


def _json_path(obj: Any, path: str) -> Any:
    for part in path.strip(".").split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m"


def as_table(request: rendering.Request, items: list[dict[str, Any]]) -> dict[str, Any]:
    """A meta.k8s.io/v1 Table as the API server renders for ``kubectl get`` of a custom
    resource: Name, then the CRD's printer columns (dates as ages)."""
    assert request.resource is not None
    columns = printer_columns().get(str(request.resource.plural), [])
    definitions = [{"name": "Name", "type": "string", "format": "name", "priority": 0}]
    definitions += [
        {"name": c["name"], "type": c["type"], "format": "", "priority": c.get("priority", 0)}
        for c in columns
    ]
    rows = []
    for obj in items:
        cells: list[Any] = [obj["metadata"]["name"]]
        for c in columns:
            value = _json_path(obj, c["jsonPath"])
            cells.append(_age(value) if c["type"] == "date" else value)
        rows.append(
            {
                "cells": cells,
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": obj["metadata"],
                },
            }
        )
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": str(next(_versions))},
        "columnDefinitions": definitions,
        "rows": rows,
    }


def declare_resources(emulator: kmock.KubernetesEmulator) -> None:
    """Discovery, as kopf and kubectl ask for it."""
    every = {"get", "list", "watch", "create", "update", "patch", "delete"}
    emulator.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", namespaced=False, verbs=every
    )
    for plural, kind in (
        ("pods", "Pod"),
        ("services", "Service"),
        ("secrets", "Secret"),
        ("configmaps", "ConfigMap"),
        ("events", "Event"),
    ):
        emulator.resources[f"v1/{plural}"] = kmock.ResourceInfo(
            kind=kind,
            singular=kind.lower(),
            namespaced=True,
            verbs=every,
            subresources={"status"} if plural == "pods" else set(),
        )
    emulator.resources["v1/nodes"] = kmock.ResourceInfo(
        kind="Node", singular="node", namespaced=False, verbs=every
    )
    emulator.resources["policy/v1/poddisruptionbudgets"] = kmock.ResourceInfo(
        kind="PodDisruptionBudget", singular="poddisruptionbudget", namespaced=True, verbs=every
    )
    emulator.resources["cert-manager.io/v1/certificates"] = kmock.ResourceInfo(
        kind="Certificate", singular="certificate", namespaced=True, verbs=every
    )
    emulator.resources["networking.k8s.io/v1/networkpolicies"] = kmock.ResourceInfo(
        kind="NetworkPolicy", singular="networkpolicy", namespaced=True, verbs=every
    )
    emulator.resources["coordination.k8s.io/v1/leases"] = kmock.ResourceInfo(
        kind="Lease", singular="lease", namespaced=True, verbs=every
    )
    emulator.resources["canopy.dev/v1alpha1/brokeroverlays"] = kmock.ResourceInfo(
        kind="BrokerOverlay",
        singular="brokeroverlay",
        namespaced=True,
        verbs=every,
        shortnames={"bo", "overlay"},
        categories={"canopy"},
        subresources={"status"},
    )
    emulator.resources["canopy.dev/v1alpha1/topologyproposals"] = kmock.ResourceInfo(
        kind="TopologyProposal",
        singular="topologyproposal",
        namespaced=True,
        verbs=every,
        shortnames={"tp"},
        subresources={"status"},
    )


def server_url(emulator: kmock.KubernetesEmulator) -> str:
    return str(emulator.url).rstrip("/")


def objects(emulator: kmock.KubernetesEmulator, plural: str) -> list[dict[str, Any]]:
    out = []
    for (resource, _ns, _name), obj in list(emulator.objects.items()):
        if resource.plural == plural and not obj.deleted:
            out.append(obj.raw)
    return out


async def until(
    predicate: Callable[[], Awaitable[T | None]] | Callable[[], T | None],
    within: float = 30.0,
    what: str = "condition",
) -> T:
    """Poll ``predicate`` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.05)


class Kubelet:
    """Runs a real broker process for every broker Pod in the emulator and marks it Ready."""

    def __init__(self, emulator: kmock.KubernetesEmulator, log_dir: Path) -> None:
        self.emulator = emulator
        self.log_dir = log_dir
        self.procs: dict[str, BrokerProc] = {}
        self.endpoints: dict[str, Endpoints] = {}
        self.started: list[str] = []
        self.cut_off: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._starting: dict[str, asyncio.Task[None]] = {}
        self.broker_args: tuple[str, ...] = ()  # extra `canopy-broker serve` flags for new pods
        # Per pod: its --tls-dir (None: --insecure) and --policy flags, from its spec.
        self.security: dict[str, tuple[Path | None, tuple[str, ...]]] = {}
        # Per pod: its downward-API directory (--placement-dir) and its node (CANOPY_NODE).
        self.placement: dict[str, tuple[str, ...]] = {}

    def resolve(self, namespace: str, service: str, pod: str) -> Endpoints:
        if pod in self.cut_off:  # the operator cannot reach this broker's admin API
            e = self.endpoints[pod]
            return Endpoints(e.listen, "127.0.0.1:1", e.link)
        return self.endpoints[pod]

    def token(self, overlay: str) -> str:
        for secret in objects(self.emulator, "secrets"):
            if secret["metadata"]["name"] == secret_name(overlay):
                return base64.b64decode(secret["data"]["token"]).decode()
        raise KeyError(overlay)

    def _object(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        for obj in objects(self.emulator, plural):
            meta = obj["metadata"]
            if meta["name"] == name and meta.get("namespace", namespace) == namespace:
                return obj
        raise KeyError(f"{plural}/{name} not found: the pod cannot start")

    def _volume_at(self, pod: dict[str, Any], path: str) -> dict[str, Any]:
        (container,) = pod["spec"]["containers"]
        (mount,) = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
        return dict(volume)

    def _mount(self, pod: dict[str, Any]) -> tuple[Path | None, tuple[str, ...]]:
        """What the pod's container is started with, as the kubelet would mount it: the
        Secret behind ``--tls-dir`` and the ConfigMap behind ``--policy``, as files."""
        (container,) = pod["spec"]["containers"]
        args = list(container["args"])
        namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        if "--tls-dir" not in args:
            assert "--insecure" in args, f"{name} has neither --tls-dir nor --insecure"
            return None, ()
        base = self.log_dir / "volumes" / name
        tls_path = args[args.index("--tls-dir") + 1]
        ref = self._volume_at(pod, tls_path)["secret"]["secretName"]
        secret = self._object("secrets", namespace, ref)
        tls_dir = base / "tls"
        tls_dir.mkdir(parents=True, exist_ok=True)
        for key in ("ca.crt", "tls.crt", "tls.key"):
            (tls_dir / key).write_bytes(secret_bytes(secret, key))
        policy: tuple[str, ...] = ()
        if "--policy" in args:
            file = Path(args[args.index("--policy") + 1])
            ref = self._volume_at(pod, str(file.parent))["configMap"]["name"]
            cm = self._object("configmaps", namespace, ref)
            (base / "policy").mkdir(parents=True, exist_ok=True)
            target = base / "policy" / file.name
            target.write_text(cm["data"][file.name])
            policy = ("--policy", str(target))
        return tls_dir, policy

    def _downward(self, pod: dict[str, Any]) -> tuple[str, ...]:
        """The pod's downward-API volume (behind ``--placement-dir``) as the kubelet keeps it:
        ``labels`` and ``annotations`` files, rewritten when they change; and the node the pod
        is bound to, which the kubelet puts in ``$CANOPY_NODE`` at the container's start."""
        (container,) = pod["spec"]["containers"]
        args = list(container["args"])
        if "--placement-dir" not in args:
            return ()
        volume = self._volume_at(pod, args[args.index("--placement-dir") + 1])["downwardAPI"]
        fields = {item["fieldRef"]["fieldPath"]: item["path"] for item in volume["items"]}
        target = self.log_dir / "volumes" / pod["metadata"]["name"] / "placement"
        target.mkdir(parents=True, exist_ok=True)
        for field, path in fields.items():
            values = pod["metadata"].get(field.removeprefix("metadata.")) or {}
            text = "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(values.items()))
            file = target / path
            if not file.exists() or file.read_text() != text:
                tmp = target / f".{path}.tmp"
                tmp.write_text(text)
                tmp.replace(file)
        (env,) = [e for e in container["env"] if e["name"] == "CANOPY_NODE"]
        assert env["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        return ("--placement-dir", str(target), "--node", pod["spec"].get("nodeName", ""))

    def credentials(self, overlay: str, namespace: str = NS) -> Credentials:
        """The overlay's client Secret, as a user would take it out of the cluster."""
        secret = self._object("secrets", namespace, client_secret_name(overlay))
        d = self.log_dir / "clients" / overlay
        d.mkdir(parents=True, exist_ok=True)
        for key in ("ca.crt", "tls.crt", "tls.key"):
            (d / key).write_bytes(secret_bytes(secret, key))
        return Credentials(d / "ca.crt", d / "tls.crt", d / "tls.key")

    async def _spawn(self, pod: str, broker: str, token: str) -> BrokerProc:
        tls_dir, policy = self.security[pod]
        return await spawn_broker(
            broker,
            pki=None,  # with tls_dir None: --insecure, as the pod says
            tls_dir=tls_dir,
            token=token,
            log_dir=self.log_dir,
            extra_args=(*policy, *self.placement.get(pod, ()), *self.broker_args),
        )

    async def _start(self, key: Any, pod: dict[str, Any]) -> None:
        labels = pod["metadata"]["labels"]
        name = pod["metadata"]["name"]
        self.security[name] = self._mount(pod)
        self.placement[name] = self._downward(pod)
        proc = await self._spawn(name, labels[LABEL_BROKER], self.token(labels[LABEL_OVERLAY]))
        self.procs[name] = proc
        self.endpoints[name] = Endpoints(proc.listen, proc.admin_address, proc.link_address)
        self.started.append(name)
        self.emulator.objects[key].patch(
            {
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.1",
                    "conditions": [{"type": "Ready", "status": "True"}],
                }
            }
        )

    async def _loop(self) -> None:
        while True:
            seen = set()
            for key, obj in list(self.emulator.objects.items()):
                if key[0].plural != "pods" or obj.deleted:
                    continue
                name = key[2]
                seen.add(name)
                if name in self.procs:
                    self._downward(obj.raw)  # labels and annotations, as they are now
                if name not in self._starting:
                    self._starting[name] = asyncio.create_task(self._start(key, obj.raw))
            for name in [n for n in self._starting if n not in seen]:
                task = self._starting.pop(name)
                await task
                self.endpoints.pop(name, None)
                proc = self.procs.get(name)
                if proc is not None:  # forgotten once stopped: __aexit__ stops what is left
                    await proc.stop()
                    del self.procs[name]
            await asyncio.sleep(0.05)

    async def restart(self, pod: str, *, after: float = 0.0) -> None:
        """The broker process of ``pod`` dies and the kubelet starts it again (empty state),
        ``after`` seconds later (a crash-looping container's back-off)."""
        proc = self.procs.pop(pod)
        proc.kill()
        await proc.stop()
        await asyncio.sleep(after)
        new = await self._spawn(pod, proc.name, proc.token)
        self.procs[pod] = new
        self.endpoints[pod] = Endpoints(new.listen, new.admin_address, new.link_address)

    async def __aenter__(self) -> Kubelet:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in self._starting.values():
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await asyncio.gather(*(p.stop() for p in self.procs.values()))
        self.procs.clear()


class OperatorThread:
    """The operator in a thread with its own event loop; :meth:`stop` ends it (mid-plan too)."""

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="canopy-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(run_operator(self.config, stop_flag=self._stop, hard_exit=False))
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def start(self) -> OperatorThread:
        self._thread.start()
        return self

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 30)
        assert not self._thread.is_alive(), "the operator did not stop within 30s"
        if self.error is not None:
            raise self.error


def make_config(emulator: kmock.KubernetesEmulator, kubelet: Kubelet) -> OperatorConfig:
    return OperatorConfig(
        server=server_url(emulator),
        resolver=kubelet.resolve,
        ready_within=30.0,
        poll=0.05,
        heal_interval=0.5,
    )


async def get_overlay(api: KubeApi, name: str) -> dict[str, Any]:
    obj = await api.get(f"/apis/canopy.dev/v1alpha1/namespaces/{NS}/brokeroverlays/{name}")
    assert obj is not None
    return obj


def overlay_manifest(
    name: str, brokers: list[str], links: list[tuple[str, str]] | None, **spec: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "canopy.dev/v1alpha1",
        "kind": "BrokerOverlay",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"brokers": [{"name": b} for b in brokers], "maxFanOut": 3, **spec},
    }
    if links is not None:
        body["spec"]["links"] = [list(e) for e in links]
    return body


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return {}


class BrokerView:
    """The kubelet's broker processes of one overlay, shaped like ``procs.Overlay`` for the
    integration tests' traffic helpers."""

    def __init__(self, kubelet: Kubelet, overlay: str, edges: list[tuple[str, str]]) -> None:
        self.kubelet, self.overlay, self.prefix, self.edges = kubelet, overlay, f"{overlay}-", edges

    @property
    def credentials(self) -> Credentials:
        """What the traffic helpers connect with: the overlay's client Secret."""
        return self.kubelet.credentials(self.overlay)

    def __getitem__(self, broker: str) -> Any:
        return self.kubelet.procs[self.prefix + broker]

    @property
    def brokers(self) -> dict[str, Any]:
        return {p.removeprefix(self.prefix): proc for p, proc in self.kubelet.procs.items()}


async def live_traffic(
    view: BrokerView, subscribers: list[str], publishers: list[str], seed: int
) -> Run:
    """A subscriber with two filters on each of ``subscribers`` (settled: routing converged),
    then a paced publisher on each of ``publishers`` (clients s0.., p0..)."""
    run = Run()
    rng = random.Random(seed)
    for i, broker in enumerate(subscribers):
        await run.subscriber(view, f"s{i}", broker, ["qty > 400", random_filter(rng)])  # type: ignore[arg-type]
    run.settled(await converged(view, run))  # type: ignore[arg-type]
    for i, broker in enumerate(publishers):
        await run.publisher(view, f"p{i}", broker, seed=i)  # type: ignore[arg-type]
    return run


async def deliveries(
    view: BrokerView, run: Run, edges: list[tuple[str, str]], within: float = 30
) -> DeliveryReport:
    """Once the routing tables are those of ``edges``: stop publishing, wait for what is owed,
    and check it was delivered exactly once and in order."""
    view.edges = edges
    await converged(view, run)  # type: ignore[arg-type]
    run.stop.set()
    await asyncio.gather(*(c.flush() for name, c in run.clients.items() if name.startswith("p")))
    await run.wait_delivered(within=within)
    await run.finish()
    return check_deliveries(run.subs, run.pubs, run.deliveries)


# -- kubeconfigs, as kubectl reads them ------------------------------------------------------

EXEC_PLUGIN = """\
import json, pathlib, sys
pathlib.Path(sys.argv[1]).write_text("asked")
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1beta1",
                  "kind": "ExecCredential", "status": {"token": "from-the-plugin"}}))
"""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig(tmp_path: Path, url: str) -> Path:
    ca = Authority.create("a client of the API server")
    cert = ca.cert.public_bytes(serialization.Encoding.PEM)
    key = ca.key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    plugin = tmp_path / "plugin.py"
    plugin.write_text(EXEC_PLUGIN)
    exec_user = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": sys.executable,
        "args": [str(plugin), str(tmp_path / "plugin-ran")],
        "interactiveMode": "Never",
    }
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "emulator", "cluster": {"server": url}},
            {"name": "nowhere", "cluster": {"server": "http://127.0.0.1:9"}},
        ],
        "users": [
            {"name": "token", "user": {"token": "t0ken"}},
            {
                "name": "cert",
                "user": {"client-certificate-data": b64(cert), "client-key-data": b64(key)},
            },
            {"name": "exec", "user": {"exec": exec_user}},
        ],
        "contexts": [
            {"name": "good", "context": {"cluster": "emulator", "user": "token"}},
            {"name": "gone", "context": {"cluster": "nowhere", "user": "token"}},
            {"name": "cert", "context": {"cluster": "emulator", "user": "cert"}},
            {"name": "exec", "context": {"cluster": "emulator", "user": "exec"}},
        ],
        "current-context": "gone",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path
