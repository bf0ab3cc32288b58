"""Wire format: frame splitting, message codecs and the checks that protect the broker."""

from __future__ import annotations

import itertools
import math

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from canopy_broker.core import messages as core_messages
from canopy_broker.core.events import Event
from canopy_broker.core.filters import Filter
from canopy_broker.core.messages import Publish, RouteKey, RoutingMode, Subscribe, Unsubscribe
from canopy_broker.runtime import outbox
from canopy_broker.runtime.framing import (
    F_MSGS,
    MAX_FRAME,
    FrameError,
    FrameSplitter,
    check_wire_attributes,
    data_frame,
    decode_filter,
    decode_link_message,
    decode_peer_message,
    encode_event_body,
    encode_filter,
    encode_generic,
    encode_link_message,
    frame,
    from_wire,
    join_address,
    loads_frame,
    parse_address,
    to_wire,
)
from canopy_broker.runtime.framing import seconds as framing_seconds
from canopy_broker.runtime.outbox import (
    BATCH_BYTES,
    SUB_IDS_KEPT,
    Outlet,
    batches,
    fan_out,
    flush_outlets,
    msgs_frames,
    notify_message,
)


@given(
    payloads=st.lists(st.binary(max_size=300), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=7000), max_size=30),
)
def test_splitter_recovers_frames_from_any_chunking(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(p) for p in payloads)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    splitter = FrameSplitter()
    got: list[bytes] = []
    for a, b in itertools.pairwise(bounds):
        got.extend(splitter.feed(stream[a:b]))
    assert got == payloads
    assert splitter.buffered == 0


def test_oversized_length_is_rejected_before_the_body_arrives() -> None:
    splitter = FrameSplitter(max_frame=1024)
    with pytest.raises(FrameError) as info:
        splitter.feed((1025).to_bytes(4, "big") + b"x")
    assert info.value.code == "too-large"
    assert FrameSplitter().max_frame == MAX_FRAME


@pytest.mark.parametrize(
    "payload",
    [b"\xff\xfe garbage", b"{}", b"[]", b'["x"]', b"[1.5]", b"not json at all"],
)
def test_malformed_payloads_raise_frame_error(payload: bytes) -> None:
    with pytest.raises(FrameError):
        loads_frame(payload)


FILTER_TEXTS = [
    "true",
    'symbol = "ACME" and price < 10',
    "price >= 1.5 and price <= 2 and volume != 3",
    'name prefix "ab" and name suffix "z" and name contains "q"',
    "flag = true and tag exists and count > -4",
]


@pytest.mark.parametrize("text", FILTER_TEXTS)
def test_filters_round_trip_in_structured_and_text_form(text: str) -> None:
    f = Filter.parse(text)
    wire = orjson.loads(orjson.dumps(encode_filter(f)))
    assert decode_filter(wire) == f
    assert decode_filter(str(f)) == f


@pytest.mark.parametrize(
    "bad",
    [
        "price <",
        "price ~ 3",
        [["price", "like", 3]],
        [["price"]],
        [["", "=", 1]],
        [["a", "<", True]],
        42,
    ],
)
def test_invalid_filters_are_frame_errors(bad: object) -> None:
    with pytest.raises(FrameError) as info:
        decode_filter(bad)
    assert info.value.code in ("invalid-filter", "malformed")


def test_link_messages_round_trip() -> None:
    event = Event("pub-1", 7, {"s": "x", "i": 3, "f": 2.0, "b": False}, hops=2)
    key = RouteKey(Filter.parse("i > 1"), "c/s1")
    for msg in (Publish(event), Subscribe(key), Unsubscribe(key)):
        assert decode_link_message(orjson.loads(encode_link_message(msg))) == msg
    # Kinds survive the trip: 2.0 stays a float, False stays a bool, 3 stays an int.
    back = decode_link_message(orjson.loads(encode_link_message(Publish(event))))
    assert isinstance(back, Publish)
    assert [type(v) for v in back.event.attrs.values()] == [str, int, float, bool]


