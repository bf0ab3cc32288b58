"""The HTTP gateway on real processes: two brokers, TLS, a client policy with bearer tokens.
An application with nothing but HTTP subscribes over Server-Sent Events on one broker and over
a WebSocket on the other, publishes by POST and over its WebSocket, and gets every matching
notification once, in order; a native client sees the gateway's publications the same way.
The policy holds for HTTP exactly as for native clients: an unknown token is 401, a filter or a
publication it does not allow 403; bad bodies and filters are 400 with the reason."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from canopy_broker import gateway as gw
from canopy_broker.client import Credentials, connect
from canopy_broker.procs import BrokerProc, spawn_broker, wait_settled
from canopy_broker.runtime.httpsite import MAX_PER_SOURCE
from tests.integration.token_pair import READER, WRITER, linked_pair, token_policy

pytestmark = pytest.mark.integration


async def start(tmp_path: Path) -> tuple[BrokerProc, BrokerProc, ssl.SSLContext]:
    policy = token_policy(publish="kind = 'temp'", subscribe="kind = 'temp'")
    a, b, ca = await linked_pair(tmp_path, policy, "--gateway", "127.0.0.1:0")
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.check_hostname = False  # the brokers' certificates name canopy identities, not hosts
    return a, b, ctx


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def read_sse(response: aiohttp.ClientResponse, into: list[dict[str, Any]]) -> None:
    event: dict[str, str] = {}
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if not line:
            if event.get("event") == "notification":
                into.append(orjson.loads(event["data"]))
            event = {}
        elif not line.startswith(":"):
            key, _, value = line.partition(": ")
            event[key] = value


async def test_http_clients_publish_and_subscribe_with_the_brokers_guarantees(
    tmp_path: Path,
) -> None:
    a, b, ctx = await start(tmp_path)
    native = None
    reading: asyncio.Task[None] | None = None
    try:
        assert a.gateway and b.gateway
        await wait_settled([a, b])
        base_a, base_b = f"https://{a.gateway}", f"https://{b.gateway}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as http:
            # SSE on b for "temp" events above 20; a WebSocket on a for all "temp" events.
            sse = await http.get(
                f"{base_b}/v1/subscribe",
                params={"filter": "kind = 'temp' and value > 20"},
                headers={**bearer(READER), "X-Canopy-Client-Id": "reader/sse"},
            )
            assert sse.status == 200, await sse.text()
            assert sse.headers["X-Canopy-Client-Id"] == "reader/sse"
            got_sse: list[dict[str, Any]] = []
            reading = asyncio.create_task(read_sse(sse, got_sse))
            ws = await http.ws_connect(
                f"{base_a}/v1/ws",
                params={"filter": "kind = 'temp'", "client_id": "reader/ws"},
                headers=bearer(READER),
            )
            native = await connect(a.listen, "canopy/native")
            await native.subscribe("kind = 'temp'")
            await wait_settled([a, b])  # the routes reached both brokers

            # 200 events by POST on a, in batches of 20, numbered on from the first (the
            # gateway's client starts from the clock).
            start_seq = None
            for first in range(0, 200, 20):
                batch = [{"kind": "temp", "value": v} for v in range(first, first + 20)]
                r = await http.post(
                    f"{base_a}/v1/publish",
                    data=orjson.dumps(batch),
                    headers={**bearer(WRITER), "X-Canopy-Client-Id": "writer/post"},
                )
                assert r.status == 200, await r.text()
                body = await r.json()
                start_seq = start_seq or body["first_seq"]
                assert body["published"] == 20
                assert body["last_seq"] == start_seq + first + 19
                assert body["client_id"] == "writer/post"
            # A reader's WebSocket may not publish: the broker refuses, the reply says so.
            wpub = await http.ws_connect(
                f"{base_b}/v1/ws",
                params={"filter": "kind = 'temp' and value < 0", "client_id": "reader/ws2"},
                headers=bearer(READER),
            )
            await wpub.send_str(orjson.dumps({"publish": {"kind": "temp", "value": 1}}).decode())
            refused = orjson.loads(await wpub.receive_bytes())
            assert "error" in refused, refused  # the reader may not publish: the broker says so
            await wpub.close()

            async def ws_all(n: int) -> list[dict[str, Any]]:
                out = []
                while len(out) < n:
                    out.append(orjson.loads(await ws.receive_bytes()))
                return out

            over_ws = await asyncio.wait_for(ws_all(200), 20)
            assert [m["attrs"]["value"] for m in over_ws] == list(range(200))
            assert {(m["publisher"], m["hops"]) for m in over_ws} == {("writer/post", 0)}
            assert [m["seq"] for m in over_ws] == list(range(start_seq, start_seq + 200))
            async with asyncio.timeout(20):
                while len(got_sse) < 179:  # noqa: ASYNC110 - filled by the reading task
                    await asyncio.sleep(0.05)
            assert [m["attrs"]["value"] for m in got_sse] == list(range(21, 200))
            assert {m["hops"] for m in got_sse} == {1}  # from a, over the link
            mine = await native.receive(1000, timeout=5)
            while len(mine) < 200:
                more = await native.receive(1000, timeout=5)
                assert more, f"the native client got {len(mine)} of 200"
                mine += more
            assert [n.seq for n in mine] == list(range(start_seq, start_seq + 200))

            await ws.close()
            sse.close()
    finally:
        if reading is not None:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
        if native is not None:
            await native.close()
        await asyncio.gather(a.stop(), b.stop())


async def test_the_gateway_refuses_what_the_policy_or_the_request_gets_wrong(
    tmp_path: Path,
) -> None:
    a, b, ctx = await start(tmp_path)
    try:
        base = f"https://{a.gateway}"
        temp = orjson.dumps({"kind": "temp", "value": 1})
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as http:

            async def status(method: str, path: str, **kw: Any) -> tuple[int, str]:
                async with http.request(method, f"{base}{path}", **kw) as r:
                    return r.status, (await r.json())["error"]

            code, why = await status("POST", "/v1/publish", data=temp)
            assert code == 401 and "bearer token" in why
            code, why = await status("POST", "/v1/publish", data=temp, headers=bearer("nope"))
            assert code == 401 and "unknown bearer token" in why
            code, why = await status(
                "POST", "/v1/publish", data=orjson.dumps({"kind": "alarm"}), headers=bearer(WRITER)
            )
            assert code == 403, why  # the writer may publish temp events only
            code, why = await status("POST", "/v1/publish", data=b"{oops", headers=bearer(WRITER))
            assert code == 400 and "not JSON" in why
            code, why = await status("POST", "/v1/publish", data=b"[1, 2]", headers=bearer(WRITER))
            assert code == 400 and "JSON object" in why
            # An integer beyond 64 bits: refused, not published as the float orjson makes of it.
            huge = b'{"kind": "temp", "value": 123456789012345678901234567890}'
            code, why = await status("POST", "/v1/publish", data=huge, headers=bearer(WRITER))
            assert code == 400 and "does not fit in 64 bits" in why, why
            code, why = await status(
                "POST",
                "/v1/publish",
                data=temp,
                headers={**bearer(WRITER), "X-Canopy-Client-Id": "someone-else"},
            )
            assert code == 403 and "may not use client id" in why
            code, why = await status("GET", "/v1/subscribe", headers=bearer(READER))
            assert code == 400 and "filter" in why
            code, why = await status(
                "GET", "/v1/subscribe", params={"filter": "value >"}, headers=bearer(READER)
            )
            assert code == 400, why
            code, why = await status(
                "GET", "/v1/subscribe", params={"filter": "kind = 'alarm'"}, headers=bearer(READER)
            )
            assert code == 403, why  # not covered by the reader's subscribe filters
            # A batch with one invalid event is refused whole: nothing of it is published
            # (the next publication's number follows the last one accepted).
            r = await http.post(f"{base}/v1/publish", data=temp, headers=bearer(WRITER))
            assert r.status == 200, await r.text()
            last = (await r.json())["last_seq"]
            bad = orjson.dumps([{"kind": "temp", "value": 2}, {"kind": "temp", "value": None}])
            code, why = await status("POST", "/v1/publish", data=bad, headers=bearer(WRITER))
            assert code == 400 and why.startswith("event 1: "), why
            # The broker is unharmed: a good request still works.
            r = await http.post(f"{base}/v1/publish", data=temp, headers=bearer(WRITER))
            assert r.status == 200, await r.text()
            assert (await r.json())["first_seq"] == last + 1
    finally:
        await asyncio.gather(a.stop(), b.stop())


async def test_the_gateway_keeps_a_bounded_number_of_publishing_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One kept connection per (token, client id), the least recently used closed beyond the
    bound, so callers inventing client ids cannot make the gateway hold connections without
    end."""

    class Fake:
        def __init__(self, cid: str | None) -> None:
            self.client_id, self.closed = cid, False

        async def close(self) -> None:
            self.closed = True

    made: list[Fake] = []

    async def fake_connect(self: gw.Gateway, creds: Credentials, cid: str | None) -> Fake:
        made.append(Fake(cid))
        return made[-1]

    monkeypatch.setattr(gw, "MAX_PUBLISHERS", 2)
    monkeypatch.setattr(gw.Gateway, "_connect", fake_connect)
    g = gw.Gateway("127.0.0.1:1", None)
    creds = Credentials(token="t")
    a = await g.publisher(creds, "a")
    b = await g.publisher(creds, "b")
    assert await g.publisher(creds, "a") is a  # kept, and now the most recent
    await g.publisher(creds, "c")  # over the bound: b, the least recently used, goes
    assert b.closed and not a.closed and len(made) == 3
    await g.close()
    assert all(f.closed for f in made)


