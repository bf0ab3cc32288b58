"""The admin HTTP API (aiohttp), documented in docs/broker.md.

Authentication is a static bearer token compared in constant time (``hmac.compare_digest``), so
response timing does not leak how much of a guessed token was right. ``/healthz``, ``/readyz`` and
``/metrics`` are open: kubelet probes and Prometheus scrapers do not carry the token, and none of
the three reveals or changes anything that matters. Every other endpoint needs the token; a broker
started without one refuses to run unless ``--insecure-no-token`` says so explicitly (see cli.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from canopy_broker.core.errors import ProtocolError
from canopy_broker.runtime.framing import finite_number, printable
from canopy_broker.runtime.metrics import CONTENT_TYPE
from canopy_broker.runtime.server import Broker

BROKER: web.AppKey[Broker] = web.AppKey("broker", Broker)
PUBLIC = frozenset({"/healthz", "/readyz", "/metrics"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _auth_middleware(token: str | None) -> Middleware:
    expected = token.encode() if token is not None else None

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        request.app[BROKER].wake()  # a request is work: stalls it causes are measured finely
        if expected is not None and request.path not in PUBLIC:
            # The scheme's name is case-insensitive (RFC 9110, 11.1); the token is not, and is
            # compared in constant time.
            scheme, _, got = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(got.encode(), expected):
                resp = _error(401, "missing or wrong bearer token")
                resp.headers["WWW-Authenticate"] = 'Bearer realm="canopy-broker"'
                return resp
        return await handler(request)

    return auth


async def healthz(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    if broker.failed is not None:
        return web.json_response({"status": "failed", "reason": broker.failed}, status=500)
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    if broker.ready:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "not ready"}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[BROKER].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[BROKER].status())


async def routing(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    table = broker.core.routing_table()
    return web.json_response(
        {
            "broker": broker.name,
            "routing": broker.core.mode.value,
            "size": table.size(),
            "table": table.to_json(),
        }
    )


async def add_link(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    body = await _json_object(request)
    peer, address, timeout = body.get("peer"), body.get("address"), body.get("timeout", 5.0)
    if not isinstance(peer, str) or not peer or not isinstance(address, str):
        return _error(400, "need 'peer' (name) and 'address' (HOST:PORT)")
    if not _seconds(timeout, 0, 120):
        return _error(400, "'timeout' must be a number of seconds in [0, 120]")
    existed = peer in broker.links
    try:
        broker.add_link(peer, address)
    except ValueError as exc:
        return _error(400, str(exc))
    up = await broker.wait_link_up(peer, float(timeout)) if timeout else False
    link = broker.links.get(peer)
    if link is None:
        return _error(409, f"the link to {peer} was removed while connecting")
    return web.json_response(
        {"created": not existed, "up": up, "link": link.status()}, status=200 if up else 202
    )


async def remove_link(request: web.Request) -> web.Response:
    """409 while the link is on the cycle of a running exchange (nothing changed: the core
    refuses first); it answered 500 with a traceback in the log, once per supervisor tick
    that asked (chaos soak reproduction)."""
    try:
        removed = request.app[BROKER].remove_link(request.match_info["peer"])
    except ProtocolError as exc:
        return _error(409, str(exc))
    return web.json_response({"removed": removed})


async def drop_link(request: web.Request) -> web.Response:
    dropped = request.app[BROKER].drop_link_connection(request.match_info["peer"])
    return web.json_response({"dropped": dropped})


async def cut_link(request: web.Request) -> web.Response:
    """Fault injection: fail the link for good (both brokers alive), refusing its connections
    but a detour's; DELETE heals it."""
    cut = request.app[BROKER].cut_link(request.match_info["peer"])
    return web.json_response({"cut": cut})


async def heal_link(request: web.Request) -> web.Response:
    healed = request.app[BROKER].heal_link(request.match_info["peer"])
    return web.json_response({"healed": healed})


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise web.HTTPBadRequest(
            text='{"error": "body must be JSON"}', content_type="application/json"
        ) from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(
            text='{"error": "body must be a JSON object"}', content_type="application/json"
        )
    return body


async def get_peers(request: web.Request) -> web.Response:
    return web.json_response({"peers": request.app[BROKER].peers})


