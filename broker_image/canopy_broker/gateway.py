"""HTTP gateway: applications in any language publish and subscribe over HTTP.

``canopy-broker serve --gateway HOST:PORT`` runs it in the broker's process, beside the admin
API. It speaks to its own broker as an ordinary client (this package's client library, over the
broker's port, TLS when the broker has it), so everything a native client gets holds: the
broker authenticates the principal, applies its policy to every filter and publication, stamps
the publisher identity, and delivers each notification once and in publisher order for as long
as the HTTP stream is connected. Nothing is checked here that the broker does not check itself.

* ``POST /v1/publish`` — a JSON object (one event's attributes) or an array of them; answered
  once the broker acknowledged them: ``{"client_id", "published", "first_seq", "last_seq"}``.
  Publications of one client id share one connection, so they keep their order.
* ``GET /v1/subscribe?filter=...`` (repeatable) — Server-Sent Events: ``event: notification``
  with ``{"publisher", "seq", "hops", "attrs", "subscriptions"}`` as data and
  ``publisher:seq`` as id; ``event: gap`` when the broker cannot vouch for an interval; a
  comment line every 15 s keeps proxies from closing an idle stream.
* ``GET /v1/ws?filter=...`` — a WebSocket with the same notifications as JSON text messages;
  the application may send ``{"publish": {...}}`` on it, answered ``{"published": seq}`` once
  the broker acknowledged it (or ``{"error": ...}``).

Credentials: ``Authorization: Bearer TOKEN``, a token of the broker's client policy (without
TLS, none is needed). The client id: ``X-Canopy-Client-Id`` or ``?client_id=`` (the policy
decides which a principal may use); without one the broker picks. Errors are JSON
``{"error": ...}``: 400 for a bad body or filter, 401 without a token or with one the broker
does not know, 403 when the policy refuses the client id, a filter or a publication, 409 for a
client id connected already, 502 when the broker cannot be reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import orjson
from aiohttp import WSMsgType, web

from canopy_broker.client import Client, ClientError, Credentials, Gap, Notification, connect
from canopy_broker.runtime.accept import SourceCounts
from canopy_broker.runtime.framing import FrameError, check_wire_attributes

log = logging.getLogger("canopy.gateway")

KEEPALIVE_SECONDS = 15.0
MAX_BODY = 4 * 1024 * 1024
MAX_BATCH = 10_000
MAX_PUBLISHERS = 64  # publishing connections kept open between requests
PUBLISHER_IDLE = 30.0  # seconds a kept publishing connection may go unused before it is closed
BODY_TIMEOUT = 10.0  # seconds to receive a request's body
MAX_STREAMS_PER_SOURCE = 64  # SSE and WebSocket streams at once from one remote address


def _int64(text: str) -> int:
    n = int(text)
    if not -(2**63) <= n < 2**64:
        raise ValueError(f"the integer {text[:40]} does not fit in 64 bits")
    return n


def _loads(raw: bytes | str) -> Any:
    """JSON as orjson reads it, except that an integer beyond 64 bits is an error (ValueError):
    orjson makes it a float, and the gateway published a number other than the one sent. Only
    a body holding a float that large is read again, by the standard library, to tell."""
    body = orjson.loads(raw)
    todo, huge = [body], False
    while todo and not huge:
        value = todo.pop()
        if type(value) is float:
            huge = abs(value) >= 2.0**63
        elif isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
    if not huge:
        return body
    try:
        return json.loads(raw, parse_int=_int64)
    except RecursionError:  # orjson reads 1,024 levels, the standard library fewer
        raise ValueError("nested too deeply") from None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class Gateway:
    """The gateway's state: where its broker is and with what CA it is reached, and one
    publishing connection per (token, client id), kept open for the next request."""

    def __init__(self, broker: str, ca: Path | None) -> None:
        self.broker = broker
        self.ca = ca
        self._publishers: dict[tuple[str | None, str | None], Client] = {}
        self._used: dict[tuple[str | None, str | None], float] = {}  # when, by key
        # One lock per key while a request uses it or its connection is kept: a lock left for
        # each refused token grew the gateway's memory without bound (review: 236 MB after
        # 30,000 requests with made-up tokens).
        self._locks: dict[tuple[str | None, str | None], tuple[asyncio.Lock, int]] = {}
        self._streams = SourceCounts(MAX_STREAMS_PER_SOURCE)  # SSE and WebSocket streams

    def credentials(self, request: web.Request) -> Credentials | web.Response:
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if self.ca is not None and not token:
            return _error(401, "a bearer token is required (Authorization: Bearer TOKEN)")
        return Credentials(ca=self.ca, token=token or None)

    @staticmethod
    def client_id(request: web.Request) -> str | None:
        return request.headers.get("X-Canopy-Client-Id") or request.query.get("client_id") or None

    def _broker_error(self, exc: ClientError | OSError) -> web.Response:
        """What the broker said (its error frame's code as an HTTP status), or that it could
        not be reached."""
        if isinstance(exc, ClientError):
            response = _error(_status(exc), str(exc))
            if exc.code == "joining":  # linked within seconds; the hold ends by its cap anyway
                response.headers["Retry-After"] = "1"
            return response
        return _error(502, f"the broker at {self.broker} cannot be reached: {exc}")

    async def _connect(self, creds: Credentials, client_id: str | None) -> Client:
        # One broker, no failover: the gateway runs beside it, and goes with it.
        return await connect(self.broker, client_id, credentials=creds, failover_within=0)

    async def publisher(self, creds: Credentials, client_id: str | None) -> Client:
        """The kept connection for (token, client id), made if missing or closed. At most
        ``MAX_PUBLISHERS`` are kept, none unused for more than ``PUBLISHER_IDLE`` seconds: the
        least recently used one is closed for a new one. Each is a connection to the broker
        held open, so callers inventing client ids must not make the gateway hold them for
        ever (review: 256 kept for good, then the broker's whole allowance for the gateways'
        address, locked every new MQTT and HTTP client out)."""
        key = (creds.token, client_id)
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                await self.sweep()
                client = self._publishers.pop(key, None)
                if client is None or client.closed:
                    while len(self._publishers) >= MAX_PUBLISHERS:
                        await self._drop(next(iter(self._publishers)))
                    client = await self._connect(creds, client_id)
                self._publishers[key] = client  # last: the most recently used
                self._used[key] = asyncio.get_running_loop().time()
                return client
        finally:
            lock, users = self._locks[key]
            if users > 1 or key in self._publishers:
                self._locks[key] = (lock, users - 1)
            else:
                del self._locks[key]

    async def sweep(self) -> None:
        """Close the kept connections unused for ``PUBLISHER_IDLE`` seconds."""
        stale = asyncio.get_running_loop().time() - PUBLISHER_IDLE
        for key in [k for k, used in self._used.items() if used < stale]:
            await self._drop(key)

    async def _drop(self, key: tuple[str | None, str | None]) -> None:
        self._used.pop(key, None)
        client = self._publishers.pop(key, None)
        held = self._locks.get(key)
        if held is not None and held[1] == 0:
            del self._locks[key]
        if client is not None:
            await client.close()

    async def close(self) -> None:
        for client in self._publishers.values():
            await client.close()
        self._publishers.clear()
        self._used.clear()

    # -- handlers ----------------------------------------------------------------------------

    async def publish(self, request: web.Request) -> web.Response:
        creds = self.credentials(request)
        if isinstance(creds, web.Response):
            return creds
        try:
            async with asyncio.timeout(BODY_TIMEOUT):
                raw = await request.read()
        except TimeoutError:
            return _error(408, f"the body did not arrive within {BODY_TIMEOUT:g} s")
        try:
            body = _loads(raw)
        except ValueError as exc:  # orjson.JSONDecodeError is one too
            return _error(400, f"the body is not JSON: {exc}")
        events = body if isinstance(body, list) else [body]
        if not events or len(events) > MAX_BATCH:
            return _error(400, f"publish 1 to {MAX_BATCH} events, got {len(events)}")
        if not all(isinstance(e, dict) for e in events):
            return _error(400, "each event must be a JSON object of attributes")
        for i, event in enumerate(events):  # all or nothing: none is sent if one is invalid
            try:
                check_wire_attributes(event)
            except FrameError as exc:
                where = f"event {i}: " if len(events) > 1 else ""
                return _error(400, f"{where}{exc}")
        try:
            client = await self.publisher(creds, self.client_id(request))
            seqs = [client.publish_nowait(e) for e in events]
            if not await client.wait_acknowledged(timeout=10.0):
                return _error(504, "the broker did not acknowledge the events within 10 s")
        except ValueError as exc:
            return _error(400, str(exc))
        except (ClientError, OSError) as exc:
            return self._broker_error(exc)
        return web.json_response(
            {
                "client_id": client.client_id,
                "published": len(seqs),
                "first_seq": seqs[0],
                "last_seq": seqs[-1],
            }
        )

    @contextlib.asynccontextmanager
    async def subscriber(self, request: web.Request) -> AsyncIterator[Client | web.Response]:
        """A client subscribed to the request's filters, closed when the stream ends."""
        creds = self.credentials(request)
        if isinstance(creds, web.Response):
            yield creds
            return
        filters = request.query.getall("filter", [])
        if not filters:
            yield _error(400, "give at least one filter: ?filter=...")
            return
        source = request.remote or "?"
        if not self._streams.take(source):
            # As the MQTT listener bounds its connections: the broker does not count its own
            # gateways' clients by their addresses, the gateways do.
            limit = self._streams.limit
            self._streams.refused(source, log, "gateway", "stream(s)")
            yield _error(429, f"{limit} streams from {source} are open already")
            return
        try:
            async with self._subscribed(creds, request, filters) as client:
                yield client
        finally:
            self._streams.give_back(source)

    @contextlib.asynccontextmanager
    async def _subscribed(
        self, creds: Credentials, request: web.Request, filters: list[str]
    ) -> AsyncIterator[Client | web.Response]:
        try:
            client = await self._connect(creds, self.client_id(request))
        except (ClientError, OSError) as exc:
            yield self._broker_error(exc)
            return
        try:
            for i, f in enumerate(filters):
                try:
                    await client.subscribe(f, sub_id=f"f{i}")
                except ValueError as exc:
                    yield _error(400, f"filter {f!r}: {exc}")
                    return
                except ClientError as exc:
                    yield _error(_status(exc), f"filter {f!r}: {exc}")
                    return
            yield client
        finally:
            await client.close()

    async def sse(self, request: web.Request) -> web.StreamResponse:
        async with self.subscriber(request) as client:
            if isinstance(client, web.Response):
                return client
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Canopy-Client-Id": client.client_id or "",
                }
            )
            await response.prepare(request)
            told = 0
            while True:
                batch = await _receive(client, KEEPALIVE_SECONDS)
                if batch is None:
                    break
                chunks = [_sse(n) for n in batch] or [b": keep-alive\n\n"]
                for gap in client.gaps[told:]:
                    chunks.append(b"event: gap\ndata: " + orjson.dumps(_gap(gap)) + b"\n\n")
                told = len(client.gaps)
                await response.write(b"".join(chunks))
            return response

    async def websocket(self, request: web.Request) -> web.StreamResponse:
        async with self.subscriber(request) as client:
            if isinstance(client, web.Response):
                return client
            ws = web.WebSocketResponse(heartbeat=KEEPALIVE_SECONDS)
            await ws.prepare(request)

            async def forward() -> None:
                while (batch := await _receive(client, None)) is not None:
                    for n in batch:
                        await ws.send_bytes(orjson.dumps(_notification(n)))

            forwarding = asyncio.create_task(forward())
            try:
                async for msg in ws:
                    if msg.type is not WSMsgType.TEXT:
                        continue
                    await ws.send_bytes(await _ws_request(client, msg.data))
            finally:
                forwarding.cancel()
                with contextlib.suppress(asyncio.CancelledError, ClientError, ConnectionError):
                    await forwarding
            return ws


