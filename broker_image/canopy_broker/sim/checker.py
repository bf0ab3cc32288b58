"""The exact delivery checker and the canonical routing tables.

The checker decides, centrally and without trusting any broker, who was owed each notification,
and compares that with what was delivered. It works on plain records, so the same checker judges
simulator runs, integration tests with real processes and the demo.

**Owed** (DESIGN.md §4): a notification is owed to a client if one of the client's subscriptions
matches it, had *settled* (was established everywhere) before the notification was published, and
was not withdrawn before the notification's life ended (its last copy was handled). Such a
notification must arrive exactly once. A delivery is **spurious** if no subscription of the client
that matches it had been issued and was still in force at its broker when it was delivered.
**Duplicates** are the same notification delivered to a client more than once. **Reordered**
deliveries break a publisher's sequence order at a subscriber.

**Under faults** (DESIGN.md §7) the guarantee is for the clients *not* attached to a broker that
died: :func:`check_faults` splits the clients into survivors, held to it, and victims, whose
figures are reported beside them. A victim publisher's notifications may be lost (they may have
died with its broker), so none is owed; what of them is delivered still counts for duplicates,
order and spuriousness.

Canonical routing tables follow the forwarding rule of the core (see ``core.broker``): what X
advertises to Y is the maximal set of the keys X holds from every source other than Y.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cache

from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.events import Value
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import RouteKey, RoutingMode
from canopy_broker.core.routing import client_key, maximal


@dataclass(frozen=True, slots=True)
class SubRecord:
    """One subscription's life (times in one clock): issued by the client, settled everywhere,
    withdrawn by the client, and gone from its broker (the withdrawal took effect there)."""

    client: str
    sub_id: str
    filter: Filter
    issued_at: float
    settled_at: float = math.inf
    withdrawn_at: float = math.inf
    gone_at: float = math.inf

    def settled(self, t: float) -> SubRecord:
        return replace(self, settled_at=min(self.settled_at, t))

    def withdrawn(self, t: float) -> SubRecord:
        return replace(self, withdrawn_at=t)

    def gone(self, t: float) -> SubRecord:
        return replace(self, gone_at=min(self.gone_at, t))


@dataclass(frozen=True, slots=True)
class PubRecord:
    """One notification's life: published, last copy handled."""

    publisher: str
    seq: int
    attrs: Mapping[str, Value]
    published_at: float
    ended_at: float
    # Vector clock: for each publisher, the highest of its sequence numbers that causally
    # precede (or are) this notification. None when causality was not tracked.
    vc: Mapping[str, int] | None = None

    def ended(self, t: float) -> PubRecord:
        return replace(self, ended_at=max(self.ended_at, t))


@dataclass(frozen=True, slots=True)
class DeliveryRecord:
    client: str
    publisher: str
    seq: int
    at: float


_PROBLEMS = ("lost", "duplicated", "reordered", "spurious")


