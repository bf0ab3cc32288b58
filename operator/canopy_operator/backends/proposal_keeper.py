"""TopologyProposals: the operator's side of a proposal's life. The model
(:func:`~canopy_operator.model.proposals.lifecycle`) decides; :class:`ProposalKeeper` writes the
decision into the proposal's status and applies an approved one with the planner and the shared
executor, holding its overlay's lock.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from canopy_operator.backends.k8s import KubernetesBackend, closed, live_tree
from canopy_operator.backends.kube import PROPOSALS, KubeApi, overlay_path, proposal_path
from canopy_operator.backends.reconciler import (
    STEPS,
    OperatorConfig,
    Reconciler,
    now,
    post_event,
    set_condition,
)
from canopy_operator.executor import Executor, StepError
from canopy_operator.model.phases import ConditionType, OverlayPhase, ProposalPhase
from canopy_operator.model.planner import (
    Plan,
    plan,
    plan_status,
    steps_from_json,
)
from canopy_operator.model.proposals import (
    TERMINAL_PHASES,
    Decision,
    apply_changes,
    from_manifest,
    lifecycle,
)
from canopy_operator.model.restore import (
    reported_links,
)
from canopy_operator.model.topology import OverlaySpec

log = logging.getLogger("canopy.operator")


class ProposalKeeper:
    """One pass over one TopologyProposal: :func:`~canopy_operator.model.proposals.lifecycle`
    decides,
    this writes the decision into the proposal's status (conditions, an Event per transition)
    and, for an approved proposal of a managed-links overlay, applies it with the planner and
    the shared executor, holding the overlay's lock. Writes only the proposal's status and,
    around an apply, the overlay's."""

    def __init__(self, config: OperatorConfig, api: KubeApi, namespace: str, name: str) -> None:
        self.config, self.api, self.namespace, self.name = config, api, namespace, name
        self.obj: dict[str, Any] = {}

    @property
    def path(self) -> str:
        return proposal_path(self.namespace, self.name)

    @property
    def overlay(self) -> str:
        name = (self.obj.get("spec") or {}).get("overlay")
        return name if isinstance(name, str) else ""

    async def load(self) -> bool:
        obj = await self.api.get(self.path)
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            return False
        self.obj = obj
        return True

    async def load_overlay(self) -> dict[str, Any] | None:
        if not self.overlay:
            return None
        obj = await self.api.get(overlay_path(self.namespace, self.overlay))
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            return None
        return obj

    async def status(self, **fields: Any) -> None:
        await self.api.patch(self.path + "/status", {"status": fields})
        self.obj["status"] = {**(self.obj.get("status") or {}), **fields}

    async def record(self, d: Decision, **extra: Any) -> None:
        """Write ``d`` if it changes anything; an Event when the phase changes."""
        status = self.obj.get("status") or {}
        old = status.get("phase")
        patch_changed = d.patch is not None and d.patch != status.get("patch")
        if (
            d.phase == old
            and d.message == status.get("message")
            and not patch_changed
            and not extra
        ):
            return
        conditions = list(status.get("conditions") or [])
        was: dict[str, Any] = next(
            (c for c in conditions if c.get("type") == ConditionType.APPROVED), {}
        )
        if d.approved is not None and was.get("status") != str(d.approved):
            why = (
                d.reason if d.approved or d.phase == ProposalPhase.REJECTED else "AwaitingApproval"
            )
            conditions = set_condition(
                conditions, ConditionType.APPROVED, d.approved, why, d.message
            )
        applied_reason = (
            d.reason
            if d.phase in (ProposalPhase.APPLIED, ProposalPhase.STALE, ProposalPhase.FAILED)
            else d.phase
        )
        conditions = set_condition(
            conditions,
            ConditionType.APPLIED,
            d.phase == ProposalPhase.APPLIED,
            applied_reason,
            d.message,
        )
        fields: dict[str, Any] = {
            "phase": d.phase,
            "message": d.message,
            "observedGeneration": int((self.obj.get("metadata") or {}).get("generation") or 1),
            "conditions": conditions,
            **extra,
        }
        if d.patch is not None:
            fields["patch"] = dict(d.patch)
        await self.status(**fields)
        if d.phase != old:
            post_event(
                self.obj,
                d.phase,
                d.message,
                warning=d.phase in (ProposalPhase.STALE, ProposalPhase.FAILED),
            )

    async def run(self) -> bool:
        """One pass; True if the overlay's live links changed (other proposals may not fit)."""
        if not await self.load():
            return False
        decision = lifecycle(self.obj, await self.load_overlay())
        await self.record(decision)
        if decision.action != "apply":
            return False
        async with self.config.lock(self.namespace, self.overlay):
            return await self._apply()

    async def _apply(self) -> bool:
        """Apply (or resume applying) this proposal to its managed-links overlay; the caller
        holds the overlay's lock, so no reconcile of the overlay runs meanwhile."""
        if not await self.load():
            return False
        r = Reconciler(self.config, self.api, self.namespace, self.overlay)
        if not await r.load():
            await self.record(lifecycle(self.obj, None))
            return False
        spec, problems = r.parse()
        if spec is None or problems:
            await self.record(
                Decision(
                    ProposalPhase.FAILED, "InvalidOverlay", f"overlay {self.overlay} is invalid"
                )
            )
            return False
        status = self.obj.get("status") or {}
        saved = status.get("plan") or {}
        p = from_manifest(self.obj)
        backend = r.backend(spec, await r.ensure_objects(spec))
        try:
            if status.get("phase") == ProposalPhase.APPLYING and saved.get("steps"):
                the_plan = Plan(steps_from_json(saved["steps"]), ())
                completed = [i for i, s in enumerate(saved["steps"]) if s.get("done")]
                post_event(
                    self.obj,
                    "PlanResumed",
                    f"resuming: {len(completed)}/{len(the_plan.steps)} steps were done",
                )
            else:
                live = live_tree(await backend.neighbours(spec.broker_names), spec.broker_names)
                decision = lifecycle(self.obj, r.obj, live_links=live.links)
                if decision.action != "apply":
                    await self.record(decision)
                    return False
                desired = dataclasses.replace(spec, links=apply_changes(live.links, p.changes))
                the_plan = plan(live, desired)
                completed = []
                n = len(the_plan.steps)
                await self.record(
                    Decision(
                        ProposalPhase.APPLYING, "Applying", f"applying {n} steps to {self.overlay}"
                    ),
                    plan=plan_status(p.generation, the_plan, []),
                )
            r.condition(
                ConditionType.RECONFIGURING,
                True,
                "ProposalApplying",
                f"applying proposal {self.name}",
            )
            await r.status(phase=OverlayPhase.RECONFIGURING)
            r.event("ProposalApplying", f"applying proposal {self.name}")
            await self._execute(
                r=r,
                spec=spec,
                backend=backend,
                generation=p.generation,
                the_plan=the_plan,
                completed=completed,
            )
        finally:
            await closed(backend)
        return True

    async def _execute(
        self,
        *,
        r: Reconciler,
        spec: OverlaySpec,
        backend: KubernetesBackend,
        generation: int,
        the_plan: Plan,
        completed: list[int],
    ) -> None:
        started = time.perf_counter()
        uid = str((self.obj.get("metadata") or {}).get("uid") or "")[:8]
        executor = Executor(
            backend,
            _ProposalStore(self, the_plan),
            f"{self.name}-{uid}",  # exchange ids unique to this proposal object
            ordering=spec.ordering,
            lease=spec.lease_seconds,
            on_event=lambda reason, message: post_event(self.obj, reason, message),
            on_degraded=r._on_degraded,
        )
        failure: StepError | None = None
        try:
            await executor.run(
                the_plan, generation, {"generation": generation, "completed": completed}
            )
        except StepError as exc:
            STEPS.labels(exc.step.kind, "failed").inc()
            failure = exc
        # Every step leaves a tree: what the brokers hold now is the overlay's live tree.
        live_now = await backend.neighbours(spec.broker_names)
        links = sorted(reported_links(live_now))
        seconds = round(time.perf_counter() - started, 3)
        r.condition(ConditionType.RECONFIGURING, False, "Idle")
        fields: dict[str, Any] = {
            "phase": OverlayPhase.READY,
            "linkCount": len(links),
            "links": [list(e) for e in links],
        }
        if failure is None:
            fields["lastReconfiguration"] = {
                "generation": generation,
                "proposal": self.name,
                "steps": len(the_plan.steps),
                "exchanges": len(the_plan.exchanges),
                "seconds": seconds,
                "finished": now(),
            }
        await r.status(**fields)
        if failure is not None:
            await self.record(Decision(ProposalPhase.FAILED, "StepFailed", str(failure)))
            r.event("ProposalFailed", f"proposal {self.name}: {failure}", warning=True)
            return
        message = f"applied {len(the_plan.exchanges)} exchanges to {self.overlay} in {seconds}s"
        await self.record(
            Decision(ProposalPhase.APPLIED, "Applied", message, approved=True),
            plan=plan_status(generation, the_plan, range(len(the_plan.steps))),
        )
        r.event("ProposalApplied", f"proposal {self.name}: {message}")


