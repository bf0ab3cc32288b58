"""Per-broker state of one coordinated link exchange, and where this broker sits on the cycle.

The exchange removes r = (R1, R2) and adds a = (A1, A2). Its *cycle* is given as the tree path
``path = [A1, ..., R1, R2, ..., A2]``; ``k`` is R1's index. Side 1 is ``path[0..k]`` and side 2
is ``path[k+1..]``. On each side, *down* points towards the removed link and *up* towards the
added one (for A1 and A2, up is the added link itself; for R1 and R2, down is the removed link).

How the protocol runs (each step is a message handled by ``BrokerCore``):

1. **Lock** travels A1 → A2 over tree links; each broker joins only one exchange at a time and
   turns *black*. A busy broker (or a hop that is not a link) sends **LockRefused** back, which
   releases every broker on the way; A1 retries with randomised exponential backoff. A2, the last
   to lock, answers **Granted**, which travels back to A1. A1 and A2 add the new link when they
   lock, *frozen*: no routing advertisement crosses it until the end.
2. **Phase 1.** When Granted passes an R end, that R end freezes the removed link too, and sends
   its A end (out of band) a **Transfer**: the routing keys it holds from r — exactly what the A
   end must hold from a in the new tree. Later routing changes arriving over r are **Relay**-ed. A
   **Separator** follows the transfer. The A end installs the keys as if received over a, which
   propagates them down its side of the cycle by ordinary covering/identity forwarding.
3. The separator walks its side down to its R end, turning each broker *gray*, crosses r, and
   walks the other side up to the other A end, where it is absorbed. When it returns to its R end,
   that end starts **phase 2**: it drops r's routing entries, which withdraws them up its side.
   An R end that has done phase 2 and received the other side's separator closes r, says
   **RelayEnd** to its A end and sends **End** up its side; each broker releases its lock as End
   passes.
4. Notifications carry a colour (:class:`~canopy_broker.core.messages.Tag`) on the cycle: black
   ones cross r only, gray ones cross a only, so each takes exactly one of the two paths. A
   message takes the colour of the broker where it enters the cycle; an untagged message from a
   cycle neighbour was sent before that neighbour locked, so it is black. Gray notifications that
   cross a are queued at the far A end until the other side's separator has arrived there (no
   black notification of that publisher can still overtake them) — FIFO-publisher order. For
   causal order the queue also waits for an **Echo** of the A end's own separator, sent up by its
   R end: then no black notification of its own side is still on its way to the A end either.
5. An A end that has End, RelayEnd and the other separator unfreezes a and sends **Done** with
   the complete set it advertises over a; the other A end, which holds the old advertisement of
   this side (its R end's transfer), applies the difference. With Done from both sides the
   exchange is finished; A1 reports it.

Routing changes made by subscribers *during* an exchange propagate normally inside each side; they
cross between the sides when the exchange completes (step 5), which is when they are established.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from canopy_broker.core.errors import ProtocolError
from canopy_broker.core.messages import (
    CloseLink,
    Done,
    Echo,
    Effect,
    End,
    ExchangeFinished,
    FromLink,
    Granted,
    Lock,
    LockRefused,
    OpenLink,
    Ordering,
    PeerMessage,
    Publish,
    Relay,
    RelayEnd,
    RouteKey,
    SendToLink,
    Separator,
    StartExchange,
    StartTimer,
    Subscribe,
    Tag,
    Transfer,
    Unsubscribe,
)

if TYPE_CHECKING:
    from canopy_broker.core.broker import BrokerCore

MAX_LOCK_ATTEMPTS = 60


@dataclass
class Exchange:
    xid: str
    path: tuple[str, ...]
    k: int
    me: int
    ordering: Ordering = Ordering.FIFO
    lease: float = 30.0
    gray: bool = False
    granted: bool = False
    phase2_done: bool = False
    other_sep_seen: bool = False
    relay_end: bool = False
    end_seen: bool = False
    own_done: bool = False
    peer_done: bool = False
    echo_seen: bool = False
    by_lease: bool = False  # this broker finished its part because the lease ran out
    queue_released: bool = False
    queue: list[tuple[float, FromLink]] = field(default_factory=list)
    queued_total: int = 0

    @property
    def last(self) -> int:
        return len(self.path) - 1

    @property
    def side(self) -> int:
        return 1 if self.me <= self.k else 2

    @property
    def is_a(self) -> bool:
        return self.me in (0, self.last)

    @property
    def is_r(self) -> bool:
        return self.me in (self.k, self.k + 1)

    @property
    def a_peer(self) -> str | None:
        """The other end of the added link, if this broker is an A end."""
        if self.me == 0:
            return self.path[-1]
        if self.me == self.last:
            return self.path[0]
        return None

    @property
    def r_peer(self) -> str | None:
        """The other end of the removed link, if this broker is an R end."""
        if self.me == self.k:
            return self.path[self.k + 1]
        if self.me == self.k + 1:
            return self.path[self.k]
        return None

    @property
    def down(self) -> str:
        """Next broker towards the removed link (over it, for an R end)."""
        return self.path[self.me + 1] if self.side == 1 else self.path[self.me - 1]

    @property
    def up(self) -> str:
        """Next broker towards the added link (over it, for an A end)."""
        if self.is_a:
            a = self.a_peer
            assert a is not None
            return a
        return self.path[self.me - 1] if self.side == 1 else self.path[self.me + 1]

    @property
    def a_end_of_my_side(self) -> str:
        return self.path[0] if self.side == 1 else self.path[-1]

    @property
    def r_end_of_my_side(self) -> str:
        return self.path[self.k] if self.side == 1 else self.path[self.k + 1]

    def cycle_peers(self) -> tuple[str, str]:
        return (self.up, self.down)


def backoff(xid: str, attempt: int, base: float = 0.05, cap: float = 5.0) -> float:
    """Randomised exponential backoff without a random source: the jitter is a hash of the
    exchange id and the attempt, so runs stay reproducible while colliding exchanges (which have
    different ids) spread out."""
    jitter = zlib.crc32(f"{xid}#{attempt}".encode()) / 0x1_0000_0000
    return float(min(cap, base * (2 ** min(attempt, 16))) * (0.5 + jitter))


def validate_path(path: tuple[str, ...], remove: tuple[str, str]) -> int:
    """Return k (R1's index) or raise ``ValueError`` saying what is wrong with the request."""
    if len(set(path)) != len(path):
        raise ValueError(f"cycle path repeats a broker: {list(path)}")
    if len(path) < 3:
        raise ValueError(
            f"cycle path {list(path)} is too short: the added link must differ from the removed one"
        )
    for k in range(len(path) - 1):
        if {path[k], path[k + 1]} == set(remove):
            return k
    raise ValueError(f"removed link {remove[0]}-{remove[1]} is not on the cycle path {list(path)}")


# --------------------------------------------------------------------------- the protocol
# Functions over a BrokerCore's routing state; BrokerCore.handle() dispatches to them.


def route_on_cycle(
    core: BrokerCore,
    ex: Exchange,
    copy: Publish,
    peers: list[str],
    out: list[Effect],
    *,
    source: str | None,
    tag: Tag | None,
) -> None:
    """Forward a notification on a reconfiguration cycle: colour it, and let black copies
    cross only the removed link and gray copies only the added one."""
    if tag is not None and tag.xid == ex.xid:
        gray = tag.gray
    elif source is not None and source in ex.cycle_peers():
        # Untagged from a cycle neighbour: sent before it locked (old tree, black) — except
        # at an A end that has seen End, whose down neighbour has released: new tree.
        gray = ex.end_seen and source == ex.down
    else:
        gray = ex.gray
    tagged = Publish(copy.event, Tag(ex.xid, gray))
    for peer in peers:
        if peer == ex.r_peer:
            if not gray:
                out.append(SendToLink(peer, tagged))
        elif peer == ex.a_peer:
            if gray:
                out.append(SendToLink(peer, tagged))
        elif peer in (ex.up, ex.down):
            out.append(SendToLink(peer, tagged))
        else:
            out.append(SendToLink(peer, copy))


def start(core: BrokerCore, req: StartExchange, out: list[Effect]) -> None:
    """At A1: a new exchange request (idempotent by id); lock the cycle."""
    if req.xid in core._attempts:
        return  # idempotent: the same request is already being carried out
    try:
        validate_path(req.path, req.remove)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    if req.path[0] != core.name:
        raise ProtocolError(f"{core.name}: exchange {req.xid} must start at {req.path[0]}")
    core._attempts[req.xid] = (req, 0)
    try_lock(core, req.xid, out)


def try_lock(core: BrokerCore, xid: str, out: list[Effect]) -> None:
    req, _ = core._attempts[xid]
    k = validate_path(req.path, req.remove)
    problem = lock_problem(core, req.path, 0, req.xid)
    if problem is None:
        lock = Lock(req.xid, req.path, k, req.ordering, req.lease)
        lock_here(core, lock, 0, out)
        out.append(SendToLink(req.path[1], lock))
    else:
        retry_later(core, xid, problem, out)


def retry_later(core: BrokerCore, xid: str, reason: str, out: list[Effect]) -> None:
    req, attempt = core._attempts[xid]
    attempt += 1
    if attempt >= MAX_LOCK_ATTEMPTS:
        del core._attempts[xid]
        out.append(
            ExchangeFinished(xid, False, f"gave up after {attempt} attempts: {reason}", attempt)
        )
        return
    core._attempts[xid] = (req, attempt)
    out.append(StartTimer(f"lock:{xid}", backoff(xid, attempt)))


def timer(core: BrokerCore, key: str, out: list[Effect]) -> None:
    kind, _, xid = key.partition(":")
    if kind == "lock" and xid in core._attempts and (core._ex is None or core._ex.xid != xid):
        try_lock(core, xid, out)
    elif kind == "lease" and core._ex is not None and core._ex.xid == xid:
        lease_expired(core, core._ex, out)


def lease_expired(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    """Nothing heard from the exchange for a whole lease: a participant or the initiator is
    gone. Before phase 1 nothing has changed, so roll back; after it the new link may carry
    traffic, so roll forward — finish this broker's part without the missing messages."""
    if not ex.granted:
        undo_lock(core, ex, out)
        if ex.me == 0:
            retry_later(core, ex.xid, "lease expired while locking", out)
        return
    ex.by_lease = True
    r = ex.r_peer
    if r is not None and r in core._from_link:
        if not ex.phase2_done:
            phase2(core, ex, out)
        ex.other_sep_seen = True
        close_removed_link(core, ex, out)
    if ex.is_a and not ex.own_done:
        ex.other_sep_seen = ex.relay_end = ex.echo_seen = ex.end_seen = True
        maybe_release_queue(core, ex, out)
        maybe_finish_a(core, ex, out)
    if core._ex is not ex:
        return  # finishing our part completed the exchange after all
    core._ex = None
    core._left.append(ex.xid)
    if ex.me == 0:
        _req, attempt = core._attempts.pop(ex.xid)
        reason = "lease expired after phase 1 began: rolled forward"
        out.append(ExchangeFinished(ex.xid, False, reason, attempt + 1))


def lock_problem(core: BrokerCore, path: tuple[str, ...], i: int, xid: str) -> str | None:
    """Why this broker cannot lock for the exchange at position ``i`` (None if it can)."""
    if core._ex is not None:
        return f"{core.name} is locked by exchange {core._ex.xid}"
    if i < len(path) - 1 and (path[i + 1] not in core._from_link or path[i + 1] in core._frozen):
        return f"{core.name} has no link to {path[i + 1]}"
    if i in (0, len(path) - 1):
        other = path[-1] if i == 0 else path[0]
        if other in core._from_link:
            return f"{core.name} is already linked to {other}"
    return None


def lock_here(core: BrokerCore, lock: Lock, i: int, out: list[Effect]) -> None:
    ex = Exchange(lock.xid, lock.path, lock.k, i, lock.ordering, lock.lease)
    core._ex = ex
    out.append(StartTimer(f"lease:{ex.xid}", ex.lease))
    a = ex.a_peer
    if a is not None:  # an A end: the added link exists from now on, frozen
        core._from_link[a] = set()
        core._advertised[a] = set()
        core._frozen.add(a)
        out.append(OpenLink(a))


def release(core: BrokerCore, out: list[Effect]) -> None:
    """Leave the exchange (normal end, or a refused lock before anything changed)."""
    ex = core._ex
    assert ex is not None
    core._ex = None
    if ex.me == 0 and ex.own_done:
        _req, attempt = core._attempts.pop(ex.xid)
        reason = "lease expired after phase 1 began: rolled forward" if ex.by_lease else ""
        out.append(ExchangeFinished(ex.xid, not ex.by_lease, reason, attempt + 1))


def apply_done(core: BrokerCore, peer: str, msg: Done, out: list[Effect]) -> None:
    """The other side's advertisement, complete: apply what differs from what we hold."""
    table = core._from_link[peer]
    keys = set(msg.keys)
    for key in sorted(keys - table, key=RouteKey.sort_key):
        core._apply_route_msg(table, peer, Subscribe(key), out)
    for key in sorted(table - keys, key=RouteKey.sort_key):
        core._apply_route_msg(table, peer, Unsubscribe(key), out)


def on_lock(core: BrokerCore, peer: str, msg: Lock, out: list[Effect]) -> None:
    path = msg.path
    if core.name not in path:
        raise ProtocolError(f"{core.name}: lock {msg.xid} for a path it is not on")
    i = path.index(core.name)
    if i == 0 or path[i - 1] != peer:
        raise ProtocolError(f"{core.name}: lock {msg.xid} arrived from {peer}, not path[{i - 1}]")
    problem = lock_problem(core, path, i, msg.xid)
    if problem is not None:
        out.append(SendToLink(peer, LockRefused(msg.xid, problem)))
        return
    lock_here(core, msg, i, out)
    if i == len(path) - 1:
        assert core._ex is not None
        on_granted(core, core._ex, out)  # the last lock grants: phase 1 starts here
    else:
        out.append(SendToLink(path[i + 1], msg))


def undo_lock(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    """Leave an exchange that never started phase 1 (only an A end has changed anything)."""
    a = ex.a_peer
    if a is not None and a in core._frozen:
        del core._from_link[a]
        del core._advertised[a]
        core._frozen.discard(a)
        out.append(CloseLink(a))
    core._ex = None


def on_refused(core: BrokerCore, ex: Exchange, msg: LockRefused, out: list[Effect]) -> None:
    if ex.granted:
        raise ProtocolError(f"{core.name}: lock of {ex.xid} refused after it was granted")
    undo_lock(core, ex, out)
    if ex.me == 0:
        retry_later(core, ex.xid, msg.reason, out)
    else:
        out.append(SendToLink(ex.path[ex.me - 1], msg))


def on_granted(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    ex.granted = True
    if ex.is_r:
        r = ex.r_peer
        assert r is not None
        core._frozen.add(r)
        transfer = Transfer(ex.xid, tuple(sorted(core._from_link[r], key=RouteKey.sort_key)))
        core._to_peer(ex.a_end_of_my_side, transfer, out)
        core._to_peer(ex.a_end_of_my_side, Separator(ex.xid, ex.side), out)
    if ex.me > 0:
        out.append(SendToLink(ex.path[ex.me - 1], Granted(ex.xid)))


def from_peer(core: BrokerCore, peer: str, msg: PeerMessage, out: list[Effect]) -> None:
    """Out-of-band messages to an A end: the transfer, relays, RelayEnd, its separator."""
    ex = core._ex
    if ex is None or ex.xid != msg.xid or not ex.is_a:
        if msg.xid in core._left:
            return  # late: we finished this exchange by lease
        raise ProtocolError(
            f"{core.name}: {type(msg).__name__} for exchange {msg.xid} it is not an A end of"
        )
    a = ex.a_peer
    assert a is not None
    out.append(StartTimer(f"lease:{ex.xid}", ex.lease))  # the exchange is alive: renew
    table = core._from_link[a]
    if isinstance(msg, Transfer):
        for key in msg.keys:
            core._apply_route_msg(table, a, Subscribe(key), out)
    elif isinstance(msg, Relay):
        core._apply_route_msg(table, a, msg.message, out)
    elif isinstance(msg, RelayEnd):
        ex.relay_end = True
        maybe_release_queue(core, ex, out)
    elif isinstance(msg, Separator):
        on_separator(core, ex, msg.side, out)
    else:  # pragma: no cover
        raise ProtocolError(f"unknown peer message {msg!r}")


def on_separator(core: BrokerCore, ex: Exchange, side: int, out: list[Effect]) -> None:
    if side == ex.side:
        # Our side's separator walks down to our R end: everything the transfer changed
        # is in place above us, so notifications entering here may take the new link.
        ex.gray = True
        if ex.is_r:
            phase2(core, ex, out)
            if ex.ordering is Ordering.CAUSAL:
                on_echo(core, ex, out)
            r = ex.r_peer
            assert r is not None
            out.append(SendToLink(r, Separator(ex.xid, side)))
            maybe_finish_r(core, ex, out)
        else:
            out.append(SendToLink(ex.down, Separator(ex.xid, side)))
        return
    # The other side's separator walks up to our A end: no black message from that side
    # follows it.
    ex.other_sep_seen = True
    if ex.is_r:
        core._to_peer(ex.a_end_of_my_side, RelayEnd(ex.xid), out)
    if ex.is_a:
        maybe_release_queue(core, ex, out)
    else:
        out.append(SendToLink(ex.up, Separator(ex.xid, side)))
    if ex.is_r:
        maybe_finish_r(core, ex, out)


def phase2(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    """Drop the removed link's routing entries; the withdrawals travel up this side only."""
    r = ex.r_peer
    assert r is not None
    ex.phase2_done = True
    table = core._from_link[r]
    core._retired.add(r)
    for key in sorted(table, key=RouteKey.sort_key):
        table.remove(key)
        core._matcher.remove(key.filter, r)
        core._key_removed(key, r, out)


def close_removed_link(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    r = ex.r_peer
    assert r is not None
    del core._from_link[r]
    del core._advertised[r]
    core._frozen.discard(r)
    core._retired.discard(r)
    out.append(CloseLink(r))


def maybe_finish_r(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    if not (ex.phase2_done and ex.other_sep_seen):
        return
    close_removed_link(core, ex, out)
    if ex.is_a:
        on_end(core, ex, out)
    else:
        out.append(SendToLink(ex.up, End(ex.xid, ex.side)))
        release(core, out)


def on_end(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    if not ex.is_a:
        out.append(SendToLink(ex.up, End(ex.xid, ex.side)))
        release(core, out)
        return
    ex.end_seen = True
    maybe_finish_a(core, ex, out)


def on_echo(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    if ex.is_a:
        ex.echo_seen = True
        maybe_release_queue(core, ex, out)
    else:
        out.append(SendToLink(ex.up, Echo(ex.xid)))


def maybe_release_queue(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    causal_ready = ex.echo_seen or ex.ordering is not Ordering.CAUSAL
    if ex.queue_released or not (ex.other_sep_seen and ex.relay_end and causal_ready):
        return
    ex.queue_released = True
    queued, ex.queue = ex.queue, []
    for queued_at, inp in queued:
        if isinstance(inp.message, Publish):
            core.ordering_delays.append(core._now - queued_at)
            by_xid = core.ordering_delays_by_exchange
            if ex.xid not in by_xid and len(by_xid) >= 64:
                del by_xid[next(iter(by_xid))]
            by_xid.setdefault(ex.xid, []).append(core._now - queued_at)
        core._from_link_msg(inp, out)
        if core._ex is not ex:  # a queued Done finished the exchange
            break
    maybe_finish_a(core, ex, out)


def maybe_finish_a(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    if core._ex is not ex or ex.own_done or not (ex.end_seen and ex.queue_released):
        return
    a = ex.a_peer
    assert a is not None
    # Unfreeze the added link: tell the other side exactly what this side advertises; it
    # holds the old advertisement (from its R end's transfer) and applies the difference.
    core._frozen.discard(a)
    want = core._wanted_by(a)
    core._advertised[a] = want
    out.append(SendToLink(a, Done(ex.xid, tuple(sorted(want, key=RouteKey.sort_key)))))
    ex.own_done = True
    maybe_release_a(core, ex, out)


def maybe_release_a(core: BrokerCore, ex: Exchange, out: list[Effect]) -> None:
    if ex.own_done and ex.peer_done:
        release(core, out)
