"""The broker's link sessions: overlay links and out-of-band channels, from hello to goodbye.

:class:`LinkSessions` owns the tables of :class:`~.links.Link` objects (overlay links, channels
dialed and accepted, closing links displaced by a re-opened one) and everything that happens to
them: the hello of a dialing or dialed broker, resuming a session after a reconnect, data, acks,
heartbeats, pressure signals and goodbyes, the dial loop with its backoff, and the core's
``OpenLink``/``CloseLink`` effects. It reaches the rest of the broker only through
:class:`LinkHost`, so it never imports :mod:`canopy_broker.runtime.server`.

Session rules, in one place:

* A dialer says ``resume`` when a session exists on both ends; the accepting end resumes it if it
  knows the session id, refuses with ``link-removed`` if the link was removed here, and with
  ``unknown-session`` otherwise (it restarted): the dialer then starts a fresh session and both
  cores see the link as new, exchanging their routing state over it.
* A link the *core* opened (an exchange's added link) is dialed by the end whose name sorts
  first; what its core queued before the dial is sent once the session is up.
* A closing link keeps flushing on its own session, even while a re-opened instance of the same
  link runs beside it (``_retired``), and says goodbye once everything is acknowledged.
* Standby links (hello role ``standby``) go to the brokers a crash repair would link this one
  to (:meth:`BrokerCore.standby_peers`), dialed by the end whose name sorts first, with the
  addresses neighbours told (F_PEERS) and the same fencing as links. They carry hellos and
  heartbeats only and are in no routing table; a standby connection that is lost is dialed
  again on a new session (there is nothing to resume). When the core's repair opens a link to a
  broker whose standby link is up, the link is *promoted*: the end whose core opened it first
  says ``F_PROMOTE`` and sends the new link's messages right behind it, on the same connection
  and session, so the repair costs no dial and no hello. The other end promotes its side on that
  word and holds the data (reading paused) until its own core opens the link. An end that
  cannot take the promotion (it already has another instance of the link) refuses it with
  ``promotion-refused`` and the promoting end falls back to a fresh session of the opened link.
* **A link failure is not a death** (paper 004, with ``cycle_bound`` >= 3 and standby links).
  A link without a connection for the detection timeout is first *asked about*: this broker's
  neighbours and standby peers are the brokers that would hear the silent neighbour N if it
  lived (the standby links go to N's other neighbours, and a standby link to N itself closes
  each cycle through the link: a leaf N is heard over it). Each is asked ``F_HEARS`` (do you
  hear N?) on the connection it has, and answers ``F_HEARD``: its link or standby link to N has
  a connection that carried a frame within the detection timeout (null: it has neither, so it
  cannot tell). One yes: N is alive and only this link
  failed, the core is told ``LinkFailed`` (no fence: N is alive and still a member). All no,
  or no answer within two heartbeats, or nobody to ask: ``PeerFailed`` and the fence, as
  before. A link told failed is asked about again after each further timeout, so a peer that
  dies meanwhile is still repaired as a death.
* **Detours.** The core's ``DetourLink`` moves the failed link's session (sequence numbers,
  retransmit buffer, receive position) onto an out-of-band connection: its dialer dials the
  peer again with ``detour`` in the hello, the other end takes such a hello only once its own
  core has detoured the link (``not-detoured`` before: the dialer retries), and the session
  resumes there as after any reconnect, the unacknowledged backlog first. It lasts until the
  repair's exchange closes the link. The detour is a new connection straight to the peer, as
  the simulator's out-of-band channel is: it helps when what failed is the link's connection
  (a stuck or refused flow, as ``cut_link`` injects), not when the two brokers cannot reach
  each other at all (then the lock cannot cross, the exchange is rolled back by its lease and
  the link waits; a relay along the cycle is not built).
* **Cycle detection** runs here too: the core is given ``StandbyLinks`` whenever the set it
  would keep changes, and ``FindCycles`` at every period of the wall clock (round numbers
  ``floor(time / period) * ROUND_STRIDE``, the same at every broker with synchronised clocks),
  after each change of this broker's links or standby set (the next number, a wave within the
  period), and on a probe of a round newer than its own (so a wave, and a broker whose clock
  lags, join the round the probe carries).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import ssl
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from canopy_broker.core.broker import BrokerCore, ProtocolError
from canopy_broker.core.events import Event
from canopy_broker.core.messages import (
    AddLink,
    CycleProbe,
    Effect,
    FindCycles,
    FromLink,
    FromPeer,
    Input,
    LinkFailed,
    LinkRepair,
    Neighbours,
    PeerFailed,
    PeerFeatures,
    PeerGone,
    Publish,
    RemoveLink,
    RepairFinished,
    StandbyLinks,
)
from canopy_broker.runtime.config import BrokerConfig
from canopy_broker.runtime.conn import Conn, ConnOwner
from canopy_broker.runtime.framing import (
    F_ACK,
    F_BYE,
    F_DATA,
    F_ERROR,
    F_HEARD,
    F_HEARS,
    F_HELLO,
    F_PEERS,
    F_PING,
    F_PONG,
    F_PRESSURE,
    F_PROMOTE,
    FEATURES,
    PROTOCOL_VERSION,
    FrameError,
    FrameProtocol,
    control_frame,
    decode_link_message,
    decode_peer_message,
    encode_generic,
    error_detail,
    finite_number,
    parse_address,
    seconds,
)
from canopy_broker.runtime.links import Link
from canopy_broker.runtime.linkstate import LinkEvent
from canopy_broker.runtime.metrics import BrokerMetrics
from canopy_broker.runtime.security import AccessError, check_link_peer
from canopy_broker.runtime.tasks import TaskSet
from canopy_broker.runtime.telemetry import Telemetry

log = logging.getLogger("canopy.broker")

ROUND_STRIDE = 64
"""Cycle detection rounds per wall-clock period: the period's own round, then up to 63 waves
started by reshapings within it; the next period's round is newer than all of them."""

MAX_LINK_REPAIR_RECORDS = 10

HEARD_AFTER_MARGIN = 1.0
"""Seconds by which a repair link's far end must have heard the dead broker after this end
last did, to count as hearing it alive (LinkSessions._alive_there): a far end whose detector
is merely slower heard it last at about the same time, a frame in flight or a heartbeat's
phase apart."""

ENDED_SESSIONS_KEPT = 256
"""Ended link sessions remembered to answer late resumes (an exchange loop ends one per swap;
a resume comes within a reconnect backoff, so a few hundred cover any realistic pace)."""


@dataclass
class _Check:
    """A silent neighbour being asked about: who was asked, and until when they may answer."""

    nonce: str
    asked: set[str]
    deadline: float
    silent: float
    answers: dict[str, bool | None] = field(default_factory=dict)


class LinkHost(ConnOwner, Protocol):
    """What link sessions need from the broker process that owns them."""

    name: str
    incarnation: str
    advertised: str
    client_advertised: str
    config: BrokerConfig
    core: BrokerCore
    peers: dict[str, str]
    client_peers: dict[str, str]
    metrics: BrokerMetrics
    telemetry: Telemetry
    tasks: TaskSet
    stopping: bool
    fenced_by: str | None
    secure: bool
    tls_client: ssl.SSLContext | None
    queue_slot: int  # bytes of a link's queue counted as one message (BrokerConfig.slot)

    def now(self) -> float: ...

    def apply(self, effects: list[Effect]) -> None: ...

    def route_event(self, inp: Input, event: Event, source_kind: str, source: str) -> None: ...

    def answer_hello(self, conn: Conn, **fields: object) -> None: ...

    def refusal(self, role: str, conn: FrameProtocol, exc: AccessError) -> FrameError: ...

    def link_acked(self, link: Link) -> None: ...

    def update_pressure(self) -> None: ...

    def unpressure(self, dest: Link) -> None: ...

    def fenced_out(self, by: str, silent_for: float | None) -> None: ...

    def linked(self, peer: str) -> None: ...

    async def probe_hello(self, address: str, peer: str) -> dict[str, Any] | None: ...

    async def fenced_at(self, peer: str, address: str) -> dict[str, Any] | None: ...


def valid_addresses(book: dict[str, object], me: str) -> list[tuple[str, str]]:
    """The (name, HOST:PORT) entries of an address book a neighbour sent that are about other
    brokers and are addresses at all; the rest is ignored, not trusted."""
    out = []
    for name, address in book.items():
        if name == me or not isinstance(address, str):
            continue
        try:
            parse_address(address)
        except ValueError:
            continue
        out.append((name, address))
    return out


def str_field(hello: dict[str, Any], key: str) -> str:
    value = hello.get(key)
    if type(value) is not str or not value:
        raise FrameError(f"hello needs a non-empty string {key!r}", "bad-hello")
    return value


