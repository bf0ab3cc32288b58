"""The `canopy` command: the user's entry point (demo, clients, simulator, benchmarks).

Subcommands import their modules lazily so that `canopy --help` and light commands start fast
and do not pull in aiohttp or the process machinery they don't use.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from canopy_broker import logs


def as_kubectl_plugin() -> bool:
    """Run by kubectl as `kubectl canopy ...` (the executable kubectl-canopy): then `status`
    speaks of the cluster, as every kubectl command does."""
    return Path(sys.argv[0]).name == "kubectl-canopy"


def build_parser() -> argparse.ArgumentParser:
    from canopy_operator.commands import demo, local, mine, plan, sim, supervise

    parser = argparse.ArgumentParser(
        prog="kubectl canopy" if as_kubectl_plugin() else "canopy",
        description="Canopy: a content-based publish/subscribe overlay that reshapes itself live.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_arguments(sub)
    plan.add_arguments(sub)
    local.add_arguments(sub)
    supervise.add_arguments(sub)
    sim.add_arguments(sub)
    mine.add_arguments(sub)
    _add_operator_command(sub)
    _add_proposal_commands(sub)
    _add_broker_commands(sub)
    p = sub.add_parser(
        "completion",
        help="print a shell completion script: source <(canopy completion bash)",
    )
    p.add_argument("shell", choices=("bash", "zsh", "tcsh"))
    p.set_defaults(func=_completion)
    return parser


def _completion(args: argparse.Namespace) -> int:
    """The completion script, generated from the parser itself (shtab), so it never drifts
    from the commands and flags."""
    import shtab

    print(shtab.complete(build_parser(), shell=args.shell))
    return 0


def _add_proposal_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`canopy proposal export | list`: TopologyProposals for GitOps and people."""
    from canopy_operator.commands import proposal

    proposal.add_arguments(sub)


def _add_operator_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`canopy operator`: the Kubernetes operator (kopf), imported only when it runs."""
    p = sub.add_parser("operator", help="run the Kubernetes operator (BrokerOverlay handlers)")
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: all namespaces)",
    )
    p.add_argument(
        "--server",
        help="API server URL (default: the pod's service account, else the kubeconfig)",
    )
    p.add_argument("--token", help="bearer token for --server")
    p.add_argument("--insecure", action="store_true", help="do not verify --server's TLS")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context (default: its current context)")
    p.add_argument("--broker-image", help="default broker image (or $CANOPY_BROKER_IMAGE)")
    p.add_argument("--metrics-port", type=int, default=8000, help="/metrics port (0: off)")
    p.add_argument("--liveness", help="kopf's liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    p.add_argument("--heal-interval", type=float, default=30.0, help="seconds between checks")
    p.add_argument(
        "--renew-interval",
        type=float,
        default=3600.0,
        help="seconds between looks at the brokers' certificates (renewed in the last third of "
        "their validity)",
    )
    p.add_argument(
        "--leader-election",
        action="store_true",
        help="act only while holding a coordination.k8s.io Lease (for several replicas)",
    )
    p.add_argument("--lease-name", default="canopy-operator")
    p.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="the Lease's namespace (default: $POD_NAMESPACE)",
    )
    p.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or socket.gethostname(),
        help="this replica's name in the Lease (default: $POD_NAME, else the host name)",
    )
    p.add_argument("--lease-duration", type=float, default=15.0, help="seconds")
    p.add_argument(
        "--network-policy-namespace",
        action="append",
        default=[],
        metavar="NS",
        help="a namespace whose broker pods a NetworkPolicy isolates (the chart's): give each"
        " overlay there a policy admitting its link port from its own brokers (repeatable)",
    )
    logs.add_argument(p)
    p.set_defaults(func=_run_operator)


def _run_operator(args: argparse.Namespace) -> int:
    import asyncio

    from prometheus_client import start_http_server

    from canopy_operator.backends import handlers, reconciler
    from canopy_operator.backends.leader import LeaseConfig, LostLeadershipError

    logs.configure("INFO", args.log_format)
    config = reconciler.OperatorConfig(
        server=args.server,
        token=args.token,
        insecure=args.insecure,
        kubeconfig=args.kubeconfig,
        context=args.context,
        heal_interval=args.heal_interval,
        renew_interval=args.renew_interval,
        network_policy_namespaces=frozenset(args.network_policy_namespace),
    )
    if args.broker_image:
        config.image = args.broker_image
    if args.leader_election:
        config.leader = LeaseConfig(
            args.lease_namespace, args.lease_name, args.identity, args.lease_duration
        )
    if args.metrics_port:
        start_http_server(args.metrics_port)
    try:
        asyncio.run(
            handlers.run_operator(config, namespaces=args.namespace, liveness=args.liveness)
        )
    except LostLeadershipError as exc:  # the pod restarts and waits for the lease again
        print(f"canopy operator: {exc}; exiting", file=sys.stderr)
        return 1
    return 0


def _add_broker_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Client and benchmark commands that live with the broker package."""
    from canopy_broker import (
        bench,
        bench_faults,
        bench_peers,
        bench_scale,
        bench_subscriptions,
        clients_cli,
    )
    from canopy_operator.commands import mine

    clients_cli.add_pubsub_arguments(sub)
    p = sub.add_parser("bench", help="benchmarks that print measured figures")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    dataplane = bench_sub.add_parser(
        "dataplane", help="throughput, latency, matching speed-up and memory of real brokers"
    )
    bench.add_arguments(dataplane)
    dataplane.set_defaults(func=bench.run_args)
    subscriptions = bench_sub.add_parser(
        "subscriptions",
        help="subscription install time, churn and event-loop stalls in a real overlay",
    )
    bench_subscriptions.add_arguments(subscriptions)
    subscriptions.set_defaults(func=bench_subscriptions.run_args)
    faults = bench_sub.add_parser(
        "faults",
        help="a broker SIGKILLed under traffic: repair time, losses, retention memory, "
        "custody cost",
    )
    bench_faults.add_arguments(faults)
    faults.set_defaults(func=bench_faults.run_args)
    peers = bench_sub.add_parser(
        "peers",
        help="broker CPU per notification: Canopy, NATS and Mosquitto on the same workload",
    )
    bench_peers.add_arguments(peers)
    peers.set_defaults(func=bench_peers.run_args)
    bench_scale.add_arguments(
        bench_sub.add_parser(
            "broker",
            help="one broker at 1k, 10k and 100k filters: notifications/s, CPU per "
            "notification, memory",
        )
    )
    mine.add_bench_arguments(bench_sub)
    from canopy_operator.commands import bench_chaos, bench_day2

    bench_chaos.add_arguments(
        bench_sub.add_parser(
            "chaos",
            help="a local overlay under seeded combined faults (kills, pauses, cuts, "
            "reshapes): every subscriber's losses, told and untold",
        )
    )

    bench_day2.add_arguments(
        bench_sub.add_parser(
            "day2",
            help="a local overlay with its supervisor: kill to declared shape restored, a "
            "rolling replacement of every broker, losses of each under load",
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    from canopy_operator.backends.local import BrokerDownError, StateFileError

    parser = build_parser()
    args = parser.parse_args(argv)
    if as_kubectl_plugin() and args.command == "status":
        args.cluster = True
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (BrokerDownError, StateFileError) as exc:  # a dead broker, an unreadable state
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        try:
            sys.stdout.flush()
        except BrokenPipeError:  # `canopy status | head`: the reader has what it wanted
            # Python flushes stdout again at exit, into the closed pipe: point it at /dev/null.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        raise  # not our output's pipe (a socket to a broker, say): a real error
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
