"""Who may connect, as what, and do what (issue 14; the model is in docs/security.md).

Three questions, answered here and nowhere else:

* **Who is at the other end of a connection?** An :class:`Identity` read from the peer's TLS
  certificate (its ``canopy://broker/NAME`` or ``canopy://client/NAME`` URI SAN, in a chain that
  the overlay's CA signed), or a client's bearer token looked up in the :class:`Policy`. TLS
  verifies the chain; this module only reads the names, so a certificate of another CA never
  gets this far (its handshake fails).
* **May it be what it says?** A link hello must come from the broker certificate of the broker
  it names; a dialed broker must answer with the certificate of the broker we meant to reach.
  A client's id must be one its principal may use (its name or ``NAME/...`` by default), so no
  client publishes under another's id: the broker stamps that id on every notification.
* **May it publish this, subscribe to that?** Content-based authorisation: a principal's allowed
  subscriptions and publications are filters of the same language. A subscription is allowed iff
  an allowed filter *covers* it (every event it can match, the principal may see); a publication
  iff an allowed publish filter *matches* it.

The checks are pure functions of the identity, the policy and the request; the broker calls
them at its one boundary (the hello, a client message) and turns a refusal into an error frame
that closes only that connection.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from canopy_broker.core.events import Value
from canopy_broker.core.filters import Filter, FilterError, covers

URI_PREFIX = "canopy://"
BROKER, CLIENT = "broker", "client"


class SecurityError(ValueError):
    """Bad security material or policy: raised at start-up or reload, with what is wrong."""


class AccessError(Exception):
    """A connection or request that security refuses; ``code`` goes into the error frame."""

    def __init__(self, message: str, code: str = "unauthenticated") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Identity:
    """What the other end proved: its kind (broker or client) and name."""

    kind: str
    name: str

    @property
    def uri(self) -> str:
        return f"{URI_PREFIX}{self.kind}/{self.name}"

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


def identity_of(cert: Mapping[str, Any] | None) -> Identity | None:
    """The canopy identity in a verified peer certificate (``SSLObject.getpeercert()``)."""
    if not cert:
        return None
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "URI" and isinstance(value, str) and value.startswith(URI_PREFIX):
            role, _, name = value[len(URI_PREFIX) :].partition("/")
            if role in (BROKER, CLIENT) and name:
                return Identity(role, name)
    return None


def transport_identity(transport: Any) -> Identity | None:
    """The identity of an asyncio transport's peer (None: plaintext, or no certificate)."""
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    return None if ssl_object is None else identity_of(ssl_object.getpeercert())


# --------------------------------------------------------------------------- TLS material


def file_stamp(path: str | os.PathLike[str] | None) -> tuple[int, int] | None:
    """A file's modification time and size (None: no such file): what a broker compares to
    notice that its policy or TLS files were rewritten."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: the overlay's CA, and this party's certificate and key (optional for a
    client that authenticates with a token)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def check(self) -> TlsFiles:
        for what, path in (("CA", self.ca), ("certificate", self.cert), ("key", self.key)):
            if path is not None and not Path(path).is_file():
                raise SecurityError(f"TLS {what} file {path} does not exist")
        if (self.cert is None) != (self.key is None):
            raise SecurityError("a TLS certificate needs its key, and a key its certificate")
        return self

    def _load(self, ctx: ssl.SSLContext) -> ssl.SSLContext:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_verify_locations(cafile=str(self.ca))
            if self.cert is not None:
                ctx.load_cert_chain(str(self.cert), str(self.key))
        except (ssl.SSLError, OSError) as exc:
            raise SecurityError(f"cannot load TLS material ({self}): {exc}") from None
        return ctx

    def server_context(self, *, require_certificate: bool = False) -> ssl.SSLContext:
        """For a listener. Client certificates are verified when presented (a client may use
        a token instead); whether one was *required* is decided at the hello, by role."""
        if self.cert is None:
            raise SecurityError("a TLS listener needs a certificate and key")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.verify_mode = ssl.CERT_REQUIRED if require_certificate else ssl.CERT_OPTIONAL
        return self._load(ctx)

    def client_context(self) -> ssl.SSLContext:
        """For dialing. The chain is verified against the overlay's CA; host names are not
        (brokers move between addresses): the peer's canopy identity is checked instead."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        return self._load(ctx)

    def stamp(self) -> tuple[tuple[int, int] | None, ...]:
        """What changes when the files are rewritten (rotation): their mtimes and sizes."""
        return tuple(file_stamp(path) for path in (self.ca, self.cert, self.key))

    def reload(self, *contexts: ssl.SSLContext) -> None:
        """Load rotated material into live contexts: new handshakes use the new certificate,
        and the new CA is trusted *besides* the old one (a rollover needs both for a while;
        a restart forgets the old). Connections already up keep their session."""
        for ctx in contexts:
            self._load(ctx)

    def __str__(self) -> str:
        return f"CA {self.ca}, certificate {self.cert}, key {self.key}"


# --------------------------------------------------------------------------- policy