def test_data_frame_carries_its_first_sequence_number() -> None:
    msgs = [encode_link_message(Publish(Event("p", i, {"a": i}))) for i in (1, 2)]
    [payload] = FrameSplitter().feed(data_frame(41, msgs))
    ftype, first, items = loads_frame(payload)
    assert (ftype, first, len(items)) == (1, 41, 2)


@pytest.mark.parametrize(
    "item",
    [
        [],
        [9, "x"],
        [0, "p", 0, 0, {}],  # seq must be >= 1
        [0, "p", 1, -1, {}],  # hops >= 0
        [0, "p", 1, 0, []],  # attrs must be an object
        [0, "", 1, 0, {}],  # publisher non-empty
        [1, [["a", "=", 1]], 5],  # tag must be a string
        "string",
    ],
)
def test_bad_link_messages_are_rejected(item: object) -> None:
    with pytest.raises(FrameError):
        decode_link_message(item)


@pytest.mark.parametrize(
    "attrs",
    [
        {"x": math.inf},
        {"x": -math.inf},
        {"x": math.nan},
        {"x": 2**70},
        {"x": 2**64},
        {"x": -(2**63) - 1},
        {"x": None},
        {"": 1},
        {1: 2},  # a key that is not a string (the client library's publish takes any mapping)
        {"x": [1]},
        [1, 2],
    ],
)
def test_wire_attributes_refuse_what_json_or_the_core_cannot_carry(attrs: object) -> None:
    with pytest.raises(FrameError) as refused:
        check_wire_attributes(attrs)
    assert refused.value.code in {"invalid-event", "malformed"}


def test_wire_attributes_keep_what_json_carries() -> None:
    edge = {"a": 2**64 - 1, "b": -(2**63), "c": 1.5, "d": True, "e": "", "f": -0.0}
    assert check_wire_attributes(edge) == edge


def test_notify_message_reuses_one_encoded_event_body() -> None:
    body = encode_event_body(Event("p", 3, {"a": 1}, hops=1))
    assert orjson.loads(notify_message(body, ("s1", "s2"))) == [
        20,
        "p",
        3,
        1,
        {"a": 1},
        ["s1", "s2"],
    ]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["c1", "c2", "c3", "gone"]),
            st.lists(st.sampled_from(["s1", "s2", "s3"]), min_size=1, max_size=2, unique=True),
        ),
        max_size=8,
    ),
    st.sets(st.sampled_from(["c1", "c2", "c3"])),
    st.integers(min_value=0, max_value=3),
)
def test_fan_out_queues_one_notification_per_target_and_wakes_each_outlet_once(
    targets: list[tuple[str, list[str]]], busy: set[str], waiting: int
) -> None:
    """The compiled fan-out against the plain loop it replaces: every target with an outlet
    gets the event's notification with its own subscription ids, in order, behind what its
    queue held; a target without one (a client gone since routing) gets nothing; each outlet
    not waiting for a flush yet is marked and put on the dirty list once, in order of first
    notification, after those already on it (``waiting`` of them)."""
    body = encode_event_body(Event("p", 7, {"a": 1}))
    earlier = b'[20,"q",1,0,{},["s1"]]'
    outlets = {c: Outlet(c, None) for c in ("c1", "c2", "c3")}
    for c in busy:
        outlets[c].pending.append(earlier)
    dirty = [outlets[c] for c in sorted(busy)[:waiting]]  # on the list already: marked
    for o in dirty:
        o.dirty = True
    expected = {c: list(o.pending) for c, o in outlets.items()}
    dirty_expected = [o.client_id for o in dirty]
    typed = tuple((c, tuple(ids)) for c, ids in targets)
    for c, ids in typed:
        if c in expected:
            if c not in dirty_expected:
                dirty_expected.append(c)
            expected[c].append(notify_message(body, ids))
    n = fan_out(body, typed, outlets, dirty)
    assert {c: o.pending for c, o in outlets.items()} == expected
    assert [o.client_id for o in dirty] == dirty_expected
    assert all(o.dirty == (c in dirty_expected) for c, o in outlets.items())
    assert n == sum(c in outlets for c, _ in typed)
    for c, ids in typed:  # what a subscriber decodes
        if c in outlets:
            assert [20, "p", 7, 0, {"a": 1}, list(ids)] in [
                orjson.loads(m) for m in outlets[c].pending
            ]


