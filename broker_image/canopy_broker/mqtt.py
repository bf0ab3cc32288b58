"""MQTT gateway: existing MQTT clients (paho, mosquitto_pub/sub, any device SDK) publish and
subscribe through a Canopy broker.

``canopy-broker serve --mqtt HOST:PORT`` runs it in the broker's process. Like the HTTP gateway
(:mod:`canopy_broker.gateway`) it is an ordinary client of its own broker, one connection per
MQTT connection, so authentication, the policy, the publisher identity and the delivery
guarantees are the broker's: each notification reaches a connected subscriber once and in
publisher order. Nothing is checked here that the broker does not check itself.

**Protocol.** MQTT 5 and 3.1.1, QoS 0 and 1 (a QoS 2 request is granted QoS 1; a QoS 2
publication is refused). Packets are parsed and written by ``mqtt5`` (a maintained, strictly
validating sans-I/O codec). MQTT 3.1.1 differs from 5 only by the absence of properties and of
reason codes in a few packets, so a 3.1.1 connection's packets are brought to the 5 form on the
way in (an empty property list inserted where 5 has one) and back on the way out
(:func:`upgrade`, :func:`downgrade`): the codec still validates everything. No sessions are kept
after a disconnection, no retained messages, no wills: a connection's subscriptions live as long
as it does (clean start), as with the HTTP gateway.

**Credentials.** The MQTT password is a token of the broker's client policy (the user name is
not used); the MQTT client id is the Canopy client id, which the policy may restrict (empty: the
broker picks one, returned as the assigned client id in MQTT 5). With TLS on, the listener
presents the broker's client certificate and a password is required.

**Topics and attributes.** A publication on topic ``T`` with a payload that is a JSON object
of strings, numbers and booleans becomes the event ``{**payload, "topic": T}``; any other UTF-8
payload becomes ``{"topic": T, "payload": text}``. A subscription to a topic filter subscribes
to ``topic`` (``a/b`` → ``topic = "a/b"``; ``a/#`` and ``a/+/c`` → ``topic prefix "a/"``, the
wildcards then checked exactly here; ``#`` → ``topic exists``). A topic filter
``$canopy/FILTER`` subscribes with the content-based filter ``FILTER`` itself, e.g.
``$canopy/price > 10 and sym = "X"``: what an MQTT broker cannot do. A notification goes out on
its ``topic`` attribute (``canopy/<publisher>`` if it has none) with the payload it came with,
or the JSON of its attributes other than ``topic``, at the QoS granted to the subscription: the
overlay carries every publication reliably, whatever QoS it was published with, so a QoS 0
publication is not delivered less reliably than a QoS 1 one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from pathlib import Path

import mqtt5
import orjson

from canopy_broker.client import Client, ClientError, Credentials, Notification, connect
from canopy_broker.core.filters import Filter, FilterError
from canopy_broker.runtime.accept import Admission, Serving, SourceCounts, listen, source_of
from canopy_broker.runtime.tasks import TaskSet

log = logging.getLogger("canopy.mqtt")

MAX_PACKET = 1 << 20  # bytes of one packet; larger ones close the connection
CONNECT_TIMEOUT = 10.0  # seconds from accepting a connection to its CONNECT
ACK_TIMEOUT = 10.0  # seconds for the broker to acknowledge a QoS 1 publication
MAX_PER_SOURCE = 64  # MQTT connections at once from one remote address
CONTENT_PREFIX = "$canopy/"

CONNECT, CONNACK, PUBLISH, PUBACK = 1, 2, 3, 4
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK = 8, 9, 10, 11
PINGREQ, DISCONNECT = 12, 14
V311, V5 = 4, 5

Codes = mqtt5.ConnAckReasonCode
# What the broker's refusal (its error frame's code) means to an MQTT client.
_REFUSALS = {
    "unauthenticated": Codes.BAD_USER_NAME_OR_PASSWORD,
    "forbidden": Codes.NOT_AUTHORIZED,
    "wrong-identity": Codes.NOT_AUTHORIZED,
    "client-id-in-use": Codes.CLIENT_ID_NOT_VALID,
}
# MQTT 3.1.1's six CONNACK return codes, for the 5 reason codes used here.
_V311_CONNACK = {  # (the codec's enums are not hashable: keyed by value)
    int(Codes.SUCCESS): 0,
    int(Codes.UNSUPPORTED_PROTOCOL_VERSION): 1,
    int(Codes.CLIENT_ID_NOT_VALID): 2,
    int(Codes.SERVER_UNAVAILABLE): 3,
    int(Codes.BAD_USER_NAME_OR_PASSWORD): 4,
    int(Codes.NOT_AUTHORIZED): 5,
}


class MqttError(Exception):
    """The peer broke the protocol: its connection is closed (never the broker)."""


class PacketTooLargeError(MqttError):
    """A packet longer than :data:`MAX_PACKET` (told before its body is read): an MQTT 5
    client is told why (DISCONNECT 0x95) before the connection closes."""


# --------------------------------------------------------------------------- framing


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _frame(first: int, body: bytes) -> bytes:
    return bytes([first]) + _varint(len(body)) + body


def _uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    """The variable byte integer at ``pos``: (its value, the position after it)."""
    value, shift = 0, 0
    for _ in range(4):
        if pos >= len(buf):
            raise MqttError("truncated packet")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos
    raise MqttError("malformed variable byte integer")


def _split(packet: bytes) -> tuple[int, bytes]:
    """A whole packet written by the codec → (first byte, body)."""
    length, pos = _uvarint(packet, 1)
    return packet[0], packet[pos : pos + length]


async def read_packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One packet off the wire: (first byte, body). Its size is checked before it is read."""
    first = (await reader.readexactly(1))[0]
    length, shift = 0, 0
    for _ in range(4):
        b = (await reader.readexactly(1))[0]
        if shift and not b:  # a last byte of 0 after others: not the shortest form (1.5.5)
            raise MqttError("malformed remaining length (not in its shortest form)")
        length |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    else:
        raise MqttError("malformed remaining length")
    if length > MAX_PACKET:
        raise PacketTooLargeError(f"a packet of {length} bytes (at most {MAX_PACKET})")
    return first, await reader.readexactly(length)


