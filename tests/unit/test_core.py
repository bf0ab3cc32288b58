"""The sans-I/O broker core: forwarding rules, protocol errors at the boundary, determinism."""

from __future__ import annotations

import pytest

from canopy_broker.core.broker import BrokerCore, ProtocolError
from canopy_broker.core.events import Event
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import (
    AddLink,
    ClientAttach,
    ClientDetach,
    ClientPublish,
    ClientPublisherGap,
    ClientSubscribe,
    ClientUnsubscribe,
    Deliver,
    FromLink,
    Publish,
    PublisherGap,
    RemoveLink,
    RouteKey,
    RoutingMode,
    SendToLink,
    Subscribe,
    TellGap,
    Unsubscribe,
)

F = Filter.parse


def hub(mode: RoutingMode) -> BrokerCore:
    core = BrokerCore("hub", mode)
    for peer in ("n1", "n2"):
        core.handle(AddLink(peer))
    core.handle(ClientAttach("c"))
    return core


def sent(effects: list[object]) -> list[tuple[str, str, str]]:
    out = []
    for e in effects:
        assert isinstance(e, SendToLink)
        msg = e.message
        assert isinstance(msg, Subscribe | Unsubscribe)
        out.append((e.peer, type(msg).__name__, str(msg.key)))
    return out


def test_covering_suppresses_covered_and_reforwards_on_unsubscribe() -> None:
    core = hub(RoutingMode.COVERING)
    assert sent(core.handle(ClientSubscribe("c", "1", F("x < 10")))) == [
        ("n1", "Subscribe", "x < 10"),
        ("n2", "Subscribe", "x < 10"),
    ]
    assert core.handle(ClientSubscribe("c", "2", F("x < 5"))) == []
    assert sent(core.handle(ClientUnsubscribe("c", "1"))) == [
        ("n1", "Subscribe", "x < 5"),
        ("n1", "Unsubscribe", "x < 10"),
        ("n2", "Subscribe", "x < 5"),
        ("n2", "Unsubscribe", "x < 10"),
    ]


def test_covering_subscription_replaces_covered_ones() -> None:
    core = hub(RoutingMode.COVERING)
    core.handle(ClientSubscribe("c", "1", F("x < 5")))
    assert sent(core.handle(FromLink("n1", Subscribe(RouteKey(F("x < 10")))))) == [
        ("n2", "Subscribe", "x < 10"),
        ("n2", "Unsubscribe", "x < 5"),
    ]


def test_identity_and_simple_modes() -> None:
    ident = hub(RoutingMode.IDENTITY)
    assert len(ident.handle(ClientSubscribe("c", "1", F("x < 10")))) == 2
    assert ident.handle(ClientSubscribe("c", "2", F("x < 10"))) == []
    assert len(ident.handle(ClientSubscribe("c", "3", F("x < 5")))) == 2
    simple = hub(RoutingMode.SIMPLE)
    simple.handle(ClientSubscribe("c", "1", F("x < 10")))
    assert sent(simple.handle(ClientSubscribe("c", "2", F("x < 10"))))[0] == (
        "n1",
        "Subscribe",
        "x < 10 #c/2",
    )


def test_events_go_to_matching_neighbours_except_source_and_to_local_clients() -> None:
    core = hub(RoutingMode.COVERING)
    core.handle(ClientSubscribe("c", "1", F("x < 10")))
    core.handle(ClientSubscribe("c", "2", F("x > 0")))
    core.handle(FromLink("n1", Subscribe(RouteKey(F("x exists")))))
    core.handle(FromLink("n2", Subscribe(RouteKey(F("x exists")))))
    out = core.handle(FromLink("n1", Publish(Event("p", 1, {"x": 3}, hops=1))))
    assert out == [
        SendToLink("n2", Publish(Event("p", 1, {"x": 3}, hops=2))),
        Deliver(Event("p", 1, {"x": 3}, hops=1), (("c", ("1", "2")),)),
    ]
    assert core.handle(FromLink("n1", Publish(Event("p", 2, {"y": 3})))) == []


