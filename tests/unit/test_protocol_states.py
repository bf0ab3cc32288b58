"""Illegal inputs of every protocol role are refused before they change anything, and a core that
fails unexpectedly refuses everything after.

Each case drives a real core into a known phase, then feeds it an input its transition table has
no entry for, and compares the whole routing table and the protocol state before and after.
"""

from __future__ import annotations

import copy

import pytest

from canopy_broker.core import exchange as exchange_module
from canopy_broker.core import routing as routing_module
from canopy_broker.core.broker import BrokerCore
from canopy_broker.core.errors import CoreFailedError, ProtocolError
from canopy_broker.core.events import Event
from canopy_broker.core.exchange import TRANSITIONS, Mark, Phase, Step, backoff
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import (
    AddLink,
    ClientAttach,
    ClientPublish,
    ClientSubscribe,
    CloseLink,
    CtrlMsg,
    Deliver,
    Done,
    Echo,
    Effect,
    End,
    ExchangeFinished,
    FlushMsg,
    FromLink,
    FromPeer,
    Go,
    Granted,
    HandoverBegin,
    HandoverEnd,
    Input,
    KeepRemoved,
    LinkReady,
    Lock,
    LockRefused,
    Neighbours,
    OpenLink,
    PeerFailed,
    PeerFeatures,
    PeerGone,
    Publish,
    RecMsg,
    RelayEnd,
    RepairSweep,
    ReplayEnd,
    RouteKey,
    RoutesIn,
    RoutingMode,
    SendToLink,
    Separator,
    SeparatorSeen,
    Settle,
    StartExchange,
    StartTimer,
    Subscribe,
    Tag,
    TimerFired,
    Transfer,
)

PATH = ("a", "m", "r1", "r2", "z")  # A1 = a, R1 = r1, R2 = r2, A2 = z; k = 2
K = 2


def state_of(core: BrokerCore) -> object:
    ex = core.exchange
    return (
        core.routing_table(),
        None if ex is None else (ex.phase, frozenset(ex.marks), len(ex.queue)),
        dict(core.path_roles),
        copy.deepcopy(core.ignore),
    )


def refused(core: BrokerCore, inp: Input, match: str = "") -> None:
    before = state_of(core)
    with pytest.raises(ProtocolError, match=match):
        core.handle(inp)
    assert state_of(core) == before
    assert core.failed is None


def locked_middle() -> BrokerCore:
    """``m``: between A1 and R1, holding the lock, not yet granted."""
    core = BrokerCore("m")
    core.handle(AddLink("a"))
    core.handle(AddLink("r1"))
    core.handle(ClientAttach("c"))
    core.handle(ClientSubscribe("c", "s", Filter.parse("x = 1")))
    core.handle(FromLink("a", Lock("x1", PATH, K)))
    assert core.exchange is not None and core.exchange.phase is Phase.LOCKED
    return core


def test_every_phase_has_a_way_out_and_unknown_pairs_are_absent() -> None:
    reachable = {Phase.LOCKED} | set(TRANSITIONS.values())
    assert reachable == set(Phase)
    assert (Phase.LOCKED, Step.END) not in TRANSITIONS
    assert (Phase.CLOSING, Step.GRANTED) not in TRANSITIONS
    assert TRANSITIONS[Phase.LOCKED, Step.GRANTED] is Phase.LOCKED  # Granted changes nothing


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (End("x1", 1), "End is not expected in phase locked"),
        (Echo("x1"), "Echo is not expected in phase locked"),
        (Separator("x1", 2), "other side's Separator is not expected in phase locked"),
        (Done("x1", ()), "Done is not expected in phase locked"),
        (Granted("x9"), "exchange x9 it is not in"),
        (Go("x9"), "exchange x9 it is not in"),
        (Separator("x1", 7), "not expected|side 7"),
    ],
)
def test_a_locked_broker_refuses_what_comes_later(message: object, match: str) -> None:
    core = locked_middle()
    refused(core, FromLink("r1", message), match)  # type: ignore[arg-type]


def test_granted_passes_changing_nothing_and_go_starts_phase_1() -> None:
    core = locked_middle()
    passed = core.handle(FromLink("r1", Granted("x1")))
    assert [(e.peer, e.message) for e in passed if hasattr(e, "message")] == [("a", Granted("x1"))]
    assert core.exchange is not None and core.exchange.phase is Phase.LOCKED
    refused(core, FromLink("r1", Granted("x1")), "Granted again is not expected in phase locked")
    on = core.handle(FromLink("a", Go("x1")))
    assert [(e.peer, e.message) for e in on if hasattr(e, "message")] == [("r1", Go("x1"))]
    assert core.exchange.phase is Phase.BLACK
    refused(core, FromLink("a", Go("x1")), "Go is not expected in phase black")
    refused(core, FromLink("r1", LockRefused("x1", "late")), "LockRefused is not expected")
    # A final refusal (a broker past here died before Go reached it) is dropped: this side
    # has begun phase 1 and rolls forward.
    before = state_of(core)
    assert core.handle(FromLink("r1", LockRefused("x1", "r2 died", final=True))) == []
    assert state_of(core) == before
    core.handle(FromLink("r1", Separator("x1", 2)))  # the other side's separator passes up
    refused(core, FromLink("r1", Separator("x1", 2)), "again")


def test_a_final_refusal_for_an_exchange_already_left_is_dropped() -> None:
    """A side-2 broker can release on End just before its downstream neighbour, whose own
    neighbour died while Go was on its way, sends a final refusal back: nothing to release."""
    core = BrokerCore("m")
    core.handle(AddLink("r1"))
    assert core.handle(FromLink("r1", LockRefused("x1", "z died", final=True))) == []
    refused(core, FromLink("r1", LockRefused("x1", "busy")), "exchange x1 it is not in")


def test_the_own_separator_can_overtake_go_on_side_2() -> None:
    """R2 sends Go up side 2 and its separator out of band to A2, which walks it down side 2:
    a side-2 broker may see the separator first (gray, still locked), then Go."""
    path, k = ("a", "r1", "r2", "m", "z"), 1
    core = BrokerCore("m")
    core.handle(AddLink("r2"))
    core.handle(AddLink("z"))
    core.handle(FromLink("r2", Lock("x1", path, k)))
    core.handle(FromLink("z", Granted("x1")))
    core.handle(FromLink("z", Separator("x1", 2)))
    assert core.exchange is not None and core.exchange.phase is Phase.LOCKED_GRAY
    core.handle(FromLink("r2", Go("x1")))
    assert core.exchange.phase is Phase.GRAY


