"""The operator process: kopf's handlers for BrokerOverlay and TopologyProposal (a fresh registry
per run, :func:`build_registry`), how it logs in, and :func:`run_operator`, which runs them
under leader election (one active replica; the others wait for the Lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import aiohttp
import kopf

from canopy_broker.admin_client import AdminError
from canopy_operator.backends.certs import (
    CertificatesPendingError,
)
from canopy_operator.backends.kube import (
    GROUP,
    PLURAL,
    PROPOSALS,
    VERSION,
    KubeApi,
    KubeConfigError,
    KubeError,
    core_path,
    load_credentials,
)
from canopy_operator.backends.leader import Elector, run_as_leader
from canopy_operator.backends.manifests import LABEL_OVERLAY
from canopy_operator.backends.proposal_keeper import keep_proposal, recheck_proposals
from canopy_operator.backends.reconciler import (
    PLAN_LENGTH,
    RECONCILE_SECONDS,
    OperatorConfig,
    Reconciler,
    heal,
)
from canopy_operator.model.proposals import (
    BOOKKEEPING_PREFIX,
)

log = logging.getLogger("canopy.operator")


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
        if info is not None:
            if config.api is None:
                config.api = KubeApi.from_connection(info)
            else:  # kopf logs in again when the old credentials are refused (expired token)
                config.api.use(info)
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


def connection_info(config: OperatorConfig, **_: Any) -> kopf.ConnectionInfo | None:
    """How to reach the API server: ``--server`` if given, else through the official client's
    loaders, the way kubectl does: ``--kubeconfig``/``--context`` if given, else the pod's
    service account, else ``$KUBECONFIG`` or ``~/.kube/config`` (client certificates, tokens and
    exec credential plugins included). kopf and the operator's own requests use the same."""
    if config.server:
        return kopf.ConnectionInfo(
            server=config.server, token=config.token, insecure=config.insecure
        )
    try:
        return load_credentials(config.kubeconfig, config.context, in_cluster_first=True)
    except KubeConfigError as exc:
        raise kopf.LoginError(str(exc)) from None


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
    info = await asyncio.to_thread(connection_info, config)  # an exec plugin may run
    if info is None:
        raise RuntimeError("leader election: no way to reach the API server")
    lease_api = KubeApi.from_connection(info)

    def stopping() -> bool:
        return bool(stop_flag is not None and stop_flag.is_set())

    try:
        await run_as_leader(Elector(lease_api, config.leader), operate, stopping, liveness)
    finally:
        await lease_api.close()