class _Transport:
    def __init__(self, closing: bool = False, broken: bool = False) -> None:
        self.closing = closing
        self.broken = broken
        self.written: list[bytes] = []

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        if self.broken:
            raise RuntimeError("the transport is gone")
        self.written.append(data)

    def abort(self) -> None:
        self.closing = True


class _Conn:
    def __init__(self, paused: bool = False, transport: _Transport | None = None) -> None:
        self.writing_paused = paused
        self.transport = transport


def test_flush_writes_each_queue_as_frames_and_hands_back_what_needs_deciding() -> None:
    """flush_outlets writes each dirty outlet's queue as F_MSGS frame(s) and clears it (in
    place: Client.pending is the same list), leaves a paused connection's queue as it is, drops
    nothing into a closing or absent transport (the connection's loss drops the queue), unmarks
    every outlet, and returns exactly those over the limit or marked, in order."""
    msgs = [b'[20,"p",%d,0,{},["s"]]' % i for i in range(5)]
    live, paused, closing, gone, marked, empty = (
        Outlet("live", _Conn(transport=_Transport())),
        Outlet("paused", _Conn(paused=True, transport=_Transport())),
        Outlet("closing", _Conn(transport=_Transport(closing=True))),
        Outlet("gone", _Conn(transport=None)),
        Outlet("marked", _Conn(transport=_Transport())),
        Outlet("empty", _Conn(transport=_Transport())),
    )
    for o in (live, paused, closing, gone, marked):
        o.pending.extend(msgs)
    queue = live.pending
    dirty = [live, paused, closing, gone, marked, empty]
    for o in dirty:
        o.dirty = True
    attention = flush_outlets(dirty, 3, {marked, empty})
    assert [o.client_id for o in attention] == ["paused", "marked", "empty"]
    assert not any(o.dirty for o in dirty)
    assert live.pending is queue and queue == [] and closing.pending == gone.pending == []
    assert paused.pending == msgs and paused.conn.transport.written == []
    assert closing.conn.transport.written == [] and empty.conn.transport.written == []
    for o in (live, marked):
        (data,) = o.conn.transport.written
        frames = [loads_frame(p) for p in FrameSplitter().feed(data)]
        assert frames == [[F_MSGS, [orjson.loads(m) for m in msgs]]]
    assert flush_outlets([], 0, None) == []
    broken = Outlet("broken", _Conn(transport=_Transport(broken=True)))
    after = Outlet("after", _Conn(transport=_Transport()))
    for o in (broken, after):
        o.pending.extend(msgs)
        o.dirty = True
    assert flush_outlets([broken, after], 10, None) == []  # a write that raises: that one
    assert broken.conn.transport.closing and not broken.dirty  # is dropped, the next written
    assert len(after.conn.transport.written) == 1 and not after.dirty
    big = Outlet("big", _Conn(transport=_Transport()))
    big.pending.extend(msgs)
    assert flush_outlets([big], 4, None) == [] and big.pending == []
    paused.conn.writing_paused = False  # drained: its next flush writes it all, in order
    assert flush_outlets([paused], 0, None) == []
    (data,) = paused.conn.transport.written
    assert FrameSplitter().feed(data) == [msgs_frames(msgs)[4:]]


def test_the_sub_ids_encodings_kept_are_bounded() -> None:
    body = encode_event_body(Event("p", 1, {}))
    for i in range(SUB_IDS_KEPT + 10):
        assert orjson.loads(notify_message(body, (f"s{i}",)))[-1] == [f"s{i}"]
    assert len(outbox._SUB_IDS) <= SUB_IDS_KEPT


def test_batches_split_at_the_byte_limit_and_keep_order() -> None:
    msgs = [bytes([65 + i % 26]) * 100 for i in range(50)]
    chunks = batches(msgs, limit=1000)
    assert [m for c in chunks for m in c] == msgs
    assert all(sum(map(len, c)) <= 1000 for c in chunks)
    assert batches([b"x" * 5000], limit=1000) == [[b"x" * 5000]]  # one oversize message alone


