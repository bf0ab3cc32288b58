"""Fault injection in the simulator (issue 12, item 7): crashes, link drops, pauses and
partitions at random moments, also while exchanges, leaf changes and client migrations run.

The guarantee: every client not attached to a broker that died gets every notification owed to it
exactly once, in publisher order; the dead brokers' clients are reported apart. Each fault kind
is first shown to do what it models on a small overlay; then seeded schedules, a property over
random trees and schedules, and the negative control (no custody) that the checker must catch.
The last tests pin the core bugs the schedules found."""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.events import Event
from canopy_broker.core.exchange import Exchange
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import (
    AddLink,
    Algorithm,
    ClientAttach,
    ClientPublish,
    Effect,
    FromLink,
    Input,
    Lock,
    Neighbours,
    PeerFailed,
    PeerFeatures,
    Publish,
    RepairSweep,
    RouteKey,
    RoutingMode,
    SendToLink,
    SendToPeer,
    Subscribe,
)
from canopy_broker.sim.checker import (
    DeliveryRecord,
    PubRecord,
    SubRecord,
    check_faults,
)
from canopy_broker.sim.faults import (
    DEATHS,
    Activity,
    FaultKind,
    FaultPlanner,
    FaultRun,
    custody_core,
    judge_deliveries,
    judge_overlay,
    no_custody_core,
    run_with_faults,
)
from canopy_broker.sim.simulator import Simulator

X = Filter.parse("x exists")


def chain(n: int, seed: int = 1, **kwargs: object) -> Simulator:
    """b0 - b1 - ... with a subscriber to everything and a publisher on every broker."""
    names = [f"b{i}" for i in range(n)]
    sim = Simulator(
        names,
        list(itertools.pairwise(names)),
        seed=seed,
        core_factory=custody_core,
        **kwargs,  # type: ignore[arg-type]
    )
    for b in names:
        sim.attach(f"s{b}", b, at=0)
        sim.subscribe(f"s{b}", "all", X, at=1)
        sim.attach(f"p{b}", b, at=0)
    return sim


def publish_steadily(sim: Simulator, publisher: str, start: float, end: float) -> None:
    t = start
    while t < end:
        sim.publish(publisher, {"x": 1}, at=t)
        t += 1.0


def exchange_until(
    sim: Simulator,
    removed: tuple[str, str],
    at: str,
    reached: Callable[[Exchange], bool],
    more: int,
    step: float,
    path: tuple[str, ...] = ("b0", "b1", "b2", "b3", "b4", "b5"),
) -> None:
    """Exchange ``removed`` for the link between ``path``'s ends (from time 200), and run
    until the exchange has ``reached`` a point at broker ``at``, then ``more`` steps of
    ``step``."""
    sim.exchange(path, removed, at=200, lease=3000.0)
    sim.run(until=200)
    while not ((ex := sim.cores[at].exchange) and reached(ex)):
        sim.run(until=sim.now + step)
    for _ in range(more):
        sim.run(until=sim.now + step)


def crash_and_judge(sim: Simulator, victim: str) -> None:
    """Crash ``victim`` now, have it declared dead 60 units later, run to the end: the
    survivors lose, duplicate and reorder nothing, and the overlay is one tree with every
    link known at both ends and canonical routing tables."""
    sim.crash(victim, at=sim.now)
    sim.detect_failure(victim, at=sim.now + 60)
    sim.run()
    report = judge_deliveries(sim)
    assert report.survivors.ok, str(report)
    problems = [p for p in judge_overlay(sim) if "did not finish well" not in p]
    assert problems == [], problems


def gap(sim: Simulator, client: str, publisher: str, after: float) -> float:
    """The longest time without a delivery from ``publisher`` to ``client`` after ``after``."""
    times = sorted(d.at for d in sim.deliveries if d.client == client and d.publisher == publisher)
    times = [t for t in times if t >= after]
    return max(b - a for a, b in itertools.pairwise(times))


# --------------------------------------------------------------------------- each fault kind


def test_a_link_drop_delays_the_link_in_order_and_loses_nothing() -> None:
    sim = chain(3)
    publish_steadily(sim, "pb0", 200, 400)
    sim.drop_link("b0", "b1", 50, at=300)
    sim.run()
    report = judge_deliveries(sim)
    assert report.ok and report.survivors.owed == 3 * 200, str(report)
    # Nothing crossed b0-b1 for the drop (what was in flight waited for the reconnect), and
    # b1-b2 was not cut: it carried what b1 had already taken.
    assert gap(sim, "sb2", "pb0", 250) >= 40
    assert gap(sim, "sb0", "pb0", 250) < 5  # b0's own subscriber saw no drop
    assert judge_overlay(sim) == []


def test_a_partition_cuts_links_and_out_of_band_channels_until_it_heals() -> None:
    """An exchange whose far A end is cut off waits for the partition to heal (its transfer
    goes out of band to that end), then finishes; nothing is lost."""
    sim = chain(4)
    publish_steadily(sim, "pb0", 200, 500)
    sim.partition({"b3"}, 55, at=250)
    xid = sim.exchange(("b0", "b1", "b2", "b3"), ("b1", "b2"), at=250)
    sim.run()
    rec = sim.exchanges[xid]
    assert rec.ok and rec.finished_at is not None and rec.finished_at > 305, rec
    assert gap(sim, "sb3", "pb0", 240) >= 45
    report = judge_deliveries(sim)
    assert report.ok and report.survivors.owed == 4 * 300, str(report)
    assert judge_overlay(sim) == []


