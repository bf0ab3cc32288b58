"""docs/gitops.md's Argo CD health checks, run for real: each Lua script is taken out of the
documented `argocd-cm` ConfigMap exactly as a user pastes it and executed the way Argo CD does
(Lua 5.1 like gopher-lua, a fresh state per evaluation with only the libraries Argo CD opens for
custom checks, the object as the global `obj`, the returned table's `status` and `message`).

The cases are the statuses the operator writes (canopy_operator.backends.reconciler and
proposal_keeper), one table per kind; every phase of the CRDs' enums must have a case, so a
new phase fails here until the health check (and this table) handle it. A broken script must
fail the same table."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa import lua51

ROOT = Path(__file__).resolve().parents[2]
GITOPS = ROOT / "docs" / "gitops.md"
CRDS = ROOT / "manifests" / "crds"
KEY = "resource.customizations.health."
# gitops-engine's health codes; Argo CD turns anything else into Unknown.
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def health_scripts() -> dict[str, str]:
    """`group_Kind` -> Lua, from the argocd-cm ConfigMap in docs/gitops.md's YAML blocks."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", GITOPS.read_text(), re.S | re.M)
    docs = [d for b in blocks for d in yaml.safe_load_all(b) if isinstance(d, dict)]
    (config,) = [
        d for d in docs if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == "argocd-cm"
    ]
    return {k.removeprefix(KEY): v for k, v in config["data"].items() if k.startswith(KEY)}


def crd_enum(name: str, *path: str) -> list[str]:
    crd = yaml.safe_load((CRDS / name).read_text())
    node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for key in path:
        node = node["items"] if key == "[]" else node["properties"][key]
    return list(node["enum"])


# --- Argo CD's Lua VM (util/lua/lua.go) -----------------------------------------------------


def _to_lua(lua: Any, value: Any) -> Any:
    """Like Argo CD's decodeValue: maps and lists become tables (lists 1-based), null is nil."""
    if isinstance(value, Mapping):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items() if v is not None})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


_SANDBOX = """
-- Argo CD opens only package, base, table and a "safe" os (time, date) for custom checks.
string, math, io, debug, coroutine, python = nil, nil, nil, nil, nil, nil
getmetatable("").__index = nil  -- no ("x"):find(...) without the string library
os = {time = os.time, date = os.date}
"""


def evaluate(script: str, obj: Mapping[str, Any]) -> tuple[str, str]:
    """(status, message) as Argo CD would show them; raises lupa.LuaError like Argo CD errs."""
    lua = lua51.LuaRuntime(register_eval=False, register_builtins=False)
    lua.execute(_SANDBOX)
    lua.globals().obj = _to_lua(lua, obj)
    result = lua.execute(script)
    if lua.eval("type")(result) != "table":
        raise TypeError(f"expect table output from Lua script, not {lua.eval('type')(result)}")
    status, message = result["status"], result["message"]
    if status not in ARGO_STATUSES:
        return "Unknown", "Lua returned an invalid health status"
    return status, message if message is not None else ""


@dataclass(frozen=True)
class Case:
    name: str
    obj: dict[str, Any]
    status: str
    message: str

    def __str__(self) -> str:
        return self.name


def mismatches(script: str, cases: Sequence[Case]) -> list[str]:
    """Every case whose (status, message) the script gets wrong, or fails on."""
    out = []
    for case in cases:
        try:
            got: tuple[str, str] | str = evaluate(script, case.obj)
        except Exception as exc:  # a Lua error is what Argo CD would show: not the expectation
            got = f"{type(exc).__name__}: {exc}"
        if got != (case.status, case.message):
            out.append(f"{case.name}: expected {(case.status, case.message)}, got {got}")
    return out


# --- BrokerOverlay: the statuses canopy_operator.backends.reconciler.Reconciler writes ---


def cond(ctype: str, status: bool | str, reason: str = "", message: str = "") -> dict[str, Any]:
    value = status if isinstance(status, str) else str(status)
    return {
        "type": ctype,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2025-01-01T00:00:00Z",
    }


def overlay(status: dict[str, Any] | None, generation: int = 2) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "canopy.dev/v1alpha1",
        "kind": "BrokerOverlay",
        "metadata": {"name": "trading", "namespace": "trading", "generation": generation},
        "spec": {"brokers": [{"name": "a"}, {"name": "b"}, {"name": "c"}]},
    }
    if status is not None:
        obj["status"] = status
    return obj


def plan(generation: int, done: int, total: int) -> dict[str, Any]:
    return {"generation": generation, "steps": [], "done": done, "progress": f"{done}/{total}"}