def _u16(body: bytes, pos: int) -> int:
    if pos + 2 > len(body):
        raise MqttError("truncated packet")
    return int.from_bytes(body[pos : pos + 2], "big")


def upgrade(first: int, body: bytes) -> bytes:
    """A 3.1.1 packet (client to server) in MQTT 5 form: an empty property list where 5 has
    one, and protocol level 5 in CONNECT. Packets without properties in 5 pass unchanged."""
    kind = first >> 4
    if kind == CONNECT:
        at = 2 + _u16(body, 0)  # after the protocol name: level, flags, keep-alive
        flags = body[at + 1] if at + 1 < len(body) else 0
        head = body[:at] + bytes([V5]) + body[at + 1 : at + 4] + b"\x00"
        rest = body[at + 4 :]
        if flags & 0x04:  # a will: its (empty) properties come after the client id
            cid_end = 2 + _u16(rest, 0)
            rest = rest[:cid_end] + b"\x00" + rest[cid_end:]
        body = head + rest
    elif kind == PUBLISH:
        at = 2 + _u16(body, 0) + (2 if (first >> 1) & 0x03 else 0)
        body = body[:at] + b"\x00" + body[at:]
    elif kind in (SUBSCRIBE, UNSUBSCRIBE):
        body = body[:2] + b"\x00" + body[2:]
    return _frame(first, body)


# Bits of a subscription's options that must be 0: MQTT 5's two highest; 3.1.1 has only the QoS.
_RESERVED_OPTIONS = {V5: 0xC0, V311: 0xFC}


def check_subscription_options(body: bytes, version: int) -> None:
    """Raise MqttError when a SUBSCRIBE's body (as received, before :func:`upgrade`) sets a
    reserved bit of a subscription's options: a malformed packet (MQTT 5 3.8.3.1, 3.1.1
    3.8.3.1), which the codec reads as if the bit were not there."""
    pos = 2  # after the packet identifier
    if version == V5:
        properties, pos = _uvarint(body, pos)
        pos += properties
    while pos < len(body):
        pos += 2 + _u16(body, pos)  # the topic filter
        if pos >= len(body):
            raise MqttError("truncated SUBSCRIBE")
        if body[pos] & _RESERVED_OPTIONS[version]:
            raise MqttError(f"malformed SUBSCRIBE: reserved option bits set ({body[pos]:#04x})")
        pos += 1


