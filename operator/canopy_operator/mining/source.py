"""Where the miner's input comes from, and what it keeps of it.

Telemetry (schema ``canopy.telemetry/v1``) is read as JSON lines from a directory (the brokers'
``--telemetry-dir`` layout, ``broker=NAME/date=…/hour=…/part-….jsonl``), from any path Spark can
read (``s3a://…``), or pulled first from the brokers' admin APIs (``GET /telemetry``) into a
staging directory of the same layout, so that one reader serves every source.

JSON lines are cheap for a broker to append, and costly for Spark to read (the parse is most of a
mining run). :func:`compact_telemetry` turns closed JSON files (an hour a broker no longer
appends to) into Parquet under ``_parquet/`` (the explicit schema below, partitioned by the hour
of the record), and hides the JSON files it compacted (a leading dot: Spark skips them) without
deleting them. The reader reads both, so a directory may be compacted in part, or not at all.
Compaction keeps each (broker, event) once, so that the reader need not: de-duplicating ten
million records is the costliest step of a mining run, paid once per file this way instead of
once per run. It commits through a staging directory (see :func:`compact_telemetry`), so a crash
part-way neither loses records nor compacts the same file twice.

The reader is strict about meaning and lenient about damage: every record is classified once
(ok, malformed JSON, another schema version, missing fields, a broker the overlay does not
have), the bad ones are counted and skipped, and an input with no usable event at all is an
error that says why. Telemetry files are appended to by live brokers and pulled more than once,
so the same (broker, event) may appear twice: it is kept once.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from pyspark import StorageLevel
from pyspark.sql import functions as F

from canopy_broker.admin_client import AdminClient, AdminError
from canopy_operator.mining.errors import TelemetryError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SCHEMA_V1 = "canopy.telemetry/v1"
CORRUPT = "_corrupt_record"
PARQUET_DIR = "_parquet"  # Spark's file listing skips names starting with "_" or "."
DEDUPLICATED = "_DEDUPLICATED"  # in PARQUET_DIR: every batch in it holds each (broker, event) once
STAGING = "_compacting-"  # a compaction under way (or interrupted): its journal and its output
CLOSED_AFTER_S = 3600.0  # a JSON file untouched this long has no broker appending to it

# Columns the miner reads; anything else in a record (``attrs``, …) is never parsed. Counters
# are read as numbers of either kind (another writer may emit ``1.0``) and cast where used.
_FIELDS: tuple[tuple[str, str], ...] = (
    ("schema", "string"),
    ("type", "string"),
    ("broker", "string"),
    ("ts", "double"),
    ("cursor", "double"),
    ("event_id", "string"),
    ("publisher", "string"),
    ("hops", "double"),
    ("source_kind", "string"),
    ("source", "string"),
    ("matched_local", "boolean"),
    ("deliveries", "double"),
    ("peer", "string"),
    ("rtt_ms", "double"),
    ("via", "string"),
    ("msgs_in", "double"),
    ("msgs_out", "double"),
    ("bytes_in", "double"),
    ("bytes_out", "double"),
    ("zone", "string"),
    (CORRUPT, "string"),
)

# Why a record was skipped, in the order the checks apply.
SKIP_REASONS = ("malformed", "other_schema", "incomplete", "unknown_broker", "unknown_type")


@dataclass
class Telemetry:
    """The usable records, split by type, and the count of what was skipped and why."""

    events: DataFrame  # broker, event_id, publisher, hops, source_kind, source, matched, deliveries
    rtts: DataFrame  # broker, peer, rtt_ms, via
    links: DataFrame  # broker, peer, msgs_in, msgs_out, bytes_in, bytes_out (latest snapshot)
    records: int = 0
    zones: dict[str, str] = field(default_factory=dict)  # broker -> zone it last reported
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())


def schema_ddl() -> str:
    return ", ".join(f"`{name}` {kind}" for name, kind in _FIELDS)


def _json(spark: SparkSession, where: str | list[str]) -> DataFrame:
    """JSON lines with the explicit schema (no inference pass); a damaged line becomes a row
    with only ``_corrupt_record`` set, for the classification to count."""
    reader = (
        spark.read.schema(schema_ddl())
        .option("mode", "PERMISSIVE")
        .option("columnNameOfCorruptRecord", CORRUPT)
    )
    if isinstance(where, list):
        return reader.json(where)
    return (
        reader.option("recursiveFileLookup", "true")  # broker=… folders are data, not partitions
        .option("pathGlobFilter", "*.json*")  # .jsonl from brokers, .json from Spark
        .json(where)
    )


def json_files(root: Path) -> list[Path]:
    """The JSON telemetry files under ``root`` that a reader sees (not hidden, not compacted)."""
    return sorted(
        p
        for p in root.rglob("*.json*")
        if p.is_file()
        and not any(part.startswith(("_", ".")) for part in p.relative_to(root).parts)
    )


def compact_telemetry(
    spark: SparkSession,
    root: Path,
    *,
    into: Path | None = None,
    everything: bool = False,
    now: float | None = None,
) -> int:
    """Write the closed JSON files under ``root`` as Parquet into ``into/_parquet`` (default:
    ``root``), partitioned by hour, each (broker, event) once, and hide them; returns how many
    files were compacted.

    ``everything``: every file, closed or not (a directory nobody writes to any more). With
    ``into`` elsewhere, the JSON files stay as they are (a copy, e.g. for the benchmark).

    The commit, so that a crash anywhere leaves the directory readable and whole: the batch's
    journal (the files, whether to hide them) and its Parquet go to a staging directory first;
    a marker then commits it; only then are the JSON files hidden and the Parquet files moved
    into ``_parquet`` (both steps can be redone). The next compaction finishes a committed batch
    an earlier one left behind, and discards an uncommitted one (its JSON files were never
    touched). A ``_parquet`` created this way is marked :data:`DEDUPLICATED`; one written by an
    older version is not, and the reader then de-duplicates it, as before.
    """
    home = into or root
    finish_compactions(root, home)
    cutoff = (now if now is not None else time.time()) - CLOSED_AFTER_S
    files = [p for p in json_files(root) if everything or p.stat().st_mtime < cutoff]
    if not files:
        return 0
    target = home / PARQUET_DIR
    if not target.exists():
        target.mkdir(parents=True)
        (target / DEDUPLICATED).touch()
    staging = home / f"{STAGING}{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    journal = {"files": [str(p.relative_to(root)) for p in files], "hide": into is None}
    (staging / "journal.json").write_text(json.dumps(journal))
    records = _json(spark, [str(p) for p in files]).persist(StorageLevel.MEMORY_AND_DISK)
    keyed = F.coalesce(
        (F.col("type") == "event") & F.col("broker").isNotNull() & F.col("event_id").isNotNull(),
        F.lit(False),
    )
    once = (
        records.where(keyed)
        .dropDuplicates(["broker", "event_id"])
        .unionByName(records.where(~keyed))  # the others (damaged ones too) as they are
    )
    hour = F.date_format(F.from_unixtime(F.col("ts")), "yyyy-MM-dd'T'HH")
    (
        once.withColumn("hour", F.coalesce(hour, F.lit("unknown")))
        .write.partitionBy("hour")
        .parquet(str(staging / "data"))
    )
    records.unpersist()
    (staging / "COMMITTED").touch()
    _publish(root, home, staging)
    return len(files)


def finish_compactions(root: Path, home: Path) -> None:
    """Finish the committed compactions a crash left in ``home``; discard the others."""
    for staging in sorted(home.glob(f"{STAGING}*")):
        if (staging / "COMMITTED").exists():
            _publish(root, home, staging)
        else:
            shutil.rmtree(staging)


def _publish(root: Path, home: Path, staging: Path) -> None:
    """A committed batch: hide its JSON files, move its Parquet files in, drop the staging
    directory. Each step skips what is done already, so it can be run again after a crash."""
    journal = json.loads((staging / "journal.json").read_text())
    if journal["hide"]:
        for rel in journal["files"]:
            p = root / rel
            if p.exists():
                p.rename(p.with_name("." + p.name))
    data = staging / "data"
    for f in sorted(data.glob("hour=*/*.parquet")):
        dest = home / PARQUET_DIR / f.parent.name / f.name  # Spark's names are unique (a UUID)
        dest.parent.mkdir(parents=True, exist_ok=True)
        f.rename(dest)
    shutil.rmtree(staging)


def read_telemetry(
    spark: SparkSession,
    path: str | Path,
    brokers: Iterable[str],
    *,
    since_ts: float | None = None,
) -> Telemetry:
    """Read, classify and clean the telemetry under ``path`` for an overlay of ``brokers``;
    with ``since_ts`` (Unix seconds), only events recorded from then on are mined (e.g. the
    traffic since the last reconfiguration)."""
    where = str(path)
    if "://" not in where and not Path(where).exists():
        raise TelemetryError(f"no telemetry at {where}: the path does not exist")
    # Spark remembers a directory's listing per session: files compacted (renamed) or written
    # since an earlier read of the same path would be missed or looked for in vain.
    spark.catalog.refreshByPath(where)
    # `_once`: the record comes from Parquet that compaction wrote de-duplicated.
    raw = _json(spark, where).withColumn("_once", F.lit(False))
    compacted = Path(where) / PARQUET_DIR
    columnar_only = trusted = False
    if "://" not in where and compacted.is_dir():
        trusted = (compacted / DEDUPLICATED).exists()
        columnar = (
            spark.read.schema(schema_ddl())
            .parquet(str(compacted))
            .drop("hour")
            .withColumn("_once", F.lit(trusted))
        )
        if json_files(Path(where)):
            raw = raw.unionByName(columnar)
        else:
            raw, columnar_only = columnar, True
    known = sorted(set(brokers))  # `isin` with many values becomes a hash-set lookup
    is_event = F.col("type") == "event"
    status = (
        F.when(F.col(CORRUPT).isNotNull(), "malformed")
        .when(F.col("schema").isNull() | (F.col("schema") != SCHEMA_V1), "other_schema")
        .when(F.col("broker").isNull() | F.col("type").isNull(), "incomplete")
        .when(
            is_event
            & (
                F.col("event_id").isNull()
                | F.col("source_kind").isNull()
                | F.col("matched_local").isNull()
            ),
            "incomplete",
        )
        .when(
            (F.col("type") == "rtt") & (F.col("peer").isNull() | F.col("rtt_ms").isNull()),
            "incomplete",
        )
        .when((F.col("type") == "link") & F.col("peer").isNull(), "incomplete")
        .when(~F.col("broker").isin(known), "unknown_broker")
        .when(~F.col("type").isin("event", "rtt", "link", "placement"), "unknown_type")
        .otherwise("ok")
    )
    # One parse of JSON files: the classified, narrowed records are cached and everything below
    # (the counts, the events, the small rtt and link tables) is computed from that cache.
    # Parquet alone is not cached: each query below reads only the columns it needs, which is
    # cheaper than building a cache of all of them.
    keep = [name for name, _ in _FIELDS if name not in (CORRUPT, "schema")] + ["_once"]
    narrow = raw.select(status.alias("_status"), *keep)
    if not columnar_only:
        narrow = narrow.persist(StorageLevel.MEMORY_AND_DISK)
    counts = {
        r["_status"]: r["n"]
        for r in narrow.groupBy("_status").agg(F.count("*").alias("n")).collect()
    }
    total = sum(counts.values())
    skipped = {reason: counts.get(reason, 0) for reason in SKIP_REASONS if counts.get(reason, 0)}
    good = narrow.where(F.col("_status") == "ok")

    # Partitioned by event once: the de-duplication, the self-join for associativity and the
    # per-event aggregations of the replay then need no further shuffle of the big table.
    # Compacted Parquet marked de-duplicated skips the de-duplication (the costliest step
    # here); JSON beside it is still de-duplicated, on its own.
    unique = ["broker", "event_id"]
    all_events = good.where(is_event).select(
        *unique,
        "publisher",
        F.coalesce("hops", F.lit(0)).cast("long").alias("hops"),
        "source_kind",
        "source",
        F.col("matched_local").alias("matched"),
        F.coalesce("deliveries", F.lit(0)).cast("long").alias("deliveries"),
        "_once",
    )
    if not trusted:
        events = all_events.repartition("event_id").dropDuplicates(unique)
    elif columnar_only:
        events = all_events.repartition("event_id")
    else:
        loose = all_events.where(~F.col("_once")).repartition("event_id").dropDuplicates(unique)
        events = all_events.where(F.col("_once")).unionByName(loose).repartition("event_id")
    events = events.drop("_once")
    if since_ts is not None:
        # Whole events only: those whose publisher's broker recorded them from then on (an
        # event cut in two by the boundary would count hops it did not make, or miss some).
        fresh = good.where(
            is_event & (F.col("source_kind") == "client") & (F.col("ts") >= since_ts)
        ).select("event_id")
        events = events.join(fresh, "event_id", "left_semi")
    events = events.persist(StorageLevel.MEMORY_AND_DISK)
    if counts.get("ok", 0) == 0 or events.isEmpty():
        found = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no records"
        raise TelemetryError(
            f"no usable event records in {where} ({found}); expected {SCHEMA_V1} JSON lines "
            f"from brokers {', '.join(sorted(set(brokers))[:5])}…"
        )
    rtts = good.where(F.col("type") == "rtt").select(
        "broker", "peer", "rtt_ms", F.coalesce("via", F.lit("heartbeat")).alias("via")
    )
    latest = F.max(F.struct("ts", "cursor", "msgs_in", "msgs_out", "bytes_in", "bytes_out"))
    links = (
        good.where(F.col("type") == "link")
        .groupBy("broker", "peer")
        .agg(latest.alias("s"))
        .select(
            "broker",
            "peer",
            *(
                F.col(f"s.{c}").cast("long").alias(c)
                for c in ("msgs_in", "msgs_out", "bytes_in", "bytes_out")
            ),
        )
    )
    # Where each broker runs, as it last said (the zone its node is in; a broker that knows
    # none says ""): real placement, which the manifest's declared zones only stand in for.
    placed = (
        good.where((F.col("type") == "placement") & (F.coalesce("zone", F.lit("")) != ""))
        .groupBy("broker")
        .agg(F.max(F.struct("ts", "cursor", "zone")).alias("s"))
        .select("broker", F.col("s.zone").alias("zone"))
        .collect()
    )
    rtts, links = rtts.persist(), links.persist()
    rtts.count(), links.count()  # materialised: the wide cache can go
    narrow.unpersist()
    return Telemetry(
        events=events,
        rtts=rtts,
        links=links,
        records=total,
        skipped=skipped,
        zones={str(r["broker"]): str(r["zone"]) for r in placed},
    )


# -- pulling from brokers ---------------------------------------------------------------------


@dataclass
class Pulled:
    """What a pull fetched: records per broker (-1: unreachable, nothing kept from it) and
    where the brokers' histories were cut short."""

    records: dict[str, int] = field(default_factory=dict)
    oldest_ts: dict[str, float] = field(default_factory=dict)  # of brokers whose ring overflowed

    @property
    def unreachable(self) -> list[str]:
        return sorted(b for b, n in self.records.items() if n < 0)

    @property
    def window_start(self) -> float | None:
        """From when every broker's history is complete: events before it are missing on the
        brokers whose ring buffer overflowed, which would bias their associativity down (and
        cut events short), so the miner starts there."""
        return max(self.oldest_ts.values()) if self.oldest_ts else None

    def since(self, since_ts: float | None = None) -> float | None:
        """Where mining starts: the later of ``since_ts`` and :attr:`window_start`."""
        starts = [t for t in (since_ts, self.window_start) if t is not None]
        return max(starts) if starts else None

    def describe(self) -> str:
        got = sum(n for n in self.records.values() if n > 0)
        text = f"pulled {got:,} telemetry records from {len(self.records)} brokers"
        if self.unreachable:
            text += f"; unreachable: {', '.join(self.unreachable)}"
        if self.oldest_ts:
            text += f"; histories cut short on {', '.join(sorted(self.oldest_ts))}"
        return text