def test_a1_commits_only_within_half_a_lease_of_its_lock() -> None:
    """Granted at A1 is the commit point: in time, A1 sends Go; too late (the far brokers'
    leases might end before Go reached them), it lets the try go and retries, and nothing
    anywhere has begun phase 1."""
    core = a1_locked()
    on = core.handle(FromLink("m", Granted("x1")))
    assert [(e.peer, e.message) for e in on if hasattr(e, "message")] == [("m", Go("x1"))]
    assert core.exchange is not None and core.exchange.phase is Phase.BLACK
    assert core.handle(TimerFired("commit:x1")) == []  # committed: the window no longer matters

    late = a1_locked()
    effects = late.handle(TimerFired("commit:x1"))  # half the lease, and no Granted yet
    assert late.exchange is None and "x1" in late.attempts
    assert any(getattr(e, "key", "").startswith("lock:x1") for e in effects)  # retry planned
    assert late.handle(FromLink("m", Granted("x1"))) == []  # too late: dropped, no Go
    retry = late.handle(TimerFired("lock:x1"))
    locks = [getattr(e, "message", None) for e in retry]
    assert any(isinstance(m, Lock) and m.attempt == 1 for m in locks), retry


def test_a_retry_takes_over_an_ungranted_lock_and_late_answers_to_the_old_try_are_dropped() -> None:
    """A1's lease ran out while its lock was held up (a paused broker on the path): it retries
    under the same exchange id. The retry's lock replaces the old one, and the old try's
    Granted, when it finally comes, must not be taken for the new try's."""
    core = locked_middle()
    assert core.exchange is not None and core.exchange.attempt == 0
    core.handle(FromLink("a", Lock("x1", PATH, K, attempt=1)))
    assert core.exchange is not None and core.exchange.attempt == 1
    before = state_of(core)
    assert core.handle(FromLink("r1", Granted("x1", attempt=0))) == []
    assert core.handle(FromLink("r1", LockRefused("x1", "late", attempt=0))) == []
    assert state_of(core) == before and core.exchange.phase is Phase.LOCKED
    refused(core, FromLink("r1", Granted("x1", attempt=2)), "try 2, but this broker is locked")
    core.handle(FromLink("r1", Granted("x1", attempt=1)))
    assert core.handle(FromLink("a", Go("x1", attempt=0))) == []  # the old try's commit: none
    assert core.exchange.phase is Phase.LOCKED
    core.handle(FromLink("a", Go("x1", attempt=1)))
    assert core.exchange.phase is Phase.BLACK


def test_a_retry_takes_over_a_lock_that_granted_but_never_got_go() -> None:
    """Granted changes nothing, so a lock it passed is still only a lock: A1 let that try go
    (too slow to commit) and the retry takes the broker over."""
    core = locked_middle()
    core.handle(FromLink("r1", Granted("x1", attempt=0)))
    core.handle(FromLink("a", Lock("x1", PATH, K, attempt=1)))
    assert core.exchange is not None and core.exchange.attempt == 1
    assert core.exchange.phase is Phase.LOCKED and not core.exchange.marks


def locked_a2() -> BrokerCore:
    """``z``: A2, the last to lock, with the added link to ``a`` open (frozen)."""
    core = BrokerCore("z")
    core.handle(AddLink("r2"))
    core.handle(FromLink("r2", Lock("x1", PATH, K)))
    assert core.exchange is not None and core.routing.is_frozen("a")
    return core


def test_a2_keeps_the_added_link_when_a_retry_takes_its_lock_over() -> None:
    """A1 let a try go (a neighbour off the cycle died) and opened its end of the added link
    again for the next try before that try's Lock came round the path. A2 closing and opening
    the link again in one turn closed it under A1's new try, and the exchange ran to its end
    with the link down at both ends (CI, real processes: a 30 s split). The link is the same
    for the new try: nothing crosses it before phase 1."""
    core = locked_a2()
    effects = core.handle(FromLink("r2", Lock("x1", PATH, K, attempt=1)))
    assert core.exchange is not None and core.exchange.attempt == 1
    assert [e for e in effects if isinstance(e, OpenLink | CloseLink)] == [OpenLink("a", True)]
    assert core.routing.is_frozen("a")
    granted = [e.message for e in effects if isinstance(e, SendToLink)]
    assert granted == [Granted("x1", attempt=1)]