async def set_peers(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    peers = (await _json_object(request)).get("peers")
    if not isinstance(peers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in peers.items()
    ):
        return _error(400, "need 'peers': {name: 'HOST:PORT'}")
    try:
        broker.set_peers(peers)
    except ValueError as exc:
        return _error(400, str(exc))
    return web.json_response({"peers": broker.peers})


async def lift_fences(request: web.Request) -> web.Response:
    incarnations = (await _json_object(request)).get("incarnations")
    if not isinstance(incarnations, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in incarnations.items()
    ):
        return _error(400, "need 'incarnations': {name: incarnation}")
    try:
        lifted = request.app[BROKER].lift_fences(incarnations)
    except ValueError as exc:
        return _error(400, str(exc))
    return web.json_response({"lifted": lifted})


async def tell_gap(request: web.Request) -> web.Response:
    body = await _json_object(request)
    since, until = finite_number(body.get("since")), finite_number(body.get("until"))
    reason, covers = body.get("reason"), body.get("covers", [])
    if since is None or until is None or not isinstance(reason, str) or not reason:
        return _error(400, "need 'since' and 'until' (epoch seconds) and a 'reason'")
    if not isinstance(covers, list) or not all(isinstance(c, str) for c in covers):
        return _error(400, "'covers' must be a list of broker names")
    try:
        told = request.app[BROKER].tell_gap(since, until, printable(reason), covers)
    except ValueError as exc:
        return _error(400, str(exc))
    return web.json_response({"told": told})


async def start_exchange(request: web.Request) -> web.Response:
    body = await _json_object(request)
    return await _exchange(request.app[BROKER], body, body.get("xid"))


async def _exchange(broker: Broker, body: dict[str, Any], xid: object) -> web.Response:
    path, remove = body.get("path"), body.get("remove")
    ordering, wait = body.get("ordering", "fifo"), body.get("wait", 0)
    lease = body.get("lease", 30.0)
    if (
        not isinstance(path, list)
        or not all(isinstance(p, str) for p in path)
        or not isinstance(remove, list)
        or len(remove) != 2
        or not all(isinstance(r, str) for r in remove)
    ):
        return _error(400, "need 'path': [names from A1 to A2] and 'remove': [R1, R2]")
    if ordering not in ("fifo", "causal") or not (xid is None or isinstance(xid, str)):
        return _error(400, "'ordering' is fifo or causal; 'xid' a string")
    if not _seconds(wait, 0, 600):
        return _error(400, "'wait' must be a number of seconds in [0, 600]")
    if not _seconds(lease, 0.01, 3600):
        return _error(400, "'lease' must be a number of seconds in [0.01, 3600]")
    try:
        rec = broker.start_exchange(path, (remove[0], remove[1]), ordering, xid, float(lease))
    except ValueError as exc:
        return _error(400, str(exc))
    if wait:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(rec.done.wait(), float(wait))
    return web.json_response(
        _with_counts(broker, rec.to_json()), status=202 if rec.state == "running" else 200
    )


def _with_counts(broker: Broker, record: dict[str, Any]) -> dict[str, Any]:
    counts = broker.reconfiguration_messages.get(record.get("xid") or record.get("id", ""), {})
    return {**record, "messages_sent_here": dict(counts)}


async def start_reconfiguration(request: web.Request) -> web.Response:
    """One entry point for the elementary reconfigurations, idempotent by the caller's ``id``:
    ``exchange`` (on A1: path, remove, ordering, lease, wait), ``add-leaf`` (on the new broker:
    peer, address — it dials its neighbour) and ``remove-leaf`` (on the leaf: target, address,
    wait — its clients migrate to the target, then the link goes)."""
    broker = request.app[BROKER]
    body = await _json_object(request)
    rid, kind = body.get("id"), body.get("kind")
    if not isinstance(rid, str) or not rid:
        return _error(400, "need 'id' (chosen by the caller; repeating it repeats nothing)")
    if kind == "exchange":
        return await _exchange(broker, body, rid)
    if kind not in ("add-leaf", "remove-leaf"):
        return _error(400, "'kind' is exchange, add-leaf or remove-leaf")
    step = broker.leaf_steps.get(rid)
    if step is not None and step["state"] == "finished":
        return web.json_response(step)
    wait = body.get("wait", 30.0)
    if not _seconds(wait, 0, 600):
        return _error(400, "'wait' must be a number of seconds in [0, 600]")
    if kind == "add-leaf":
        peer, address = body.get("peer"), body.get("address")
        if not isinstance(peer, str) or not peer or not isinstance(address, str):
            return _error(400, "need 'peer' (the neighbour's name) and 'address' (HOST:PORT)")
        try:
            broker.add_link(peer, address)
        except ValueError as exc:
            return _error(400, str(exc))
        up = await broker.wait_link_up(peer, float(wait)) if wait else False
        step = {"id": rid, "kind": kind, "peer": peer, "state": "finished" if up else "running"}
    else:
        target, address = body.get("target"), body.get("address")
        if not isinstance(target, str) or not (address is None or isinstance(address, str)):
            return _error(400, "need 'target' (the neighbour's name), optionally 'address'")
        try:
            broker.drain(target, address)
        except ValueError as exc:
            return _error(400, str(exc))
        drained = await broker.wait_drained(float(wait)) if wait else False
        if drained:
            broker.remove_link(target)
        step = {
            "id": rid,
            "kind": kind,
            "target": target,
            "state": "finished" if drained else "draining",
        }
    broker.leaf_steps[rid] = step
    return web.json_response(step, status=200 if step["state"] == "finished" else 202)


async def get_reconfiguration(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    rid = request.match_info["id"]
    rec = broker.exchanges.get(rid)
    if rec is not None:
        return web.json_response(_with_counts(broker, rec.to_json()))
    if rid in broker.leaf_steps:
        return web.json_response(broker.leaf_steps[rid])
    if rid in broker.reconfiguration_messages:  # a participant, not the initiator
        return web.json_response(_with_counts(broker, {"id": rid, "state": "participant"}))
    return _error(404, f"no reconfiguration {rid} here")


def _seconds(value: object, low: float, high: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high


async def start_drain(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    body = await _json_object(request)
    target, address, wait = body.get("target"), body.get("address"), body.get("wait", 0)
    if (
        not isinstance(target, str)
        or not target
        or not (address is None or isinstance(address, str))
    ):
        return _error(
            400, "need 'target' (a neighbour's name) and optionally 'address' (HOST:PORT)"
        )
    if not _seconds(wait, 0, 600):
        return _error(400, "'wait' must be a number of seconds in [0, 600]")
    try:
        broker.drain(target, address)
    except ValueError as exc:
        return _error(400, str(exc))
    drained = await broker.wait_drained(float(wait)) if wait else broker.drain_status()["drained"]
    return web.json_response(broker.drain_status(), status=200 if drained else 202)


async def get_drain(request: web.Request) -> web.Response:
    return web.json_response(request.app[BROKER].drain_status())


async def cancel_drain(request: web.Request) -> web.Response:
    return web.json_response(request.app[BROKER].cancel_drain())


async def get_exchange(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    rec = broker.exchanges.get(request.match_info["xid"])
    if rec is None:
        return _error(404, "no such exchange started here")
    return web.json_response(_with_counts(broker, rec.to_json()))


async def telemetry(request: web.Request) -> web.Response:
    try:
        since = int(request.query.get("since", "0"))
        limit = int(request.query.get("limit", "10000"))
    except ValueError:
        return _error(400, "'since' and 'limit' must be integers")
    if limit < 1:
        return _error(400, "'limit' must be positive")
    return web.json_response(request.app[BROKER].telemetry.since(since, limit))


def make_admin_app(broker: Broker, token: str | None) -> web.Application:
    """The admin application for ``broker``; ``token=None`` disables authentication."""
    app = web.Application(middlewares=[_auth_middleware(token)])
    app[BROKER] = broker
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app


ROUTES: list[tuple[str, str, Callable[[web.Request], Awaitable[web.Response]]]] = [
    ("GET", "/healthz", healthz),
    ("GET", "/readyz", readyz),
    ("GET", "/metrics", metrics),
    ("GET", "/status", status),
    ("GET", "/routing", routing),
    ("POST", "/links", add_link),
    ("DELETE", "/links/{peer}", remove_link),
    ("POST", "/links/{peer}/drop", drop_link),
    ("POST", "/links/{peer}/cut", cut_link),
    ("DELETE", "/links/{peer}/cut", heal_link),
    ("GET", "/telemetry", telemetry),
    ("GET", "/peers", get_peers),
    ("POST", "/peers", set_peers),
    ("POST", "/fences/lift", lift_fences),
    ("POST", "/gaps", tell_gap),
    ("POST", "/exchanges", start_exchange),
    ("POST", "/reconfigurations", start_reconfiguration),
    ("GET", "/reconfigurations/{id}", get_reconfiguration),
    ("GET", "/exchanges/{xid}", get_exchange),
    ("POST", "/drain", start_drain),
    ("GET", "/drain", get_drain),
    ("DELETE", "/drain", cancel_drain),
]
