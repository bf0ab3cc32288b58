"""The MQTT gateway on real processes, with real MQTT clients: two linked brokers with TLS and a
token policy; paho-mqtt speaking 3.1.1 and 5, and the mosquitto_pub/mosquitto_sub command-line
clients (3.1.1 by default). Publications over MQTT reach MQTT subscribers on the other broker
once and in order, at QoS 1 and 0, with topic wildcards checked exactly and a content-based
``$canopy/`` subscription; a native client sees them as events. The policy holds as for native
clients (a bad password refuses the connection, a subscription outside the policy is refused in
its SUBACK), and a malformed packet closes that connection only."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mqtt5
import orjson
import pytest
from paho.mqtt import client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.reasoncodes import ReasonCode

from canopy_broker.client import Client, connect
from canopy_broker.mqtt import MAX_PACKET
from canopy_broker.procs import BrokerProc, wait_settled
from tests.integration.token_pair import READER, WRITER, linked_pair, token_policy

pytestmark = pytest.mark.integration

# "sensors/#" subscribes to `topic prefix "sensors"` (it matches "sensors" too), so the reader's
# allowed filter is that one.
POLICY = token_policy(publish="topic prefix 'sensors/'", subscribe="topic prefix 'sensors'")


async def start(tmp_path: Path) -> tuple[BrokerProc, BrokerProc, Path]:
    return await linked_pair(tmp_path, POLICY, "--mqtt", "127.0.0.1:0")


class Mqtt:
    """A paho client on its own thread, its messages and answers collected for the test."""

    def __init__(self, address: str, ca: Path, client_id: str, token: str, v5: bool) -> None:
        protocol = paho.MQTTv5 if v5 else paho.MQTTv311
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol)
        self.c.tls_set(ca_certs=str(ca))
        self.c.tls_insecure_set(True)  # broker certificates name canopy identities, not hosts
        self.c.username_pw_set("unused", token)
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.messages: list[tuple[str, bytes, int]] = []
        self.granted: dict[int, list[int]] = {}
        self.acked: set[int] = set()
        self.connected = threading.Event()
        # Set when the broker ends the connection. `is_connected()` cannot tell: paho's network
        # thread reconnects by itself a second after a lost connection, so a poll that comes
        # late (a loaded machine) sees the new connection and never the end of the old one.
        self.dropped = threading.Event()
        self.reason: ReasonCode | None = None
        self.lock = threading.Lock()
        self.c.on_connect = self._on_connect
        self.c.on_message = self._on_message
        self.c.on_subscribe = self._on_subscribe
        self.c.on_publish = self._on_publish
        self.c.on_disconnect = self._on_disconnect

    def _on_connect(self, _c: Any, _u: Any, _f: Any, reason: ReasonCode, _p: Any) -> None:
        self.reason = reason
        self.connected.set()

    def _on_disconnect(self, _c: Any, _u: Any, _f: Any, _r: ReasonCode, _p: Any) -> None:
        self.dropped.set()

    def _on_message(self, _c: Any, _u: Any, msg: paho.MQTTMessage) -> None:
        with self.lock:
            self.messages.append((msg.topic, msg.payload, msg.qos))

    def _on_subscribe(self, _c: Any, _u: Any, mid: int, codes: list[ReasonCode], _p: Any) -> None:
        self.granted[mid] = [c.value for c in codes]

    def _on_publish(self, _c: Any, _u: Any, mid: int, _r: Any, _p: Any) -> None:
        self.acked.add(mid)

    async def start(self) -> ReasonCode:
        self.c.connect(self.host, self.port, keepalive=30)
        self.c.loop_start()
        assert await asyncio.to_thread(self.connected.wait, 15), "no CONNACK"
        assert self.reason is not None
        return self.reason

    async def subscribe(self, *topics: tuple[str, int]) -> list[int]:
        _rc, mid = self.c.subscribe(list(topics))
        await until(lambda: mid in self.granted, "SUBACK")
        return self.granted[mid]

    async def wait_messages(self, n: int) -> list[tuple[str, bytes, int]]:
        await until(lambda: len(self.messages) >= n, f"{n} messages ({len(self.messages)})")
        with self.lock:
            return list(self.messages)

    def stop(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()
        # paho wakes its network thread through a loopback socket pair that only its __del__
        # closes; close it now rather than leave it to the garbage collector's order.
        self.c._reset_sockets()


async def read_to_end(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection (a TLS close may be abrupt)."""
    try:
        return await reader.read()
    except (ConnectionError, ssl.SSLError):
        return b""