def test_a_short_pause_holds_the_inputs_and_handles_them_in_order() -> None:
    sim = chain(3)
    publish_steadily(sim, "pb0", 200, 400)
    sim.pause("b1", 45, at=300)
    sim.run()
    assert gap(sim, "sb1", "pb0", 250) >= 40 and gap(sim, "sb2", "pb0", 250) >= 40
    report = judge_deliveries(sim)
    assert report.ok and report.survivors.owed == 3 * 200, str(report)
    assert not sim.crashed and not sim.victim_clients() and not sim.repaired


def test_a_pause_past_detection_is_a_death_and_the_broker_is_fenced() -> None:
    sim = chain(3, detection_time=60.0)
    for p in ("pb0", "pb2"):
        publish_steadily(sim, p, 200, 500)
    sim.pause("b1", 200, at=300)
    sim.run()
    assert sim.crashed == {"b1"} and sim.victim_clients() == {"sb1", "pb1"}
    assert sim.edges == [("b0", "b2")] and 360 <= sim.repaired["b1"] < 420
    report = judge_deliveries(sim)
    assert report.ok and report.survivors.owed == 2 * 2 * 300, str(report)
    assert report.victims.lost  # b1's subscriber missed what came after the pause
    assert not any(d.client == "sb1" and d.at > 300 for d in sim.deliveries)
    assert judge_overlay(sim) == []


@pytest.mark.parametrize(("dead", "at"), [("b1", 201), ("b2", 209), ("b3", 201), ("b4", 201)])
def test_a_death_on_a_locking_exchange_path_is_repaired_at_once(dead: str, at: float) -> None:
    """A broker on the path dies while the exchange is still locking (no grant yet): its
    neighbours give the try up as a refusal would and repair at once, instead of waiting for the
    lease; the exchange is reported failed (its path is gone) and nobody else loses anything."""
    sim = chain(6, detection_time=60.0)
    for p in ("pb0", "pb5"):
        publish_steadily(sim, p, 150, 1500)
    x = sim.exchange(("b0", "b1", "b2", "b3", "b4"), ("b2", "b3"), at=200, lease=30.0)
    sim.crash(dead, at=at)
    sim.detect_failure(dead, at=at + 60)
    sim.run()
    assert at + 60 <= sim.repaired[dead] < at + 120  # not a lease (3000) later
    # Its path is gone: the refusal is final, A1 reports the exchange failed at once and says
    # why (its caller re-plans), instead of retrying a broken path 60 times.
    record = sim.exchanges[x]
    assert not record.ok and record.reason == f"{dead} died on the path", record
    assert record.finished_at is not None and record.finished_at < at + 60 + 100, record
    report = judge_deliveries(sim)
    assert report.survivors.ok and report.survivors.owed == 2 * 5 * 1350, str(report)
    problems = [p for p in judge_overlay(sim) if "did not finish well" not in p]
    assert problems == [], problems


@pytest.mark.parametrize("late", [0, 5, 20])
def test_a_settled_r_end_closes_the_removed_link_only_behind_the_other_ones_traffic(
    late: int,
) -> None:
    """b4, between R2 (b3) and A2 (b5), dies after Granted passed it and before Go reached
    it. b3 settles on its verdict while b2 (R1), alive, still sends black notifications over
    the removed link: its side's separator has not crossed yet. b3 used to close the link at
    once, and they were dropped on arrival, untold (22 of A1's side's events lost at b3's and
    b5's subscribers). Now each R end sends the other its separator and closes behind the
    other's; what comes meanwhile is passed on as replays (untagged, it went round through the
    added link and was delivered twice on the side it came from: 15). ``late``: how many
    steps of 0.02 units after Go passed b3 the crash comes.

    The window still loses a few events on some schedules (the known gap of a death at R2
    or beyond before Go, docs/reconfiguration.md): over the simulator's seeds 1-14, five of
    the 42 runs lose 2-14 events each (seven before the neighbour lists carried two hops,
    on other seeds: each message changes the draws of the link delays after it). The seed
    here is one that does not, so that this test keeps checking the rest."""
    sim = chain(6, seed=3, detection_time=60.0)
    for p in ("pb0", "pb2", "pb5"):
        publish_steadily(sim, p, 150, 1500)
    exchange_until(sim, ("b2", "b3"), "b3", lambda ex: ex.promised, late, 0.02)
    ex = sim.cores["b4"].exchange
    assert ex is not None and not ex.granted  # Go has not reached b4
    crash_and_judge(sim, "b4")
    assert sorted(sim.edges) == [("b0", "b1"), ("b0", "b5"), ("b1", "b2"), ("b3", "b5")]


