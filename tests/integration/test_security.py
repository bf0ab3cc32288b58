"""Issue 14 on real processes: an overlay started with its own CA and policy, honest traffic
flowing, and the attacks a stranger or a misbehaving client would try. Each is refused (and
counted), and the honest subscriber still gets every notification once, in order."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from canopy_broker.client import Client, ClientError, Credentials, Notification, connect
from canopy_broker.pki import Authority, LocalPki
from canopy_broker.procs import Overlay
from canopy_broker.runtime.framing import FrameSplitter, control_frame, loads_frame
from canopy_broker.runtime.security import BROKER, CLIENT, Identity, TlsFiles, token_digest
from tests.integration.crash_overlay import drain

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-for-the-dashboard"
POLICY = f"""
default: deny
principals:
  - name: canopy
    clients: ["*"]
  - name: sensors
    publish: ["kind = 'temp'"]
    subscribe: []
  - name: dashboard
    tokenSha256: {token_digest(TOKEN)}
    subscribe: ["kind = 'temp' and site = 'lab'"]
    publish: []
  - name: mallory
"""


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Overlay]:
    pki = LocalPki(tmp_path / "pki").ensure()
    pki.policy_path.write_text(POLICY)
    async with Overlay(["b1", "b2"], [("b1", "b2")], log_dir=tmp_path, pki=pki) as ov:
        yield ov


def creds(ov: Overlay, principal: str) -> Credentials:
    assert ov.pki is not None
    files = ov.pki.client(principal)
    return Credentials(files.ca, files.cert, files.key)


async def said(ctx: ssl.SSLContext | None, address: str, hello: dict[str, object]) -> bytes:
    """Connect, say ``hello``, return what the broker says until it closes the connection."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), ssl=ctx)
    try:
        writer.write(control_frame(0, hello))
        async with asyncio.timeout(5):
            return await reader.read()
    finally:
        writer.transport.abort()


async def answer_or_nothing(ctx: ssl.SSLContext | None, address: str) -> bytes:
    """What a link hello gets when TLS itself refuses the peer: nothing (with TLS 1.3 the
    client learns of its rejected certificate at its first read, as an alert or a reset)."""
    try:
        return await said(ctx, address, LINK_HELLO)
    except (ssl.SSLError, ConnectionError):
        return b""


def refusal(data: bytes) -> list[object]:
    """The first frame the broker sent: its error frame [7, code, message], as [7, code]."""
    first = next(loads_frame(p) for p in FrameSplitter().feed(data))
    return list(first[:2])


def context_as(ov: Overlay, kind: str, name: str) -> ssl.SSLContext:
    assert ov.pki is not None
    files = ov.pki.broker(name) if kind == BROKER else ov.pki.client(name)
    return files.client_context()


LINK_HELLO = {"v": 1, "role": "link", "name": "b1", "session": "x", "resume": False, "last_rx": 0}


