"""The MQTT gateway's pure parts: topic matching, the topic ↔ attribute mapping, the 3.1.1 ↔ 5
packet adapter (checked against hand-built 3.1.1 packets from the specification) and the bounded
packet reader. Real clients (paho, mosquitto_pub/sub) are in tests/integration/test_mqtt.py."""

from __future__ import annotations

import asyncio

import mqtt5
import pytest

from canopy_broker.core.filters import Filter
from canopy_broker.mqtt import (
    MAX_PACKET,
    V5,
    V311,
    MqttError,
    check_subscription_options,
    downgrade,
    event_of,
    filter_of,
    message_of,
    read_packet,
    start_mqtt,
    topic_matches,
    upgrade,
)
from canopy_broker.runtime.inbox import Notification


@pytest.mark.parametrize(
    ("pattern", "topic", "matches"),
    [
        ("a/b", "a/b", True),
        ("a/b", "a/b/c", False),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/+/c", "a/x/c", True),
        ("a/+/c", "a/x/d", False),
        ("a/#", "a", True),  # the parent level too (MQTT 4.7.1.2)
        ("a/#", "a/b/c", True),
        ("a/#", "ab/c", False),
        ("#", "x/y", True),
        ("#", "$SYS/x", False),  # no leading wildcard matches a $ topic
        ("+/x", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("+/+", "/x", True),  # an empty first level is a level
    ],
)
def test_topic_matching_follows_mqtt(pattern: str, topic: str, matches: bool) -> None:
    assert topic_matches(pattern, topic) is matches


@pytest.mark.parametrize(
    ("pattern", "canopy", "check"),
    [
        ("a/b", 'topic = "a/b"', False),
        ("a/#", 'topic prefix "a"', True),
        ("a/+/c", 'topic prefix "a/"', True),
        ("#", "topic exists", True),
        ("+/x", "topic exists", True),
        ('we"ird', 'topic = "we\\"ird"', False),
        ("$canopy/price > 10 and sym = 'X'", "price > 10 and sym = 'X'", False),
    ],
)
def test_topic_filters_become_canopy_filters(pattern: str, canopy: str, check: bool) -> None:
    f, exact = filter_of(pattern)
    assert f == Filter.parse(canopy) and exact is check


@pytest.mark.parametrize("pattern", ["a/#/b", "a#", "a/b+", "", "x/++"])
def test_invalid_topic_filters_are_refused(pattern: str) -> None:
    with pytest.raises(MqttError, match="topic filter"):
        filter_of(pattern)


def test_publications_become_events_and_notifications_go_back_out_unchanged() -> None:
    assert event_of("s/1", b'{"v": 2, "ok": true, "topic": "x"}') == {
        "v": 2,
        "ok": True,
        "topic": "s/1",  # the MQTT topic wins over a payload key of that name
    }
    assert event_of("s/1", b"21.5") == {"topic": "s/1", "payload": "21.5"}
    assert event_of("s/1", b'{"nested": {"a": 1}}') == {
        "topic": "s/1",
        "payload": '{"nested": {"a": 1}}',
    }
    assert event_of("s/1", b"{not json") == {"topic": "s/1", "payload": "{not json"}
    with pytest.raises(ValueError, match="UTF-8"):
        event_of("s/1", b"\xff\xfe")
    raw = Notification("p", 1, 0, {"topic": "s/1", "payload": "21.5"}, ("mqtt0",))
    assert message_of(raw) == ("s/1", b"21.5")
    obj = Notification("p", 2, 0, {"topic": "s/1", "v": 2}, ("mqtt0",))
    assert message_of(obj) == ("s/1", b'{"v":2}')
    native = Notification("feed", 3, 1, {"kind": "t"}, ("mqtt0",))
    assert message_of(native) == ("canopy/feed", b'{"kind":"t"}')


def _str(s: str) -> bytes:
    return len(s.encode()).to_bytes(2, "big") + s.encode()


def test_311_packets_are_read_by_the_mqtt5_codec_after_upgrade() -> None:
    # CONNECT, 3.1.1 (MQTT-3.1): flags = user name, password, will (QoS 0), clean session.
    flags = 0x80 | 0x40 | 0x04 | 0x02
    body = _str("MQTT") + bytes([4, flags]) + (60).to_bytes(2, "big")
    body += _str("dev-1") + _str("w/t") + _str("bye") + _str("user") + _str("tok")
    connect, _ = mqtt5.read(memoryview(upgrade(0x10, body)))
    assert isinstance(connect, mqtt5.ConnectPacket)
    assert (connect.client_id, connect.username, connect.password) == ("dev-1", "user", b"tok")
    assert connect.keep_alive == 60 and connect.will is not None
    assert (connect.will.topic, connect.will.payload) == ("w/t", b"bye")

    publish = _str("s/1") + (7).to_bytes(2, "big") + b"hello"  # QoS 1
    p, _ = mqtt5.read(memoryview(upgrade(0x32, publish)))
    assert isinstance(p, mqtt5.PublishPacket)
    assert (p.topic, p.payload, p.packet_id, int(p.qos)) == ("s/1", b"hello", 7, 1)
    q0, _ = mqtt5.read(memoryview(upgrade(0x30, _str("s/1") + b"x")))
    assert isinstance(q0, mqtt5.PublishPacket) and q0.payload == b"x" and q0.packet_id is None

    subscribe = (3).to_bytes(2, "big") + _str("a/+") + b"\x01" + _str("b/#") + b"\x00"
    s, _ = mqtt5.read(memoryview(upgrade(0x82, subscribe)))
    assert isinstance(s, mqtt5.SubscribePacket) and s.packet_id == 3
    assert [(t.pattern, int(t.max_qos)) for t in s.topic_filters] == [("a/+", 1), ("b/#", 0)]

    u, _ = mqtt5.read(memoryview(upgrade(0xA2, (4).to_bytes(2, "big") + _str("a/+"))))
    assert isinstance(u, mqtt5.UnsubscribePacket) and u.patterns == ["a/+"]


@pytest.mark.parametrize(
    ("version", "options", "malformed"),
    [
        (V5, 0x01, False),
        (V5, 0x2D, False),  # no local, retain as published, retain handling 2, QoS 1
        (V5, 0x41, True),
        (V5, 0x81, True),
        (V311, 0x01, False),
        (V311, 0x05, True),  # what 5 calls "no local" is reserved in 3.1.1
        (V311, 0x80, True),
    ],
)
def test_reserved_subscription_option_bits_make_a_subscribe_malformed(
    version: int, options: int, malformed: bool
) -> None:
    """The codec reads a SUBSCRIBE as if its reserved option bits were not there; MQTT calls
    it malformed (3.8.3.1), so the listener checks them, on every filter of the packet."""
    properties = b"\x00" if version == V5 else b""
    filters = _str("a/b") + b"\x00" + _str("c") + bytes([options])
    body = (3).to_bytes(2, "big") + properties + filters
    if malformed:
        with pytest.raises(MqttError, match="reserved option bits"):
            check_subscription_options(body, version)
    else:
        check_subscription_options(body, version)
    with pytest.raises(MqttError, match="truncated"):
        check_subscription_options(body[:-1], version)


def test_server_packets_are_written_in_311_form() -> None:
    codes = mqtt5.ConnAckReasonCode
    assert downgrade(mqtt5.ConnAckPacket().write()) == b"\x20\x02\x00\x00"
    refused = mqtt5.ConnAckPacket(reason_code=codes.NOT_AUTHORIZED).write()
    assert downgrade(refused) == b"\x20\x02\x00\x05"
    bad = mqtt5.ConnAckPacket(reason_code=codes.BAD_USER_NAME_OR_PASSWORD).write()
    assert downgrade(bad) == b"\x20\x02\x00\x04"
    sub = mqtt5.SubAckPacket(
        3, [mqtt5.SubAckReasonCode(1), mqtt5.SubAckReasonCode.NOT_AUTHORIZED]
    ).write()
    assert downgrade(sub) == b"\x90\x04\x00\x03\x01\x80"
    unsub = mqtt5.UnsubAckPacket(3, [mqtt5.UnsubAckReasonCode.SUCCESS]).write()
    assert downgrade(unsub) == b"\xb0\x02\x00\x03"
    assert downgrade(mqtt5.PubAckPacket(9).write()) == b"\x40\x02\x00\x09"
    pub = mqtt5.PublishPacket("s/1", b"hi", qos=mqtt5.QoS.AT_LEAST_ONCE, packet_id=5).write()
    assert downgrade(pub) == b"\x32\x09" + _str("s/1") + b"\x00\x05hi"
    pub0 = mqtt5.PublishPacket("s/1", b"hi").write()
    assert downgrade(pub0) == b"\x30\x07" + _str("s/1") + b"hi"


async def test_the_packet_reader_bounds_sizes_and_refuses_malformed_lengths() -> None:
    def reader(data: bytes) -> asyncio.StreamReader:
        r = asyncio.StreamReader()
        r.feed_data(data)
        r.feed_eof()
        return r

    assert await read_packet(reader(b"\xc0\x00")) == (0xC0, b"")  # PINGREQ
    big = MAX_PACKET + 1
    length = bytes([(big & 0x7F) | 0x80, ((big >> 7) & 0x7F) | 0x80, big >> 14])
    with pytest.raises(MqttError, match="bytes"):
        await read_packet(reader(b"\x30" + length))  # refused before reading the body
    with pytest.raises(MqttError, match="remaining length"):
        await read_packet(reader(b"\x30\xff\xff\xff\xff\x01"))
    with pytest.raises(asyncio.IncompleteReadError):
        await read_packet(reader(b"\x30\x05ab"))


async def test_one_address_cannot_take_every_mqtt_slot() -> None:
    """Every MQTT connection is a client of the broker from the gateway's own address, so the
    broker's per-source limit cannot tell remote addresses apart: the listener does. Past its
    limit a source's next connection is closed at once; the ones it has stay open (each waits
    for its CONNECT), and a slot freed is usable again."""
    server, gateway = await start_mqtt("127.0.0.1", 0, "127.0.0.1:9", None, None, max_per_source=3)
    host, port = server.sockets[0].getsockname()[:2]
    try:
        held = [await asyncio.open_connection(host, port) for _ in range(3)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection(host, port)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # refused: closed at once
        writer.close()
        for r, _w in held:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(r.read(1), 0.2)  # still open, waiting for CONNECT
        held.pop()[1].close()
        await asyncio.sleep(0.1)
        again = await asyncio.open_connection(host, port)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(again[0].read(1), 0.2)  # a freed slot is taken again
        again[1].close()
        for _r, w in held:
            w.close()
    finally:
        server.close()
        await gateway.close()
        await server.wait_closed()
