"""Migration (make-before-break, docs/broker.md): moving a client to a neighbouring broker.

:meth:`Migrating.migrate` moves the client without losing, duplicating or reordering a
notification, and a draining broker's redirect makes the library do it on its own. While it runs
the client holds two connections: the old one keeps delivering until the broker's *marker* arrives
on it, the new one's deliveries are held until then; from the marker on, a notification passes
only if its sequence number is above the last one delivered from its publisher (each connection is
FIFO per publisher, so that removes exactly the notifications both connections carried).

:class:`Migrating` is the part of :class:`~canopy_broker.client.Client` that does this, kept in a
module of its own; it declares the client state it works on.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson

from canopy_broker.client.connection import BrokerConnection, subscribe_message
from canopy_broker.client.credentials import Credentials
from canopy_broker.client.notification import ClientError
from canopy_broker.core.filters import Filter
from canopy_broker.runtime.framing import B_MIGRATING, B_SUBSCRIBED, C_MIGRATING, C_MOVE
from canopy_broker.runtime.inbox import Notification
from canopy_broker.runtime.tasks import TaskSet

log = logging.getLogger("canopy.client")


@dataclass
class Migration:
    """A move in progress: deliveries from ``old`` count until its marker, those from ``new``
    are held until then."""

    old: BrokerConnection
    new: BrokerConnection
    switched: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    held: list[Notification] = field(default_factory=list)


class Migrating:
    """The migration half of a client (see the module's docstring)."""

    dedup = True
    """Drop notifications not newer than the last one delivered from their publisher once a
    migration has switched connections. Only a negative control turns this off: without it the
    notifications both connections carried are delivered twice."""

    client_id: str
    credentials: Credentials
    follow_redirects: bool
    subscriptions: dict[str, Filter]
    migrations: int
    duplicates_dropped: int
    migration_error: BaseException | None
    _conn: BrokerConnection | None
    _migration: Migration | None
    _migrated: bool
    _last_seq: dict[str, int]
    _lock: asyncio.Lock
    _redirect: asyncio.Task[None] | None
    _tasks: TaskSet
    _inbox: deque[Notification]
    _closing: bool

    def _check_open(self) -> BrokerConnection:
        raise NotImplementedError

    def _wake_inbox(self) -> None:
        raise NotImplementedError

    def _frame(self, conn: BrokerConnection, frame: list[Any]) -> None:
        raise NotImplementedError

    def _switch(self, m: Migration) -> None:
        """The marker (or the end of the old connection): from now on the new connection
        delivers, and only what is newer than the last delivery from each publisher."""
        self._migrated = True
        m.switched.set_result(None)
        last = self._last_seq
        for n in m.held:
            if n.seq <= last.get(n.publisher, 0) and self.dedup:
                self.duplicates_dropped += 1
                continue
            last[n.publisher] = n.seq
            self._inbox.append(n)
        m.held.clear()
        self._wake_inbox()

    def _lost(self, conn: BrokerConnection) -> None:
        m = self._migration
        if m is not None and conn is m.old and not m.switched.done():
            # The old broker is gone or dropped us: nothing more will come from it, and what it
            # had not delivered is lost with it. The new connection takes over.
            self._switch(m)
        self._wake_inbox()

    def _redirected(self, conn: BrokerConnection, target: object, address: object) -> None:
        """A draining broker asks us to move to its neighbour ``target``. Kept on the
        connection it came on: it may come before :func:`connect` returns, or on the new
        connection while a migration is still under way, and it is followed once that
        connection is the client's."""
        if isinstance(target, str) and isinstance(address, str):
            conn.redirect = (target, address)
            self._maybe_follow()

    def _maybe_follow(self) -> None:
        conn = self._conn
        if (
            conn is None
            or conn.redirect is None
            or not self.follow_redirects
            or self._closing
            or self._migration is not None
            or (self._redirect is not None and not self._redirect.done())
        ):
            return
        self._redirect = self._tasks.spawn(self._follow(), "follow redirect")

    async def _follow(self) -> None:
        while (conn := self._conn) is not None and conn.redirect is not None:
            target, address = conn.redirect
            conn.redirect = None
            try:
                await self.migrate(address, target)
            except Exception as exc:  # reported on the client; the application decides
                self.migration_error = exc
                log.warning(
                    "%s: could not follow a redirect to %s: %s", self.client_id, target, exc
                )
                return

    async def _resubscribe(self, new: BrokerConnection) -> None:
        """Step 1 of :meth:`migrate`: the same subscription ids and filters on ``new``."""
        await asyncio.gather(
            *(
                new.request(B_SUBSCRIBED, sid, subscribe_message(sid, f))
                for sid, f in self.subscriptions.items()
            )
        )

    async def migrate(
        self,
        address: str,
        broker: str | None = None,
        *,
        within: float = 30.0,
    ) -> None:
        """Move to the broker at ``address`` (named ``broker``, if given, which is checked), a
        neighbour of the current one, without losing, duplicating or reordering anything.

        1. Connect to the new broker under the same client id and re-subscribe with the same
           subscription ids and filters (identical routing keys: nothing new propagates past
           the new broker). Its deliveries are held.
        2. Tell it we migrate from the old broker and wait for its answer: from then on it
           holds our publications until the old broker says ``Moved``, and it has sent the
           marker down the link to the old broker.
        3. Switch publishing to the new connection and tell the old broker we move (after
           everything we published there, so ``Moved`` follows all of it).
        4. At the marker on the old connection, deliver what the new one held and everything
           after it, if newer than the last delivery from its publisher; then leave the old
           broker.

        Failures before step 3 leave the client where it was. If the marker does not arrive
        within ``within`` seconds the client switches anyway and raises :class:`ClientError` (code
        ``marker-timeout``): duplicates are still filtered, but notifications may be missing.
        """
        async with self._lock:
            old = self._check_open()
            if broker is not None and broker == old.broker:
                raise ValueError(f"already attached to {broker}")
            new = await BrokerConnection.open(self, address, self.client_id, within)
            m = Migration(old, new)
            self._migration = m
            announced = False
            try:
                if broker is not None and new.broker != broker:
                    raise ClientError(f"{address} is {new.broker}, not {broker}", "wrong-broker")
                async with asyncio.timeout(within):
                    await self._resubscribe(new)
                    if not old.is_closing():
                        msg = orjson.dumps([C_MIGRATING, old.broker])
                        await new.request(B_MIGRATING, old.broker, msg)
                        announced = True
                if old.is_closing() and announced:
                    # Too late to say Moved: the new broker would hold our publications for
                    # ever. Leaving it releases them; the client ends closed, as it would have
                    # without the move.
                    raise ClientError(
                        f"the connection to {old.broker} was lost during the move",
                        "connection-lost",
                    )
            except BaseException:
                self._migration = None
                await new.close_gracefully()
                raise
            try:
                if announced:  # after everything published on the old connection: Moved
                    old.send(orjson.dumps([C_MOVE, new.broker]))
                    old.write_out()
                elif not m.switched.done():
                    self._switch(m)  # the old connection died first: a plain re-attach
                self._conn = new
                try:
                    await asyncio.wait_for(asyncio.shield(m.switched), within)
                except TimeoutError:
                    self._switch(m)
                    raise ClientError(
                        f"no marker from {old.broker} within {within}s: switched anyway, "
                        "notifications may be missing",
                        "marker-timeout",
                    ) from None
                finally:
                    await old.leave()
            finally:
                if not m.switched.done():
                    self._switch(m)
                self._migration = None
                self._wake_inbox()
                self._maybe_follow()  # the new broker may be draining too
            self.migrations += 1