@pytest.mark.parametrize("victim", ["b2", "b4"])
def test_a1_rolls_back_with_a2_when_a_death_kept_go_from_r1(victim: str) -> None:
    """A1 (b0) committed, and ``victim`` (between A1 and R1, or R1 itself) died before Go
    reached it: b3 to b5 roll back, Go being cut off, and A1's side rolled forward, keeping
    its end of the added link b0-b5. The link was known at b0's end only until the
    supervisor's restore (on real processes, `canopy bench faults --only exchange`: 1 to 3
    kills of b2 or b4 in 16). A2 now tells A1 over the link as it rolls back, and A1, R1's
    transfer not in (nothing crossed the link), drops its end too."""
    sim = chain(6, detection_time=60.0)
    for p in ("pb0", "pb3", "pb5"):
        publish_steadily(sim, p, 150, 1500)
    prev = f"b{int(victim[1:]) - 1}"
    exchange_until(sim, ("b4", "b5"), prev, lambda ex: ex.granted, 0, 0.02)
    ex = sim.cores[victim].exchange
    assert ex is not None and not ex.granted  # Go has not reached the victim
    crash_and_judge(sim, victim)  # one tree, each link known at both ends
    assert ("b0", "b5") not in sim.edges


def test_a2_rolls_forward_with_a1_when_r2_died_before_go_reached_it() -> None:
    """A1 (b0) committed, Go passed R1 (b1), and R2 (b2) died before it came: R1 rolled
    forward, closing the removed link, while b3 to b5 rolled back, Go cut off, and A2 (b5)
    dropped the added link: b0 and b1 were cut off from the rest for good (12,300 events
    lost here, until a restore). A2 has A1's list, which names it from A1's commit on, and
    rolls forward instead: one tree, with the added link.

    Not closed yet: b3 and b4 rolled back, so nobody hands over what went R2's way, and what
    crosses between the sides is lost until the A ends' Done (about 500 events here, all
    published within a failure detection of the death; a gap of the known kind)."""
    sim = chain(6, detection_time=60.0)
    for p in ("pb0", "pb1", "pb4", "pb5"):
        publish_steadily(sim, p, 150, 1500)
    exchange_until(sim, ("b1", "b2"), "b1", lambda ex: ex.granted, 0, 0.02)
    ex = sim.cores["b2"].exchange
    assert ex is not None and not ex.granted  # Go has not reached R2
    dead_at = sim.now
    sim.crash("b2", at=dead_at)
    sim.detect_failure("b2", at=dead_at + 60)
    sim.run()
    problems = [p for p in judge_overlay(sim) if "did not finish well" not in p]
    assert problems == [], problems
    assert ("b0", "b5") in sim.edges
    report = judge_deliveries(sim).survivors
    published = {(p.publisher, p.seq): p.published_at for p in sim.publications()}
    late = [x for x in report.lost if published[x[1], x[2]] > dead_at + 2 * 60]
    assert report.lost and late == [], late[:5]
    assert not report.duplicated and not report.reordered


def b1_dead_before_go_on_a_path_of_three(removed: tuple[str, str]) -> Simulator:
    """The chain b0-b1-b2 exchanges ``removed`` for b0-b2, and b1 dies once A1 (b0) has
    committed, before Go reached it: judged (see :func:`crash_and_judge`), the overlay ends
    as the link b0-b2 alone."""
    sim = chain(3, detection_time=60.0)
    for p in ("pb0", "pb2"):
        publish_steadily(sim, p, 150, 1500)
    exchange_until(sim, removed, "b0", lambda ex: ex.granted, 0, 0.02, ("b0", "b1", "b2"))
    crash_and_judge(sim, "b1")
    assert sorted(sim.edges) == [("b0", "b2")]
    return sim


def test_r2_dead_before_go_leaves_r1_out_of_its_chain_at_every_neighbour() -> None:
    """The path b0-b1-b2 exchanges b0-b1 (A1 is R1) for b0-b2, and R2 (b1) dies after
    Granted passed it, before Go: b0, having taken Go itself, rolls forward and leaves itself
    out of the chain around b1, as the removed link's other end. b2 read b1's list with b0 in
    it, and swept towards b0, which was in no such repair: a protocol error (the fault
    simulator's seed 30). R2 now stops listing R1 from Granted on."""
    b1_dead_before_go_on_a_path_of_three(("b0", "b1"))


def test_a_rolled_back_a2_that_repairs_over_the_added_link_takes_a1_with_it() -> None:
    """The path b0-b1-b2 exchanges b1-b2 for b0-b2, and R1 (b1) dies after Granted passed
    it, before Go: b2 rolls back and, in the repair around b1 (whose neighbours were b0 and
    b2), links to b0 over what was the added link. b0 repaired over its frozen end of it: its
    sweep went before its routes, b2's replay without them was lost (45 events in the fault
    simulator), and b0 waited in the exchange, b2's repair messages queued, for its lease.
    b0 now holds that sweep until the exchange is decided: told that b2 rolled back, it
    rolls back too, and the link is the repair's."""
    sim = b1_dead_before_go_on_a_path_of_three(("b1", "b2"))
    record = sim.exchanges[next(iter(sim.exchanges))]
    assert record.finished_at is not None and record.finished_at < 400  # not by lease (3000)