def test_a2_refusing_the_retry_closes_the_old_tries_added_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Should the new try be refused (no case reaches this today: A2 has no next hop to
    check, and a repair starting here lets the old try go first), nothing is left behind."""
    core = locked_a2()
    monkeypatch.setattr(exchange_module, "lock_problem", lambda *_a, **_k: ("busy", False))
    effects = core.handle(FromLink("r2", Lock("x1", PATH, K, attempt=1)))
    assert core.exchange is None and not core.routing.has_link("a")
    assert CloseLink("a") in effects
    assert [e.message for e in effects if isinstance(e, SendToLink)] == [
        LockRefused("x1", "busy", 1)
    ]


def test_a1_drops_the_late_answer_to_a_try_its_lease_gave_up_on() -> None:
    core = a1_locked()
    effects = core.handle(TimerFired("lease:x1"))  # the lock never came back in time
    assert core.exchange is None and "x1" in core.attempts
    assert any(getattr(e, "key", "").startswith("lock:x1") for e in effects)  # retry planned
    assert core.handle(FromLink("m", Granted("x1", attempt=0))) == []
    assert core.handle(FromLink("m", LockRefused("x1", "late", attempt=0))) == []
    retry = core.handle(TimerFired("lock:x1"))
    locks = [getattr(e, "message", None) for e in retry]
    assert any(isinstance(m, Lock) and m.attempt == 1 for m in locks), retry


def test_a_broker_of_the_cycle_that_fenced_this_one_settles_the_exchange_as_its_lease_would() -> (
    None
):
    """``z`` (on the path) declared ``m`` dead: nothing more of the exchange will come through
    it, so ``m`` settles at once as at its lease's end (here: locked, so it rolls back), and
    its later lease timer finds nothing. A broker off the path changes nothing."""
    core = locked_middle()
    before = state_of(core)
    assert core.handle(PeerGone("elsewhere")) == [] and state_of(core) == before
    assert core.handle(PeerGone("m")) == [] and state_of(core) == before  # itself: no meaning
    by_fence = locked_middle()
    by_fence.handle(PeerGone("z"))
    by_lease = locked_middle()
    by_lease.handle(TimerFired("lease:x1"))
    assert by_fence.exchange is None and state_of(by_fence) == state_of(by_lease)
    assert by_fence.handle(TimerFired("lease:x1")) == []


def in_phase_1(*, settle_r1: bool = True) -> BrokerCore:
    """``m`` in phase 1 (Go passed), ``r1`` knowing Settle unless told otherwise."""
    core = locked_middle()
    core.handle(PeerFeatures("r1", placement=True, settle=settle_r1))
    core.handle(FromLink("r1", Granted("x1")))
    core.handle(FromLink("a", Go("x1")))
    assert core.exchange is not None and core.exchange.phase is Phase.BLACK
    return core


def sent(out: list[Effect]) -> list[tuple[str, object]]:
    return [(e.peer, e.message) for e in out if isinstance(e, SendToLink)]


def test_a_settle_walks_on_away_from_the_dead_member_and_settles_as_the_lease_would() -> None:
    """A cycle member died after Go: the broker next to it settles (its detector or a fence:
    PeerGone) and sends a Settle on along the path, away from the dead one, ahead of what
    settling sends; each broker that takes it settles the same way as at its lease's end and
    passes it on. It never crosses the added link, goes only to a peer whose hello said it
    knows Settle, and does nothing before Go (a roll back is the lease's, or the refusal's)."""
    by_lease = in_phase_1()
    by_lease.handle(TimerFired("lease:x1"))
    dead_r1 = in_phase_1()
    out = dead_r1.handle(PeerGone("r1"))
    assert sent(out)[0] == ("a", Settle("x1", 0, "r1", handover=True))  # see core.handover
    assert dead_r1.exchange is None and state_of(dead_r1) == state_of(by_lease)
    # Taken from either side, it goes on to the other.
    for source, onward, gone in (("a", "r1", "z"), ("r1", "a", "r2")):
        core = in_phase_1()
        out = core.handle(FromLink(source, Settle("x1", 0, gone)))
        assert sent(out)[0] == (onward, Settle("x1", 0, gone))
        assert core.exchange is None and state_of(core) == state_of(by_lease)
        assert core.handle(FromLink(source, Settle("x1", 0, gone))) == []  # late: nothing
    # An older broker next on the path would refuse it: it hears the lease instead.
    old_r1 = in_phase_1(settle_r1=False)
    out = old_r1.handle(FromLink("a", Settle("x1", 0, "z")))
    assert all(not isinstance(m, Settle) for _p, m in sent(out))
    assert old_r1.exchange is None
    # Before Go, or for another try: nothing here.
    locked = locked_middle()
    before = state_of(locked)
    assert locked.handle(FromLink("a", Settle("x1", 0, "z"))) == [] and state_of(locked) == before
    assert all(not isinstance(m, Settle) for _p, m in sent(locked.handle(PeerGone("r1"))))
    other_try = in_phase_1()
    before = state_of(other_try)
    assert other_try.handle(FromLink("a", Settle("x1", 1, "z"))) == []
    assert state_of(other_try) == before
    # From a broker that is not its neighbour on the path, or naming a broker that is not
    # behind the sender as the walk goes (nor the far A end): refused.
    stranger = in_phase_1()
    stranger.handle(AddLink("q"))
    refused(stranger, FromLink("q", Settle("x1", 0, "z")), "not a path neighbour")
    for source, gone in (("a", "r1"), ("a", "m"), ("r1", "nobody"), ("r1", "m")):
        refused(in_phase_1(), FromLink(source, Settle("x1", 0, gone)), "names")
    # The walk an A end begins when it lost the other ends before it: never sent to the dead.
    a1 = BrokerCore("a")
    a1.handle(AddLink("m"))
    a1.handle(StartExchange("x1", PATH, ("r1", "r2")))
    a1.handle(FromLink("m", Granted("x1")))
    assert a1.exchange is not None and a1.exchange.granted
    assert sent(a1.handle(PeerGone("z")))[0] == ("m", Settle("x1", 0, "z"))
    end = in_phase_1()  # m, next to A1: that walk (z's) ends here, a is the dead one
    out = end.handle(FromLink("r1", Settle("x1", 0, "a")))
    assert not any(isinstance(m, Settle) for _p, m in sent(out)) and end.exchange is None


def delivered(out: list[Effect]) -> list[int]:
    return [e.event.seq for e in out if isinstance(e, Deliver)]


def a2_after_go() -> BrokerCore:
    """``z``: A2 (R2 is ``r2``) in phase 1, with a client subscribed, and A1's list heard."""
    z = locked_a2()
    z.handle(ClientAttach("c"))
    z.handle(ClientSubscribe("c", "s", Filter.parse("x = 1")))
    z.handle(FromLink("r2", Go("x1")))
    assert z.exchange is not None and z.exchange.granted and z.routing.has_link("a")
    z.handle(FromLink("a", Neighbours(("m", "z"))))  # not queued behind the old path
    return z


def test_a1_dead_waits_at_its_neighbour_for_the_repair_and_a2_bridges_until_the_walk() -> None:
    """A1 died after Go. Its path neighbour ``m`` settles only once its repair around A1 has
    the routes (its Settle walks to R1 behind them), and A2 keeps the removed link's side
    while it holds what comes over its own repair link, until that walk comes round; then
    it takes the held notifications as replays: each once, in order, none lost. Settling at
    once, whichever of the two heard first had R1 withdraw the old way before the new one
    was there (on `canopy up` and in CI: 14-70 events lost untold)."""
    m = in_phase_1()
    m.handle(FromLink("a", Neighbours(("m", "z"))))  # A1's list, over the added link's side
    out = m.handle(PeerGone("a"))
    assert sent(out) == [] and m.exchange is not None
    out = m.handle(PeerFailed("a"))  # the repair proceeds while the exchange waits on it
    assert OpenLink("z") in out and not any(isinstance(x, Settle) for _p, x in sent(out))
    assert m.exchange is not None
    out = m.handle(FromLink("z", RepairSweep("a", forward=False)))  # z's routes are in
    assert ("r1", Settle("x1", 0, "a")) in sent(out) and m.exchange is None

    z = a2_after_go()
    out = z.handle(PeerGone("a"))
    assert sent(out) == [] and z.exchange is not None  # no walk into the path: it bridges
    out = z.handle(PeerFailed("a"))
    assert OpenLink("m") in out and z.exchange is not None

    def pub(seq: int, tag: Tag | None = None) -> Publish:
        return Publish(Event("p", seq, {"x": 1}), tag)

    black = Tag("x1", gray=False)
    assert delivered(z.handle(FromLink("r2", pub(1, black)))) == [1]  # the old way
    assert delivered(z.handle(FromLink("m", pub(1)))) == []  # the new way: held
    assert delivered(z.handle(FromLink("m", pub(2)))) == []
    assert delivered(z.handle(FromLink("r2", pub(2, black)))) == [2]
    # The walk comes round behind the last of the old way: the held ones, as replays.
    out = z.handle(FromLink("m", pub(3)))
    assert delivered(out) == []
    out = z.handle(FromLink("r2", Settle("x1", 0, "a")))
    assert delivered(out) == [3] and z.exchange is None
    # A copy that took the new way while the old one was still in use, late: not again.
    assert delivered(z.handle(FromLink("m", pub(2)))) == []
    assert delivered(z.handle(FromLink("m", pub(4)))) == [4]
    # Once the removed link is gone (End came), A1's death leaves nothing to bridge.
    done = BrokerCore("z")
    done.handle(AddLink("r2"))
    done.handle(FromLink("r2", Lock("x1", PATH, K)))
    done.handle(FromLink("r2", Go("x1")))
    assert done.exchange is not None
    done.exchange.marks.add(Mark.END)
    done.handle(PeerGone("a"))
    assert done.exchange is None


