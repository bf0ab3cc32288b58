"""Damaged, partial and foreign telemetry: counted and skipped, or a clear error — never a crash."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from canopy_broker.core.events import Event
from canopy_broker.core.messages import Deliver
from canopy_broker.runtime.placement import Placement
from canopy_broker.runtime.telemetry import Telemetry
from canopy_operator.mining import source
from canopy_operator.mining.propose import terminal_sets
from canopy_operator.mining.source import (
    DEDUPLICATED,
    PARQUET_DIR,
    STAGING,
    TelemetryError,
    compact_telemetry,
    json_files,
    read_telemetry,
)
from tests.mining.telemetry import event_records, record, rtt, write
from tests.mining.test_metrics import LINKS, SPEC


def test_bad_records_are_counted_and_skipped(spark: SparkSession, tmp_path: Path) -> None:
    good = event_records(LINKS, "E1", "d", ["d", "e"])  # 5 records
    bad = [
        {**record("a", "event", event_id="E9"), "schema": "canopy.telemetry/v2"},  # other schema
        record("a", "event", source_kind="link", matched_local=False),  # no event_id
        record("zz", "event", event_id="E8", source_kind="client", matched_local=True),
        record("b", "gossip"),  # a type this miner does not know
        record("c", "rtt", peer="a"),  # no rtt_ms
    ]
    lines = ['{"schema": "canopy.telemetry/v1", "type": "ev', "not json at all", "[1, 2]"]
    tel = read_telemetry(spark, write(tmp_path, good + bad, lines), SPEC.broker_names)
    assert tel.records == 5 + 5 + 3
    assert tel.skipped == {
        "malformed": 3,
        "other_schema": 1,
        "incomplete": 2,
        "unknown_broker": 1,
        "unknown_type": 1,
    }
    assert tel.events.count() == 5


def test_duplicate_records_count_once(spark: SparkSession, tmp_path: Path) -> None:
    recs = event_records(LINKS, "E1", "d", ["d", "e"])
    tel = read_telemetry(spark, write(tmp_path, recs + recs), SPEC.broker_names)
    assert tel.events.count() == len(recs)


def test_nothing_usable_is_a_clear_error(spark: SparkSession, tmp_path: Path) -> None:
    with pytest.raises(TelemetryError, match="does not exist"):
        read_telemetry(spark, tmp_path / "missing", SPEC.broker_names)
    stranger = record("zz", "event", event_id="E1", source_kind="client", matched_local=True)
    write(tmp_path / "junk", [stranger], ["{oops"])
    with pytest.raises(
        TelemetryError, match=r"no usable event records .*1 malformed.*1 unknown_broker"
    ):
        read_telemetry(spark, tmp_path / "junk", SPEC.broker_names)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.jsonl").write_text("")
    with pytest.raises(TelemetryError, match="no usable event records"):
        read_telemetry(spark, tmp_path / "empty", SPEC.broker_names)


def test_brokers_own_files_are_read_as_written(spark: SparkSession, tmp_path: Path) -> None:
    """The layout and field set a real broker writes (runtime/telemetry.py), attrs and all."""
    t = Telemetry("a", sample_rate=1.0, directory=tmp_path)
    event = Event("p", 1, {"k": 1, "s": "x"})
    t.record_event(event, "client", "p", [Deliver(event, (("c1", ("s1",)),))])
    t.rtt("b", 1.5, via="probe")
    t._write_pending(t._pending)
    files = list(tmp_path.rglob("*.jsonl"))
    assert files and "broker=a" in str(files[0])
    assert json.loads(files[0].read_text().splitlines()[0])["schema"] == "canopy.telemetry/v1"
    tel = read_telemetry(spark, tmp_path, ["a", "b"])
    assert tel.skipped == {} and tel.events.count() == 1 and tel.rtts.count() == 1
    assert tel.zones == {}  # a broker that said nothing of its placement


def test_the_zone_a_broker_reports_last_is_its_zone(spark: SparkSession, tmp_path: Path) -> None:
    """Placement records as brokers write them (runtime/telemetry.py): the latest non-empty
    zone per broker; a broker that knows none ("") or never said is left to the manifest."""
    t = Telemetry("a", sample_rate=1.0, directory=tmp_path)
    event = Event("p", 1, {"k": 1})
    t.record_event(event, "client", "p", [Deliver(event, (("c1", ("s1",)),))])
    t.placement(Placement("", "n1"))  # not scheduled yet
    t.placement(Placement("zone-x", "n1"))
    t.placement(Placement("zone-y", "n2"))  # rescheduled elsewhere
    b = Telemetry("b", sample_rate=1.0, directory=tmp_path)
    b.placement(Placement("", "n3"))
    t._write_pending(t._pending)
    b._write_pending(b._pending)
    tel = read_telemetry(spark, tmp_path, ["a", "b"])
    assert tel.skipped == {} and tel.zones == {"a": "zone-y"}


def test_events_missing_their_publishers_record_are_counted_partial(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A broker's history cut short (ring overflow) loses an event's origin record: that event
    still counts in the measured figures but cannot be replayed, and says so."""
    whole = event_records(LINKS, "E1", "d", ["d", "e"])
    cut = [r for r in event_records(LINKS, "E2", "d", ["d", "e"]) if r["source_kind"] != "client"]
    tel = read_telemetry(spark, write(tmp_path, whole + cut), SPEC.broker_names)
    _, stats = terminal_sets(tel.events)
    assert (stats["events"], stats["replayable"], stats["partial"]) == (2, 1, 1)


