"""How a client proves who it is to a broker, and checks that the broker is the overlay's.

:class:`Credentials` holds the overlay's CA and either a client certificate and key, or a
bearer token (with the CA to verify the broker). ``connect()`` without credentials takes them
from the environment, the way libpq and kubectl do:

* ``CANOPY_CA``, ``CANOPY_CERT``, ``CANOPY_KEY``, ``CANOPY_TOKEN``: explicit files and token;
* otherwise ``CANOPY_PKI``: a local overlay's ``pki`` directory (``canopy up`` makes one in
  its state directory), whose ``canopy`` client certificate is used.

With none of these the client speaks plaintext, which only a broker started with
``--insecure`` accepts.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from canopy_broker.runtime.security import TlsFiles

ENV_CA, ENV_CERT, ENV_KEY, ENV_TOKEN, ENV_PKI = (
    "CANOPY_CA",
    "CANOPY_CERT",
    "CANOPY_KEY",
    "CANOPY_TOKEN",
    "CANOPY_PKI",
)
LOCAL_CLIENT = "canopy"  # pki/clients/canopy.pem: the local user (see canopy_broker.pki)


@dataclass(frozen=True)
class Credentials:
    """TLS material and/or a bearer token; ``Credentials()`` is plaintext."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    token: str | None = None

    @property
    def secure(self) -> bool:
        return self.ca is not None

    def ssl_context(self) -> ssl.SSLContext | None:
        """The context for dialing a broker: the chain must lead to the CA."""
        return self._ssl_context

    @cached_property
    def _ssl_context(self) -> ssl.SSLContext | None:  # built once per credentials
        if self.ca is None:
            return None
        return TlsFiles(self.ca, self.cert, self.key).check().client_context()

    @classmethod
    def from_pki(cls, pki_dir: str | os.PathLike[str], client: str = LOCAL_CLIENT) -> Credentials:
        """A local overlay's ``pki`` directory: its CA and a client's certificate."""
        d = Path(pki_dir)
        return cls(d / "ca.pem", d / "clients" / f"{client}.pem", d / "clients" / f"{client}.key")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credentials:
        env = os.environ if env is None else env
        token = env.get(ENV_TOKEN) or None
        if env.get(ENV_CA):
            cert, key = env.get(ENV_CERT), env.get(ENV_KEY)
            return cls(
                Path(env[ENV_CA]),
                Path(cert) if cert else None,
                Path(key) if key else None,
                token,
            )
        if env.get(ENV_PKI):
            creds = cls.from_pki(env[ENV_PKI])
            return creds if token is None else cls(creds.ca, token=token)
        return cls(token=token)
