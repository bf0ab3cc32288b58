"""The sans-I/O broker: one entry point that turns an input into effects.

``BrokerCore.handle(input, now)`` is the only thing that changes state. It validates the input
first (raising :class:`ProtocolError` without touching state), then applies it and returns the
effects the caller must carry out, in a deterministic order (the simulator relies on that).

The broker itself owns little: the routing tables live in :mod:`~canopy_broker.core.routing`
(subscription forwarding), and the two reconfiguration protocols in
:mod:`~canopy_broker.core.exchange` (coordinated, paper 000) and :mod:`~canopy_broker.core.path`
(paper 002), which are peers: each depends on the routing state and on the small host interface
it declares, never on the other or on this module. Crash repair (paper 001) lives in
:mod:`~canopy_broker.core.repair`; small cycles through standby links and the choice of the
exchange that repairs a failed link (paper 004) in :mod:`~canopy_broker.core.cycles`.
What stays here is dispatch, notification routing, and client migration (make-before-break),
which needs both the tables and the links.

**Failure.** An unexpected exception inside the core means its state may be half-applied. The
broker then refuses every further input with :class:`CoreFailedError` instead of carrying on with
tables nobody can vouch for; the runtime reports the broker as failed.
"""

from __future__ import annotations

from collections import deque

from canopy_broker.core import exchange as coordinated
from canopy_broker.core import handover
from canopy_broker.core import path as path_algorithm
from canopy_broker.core.cycles import CycleTable, plan_link_repair
from canopy_broker.core.errors import CoreFailedError, ProtocolError
from canopy_broker.core.events import Event
from canopy_broker.core.exchange import Exchange, Mark, Step
from canopy_broker.core.handover import Handover
from canopy_broker.core.messages import (
    AddLink,
    Algorithm,
    ClientAttach,
    ClientDetach,
    ClientMigrating,
    ClientMove,
    ClientPublish,
    ClientPublisherGap,
    ClientResume,
    ClientSubscribe,
    ClientUnsubscribe,
    CloseLink,
    CtrlMsg,
    CycleFound,
    CycleProbe,
    Deliver,
    DeliverMarker,
    DetourLink,
    Done,
    Echo,
    Effect,
    End,
    FindCycles,
    FlushMsg,
    FromLink,
    FromPeer,
    Gap,
    Go,
    Granted,
    HandoverBegin,
    HandoverEnd,
    Input,
    KeepRemoved,
    LinkFailed,
    LinkReady,
    LinkRepair,
    Lock,
    LockRefused,
    Marker,
    Moved,
    Neighbours,
    OpenLink,
    PeerFailed,
    PeerFeatures,
    PeerGone,
    PeerMessage,
    Placed,
    Publish,
    PublisherGap,
    RecMsg,
    Relay,
    RemoveLink,
    Repaired,
    RepairLink,
    RepairSweep,
    ReplayEnd,
    Resumed,
    RouteKey,
    RoutesIn,
    RoutingMode,
    SendToLink,
    SendToPeer,
    Separator,
    SeparatorSeen,
    Settle,
    StandbyLinks,
    StartExchange,
    StartTimer,
    Subscribe,
    Tag,
    TellGap,
    TimerFired,
    Unsubscribe,
)
from canopy_broker.core.path import Role
from canopy_broker.core.repair import (
    NeighbourLists,
    RepairRun,
    Retention,
    bridge_ends,
    chain_links,
    merged,
    standby_peers,
)
from canopy_broker.core.repair import Phase as RepairPhase
from canopy_broker.core.repair import Step as RepairStep
from canopy_broker.core.routing import (
    RoutingState,
    RoutingTable,
    client_key,
    dominates,
    maximal,
)

__all__ = [
    "BrokerCore",
    "CoreFailedError",
    "ProtocolError",
    "RoutingTable",
    "client_key",
    "dominates",
    "maximal",
]

# Link messages of the coordinated exchange, by the transition-table step they are.
_EXCHANGE_STEPS: dict[type, Step] = {
    LockRefused: Step.REFUSED,
    Granted: Step.GRANTED,
    Go: Step.GO,
    Echo: Step.ECHO,
    End: Step.END,
    Done: Step.DONE,
    SeparatorSeen: Step.SEPARATOR_SEEN,
}


_LEAVES_NEIGHBOURS = frozenset({ClientPublish, ClientSubscribe, ClientUnsubscribe, ClientAttach})
_LEAVES_NEIGHBOURS_FROM_LINK = frozenset({Publish, Subscribe, Unsubscribe})


def _leaves_neighbours(inp: Input) -> bool:
    """An input that cannot change the neighbour list, placements or frozen links: a
    publication or a route update (over a link or from a client). The neighbour list is then
    not recomputed: at 100k subscriptions, recomputing it per route update cost more than the
    update itself. Checked without allocating."""
    t = type(inp)
    if t is FromLink:
        return type(inp.message) in _LEAVES_NEIGHBOURS_FROM_LINK  # type: ignore[union-attr]
    return t in _LEAVES_NEIGHBOURS


