"""Command-line tools the deploy and operator tests run (installed into the venv by setup)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def tool(name: str) -> str:
    """A console script of the project's venv (or the PATH's)."""
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool(name), *args], capture_output=True, text=True, check=False)


def kubernetes_validate(paths: Iterable[Path], version: str) -> subprocess.CompletedProcess[str]:
    """``kubernetes-validate --strict`` against one Kubernetes version's schemas (offline)."""
    return run_tool("kubernetes-validate", "--strict", "-k", version, *map(str, paths))


def yaml_docs(paths: Iterable[Path]) -> list[dict[str, Any]]:
    return [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]
