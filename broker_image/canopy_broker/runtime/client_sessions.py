"""The broker's client sessions: attach, publish, (un)subscribe, migrate, leave, and draining.

:class:`ClientSessions` owns the table of attached :class:`~.links.Client` objects and turns a
client's messages into core inputs, in order. It reaches the rest of the broker only through
:class:`ClientHost`, so it never imports :mod:`canopy_broker.runtime.server`.

Draining (before a leaf broker is removed) lives here too: it is about clients. Every attached
client, and any that attaches while the drain lasts, is told to migrate to a neighbour; the broker
is drained once no client is attached and its links have had everything acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.events import Event
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import (
    ClientAttach,
    ClientDetach,
    ClientMigrating,
    ClientMove,
    ClientPublish,
    ClientPublisherGap,
    ClientResume,
    ClientSubscribe,
    ClientUnsubscribe,
    Effect,
    Input,
    Resumed,
)
from canopy_broker.runtime.conn import Conn
from canopy_broker.runtime.framing import (
    B_GAP,
    B_MIGRATING,
    B_PUBACK,
    B_REDIRECT,
    B_RESUMED,
    B_SUBSCRIBED,
    B_UNSUBSCRIBED,
    C_LEAVE,
    C_MIGRATING,
    C_MOVE,
    C_PUB_GAP,
    C_PUBLISH,
    C_REPUBLISH,
    C_RESUME,
    C_SUBSCRIBE,
    C_UNSUBSCRIBE,
    F_ERROR,
    FrameError,
    FrameProtocol,
    TurnBudget,
    check_wire_attributes,
    control_frame,
    decode_filter,
    dumps,
    finite_number,
    parse_address,
)
from canopy_broker.runtime.links import Client, Link
from canopy_broker.runtime.metrics import BrokerMetrics
from canopy_broker.runtime.outbox import Outlet
from canopy_broker.runtime.security import AccessError, Policy, Principal
from canopy_broker.runtime.tasks import TaskSet

log = logging.getLogger("canopy.broker")
_PUBLISH = frozenset((C_PUBLISH, C_REPUBLISH))
# The oldest a publisher gap may reach back: a client keeps acknowledged publications 30 s by
# default (Client.keep_acked_for); an hour is room for any setting, not for a prank.
MAX_PUBLISHER_GAP_AGO = 3600.0
WITHDRAW_AT = 256
"""A leaving client with more subscriptions than this has them withdrawn over several loop
turns (see :meth:`ClientSessions.detach`); fewer are withdrawn at once (~10 ms at most)."""


class ClientHost(Protocol):
    """What client sessions need from the broker process that owns them."""

    name: str
    incarnation: str
    core: BrokerCore
    client_peers: dict[str, str]  # neighbours' client addresses (what clients fail over to)
    links: dict[str, Link]
    metrics: BrokerMetrics
    resume_slack: float
    """Seconds added to a resuming client's outage: what its broker may have swallowed before
    the client noticed it was gone."""
    max_subscriptions: int
    queue_slot: int  # bytes of a client's queue counted as one message (BrokerConfig.slot)
    tasks: TaskSet
    work_budget: TurnBudget
    stopping: bool

    @property
    def publishers_paused(self) -> bool: ...

    def now(self) -> float: ...

    def apply(self, effects: list[Effect]) -> None: ...

    def route_event(self, inp: Input, event: Event, source_kind: str, source: str) -> None: ...

    def publications(self) -> None: ...

    def answer_hello(self, conn: Conn, **fields: object) -> None: ...

    def mark_dirty(self, dest: Client) -> None: ...

    def refusal(self, role: str, conn: FrameProtocol, exc: AccessError) -> FrameError: ...

    def unpressure(self, dest: Client) -> None: ...


def _covered(link: Link, session: str, position: int) -> bool:
    """The link has acknowledged ``position`` of ``session``, or that custody moved on: the link
    is gone or restarted (a repair replays what it held)."""
    return link.base > position or link.removed or link.session != session


def _name(value: object, what: str) -> str:
    if type(value) is not str or not value:
        raise FrameError(f"{what} must be a broker name, got {value!r}")
    return value


def untold(
    told: list[tuple[float, float]], since: float, until: float
) -> list[tuple[float, float]]:
    """The parts of ``[since, until]`` outside the stretches ``told`` (sorted, disjoint)."""
    parts, start = [], since
    for a, b in told:
        if b <= start or a >= until:
            continue
        if a > start:
            parts.append((start, a))
        start = max(start, b)
    if start < until:
        parts.append((start, until))
    return parts


def merged(
    told: list[tuple[float, float]], since: float, until: float
) -> list[tuple[float, float]]:
    """``told`` with ``[since, until]`` added, kept sorted and disjoint."""
    out: list[tuple[float, float]] = []
    for a, b in sorted([*told, (since, until)]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _seconds(value: object, what: str, least: float = 0.0) -> float:
    """A duration a resume request gives (``what``): finite, from ``least`` on, within
    reason."""
    seconds = finite_number(value)
    if seconds is None or not least <= seconds < 1e9:
        raise FrameError(f"resume: {what} must be seconds >= {least:g}, got {value!r}")
    return seconds


RESENT_KEPT = 256
"""Publishers whose resend a broker remembers (see :attr:`ClientSessions.resent`)."""


class ClientSessions:
    """Every client attached to one broker, and the handling of their messages."""

    def __init__(self, host: ClientHost, unacknowledged: Callable[[], int]) -> None:
        self.host = host
        self.clients: dict[str, Client] = {}
        # Each attached client's outlet by id, kept with ``clients`` (and only here): what the
        # compiled fan-out queues notifications to (runtime/outbox.py).
        self.outlets: dict[str, Outlet] = {}
        self._counter = 0
        self._unacknowledged = unacknowledged
        m = host.metrics
        self._m_published = m.published
        self._m_client_in = m.client_messages.labels("in")
        # Draining (before a leaf is removed): the neighbour its clients are sent to.
        self.drain_target: tuple[str, str] | None = None  # (name, HOST:PORT)
        self._drained = asyncio.Event()
        # Clients gone from ``clients`` whose subscriptions are still being withdrawn (what is
        # left of each, in reverse), the worker doing it, and the hello waiting for each.
        self._leaving: dict[str, list[str]] = {}
        self._withdrawer: asyncio.Task[None] | None = None
        self._waiting: dict[str, Conn] = {}
        # Publish acknowledgements sent: the broker paces its acknowledgement rounds by the
        # last one that sent any (Broker._acknowledge).
        self.pubacks = 0
        # Publishers that failed over to this broker and sent publications again: since when
        # those were published, and when they came (epoch seconds), the last RESENT_KEPT. A
        # join of a split overlay reads them (status "resent"): what came here while the
        # parts were apart reached this part only, and its gap must reach back to them.
        self.resent: dict[str, tuple[float, float]] = {}

    # ------------------------------------------------------------------ attach and detach

    def attach(self, conn: Conn, hello: dict[str, Any], principal: Principal | None = None) -> None:
        """A client hello (``principal``: who it proved to be, see security.py)."""
        host = self.host
        cid = hello.get("client_id")
        if cid is None:
            self._counter += 1
            cid = f"{host.name}-{host.incarnation}-{self._counter}"
            if principal is not None and not principal.permissions.may_use_id(principal.name, cid):
                cid = f"{principal.name}/{cid}"  # under its own name, like any id it picks
        elif type(cid) is not str or not cid:
            raise FrameError(f"client_id must be a non-empty string, got {cid!r}", "bad-hello")
        if cid in self.clients:
            raise FrameError(f"client id {cid!r} is already attached here", "client-id-in-use")
        if cid in self._leaving:  # defensive: a hello under a leaving id is held first
            self._withdrawn(cid)  # (held_until_withdrawn); were it not, the rest goes at once
        host.apply(host.core.handle(ClientAttach(cid), host.now()))
        client = Client(cid, conn, principal, slot=host.queue_slot)
        self.clients[cid] = client
        self.outlets[cid] = client.outlet
        conn.role = "client"
        conn.client = client
        core = host.core
        neighbours = {n: a for n, a in host.client_peers.items() if core.is_neighbour(n)}
        # ``acks``: this broker acknowledges publications (the client keeps what is not acked
        # and sends it again after a failover); ``neighbours``: where to fail over to first.
        host.answer_hello(conn, client_id=cid, acks=True, neighbours=neighbours)
        if self.drain_target is not None:
            self._redirect(client, *self.drain_target)

    def detach(self, client: Client) -> None:
        """The client is gone (left, or its connection broke): withdraw its subscriptions.
        Only the connection that attached it may detach it: a late loss of an older
        connection under the same id must not take the newer one's subscriptions with it.

        A client holding thousands of subscriptions is withdrawn over several loop turns, by
        one worker for all leaving clients, within the broker's turn budget: in one go, 5,000
        held the loop for ~0.2 s, and every other connection and heartbeat with it. Meanwhile
        nothing is delivered to it (it is no longer in ``clients``) and it keeps its id in the
        core until the last one is gone; a client that comes back under that id waits for that
        (:meth:`held_until_withdrawn`). Withdrawn at once instead: a client the core holds
        published events for (a migration's hold, released by the detach: later would reorder
        them behind the client's republications elsewhere), and any while the broker stops."""
        if self.clients.get(client.id) is not client:
            return
        host = self.host
        del self.clients[client.id]
        del self.outlets[client.id]
        client.pending.clear()
        client.outlet.pending_bytes = 0
        host.unpressure(client)
        subs = host.core.routing.subscriptions(client.id)
        if (
            subs is not None
            and len(subs) > WITHDRAW_AT
            and not host.stopping
            and not host.core.holds_for(client.id)
        ):
            self._leaving[client.id] = list(subs)[::-1]  # popped from the end, in order
            if self._withdrawer is None:
                self._withdrawer = host.tasks.spawn(self._withdraw(), "withdrawals")
        else:
            self._detached(client.id)

    def held_until_withdrawn(self, conn: Conn, cid: object) -> bool:
        """Whether a client's hello (authenticated already) must wait: its id is that of a
        client whose subscriptions are still being withdrawn. The caller holds the frame and it
        is handled when the withdrawal ends, rather than have the rest withdrawn at once, which
        would hold the loop: reconnecting at once, even on purpose, costs no stall. One hello
        waits per id (another is refused as for an attached id); a held connection still
        answers to the hello timeout, so none waits longer than that."""
        if not isinstance(cid, str) or cid not in self._leaving:
            return False
        waiting = self._waiting.get(cid)
        if waiting is not None and not waiting.is_closing():
            raise FrameError(f"client id {cid!r} is already attached here", "client-id-in-use")
        self._waiting[cid] = conn
        return True

    async def _withdraw(self) -> None:
        """The worker: one unsubscription after another, oldest leaver first, at least one per
        loop turn and as many as the turn budget allows. A failure withdraws that client's
        rest at once (logged); cancelled (the broker stops), everything left goes at once."""
        host = self.host
        core, loop, leaving = host.core, asyncio.get_running_loop(), self._leaving
        try:
            while leaving:
                await asyncio.sleep(0)
                deadline = host.work_budget.deadline(loop)
                while leaving:
                    cid = next(iter(leaving))
                    rest = leaving[cid]
                    try:
                        host.apply(core.handle(ClientUnsubscribe(cid, rest.pop()), host.now()))
                    except Exception:
                        log.exception("%s: withdrawing %s failed; the rest at once", host.name, cid)
                        rest.clear()
                    if not rest:
                        self._withdrawn(cid)
                    if time.perf_counter() >= deadline:
                        break
        finally:
            self._withdrawer = None
            for cid in list(leaving):
                self._withdrawn(cid)

    def _withdrawn(self, cid: str) -> None:
        del self._leaving[cid]
        self._detached(cid)
        waiting = self._waiting.pop(cid, None)
        if waiting is not None and not waiting.is_closing():
            waiting.release("withdrawing")

    def _detached(self, cid: str) -> None:
        core = self.host.core
        if core.routing.has_client(cid):
            self.host.apply(core.handle(ClientDetach(cid), self.host.now()))
        if self.drain_target is not None:
            self.check_drained()

    def _redirect(self, client: Client, target: str, address: str) -> None:
        self.send(client, dumps([B_REDIRECT, target, address]))

    def send(self, client: Client, msg: bytes) -> None:
        client.pending.append(msg)
        client.outlet.pending_bytes += len(msg)
        self.host.mark_dirty(client)

    def tell_gap(self, since: float, until: float, reason: str) -> int:
        """Tell every client with a subscription here that notifications published between
        ``since`` and ``until`` (wall clock) may be missing, for ``reason``; how many were told.
        A client that stays put hears of what it missed this way (an overlay split and joined
        again: docs/operations.md), as a client that fails over does in its resume answer."""
        now = time.time()
        routing = self.host.core.routing
        told = 0
        for client in self.clients.values():
            if not routing.subscriptions(client.id):
                continue
            # Only what it was not told already, as its own gap each: a join retried, or a
            # later join of a third part, tells the sides of an earlier join from the same
            # start (review: the same stretch twice). Per client, not per broker: one that
            # attached since (failing over, reconnecting) was not told the first (review).
            parts = untold(client.gaps_told, since, until)
            for a, b in parts:
                self.send(client, dumps([B_GAP, round(now - a, 3), round(now - b, 3), reason]))
            told += bool(parts)
            # Remembered up to now at most: an ``until`` ahead (a clock ahead of this one)
            # silences nothing later.
            if since < now:
                client.gaps_told = merged(client.gaps_told, since, min(until, now))
        return told

    # ------------------------------------------------------------------ messages

    def messages(
        self, client: Client, items: list[Any], deadline: float = math.inf
    ) -> list[Any] | None:
        """Handle a client's messages in order; if ``deadline`` passes, return the ones not
        handled yet (they are handed back on the next loop turn, still in order)."""
        host = self.host
        core, now = host.core, host.now
        cid = client.id
        published = 0
        handled = 0
        rest: list[Any] | None = None
        for item in items:
            if handled & 15 == 15 and time.perf_counter() >= deadline:
                rest = items[handled:]
                break
            handled += 1
            if type(item) is not list or not item:
                raise FrameError(f"a client message must be a non-empty array, got {item!r}")
            code = item[0]
            if code in _PUBLISH and len(item) == 3:
                seq = item[1]
                if (
                    type(seq) is not int
                    or seq < 1
                    or (client.last_seq and seq != client.last_seq + 1)
                ):
                    raise FrameError(
                        f"publish seq {seq!r} after {client.last_seq}: seq must grow by one",
                        "sequence",
                    )
                if client.moved:  # it would overtake what it published at its new broker
                    raise FrameError(f"{cid} published here after moving away", "protocol")
                event = Event(cid, seq, check_wire_attributes(item[2]))
                if client.principal.permissions.publish is not None:
                    self._check_publish(client, event)
                client.last_seq = seq
                published += 1
                host.route_event(
                    ClientPublish(cid, event, code == C_REPUBLISH), event, "client", cid
                )
            elif code == C_SUBSCRIBE and len(item) == 3:
                sub_id = item[1]
                if type(sub_id) is not str or not sub_id:
                    raise FrameError(f"sub_id must be a non-empty string, got {sub_id!r}")
                f = decode_filter(item[2])
                self._check_subscribe(client, f)
                self._check_room(cid, sub_id)
                host.apply(core.handle(ClientSubscribe(cid, sub_id, f), now()))
                self.send(client, dumps([B_SUBSCRIBED, sub_id]))
            elif code == C_UNSUBSCRIBE and len(item) == 2:
                sub_id = item[1]
                if type(sub_id) is not str:
                    raise FrameError(f"sub_id must be a string, got {sub_id!r}")
                host.apply(core.handle(ClientUnsubscribe(cid, sub_id), now()))
                self.send(client, dumps([B_UNSUBSCRIBED, sub_id]))
            elif code == C_RESUME and len(item) == 2:
                self._resume(client, item[1])
            elif code == C_MIGRATING and len(item) == 2:
                source = _name(item[1], "source")
                host.apply(core.handle(ClientMigrating(cid, source), now()))
                self.send(client, dumps([B_MIGRATING, source]))
            elif code == C_MOVE and len(item) == 2:
                target = _name(item[1], "target")
                host.apply(core.handle(ClientMove(cid, target), now()))
                client.moved = True
            elif code == C_PUB_GAP and len(item) == 3:
                self._publisher_gap(client, item[1], item[2])
            elif code == C_LEAVE and len(item) == 1:
                self.detach(client)
                client.conn.close()
                break  # whatever follows in this frame has no client any more
            else:
                raise FrameError(f"unknown client message {item!r}", "unknown-type")
        self._m_client_in.inc(handled)
        if published:
            self._m_published.inc(published)
            host.publications()
            if not client.publisher:
                client.publisher = True
                if host.publishers_paused:
                    client.conn.pause("pressure")
        return rest

    def _publisher_gap(self, client: Client, since_ago: object, until_ago: object) -> None:
        """The client failed over from a broker that was fenced, and what that broker
        acknowledged after it left the overlay is partly no longer kept: every broker's
        subscribers are told (PublisherGap). Once per attachment, after its resume, and only
        from a client that may publish, or any client could make every subscriber hear of
        gaps."""
        since, until = finite_number(since_ago), finite_number(until_ago)
        if since is None or until is None or not 0 <= until < since <= MAX_PUBLISHER_GAP_AGO:
            raise FrameError(
                f"a publisher gap needs 0 <= until_ago < since_ago <= {MAX_PUBLISHER_GAP_AGO:g}: "
                f"{[since_ago, until_ago]!r}"
            )
        if client.gap_told or not client.resumed:
            # Only after a failover (its resume), once: a client that may publish could
            # otherwise make every subscriber of the overlay hear gaps at will (review).
            raise FrameError("a publisher gap is told once, after a failover (resume)", "protocol")
        if client.principal.permissions.publish == ():
            raise self._refuse(client, f"{client.principal.name} may not publish")
        client.gap_told = True
        now = time.time()
        gap = ClientPublisherGap(client.id, now - since, now - until)
        self.host.apply(self.host.core.handle(gap, self.host.now()))

    def _refuse(self, client: Client, why: str) -> FrameError:
        return self.host.refusal("client", client.conn, AccessError(why, "forbidden"))

    def _check_subscribe(self, client: Client, f: Filter) -> None:
        """Content-based authorisation: an allowed filter must cover the subscription."""
        p = client.principal
        if not p.permissions.may_subscribe(f):
            raise self._refuse(
                client, f"{p.name} may not subscribe to {f} (no allowed filter covers it)"
            )

    def _check_publish(self, client: Client, event: Event) -> None:
        p = client.principal
        if not p.permissions.may_publish(event.attrs):
            raise self._refuse(
                client,
                f"{p.name} may not publish {dict(event.attrs)} (no allowed filter matches it)",
            )

    def policy_changed(self, policy: Policy) -> None:
        """A reloaded policy applies to attached clients too: their permissions are looked up
        again, and a client whose principal or id is no longer allowed is cut off."""
        for client in list(self.clients.values()):
            p = client.principal
            if p.via == "insecure":
                continue
            perms = policy.permissions(p.name)
            if perms is None or not perms.may_use_id(p.name, client.id):
                why = f"{p.name} is no longer allowed as {client.id} (policy reloaded)"
                exc = self._refuse(client, why)
                client.conn.write(control_frame(F_ERROR, exc.code, str(exc)))
                client.conn.close()
                continue
            client.principal = Principal(p.name, perms, p.via)

    def _check_room(self, cid: str, sub_id: str) -> None:
        subs = self.host.core.routing.subscriptions(cid) or {}
        limit = self.host.max_subscriptions
        if sub_id not in subs and len(subs) >= limit:
            raise FrameError(f"{cid} has {len(subs)} subscriptions (limit {limit})", "limit")

    # ------------------------------------------------------------------ failover

    def _resume(self, client: Client, req: object) -> None:
        """A client that lost its broker: its subscriptions again, then what it missed from
        this broker's retention, then the answer (with the gaps) behind them."""
        if type(req) is not dict:
            raise FrameError(f"a resume request must be an object, got {req!r}")
        subs, last, lost_for = req.get("subs", []), req.get("last", {}), req.get("lost_for", 0)
        previous = _name(req.get("previous"), "previous")
        client.resumed = True  # it failed over: it may tell of a publisher gap (once)
        if type(subs) is not list or type(last) is not dict:
            raise FrameError("resume: subs must be an array and last an object")
        lost_for = _seconds(lost_for, "lost_for")
        unsure_for = _seconds(req.get("unsure_for", lost_for), "unsure_for", least=lost_for)
        if req.get("resent_for") is not None:
            self.note_resent(client.id, _seconds(req["resent_for"], "resent_for"))
        marks: list[tuple[str, int]] = []
        for publisher, seq in last.items():
            if type(seq) is not int or seq < 0:
                raise FrameError(f"resume: last seq of {publisher!r} must be an int, got {seq!r}")
            marks.append((publisher, seq))
        host = self.host
        core, now = host.core, host.now()
        known = core.routing.subscriptions(client.id) or {}
        for entry in subs:
            if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not str:
                raise FrameError(f"resume: a subscription is [sub_id, filter], got {entry!r}")
            if entry[0] not in known:
                f = decode_filter(entry[1])
                self._check_subscribe(client, f)
                self._check_room(client.id, entry[0])
                host.apply(core.handle(ClientSubscribe(client.id, entry[0], f), now))
        resume = ClientResume(
            client.id,
            previous,
            now - lost_for,
            tuple(marks),
            host.resume_slack,
            unsure_since=now - unsure_for,
        )
        host.apply(core.handle(resume, now))

    def note_resent(self, publisher: str, ago: float) -> None:
        """``publisher`` sends again here what it published from ``ago`` seconds on (see
        :attr:`resent`)."""
        now = time.time()
        self.resent.pop(publisher, None)  # the latest last, for the bound below
        self.resent[publisher] = (round(now - ago, 3), round(now, 3))
        while len(self.resent) > RESENT_KEPT:
            del self.resent[next(iter(self.resent))]

    def resumed(self, eff: Resumed) -> None:
        client = self.clients.get(eff.client)
        if client is None:
            return
        now = self.host.now()
        gaps = [[now - g.since, now - g.until, g.reason] for g in eff.gaps]
        self.send(client, dumps([B_RESUMED, eff.served, gaps]))
        log.info(
            "%s: %s resumed here (%d notifications from retention, %d gap(s))",
            self.host.name,
            eff.client,
            eff.served,
            len(gaps),
        )

    def acknowledge_publishers(self) -> bool:
        """Tell each publisher how far its publications are safe: everything up to the seq
        acknowledged has reached the next hops (their link acknowledgements cover it), so it
        survives this broker's death; the client re-sends the rest after a failover.

        A mark is taken per publisher (its last seq, and every link's last queued position) at
        most once per call, and only while nothing it published is held back inside the core;
        the mark's seq is acknowledged once every link has acknowledged its position (or is
        gone, or started a new session: its custody then passed to a repair).

        Returns whether some publisher still has publications not acknowledged (in the same
        pass: the broker rests only when none has)."""
        core = self.host.core
        links: list[Link] | None = None
        owed = False
        for client in self.clients.values():
            if not client.publisher:
                continue
            if client.last_seq > client.marked_seq and core.custody_settled(client.id):
                if links is None:
                    links = [lk for lk in self.host.links.values() if lk.kind == "link"]
                client.ack_marks.append(
                    (
                        client.last_seq,
                        [(lk, lk.session, lk.base + len(lk.out) - 1) for lk in links if lk.out],
                    )
                )
                client.marked_seq = client.last_seq
            acked = client.acked_seq
            marks = client.ack_marks
            while marks and all(
                lk.base > tx or lk.removed or lk.session != session
                for lk, session, tx in marks[0][1]
            ):
                acked = marks.popleft()[0]
            if acked > client.acked_seq:
                client.acked_seq = acked
                self.send(client, dumps([B_PUBACK, acked]))
                self.pubacks += 1
            if client.last_seq > client.acked_seq or marks:
                owed = True
        return owed

    @property
    def withdrawing(self) -> bool:
        """Departed clients' subscriptions are still being withdrawn, a turn at a time."""
        return bool(self._leaving)

    # ------------------------------------------------------------------ draining

    def drain(self, target: str, address: str | None = None) -> dict[str, Any]:
        """Empty this broker of clients before it is removed: every attached client (and any
        that attaches from now on) is asked to migrate to neighbour ``target`` at ``address``
        (default: the client address ``target`` told). The client library follows on its own;
        see :meth:`drain_status` for when the broker is empty."""
        host = self.host
        if not host.core.is_neighbour(target):
            raise ValueError(
                f"{target} is not a neighbour of {host.name}: clients can only move one link"
            )
        address = address or host.client_peers.get(target)
        if not address:
            raise ValueError(f"no client address known for {target}: pass one")
        parse_address(address)
        self.drain_target = (target, address)
        self._drained.clear()
        for client in list(self.clients.values()):
            self._redirect(client, target, address)
        self.check_drained()
        return self.drain_status()

    def cancel_drain(self) -> dict[str, Any]:
        self.drain_target = None
        self._drained.clear()
        return self.drain_status()

    def drain_status(self) -> dict[str, Any]:
        """``drained`` once no client is attached *and* every link has had everything
        acknowledged: the ``Moved`` of the last publisher that left must reach the
        neighbour before the link may be removed, or that neighbour holds the publisher's
        events for ever."""
        unacked = self._unacknowledged()
        target = self.drain_target
        return {
            "draining": target is not None,
            "target": target[0] if target else None,
            "address": target[1] if target else None,
            "clients": len(self.clients),
            "withdrawing": len(self._leaving),  # clients gone, subscriptions still going
            "unacknowledged": unacked,
            "drained": target is not None
            and not self.clients
            and not self._leaving
            and not unacked,
        }

    def check_drained(self) -> None:
        if self.drain_status()["drained"]:
            self._drained.set()

    async def wait_drained(self, within: float) -> bool:
        """Wait up to ``within`` seconds for :meth:`drain_status` to say drained."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while not self.drain_status()["drained"]:
                    self._drained.clear()
                    await self._drained.wait()
        return bool(self.drain_status()["drained"])