class BrokerCore:
    """State of one broker; see the module docstring for who owns what."""

    def __init__(
        self,
        name: str,
        mode: RoutingMode = RoutingMode.COVERING,
        *,
        routing: RoutingState | None = None,
        announce_neighbours: bool = False,
        retention_window: float = 0.0,
        retention_limit: int = 100_000,
        retention_bytes: int = 0,
        repair_timeout: float = 10.0,
        started: float = 0.0,
        custody_horizon: float | None = None,
    ) -> None:
        self.name = name
        self.routing = routing if routing is not None else RoutingState(mode)
        self.mode = self.routing.mode
        self.now = 0.0
        self.failed: str | None = None
        # Crash repair: neighbours' neighbour lists. Announcing our own is off by default so
        # the papers' overhead figures count only their protocols' messages; the runtime and
        # the fault simulator turn it on.
        self.neighbour_lists = NeighbourLists(name)
        self.announce_neighbours = announce_neighbours
        # Custody for crash repair: what was forwarded on each link lately (0: off), the
        # repairs under way or recently finished, the new links whose traffic waits for one,
        # and each publisher's last sequence number seen here (to drop replayed duplicates,
        # kept even with repair off: a client that fails over replays too).
        self.retention = Retention(
            retention_window,
            retention_limit,
            origin=started,
            horizon=custody_horizon,
            limit_bytes=retention_bytes,
        )
        self.repair_timeout = repair_timeout
        self.repairs: dict[str, RepairRun] = {}
        # A chain partner that died with the broker a repair is around, bridged over by that
        # repair (see _bridge): its sweeps and ReplayEnds, named for it, belong to that run.
        self._bridged: dict[str, RepairRun] = {}
        # Bridge partners not heard from yet, with the run that waits for them (see _bridge).
        self._unanswered: dict[str, RepairRun] = {}
        # Each chain end a repair under way waits for, with the runs that wait for it (two
        # repairs may share an end: each holds it until its own sweep came).
        self._holding: dict[str, list[RepairRun]] = {}
        # Dead neighbours whose routes stay until their repair has the new routes: withdrawing
        # them at once would cut this broker's side off from the far side meanwhile.
        self._ghosts: set[str] = set()
        # Links whose publications count as replays: an exchange's bridge (exchange._end_bridge).
        self.deduped: set[str] = set()
        # Since when each neighbour has been one (the clock handle() is given), in name order:
        # a client that lost a broker before this one was linked to it is not covered by what
        # this one forwarded to it (see _resume_gaps).
        self._linked_at: dict[str, float] = {}
        self._last_seen: dict[str, int] = {}
        self.replay_duplicates = 0
        # Clients that failed over to this broker lately (until when): a replayed notification
        # this broker already had is still delivered to them, since they may not have had it
        # (the client library drops what it did have, by publisher sequence).
        self.resuming: dict[str, float] = {}
        # Small cycles through standby links (paper 004), for repairing a failed link.
        self.cycles = CycleTable(name)
        # Coordinated exchange: this broker takes part in at most one at a time (the lock).
        self.ex: Exchange | None = None
        self.attempts: dict[str, tuple[StartExchange, int]] = {}  # initiator's requests
        # Exchanges this broker left on lease expiry: their late messages are expected.
        self.left: deque[str] = deque(maxlen=64)
        self.unconfirmed: dict[str, tuple[str, int]] = {}  # exchange.other_a_end_rolled_back
        # (partner, dead) -> when: ReplayEnds that came before this repair began here
        self._early_replay_ends: dict[tuple[str, str], float] = {}
        # Peers whose software would refuse a Settle (from before it: a roll-out).
        self.unsettled: set[str] = set()
        # Peers whose software sends no ReplayEnd after a repair's replay: not waited for.
        self.no_replay_end: set[str] = set()
        # Peers whose software knows nothing of handing over (core.handover): not sent its
        # messages, not waited for.
        self.no_handover: set[str] = set()
        # Peers whose software would refuse a KeepRemoved: the removed link closes as before.
        self.no_keep_removed: set[str] = set()
        # Exchanges whose removed link this broker kept (exchange.keep_removed), its other end.
        self.kept: dict[str, str] = {}
        # Verdicts on a dead neighbour that wait (exchange.a2_dead_unlisted): the exchange and
        # the path neighbour whose walk they wait for.
        self._waiting_verdicts: dict[str, tuple[str, str]] = {}
        # This broker's parts in handing over what went the way of a cycle member dead in
        # phase 1 of an exchange, by the dead one's name (core.handover). Each holds for a
        # few link round trips, and never past its timer (the repair timeout).
        self.handovers: dict[str, Handover] = {}
        # Path algorithm: this broker's role per reconfiguration, and the (un)subscriptions
        # from a neighbour to ignore while its RECMSG travels.
        self.path_roles: dict[str, tuple[Role, str]] = {}
        self.ignore: dict[str, dict[str, set[RouteKey]]] = {}
        # Migrating publishers: their publications here wait until the old broker says Moved.
        self._held: dict[str, tuple[str, list[Event]]] = {}
        self._early_moved: set[tuple[str, str]] = set()  # (client, old broker): Moved came first
        self.ordering_delays: list[float] = []  # how long each queued notification waited
        # Per exchange, for the simulator's figures (bounded: the last 64 exchanges).
        self.ordering_delays_by_exchange: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ queries

    @property
    def neighbours(self) -> list[str]:
        return self.routing.neighbours

    def is_neighbour(self, peer: str) -> bool:
        return self.routing.has_link(peer) and peer not in self._ghosts

    @property
    def exchange(self) -> Exchange | None:
        """The exchange this broker is locked for, if any."""
        return self.ex

    @property
    def pending_exchanges(self) -> list[str]:
        """Exchanges this broker initiated that are not finished (locking or running)."""
        return sorted(self.attempts)

    @property
    def clients(self) -> list[str]:
        return self.routing.clients

    def standby_peers(self) -> tuple[str, ...]:
        """The brokers a repair would link this one to if one of its neighbours died (see
        :func:`~canopy_broker.core.repair.standby_peers`); the runtime keeps links to them warm.
        A dead neighbour's list is gone once its repair started, so are its chain's peers."""
        live = [n for n in self.routing.neighbours if n not in self._ghosts]
        return standby_peers(self.name, live, self.neighbour_lists.lists)

    def routing_table(self) -> RoutingTable:
        return self.routing.snapshot()

    def routing_table_size(self) -> int:
        return self.routing.size()

    # ------------------------------------------------------------------ the boundary

    def handle(self, inp: Input, now: float = 0.0) -> list[Effect]:
        """Apply one input; return effects in a deterministic order.

        ``now`` is the caller's clock; the data plane needs none, but the signature is shared with
        the time-dependent parts (reconfiguration leases) so every driver calls it the same way.
        """
        if self.failed is not None:
            raise CoreFailedError(f"{self.name} failed earlier ({self.failed}); it takes no input")
        out: list[Effect] = []
        self.now = now
        try:
            self._dispatch(inp, out)
            if not _leaves_neighbours(inp):
                neighbours = self.routing.neighbours
                if neighbours != list(self._linked_at):
                    self._linked_at = {n: self._linked_at.get(n, now) for n in neighbours}
                if self.announce_neighbours:
                    live = self._listed(neighbours)
                    self.neighbour_lists.announce(live, out, self._withholds_list, neighbours)
        except ProtocolError:
            raise
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc} (handling {type(inp).__name__})"
            raise CoreFailedError(f"{self.name}: {self.failed}; refusing further input") from exc
        return out

    def _dispatch(self, inp: Input, out: list[Effect]) -> None:
        routing = self.routing
        if isinstance(inp, FromLink):
            self.from_link(inp, out)
        elif isinstance(inp, ClientPublish):
            routing.check_client(inp.client)
            if inp.event.publisher != inp.client:
                raise ProtocolError(
                    f"client {inp.client!r} published as {inp.event.publisher!r}; "
                    "a client publishes under its own id"
                )
            held = self._held.get(inp.client)
            if held is not None:
                held[1].append(inp.event)
            else:
                self._route(inp.event, None, out, replay=inp.replay)
        elif isinstance(inp, ClientResume):
            self._resume(inp, out)
        elif isinstance(inp, ClientSubscribe):
            routing.subscribe(inp.client, inp.sub_id, inp.filter, out)
        elif isinstance(inp, ClientUnsubscribe):
            routing.unsubscribe(inp.client, inp.sub_id, out)
        elif isinstance(inp, ClientAttach):
            routing.attach(inp.client)
        elif isinstance(inp, ClientDetach):
            routing.detach(inp.client, out)
            self.resuming.pop(inp.client, None)
            if inp.client in self._held:  # left before the move finished: release its events
                self._release_held(inp.client, out)
        elif isinstance(inp, ClientMigrating):
            self._migrating(inp, out)
        elif isinstance(inp, ClientPublisherGap):
            routing.check_client(inp.client)
            gap = PublisherGap(inp.client, inp.since, inp.until)
            self._spread_gap(gap, None, out)
        elif isinstance(inp, ClientMove):
            routing.check_client(inp.client)
            if not self.is_neighbour(inp.target):
                raise ProtocolError(
                    f"{self.name}: {inp.client!r} moves to {inp.target!r}, which is not a neighbour"
                )
            out.append(SendToLink(inp.target, Moved(inp.client)))
        elif isinstance(inp, AddLink):
            if inp.peer == self.name:
                raise ProtocolError(f"{self.name}: a broker cannot link to itself")
            routing.add_link(inp.peer, out)
        elif isinstance(inp, RemoveLink):
            self._remove_link(inp.peer, out)
            self.neighbour_lists.forget(inp.peer)
            self._chain_end_gone(inp.peer, out)
            self._partner_gone(out)
        elif isinstance(inp, PeerFailed):
            self._peer_failed(inp.peer, out)
            self._partner_gone(out)
        elif isinstance(inp, PeerGone):
            self._peer_gone(inp.peer, out)
        elif isinstance(inp, LinkFailed):
            self._link_failed(inp.peer, out)
        elif isinstance(inp, StandbyLinks):
            self.cycles.set_standby(inp.peers)
        elif isinstance(inp, Placed):
            self.neighbour_lists.own = (inp.zone, inp.node)
        elif isinstance(inp, PeerFeatures):
            if inp.placement:
                self.neighbour_lists.legacy.discard(inp.peer)
            else:
                self.neighbour_lists.legacy.add(inp.peer)
            for told, lacking in self._lacking(inp):
                (lacking.discard if told else lacking.add)(inp.peer)
        elif isinstance(inp, FindCycles):
            for peer, probe in self.cycles.start(inp.round, inp.bound, self._tree_links()):
                self.to_peer(peer, probe, out)
        elif isinstance(inp, FromPeer):
            self.to_peer(inp.peer, inp.message, out, incoming=True)
        elif isinstance(inp, StartExchange):
            if inp.algorithm is Algorithm.PATH:
                path_algorithm.start(self, inp, out)
            else:
                coordinated.start(self, inp, out)
        elif isinstance(inp, TimerFired):
            kind, _, name = inp.key.partition(":")
            if kind == "repair":
                self.repair_timer(name, out)
            elif kind == "bridge":
                self._bridge_timer(name, out)
            elif kind == "verdict":
                self._verdict_due(name, out)
            elif kind == "handover":
                handover.timer(self, name, out)
            else:
                coordinated.timer(self, inp.key, out)
        else:  # pragma: no cover - the type checker proves this unreachable
            raise ProtocolError(f"unknown input {inp!r}")

    def from_link(self, inp: FromLink, out: list[Effect]) -> None:
        """A message over an overlay link (also replayed from an exchange's queue)."""
        if not self.routing.has_link(inp.peer):
            raise ProtocolError(f"{self.name}: message from {inp.peer!r}, which is not a neighbour")
        msg = inp.message
        if self._unanswered:
            self._unanswered.pop(inp.peer, None)  # it opened its end: it bridges too
        ex = self.ex
        if ex is not None and ex.bridge is not None and inp.peer in ex.bridge_peers:
            ex.bridged.append(inp)  # until the removed link has done (see defer_settle)
            return
        if (
            ex is not None
            and inp.peer == ex.a_peer
            and not ex.queue_released
            and not isinstance(msg, Neighbours | LockRefused)
        ):
            # Everything crossing the new link waits until the old path has drained; not the
            # other A end's neighbour list, which a repair around it needs before that (A2,
            # bridging when A1 died, heard none and linked to nobody; see defer_settle).
            ex.queue.append((self.now, inp))
            ex.queued_total += 1
            return
        if isinstance(msg, Publish):
            if self.handovers and handover.holds_in(self, inp):
                return
            replay = msg.replay or inp.peer in self.deduped
            self._route(msg.event, inp.peer, out, msg.tag, replay=replay)
        elif isinstance(msg, Subscribe | Unsubscribe):
            self._route_update(inp.peer, msg, out)
        else:
            self._control(inp.peer, msg, out)

    def _route_update(self, peer: str, msg: Subscribe | Unsubscribe, out: list[Effect]) -> None:
        ex = self.ex
        if ex is not None and peer == ex.r_peer and ex.granted:
            # The removed link is frozen: its routing changes go to this side's A end, and
            # apply here only until phase 2 has dropped the link's entries.
            if ex.retired != peer:
                self.routing.apply(peer, msg, out)
            self.to_peer(ex.a_end_of_my_side, Relay(ex.xid, msg), out)
        elif not self._ignored(peer, msg):
            self.routing.apply(peer, msg, out)

    def _ignored(self, peer: str, msg: Subscribe | Unsubscribe) -> bool:
        """Path algorithm: a route our RECMSG just gave this neighbour must not be undone by a
        withdrawal it sent before it saw the RECMSG (nor added twice)."""
        pending = self.ignore.get(peer)
        if not pending or not any(msg.key in keys for keys in pending.values()):
            return False
        return isinstance(msg, Unsubscribe) or msg.key in self.routing.held_from(peer)

    # ------------------------------------------------------------------ events

    def _route(
        self,
        event: Event,
        source: str | None,
        out: list[Effect],
        tag: Tag | None = None,
        *,
        replay: bool = False,
    ) -> None:
        deliver: bool | None = True  # None: only to clients that are resuming here
        # Each publisher's last sequence number seen here: a replay (a repair's, or a client's
        # after a failover) of what this broker already had is passed on, not delivered again.
        last = self._last_seen.get(event.publisher, 0)
        if event.seq > last:
            self._last_seen[event.publisher] = event.seq
        elif replay:  # had it already: pass it on (others may not), deliver it not again
            deliver = None if self.resuming else False
            self.replay_duplicates += 1
        if self._holding:
            # A repair is waiting for its routes: whatever the new links will need of this
            # is sent with the replay, once the routes are known (they are partial now); not
            # what came from one of that repair's own chain ends. Nor, at A2 bridging for the
            # repair around A1 (exchange.defer_settle), what is black here: it takes the
            # removed link, still open, to A1's side, which the replay would reach as well,
            # and a copy overtaking the other one was delivered twice there, out of order
            # (`canopy bench faults --only exchange`: 1 kill in 75, 3 duplicates).
            own = self._holding.get(source, ()) if source is not None else ()
            ex = self.ex
            old_way = (
                ex.bridge
                if ex is not None
                and ex.bridge is not None
                and not coordinated.is_gray(ex, source, tag)
                else None
            )
            for run in self._holding_runs():
                if run not in own and run.dead != old_way:
                    run.retained.append(event.forwarded())
        peers, targets = self.routing.route(event.attrs, source)
        if peers:
            ex = self.ex
            copy = Publish(event.forwarded(), replay=replay)
            keep = self.retention.keep if self.retention.enabled else None
            holding = self._holding
            ghosts = self._ghosts
            handovers = self.handovers
            if holding or ghosts or handovers:
                if handovers:  # collected for a handover, or held from the added link
                    peers = handover.handing(self, copy.event, peers, source)
                # A repair's new link, or a dead one: sent with the replay (during an exchange
                # too: the repair is not the exchange's business).
                peers = tuple(p for p in peers if p not in holding and p not in ghosts)
            if ex is None:
                for peer in peers:
                    out.append(SendToLink(peer, copy))
                    if keep is not None:
                        keep(peer, self.now, copy.event)
            else:
                sent = len(out)
                coordinated.route_on_cycle(ex, copy, peers, out, source=source, tag=tag)
                if keep is not None:  # custody holds during an exchange as well
                    for eff in out[sent:]:
                        assert isinstance(eff, SendToLink)
                        keep(eff.peer, self.now, copy.event)
        if not targets:
            return
        if deliver:
            out.append(Deliver(event, targets))
        elif deliver is None:
            now = self.now
            resuming = self.resuming
            again = tuple(t for t in targets if resuming.get(t[0], -1.0) >= now)
            if again:
                out.append(Deliver(event, again))

    # ------------------------------------------------------------------ failover

    def holds_for(self, client: str) -> bool:
        """Whether events ``client`` published here wait in a migration's hold (released when it
        moves on, or when it detaches)."""
        return client in self._held

    def custody_settled(self, client: str) -> bool:
        """Everything ``client`` published here has left the core: none of it waits in an
        exchange's queues, a repair's hold or a migration's hold. Only then may the runtime
        take the links' positions as covering it (a publish acknowledgement)."""
        return self.ex is None and not self._holding and client not in self._held

    def _resume(self, inp: ClientResume, out: list[Effect]) -> None:
        """A client of a broker that died (or dropped it) is back, here: serve what this broker
        still holds that it missed, and name every interval it cannot vouch for.

        Served: what this broker forwarded (its retention) that matches the client's
        subscriptions and is newer than what it got from that publisher, however long before
        the loss it was forwarded: the lost broker may have held it in a backlog for the client
        for a while. From a publisher the client never heard of, only what was forwarded since
        the loss (less a margin): older ones predate its interest. If this broker is a
        neighbour of the lost one, that is everything from this side of it; what came from the
        other sides is replayed by the repair and reaches the client here as well (it is in
        :attr:`resuming` for a window)."""
        routing = self.routing
        routing.check_client(inp.client)
        subs = routing.subscriptions(inp.client) or {}
        last = dict(inp.last)
        now = self.now
        served = 0
        if subs:
            strangers_from = inp.since - inp.margin
            for when, event in self.retention.since(now - self.retention.window, now):
                had = last.get(event.publisher)
                if event.seq <= (had or 0) or (had is None and when < strangers_from):
                    continue
                matched = tuple(sorted(s for s, f in subs.items() if f.matches(event.attrs)))
                if matched:
                    out.append(Deliver(event, ((inp.client, matched),)))
                    served += 1
        window = self.retention.window
        self.resuming = {c: t for c, t in self.resuming.items() if t >= now}
        self.resuming[inp.client] = now + max(window, self.repair_timeout)
        out.append(Resumed(inp.client, served, tuple(self._resume_gaps(inp))))

    def _resume_gaps(self, inp: ClientResume) -> list[Gap]:
        now, prev = self.now, inp.previous
        since = inp.since if inp.unsure_since is None else min(inp.since, inp.unsure_since)
        gaps: list[Gap] = []
        if not self.retention.enabled:
            gaps.append(Gap(since, now, f"{self.name} keeps no retention (repair is off)"))
            return gaps
        if not self.retention.covers(since, now):
            start = max(now - self.retention.window, self.retention.origin)
            gaps.append(Gap(since, start, f"{self.name}'s retention does not reach back that far"))
        if prev == self.name:  # back at the same broker (a blip, a slow consumer cut off)
            gaps.append(
                Gap(
                    since,
                    now,
                    f"{self.name} keeps what it forwarded to other brokers, not what it "
                    "delivered to its own clients: notifications from publishers attached "
                    f"to {self.name} may be missing",
                )
            )
            return gaps
        run = self.repairs.get(prev)
        if run is not None and run.finished_at is not None and run.finished_at < since:
            # Over before the client lost ``prev``: a repair around an earlier incarnation
            # of that name (it restarted and was linked elsewhere since), nothing to do with
            # this loss. It hid the check below: a client lost a broker this one was no
            # neighbour of, and was told nothing (chaos soak: 92 events lost untold).
            run = None
        if run is None:
            linked_at = self._linked_at.get(prev)
            if linked_at is None:
                gaps.append(
                    Gap(
                        since,
                        now,
                        f"{self.name} is not a neighbour of {prev}: notifications that were on "
                        f"their way to {prev} from other sides may be missing",
                    )
                )
            elif linked_at > inp.since:
                # Linked since the loss: to a new process of that name (restored and linked
                # here meanwhile), or by a reshape. What went to the one the client lost
                # did not pass here (chaos: a subscriber of a broker killed with its
                # neighbour failed over to the neighbour's restored process, already linked
                # to the victim's restored one; 281 events lost untold).
                gaps.append(
                    Gap(
                        since,
                        now,
                        f"{self.name} was linked to {prev} only after the client lost it: "
                        f"notifications that were on their way to {prev} from other sides "
                        "may be missing",
                    )
                )
        else:
            # Under way: this end has sent its routes and its sweep already, and the client's
            # subscriptions follow them, so they may reach the chain's far ends after those
            # replayed. Over: it replayed before the client was back, and since then the dead
            # broker's routes are gone: what came here for its clients alone was not kept
            # (retention keeps what went to links). So up to now, not to the repair's end:
            # a client told late that its broker left the overlay (a leaf cut off 4 s) missed
            # 1,650-1,710 events per publisher after the repair's end, untold (review).
            what = (
                "was under way here when the client came back"
                if run.finished_at is None
                else "replayed its notifications before the client was back"
            )
            gaps.append(
                Gap(
                    since,
                    now,
                    f"the repair around {prev} {what}; what came from beyond {self.name}'s side "
                    "may be missing",
                )
            )
        return gaps

    # ------------------------------------------------------------------ links

    def _remove_link(self, peer: str, out: list[Effect]) -> None:
        if not self.routing.has_link(peer):
            raise ProtocolError(f"{self.name}: no link to {peer!r}")
        ex = self.ex
        if (
            ex is not None
            and peer in ex.cycle_peers()
            and peer not in ex.waits_on
            and not ex.has(Mark.DRAINING)  # settled: only the removed link is left to close
        ):
            raise ProtocolError(
                f"{self.name}: link to {peer!r} is on the cycle of exchange {ex.xid}"
            )
        self.routing.remove_link(peer, out)
        self.deduped.discard(peer)
        # A migrating publisher's old broker is gone: nothing can overtake its held events now.
        for client in [c for c, (source, _) in self._held.items() if source == peer]:
            self._release_held(client, out)

    def adopt_added_link(self, ex: Exchange, out: list[Effect]) -> None:
        """A1 rolls back (see exchange.other_a_end_rolled_back), and the added link stays as
        the link of its repair around R1 (``ex.sweep_held``), as the other end has taken it:
        this end's routes go over it as over any repair link, then the sweep it held, then
        what the other end sent meanwhile and the exchange queued. What this broker routed
        to R1 the repair replays: nothing is handed over."""
        a, dead = ex.a_peer, ex.sweep_held
        assert a is not None and dead is not None
        queued, ex.queue = ex.queue, []
        self.leave_exchange(ex, by_lease=True)
        for key in sorted(self.routing.unfreeze(a), key=RouteKey.sort_key):
            out.append(SendToLink(a, Subscribe(key)))
        self.handovers.pop(dead, None)
        run = self.repairs.get(dead)
        if run is not None:
            out.extend(run.sweeps_due())
        for _at, inp in queued:
            if self.routing.has_link(inp.peer):
                self.from_link(inp, out)

    def declared_dead(self, peer: str) -> bool:
        """Whether ``peer`` was declared dead here and is being repaired around."""
        return peer in self._ghosts

    def repair_uses(self, peer: str) -> bool:
        """Whether a repair under way here has ``peer`` as a chain partner."""
        return any(peer in run.partners for run in self.repairs.values())

    @property
    def repair_holding(self) -> str | None:
        """The broker a repair under way here is around, while it holds what this broker
        routes towards its chain (waiting for the sweeps); None when none is."""
        for runs in self._holding.values():
            return runs[0].dead
        for h in self.handovers.values():  # reshaped under it, its replay could go astray
            return h.dead
        return None

    def _holding_runs(self) -> list[RepairRun]:
        """The repairs under way that hold a chain end, each once."""
        return list(dict.fromkeys(run for runs in self._holding.values() for run in runs))

    def _chain_end_gone(self, peer: str, out: list[Effect]) -> list[Event]:
        """``peer``, this broker's neighbour in the chain of a repair under way, will send no
        sweep: it died, or its link was removed (the runtime withdraws a repair link whose far
        end will never open it, a partition: LinkSessions._alive_there). As when it dies, this
        broker is that end of the chain now, and the repair completes on the others instead of
        waiting for its timer.

        Returns what that repair kept for its replay so far. Its replay goes over the chain
        links that are left, and what was bound for the far side of ``peer``'s end can no
        longer get there that way: the repair around ``peer``, if it died, takes it over
        (chaos soak: b6 and b3 paused together, b0 repaired around b6 by linking to b3, then
        declared b3 dead too; the repair around b6 replayed 0 of 559 notifications, and
        subscribers of brokers nothing had happened to lost 692 events untold)."""
        kept: list[Event] = []
        for run in self._holding.pop(peer, ()):
            kept = merged(kept, run.retained)
            out.extend(run.end_died(peer))
            if run.complete:
                self._finish_repair(run, out)
        return kept

    def _peer_gone(self, peer: str, out: list[Effect]) -> None:
        """Nothing more will come from ``peer``: if it is on the exchange's path, this broker's
        part settles now, as at its lease's end, or once the repair around it is through
        (exchange.defer_settle)."""
        ex = self.ex
        if (
            ex is not None
            and peer in ex.path
            and peer != self.name
            and not coordinated.defer_settle(ex, peer)
        ):
            coordinated.settle(self, ex, peer, peer, out)

    def _peer_failed(self, peer: str, out: list[Effect], *, via: str | None = None) -> None:
        """Paper 001's repair: drop the dead link (its routes are withdrawn), then link to this
        broker's neighbours in the chain through the dead broker's former neighbours; each new
        link advertises what this end holds, as an added link does."""
        if not self.routing.has_link(peer) or peer in self._ghosts:
            raise ProtocolError(f"{self.name}: no link to {peer!r}")
        if self.ex is None and self._bridge(peer, out):
            return
        ex = self.ex
        if ex is not None and not ex.promised:
            # Locked, nothing changed yet: let the try go. Its path has lost a broker (final:
            # A1 reports it failed), or the repair about to hold here must not have the tree
            # reshaped under it (as lock_problem refuses a new lock meanwhile; A1 tries again).
            coordinated.abandon_lock(self, ex, peer, out, final=peer in ex.cycle_peers())
            if not self.routing.has_link(peer):
                # It was the other end of the link this exchange added (A1 whose A2 died):
                # letting the try go took the link away, and it never carried the tree.
                # Going on froze and ghosted a link that was gone, and the repair's end
                # failed on removing it, the abandoned try's report with it (review: newly
                # reachable once an unconnected added link is suspected).
                return
        elif ex is not None and coordinated.a1_dead_before_go(ex, peer):
            return  # until Go comes (then again, below), or the added link goes
        elif ex is not None and coordinated.a2_dead_unlisted(self, ex, peer):
            self._waiting_verdicts[peer] = (ex.xid, ex.path[1])
            out.append(StartTimer(f"verdict:{peer}", self.repair_timeout))
            return  # until the walk from the path comes (_verdict_due), or the timer
        elif ex is not None and peer in ex.cycle_peers() and peer not in ex.waits_on:
            # Phase 1 has begun, or is about to (Granted passed here): the verdict is as strong
            # as a fence, so this part settles first, as PeerGone would (now, or once this
            # repair is through), and the repair follows. The drivers used to do this in three
            # steps (this input refused, PeerGone, this input again), each in its own copy: the
            # runtime's failure detector and the simulator.
            coordinated.go_implied(self, ex, peer, peer, out)
            handover.begin(self, ex, peer, out)  # before settling: it may take the link away
            self._peer_gone(peer, out)
            if not self.routing.has_link(peer):
                # Settling took the link away (the added one rolled back, or r closed): no
                # repair runs here, and a hand-over need not wait for one.
                handover.no_repair(self, peer, out)
                return
            ex = self.ex
        # The dead link stays in the tables, frozen (nothing is sent to it), until the new
        # routes are in: its routes keep this side's traffic coming here, and the repair
        # collects it for the replay.
        self.routing.freeze(peer)
        self._ghosts.add(peer)
        # It was in the chain of a repair still under way: what that one kept is replayed by
        # this one too (its own chain reaches the far side of the dead end).
        carried = self._chain_end_gone(peer, out)
        # Not a neighbour of the dead R end in the tree the exchange leaves: it dropped this
        # broker from its list as it began to roll forward, but that list did not cross the
        # frozen removed link, and from the one before, this broker linked to the dead one's
        # other neighbour, which never linked back (its repair then waited for its timer).
        gone_from = ex is not None and peer == ex.r_peer and ex.rolls_forward
        chain, targets = self.neighbour_lists.chain_for(peer, without=gone_from)
        if ex is not None and ex.r_peer in targets and coordinated.keeps_removed(self, ex):
            coordinated.keep_removed(self, ex, out)  # first: the sweep follows it
        opened: list[str] = []
        for t in targets:
            if t != self.name and not self.routing.has_link(t):
                out.append(OpenLink(t))  # first: what follows is queued on the new link
                self.routing.add_link(t, out)
                opened.append(t)
        out.append(Repaired(peer, chain, tuple(opened)))
        if ex is not None and ex.bridge == peer:
            ex.bridge_peers.update(opened)
        me = chain.index(self.name) if self.name in chain else -1

        def chain_end(i: int) -> str | None:
            """The chain's broker at ``i``, unless there is none or it died too: its own
            repair is under way here, and this broker is that end of the chain (a sweep sent
            to it would go nowhere, and this repair would wait for one from it until its
            timer)."""
            n = chain[i] if me >= 0 and 0 <= i < len(chain) else None
            return None if n in self._ghosts else n

        run = RepairRun(
            peer,
            previous=chain_end(me - 1),
            next=chain_end(me + 1),
            retained=merged(carried, self.retention.take(peer, self.now)),
            chain=chain,
            replay_also=(via,) if via is not None and self.routing.has_link(via) else (),
        )
        for partner in (run.previous, run.next):  # it came before this repair began here
            at = self._early_replay_ends.pop((partner, peer), None) if partner else None
            if partner and at is not None and at >= self.now - self.repair_timeout:
                run.replay_ends.add(partner)
        self._forget_repairs()
        self.repairs[peer] = run
        handing = self.handovers.get(peer)
        if handing is not None and handing.ghost:
            handing.repair = run  # it hands over only once this is through
        for end in run.partners:
            self._holding.setdefault(end, []).append(run)
        if (
            ex is not None
            and ex.me == 0
            and ex.granted
            and not ex.gray
            and ex.k > 0
            and run.previous is None
            and run.next == ex.a_peer
        ):
            # A1, before R1 took Go, repairs around R1 over the added link (R1's neighbours
            # were the two A ends): A2 may have rolled back and taken the link up as this
            # repair's, advertising over it. Swept now, before this end's routes (which the
            # frozen link does not carry), A2's replay went out without them, and was lost
            # (simulator: 45 events; and this end waited in the exchange for its lease).
            ex.sweep_held = peer
        else:
            out.extend(run.sweeps_due())  # behind this end's routes on the new link
        if run.complete:
            self._finish_repair(run, out)
        else:
            out.append(StartTimer(f"repair:{peer}", self.repair_timeout))

    def _bridge(self, peer: str, out: list[Effect]) -> bool:
        """``peer``, a chain partner of a repair under way here, is dead too, and its link never
        brought its list: it died with the broker that repair is around (two neighbours killed
        together, or a node taking both). Each dead broker's chain then runs through the other
        and falls apart there, and without more the overlay stays split until the operator's
        restore joins it (chaos runs: 1,318-1,789 events lost, told, at subscribers whose
        brokers never failed). Where the dead broker told this one ``peer``'s list (two hops,
        ``Neighbours.lists``), this broker links instead to its partners on the bridge over the
        two (:func:`~canopy_broker.core.repair.bridge_ends`), which the survivors on the other
        side compute alike, and the run goes on over the larger tree: sweeps, replay and all.
        False where it cannot (an exchange runs, or no such list): the repair around ``peer``
        follows as before.

        A far end that never bridges back (older software, an exchange there, lists that
        differ) would hold this run, and every chain partner's behind it, until the repair's
        timer: a bridge partner not heard from within half of it is dropped as a dead chain
        end would be (:meth:`_bridge_timer`), and the run completes on the rest, split there
        as it was before bridges (review)."""
        if peer in self.neighbour_lists.lists:
            return False  # it said its own list: the repair around it knows better
        for run in self._holding.get(peer, ()):
            theirs = self.neighbour_lists.list_via(run.dead, peer)
            if run.phase is not RepairPhase.WAITING or theirs is None or run.dead not in theirs:
                continue
            ends = bridge_ends(run.dead, run.chain, peer, theirs)
            partners = [
                t for t in chain_links(ends, self.name) if t not in (run.previous, run.next)
            ]
            # Another repair that holds the same dead partner cannot wait for it either (its
            # link goes now): it ends there, and what it kept is replayed by this one, which
            # reaches beyond, as it would be by the repair around a dead chain end.
            self._holding[peer] = [r for r in self._holding[peer] if r is not run]
            run.retained = merged(run.retained, self._chain_end_gone(peer, out))
            self._remove_link(peer, out)  # it never carried anything: nothing to wait for
            opened: list[str] = []
            for t in partners:
                if not self.routing.has_link(t):
                    out.append(OpenLink(t))  # first: its routes follow on it
                    self.routing.add_link(t, out)
                    opened.append(t)
                self._holding.setdefault(t, []).append(run)
                self._unanswered[t] = run
            out.append(Repaired(peer, ends, tuple(opened), together=run.dead))
            self._bridged[peer] = run
            out.extend(run.bridge(peer, partners))  # behind this end's routes on the new links
            if run.complete:
                self._finish_repair(run, out)
            else:  # the bridge needs its own time: the far side's probe came later too
                out.append(StartTimer(f"repair:{run.dead}", self.repair_timeout))
                out.append(StartTimer(f"bridge:{run.dead}", self.repair_timeout / 2))
            return True
        return False

    def _bridge_timer(self, dead: str, out: list[Effect]) -> None:
        """The bridge of the repair around ``dead`` had half a repair timeout: its partners
        that never answered (opened their end and said anything) are not bridging back. Each
        is dropped as a dead chain end, and its link closed; the run completes on the rest."""
        run = self.repairs.get(dead)
        if run is None or run.phase is not RepairPhase.WAITING:
            return
        for partner in [p for p, r in self._unanswered.items() if r is run]:
            del self._unanswered[partner]
            if partner not in run.bridges:
                continue
            self._holding[partner] = [r for r in self._holding.get(partner, ()) if r is not run]
            if not self._holding[partner]:
                del self._holding[partner]
            out.extend(run.end_died(partner))
            if self.routing.has_link(partner) and partner not in self._ghosts:
                self._remove_link(partner, out)
                out.append(CloseLink(partner))
        if run.complete:
            self._finish_repair(run, out)

    def _run_for(self, dead: str, peer: str) -> RepairRun | None:
        """The repair under way here that ``peer``'s message about ``dead`` belongs to: the one
        around ``dead``, or the one bridging over it, whichever has ``peer`` as a partner (a
        finished repair around an earlier broker of the same name may still be kept; review).
        Else the one around ``dead``, if any."""
        around, bridging = self.repairs.get(dead), self._bridged.get(dead)
        for run in (around, bridging):
            if run is not None and peer in run.partners:
                return run
        return around

    def _verdict_due(self, dead: str, out: list[Effect], via: str | None = None) -> None:
        """A verdict that waited (exchange.a2_dead_unlisted) goes ahead: the walk from the
        path has come (``via``, this broker's path neighbour), behind the kept link's routes,
        or the wait timed out. The repair around the dead one leaves this broker out of its
        chain, so what this broker sent it is replayed ``via`` the path, towards the kept
        link."""
        if self._waiting_verdicts.pop(dead, None) is None:
            return
        if self.routing.has_link(dead) and dead not in self._ghosts:
            self._peer_failed(dead, out, via=via)

    def _spread_gap(self, gap: PublisherGap, source: str | None, out: list[Effect]) -> None:
        """A publisher's gap goes to every broker once (flooded over the settled tree links,
        never back where it came from), and each tells its own subscribers."""
        out.extend(SendToLink(n, gap) for n in self._tree_links() if n != source)
        out.append(TellGap(gap.publisher, gap.since, gap.until))

    def _lacking(self, told: PeerFeatures) -> list[tuple[bool, set[str]]]:
        """Each feature a hello tells of, with the set of peers that lack it."""
        return [
            (told.settle, self.unsettled),
            (told.replay_end, self.no_replay_end),
            (told.handover, self.no_handover),
            (told.keep_removed, self.no_keep_removed),
        ]

    def knows_features(self, told: PeerFeatures) -> bool:
        """Whether the core already holds what ``told`` says of its peer (no news)."""
        peer = told.peer
        placement = peer not in self.neighbour_lists.legacy
        return placement == told.placement and all(
            (peer not in lacking) == has for has, lacking in self._lacking(told)
        )

    def _unlisted(self, peer: str) -> bool:
        """Whether ``peer`` stays out of the neighbour list this broker announces: a ghost, the
        other end of the link an exchange adds here until this end would roll the exchange
        forward (until then it may still roll back and take the link away), or the other end
        of the link it removes from then on (settled, it goes). Listed, the removed link led a
        repair around a dead R end to link its other neighbour with the other R end while the
        exchange rolled forward: the overlay was left with a cycle (simulator).

        A repair around a dead broker links up its neighbours along its last list, and every
        one of them must read the same list. The added link used to be listed from the lock
        on, but its other end heard no list over it before the exchange ended (see
        :meth:`_withholds_list`): when an A end died during an exchange, its other neighbours
        chained up with the other A end, which linked to nobody; the repair link came up at
        one end only and the overlay stayed split until the supervisor's restore joined it
        (on real processes: an initiator killed 18 ms into a six-broker exchange, a 12 s
        split, 3,610 events lost, told, at one subscriber). Both ends now list the link, and
        tell each other, once each would roll the exchange forward. What is left: an A end
        dying while Go is on its way between them (a few milliseconds; see
        docs/reconfiguration.md, "A death on the cycle").

        R2 stops listing R1 from Granted on, not from Go: R1 leaves itself out of the chain
        around a dead R2 once it rolls forward, which it can do from then on (docs, "Deaths
        between Granted and Go")."""
        if peer in self._ghosts:
            return True
        ex = self.ex
        if ex is None:
            return False
        if peer == ex.a_peer:
            return not ex.rolls_forward
        if peer != ex.r_peer or ex.has(Mark.KEPT):  # kept: a repair's link (keep_removed)
            return False
        if ex.me == ex.k + 1:
            # R2, from Granted on: R1 leaves itself out of the chain around a dead R2 once it
            # rolls forward, which it does only after Granted passed R2. Listed until Go
            # came, R2's other neighbours chained up with R1, which did not link back.
            return ex.promised
        return ex.rolls_forward

    def _withholds_list(self, peer: str) -> bool:
        """Whether this broker's neighbour list may not go to ``peer`` yet: not over a frozen
        link (a reconfiguration's new link carries nothing before both its ends have it),
        except the added link of an exchange once this end would roll it forward (both ends
        have the link then; see :meth:`_unlisted`)."""
        if not self.routing.is_frozen(peer):
            return False
        ex = self.ex
        return ex is None or peer != ex.a_peer or not ex.rolls_forward

    def _tree_links(self) -> list[str]:
        """The settled tree links cycle probes travel (not a dead one, nor one an exchange is
        adding or removing)."""
        routing = self.routing
        return [n for n in routing.neighbours if self.is_neighbour(n) and not routing.is_frozen(n)]

    def _link_failed(self, peer: str, out: list[Effect]) -> None:
        """Repair a failed link whose far end is alive (see :mod:`~canopy_broker.core.cycles`):
        detour it, and have the exchange onto the standby link of the smallest known cycle
        through it started, by one end only."""
        if not self.is_neighbour(peer):
            raise ProtocolError(f"{self.name}: no link to {peer!r}")
        plan = plan_link_repair(self.name, peer, self.cycles.known(self.is_neighbour))
        if plan is None:
            reason = f"no known small cycle contains {self.name}-{peer}: it waits for the link"
            out.append(LinkRepair(peer, "", (), reason))
            return
        out.append(DetourLink(peer))
        if plan.decider != self.name:
            return
        out.append(LinkRepair(peer, plan.xid, plan.path))
        self.to_peer(plan.initiator, RepairLink(plan.xid, plan.path, plan.remove), out)

    def _forget_repairs(self) -> None:
        """Finished repairs are kept a while (late sweeps are passed on); not for ever."""
        done = [d for d, r in self.repairs.items() if r.phase is RepairPhase.DONE]
        for dead in done[: max(0, len(done) - 16)]:
            del self.repairs[dead]
        kept = set(map(id, self.repairs.values()))
        for dead in [d for d, r in self._bridged.items() if id(r) not in kept]:
            del self._bridged[dead]
        for peer in [p for p, r in self._unanswered.items() if id(r) not in kept]:
            del self._unanswered[peer]

    def _finish_repair(self, run: RepairRun, out: list[Effect], *, timed_out: bool = False) -> None:
        for partner in [p for p, r in self._unanswered.items() if r is run]:
            del self._unanswered[partner]  # done: nothing waits for its answer any more
        ex = self.ex
        if ex is not None and ex.bridge == run.dead:
            # A2's repair around A1 gave up waiting, or lost its chain end, before the walk
            # came (see exchange.defer_settle): the bridge ends first, while A1's link, which
            # its held notifications came over, is still there.
            coordinated.settle(self, ex, run.dead, run.dead, out)
        holding = self._holding
        shared: list[str] = []  # this run's chain ends another repair still holds
        for peer in [p for p, runs in holding.items() if run in runs]:
            holding[peer] = [r for r in holding[peer] if r is not run]
            if holding[peer]:
                shared.append(peer)
            else:
                del holding[peer]
        # What this run kept for an end another repair still holds is replayed by that one,
        # with what it holds: replayed now, it would reach the end ahead of older events
        # only the other run kept, which the end would then drop as had (review).
        for other in dict.fromkeys(r for peer in shared for r in holding[peer]):
            other.retained = merged(run.retained, other.retained)
        collecting = run.dead in self.handovers and self.handovers[run.dead].collecting
        if run.dead in self._ghosts and not collecting:
            # Now its routes may go: the new links have theirs (a handover that still collects
            # what they bring removes them when it is through).
            self._ghosts.discard(run.dead)
            self._remove_link(run.dead, out)

        def route(event: Event) -> list[str]:
            return list(self.routing.route(event.attrs, None)[0])

        sent = len(out)
        run.finish(route, out, now=self.now, timed_out=timed_out, skip=shared)
        if self.retention.enabled:  # the replay is in custody too: the next hop may die next
            for eff in out[sent:]:
                if isinstance(eff, SendToLink) and isinstance(eff.message, Publish):
                    self.retention.keep(eff.peer, self.now, eff.message.event)
        self._send_replay_ends(run, out)
        self._settle_after(run, out, now=timed_out)
        handover.repaired(self, run.dead, out)

    def _send_replay_ends(self, run: RepairRun, out: list[Effect]) -> None:
        """Tell each chain partner that the replay towards it is through, once it is: this
        broker's own (the run is done), and what the partner on its other side replayed, which
        passed on through here (that partner's ReplayEnd came, or none will: an end of the
        chain, gone, or older software). A partner's ReplayEnd used to say only that its own
        replay was through: an A end or a hand-over waiting on it went ahead of replays still
        coming from further along the chain, and had them dropped as had (fault simulator,
        deaths on an exchange's path: 1-4 events lost in 5 seeds of 200)."""
        if run.phase is not RepairPhase.DONE:
            return
        ends = self.replaying(run)  # the partners that take a ReplayEnd, and send one
        partners = run.partners
        for partner in partners:
            if partner not in ends or partner in run.replay_ends_sent:
                continue
            if all(o not in ends or o in run.replay_ends for o in partners if o != partner):
                run.replay_ends_sent.add(partner)
                out.append(SendToLink(partner, ReplayEnd(run.name_for(partner))))

    def _settle_after(self, run: RepairRun, out: list[Effect], *, now: bool = False) -> None:
        """Settle the exchange that waits on ``run`` (see exchange.defer_settle) once it is
        through: done, and (unless ``now``: it gave up waiting) the replay of each chain partner
        that is still there and sends one has ended. Its Settle walks on behind all of it."""
        ex = self.ex
        if ex is None or ex.after_repair != run.dead or run.phase is not RepairPhase.DONE:
            return
        if ex.after_replay and not now and set(self.replaying(run)) - run.replay_ends:
            return
        coordinated.settle(self, ex, run.dead, run.dead, out)

    def _replay_ended(self, peer: str, dead: str, out: list[Effect]) -> None:
        run = self._run_for(dead, peer)
        if run is None:
            # Its repair may not have begun here yet: this broker's detector is slower, and
            # the partner's repair ended on its timer. A middle member of the chain says its
            # own ReplayEnd only behind this one (see _send_replay_ends), so it is kept for a
            # repair timeout; a stale one (an earlier repair around a broker of the same name)
            # is dropped then.
            early = self._early_replay_ends
            for key in [k for k, at in early.items() if at < self.now - self.repair_timeout]:
                del early[key]
            if len(early) < 256:
                early[(peer, dead)] = self.now
            return
        if peer not in run.partners:
            # One from before a later repair around a broker of the same name (a restarted one
            # died again), or from outside the chain: nothing waits on it here. Dropped, not
            # refused: the link it came over is sound.
            return
        run.replay_ends.add(peer)
        self._send_replay_ends(run, out)
        self._settle_after(run, out)
        handover.repaired(self, run.dead, out)

    def _partner_gone(self, out: list[Effect]) -> None:
        """A link went: if it was a chain partner whose ReplayEnd the exchange waits for, it
        will not come."""
        for each in self.repairs.values():  # a ReplayEnd that waited on the gone one goes now
            self._send_replay_ends(each, out)
        ex = self.ex
        run = self.repairs.get(ex.after_repair) if ex is not None and ex.after_repair else None
        if run is not None:
            self._settle_after(run, out)
        for dead in list(self.handovers):
            handover.repaired(self, dead, out)

    def _repair_msg(self, peer: str, msg: RepairSweep, out: list[Effect]) -> None:
        run = self._run_for(msg.dead, peer)
        if run is None:
            raise ProtocolError(f"{self.name}: repair sweep for {msg.dead}, which it is not in")
        run.on_sweep(peer, msg, out)
        if run.complete:
            self._finish_repair(run, out)

    def repair_timer(self, dead: str, out: list[Effect]) -> None:
        run = self.repairs.get(dead)
        if run is not None and run.phase is RepairPhase.WAITING:
            run.step(RepairStep.TIMEOUT, "the timer")
            self._finish_repair(run, out, timed_out=True)

    # ------------------------------------------------------------------ handing over
    # (the protocol is core.handover's; these are the hooks it needs from the broker)

    def heard_list(self, peer: str) -> tuple[str, ...]:
        """The last neighbour list ``peer`` told this broker (empty if none came)."""
        return self.neighbour_lists.lists.get(peer, ())

    def expect_handover(self, ex: Exchange, gone: str, out: list[Effect]) -> None:
        handover.expect(self, ex, gone, out)

    def replaying(self, run: RepairRun) -> list[str]:
        """The chain partners of ``run`` whose ReplayEnd is to come: still linked, and sending
        one."""
        return [p for p in run.partners if self.is_neighbour(p) and p not in self.no_replay_end]

    def drop_ghost(self, dead: str, out: list[Effect]) -> None:
        """A hand-over is through collecting at the ghost of ``dead``: its routes go, unless
        the repair around it still waits (its end removes them then)."""
        run = self.repairs.get(dead)
        if dead in self._ghosts and (run is None or run.phase is RepairPhase.DONE):
            self._ghosts.discard(dead)
            if self.routing.has_link(dead):  # an R end's settling closed it
                self._remove_link(dead, out)

    # ------------------------------------------------------------------ protocol messages

    def to_peer(
        self, peer: str, msg: PeerMessage, out: list[Effect], *, incoming: bool = False
    ) -> None:
        """Out of band: send to ``peer``, or (``incoming``) take a message ``peer`` sent. A
        broker that plays both roles of a step hands the message to itself."""
        if not incoming and peer != self.name:
            out.append(SendToPeer(peer, msg))
        elif isinstance(msg, RecMsg):  # the path algorithm's RECMSG across the new link
            path_algorithm.on_recmsg(self, peer, msg, out)
        elif isinstance(msg, CycleProbe):
            onward, tell = self.cycles.on_probe(peer, msg, self._tree_links())
            out.extend(SendToPeer(target, probe) for target, probe in onward)
            out.extend(SendToPeer(target, found) for target, found in tell)
        elif isinstance(msg, CycleFound):
            self.cycles.on_found(msg)
        elif isinstance(msg, RepairLink):
            coordinated.start(self, StartExchange(msg.xid, msg.path, msg.remove), out)
        else:
            coordinated.from_peer(self, peer, msg, out)

    def _control(self, peer: str, msg: object, out: list[Effect]) -> None:
        """Link messages of the reconfiguration protocols and of client migration."""
        if isinstance(msg, Lock):
            coordinated.on_lock(self, peer, msg, out)
        elif isinstance(msg, RecMsg):
            path_algorithm.on_recmsg(self, peer, msg, out)
        elif isinstance(msg, CtrlMsg):
            path_algorithm.on_ctrl(self, peer, msg)
        elif isinstance(msg, FlushMsg):
            path_algorithm.on_flush(self, peer, msg, out)
        elif isinstance(msg, LinkReady):
            path_algorithm.on_link_ready(self, peer, msg, out)
        elif isinstance(msg, Neighbours):
            self.neighbour_lists.heard(peer, msg)
        elif isinstance(msg, Settle):
            ex = self.ex
            ahead = (  # the walk that keeps the removed link, ahead of A1's own verdict on A2
                msg.keep
                and ex is not None
                and ex.xid == msg.xid
                and ex.me == ex.k == 0
                and msg.gone == ex.a_peer
                and msg.gone not in self._waiting_verdicts
                and peer == ex.path[1]
            )
            coordinated.on_settle(self, peer, msg, out)
            if self._waiting_verdicts.get(msg.gone) == (msg.xid, peer):
                self._verdict_due(msg.gone, out, via=peer)
            elif ahead and self.routing.has_link(msg.gone) and msg.gone not in self._ghosts:
                # A2's path neighbour declared it dead, and this broker's detector has not yet
                # (real processes differ by tens of milliseconds): repaired now, what this
                # broker sent A2 is replayed over the kept link ahead of anything newer. Later,
                # newer events went over the kept link first and the replay was dropped as had
                # (simulator: 360 lost with this verdict 30 units after the other). The
                # runtime's own verdict then finds no link and only fences A2.
                if self.ex is ex and ex is not None:
                    ex.a2_dead = True  # the walk it would wait for has come (a2_dead_unlisted)
                self._peer_failed(msg.gone, out, via=peer)
        elif isinstance(msg, RepairSweep):
            self._repair_msg(peer, msg, out)
        elif isinstance(msg, ReplayEnd):
            self._replay_ended(peer, msg.dead, out)
        elif isinstance(msg, KeepRemoved):
            coordinated.on_keep_removed(self, peer, msg, out)
        elif isinstance(msg, RoutesIn | HandoverBegin | HandoverEnd):
            handover.on_message(self, peer, msg, out)
        elif isinstance(msg, PublisherGap):
            self._spread_gap(msg, peer, out)
        elif isinstance(msg, Marker):
            if self.routing.has_client(msg.client):  # else it has left: nothing to say
                out.append(DeliverMarker(msg.client))
        elif isinstance(msg, Moved):
            held = self._held.get(msg.client)
            if held is not None and held[0] == peer:
                self._release_held(msg.client, out)
            elif held is None:
                self._early_moved.add((msg.client, peer))  # ClientMigrating is on its way
        else:
            self._exchange_msg(peer, msg, out)

    def _exchange_msg(self, peer: str, msg: object, out: list[Effect]) -> None:
        """A link message of the coordinated exchange: checked against the exchange this broker
        is in before anything changes."""
        ex = self.ex
        xid = getattr(msg, "xid", None)
        if (
            isinstance(msg, LockRefused)
            and msg.final
            and coordinated.other_a_end_rolled_back(self, peer, msg, out)
        ):
            return
        if (
            isinstance(msg, LockRefused)
            and msg.final
            and (ex is None or ex.xid != xid or ex.granted)
        ):
            # A broker of the path died and its neighbour gave the try up, but Go was already
            # past (or the exchange over) here: this side rolls forward by lease, or is done.
            return
        if isinstance(msg, LockRefused | Granted | Go):
            if ex is not None and ex.xid == xid and msg.attempt != ex.attempt:
                if msg.attempt < ex.attempt:
                    return  # the answer to a try A1 gave up on; the new try holds the lock
                raise ProtocolError(
                    f"{self.name}: {type(msg).__name__} of {xid} for try {msg.attempt}, "
                    f"but this broker is locked for try {ex.attempt}"
                )
            if (ex is None or ex.xid != xid) and (xid in self.left or xid in self.attempts):
                # The answer to a try this broker no longer holds (its lease gave up on it: a
                # path broker was paused, or the path is slow): A1 has retried or will. Acting
                # on it would take an old try's grant for a new one's.
                return
        if ex is None or ex.xid != xid:
            if xid in self.left:
                # A late message of an exchange we finished by lease. The other A end's Done
                # still says what it advertises over the added link: take it.
                if isinstance(msg, Done) and self.routing.has_link(peer):
                    self.routing.sync_from(peer, msg.keys, out)
                    handover.routes_arrived(self, peer, out)
                return
            raise ProtocolError(
                f"{self.name}: {type(msg).__name__} for exchange {xid} it is not in"
            )
        if isinstance(msg, Separator):
            if msg.side not in (1, 2):
                raise ProtocolError(f"{self.name}: separator of {ex.xid} for side {msg.side}")
            step = Step.OWN_SEPARATOR if msg.side == ex.side else Step.OTHER_SEPARATOR
        else:
            found = _EXCHANGE_STEPS.get(type(msg))
            if found is None:
                raise ProtocolError(f"unknown link message {msg!r}")
            step = found
        ex.expect(step)
        out.append(StartTimer(f"lease:{ex.xid}", ex.lease))  # the exchange is alive: renew
        if isinstance(msg, LockRefused):
            coordinated.on_refused(self, ex, msg, out)
        elif isinstance(msg, Granted):
            coordinated.on_granted(self, ex, out)
        elif isinstance(msg, Go):
            coordinated.go(self, ex, out, msg.a1_list)
            if ex.a1_dead and self.ex is ex:  # its verdict waited for this (a1_dead_before_go)
                self._peer_failed(ex.path[0], out)
        elif isinstance(msg, Separator):
            coordinated.on_separator(self, ex, msg.side, out)
        elif isinstance(msg, End):
            coordinated.on_end(self, ex, msg.side, out)
        elif isinstance(msg, Done):
            coordinated.on_done(self, peer, ex, msg, out)
            handover.routes_arrived(self, peer, out)
        elif isinstance(msg, Echo):
            coordinated.on_echo(self, ex, out)
        elif isinstance(msg, SeparatorSeen):
            if peer != ex.r_peer:
                raise ProtocolError(f"{self.name}: SeparatorSeen of {ex.xid} from {peer}")
            ex.fire(Step.SEPARATOR_SEEN)
            coordinated.maybe_finish_r(self, ex, out)

    def leave_exchange(self, ex: Exchange, *, by_lease: bool) -> None:
        """The exchange is over for this broker (``by_lease``: its late messages are expected)."""
        if self.ex is ex:
            self.ex = None
        if by_lease:
            self.left.append(ex.xid)

    def own_list(self) -> tuple[str, ...]:
        """The neighbour list this broker would announce now (empty with repair off)."""
        if not self.announce_neighbours:
            return ()
        return self.neighbour_lists.order(self._listed(self.routing.neighbours))

    def _listed(self, neighbours: list[str]) -> list[str]:
        """The ``neighbours`` this broker names in its list (see :meth:`_unlisted`)."""
        return [n for n in neighbours if not self._unlisted(n)]

    def heard_with_go(self, peer: str, names: tuple[str, ...], *, newest: bool) -> None:
        if self.announce_neighbours:
            self.neighbour_lists.heard_with_go(peer, names, newest=newest)

    def record_ordering_delay(self, xid: str, delay: float) -> None:
        self.ordering_delays.append(delay)
        by_xid = self.ordering_delays_by_exchange
        if xid not in by_xid and len(by_xid) >= 64:
            del by_xid[next(iter(by_xid))]
        by_xid.setdefault(xid, []).append(delay)

    # ------------------------------------------------------------------ client migration

    def _migrating(self, inp: ClientMigrating, out: list[Effect]) -> None:
        self.routing.check_client(inp.client)
        if not self.routing.has_link(inp.source):
            raise ProtocolError(
                f"{self.name}: {inp.client!r} migrates from {inp.source!r}, "
                "which is not a neighbour"
            )
        if (inp.client, inp.source) in self._early_moved:
            self._early_moved.discard((inp.client, inp.source))  # Moved came first: no hold
        else:
            self._held[inp.client] = (inp.source, [])
        out.append(SendToLink(inp.source, Marker(inp.client)))

    def _release_held(self, client: str, out: list[Effect]) -> None:
        """A migrating publisher's publications here may go: the old broker's have passed."""
        _source, events = self._held.pop(client)
        for event in events:
            self._route(event, None, out)

    def take_ordering_delays(self) -> list[float]:
        """Hand over (and forget) the ordering delays measured since the last call."""
        delays, self.ordering_delays = self.ordering_delays, []
        return delays
