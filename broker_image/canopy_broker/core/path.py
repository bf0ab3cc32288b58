"""The reconfiguration-path algorithm (paper 002), on the canonical routing core.

Instead of withdrawing and re-advertising routes, a single RECMSG walks the *reconfiguration
path* — head path R1 → ... → A1, the new link A1 → A2, tail path A2 → ... → R2 — and each broker
on the head path rewrites its tables in place:

* routes the removed link used to serve (P_add) now point at the next broker towards the new
  link: added to the table from that neighbour, and to what this broker advertised to the
  previous one (which did the same on its side, without a message);
* routes that were there *only* for the removed link (P_del) are dropped from the table from the
  previous broker; what this broker now stops advertising to the next one becomes the next P_del.

While a RECMSG is on its way to the next broker, that broker may still withdraw one of those
routes the old way; the *ignore table* keeps such (un)subscriptions from undoing the rewrite
until the next broker confirms with CTRLMSG. A1 opens the new link and, once A2 has it
(LINKREADY), advertises over it normally. A2 holds its own advertisement back (it remembers
P_add as what A1 believes it advertised) and passes RECMSG down the tail path; R2 then drops the
removed link the ordinary way — withdrawals travel up the tail path only as far as they must —
and sends FLUSHMSG up to A2, which finally advertises the difference over the new link.

The rewrite is exact for identity and simple routing, where a table is the *set* of keys behind a
link; with covering routing a union of tables is not the set of maximal keys, so covering
overlays must use the coordinated algorithm. The path algorithm takes no locks and does not
colour notifications: in-flight notifications can be lost or duplicated — the price of its low
overhead, which the checker reports rather than hides.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from canopy_broker.core.errors import ProtocolError
from canopy_broker.core.messages import (
    CloseLink,
    CtrlMsg,
    Effect,
    ExchangeFinished,
    FlushMsg,
    LinkReady,
    OpenLink,
    RecMsg,
    RouteKey,
    RoutingMode,
    SendToLink,
    SendToPeer,
    StartExchange,
    validate_path,
)

if TYPE_CHECKING:
    from canopy_broker.core.routing import RoutingState


class Role(Enum):
    """What one broker still waits for in one path reconfiguration."""

    AWAIT_CTRL = "awaiting CTRLMSG"  # passed RECMSG on along the head path
    AWAIT_LINK_READY = "awaiting LINKREADY"  # A1: the new link is open, held back
    AWAIT_FLUSH = "awaiting FLUSHMSG"  # A2: its advertisement over the new link is held back
    TAIL = "on the tail path"  # passed RECMSG towards R2; FLUSHMSG comes back this way


ANSWERS: dict[Role, type[CtrlMsg | LinkReady | FlushMsg]] = {
    Role.AWAIT_CTRL: CtrlMsg,
    Role.AWAIT_LINK_READY: LinkReady,
    Role.AWAIT_FLUSH: FlushMsg,
    Role.TAIL: FlushMsg,
}
"""The one message that ends each role (and from whom it must come: the peer recorded with the
role). Anything else for a path reconfiguration is refused before it changes anything."""


class PathHost(Protocol):
    """What the path algorithm needs from its broker (``core.broker.BrokerCore``)."""

    name: str
    routing: RoutingState
    # Per reconfiguration: this broker's role and the peer whose message ends it.
    path_roles: dict[str, tuple[Role, str]]
    # Per neighbour, per reconfiguration: (un)subscriptions to ignore while RECMSG travels.
    ignore: dict[str, dict[str, set[RouteKey]]]


def _keys(ks: Collection[RouteKey]) -> tuple[RouteKey, ...]:
    return tuple(sorted(ks, key=RouteKey.sort_key))


def _take_role(core: PathHost, xid: str, role: Role, peer: str) -> None:
    if xid in core.path_roles:
        raise ProtocolError(f"{core.name}: reconfiguration {xid} reached it twice")
    core.path_roles[xid] = (role, peer)


def expect(core: PathHost, peer: str, msg: CtrlMsg | LinkReady | FlushMsg) -> None:
    """Refuse (changing nothing) a message that ends no role this broker holds."""
    role, from_peer = core.path_roles.get(msg.xid, (None, ""))
    if role is None or not isinstance(msg, ANSWERS[role]) or peer != from_peer:
        have = f"it is {role.value} from {from_peer}" if role else "it takes no part in it"
        raise ProtocolError(
            f"{core.name}: {type(msg).__name__} of reconfiguration {msg.xid} from {peer}, "
            f"but {have}"
        )


def start(core: PathHost, req: StartExchange, out: list[Effect]) -> None:
    """At R1: the head path starts here."""
    try:
        k = validate_path(req.path, req.remove)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    if core.routing.mode is RoutingMode.COVERING:
        raise ProtocolError(
            "the path algorithm needs identity or simple routing; covering overlays use the "
            "coordinated algorithm"
        )
    if req.path[k] != core.name:
        raise ProtocolError(f"{core.name}: the path algorithm starts at R1 = {req.path[k]}")
    r = req.path[k + 1]
    if not core.routing.has_link(r):
        raise ProtocolError(f"{core.name}: no link to {r} to remove")
    if req.xid in core.path_roles:
        return  # idempotent: already under way here
    p_add = _keys(core.routing.held_from(r))
    _head_step(core, RecMsg(req.xid, req.path, k, p_add, p_add), k, r, out)


def _next_on_head(path: tuple[str, ...], i: int) -> str:
    """Towards A1, and from A1 across the new link to A2."""
    return path[i - 1] if i > 0 else path[-1]


def _head_step(core: PathHost, msg: RecMsg, i: int, prev: str, out: list[Effect]) -> None:
    """Rewrite this broker's tables for head-path position ``i``; ``msg`` came from ``prev``."""
    xid, path, k = msg.xid, msg.path, msg.k
    routing = core.routing
    nxt = _next_on_head(path, i)
    at_r1 = i == k
    if not routing.has_link(prev) or (i > 0 and not routing.has_link(nxt)):
        raise ProtocolError(f"{core.name}: RECMSG {xid} needs links to {prev} and {nxt}")
    if i == 0 and routing.has_link(nxt):
        raise ProtocolError(f"{core.name}: RECMSG {xid}: already linked to {nxt}")
    _take_role(core, xid, Role.AWAIT_LINK_READY if i == 0 else Role.AWAIT_CTRL, nxt)
    if i == 0:  # A1: the new link exists from now on, held back until A2 has it
        routing.open_frozen(nxt)
        out.append(OpenLink(nxt))
    # Rewrite without the ordinary advertisements: both neighbours on the path learn the
    # change from RECMSG itself.
    with routing.held_back(prev, nxt):
        routing.learn(nxt, msg.p_add, out)
        routing.forget(prev, msg.p_del, out)
        if at_r1:  # the removed link is gone at this end
            routing.remove_link(prev, out)
            out.append(CloseLink(prev))
        else:
            routing.set_advertised(prev, routing.wanted_by(prev))
            out.append(SendToLink(prev, CtrlMsg(xid)))
    if i == 0:
        # A1 advertises over the new link only once A2 has it (LINKREADY): nothing sent yet.
        out.append(SendToPeer(nxt, RecMsg(xid, path, k, msg.p_add)))
        return
    new_next = routing.wanted_by(nxt)
    p_del_next = frozenset(k for k in routing.advertised_to(nxt) if k not in new_next)
    routing.set_advertised(nxt, new_next)
    core.ignore.setdefault(nxt, {})[xid] = set(msg.p_add)
    out.append(SendToLink(nxt, RecMsg(xid, path, k, msg.p_add, _keys(p_del_next))))


