"""Reconfiguration overhead, measured the way paper 002 does (hop-weighted message costs).

Every message a reconfiguration causes costs its weight times the overlay hops it travels:

* notifications, subscriptions, unsubscriptions (and relayed routing changes): 1.0;
* a message carrying pattern sets (paper 002's RECMSG; our out-of-band ``Transfer`` and the
  ``Done`` that carries an A end's advertisement) costs ``2·|patterns|/3 + 1/3`` — a fixed header
  part plus a part that grows with the patterns;
* small protocol messages: 0.1 for acknowledgement-like ones (paper 002's CTRLMSG; our Granted, Go,
  LockRefused, Separator, Echo, End, RelayEnd), 0.2 for one that carries the path
  (paper 002's FLUSHMSG; our Lock).

Out-of-band messages travel between two brokers of the cycle; they are charged the number of
overlay hops between them along the cycle path (a conservative stand-in for the underlay route),
or one hop between the two ends of the new link.

*Misrouted* notifications are link traversals that led to no delivery — copies following stale
routes during a reconfiguration, or (in our algorithm) copies of the wrong colour that stop at the
removed or added link. With canonical routing tables there are none, so in a run whose
subscriptions do not change, every misrouted traversal is reconfiguration overhead too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from canopy_broker.core.messages import (
    Done,
    Publish,
    RecMsg,
    Relay,
    RelayEnd,
    Separator,
    Transfer,
)
from canopy_broker.sim.checker import DeliveryRecord

WEIGHTS: Mapping[str, float] = {
    "Subscribe": 1.0,
    "Unsubscribe": 1.0,
    "Relay": 1.0,
    "Lock": 0.2,
    "LockRefused": 0.1,
    "Granted": 0.1,
    "Go": 0.1,
    "Separator": 0.1,
    "Echo": 0.1,
    "End": 0.1,
    "RelayEnd": 0.1,
    # Paper 002's own messages: CTRLMSG 0.1, FLUSHMSG 0.2 (it names the path); our LinkReady is
    # an acknowledgement like CTRLMSG.
    "CtrlMsg": 0.1,
    "FlushMsg": 0.2,
    "LinkReady": 0.1,
}

Traffic = Iterable[tuple[float, str, str, object]]


def message_weight(msg: object) -> float:
    if isinstance(msg, Transfer | Done):
        return 2 * len(msg.keys) / 3 + 1 / 3
    if isinstance(msg, RecMsg):  # paper 002's RECMSG weight, with its two pattern sets
        return 2 * (len(msg.p_add) + len(msg.p_del)) / 3 + 1 / 3
    return WEIGHTS.get(type(msg).__name__, 0.0)


@dataclass
class Overhead:
    by_type: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    control: float = 0.0
    misrouted: int = 0

    @property
    def total(self) -> float:
        return self.control + self.misrouted

    def to_json(self) -> dict[str, object]:
        return {
            "total": round(self.total, 2),
            "control": round(self.control, 2),
            "misrouted": self.misrouted,
            "by_type": {k: round(v, 2) for k, v in sorted(self.by_type.items())},
        }


def measure(
    traffic: Traffic,
    deliveries: Iterable[DeliveryRecord],
    client_broker: Mapping[str, str],
    paths: Mapping[str, tuple[str, ...]],
    since: float = 0.0,
) -> Overhead:
    """Weighted control cost and misrouted notifications of everything sent after ``since``."""
    out = Overhead()
    hops_out: dict[tuple[str, int], dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for t, sender, receiver, msg in traffic:
        if t < since:
            continue
        if isinstance(msg, Publish):
            e = msg.event
            hops_out[(e.publisher, e.seq)][sender].append(receiver)
            continue
        hops = 1
        if isinstance(msg, Transfer | Relay | RelayEnd | Separator | RecMsg) and msg.xid in paths:
            path = paths[msg.xid]
            if {sender, receiver} == {path[0], path[-1]}:
                hops = 1  # the two ends of the new link
            elif sender in path and receiver in path:
                hops = abs(path.index(sender) - path.index(receiver))
        cost = message_weight(msg) * hops
        out.by_type[type(msg).__name__] += cost
        out.control += cost
    delivered_at: dict[tuple[str, int], set[str]] = defaultdict(set)
    for d in deliveries:
        if d.at >= since:
            delivered_at[(d.publisher, d.seq)].add(client_broker[d.client])
    for event, forwards in hops_out.items():
        out.misrouted += _wasted(forwards, delivered_at.get(event, set()))
    return out


def _wasted(forwards: Mapping[str, list[str]], delivered: set[str]) -> int:
    """Traversals of one notification that reached no delivery (iterative post-order)."""
    useful: dict[tuple[str, str], bool] = {}
    visiting: set[tuple[str, str]] = set()  # duplicates can make the graph cyclic
    wasted = 0
    for root_sender, receivers in forwards.items():
        for root_receiver in receivers:
            stack = [(root_sender, root_receiver, False)]
            while stack:
                x, y, expanded = stack.pop()
                if (x, y) in useful:
                    continue
                children = [z for z in forwards.get(y, ()) if z != x]
                if not expanded:
                    if (x, y) in visiting:
                        continue
                    visiting.add((x, y))
                    stack.append((x, y, True))
                    stack.extend(
                        (y, z, False)
                        for z in children
                        if (y, z) not in useful and (y, z) not in visiting
                    )
                    continue
                ok = y in delivered or any(useful.get((y, z), False) for z in children)
                useful[(x, y)] = ok
                wasted += not ok
    return wasted