@dataclass
class DeliveryReport:
    owed: int = 0
    delivered: int = 0
    lost: list[tuple[str, str, int]] = field(default_factory=list)
    duplicated: list[tuple[str, str, int]] = field(default_factory=list)
    reordered: list[tuple[str, str, int]] = field(default_factory=list)
    spurious: list[tuple[str, str, int]] = field(default_factory=list)
    # Deliveries that came after a notification which causally depends on them (across
    # publishers; same-publisher inversions are counted as reordered).
    causal: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Exactly once and FIFO per publisher (causal order is judged separately)."""
        return not (self.lost or self.duplicated or self.reordered or self.spurious)

    @property
    def causal_ok(self) -> bool:
        return self.ok and not self.causal

    def by_subscriber(self) -> dict[str, dict[str, int]]:
        """Per client: how many of its notifications were lost, duplicated, reordered, spurious
        (only clients with at least one problem appear)."""
        out: dict[str, dict[str, int]] = {}
        for name in ("lost", "duplicated", "reordered", "spurious"):
            for client, _, _ in getattr(self, name):
                counts = out.setdefault(client, dict.fromkeys(_PROBLEMS, 0))
                counts[name] += 1
        return out

    def summary(self) -> dict[str, int]:
        return {
            "owed": self.owed,
            "delivered": self.delivered,
            "lost": len(self.lost),
            "duplicated": len(self.duplicated),
            "reordered": len(self.reordered),
            "spurious": len(self.spurious),
            "causal": len(self.causal),
        }

    def __str__(self) -> str:
        s = self.summary()
        verdict = "OK" if self.ok else "FAILED"
        return (
            f"{verdict}: {s['delivered']} delivered, {s['owed']} owed, {s['lost']} lost, "
            f"{s['duplicated']} duplicated, {s['reordered']} reordered, {s['spurious']} spurious"
        )


def check_deliveries(
    subs: Iterable[SubRecord],
    pubs: Iterable[PubRecord],
    deliveries: Iterable[DeliveryRecord],
    *,
    owed_from: Collection[str] | None = None,
) -> DeliveryReport:
    """Compare deliveries with what each subscription was owed (see the module docstring).

    ``owed_from``: only these publishers' notifications are owed (default: all); the others'
    deliveries are still checked for duplicates, order and spuriousness."""
    report = DeliveryReport()
    subs_by_client: dict[str, list[SubRecord]] = defaultdict(list)
    for s in subs:
        subs_by_client[s.client].append(s)
    pub_index = {(p.publisher, p.seq): p for p in pubs}

    seen: set[tuple[str, str, int]] = set()
    last_seq: dict[tuple[str, str], int] = {}
    # Per client and publisher: the highest sequence number some delivered notification depends on.
    bound: dict[str, dict[str, int]] = defaultdict(dict)
    for d in deliveries:
        report.delivered += 1
        key = (d.client, d.publisher, d.seq)
        if key in seen:
            report.duplicated.append(key)
            continue
        seen.add(key)
        stream = (d.client, d.publisher)
        pub = pub_index.get((d.publisher, d.seq))
        if d.seq < last_seq.get(stream, 0):
            report.reordered.append(key)
        elif d.seq <= bound[d.client].get(d.publisher, 0):
            report.causal.append(key)
        last_seq[stream] = max(d.seq, last_seq.get(stream, 0))
        if pub is not None and pub.vc is not None:
            b = bound[d.client]
            for q, n in pub.vc.items():
                if n > b.get(q, 0):
                    b[q] = n
        if pub is None or not any(
            s.filter.matches(pub.attrs) and s.issued_at <= d.at <= s.gone_at
            for s in subs_by_client.get(d.client, ())
        ):
            report.spurious.append(key)

    for pub in pub_index.values():
        if owed_from is not None and pub.publisher not in owed_from:
            continue
        for client, client_subs in subs_by_client.items():
            if any(
                s.settled_at <= pub.published_at
                and s.withdrawn_at >= pub.ended_at
                and s.filter.matches(pub.attrs)
                for s in client_subs
            ):
                report.owed += 1
                if (client, pub.publisher, pub.seq) not in seen:
                    report.lost.append((client, pub.publisher, pub.seq))
    return report


@dataclass
class FaultReport:
    """Deliveries under faults: the survivors' report (the guarantee) and the victims'."""

    survivors: DeliveryReport
    victims: DeliveryReport
    victim_clients: frozenset[str]

    @property
    def ok(self) -> bool:
        return self.survivors.ok

    def by_subscriber(self) -> dict[str, dict[str, int]]:
        """Per subscriber with a problem, survivors and victims alike (victims are marked)."""
        out = self.survivors.by_subscriber()
        for client, counts in self.victims.by_subscriber().items():
            out[client] = {**counts, "victim": 1}
        return out

    def __str__(self) -> str:
        return f"survivors {self.survivors}; victims {sorted(self.victim_clients)}: {self.victims}"


def check_faults(
    subs: Iterable[SubRecord],
    pubs: Iterable[PubRecord],
    deliveries: Iterable[DeliveryRecord],
    victims: Collection[str],
) -> FaultReport:
    """:func:`check_deliveries` for survivors and victims apart (see the module docstring):
    ``victims`` are the clients of brokers that died."""
    subs, pubs, deliveries = list(subs), list(pubs), list(deliveries)
    survivors = {p.publisher for p in pubs} - set(victims)

    def report(victim: bool) -> DeliveryReport:
        return check_deliveries(
            [s for s in subs if (s.client in victims) is victim],
            pubs,
            [d for d in deliveries if (d.client in victims) is victim],
            owed_from=survivors,
        )

    return FaultReport(report(False), report(True), frozenset(victims))


# --------------------------------------------------------------------------- routing tables


def canonical_tables(
    edges: Iterable[tuple[str, str]],
    subscriptions: Mapping[str, Iterable[tuple[str, str, Filter]]],
    mode: RoutingMode,
) -> dict[str, dict[str, frozenset[RouteKey]]]:
    """For every broker Y and neighbour X: the keys Y must hold from X.

    ``subscriptions`` maps each broker to its local (client, sub_id, filter) triples.
    """
    neighbours: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        neighbours[a].add(b)
        neighbours[b].add(a)
    local = {
        broker: [client_key(mode, c, s, f) for c, s, f in subs]
        for broker, subs in subscriptions.items()
    }

    @cache
    def advertised(x: str, y: str) -> frozenset[RouteKey]:
        keys: list[RouteKey] = list(local.get(x, ()))
        for z in sorted(neighbours[x] - {y}):
            keys.extend(advertised(z, x))
        return frozenset(maximal(keys, mode))

    brokers = set(neighbours) | set(subscriptions)
    return {y: {x: advertised(x, y) for x in sorted(neighbours[y])} for y in sorted(brokers)}


def check_routing(
    cores: Mapping[str, BrokerCore],
    edges: Iterable[tuple[str, str]],
    subscriptions: Mapping[str, Iterable[tuple[str, str, Filter]]],
) -> list[str]:
    """Differences between every broker's routing table and the canonical one (empty = equal)."""
    cores = dict(cores)
    if not cores:
        return []
    mode = next(iter(cores.values())).mode
    expected = canonical_tables(edges, subscriptions, mode)
    problems: list[str] = []
    for name, core in sorted(cores.items()):
        table = core.routing_table()
        want = expected.get(name, {})
        if set(table.links) != set(want):
            problems.append(
                f"{name}: neighbours {sorted(table.links)} but the tree says {sorted(want)}"
            )
        for peer in sorted(set(table.links) & set(want)):
            have = table.links[peer]
            if have != want[peer]:
                missing = sorted(map(str, want[peer] - have))
                stale = sorted(map(str, have - want[peer]))
                problems.append(f"{name} from {peer}: missing {missing}, stale {stale}")
        subs = {(c, s): f for c, s, f in subscriptions.get(name, ())}
        have_subs = {(c, s): f for c, cs in table.clients.items() for s, f in cs.items()}
        if have_subs != subs:
            problems.append(f"{name}: local subscriptions differ from the clients' view")
    return problems
