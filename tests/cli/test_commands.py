"""The user-facing commands do what the README says (run as real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def canopy(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "canopy_operator.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def last_json(out: str) -> dict[str, object]:
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_help_lists_the_commands() -> None:
    result = canopy("--help")
    assert result.returncode == 0
    for command in ("demo", "sim", "pub", "sub", "bench"):
        assert command in result.stdout


def test_sim_routing_verifies_every_mode() -> None:
    result = canopy("sim", "routing", "--brokers", "60", "--events", "400", "--json")
    assert result.returncode == 0, result.stderr
    data = last_json(result.stdout)
    assert data["ok"] is True
    results = data["results"]
    assert isinstance(results, list) and len(results) == 3
    for r in results:
        assert r["delivered"] > 0 and r["lost"] == 0 and r["routing_tables_canonical"]


@pytest.mark.integration
def test_demo_runs_and_verifies_deliveries() -> None:
    result = canopy(
        "demo", "--brokers", "6", "--duration", "2", "--rate", "1500", "--seed", "5", "--json"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = last_json(result.stdout)
    assert data["ok"] is True
    assert data["owed"] > 500 and data["lost"] == 0 and data["duplicated"] == 0
    assert data["mean_hops"] > 0  # notifications really crossed broker links
    assert "verified: OK" in result.stdout
