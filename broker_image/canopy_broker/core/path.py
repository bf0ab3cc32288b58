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

from typing import TYPE_CHECKING

from canopy_broker.core.errors import ProtocolError
from canopy_broker.core.exchange import validate_path
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
    Subscribe,
    Unsubscribe,
)

if TYPE_CHECKING:
    from canopy_broker.core.broker import BrokerCore


def _keys(ks: set[RouteKey] | frozenset[RouteKey]) -> tuple[RouteKey, ...]:
    return tuple(sorted(ks, key=RouteKey.sort_key))


def start(core: BrokerCore, req: StartExchange, out: list[Effect]) -> None:
    """At R1: the head path starts here."""
    try:
        k = validate_path(req.path, req.remove)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    if core.mode is RoutingMode.COVERING:
        raise ProtocolError(
            "the path algorithm needs identity or simple routing; covering overlays use the "
            "coordinated algorithm"
        )
    if req.path[k] != core.name:
        raise ProtocolError(f"{core.name}: the path algorithm starts at R1 = {req.path[k]}")
    r = req.path[k + 1]
    if r not in core._from_link:
        raise ProtocolError(f"{core.name}: no link to {r} to remove")
    p_add = _keys(core._from_link[r])
    _head_step(core, RecMsg(req.xid, req.path, k, p_add, p_add), k, r, out)


def _next_on_head(path: tuple[str, ...], i: int) -> str:
    """Towards A1, and from A1 across the new link to A2."""
    return path[i - 1] if i > 0 else path[-1]


def _head_step(core: BrokerCore, msg: RecMsg, i: int, prev: str, out: list[Effect]) -> None:
    """Rewrite this broker's tables for head-path position ``i``; ``msg`` came from ``prev``."""
    xid, path, k = msg.xid, msg.path, msg.k
    p_add, p_del = frozenset(msg.p_add), frozenset(msg.p_del)
    nxt = _next_on_head(path, i)
    at_r1 = i == k
    if i == 0:  # A1: the new link exists from now on, held back until A2 has it
        core._from_link[nxt] = set()
        core._advertised[nxt] = set()
        core._frozen.add(nxt)
        out.append(OpenLink(nxt))
    # Rewrite without the ordinary advertisements: both neighbours on the path learn the
    # change from RECMSG itself.
    was_frozen = {p for p in (prev, nxt) if p in core._frozen}
    core._frozen.update((prev, nxt))
    table_next = core._from_link[nxt]
    for key in _keys(p_add):
        if key not in table_next:
            table_next.add(key)
            core._matcher.add(key.filter, nxt)
            core._key_added(key, nxt, out)
    table_prev = core._from_link[prev]
    for key in _keys(p_del & table_prev):
        table_prev.remove(key)
        core._matcher.remove(key.filter, prev)
        core._key_removed(key, prev, out)
    if at_r1:  # the removed link is gone at this end
        del core._from_link[prev]
        del core._advertised[prev]
        out.append(CloseLink(prev))
    else:
        core._advertised[prev] = core._wanted_by(prev)
        out.append(SendToLink(prev, CtrlMsg(xid)))
    core._frozen -= {prev, nxt} - was_frozen
    if i == 0:
        # A1 advertises over the new link only once A2 has it (LINKREADY): nothing sent yet.
        core._frozen.add(nxt)
        out.append(SendToPeer(nxt, RecMsg(xid, path, k, _keys(p_add))))
        return
    new_next = core._wanted_by(nxt)
    p_del_next = frozenset(core._advertised[nxt] - new_next)
    core._advertised[nxt] = new_next
    core._ignore.setdefault(nxt, {})[xid] = set(p_add)
    out.append(SendToLink(nxt, RecMsg(xid, path, k, _keys(p_add), _keys(p_del_next))))


def on_recmsg(core: BrokerCore, peer: str, msg: RecMsg, out: list[Effect]) -> None:
    path, k = msg.path, msg.k
    i = path.index(core.name)
    last = len(path) - 1
    if i <= k:  # head path
        _head_step(core, msg, i, peer, out)
        return
    if i == last and peer == path[0]:  # A2, across the new link (out of band)
        core._from_link[peer] = set()
        core._advertised[peer] = set(msg.p_add)  # what A1 believes we advertise
        core._frozen.add(peer)
        out.append(OpenLink(peer))
        out.append(SendToLink(peer, LinkReady(msg.xid)))
    _tail_step(core, msg, i, out)


def _tail_step(core: BrokerCore, msg: RecMsg, i: int, out: list[Effect]) -> None:
    path, k = msg.path, msg.k
    if i > k + 1:
        out.append(SendToLink(path[i - 1], RecMsg(msg.xid, path, k)))
        return
    # R2: drop the removed link the ordinary way; withdrawals go up the tail path only as far
    # as they must, then FLUSHMSG follows them to A2.
    r1 = path[k]
    if r1 in core._from_link:
        core._remove_link(r1, out)
        out.append(CloseLink(r1))
    on_flush(core, FlushMsg(msg.xid, path), out)


def on_flush(core: BrokerCore, msg: FlushMsg, out: list[Effect]) -> None:
    """Up the tail path to A2, where the reconfiguration completes: A2 advertises across the new
    link the difference to what A1 believes it advertises (P_add)."""
    path = msg.path
    i = path.index(core.name)
    if i < len(path) - 1:
        out.append(SendToLink(path[i + 1], msg))
        return
    unfreeze_and_reconcile(core, path[0], out)
    out.append(ExchangeFinished(msg.xid, True))


def on_link_ready(core: BrokerCore, peer: str, out: list[Effect]) -> None:
    """At A1: A2 has the new link; advertise over it normally from now on."""
    unfreeze_and_reconcile(core, peer, out)


def unfreeze_and_reconcile(core: BrokerCore, peer: str, out: list[Effect]) -> None:
    """Advertise over ``peer`` exactly the difference to what it holds from us."""
    core._frozen.discard(peer)
    want = core._wanted_by(peer)
    have = core._advertised[peer]
    for key in _keys(want - have):
        out.append(SendToLink(peer, Subscribe(key)))
    for key in _keys(have - want):
        out.append(SendToLink(peer, Unsubscribe(key)))
    core._advertised[peer] = want
