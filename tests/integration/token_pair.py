"""Two linked brokers with TLS and a client policy of two token principals, a writer and a
reader: what the gateway tests (HTTP, MQTT) run against. Each test names what the writer may
publish and the reader may subscribe to."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from canopy_broker.procs import BrokerProc, env_pki, spawn_broker

WRITER, READER = "writer-token-0123456789", "reader-token-0123456789"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_policy(publish: str, subscribe: str) -> str:
    """Deny by default; ``canopy`` (the native clients' certificate) anything; the writer may
    use client ids ``writer``/``writer/*`` and publish ``publish``; the reader likewise may
    subscribe to ``subscribe``."""
    return f"""\
default: deny
principals:
  - name: canopy
    clients: ["*"]
  - name: writer
    tokenSha256: {sha(WRITER)}
    clients: ["writer", "writer/*"]
    publish: ["{publish}"]
    subscribe: []
  - name: reader
    tokenSha256: {sha(READER)}
    clients: ["reader", "reader/*"]
    publish: []
    subscribe: ["{subscribe}"]
"""


async def linked_pair(
    tmp_path: Path, policy: str, *extra: str
) -> tuple[BrokerProc, BrokerProc, Path]:
    """Brokers ``a`` and ``b``, linked, with ``policy`` and ``extra`` flags; and the CA file."""
    pki = env_pki()
    assert pki is not None, "the test session runs brokers with TLS ($CANOPY_PKI)"
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy)
    args = ("--policy", str(policy_file), *extra)
    a, b = await asyncio.gather(
        *(spawn_broker(n, log_dir=tmp_path, extra_args=args) for n in ("a", "b"))
    )
    assert (await a.admin.add_link("b", b.link_address, wait=10))["up"]
    return a, b, pki.ca_path