@pytest.mark.parametrize(
    ("inp", "message"),
    [
        (FromLink("zz", Publish(Event("p", 1, {}))), "not a neighbour"),
        (ClientSubscribe("nobody", "1", F("x = 1")), "not attached"),
        (ClientSubscribe("c", "dup", F("x = 1")), "already has subscription"),
        (ClientUnsubscribe("c", "nope"), "no subscription"),
        (ClientPublish("c", Event("someone-else", 1, {})), "under its own id"),
        (ClientAttach("c"), "already attached"),
        (AddLink("n1"), "exists already"),
        (AddLink("hub"), "cannot link to itself"),
        (RemoveLink("zz"), "no link"),
        (FromLink("n1", Unsubscribe(RouteKey(F("q = 1")))), "never subscribed"),
        (FromLink("n1", Subscribe(RouteKey(F("k = 1")))), "subscribed twice"),
    ],
)
def test_illegal_inputs_raise_and_leave_state_unchanged(inp: object, message: str) -> None:
    core = hub(RoutingMode.COVERING)
    core.handle(ClientSubscribe("c", "dup", F("x = 1")))
    core.handle(FromLink("n1", Subscribe(RouteKey(F("k = 1")))))
    before = core.routing_table()
    with pytest.raises(ProtocolError, match=message):
        core.handle(inp)  # type: ignore[arg-type]
    assert core.routing_table() == before


def test_detach_and_remove_link_withdraw_everything() -> None:
    core = hub(RoutingMode.COVERING)
    core.handle(ClientSubscribe("c", "1", F("x < 10")))
    core.handle(FromLink("n1", Subscribe(RouteKey(F("y = 1")))))
    out = sent(core.handle(ClientDetach("c")))
    assert ("n1", "Unsubscribe", "x < 10") in out and ("n2", "Unsubscribe", "x < 10") in out
    assert sent(core.handle(RemoveLink("n1"))) == [("n2", "Unsubscribe", "y = 1")]
    assert core.routing_table_size() == 0
    # A new link immediately learns what the broker holds.
    core.handle(FromLink("n2", Subscribe(RouteKey(F("z = 1")))))
    assert sent(core.handle(AddLink("n3"))) == [("n3", "Subscribe", "z = 1")]


def test_a_publisher_gap_reaches_every_broker_of_the_tree_once() -> None:
    """Flooded over the tree: from the publisher's broker to every neighbour, from each on to
    every neighbour but the one it came from; each broker tells its subscribers once. Nothing
    goes back, so a tree carries it exactly once per link."""
    cores = {n: BrokerCore(n, RoutingMode.COVERING) for n in ("a", "b", "c", "d")}
    for x, y in (("a", "b"), ("b", "c"), ("b", "d")):
        cores[x].handle(AddLink(y))
        cores[y].handle(AddLink(x))
    cores["a"].handle(ClientAttach("p"))
    pending = [("a", cores["a"].handle(ClientPublisherGap("p", 100.0, 110.0)))]
    told: list[str] = []
    links: list[tuple[str, str]] = []
    while pending:
        at, effects = pending.pop()
        for e in effects:
            if isinstance(e, TellGap):
                assert (e.publisher, e.since, e.until) == ("p", 100.0, 110.0)
                told.append(at)
            else:
                assert isinstance(e, SendToLink) and isinstance(e.message, PublisherGap)
                links.append((at, e.peer))
                pending.append((e.peer, cores[e.peer].handle(FromLink(at, e.message))))
    assert sorted(told) == ["a", "b", "c", "d"]
    assert sorted(links) == [("a", "b"), ("b", "c"), ("b", "d")]
    with pytest.raises(ProtocolError):  # only an attached client tells of its own gap
        cores["b"].handle(ClientPublisherGap("stranger", 1.0, 2.0))