async def test_strangers_are_refused_while_honest_traffic_flows(
    secured: Overlay, tmp_path: Path
) -> None:
    ov = secured
    sub = await connect(ov["b2"].listen, "honest-sub", credentials=ov.credentials)
    await sub.subscribe("n >= 0")
    await ov.settle()
    got: list[Notification] = []
    reader = asyncio.create_task(drain(sub, got))
    pub = await connect(ov["b1"].listen, "honest-pub", credentials=ov.credentials)

    async def publish() -> None:
        for i in range(1, 2001):
            await pub.publish({"n": i})
            if i % 100 == 0:
                await asyncio.sleep(0.01)

    publishing = asyncio.create_task(publish())
    b2, b2_link = ov["b2"].listen, ov["b2"].link_address
    assert b2 != b2_link  # separate listeners: clients here, brokers there
    assert ov.pki is not None
    plain_ca = TlsFiles(ov.pki.ca_path).client_context()  # verifies the broker, shows nothing

    # 1. No certificate at all, claiming to be neighbour b1: the link port wants one (the
    # handshake fails), and the client port takes no brokers.
    assert await answer_or_nothing(plain_ca, b2_link) == b""
    assert refusal(await said(plain_ca, b2, LINK_HELLO)) == [7, "wrong-port"]
    # 2. A client's certificate, claiming to be a broker.
    client_ctx = context_as(ov, CLIENT, "mallory")
    assert refusal(await said(client_ctx, b2_link, LINK_HELLO)) == [7, "wrong-identity"]
    # 3. A real broker certificate of this overlay, but for another name than the hello's; and
    # the right one, on the client port.
    evil = context_as(ov, BROKER, "evil")
    assert refusal(await said(evil, b2_link, LINK_HELLO)) == [7, "wrong-identity"]
    assert refusal(await said(context_as(ov, BROKER, "b1"), b2, LINK_HELLO)) == [7, "wrong-port"]
    # 4. A certificate from another CA: the TLS handshake fails, no hello is read.
    other = Authority.create("somebody else's CA")
    d = tmp_path / "other"
    d.mkdir()
    cert, key = other.issue(Identity(BROKER, "b1"))
    (d / "ca.pem").write_bytes(other.cert_pem)
    (d / "b1.pem").write_bytes(cert)
    (d / "b1.key").write_bytes(key)
    foreign = TlsFiles(ov.pki.ca_path, d / "b1.pem", d / "b1.key").client_context()
    assert await answer_or_nothing(foreign, b2_link) == b""
    assert await answer_or_nothing(foreign, b2) == b""
    # 5. Plaintext: not even TLS. The broker's TLS layer drops it.
    assert await answer_or_nothing(None, b2_link) == b""
    assert await answer_or_nothing(None, b2) == b""
    # 6. A client without a certificate or token.
    with pytest.raises(ClientError, match="unauthenticated"):
        await connect(b2, "nobody", credentials=Credentials(ov.pki.ca_path), failover_within=0)
    # 7. A client claiming another principal's id.
    with pytest.raises(ClientError, match="forbidden"):
        await connect(b2, "sensors", credentials=creds(ov, "mallory"), failover_within=0)
    # 8. An honest client on the link port: refused, told where clients go.
    with pytest.raises(ClientError, match=f"wrong-port.*clients connect to {b2}"):
        await connect(b2_link, "honest-2", credentials=ov.credentials, failover_within=0)

    await publishing
    assert await pub.wait_acknowledged(10.0)
    async with asyncio.timeout(20):
        while len(got) < 2000:  # noqa: ASYNC110 - the drain task fills it
            await asyncio.sleep(0.05)
    assert [n.seq for n in got] == list(range(1, 2001))  # 0 lost, 0 duplicated, in order
    assert {n.publisher for n in got} == {"honest-pub"}
    metrics = await ov["b2"].admin.metrics()
    for code in ("unauthenticated", "wrong-identity", "forbidden", "wrong-port"):
        assert f'code="{code}"' in metrics, code
    for c in (pub, sub):
        await c.close()
    await reader


async def test_content_based_permissions(secured: Overlay) -> None:
    ov = secured
    address = ov["b1"].listen
    # The sensors may publish temperatures only, under their own ids, and subscribe to nothing.
    sensors = await connect(address, "sensors/1", credentials=creds(ov, "sensors"))
    await sensors.publish({"kind": "temp", "site": "lab", "v": 21})
    assert await sensors.wait_acknowledged(5.0)
    with pytest.raises(ClientError, match="forbidden"):
        await sensors.subscribe("kind = 'temp'")
    await sensors.close()
    # The dashboard (a bearer token over TLS) may subscribe to what its filter covers.
    token = Credentials(ov.pki.ca_path if ov.pki else None, token=TOKEN)
    dash = await connect(ov["b2"].listen, "dashboard", credentials=token)
    await dash.subscribe("kind = 'temp' and site = 'lab' and v > 30")  # covered: allowed
    with pytest.raises(ClientError, match="forbidden"):
        await dash.subscribe("kind = 'temp'")  # wider than allowed
    await dash.close()
    with pytest.raises(ClientError, match="unauthenticated"):
        bad = Credentials(ov.pki.ca_path if ov.pki else None, token="guess")
        await connect(address, "dashboard", credentials=bad, failover_within=0)
    # A publication outside the sensors' filter closes their connection.
    sensors = await connect(address, "sensors/2", credentials=creds(ov, "sensors"))
    await sensors.publish({"kind": "humidity", "v": 40})
    with pytest.raises(ClientError, match="forbidden"):
        await sensors.wait_acknowledged(5.0)
        raise AssertionError(sensors.unacknowledged)
    await sensors.close()


async def test_the_policy_is_reloaded_while_the_broker_runs(secured: Overlay) -> None:
    ov = secured
    assert ov.pki is not None
    watcher: Client = await connect(ov["b1"].listen, "mallory", credentials=creds(ov, "mallory"))
    await watcher.subscribe("kind = 'temp'")  # mallory is listed without limits: allowed
    ov.pki.policy_path.write_text(POLICY.replace("  - name: mallory\n", ""))  # now: default deny
    async with asyncio.timeout(10):
        while not watcher.closed:  # noqa: ASYNC110 - the broker cuts it off on reload
            await asyncio.sleep(0.1)
    with pytest.raises(ClientError, match="forbidden"):
        await connect(ov["b1"].listen, "mallory", credentials=creds(ov, "mallory"))
    await watcher.close()
