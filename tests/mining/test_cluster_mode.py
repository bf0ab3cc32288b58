"""`canopy mine --cluster` (the chart's CronJob) against the API emulator, with the real operator
and real broker processes for the pods: it mines only self-organising overlays, files
TopologyProposals the operator then tracks, never files the same open proposal twice, and makes
no request its ClusterRole does not grant."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
from pyspark.sql import SparkSession

from canopy_broker.client import Client, connect
from canopy_operator.backends.manifests import pod_name
from canopy_operator.cli import build_parser
from canopy_operator.commands import mine as minecmd
from canopy_operator.commands.selforg import TELEMETRY_ARGS
from canopy_operator.model.proposals import LABEL_OVERLAY
from tests.operator import test_k8s_operator
from tests.operator.k8s_harness import (
    CanopyEmulator,
    objects,
    overlay_manifest,
    server_url,
    until,
)
from tests.operator.test_k8s_operator import Cluster, verbs_granted, verbs_used

pytestmark = [pytest.mark.integration, pytest.mark.kmock(cls=CanopyEmulator)]
cluster = test_k8s_operator.cluster  # emulator, kubelet (real brokers), operator thread

CHAIN = [f"b{i}" for i in range(6)]


def proposals_of(cluster: Cluster, overlay: str) -> list[dict[str, object]]:
    return [
        p
        for p in objects(cluster.emulator, "topologyproposals")
        if p["metadata"].get("labels", {}).get(LABEL_OVERLAY) == overlay
    ]


async def _traffic(cluster: Cluster) -> None:
    """Same interest at both ends of the chain; a publisher at one end."""

    def address(broker: str) -> str:
        return str(cluster.kubelet.procs[pod_name("chain", broker)].listen)

    creds = cluster.kubelet.credentials("chain")  # the overlay's client Secret
    clients: list[Client] = []
    try:
        for broker in ("b0", "b5"):
            c = await connect(address(broker), client_id=f"sub-{broker}", credentials=creds)
            await c.subscribe('symbol = "ACME"', sub_id="s")
            clients.append(c)
        pub = await connect(address("b0"), client_id="pub", credentials=creds)
        clients.append(pub)
        await asyncio.sleep(1.0)  # the subscriptions reach every broker
        rng = random.Random(1)
        for i in range(300):
            pub.publish_nowait({"symbol": "ACME" if rng.random() < 0.8 else "X", "n": i})
            if i % 30 == 29:
                await pub.flush()
                await asyncio.sleep(0.02)
        await pub.flush()
        received = 0
        while received < 300 * 0.7:  # most of the ACME events reached both subscribers
            for c in clients[:2]:
                received += len(await c.receive(max_items=1000, timeout=0.1))
    finally:
        for c in clients:
            await c.close()


async def test_the_cronjob_files_proposals_for_self_organising_overlays(
    cluster: Cluster, spark: SparkSession
) -> None:
    cluster.kubelet.broker_args = TELEMETRY_ARGS
    cluster.start_operator()
    links = list(itertools.pairwise(CHAIN))
    await cluster.apply(
        overlay_manifest("chain", CHAIN, links, selfOrganization={"mode": "propose"})
    )
    await cluster.apply(overlay_manifest("quiet", ["q0", "q1"], [("q0", "q1")]))  # mode off
    await cluster.ready("chain")
    await cluster.ready("quiet")
    await _traffic(cluster)

    args = build_parser().parse_args(
        [
            "mine",
            "--cluster",
            "--server",
            server_url(cluster.emulator),
            "--spark-master",
            "local[2]",
        ]
    )
    assert await minecmd.mine_cluster(args, resolver=cluster.kubelet.resolve) == 0
    filed = proposals_of(cluster, "chain")
    assert filed, "no proposal filed"
    best = filed[0]["spec"]
    assert best["overlay"] == "chain" and best["generation"] == 1
    assert any(c["add"] == ["b0", "b5"] for p in filed for c in p["spec"]["changes"])
    assert float(best["evidence"]["hopsPerEventAfter"]) < float(
        best["evidence"]["hopsPerEventBefore"]
    )
    assert proposals_of(cluster, "quiet") == []

    name = filed[0]["metadata"]["name"]

    async def proposed() -> bool | None:
        p = next(x for x in proposals_of(cluster, "chain") if x["metadata"]["name"] == name)
        return (p.get("status") or {}).get("phase") == "Proposed" or None

    await until(proposed, 20, f"{name} Proposed")  # the operator took it up

    # The next run finds the same proposals open and files nothing new.
    before = sorted(p["metadata"]["name"] for p in proposals_of(cluster, "chain"))
    assert await minecmd.mine_cluster(args, resolver=cluster.kubelet.resolve) == 0
    assert sorted(p["metadata"]["name"] for p in proposals_of(cluster, "chain")) == before

    used = verbs_used(cluster.emulator, agents=("canopy-miner",))
    assert used, "the miner made no API request?"
    assert used <= verbs_granted("manifests/install/miner.yaml"), used