def test_since_keeps_whole_events_published_from_then_on(
    spark: SparkSession, tmp_path: Path
) -> None:
    old = event_records(LINKS, "OLD", "d", ["d", "e"], ts=10.0)
    new = event_records(LINKS, "NEW", "d", ["d", "e"], ts=20.0)
    # published before the boundary, recorded downstream after it: not half of it, none of it
    straddling = [
        r | {"ts": 10.0 if r["source_kind"] == "client" else 20.0}
        for r in event_records(LINKS, "MID", "d", ["d", "e"])
    ]
    tel = read_telemetry(
        spark, write(tmp_path, old + new + straddling), SPEC.broker_names, since_ts=15.0
    )
    assert {r["event_id"] for r in tel.events.select("event_id").distinct().collect()} == {"NEW"}
    assert tel.events.count() == len(new)


def test_counters_written_as_floats_are_still_read(spark: SparkSession, tmp_path: Path) -> None:
    recs = [
        r | {"cursor": 1.0, "hops": 2.0, "deliveries": 1.0}
        for r in event_records(LINKS, "E1", "d", ["e"])
    ]
    tel = read_telemetry(spark, write(tmp_path, recs), SPEC.broker_names)
    assert tel.skipped == {} and tel.events.count() == len(recs)


def test_compacted_telemetry_reads_as_the_json_did(spark: SparkSession, tmp_path: Path) -> None:
    """Closed JSON files become Parquet (hidden, not deleted); the reader finds the same
    records, damaged ones included, in a directory compacted in part or in whole."""
    good = [*event_records(LINKS, "E1", "d", ["d", "e"]), rtt("a", "b", 3.0)]
    root = write(tmp_path / "tel", good, ["not json at all"])
    before = read_telemetry(spark, root, SPEC.broker_names)
    expected = (before.records, before.skipped, sorted(map(tuple, before.events.collect())))
    assert before.rtts.count() == 1
    files = json_files(root)
    assert len(files) == len({r["broker"] for r in good})
    # Only closed files: one a broker is still appending to stays JSON.
    fresh = files[0]
    old = time.time() - 2 * 3600
    for f in files[1:]:
        os.utime(f, (old, old))
    assert compact_telemetry(spark, root) == len(files) - 1
    assert json_files(root) == [fresh]
    assert sorted(p.name for p in (root / PARQUET_DIR).iterdir() if p.is_dir()) == [
        "hour=1970-01-01T00"
    ]
    hidden = [f.with_name("." + f.name) for f in files[1:]]
    assert all(h.exists() for h in hidden)  # kept, but no reader sees them
    mixed = read_telemetry(spark, root, SPEC.broker_names)
    mixed_seen = (mixed.records, mixed.skipped, sorted(map(tuple, mixed.events.collect())))
    assert mixed_seen == expected and mixed.rtts.count() == 1
    assert compact_telemetry(spark, root, everything=True) == 1
    assert json_files(root) == []
    whole = read_telemetry(spark, root, SPEC.broker_names)
    assert compact_telemetry(spark, root, everything=True) == 0  # nothing left to do
    assert (whole.records, whole.skipped, sorted(map(tuple, whole.events.collect()))) == expected
    assert whole.rtts.count() == 1