async def shut(clients: list[Mqtt], native: Client | None, *brokers: BrokerProc) -> None:
    """Stop the test's MQTT clients, its native client and its brokers."""
    for c in clients:
        c.stop()
    if native is not None:
        await native.close()
    await asyncio.gather(*(b.stop() for b in brokers))


async def until(test: Callable[[], bool], what: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not test():
        assert time.monotonic() < deadline, f"waited {within} s for {what}"
        await asyncio.sleep(0.05)


async def test_mqtt_clients_publish_and_subscribe_with_the_brokers_guarantees(
    tmp_path: Path,
) -> None:
    a, b, ca = await start(tmp_path)
    clients: list[Mqtt] = []
    native = None
    try:
        assert a.mqtt and b.mqtt
        # On b: a 3.1.1 subscriber with a wildcard, a 5 subscriber with a content filter.
        temps = Mqtt(b.mqtt, ca, "reader/temps", READER, v5=False)
        hot = Mqtt(b.mqtt, ca, "reader/hot", READER, v5=True)
        pub = Mqtt(a.mqtt, ca, "writer/dev", WRITER, v5=True)
        clients += [temps, hot, pub]
        for c in clients:
            assert not (await c.start()).is_failure
        assert await temps.subscribe(("sensors/+/temp", 1)) == [1]
        assert await hot.subscribe(("$canopy/topic prefix 'sensors/' and value >= 190", 2)) == [1]
        native = await connect(b.listen, "reader/native")
        await native.subscribe("topic prefix 'sensors/k1/'")
        await wait_settled([a, b])

        # 200 temperatures at QoS 1 and 50 humidities at QoS 0, interleaved, from a 5 client.
        mids = []
        for i in range(200):
            info = pub.c.publish("sensors/k1/temp", orjson.dumps({"value": i}), qos=1)
            mids.append(info.mid)
            if i % 4 == 0:
                pub.c.publish("sensors/k1/humidity", orjson.dumps({"value": 1000 + i}), qos=0)
        await until(lambda: set(mids) <= pub.acked, "PUBACKs for every QoS 1 publication")

        got = await temps.wait_messages(200)
        # Exactly the temperatures (the humidity topics match the broker-side prefix only), once
        # each, in publication order, at the granted QoS.
        assert [orjson.loads(p)["value"] for _t, p, _q in got] == list(range(200))
        assert {(t, q) for t, _p, q in got} == {("sensors/k1/temp", 1)}
        hot_got = await hot.wait_messages(60)  # temperatures 190..199, every humidity (1000+)
        values = [orjson.loads(p)["value"] for _t, p, _q in hot_got]
        assert [v for v in values if v < 1000] == list(range(190, 200))
        assert [v for v in values if v >= 1000] == list(range(1000, 1200, 4))
        # At the granted QoS: Canopy delivers a QoS 0 publication as reliably as any other.
        assert {q for _t, _p, q in hot_got} == {1}
        mine = []
        while len(mine) < 250:
            more = await native.receive(1000, timeout=5)
            assert more, f"the native client got {len(mine)} of 250"
            mine += more
        seqs = [n.seq for n in mine]  # one publisher, in order (numbered from the clock)
        assert seqs == list(range(seqs[0], seqs[0] + 250))
        assert {n.publisher for n in mine} == {"writer/dev"}
        assert mine[0].attrs == {"topic": "sensors/k1/temp", "value": 0}

        # The mosquitto command-line clients (MQTT 3.1.1): a plain-text payload round trip.
        sub_cmd, pub_cmd = shutil.which("mosquitto_sub"), shutil.which("mosquitto_pub")
        assert sub_cmd and pub_cmd, "make setup installs mosquitto-clients"
        host, port = b.mqtt.rsplit(":", 1)
        tls = ("--cafile", str(ca), "--insecure", "-u", "x")
        sub = await asyncio.create_subprocess_exec(
            sub_cmd, "-h", host, "-p", port, *tls, "-P", READER, "-i", "reader/cli",
            "-t", "sensors/cli/#", "-q", "1", "-C", "3", "-v",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await asyncio.sleep(1.0)  # its SUBSCRIBE reaches a
        await wait_settled([a, b])
        ahost, aport = a.mqtt.rsplit(":", 1)
        for text in ("21.5", "22.0", "hello world"):
            done = await asyncio.create_subprocess_exec(
                pub_cmd, "-h", ahost, "-p", aport, *tls, "-P", WRITER, "-i", "writer/cli",
                "-t", "sensors/cli/x", "-q", "1", "-m", text,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _out, err = await done.communicate()
            assert done.returncode == 0, err.decode()
        out, err = await asyncio.wait_for(sub.communicate(), 20)
        assert sub.returncode == 0, err.decode()
        assert out.decode().splitlines() == [
            "sensors/cli/x 21.5",
            "sensors/cli/x 22.0",
            "sensors/cli/x hello world",
        ]
    finally:
        await shut(clients, native, a, b)


async def test_the_mqtt_gateway_refuses_what_the_policy_or_the_protocol_gets_wrong(
    tmp_path: Path,
) -> None:
    a, b, ca = await start(tmp_path)
    clients: list[Mqtt] = []
    try:
        assert a.mqtt
        for v5, code in ((False, "Bad user name or password"), (True, "Bad user name or password")):
            stranger = Mqtt(a.mqtt, ca, "reader/x", "not-a-token", v5=v5)
            clients.append(stranger)
            reason = await stranger.start()
            assert reason.is_failure and str(reason) == code, (v5, str(reason))
        wrong_id = Mqtt(a.mqtt, ca, "someone-else", READER, v5=True)
        clients.append(wrong_id)
        assert str(await wrong_id.start()) == "Not authorized"

        # A filter the policy does not allow ("#" is wider than "sensors/"): its SUBACK says
        # so (0x80 in 3.1.1, 0x87 in 5), and the broker ends the connection, as it ends a native
        # client's. An invalid filter is only refused (0x8F), the connection kept.
        v311 = Mqtt(a.mqtt, ca, "reader/policy", READER, v5=False)
        v5 = Mqtt(a.mqtt, ca, "reader/policy5", READER, v5=True)
        clients += [v311, v5]
        assert not (await v311.start()).is_failure and not (await v5.start()).is_failure
        assert await v5.subscribe(("$canopy/value >", 0), ("sensors/#", 0)) == [0x8F, 0]
        assert v5.c.is_connected() and not v5.dropped.is_set()
        assert await v311.subscribe(("sensors/#", 1), ("#", 1)) == [1, 0x80]
        assert await v5.subscribe(("#", 0)) == [0x87]
        await until(v311.dropped.is_set, "the 3.1.1 client's disconnection")
        await until(v5.dropped.is_set, "the 5 client's disconnection")

        # A stranger's bytes: not a CONNECT, a length of 268 MB, a 3.1 client ("MQIsdp", told
        # the version is not spoken: return code 1). Each closes its own connection only.
        ctx = ssl.create_default_context(cafile=str(ca))
        ctx.check_hostname = False
        host, port = a.mqtt.rsplit(":", 1)
        mqisdp = b"\x00\x06MQIsdp\x03\x02\x00\x3c\x00\x01x"
        for junk, answer in (
            (b"\x00\x01garbage", b""),
            (b"\x30\x01\x00", b""),
            (b"\x10\xff\xff\xff\x7f", b""),
            (bytes([0x10, len(mqisdp)]) + mqisdp, b"\x20\x02\x00\x01"),
        ):
            reader_s, writer_s = await asyncio.open_connection(host, int(port), ssl=ctx)
            writer_s.write(junk)
            await writer_s.drain()
            assert await asyncio.wait_for(read_to_end(reader_s), 15) == answer, junk
            writer_s.close()
        # A connected MQTT 5 client announcing a packet past the limit the CONNACK advertised:
        # told why (DISCONNECT 0x95), before its body is read, and closed.
        reader_s, writer_s = await asyncio.open_connection(host, int(port), ssl=ctx)
        hello = mqtt5.ConnectPacket("writer/big", password=WRITER.encode()).write()
        writer_s.write(hello)
        connack, _ = mqtt5.read(memoryview(await reader_s.read(4096)))
        assert isinstance(connack, mqtt5.ConnAckPacket), connack
        assert connack.reason_code == mqtt5.ConnAckReasonCode.SUCCESS
        assert connack.max_packet_size == MAX_PACKET
        big = MAX_PACKET + 1
        writer_s.write(
            b"\x30" + bytes([(big & 0x7F) | 0x80, ((big >> 7) & 0x7F) | 0x80, big >> 14])
        )
        told, _ = mqtt5.read(memoryview(await asyncio.wait_for(read_to_end(reader_s), 15)))
        assert isinstance(told, mqtt5.DisconnectPacket), told
        assert told.reason_code == mqtt5.DisconnectReasonCode.PACKET_TOO_LARGE
        writer_s.close()
        # Plain TCP on the TLS listener: the handshake fails, nothing MQTT is answered.
        reader_s, writer_s = await asyncio.open_connection(host, int(port))
        writer_s.write(bytes([0x10, len(mqisdp)]) + mqisdp)
        answered = await asyncio.wait_for(read_to_end(reader_s), 15)
        assert not answered.startswith(b"\x20"), answered
        writer_s.close()

        # Still serving: a good subscriber gets a good publisher's message.
        after = Mqtt(a.mqtt, ca, "reader/after", READER, v5=False)
        writer = Mqtt(b.mqtt, ca, "writer/after", WRITER, v5=False)
        clients += [after, writer]
        assert not (await after.start()).is_failure and not (await writer.start()).is_failure
        assert await after.subscribe(("sensors/after", 1)) == [1]
        await wait_settled([a, b])
        writer.c.publish("sensors/after", b"still here", qos=1)
        assert await after.wait_messages(1) == [("sensors/after", b"still here", 1)]
        # A publication the policy refuses (a reader may not publish): the connection ends.
        after.c.publish("sensors/after", b"not allowed", qos=1)
        await until(after.dropped.is_set, "the refused publisher's disconnection")
    finally:
        for c in clients:
            c.stop()
        await asyncio.gather(a.stop(), b.stop())


async def test_a_topic_no_mqtt_message_can_carry_costs_that_notification_only(
    tmp_path: Path,
) -> None:
    """Any client may give the ``topic`` attribute any text: a wildcard, a control character,
    more than MQTT's 65,535 bytes. Such a notification is skipped for MQTT subscribers (no
    PUBLISH can carry it), and the next ones still go out (review: the codec raised in the
    middle of forwarding, and that subscriber heard nothing more while its connection stayed
    up). Over MQTT, a PUBLISH with such a topic name is malformed (DISCONNECT 0x90), and one
    the codec cannot even read (an invalid UTF-8 topic, on which its Rust core panics) closes
    that connection only, with no traceback in the broker's log."""
    a, b, ca = await start(tmp_path)
    clients: list[Mqtt] = []
    native = None
    try:
        assert a.mqtt
        v311 = Mqtt(a.mqtt, ca, "reader/all", READER, v5=False)
        v5 = Mqtt(a.mqtt, ca, "reader/all5", READER, v5=True)
        clients += [v311, v5]
        for c in clients:
            assert not (await c.start()).is_failure
            assert await c.subscribe(("sensors/#", 1)) == [1]
        native = await connect(b.listen, "poisoner")
        await wait_settled([a, b])
        for topic in ("sensors/+", "sensors/#", "sensors/a\x01b", "sensors/" + "x" * 70_000):
            native.publish_nowait({"topic": topic, "n": 0})
        native.publish_nowait({"topic": "sensors/ok", "n": 1})
        await native.flush()
        for c in (v311, v5):
            assert await c.wait_messages(1) == [("sensors/ok", b'{"n":1}', 1)]
            assert c.c.is_connected() and not c.dropped.is_set()

        ctx = ssl.create_default_context(cafile=str(ca))
        ctx.check_hostname = False
        host, port = a.mqtt.rsplit(":", 1)
        for topic, told in (
            (b"sensors/+", True),
            (b"sensors/\x00", True),
            (b"x\x1a\xa1\xc4", False),
        ):
            reader_s, writer_s = await asyncio.open_connection(host, int(port), ssl=ctx)
            writer_s.write(mqtt5.ConnectPacket("writer/bad", password=WRITER.encode()).write())
            connack, _ = mqtt5.read(memoryview(await reader_s.read(4096)))
            assert isinstance(connack, mqtt5.ConnAckPacket), connack
            body = len(topic).to_bytes(2, "big") + topic + b"\x00\x01" + b"\x00" + b"hi"
            writer_s.write(bytes([0x32, len(body)]) + body)  # PUBLISH, QoS 1, packet id 1
            answer = await asyncio.wait_for(read_to_end(reader_s), 15)
            if told:
                packet, _ = mqtt5.read(memoryview(answer))
                assert isinstance(packet, mqtt5.DisconnectPacket), (topic, packet)
                assert packet.reason_code == mqtt5.DisconnectReasonCode.TOPIC_NAME_INVALID
            else:
                assert answer == b"", (topic, answer)
            writer_s.close()
        # What MQTT calls malformed, the connection closed with nothing answered: a length not
        # in its shortest form, a CONNECT with its reserved flag set, a SUBSCRIBE whose packet
        # identifier is 0, one with a reserved bit of its options set, one with U+0000 in its
        # filter (the last two the codec lets through).
        good = mqtt5.ConnectPacket("writer/r", password=WRITER.encode()).write()
        assert good[1] < 0x80  # its length in one byte: say it in two, 0x80 | n, 0
        longhand = bytes([good[0], good[1] | 0x80, 0]) + good[2:]
        flagged = bytearray(good)
        flagged[9] |= 1  # the CONNECT flags byte, after the header, "MQTT" and the level
        reader_connect = mqtt5.ConnectPacket("reader/z", password=READER.encode()).write()
        sub0 = b"\x00\x00" + b"\x00" + b"\x00\x09sensors/x\x01"  # packet id 0, no properties
        reserved = b"\x00\x05" + b"\x00" + b"\x00\x09sensors/x\x81"
        null = b"\x00\x05" + b"\x00" + b"\x00\x09sensors/\x00\x01"
        for opening, then in (
            (longhand, b""),
            (bytes(flagged), b""),
            (reader_connect, sub0),
            (reader_connect, reserved),
            (reader_connect, null),
        ):
            reader_s, writer_s = await asyncio.open_connection(host, int(port), ssl=ctx)
            writer_s.write(opening)
            if then:
                connack, _ = mqtt5.read(memoryview(await reader_s.read(4096)))
                assert isinstance(connack, mqtt5.ConnAckPacket), connack
                writer_s.write(bytes([0x82, len(then)]) + then)
            assert await asyncio.wait_for(read_to_end(reader_s), 15) == b"", opening
            writer_s.close()
        # A topic alias, when the CONNACK advertised none: DISCONNECT 0x94, nothing published.
        reader_s, writer_s = await asyncio.open_connection(host, int(port), ssl=ctx)
        writer_s.write(mqtt5.ConnectPacket("writer/alias", password=WRITER.encode()).write())
        connack, _ = mqtt5.read(memoryview(await reader_s.read(4096)))
        assert isinstance(connack, mqtt5.ConnAckPacket), connack
        writer_s.write(mqtt5.PublishPacket("sensors/ok", b'{"n":-1}', topic_alias=1).write())
        packet, _ = mqtt5.read(memoryview(await asyncio.wait_for(read_to_end(reader_s), 15)))
        assert isinstance(packet, mqtt5.DisconnectPacket), packet
        assert packet.reason_code == mqtt5.DisconnectReasonCode.TOPIC_ALIAS_INVALID
        writer_s.close()
        native.publish_nowait({"topic": "sensors/ok", "n": 2})
        await native.flush()
        for c in (v311, v5):
            assert [m[1] for m in await c.wait_messages(2)] == [b'{"n":1}', b'{"n":2}']
        assert a.log_path is not None
        log = await asyncio.to_thread(a.log_path.read_text)
        assert "Unhandled exception" not in log and "PanicException" not in log, log[-3000:]
        assert "cannot go out over MQTT" in log
    finally:
        await shut(clients, native, a, b)
