"""The Kubernetes API as the operator speaks it: a small aiohttp client (get, list, create,
merge-patch, delete; nothing the operator does not use) and the paths of the objects it touches.

Credentials come from the official ``kubernetes`` package's loaders
(:func:`load_credentials`: kubeconfig contexts, tokens, client certificates, exec credential
plugins, the pod's service account), for the operator as for the CLI's cluster commands. The
transport is aiohttp, as kopf's own API client is: the operator is asynchronous, and the
official client's calls would each need a thread. The same client runs against a cluster and
against kmock's emulator in the tests.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

GROUP, VERSION, PLURAL, KIND = "canopy.dev", "v1alpha1", "brokeroverlays", "BrokerOverlay"
PROPOSALS = "topologyproposals"


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
    def from_connection(
        cls, info: kopf.ConnectionInfo, user_agent: str = "canopy-operator"
    ) -> KubeApi:
        return cls(info.server, user_agent=user_agent, **_tls_of(info))

    def use(self, info: kopf.ConnectionInfo) -> None:
        """Take fresh credentials (kopf logs in again when the API refuses the old ones, e.g.
        an exec plugin's token expired); requests already sent finish with the old ones."""
        fresh = KubeApi.from_connection(info, self._headers["User-Agent"])
        self.server, self._headers, self._ssl = fresh.server, fresh._headers, fresh._ssl

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


def _tls_of(info: kopf.ConnectionInfo) -> dict[str, Any]:
    def path(p: object) -> str | None:
        return os.fsdecode(p) if p else None  # type: ignore[arg-type]

    return {
        "token": info.token,
        "ca_path": path(info.ca_path),
        "cert_path": path(info.certificate_path),
        "key_path": path(info.private_key_path),
        "insecure": bool(info.insecure),
    }


class KubeConfigError(Exception):
    """No usable credentials: the message names the kubeconfig and what is wrong with it."""


def load_credentials(
    kubeconfig: str | None = None, context: str | None = None, *, in_cluster_first: bool = False
) -> kopf.ConnectionInfo:
    """Server, token and TLS files from the official client's loaders: a kubeconfig (its
    current context, or ``context``) with tokens, client certificates or exec credential
    plugins, or the pod's service account (first, with ``in_cluster_first``, unless a
    kubeconfig or context is named). Blocking: an exec plugin is a subprocess."""
    from kubernetes import client, config  # noqa: PLC0415  (a second to import)

    cfg = client.Configuration()
    default = os.path.expanduser("~/.kube/config")
    explicit = kubeconfig or os.environ.get("KUBECONFIG")
    in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    try:
        if (
            in_pod
            and (in_cluster_first or not (explicit or os.path.exists(default)))
            and not (kubeconfig or context)
        ):
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        elif explicit or context or os.path.exists(default):
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, context=context, client_configuration=cfg
            )
        else:
            raise KubeConfigError(
                "no cluster: give --kubeconfig or --server, set $KUBECONFIG, or run in a pod"
            )
    except config.ConfigException as exc:
        where = kubeconfig or explicit or default
        raise KubeConfigError(f"cannot use kubeconfig {where}: {exc}") from None
    except OSError as exc:
        raise KubeConfigError(f"cannot read kubeconfig: {exc}") from None
    token = str(cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken") or "")
    return kopf.ConnectionInfo(
        server=cfg.host,
        token=token.removeprefix("Bearer ").strip() or None,
        ca_path=cfg.ssl_ca_cert,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        insecure=not cfg.verify_ssl,
    )


def overlay_path(namespace: str, name: str = "") -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    return f"{base}/{name}" if name else base


def core_path(namespace: str, plural: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{namespace}/{plural}"
    return f"{base}/{name}" if name else base


def proposal_path(namespace: str, name: str = "") -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PROPOSALS}"
    return f"{base}/{name}" if name else base
