"""Where an overlay's certificates come from in Kubernetes: the operator's own CA, or a
cert-manager Issuer the user names in ``spec.security.issuerRef`` (docs/security.md).

Either way every certificate ends up in a ``kubernetes.io/tls`` Secret with ``ca.crt``,
``tls.crt`` and ``tls.key`` (what ``canopy-broker serve --tls-dir`` reads), named as the pods
mount it, so nothing downstream knows which source made it. The two differ in who holds the
CA key and who renews:

* :class:`OwnCa`: the operator keeps the overlay's CA in a Secret, issues each certificate
  itself and renews it in the last third of its validity (:func:`needs_renewal`).
* :class:`CertManager`: the operator writes a cert-manager ``Certificate`` per identity and
  waits for cert-manager to fill its Secret; cert-manager renews, the brokers re-read the
  rewritten files. The CA the brokers and the operator trust is the ``ca.crt`` the Issuer puts
  beside each certificate, so the Issuer must name its CA (the CA and Vault issuers do; ACME
  does not, and is refused with a message saying so).

The operator reaches Kubernetes through :class:`Objects` (get, create, delete), declared here so
that this module sits below the backend that implements it.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cryptography import x509

from canopy_broker.pki import Authority
from canopy_broker.runtime.security import Identity

CERT_MANAGER_GROUP = "cert-manager.io"
ISSUER_KINDS = ("Issuer", "ClusterIssuer")
SCRAPE_NAME = "canopy-broker"
"""A DNS name in every broker certificate, the same for all: the ``serverName`` a scraper
(Prometheus) verifies the admin port's certificate against, since it reaches pods by IP."""


class Objects(Protocol):
    """The Kubernetes API as the certificate sources use it."""

    async def get(self, path: str) -> dict[str, Any] | None: ...

    async def create(self, path: str, body: Mapping[str, Any]) -> bool: ...

    async def delete(self, path: str) -> None: ...


class CertificatesPendingError(RuntimeError):
    """cert-manager has not issued a certificate yet, or issued one Canopy cannot use; the
    reconcile is retried later and the message says what to look at."""


def secrets_path(namespace: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{namespace}/secrets"
    return f"{base}/{name}" if name else base


def certificates_path(namespace: str, name: str = "") -> str:
    base = f"/apis/{CERT_MANAGER_GROUP}/v1/namespaces/{namespace}/certificates"
    return f"{base}/{name}" if name else base


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def secret_bytes(secret: Mapping[str, Any] | None, key: str) -> bytes:
    """A key of a Secret's ``data`` (b"" if absent)."""
    value = ((secret or {}).get("data") or {}).get(key)
    return base64.b64decode(value) if value else b""


def verify_context(ca_pem: bytes) -> ssl.SSLContext:
    """Verifies a broker's admin API certificate against the overlay's CA (in memory); host
    names are not checked (brokers move between addresses), the chain is."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cadata=ca_pem.decode())
    return ctx


def needs_renewal(cert_pem: bytes, now: datetime.datetime | None = None) -> bool:
    """Whether a certificate is in the last third of its validity, when cert-manager renews by
    default: months before a one-year certificate expires, so missed checks (an operator down
    for a week) still leave plenty of time. An unreadable one is renewed too."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        return True
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return (now or datetime.datetime.now(datetime.UTC)) >= end - (end - start) / 3


def uris_of(cert_pem: bytes) -> list[str]:
    """The URI SANs of a PEM certificate ([] if it cannot be read or has none)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return []
    return list(sans.get_values_for_type(x509.UniformResourceIdentifier))


def tls_secret(
    name: str,
    namespace: str,
    *,
    labels: Mapping[str, str],
    owner: Mapping[str, Any],
    authority: Authority,
    identity: Identity,
    hosts: Sequence[str] = (),
) -> dict[str, Any]:
    """A ``kubernetes.io/tls`` Secret for ``identity``, issued by the overlay's CA, with the
    CA's certificate beside it (the layout ``canopy-broker serve --tls-dir`` reads)."""
    cert, key = authority.issue(identity, hosts)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels),
            "annotations": {"canopy.dev/identity": identity.uri},
            "ownerReferences": [dict(owner)],
        },
        "type": "kubernetes.io/tls",
        "data": {"ca.crt": b64(authority.cert_pem), "tls.crt": b64(cert), "tls.key": b64(key)},
    }


async def ensure_tls_secret(
    api: Objects, namespace: str, name: str, make: Callable[[], dict[str, Any]], ca_pem: bytes
) -> str:
    """Create the Secret ``make()`` builds, or make it anew when it was issued by another CA
    (the CA Secret was deleted and made anew) or its certificate is due for renewal; otherwise
    keep it as it is. Returns why an existing Secret was made anew ("" when it was created or
    kept), for an Event. A broker re-reads its rewritten files and resumes its links on new
    connections, losing nothing (docs/security.md)."""
    path = secrets_path(namespace, name)
    current = await api.get(path)
    if current is None:
        if await api.create(secrets_path(namespace), make()):
            return ""
        current = await api.get(path)
    if current is None:
        return ""
    if secret_bytes(current, "ca.crt") != ca_pem:
        why = "issued anew by the overlay's new CA"
    elif needs_renewal(secret_bytes(current, "tls.crt")):
        why = "renewed: its certificate was in the last third of its validity"
    else:
        return ""
    await api.delete(path)  # made anew, not patched: the operator never edits a Secret
    await api.create(secrets_path(namespace), make())
    return why


