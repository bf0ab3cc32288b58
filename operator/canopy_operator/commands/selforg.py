"""Self-organisation of a live local overlay: mine its telemetry, apply a proposal, measure.

The loop a cluster runs with a CronJob and the operator, done in one process for the demo and
the tests: pull the brokers' telemetry through their admin APIs, mine it on Spark (the same job
as ``canopy mine``), and apply a proposal with the operator's own planner and executor — the
exchanges run live, under traffic, with the coordinated protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from canopy_operator.backends.local import LocalBackend
from canopy_operator.commands.local import apply
from canopy_operator.executor import Executor
from canopy_operator.model.planner import Plan
from canopy_operator.model.proposals import Proposal, apply_changes
from canopy_operator.model.topology import parse_overlay

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from canopy_operator.mining.job import MiningResult, Settings
    from canopy_operator.mining.metrics import Traffic

# Broker flags that make telemetry rich enough to mine within seconds: one event in five
# sampled (the default, 1%, suits production rates), RTT probes every two seconds.
TELEMETRY_ARGS = ("--telemetry-sample", "0.2", "--probe-interval", "2")


def start_spark(master: str | None = None) -> SparkSession:
    """The process's Spark session (pyspark is imported here, only when mining runs)."""
    from canopy_operator.mining.session import spark_session

    return spark_session(master, app="canopy-self-organisation")


def describe(result: MiningResult, names: Mapping[int, str]) -> list[str]:
    """The mining result for people (see :func:`canopy_operator.mining.job.describe`)."""
    from canopy_operator.mining.job import describe as describe_result

    return describe_result(result, names)


@contextlib.asynccontextmanager
async def _pulled(
    backend: LocalBackend, since_ts: float | None, progress: Callable[[str], None]
) -> AsyncIterator[tuple[str, float | None]]:
    """Every broker's telemetry pulled into a temporary directory: (its path, where mining
    starts — ``since_ts`` or later, where every broker's history is complete)."""
    from canopy_operator.mining.source import pull_telemetry

    admins = {name: info["admin"] for name, info in backend.brokers.items()}
    with tempfile.TemporaryDirectory(prefix="canopy-telemetry-") as staging:
        pulled = await pull_telemetry(
            admins, backend.state["token"], Path(staging), tls=backend.admin_tls
        )
        progress(pulled.describe())
        yield staging, pulled.since(since_ts)


async def mine_overlay(
    backend: LocalBackend,
    manifest: dict[str, Any],
    spark: SparkSession,
    *,
    settings: Settings | None = None,
    since_ts: float | None = None,
    progress: Callable[[str], None] = lambda _m: None,
) -> MiningResult:
    """Pull every broker's telemetry and mine it against the live links."""
    from canopy_operator.mining.job import Settings, mine

    links = await backend.live_links()
    spec = parse_overlay(manifest)
    async with _pulled(backend, since_ts, progress) as (staging, since):
        # Spark works in a thread: the event loop keeps serving the clients meanwhile.
        return await asyncio.to_thread(
            mine,
            spark,
            staging,
            spec,
            links,
            settings or Settings(),
            progress=progress,
            since_ts=since,
        )


async def measure_overlay(
    backend: LocalBackend,
    manifest: dict[str, Any],
    spark: SparkSession,
    *,
    since_ts: float | None = None,
) -> Traffic:
    """Hops and pure forwarders of the traffic since ``since_ts``, from the brokers' telemetry."""
    from canopy_operator.mining.metrics import traffic
    from canopy_operator.mining.source import read_telemetry

    brokers = parse_overlay(manifest).broker_names
    async with _pulled(backend, since_ts, lambda _m: None) as (staging, since):
        tel = await asyncio.to_thread(read_telemetry, spark, staging, brokers, since_ts=since)
        return await asyncio.to_thread(traffic, tel.events)


async def apply_proposal(
    backend: LocalBackend,
    manifest: dict[str, Any],
    proposal: Proposal,
    *,
    progress: Callable[[str], None] = lambda _m: None,
) -> tuple[dict[str, Any], Plan, Executor, float]:
    """Move the live overlay to ``manifest`` with the proposal's changes applied; returns the
    new manifest, the plan, the executor (step results) and the wall time."""
    live = await backend.live_tree()  # the changes are to the whole tree, not a view of it
    target = copy.deepcopy(manifest)
    target["spec"]["links"] = [list(e) for e in apply_changes(live, proposal.changes)]
    the_plan, executor, wall = await apply(parse_overlay(target), target, backend, log=progress)
    return target, the_plan, executor, wall
