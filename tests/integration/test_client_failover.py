"""Clients of a broker that dies (issue 12, item 4), on real processes: the subscriber and the
publisher attached to the SIGKILLed inner broker fail over and carry on, and nothing is lost,
duplicated or reordered, not for them and not for anybody else.

* The subscriber on b3 is told by nobody: its connection breaks, it attaches to one of b3's
  neighbours (b3's hello named them), re-subscribes and is served what it missed from that
  broker's retention; what came from the other sides reaches it with the repair's replay.
  Twice: one reading with ``receive()``, one consuming with ``on_notifications``.
* The publisher on b3 sends again, after failing over, what no broker had acknowledged; the
  brokers that already had some of it do not deliver it twice.

The negative control: a publisher that does not send anything again loses, for everybody, what
the killed broker had taken and not passed on, and the same check must see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

import pytest

from canopy_broker.client import Client, Gap, connect
from canopy_broker.procs import wait_settled
from tests.integration.crash_overlay import (
    FILTER,
    SUBSCRIBERS,
    close_all,
    drain,
    kill,
    publish_steadily,
    start,
    subscribe_all,
    verdict,
    wait_for_last,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "pacing",
    [(), ("--client-write-interval-ms", "20")],
    ids=["unpaced", "writes-paced-20ms"],  # held in b3's outbox when it dies: resumed elsewhere
)
async def test_the_subscriber_of_a_killed_broker_fails_over_and_misses_nothing(
    tmp_path: Path, pacing: tuple[str, ...]
) -> None:
    brokers = await start(tmp_path, *pacing)
    try:
        clients, received, drains = await subscribe_all(brokers)
        gaps: list[Gap] = []
        orphan = await connect(brokers["b3"].listen, client_id="s3", on_gap=gaps.append)
        await orphan.subscribe(FILTER, sub_id="all")
        received["s3"] = []
        drains.append(asyncio.create_task(drain(orphan, received["s3"])))
        received["s3-callback"] = []  # the same, consuming with on_notifications
        orphan_cb = await connect(
            brokers["b3"].listen,
            client_id="s3-callback",
            on_gap=gaps.append,
            on_notifications=received["s3-callback"].extend,
        )
        await orphan_cb.subscribe(FILTER, sub_id="all")
        cli = await asyncio.create_subprocess_exec(  # and `canopy sub` on b3, from the shell
            sys.executable,
            *("-m", "canopy_operator.cli", "sub", "--broker", brokers["b3"].listen, "--json"),
            FILTER,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert cli.stderr is not None
        assert b"subscribed on b3" in await cli.stderr.readline()
        pub = await connect(brokers["b0"].listen, client_id="p")
        await wait_settled(brokers.values())

        published: list[int] = []
        stop = asyncio.Event()
        publisher = asyncio.create_task(publish_steadily(pub, stop, published))
        await asyncio.sleep(1.0)
        await kill(brokers, "b3")
        await asyncio.sleep(3.0)  # the failover, the repair (0.6 s detection), traffic after
        stop.set()
        await publisher
        await pub.flush()
        last = published[-1]
        await wait_for_last(received, last)

        for client in (orphan, orphan_cb):
            assert client.failovers == 1
            assert client.broker in {"b1", "b4", "b5"}  # one of b3's neighbours (its hello)
        assert gaps == [], [str(g) for g in gaps]
        for sub, got in received.items():
            missed, exact = verdict(got, last, "p")
            assert not missed, f"{sub} missed {len(missed)}: {missed[:10]}"
            assert exact, f"{sub}: duplicated or reordered"

        assert cli.stdout is not None
        seqs: list[int] = []
        with contextlib.suppress(TimeoutError):  # it is one more process on two busy cores
            async with asyncio.timeout(20):
                while not seqs or seqs[-1] < last:
                    seqs.append(json.loads(await cli.stdout.readline())["seq"])
        cli.terminate()
        _, err = await cli.communicate()
        assert seqs == list(range(1, last + 1)), f"canopy sub: {len(seqs)} of {last}"
        assert b"canopy: failed over to b" in err, err
        assert b"gap" not in err, err
        await close_all([pub, orphan, orphan_cb, *clients.values()], drains)
    finally:
        await asyncio.gather(*(b.stop() for b in brokers.values()))


async def publisher_on_the_victim(
    tmp_path: Path, *, resend: bool
) -> tuple[dict[str, list[int]], int, Client]:
    """A publisher on b3 under steady traffic, b3 killed; returns what each subscriber not on
    b3 missed, the last seq published, and the publisher."""
    brokers = await start(tmp_path)
    try:
        clients, received, drains = await subscribe_all(brokers)
        pub = await connect(brokers["b3"].listen, client_id="p")
        pub.resend = resend
        await wait_settled(brokers.values())
        published: list[int] = []
        stop = asyncio.Event()
        publisher = asyncio.create_task(publish_steadily(pub, stop, published))
        await asyncio.sleep(1.0)
        await kill(brokers, "b3", frozen_for=0.3)  # what it took meanwhile, it never passed on
        await asyncio.sleep(3.0)
        stop.set()
        await publisher
        assert await pub.wait_acknowledged(10.0)
        if resend:  # the broker that took it knows since when what it sent again was published
            status = await brokers[pub.broker].admin.status()
            since, when = status["resent"]["p"]
            assert when - 5.0 < since < when, status["resent"]
        last = published[-1]
        missed: dict[str, list[int]] = {}
        with contextlib.suppress(TimeoutError):  # the negative control never gets all
            await wait_for_last(received, last)
        for sub, got in received.items():
            missing, exact = verdict(got, last, "p")
            missed[sub] = missing
            assert exact or missing, f"{sub}: duplicated or reordered"
        await close_all([pub, *clients.values()], drains)
        return missed, last, pub
    finally:
        await asyncio.gather(*(b.stop() for b in brokers.values()))


async def test_the_publisher_of_a_killed_broker_fails_over_and_sends_again_what_was_not_acked(
    tmp_path: Path,
) -> None:
    missed, last, pub = await publisher_on_the_victim(tmp_path, resend=True)
    assert pub.failovers == 1
    assert last > 1000
    assert missed == {s: [] for s in SUBSCRIBERS}, {s: m[:10] for s, m in missed.items()}


async def test_without_sending_again_the_kill_loses_the_publishers_last_events(
    tmp_path: Path,
) -> None:
    """Negative control: a publisher that forgets what was not acknowledged loses what b3 held
    when it died, and the same check must see it."""
    missed, _, _ = await publisher_on_the_victim(tmp_path, resend=False)
    assert any(missed.values()), "the check did not see the loss"
