"""Async client library for Canopy brokers.

    async with await connect("127.0.0.1:7400") as c:
        sub = await c.subscribe('symbol = "ACME" and price < 10')
        await c.publish({"symbol": "ACME", "price": 5})
        async for n in c.notifications():
            print(n.publisher, n.seq, n.attrs, n.sub_ids)

Publishes are batched: :meth:`Client.publish` appends the encoded message to a buffer that is
written as one frame at the end of the current event-loop iteration (or at once when it grows
large), so a tight publish loop costs one ``write()`` per few hundred events while a single
publish still goes out without a timer delay. :meth:`Client.flush` forces the write and waits for
the socket to accept it. When the broker applies backpressure (it stops reading from publishers),
the socket's buffer fills and ``publish`` waits; ``publish_nowait`` never waits.

Receiving: :meth:`Client.receive` (or ``async for`` over :meth:`Client.notifications`) waits for
notifications in a task; ``connect(..., on_notifications=callback)`` instead hands each batch to
``callback`` as it is read, with no task switch (the style of paho's ``on_message``; a process
with many subscribers spends a third less CPU this way, see docs/performance.md). The callback
is a plain function (an ``async def`` one is refused: nothing would await it); it must not
block, and with it nothing queues in the client, so its own storage is the application's flow
control. What it raises goes to the event loop's exception handler and the connection stays up.

Filters are parsed here before anything is sent, so a typo raises :class:`FilterError` at the call
instead of costing the connection (the broker closes connections that send invalid filters).

**Migration** (make-before-break, docs/broker.md): :meth:`Client.migrate` moves the client to a
neighbouring broker without losing, duplicating or reordering a notification, and a draining
broker's redirect makes the library do it on its own; see :mod:`.migration`.

**Failover**: when its broker is lost the client carries on at another one (the dead broker's
neighbours first), re-subscribes, is served what it missed from that broker's retention, sends
again what no broker acknowledged, and is told of any interval that cannot be vouched for
(:class:`Gap`); see :mod:`.failover`. ``connect`` takes several addresses for that.

The package is split by job: :mod:`.connection` (one connection to one broker), :mod:`.migration`
(moving between brokers), :mod:`.failover` (carrying on when a broker is lost),
:mod:`.notification` (what is received) and :mod:`.api` (the client).
"""

from __future__ import annotations

from canopy_broker.client.api import Client, NotificationCallback, connect, parse_addresses
from canopy_broker.client.credentials import Credentials
from canopy_broker.client.failover import Gap
from canopy_broker.client.notification import (
    ClientError,
    ConnectionLost,
    ConnectionLostError,
)
from canopy_broker.runtime.inbox import Notification

__all__ = [
    "Client",
    "ClientError",
    "ConnectionLost",
    "ConnectionLostError",
    "Credentials",
    "Gap",
    "Notification",
    "NotificationCallback",
    "connect",
    "parse_addresses",
]