def downgrade(packet: bytes) -> bytes:
    """A packet written by the codec (server to client, without properties) in 3.1.1 form."""
    first, body = _split(packet)
    kind = first >> 4
    if kind == CONNACK:
        body = bytes([body[0], _V311_CONNACK.get(body[1], 3)])
    elif kind == PUBLISH:
        at = 2 + _u16(body, 0) + (2 if (first >> 1) & 0x03 else 0)
        body = body[:at] + body[at + 1 :]  # the empty property list
    elif kind == SUBACK:
        body = body[:2] + bytes(c if c < 0x80 else 0x80 for c in body[3:])
    elif kind in (UNSUBACK, PUBACK):
        body = body[:2]
    return _frame(first, body)


# --------------------------------------------------------------------------- topics


def parse(raw: bytes) -> object:
    """A whole packet (in the MQTT 5 form) decoded by the codec. Whatever the codec fails
    with is a malformed packet: that connection's end. Its Rust core can also panic (an
    invalid UTF-8 string in some fields): ``PanicException``, a BaseException the gateway would
    otherwise let escape its connection handler (review)."""
    try:
        packet, _ = mqtt5.read(memoryview(raw))
    except (ValueError, IndexError) as exc:
        raise MqttError(f"malformed packet: {exc}") from None
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise MqttError("malformed packet: the codec could not read it") from None
    return packet


MAX_TOPIC = 65_535  # bytes of UTF-8: MQTT's string length


def _unprintable(text: str) -> bool:
    """U+0000 (MQTT forbids it) or another control character (it advises against them, and
    clients such as mosquitto_sub drop a connection that brings one)."""
    return any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text)


def topic_name_problem(topic: str) -> str | None:
    """Why ``topic`` cannot be an MQTT topic name (None: it can). Checked on publications
    that come in, and on notifications that go out: another client may have published the
    ``topic`` attribute with anything in it (review: a topic with a wildcard made the codec
    raise in the middle of forwarding, which stopped that subscriber's notifications)."""
    if not topic:
        return "an empty topic name"
    if "+" in topic or "#" in topic:
        return f"a wildcard in the topic name {topic[:100]!r}"
    if _unprintable(topic):
        return f"a control character in the topic name {topic[:100]!r}"
    if len(topic.encode(errors="surrogatepass")) > MAX_TOPIC:
        return f"a topic name longer than {MAX_TOPIC} bytes"
    return None