VALID = cond("Valid", True, "SpecValid", "the spec describes a valid tree")
CONVERGED = [
    VALID,
    cond("Ready", True, "Converged", "3 brokers, 2 links"),
    cond("Reconfiguring", False, "Idle"),
    cond("Degraded", False, "AllBrokersReachable"),
]
READY = {
    "phase": "Ready",
    "observedGeneration": 2,
    "brokersReady": "3/3",
    "linkCount": 2,
    "links": [["a", "b"], ["b", "c"]],
    "plan": plan(2, 4, 4),
    "conditions": CONVERGED,
}
UNREACHABLE = "broker c unreachable: connection refused"
STEP_FAILED = "step 2 (exchange a-b for a-c) failed: timed out"

OVERLAY_CASES = [
    Case("no status yet", overlay(None), "Progressing", "waiting for the operator"),
    Case(
        "status without observedGeneration",
        overlay({"phase": "Pending"}),
        "Progressing",
        "the operator has not reconciled generation 2 yet",
    ),
    Case(
        "Pending at the current generation",
        overlay({"phase": "Pending", "observedGeneration": 2}),
        "Progressing",
        "Pending",
    ),
    Case(
        "Creating (pods starting)",
        overlay({"phase": "Creating", "observedGeneration": 2, "conditions": [VALID]}),
        "Progressing",
        "Creating",
    ),
    Case(
        "Reconfiguring the first generation, with the plan's progress",
        overlay(
            {
                "phase": "Reconfiguring",
                "observedGeneration": 2,
                "plan": plan(2, 1, 3),
                "conditions": [VALID, cond("Reconfiguring", True, "PlanRunning", "3 steps")],
            }
        ),
        "Progressing",
        "Reconfiguring: step 1/3",
    ),
    Case(
        # The operator records observedGeneration only when it reaches Ready: while it moves
        # the overlay to an edited spec, status.plan is what says it is on the new generation.
        "Reconfiguring to an edited spec (observedGeneration still the old one)",
        overlay(
            {
                **READY,
                "phase": "Reconfiguring",
                "observedGeneration": 1,
                "plan": plan(2, 2, 5),
                "conditions": [*CONVERGED[:2], cond("Reconfiguring", True, "PlanRunning")],
            }
        ),
        "Progressing",
        "Reconfiguring: step 2/5",
    ),
    Case(
        "Reconfiguring for an approved proposal (managed links)",
        overlay(
            {
                **READY,
                "phase": "Reconfiguring",
                "conditions": [
                    *CONVERGED[:2],
                    cond("Reconfiguring", True, "ProposalApplying", "applying proposal p-1"),
                    CONVERGED[3],
                ],
            }
        ),
        "Progressing",
        "Reconfiguring: step 4/4",
    ),
    Case("Ready at its generation", overlay(READY), "Healthy", "3/3 brokers ready, 2 links"),
    Case(
        "Ready without a plan or counts",
        overlay({"phase": "Ready", "observedGeneration": 2, "conditions": CONVERGED}),
        "Healthy",
        "? brokers ready, 0 links",
    ),
    Case(
        "Ready, but for an older generation (spec edited, not yet seen)",
        overlay(READY, generation=3),
        "Progressing",
        "the operator has not reconciled generation 3 yet",
    ),
    Case(
        "phase Ready while the Ready condition is False",
        overlay({**READY, "conditions": [VALID, cond("Ready", False, "StepFailed")]}),
        "Progressing",
        "Ready: step 4/4",
    ),
    Case(
        "phase Ready while the Ready condition is Unknown",
        overlay({**READY, "conditions": [VALID, cond("Ready", "Unknown", "")]}),
        "Progressing",
        "Ready: step 4/4",
    ),
    Case(
        "phase Ready while Reconfiguring=True",
        overlay({**READY, "conditions": [*CONVERGED[:2], cond("Reconfiguring", True, "X")]}),
        "Progressing",
        "Ready: step 4/4",
    ),
    Case(
        "Degraded: brokers not ready at creation",
        overlay(
            {
                "phase": "Degraded",
                "observedGeneration": 2,
                "conditions": [
                    VALID,
                    cond("Ready", False, "BrokersNotReady", "c not ready within 120s"),
                    cond("Degraded", True, "BrokersNotReady", "c not ready within 120s"),
                ],
            }
        ),
        "Degraded",
        "c not ready within 120s",
    ),
    Case(
        # A step fails while the overlay moves to an edited spec: observedGeneration is still
        # the old one, and the fault must not hide behind "not reconciled yet" (Progressing).
        "Degraded: a step failed while reconfiguring to an edited spec",
        overlay(
            {
                **READY,
                "phase": "Degraded",
                "observedGeneration": 1,
                "plan": plan(2, 1, 5),
                "conditions": [
                    VALID,
                    cond("Ready", False, "StepFailed", STEP_FAILED),
                    cond("Reconfiguring", True, "PlanRunning", "5 steps"),
                    cond("Degraded", True, "StepFailed", STEP_FAILED),
                ],
            }
        ),
        "Degraded",
        STEP_FAILED,
    ),
    Case(
        "Degraded: a new broker never got ready (edited spec, no plan yet)",
        overlay(
            {
                **READY,
                "phase": "Degraded",
                "observedGeneration": 1,
                "plan": plan(1, 4, 4),
                "conditions": [
                    VALID,
                    cond("Ready", False, "BrokersNotReady", "d not ready within 120s"),
                    cond("Degraded", True, "BrokersNotReady", "d not ready within 120s"),
                ],
            }
        ),
        "Degraded",
        "d not ready within 120s",
    ),
    Case(
        "Degraded condition while phase Ready (a broker became unreachable)",
        overlay(
            {
                **READY,
                "conditions": [
                    *CONVERGED[:3],
                    cond("Degraded", True, "BrokerUnreachable", UNREACHABLE),
                ],
            }
        ),
        "Degraded",
        UNREACHABLE,
    ),
    Case(
        "phase Degraded without a condition",
        overlay({"phase": "Degraded", "observedGeneration": 2}),
        "Degraded",
        "degraded",
    ),
    Case(
        "Invalid spec (Valid=False)",
        overlay(
            {
                "phase": "Invalid",
                "observedGeneration": 2,
                "conditions": [
                    cond("Valid", False, "InvalidSpec", "links may only name declared brokers")
                ],
            }
        ),
        "Degraded",
        "links may only name declared brokers",
    ),
    Case(
        "phase Invalid without a condition",
        overlay({"phase": "Invalid", "observedGeneration": 2}),
        "Degraded",
        "invalid spec",
    ),
    Case(
        "Valid=False whatever the phase",
        overlay({**READY, "conditions": [cond("Valid", False, "InvalidSpec", "bad tree")]}),
        "Degraded",
        "bad tree",
    ),
    Case(
        "Invalid, but the spec was edited since (the fix is not yet seen)",
        overlay(
            {
                "phase": "Invalid",
                "observedGeneration": 2,
                "conditions": [cond("Valid", False, "InvalidSpec", "bad tree")],
            },
            generation=3,
        ),
        "Progressing",
        "the operator has not reconciled generation 3 yet",
    ),
    Case(
        "Deleting",
        overlay({**READY, "phase": "Deleting", "conditions": [VALID]}),
        "Progressing",
        "Deleting: step 4/4",
    ),
    Case(
        "no generation in metadata (not from the API server)",
        {**overlay(READY), "metadata": {"name": "trading"}},
        "Healthy",
        "3/3 brokers ready, 2 links",
    ),
]


