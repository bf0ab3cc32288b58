"""Async client for a broker's admin API (shared by tests, the benchmark and the operator).

One :class:`aiohttp.ClientSession` per :class:`AdminClient`, or a session the caller owns and
shares across many brokers (the operator does: one connection pool for the whole overlay).
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import Any

import aiohttp

from canopy_broker.runtime.framing import AsyncClosing


class AdminError(Exception):
    """The admin API answered with an error status."""

    def __init__(self, status: int, message: str, url: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status
        self.message = message


def base_url(address: str, tls: bool = False) -> str:
    """``HOST:PORT`` or a full URL -> URL without trailing slash (https with ``tls``)."""
    if "://" not in address:
        address = ("https://" if tls else "http://") + address
    return address.rstrip("/")


class AdminClient(AsyncClosing):
    """Typed calls for every admin endpoint; raises :class:`AdminError` on error statuses."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout: float = 10.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: the context that verifies the broker's certificate (the overlay's CA);
        the admin API of a broker started with TLS speaks HTTPS only."""
        self.url = base_url(address, tls is not None)
        self._ssl: ssl.SSLContext | bool = tls if tls is not None else True
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own_session = session is None
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        ok: tuple[int, ...] = (200,),
        params: dict[str, str] | None = None,
        waits: float = 0.0,
    ) -> Any:
        """``waits``: seconds the broker may hold the request before it answers (the ``wait``
        of a long call), added to this client's timeout so it does not give up first."""
        url = self.url + path
        timeout = self._timeout
        if waits and timeout.total is not None:
            timeout = aiohttp.ClientTimeout(total=timeout.total + waits)
        async with self._sess().request(
            method,
            url,
            json=json,
            headers=self._headers,
            params=params,
            timeout=timeout,
            ssl=self._ssl,
        ) as resp:
            if resp.status not in ok:
                text = await resp.text()
                try:
                    message = str((await resp.json()).get("error", text))
                except (aiohttp.ContentTypeError, ValueError, AttributeError):
                    message = text
                raise AdminError(resp.status, message, url)
            if resp.content_type == "application/json":
                return await resp.json()
            return await resp.text()

    async def _object(self, method: str, path: str, **options: Any) -> dict[str, Any]:
        """A request whose answer is a JSON object, typed as one (most endpoints)."""
        result: dict[str, Any] = await self._request(method, path, **options)
        return result

    # -- endpoints ---------------------------------------------------------------------------

    async def _probe(self, path: str) -> bool:
        try:
            await self._request("GET", path)
        except (AdminError, aiohttp.ClientError, TimeoutError):
            return False
        return True

    async def healthz(self) -> bool:
        return await self._probe("/healthz")

    async def reports_failed(self) -> bool:
        """Whether the broker answers that it has failed (``/healthz`` 500): not merely that
        it did not answer (paused, busy, a connection reset), which restarting would not
        mend but lose."""
        try:
            await self._request("GET", "/healthz")
        except AdminError as exc:
            return exc.status == 500
        except (aiohttp.ClientError, TimeoutError):
            return False
        return False

    async def readyz(self) -> bool:
        return await self._probe("/readyz")

    async def status(self) -> dict[str, Any]:
        return await self._object("GET", "/status")

    async def routing(self) -> dict[str, Any]:
        return await self._object("GET", "/routing")

    async def add_link(self, peer: str, address: str, *, wait: float = 5.0) -> dict[str, Any]:
        """Make this broker dial ``peer`` at ``address``; waits up to ``wait`` s for it to be up
        (``result["up"]`` says whether it is). Idempotent."""
        return await self._object(
            "POST",
            "/links",
            json={"peer": peer, "address": address, "timeout": wait},
            waits=wait,
            ok=(200, 202),
        )

    async def remove_link(self, peer: str) -> bool:
        result = await self._request("DELETE", f"/links/{peer}")
        return bool(result["removed"])

    async def drop_link_connection(self, peer: str) -> bool:
        """Abort the link's TCP connection (it reconnects and resumes): fault injection."""
        result = await self._request("POST", f"/links/{peer}/drop")
        return bool(result["dropped"])

    async def cut_link(self, peer: str) -> bool:
        """Fail the link for good, both brokers alive (its connections refused, a detour's
        excepted): fault injection for link-failure repair."""
        result = await self._request("POST", f"/links/{peer}/cut")
        return bool(result["cut"])

    async def heal_link(self, peer: str) -> bool:
        result = await self._request("DELETE", f"/links/{peer}/cut")
        return bool(result["healed"])

    async def telemetry(self, since: int = 0, limit: int = 10_000) -> dict[str, Any]:
        return await self._object(
            "GET", "/telemetry", params={"since": str(since), "limit": str(limit)}
        )

    async def peers(self) -> dict[str, str]:
        result = await self._request("GET", "/peers")
        return dict(result["peers"])

    async def set_peers(self, peers: dict[str, str]) -> dict[str, str]:
        """Merge ``name -> HOST:PORT`` into the broker's address book (exchange links and
        out-of-band channels dial brokers that are not neighbours yet)."""
        result = await self._request("POST", "/peers", json={"peers": peers})
        return dict(result["peers"])

    async def lift_fences(self, incarnations: dict[str, str]) -> list[str]:
        """Stop refusing these processes (``name -> incarnation``) if this broker declared
        exactly them dead: both sides of a healed partition are alive (the restore's join).
        Returns the names whose fence was lifted."""
        result = await self._request("POST", "/fences/lift", json={"incarnations": incarnations})
        return [str(p) for p in result["lifted"]]

    async def tell_gap(
        self, since: float, until: float, reason: str, covers: Sequence[str] = ()
    ) -> int:
        """Tell the broker's subscribers that notifications published between ``since`` and
        ``until`` (epoch seconds) may be missing, for ``reason``; how many were told.
        ``covers``: brokers whose lifted fences (``lifted_since`` in ``/status``) this gap
        tells of: the broker forgets them."""
        body = {"since": since, "until": until, "reason": reason, "covers": list(covers)}
        result = await self._request("POST", "/gaps", json=body)
        return int(result["told"])

    async def start_exchange(
        self,
        path: list[str],
        remove: tuple[str, str],
        *,
        ordering: str = "fifo",
        xid: str | None = None,
        wait: float = 0.0,
        lease: float | None = None,
    ) -> dict[str, Any]:
        """Ask ``path[0]`` (this broker) to exchange link ``remove`` for (path[0], path[-1]),
        the coordinated way. Waits up to ``wait`` s; ``result["state"]`` is running, finished or
        failed. Idempotent per ``xid``. ``lease``: seconds a locked broker waits for news of
        the exchange before rolling it back or forward (the broker's default: 30)."""
        body: dict[str, Any] = {
            "path": path,
            "remove": list(remove),
            "ordering": ordering,
            "wait": wait,
        }
        if xid is not None:
            body["xid"] = xid
        if lease is not None:
            body["lease"] = lease
        return await self._object("POST", "/exchanges", json=body, ok=(200, 202), waits=wait)

    async def reconfigure(self, rid: str, kind: str, **fields: Any) -> dict[str, Any]:
        """POST /reconfigurations: ``kind`` exchange / add-leaf / remove-leaf, idempotent by
        ``rid``. Waiting calls get the time they ask for (``wait``)."""
        body = {"id": rid, "kind": kind, **fields}
        wait = fields.get("wait", 30.0 if kind != "exchange" else 0.0)
        result: dict[str, Any] = await self._request(
            "POST", "/reconfigurations", json=body, ok=(200, 202), waits=float(wait)
        )
        return result

    async def reconfiguration(self, rid: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._request("GET", f"/reconfigurations/{rid}")
        return result

    async def exchange(self, xid: str) -> dict[str, Any]:
        return await self._object("GET", f"/exchanges/{xid}")

    async def drain(
        self, target: str, address: str | None = None, *, wait: float = 0.0
    ) -> dict[str, Any]:
        """Ask every client of this broker to migrate to neighbour ``target`` (at ``address``,
        default: the broker's address book). Waits up to ``wait`` s for the broker to be empty;
        ``result["drained"]`` says whether it is. Idempotent."""
        body: dict[str, Any] = {"target": target, "wait": wait}
        if address is not None:
            body["address"] = address
        return await self._object("POST", "/drain", json=body, ok=(200, 202), waits=wait)

    async def drain_status(self) -> dict[str, Any]:
        return await self._object("GET", "/drain")

    async def cancel_drain(self) -> dict[str, Any]:
        return await self._object("DELETE", "/drain")

    async def metrics(self) -> str:
        return str(await self._request("GET", "/metrics"))