async def test_the_gateway_forgets_refused_callers_and_closes_idle_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing is kept for a (token, client id) whose connection the broker refused: a lock
    kept for each made-up token grew the gateway's memory without bound (review). A kept
    connection unused for ``PUBLISHER_IDLE`` seconds is closed, requests or not: each one
    counts against the broker's per-address limit, shared by every client of the gateways."""

    class Fake:
        def __init__(self) -> None:
            self.client_id, self.closed = "x", False

        async def close(self) -> None:
            self.closed = True

    async def refused(self: gw.Gateway, creds: Credentials, cid: str | None) -> Fake:
        raise OSError("refused")

    monkeypatch.setattr(gw.Gateway, "_connect", refused)
    g = gw.Gateway("127.0.0.1:1", None)
    for i in range(1000):
        with pytest.raises(OSError):
            await g.publisher(Credentials(token=f"made-up-{i}"), None)
    assert not g._locks and not g._publishers

    kept = Fake()

    async def accepted(self: gw.Gateway, creds: Credentials, cid: str | None) -> Fake:
        return kept

    monkeypatch.setattr(gw.Gateway, "_connect", accepted)
    monkeypatch.setattr(gw, "PUBLISHER_IDLE", 0.2)
    app = gw.make_gateway_app("127.0.0.1:1", None)
    runner = web.AppRunner(app)
    await runner.setup()  # starts the sweeping task
    try:
        gateway = app[gw.GATEWAY]
        assert await gateway.publisher(Credentials(token="t"), "c") is kept
        async with asyncio.timeout(5):
            while not kept.closed:  # noqa: ASYNC110 - the sweep closes it
                await asyncio.sleep(0.05)
        assert not gateway._publishers and not gateway._locks
    finally:
        await runner.cleanup()