def seen(tel: source.Telemetry) -> list[tuple[object, ...]]:
    return sorted(map(tuple, tel.events.collect()))


def test_compaction_keeps_each_event_once_so_the_reader_need_not(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A record written twice (a directory fed twice) is kept once by the compaction, which
    marks its Parquet as such; the reader then skips its own de-duplication. The negative
    control: the same duplicated Parquet *not* marked is de-duplicated by the reader, and marked
    but holding a copy (which a compaction never writes) is read as it is."""
    recs = event_records(LINKS, "E1", "d", ["d", "e"])
    root = write(tmp_path / "tel", [*recs, recs[0]])
    before = read_telemetry(spark, root, SPEC.broker_names)
    assert before.records == len(recs) + 1 and before.events.count() == len(recs)
    expected = seen(before)  # now: a later read of the same path drops the cached frames
    files = len(json_files(root))
    assert compact_telemetry(spark, root, everything=True) == files
    assert compact_telemetry(spark, root, everything=True) == 0
    compacted = root / PARQUET_DIR
    assert (compacted / DEDUPLICATED).exists()
    assert not list(root.glob(f"{STAGING}*"))  # the staging directory is gone
    after = read_telemetry(spark, root, SPEC.broker_names)
    assert after.records == len(recs) and seen(after) == expected

    # Every Parquet file twice: marked, it is trusted (and counted twice)...
    for f in list(compacted.glob("hour=*/*.parquet")):
        (f.parent / ("copy-" + f.name)).write_bytes(f.read_bytes())
    assert read_telemetry(spark, root, SPEC.broker_names).events.count() == 2 * len(recs)
    # ...not marked (an older version's compaction), the reader de-duplicates it.
    (compacted / DEDUPLICATED).unlink()
    unmarked = read_telemetry(spark, root, SPEC.broker_names)
    assert unmarked.records == 2 * len(recs) and seen(unmarked) == expected


def test_a_compaction_cut_short_loses_nothing_and_compacts_nothing_twice(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after its commit, before the JSON files were hidden and the Parquet moved in: the
    reader still sees every record once (the staging directory is hidden from it), and the
    next compaction finishes the batch. Killed before its commit: the batch is discarded."""
    recs = [*event_records(LINKS, "E1", "d", ["d", "e"]), rtt("a", "b", 3.0)]
    root = write(tmp_path / "tel", recs)
    expected = seen(read_telemetry(spark, root, SPEC.broker_names))
    publish = source._publish

    def crash(*_: object) -> None:
        raise RuntimeError("killed")

    monkeypatch.setattr(source, "_publish", crash)
    with pytest.raises(RuntimeError):
        compact_telemetry(spark, root, everything=True)
    [staging] = root.glob(f"{STAGING}*")
    assert (staging / "COMMITTED").exists() and json_files(root)  # nothing hidden yet
    assert seen(read_telemetry(spark, root, SPEC.broker_names)) == expected
    monkeypatch.setattr(source, "_publish", publish)
    assert compact_telemetry(spark, root, everything=True) == 0  # finished, nothing new
    assert json_files(root) == [] and not list(root.glob(f"{STAGING}*"))
    whole = read_telemetry(spark, root, SPEC.broker_names)
    assert seen(whole) == expected and whole.records == len(recs)

    # Cut short before the commit: what it wrote is dropped, the files compacted afresh.
    more = write(tmp_path / "more", recs)
    (more / f"{STAGING}dead").mkdir()
    (more / f"{STAGING}dead" / "journal.json").write_text('{"files": [], "hide": true}')
    files = len(json_files(more))
    assert compact_telemetry(spark, more, everything=True) == files
    assert not list(more.glob(f"{STAGING}*"))
    assert seen(read_telemetry(spark, more, SPEC.broker_names)) == expected
