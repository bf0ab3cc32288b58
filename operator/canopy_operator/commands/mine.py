"""`canopy mine` and `canopy bench mining`: the Spark job's command-line shells.

Three ways to feed the job, one pipeline (:func:`canopy_operator.mining.job.mine`):

* ``--telemetry PATH``: JSON lines already on disk or in an object store;
* ``--pull``: fetch them first from a local overlay's brokers (``canopy up`` / the demo);
* ``--cluster``: the CronJob's mode — for every BrokerOverlay whose ``selfOrganization.mode`` is
  ``propose`` or ``auto``, pull from its brokers over the cluster DNS, mine, and file
  TopologyProposals (de-duplicated against open ones; old closed ones pruned).

pyspark is imported only when a job runs, so the rest of ``canopy`` works without the mining
extra.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import ssl
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from canopy_operator.commands.plan import load_overlay
from canopy_operator.model.phases import OverlayPhase, ProposalPhase
from canopy_operator.model.topology import Edge, OverlaySpec, SpecError, norm


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "mine",
        help="mine broker telemetry on Spark and propose better topologies",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--telemetry", help="telemetry directory or Spark-readable path")
    src.add_argument("--pull", action="store_true", help="pull from a local overlay's brokers")
    src.add_argument("--cluster", action="store_true", help="mine every overlay in the cluster")
    p.add_argument("--overlay", type=Path, help="the BrokerOverlay manifest (not with --cluster)")
    p.add_argument("--state-dir", type=Path, default=Path(".canopy"), help="for --pull")
    p.add_argument("--out", type=Path, help="write tables, summary and proposal YAML here")
    p.add_argument(
        "--compact",
        action="store_true",
        help="--telemetry DIR: first turn its closed JSON files (untouched for an hour) into "
        "Parquet under DIR/_parquet, which this and later runs read much faster",
    )
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    p.add_argument("--top", type=_positive, default=3, help="proposals to emit (default 3)")
    p.add_argument(
        "--max-distance",
        type=float,
        help="ms; default: the overlay's spec.selfOrganization.maxDistance (none: any)",
    )
    p.add_argument("--replay-sets", type=_positive, default=3000, help="terminal sets replayed")
    p.add_argument(
        "--since",
        type=since_time,
        help="only events published from then on: Unix seconds, ISO 8601 (2026-11-21T10:00Z), "
        "or an age such as 30m, 6h, 2d",
    )
    p.add_argument("--spark-master", help="default $CANOPY_SPARK_MASTER or local[*]")
    p.add_argument("--driver-memory", help="Spark driver memory, e.g. 4g (local mode)")
    p.add_argument("-n", "--namespace", action="append", default=[], help="--cluster: only here")
    p.add_argument("--history-limit", type=int, default=10, help="--cluster: closed proposals kept")
    p.add_argument("--kubeconfig", help="--cluster: kubeconfig (default: $KUBECONFIG, in-cluster)")
    p.add_argument("--context", help="--cluster: kubeconfig context (default: the current one)")
    p.add_argument("--server", help="--cluster: API server URL (instead of a kubeconfig)")
    p.add_argument("--token", help="--cluster: bearer token for --server")
    p.add_argument("--insecure", action="store_true", help="--cluster: skip TLS verification")
    p.set_defaults(func=run_mine)


def since_time(text: str, now: float | None = None) -> float:
    """``--since``: Unix seconds, an ISO 8601 time (UTC unless it says otherwise), or an age
    (``90s``, ``30m``, ``6h``, ``2d``) before ``now``."""
    import datetime
    import time

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip()
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return (now if now is not None else time.time()) - float(text[:-1]) * units[text[-1]]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (Unix seconds, ISO 8601, or an age like 30m, 6h, 2d)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_bench_arguments(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bench_sub.add_parser("mining", help="wall time of the Spark job on synthetic telemetry")
    p.add_argument("--brokers", type=int, default=1000, help="brokers in the synthetic overlay")
    p.add_argument("--rows", type=int, default=1_000_000, help="telemetry records to mine")
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    p.add_argument("--driver-memory", default="6g", help="Spark driver memory (local mode)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data-dir", type=Path, default=Path(".canopy/bench-mining"))
    p.add_argument(
        "--format",
        choices=("parquet", "json"),
        default="parquet",
        help="mine the telemetry compacted to Parquet (default; the compaction is timed apart, "
        "as the generation is) or the brokers' JSON lines as written",
    )
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from canopy_operator.mining import bench

    return bench.run(args)


def _say(msg: str) -> None:
    print(f"[mine] {msg}", file=sys.stderr, flush=True)


def current_links(manifest: dict[str, Any], spec: OverlaySpec) -> list[Edge] | None:
    """Explicit links, else the live links the operator reported in ``status.links``."""
    if spec.links is not None:
        return [norm(e) for e in spec.links]
    live = (manifest.get("status") or {}).get("links")
    if live:
        return [norm((str(a), str(b))) for a, b in live]
    return None


def settings_for(args: argparse.Namespace, manifest: dict[str, Any]) -> Any:
    from canopy_operator.mining.job import Settings

    selforg = (manifest.get("spec") or {}).get("selfOrganization") or {}
    distance = args.max_distance if args.max_distance is not None else selforg.get("maxDistance")
    return Settings(
        top_k=args.top,
        max_distance=None if distance is None else float(distance),
        replay_sets=args.replay_sets,
    )


def run_mine(args: argparse.Namespace) -> int:
    if args.cluster:
        return asyncio.run(mine_cluster(args))
    if args.overlay is None:
        print(
            "error: --overlay FILE is required (the overlay the telemetry is from)", file=sys.stderr
        )
        return 2
    try:
        spec = load_overlay(args.overlay)
        manifest = next(
            d
            for d in yaml.safe_load_all(args.overlay.read_text())
            if isinstance(d, dict) and d.get("kind") == "BrokerOverlay"
        )
    except (OSError, SpecError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        print(f"error: --out {args.out} exists and is not a directory", file=sys.stderr)
        return 2
    links = current_links(manifest, spec)
    since: float | None = args.since
    with tempfile.TemporaryDirectory(prefix="canopy-pull-") as staging:
        where: str = args.telemetry or staging
        if args.pull:
            from canopy_operator.mining.errors import MiningInputError

            try:
                live, since = asyncio.run(
                    _pull_local(args.state_dir, spec.name, Path(staging), since)
                )
            except MiningInputError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            links = live or links
        if links is None:
            print(
                "error: a managed-links overlay has no links in its manifest: pass --pull "
                "(asks the brokers) or a manifest with status.links (kubectl get -o yaml)",
                file=sys.stderr,
            )
            return 2
        return _mine_one(args, manifest, spec, links, where, since=since)


async def _pull_local(
    state_dir: Path, overlay: str, into: Path, since: float | None
) -> tuple[list[Edge], float | None]:
    """Pull telemetry from a local overlay; return its live links and where mining starts
    (``since``, or later where a broker's history was cut short)."""
    from canopy_operator.backends.local import LocalBackend
    from canopy_operator.mining.source import local_admins, pull_telemetry

    admins, token = local_admins(state_dir, overlay)
    backend = LocalBackend(state_dir / overlay)
    try:
        pulled = await pull_telemetry(admins, token, into, tls=backend.admin_tls)
        _say(pulled.describe())
        return await backend.live_links(), pulled.since(since)
    finally:
        await backend.close()


def _mine_one(
    args: argparse.Namespace,
    manifest: dict[str, Any],
    spec: OverlaySpec,
    links: Sequence[Edge],
    where: str,
    *,
    since: float | None = None,
) -> int:
    from canopy_broker.progress import Progress
    from canopy_operator.mining.errors import MiningInputError
    from canopy_operator.mining.job import STAGES, describe, mine, write_outputs
    from canopy_operator.mining.session import spark_session

    spark = spark_session(args.spark_master, driver_memory=args.driver_memory)
    if getattr(args, "compact", False) and "://" not in where and Path(where).is_dir():
        from canopy_operator.mining.source import compact_telemetry

        files = compact_telemetry(spark, Path(where))
        _say(f"compacted {files} closed JSON file(s) into Parquet under {where}")
    try:
        with Progress("mine", len(STAGES)) as shown:  # a bar of the stages on a terminal
            result = mine(
                spark,
                where,
                spec,
                links,
                settings_for(args, manifest),
                progress=shown.note,
                stage=shown.step,
                since_ts=since,
            )
    except MiningInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    proposals = result.proposals()
    names = {i: p.name or "" for i, p in enumerate(proposals)}
    for line in describe(result, names):
        print(line)
    if args.out:
        written = write_outputs(result, args.out, proposals)
        print(f"wrote {args.out}/ (mining.json, tables, {len(written)} proposal file(s))")
    if args.json:
        print(json.dumps(result.to_json()))
    return 0


# -- cluster ----------------------------------------------------------------------------------


async def mine_cluster(args: argparse.Namespace, resolver: Any = None) -> int:
    """The CronJob: every self-organising overlay → pull → mine → file proposals.

    One overlay's failure (a broker unreachable, the API refusing, Spark failing) is reported
    and counted; the others are still mined; the exit code is 1 if any failed.
    ``resolver`` maps (namespace, service, pod) to a broker's endpoints: the cluster DNS by
    default, local processes in tests (as for the operator)."""
    from canopy_operator.backends import kube, manifests
    from canopy_operator.commands.cluster import CommandError, kube_api

    try:
        api = await kube_api(args, user_agent="canopy-miner")
    except CommandError as exc:
        raise SystemExit(f"error: {exc}") from None
    failures = 0
    try:
        paths = [kube.overlay_path(ns) for ns in args.namespace] or [
            f"/apis/{kube.GROUP}/{kube.VERSION}/{kube.PLURAL}"
        ]
        overlays = [o for path in paths for o in await api.items(path)]
        for obj in overlays:
            meta = obj.get("metadata") or {}
            where = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
            try:
                await _mine_overlay(args, api, obj, resolver or manifests.dns_resolver)
            except Exception as exc:  # one overlay must not stop the others
                failures += 1
                _say(f"{where}: FAILED: {type(exc).__name__}: {exc}")
    finally:
        await api.close()
    _say(f"mined {len(overlays)} overlay(s), {failures} failed")
    return 1 if failures else 0


async def _mine_overlay(
    args: argparse.Namespace, api: Any, obj: dict[str, Any], resolve: Any
) -> None:
    from canopy_operator.backends import certs, kube, manifests
    from canopy_operator.model.topology import parse_overlay, validate_tree

    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    ns, name = str(meta.get("namespace") or "default"), str(meta.get("name"))
    mode = ((obj.get("spec") or {}).get("selfOrganization") or {}).get("mode", "off")
    if mode not in ("propose", "auto"):
        _say(f"{ns}/{name}: selfOrganization.mode is {mode}: skipped")
        return
    try:
        spec = parse_overlay(obj)
    except SpecError as exc:
        _say(f"{ns}/{name}: invalid spec, skipped: {exc}")
        return
    if (
        status.get("phase") != OverlayPhase.READY
        or status.get("observedGeneration") != spec.generation
    ):
        # Mid-reconfiguration the live links are not the spec's yet: proposals made against
        # them would be stale at birth. The next run will find it converged.
        _say(f"{ns}/{name}: not converged (phase {status.get('phase')}): skipped")
        return
    links = current_links(obj, spec)
    problems = validate_tree(set(spec.broker_names), links or [], 10**6)
    if not links or problems:
        _say(f"{ns}/{name}: live links are not a tree over its brokers: skipped ({problems})")
        return
    secret = await api.get(kube.core_path(ns, "secrets", manifests.secret_name(name)))
    token_b64 = ((secret or {}).get("data") or {}).get("token")
    if not token_b64:
        raise RuntimeError(f"no admin token in secret {manifests.secret_name(name)}")
    tls = None
    if manifests.security_of(name, obj.get("spec") or {}).tls:  # the brokers' admin APIs are HTTPS
        client = await api.get(kube.core_path(ns, "secrets", manifests.client_secret_name(name)))
        ca = certs.secret_bytes(client, "ca.crt")
        if not ca:
            raise RuntimeError(f"no CA certificate in secret {manifests.client_secret_name(name)}")
        tls = certs.verify_context(ca)
    admins = {
        b: resolve(ns, manifests.service_name(name), manifests.pod_name(name, b)).admin
        for b in spec.broker_names
    }
    await _mine_and_file(
        args,
        api,
        obj=obj,
        spec=spec,
        links=links,
        admins=admins,
        token=base64.b64decode(token_b64).decode(),
        ns=ns,
        tls=tls,
    )


async def _mine_and_file(
    args: argparse.Namespace,
    api: Any,
    *,
    obj: dict[str, Any],
    spec: OverlaySpec,
    links: Sequence[Edge],
    admins: dict[str, str],
    token: str,
    ns: str,
    tls: ssl.SSLContext | None = None,
) -> None:
    from canopy_operator.backends.kube import GROUP, VERSION
    from canopy_operator.mining.errors import TelemetryError
    from canopy_operator.mining.job import describe, mine
    from canopy_operator.mining.session import spark_session
    from canopy_operator.mining.source import pull_telemetry
    from canopy_operator.model import proposals

    name = spec.name
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/topologyproposals"
    spark = spark_session(args.spark_master, driver_memory=args.driver_memory)
    with tempfile.TemporaryDirectory(prefix="canopy-pull-") as staging:
        pulled = await pull_telemetry(admins, token, Path(staging), tls=tls)
        _say(f"{ns}/{name}: {pulled.describe()}")
        if pulled.unreachable:
            raise RuntimeError(
                f"brokers unreachable: {', '.join(pulled.unreachable)} (no proposal from a "
                "partial view)"
            )
        try:
            result = await asyncio.to_thread(
                mine,
                spark,
                staging,
                spec,
                links,
                settings_for(args, obj),
                progress=_say,
                since_ts=pulled.since(args.since),
            )
        except TelemetryError as exc:
            _say(f"{ns}/{name}: nothing to mine yet: {exc}")
            return
        finally:
            spark.catalog.clearCache()  # the next overlay starts with an empty cache
    for line in describe(result):
        _say(f"{ns}/{name}: {line}")
    existing = [
        p
        for p in await api.items(base)
        if ((p.get("metadata") or {}).get("labels") or {}).get(proposals.LABEL_OVERLAY) == name
    ]
    for p in result.proposals(namespace=ns):
        if proposals.open_duplicates(existing, p):
            _say(f"{ns}/{name}: {p.name} is already open: not filed again")
            continue
        manifest = proposals.to_manifest(p)
        if not await api.create(base, manifest):
            # Same changes, same name. A Stale or Failed one is replaced (this is a fresh
            # finding against the current generation); a Rejected one stays rejected.
            old = await api.get(f"{base}/{p.name}") or {}
            phase = (old.get("status") or {}).get("phase")
            if phase not in (ProposalPhase.STALE, ProposalPhase.FAILED):
                _say(f"{ns}/{name}: {p.name} was {phase or 'filed'} before: not filed again")
                continue
            await api.delete(f"{base}/{p.name}")
            existing = [e for e in existing if e["metadata"]["name"] != p.name]
            await api.create(base, manifest)
        existing.append(manifest)
        _say(f"{ns}/{name}: filed {p.name} ({p.evidence.get('expectedGain')})")
    for old_name in proposals.to_prune(existing, args.history_limit):
        await api.delete(f"{base}/{old_name}")
        _say(f"{ns}/{name}: pruned {old_name}")