@pytest.mark.parametrize("more", [0, 3, 6, 9, 12, 15, 18])
def test_a1_dead_on_a_path_of_three_leaves_the_removed_link_as_the_repairs(more: int) -> None:
    """The path b0-b1-b2 exchanges b1-b2 for b0-b2 (A2 is R2), and A1 (b0) dies after its
    commit, before R1's transfer reached it: R1 waits for A1's separator, so the removed link
    is still there when both R ends hear of the death. Once the exchange rolled forward, b0
    was the neighbour of both: the repair around it links b1 and b2, and found them linked
    already, over the removed link, which the exchange then closed. The overlay was split in
    two (2,472 events lost here; the fault simulator's seed 55 of the sweep over deaths on an
    exchange's path). Each R end now keeps the link as its repair's (KeepRemoved), and the
    overlay is that link alone. ``more``: how many steps of 0.5 units after its commit A1
    dies."""
    sim = chain(3, detection_time=60.0)
    for p in ("pb0", "pb1", "pb2"):
        publish_steadily(sim, p, 150, 1500)
    path = ("b0", "b1", "b2")
    exchange_until(sim, ("b1", "b2"), "b0", lambda ex: ex.rolls_forward, more, 0.5, path)
    crash_and_judge(sim, "b0")
    assert sorted(sim.edges) == [("b1", "b2")]
    assert sim.stats.messages["KeepRemoved"] == 2  # one from each R end


@pytest.mark.parametrize("more", [0, 8, 16, 22])  # on the path of six, Go reaches A2 at 24
@pytest.mark.parametrize("n", [3, 6])
def test_a2_dead_before_it_rolled_forward_leaves_the_removed_link_kept(n: int, more: int) -> None:
    """A1 (b0) is R1 too: the chain b0-...-b(n-1) exchanges b0-b1 for b0-b(n-1), and A2 dies
    after A1's commit, before Go reached it (``more`` steps of 0.5 units after Granted
    reached A1). A2's last list does not name A1, so the repair around A2 left A1 out, and
    the removed link closed as Go reached R2: A1 was cut off from the rest until a restore
    (about 2,470 events lost on a path of three). A2's path neighbour now says so in its walk,
    R2 keeps the removed link (KeepRemoved), and A1's verdict waits for that walk, then
    replays what it sent A2 over the kept link."""
    sim = chain(n, detection_time=60.0)
    for p in sorted({"pb0", "pb1", f"pb{n - 2}"}):
        publish_steadily(sim, p, 150, 1500)
    path = tuple(f"b{i}" for i in range(n))
    exchange_until(sim, ("b0", "b1"), "b0", lambda ex: ex.granted, more, 0.5, path)
    ex = sim.cores[f"b{n - 1}"].exchange
    assert ex is not None and not ex.rolls_forward  # Go has not reached A2
    crash_and_judge(sim, f"b{n - 1}")
    assert ("b0", "b1") in sim.edges
    assert sim.stats.messages["KeepRemoved"] == 2  # one from each R end


@pytest.mark.parametrize("late", [5.0, 30.0])
def test_a1_slower_to_declare_a2_dead_than_the_walk_replays_towards_it(late: float) -> None:
    """As above (the chain b0-...-b5, A1 = R1), but A1's detector fires ``late`` units after
    A2's path neighbour's, so the walk that keeps the removed link reaches A1 first (on real
    processes the two verdicts differ by tens of milliseconds). A1's own verdict then waits
    for no walk, and still replays what it sent A2 towards the walk's sender: without that,
    those gray events were lost (an outside review of this session's change)."""
    sim = chain(6, detection_time=60.0)
    for p in ("pb0", "pb1", "pb4"):
        publish_steadily(sim, p, 150, 1500)
    path = tuple(f"b{i}" for i in range(6))
    exchange_until(sim, ("b0", "b1"), "b0", lambda ex: ex.granted, 8, 0.5, path)
    sim.crash("b5", at=sim.now)
    sim.detect_failure("b5", at=sim.now + 60, late={"b0": late})
    sim.run()
    report = judge_deliveries(sim)
    assert report.survivors.ok, str(report)
    problems = [p for p in judge_overlay(sim) if "did not finish well" not in p]
    assert problems == [], problems
    assert ("b0", "b1") in sim.edges and sim.stats.messages["KeepRemoved"] == 2


def test_an_r_end_keeps_the_removed_link_only_if_the_other_says_it_understands_keep_removed() -> (
    None
):
    """During a roll-out, an R end whose peer's hello does not say ``keep-removed`` closes
    the removed link as before (an older broker would close the link on a KeepRemoved): the
    overlay splits, as it did, until the supervisor's restore joins it."""
    sim = chain(3, detection_time=60.0)
    for b, core in sim.cores.items():
        for other in sim.cores:
            if other != b:
                core.handle(PeerFeatures(other, placement=True, keep_removed=False))
    path = ("b0", "b1", "b2")
    exchange_until(sim, ("b1", "b2"), "b0", lambda ex: ex.rolls_forward, 0, 0.5, path)
    sim.crash("b0", at=sim.now)
    sim.detect_failure("b0", at=sim.now + 60)
    sim.run()
    assert sim.stats.messages["KeepRemoved"] == 0
    assert sim.edges == []  # b1 and b2 apart


