"""Underlay-aware chain order (papers 001 and 003): a broker announces its neighbours in the
order of its repair chain, chosen from where they run, so that the standby links the chain implies
cross nodes and zones wherever the cluster has more than one. Unknown placement keeps the order
by name, which is what brokers that know nothing (and every test before placement) rely on."""

from __future__ import annotations

import itertools
import random

from hypothesis import given
from hypothesis import strategies as st

from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.messages import AddLink, FromLink, Neighbours, Placed, SendToLink
from canopy_broker.core.repair import NOWHERE, Where, chain_links, chain_order, standby_peers


def same_zone_pairs(order: tuple[str, ...], where: dict[str, Where]) -> int:
    return sum(where[a][0] == where[b][0] for a, b in itertools.pairwise(order))


def test_knowing_nothing_the_order_is_by_name() -> None:
    assert chain_order(NOWHERE, ["c", "a", "b"], {}) == ("a", "b", "c")
    assert chain_order(("z1", "n1"), ["c", "a", "b"], {}) == ("a", "b", "c")


def test_the_announcers_own_domain_goes_last_and_zones_alternate() -> None:
    where = {
        "a": ("z1", "n1"),  # the announcer's node
        "b": ("z1", "n2"),  # its zone, another node
        "c": ("z2", "n3"),
        "d": ("z2", "n4"),
        "e": ("z3", "n5"),
    }
    order = chain_order(("z1", "n1"), where, where)
    assert order == ("c", "e", "d", "b", "a")
    # Whichever of the others dies with the announcer's zone, c, e and d stay one chain.
    assert set(order[:3]) == {"c", "d", "e"}


def test_within_a_zone_the_nodes_alternate() -> None:
    where = {"a": ("z", "n1"), "b": ("z", "n1"), "c": ("z", "n2"), "d": ("z", "n2")}
    assert chain_order(NOWHERE, where, where) == ("a", "c", "b", "d")


zones = st.sampled_from(["", "z1", "z2", "z3"])
nodes = st.sampled_from(["", "n1", "n2", "n3", "n4", "n5"])


@given(
    own=st.tuples(zones, nodes),
    where=st.dictionaries(st.text("abcdefgh", min_size=1, max_size=2), st.tuples(zones, nodes)),
)
def test_chain_order_is_a_permutation_with_the_fewest_same_zone_neighbours(
    own: Where, where: dict[str, Where]
) -> None:
    order = chain_order(own, where, where)
    assert sorted(order) == sorted(where)

    def group(n: str) -> int:
        if own[1] and where[n][1] == own[1]:
            return 2
        return 1 if own[0] and where[n][0] == own[0] else 0

    groups = [group(n) for n in order]
    assert groups == sorted(groups)  # other zones, then own zone, then own node
    for g in set(groups):
        members = tuple(n for n in order if group(n) == g)
        counts = [sum(where[n][0] == z for n in members) for z in {where[n][0] for n in members}]
        fewest = max(0, 2 * max(counts) - len(members) - 1)
        assert same_zone_pairs(members, where) == fewest, (members, where)


def test_placement_travels_with_the_list_and_orders_the_neighbours_announcement() -> None:
    core = BrokerCore("n", announce_neighbours=True)
    for peer in ("a", "b", "c", "d"):
        core.handle(AddLink(peer))
    placed = {"a": ("z1", "n2"), "b": ("z2", "n3"), "c": ("z3", "n4"), "d": ("z2", "n5")}
    for peer, (zone, node) in placed.items():
        core.handle(FromLink(peer, Neighbours(("n",), zone, node)))
    out = core.handle(Placed("z1", "n1"))
    sent = {e.peer: e.message for e in out if isinstance(e, SendToLink)}
    assert set(sent) == {"a", "b", "c", "d"}
    msg = sent["a"]
    # With the others' lists (two hops, for a bridge), never a's own.
    lists = (("b", ("n",)), ("c", ("n",)), ("d", ("n",)))
    assert msg == Neighbours(("b", "c", "d", "a"), "z1", "n1", lists=lists)
    # What each neighbour keeps warm for n's death: never a broker of n's zone but for a,
    # which is in n's zone itself and has the last place.
    lists = {"n": msg.names}  # type: ignore[union-attr]
    peers = {p: standby_peers(p, ["n"], lists) for p in placed}
    assert peers == {"a": ("d",), "b": ("c",), "c": ("b", "d"), "d": ("a", "c")}
    assert core.handle(Placed("z1", "n1")) == []  # nothing changed: nothing said again


def test_a_neighbour_that_moves_zone_reorders_the_list() -> None:
    core = BrokerCore("n", announce_neighbours=True)
    for peer in ("a", "b", "c"):
        core.handle(AddLink(peer))
    core.handle(Placed("z1", "n1"))
    out = core.handle(FromLink("a", Neighbours(("n",), "z1", "n1")))  # a shares n's node
    names = {e.message.names for e in out if isinstance(e, SendToLink)}  # type: ignore[union-attr]
    assert names == {("b", "c", "a")}


def test_chain_order_keeps_repair_symmetric_on_random_placed_trees() -> None:
    """Both ends of every chain link read it from the same announced list, whatever order
    placement gives it: the link is wanted at both ends, never at one only."""
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(3, 25)
        names = [f"b{i}" for i in range(n)]
        where = {b: (rng.choice("xyz"), rng.choice("12345")) for b in names}
        nbrs: dict[str, list[str]] = {b: [] for b in names}
        for i in range(1, n):
            p = names[rng.randrange(i)]
            nbrs[names[i]].append(p)
            nbrs[p].append(names[i])
        lists = {b: chain_order(where[b], nbrs[b], where) for b in names}
        for dead in names:
            for m in nbrs[dead]:
                for t in chain_links(lists[dead], m):
                    assert m in chain_links(lists[dead], t)