async def pull_telemetry(
    admins: Mapping[str, str],
    token: str,
    into: Path,
    *,
    batch: int = 10_000,
    request_timeout: float = 10.0,
    concurrency: int = 16,
    tls: ssl.SSLContext | None = None,
) -> Pulled:
    """Fetch every broker's telemetry ring into ``into/broker=NAME/part-pull.jsonl``.

    ``admins`` maps broker name → admin address. A broker that cannot be reached (or fails
    half-way) contributes nothing and is reported; the miner carries on with the others.
    ``tls``: verifies the admin APIs' certificates (brokers started with TLS speak HTTPS).
    """
    pulled = Pulled()
    gate = asyncio.Semaphore(concurrency)

    async def one(name: str, address: str) -> None:
        target = into / f"broker={name}" / "part-pull.jsonl"
        target.parent.mkdir(parents=True, exist_ok=True)
        got, cursor = 0, 0
        try:
            async with gate, AdminClient(address, token, timeout=request_timeout, tls=tls) as admin:
                with target.open("wb") as fh:
                    while True:
                        page = await admin.telemetry(since=cursor, limit=batch)
                        records = page.get("records") or []
                        if (
                            cursor == 0
                            and records
                            and (page.get("truncated") or int(records[0].get("cursor", 1)) > 1)
                        ):
                            pulled.oldest_ts[name] = float(records[0].get("ts", 0.0))
                        fh.writelines(orjson.dumps(r) + b"\n" for r in records)
                        got += len(records)
                        if not records or page.get("next", cursor) <= cursor:
                            break
                        cursor = int(page["next"])
            pulled.records[name] = got
        except (AdminError, aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            target.unlink(missing_ok=True)  # half a history would skew the figures
            target.with_name("pull-error.txt").write_text(f"{type(exc).__name__}: {exc}\n")
            pulled.records[name] = -1

    await asyncio.gather(*(one(n, a) for n, a in sorted(admins.items())))
    return pulled


def local_admins(state_dir: Path, overlay: str) -> tuple[dict[str, str], str]:
    """Admin addresses and token of a local overlay started by ``canopy up`` or the demo."""
    state_file = state_dir / overlay / "state.json"
    if not state_file.exists():
        raise TelemetryError(f"no local overlay {overlay!r} in {state_dir} (no {state_file})")
    state: dict[str, Any] = json.loads(state_file.read_text())
    admins = {name: b["admin"] for name, b in (state.get("brokers") or {}).items()}
    return admins, str(state["token"])