@pytest.mark.parametrize("step", [0, 1, 2, 3])
def test_an_a_end_dead_in_phase_1_is_repaired_around_by_the_other_one_too(step: int) -> None:
    """The initiator (A1) dies after phase 1 began, while the exchange runs (on real
    processes: the initiator of an apply killed 18-24 ms into it). Its neighbours are b1 and,
    over the new link, b5, which must chain up with b1 from the same list b1 has: the added
    link carries the A ends' lists once phase 1 began at each. It used to carry none, so b5
    linked to nobody, b1's repair link came up at one end only and the overlay stayed split
    until a restore joined it. ``step``: how many more inputs b5 handles after its phase 1
    began before b0 dies."""
    sim = chain(6, detection_time=60.0)
    for p in ("pb1", "pb5"):
        publish_steadily(sim, p, 150, 1500)
    exchange_until(sim, ("b4", "b5"), "b5", lambda ex: ex.granted, step, 0.25)
    dead_at = sim.now
    sim.crash("b0", at=dead_at)
    sim.detect_failure("b0", at=dead_at + 60)
    sim.run()
    assert sim.cores["b5"].is_neighbour("b1") and sim.cores["b1"].is_neighbour("b5")
    assert dead_at + 60 <= sim.repaired["b0"] < dead_at + 120  # not a lease (3000) later
    report = judge_deliveries(sim)
    assert report.survivors.ok and report.survivors.owed == 2 * 5 * 1350, str(report)
    problems = [p for p in judge_overlay(sim) if "did not finish well" not in p]
    assert problems == [], problems


@pytest.mark.parametrize("reached", ["b1", "b3"])
def test_a2_hearing_of_a1s_death_before_go_waits_for_go(reached: str) -> None:
    """A1 dies after its Go passed ``reached`` but before Go reached A2 (b5), and A2 declares
    it dead before Go comes (Go is slow on its way: detection here is 0.5 units). A2 used to
    roll back at once: it kept the removed link, which R1 (b4), reached by Go, rolled forward
    and closed, and b5's subscriber lost about 200 events untold, b5 believing itself linked
    to b4. A2's verdict now waits for Go, and the death is then bridged as any after Go."""
    sim = chain(6, detection_time=60.0)
    publish_steadily(sim, "pb3", 150, 1500)
    sim.exchange(("b0", "b1", "b2", "b3", "b4", "b5"), ("b4", "b5"), at=200, lease=3000.0)
    sim.run(until=200)

    def granted(b: str) -> bool:
        ex = sim.cores[b].exchange
        return ex is not None and ex.granted

    while not granted(reached):
        sim.run(until=sim.now + 0.05)
    assert not granted("b5")
    dead_at = sim.now
    sim.crash("b0", at=dead_at)
    sim.detect_failure("b0", at=dead_at + 0.5)
    sim.run()
    assert sim.edges == [("b1", "b2"), ("b1", "b5"), ("b2", "b3"), ("b3", "b4")]
    report = judge_deliveries(sim)
    assert report.survivors.ok and report.survivors.owed == 5 * 1350, str(report)
    problems = [p for p in judge_overlay(sim) if "did not finish well" not in p]
    assert problems == [], problems


def _without_handover(sim: Simulator) -> None:
    """Every broker as from before the hand-over (a hello without the feature, to all)."""
    for b, core in sim.cores.items():
        for other in sim.cores:
            if other != b:
                core.handle(PeerFeatures(other, placement=True, handover=False))


def _out_of_band_lost_after_go(sim: Simulator, broker: str) -> None:
    """What ``broker`` sends out of band once phase 1 has begun there never leaves it (its
    peer connection to its A end was still being dialed when it died): its transfer."""
    core = sim.cores[broker]
    handle = core.handle

    def lossy(inp: Input, now: float = 0.0) -> list[Effect]:
        out = handle(inp, now)
        ex = core.exchange
        if ex is not None and ex.granted:
            out = [e for e in out if not isinstance(e, SendToPeer)]
        return out

    core.handle = lossy  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("removed", "dead"),
    [
        (("b4", "b5"), "b4"),  # R1, its R2 the A2 (canopy bench faults --victim b4)
        (("b2", "b3"), "b2"),  # R1 mid-path
        (("b2", "b3"), "b3"),  # R2 mid-path
        (("b1", "b2"), "b1"),  # R1 next to A1
        (("b3", "b4"), "b2"),  # between A1 and R1
        (("b1", "b2"), "b3"),  # between R2 and A2
    ],
)
@pytest.mark.parametrize(
    ("transfer", "after", "handover"),
    [
        ("lost", 0.0, True),
        ("sent", 0.0, True),
        ("sent", 20.0, True),
        ("lost", 0.0, False),  # the negative controls: each of these lost, before
        ("sent", 0.0, False),
    ],
)
def test_a_death_in_phase_1_hands_over_what_went_its_way(
    removed: tuple[str, str], dead: str, transfer: str, after: float, handover: bool
) -> None:
    """A member of the cycle dies once Go has passed it (``after`` units later; ``lost``: its
    transfer, if it is an R end, never reached its A end). What its side published for the
    other side went its way, black, until its neighbours heard of the death, and what it had
    not passed on died with it. Its neighbour towards the A end kept it (and, if it was an R
    end, the other R end kept what came the other way), and hands it over to its A end, which
    sends it over the added link, newer ones held back behind it; each A end takes what came
    over the link only behind both sides' replays (core.handover). Without the hand-over
    (every broker as from before it: the negative control), 3 to 600 notifications were lost
    here, untold; on real processes 827 at 1,000 events/s (``canopy bench faults --only
    exchange --victim b4``). ``after`` 20: the other R end has had this one's separator and
    would have closed the removed link, so it no longer heard of the death, but for
    SeparatorSeen."""
    sim = chain(6, detection_time=60.0)
    publishers = [p for p in ("pb0", "pb1", "pb2", "pb3", "pb5") if p != f"p{dead}"]
    for p in publishers:
        publish_steadily(sim, p, 150, 1500)
    if not handover:
        _without_handover(sim)
    if transfer == "lost":
        _out_of_band_lost_after_go(sim, dead)
    path = ("b0", "b1", "b2", "b3", "b4", "b5")
    sim.exchange(path, removed, at=200, lease=3000.0)
    sim.run(until=200)
    while not ((ex := sim.cores[dead].exchange) is not None and ex.granted):
        assert sim.now < 400, "Go never reached the R end"
        sim.run(until=sim.now + 0.25)
    dead_at = sim.now + after
    sim.crash(dead, at=dead_at)
    sim.detect_failure(dead, at=dead_at + 60)
    sim.run()
    report = judge_deliveries(sim)
    assert report.survivors.owed == len(publishers) * 5 * 1350, str(report)
    problems = [p for p in judge_overlay(sim) if "did not finish well" not in p]
    assert problems == [], problems
    if handover:
        assert report.survivors.ok, str(report)
        assert not any(core.handovers for core in sim.cores.values())  # all through
    else:
        assert report.survivors.lost, str(report)