def test_a2_bridging_replays_to_a1s_neighbour_only_what_would_have_crossed_the_added_link() -> None:
    """A2 bridges (A1 died after Go): its repair around A1 collects, for the replay, what it
    routes while the repair waits. What came black over the removed link is from A1's side,
    and reaches A1's path neighbour ``m`` the old way, which is still open: replayed to ``m``
    too, a copy could overtake that one, and ``m``'s subscriber got it twice, out of order
    (`canopy bench faults --only exchange`, b0 killed 10 ms in: 3 duplicates and a reordering
    in 1 run of 75; CI once). So is what A2 sent down black itself. What would have crossed
    the added link (gray) is replayed."""
    z = a2_after_go()
    z.handle(PeerGone("a"))
    assert OpenLink("m") in z.handle(PeerFailed("a"))
    z.handle(FromLink("m", Subscribe(RouteKey(Filter.parse("x = 1")))))  # held: bridging
    z.handle(FromLink("m", RepairSweep("a", forward=True)))  # held too

    def pub(seq: int, *, gray: bool) -> Publish:
        return Publish(Event("p", seq, {"x": 1}), Tag("x1", gray=gray))

    z.handle(FromLink("r2", pub(1, gray=False)))  # from A1's side, the old way
    z.handle(FromLink("r2", pub(2, gray=False)))
    z.handle(ClientPublish("c", Event("c", 1, {"x": 1})))  # black here: down, the old way
    z.handle(FromLink("r2", pub(3, gray=True)))  # R2's side, gray: for the added link
    out = z.handle(FromLink("r2", Settle("x1", 0, "a")))  # the walk: the bridge ends
    assert z.exchange is None
    replayed = [
        (e.message.event.publisher, e.message.event.seq, e.message.replay)
        for e in out
        if isinstance(e, SendToLink) and e.peer == "m" and isinstance(e.message, Publish)
    ]
    assert replayed == [("p", 3, True)], replayed


def test_an_a_end_whose_neighbour_died_releases_its_queue_only_behind_the_repairs_replay() -> None:
    """A1's neighbour on its side died in phase 1. A1 holds notifications that crossed the added
    link (newer); the repair around the dead one replays what its chain partner had sent it
    (older). A1 settles, releasing its queue, only once that partner's ReplayEnd is in: the
    replay first, then the queue, each delivered. Released as it settled, the queue came first
    and the replay was dropped as had (simulator: 20-30 events per subscriber). A partner whose
    software sends no ReplayEnd is not waited for; one from outside the chain changes nothing."""

    def a1_in_phase_1(*, replay_end: bool = True) -> BrokerCore:
        core = BrokerCore("a")
        core.handle(AddLink("m"))
        core.handle(ClientAttach("c"))
        core.handle(ClientSubscribe("c", "s", Filter.parse("x = 1")))
        core.handle(StartExchange("x1", PATH, ("r1", "r2")))
        core.handle(FromLink("m", Granted("x1")))
        core.handle(FromLink("m", Neighbours(("a", "r1"))))
        core.handle(PeerFeatures("r1", placement=True, settle=True, replay_end=replay_end))
        assert core.exchange is not None and core.exchange.granted
        gray = Publish(Event("p", 9, {"x": 1}), Tag("x1", gray=True))
        assert delivered(core.handle(FromLink("z", gray))) == []  # queued behind the old way
        return core

    a = a1_in_phase_1()
    assert a.handle(PeerGone("m")) == [] and a.exchange is not None
    out = a.handle(PeerFailed("m"))
    assert OpenLink("r1") in out and a.exchange is not None
    out = a.handle(FromLink("r1", RepairSweep("m", forward=False)))
    assert ("r1", ReplayEnd("m")) in sent(out) and a.exchange is not None  # its own replay end
    replayed = Publish(Event("p", 5, {"x": 1}), replay=True)
    assert delivered(a.handle(FromLink("r1", replayed))) == [5]
    stranger = a1_in_phase_1()
    stranger.handle(PeerGone("m"))
    stranger.handle(PeerFailed("m"))
    stranger.handle(FromLink("r1", RepairSweep("m", forward=False)))
    stranger.handle(AddLink("q"))
    assert stranger.handle(FromLink("q", ReplayEnd("m"))) == []  # not from its chain: dropped
    assert stranger.exchange is not None
    out = a.handle(FromLink("r1", ReplayEnd("m")))
    assert delivered(out) == [9] and a.exchange is None
    old = a1_in_phase_1(replay_end=False)
    old.handle(PeerGone("m"))
    old.handle(PeerFailed("m"))
    out = old.handle(FromLink("r1", RepairSweep("m", forward=False)))
    assert delivered(out) == [9] and old.exchange is None
    assert not any(isinstance(x, ReplayEnd) for _p, x in sent(out))


def test_a_middle_of_the_chain_says_replay_end_only_behind_the_far_sides_replay() -> None:
    """m is in the middle of the chain p-m-n around the dead d. Its ReplayEnd to p says that
    everything replayed towards p through m has gone: m's own replay, and n's, which passes
    through m. So it follows n's ReplayEnd (and the other way round). Sent after m's own
    replay alone, it let an A end or a hand-over waiting on it go ahead of n's replay, which
    was then dropped as had (fault simulator: 1-4 events in 5 seeds of 200). A partner that
    sends none (older software) is not waited for."""

    def middle(*, n_sends: bool = True) -> tuple[BrokerCore, list[Effect]]:
        m = BrokerCore("m")
        m.handle(AddLink("d"))
        m.handle(FromLink("d", Neighbours(("p", "m", "n"))))
        out = m.handle(PeerFailed("d"))
        assert OpenLink("p") in out and OpenLink("n") in out
        m.handle(PeerFeatures("n", placement=True, replay_end=n_sends))
        out = m.handle(FromLink("p", RepairSweep("d", forward=True)))
        out += m.handle(FromLink("n", RepairSweep("d", forward=False)))
        assert "d" in m.repairs
        return m, out

    m, out = middle()
    assert not any(isinstance(x, ReplayEnd) for _p, x in sent(out))
    assert sent(m.handle(FromLink("n", ReplayEnd("d")))) == [("p", ReplayEnd("d"))]
    assert sent(m.handle(FromLink("p", ReplayEnd("d")))) == [("n", ReplayEnd("d"))]
    assert sent(m.handle(FromLink("p", ReplayEnd("d")))) == []  # once
    _old, out = middle(n_sends=False)
    assert ("p", ReplayEnd("d")) in sent(out)  # n sends none: not waited for
    # n's ReplayEnd before m's own repair began (its detector was slower): kept for it.
    slow = BrokerCore("m")
    slow.handle(AddLink("d"))
    slow.handle(FromLink("d", Neighbours(("p", "m", "n"))))
    slow.handle(AddLink("n"))
    slow.handle(FromLink("n", ReplayEnd("d")))
    slow.handle(PeerFailed("d"))
    out = slow.handle(FromLink("p", RepairSweep("d", forward=True)))
    out += slow.handle(FromLink("n", RepairSweep("d", forward=False)))
    assert ("p", ReplayEnd("d")) in sent(out)


