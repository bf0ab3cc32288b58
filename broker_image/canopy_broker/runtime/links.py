"""The destinations of a broker process: overlay links (and channels) and attached clients.

* :class:`Link` is one overlay link or out-of-band channel. It outlives its connections:
  sequence numbers, the retransmit buffer and the receive position survive a reconnect, which is
  what makes the link reliable and FIFO across reconnects (nothing lost, nothing duplicated). Its
  session and closure states change only through the tables of
  :mod:`canopy_broker.runtime.linkstate`.
* :class:`Client` is one attached client with its outbound queue.

Both know their connection only as a :class:`~canopy_broker.runtime.framing.FrameProtocol`
(something frames are written to), so this module sits below the connection class
(:mod:`canopy_broker.runtime.conn`) and the broker. What to do with frames received is the job
of :mod:`~canopy_broker.runtime.link_sessions` and :mod:`~canopy_broker.runtime.client_sessions`.

Outbound data is never written message by message. Producers append encoded messages to a
destination's list and mark it dirty; the broker flushes all dirty destinations once per event-loop
iteration, writing one frame (or a few, at ``BATCH_BYTES``) per destination. Under load this
batches hundreds of messages per ``write()``; at low load it adds no delay beyond the current
iteration.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from canopy_broker.runtime.framing import (
    F_ACK,
    FrameError,
    FrameProtocol,
    control_frame,
    data_frame,
)
from canopy_broker.runtime.linkstate import LinkEvent, LinkState, LinkStates, Route, Standing
from canopy_broker.runtime.outbox import Outlet, batches
from canopy_broker.runtime.security import ANYTHING, Principal

if TYPE_CHECKING:
    from prometheus_client import Counter


class Link:
    """One reliable, ordered message channel to a peer: sequence numbers, retransmit buffer and
    connection state.

    ``kind`` is ``"link"`` for an overlay link (messages are the core's link messages),
    ``"peer"`` for an out-of-band control channel of the reconfiguration protocols (messages go
    to the core as ``FromPeer``; a channel carries data one way, from its dialer), or
    ``"standby"`` for a standby link: a connection kept warm to a broker a crash repair would
    link this one to, carrying hellos and heartbeats only, until a repair promotes it
    (:meth:`promote`) into an overlay link on the same connection and session. ``opened``
    marks an overlay link the *core* created (the added link of an exchange): the runtime then
    never tells the core ``AddLink``/``RemoveLink`` for it, the core's ``OpenLink``/``CloseLink``
    effects drive it.

    ``out`` holds every message not yet acknowledged by the peer, sent or not: ``out[0]`` has
    sequence number ``base`` and ``sent`` is the next sequence number to put on the wire. An ack
    drops a prefix; a reconnect rewinds ``sent`` to what the peer says it has received.
    ``out_bytes`` is their size: whoever appends to ``out`` adds to it (the broker's hot path
    does it inline), and :meth:`ack` and :meth:`clear_out` take it back.
    """

    slot = 0
    """Bytes of ``out`` that count as one message against the marks (``BrokerConfig.slot``,
    set by the link sessions; 0: by messages only)."""

    def __init__(
        self,
        peer: str,
        session: str,
        *,
        dialer: bool,
        address: str | None,
        kind: str = "link",
        opened: bool = False,
    ) -> None:
        self.peer = peer
        self.session = session
        self.dialer = dialer
        self.address = address
        self.kind = kind
        self.opened = opened
        self.established = False  # the core knows this link (AddLink given, or it opened it)
        # session, closure and standing; see linkstate.py
        self.states = LinkStates(Standing.STANDBY if kind == "standby" else Standing.ACTIVE)
        self.farewell: str | None = None  # the goodbye it was dropped with
        self.conn: FrameProtocol | None = None
        self.out: list[bytes] = []
        self.out_bytes = 0
        self.base = 1
        self.sent = 1
        self.rx_seq = 0
        self.acked_rx = 0
        self.last_heard = 0.0
        self.down_since: float | None = None  # when its session lost its connection
        self.up_since = 0.0  # when its current connection came up (loop clock)
        self.incarnation = ""  # the peer's process, from its hello (what a fence names)
        self.rtt_ms: float | None = None
        self.connects = 0
        # The peer refused data as ``not-open`` and has sent nothing since: its core has no
        # such link (a repair link to a broker that never saw the death, see repair_finished).
        self.refused_open = False
        # The core kept this link for a new try of an exchange (LinkSessions.open, ``kept``);
        # until data comes over it, a goodbye on it is from the old try's end of the peer.
        self.kept = False
        self.dirty = False
        self.over = False  # above high water, counted in the broker's pressure set
        self.remote_pressure = False  # the peer says it (or a broker behind it) is congested
        self.sent_pressure = False  # what we last told the peer
        self.up = asyncio.Event()
        # The dial loop's backoff, which a detour cuts short (:meth:`wake`).
        self.backoff: asyncio.Future[None] | None = None
        self.woken = False
        self.dial_task: asyncio.Task[None] | None = None
        self.msgs_in = self.msgs_out = self.bytes_in = self.bytes_out = 0
        self.m_msgs_in: Counter | None = None
        self.m_msgs_out: Counter | None = None
        self.m_bytes_in: Counter | None = None
        self.m_bytes_out: Counter | None = None

    # -- state (changed only through the transition tables of linkstate.py) ------------------

    def fire(self, event: LinkEvent) -> None:
        self.states.fire(event, self.peer)

    @property
    def state(self) -> str:
        """The admin API's name for the connection state: ``up``, ``connecting`` or ``down``."""
        return self.states.public_state(self.dialer)

    @property
    def removed(self) -> bool:
        return self.states.session is LinkState.REMOVED

    @property
    def connected_once(self) -> bool:
        """A session exists on both ends: a reconnect resumes it."""
        return self.states.session in (LinkState.UP, LinkState.LOST)

    @property
    def closing(self) -> bool:
        """The core closed it: flush, then say goodbye."""
        return self.states.closing

    @property
    def peer_closed(self) -> bool:
        """The peer's core closed it: never redial."""
        return self.states.peer_closed

    def connected(self, conn: FrameProtocol) -> None:
        """A hello completed on ``conn``: it carries the session from now on."""
        self.fire(LinkEvent.CONNECTED)
        self.conn = conn
        self.up.set()

    def disconnected(self) -> None:
        """The session's connection is gone; the session stays for a resume."""
        self.fire(LinkEvent.DISCONNECTED)
        self.conn = None
        self.up.clear()

    def remove(self) -> FrameProtocol | None:
        """Forget the link; returns the connection it had, for the goodbye."""
        self.fire(LinkEvent.REMOVE)
        conn, self.conn = self.conn, None
        self.up.clear()
        return conn

    def reset_session(self, session: str) -> None:
        """Start over on ``session``: nothing sent or received on the old one counts."""
        self.fire(LinkEvent.RESET)
        self.session = session
        self.base = self.sent = 1
        self.rx_seq = self.acked_rx = 0

    def promote(self) -> None:
        """A repair takes this standby link over: from now on it is an overlay link the core
        opened, on the same session (a standby link has sent and received no data, so its
        sequence numbers start where an opened link's do)."""
        self.fire(LinkEvent.PROMOTE)
        self.kind = "link"
        self.opened = True

    @property
    def promoted(self) -> bool:
        return self.states.standing is Standing.PROMOTED

    def detour(self) -> None:
        """The core's link-failure repair: from now on this session resumes on an out-of-band
        connection (the hello says ``detour``), which the link's failure does not block."""
        self.fire(LinkEvent.DETOUR)

    def wake(self) -> None:
        """End the dial loop's backoff now (it dials at once, from the shortest delay)."""
        self.woken = True
        if self.backoff is not None and not self.backoff.done():
            self.backoff.set_result(None)

    @property
    def detoured(self) -> bool:
        return self.states.route is Route.DETOURED

    @property
    def depth(self) -> int:
        """How full its queue is, in messages: its length, or its bytes in ``slot``s if more.
        Counted by messages alone, 300 notifications of 2 MB to a neighbour were far under high
        water (20,000) and the publishers were never slowed: the publisher's broker reached
        1.9 GB (an outside review, 2.0 GB at a relaying broker)."""
        n = len(self.out)
        return max(n, self.out_bytes // self.slot) if self.slot else n

    def queue(self, data: bytes) -> None:
        self.out.append(data)
        self.out_bytes += len(data)

    def clear_out(self) -> None:
        self.out.clear()
        self.out_bytes = 0

    def ack(self, upto: int) -> None:
        """Drop messages the peer has acknowledged up to and including ``upto``."""
        n = upto - self.base + 1
        if n <= 0:
            return
        if upto >= self.sent:
            raise FrameError(f"ack {upto} for messages not sent yet (sent up to {self.sent - 1})")
        out = self.out
        if n < len(out):
            self.out_bytes -= sum(map(len, out[:n]))
        else:
            self.out_bytes = 0
        del out[:n]
        self.base += n

    def rewind(self, peer_last_rx: int) -> None:
        """After a hello: the peer has everything up to ``peer_last_rx``; resend the rest."""
        if not self.base - 1 <= peer_last_rx < self.base + len(self.out):
            raise FrameError(
                f"peer says it received up to {peer_last_rx}, but this side holds "
                f"{self.base}..{self.base + len(self.out) - 1} unacknowledged",
                "sequence",
            )
        self.sent = self.base + len(self.out)  # so that ack() accepts everything held
        self.ack(peer_last_rx)
        self.sent = peer_last_rx + 1

    def flush(self) -> int:
        """Write what is unsent (and the acknowledgement owed); return the depth after it."""
        conn = self.conn
        if conn is None:
            return self.depth
        parts: list[bytes] = []
        if self.rx_seq != self.acked_rx:
            parts.append(control_frame(F_ACK, self.rx_seq))
            self.acked_rx = self.rx_seq
        end = self.base + len(self.out)
        if self.sent < end and not conn.writing_paused:
            msgs = self.out[self.sent - self.base :]
            for chunk in batches(msgs):
                parts.append(data_frame(self.sent, chunk))
                self.sent += len(chunk)
            self.msgs_out += len(msgs)
            if self.m_msgs_out is not None:
                self.m_msgs_out.inc(len(msgs))
        if parts:
            data = b"".join(parts)
            self.bytes_out += len(data)
            if self.m_bytes_out is not None:
                self.m_bytes_out.inc(len(data))
            conn.write(data)
        return self.depth

    def status(self) -> dict[str, Any]:
        return {
            "peer": self.peer,
            "kind": self.kind,
            "opened": self.opened,
            "promoted": self.promoted,
            "detoured": self.detoured,
            "closing": self.closing,
            "state": self.state,
            "dialer": self.dialer,
            "address": self.address,
            "session": self.session,
            "established": self.established,
            "rtt_ms": self.rtt_ms,
            "pressure_in": self.remote_pressure,
            "pressure_out": self.sent_pressure,
            "queue_depth": self.depth,
            "queue_bytes": self.out_bytes,
            "unsent": self.base + len(self.out) - self.sent,
            "tx_seq": self.base + len(self.out) - 1,
            "rx_seq": self.rx_seq,
            "connects": self.connects,
            "msgs_in": self.msgs_in,
            "msgs_out": self.msgs_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
        }


class Client:
    """An attached client: its id, connection, publish sequence and outbound queue."""

    def __init__(
        self,
        client_id: str,
        conn: FrameProtocol,
        principal: Principal | None = None,
        slot: int = 0,
    ) -> None:
        self.id = client_id
        # Bytes its queue may hold per message of the high-water marks (0: not counted): its
        # depth is the larger of its length and its bytes over this (see BrokerConfig).
        self.slot = slot
        self.conn = conn
        # Who it proved to be and what that principal may do (security.py); the permissions
        # are looked up again when the policy is reloaded.
        self.principal = principal or Principal("anonymous", ANYTHING, "insecure")
        # Its way out (outbox.py, compiled): the encoded messages waiting for the next flush
        # (``pending``: the same list for the client's whole attachment, cleared in place;
        # ClientSessions.outlets holds the outlet for the fan-out) and whether it waits.
        self.outlet = Outlet(client_id, conn)
        self.pending = self.outlet.pending
        self.last_seq = 0
        self.publisher = False
        self.moved = False  # it said it moved to another broker: it may not publish here
        self.gap_told = False  # it told of a publisher gap (once per attachment)
        # Wall-clock stretches it was told may be missing (POST /gaps), sorted and disjoint:
        # each is told once to it (ClientSessions.tell_gap).
        self.gaps_told: list[tuple[float, float]] = []
        self.resumed = False  # it attached after a failover (C_RESUME)
        self.over = False
        self.over_since: float | None = None
        self.delivered = 0
        # Publish acknowledgements (see ClientSessions.acknowledge_publishers): marks of
        # (seq, [(link, session, last queued position)]) not yet covered, oldest first.
        self.ack_marks: deque[tuple[int, list[tuple[Link, str, int]]]] = deque()
        self.marked_seq = 0
        self.acked_seq = 0

    @property
    def depth(self) -> int:
        """How full its queue is, in messages: its length, or its bytes in ``slot``s if more
        (a few large notifications fill memory as many small ones do)."""
        n = len(self.pending)
        return max(n, self.outlet.pending_bytes // self.slot) if self.slot else n