@pytest.mark.parametrize("locked", ["b1", "b5"])
def test_an_a_end_dead_before_phase_1_leaves_the_old_tree_whole(locked: str) -> None:
    """A1 dies while the exchange still locks: it has not committed, so A2 rolls back, and
    A1's other neighbour must not chain up with A2 from a list naming the link that never
    was (it was listed from A1's lock on: b1 linked to b5, which linked to nobody)."""
    sim = chain(6, detection_time=60.0)
    for p in ("pb1", "pb5"):
        publish_steadily(sim, p, 150, 1500)
    x = sim.exchange(("b0", "b1", "b2", "b3", "b4", "b5"), ("b4", "b5"), at=200, lease=3000.0)
    sim.run(until=200)
    while sim.cores[locked].exchange is None:  # locked there: b1 first, b5 (A2) last
        sim.run(until=sim.now + 0.25)
    assert not (sim.cores["b0"].exchange and sim.cores["b0"].exchange.granted)
    dead_at = sim.now
    sim.crash("b0", at=dead_at)
    sim.detect_failure("b0", at=dead_at + 60)
    sim.run()
    assert not sim.exchanges[x].ok
    assert sorted(sim.edges) == [("b1", "b2"), ("b2", "b3"), ("b3", "b4"), ("b4", "b5")]
    report = judge_deliveries(sim)
    assert report.survivors.ok and report.survivors.owed == 2 * 5 * 1350, str(report)
    problems = [p for p in judge_overlay(sim) if "did not finish well" not in p]
    assert problems == [], problems


@pytest.mark.parametrize(
    ("dead", "removed"),
    [
        ("b0", ("b4", "b5")),  # A1 (b5 is both A2 and R2)
        ("b1", ("b2", "b3")),  # a middle broker
        ("b2", ("b2", "b3")),  # R1
    ],
)
def test_the_cycle_away_from_a_dead_member_settles_at_once(
    dead: str, removed: tuple[str, str]
) -> None:
    """A member of the cycle dies after Go passed everywhere. Its neighbours settle at once
    (their detector); the brokers further along hear it from a Settle that walks away from the
    dead one, and settle too. They used to stay locked for the lease: on real processes 30 s
    without acknowledgements for their publishers, the removed link known at one end, the
    restore waiting; and with R1 dead, the A ends, still locked, refused the other side's
    notifications the way round (black, and r gone) until their lease ended: here every
    notification from b3 and b5 to b0 and b1 after the death.

    Nothing is lost: with A1 or the broker next to it dead, the A end releases what crossed
    the added link only behind the repair's replay (ReplayEnd; before it, 56 events were lost
    with b1 dead); with R1 dead, what was in flight through it is handed over by its
    neighbours on the cycle (core.handover; before it, 17-20 events per subscriber)."""
    sim = chain(6, detection_time=60.0)
    for p in ("pb3", "pb5"):
        publish_steadily(sim, p, 150, 1500)
    path = ("b0", "b1", "b2", "b3", "b4", "b5")
    sim.exchange(path, removed, at=200, lease=3000.0)
    sim.run(until=200)
    while not (sim.cores["b5"].exchange and sim.cores["b5"].exchange.granted):
        assert sim.now < 400, "Go never reached b5"
        sim.run(until=sim.now + 0.25)
    dead_at = sim.now
    sim.crash(dead, at=dead_at)
    sim.detect_failure(dead, at=dead_at + 60)
    sim.run(until=dead_at + 100)
    locked = [b for b in path if b != dead and sim.cores[b].exchange is not None]
    assert locked == [], locked  # not a lease (3000) later
    sim.run()
    report = judge_deliveries(sim)
    assert report.survivors.owed == 2 * 5 * 1350, str(report)
    assert not (report.survivors.duplicated or report.survivors.reordered), str(report)
    assert report.survivors.ok, str(report)
    problems = [p for p in judge_overlay(sim) if "did not finish well" not in p]
    assert problems == [], problems


