"""The checkers must be able to fail: each broken router below is caught.

These are the negative controls for ``test_routing``: a checker that never fails proves nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import (
    ClientPublish,
    Deliver,
    Effect,
    FromLink,
    Input,
    Publish,
    RouteKey,
    RoutingMode,
    SendToLink,
    Unsubscribe,
)
from canopy_broker.core.routing import RoutingState
from canopy_broker.sim.checker import (
    DeliveryRecord,
    DeliveryReport,
    PubRecord,
    SubRecord,
    check_deliveries,
    check_routing,
)
from canopy_broker.sim.simulator import Simulator
from canopy_broker.sim.topology import random_tree


class LossyCore(BrokerCore):
    """Drops every 7th notification it forwards."""

    n = 0

    def handle(self, inp: Input, now: float = 0.0) -> list[Effect]:
        out = []
        for e in super().handle(inp, now):
            if isinstance(e, SendToLink) and isinstance(e.message, Publish):
                LossyCore.n += 1
                if LossyCore.n % 7 == 0:
                    continue
            out.append(e)
        return out


class DuplicatingCore(BrokerCore):
    """Delivers every 5th local notification twice."""

    n = 0

    def handle(self, inp: Input, now: float = 0.0) -> list[Effect]:
        out: list[Effect] = []
        for e in super().handle(inp, now):
            out.append(e)
            if isinstance(e, Deliver):
                for target in e.targets:
                    DuplicatingCore.n += 1
                    if DuplicatingCore.n % 5 == 0:
                        out.append(Deliver(e.event, (target,)))
        return out


class ReorderingCore(BrokerCore):
    """Holds back each odd notification of a publisher until the next one has gone out."""

    def __init__(self, name: str, mode: RoutingMode) -> None:
        super().__init__(name, mode)
        self.held: dict[tuple[str, str], Deliver] = {}

    def handle(self, inp: Input, now: float = 0.0) -> list[Effect]:
        out: list[Effect] = []
        for effect in super().handle(inp, now):
            if not isinstance(effect, Deliver):
                out.append(effect)
                continue
            for target in effect.targets:  # one client at a time
                e = Deliver(effect.event, (target,))
                key = (target[0], e.event.publisher)
                if key in self.held:
                    out.append(e)
                    out.append(self.held.pop(key))
                elif e.event.seq % 2:
                    self.held[key] = e
                else:
                    out.append(e)
        return out


class PromiscuousCore(BrokerCore):
    """Delivers every notification to every local client, matching or not."""

    def handle(self, inp: Input, now: float = 0.0) -> list[Effect]:
        out = super().handle(inp, now)
        event = inp.event if isinstance(inp, ClientPublish) else None
        if isinstance(inp, FromLink) and isinstance(inp.message, Publish):
            event = inp.message.event
        if event is not None:
            done = {t[0] for e in out if isinstance(e, Deliver) for t in e.targets}
            rest = tuple((c, ()) for c in self.clients if c not in done)
            if rest:
                out.append(Deliver(event, rest))
        return out


class ForgetfulRouting(RoutingState):
    """Covering routing that forgets to re-forward what a withdrawn filter covered."""

    def _key_left(self, peer: str, key: RouteKey, out: list[Effect]) -> None:
        adv = self._adv[peer]
        if key in adv:
            adv.discard(key)
            out.append(SendToLink(peer, Unsubscribe(key)))


def ForgetfulCore(name: str, mode: RoutingMode) -> BrokerCore:  # noqa: N802 - a core factory
    return BrokerCore(name, routing=ForgetfulRouting(mode))


def run(factory: Callable[[str, RoutingMode], BrokerCore]) -> tuple[DeliveryReport, list[str]]:
    rng = random.Random(11)
    n = 25
    sim = Simulator(
        [f"b{i}" for i in range(n)],
        random_tree(n, rng),
        mode=RoutingMode.COVERING,
        seed=11,
        core_factory=factory,
    )
    for i in range(20):
        sim.attach(f"c{i}", f"b{rng.randrange(n)}", at=0)
        sim.subscribe(f"c{i}", "wide", Filter.parse(f"x < {5 + i % 3}"), at=1)
        sim.subscribe(f"c{i}", "narrow", Filter.parse(f"x < {1 + i % 3}"), at=1)
    for i in range(20):
        sim.unsubscribe(f"c{i}", "wide", at=100)
    for k in range(300):
        sim.publish(f"c{k % 4}", {"x": k % 8}, at=400 + k)
    sim.run()
    report = check_deliveries(sim.subs, sim.publications(), sim.deliveries)
    problems = check_routing(sim.cores, sim.edges, sim.subscriptions_by_broker())
    return report, problems


def test_correct_router_passes_the_same_scenario() -> None:
    report, problems = run(BrokerCore)
    assert report.ok and report.owed > 1000 and not problems, (str(report), problems)


@pytest.mark.parametrize(
    ("factory", "symptom"),
    [
        (LossyCore, "lost"),
        (DuplicatingCore, "duplicated"),
        (ReorderingCore, "reordered"),
        (PromiscuousCore, "spurious"),
        (ForgetfulCore, "lost"),
    ],
)
def test_checker_catches_broken_router(
    factory: Callable[[str, RoutingMode], BrokerCore], symptom: str
) -> None:
    report, _ = run(factory)
    assert not report.ok
    assert report.summary()[symptom] > 0, str(report)


def test_routing_check_catches_stale_and_missing_entries() -> None:
    _, problems = run(ForgetfulCore)
    assert any("missing" in p for p in problems), problems[:3]


def test_causal_check_on_hand_made_records() -> None:
    """q's notification 1 was published after q saw p:1, so anyone receiving both must get p:1
    first; c2 does not."""
    f = Filter.parse("x exists")
    subs = [SubRecord(c, "s", f, issued_at=0, settled_at=0) for c in ("c1", "c2")]
    pubs = [
        PubRecord("p", 1, {"x": 1}, 1, 2, vc={"p": 1}),
        PubRecord("q", 1, {"x": 2}, 3, 4, vc={"p": 1, "q": 1}),
    ]
    good = [DeliveryRecord("c1", "p", 1, 2), DeliveryRecord("c1", "q", 1, 4)]
    bad = [DeliveryRecord("c2", "q", 1, 4), DeliveryRecord("c2", "p", 1, 5)]
    report = check_deliveries(subs, pubs, good + bad)
    assert report.causal == [("c2", "p", 1)]
    assert report.ok and not report.causal_ok
