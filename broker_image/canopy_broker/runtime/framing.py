"""Wire format: length-prefixed frames of JSON (orjson) arrays, and the message codecs.

A frame is a 4-byte big-endian length followed by that many bytes of payload; the payload is one
JSON array whose first element names the frame type. Data frames carry a *batch* of messages, so
one ``orjson.loads`` per frame decodes hundreds of messages, and batches are built by joining
already-encoded messages (``b"[" + b",".join(msgs) + b"]"``) so a notification forwarded to ten
subscribers is serialised once, not ten times.

Why orjson and not msgpack or pickle: measured on this machine (see ``docs/broker.md``) orjson
encodes a batch of publish messages ~4.5x faster and decodes it ~1.5x faster than msgpack, at
~1.5x the bytes, which is the right trade for a CPU-bound broker on loopback or a LAN. JSON keeps
the value kinds the core distinguishes (int vs float vs bool vs str) and is readable in a packet
capture. pickle was faster than msgpack but executes code on load, so it is unusable for input from
untrusted peers and clients. JSON cannot carry NaN or infinities (orjson writes them as ``null``),
so :func:`check_wire_attributes` refuses them before they are encoded.

Every decoder here raises :class:`FrameError` on any malformed input; the runtime closes only the
offending connection when it does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import types
import typing
from collections import deque
from collections.abc import Mapping
from enum import Enum
from types import TracebackType
from typing import Any, Final, Self, cast

import orjson

from canopy_broker.core import messages as core_messages
from canopy_broker.core.events import Event, Value, check_attributes
from canopy_broker.core.filters import Constraint, Filter, FilterError, Op
from canopy_broker.core.messages import (
    LinkMessage,
    PeerMessage,
    Publish,
    RouteKey,
    Subscribe,
    Unsubscribe,
)

# Frames built from messages encoded already live with the flush that builds most of them
# (outbox.py, compiled); they stay importable from here, the wire format's module, for tools.
from canopy_broker.runtime.outbox import (  # noqa: F401
    BATCH_BYTES,
    batches,
    frame,
    join_array,
    msg_frame,
    msgs_frame,
    msgs_frames,
)
from canopy_broker.runtime.outbox import HEADER as _HEADER

PROTOCOL_VERSION: Final = 1
FEATURES: Final = ("placement", "settle", "replay-end", "handover", "keep-removed")
"""What this broker's link protocol understands beyond version 1, told in every hello (a peer
without a feature is not sent what it would refuse): ``placement``, neighbour lists with the
sender's zone and node, in chain order; ``settle``, the exchange's Settle after a member of its
cycle died; ``replay-end``, a repair's ReplayEnd after its replay; ``handover``, handing over
what went the way of a cycle member dead in phase 1 (RoutesIn, HandoverBegin, HandoverEnd,
SeparatorSeen, ``Settle.handover``); ``keep-removed``, KeepRemoved (an exchange's removed link
kept as a repair's link)."""
MAX_FRAME: Final = 8 * 1024 * 1024
"""Largest accepted payload; a bigger length prefix closes the connection before any is read."""
# Frame types (first element of every frame's JSON array).
F_HELLO: Final = 0  # [0, {hello}]
F_DATA: Final = 1  # [1, first_seq, [link messages]]      link only, sequence-numbered
F_ACK: Final = 2  # [2, cumulative_ack]                    link only
F_PING: Final = 3  # [3, sender_clock, cumulative_ack]      link only
F_PONG: Final = 4  # [4, echoed_clock, cumulative_ack]      link only
F_BYE: Final = 5  # [5, reason]                            link only: "removed" | "shutdown"
F_MSGS: Final = 6  # [6, [client messages]]                 client connections, both directions
F_ERROR: Final = 7  # [7, code, text]                        then the sender closes
F_PRESSURE: Final = 8  # [8, true|false]                     link only: congestion on / off
F_PEERS: Final = (
    9  # [9, {name: "HOST:PORT"}, {name: client "HOST:PORT"}]  link only: neighbours' addresses
)
F_PROMOTE: Final = 10  # [10, session]                        standby only: now an overlay link
F_HEARS: Final = 11  # [11, nonce, peer]                        standby only: do you hear peer?
F_HEARD: Final = 12  # [12, nonce, peer, true|false|null]       the answer (null: not a neighbour)

# Link messages (inside F_DATA).
L_PUBLISH: Final = 0  # [0, publisher, seq, hops, attrs]
L_SUBSCRIBE: Final = 1  # [1, filter, tag]
L_UNSUBSCRIBE: Final = 2  # [2, filter, tag]
L_GENERIC: Final = 3  # [3, {"$": "TypeName", ...}]   every other core message (see to_wire)

# Client -> broker messages (inside F_MSGS).
C_SUBSCRIBE: Final = 10  # [10, sub_id, filter]   filter: text or [[attr, op, value?], ...]
C_UNSUBSCRIBE: Final = 11  # [11, sub_id]
C_PUBLISH: Final = 12  # [12, seq, attrs]
C_MIGRATING: Final = 13  # [13, source]   I am moving here from neighbour `source` (answered by 24)
C_MOVE: Final = 14  # [14, target]   I publish nothing more here; I move to neighbour `target`
C_LEAVE: Final = 15  # [15]           detach me now; the broker closes the connection
C_REPUBLISH: Final = 16  # [16, seq, attrs]   sent again after a failover (answered by acks)
C_RESUME: Final = 17  # [17, {"subs": [[sub_id, filter]], "last": {publisher: seq},
#                            "lost_for": seconds, "previous": broker}]   (answered by 27)
C_PUB_GAP: Final = 18  # [18, since_ago, until_ago]   what I published then may be lost
# Broker -> client messages (inside F_MSGS).
B_NOTIFY: Final = 20  # [20, publisher, seq, hops, attrs, [sub_ids]]
B_SUBSCRIBED: Final = 21  # [21, sub_id]
B_UNSUBSCRIBED: Final = 22  # [22, sub_id]
B_MARKER: Final = 23  # [23]           migration marker on the old connection: switch now
B_MIGRATING: Final = 24  # [24, source]   the migration from `source` is registered here
B_REDIRECT: Final = 25  # [25, target, address]   please migrate to neighbour `target` (drain)
B_PUBACK: Final = 26  # [26, seq]   everything you published up to seq is in the next hops' custody
B_RESUMED: Final = 27  # [27, served, [[since_ago, until_ago, reason]]]   gaps in seconds ago
B_CUT_OFF: Final = 28  # [28, seconds]   this broker left the overlay that long ago: fail over
B_GAP: Final = 29  # [29, since_ago, until_ago, reason]   what you may have missed, staying here

log = logging.getLogger("canopy.framing")


def finite_number(value: object) -> float | None:
    """A finite number (a bool is not one) as a float, or None: what a peer sent for a time
    or a duration, checked before any arithmetic."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)  # an integer too large for a float raises (review: a 500)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def printable(text: str, limit: int = 500) -> str:
    """``text`` cut to ``limit`` characters, anything unprintable (escapes, newlines)
    replaced: a peer's words that go into a log or before people must not forge lines."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


class FrameError(Exception):
    """The peer sent something this side cannot accept; ``code`` goes into the error frame."""

    def __init__(
        self, message: str, code: str = "malformed", detail: dict[str, object] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail  # sent as the error frame's 4th element, for the peer's program


# --------------------------------------------------------------------------- frames


def dumps(obj: object) -> bytes:
    return orjson.dumps(obj)


class FrameSplitter:
    """Incremental length-prefix parser: feed bytes, get complete payloads.

    The length is checked before the body is buffered, so an oversized (or garbage) prefix is
    rejected at once instead of making the broker wait for gigabytes that will never come.
    """

    __slots__ = ("_buf", "max_frame")

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame

    @property
    def partial(self) -> bool:
        """Bytes of a frame not complete yet are buffered."""
        return bool(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        if buf:
            buf += data
            view: bytes | bytearray = buf
        else:
            view = data
        out: list[bytes] = []
        pos = 0
        end = len(view)
        while end - pos >= _HEADER:
            length = int.from_bytes(view[pos : pos + _HEADER], "big")
            if length > self.max_frame:
                raise FrameError(
                    f"frame of {length} bytes exceeds the limit of {self.max_frame}", "too-large"
                )
            stop = pos + _HEADER + length
            if stop > end:
                break
            out.append(bytes(view[pos + _HEADER : stop]))
            pos = stop
        if view is buf:
            del buf[:pos]
        else:
            buf += data[pos:]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)


def loads_frame(payload: bytes) -> list[Any]:
    """Decode one payload into its JSON array; the first element must be an int frame type."""
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"payload is not valid JSON: {exc}") from None
    if not isinstance(obj, list) or not obj or type(obj[0]) is not int:
        raise FrameError("a frame must be a JSON array starting with an integer type")
    return obj


# --------------------------------------------------------------------------- values


def check_wire_attributes(attrs: object) -> dict[str, Value]:
    """Validate event attributes for the wire: the core's rules plus finite floats and 64-bit
    ints (JSON has no infinities, and orjson refuses larger integers), all checked in the
    compiled core (``check_attributes(..., wire=True)``)."""
    # A decoded JSON object is a dict: tested first, because isinstance against the Mapping ABC
    # costs a Python-level __instancecheck__ on every event.
    if type(attrs) is not dict and not isinstance(attrs, Mapping):
        raise FrameError(f"event attributes must be an object, got {type(attrs).__name__}")
    try:
        return check_attributes(attrs, wire=True)
    except ValueError as exc:
        raise FrameError(str(exc), "invalid-event") from None


def _str(value: object, what: str) -> str:
    if type(value) is not str or not value:
        raise FrameError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _int(value: object, what: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise FrameError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


# --------------------------------------------------------------------------- filters

_OPS = {op.value: op for op in Op}


def encode_filter(f: Filter) -> list[list[object]]:
    """Structured form: ``[[attr, op, value], ...]`` (``[attr, "exists"]`` for exists)."""
    return [
        [c.attr, c.op.value] if c.op is Op.EXISTS else [c.attr, c.op.value, c.value]
        for c in f.constraints
    ]


MAX_FILTER_TEXT: Final = 8192
MAX_CONSTRAINTS: Final = 64
"""A filter's size limits: matching and covering cost grows with them, and a hostile client
must not be able to make one subscription cost a broker (and every broker it propagates to)
more than any honest one does."""


def decode_filter(obj: object) -> Filter:
    """Accept the structured form or (from clients) the text syntax of ``Filter.parse``."""
    try:
        if isinstance(obj, str):
            if len(obj) > MAX_FILTER_TEXT:
                raise FrameError(
                    f"filter text of {len(obj)} characters (limit {MAX_FILTER_TEXT})",
                    "invalid-filter",
                )
            f = Filter.parse(obj)
            if len(f.constraints) > MAX_CONSTRAINTS:
                raise FrameError(
                    f"filter of {len(f.constraints)} constraints (limit {MAX_CONSTRAINTS})",
                    "invalid-filter",
                )
            return f
        if not isinstance(obj, list):
            raise FrameError(f"a filter must be text or a list of constraints, got {obj!r}")
        if len(obj) > MAX_CONSTRAINTS:
            raise FrameError(
                f"filter of {len(obj)} constraints (limit {MAX_CONSTRAINTS})", "invalid-filter"
            )
        constraints: list[Constraint] = []
        for item in obj:
            if not isinstance(item, list) or len(item) not in (2, 3):
                raise FrameError(f"a constraint must be [attr, op, value?], got {item!r}")
            op = _OPS.get(item[1]) if isinstance(item[1], str) else None
            if op is None:
                raise FrameError(f"unknown operator {item[1]!r}")
            constraints.append(Constraint(item[0], op, item[2] if len(item) == 3 else None))
        return Filter.of(constraints)
    except (FilterError, TypeError) as exc:
        raise FrameError(f"invalid filter: {exc}", "invalid-filter") from None


# --------------------------------------------------------------------------- link messages


def encode_event_body(event: Event) -> bytes:
    """``publisher,seq,hops,attrs`` without brackets: shared by link publishes and notifies."""
    return orjson.dumps([event.publisher, event.seq, event.hops, event.attrs])[1:-1]


def encode_link_message(msg: LinkMessage) -> bytes:
    """Compact arrays for the data plane; the tagged generic form for everything else."""
    if isinstance(msg, Publish) and msg.tag is None and not msg.replay:
        return b"[0," + encode_event_body(msg.event) + b"]"
    if isinstance(msg, Subscribe | Unsubscribe):
        code = L_SUBSCRIBE if isinstance(msg, Subscribe) else L_UNSUBSCRIBE
        return orjson.dumps([code, encode_filter(msg.key.filter), msg.key.tag])
    return encode_generic(msg)


def encode_generic(msg: object) -> bytes:
    """``[3, generic]``: link messages other than the data plane, and out-of-band messages."""
    return b"[3," + orjson.dumps(to_wire(msg)) + b"]"


def decode_peer_message(item: object) -> PeerMessage:
    """An out-of-band message of the reconfiguration protocols (always the generic form)."""
    if not isinstance(item, list) or len(item) != 2 or item[0] != L_GENERIC:
        raise FrameError(f"an out-of-band message must be [3, generic], got {item!r}")
    msg = from_wire(item[1])
    if not isinstance(msg, PeerMessage):
        raise FrameError(f"{type(msg).__name__} is not an out-of-band message", "unknown-type")
    return msg


# Generic form. The reconfiguration protocols add core messages faster than a hand-written
# array layout per type could follow, and they are rare (a few per link exchange), so they travel
# as self-describing JSON: a dataclass of the core's message module is {"$": "Name", field: ...},
# an Enum {"$e": "Name", "v": value}, a Filter {"$f": structured}, an Event {"$ev": [p, s, h, a]};
# arrays decode to tuples (the core's dataclasses are frozen and hold tuples). Only classes
# defined in canopy_broker.core.messages can be instantiated from the wire.
_WIRE_TYPES: dict[str, type] = {
    name: obj
    for name, obj in vars(core_messages).items()
    if isinstance(obj, type)
    and obj.__module__ == core_messages.__name__
    and (dataclasses.is_dataclass(obj) or issubclass(obj, Enum))
}
_MAX_DEPTH = 32
# Every field's declared type, resolved once: decoding checks each value against it, so a peer
# cannot hand the core a message whose fields are of the wrong type (an int for a broker name,
# a string for a path).
_FIELD_TYPES: dict[str, dict[str, Any]] = {
    name: typing.get_type_hints(cls)
    for name, cls in _WIRE_TYPES.items()
    if dataclasses.is_dataclass(cls)
}


def conforms(value: object, hint: Any) -> bool:
    """Whether ``value`` (as decoded from the wire) is of the declared type ``hint``."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, h) for h in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if type(value) is not tuple:
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(conforms, value, args))
    if hint is type(None):
        return value is None
    if hint is float:
        return type(value) in (int, float)
    if hint in (str, int, bool):
        return type(value) is hint
    if isinstance(hint, type):
        return isinstance(value, hint)
    return False


def _hint_name(hint: Any) -> str:
    if typing.get_origin(hint) is None and hasattr(hint, "__name__"):
        return str(hint.__name__)
    return str(hint).replace("canopy_broker.core.messages.", "").replace("canopy_broker.core.", "")


def to_wire(obj: object) -> Any:
    """A core message (or any value inside one) as JSON-able data; see the comment above."""
    if obj is None or type(obj) in (str, int, float, bool):
        return obj
    if isinstance(obj, Enum):
        return {"$e": type(obj).__name__, "v": obj.value}
    if isinstance(obj, Filter):
        return {"$f": encode_filter(obj)}
    if isinstance(obj, Event):
        return {"$ev": [obj.publisher, obj.seq, obj.hops, dict(obj.attrs)]}
    if isinstance(obj, tuple | list | frozenset):
        return [to_wire(x) for x in obj]
    name = type(obj).__name__
    if _WIRE_TYPES.get(name) is type(obj) and dataclasses.is_dataclass(obj):
        out: dict[str, Any] = {"$": name}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue  # derived from the others (a cached hash): rebuilt by the receiver
            value = getattr(obj, f.name)
            if f.default is not dataclasses.MISSING and value == f.default:
                continue  # a field added later, at its default: what older brokers read
            out[f.name] = to_wire(value)
        return out
    raise TypeError(f"{name} cannot be put on the wire")


def from_wire(obj: object, depth: int = 0) -> Any:
    """Inverse of :func:`to_wire`; raises :class:`FrameError` on anything it would not make."""
    if depth > _MAX_DEPTH:
        raise FrameError("message nested too deeply")
    if obj is None or type(obj) in (str, int, float, bool):
        return obj
    if type(obj) is list:
        return tuple(from_wire(x, depth + 1) for x in obj)
    if type(obj) is dict:
        if "$" in obj:
            cls = _WIRE_TYPES.get(obj["$"]) if isinstance(obj["$"], str) else None
            if cls is None or not dataclasses.is_dataclass(cls):
                raise FrameError(f"unknown message type {obj['$']!r}", "unknown-type")
            hints = _FIELD_TYPES[cls.__name__]
            # Fields this version does not know (a newer broker's) are left out, not refused.
            fields = {k: from_wire(v, depth + 1) for k, v in obj.items() if k in hints}
            for key, value in fields.items():
                hint = hints.get(key)
                if hint is not None and not conforms(value, hint):
                    raise FrameError(
                        f"bad {cls.__name__}: field {key!r} is {type(value).__name__} "
                        f"{str(value)[:40]!r}, not {_hint_name(hint)}"
                    )
            try:
                return cls(**fields)
            except (TypeError, ValueError) as exc:
                raise FrameError(f"bad {cls.__name__}: {exc}") from None
        if "$e" in obj:
            cls = _WIRE_TYPES.get(obj["$e"]) if isinstance(obj["$e"], str) else None
            if cls is None or not issubclass(cls, Enum):
                raise FrameError(f"unknown enum {obj['$e']!r}", "unknown-type")
            try:
                return cls(obj.get("v"))
            except ValueError as exc:
                raise FrameError(str(exc)) from None
        if "$f" in obj:
            return decode_filter(obj["$f"])
        if "$ev" in obj and type(obj["$ev"]) is list and len(obj["$ev"]) == 4:
            return decode_event(obj["$ev"], 0)
    raise FrameError(f"cannot decode {str(obj)[:80]!r}")


def decode_event(item: list[Any], start: int) -> Event:
    """Decode ``publisher, seq, hops, attrs`` found at ``item[start:start+4]``."""
    return Event(
        _str(item[start], "publisher"),
        _int(item[start + 1], "seq", 1),
        check_wire_attributes(item[start + 3]),
        _int(item[start + 2], "hops"),
    )


def decode_link_message(item: object) -> LinkMessage:
    if not isinstance(item, list) or not item:
        raise FrameError(f"a link message must be a non-empty array, got {item!r}")
    code = item[0]
    if code == L_PUBLISH and len(item) == 5:
        return Publish(decode_event(item, 1))
    if code in (L_SUBSCRIBE, L_UNSUBSCRIBE) and len(item) == 3:
        tag = item[2]
        if type(tag) is not str:
            raise FrameError(f"route tag must be a string, got {tag!r}")
        key = RouteKey(decode_filter(item[1]), tag)
        return Subscribe(key) if code == L_SUBSCRIBE else Unsubscribe(key)
    if code == L_GENERIC and len(item) == 2:
        msg = from_wire(item[1])
        if not isinstance(msg, LinkMessage):
            raise FrameError(f"{type(msg).__name__} is not a link message", "unknown-type")
        return msg
    raise FrameError(f"unknown link message {item!r}", "unknown-type")


def data_frame(first_seq: int, msgs: list[bytes]) -> bytes:
    return frame(join_array(b"[1,%d," % first_seq, msgs))


def seconds(value: object) -> float | None:
    """A duration from the wire: a plain, finite number from 0 to a million, else None."""
    if type(value) is int or type(value) is float:
        number = float(value)
        if 0.0 <= number < 1e6:
            return number
    return None


def error_detail(frame: list[Any]) -> dict[str, Any]:
    """The detail of an error frame ``[7, code, text, {detail}]`` ({} without one, or when
    it is not an object)."""
    return frame[3] if len(frame) > 3 and type(frame[3]) is dict else {}


def control_frame(*parts: object) -> bytes:
    return frame(orjson.dumps(parts))


def parse_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``, ``[v6]:PORT``) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT (a port up to 65535), got {address!r}")
    host = host.strip("[]") or default_host
    return host, int(port)


def join_address(host: str, port: int) -> str:
    """(host, port) -> ``HOST:PORT``, an IPv6 host in brackets (what :func:`parse_address`
    reads back: ``:::7000`` was read as host ``::`` by luck, ``fd00::2:7000`` not at all)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --------------------------------------------------------------------------- transport glue


class AsyncClosing:
    """``async with obj:`` closes ``obj`` on exit (clients of the broker and of its admin API)."""

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class TurnBudget:
    """How long frame handling may hold the event loop in one turn, shared by every
    connection of a process.

    Per connection, a budget would let twenty busy clients hold the loop for twenty budgets
    (a 10-broker overlay installing 100k subscriptions stalled a broker for 0.9 s so). The
    first connection to work in a turn starts the clock; every other one works against the
    same deadline, handling at least one frame (a few messages) even when it has passed, so
    none starves; the rest waits for the next turn. A turn ends when the callbacks scheduled
    in it run: ``call_soon`` then resets the clock before anything else of the next turn.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._deadline: float | None = None

    def deadline(self, loop: asyncio.AbstractEventLoop) -> float:
        if self._deadline is None:
            self._deadline = time.perf_counter() + self.seconds
            loop.call_soon(self._next_turn)
        return self._deadline

    def _next_turn(self) -> None:
        self._deadline = None


class FrameProtocol(asyncio.Protocol):
    """An asyncio protocol speaking frames: splits the byte stream, decodes each payload and
    hands it to :meth:`frame_received`; tracks the transport's write pause for backpressure.

    Protocols (not streams) because the broker's hot path is synchronous: a whole TCP read is
    split, decoded and routed in one call with no task switch per frame.
    """

    write_high_water = 1024 * 1024
    work_budget: TurnBudget | None = None
    """Frame handling per event-loop turn (None: no limit). With a budget, a read that brings
    more work than that is handled over several turns: reading pauses, the rest waits in
    ``pending`` (a frame may be handed back half done, see :meth:`frame_received`), and
    heartbeats, timers and other connections get the loop in between."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.transport: asyncio.Transport | None = None
        self.splitter = FrameSplitter(max_frame)
        # A frame has begun and is not complete yet: since when, on the loop's clock (the clock
        # every timeout of the runtime reads, so that tests can fake it with looptime).
        self.partial_since: float | None = None
        self.writing_paused = False
        self.secured = False  # over TLS (known from connection_made on)
        self._loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = self._loop.create_future()
        self._drained: asyncio.Future[None] | None = None
        self.pending: deque[list[Any]] = deque()
        self.deadline = math.inf  # when the current turn's budget runs out
        self._pauses: set[str] = set()
        self._holds: set[str] = set()  # reasons no frame may be handled now (see hold)
        self._continuing = False
        # This end closed (or failed) the connection: what it read but has not handled yet is
        # dropped. Not when the *peer* closed: what it sent before is handled (see _work).
        self._closed_here = False
        # The transport is gone but frames the peer sent before are still being handled (a
        # turn budget at a time): the loss is reported once they are (see connection_lost).
        self._loss_deferred = False
        self._ended = False  # the loss is reported: nothing more is handled

    # -- asyncio callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (asyncio's or uvloop's, which does not subclass asyncio.Transport).
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=self.write_high_water)
        # Asked now: asyncio's TLS transport, once closed twice, raises on get_extra_info.
        self.secured = transport.get_extra_info("sslcontext") is not None

    def data_received(self, data: bytes) -> None:
        try:
            for payload in self.splitter.feed(data):
                self.pending.append(loads_frame(payload))
        except FrameError as exc:
            self.fail(exc)
            return
        if self.splitter.partial:  # the owner closes a connection that stalls mid-frame
            if self.partial_since is None:
                self.partial_since = self._loop.time()
        elif self.partial_since is not None:
            self.partial_since = None
        if not self._continuing and not self._holds:
            self._work()

    def _work(self) -> None:
        """Handle pending frames until done or the turn's budget is spent."""
        self._continuing = False
        budget = self.work_budget
        self.deadline = math.inf if budget is None else budget.deadline(self._loop)
        pending = self.pending
        try:
            while pending and not self._holds:
                if self._closed_here or self._ended:
                    pending.clear()
                    break
                rest = self.frame_received(pending.popleft())
                if rest is not None:
                    pending.appendleft(rest)
                if pending and time.perf_counter() >= self.deadline:
                    self.pause("busy")
                    self._continuing = True
                    self._loop.call_soon(self._work)
                    return
            self.resume("busy")
        except FrameError as exc:
            self.fail(exc)
        except Exception as exc:  # a bug must cost this connection, not the process
            log.exception("internal error while handling a frame")
            self.fail(FrameError(f"internal error: {exc!r}", "internal"))
        if self._loss_deferred:  # everything the peer sent is handled: now it is lost
            self._loss_deferred = False
            self.connection_ended(None)

    def eof_received(self) -> bool | None:
        """The peer closed its side. Over plain TCP the transport then closes itself (None).
        Over TLS it would first wait up to 30 s for the peer's close_notify, which a crashed
        or killed peer never sends, and all that time the connection looks closing but not
        lost: abort at once, so that a failover or a link's reconnect starts now."""
        if self.transport is not None and self.secured:
            self.transport.abort()
        return None

    @property
    def reading_paused(self) -> bool:
        """This side stopped reading (backpressure, a busy turn): a frame may stay incomplete
        for as long without the peer being at fault."""
        return bool(self._pauses)

    def pause(self, reason: str) -> None:
        """Stop reading for ``reason``; reading resumes once no reason is left."""
        if not self._pauses and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._pauses.add(reason)

    def resume(self, reason: str) -> None:
        if reason not in self._pauses:
            return
        self._pauses.discard(reason)
        if not self._pauses and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
            if self.partial_since is not None:  # the wait was ours: the peer's clock restarts
                self.partial_since = self._loop.time()

    def hold(self, reason: str, frame: list[Any]) -> None:
        """Handle nothing more (``frame``, given back unhandled, and everything after it) until
        :meth:`release` of ``reason``; reading pauses meanwhile, so what waits is bounded by
        what was read already. For a frame that may not be handled *yet* but must not be
        refused either (data on a promoted standby link before this end's core opened it)."""
        self.pending.appendleft(frame)
        self._holds.add(reason)
        self.pause(reason)

    def release(self, reason: str) -> None:
        """Undo :meth:`hold`: handle what waits, in order, on the next loop turn."""
        if reason not in self._holds:
            return
        self._holds.discard(reason)
        self.resume(reason)
        if not self._holds and self.pending and not self._continuing:
            self._continuing = True
            self._loop.call_soon(self._work)

    @property
    def held(self) -> bool:
        return bool(self._holds)

    def holds(self, reason: str) -> bool:
        return reason in self._holds

    def connection_lost(self, exc: Exception | None) -> None:
        """asyncio's callback. If the peer closed cleanly (``exc`` None: its FIN, or over TLS
        its close_notify, which arrives with its last data) while a busy turn had put off
        frames it sent before (a publisher's last events), they are handled first, a turn
        budget at a time as ever, and only then is the loss reported
        (:meth:`connection_ended`): what was sent and then closed on is not dropped. After an
        error (a reset) they are dropped as before: a client whose connection failed sends
        what was not acknowledged again, through its next broker."""
        if exc is None and self.pending and not self._holds and not self._closed_here:
            self._loss_deferred = True
            if not self._continuing:
                self._continuing = True
                self._loop.call_soon(self._work)
            return
        self.connection_ended(exc)

    def connection_ended(self, exc: Exception | None) -> None:
        """The connection is gone and what the peer sent is handled (or dropped: held, or
        after an error); subclasses extend this (not ``connection_lost``) to act on the loss.
        Nothing is handled after it, not even frames a :meth:`release` would free."""
        self._ended = True
        self.pending.clear()
        if not self.lost.done():
            self.lost.set_result(None)
        self._wake_drain()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake_drain()

    # -- for subclasses and owners -----------------------------------------------------------

    def frame_received(self, frame: list[Any]) -> list[Any] | None:
        """Handle one frame; return what is left of it if ``deadline`` passed half-way (it is
        handed back first on the next turn), or None when it is done."""
        raise NotImplementedError

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def write(self, data: bytes) -> None:
        transport = self.transport  # is_closing() inline: one write per subscriber per turn
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def fail(self, exc: FrameError) -> None:
        """Tell the peer why (best effort) and close this connection only."""
        detail = () if exc.detail is None else (exc.detail,)
        self.write(control_frame(F_ERROR, exc.code, str(exc), *detail))
        self.close()

    def close(self) -> None:
        self._closed_here = True
        transport = self.transport
        if transport is not None and not transport.is_closing():
            try:
                transport.close()
            except RuntimeError:
                # A TLS transport whose session has ended already (the peer's close_notify
                # came first): asyncio refuses to shut it down twice. Nothing is left to flush.
                transport.abort()

    def abort(self) -> None:
        self._closed_here = True
        if self.transport is not None:
            self.transport.abort()

    async def drain(self) -> None:
        """Wait until the transport accepts writes again (or the connection is gone)."""
        while self.writing_paused and not self.is_closing():
            if self._drained is None:
                self._drained = self._loop.create_future()
            await asyncio.shield(self._drained)

    def _wake_drain(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None
