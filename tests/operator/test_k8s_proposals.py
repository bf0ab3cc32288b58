"""TopologyProposals through the real operator (kopf on kmock's emulator, real broker processes):
the lifecycle by annotation and by ``mode: auto``, Stale and Rejected, the GitOps path of
explicit-links overlays, and a restart in the middle of applying a proposal."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from canopy_operator.backends.kube import overlay_path, proposal_path
from canopy_operator.cli import main
from canopy_operator.model.proposals import (
    Change,
    Proposal,
    apply_changes,
    exported_overlay,
    to_manifest,
)
from canopy_operator.model.topology import Edge, adjacency, norm, tree_path
from tests.operator import test_k8s_operator
from tests.operator.k8s_harness import (
    NS,
    BrokerView,
    CanopyEmulator,
    Gate,
    condition,
    deliveries,
    live_traffic,
    overlay_manifest,
    server_url,
    until,
)
from tests.operator.test_k8s_operator import (
    ROOT,
    Cluster,
    events,
    undeclared,
    verbs_granted,
    verbs_used,
)

pytestmark = [pytest.mark.integration, pytest.mark.kmock(cls=CanopyEmulator)]
cluster = test_k8s_operator.cluster  # the same fixture: emulator, kubelet, operator thread


def exchanges(links: list[Edge], max_fan_out: int = 3) -> list[Change]:
    """Every valid single exchange on the tree ``links`` that keeps fan-out, in a fixed order:
    add a link between two brokers that are not adjacent, remove the first link of the path."""
    adj = adjacency(links)
    out: list[Change] = []
    for u, v in itertools.combinations(sorted(adj), 2):
        if v in adj[u] or len(adj[u]) >= max_fan_out or len(adj[v]) >= max_fan_out:
            continue
        path = tree_path(adj, u, v)
        out.append((norm((path[0], path[1])), (u, v)))
    return out


async def file(cluster: Cluster, p: Proposal, **annotations: str) -> str:
    body = to_manifest(p)
    if annotations:
        body["metadata"]["annotations"] = annotations
    await cluster.api.create(proposal_path(NS), body)
    return p.resource_name


async def annotate(cluster: Cluster, name: str, key: str, value: str) -> None:
    await cluster.api.patch(proposal_path(NS, name), {"metadata": {"annotations": {key: value}}})


async def get_proposal(cluster: Cluster, name: str) -> dict[str, Any]:
    obj = await cluster.api.get(proposal_path(NS, name))
    assert obj is not None
    return obj


async def reaches(cluster: Cluster, name: str, phase: str, within: float = 20) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        obj = await get_proposal(cluster, name)
        return obj if (obj.get("status") or {}).get("phase") == phase else None

    return await until(check, within, f"proposal {name} {phase}")


def phases(emulator: kmock.KubernetesEmulator, name: str) -> list[str]:
    """The proposal's phases as the API server stored them, oldest first, without repeats."""
    for (resource, _ns, pname), obj in list(emulator.objects.items()):
        if resource.plural == "topologyproposals" and pname == name:
            seen = [(v.raw.get("status") or {}).get("phase") for v in obj.history if v]
            return [p for p, _ in itertools.groupby(p for p in seen if p)]
    return []


def about(emulator: kmock.KubernetesEmulator, name: str, reason: str) -> list[str]:
    return [
        e["message"]
        for e in events(emulator, reason)
        if e["involvedObject"]["name"] == name and e["involvedObject"]["kind"] == "TopologyProposal"
    ]


async def live_links(cluster: Cluster, overlay: str) -> set[Edge]:
    links = set()
    for pod, proc in cluster.kubelet.procs.items():
        if pod.startswith(f"{overlay}-"):
            for n in (await proc.admin.status())["neighbours"]:
                links.add(norm((pod.removeprefix(f"{overlay}-"), n["peer"])))
    return links