# --- TopologyProposal: the statuses canopy_operator.model.proposals decides ----------------------


def proposal(phase: str | None, message: str | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "canopy.dev/v1alpha1",
        "kind": "TopologyProposal",
        "metadata": {"name": "trading-1", "namespace": "trading", "generation": 1},
        "spec": {"overlay": "trading", "overlayGeneration": 2, "changes": []},
    }
    if phase is not None or message is not None:
        obj["status"] = {"phase": phase, "message": message, "observedGeneration": 1}
    return obj


WAITING = "proposed; approve with canopy.dev/approve=true"
PROPOSAL_CASES = [
    Case("no status yet", proposal(None), "Suspended", WAITING),
    Case("status without a phase", proposal(None, "filed"), "Suspended", WAITING),
    Case(
        "Proposed",
        proposal("Proposed", "awaiting approval"),
        "Suspended",
        "Proposed: awaiting approval",
    ),
    Case(
        "Approved, explicit links (waiting for the pull request)",
        proposal("Approved", "approved; export it: canopy proposal export trading-1"),
        "Suspended",
        "Approved: approved; export it: canopy proposal export trading-1",
    ),
    Case("Applying", proposal("Applying", "step 2/4"), "Progressing", "Applying: step 2/4"),
    Case(
        "Applied",
        proposal("Applied", "applied at generation 3"),
        "Healthy",
        "Applied: applied at generation 3",
    ),
    Case("Applied without a message", proposal("Applied"), "Healthy", "Applied"),
    Case(
        "Rejected (closed)",
        proposal("Rejected", "rejected by annotation"),
        "Healthy",
        "Rejected: rejected by annotation",
    ),
    Case(
        "Stale (closed)",
        proposal("Stale", "overlay trading moved on to generation 4"),
        "Healthy",
        "Stale: overlay trading moved on to generation 4",
    ),
    Case(
        "Failed",
        proposal("Failed", "malformed proposal: no changes"),
        "Degraded",
        "Failed: malformed proposal: no changes",
    ),
]


