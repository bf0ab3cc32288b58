"""A small certificate authority for one overlay (issue 14, item 6).

``canopy up`` (and every test overlay) keeps one in its state directory, created on first use
without any flag: the CA, a certificate per broker (``canopy://broker/NAME``), a client
certificate for the local user, the admin token and the client policy. Keys are written with
mode 0600 in a 0700 directory. In Kubernetes the operator uses the same functions to fill the
overlay's Secrets (see canopy_operator).

ECDSA P-256 keys: a handshake costs a fraction of an RSA one, and every TLS stack speaks it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from canopy_broker.client.credentials import LOCAL_CLIENT
from canopy_broker.runtime.security import BROKER, CLIENT, Identity, TlsFiles

CA_DAYS = 3650
CERT_DAYS = 365


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write_private(path: Path, data: bytes) -> None:
    """Write with mode 0600 from the start (never readable by others, not even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@dataclass(frozen=True)
class Authority:
    """A CA's certificate and key, in memory."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, common_name: str = "canopy overlay CA") -> Authority:
        key = _key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes) -> Authority:
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("the CA key is not an EC key")
        return cls(x509.load_pem_x509_certificate(cert_pem), key)

    def issue(
        self, identity: Identity, hosts: Iterable[str] = (), days: int = CERT_DAYS
    ) -> tuple[bytes, bytes]:
        """A certificate for ``identity`` (and ``hosts``, DNS names or IPs, for tools that
        check them): returns (certificate PEM, key PEM)."""
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
        for h in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                names.append(x509.DNSName(h))
        usage = (
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            if identity.kind == BROKER  # a broker both accepts and dials links
            else [ExtendedKeyUsageOID.CLIENT_AUTH]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        return _cert_pem(cert), _key_pem(key)

    @property
    def cert_pem(self) -> bytes:
        return _cert_pem(self.cert)

    @property
    def key_pem(self) -> bytes:
        return _key_pem(self.key)


class LocalPki:
    """The credentials of a local overlay, in a directory (``STATE_DIR/pki`` for
    ``canopy up``; created on first use)::

    ca.pem  ca.key                   the overlay's CA
    brokers/NAME.pem  NAME.key       one per broker (also serves its admin API)
    clients/NAME.pem  NAME.key       client certificates (canopy: the local user)
    admin-token                      the brokers' admin bearer token
    policy.yaml                      who may publish and subscribe what (hot-reloaded)
    """

    def __init__(self, pki_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(pki_dir)
        self._ca: Authority | None = None

    @property
    def ca_path(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def policy_path(self) -> Path:
        return self.dir / "policy.yaml"

    def ensure(self) -> LocalPki:
        """Create the directory, CA, admin token, policy and the local user's client
        certificate if missing; idempotent."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        if not self.ca_path.exists():
            ca = Authority.create()
            _write_private(self.dir / "ca.key", ca.key_pem)
            self.ca_path.write_bytes(ca.cert_pem)
            self._ca = ca
        token = self.dir / "admin-token"
        if not token.exists():
            _write_private(token, secrets.token_urlsafe(24).encode())
        if not self.policy_path.exists():
            self.policy_path.write_text(permissive_policy(LOCAL_POLICY_HEADER))
        self.client()
        return self

    def authority(self) -> Authority:
        if self._ca is None:
            if not self.ca_path.exists():
                self.ensure()  # creates it
            else:
                self._ca = Authority.from_pem(
                    self.ca_path.read_bytes(), (self.dir / "ca.key").read_bytes()
                )
        assert self._ca is not None
        return self._ca

    def _files(self, kind: str, name: str, hosts: Iterable[str]) -> TlsFiles:
        sub = self.dir / ("brokers" if kind == BROKER else "clients")
        cert, key = sub / f"{name}.pem", sub / f"{name}.key"
        if not (cert.exists() and key.exists()):
            sub.mkdir(exist_ok=True, mode=0o700)
            cert_pem, key_pem = self.authority().issue(Identity(kind, name), hosts)
            _write_private(key, key_pem)
            cert.write_bytes(cert_pem)
        return TlsFiles(self.ca_path, cert, key)

    def broker(self, name: str) -> TlsFiles:
        """The broker's certificate (issued on first use, for 127.0.0.1 and localhost too)."""
        return self._files(BROKER, name, ("127.0.0.1", "localhost"))

    def client(self, name: str = LOCAL_CLIENT) -> TlsFiles:
        return self._files(CLIENT, name, ())

    def serve_args(self, name: str) -> list[str]:
        """``canopy-broker serve`` flags for broker ``name``: its TLS material and the policy."""
        files = self.broker(name)
        return [
            "--tls-ca",
            str(files.ca),
            "--tls-cert",
            str(files.cert),
            "--tls-key",
            str(files.key),
            "--policy",
            str(self.policy_path),
        ]

    def verify_context(self) -> ssl.SSLContext:
        """Verifies a broker's certificate (for its admin API): the CA only, no identity."""
        return TlsFiles(self.ca_path).client_context()

    def admin_token(self) -> str:
        self.ensure()
        return (self.dir / "admin-token").read_text().strip()


LOCAL_POLICY_HEADER = f"""\
# Who may publish and subscribe what on this overlay (docs/security.md). Edited files are
# picked up by the brokers within a few seconds.
#
# A principal is a client certificate's name (canopy://client/NAME) or a bearer token's
# principal (tokenSha256: the sha256 of the token). clients: the client ids it may use
# (default: NAME and NAME/*). publish / subscribe: filters; a subscription must be covered by
# one, a publication matched by one (left out: anything; []: nothing).
# {LOCAL_CLIENT} is the local user (pki/clients/{LOCAL_CLIENT}.pem): any client id.
"""


def permissive_policy(header: str) -> str:
    """The policy an overlay starts with (``canopy up``, and the operator when the spec has
    none): the local user's principal may use any client id; anybody else with a certificate
    of the overlay, anything under their own ids. ``header``: comments for the reader."""
    return f"""{header}\
default: allow  # principals not listed: anything, under their own client ids
principals:
  - name: {LOCAL_CLIENT}
    clients: ["*"]
"""