class Issuing(Protocol):
    """A source of the overlay's certificates (see the module's docstring)."""

    @property
    def renews(self) -> bool:
        """Whether the operator renews what it issued (False: the issuer does)."""
        ...

    @property
    def ca_pem(self) -> bytes:
        """The CA the overlay's certificates chain to (what the operator trusts)."""
        ...

    async def ensure(
        self, name: str, identity: Identity, hosts: Sequence[str], labels: Mapping[str, str]
    ) -> str:
        """Secret ``name`` holds a certificate of ``identity`` for ``hosts``; returns why an
        existing one was made anew ("" if none was)."""
        ...

    async def remove(self, name: str) -> None:
        """The certificate in Secret ``name`` is no longer needed."""
        ...


@dataclass
class OwnCa:
    """The operator as the overlay's CA."""

    api: Objects
    namespace: str
    owner: Mapping[str, Any]
    authority: Authority
    renews: bool = True

    @property
    def ca_pem(self) -> bytes:
        return self.authority.cert_pem

    async def ensure(
        self, name: str, identity: Identity, hosts: Sequence[str], labels: Mapping[str, str]
    ) -> str:
        return await ensure_tls_secret(
            self.api,
            self.namespace,
            name,
            lambda: tls_secret(
                name,
                self.namespace,
                labels=labels,
                owner=self.owner,
                authority=self.authority,
                identity=identity,
                hosts=hosts,
            ),
            self.authority.cert_pem,
        )

    async def remove(self, name: str) -> None:
        await self.api.delete(secrets_path(self.namespace, name))


@dataclass(frozen=True)
class IssuerRef:
    """``spec.security.issuerRef``: the cert-manager Issuer or ClusterIssuer to use."""

    name: str
    kind: str = "Issuer"
    group: str = CERT_MANAGER_GROUP

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


def certificate(
    name: str,
    namespace: str,
    *,
    issuer: IssuerRef,
    identity: Identity,
    hosts: Sequence[str],
    labels: Mapping[str, str],
    owner: Mapping[str, Any],
) -> dict[str, Any]:
    """A cert-manager ``Certificate`` for ``identity`` into Secret ``name``. The identity is the
    URI SAN the brokers check; the key is ECDSA P-256 like the operator's own, made anew at
    each renewal; the certificate serves both ends of a TLS connection (links are mutual)."""
    spec: dict[str, Any] = {
        "secretName": name,
        "issuerRef": {"name": issuer.name, "kind": issuer.kind, "group": issuer.group},
        "commonName": identity.name,
        "uris": [identity.uri],
        "usages": ["digital signature", "key encipherment", "server auth", "client auth"],
        "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
        "secretTemplate": {"labels": dict(labels)},
    }
    if hosts:
        spec["dnsNames"] = list(hosts)
    return {
        "apiVersion": f"{CERT_MANAGER_GROUP}/v1",
        "kind": "Certificate",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels),
            "ownerReferences": [dict(owner)],
        },
        "spec": spec,
    }


@dataclass
class CertManager:
    """cert-manager as the overlay's CA, through ``issuer``."""

    api: Objects
    namespace: str
    owner: Mapping[str, Any]
    issuer: IssuerRef
    within: float = 60.0  # how long to wait for cert-manager to fill a Secret
    poll: float = 0.5
    renews: bool = False
    _ca: bytes = b""

    @property
    def ca_pem(self) -> bytes:
        return self._ca

    async def ensure(
        self, name: str, identity: Identity, hosts: Sequence[str], labels: Mapping[str, str]
    ) -> str:
        await self.api.create(
            certificates_path(self.namespace),
            certificate(
                name,
                self.namespace,
                issuer=self.issuer,
                identity=identity,
                hosts=hosts,
                labels=labels,
                owner=self.owner,
            ),
        )
        deadline = time.monotonic() + self.within
        while True:
            secret = await self.api.get(secrets_path(self.namespace, name))
            cert = secret_bytes(secret, "tls.crt")
            if identity.uri in uris_of(cert):
                break
            if time.monotonic() > deadline:
                raise CertificatesPendingError(
                    f"cert-manager has not issued Secret {name} for {identity.uri} within "
                    f"{self.within:g}s (kubectl describe certificate {name} -n {self.namespace};"
                    f" issuer {self.issuer})"
                )
            await asyncio.sleep(self.poll)
        ca = secret_bytes(secret, "ca.crt")
        if not ca:
            raise CertificatesPendingError(
                f"Secret {name} from {self.issuer} has no ca.crt: the brokers need the CA to "
                "verify each other; use an issuer that names its CA (CA, Vault), not ACME"
            )
        self._ca = ca
        return ""

    async def remove(self, name: str) -> None:
        await self.api.delete(certificates_path(self.namespace, name))
        await self.api.delete(secrets_path(self.namespace, name))  # cert-manager leaves it