def application(health: dict[str, Any] | None) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Application"}
    obj["metadata"] = {"name": "canopy", "namespace": "argocd"}
    if health is not None:
        obj["status"] = {"health": health}
    return obj


APPLICATION_CASES = [
    Case("no status yet", application(None), "Progressing", ""),
    Case("Healthy", application({"status": "Healthy"}), "Healthy", ""),
    Case("Progressing", application({"status": "Progressing"}), "Progressing", ""),
    Case(
        "Degraded with a message",
        application({"status": "Degraded", "message": "operator crash-looping"}),
        "Degraded",
        "operator crash-looping",
    ),
]

CASES: dict[str, list[Case]] = {
    "canopy.dev_BrokerOverlay": OVERLAY_CASES,
    "canopy.dev_TopologyProposal": PROPOSAL_CASES,
    "argoproj.io_Application": APPLICATION_CASES,
}


def test_the_doc_has_exactly_the_checks_this_table_covers() -> None:
    assert set(health_scripts()) == set(CASES)


@pytest.mark.parametrize(("kind", "case"), [(k, c) for k, cs in CASES.items() for c in cs], ids=str)
def test_the_documented_health_check(kind: str, case: Case) -> None:
    assert case.status in ARGO_STATUSES
    assert mismatches(health_scripts()[kind], [case]) == []


def phases_of(cases: Sequence[Case]) -> set[str]:
    return {c.obj["status"]["phase"] for c in cases if (c.obj.get("status") or {}).get("phase")}


def test_every_overlay_phase_and_condition_has_a_case() -> None:
    phases = crd_enum("brokeroverlays.canopy.dev.yaml", "status", "phase")
    assert set(phases) <= phases_of(OVERLAY_CASES), set(phases) - phases_of(OVERLAY_CASES)
    conditions = crd_enum("brokeroverlays.canopy.dev.yaml", "status", "conditions", "[]", "type")
    for ctype in conditions:
        for value in ("True", "False"):
            assert any(
                {"type": ctype, "status": value}.items() <= c.items()
                for case in OVERLAY_CASES
                for c in (case.obj.get("status") or {}).get("conditions", [])
            ), f"no case with {ctype}={value}"
    assert {c.status for c in OVERLAY_CASES} == {"Healthy", "Progressing", "Degraded"}


def test_every_proposal_phase_has_a_case() -> None:
    phases = crd_enum("topologyproposals.canopy.dev.yaml", "status", "phase")
    assert set(phases) <= phases_of(PROPOSAL_CASES), set(phases) - phases_of(PROPOSAL_CASES)
    assert phases_of(PROPOSAL_CASES) <= set(phases)  # no case for a phase the CRD rejects


def test_the_cases_fit_the_crd_status_schema() -> None:
    """The case objects' status enums are the CRDs' (a typo in a case would test nothing)."""
    overlay_phases = set(crd_enum("brokeroverlays.canopy.dev.yaml", "status", "phase"))
    assert phases_of(OVERLAY_CASES) <= overlay_phases
    types = set(crd_enum("brokeroverlays.canopy.dev.yaml", "status", "conditions", "[]", "type"))
    values = set(crd_enum("brokeroverlays.canopy.dev.yaml", "status", "conditions", "[]", "status"))
    for case in OVERLAY_CASES:
        for c in (case.obj.get("status") or {}).get("conditions", []):
            assert c["type"] in types and c["status"] in values, (case.name, c)


ALWAYS_HEALTHY = 'return {status = "Healthy", message = ""}'


def mutants() -> list[tuple[str, str, str]]:
    """(kind, name, script): the documented checks with one deliberate fault each."""
    scripts = health_scripts()
    out = [(kind, "always Healthy", ALWAYS_HEALTHY) for kind in CASES]
    for kind, name, old, new in [
        ("canopy.dev_TopologyProposal", "Failed not Degraded", '"Failed"', '"Failing"'),
        ("canopy.dev_BrokerOverlay", "no nil guard", "if obj.status == nil", "if false"),
        ("canopy.dev_BrokerOverlay", "ignores Reconfiguring", '"Reconfiguring")', '"X")'),
    ]:
        assert old in scripts[kind], (kind, old)
        out.append((kind, name, scripts[kind].replace(old, new, 1)))
    return out


@pytest.mark.parametrize(
    ("kind", "name", "script"), [pytest.param(*m, id=f"{m[0]}: {m[1]}") for m in mutants()]
)
def test_a_broken_check_fails_the_same_table(kind: str, name: str, script: str) -> None:
    """Negative control: the checker tells a wrong health check from the documented one."""
    assert mismatches(script, CASES[kind]), f"{kind}: the mutant '{name}' passed every case"
