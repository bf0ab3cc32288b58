"""`canopy mine` as a user runs it on files: outputs, the JSON line, and clear errors."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pytest
import yaml
from pyspark.sql import SparkSession

from canopy_operator.cli import main
from canopy_operator.commands.mine import since_time
from canopy_operator.mining.source import PARQUET_DIR, json_files
from tests.mining.telemetry import write
from tests.mining.test_metrics import fixture_records, overlay_manifest


@pytest.fixture
def overlay_file(tmp_path: Path) -> Path:
    path = tmp_path / "overlay.yaml"
    path.write_text(yaml.safe_dump(overlay_manifest()))
    return path


def test_mine_writes_tables_summary_and_proposals(
    spark: SparkSession, tmp_path: Path, overlay_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    telemetry = write(tmp_path / "telemetry", fixture_records())
    out = tmp_path / "mined"
    code = main(
        [
            "mine",
            "--telemetry",
            str(telemetry),
            "--overlay",
            str(overlay_file),
            "--out",
            str(out),
            "--json",
            "--spark-master",
            "local[2]",
        ]
    )
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["measured"]["events"] == 7 and summary["associativity"]["total"] == 2.0
    assert [(p["remove"], p["add"]) for p in summary["proposals"]] == [(["a", "c"], ["d", "e"])]
    assert "exchange a-c for d-e" in stdout and "-63.2% hops/event" in stdout
    assert json.loads((out / "mining.json").read_text()) == summary
    (proposal,) = (out / "proposals").glob("*.yaml")
    manifest = yaml.safe_load(proposal.read_text())
    assert manifest["kind"] == "TopologyProposal"
    assert manifest["metadata"]["labels"]["canopy.dev/overlay"] == "hand"
    assert proposal.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    pairs = next((out / "associativity").glob("part-*.csv")).read_text().splitlines()
    assert pairs[0].startswith("a,b,common") and len(pairs) == 3  # header + two pairs


def test_mine_errors_name_the_problem(
    spark: SparkSession, tmp_path: Path, overlay_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = ["mine", "--telemetry", str(tmp_path / "nowhere"), "--overlay", str(overlay_file)]
    assert main(missing) == 2
    assert "no telemetry at" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "kind: BrokerOverlay\nmetadata: {name: x}\nspec: {brokers: [{name: a}, {name: a}]}\n"
    )
    assert main(["mine", "--telemetry", str(tmp_path), "--overlay", str(bad)]) == 2
    assert "declared more than once" in capsys.readouterr().err
    managed = tmp_path / "managed.yaml"
    managed.write_text("kind: BrokerOverlay\nmetadata: {name: x}\nspec: {brokers: [{name: a}]}\n")
    assert main(["mine", "--telemetry", str(tmp_path), "--overlay", str(managed)]) == 2
    assert "managed-links overlay" in capsys.readouterr().err


def test_links_that_are_not_one_tree_are_refused(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `kubectl get -o yaml` dump whose status.links is a forest (mid-change, or stale)."""
    dump = overlay_manifest()
    del dump["spec"]["links"]  # type: ignore[attr-defined]
    dump["status"] = {"links": [["a", "b"], ["c", "e"]]}
    path = tmp_path / "dump.yaml"
    path.write_text(yaml.safe_dump(dump))
    telemetry = write(tmp_path / "telemetry", fixture_records())
    assert main(["mine", "--telemetry", str(telemetry), "--overlay", str(path)]) == 2
    assert "not one tree over its brokers" in capsys.readouterr().err


def test_since_accepts_unix_iso_and_ages() -> None:
    assert since_time("1795000000") == 1_795_000_000.0
    assert since_time("2026-11-21T10:00:00Z") == since_time("2026-11-21T10:00:00") == 1795255200.0
    assert since_time("2026-11-21T11:00:00+01:00") == 1795255200.0
    assert since_time("30m", now=10_000.0) == 8_200.0
    assert since_time("2d", now=200_000.0) == 200_000.0 - 2 * 86_400
    with pytest.raises(argparse.ArgumentTypeError, match="not a time"):
        since_time("yesterday")


def test_since_drops_older_events(
    spark: SparkSession, tmp_path: Path, overlay_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    telemetry = write(tmp_path / "telemetry", fixture_records())  # every record at ts 1.0
    args = ["mine", "--telemetry", str(telemetry), "--overlay", str(overlay_file), "--json"]
    assert main([*args, "--since", "0"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["measured"]["events"] == 7
    assert main([*args, "--since", "2"]) == 2  # nothing left to mine: said so
    assert "no usable event records" in capsys.readouterr().err


def test_compact_then_mine_gives_the_same_answer(
    spark: SparkSession, tmp_path: Path, overlay_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--compact` turns closed JSON files into Parquet first; this run and the next, which
    reads only Parquet, find what the JSON said."""
    telemetry = write(tmp_path / "telemetry", fixture_records())
    old = time.time() - 2 * 3600
    for f in json_files(telemetry):
        os.utime(f, (old, old))
    argv = ["mine", "--telemetry", str(telemetry), "--overlay", str(overlay_file), "--json"]
    argv += ["--spark-master", "local[2]"]
    for run in ([*argv, "--compact"], argv):
        assert main(run) == 0
        out = capsys.readouterr().out
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["measured"]["events"] == 7 and summary["associativity"]["total"] == 2.0
        assert [(p["remove"], p["add"]) for p in summary["proposals"]] == [(["a", "c"], ["d", "e"])]
        assert json_files(telemetry) == [] and (telemetry / PARQUET_DIR).is_dir()