def test_the_planner_spares_what_the_core_does_not_support() -> None:
    """No death on a running exchange's path, none while a repair runs; drops stay shorter
    than detection (see the module docstring of canopy_broker.sim.faults)."""
    sim = chain(6)
    sim.run(until=100)
    sim.exchange(("b1", "b2", "b3", "b4"), ("b2", "b3"))
    sim.run(until=110)
    planner = FaultPlanner(random.Random(0), list(FaultKind))
    for kind in DEATHS:
        assert sorted(v[0] for v in planner.victims(sim, kind)) == ["b0", "b5"]
    sim.crash("b0")
    sim.run(until=120)
    assert planner.victims(sim, FaultKind.CRASH) == []  # b0's repair is not done
    assert planner.victims(sim, FaultKind.PAUSE) == []
    assert all(planner.duration(sim, FaultKind.LINK_DROP) < 60 for _ in range(50))


def test_the_checker_separates_the_victims() -> None:
    """A victim's loss is reported, not held against the run; a survivor's is; a victim
    publisher's notifications are not owed, but a duplicate of one still counts."""
    subs = [SubRecord(c, "s", X, issued_at=0, settled_at=0) for c in ("live", "dead")]
    pubs = [PubRecord(p, 1, {"x": 1}, 1, 2) for p in ("alive", "gone")]
    deliveries = [DeliveryRecord("live", "alive", 1, 3)]
    report = check_faults(subs, pubs, deliveries, victims={"dead", "gone"})
    assert report.ok and report.survivors.owed == 1
    assert report.victims.lost == [("dead", "alive", 1)]
    assert report.by_subscriber() == {
        "dead": {"lost": 1, "duplicated": 0, "reordered": 0, "spurious": 0, "victim": 1}
    }
    twice = [*deliveries, *(DeliveryRecord("live", "gone", 1, t) for t in (3, 4))]
    assert check_faults(subs, pubs, twice, victims={"dead", "gone"}).survivors.duplicated
    assert not check_faults(subs, pubs, [], victims={"dead", "gone"}).ok


# --------------------------------------------------------------------------- random schedules


@functools.cache
def seeded(seed: int) -> FaultRun:
    return run_with_faults(seed)


@pytest.mark.parametrize("seed", range(12))
def test_seeded_fault_schedules(seed: int) -> None:
    run = seeded(seed)
    assert run.faults and run.report.survivors.owed > 200
    assert run.ok, str(run)


def test_the_seeded_schedules_hit_every_fault_kind_and_activity() -> None:
    runs = [seeded(seed) for seed in range(12)]
    kinds = {f.kind for r in runs for f in r.faults}
    during = {d.split()[0] for r in runs for f in r.faults for d in f.during}
    assert kinds == set(FaultKind)
    assert {"exchange", "migration", "leaf", "repair"} <= during, during
    assert any(r.report.victims.lost for r in runs)  # the victims are reported apart


@pytest.mark.parametrize("seed", range(6))
def test_deaths_during_exchanges(seed: int) -> None:
    """Crashes and fenced pauses aimed at exchanges: a broker next to the cycle (never on it)
    dies, its neighbours on the cycle repair while locked."""
    run = run_with_faults(
        seed, kinds=DEATHS, activities=[Activity.EXCHANGE, Activity.MIGRATION], rounds=5
    )
    assert any(d.startswith("exchange") for f in run.faults for d in f.during)
    assert run.ok, str(run)


def test_deaths_on_paths_are_left_out_unless_asked_for() -> None:
    """The suite's schedule spares a running exchange's path (the windows of the module
    docstring); ``on_paths`` lifts that for ``scripts/sim_on_paths.py``, which measures them."""

    def on_path(run: FaultRun) -> int:
        return sum(
            f.victim[0] in run.sim.exchanges[d.removeprefix("exchange ")].path
            for f in run.faults
            if f.kind in DEATHS
            for d in f.during
            if d.startswith("exchange ")
        )

    def runs(on_paths: bool) -> list[FaultRun]:
        return [
            run_with_faults(
                seed, kinds=DEATHS, activities=[Activity.EXCHANGE], rounds=5, on_paths=on_paths
            )
            for seed in range(4)
        ]

    assert sum(on_path(r) for r in runs(False)) == 0
    assert sum(on_path(r) for r in runs(True)) > 0


@settings(max_examples=40)  # ~0.15 s each; the profile gives no deadline
@given(
    seed=st.integers(0, 2**32 - 1),
    brokers=st.integers(4, 14),
    kinds=st.sets(st.sampled_from(list(FaultKind)), min_size=1),
    activities=st.sets(st.sampled_from(list(Activity)), min_size=1),
)
def test_property_random_trees_and_fault_schedules(
    seed: int, brokers: int, kinds: set[FaultKind], activities: set[Activity]
) -> None:
    run = run_with_faults(
        seed,
        brokers=brokers,
        rounds=4,
        kinds=sorted(kinds, key=lambda k: k.value),
        activities=sorted(activities, key=lambda a: a.value),
    )
    assert run.ok, str(run)


