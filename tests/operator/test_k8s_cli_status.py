"""`canopy status --cluster` and `kubectl canopy status` against the Kubernetes API emulator,
reached the way kubectl reaches a cluster: a kubeconfig with several contexts, a user with a
client certificate, a user whose token comes from an exec credential plugin."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from canopy_operator.backends.kube import KubeApi, overlay_path
from canopy_operator.cli import main
from tests.operator.k8s_harness import (
    NS,
    CanopyEmulator,
    declare_resources,
    kubeconfig,
    server_url,
)

pytestmark = [pytest.mark.integration, pytest.mark.kmock(cls=CanopyEmulator)]


async def an_overlay(emulator: kmock.KubernetesEmulator) -> None:
    declare_resources(emulator)
    api = KubeApi(server_url(emulator), user_agent="canopy-tests")
    try:
        body = {
            "apiVersion": "canopy.dev/v1alpha1",
            "kind": "BrokerOverlay",
            "metadata": {"name": "trading", "namespace": NS},
            "spec": {"brokers": [{"name": "a"}, {"name": "b"}], "routing": "identity"},
        }
        await api.create(overlay_path(NS), body)
    finally:
        await api.close()


async def status(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, ["status", "--cluster", "-n", NS, *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_contexts_client_certificates_and_exec_plugins(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await an_overlay(kmock)
    config = str(kubeconfig(tmp_path, server_url(kmock)))

    code, out, _ = await status(capsys, "--kubeconfig", config, "--context", "good", "-o", "yaml")
    assert code == 0
    listed = yaml.safe_load(out)
    assert [o["metadata"]["name"] for o in listed["items"]] == ["trading"]

    # The current context points nowhere: the error names what could not be read.
    code, _, err = await status(capsys, "--kubeconfig", config)
    assert code == 2 and "cannot read brokeroverlays" in err

    code, _, err = await status(capsys, "--kubeconfig", config, "--context", "nope")
    assert code == 2 and f"cannot use kubeconfig {config}" in err and "nope" in err

    code, out, _ = await status(capsys, "--kubeconfig", config, "--context", "cert")
    assert code == 0 and out.split()[:7] == [
        "NAME",
        "PHASE",
        "BROKERS",
        "LINKS",
        "GENERATION",
        "PLAN",
        "trading",
    ]

    assert not (tmp_path / "plugin-ran").exists()
    code, out, _ = await status(capsys, "--kubeconfig", config, "--context", "exec", "-o", "wide")
    assert code == 0 and (tmp_path / "plugin-ran").exists()  # the token came from the plugin
    header, row = out.splitlines()[:2]
    assert "RECONFIGURATION" in header and "identity" in row and "coordinated/fifo" in row


async def test_kubectl_canopy_plugin_speaks_of_the_cluster(
    kmock: kmock.KubernetesEmulator, tmp_path: Path
) -> None:
    """kubectl runs `kubectl-canopy` from the PATH for `kubectl canopy`; installed with the
    package next to `canopy`, it lists the cluster's overlays without --cluster."""
    await an_overlay(kmock)
    config = kubeconfig(tmp_path, server_url(kmock))
    plugin = Path(sys.executable).parent / "kubectl-canopy"
    assert plugin.exists(), "pip install -e . puts kubectl-canopy beside canopy"
    argv = [str(plugin), "status", "-n", NS, "--kubeconfig", str(config), "--context", "good"]
    done = await asyncio.to_thread(
        subprocess.run, [*argv, "-o", "json"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    listed: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    assert listed["kind"] == "List" and listed["items"][0]["metadata"]["name"] == "trading"
    helped = await asyncio.to_thread(
        subprocess.run, [str(plugin), "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.stdout.startswith("usage: kubectl canopy")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs the kubectl client")
async def test_the_real_kubectl_runs_the_plugin(
    kmock: kmock.KubernetesEmulator, tmp_path: Path
) -> None:
    await an_overlay(kmock)
    config = kubeconfig(tmp_path, server_url(kmock))
    env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "HOME": str(tmp_path),
        "KUBECONFIG": str(config),  # kubectl hands its environment to the plugin
    }
    listed = await asyncio.to_thread(
        subprocess.run,
        ["kubectl", "plugin", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert "kubectl-canopy" in listed.stdout, listed.stdout + listed.stderr
    done = await asyncio.to_thread(
        subprocess.run,
        ["kubectl", "canopy", "status", "-n", NS, "--context", "good", "-o", "yaml"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert [o["metadata"]["name"] for o in yaml.safe_load(done.stdout)["items"]] == ["trading"]
