"""Failover: a client whose broker dies carries on at another one.

When the connection to its broker ends without the application closing it (the broker was
killed, stopped, or the network dropped it), the client tries, in order: the dead broker's
neighbours (each broker names them in its hello), the addresses the application gave
:func:`~canopy_broker.client.connect`, and the lost broker's own address (it may come back, or
be a Kubernetes Service in front of several). At the first broker that answers it

1. attaches under the same client id and sends one *resume* request: its subscriptions (same
   ids and filters), the last sequence number it got from each publisher, and how long it has
   been gone. The broker registers the subscriptions, then serves from its retention what the
   client missed, then answers with the *gaps*: intervals it cannot vouch for (its retention
   does not reach back that far, it is not a neighbour of the dead broker, the repair replayed
   before the client came back). Gaps are reported to the application (:attr:`gaps`, and the
   ``on_gap`` callback), never left silent;
2. sends again everything it published that no broker acknowledged (same publisher and
   sequence numbers, marked as a replay: brokers that already had them do not deliver them
   again), then carries on. When the lost broker was *fenced* (it tells its clients how long
   ago it left the overlay before it lets them go), that includes what it acknowledged since
   it left: cut off from the overlay, it had declared its neighbours dead, so its custody
   passed to a repair with no link, and the overlay never got those publications. The client
   keeps acknowledged publications :attr:`~Client.keep_acked_for` seconds for this.

From the resume on, a notification passes only if it is newer than the last one delivered from
its publisher: the retention and the repair's replay may bring what the client already had.
If no broker takes the client within ``failover_within`` seconds, :class:`ConnectionLost` is
raised to the application, naming the broker that was lost and where it tried.

:class:`FailingOver` is the part of :class:`~canopy_broker.client.Client` that does this; it
declares the client state it works on, like :class:`~canopy_broker.client.migration.Migrating`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from canopy_broker.client.connection import BrokerConnection
from canopy_broker.client.credentials import Credentials
from canopy_broker.client.notification import ClientError, ConnectionLostError
from canopy_broker.core.filters import Filter
from canopy_broker.runtime.framing import (
    B_RESUMED,
    C_PUB_GAP,
    C_REPUBLISH,
    C_RESUME,
    FrameError,
    encode_filter,
    finite_number,
    printable,
)
from canopy_broker.runtime.tasks import TaskSet

CUT_OFF_MARGIN = 1.0
"""Seconds before the time a fenced broker says it left the overlay from which its
acknowledgements are revoked: that time is measured by another broker and reaches the client
late by a hop or two. Sending a publication again that the overlay had costs nothing more
than a duplicate that brokers drop."""
# The furthest back a broker's gap may reach: only absurd values are refused (a client may
# resume after days away, and its gap then reaches back as far).
MAX_GAP_AGO = 1e9
IN_FLIGHT = 15.0
"""Seconds a notification may spend in the overlay on its way to a broker: held by a crash
repair waiting for its routes (its timer: 10 s at least), or in a link's resend queue until
its peer is declared dead. A client that loses its broker tells the next one it may lack
what was on its way then, from the time before the last that it heard each publisher
active within this long (:meth:`FailingOver._gap_from`), not only from the loss:
notifications held upstream while repairs ran were published seconds before the broker died,
and were covered by no gap (chaos soak: 58-3,008 events lost untold at subscribers that
failed over)."""
HEARD_EVERY = 0.25
"""Seconds between looks at which publishers were heard from (:meth:`Client._note_heard`):
the precision of :data:`IN_FLIGHT`'s start, taken off it as a margin."""
REMEMBERED = 10_000
"""Publishers a subscriber keeps its last sequence number for (and when it heard them); past
that, the ones heard longest ago are forgotten, a tenth at a time. A subscriber outliving many
short-lived publishers kept one entry per publisher it ever heard, sent them all at each
resume and looked through them every :data:`HEARD_EVERY` s. A forgotten publisher counts as
never heard at a resume: of its notifications, only those the next broker kept since the loss
are served. That is what it can lack unless it spoke again after a long silence and a broker
held it back for this client (a slow one) for longer than the resume's margin: an untold loss
then, and a duplicate if a broker replays one it had before. Both need more publishers alive
than this at once, which a size bound, unlike a time bound, leaves to deployments that big."""