async def _ws_request(client: Client, text: str) -> bytes:
    """One message the application sent on its WebSocket: a publication."""
    try:
        msg = _loads(text)
    except ValueError as exc:
        return orjson.dumps({"error": f"not JSON: {exc}"})
    attrs = msg.get("publish") if isinstance(msg, dict) else None
    if not isinstance(attrs, dict):
        return orjson.dumps({"error": 'send {"publish": {attributes}}'})
    try:
        seq = await client.publish(attrs)
        if not await client.wait_acknowledged(timeout=10.0):
            return orjson.dumps({"error": "the broker did not acknowledge it within 10 s"})
    except (ValueError, ClientError) as exc:
        return orjson.dumps({"error": str(exc)})
    return orjson.dumps({"published": seq})


async def _receive(client: Client, timeout: float | None) -> list[Notification] | None:  # noqa: ASYNC109
    """The next notifications ([] after ``timeout`` seconds without any); None at the end of
    the client's connection."""
    try:
        batch = await client.receive(1000, timeout=timeout)
    except ClientError:
        return None
    if not batch and client.closed:
        return None
    return batch


def _notification(n: Notification) -> dict[str, Any]:
    return {
        "publisher": n.publisher,
        "seq": n.seq,
        "hops": n.hops,
        "attrs": n.attrs,
        "subscriptions": list(n.sub_ids),
    }