async def test_an_approved_proposal_reshapes_a_managed_overlay_live(cluster: Cluster) -> None:
    names = ["a", "b", "c", "d", "e", "f"]
    cluster.start_operator()
    await cluster.apply(overlay_manifest("demo", names, None, selfOrganization={"mode": "propose"}))
    obj = await cluster.ready("demo")
    tree = [norm((x, y)) for x, y in obj["status"]["links"]]
    options = exchanges(tree)
    good = Proposal("demo", 1, (options[0],), {"expectedGain": "-10% hops/event"}, namespace=NS)
    # Removes the same link as the good one, adds another: valid now, not once `good` is in.
    rival = next(c for c in options if c[0] == options[0][0] and c[1] != options[0][1])
    other = next(c for c in options if c[0] != options[0][0])
    absent = next(norm(p) for p in itertools.combinations(names, 2) if norm(p) not in tree)
    gone = Proposal("demo", 1, ((absent, options[0][1]),), {}, namespace=NS)
    behind = Proposal("demo", 0, (other,), {}, namespace=NS, name="demo-behind")

    good_name = await file(cluster, good)
    rival_name = await file(cluster, Proposal("demo", 1, (rival,), {}, namespace=NS))
    rejected_name = await file(cluster, Proposal("demo", 1, (other,), {}, namespace=NS))
    gone_name = await file(cluster, gone)
    behind_name = await file(cluster, behind)

    proposed = await reaches(cluster, good_name, "Proposed")
    assert "canopy.dev/approve=true" in proposed["status"]["message"]
    assert condition(proposed, "Approved")["status"] == "False"
    assert condition(proposed, "Applied")["status"] == "False"
    stale = await reaches(cluster, gone_name, "Stale")
    assert f"{absent[0]}-{absent[1]} is not in the overlay" in stale["status"]["message"]
    assert condition(stale, "Applied")["reason"] == "ChangesInvalid"
    stale = await reaches(cluster, behind_name, "Stale")
    assert condition(stale, "Applied")["reason"] == "GenerationChanged"
    await reaches(cluster, rival_name, "Proposed")
    await reaches(cluster, rejected_name, "Proposed")
    await annotate(cluster, rejected_name, "canopy.dev/reject", "true")
    rejected = await reaches(cluster, rejected_name, "Rejected")
    assert condition(rejected, "Approved")["status"] == "False"

    # Live traffic while the proposal is applied.
    view = BrokerView(cluster.kubelet, "demo", tree)
    run = await live_traffic(view, names, [options[0][1][0], options[0][0][1]], seed=11)
    await until(lambda: len(run.pubs) > 100, 10, "some traffic")

    await annotate(cluster, good_name, "canopy.dev/approve", "true")
    applied = await reaches(cluster, good_name, "Applied")
    assert phases(cluster.emulator, good_name) == ["Proposed", "Approved", "Applying", "Applied"]
    assert condition(applied, "Approved")["reason"] == "ApprovedByAnnotation"
    assert condition(applied, "Applied")["status"] == "True"
    assert applied["status"]["plan"]["progress"] == "1/1"
    want = set(apply_changes(tree, good.changes))
    assert await live_links(cluster, "demo") == want
    overlay = await cluster.overlay("demo")
    assert {norm(e) for e in overlay["status"]["links"]} == want
    assert overlay["status"]["phase"] == "Ready" and overlay["metadata"]["generation"] == 1
    assert overlay["status"]["lastReconfiguration"]["proposal"] == good_name
    assert "links" not in overlay["spec"]  # the operator never writes spec
    # The rival no longer fits: noticed once the good one is in, without being touched.
    rival_now = await reaches(cluster, rival_name, "Stale")
    assert "not in the overlay" in rival_now["status"]["message"]

    # Nothing lost, duplicated or reordered.
    report = await deliveries(view, run, sorted(want))
    assert report.ok and report.owed > 100, str(report)

    # An Event per transition, on the proposal; the overlay is told too.
    await until(lambda: about(cluster.emulator, good_name, "Applied"), 10, "the Applied Event")
    for reason in ("Proposed", "Approved", "Applying", "StepDone"):
        assert about(cluster.emulator, good_name, reason), reason
    assert about(cluster.emulator, rejected_name, "Rejected")
    await until(lambda: events(cluster.emulator, "ProposalApplied"), 10, "ProposalApplied")

    # Everything written into a proposal's status is declared in the CRD (nothing is pruned).
    crd = yaml.safe_load((ROOT / "manifests/crds/topologyproposals.canopy.dev.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    for (resource, _ns, _name), stored in list(cluster.emulator.objects.items()):
        if resource.plural == "topologyproposals":
            for version in filter(None, stored.history):
                assert not undeclared(version.raw.get("status") or {}, schema, "status")

    # Least privilege: what proposals need is granted, and used.
    used, granted = verbs_used(cluster.emulator), verbs_granted()
    assert used <= granted
    mine = {v for v in granted if v[1].startswith("topologyproposals")}
    assert {v for v in used if v[1].startswith("topologyproposals")} == mine


async def test_auto_mode_applies_a_proposal_without_approval(cluster: Cluster) -> None:
    cluster.start_operator()
    await cluster.apply(
        overlay_manifest("auto", ["a", "b", "c", "d"], None, selfOrganization={"mode": "auto"})
    )
    obj = await cluster.ready("auto")
    tree = [norm((x, y)) for x, y in obj["status"]["links"]]
    p = Proposal("auto", 1, (exchanges(tree)[0],), {}, namespace=NS)
    name = await file(cluster, p)
    applied = await reaches(cluster, name, "Applied")
    assert condition(applied, "Approved")["reason"] == "ApprovedAutomatically"
    assert await live_links(cluster, "auto") == set(apply_changes(tree, p.changes))


async def test_an_explicit_links_overlay_gets_a_patch_and_is_applied_by_gitops(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    links = [("a", "b"), ("b", "c"), ("c", "d")]
    cluster.start_operator()
    body = overlay_manifest("git", ["a", "b", "c", "d"], links, selfOrganization={"mode": "auto"})
    await cluster.apply(body)
    before = await cluster.ready("git")
    p = Proposal("git", 1, ((("b", "c"), ("a", "c")),), {}, namespace=NS)
    later = Proposal("git", 1, ((("c", "d"), ("b", "d")),), {}, namespace=NS)
    name = await file(cluster, p)
    later_name = await file(cluster, later, **{"canopy.dev/approve": "false"})
    await reaches(cluster, later_name, "Rejected")

    approved = await reaches(cluster, name, "Approved")
    patch = approved["status"]["patch"]
    assert patch == exported_overlay(before, p)["spec"]
    assert patch["links"] == [["a", "b"], ["a", "c"], ["c", "d"]]
    assert f"canopy proposal export {name}" in approved["status"]["message"]
    assert condition(approved, "Applied")["status"] == "False"
    # The operator never writes the spec: the overlay and its brokers are as they were.
    await asyncio.sleep(0.5)
    overlay = await cluster.overlay("git")
    assert overlay["spec"] == before["spec"] and overlay["metadata"]["generation"] == 1
    assert await live_links(cluster, "git") == {norm(e) for e in links}
    assert await reaches(cluster, name, "Approved")  # and it waits for the merge

    # `canopy proposal export NAME` reads both from the cluster and prints the same spec.
    server = ["--server", server_url(cluster.emulator), "-n", NS]
    out = tmp_path / "git.yaml"
    export = ["proposal", "export", name, *server, "-o", str(out)]
    assert await asyncio.to_thread(main, export) == 0
    exported = yaml.safe_load(out.read_text())
    assert exported["spec"] == patch and exported["metadata"] == {"name": "git", "namespace": NS}
    assert await asyncio.to_thread(main, ["proposal", "export", "nope", *server]) == 2
    assert "topologyproposal nope in namespace canopy not found" in capsys.readouterr().err

    # GitOps merges the exported spec: the overlay reconciles, the proposal is Applied.
    await cluster.api.patch(overlay_path(NS, "git"), {"spec": patch})
    await cluster.ready("git", generation=2)
    applied = await reaches(cluster, name, "Applied")
    assert condition(applied, "Applied")["reason"] == "Merged"
    assert await live_links(cluster, "git") == {("a", "b"), ("a", "c"), ("c", "d")}
    assert (await get_proposal(cluster, later_name))["status"]["phase"] == "Rejected"


async def test_a_restarted_operator_resumes_applying_a_proposal(cluster: Cluster) -> None:
    cluster.start_operator()
    await cluster.apply(
        overlay_manifest("demo", list("abcde"), None, selfOrganization={"mode": "auto"})
    )
    obj = await cluster.ready("demo")
    tree = [norm((x, y)) for x, y in obj["status"]["links"]]
    # Two exchanges, the second on the tree the first leaves.
    first = exchanges(tree)[0]
    second = next(
        c for c in exchanges(list(apply_changes(tree, [first]))) if c[0] != norm(first[1])
    )
    p = Proposal("demo", 1, (first, second), {}, namespace=NS)

    def first_step_saved(patch: dict[str, Any]) -> bool:
        plan = patch.get("status", {}).get("plan") or {}
        steps = plan.get("steps") or []
        return bool(plan.get("done") == 1 and steps and steps[0]["kind"] == "exchange")

    gate = cluster.emulator.gate = Gate(first_step_saved)
    name = await file(cluster, p)
    await asyncio.wait_for(gate.reached.wait(), 20)
    await cluster.stop_operator()  # dies between step 1 and step 2
    gate.opened.set()
    saved = await get_proposal(cluster, name)
    assert saved["status"]["phase"] == "Applying" and saved["status"]["plan"]["done"] == 1

    cluster.start_operator()
    await reaches(cluster, name, "Applied", within=30)
    assert await live_links(cluster, "demo") == set(apply_changes(tree, p.changes))
    await until(lambda: about(cluster.emulator, name, "Applied"), 10, "the Applied Event")
    assert about(cluster.emulator, name, "PlanResumed")
    # Step 1 was not run again (Events are best effort: the first operator's may be lost).
    started = [m.split(":")[0] for m in about(cluster.emulator, name, "StepStarted")]
    assert started.count("step 1/2") <= 1 and started.count("step 2/2") == 1, started
