"""The Kubernetes backend of the shared executor: one Pod per broker (``<overlay>-<broker>``, not
a StatefulSet: brokers are not interchangeable), created, waited for, asked for their links
over their admin API and deleted (:class:`KubernetesBackend`), and the live tree read from them
(:func:`live_tree`). The objects themselves are described in :mod:`.manifests`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from canopy_broker.admin_client import AdminClient
from canopy_broker.runtime.placement import HOLD_ANNOTATION, ZONE_ANNOTATION, ZONE_LABEL
from canopy_broker.runtime.security import BROKER, Identity
from canopy_operator.backends.certs import (
    SCRAPE_NAME,
    Issuing,
    verify_context,
)
from canopy_operator.backends.kube import KubeApi, KubeError, core_path
from canopy_operator.backends.manifests import (
    DEFAULT_IMAGE,
    LABEL_BROKER,
    LABEL_OVERLAY,
    TEMPLATE_HASH,
    Endpoints,
    Resolver,
    client_hold,
    dns_resolver,
    pod_manifest,
    pod_name,
    pod_ready,
    service_name,
    template_hash,
    tls_secret_name,
)
from canopy_operator.model.planner import (
    LiveOverlay,
)
from canopy_operator.model.restore import (
    status_neighbours,
)
from canopy_operator.model.topology import OverlaySpec, norm

log = logging.getLogger("canopy.operator")


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

    async def annotate_holds(self) -> dict[str, str | None]:
        """Give each broker pod the client hold its overlay's size asks for now
        (:func:`~canopy_operator.backends.manifests.client_hold`). A pod gets it when created;
        an overlay grown from one broker to more, or shrunk to one, changes what its running
        pods need: a container restarted in place reads it through the downward API at start
        (an unlinked broker taking clients routes their events to nobody; a lone one held
        would refuse them for nothing). Returns what was changed (None: removed)."""
        want = client_hold(self.spec)
        changed: dict[str, str | None] = {}
        for broker, pod in sorted((await self.pods()).items()):
            meta = pod.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                continue
            if (meta.get("annotations") or {}).get(HOLD_ANNOTATION) != want:
                try:
                    await self.api.patch(
                        self._pod_path(broker),
                        {"metadata": {"annotations": {HOLD_ANNOTATION: want}}},
                    )
                except KubeError as exc:  # deleted since it was listed: the next heal sees
                    log.info("pod of %s not annotated: %s", broker, exc)
                    continue
                changed[broker] = want
        return changed

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

    async def gone(self, name: str) -> bool:
        """No pod, or one being deleted or ended for good. A container restarted in place is
        not gone: it answers again under a new incarnation, which the brokers tell apart."""
        pod = await self.api.get(self._pod_path(name))
        if pod is None or (pod.get("metadata") or {}).get("deletionTimestamp"):
            return True
        return (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded")

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