def _sse(n: Notification) -> bytes:
    data = orjson.dumps(_notification(n))
    return b"event: notification\nid: %s:%d\ndata: %s\n\n" % (n.publisher.encode(), n.seq, data)


def _gap(gap: Gap) -> Mapping[str, object]:
    return {"since": gap.since, "until": gap.until, "reason": gap.reason}


_STATUS = {"unauthenticated": 401, "forbidden": 403, "wrong-identity": 403}
_STATUS |= {"client-id-in-use": 409, "invalid-filter": 400, "joining": 503}


def _status(exc: ClientError) -> int:
    """The HTTP status for what the broker said (the code of its error frame): who it does
    not know 401, what it does not allow 403, a client id in use 409, not taking clients
    until it is linked into the overlay 503 (with ``Retry-After``); anything else (the
    connection ended) 502."""
    return _STATUS.get(exc.code, 502)


GATEWAY = web.AppKey("gateway", Gateway)


def make_gateway_app(broker: str, ca: Path | None) -> web.Application:
    """The gateway for the broker at ``broker`` (HOST:PORT), reached with ``ca`` (None:
    plaintext)."""
    gateway = Gateway(broker, ca)
    app = web.Application(client_max_size=MAX_BODY)
    app[GATEWAY] = gateway
    app.router.add_post("/v1/publish", gateway.publish)
    app.router.add_get("/v1/subscribe", gateway.sse)
    app.router.add_get("/v1/ws", gateway.websocket)

    async def sweeping(_app: web.Application) -> AsyncIterator[None]:
        async def sweep() -> None:  # kept connections are closed once idle, requests or not
            while True:
                await asyncio.sleep(PUBLISHER_IDLE / 3)
                await gateway.sweep()

        task = asyncio.create_task(sweep())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await gateway.close()

    app.cleanup_ctx.append(sweeping)
    return app