class LinkSessions:
    """Every link and channel of one broker, and the handling of their frames."""

    def __init__(self, host: LinkHost) -> None:
        self.host = host
        self.name = host.name
        self.links: dict[str, Link] = {}
        self.channels_out: dict[str, Link] = {}  # out-of-band control channels we dialed
        self.channels_in: dict[str, Link] = {}  # ... and those other brokers dialed
        # Link sessions that ended here, removed or closed, newest last (bounded): a late
        # resume of one is told ``link-removed``, never ``unknown-session``, which would make
        # its dialer start a fresh session that displaces the link's current instance.
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._retired: dict[str, Link] = {}  # closing links displaced by a re-opened one
        # Neighbours declared dead, by the incarnation (process) that died: that process is
        # refused if it comes back (paused, partitioned); a restarted one is a new member.
        self.fenced: dict[str, str] = {}
        # When each fenced peer was last heard (host.now()): told to it if it ever comes back,
        # so that its clients resume from then (Broker.fenced_out).
        self._fenced_heard: dict[str, float] = {}
        # When each fenced peer was last heard, wall clock (/status: where a partition's
        # stretch begins, for the subscribers the restore's join tells).
        self.fenced_since: dict[str, float] = {}
        # The same, for fences lifted (a partition's join) until a gap told covers them: a
        # join retried after a failure must still know since when the sides were apart.
        self.lifted_since: dict[str, float] = {}
        self._learned: dict[str, str] = {}  # addresses told by neighbours (F_PEERS)
        # The last book of addresses told (see _tell_peers).
        self._told_book: tuple[dict[str, str], dict[str, str]] | None = None
        self.repairs: list[dict[str, Any]] = []  # the last few, for the admin API
        self.standby: dict[str, Link] = {}  # standby links by peer, dialed or accepted
        self._probing: set[str] = set()  # unconnected repair links whose peer is being probed
        # How the core's last OpenLink to each peer was carried out, for its Repaired record:
        # "promoted" (a standby link taken over) or "dialed" (a new connection).
        self._opened_how: dict[str, str] = {}
        # Link failures (see the module docstring): fault injection, questions out, verdicts.
        self.cut: set[str] = set()  # peers whose link connections are refused (cut_link)
        self._checks: dict[str, _Check] = {}  # silent neighbours being asked about
        self._link_failed: set[str] = set()  # neighbours whose link the core was told failed
        # Fence checks (see heartbeat): the last heartbeat, when this broker last woke from a
        # stall of its own, peers being asked, when the next check of an isolated broker is due.
        self._last_beat: float | None = None
        self._woke_at = -math.inf
        self._asking_fence: set[str] = set()
        self._fence_asked: dict[str, float] = {}  # when each link peer was last asked
        # Why a verdict on a peer was deferred, last said: checked again every heartbeat while
        # an exchange's lease runs, and said once, not five times a second for 30 s.
        self._deferred: dict[str, str] = {}
        self._next_fence_check = -math.inf
        self.link_repairs: list[dict[str, Any]] = []  # the last few, for the admin API
        # Cycle detection: what the core was told, the newest round started here.
        self._standby_told: tuple[str, ...] | None = None
        self._shape: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self.cycle_round = 0

    # ------------------------------------------------------------------ tables

    def _table(self, kind: str, dialer: bool) -> dict[str, Link]:
        if kind == "link":
            return self.links
        if kind == "standby":
            return self.standby
        return self.channels_out if dialer else self.channels_in

    def all_links(self) -> list[Link]:
        return [
            *self.links.values(),
            *self._retired.values(),
            *self.channels_out.values(),
            *self.channels_in.values(),
            *self.standby.values(),
        ]

    def _retire(self, link: Link) -> None:
        """Move a closing link out of the way of a new instance of the same link: it keeps
        flushing (and resuming) on its own session until the peer has acknowledged everything,
        then says goodbye as usual."""
        old = self._retired.pop(link.peer, None)
        if old is not None:
            self.drop(old, bye="closed")
        del self.links[link.peer]
        self._retired[link.peer] = link

    def _new_link(self, link: Link) -> Link:
        """Register a new link or channel (metrics, table) and start dialing if it is ours."""
        peer, kind, dialer = link.peer, link.kind, link.dialer
        link.slot = self.host.queue_slot
        if kind == "link":
            self._as_link(link)
        self._table(kind, dialer)[peer] = link
        if dialer:
            link.dial_task = self.host.tasks.spawn(self._dial_loop(link), f"dial {peer} ({kind})")
        return link

    def _as_link(self, link: Link) -> None:
        """What every overlay link has: its metrics, and no memory of an earlier removal."""
        m = self.host.metrics
        peer = link.peer
        link.m_msgs_in = m.link_messages.labels(peer, "in")
        link.m_msgs_out = m.link_messages.labels(peer, "out")
        link.m_bytes_in = m.link_bytes.labels(peer, "in")
        link.m_bytes_out = m.link_bytes.labels(peer, "out")

    # ------------------------------------------------------------------ declared links

    def add(self, peer: str, address: str) -> Link:
        """Declare a link this broker dials (idempotent: an existing link is returned as is).
        Refused (ValueError) once this broker was fenced out."""
        if peer == self.name:
            raise ValueError("a broker cannot link to itself")
        # It left the overlay (leave): a link would bring its stale state back to a broker
        # that never fenced it (review: add_link did, and the link stayed up).
        self._check_in_overlay()
        parse_address(address)
        self.host.peers[peer] = address
        link = self.links.get(peer)
        if link is not None:
            if link.dialer and link.address != address:
                link.address = address  # a moved peer: the next dial uses the new address
            return link
        return self._new_link(Link(peer, uuid.uuid4().hex, dialer=True, address=address))

    def remove(self, peer: str) -> bool:
        """Uncoordinated removal: RemoveLink here, BYE to the peer (which does the same)."""
        link = self.links.get(peer)
        if link is None:
            return False
        self.drop(link, bye="removed")
        return True

    def drop(self, link: Link, *, bye: str | None) -> None:
        """Forget a link or channel; tell the core (RemoveLink) if it is a link the core has and
        did not close itself."""
        host = self.host
        # The core first: if it refuses (the link is on an exchange's cycle) nothing has changed.
        effects = host.core.handle(RemoveLink(link.peer), host.now()) if link.established else []
        link.established = False
        table = self._table(link.kind, link.dialer)
        if table.get(link.peer) is link:
            del table[link.peer]
        if link.kind == "link" and self._retired.get(link.peer) is link:
            del self._retired[link.peer]
        if link.kind == "link" and self.links.get(link.peer) is None:
            self._link_failed.discard(link.peer)
            self._checks.pop(link.peer, None)
            self._deferred.pop(link.peer, None)
            self._fence_asked.pop(link.peer, None)
        if link.detoured:
            self._detour_ended(link)
        conn = link.remove()
        link.farewell = bye
        if link.kind == "link" and link.session:
            self._ended[(link.peer, link.session)] = None
            if len(self._ended) > ENDED_SESSIONS_KEPT:
                self._ended.popitem(last=False)
        if link.dial_task is not None and link.dial_task is not asyncio.current_task():
            link.dial_task.cancel()
        host.unpressure(link)
        host.apply(effects)
        if conn is not None:
            if bye:
                conn.write(control_frame(F_BYE, bye))
            conn.close()
        link.clear_out()
        host.update_pressure()
        log.info("%s: %s to %s removed", self.name, link.kind, link.peer)

    def _drop_channels(self, peer: str, unless: str | None, keep: Link | None = None) -> None:
        """Drop the out-of-band channels to ``peer`` whose session is with a process that is
        gone: all of them once it is declared dead, or those of another incarnation than
        ``unless`` once a new one said hello. Left in place, a channel would resume its old
        session at the new process, be refused, and lose what an exchange queued on it (which
        stalls that exchange until its lease ends). What they held was for the dead process."""
        for table in (self.channels_out, self.channels_in):
            ch = table.get(peer)
            if ch is None or ch is keep or (unless is not None and ch.incarnation in ("", unless)):
                continue
            log.info(
                "%s: %s's %s channel was with a process that is gone; dropped",
                self.name,
                peer,
                "outgoing" if ch.dialer else "incoming",
            )
            self.drop(ch, bye=None)

    def moved(self, peer: str) -> None:
        """``peer`` is at a new address: an outgoing channel that is down, with a session
        begun with the process at the old one, can only resume that session, which the new
        process refuses, losing what was queued on it meanwhile (an exchange's transfer, which
        then stalls until its lease ends). Drop it; the next message dials afresh. A channel
        that is up talks to a live process and stays; incoming channels are the peer's to
        manage; links are left to their failure detector and fencing."""
        ch = self.channels_out.get(peer)
        if ch is not None and ch.conn is None and ch.incarnation:
            log.info("%s: %s moved; its outgoing channel's old session dropped", self.name, peer)
            self.drop(ch, bye=None)

    def send_to_peer(self, peer: str, msg: object) -> None:
        """Queue an out-of-band message on the channel to ``peer`` (dialed on first use)."""
        ch = self.channels_out.get(peer)
        if ch is None:
            ch = self._new_link(
                Link(peer, uuid.uuid4().hex, dialer=True, address=None, kind="peer")
            )
        ch.queue(encode_generic(msg))
        self.host.mark_dirty(ch)

    # ------------------------------------------------------------------ the core's links

    def open(self, peer: str, *, kept: bool = False) -> None:
        """The core added a link (an exchange's new link, frozen): connect it. The end whose
        name sorts first dials; the other waits for it (or finds it already connected).
        ``kept``: the core had the link and keeps it (A2, a new try of the exchange took its
        lock over); it is connected afresh only if the peer closed its end meanwhile."""
        link = self.links.get(peer)
        if link is not None and kept:
            if not (link.established and link.peer_closed):
                link.kept = True  # the old try's goodbye may still be on its way
                return  # as it is: connected, or being connected, to the peer's end
            self._afresh(link)
            return
        if link is not None:
            if link.established:
                log.error("%s: the core opened a link to %s, which exists", self.name, peer)
                return
            if (
                link.opened
                and (link.promoted or not link.dialer)
                and not (link.closing or link.peer_closed)
            ):
                # The peer dialed (or promoted its standby link) before our core opened it.
                link.established = True
                self._opened_how[peer] = "promoted" if link.promoted else "dialed"
                if link.conn is not None:
                    link.conn.release("unopened")  # its data waited for this
                    link.last_heard = self.host.now()  # unread on purpose: its clock restarts
                self.host.mark_dirty(link)
                return
            # What is left of an earlier instance of this link: still flushing what that
            # instance's core queued (closing), or abandoned by the peer. It must not carry the
            # new instance's messages, nor take them down with it when it goes.
            if link.closing and not link.peer_closed:
                self._retire(link)
            else:
                self.drop(link, bye=None)
        standby = self.standby.get(peer)
        if standby is not None:
            if standby.conn is not None:
                self._promote(standby, tell=True)
                standby.established = True
                self._opened_how[peer] = "promoted"
                return
            self.drop(standby, bye=None)  # not up: the repair cannot wait for it
        dialer = self.name < peer
        session = uuid.uuid4().hex if dialer else ""
        link = self._new_link(Link(peer, session, dialer=dialer, address=None, opened=True))
        link.established = True
        self._opened_how[peer] = "dialed"
        # Suspected like a link that lost its connection if it never connects: its far end
        # may have died before dialing. An exchange's new link waited for the exchange's lease
        # (30 s) at the end that does not dial, locked, its link known at this end only, when
        # the initiator was killed right after its lock (a kill during an apply).
        link.down_since = self.host.now()

    def _afresh(self, link: Link) -> None:
        """The core keeps ``link`` for a new try of an exchange, and the peer closed its end of
        the old try's connection: A1 let the old try go and opened its end again for the new
        one, on a new session. Connect it anew: when this end dials, nobody else will (its
        dialing stopped at the goodbye)."""
        log.info(
            "%s: %s closed the link and opened it again; connecting afresh", self.name, link.peer
        )
        link.established = False  # the core keeps its link: not a RemoveLink
        self.drop(link, bye=None)
        self.open(link.peer)

    # ------------------------------------------------------------------ standby links

    def update_standby(self) -> None:
        """Keep standby links to the brokers the core says a repair would link this one to:
        dial the missing ones this end dials (its name sorts first; the other end dials the
        rest), drop the dialed ones no longer wanted. Accepted ones are the dialer's to drop."""
        host = self.host
        if not (host.config.repair and host.config.standby) or host.stopping:
            return
        want = set(host.core.standby_peers())
        for peer, link in list(self.standby.items()):
            if link.dialer and peer not in want:
                self.drop(link, bye="removed")
        for peer in sorted(want):
            if peer < self.name or peer in self.standby or peer in self.links:
                continue
            self._new_link(Link(peer, uuid.uuid4().hex, dialer=True, address=None, kind="standby"))
            log.info("%s: keeping a standby link to %s", self.name, peer)

    def _unlist_standby(self, link: Link) -> None:
        if self.standby.get(link.peer) is link:
            del self.standby[link.peer]

    def _promote(self, link: Link, *, tell: bool) -> None:
        """Make the standby link ``link`` (up) an overlay link on its connection and session;
        ``tell``: this end's core opened it, so say so to the peer ahead of the link's data."""
        conn = link.conn
        assert conn is not None
        self._unlist_standby(link)
        link.promote()
        self._as_link(link)
        self.links[link.peer] = link
        if isinstance(conn, Conn):
            conn.role = "link"
        if tell:
            conn.write(control_frame(F_PROMOTE, link.session))
        self.host.metrics.standby_promotions.inc()
        self._tell_peers()
        self.host.mark_dirty(link)
        log.info(
            "%s: standby link to %s promoted to an overlay link (%s)",
            self.name,
            link.peer,
            "by this end" if tell else "by the peer",
        )

    def _promoted_by_peer(self, link: Link, conn: Conn, session: object) -> None:
        """The peer's core opened the link over our standby link (``F_PROMOTE``)."""
        if link.promoted:
            return  # both cores opened it; ours was first here
        if link.kind != "standby" or session != link.session:
            raise FrameError(f"promotion of a {link.kind} (session {session!r})", "bad-promote")
        other = self.links.get(link.peer)
        if other is None:
            self._promote(link, tell=False)
            link.established = False  # until our core opens it: its data waits (see data)
            return
        if other.opened and not (
            other.dialer or other.closing or other.peer_closed or other.connected_once
        ):
            # Our core opened the link while the standby link was down from here, and waits
            # for the peer's dial: this connection is it. Nothing was sent on either session.
            self._unlist_standby(link)
            link.remove()
            if link.dial_task is not None:
                link.dial_task.cancel()
            other.reset_session(link.session)
            self._up(other, conn, {"last_rx": 0, "incarnation": link.incarnation})
            self.host.metrics.standby_promotions.inc()
            self._carried(link.peer, "promoted")
            return
        why = f"{self.name} has another instance of the link to {link.peer}"
        log.info(
            "%s: refusing the promotion of the standby link to %s: %s", self.name, link.peer, why
        )
        conn.write(control_frame(F_ERROR, "promotion-refused", why))
        self.drop(link, bye=None)

    def _carried(self, peer: str, how: str) -> None:
        """The link to ``peer`` turned out to be carried ``how`` after all (a promotion taken
        or refused late): correct the record of the repair that opened it, if any."""
        self._opened_how[peer] = how
        for rec in reversed(self.repairs):
            if peer in rec["linked"]:
                rec["promoted"] = [p for p in rec["promoted"] if p != peer]
                rec["dialed"] = [p for p in rec["dialed"] if p != peer]
                rec["promoted" if how == "promoted" else "dialed"].append(peer)
                break

    def _promotion_refused(self, link: Link, conn: Conn) -> None:
        """The peer refused our promotion: nothing was taken on either side of it, so the
        link starts a fresh session, as an opened link does (the end whose name sorts first
        dials it again), and everything the core queued on it goes out from the start."""
        conn.role = None  # its connection_lost must not touch the link
        conn.close()
        link.disconnected()
        link.down_since = None
        link.reset_session(uuid.uuid4().hex if link.dialer else "")
        self._carried(link.peer, "dialed")
        log.info("%s: %s refused the promotion; dialing the link afresh", self.name, link.peer)

    def close(self, peer: str) -> None:
        """The core dropped a link (an exchange's removed link, or an added link whose lock was
        refused). Everything already queued on it still goes out; then goodbye."""
        link = self.links.get(peer)
        if link is None:
            return
        link.established = False
        if not link.closing:
            link.fire(LinkEvent.CORE_CLOSED)
        self.maybe_finish_close(link)

    def maybe_finish_close(self, link: Link) -> None:
        if link.closing and (not link.out or link.peer_closed):
            if link.out:
                log.warning(
                    "%s: %d message(s) to %s were never acknowledged",
                    self.name,
                    len(link.out),
                    link.peer,
                )
            self.drop(link, bye="closed")

    # ------------------------------------------------------------------ frames

    def frame(self, link: Link, conn: Conn, ftype: object, frame: list[Any]) -> None:
        """A control frame on an established link or channel."""
        host = self.host
        if ftype == F_ACK and len(frame) == 2 and type(frame[1]) is int:
            self._acked(link, frame[1])
        elif ftype == F_PING and len(frame) == 3 and type(frame[2]) is int:
            self._acked(link, frame[2])
            conn.write(control_frame(F_PONG, frame[1], link.rx_seq))
            link.acked_rx = link.rx_seq
        elif ftype == F_PONG and len(frame) == 3 and type(frame[2]) is int:
            self._acked(link, frame[2])
            if isinstance(frame[1], int | float):
                link.rtt_ms = (host.now() - frame[1]) * 1000.0
                if link.kind == "link":
                    host.telemetry.rtt(link.peer, link.rtt_ms)
        elif ftype == F_PRESSURE and len(frame) == 2 and type(frame[1]) is bool:
            if link.remote_pressure != frame[1]:
                link.remote_pressure = frame[1]
                host.update_pressure()
        elif ftype == F_PEERS and len(frame) in {2, 3} and isinstance(frame[1], dict):
            self._heard_peers(frame[1], frame[2] if len(frame) == 3 else {})
        elif ftype == F_PROMOTE and len(frame) == 2:
            self._promoted_by_peer(link, conn, frame[1])
        elif ftype == F_HEARS and len(frame) == 3 and _strs(frame[1], frame[2]):
            self._answer(conn, frame[1], frame[2])
        elif (
            ftype == F_HEARD
            and len(frame) == 4
            and _strs(frame[1], frame[2])
            and (frame[3] is None or type(frame[3]) is bool)
        ):
            self._heard(link.peer, frame[1], frame[2], frame[3])
        elif ftype == F_BYE:
            reason = frame[1] if len(frame) > 1 else "?"
            log.info("%s: %s said goodbye (%s)", self.name, link.peer, reason)
            if link.kind == "standby" and (reason == "removed" or not link.dialer):
                self.drop(link, bye=None)  # the dialer keeps it, or drops it; the other obeys
            elif reason == "removed":
                self.drop(link, bye=None)
            elif reason == "closed":  # the peer's core closed it (a link exchange)
                if not link.peer_closed:
                    link.fire(LinkEvent.PEER_CLOSED)
                if link.kept and link.established and not link.closing:
                    self._afresh(link)  # late: from the old try's end (see open)
                elif link.closing or not link.established:
                    self.drop(link, bye=None)
                else:
                    conn.close()  # our core closes its end in its own time
            else:
                conn.close()
        elif ftype == F_ERROR and link.promoted and frame[1:2] == ["promotion-refused"]:
            self._promotion_refused(link, conn)
        elif ftype == F_ERROR:
            log.warning("%s: %s reported an error: %s", self.name, link.peer, frame[1:])
            if frame[1:2] == ["not-open"]:
                link.refused_open = True
                self._alive_there(link, error_detail(frame).get("heard"))
            conn.close()
        else:
            raise FrameError(f"unexpected link frame {frame[:2]!r}", "unknown-type")

    def _acked(self, link: Link, upto: int) -> None:
        link.ack(upto)
        self.host.link_acked(link)  # queues shrank: pressure, a drain waiting for acks
        if link.closing:
            self.maybe_finish_close(link)

    def data(
        self, link: Link, first: object, items: object, deadline: float = math.inf
    ) -> list[Any] | None:
        """Hand a data frame's messages to the core in order; if ``deadline`` passes, return
        the rest as a data frame that starts where this one stopped (acknowledged only once
        handled)."""
        if type(first) is not int or type(items) is not list:
            raise FrameError("data frame must be [1, first_seq, [messages]]")
        skip = link.rx_seq + 1 - first
        if skip < 0:
            raise FrameError(f"sequence gap: expected {link.rx_seq + 1}, got {first}", "sequence")
        if skip:
            items = items[skip:]
        if link.kind == "standby":
            raise FrameError(f"data on the standby link to {link.peer}", "standby")
        if items:  # the peer's end talks to this one: a goodbye would be a real one now
            link.kept = False
        if link.kind == "link" and not link.established and items:
            if link.promoted and link.conn is not None:
                # The peer's repair took our standby link over before our core opened the
                # link (its failure detector was first): the data waits, unread, for ours.
                link.conn.hold("unopened", [F_DATA, link.rx_seq + 1, items])
                return None
            # An added link the peer's core opened before ours did. The protocol sends nothing
            # over it before this core has it; if something comes anyway, refuse without
            # acknowledging, so the peer resends it after reconnecting.
            raise FrameError(
                f"data on the link to {link.peer} before it was opened",
                "not-open",
                {"heard": self.heard_ago()},
            )
        host = self.host
        peer = link.peer
        handle = host.core.handle
        n = 0
        rest: list[Any] | None = None
        try:
            if link.kind == "peer":
                for item in items:
                    pmsg = decode_peer_message(item)
                    if type(pmsg) is CycleProbe and pmsg.round > self.cycle_round:
                        self.start_round(pmsg.round)  # join the round the probe carries
                    try:
                        effects = handle(FromPeer(peer, pmsg), host.now())
                    except ProtocolError as exc:
                        # Out of context (an exchange this process is not in: the sender
                        # queued it for an earlier process of this name, see ``refused``).
                        # The core changed nothing; drop it, keep the channel.
                        log.warning("%s: dropped out-of-band %s", self.name, exc)
                    else:
                        host.apply(effects)
                    n += 1
            else:
                for item in items:
                    if n & 15 == 15 and time.perf_counter() >= deadline:
                        rest = [F_DATA, link.rx_seq + n + 1, items[n:]]
                        break
                    msg = decode_link_message(item)
                    if type(msg) is Publish:
                        host.route_event(FromLink(peer, msg), msg.event, "link", peer)
                    else:
                        host.apply(handle(FromLink(peer, msg), host.now()))
                        if type(msg) is Neighbours:
                            self.update_standby()  # a repair's peers may have changed
                            self._tell_peers(changed=True)  # and who is two hops away
                    n += 1
        finally:
            if n:
                link.refused_open = False
            link.rx_seq += n
            link.msgs_in += n
            if link.m_msgs_in is not None:
                link.m_msgs_in.inc(n)
            if not link.dirty:
                host.mark_dirty(link)  # to acknowledge
        return rest

    # ------------------------------------------------------------------ hellos

    def hello_frame(self, link: Link) -> bytes:
        """The hello a dialing end sends first."""
        return control_frame(
            F_HELLO,
            {
                "v": PROTOCOL_VERSION,
                "role": link.kind,
                "name": self.name,
                "session": link.session,
                "resume": link.connected_once,
                "last_rx": link.rx_seq,
                "opened": link.opened,
                "detour": link.detoured,
                "address": self.host.advertised,
                "clients": self.host.client_advertised,
                "incarnation": self.host.incarnation,
                "features": list(FEATURES),
            },
        )

    def _up(self, link: Link, conn: Conn, hello: dict[str, Any]) -> None:
        peer_last_rx = hello.get("last_rx")
        if type(peer_last_rx) is not int:
            raise FrameError("hello needs an integer last_rx", "bad-hello")
        host = self.host
        incarnation = hello.get("incarnation")
        if isinstance(incarnation, str):
            link.incarnation = incarnation
            self._drop_channels(link.peer, unless=incarnation, keep=link)
            if link.kind == "link" and self.fenced.get(link.peer) not in (None, incarnation):
                # Linked with its new process: the failure of the old one is over here, and a
                # later join must not tell a gap reaching back to it (the fence stays).
                self.fenced_since.pop(link.peer, None)
        link.rewind(peer_last_rx)
        old = link.conn
        if old is not None and old is not conn:
            if isinstance(old, Conn):
                old.role = None  # its late connection_lost must not touch the link
            old.abort()
        link.connected(conn)
        conn.link = link
        conn.role = link.kind
        link.last_heard = link.up_since = host.now()
        link.down_since = None
        link.connects += 1
        if "v" in hello:  # a peer's own hello (not a standby link's, taken over)
            features = hello.get("features")
            known = features if isinstance(features, list) else []
            told = PeerFeatures(
                link.peer,
                "placement" in known,
                "settle" in known,
                "replay-end" in known,
                "handover" in known,
                "keep-removed" in known,
            )
            core = host.core
            if not core.knows_features(told):  # news
                host.apply(core.handle(told, host.now()))
        if link.kind == "link":
            self._checks.pop(link.peer, None)  # it answered for itself
            if not link.detoured:
                self._link_failed.discard(link.peer)  # the link came back on its own
            host.metrics.link_reconnects.labels(link.peer).inc()
            if not link.established and not link.opened:
                link.established = True
                host.apply(host.core.handle(AddLink(link.peer), host.now()))
            host.linked(link.peer)
            link.remote_pressure = link.sent_pressure = False
            host.update_pressure()
            self._tell_peers()
        host.mark_dirty(link)
        log.info(
            "%s: %s to %s is up (session %s, resend from %d)",
            self.name,
            link.kind,
            link.peer,
            link.session[:8],
            link.sent,
        )

    def lost(self, link: Link, conn: Conn) -> None:
        """The connection ``conn`` of ``link`` is gone; the session stays for a resume."""
        if link.conn is not conn:
            return
        link.disconnected()
        link.down_since = self.host.now()
        link.remote_pressure = link.sent_pressure = False
        if link.over:
            self.host.unpressure(link)  # a down link's backlog must not stop the overlay
        else:
            self.host.update_pressure()
        log.info("%s: %s to %s is down", self.name, link.kind, link.peer)
        if link.kind == "standby" and not link.dialer:
            self.drop(link, bye=None)  # its dialer comes back on a new session, if it wants

    def accept(self, conn: Conn, hello: dict[str, Any], kind: str) -> None:
        """A peer broker dialed us, for an overlay link or an out-of-band channel."""
        host = self.host
        peer = str_field(hello, "name")
        session = str_field(hello, "session")
        if peer == self.name:
            raise FrameError("a broker cannot link to itself", "bad-hello")
        self.refuse_fenced(peer, hello)
        address = hello.get("address")
        if isinstance(address, str) and address:
            host.peers.setdefault(peer, address)
        self._heard_peers({}, {peer: hello.get("clients")})
        if kind == "standby":
            self._accept_standby(conn, hello, peer, session)
            return
        if kind == "link":
            self._check_detour(peer, session, hello)
        if kind == "link" and peer in self.standby:
            # A link makes a standby link to the same broker pointless, and a promotion of it
            # would meet this link: drop it (the peer drops its end on the goodbye).
            self.drop(self.standby[peer], bye="removed")
        table = self._table(kind, dialer=False)
        link = table.get(peer)
        retired = self._retired.get(peer) if kind == "link" else None
        if retired is not None and retired.session == session:
            link = retired  # the earlier instance of a re-opened link resumes its flushing
        if link is not None and link.session == session:
            host.answer_hello(conn, last_rx=link.rx_seq)
            self._up(link, conn, hello)
            return
        if hello.get("resume"):
            removed = kind == "link" and (peer, session) in self._ended
            code = "link-removed" if removed else "unknown-session"
            raise FrameError(f"no {kind} session {session[:8]} with {peer}", code)
        if (
            link is not None
            and link.opened
            and not link.dialer
            and not link.closing
            and (not link.connected_once or (link.established and hello.get("opened")))
        ):
            # The dial our OpenLink was waiting for. Or a new one: the dialer abandoned an
            # earlier session of this link (its lock was refused, and it retried) after our core
            # had opened the link on that session; the core's link is the same, so its queue
            # goes out on the new session from the start.
            link.reset_session(session)
            if link.peer_closed:
                link.fire(LinkEvent.REOPENED)
        else:
            if link is not None:  # the peer started a new session (restarted, or re-added it)
                log.info("%s: %s opened a new %s session; resetting", self.name, peer, kind)
                self.drop(link, bye=None)
            opened = kind == "link" and bool(hello.get("opened"))
            link = self._new_link(
                Link(peer, session, dialer=False, address=None, kind=kind, opened=opened)
            )
            if opened:
                link.established = host.core.is_neighbour(peer)
        host.answer_hello(conn, last_rx=0)
        self._up(link, conn, hello)

    def refuse_fenced(self, peer: str, hello: dict[str, Any]) -> None:
        """Refuse a hello (a link's, a channel's or a probe's) from the process of ``peer``
        that this broker declared dead, telling it how long it had not been heard
        (``silent_for``) and whether this broker still has a live link (``linked``: a
        broker cut off from all its neighbours asks, see heartbeat)."""
        fenced = self.fenced.get(peer)
        if fenced is not None and hello.get("incarnation") == fenced:
            heard = self._fenced_heard.get(peer)
            detail: dict[str, object] = {"linked": self._linked()}
            if heard is not None:
                detail["silent_for"] = round(self.host.now() - heard, 3)
            raise FrameError(
                f"{self.name} declared {peer} (incarnation {fenced}) dead and repaired the "
                "overlay without it; restart it to rejoin as a new member",
                "fenced",
                detail,
            )

    def lift_fences(self, incarnations: dict[str, str]) -> list[str]:
        """Stop refusing the processes named (``peer -> incarnation``), if this broker fenced
        exactly those; the peers whose fence was lifted.

        A fence keeps a process declared dead from resuming its old sessions. After a network
        partition, each side fenced the other, and both sides are alive, each a tree: the
        restore joins them with a new link (docs/operations.md), and every fence between
        them must go, or the join, and any later exchange over a channel between the two
        sides, would be refused. Only the restore asks, having seen every broker alive,
        answering, with no repair under way and no link known at one end only: a process
        that was paused and repaired around still reports its old links, so it is never
        taken for a member."""
        self._check_in_overlay()
        lifted = []
        for peer, incarnation in incarnations.items():
            if incarnation and self.fenced.get(peer) == incarnation:
                del self.fenced[peer]
                self._fenced_heard.pop(peer, None)
                since = self.fenced_since.pop(peer, None)
                if since is not None:
                    self.lifted_since[peer] = since
                lifted.append(peer)
        if lifted:
            log.warning(
                "%s: fences lifted for %s: alive and in the overlay (a partition healed)",
                self.name,
                sorted(lifted),
            )
        return lifted

    def _check_in_overlay(self) -> None:
        """Refuse (ValueError) what only a member of the overlay may do, once this broker
        was fenced out (Broker.fenced_out): it must be restarted to rejoin."""
        if self.host.fenced_by is not None:
            raise ValueError(
                f"{self.name} was declared dead by {self.host.fenced_by} and is out of the "
                "overlay: restart it to rejoin as a new member"
            )

    def leave(self) -> None:
        """This broker was fenced out (Broker.fenced_out): drop every link and channel
        without a goodbye, and dial none again. Its neighbours take it for dead and repair
        around it; kept, a link to a neighbour that had not fenced it yet left that neighbour
        with a broker that had failed, so it never repaired, and events between two healthy
        brokers were lost unreported (review: an inner broker paused 1.35 s). The core is
        not told: it is about an overlay this broker is no longer in."""
        for link in [*self.all_links(), *self._retired.values()]:
            conn = link.remove()
            if link.dial_task is not None and link.dial_task is not asyncio.current_task():
                link.dial_task.cancel()
            if conn is not None:
                conn.abort()
        for table in (self.links, self.channels_out, self.channels_in, self.standby):
            table.clear()
        self._retired.clear()
        self._checks.clear()
        log.warning("%s: dropped every link: out of the overlay until restarted", self.name)

    def _accept_standby(self, conn: Conn, hello: dict[str, Any], peer: str, session: str) -> None:
        """A standby link dialed by ``peer``: always a new session (nothing to resume)."""
        old = self.standby.get(peer)
        if old is not None:
            self.drop(old, bye=None)
        link = self._new_link(Link(peer, session, dialer=False, address=None, kind="standby"))
        self.host.answer_hello(conn, last_rx=0)
        self._up(link, conn, hello)

    def answered(self, conn: Conn, hello: dict[str, Any]) -> None:
        """The broker we dialed answered our hello."""
        link = conn.link
        assert link is not None
        if link.removed:
            # Dropped while the hello was on its way: the peer has just set up its end, so it
            # must hear the goodbye it would have heard on an established connection.
            if link.farewell:
                conn.write(control_frame(F_BYE, link.farewell))
            conn.close()
            return
        if hello.get("name") != link.peer:
            raise FrameError(f"dialed {link.peer} but {hello.get('name')!r} answered", "wrong-peer")
        try:  # the certificate must be that broker's too, not just any of the overlay's
            check_link_peer(conn.identity, link.peer, secure=self.host.secure)
        except AccessError as exc:
            raise self.host.refusal(link.kind, conn, exc) from None
        self._up(link, conn, hello)
        if not conn.handshake.done():
            conn.handshake.set_result(None)

    def refused(self, conn: Conn, frame: list[Any]) -> None:
        """The broker we dialed refused our hello."""
        host = self.host
        link = conn.link
        assert link is not None
        code = frame[1] if len(frame) > 1 else "?"
        log.warning("%s: %s refused the %s: %s", self.name, link.peer, link.kind, frame[1:])
        if code in ("link-removed", "fenced"):
            if code == "fenced":
                self._fenced_by_peer(link, error_detail(frame))
            if not link.removed:
                self.drop(link, bye=None)
        elif code == "unknown-session" and link.closing:
            # A closing link whose session the peer no longer has: it restarted, or it ended
            # the session before our goodbye came. Nothing is left to flush to it, and a fresh
            # session would displace the link's current instance there: let it go.
            self.drop(link, bye=None)
        elif code == "unknown-session" and not link.removed:  # the peer lost our session
            if link.established and not link.opened:
                link.established = False
                host.apply(host.core.handle(RemoveLink(link.peer), host.now()))
            link.reset_session(uuid.uuid4().hex)
            if link.kind != "peer":
                link.clear_out()  # a link's core state is exchanged afresh on the new session
                host.link_acked(link)  # emptied: publishers it held back may go
            # A channel keeps what it holds: the peer restarted, and what was queued since its
            # old process died is for the new one (an exchange that includes it). Messages of
            # the old process's exchanges are dropped there as out of context (``data``).
        conn.close()
        if not conn.handshake.done():
            conn.handshake.set_exception(ConnectionRefusedError(f"{link.peer} refused: {code}"))

    async def _dial_loop(self, link: Link) -> None:
        """Keep the connection up: dial, hello, wait for loss, back off, repeat."""
        host = self.host
        cfg = host.config
        loop = asyncio.get_running_loop()
        delay = cfg.reconnect_min
        while not (link.removed or link.peer_closed or host.stopping or host.fenced_by):
            if link.kind == "standby" and link.connected_once:
                link.reset_session(uuid.uuid4().hex)  # nothing to resume: a new session
            address = link.address or host.peers.get(link.peer)
            conn: Conn | None = None
            try:
                if link.kind == "link" and link.peer in self.cut and not link.detoured:
                    raise OSError(f"the link to {link.peer} is cut (fault injection)")
                if address is None:
                    raise OSError(f"no address known for {link.peer} (POST /peers)")
                h, port = parse_address(address)
                _, dialed = await asyncio.wait_for(
                    loop.create_connection(lambda: Conn(host, link), h, port, ssl=host.tls_client),
                    cfg.handshake_timeout,
                )
                conn = dialed
                await asyncio.wait_for(asyncio.shield(dialed.handshake), cfg.handshake_timeout)
                delay = cfg.reconnect_min
                if link.removed or host.stopping:
                    # Cancelled as the handshake completed: Python 3.11's wait_for returns the
                    # result and drops the cancellation, and waiting for the loss of a healthy
                    # connection would hang the broker's stop (seen in test_runtime_linkfail).
                    dialed.abort()
                    break
                await dialed.lost
            except (OSError, TimeoutError, FrameError, ValueError) as exc:
                log.debug("%s: dialing %s failed: %s", self.name, link.peer, exc)
                if conn is not None:
                    conn.abort()
            if link.removed or link.peer_closed or host.stopping:
                break
            if not link.woken:  # a detour wakes the loop (Link.wake)
                link.backoff = loop.create_future()
                timer = loop.call_later(delay * (0.5 + random.random()), _done, link.backoff)
                try:
                    await link.backoff
                finally:
                    timer.cancel()
                    link.backoff = None
            if link.woken:
                link.woken = False
                delay = cfg.reconnect_min
            else:
                delay = min(delay * 2, cfg.reconnect_max)
            if link.detoured:  # the other end may detour a heartbeat or so later: keep trying
                delay = min(delay, cfg.heartbeat_interval)

    # ------------------------------------------------------------------ failures

    def _fenced_by_peer(self, link: Link, detail: dict[str, Any]) -> None:
        """``link.peer`` declared this process dead (it refused a dial, or answered a probe,
        with ``fenced``) and repaired the overlay without it: that process will never take
        this one back over the link. Cut off from the rest of the overlay as well, this
        broker is the stale side and fails (before the link goes, so that nothing more is
        acknowledged for it). Else it lives on in the overlay, its clients with it, and the
        peer is a death here too, whatever this end's own detector made of its silence: a
        partition can show it alive through a witness (a link failure, waited for), and
        the link was then known at this end only for good, which no restore would ever get
        past (review, a partition during an exchange). Declared dead, its fence time is
        kept (the join tells the gap from it) and this side repairs around it, as the other
        side did around this broker."""
        log.error(
            "%s: %s declared this broker dead and repaired the overlay without it; "
            "the link is dropped (restart this broker to rejoin as a new member)",
            self.name,
            link.peer,
        )
        if link.kind == "link" and link.incarnation:
            # Symmetric: that process will not take us back, nor we it (a link that failed
            # both ways is then fenced at both ends whichever detector fired first; the
            # other end's refusal can come before our own timeout).
            self.fenced.setdefault(link.peer, link.incarnation)
        if not self._connected_elsewhere(link):
            # Whatever the connection (a link, a channel): cut off from the whole overlay,
            # this is the stale side. First, so that nothing more is acknowledged or sent
            # for it (an exchange it is in is not settled: it leaves).
            self.host.fenced_out(link.peer, seconds(detail.get("silent_for")))
            return
        # Whatever the connection: an exchange whose cycle the peer is on will hear nothing
        # more from it, and settles now rather than at its lease's end.
        self.host.apply(self.host.core.handle(PeerGone(link.peer), self.host.now()))
        if link.kind == "link" and link.established and not link.closing:
            self._declare_dead(link, self.host.now() - (link.down_since or self.host.now()))

    def _declare_dead(
        self, link: Link, silent: float, answers: dict[str, bool | None] | None = None
    ) -> None:
        """The failure detector's verdict: the core repairs the tree around ``link.peer``, and
        the peer's process is fenced (refused if it ever resumes). ``answers``: what the
        standby peers asked about it said (none heard it)."""
        host = self.host
        peer = link.peer
        if not link.established or link.closing:
            return  # not a link of the core's tree (yet, or any more): nothing to repair
        core = host.core
        if not core.routing.has_link(peer):
            # The core has no such link (it went with an exchange the peer's death cut short):
            # nothing to repair, but the runtime's link must go and the peer be fenced as
            # below. Deferred, the repair waited for an exchange that had ended, and asked the
            # witnesses about the peer every heartbeat for good; the supervisor saw the link
            # at this end only and never brought the peer back (chaos soak reproduction).
            effects = []
        else:
            # On the cycle of an exchange past its grant, the core settles its part first
            # (BrokerCore._peer_failed), and the repair follows at once.
            try:
                effects = core.handle(PeerFailed(peer), host.now())
            except ProtocolError as exc:
                self._defer(peer, "looks dead", exc)
                self._ask_link_fence(link)
                return
        self._deferred.pop(peer, None)
        link.established = False  # the core has dropped it already
        if link.incarnation:
            self.fenced[peer] = link.incarnation
            # From when it was last heard, not from ``silent``: that was measured when the
            # check of the witnesses began, half a second before this verdict (review: every
            # partition's gap started that late, and a fenced broker's clients resumed from
            # 1.4 s too late).
            heard = max(silent, host.now() - link.last_heard if link.last_heard else 0.0)
            self._fenced_heard[peer] = host.now() - heard
            self.fenced_since[peer] = round(time.time() - heard, 3)
        self.drop(link, bye=None)
        self._drop_channels(peer, unless=None)
        host.metrics.peer_failures.inc()
        log.warning(
            "%s: declared %s dead (no connection for %.1fs%s); repairing the tree without it",
            self.name,
            peer,
            silent,
            f", heard by none of {sorted(answers)}" if answers else "",
        )
        host.apply(effects)

    def _defer(self, peer: str, what: str, exc: ProtocolError) -> None:
        why = f"{what}: {exc}"
        if self._deferred.get(peer) != why:
            self._deferred[peer] = why
            log.info("%s: %s %s, repair deferred until the exchange ends", self.name, peer, why)

    # ------------------------------------------------------------------ link failures

    def link_repair_on(self) -> bool:
        """Whether a silent link is asked about before it is taken for a death: there must be
        standby links to ask over, and cycles to exchange a failed link onto."""
        cfg = self.host.config
        return cfg.repair and cfg.standby and cfg.cycle_bound >= 3

    def _suspect(self, link: Link, silent: float, now: float) -> None:
        """``link`` has had no connection for the detection timeout: ask the standby peers
        whether they still hear its peer (see the module docstring), or, with nobody to ask,
        declare it dead at once."""
        peer = link.peer
        if peer in self._checks:
            return  # asked already; the answers or the deadline decide
        if not (self.link_repair_on() and link.established and not link.closing):
            self._declare_dead(link, silent)
            return
        witnesses = {
            lk.peer: lk.conn
            for lk in [*self.links.values(), *self.standby.values()]
            if lk.conn is not None and not lk.conn.held and lk.peer != peer
        }
        asked = set(witnesses)
        if not asked:
            self._verdict(peer, _Check("", set(), now, silent), None)
            return
        nonce = uuid.uuid4().hex[:12]
        question = control_frame(F_HEARS, nonce, peer)
        for conn in witnesses.values():
            if conn is not None:
                conn.write(question)
        cfg = self.host.config
        self._checks[peer] = _Check(nonce, asked, now + 2 * cfg.heartbeat_interval, silent)
        log.info(
            "%s: no connection to %s for %.1fs; asking %s whether they hear it",
            self.name,
            peer,
            silent,
            sorted(asked),
        )

    def _probe_unconnected(self, link: Link, now: float) -> None:
        """A repair link that has never connected: its peer may have died with the dead broker
        (a node or zone failure), or be alive and not have dialed yet (its own detection comes
        later, its heartbeat may be slower). A hello on a fresh connection to its address
        tells them apart: no answer within the handshake timeout is a death (refused: the
        process is gone; silent: its node, or a paused process, which is fenced as usual),
        and so is a refusal of the probe (``left``: a broker fenced out, waiting to be
        restarted; see Broker.probe)."""
        if link.peer in self._probing:
            return
        address = self.host.peers.get(link.peer) or link.address
        if not address:
            self._declare_dead(link, now - (link.down_since or now))
            return
        self._probing.add(link.peer)

        async def probe() -> None:
            try:
                answer = await self.host.probe_hello(address, link.peer)
            finally:
                self._probing.discard(link.peer)
            if self.links.get(link.peer) is not link or link.conn is not None:
                return  # connected (or gone) meanwhile
            if answer is None:
                self._declare_dead(link, self.host.now() - (link.down_since or now))
            else:  # alive: give its dial another detection timeout, unless it never will
                link.down_since = self.host.now()
                self._alive_there(link, answer.get("heard"))

        self.host.tasks.spawn(probe(), f"probe {link.peer}")

    def _connected_elsewhere(self, but: Link) -> bool:
        """Whether another overlay link of this broker is connected and was heard within the
        detection timeout: then a neighbour that refuses it as fenced is the one cut off (a
        broker paused past detection declares its own neighbours dead when it resumes), and
        this broker is no reason to fail. Not so within a detection timeout of a stall of this
        broker's own: then it is the stale one (see heartbeat)."""
        if self._just_woke():
            return False
        return any(lk is not but and self._heard_lately(lk) for lk in self.links.values())

    def _just_woke(self) -> bool:
        return self.host.now() - self._woke_at <= self.host.config.detection_timeout

    def _linked(self) -> bool:
        """Some overlay link of this broker is connected and was heard lately. Not merely
        listed: a repair link the far end refuses (``not-open``) is dialed again and again,
        and a broker cut off behind it would never ask whether it was fenced (review, with
        standby links off)."""
        return any(self._heard_lately(lk) for lk in self.links.values())

    def _heard_lately(self, link: Link) -> bool:
        """``link`` has a connection and a frame came over it within the detection timeout."""
        timeout = self.host.config.detection_timeout
        return link.conn is not None and self.host.now() - link.last_heard <= timeout

    def heard_ago(self) -> dict[str, list[float]]:
        """For each overlay neighbour heard lately: how long ago it was last heard, and for how
        long its connection has been up (seconds). Sent with a ``not-open`` refusal and in a
        probe's answer, so that a broker repairing around one of them learns it is alive here
        (see _alive_there).

        Nothing while this broker's own loop has just stalled past the detection timeout: it
        was paused, its neighbours have likely declared it dead, and what it hears is a
        neighbour paused with it (an old connection, neither side read it meanwhile). Said,
        that made the survivors take the pair for a healed partition and withdraw the repair
        links a bridge over both needed (an outside attack: two neighbours SIGSTOPped 2-6 s
        together, the overlay split until the restore)."""
        if self._just_woke():
            return {}
        now = self.host.now()
        return {
            p: [round(now - lk.last_heard, 3), round(now - lk.up_since, 3)]
            for p, lk in self.links.items()
            if lk.established and self._heard_lately(lk)
        }

    def _alive_there(self, link: Link, heard: object) -> None:
        """The far end of a repair link (refusing its data as ``not-open``: its core has no
        such link; or answering a probe because it never connected) still hears the broker
        this end repaired around (``heard``: its heard_ago), later than this end last did,
        over a connection up since before this end last heard it: to it that broker has been
        alive all along, so it will never open the link. A partition healed: each side
        repaired around the other, and its repair links reach the other side. The link is
        withdrawn now, which ends the repair at once (this end is that end of the chain now),
        rather than when its timer runs out (_withdraw_unjoined): the restore joins the sides
        that much sooner. A far end whose own detector is merely slower last heard the dead
        broker no later than this end did; one that hears it again over a new connection
        heard a process that was paused (it lost that connection to heartbeats meanwhile),
        which is about to find itself fenced and fail, and whose repair by the far end then
        needs this very link (review). Both are waited for, as before."""
        if type(heard) is not dict or not self.host.config.repair:
            return
        now = self.host.now()
        for rec in self.repairs:
            dead = rec["dead"]
            lost = self._fenced_heard.get(dead)
            if "complete_at" in rec or link.peer not in rec["linked"] or lost is None:
                continue
            ages = heard.get(dead)
            if type(ages) is not list or len(ages) != 2:
                continue  # not heard there
            ago, up_for = (finite_number(a) for a in ages)
            if ago is None or up_for is None or ago < 0 or up_for < 0:
                continue  # not numbers of seconds: nothing to go by
            if not (ago < now - lost - HEARD_AFTER_MARGIN and up_for > now - lost):
                continue
            log.warning(
                "%s: %s still hears %s (%.1fs ago, after this broker lost it): it will never "
                "open the repair link; withdrawing it: the overlay is split until it is joined",
                self.name,
                link.peer,
                dead,
                ago,
            )
            try:
                self.drop(link, bye="removed")
            except ProtocolError as exc:  # an exchange holds it: its lease settles it first
                log.info("%s: the link to %s stays for now: %s", self.name, link.peer, exc)
                return
            rec.setdefault("withdrawn", []).append(link.peer)
            return

    def _answer(self, conn: Conn, nonce: str, peer: str) -> None:
        """A neighbour or standby peer asks whether this broker hears ``peer``: its link or
        standby link to ``peer`` has a connection and a frame came over it within the detection
        timeout (None: it has neither, so it cannot tell)."""
        hears: bool | None = None
        for lk in (self.links.get(peer), self.standby.get(peer)):
            if lk is None:
                continue
            hears = bool(hears) or self._heard_lately(lk)
        conn.write(control_frame(F_HEARD, nonce, peer, hears))

    def _heard(self, witness: str, nonce: str, peer: str, hears: bool | None) -> None:
        check = self._checks.get(peer)
        if check is None or check.nonce != nonce or witness not in check.asked:
            return  # a late answer to a settled question
        check.asked.discard(witness)
        check.answers[witness] = hears
        if hears is True:
            del self._checks[peer]
            self._verdict(peer, check, witness)
        elif not check.asked:
            del self._checks[peer]
            self._verdict(peer, check, None)

    def _verdict(self, peer: str, check: _Check, witness: str | None) -> None:
        """Alive (``witness`` hears it): the core is told the link failed (once per failure;
        asked again after each further timeout). Dead: the crash repair, as before."""
        host = self.host
        link = self.links.get(peer)
        if link is None or link.conn is not None:
            return  # dropped, or back, while the question was out
        if witness is None:
            self._declare_dead(link, check.silent, check.answers)
            return
        now = host.now()
        link.down_since = now  # the next question after another detection timeout
        self._ask_link_fence(link)
        if peer in self._link_failed:
            return
        try:
            effects = host.core.handle(LinkFailed(peer), now)
        except ProtocolError as exc:
            self._defer(peer, "failed (its link)", exc)
            return
        self._deferred.pop(peer, None)
        self._link_failed.add(peer)
        host.metrics.link_failures.inc()
        log.warning(
            "%s: the link to %s failed (no connection for %.1fs) but %s still hears it: a "
            "link failure, not a death",
            self.name,
            peer,
            check.silent,
            witness,
        )
        self.link_repairs = [
            *self.link_repairs[-(MAX_LINK_REPAIR_RECORDS - 1) :],
            {
                "peer": peer,
                "witness": witness,
                "failed_at": time.time(),
                "xid": None,
                "path": None,
                "reason": None,
                "detoured": False,
                "detour_up_at": None,
                "closed_at": None,
            },
        ]
        host.apply(effects)

    def _record(self, peer: str) -> dict[str, Any] | None:
        """The newest record of a failure of the link to ``peer``."""
        recs: list[dict[str, Any]] = [r for r in self.link_repairs if r["peer"] == peer]
        return recs[-1] if recs else None

    def link_repair(self, eff: LinkRepair) -> None:
        """The core's decision on a failed link (at the end that decides): an exchange, or
        nothing (no known small cycle contains the link: its traffic waits for it)."""
        outcome = "exchange" if eff.xid else "none"
        self.host.metrics.link_repairs.labels(outcome).inc()
        rec = self._record(eff.peer)
        if rec is not None:
            rec.update(xid=eff.xid or None, path=list(eff.path) or None, reason=eff.reason or None)
        if eff.xid:
            log.warning(
                "%s: repairing the failed link to %s by exchange %s onto the standby link %s-%s "
                "(cycle %s)",
                self.name,
                eff.peer,
                eff.xid,
                eff.path[0],
                eff.path[-1],
                list(eff.path),
            )
        else:
            log.warning(
                "%s: the failed link to %s is not repaired: %s", self.name, eff.peer, eff.reason
            )

    def detour(self, peer: str) -> None:
        """The core's ``DetourLink``: carry the failed link's session out of band (see the
        module docstring) until the exchange closes it."""
        link = self.links.get(peer)
        if link is None or link.closing:
            return
        if not link.detoured:
            link.detour()
            self.host.metrics.detours.inc()
            rec = self._record(peer)
            if rec is not None:
                rec["detoured"] = True
            log.warning(
                "%s: detouring the link to %s out of band (%d message(s) unacknowledged)",
                self.name,
                peer,
                len(link.out),
            )
        if link.dialer and link.conn is None:
            link.wake()  # dial now, with the detour hello

    def _check_detour(self, peer: str, session: str, hello: dict[str, Any]) -> None:
        """A link hello: a detour is taken only for a link this end's core detoured too (the
        same session); a plain one is refused while the link is cut (fault injection)."""
        if hello.get("detour"):
            link = self.links.get(peer)
            if link is None or not link.detoured or link.session != session:
                raise FrameError(
                    f"{self.name} has not detoured its link to {peer} (yet)", "not-detoured"
                )
            rec = self._record(peer)
            if rec is not None and rec["detour_up_at"] is None:
                rec["detour_up_at"] = time.time()
        elif peer in self.cut:
            raise FrameError(f"the link to {peer} is cut (fault injection)", "link-cut")

    def _detour_ended(self, link: Link) -> None:
        rec = self._record(link.peer)
        if rec is not None and rec["closed_at"] is None:
            rec["closed_at"] = time.time()
        log.warning("%s: the detoured link to %s is closed", self.name, link.peer)

    def cut_link(self, peer: str) -> bool:
        """Fault injection: fail the link to ``peer`` for good while both brokers live. Its
        connection is aborted and every later one refused (this end neither dials it nor takes
        the peer's dials), except a detour. Other connections to ``peer`` (standby links,
        channels) are untouched. False if there is no such link."""
        link = self.links.get(peer)
        if link is None:
            return False
        self.cut.add(peer)
        if link.conn is not None:
            link.conn.abort()
        log.warning("%s: the link to %s is cut (fault injection)", self.name, peer)
        return True

    def heal_link(self, peer: str) -> bool:
        """Undo :meth:`cut_link`: the link's connections are taken again."""
        if peer not in self.cut:
            return False
        self.cut.discard(peer)
        return True

    # ------------------------------------------------------------------ cycle detection

    def cycles(self) -> None:
        """Tell the core the standby set when it changes and start detection rounds: one per
        wall-clock period, and a wave after this broker's links or standby set changed."""
        host = self.host
        cfg = host.config
        if not self.link_repair_on() or host.stopping or not cfg.cycle_period > 0:
            return
        core = host.core
        standby = tuple(sorted(core.standby_peers()))
        if standby != self._standby_told:
            self._standby_told = standby
            host.apply(core.handle(StandbyLinks(standby), host.now()))
        tree = tuple(sorted(p for p, lk in self.links.items() if lk.established))
        shape = (tree, standby)
        period_round = int(time.time() / cfg.cycle_period) * ROUND_STRIDE
        if period_round > self.cycle_round:
            self.start_round(period_round)
        elif (
            self._shape is not None
            and shape != self._shape
            and self.cycle_round + 1 < period_round + ROUND_STRIDE
        ):
            self.start_round(self.cycle_round + 1)
        self._shape = shape

    def start_round(self, number: int) -> None:
        """``FindCycles(number)``; a round the core has moved past (a probe of a newer one
        came first) is skipped."""
        host = self.host
        self.cycle_round = max(self.cycle_round, number)
        try:
            effects = host.core.handle(FindCycles(number, host.config.cycle_bound), host.now())
        except ProtocolError as exc:
            log.debug("%s: cycle round %d skipped: %s", self.name, number, exc)
            return
        host.apply(effects)

    def cycles_status(self) -> dict[str, Any]:
        core = self.host.core
        known = core.cycles.known(core.is_neighbour)
        return {
            "bound": self.host.config.cycle_bound if self.link_repair_on() else 0,
            "round": self.cycle_round,
            "standby": list(self._standby_told or ()),
            "known": [{"cycle": list(c), "round": r} for c, r in sorted(known.items())],
        }

    def repaired(
        self, dead: str, chain: tuple[str, ...], links: tuple[str, ...], together: str = ""
    ) -> None:
        """The core's account of a repair (its :class:`Repaired` effect): which of its new
        links were promoted standby links and which were dialed. ``together``: the broker
        ``dead`` died with, where this is a bridge over the two."""
        how = {p: self._opened_how.pop(p, "dialed") for p in links}
        promoted = [p for p in links if how[p] == "promoted"]
        dialed = [p for p in links if how[p] != "promoted"]
        self.host.metrics.repairs.inc(len(links))
        self.host.metrics.repair_links_promoted.inc(len(promoted))
        now = self.host.now()
        for p in dialed:
            link = self.links.get(p)
            if link is not None and link.conn is None and link.down_since is None:
                # Its far end may have died with the dead one (a node or zone failure): a
                # repair link that never connects is suspected like one that lost its
                # connection, so that death is detected and repaired too.
                link.down_since = now
        if together:
            log.warning(
                "%s: %s died with %s: bridging over both; the bridge is %s; linking to %s",
                self.name,
                dead,
                together,
                list(chain),
                list(links) or "nobody new",
            )
        else:
            log.warning(
                "%s: repair around %s: its neighbours %s form a chain; linking to %s "
                "(standby links promoted: %s)",
                self.name,
                dead,
                list(chain),
                list(links) or "nobody new",
                promoted or "none",
            )
        self.repairs = [
            *self.repairs[-9:],
            {
                "dead": dead,
                "chain": list(chain),
                "linked": list(links),
                **({"died_with": together} if together else {}),
                "promoted": promoted,
                "dialed": dialed,
                "at": time.time(),
            },
        ]

    def repair_finished(self, eff: RepairFinished) -> None:
        self.host.metrics.replayed.inc(eff.replayed)
        log.warning(
            "%s: repair around %s complete%s: %d notification(s) sent again over the new links "
            "(of %d kept)",
            self.name,
            eff.dead,
            " (a sweep never came: finished by timeout)" if eff.timed_out else "",
            eff.replayed,
            eff.retained,
        )
        for rec in reversed(self.repairs):
            if rec["dead"] == eff.dead and "replayed" not in rec:
                rec.update(replayed=eff.replayed, complete_at=time.time())
                if eff.timed_out:
                    self._withdraw_unjoined(rec)
                break

    def _withdraw_unjoined(self, rec: dict[str, Any]) -> None:
        """A repair that ended by timeout: withdraw its new links that the far end never
        took up (never connected, or refused as ``not-open``: its core has no such link).

        A network partition does this. Both sides declare each other dead, and each links to
        the far side of the other's neighbours, which it cannot reach, or which never saw a
        death (its neighbour is alive on its side) and so never opens its end. Kept, such a
        link held this side's traffic for a broker that would never take it, was dialed for
        ever, and, once the network healed, could close a cycle between the two sides' trees
        (found on real processes, tests/integration/test_partition.py). Withdrawn, each side
        is a tree of its own, which the restore joins (docs/operations.md)."""
        for peer in rec["linked"]:
            link = self.links.get(peer)
            if link is None or link.closing or not (link.connects == 0 or link.refused_open):
                continue
            log.warning(
                "%s: the repair link to %s was never taken up by %s (%s); withdrawing it: "
                "the overlay is split until it is joined",
                self.name,
                peer,
                peer,
                "never connected" if link.connects == 0 else "refused as not open",
            )
            try:
                self.drop(link, bye="removed")
            except ProtocolError as exc:  # an exchange holds it: its lease settles it first
                log.info("%s: the link to %s stays for now: %s", self.name, peer, exc)
                continue
            rec.setdefault("withdrawn", []).append(peer)

    def _tell_peers(self, *, changed: bool = False) -> None:
        """Tell every neighbour the addresses of all the others: a repair links brokers that
        never talked, and each must be able to dial the other; and their client addresses,
        which a client fails over to (with separate listeners they are other ports).

        Also those of the neighbours' own neighbours, as far as they are known here: a bridge
        over two neighbours that died together links brokers two hops apart from either side
        (core.repair.bridge_ends). ``changed``: only if the book differs from the last one
        told (a neighbour's list or addresses changed), else to every connected link."""
        host = self.host
        book = {host.name: host.advertised}
        clients = {host.name: host.client_advertised}
        for peer, link in self.links.items():
            address = link.address or host.peers.get(peer)
            if address:
                book[peer] = address
            if peer in host.client_peers:
                clients[peer] = host.client_peers[peer]
        for names in host.core.neighbour_lists.lists.values():
            for name in names:
                if name not in book and name in host.peers:
                    book[name] = host.peers[name]
        told = (book, clients)
        if changed and told == self._told_book:
            return
        self._told_book = told
        frame = control_frame(F_PEERS, book, clients)
        for link in self.links.values():
            if link.conn is not None:
                link.conn.write(frame)

    def _heard_peers(self, book: dict[str, object], clients: dict[str, object]) -> None:
        peers = self.host.peers
        for name, address in valid_addresses(book, self.name):
            # An address the operator gave wins; one learnt from a neighbour may be updated.
            if name not in peers or peers[name] == self._learned.get(name):
                old = peers.get(name)
                peers[name] = self._learned[name] = address
                if old is not None and old != address:
                    self.moved(name)
        self.host.client_peers.update(valid_addresses(clients, self.name))
        self._tell_peers(changed=True)  # the second hop's addresses may be news to the others

    # ------------------------------------------------------------------ heartbeats

    def heartbeat(self, now: float) -> None:
        """Ping every connected link and channel; drop a connection that has been silent for
        ``dead_after`` heartbeats (the session stays, and the dialer reconnects); declare a
        neighbour dead whose link has had no connection for as long again.

        Two cases where only the neighbours know whether this broker is still a member, so
        they are asked (a probe naming this incarnation, refused ``fenced`` by one that
        declared it dead: ``Broker.fenced_out``):

        * **This broker's own loop stalled** past the detection timeout (the heartbeats came
          that late: paused, a frozen VM, a blocked loop). Its neighbours heard nothing from
          it for as long and may have repaired the overlay without it; what it did not hear
          from them says nothing about them. So the silence it measured is discarded
          (detection starts again from the wake-up) and every neighbour is asked at once.
          Before, a broker that dials none of its neighbours was never refused: it went on
          declaring them dead, acknowledging its publishers' events that nobody else would
          get (found by review: a leaf paused 2 s; 11,040 events of its publisher missed at
          the other broker, untold).
        * **It has no live neighbour left** (no link connected and heard lately) and declared
          some dead: a partition, or a stall shorter than this broker's own detection, may
          have made it the side that was cut off. The neighbours it declared dead are asked
          every detection timeout until it has a live link again. One that fenced it and
          still has a live link is with the overlay: this broker is the part cut off. One
          that fenced it and is cut off too (two brokers, parted): they fenced each other,
          and only one must go, the one whose name sorts last, or both would restart."""
        cfg = self.host.config
        if self.host.fenced_by is not None:
            return  # out of the overlay (leave): nothing to detect, nobody to ping
        timeout = cfg.detection_timeout
        last, self._last_beat = self._last_beat, now
        if last is not None and now - last > timeout:
            self._woke_at = now
            log.warning(
                "%s: this broker's loop did not run for %.1fs (paused?); asking its "
                "neighbours whether they declared it dead meanwhile",
                self.name,
                now - last,
            )
            if cfg.repair:  # without detection nobody fences anybody: nothing to ask
                self._ask_fence([*self.links], stale=True)
        elif self.fenced and not self._linked() and now >= self._next_fence_check:
            self._next_fence_check = now + timeout
            self._ask_fence([*self.fenced], stale=False)
        self.update_standby()
        for link in list(self.links.values()) if cfg.repair else ():
            since = link.down_since
            if (
                link.closing
                and link.conn is None
                and since is not None
                and now - max(since, self._woke_at) > timeout
            ):
                # Closed by its core, its last messages not all acknowledged, and no
                # connection for a detection timeout: the peer is gone, or dropped it. Kept
                # on, it was reported as a neighbour until the repair timeout (`canopy bench
                # faults --victim b4`: R1 died just after R2 closed the removed link, which
                # stayed at R2 for 10 s). Nothing is lost with it: the core has done with it.
                log.info(
                    "%s: closed link to %s gone for %.1fs with %d message(s) unacknowledged; "
                    "dropped",
                    self.name,
                    link.peer,
                    now - since,
                    len(link.out),
                )
                self.drop(link, bye=None)
                continue
            if (
                not link.dialer
                and not link.established
                and link.conn is None
                and since is not None
                and now - since > self.host.core.repair_timeout
                and self.host.core.exchange is None
                and not self.host.core.pending_exchanges
            ):
                # A repair link dialed to us that our core never opened (we saw no death:
                # a partition, see _withdraw_unjoined), and its dialer is gone: forget it,
                # or it would be reported as a neighbour for ever. Not while an exchange
                # runs here: its new link waits for this core's own time to open it.
                self.drop(link, bye=None)
                continue
            if (
                since is not None
                and link.conn is None
                and now - max(since, self._woke_at) > timeout
            ):
                if link.connects == 0:
                    self._probe_unconnected(link, now)
                else:
                    self._suspect(link, now - since, now)
        for peer, check in list(self._checks.items()):
            if now > check.deadline:  # the unanswered say nothing: no one heard it
                del self._checks[peer]
                self._verdict(peer, check, None)
        self.cycles()
        for link in self.all_links():
            conn = link.conn
            if conn is None:
                continue
            # A connection held back on purpose (data on a promoted standby link, waiting for
            # this end's repair) is silent because we do not read it: give it longer.
            if now - max(link.last_heard, self._woke_at) > timeout * (3 if conn.held else 1):
                log.warning("%s: link to %s missed heartbeats; dropping it", self.name, link.peer)
                conn.abort()
                continue
            conn.write(control_frame(F_PING, now, link.rx_seq))
            link.acked_rx = link.rx_seq

    def _ask_fence(self, peers: list[str], *, stale: bool) -> None:
        """Ask each of ``peers`` (at an address it or a neighbour told) whether it declared
        this process dead (see heartbeat); the first that did makes this broker fail, unless
        this broker is not ``stale`` (its loop did not stall), the one that fenced it has no
        live link either (two brokers parted), and this broker's name sorts first."""
        for peer in peers:
            link = self.links.get(peer)
            address = self.host.peers.get(peer) or (link.address if link is not None else None)
            self._fence_question(peer, address, functools.partial(self._fence_answer, peer, stale))

    def _ask_link_fence(self, link: Link) -> None:
        """Ask the peer of a link waited for (a witness hears it) whether it declared this
        process dead: once it has, it never dials or takes the link again, and only its
        answer says so (see _fenced_by_peer). Asked after each detection timeout of the
        wait, like the witnesses."""
        peer = link.peer
        now = self.host.now()
        if now - self._fence_asked.get(peer, -math.inf) < self.host.config.detection_timeout:
            return  # asked lately (a deferred verdict comes back every heartbeat)

        def answered(detail: dict[str, Any]) -> None:
            if self.host.fenced_by is None and self.links.get(peer) is link and link.conn is None:
                self._fenced_by_peer(link, detail)  # still waited for

        if self._fence_question(peer, self.host.peers.get(peer) or link.address, answered):
            self._fence_asked[peer] = now

    def _fence_question(
        self, peer: str, address: str | None, answered: Callable[[dict[str, Any]], None]
    ) -> bool:
        """Ask ``peer`` at ``address``, in the background, whether it declared this process
        dead (Broker.fenced_at); ``answered`` gets the refusal's detail if it did. One question
        per peer at a time; False when none was asked (no address, or one is out)."""
        if not address or peer in self._asking_fence:
            return False
        self._asking_fence.add(peer)

        async def ask() -> None:
            try:
                detail = await self.host.fenced_at(peer, address)
            finally:
                self._asking_fence.discard(peer)
            if detail is not None and not self.host.stopping:
                answered(detail)

        self.host.tasks.spawn(ask(), f"fence check {peer}")
        return True

    def _fence_answer(self, peer: str, stale: bool, detail: dict[str, Any]) -> None:
        if not stale and detail.get("linked") is False and self.name < peer:
            log.info(
                "%s: %s declared this broker dead, and is cut off too: it restarts, this one "
                "stays (the name sorting first)",
                self.name,
                peer,
            )
        else:
            log.error(
                "%s: %s declared this broker dead and repaired the overlay without it "
                "(restart this broker to rejoin as a new member)",
                self.name,
                peer,
            )
            self.host.fenced_out(peer, seconds(detail.get("silent_for")))


def _strs(*values: object) -> bool:
    return all(type(v) is str and v for v in values)


def _done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
