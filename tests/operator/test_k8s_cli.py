"""`canopy operator` as a process: it runs kopf on the operator module against the API server it
is given, acts on overlays, and stops cleanly on SIGTERM (as in a pod)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import kmock
import pytest

from canopy_broker.procs import broker_env
from canopy_operator.backends.kube import KubeApi, overlay_path
from tests.operator.k8s_harness import (
    NS,
    CanopyEmulator,
    condition,
    declare_resources,
    get_overlay,
    objects,
    overlay_manifest,
    server_url,
    until,
)

pytestmark = [pytest.mark.integration, pytest.mark.kmock(cls=CanopyEmulator)]


async def test_canopy_operator_runs_and_stops_on_sigterm(
    kmock: kmock.KubernetesEmulator, tmp_path: Path
) -> None:
    declare_resources(kmock)
    env = broker_env()
    env["KUBECONFIG"] = str(tmp_path / "no-kubeconfig")
    log = (tmp_path / "operator.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "canopy_operator.cli",
        "operator",
        "--server",
        server_url(kmock),
        "--metrics-port",
        "0",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=log,
        env={**env, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), env["PYTHONPATH"]])},
    )
    api = KubeApi(server_url(kmock), user_agent="canopy-tests")
    try:
        bad = overlay_manifest("bad", ["a", "b"], [("a", "b"), ("b", "a")])
        await api.create(overlay_path(NS), bad)

        async def invalid() -> dict[str, Any] | None:
            obj = await get_overlay(api, "bad")
            return obj if condition(obj, "Valid").get("status") == "False" else None

        obj = await until(invalid, 30, "the operator process to mark the overlay invalid")
        assert "b" in condition(obj, "Valid")["message"]
        assert objects(kmock, "pods") == []
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0, (tmp_path / "operator.log").read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
        await api.close()