def r1_with_its_separator_sent(*, r2_hands_over: bool = True) -> BrokerCore:
    """``r1`` in phase 1, its own side's separator come and sent on over the removed link."""
    core = BrokerCore("r1")
    core.handle(AddLink("m"))
    core.handle(AddLink("r2"))
    core.handle(PeerFeatures("r2", placement=True, handover=r2_hands_over))
    core.handle(FromLink("m", Lock("x1", PATH, K)))
    core.handle(FromLink("r2", Granted("x1")))
    core.handle(FromLink("m", Go("x1")))
    out = core.handle(FromLink("m", Separator("x1", 1)))
    assert ("r2", Separator("x1", 1)) in sent(out)
    return core


def test_an_r_end_closes_the_removed_link_once_the_other_has_its_separator() -> None:
    """Each R end tells the other it has its separator (SeparatorSeen), and closes the removed
    link only with that and the other's separator in. Closed on the separator alone, it no
    longer heard of the other R end's death a moment later, with what it had just sent over the
    link still in that end's buffers (simulator: 26-89 events lost with R2 dead 20 units
    after Go). A peer without the feature is not told, nor waited for."""
    r1 = r1_with_its_separator_sent()
    out = r1.handle(FromLink("r2", Separator("x1", 2)))
    assert ("r2", SeparatorSeen("x1")) in sent(out)
    assert not any(isinstance(e, CloseLink) for e in out) and r1.routing.has_link("r2")
    refused(r1, FromLink("m", SeparatorSeen("x1")), "SeparatorSeen of x1 from m")
    out = r1.handle(FromLink("r2", SeparatorSeen("x1")))
    assert CloseLink("r2") in out and ("m", End("x1", 1)) in sent(out)
    assert r1.exchange is None
    old = r1_with_its_separator_sent(r2_hands_over=False)
    out = old.handle(FromLink("r2", Separator("x1", 2)))
    assert CloseLink("r2") in out and old.exchange is None
    assert not any(isinstance(m, SeparatorSeen) for _p, m in sent(out))


def r1_in_phase_1(*, r2_hands_over: bool = True) -> BrokerCore:
    """``r1`` in phase 1, its own side's separator not come yet."""
    core = BrokerCore("r1")
    core.handle(AddLink("m"))
    core.handle(AddLink("r2"))
    core.handle(PeerFeatures("r2", placement=True, settle=True, handover=r2_hands_over))
    core.handle(FromLink("m", Lock("x1", PATH, K)))
    core.handle(FromLink("r2", Granted("x1")))
    core.handle(FromLink("m", Go("x1")))
    assert core.exchange is not None and core.exchange.phase is Phase.BLACK
    return core


def test_an_r_end_settled_by_a_death_on_its_side_closes_the_removed_link_behind_the_other() -> None:
    """``m`` (on r1's side) is dead: r1 settles, and the other R end, alive, may still be
    sending black notifications over the removed link. r1 sends its Settle there, then its own
    separator (nothing black follows it), and closes the link only behind r2's separator, or
    after a repair timeout (r2 rolled back: Go never reached it). Closed at once, the link
    dropped r2's traffic on arrival (simulator: 22 events lost). What comes over it meanwhile
    is taken as replays. The other R end's own death, the lease, or an older peer: closed at
    once, as before."""
    r1 = r1_in_phase_1()
    out = r1.handle(PeerGone("m"))
    assert sent(out)[:2] == [("r2", Settle("x1", 0, "m", True)), ("r2", Separator("x1", 1))]
    assert StartTimer("drain:x1", r1.repair_timeout) in out
    assert not any(isinstance(e, CloseLink) for e in out) and r1.routing.has_link("r2")
    assert r1.exchange is not None and "r2" in r1.deduped
    out = r1.handle(FromLink("r2", Separator("x1", 2)))
    assert CloseLink("r2") in out and r1.exchange is None and "r2" not in r1.deduped
    assert not any(isinstance(m, SeparatorSeen) for _p, m in sent(out))  # r2 closes on ours

    timed = r1_in_phase_1()
    timed.handle(PeerGone("m"))
    assert CloseLink("r2") in timed.handle(TimerFired("drain:x1")) and timed.exchange is None

    for core, gone in ((r1_in_phase_1(), "r2"), (r1_in_phase_1(r2_hands_over=False), "m")):
        out = core.handle(PeerGone(gone))
        assert CloseLink("r2") in out and core.exchange is None, gone
        assert ("r2", Separator("x1", 1)) not in sent(out)
    leased = r1_in_phase_1()
    assert CloseLink("r2") in leased.handle(TimerFired("lease:x1")) and leased.exchange is None


def test_an_r_end_told_that_the_other_keeps_the_removed_link_keeps_it_too() -> None:
    """A KeepRemoved over the removed link (the other R end's repair runs over it, see
    exchange.keep_removed): this end holds exactly the keys it names, whatever it held from
    there before; phase 2 then drops none of them, and the exchange's end leaves the link
    open, while the separators still do their work."""
    r1 = r1_in_phase_1()
    old, new = RouteKey(Filter.parse("x = 1")), RouteKey(Filter.parse("x = 2"))
    assert set(r1.routing.held_from("r2")) == set()
    r1.handle(FromLink("r2", Subscribe(old)))  # black: sent before r2 froze the link
    r1.handle(FromLink("r2", KeepRemoved("x1", (new,))))
    assert set(r1.routing.held_from("r2")) == {new}
    ex = r1.exchange
    assert ex is not None and ex.has(Mark.KEPT_THERE) and not ex.has(Mark.KEPT)
    out = r1.handle(FromLink("m", Separator("x1", 1)))  # phase 2
    assert ("r2", Separator("x1", 1)) in sent(out)
    assert set(r1.routing.held_from("r2")) == {new}
    r1.handle(FromLink("r2", Separator("x1", 2)))
    assert r1.routing.is_frozen("r2")
    out = r1.handle(FromLink("r2", SeparatorSeen("x1")))
    assert not any(isinstance(e, CloseLink) for e in out) and r1.routing.has_link("r2")
    assert ("m", End("x1", 1)) in sent(out) and r1.exchange is None
    assert set(r1.routing.held_from("r2")) == {new}
    # Its own repair never began here: it keeps the link too, advertising what it holds.
    # (A KeepRemoved from anyone else, or for another exchange, would keep a replaced link:
    # refused; see test_keep_removed_only_from_the_other_r_end.)
    assert not r1.routing.is_frozen("r2")
    assert [m for p, m in sent(out) if isinstance(m, KeepRemoved)] == [
        KeepRemoved("x1", tuple(sorted(r1.routing.advertised_to("r2"), key=RouteKey.sort_key)))
    ]