log = logging.getLogger("canopy.client")


@dataclass(frozen=True)
class Gap:
    """Notifications published between ``since`` and ``until`` (this process's
    ``loop.time()``) may be missing: ``broker`` could not vouch for them after the client
    failed over from ``previous``, for ``reason``."""

    broker: str
    previous: str
    since: float
    until: float
    reason: str

    def __str__(self) -> str:
        if self.previous == self.broker:  # told while staying on it (B_GAP)
            return (
                f"{self.broker} says notifications of {max(0.0, self.until - self.since):.1f} s "
                f"may be missing: {self.reason}"
            )
        return (
            f"after failing over from {self.previous} to {self.broker}, notifications of "
            f"{max(0.0, self.until - self.since):.1f} s may be missing: {self.reason}"
        )


class FailingOver:
    """The failover half of a client (see the module's docstring)."""

    resend = True
    """Send again, after a failover, what no broker acknowledged, and what a fenced broker
    acknowledged after it left the overlay. Only a negative control turns this off: without
    it what the lost broker held when it died is lost for everybody."""

    client_id: str
    credentials: Credentials
    subscriptions: dict[str, Filter]
    addresses: list[str]
    failover_within: float
    on_gap: Callable[[Gap], None] | None
    gaps: list[Gap]
    failovers: int
    _conn: BrokerConnection | None
    _migrated: bool
    _last_seq: dict[str, int]
    # Per publisher, when its last delivered notification was first seen here (the loop's
    # time, at HEARD_EVERY's precision), and the last-seq snapshot that was compared.
    _heard_at: dict[str, tuple[float, float]]  # publisher: (heard last, heard the time before)
    _heard_seq: dict[str, int]
    _heard_checked: float
    _last_frame_at: float  # when the last frame of notifications arrived (the loop's time)
    _unacked: deque[tuple[int, bytes, float]]
    _acked: deque[tuple[float, int, bytes, float]]
    _acked_forgotten: float
    # What a fenced broker acknowledged that is no longer kept to send again (loop times,
    # since and until): told at the next broker, which tells every subscriber (C_PUB_GAP).
    _pub_gap: tuple[float, float] | None
    _tasks: TaskSet
    _closing: bool
    _failover: asyncio.Task[None] | None
    _failover_error: ClientError | None

    def _wake_inbox(self) -> None:
        raise NotImplementedError

    def _wake_publishers(self) -> None:
        raise NotImplementedError

    def _frame(self, conn: BrokerConnection, frame: list[Any]) -> None:
        raise NotImplementedError

    def _lost(self, conn: BrokerConnection) -> None:
        raise NotImplementedError

    @property
    def failing_over(self) -> bool:
        """The connection was lost and the client is looking for another broker."""
        return self._failover is not None and not self._failover.done()

    def _maybe_fail_over(self, conn: BrokerConnection) -> None:
        """``conn``, the client's connection, ended: fail over if it was lost (not closed by
        the application, not refused by the broker with an error of its own)."""
        if (
            conn is not self._conn
            or self._closing
            or self.failing_over
            or self.failover_within <= 0
            or not isinstance(conn.error, ConnectionLostError)
        ):
            return
        self._failover = self._tasks.spawn(self._fail_over(conn), "failover")

    def _candidates(self, lost: BrokerConnection) -> list[str]:
        """Where to go, best first: the lost broker's neighbours (one hop from everything it
        had; the repair's replay reaches a client there), then the application's list, then
        the lost address itself (it may come back)."""
        neighbours = lost.answer.get("neighbours")
        ordered = [a for a in (neighbours or {}).values() if isinstance(a, str)]
        ordered += self.addresses
        return [*dict.fromkeys(a for a in ordered if a != lost.address), lost.address]

    async def _fail_over(self, lost: BrokerConnection) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.failover_within
        # Lost from the close, or from when the broker says it left the overlay (fenced):
        # what the overlay sent on since is asked for, and a repair since reported as a gap.
        lost_at = loop.time() - lost.cut_off_for
        tried: list[str] = []
        log.warning("%s: %s; failing over", self.client_id, lost.error)
        if lost.cut_off_for:
            self._revoke_acks(lost_at - CUT_OFF_MARGIN, lost.broker)
        gap_from = self._gap_from(lost_at)
        while True:
            for address in self._candidates(lost):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    await self._resume_at(address, lost, lost_at, gap_from, min(2.0, remaining))
                except (OSError, TimeoutError, ClientError) as exc:
                    tried.append(f"{address} ({exc or type(exc).__name__})")
                    continue
                self.failovers += 1
                log.warning(
                    "%s: failed over from %s to %s", self.client_id, lost.broker, self.broker
                )
                self._wake_inbox()
                self._wake_publishers()
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            await asyncio.sleep(min(0.25, remaining))
        self._failover_error = ConnectionLostError(
            f"{lost.error}; no broker took over within {self.failover_within:g} s"
            + (f" (tried {', '.join(dict.fromkeys(tried))})" if tried else "")
        )
        self._wake_inbox()
        self._wake_publishers()

    def _note_heard(self, at: float, *, force: bool = False) -> None:
        """Every :data:`HEARD_EVERY` s at most (``force``: now): the publishers whose last
        delivered sequence number moved since the last look were last heard at ``at``, the
        time the last frame before this look arrived (a look stamping its own time would
        date a notification received before a quiet stretch at its end). A look at the
        per-publisher map, not a stamp per notification: the receive path stays as it
        is."""
        if at - self._heard_checked < HEARD_EVERY and not force:
            return
        self._heard_checked = at
        seen = self._heard_seq
        last = self._last_seq
        heard_at = self._heard_at
        for publisher, seq in last.items():
            if seen.get(publisher) != seq:
                seen[publisher] = seq
                before = heard_at.get(publisher)
                heard_at[publisher] = (at, at if before is None else before[0])
        if len(last) > REMEMBERED:  # see REMEMBERED
            by_age = sorted(heard_at.items(), key=lambda item: item[1][0])
            for gone, _ in by_age[: len(last) - REMEMBERED * 9 // 10]:
                last.pop(gone, None)
                del heard_at[gone]
        if len(heard_at) != len(last) or len(seen) != len(last):  # forgotten since
            for gone in [p for p in heard_at if p not in last]:
                del heard_at[gone]
            for gone in [p for p in seen if p not in last]:
                del seen[gone]

    def _gap_from(self, lost_at: float) -> float:
        """Where the next broker's gaps start: at the loss, or earlier, from the time before
        the last that a publisher heard within :data:`IN_FLIGHT` before it was heard (less
        the look's precision). What was published after the last notification heard from it
        and did not arrive may have been on its way to the lost broker (see IN_FLIGHT).

        Not from the last hearing: that dates the last notification by its arrival, and one
        held up on its way (a paused broker between) arrives seconds after it was published;
        what was published just after it, and lost, then fell before the gap (chaos soak:
        9 + 21 events lost untold). Held up, it ends a silence of about as long at the
        client, so the hearing before it, at the silence's start, is not later than its
        publication while the publisher's notifications come steadily; for a sparse one the
        gap reaches back further than it must, at most IN_FLIGHT."""
        self._note_heard(self._last_frame_at, force=True)
        recent = [
            before
            for latest, before in self._heard_at.values()
            if lost_at - IN_FLIGHT <= latest < lost_at
        ]
        if not recent:
            return lost_at
        return max(lost_at - IN_FLIGHT, min(recent) - HEARD_EVERY)

    @property
    def broker(self) -> str:
        raise NotImplementedError

    async def _resume_at(
        self,
        address: str,
        lost: BrokerConnection,
        lost_at: float,
        unsure_from: float,
        within: float,
    ) -> None:
        """Attach at ``address``, resume (subscriptions, what was missed, the gaps) and send
        again what no broker acknowledged. The new connection is the client's from the start,
        so what the broker serves is delivered; if anything fails it is dropped again."""
        new = await BrokerConnection.open(self, address, self.client_id, within)
        self._conn = new
        self._migrated = True  # from now on only what is newer than the last delivery passes
        new.resuming_from = lost.broker
        try:
            now = asyncio.get_running_loop().time()
            request = {
                "subs": [[sid, encode_filter(f)] for sid, f in self.subscriptions.items()],
                "last": self._last_seq,
                "lost_for": now - lost_at,
                # The gaps start here (older brokers ignore it, and start them at the loss).
                "unsure_for": now - unsure_from,
                "previous": lost.broker,
            }
            resent_for = self._resent_for(now)
            if resent_for is not None:  # older brokers ignore it
                request["resent_for"] = resent_for
            answer = new.expect(B_RESUMED, "")
            new.send(orjson.dumps([C_RESUME, request]))
            sent = self._send_again(new, 0)  # behind the resume: after the subscriptions
            async with asyncio.timeout(within):
                await answer
            if self._pub_gap is not None:  # once, at the broker that took us
                now = asyncio.get_running_loop().time()
                since, until = self._pub_gap
                new.send(orjson.dumps([C_PUB_GAP, round(now - since, 3), round(now - until, 3)]))
                self._pub_gap = None
            # What was published while we waited; from the return on, publish sends itself
            # (nothing runs between the last line and the end of the failover).
            self._send_again(new, sent)
        except BaseException:
            self._conn = lost
            new.abort()
            raise

    def _resent_for(self, now: float) -> float | None:
        """How long ago the oldest publication this client sends again was published (None:
        none). The broker that takes it keeps that: if the overlay is split meanwhile, they
        reach one part only, and the gap the others are told when it is joined again must
        reach back to them (it started at the split, after they were published: chaos soak,
        1-6 events lost untold per subscriber)."""
        return round(now - self._unacked[0][2], 3) if self._unacked else None

    def _revoke_acks(self, since: float, broker: str) -> None:
        """What ``broker`` acknowledged from ``since`` on (it had left the overlay then) goes
        back among the unacknowledged, in order, to be sent again at the next broker; one
        that had it already passes it on without delivering it again."""
        acked, unacked = self._acked, self._unacked
        revoked = 0
        while acked and acked[-1][0] >= since:
            _, seq, body, published = acked.pop()
            unacked.appendleft((seq, body, published))
            revoked += 1
        if revoked:
            log.warning(
                "%s: %s acknowledged %d publication(s) after it left the overlay: sending "
                "them again",
                self.client_id,
                broker,
                revoked,
            )
        if self._acked_forgotten >= since:
            log.error(
                "%s: %s acknowledged publications after it left the overlay that are no longer "
                "kept (keep_acked_for): they may not have reached the other brokers; the "
                "subscribers are told",
                self.client_id,
                broker,
            )
            self._pub_gap = (since, self._acked_forgotten)

    def _send_again(self, conn: BrokerConnection, after: int) -> int:
        """Send what no broker acknowledged (or a fenced one's acknowledgement was taken back
        for: _revoke_acks), from sequence number ``after`` on, marked as sent again; returns
        the last sequence number sent (held during a failover count too)."""
        last = after
        for seq, body, _ in self._unacked:
            if seq > after:
                if self.resend:
                    conn.send(b"[%d,%d," % (C_REPUBLISH, seq) + body + b"]")
                last = seq
        return last

    def _told_gap(
        self, conn: BrokerConnection, since: object, until: object, reason: object
    ) -> None:
        """The broker this client stays on says what it may have missed (an overlay split
        and joined again)."""
        self._gap(conn.broker, conn.broker, since, until, reason)

    def _gap(
        self, broker: str, previous: str, since: object, until: object, reason: object
    ) -> None:
        """Record a gap the broker gave in seconds ago, and tell the application."""
        since_s, until_s = finite_number(since), finite_number(until)
        if since_s is None or until_s is None or not -60 <= until_s <= since_s <= MAX_GAP_AGO:
            raise FrameError(f"a gap needs seconds ago, since before until: {[since, until]!r}")
        now = asyncio.get_running_loop().time()
        gap = Gap(broker, previous, now - since_s, now - until_s, printable(str(reason)))
        self.gaps.append(gap)
        log.warning("%s: %s", self.client_id, gap)
        if self.on_gap is not None:
            self.on_gap(gap)

    def _resumed(self, conn: BrokerConnection, served: object, gaps: object) -> None:
        """The broker's answer to the resume request: record the gaps it names."""
        for g in gaps if isinstance(gaps, list) else []:
            if isinstance(g, list) and len(g) == 3:
                self._gap(conn.broker, conn.resuming_from, g[0], g[1], g[2])
        log.info("%s: resumed on %s (%s from retention)", self.client_id, conn.broker, served)
        conn.answered(B_RESUMED, "")