def check_topic_filter(pattern: str) -> None:
    """Raise MqttError unless ``pattern`` is a valid MQTT topic filter."""
    if _unprintable(pattern):
        raise MqttError(f"a control character in the topic filter {pattern[:100]!r}")
    levels = pattern.split("/")
    for i, level in enumerate(levels):
        if ("#" in level and (level != "#" or i != len(levels) - 1)) or (
            "+" in level and level != "+"
        ):
            raise MqttError(f"invalid topic filter {pattern!r}")
    if not pattern:
        raise MqttError("an empty topic filter")


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT's matching of a topic name against a filter (``+`` one level, ``#`` the rest;
    topics beginning with ``$`` are not matched by a leading wildcard)."""
    if topic.startswith("$") and pattern[:1] in ("+", "#"):
        return False
    want, have = pattern.split("/"), topic.split("/")
    for i, level in enumerate(want):
        if level == "#":
            return True
        if i >= len(have) or (level != "+" and level != have[i]):
            return False
    return len(want) == len(have)


def filter_of(pattern: str) -> tuple[Filter, bool]:
    """The Canopy filter an MQTT subscription is made with, and whether the gateway must still
    check the topic exactly (the filter is wider where a ``+`` is)."""
    if pattern.startswith(CONTENT_PREFIX):
        return Filter.parse(pattern[len(CONTENT_PREFIX) :]), False
    check_topic_filter(pattern)
    if "+" not in pattern and "#" not in pattern:
        return Filter.parse(f"topic = {json.dumps(pattern)}"), False
    literal = pattern[: min(i for i in (pattern.find("+"), pattern.find("#")) if i >= 0)]
    if pattern.endswith("/#") and "+" not in pattern:
        literal = pattern[:-2]  # "a/#" matches "a" as well as "a/..."
    if not literal:
        return Filter.parse("topic exists"), True
    return Filter.parse(f"topic prefix {json.dumps(literal)}"), True


def event_of(topic: str, payload: bytes) -> dict[str, object]:
    """The attributes an MQTT publication becomes (see the module's docstring)."""
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        raise ValueError("the payload is not UTF-8 text") from None
    try:
        obj = orjson.loads(payload) if payload[:1] == b"{" else None
    except orjson.JSONDecodeError:
        obj = None
    if (
        isinstance(obj, dict)
        and obj
        and all(isinstance(v, str | int | float | bool) for v in obj.values())
    ):
        return {**obj, "topic": topic}
    return {"topic": topic, "payload": text}


def message_of(n: Notification) -> tuple[str, bytes]:
    """The topic and payload a notification goes out with (the topic may be no MQTT topic
    name: see :func:`topic_name_problem`)."""
    attrs = n.attrs
    topic = attrs.get("topic")
    if not isinstance(topic, str) or not topic:
        topic = f"canopy/{n.publisher}"
    text = attrs.get("payload")
    if isinstance(text, str) and set(attrs) <= {"topic", "payload"}:
        return topic, text.encode()
    return topic, orjson.dumps({k: v for k, v in attrs.items() if k != "topic"})


# --------------------------------------------------------------------------- sessions


class Session:
    """One MQTT connection and the Canopy client it publishes and subscribes with."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        version: int,
        client: Client,
    ) -> None:
        self.reader, self.writer, self.version, self.client = reader, writer, version, client
        self.subs: dict[str, tuple[str, int, bool]] = {}  # pattern -> (sub id, QoS, check)
        self.by_sub_id: dict[str, str] = {}  # sub id -> pattern
        self._next_sub = 0
        self._next_packet_id = 0
        # The broker ended our client (``_forward`` saw it). The packet being handled, if any,
        # still gets its answer (a SUBACK saying what was refused) before the connection ends.
        self._client_gone = False
        self._handling = False
        self.unsendable = 0  # notifications no MQTT message can carry (skipped)

    def _unsendable(self, n: Notification, problem: str) -> None:
        """A notification this subscriber asked for that no MQTT PUBLISH can carry: skipped,
        so that the others still go out; said in the log the first time for this session."""
        self.unsendable += 1
        if self.unsendable == 1:
            log.warning(
                "mqtt: %s: %s:%d cannot go out over MQTT (%s); skipping such notifications",
                self.client.client_id,
                n.publisher,
                n.seq,
                problem,
            )

    def send(self, packet: bytes) -> None:
        self.writer.write(packet if self.version == V5 else downgrade(packet))

    async def serve(self, keep_alive: int) -> None:
        forwarding = asyncio.create_task(self._forward())
        try:
            # A client silent for one and a half keep-alive periods is gone (MQTT 3.1.2.10).
            idle = keep_alive * 1.5 if keep_alive else None
            while True:
                try:
                    first, body = await asyncio.wait_for(read_packet(self.reader), idle)
                except PacketTooLargeError as exc:
                    self._refuse(mqtt5.DisconnectReasonCode.PACKET_TOO_LARGE, str(exc))
                    await self.writer.drain()
                    raise
                self._handling = True
                try:
                    if not await self._handle(first, body):
                        return
                finally:
                    self._handling = False
                await self.writer.drain()
                if self._client_gone:
                    return
        finally:
            forwarding.cancel()
            with contextlib.suppress(asyncio.CancelledError, ClientError, ConnectionError):
                await forwarding
            # Ended: the MQTT client learns it now (its answers are written), not once the
            # Canopy client has finished closing, which may take seconds.
            self.writer.close()

    async def _handle(self, first: int, body: bytes) -> bool:
        """One packet from the client; False when the connection is to end."""
        if first >> 4 == SUBSCRIBE:
            check_subscription_options(body, self.version)
        packet = parse(_frame(first, body) if self.version == V5 else upgrade(first, body))
        patterns = (
            [tf.pattern for tf in packet.topic_filters]
            if isinstance(packet, mqtt5.SubscribePacket)
            else packet.patterns
            if isinstance(packet, mqtt5.UnsubscribePacket)
            else []
        )
        if any("\x00" in pattern for pattern in patterns):  # which the codec lets through
            raise MqttError("malformed packet: U+0000 in a topic filter (1.5.4)")
        if getattr(packet, "packet_id", None) == 0 and (
            not isinstance(packet, mqtt5.PublishPacket) or packet.qos != mqtt5.QoS.AT_MOST_ONCE
        ):  # a packet that needs an identifier needs a non-zero one (2.2.1)
            raise MqttError(f"malformed {type(packet).__name__}: packet identifier 0")
        if isinstance(packet, mqtt5.PublishPacket):
            return await self._publish(packet)
        if isinstance(packet, mqtt5.SubscribePacket):
            return await self._subscribe(packet)
        if isinstance(packet, mqtt5.UnsubscribePacket):
            await self._unsubscribe(packet)
        elif isinstance(packet, mqtt5.PingReqPacket):
            self.send(mqtt5.PingRespPacket().write())
        elif isinstance(packet, mqtt5.DisconnectPacket):
            return False
        elif not isinstance(packet, mqtt5.PubAckPacket):  # PUBACKs of our QoS 1: nothing kept
            raise MqttError(f"unexpected {type(packet).__name__}")
        return True

    def _refuse(self, reason: mqtt5.DisconnectReasonCode, why: str) -> bool:
        log.info("mqtt: closing %s: %s", self.client.client_id, why)
        if self.version == V5:
            self.send(mqtt5.DisconnectPacket(reason_code=reason, reason_str=why[:200]).write())
        return False

    async def _publish(self, p: mqtt5.PublishPacket) -> bool:
        if p.qos == mqtt5.QoS.EXACTLY_ONCE:
            return self._refuse(mqtt5.DisconnectReasonCode.QOS_NOT_SUPPORTED, "QoS 2")
        if p.topic_alias is not None:  # none accepted: the CONNACK advertises no maximum
            return self._refuse(
                mqtt5.DisconnectReasonCode.TOPIC_ALIAS_INVALID, "a topic alias (none accepted)"
            )
        problem = topic_name_problem(p.topic)
        if problem is not None:  # a malformed PUBLISH (MQTT 4.7.3): never passed on
            return self._refuse(mqtt5.DisconnectReasonCode.TOPIC_NAME_INVALID, problem)
        try:
            self.client.publish_nowait(event_of(p.topic, p.payload))  # type: ignore[arg-type]
        except ClientError as exc:  # the broker had ended the client (a refused publication)
            return self._refuse(mqtt5.DisconnectReasonCode.NOT_AUTHORIZED, str(exc))
        except ValueError as exc:  # not an event: the payload or an attribute
            if p.qos == mqtt5.QoS.AT_LEAST_ONCE and self.version == V5:
                code = mqtt5.PubAckReasonCode.PAYLOAD_FORMAT_INVALID
                self.send(mqtt5.PubAckPacket(p.packet_id or 0, reason_code=code).write())
                return True
            return self._refuse(mqtt5.DisconnectReasonCode.PAYLOAD_FORMAT_INVALID, str(exc))
        if p.qos == mqtt5.QoS.AT_LEAST_ONCE:
            # Acknowledged once the broker has it (it survives the loss of this connection).
            try:
                acked = await self.client.wait_acknowledged(timeout=ACK_TIMEOUT)
            except ClientError as exc:  # the broker ended the client: e.g. the policy refused
                return self._refuse(mqtt5.DisconnectReasonCode.NOT_AUTHORIZED, str(exc))
            if not acked:
                return self._refuse(mqtt5.DisconnectReasonCode.SERVER_BUSY, "no acknowledgement")
            self.send(mqtt5.PubAckPacket(p.packet_id or 0).write())
        return True

    async def _subscribe(self, p: mqtt5.SubscribePacket) -> bool:
        """Each filter subscribed, or refused in the SUBACK. One the policy refuses ends the
        connection after the SUBACK, as the broker ends a native client's: the broker checks,
        and the gateway does not second-guess it."""
        codes: list[mqtt5.SubAckReasonCode] = []
        refused = ""
        for tf in p.topic_filters:
            if refused:
                codes.append(mqtt5.SubAckReasonCode.NOT_AUTHORIZED)
                continue
            qos = min(int(tf.max_qos), 1)
            try:
                f, check = filter_of(tf.pattern)
            except (MqttError, FilterError) as exc:
                log.info("mqtt: %s: %s", self.client.client_id, exc)
                codes.append(mqtt5.SubAckReasonCode.TOPIC_FILTER_INVALID)
                continue
            known = self.subs.get(tf.pattern)
            if known is None:
                sub_id = f"mqtt{self._next_sub}"
                self._next_sub += 1
                try:
                    await self.client.subscribe(f, sub_id=sub_id)
                except ClientError as exc:
                    refused = f"subscription {tf.pattern!r} refused: {exc}"
                    codes.append(mqtt5.SubAckReasonCode.NOT_AUTHORIZED)
                    continue
                self.by_sub_id[sub_id] = tf.pattern
            else:
                sub_id = known[0]
            self.subs[tf.pattern] = (sub_id, qos, check)
            codes.append(mqtt5.SubAckReasonCode(qos))
        self.send(mqtt5.SubAckPacket(p.packet_id, codes).write())
        if refused:
            return self._refuse(mqtt5.DisconnectReasonCode.NOT_AUTHORIZED, refused)
        return True

    async def _unsubscribe(self, p: mqtt5.UnsubscribePacket) -> None:
        codes: list[mqtt5.UnsubAckReasonCode] = []
        for pattern in p.patterns:
            known = self.subs.pop(pattern, None)
            if known is None:
                codes.append(mqtt5.UnsubAckReasonCode.NO_SUBSCRIPTION_EXISTED)
                continue
            self.by_sub_id.pop(known[0], None)
            await self.client.unsubscribe(known[0])
            codes.append(mqtt5.UnsubAckReasonCode.SUCCESS)
        self.send(mqtt5.UnsubAckPacket(p.packet_id, codes).write())

    async def _forward(self) -> None:
        """Notifications out as PUBLISH packets, in the order the broker delivered them. A slow
        MQTT reader holds this loop at ``drain``, so the broker's slow-consumer policy, not an
        unbounded buffer here, decides what happens."""
        while True:
            try:
                batch = await self.client.receive(1000, timeout=None)
            except ClientError:
                break
            if not batch and self.client.closed:
                break
            for n in batch:
                topic, payload = message_of(n)
                qos = -1
                for sub_id in n.sub_ids:
                    pattern = self.by_sub_id.get(sub_id)
                    sub = self.subs.get(pattern) if pattern is not None else None
                    if sub is not None and (not sub[2] or topic_matches(pattern or "", topic)):
                        qos = max(qos, sub[1])
                if qos < 0:
                    continue  # only a wider filter matched: not this topic
                problem = topic_name_problem(topic)
                if problem is not None:
                    self._unsendable(n, problem)
                    continue
                packet_id = None
                if qos:
                    self._next_packet_id = self._next_packet_id % 65535 + 1
                    packet_id = self._next_packet_id
                try:
                    out = mqtt5.PublishPacket(
                        topic, payload, qos=mqtt5.QoS(qos), packet_id=packet_id
                    ).write()
                except ValueError as exc:  # anything else the codec refuses: that one only
                    self._unsendable(n, str(exc))
                    continue
                self.send(out)
            await self.writer.drain()
        self._client_gone = True
        if not self._handling:  # else the handler answers first, then the connection ends
            self.writer.close()  # the broker ended our client: the MQTT client sees it


class MqttGateway:
    """Accepts MQTT connections and gives each a Canopy client of the broker at ``broker``."""

    def __init__(self, broker: str, ca: Path | None, max_per_source: int = MAX_PER_SOURCE) -> None:
        self.broker = broker
        self.ca = ca
        self.sessions: set[asyncio.Task[None]] = set()
        # Every MQTT connection is a client connection of the broker from this process, which
        # the broker does not count by address (it is its own loopback): this listener bounds
        # them by their remote addresses, so that one of them cannot take every slot.
        self._sources = SourceCounts(max_per_source)
        self.handshakes = TaskSet("mqtt")  # TLS handshakes, counted apart (runtime.accept)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = writer.get_extra_info("peername")  # host and port, for the log
        source = source_of(writer.transport)
        if not self._sources.take(source):
            self._sources.refused(source, log, "mqtt")
            writer.close()
            return
        self.sessions.add(task)
        try:
            await self._connection(reader, writer)
        except MqttError as exc:
            log.info("mqtt: %s: %s; connection closed", peer, exc)
        except ClientError as exc:  # the broker ended this connection's client
            log.info("mqtt: %s: %s; connection closed", peer, exc)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass  # gone, silent past its keep-alive, or never sent CONNECT
        finally:
            self.sessions.discard(task)
            self._sources.give_back(source)
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first, body = await asyncio.wait_for(read_packet(reader), CONNECT_TIMEOUT)
        if first >> 4 != CONNECT:
            raise MqttError("the first packet is not CONNECT")
        at = 2 + _u16(body, 0)
        name, level = body[2:at], body[at] if at < len(body) else 0
        if name != b"MQTT" or level not in (V311, V5):
            # 3.1.1's answer to a version it does not speak (MQTT 3.1 says "MQIsdp").
            writer.write(bytes([CONNACK << 4, 2, 0, 1]))
            raise MqttError(f"protocol {name!r} level {level}: MQTT 3.1.1 and 5 are spoken")
        version = level
        if at + 1 < len(body) and body[at + 1] & 1:  # the CONNECT flags' reserved bit (3.1.2.3)
            raise MqttError("malformed CONNECT: the reserved flag is set")
        connect_packet = parse(_frame(first, body) if version == V5 else upgrade(first, body))
        assert isinstance(connect_packet, mqtt5.ConnectPacket)

        def connack(code: mqtt5.ConnAckReasonCode, **extra: object) -> None:
            packet = mqtt5.ConnAckPacket(reason_code=code, **extra).write()  # type: ignore[arg-type]
            writer.write(packet if version == V5 else downgrade(packet))

        password = connect_packet.password
        token = password.decode(errors="replace") if password else None
        if self.ca is not None and not token:
            connack(Codes.BAD_USER_NAME_OR_PASSWORD)
            raise MqttError("no password (a token of the broker's client policy)")
        try:
            client = await connect(
                self.broker,
                connect_packet.client_id or None,
                credentials=Credentials(ca=self.ca, token=token),
                failover_within=0,
            )
        except ClientError as exc:
            connack(_REFUSALS.get(exc.code, Codes.SERVER_UNAVAILABLE))
            raise MqttError(f"the broker refused: {exc}") from None
        except OSError as exc:
            connack(Codes.SERVER_UNAVAILABLE)
            raise MqttError(f"the broker at {self.broker} cannot be reached: {exc}") from None
        try:
            assigned = None if connect_packet.client_id else client.client_id
            connack(
                Codes.SUCCESS,
                assigned_client_id=assigned,
                max_qos=mqtt5.QoS.AT_LEAST_ONCE,
                max_packet_size=MAX_PACKET,  # a v5 client then does not send larger ones
                retain_available=False,
                wildcard_subscription_available=True,
                subscription_id_available=False,
                shared_subscription_available=False,
            )
            await writer.drain()
            await Session(reader, writer, version, client).serve(connect_packet.keep_alive)
        finally:
            await client.close()

    async def close(self) -> None:
        await self.handshakes.stop()
        for task in list(self.sessions):
            task.cancel()
        for task in list(self.sessions):
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def start_mqtt(
    host: str,
    port: int,
    broker: str,
    ca: Path | None,
    tls: ssl.SSLContext | None,
    *,
    max_per_source: int = MAX_PER_SOURCE,
) -> tuple[Serving, MqttGateway]:
    """Listen for MQTT clients on ``host:port`` (TLS with ``tls``), for the broker at
    ``broker`` reached with ``ca`` (None: plaintext)."""
    gateway = MqttGateway(broker, ca, max_per_source)

    def session() -> asyncio.Protocol:  # what asyncio.start_server makes for each connection
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(), gateway.handle)

    server = await listen(
        session,
        host,
        port,
        tls=tls,
        # CONNECT's time, not asyncio's 60 s
        admission=Admission(CONNECT_TIMEOUT, max_per_source, gateway.handshakes, "mqtt"),
    )
    return server, gateway