def test_keep_removed_only_from_the_other_r_end() -> None:
    """Only the other R end of this exchange, rolled forward (its Go crossed the link ahead),
    keeps the removed link: from another neighbour, for another exchange, or before Go came
    here, a KeepRemoved would have this end keep a link the exchange replaced (a cycle), and is
    refused before it changes anything. One for an exchange this end left is dropped."""
    key = RouteKey(Filter.parse("x = 2"))
    r1 = r1_in_phase_1()
    refused(r1, FromLink("m", KeepRemoved("x1", (key,))), "KeepRemoved of x1 from m")
    refused(r1, FromLink("r2", KeepRemoved("x9", (key,))), "KeepRemoved of x9 from r2")
    locked = BrokerCore("r1")
    locked.handle(AddLink("m"))
    locked.handle(AddLink("r2"))
    locked.handle(FromLink("m", Lock("x1", PATH, K)))
    refused(locked, FromLink("r2", KeepRemoved("x1", (key,))), "not the other end")
    left = r1_in_phase_1()
    left.handle(TimerFired("lease:x1"))  # by lease: out of it, the link closed here
    left.handle(AddLink("r2"))  # (a new link to it since, say)
    left.handle(FromLink("r2", KeepRemoved("x1", (key,))))
    assert set(left.routing.held_from("r2")) == set()


def m_next_to_r1(*, a_hands_over: bool = True) -> BrokerCore:
    """``m`` (X: R1's neighbour on side 1) in phase 1, keeping custody, with a subscriber
    ``c`` and R1 advertising side 2's subscription, both to ``x = 1``."""
    core = BrokerCore("m", retention_window=10.0)
    core.handle(AddLink("a"))
    core.handle(AddLink("r1"))
    core.handle(PeerFeatures("a", placement=True, handover=a_hands_over))
    core.handle(ClientAttach("c"))
    core.handle(ClientAttach("p"))
    core.handle(ClientSubscribe("c", "s", Filter.parse("x = 1")))
    core.handle(FromLink("r1", Subscribe(RouteKey(Filter.parse("x = 1")))))
    core.handle(FromLink("a", Lock("x1", PATH, K)))
    core.handle(FromLink("r1", Granted("x1")))
    core.handle(FromLink("a", Go("x1")))
    return core


def test_r1s_neighbour_hands_over_what_it_kept_for_it_and_what_came_its_way() -> None:
    """R1 died in phase 1. Its neighbour on the cycle, ``m``, kept what it had sent it and
    keeps its routes (a ghost): what it routes there meanwhile is collected, not lost. Its
    Settle tells A1 to hold what goes over the added link. Once A1 has the other side's
    routes, its RoutesIn comes down behind them, and ``m`` replays the lot up, as replays,
    then HandoverEnd; the dead one's routes go. Without the feature on the way up, none of it."""
    m = m_next_to_r1()
    early = Event("p", 1, {"x": 1})
    assert ("r1", Publish(early.forwarded(), Tag("x1", gray=False))) in sent(
        m.handle(ClientPublish("p", early))
    )
    out = m.handle(PeerFailed("r1"))
    assert ("a", Settle("x1", 0, "r1", handover=True)) in sent(out)
    assert m.exchange is None and "r1" in m.handovers and m.routing.has_link("r1")
    late = Event("p", 2, {"x": 1})
    out = m.handle(ClientPublish("p", late))
    assert delivered(out) == [2] and sent(out) == []  # to the dead one's routes: kept
    m.handle(FromLink("a", Subscribe(RouteKey(Filter.parse("x = 1")))))  # from A1, the new way
    refused(m, FromLink("a", RoutesIn("x1", "r1", ("q",))), "RoutesIn routed")
    looping = ("m", "a") * 5000  # would bounce between m and a, copying itself at each hop
    refused(m, FromLink("a", HandoverEnd("x1", "r1", looping)), "HandoverEnd routed")
    out = m.handle(FromLink("a", RoutesIn("x1", "r1", ("m",))))
    assert sent(out) == [
        ("a", Publish(early.forwarded(), replay=True)),
        ("a", Publish(late.forwarded(), replay=True)),
        ("a", HandoverEnd("x1", "r1", ("a",))),
    ]
    assert not m.routing.has_link("r1") and not m.handovers
    old = m_next_to_r1(a_hands_over=False)
    out = old.handle(PeerFailed("r1"))
    assert ("a", Settle("x1", 0, "r1")) in sent(out) and not old.handovers


def test_an_a_end_sends_over_the_added_link_only_behind_the_handover() -> None:
    """A1 heard from the walk that ``m`` hands over what it kept for the dead R1. It holds what
    it would send over the added link until ``m``'s HandoverEnd (its replay is older), then
    sends it all, each publisher's in order, as replays, and HandoverEnd. What comes over the
    link it holds until A2's HandoverEnd: A2's side sent newer ones first, before the older
    ones it handed over; taken first, they made those be dropped as had."""
    a = BrokerCore("a")
    a.handle(AddLink("m"))
    a.handle(ClientAttach("c"))
    a.handle(ClientAttach("q"))
    a.handle(ClientSubscribe("c", "s", Filter.parse("x = 1")))
    a.handle(StartExchange("x1", PATH, ("r1", "r2")))
    a.handle(FromLink("m", Granted("x1")))
    assert a.exchange is not None and a.exchange.granted
    newer_there = Publish(Event("z", 9, {"x": 1}), Tag("x1", gray=True))
    assert delivered(a.handle(FromLink("z", newer_there))) == []  # queued behind the old way
    out = a.handle(FromLink("m", Settle("x1", 0, "r1", handover=True)))
    assert ("z", HandoverBegin("x1", "r1")) in sent(out)  # z may have heard of no death
    assert delivered(out) == [] and ("z", Done("x1", (RouteKey(Filter.parse("x = 1")),))) in sent(
        out
    )
    out = a.handle(FromLink("z", Done("x1", (RouteKey(Filter.parse("x = 1")),))))
    assert ("m", RoutesIn("x1", "r1", ("m",))) in sent(out)  # behind the routes, down to m
    newer_here = Event("q", 20, {"x": 1})
    assert sent(a.handle(ClientPublish("q", newer_here))) == []  # held from the added link
    older_here = Event("q", 10, {"x": 1}).forwarded()
    assert sent(a.handle(FromLink("m", Publish(older_here, replay=True)))) == []
    out = a.handle(FromLink("m", HandoverEnd("x1", "r1", ("a",))))
    assert sent(out) == [
        ("z", Publish(older_here.forwarded(), replay=True)),
        ("z", Publish(newer_here.forwarded(), replay=True)),
        ("z", HandoverEnd("x1", "r1", ("z",))),
    ]
    older_there = Publish(Event("z", 5, {"x": 1}), replay=True)
    assert delivered(a.handle(FromLink("z", older_there))) == []  # held until z's end
    assert delivered(a.handle(FromLink("z", HandoverEnd("x1", "r1", ("a",))))) == [5, 9]
    assert not a.handovers
    assert a.handle(FromLink("z", HandoverEnd("x1", "r1", ("a",)))) == []  # late: nothing