class _ProposalStore:
    """The executor's progress, as the proposal's ``status.plan``."""

    def __init__(self, keeper: ProposalKeeper, the_plan: Plan) -> None:
        self.keeper, self.plan = keeper, the_plan

    async def save(self, progress: dict[str, Any]) -> None:
        await self.keeper.status(
            plan=plan_status(progress["generation"], self.plan, progress["completed"])
        )


async def keep_proposal(config: OperatorConfig, api: KubeApi, namespace: str, name: str) -> None:
    """Move one proposal along its lifecycle (one pass at a time per proposal)."""
    keeper = ProposalKeeper(config, api, namespace, name)
    async with config.lock(namespace, f"{PROPOSALS}/{name}"):
        changed = await keeper.run()
    if changed:  # the live tree moved: the overlay's other open proposals may no longer fit
        await recheck_proposals(config, api, namespace, keeper.overlay)


async def recheck_proposals(
    config: OperatorConfig, api: KubeApi, namespace: str, overlay: str
) -> None:
    """The overlay changed (or went): every open proposal for it is looked at again, so Stale,
    Applied (GitOps merged it) and waiting approvals are noticed at once. A proposal that
    cannot be handled now is logged; its own handler retries it."""
    for obj in await api.items(proposal_path(namespace)):
        phase = (obj.get("status") or {}).get("phase")
        if (obj.get("spec") or {}).get("overlay") != overlay or phase in TERMINAL_PHASES:
            continue
        name = str(obj["metadata"]["name"])
        try:
            await keep_proposal(config, api, namespace, name)
        except Exception:
            log.exception(
                "proposal %s/%s: re-check after overlay %s changed", namespace, name, overlay
            )
