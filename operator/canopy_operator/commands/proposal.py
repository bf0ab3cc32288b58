"""`canopy proposal export NAME|FILE` and `canopy proposal list [DIR]`: proposals for people and
for GitOps.

``export`` prints the BrokerOverlay manifest with a proposal applied, as YAML, ready to commit in
a pull request (the operator never writes an explicit-links overlay's spec). The proposal is a
file (YAML or JSON, as ``canopy mine`` writes them; ``--overlay FILE`` is then required) or the
name of a TopologyProposal in the cluster, whose overlay is read from the cluster too unless
``--overlay FILE`` gives the manifest from the repository. ``list`` shows the proposals of a
directory or of the cluster. Errors (a missing proposal, one for another overlay, changes that do
not fit the overlay's links) exit with code 2 and a message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from canopy_operator.commands.cluster import (
    API,
    CommandError,
    add_cluster_arguments,
    add_output_argument,
    get,
    kube_api,
    list_objects,
    show_list,
)
from canopy_operator.model.proposals import ProposalError, exported_overlay, from_manifest


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("proposal", help="TopologyProposals: export one for GitOps, list them")
    psub = p.add_subparsers(dest="proposal_command", required=True, metavar="COMMAND")
    export = psub.add_parser(
        "export", help="print the BrokerOverlay manifest with a proposal applied (YAML)"
    )
    export.add_argument("proposal", help="a TopologyProposal file, or its name in the cluster")
    export.add_argument(
        "--overlay",
        type=Path,
        help="the BrokerOverlay manifest (required with a file; default: the cluster's)",
    )
    export.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    add_cluster_arguments(export)
    export.set_defaults(func=run_export)
    listing = psub.add_parser("list", help="the proposals of a directory or of the cluster")
    listing.add_argument("dir", nargs="?", type=Path, help="proposal files (default: cluster)")
    add_cluster_arguments(listing, all_namespaces=True)
    add_output_argument(listing)
    listing.set_defaults(func=run_list)


def _documents(path: Path) -> list[Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise CommandError(f"{path}: {exc.strerror or exc}") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
            return (
                list(data.get("items") or []) if data.get("kind", "").endswith("List") else [data]
            )
        return [d for d in yaml.safe_load_all(text) if d]
    except (ValueError, yaml.YAMLError, AttributeError) as exc:
        raise CommandError(f"{path}: cannot read: {exc}") from None


def _one(path: Path, kind: str) -> dict[str, Any]:
    found = [d for d in _documents(path) if isinstance(d, dict) and d.get("kind") == kind]
    if len(found) != 1:
        raise CommandError(f"{path}: expected one {kind}, found {len(found)}")
    return found[0]


async def _from_cluster(
    args: argparse.Namespace, name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    api = await kube_api(args)
    try:
        ns = args.namespace
        proposal = await get(
            api,
            f"{API}/namespaces/{ns}/topologyproposals/{name}",
            f"topologyproposal {name} in namespace {ns}",
        )
        if args.overlay is not None:
            return proposal, _one(args.overlay, "BrokerOverlay")
        overlay = str((proposal.get("spec") or {}).get("overlay") or "")
        if not overlay:
            raise CommandError(f"topologyproposal {name} names no overlay (spec.overlay)")
        obj = await get(
            api,
            f"{API}/namespaces/{ns}/brokeroverlays/{overlay}",
            f"brokeroverlay {overlay} in namespace {ns}",
        )
        return proposal, {**obj, "kind": obj.get("kind") or "BrokerOverlay"}
    finally:
        await api.close()


def export(args: argparse.Namespace) -> dict[str, Any]:
    source = Path(args.proposal)
    if source.is_file():
        if args.overlay is None:
            raise CommandError("--overlay FILE is required with a proposal file")
        proposal = _one(source, "TopologyProposal")
        overlay = _one(args.overlay, "BrokerOverlay")
    elif source.suffix in (".yaml", ".yml", ".json") or "/" in args.proposal:
        raise CommandError(f"{source}: no such file")
    else:
        proposal, overlay = asyncio.run(_from_cluster(args, args.proposal))
    try:
        return exported_overlay(overlay, from_manifest(proposal))
    except ProposalError as exc:
        raise CommandError(str(exc)) from None


def run_export(args: argparse.Namespace) -> int:
    try:
        manifest = export(args)
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = yaml.safe_dump(manifest, sort_keys=False, default_flow_style=None)
    if args.output is not None:
        try:
            args.output.write_text(text)
        except OSError as exc:
            print(f"error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _row(obj: Mapping[str, Any]) -> list[str]:
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    status = obj.get("status") or {}
    changes = ", ".join(
        f"{'-'.join(c.get('remove') or [])} => {'-'.join(c.get('add') or [])}"
        for c in spec.get("changes") or []
        if isinstance(c, Mapping)
    )
    gain = str((spec.get("evidence") or {}).get("expectedGain") or "")
    return [
        str(meta.get("namespace") or ""),
        str(meta.get("name") or ""),
        str(spec.get("overlay") or ""),
        str(spec.get("generation", "")),
        str(status.get("phase") or "-"),
        gain,
        changes,
    ]


def run_list(args: argparse.Namespace) -> int:
    """The proposals in a directory (or the cluster's). A file that cannot be read is named
    on stderr and the rest are listed, exit 1 (as ``ls`` does); one such file used to end
    the whole listing."""
    unreadable: list[str] = []
    try:
        if args.dir is not None:
            if not args.dir.is_dir():
                raise CommandError(f"{args.dir}: not a directory")
            files = sorted(p for p in args.dir.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
            items = []
            for p in files:
                try:
                    docs = _documents(p)
                except CommandError as exc:
                    unreadable.append(str(exc))
                    continue
                items += [
                    d for d in docs if isinstance(d, dict) and d.get("kind") == "TopologyProposal"
                ]
        else:
            items = asyncio.run(list_objects(args, "topologyproposals"))
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for why in unreadable:
        print(f"warning: skipped {why}", file=sys.stderr)
    rows = [["NAMESPACE", "NAME", "OVERLAY", "GEN", "PHASE", "GAIN", "CHANGES"]]
    rows += sorted(_row(obj) for obj in items)
    return show_list(items, args.output, rows, "no proposals") or (1 if unreadable else 0)