def test_an_a_end_out_of_the_exchange_answers_handover_begin_at_once() -> None:
    """The other A end may have closed the removed link before R1 died (SeparatorSeen in): it
    hears of no death, and waits for no hand-over. Asked over the added link, it answers at
    once: nothing of its side went the old way since. Still in the exchange, or handing over
    itself, it answers in due course; a peer without the feature is not answered."""
    z = BrokerCore("z")
    z.handle(AddLink("a"))
    out = z.handle(FromLink("a", HandoverBegin("x1", "r1")))
    assert sent(out) == [("a", HandoverEnd("x1", "r1", ("a",)))]
    locked = locked_a2()
    assert sent(locked.handle(FromLink("a", HandoverBegin("x1", "r1")))) == []  # queued
    # Its side through (End in, Done sent, waiting for A1's): no Settle will ever reach it,
    # and nobody of its side hands over. It used to answer nothing, and A1 held what came over
    # the added link, and refused every lock, until its timer (review).
    closing = a2_after_go()
    closing.handle(FromPeer("r2", Separator("x1", 2)))  # its own, from its R end
    closing.handle(FromLink("r2", Separator("x1", 1)))  # the other side's
    closing.handle(FromPeer("r2", RelayEnd("x1")))
    closing.handle(FromLink("r2", End("x1", 2)))
    assert closing.exchange is not None and closing.exchange.phase is Phase.CLOSING
    out = closing.handle(FromLink("a", HandoverBegin("x1", "r1")))
    assert sent(out) == [("a", HandoverEnd("x1", "r1", ("a",)))]
    z.handle(PeerFeatures("a", placement=True, handover=False))
    assert sent(z.handle(FromLink("a", HandoverBegin("x1", "r1")))) == []


def test_go_carries_a1s_list_to_the_two_brokers_that_would_repair_around_it() -> None:
    """A1's neighbour list as it commits (naming A2) rides along with Go. Its path neighbour
    takes it over whatever it had (A1's lists come over the same link, so nothing before Go is
    newer); A2 takes it if it has heard none over the new link, which may not have carried one
    yet when A1 died (CI: b5 linked to nobody, b1 linked to it). A list that does not name the
    broker taking it is refused before anything changes."""
    a = BrokerCore("a", announce_neighbours=True)
    a.handle(AddLink("m"))
    a.handle(StartExchange("x1", PATH, ("r1", "r2")))
    out = a.handle(FromLink("m", Granted("x1")))
    (go,) = [x for p, x in sent(out) if isinstance(x, Go)]
    assert sorted(go.a1_list) == ["m", "z"]

    def core(name: str, links: tuple[str, ...]) -> BrokerCore:
        c = BrokerCore(name, announce_neighbours=True)
        for peer in links:
            c.handle(AddLink(peer))
        return c

    m = core("m", ("a", "r1"))
    m.handle(FromLink("a", Neighbours(("m", "q"))))  # before the commit
    m.handle(FromLink("a", Lock("x1", PATH, K)))
    m.handle(FromLink("r1", Granted("x1")))
    refused(m, FromLink("a", Go("x1", 0, ("r1", "z"))), "must name this broker")
    out = m.handle(FromLink("a", Go("x1", 0, go.a1_list)))
    assert m.neighbour_lists.lists["a"] == go.a1_list
    assert ("r1", Go("x1", 0, go.a1_list)) in sent(out)  # passed on as it came
    for heard_before in (False, True):
        z = core("z", ("r2",))
        z.handle(FromLink("r2", Lock("x1", PATH, K)))
        if heard_before:
            z.handle(FromLink("a", Neighbours(("z", "m", "q"))))  # over the new link: newer
        z.handle(FromLink("r2", Go("x1", 0, go.a1_list)))
        want = ("z", "m", "q") if heard_before else go.a1_list
        assert z.neighbour_lists.lists["a"] == want


def test_a_death_before_go_passed_rolls_the_path_beyond_it_back_at_once() -> None:
    """A broker dies before Go passed it (here A1, while it locked the path): Go can no longer
    reach anybody beyond it, so its neighbour there rolls back and walks a Settle on, and each
    broker it reaches rolls back and passes it on. They used to wait for their lease (30 s by
    default), their publishers unacknowledged. Towards A1 the final refusal does it, and a
    death beyond this broker changes nothing here but this broker's own part."""
    for verdict in (PeerFailed("a"), PeerGone("a")):  # the detector, or a fence
        m = locked_middle()
        m.handle(PeerFeatures("r1", placement=True, settle=True))
        out = m.handle(verdict)
        assert ("r1", Settle("x1", 0, "a")) in sent(out) and m.exchange is None

    def locked_r1() -> BrokerCore:
        core = BrokerCore("r1")
        core.handle(AddLink("m"))
        core.handle(AddLink("r2"))
        core.handle(PeerFeatures("r2", placement=True, settle=True))
        core.handle(FromLink("m", Lock("x1", PATH, K)))
        assert core.exchange is not None and not core.exchange.rolls_forward
        return core

    by_lease = locked_r1()
    by_lease.handle(TimerFired("lease:x1"))
    r1 = locked_r1()
    out = r1.handle(FromLink("m", Settle("x1", 0, "a")))
    assert ("r2", Settle("x1", 0, "a")) in sent(out) and r1.exchange is None
    assert state_of(r1) == state_of(by_lease)
    # The dead broker beyond this one: Go may still come from A1, so no walk on from here.
    m = locked_middle()
    assert not any(isinstance(x, Settle) for _p, x in sent(m.handle(PeerFailed("r1"))))


def test_a1_gives_up_at_once_on_a_final_refusal() -> None:
    """A broker of the path died: retrying the same path cannot succeed, so A1 reports the
    exchange failed at once (its caller re-plans) instead of backing off and retrying."""
    core = a1_locked()
    effects = core.handle(FromLink("m", LockRefused("x1", "r1 died on the path", final=True)))
    (finished,) = [e for e in effects if isinstance(e, ExchangeFinished)]
    assert not finished.ok and finished.reason == "r1 died on the path"
    assert not any(getattr(e, "key", "").startswith("lock:") for e in effects)
    assert core.exchange is None and "x1" not in core.attempts


def test_a_repair_off_the_cycle_lets_an_ungranted_lock_go_to_be_tried_again() -> None:
    """A neighbour off the exchange's cycle died while this broker held an ungranted lock:
    the repair about to hold here must not have the tree reshaped under it, so the try goes
    (a refusal that is not final: A1 tries again after a backoff, and a new lock is refused
    as busy while the repair holds). The exchange went on under the hold."""
    core = locked_middle()
    core.handle(AddLink("q"))
    effects = core.handle(PeerFailed("q"))
    refusal = LockRefused("x1", "m is repairing around q", final=False)
    assert SendToLink("a", refusal) in effects and core.exchange is None
    # Granted passed here already: A1 commits on it, and Go may have turned the brokers
    # before this one black; a refusal there is a protocol error. The exchange goes on.
    promised = locked_middle()
    promised.handle(AddLink("q"))
    promised.handle(FromLink("r1", Granted("x1")))
    effects = promised.handle(PeerFailed("q"))
    assert not any(isinstance(e, SendToLink) and e.peer == "a" for e in effects), effects
    assert promised.exchange is not None
    a1 = a1_locked()
    a1.handle(AddLink("q"))
    effects = a1.handle(PeerFailed("q"))
    assert StartTimer("lock:x1", backoff("x1", 1)) in effects
    assert not any(isinstance(e, ExchangeFinished) for e in effects)
    assert a1.exchange is None and "x1" in a1.attempts


