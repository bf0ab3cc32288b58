"""Telemetry for the mining job: sampled event history, link counters, RTT probes.

Schema ``canopy.telemetry/v1`` (documented in docs/broker.md). Every record is a flat JSON object
with ``schema``, ``type``, ``broker``, ``ts`` (Unix seconds, float) and ``cursor`` (a per-broker
counter that increases by one per record, so a puller can resume with ``?since=cursor``).

Record types:

* ``event``: one sampled event as this broker saw it: ``event_id``, ``publisher``, ``seq``,
  ``hops``, ``source_kind`` (``client`` | ``link``), ``source`` (client id or neighbour name),
  ``matched_local`` (did it match a local subscription), ``deliveries`` (local clients it went
  to), ``forwarded_to`` (neighbours), ``attrs``.
* ``link``: a snapshot of one link's counters (``peer``, ``state``, ``msgs_in``, ``msgs_out``,
  ``bytes_in``, ``bytes_out``, ``rtt_ms``).
* ``placement``: where the broker runs (``zone``, ``node``; "" when unknown), when it is first
  known or changes and with every round of link snapshots, so any window of records has it.
* ``rtt``: one round trip (``peer``, ``rtt_ms``, ``via``): ``heartbeat`` on a link to a
  neighbour, or ``probe``, a fresh connection to a broker of the address book that is not a
  neighbour (underlay distances for the miner's network-distance matrix).

Sampling is decided by :func:`canopy_broker.core.events.is_sampled` on the event id (computed as
:func:`~canopy_broker.core.events.event_sampled` without building the id), a hash that
is the same on every broker, so all brokers keep the *same* events and the miner can intersect
their histories. Records live in a ring buffer of the last *N* and, with ``--telemetry-dir``, are
appended as JSON lines to ``broker=NAME/date=YYYY-MM-DD/hour=HH/part-<start>-<pid>.jsonl`` (Hive
style partitions, which Spark reads as columns).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from canopy_broker.core.events import Event
from canopy_broker.core.messages import Deliver, Effect, SendToLink
from canopy_broker.runtime.placement import Placement

SCHEMA = "canopy.telemetry/v1"
log = logging.getLogger("canopy.telemetry")


class Telemetry:
    """Ring buffer of records plus an optional JSON-lines writer."""

    def __init__(
        self,
        broker: str,
        *,
        sample_rate: float = 0.01,
        history: int = 10_000,
        directory: str | Path | None = None,
    ) -> None:
        self.broker = broker
        self.sample_rate = sample_rate
        self._ring: deque[dict[str, Any]] = deque(maxlen=max(1, history))
        self._cursor = 0
        self._dir = Path(directory) if directory is not None else None
        self._pending: list[dict[str, Any]] = []
        self._part = f"part-{int(time.time())}-{os.getpid()}.jsonl"
        self.written = 0

    # -- recording ---------------------------------------------------------------------------

    def _add(self, rec: dict[str, Any]) -> None:
        self._cursor += 1
        rec["cursor"] = self._cursor
        self._ring.append(rec)
        if self._dir is not None:
            self._pending.append(rec)

    def _base(self, kind: str) -> dict[str, Any]:
        return {"schema": SCHEMA, "type": kind, "broker": self.broker, "ts": time.time()}

    def record_event(
        self, event: Event, source_kind: str, source: str, effects: Sequence[Effect]
    ) -> None:
        """Record ``event``, one the consistent sampler keeps: the broker asks
        :func:`~canopy_broker.core.events.event_sampled` with :attr:`sample_rate` before
        calling, so the 99 % of events a 1 % sample leaves out cost no call here."""
        deliveries = [t[0] for e in effects if type(e) is Deliver for t in e.targets]
        rec = self._base("event")
        rec.update(
            event_id=event.id,
            publisher=event.publisher,
            seq=event.seq,
            hops=event.hops,
            source_kind=source_kind,
            source=source,
            matched_local=bool(deliveries),
            deliveries=len(deliveries),
            forwarded_to=[e.peer for e in effects if type(e) is SendToLink],
            attrs=dict(event.attrs),
        )
        self._add(rec)

    def rtt(self, peer: str, rtt_ms: float, via: str = "heartbeat") -> None:
        rec = self._base("rtt")
        rec.update(peer=peer, rtt_ms=round(rtt_ms, 4), via=via)
        self._add(rec)

    def placement(self, where: Placement) -> None:
        rec = self._base("placement")
        rec.update(zone=where.zone, node=where.node)
        self._add(rec)

    def link(self, peer: str, fields: dict[str, Any]) -> None:
        rec = self._base("link")
        rec["peer"] = peer
        rec.update(fields)
        self._add(rec)

    # -- reading -----------------------------------------------------------------------------

    def since(self, cursor: int, limit: int = 10_000) -> dict[str, Any]:
        """Records with a cursor above ``cursor`` (oldest first), for ``GET /telemetry``.

        ``truncated`` is true when records after ``cursor`` already fell out of the ring, so the
        puller knows its history has a gap.
        """
        ring = self._ring
        oldest = ring[0]["cursor"] if ring else self._cursor + 1
        start = max(0, cursor + 1 - oldest)
        records = [ring[i] for i in range(start, min(len(ring), start + limit))]
        return {
            "schema": SCHEMA,
            "broker": self.broker,
            "sample_rate": self.sample_rate,
            "records": records,
            "next": records[-1]["cursor"] if records else max(cursor, self._cursor),
            "truncated": cursor + 1 < oldest and cursor < self._cursor,
        }

    # -- JSON lines --------------------------------------------------------------------------

    def _write_pending(self, recs: list[dict[str, Any]]) -> None:
        assert self._dir is not None
        by_path: dict[Path, list[bytes]] = {}
        for rec in recs:
            t = time.gmtime(rec["ts"])
            path = (
                self._dir
                / f"broker={self.broker}"
                / time.strftime("date=%Y-%m-%d", t)
                / time.strftime("hour=%H", t)
                / self._part
            )
            by_path.setdefault(path, []).append(orjson.dumps(rec) + b"\n")
        for path, lines in by_path.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("ab") as fh:
                fh.writelines(lines)
        self.written += len(recs)

    async def flush(self) -> None:
        """Append buffered records to the partitioned files (in a thread: disks can stall)."""
        if self._dir is None or not self._pending:
            return
        recs, self._pending = self._pending, []
        try:
            await asyncio.to_thread(self._write_pending, recs)
        except OSError:
            log.exception("could not write %d telemetry records", len(recs))
