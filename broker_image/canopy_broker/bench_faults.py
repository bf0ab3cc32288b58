"""``canopy bench faults``: what a broker crash costs, measured on real processes.

Three scenarios, every figure measured on this run:

* **kill**: the 7-broker overlay of the crash-resilience issue (b0-b1, b1-b2, b1-b3, b3-b4,
  b3-b5, b5-b6), a publisher on b0 at ``--rate`` events/s, subscribers on b0, b2, b4 and b6;
  b3 is SIGKILLed. Reported: time from the kill to the repaired tree (the chain links in the
  survivors' tables) and to the repair complete on all of b3's neighbours (routes known over the
  chain, retained notifications replayed), how many repair links were promoted standby links
  and how many were dialed (``--no-standby``: all dialed, for comparison), and per subscriber
  what was lost, duplicated or reordered (all must be 0: none is on b3).
* **retention**: a chain of 3 brokers at 1,000 and 10,000 events/s (paced), custody on with a
  ``--window`` second window: the notifications kept and the middle broker's RSS, against the
  same run with custody off.
* **custody cost**: the chain-of-3 data-plane benchmark (``canopy bench dataplane``'s scenario,
  flat out) with custody on and off: delivered notifications/s and broker CPU per event.
* **exchange** (only with ``--only exchange``): the chain b0-b1-b2-b3-b4-b5 under
  ``--rate`` events/s from a publisher on b3, subscribers on b1 and b5; b0 starts exchanging
  b4-b5 for b0-b5 (a cycle of all six, the broker's default 30 s lease) and ``--victim`` (b0,
  the initiator, by default) is SIGKILLed each of ``--delays`` ms later, ``--tries`` times
  each. Reported per run: which of its neighbours declared it dead first, the time from the
  kill to every broker out of the
  exchange with every link known at both ends, and per subscriber what was lost, how many
  gaps it was told of, and what was duplicated or reordered (all must be 0: neither
  subscriber is on the victim; b1 and b5 are not victims here).

Progress goes to stderr; with ``--json`` the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from canopy_broker.bench import done, progress, run_dataplane
from canopy_broker.client import Client, ConnectionLostError, Gap, Notification, connect
from canopy_broker.procs import Overlay, wait_settled
from canopy_broker.progress import showing
from canopy_broker.runtime import eventloop

NAMES = ["b0", "b1", "b2", "b3", "b4", "b5", "b6"]
EDGES = [("b0", "b1"), ("b1", "b2"), ("b1", "b3"), ("b3", "b4"), ("b3", "b5"), ("b5", "b6")]
SUBSCRIBERS = {"s0": "b0", "s2": "b2", "s4": "b4", "s6": "b6"}
CHAIN = {("b1", "b4"), ("b4", "b5")}
B3_NEIGHBOURS = ("b1", "b4", "b5")


def _edges(statuses: dict[str, dict[str, Any]]) -> set[tuple[str, str]]:
    out: set[tuple[str, str]] = set()
    for name, st in statuses.items():
        for n in st["neighbours"]:
            a, b = sorted((name, str(n["peer"])))
            out.add((a, b))
    return out


async def drain_into(client: Client, into: list[Notification]) -> None:
    """Keep what ``client`` receives in ``into`` until it closes or its broker is lost for
    good (benchmarks count what arrived, they do not fail on a loss)."""
    try:
        while batch := await client.receive(1000):
            into.extend(batch)
    except ConnectionLostError:
        return


async def _repair_records(ov: Overlay) -> dict[str, dict[str, Any]]:
    """b3's neighbours' records of its repair (admin status), once complete on all of them."""
    async with asyncio.timeout(60):
        while True:
            last: dict[str, dict[str, Any]] = {}
            for n in B3_NEIGHBOURS:
                recs = (await ov[n].admin.status())["repairs"]
                if recs and recs[-1]["dead"] == "b3" and "complete_at" in recs[-1]:
                    last[n] = recs[-1]
            if len(last) == len(B3_NEIGHBOURS):
                return last
            await asyncio.sleep(0.02)


async def kill_scenario(
    rate: float, heartbeat: float, dead_after: int, *, standby: bool = True
) -> dict[str, Any]:
    args = ["--heartbeat", str(heartbeat), "--dead-after", str(dead_after)]
    if not standby:
        args.append("--no-standby")
    async with Overlay(NAMES, EDGES, extra_args=args) as ov:
        received: dict[str, list[Notification]] = {s: [] for s in SUBSCRIBERS}
        clients = []
        drains = []
        for sub, b in SUBSCRIBERS.items():
            c = await connect(ov[b].listen, client_id=sub, credentials=ov.credentials)
            await c.subscribe("n >= 0")
            clients.append(c)
            drains.append(asyncio.create_task(drain_into(c, received[sub])))
        pub = await connect(ov["b0"].listen, client_id="p", credentials=ov.credentials)
        first = pub.last_seq + 1  # its numbering starts from the clock
        await wait_settled(ov.brokers.values())
        stop = asyncio.Event()
        publisher = asyncio.create_task(_paced(pub, rate, stop))
        await asyncio.sleep(2.0)
        kept = await _retained(ov, "b1")
        victim = ov.brokers.pop("b3")
        progress(f"kill: SIGKILL b3 at {rate:,.0f} events/s ({kept} notifications kept on b1)")
        killed, killed_wall = time.monotonic(), time.time()
        os.kill(victim.pid, signal.SIGKILL)
        await victim.stop()
        ov.edges = [e for e in ov.edges if "b3" not in e]
        repaired_s = None
        async with asyncio.timeout(60):
            while repaired_s is None:
                statuses = await ov.statuses()
                if _edges(statuses) >= CHAIN:
                    repaired_s = time.monotonic() - killed
                else:
                    await asyncio.sleep(0.02)
        progress(f"kill: tree repaired {repaired_s:.2f}s after the kill")
        records = await _repair_records(ov)
        complete_s = max(r["complete_at"] for r in records.values()) - killed_wall
        detected_s = max(r["at"] for r in records.values()) - killed_wall
        promoted = sum(len(r.get("promoted", ())) for r in records.values())
        dialed = sum(len(r.get("dialed", ())) for r in records.values())
        progress(
            f"kill: repair complete {complete_s:.3f}s after the kill; link ends promoted "
            f"{promoted}, dialed {dialed}"
        )
        await asyncio.sleep(2.0)
        last, per_sub = await _stop_and_count(pub, publisher, stop, received, first)
        for sub, counts in per_sub.items():
            counts["broker"] = SUBSCRIBERS[sub]
        replayed = sum(
            [await _metric(ov, b, "canopy_replayed_notifications_total") for b in ov.brokers]
        )
        for c in [pub, *clients]:
            await c.close()
        for d in drains:
            await d
    return {
        "rate": rate,
        "detection_timeout_s": heartbeat * dead_after,
        "repaired_s": round(repaired_s, 3),
        "repair_complete_s": round(complete_s, 3),
        "last_detection_s": round(detected_s, 3),  # the last of b3's neighbours to see it
        "standby": standby,
        "repair_link_ends_promoted": promoted,
        "repair_link_ends_dialed": dialed,
        "published": last - first + 1,  # sequence numbers start from the clock
        "replayed": int(replayed),
        "subscribers": per_sub,
    }


CHAIN6 = [f"b{i}" for i in range(6)]


async def exchange_kill_run(
    rate: float,
    heartbeat: float,
    dead_after: int,
    delay_ms: float,
    victim: str,
    *,
    log_dir: Path | None = None,
) -> dict[str, Any]:
    """One kill of ``victim`` ``delay_ms`` after b0 started its exchange (see the module);
    ``log_dir``: where the brokers write their logs (else nowhere)."""
    args = ["--heartbeat", str(heartbeat), "--dead-after", str(dead_after)]
    edges = list(itertools.pairwise(CHAIN6))
    async with Overlay(CHAIN6, edges, extra_args=args, log_dir=log_dir) as ov:
        received: dict[str, list[Notification]] = {"s1": [], "s5": []}
        gaps: dict[str, list[Gap]] = {"s1": [], "s5": []}
        clients, drains = [], []
        for sub, into in received.items():
            c = await connect(
                ov[f"b{sub[1]}"].listen,
                client_id=sub,
                credentials=ov.credentials,
                on_gap=gaps[sub].append,
            )
            await c.subscribe("n >= 0")
            clients.append(c)
            drains.append(asyncio.create_task(drain_into(c, into)))
        pub = await connect(ov["b3"].listen, client_id="p", credentials=ov.credentials)
        first = pub.last_seq + 1
        await wait_settled(ov.brokers.values())
        stop = asyncio.Event()
        publisher = asyncio.create_task(_paced(pub, rate, stop))
        await asyncio.sleep(1.0)
        started = await ov["b0"].admin.start_exchange(CHAIN6, ("b4", "b5"))
        await asyncio.sleep(delay_ms / 1000)
        proc = ov.brokers.pop(victim)
        killed, killed_wall = time.monotonic(), time.time()
        os.kill(proc.pid, signal.SIGKILL)
        await proc.stop()
        ov.edges = []
        settled_s = None
        unsettled: dict[str, Any] = {}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(60):
                while settled_s is None:
                    statuses = await ov.statuses()
                    told = {
                        (n, str(p["peer"])) for n, st in statuses.items() for p in st["neighbours"]
                    }
                    mutual = {e for e in told if (e[1], e[0]) in told}
                    locked = sorted(n for n, st in statuses.items() if st["exchange"] is not None)
                    if not locked and len(mutual) == 8 and len(told) == 8:
                        settled_s = time.monotonic() - killed
                    else:
                        unsettled = {"in_exchange": locked, "one_sided": sorted(told - mutual)}
                        await asyncio.sleep(0.02)
        verdicts = {}
        for n in ov.brokers:
            recs = [r for r in (await ov[n].admin.status())["repairs"] if r["dead"] == victim]
            if recs:
                verdicts[n] = recs[-1]["at"] - killed_wall
        await asyncio.sleep(1.0)
        last, per_sub = await _stop_and_count(pub, publisher, stop, received, first)
        for sub, counts in per_sub.items():
            counts["gaps_told"] = len(gaps[sub])
        for c in [pub, *clients]:
            await c.close()
        for d in drains:
            await d
    first_verdict = min(verdicts, key=verdicts.__getitem__) if verdicts else None
    return {
        "victim": victim,
        "delay_ms": delay_ms,
        "exchange": started.get("state"),
        "first_verdict": first_verdict,
        "verdicts_s": {n: round(t, 3) for n, t in verdicts.items()},
        "settled_s": None if settled_s is None else round(settled_s, 3),
        "unsettled_after_60s": unsettled if settled_s is None else None,
        "published": last - first + 1,
        "subscribers": per_sub,
    }


async def _stop_and_count(
    pub: Client,
    publisher: asyncio.Task[None],
    stop: asyncio.Event,
    received: dict[str, list[Notification]],
    first: int,
) -> tuple[int, dict[str, dict[str, Any]]]:
    """Stop publishing; the last sequence number, and per subscriber what it lost (after up
    to 30 s for the rest to arrive), got twice, or got out of order."""
    stop.set()
    await publisher
    await pub.flush()
    last = pub.last_seq
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):
            while any(not r or r[-1].seq < last for r in received.values()):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    per_sub: dict[str, dict[str, Any]] = {}
    for sub, got in received.items():
        seqs = [n.seq for n in got]
        twice = sorted({q for q, n in collections.Counter(seqs).items() if n > 1})
        per_sub[sub] = {
            "lost": len(set(range(first, last + 1)) - set(seqs)),
            "duplicated": len(seqs) - len(set(seqs)),
            "reordered": sum(1 for a, b in itertools.pairwise(seqs) if b < a),
            "duplicated_first": twice[:10],  # to look up in the brokers' logs
        }
    return last, per_sub


async def _paced(pub: Client, rate: float, stop: asyncio.Event) -> None:
    n, start = 0, time.monotonic()
    while not stop.is_set():
        due = int((time.monotonic() - start) * rate)
        while n < due:
            n += 1
            pub.publish_nowait({"n": n})
        await pub.flush()
        await asyncio.sleep(0.005)


async def exchange_kill_scenario(
    rate: float,
    heartbeat: float,
    dead_after: int,
    delays: Sequence[float],
    *,
    tries: int,
    victim: str,
    keep_logs: Path | None = None,
) -> list[dict[str, Any]]:
    """Each kill in turn; ``keep_logs``: a directory where the brokers' logs of each run that
    lost, duplicated or reordered anything, or did not settle within ``SLOW_SETTLE`` seconds
    (a wait for a timer, not the failure detection), are kept (one folder a run)."""
    runs = []
    for delay in delays:
        for i in range(tries):
            progress(f"exchange: SIGKILL {victim} {delay:g} ms into b0's exchange (try {i + 1})")
            logs = None if keep_logs is None else keep_logs / f"{victim}-{delay:g}ms-{i + 1}"
            if logs is not None:
                logs.mkdir(parents=True, exist_ok=True)
            run = await exchange_kill_run(rate, heartbeat, dead_after, delay, victim, log_dir=logs)
            if logs is not None and _clean(run) and run["settled_s"] <= SLOW_SETTLE:
                shutil.rmtree(logs)
            elif logs is not None:
                run["logs"] = str(logs)
            runs.append(run)
    return runs


SLOW_SETTLE = 5.0  # s: settled later than this, a run's logs are kept too


def _clean(run: dict[str, Any]) -> bool:
    return run["settled_s"] is not None and not any(
        s["lost"] or s["duplicated"] or s["reordered"] for s in run["subscribers"].values()
    )


async def _metric(ov: Overlay, broker: str, name: str) -> float:
    text = await ov[broker].admin.metrics()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def _retained(ov: Overlay, broker: str) -> int:
    return int(await _metric(ov, broker, "canopy_retention_depth"))


async def retention_scenario(rate: float, window: float) -> dict[str, Any]:
    out: dict[str, Any] = {"rate": rate, "window_s": window}
    for label, retention in (("on", window), ("off", 0.0)):
        args = ["--retention", str(retention), "--retention-limit", "10000000"]
        async with Overlay(["b1", "b2", "b3"], [("b1", "b2"), ("b2", "b3")], extra_args=args) as ov:
            sub = await connect(ov["b3"].listen, credentials=ov.credentials)
            await sub.subscribe("n >= 0")
            got: list[Notification] = []
            drain = asyncio.create_task(drain_into(sub, got))
            pub = await connect(ov["b1"].listen, credentials=ov.credentials)
            await wait_settled(ov.brokers.values())
            n, start = 0, time.monotonic()
            while time.monotonic() - start < window + 1.0:
                due = int((time.monotonic() - start) * rate)
                while n < due:
                    n += 1
                    pub.publish_nowait({"n": n, "pad": "x" * 64})
                await pub.flush()
                await asyncio.sleep(0.005)
            kept = await _retained(ov, "b2")
            rss = ov["b2"].rss_mb()
            progress(f"retention {label} at {rate:,.0f} events/s: {kept} kept, b2 RSS {rss:.1f} MB")
            out[label] = {"kept": kept, "rss_mb": round(rss, 1), "published": n}
            await pub.close()
            await sub.close()
            await drain
    out["extra_rss_mb"] = round(out["on"]["rss_mb"] - out["off"]["rss_mb"], 1)
    return out


async def custody_cost(duration: float, rounds: int) -> dict[str, Any]:
    """On and off alternately, ``rounds`` times each, medians: one pair of runs on two shared
    cores differs by more than custody costs (measured: ratios from 0.78 to 1.12)."""
    runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for _ in range(rounds):
        for label, args in (("on", []), ("off", ["--retention", "0"])):
            async with Overlay(
                ["b1", "b2", "b3"],
                [("b1", "b2"), ("b2", "b3")],
                extra_args=["--telemetry-sample", "0.01", *args],
            ) as ov:
                name = f"chain of 3, custody {label}"
                runs[label].append(await run_dataplane(ov, "b1", "b3", duration, name))
    out: dict[str, Any] = {"rounds": rounds}
    for label, results in runs.items():
        out[label] = {
            key: statistics.median(r[key] for r in results)
            for key in ("notif_per_s", "broker_cpu_us_per_event", "p99_ms")
        }
    out["throughput_ratio"] = round(out["on"]["notif_per_s"] / out["off"]["notif_per_s"], 3)
    out["cpu_ratio"] = round(
        out["on"]["broker_cpu_us_per_event"] / out["off"]["broker_cpu_us_per_event"], 3
    )
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    only = scenarios(args)
    out: dict[str, Any] = {}
    if "kill" in only:
        out["kill"] = await kill_scenario(
            args.rate, args.heartbeat, args.dead_after, standby=args.standby
        )
        done("kill")
    if "retention" in only:
        out["retention"] = [await retention_scenario(r, args.window) for r in (1_000.0, 10_000.0)]
        done("retention")
    if "custody" in only:
        out["custody"] = await custody_cost(args.duration, args.rounds)
        done("custody")
    if "exchange" in only:
        out["exchange"] = await exchange_kill_scenario(
            args.rate,
            args.heartbeat,
            args.dead_after,
            args.delays,
            tries=args.tries,
            victim=args.victim,
            keep_logs=args.keep_logs,
        )
        done("exchange")
    return out


def scenarios(args: argparse.Namespace) -> set[str]:
    return set(args.only or ("kill", "retention", "custody"))  # exchange: only when asked


def report(r: dict[str, Any]) -> str:
    lines: list[str] = []
    if "kill" in r:
        lines += _kill_report(r["kill"])
    for ret in r.get("retention", ()):
        lines.append(
            f"retention at {ret['rate']:,.0f} events/s, {ret['window_s']:.0f} s window: "
            f"{ret['on']['kept']} kept, +{ret['extra_rss_mb']} MB RSS on the middle broker"
        )
    for run in r.get("exchange", ()):
        subs = ", ".join(
            f"{sub}: lost {x['lost']} (gaps told {x['gaps_told']}), duplicated "
            f"{x['duplicated']}, reordered {x['reordered']}"
            for sub, x in run["subscribers"].items()
        )
        lines.append(
            f"{run['victim']} killed {run['delay_ms']:g} ms into the exchange: "
            f"{run['first_verdict']} declared it "
            f"dead first {run['verdicts_s']}; "
            + (
                f"settled {run['settled_s']:.2f} s after the kill; "
                if run["settled_s"] is not None
                else f"not settled 60 s after the kill {run['unsettled_after_60s']}; "
            )
            + subs
            + (f"; logs kept in {run['logs']}" if "logs" in run else "")
        )
    if "custody" in r:
        c = r["custody"]
        lines.append(
            f"custody on vs off (chain of 3, flat out, medians of {c['rounds']}): "
            f"{c['on']['notif_per_s']:,.0f} vs {c['off']['notif_per_s']:,.0f} notifications/s = "
            f"{c['throughput_ratio']:.0%} (goal >= 90%); CPU "
            f"{c['on']['broker_cpu_us_per_event']:.0f}"
            f" vs {c['off']['broker_cpu_us_per_event']:.0f} us/event"
        )
    return "\n".join(lines)


def _kill_report(k: dict[str, Any]) -> list[str]:
    lines = [
        f"kill b3 at {k['rate']:,.0f} events/s: repaired in {k['repaired_s']:.2f} s, complete "
        f"in {k['repair_complete_s']:.3f} s (detection timeout {k['detection_timeout_s']:.1f} s;"
        f" goal <= 2x), {k['published']} published, {k['replayed']} replayed",
        f"  detected by the last of b3's neighbours {k['last_detection_s']:.3f} s after the kill, "
        f"repair complete {(k['repair_complete_s'] - k['last_detection_s']) * 1000:.0f} ms later;"
        f" repair link ends: {k['repair_link_ends_promoted']} promoted standby links, "
        f"{k['repair_link_ends_dialed']} dialed"
        + ("" if k["standby"] else " (standby links off: --no-standby)"),
    ]
    for sub, s in k["subscribers"].items():
        lines.append(
            f"  {sub} on {s['broker']}: lost {s['lost']}, duplicated {s['duplicated']}, "
            f"reordered {s['reordered']}"
        )
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    parser.add_argument("--rate", type=float, default=1000.0, help="events/s in the kill run")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="broker --heartbeat, s")
    parser.add_argument("--dead-after", type=int, default=3, help="broker --dead-after")
    parser.add_argument(
        "--no-standby",
        dest="standby",
        action="store_false",
        help="run the kill with the brokers' standby links off (repair links dialed)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=["kill", "retention", "custody", "exchange"],
        help="run only this scenario (repeatable; default: kill, retention and custody)",
    )
    parser.add_argument(
        "--delays",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[0.0, 6.0, 9.0, 12.0, 18.0, 24.0, 40.0, 100.0],
        help="exchange: ms from the exchange's start to the kill, comma-separated",
    )
    parser.add_argument("--tries", type=int, default=2, help="exchange: kills per delay")
    parser.add_argument(
        "--victim",
        choices=["b0", "b2", "b4"],
        default="b0",
        help="exchange: the broker killed (b0 starts the exchange, b4 is the removed link's "
        "end on its side, b2 is between them)",
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="exchange: keep the brokers' logs of each run that lost, duplicated or reordered "
        f"anything, or did not settle within {SLOW_SETTLE:g} s, in DIR/<victim>-<delay>ms-<try>",
    )
    parser.add_argument("--window", type=float, default=5.0, help="retention window measured, s")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per flat-out phase")
    parser.add_argument(
        "--rounds", type=int, default=3, help="custody on/off runs each (medians reported)"
    )


def run_args(args: argparse.Namespace) -> int:
    with showing("bench faults", len(scenarios(args))):
        result = eventloop.run(run(args))
    print(report(result))
    if args.json:
        print(json.dumps(result))
    kill = result.get("kill", {"subscribers": {}})
    bad = [s for s in kill["subscribers"].values() if s["lost"] or s["duplicated"]]
    bad += [run for run in result.get("exchange", ()) if not _clean(run)]
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="canopy bench faults", description=__doc__)
    add_arguments(parser)
    return run_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