def token_digest(token: str) -> str:
    """How a policy stores a bearer token: its SHA-256, never the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Permissions:
    """What one principal may do. ``None``: anything; ``()``: nothing."""

    clients: tuple[str, ...] = ()  # client-id patterns (fnmatch); () means NAME and NAME/*
    publish: tuple[Filter, ...] | None = None
    subscribe: tuple[Filter, ...] | None = None

    def may_use_id(self, principal: str, client_id: str) -> bool:
        patterns = self.clients or (principal, f"{principal}/*")
        return any(fnmatch.fnmatchcase(client_id, p) for p in patterns)

    def may_subscribe(self, f: Filter) -> bool:
        return self.subscribe is None or any(covers(a, f) for a in self.subscribe)

    def may_publish(self, attrs: Mapping[str, Value]) -> bool:
        return self.publish is None or any(a.matches(attrs) for a in self.publish)


ANYTHING = Permissions()


@dataclass(frozen=True)
class Policy:
    """Principals and their permissions, and the bearer tokens that stand for them.

    A principal not listed gets ``default`` (anything, under its own client ids), unless the
    policy says ``default: deny``."""

    principals: Mapping[str, Permissions] = field(default_factory=dict)
    tokens: Mapping[str, str] = field(default_factory=dict)  # sha256 hex -> principal
    default: Permissions | None = ANYTHING
    source: str = "built-in default"

    def permissions(self, principal: str) -> Permissions | None:
        return self.principals.get(principal, self.default)

    def principal_for_token(self, token: str) -> str | None:
        digest = token_digest(token)
        found = None
        for known, principal in self.tokens.items():  # every entry: no early exit to time
            if hmac.compare_digest(known, digest):
                found = principal
        return found

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Policy:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise SecurityError(f"cannot read the policy {path}: {exc}") from None
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SecurityError(f"policy {path} is not YAML: {exc}") from None
        return cls.from_dict(doc or {}, source=str(path))

    @classmethod
    def from_dict(cls, doc: object, source: str = "inline") -> Policy:
        """Parse a policy document (see docs/security.md); errors name the entry at fault."""
        if not isinstance(doc, dict):
            raise SecurityError(f"{source}: a policy is a mapping, got {type(doc).__name__}")
        unknown = set(doc) - {"principals", "default"}
        if unknown:
            raise SecurityError(f"{source}: unknown keys {sorted(unknown)}")
        default: Permissions | None = ANYTHING
        raw_default = doc.get("default", "allow")
        if raw_default == "deny":
            default = None
        elif raw_default != "allow":
            raise SecurityError(f"{source}: default must be allow or deny, got {raw_default!r}")
        principals: dict[str, Permissions] = {}
        tokens: dict[str, str] = {}
        entries = doc.get("principals") or []
        if not isinstance(entries, list):
            raise SecurityError(f"{source}: principals must be a list")
        for i, entry in enumerate(entries):
            where = f"{source}: principals[{i}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise SecurityError(f"{where}: each principal is a mapping with a 'name'")
            name = entry["name"]
            extra = set(entry) - {"name", "clients", "publish", "subscribe", "tokenSha256"}
            if extra:
                raise SecurityError(f"{where} ({name}): unknown keys {sorted(extra)}")
            if name in principals:
                raise SecurityError(f"{where}: principal {name!r} is listed twice")
            principals[name] = Permissions(
                clients=tuple(_strings(entry.get("clients", []), f"{where}.clients")),
                publish=_filters(entry.get("publish"), f"{where}.publish"),
                subscribe=_filters(entry.get("subscribe"), f"{where}.subscribe"),
            )
            digest = entry.get("tokenSha256")
            if digest is not None:
                if not isinstance(digest, str) or len(digest) != 64:
                    raise SecurityError(f"{where}.tokenSha256: 64 hex digits (sha256 of it)")
                tokens[digest.lower()] = name
        return cls(principals, tokens, default, source)


def _strings(value: object, where: str) -> Sequence[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise SecurityError(f"{where}: a list of non-empty strings, got {value!r}")
    return value


def _filters(value: object, where: str) -> tuple[Filter, ...] | None:
    if value is None:
        return None
    out = []
    for text in _strings(value, where):
        try:
            out.append(Filter.parse(text))
        except FilterError as exc:
            raise SecurityError(f"{where}: {text!r} is not a filter: {exc}") from None
    return tuple(out)


# --------------------------------------------------------------------------- the checks


def check_link_peer(identity: Identity | None, claimed: str, *, secure: bool) -> None:
    """A broker-to-broker connection: the certificate must be the named broker's."""
    if not secure:
        return
    if identity is None:
        raise AccessError(f"a broker link needs a broker certificate; {claimed!r} showed none")
    if identity.kind != BROKER or identity.name != claimed:
        raise AccessError(f"{identity} may not link as broker {claimed!r}", "wrong-identity")


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated client: its name and what it may do."""

    name: str
    permissions: Permissions
    via: str  # "certificate" | "token" | "insecure"


def authenticate_client(
    identity: Identity | None,
    token: object,
    client_id: str | None,
    policy: Policy,
    *,
    secure: bool,
) -> Principal:
    """The principal behind a client hello, and the check of the client id it claims."""
    if not secure:
        return Principal("anonymous", ANYTHING, "insecure")
    if identity is not None and identity.kind == CLIENT:
        name, via = identity.name, "certificate"
    elif isinstance(token, str) and token:
        found = policy.principal_for_token(token)
        if found is None:
            raise AccessError("unknown bearer token")
        name, via = found, "token"
    elif identity is not None:
        raise AccessError(f"{identity} is not a client certificate", "wrong-identity")
    else:
        raise AccessError("a client needs a client certificate or a bearer token")
    perms = policy.permissions(name)
    if perms is None:
        raise AccessError(
            f"principal {name!r} is not allowed here (policy default: deny)", "forbidden"
        )
    if client_id is not None and not perms.may_use_id(name, client_id):
        raise AccessError(f"principal {name!r} may not use client id {client_id!r}", "forbidden")
    return Principal(name, perms, via)
