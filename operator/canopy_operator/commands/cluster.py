"""What the CLI's cluster commands share: how they reach the API server, and how they print.

Credentials come from the official Kubernetes client's loaders, the way kubectl finds them:
``--kubeconfig`` (else ``$KUBECONFIG``, else ``~/.kube/config``) with ``--context`` (else the
current one) — client certificates, tokens and exec credential plugins (EKS, GKE, AKS, OIDC)
included — and, with no kubeconfig at all, the pod's service account. ``--server``/``--token``
still name an API server directly. Output follows kubectl's habits: a table by default, ``-o
wide`` for more columns, ``-o json`` / ``-o yaml`` for machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from canopy_operator.backends.kube import KubeApi

API = "/apis/canopy.dev/v1alpha1"
OUTPUTS = ("json", "yaml", "wide")


class CommandError(Exception):
    """Reported as ``error: ...`` with exit code 2."""


def add_cluster_arguments(p: argparse.ArgumentParser, *, all_namespaces: bool = False) -> None:
    p.add_argument("-n", "--namespace", default="default", help="namespace (default: default)")
    if all_namespaces:
        p.add_argument("-A", "--all-namespaces", action="store_true")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("--server", help="API server URL (instead of a kubeconfig)")
    p.add_argument("--token", help="bearer token for --server")
    p.add_argument("--insecure", action="store_true", help="do not verify --server's TLS")


def add_output_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=OUTPUTS, help="json, yaml, or wide (more columns)")


async def kube_api(args: argparse.Namespace, user_agent: str = "canopy-cli") -> KubeApi:
    """An API client for the command's cluster flags (--server, else a kubeconfig, else the
    pod's service account)."""
    from canopy_operator.backends.kube import (  # noqa: PLC0415
        KubeApi,
        KubeConfigError,
        load_credentials,
    )

    if args.server:
        return KubeApi(args.server, token=args.token, insecure=args.insecure, user_agent=user_agent)
    try:
        info = await asyncio.to_thread(load_credentials, args.kubeconfig, args.context)
    except KubeConfigError as exc:
        raise CommandError(str(exc)) from None
    return KubeApi.from_connection(info, user_agent=user_agent)


async def get(api: KubeApi, path: str, what: str) -> dict[str, Any]:
    from canopy_operator.backends.kube import KubeError  # noqa: PLC0415

    try:
        obj = await api.get(path)
    except (KubeError, OSError) as exc:
        raise CommandError(f"cannot read {what}: {exc}") from None
    if obj is None:
        raise CommandError(f"{what} not found")
    return obj


async def list_objects(args: argparse.Namespace, plural: str) -> list[dict[str, Any]]:
    """Every ``plural`` of canopy.dev in the namespace (or all of them, with ``-A``)."""
    api = await kube_api(args)
    try:
        where = "" if getattr(args, "all_namespaces", False) else f"/namespaces/{args.namespace}"
        data = await get(api, f"{API}{where}/{plural}", plural)
    finally:
        await api.close()
    return list(data.get("items") or [])


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Columns padded to their widest cell; an all-empty first column (one namespace) is left
    out, as kubectl leaves NAMESPACE out without ``-A``."""
    if len(rows) > 1 and not any(r[0] for r in rows[1:]):
        rows = [r[1:] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def show_list(
    items: list[dict[str, Any]], output: str | None, rows: list[list[str]], empty: str
) -> int:
    """A listing: a kubectl-style List for ``-o json|yaml``, else the table (and ``empty`` on
    stderr when it has no rows)."""
    if output in ("json", "yaml"):
        dump({"apiVersion": "v1", "kind": "List", "items": items}, output)
        return 0
    print_table(rows)
    if len(rows) == 1:
        print(empty, file=sys.stderr)
    return 0


def dump(data: Any, output: str) -> None:
    """``-o json`` (one object on the last line) or ``-o yaml``."""
    if output == "json":
        print(json.dumps(data, default=str))
    else:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False, default_flow_style=False))


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == kind:
            return c
    return {}


def overlay_rows(
    items: Sequence[dict[str, Any]], *, wide: bool, namespaces: bool
) -> list[list[str]]:
    """BrokerOverlays as a table, the columns of ``kubectl get brokeroverlays`` and more; the
    NAMESPACE column only across namespaces, as kubectl shows it."""
    head = ["NAMESPACE", "NAME", "PHASE", "BROKERS", "LINKS", "GENERATION", "PLAN"]
    if wide:
        head += ["ROUTING", "RECONFIGURATION", "MESSAGE"]
    rows = [head]
    for obj in sorted(
        items,
        key=lambda o: (
            (o.get("metadata") or {}).get("namespace", ""),
            (o.get("metadata") or {}).get("name", ""),
        ),
    ):
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        status = obj.get("status") or {}
        row = [
            str(meta.get("namespace") or "") if namespaces else "",
            str(meta.get("name") or ""),
            str(status.get("phase") or "-"),
            str(status.get("brokersReady") or f"?/{len(spec.get('brokers') or [])}"),
            str(status.get("linkCount", "-")),
            f"{status.get('observedGeneration', '-')}/{meta.get('generation', '-')}",
            str((status.get("plan") or {}).get("progress") or "-"),
        ]
        if wide:
            reconf = spec.get("reconfiguration") or {}
            # The condition that says why the overlay is in its phase.
            kind = {"Invalid": "Valid", "Degraded": "Degraded"}.get(
                str(status.get("phase")), "Ready"
            )
            message = _condition(obj, kind)
            row += [
                str(spec.get("routing") or "covering"),
                f"{reconf.get('algorithm') or 'coordinated'}/{reconf.get('ordering') or 'fifo'}",
                str(message.get("message") or "-"),
            ]
        rows.append(row)
    return rows


def run_cluster_status(args: argparse.Namespace) -> int:
    """`canopy status --cluster` (`kubectl canopy status`): the cluster's BrokerOverlays."""
    try:
        items = asyncio.run(list_objects(args, "brokeroverlays"))
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    where = "any namespace" if args.all_namespaces else f"namespace {args.namespace}"
    return show_list(
        items,
        args.output,
        overlay_rows(items, wide=args.output == "wide", namespaces=args.all_namespaces),
        f"no BrokerOverlays in {where}",
    )