async def test_the_gateway_bounds_the_streams_from_one_address(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SSE and WebSocket streams are bounded per remote address (429 past it), as MQTT
    connections are: the broker does not count its gateways' clients by their addresses (they
    all reach it from its own), so the gateways must (review: 250 streams from one address
    locked every new client out). Refusals are logged once per address per 10 s, not once
    per request of a caller retrying in a loop."""

    class Quiet:
        client_id, closed, gaps = "q", False, []

        async def subscribe(self, f: str, sub_id: str) -> str:
            return sub_id

        async def receive(self, n: int, timeout: float | None) -> list[Any]:  # noqa: ASYNC109
            await asyncio.sleep(timeout or 3600)
            return []

        async def close(self) -> None:
            self.closed = True

    async def quiet(self: gw.Gateway, creds: Credentials, cid: str | None) -> Quiet:
        return Quiet()

    monkeypatch.setattr(gw.Gateway, "_connect", quiet)
    monkeypatch.setattr(gw, "MAX_STREAMS_PER_SOURCE", 2)
    async with TestClient(TestServer(gw.make_gateway_app("127.0.0.1:1", None))) as http:
        open_ = [await http.get("/v1/subscribe", params={"filter": "n > 0"}) for _ in range(2)]
        assert [r.status for r in open_] == [200, 200]
        refused = await http.get("/v1/subscribe", params={"filter": "n > 0"})
        assert refused.status == 429 and "2 streams" in (await refused.json())["error"]
        for _ in range(5):
            assert (await http.get("/v1/subscribe", params={"filter": "n > 0"})).status == 429
        told = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert told == ["gateway: refused 1 stream(s) from 127.0.0.1: 2 open (the limit)"]
        open_[0].close()
        async with asyncio.timeout(10):
            while True:  # the gateway notices the end of that stream, then takes another
                again = await http.get("/v1/subscribe", params={"filter": "n > 0"})
                if again.status == 200:
                    break
                await asyncio.sleep(0.05)
        again.close()
        open_[1].close()


async def test_the_brokers_http_ports_bound_the_connections_from_one_address(
    tmp_path: Path,
) -> None:
    """The gateway and the admin API of a real broker (TLS on) take at most
    ``MAX_PER_SOURCE`` connections from one address: with that many open, doing nothing after
    their handshake, another is closed at once, and an ordinary request gets through once one
    of them has gone. Before, 3,000 slow request heads from one address were each held for as
    long as they were fed, up to the broker's file-descriptor limit. (The deadline for a
    request head is tested in tests/unit/test_runtime_httpsite.py: 20 s here.)"""
    broker = await spawn_broker("h", log_dir=tmp_path, extra_args=("--gateway", "127.0.0.1:0"))
    assert broker.tls is not None and broker.gateway is not None
    ctx = broker.tls
    try:
        await broker.admin.close()  # its kept connection would take one of the admin's places
        for address in (broker.gateway, broker.admin_address):
            host, port = address.rsplit(":", 1)

            async def opened(host: str = host, port: str = port) -> Any:
                return await asyncio.open_connection(host, int(port), ssl=ctx)

            held = [await opened() for _ in range(MAX_PER_SOURCE)]
            extra_reader, extra_writer = await opened()
            async with asyncio.timeout(5):
                assert await extra_reader.read() == b"", address  # closed at once
            extra_writer.close()
            held.pop()[1].close()
            async with asyncio.timeout(10):
                while True:  # that one's place is free once the broker has seen it go
                    reader, writer = await opened()
                    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    answer = await reader.read()
                    writer.close()
                    if answer:
                        break
                    await asyncio.sleep(0.05)
            assert answer.startswith(b"HTTP/1.1 "), (address, answer[:100])
            for _, w in held:
                w.close()
        log = (tmp_path / "h.log").read_text()
        assert log.count("refused 1 connection(s) from 127.0.0.1") == 2, log[-2000:]
    finally:
        await broker.stop()


@pytest.mark.parametrize(
    ("raw", "read"),
    [
        (b'{"n": 18446744073709551615}', {"n": 2**64 - 1}),  # the largest that fits
        (b'{"n": -9223372036854775808}', {"n": -(2**63)}),
        (b'{"n": 1e30, "m": [1.5e300]}', {"n": 1e30, "m": [1.5e300]}),  # large floats are floats
        (b'{"n": 18446744073709551616}', "does not fit in 64 bits"),
        (b'[{"n": 1}, {"n": -9223372036854775809}]', "does not fit in 64 bits"),
        (b"[" * 1000 + b"1e300" + b"]" * 1000, "nested too deeply"),
    ],
)
def test_the_gateway_reads_json_numbers_as_they_were_sent(raw: bytes, read: object) -> None:
    """orjson reads an integer beyond 64 bits as a float: the gateway published a number other
    than the one sent. Such a body is now refused; large floats are still floats."""
    if isinstance(read, str):
        with pytest.raises(ValueError, match=read):
            gw._loads(raw)
    else:
        assert gw._loads(raw) == read


async def test_a_broker_not_linked_yet_answers_503_with_retry_after(tmp_path: Path) -> None:
    """A broker holding its clients until it is linked (``--hold-clients``) refuses the
    gateway's connection with ``joining``; the gateway tries again for its connect timeout
    (10 s), then the caller gets 503 and ``Retry-After``, what HTTP clients and load balancers
    retry on, not 502 (a broken broker). Once the hold ends, the same request publishes."""
    broker = await spawn_broker(
        "held", pki=None, extra_args=["--gateway", "127.0.0.1:0", "--hold-clients", "12"]
    )
    try:
        assert broker.gateway
        url = f"http://{broker.gateway}/v1/publish"
        async with aiohttp.ClientSession() as http:
            refused = await http.post(url, json={"kind": "temp", "value": 1})
            assert refused.status == 503, await refused.text()
            assert refused.headers["Retry-After"] == "1"
            assert "joining" in (await refused.json())["error"]
            async with asyncio.timeout(20):
                while (await http.post(url, json={"kind": "temp", "value": 2})).status == 503:  # noqa: ASYNC110
                    await asyncio.sleep(float(refused.headers["Retry-After"]))
            published = await http.post(url, json={"kind": "temp", "value": 3})
            assert published.status == 200, await published.text()
    finally:
        await broker.stop()
