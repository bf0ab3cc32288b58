"""Command-line tools the deploy and operator tests run (installed into the venv by setup)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "canopy"
_HELM_HOME = tempfile.TemporaryDirectory(prefix="canopy-helm-")  # removed at exit


def rbac_rules(role: Mapping[str, Any]) -> set[tuple[str, str, str]]:
    """A Role's or ClusterRole's grants as (apiGroup, resource, verb) triples."""
    return {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


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


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    """The venv's helm (scripts/setup.sh puts it there), offline, with throw-away home folders."""
    venv = Path(sys.executable).parent / "helm"
    binary = str(venv) if venv.exists() else tool("helm")
    home = _HELM_HOME.name
    env = {**os.environ, **{f"HELM_{k}_HOME": f"{home}/{k}" for k in ("CACHE", "CONFIG", "DATA")}}
    return subprocess.run([binary, *args], capture_output=True, text=True, check=False, env=env)


def helm_template(
    *values: Path, release: str = "canopy", namespace: str = "canopy-system", chart: Path = CHART
) -> list[dict[str, Any]]:
    """``helm template`` of the chart (CRDs included) as a list of objects; fails loudly."""
    flags = [a for v in values for a in ("--values", str(v))]
    result = helm(
        "template", release, str(chart), "--namespace", namespace, "--include-crds", *flags
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


_NO_SCHEMA = re.compile(r"Couldn't find schema for kind (\S+) with api version (\S+)")


def kinds_without_schema(result: subprocess.CompletedProcess[str]) -> set[tuple[str, str]]:
    """(apiVersion, kind) that kubernetes-validate skipped with only a warning (custom resources):
    a caller must validate those some other way, or fail."""
    return {(m[2], m[1]) for m in _NO_SCHEMA.finditer(result.stdout + result.stderr)}


# Chart values that are Kubernetes objects or free maps in their own right: set (and documented)
# as a whole, not key by key.
WHOLE_VALUES = {
    "podSecurityContext",
    "securityContext",
    "resources",
    "affinity",
    "sparkConf",
    "labels",
}


def value_keys(values: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a values tree -> their values, down to the leaves (or WHOLE_VALUES)."""
    if isinstance(values, dict) and values and prefix.rsplit(".", 1)[-1] not in WHOLE_VALUES:
        out: dict[str, Any] = {}
        for k, v in values.items():
            out |= value_keys(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: values}


class LoopTurns:
    """``async with LoopTurns() as turns``: a task that only yields, counting in
    ``turns.count`` the event-loop turns it got while the block ran. Tests show with it that
    other work had the loop (a flush that yields, a long frame handled in slices)."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def _spin(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> LoopTurns:
        self._task = asyncio.create_task(self._spin())
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