@pytest.mark.parametrize("seed", range(4))
def test_negative_control_without_custody_the_checker_reports_loss(seed: int) -> None:
    """The same schedules with replay impossible (nothing retained): crashes must show up as
    survivors' losses, or the checker proves nothing."""
    run = run_with_faults(seed, kinds=[FaultKind.CRASH], core_factory=no_custody_core)
    assert any(f.kind is FaultKind.CRASH for f in run.faults)
    assert run.report.survivors.lost and not run.ok, str(run)


# --------------------------------------------------------------------------- core bugs found


def in_exchange() -> BrokerCore:
    """Broker b, locked as R1 of an exchange over the cycle y - b - z (removing b-z), with a
    link to q off the cycle and one to x, whose neighbours are b and w."""
    core = BrokerCore("b", announce_neighbours=True, retention_window=100.0)
    for peer in ("q", "x", "y", "z"):
        core.handle(AddLink(peer))
    core.handle(FromLink("x", Neighbours(("b", "w"))))
    for peer in ("q", "x", "y"):
        core.handle(FromLink(peer, Subscribe(RouteKey(X, ""))))
    core.handle(FromLink("y", Lock("e1", ("y", "b", "z"), 1)))
    core.handle(ClientAttach("c"))
    assert core.exchange is not None
    return core


def test_custody_is_kept_while_the_broker_is_in_an_exchange() -> None:
    """Found by the schedules (a crash next to an exchange lost notifications): what a broker
    forwarded while locked for an exchange was not retained, so a neighbour that crashed right
    after took it with it."""
    core = in_exchange()
    out = core.handle(ClientPublish("c", Event("c", 1, {"x": 1})), 1.0)
    assert {e.peer for e in out if isinstance(e, SendToLink)} == {"q", "x", "y"}
    assert {p for p, kept in core.retention.by_peer.items() if kept} == {"q", "x", "y"}


def test_a_replay_stays_a_replay_across_an_exchange_cycle() -> None:
    """Found by the schedules (duplicates when a repair's replay crossed a running exchange):
    the colour tag replaced the replay mark, so brokers past the cycle delivered again."""
    core = in_exchange()
    out = core.handle(FromLink("q", Publish(Event("p", 1, {"x": 1}), replay=True)), 1.0)
    sent = [e.message for e in out if isinstance(e, SendToLink) and e.peer == "y"]
    assert sent and all(isinstance(m, Publish) and m.replay for m in sent)


def test_a_repair_holds_its_links_while_the_broker_is_in_an_exchange() -> None:
    """A broker in an exchange that repairs around a dead neighbour off the cycle sends nothing
    to the dead one nor over the new chain link before the replay (as it does outside one)."""
    core = in_exchange()
    core.handle(PeerFailed("x"), 2.0)
    out = core.handle(ClientPublish("c", Event("c", 1, {"x": 1})), 3.0)
    assert {e.peer for e in out if isinstance(e, SendToLink)} == {"q", "y"}


def test_a_replay_is_kept_in_custody() -> None:
    """Found by the schedules (a crash right after a repair lost what the repair had just
    replayed): the replayed copies were sent without being retained, so when the broker they
    went to died in turn, nobody could send them again."""
    core = BrokerCore("b", announce_neighbours=True, retention_window=100.0)
    core.handle(ClientAttach("c"))
    core.handle(AddLink("x"))
    core.handle(FromLink("x", Neighbours(("b", "w"))))
    core.handle(FromLink("x", Subscribe(RouteKey(X, ""))))
    core.handle(ClientPublish("c", Event("c", 1, {"x": 1})), 1.0)  # forwarded to x, kept
    core.handle(PeerFailed("x"), 2.0)  # b links to w, the rest of x's chain
    core.handle(FromLink("w", Subscribe(RouteKey(X, ""))), 3.0)
    out = core.handle(FromLink("w", RepairSweep("x", forward=False)), 4.0)
    assert any(isinstance(e, SendToLink) and e.peer == "w" for e in out)  # the replay
    assert [e.seq for _, e in core.retention.by_peer["w"]] == [1]


@pytest.mark.parametrize("seed", range(4))
def test_reconfiguration_path_exchanges_under_link_faults(seed: int) -> None:
    """Paper 002's algorithm guarantees no delivery of its own, so under drops, pauses and
    partitions it is held to what it does promise: it finishes and leaves canonical tables."""
    run = run_with_faults(
        seed,
        kinds=[FaultKind.LINK_DROP, FaultKind.PAUSE, FaultKind.PARTITION],
        activities=[Activity.EXCHANGE],
        mode=RoutingMode.IDENTITY,
        algorithm=Algorithm.PATH,
        rounds=5,
    )
    assert any(d.startswith("exchange") for f in run.faults for d in f.during)
    assert len(run.sim.exchanges) >= 3
    assert run.problems == [] and not run.report.survivors.spurious, str(run)
