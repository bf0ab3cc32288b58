"""The Dockerfile passes hadolint with no warnings (no Docker engine here, so lint is the check)."""

from __future__ import annotations

from pathlib import Path

from tests.tools import ROOT, run_tool


def test_hadolint_is_clean() -> None:
    result = run_tool("hadolint", "--failure-threshold", "warning", str(ROOT / "Dockerfile"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """Negative control: the check above can fail."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    assert run_tool("hadolint", str(bad)).returncode != 0