@given(st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=120))
def test_a_clients_queue_goes_out_as_frames_of_its_messages_in_order(sizes: list[int]) -> None:
    """msgs_frames: one frame for a short queue, several of about BATCH_BYTES for a long
    one; either way the client reads back exactly the messages queued, in order."""
    msgs = [orjson.dumps([20, "x" * n, i]) for i, n in enumerate(sizes)]
    splitter = FrameSplitter()
    frames = [loads_frame(p) for p in splitter.feed(msgs_frames(msgs))]
    assert all(f[0] == 6 for f in frames)
    assert [orjson.dumps(m) for f in frames for m in f[1]] == msgs
    if len(b",".join(msgs)) <= BATCH_BYTES:
        assert len(frames) == 1
    else:
        assert len(frames) > 1


def test_parse_address() -> None:
    assert parse_address("10.0.0.1:80") == ("10.0.0.1", 80)
    assert parse_address(":7400") == ("127.0.0.1", 7400)
    assert parse_address("[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError):
        parse_address("nohost")
    with pytest.raises(ValueError, match="up to 65535"):
        parse_address("10.0.0.1:99999")  # POST /links took it, and the link dialed for ever


@pytest.mark.parametrize("host", ["10.0.0.1", "0.0.0.0", "::", "::1", "fd00::2", "broker-0.svc"])
def test_an_address_joined_reads_back_as_it_was(host: str) -> None:
    """A broker listening on IPv6 said ``:::7000`` (and ``fd00::2:7000``), which the reader
    took apart wrongly or by luck: IPv6 hosts are joined in brackets."""
    assert parse_address(join_address(host, 7000)) == (host, 7000)
    assert join_address("fd00::2", 1) == "[fd00::2]:1"


def test_generic_form_round_trips_core_values() -> None:
    key = RouteKey(Filter.parse('a prefix "x"'), "t")
    for value in (
        Publish(Event("p", 2, {"k": 1.5}, hops=3)),
        Subscribe(key),
        (key, key),
        RoutingMode.IDENTITY,
        ("a", 1, None, True),
    ):
        assert from_wire(orjson.loads(orjson.dumps(to_wire(value)))) == value
    # A key's cached hash is derived, not sent: the receiver computes its own.
    assert to_wire(key) == {"$": "RouteKey", "filter": to_wire(key.filter), "tag": "t"}
    assert hash(from_wire(to_wire(key))) == hash(key)


def test_reconfiguration_messages_travel_in_the_generic_form() -> None:
    m = core_messages
    key = m.RouteKey(Filter.parse("x < 3"), "")
    for msg in (
        m.Lock("x1", ("a", "b", "c"), 1, m.Ordering.CAUSAL, lease=2.5),  # the lease travels
        m.Done("x1", (key,)),  # with the A end's whole advertisement
        m.KeepRemoved("x1", (key,)),  # with the R end's, over the removed link it keeps
        m.Marker("client-7"),  # client migration
        m.Moved("client-7"),
    ):
        wire = encode_link_message(msg)
        assert wire.startswith(b"[3,")
        assert decode_link_message(orjson.loads(wire)) == msg
    transfer = m.Transfer("x1", (key,))  # out of band, no advertisement any more
    assert decode_peer_message(orjson.loads(encode_generic(transfer))) == transfer


@pytest.mark.parametrize(
    "obj",
    [
        {"$": "Nope"},
        {"$": "Subscribe", "key": "not a key", "extra": 1},
        {"$": "AddLink"},  # missing field
        {"$e": "RoutingMode", "v": "fancy"},
        {"$e": "AddLink", "v": 1},
        {"plain": "dict"},
        {"$": "ClientAttach", "client": "c"},  # a core type, but not a link message
    ],
)
def test_generic_form_rejects_what_it_would_not_make(obj: object) -> None:
    with pytest.raises(FrameError):
        decode_link_message([3, obj])


def test_generic_form_refuses_deep_nesting_and_foreign_types() -> None:
    deep: object = "x"
    for _ in range(40):
        deep = [deep]
    with pytest.raises(FrameError):
        from_wire(deep)
    with pytest.raises(TypeError):
        to_wire(object())


@pytest.mark.parametrize(
    ("wire", "problem"),
    [
        ({"$": "Granted", "xid": 5}, "field 'xid' is int '5', not str"),
        ({"$": "Lock", "xid": "x", "path": "abc", "k": 1}, "field 'path' is str"),
        ({"$": "Lock", "xid": "x", "path": ["a", 1], "k": 1}, "not tuple[str, ...]"),
        ({"$": "Separator", "xid": "x", "side": True}, "field 'side' is bool"),
        ({"$": "Done", "xid": "x", "keys": [1]}, "field 'keys' is tuple"),
        ({"$": "Relay", "xid": "x", "message": {"$": "Granted", "xid": "y"}}, "Subscribe"),
        ({"$": "Lock", "xid": "x", "path": ["a", "b"], "k": 0, "lease": "long"}, "'lease'"),
    ],
)
def test_generic_messages_are_checked_against_their_declared_types(
    wire: dict[str, object], problem: str
) -> None:
    """The core never sees a message whose fields are of another type than declared."""
    with pytest.raises(FrameError, match=problem.replace("[", r"\[").replace("(", r"\(")):
        decode_link_message([3, wire])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["$", "$e", "$f", "$ev", "xid", "path", "k", "v"]), inner)
    ),
    max_leaves=12,
)
message_names = st.sampled_from(sorted(n for n in vars(core_messages) if n[:1].isupper()))