def test_done_for_another_exchange_is_checked_before_it_is_applied() -> None:
    """It used to be applied to the routing table first and refused afterwards."""
    core = locked_middle()
    key = RouteKey(Filter.parse("y = 2"))
    refused(core, FromLink("a", Done("other", (key,))), "exchange other it is not in")
    assert key not in core.routing_table().links["a"]


def a1_locked() -> BrokerCore:
    core = BrokerCore("a")
    core.handle(AddLink("m"))
    core.handle(StartExchange("x1", PATH, ("r1", "r2")))
    assert core.exchange is not None and core.exchange.phase is Phase.LOCKED
    return core


def a1_after_go() -> BrokerCore:
    core = a1_locked()
    core.handle(FromLink("m", Granted("x1")))
    assert core.exchange is not None and core.exchange.granted and core.routing.has_link("z")
    return core


def test_a1_rolls_back_when_a2_did_before_r1_took_go() -> None:
    """A2 rolling back on a death that cut Go off says so over the added link, ahead of its
    close; A1, R1's transfer not in (nothing crossed the link), rolls back too, in the
    exchange or after it rolled forward by a settle. Not once R1 has taken Go, nor for
    another try."""
    a2 = locked_a2()
    out = a2.handle(FromLink("r2", Settle("x1", 0, "r1")))  # Go cut off at r1
    refusal = LockRefused("x1", "r1 died before Go reached z: it rolled back", 0, final=True)
    assert out.index(SendToLink("a", refusal)) < out.index(CloseLink("a"))  # ahead of it
    assert sent(out) == [("a", refusal)] and a2.exchange is None

    a1 = a1_after_go()
    out = a1.handle(FromLink("z", refusal))
    assert CloseLink("z") in out and a1.exchange is None and not a1.routing.has_link("z")
    assert [e.ok for e in out if isinstance(e, ExchangeFinished)] == [False]

    settled = a1_after_go()
    settled.handle(FromLink("m", Settle("x1", 0, "r1")))  # rolled forward: the link kept
    assert settled.exchange is None and settled.routing.has_link("z")
    stranger = a1_after_go()
    stranger.handle(FromLink("m", Settle("x1", 0, "r1")))
    stranger.handle(AddLink("q"))
    assert stranger.handle(FromLink("q", refusal)) == [] and stranger.routing.has_link("z")
    out = settled.handle(FromLink("z", refusal))
    assert CloseLink("z") in out and not settled.routing.has_link("z")
    assert settled.handle(FromLink("m", refusal)) == []  # once only

    gray = a1_after_go()
    gray.handle(FromPeer("r1", Transfer("x1", ())))
    gray.handle(FromPeer("r1", Separator("x1", 1)))
    out = gray.handle(FromLink("z", refusal))
    assert not any(isinstance(e, CloseLink) for e in out) and gray.exchange is not None
    old_try = a1_after_go()
    out = old_try.handle(FromLink("z", LockRefused("x1", "old", 1, final=True)))
    assert not any(isinstance(e, CloseLink) for e in out) and old_try.exchange is not None
    settled_try = a1_after_go()
    settled_try.handle(FromLink("m", Settle("x1", 0, "r1")))
    out = settled_try.handle(FromLink("z", LockRefused("x1", "old", 1, final=True)))
    assert out == [] and settled_try.routing.has_link("z")  # another try's: not this link's

    # Ahead of Granted, still on its way along the path (A1 has not committed): given up as
    # by lease, so that the late Granted is dropped, not refused as a protocol error.
    early = a1_locked()
    out = early.handle(FromLink("z", refusal))
    assert CloseLink("z") in out and early.exchange is None
    assert [e.ok for e in out if isinstance(e, ExchangeFinished)] == [False]
    assert early.handle(FromLink("m", Granted("x1"))) == []


def test_out_of_band_messages_only_from_this_sides_r_end() -> None:
    core = a1_locked()
    key = RouteKey(Filter.parse("x = 1"))
    refused(core, FromPeer("z", Transfer("x1", (key,))), "not from this side's R end r1")
    refused(core, FromPeer("r1", Transfer("x1", (key, key))), "repeats keys")
    refused(core, FromPeer("r1", Separator("x1", 2)), "out of band")
    refused(core, FromPeer("r1", Transfer("x9", ())), "not an A end of")
    core.handle(FromPeer("r1", Transfer("x1", (key,))))  # the real one is taken
    assert key in core.routing_table().links["z"]
    refused(core, FromPeer("r1", Transfer("x1", (key,))), "came twice")


def test_path_roles_accept_only_the_awaited_answer() -> None:
    core = BrokerCore("m", RoutingMode.IDENTITY)
    core.handle(AddLink("a"))
    core.handle(AddLink("r1"))
    refused(core, FromLink("a", CtrlMsg("p1")), "takes no part in it")
    refused(core, FromLink("a", LinkReady("p1")), "takes no part in it")
    refused(core, FromLink("a", FlushMsg("p1", PATH)), "takes no part in it")
    refused(core, FromLink("a", RecMsg("p1", ("q", "w", "e"), 0)), "not on")
    refused(core, FromLink("a", RecMsg("p1", PATH, 9)), "not on")
    refused(core, FromLink("a", RecMsg("p1", PATH, K)), "from a, not r1")
    core.handle(FromLink("r1", RecMsg("p1", PATH, K)))  # m rewrites, passes RECMSG to a
    assert core.path_roles["p1"][1] == "a"
    refused(core, FromLink("r1", CtrlMsg("p1")), "from r1, but it is awaiting CTRLMSG from a")
    refused(core, FromLink("a", LinkReady("p1")), "awaiting CTRLMSG")
    refused(core, FromLink("r1", RecMsg("p1", PATH, K)), "twice")
    core.handle(FromLink("a", CtrlMsg("p1")))
    assert "p1" not in core.path_roles


def test_an_unexpected_error_fails_the_core_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    core = BrokerCore("b")
    core.handle(AddLink("n"))
    core.handle(ClientAttach("c"))

    def boom(*_args: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(routing_module.RoutingState, "_key_added", boom)
    with pytest.raises(CoreFailedError, match="RuntimeError: bug"):
        core.handle(ClientSubscribe("c", "s", Filter.parse("x = 1")))
    assert core.failed is not None
    monkeypatch.undo()
    with pytest.raises(CoreFailedError, match="failed earlier"):
        core.handle(ClientAttach("d"))