def on_recmsg(core: PathHost, peer: str, msg: RecMsg, out: list[Effect]) -> None:
    path, k = msg.path, msg.k
    if not 0 <= k < len(path) - 1 or core.name not in path:
        raise ProtocolError(f"{core.name}: RECMSG {msg.xid} for a path it is not on")
    try:
        validate_path(path, (path[k], path[k + 1]))
    except ValueError as exc:
        raise ProtocolError(f"{core.name}: RECMSG {msg.xid}: {exc}") from None
    i = path.index(core.name)
    last = len(path) - 1
    expected_from = path[i + 1] if i <= k else (path[0] if i == last else path[i + 1])
    if peer != expected_from:
        raise ProtocolError(f"{core.name}: RECMSG {msg.xid} from {peer}, not {expected_from}")
    if i <= k:  # head path
        _head_step(core, msg, i, peer, out)
        return
    if i == last:  # A2, across the new link (out of band)
        if core.routing.has_link(peer):
            raise ProtocolError(f"{core.name}: RECMSG {msg.xid}: already linked to {peer}")
        _take_role(core, msg.xid, Role.AWAIT_FLUSH, path[last - 1] if last > k + 1 else "")
        core.routing.open_frozen(peer, believed=msg.p_add)  # what A1 believes we advertise
        out.append(OpenLink(peer))
        out.append(SendToLink(peer, LinkReady(msg.xid)))
    else:
        _take_role(core, msg.xid, Role.TAIL, path[i - 1])
    _tail_step(core, msg, i, out)


def _tail_step(core: PathHost, msg: RecMsg, i: int, out: list[Effect]) -> None:
    path, k = msg.path, msg.k
    if i > k + 1:
        out.append(SendToLink(path[i - 1], RecMsg(msg.xid, path, k)))
        return
    # R2: drop the removed link the ordinary way; withdrawals go up the tail path only as far
    # as they must, then FLUSHMSG follows them to A2.
    r1 = path[k]
    if core.routing.has_link(r1):
        core.routing.remove_link(r1, out)
        out.append(CloseLink(r1))
    core.path_roles.pop(msg.xid, None)  # R2's own part ends here
    _flush(core, FlushMsg(msg.xid, path), out)


def on_flush(core: PathHost, peer: str, msg: FlushMsg, out: list[Effect]) -> None:
    expect(core, peer, msg)
    del core.path_roles[msg.xid]
    _flush(core, msg, out)


def _flush(core: PathHost, msg: FlushMsg, out: list[Effect]) -> None:
    """Up the tail path to A2, where the reconfiguration completes: A2 advertises across the new
    link the difference to what A1 believes it advertises (P_add)."""
    path = msg.path
    i = path.index(core.name)
    if i < len(path) - 1:
        out.append(SendToLink(path[i + 1], msg))
        return
    core.path_roles.pop(msg.xid, None)
    core.routing.reconcile(path[0], out)
    out.append(ExchangeFinished(msg.xid, True))


def on_link_ready(core: PathHost, peer: str, msg: LinkReady, out: list[Effect]) -> None:
    """At A1: A2 has the new link; advertise over it normally from now on."""
    expect(core, peer, msg)
    del core.path_roles[msg.xid]
    core.routing.reconcile(peer, out)


def on_ctrl(core: PathHost, peer: str, msg: CtrlMsg) -> None:
    """The next head broker has rewritten its tables: stop ignoring its withdrawals."""
    expect(core, peer, msg)
    del core.path_roles[msg.xid]
    core.ignore.get(peer, {}).pop(msg.xid, None)