@given(
    st.one_of(
        json_values,
        st.tuples(st.integers(0, 4), json_values).map(list),
        st.builds(
            lambda name, fields: [3, {"$": name, **fields}],
            message_names,
            st.dictionaries(st.sampled_from(["xid", "path", "k", "keys", "side"]), json_values),
        ),
    )
)
def test_decoding_arbitrary_input_raises_only_frame_errors(item: object) -> None:
    """Fuzz: whatever a peer sends, decoding either yields a message or a FrameError."""
    for decode, kind in (
        (decode_link_message, core_messages.LinkMessage),
        (decode_peer_message, core_messages.PeerMessage),
    ):
        try:
            msg = decode(item)  # type: ignore[operator]
        except FrameError:
            continue
        assert isinstance(msg, kind)


def test_paced_flush_holds_each_client_written_within_the_interval_on_its_own() -> None:
    """With ``pace``, an outlet due later than ``now`` is held (still dirty, queue untouched,
    not decided about); the others are written and due again ``pace`` after ``now``. A reply
    waiting (``due`` 0.0) is written whenever the client was last written."""
    msg = b'[20,"p",1,0,{},["s"]]'
    busy, quiet, replied = (Outlet(c, _Conn(transport=_Transport())) for c in "bqr")
    busy.due, quiet.due, replied.due = 10.5, 3.0, 0.0  # written at 10.4, long ago, a reply
    dirty = [busy, quiet, replied]
    for o in dirty:
        o.pending.append(msg)
        o.dirty = True
    held: list[Outlet] = []
    attention = flush_outlets(dirty, 0, {busy}, now=10.45, pace=0.1, held=held)
    assert held == [busy] and busy.dirty and busy.pending == [msg] and busy.due == 10.5
    assert busy.conn.transport.written == [] and attention == []  # decided once written
    for o in (quiet, replied):
        assert not o.dirty and o.pending == [] and len(o.conn.transport.written) == 1
        assert o.due == 10.45 + 0.1
    held = []
    assert flush_outlets([busy], 0, {busy}, now=10.5, pace=0.1, held=held) == [busy]
    assert held == [] and not busy.dirty and len(busy.conn.transport.written) == 1


def test_a_duration_from_the_wire_is_a_plain_sane_number_or_nothing() -> None:
    """What a fenced broker is told (``silent_for``) and tells its clients (``B_CUT_OFF``)."""
    assert (framing_seconds(2), framing_seconds(0.25), framing_seconds(0)) == (2.0, 0.25, 0.0)
    for bad in (True, -1, float("nan"), float("inf"), 1e7, "3", None, [1]):
        assert framing_seconds(bad) is None, bad
