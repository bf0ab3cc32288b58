"""TopologyProposals: the model the miner files and the operator acts on. Pure: no I/O, no clock.

A proposal is a sequence of link exchanges for one overlay, computed against one generation of
it, with the evidence that made the miner propose it. This module turns proposals into
``TopologyProposal`` objects and back, applies their changes to a tree (every step must leave a
tree), exports the ``BrokerOverlay`` manifest with a proposal applied (for a GitOps pull
request), finds open duplicates and old proposals to prune, and decides — :func:`lifecycle` —
what the operator does with a proposal next. The operator's Kubernetes face
(:mod:`canopy_operator.backends.proposal_keeper`) is the thin effectful shell around that decision;
docs/proposals.md
describes the lifecycle.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from canopy_operator.model.phases import (
    OPEN_PROPOSAL_PHASES,
    TERMINAL_PROPOSAL_PHASES,
    OverlayPhase,
    ProposalPhase,
)
from canopy_operator.model.topology import Edge, adjacency, norm, tree_path

__all__ = [
    "ANNOTATION_APPROVE",
    "ANNOTATION_REJECT",
    "BOOKKEEPING_PREFIX",
    "EVIDENCE_KEYS",
    "LABEL_OVERLAY",
    "OPEN_PHASES",
    "TERMINAL_PHASES",
    "Change",
    "Decision",
    "Proposal",
    "ProposalError",
    "apply_changes",
    "exported_overlay",
    "from_manifest",
    "lifecycle",
    "open_duplicates",
    "proposal_name",
    "to_manifest",
    "to_prune",
]

API_VERSION = "canopy.dev/v1alpha1"
KIND = "TopologyProposal"
LABEL_OVERLAY = "canopy.dev/overlay"
ANNOTATION_APPROVE = "canopy.dev/approve"
ANNOTATION_REJECT = "canopy.dev/reject"
# Where the operator's framework (kopf) keeps its bookkeeping annotations. Not ``canopy.dev``
# itself: kopf ignores every annotation under its own prefix when it looks for changes, and the
# approval annotations must be seen.
BOOKKEEPING_PREFIX = "operator.canopy.dev"
EVIDENCE_KEYS = (
    "associativityBefore",
    "associativityAfter",
    "hopsPerEventBefore",
    "hopsPerEventAfter",
    "pureForwarderRateBefore",
    "pureForwarderRateAfter",
    "expectedGain",
)

Phase = ProposalPhase
OPEN_PHASES = OPEN_PROPOSAL_PHASES
TERMINAL_PHASES = TERMINAL_PROPOSAL_PHASES

Change = tuple[Edge, Edge]  # (link to remove, link to add)


class ProposalError(ValueError):
    """A proposal that is malformed, or whose changes do not fit an overlay; the message names
    the problem."""


@dataclass(frozen=True)
class Proposal:
    overlay: str
    generation: int
    changes: tuple[Change, ...]
    evidence: Mapping[str, float | str] = field(default_factory=dict)
    namespace: str | None = None
    name: str | None = None  # default: proposal_name(overlay, changes)

    def __post_init__(self) -> None:
        changes = tuple((_pair(r), _pair(a)) for r, a in self.changes)
        object.__setattr__(self, "changes", changes)
        if self.name is None:
            object.__setattr__(self, "name", proposal_name(self.overlay, changes))

    @property
    def resource_name(self) -> str:
        """The object's name (``name``, which ``__post_init__`` always fills in)."""
        return self.name or proposal_name(self.overlay, self.changes)


def _pair(e: Sequence[str]) -> Edge:
    return (e[0], e[1])


def _normalised(changes: Iterable[Change]) -> list[list[list[str]]]:
    return [[list(norm(r)), list(norm(a))] for r, a in changes]


def proposal_name(overlay: str, changes: Sequence[Change]) -> str:
    """``<overlay>-<10 hex digits>``: a hash of the overlay and its normalised changes (the order
    of a link's ends does not count; the order of the changes does). The same proposal always
    gets the same name, so filing it twice is a conflict, not a duplicate."""
    digest = hashlib.sha256(
        json.dumps([overlay, _normalised(changes)], separators=(",", ":")).encode()
    ).hexdigest()[:10]
    return f"{overlay[: 253 - 11]}-{digest}"


def to_manifest(p: Proposal) -> dict[str, Any]:
    """The ``TopologyProposal`` object of ``p`` (labelled with its overlay)."""
    metadata: dict[str, Any] = {"name": p.resource_name, "labels": {LABEL_OVERLAY: p.overlay}}
    if p.namespace:
        metadata["namespace"] = p.namespace
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "overlay": p.overlay,
            "generation": p.generation,
            "changes": [{"remove": list(r), "add": list(a)} for r, a in p.changes],
            "evidence": dict(p.evidence),
        },
    }


def _link(value: Any, where: str) -> Edge:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(x, str) and x for x in value)
    ):
        raise ProposalError(f"{where} must be a pair of broker names, got {value!r}")
    if value[0] == value[1]:
        raise ProposalError(f"{where} links broker {value[0]} to itself")
    return (value[0], value[1])


def from_manifest(obj: Mapping[str, Any]) -> Proposal:
    """Read a ``TopologyProposal`` object; :class:`ProposalError` names the first malformed
    field."""
    if not isinstance(obj, Mapping):
        raise ProposalError("a TopologyProposal must be a mapping")
    if obj.get("kind", KIND) != KIND:
        raise ProposalError(f"kind must be {KIND}, got {obj.get('kind')!r}")
    meta = obj.get("metadata") or {}
    if not isinstance(meta, Mapping):
        raise ProposalError("metadata must be a mapping")
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise ProposalError("spec is required and must be a mapping")
    overlay = spec.get("overlay")
    if not isinstance(overlay, str) or not overlay:
        raise ProposalError(f"spec.overlay must be an overlay's name, got {overlay!r}")
    generation = spec.get("generation")
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise ProposalError(f"spec.generation must be an integer >= 0, got {generation!r}")
    raw = spec.get("changes")
    if not isinstance(raw, list) or not raw:
        raise ProposalError("spec.changes must be a non-empty list of {remove, add}")
    changes = []
    for i, c in enumerate(raw):
        where = f"spec.changes[{i}]"
        if not isinstance(c, Mapping):
            raise ProposalError(f"{where} must be a mapping with remove and add")
        changes.append(
            (_link(c.get("remove"), f"{where}.remove"), _link(c.get("add"), f"{where}.add"))
        )
    evidence = spec.get("evidence")
    evidence = {} if evidence is None else evidence
    if not isinstance(evidence, Mapping):
        raise ProposalError("spec.evidence must be a mapping")
    for key, value in evidence.items():
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ProposalError(f"spec.evidence.{key} must be a number or a string, got {value!r}")
    name = meta.get("name")
    namespace = meta.get("namespace")
    return Proposal(
        overlay=overlay,
        generation=generation,
        changes=tuple(changes),
        evidence=dict(evidence),
        namespace=namespace if isinstance(namespace, str) and namespace else None,
        name=name if isinstance(name, str) and name else None,
    )


def apply_changes(links: Iterable[Edge], changes: Sequence[Change]) -> tuple[Edge, ...]:
    """The tree's links after ``changes``, in order (sorted, normalised). Every change must
    remove a link that is there and add one that reconnects the two parts: a :class:`ProposalError`
    says which change does not, and why."""
    edges = {norm(e) for e in links}
    for i, (remove, add) in enumerate(changes, 1):
        r, a = norm(remove), norm(add)
        step = f"change {i} (remove {r[0]}-{r[1]}, add {a[0]}-{a[1]})"
        if r not in edges:
            raise ProposalError(f"{step}: link {r[0]}-{r[1]} is not in the overlay")
        if a[0] == a[1]:
            raise ProposalError(f"{step}: a link joins two different brokers")
        if a in edges:
            raise ProposalError(f"{step}: link {a[0]}-{a[1]} is there already")
        adj = adjacency(edges)
        unknown = [b for b in a if b not in adj]
        if unknown:
            raise ProposalError(f"{step}: broker {', '.join(unknown)} is not in the overlay")
        try:
            path = tree_path(adj, a[0], a[1])
        except ValueError as exc:  # the links given were not one tree to begin with
            raise ProposalError(f"{step}: the overlay's links are not a tree: {exc}") from None
        if r not in {norm(e) for e in itertools.pairwise(path)}:
            raise ProposalError(
                f"{step}: would not leave a tree: {r[0]}-{r[1]} is not on the path "
                f"{' - '.join(path)} that {a[0]}-{a[1]} closes into a cycle"
            )
        edges = (edges - {r}) | {a}
    return tuple(sorted(edges))


def _links_of(spec: Mapping[str, Any]) -> list[Edge] | None:
    raw = spec.get("links")
    if raw is None:
        return None
    return [_link(e, f"spec.links[{i}]") for i, e in enumerate(raw)]


def _overlay_name(overlay: Mapping[str, Any]) -> str:
    return str((overlay.get("metadata") or {}).get("name") or "")


def exported_overlay(overlay_manifest: Mapping[str, Any], p: Proposal) -> dict[str, Any]:
    """The ``BrokerOverlay`` manifest with ``p`` applied to its declared links — what a GitOps
    pull request commits. Each removed link is replaced in place by its added one (a small
    diff); server-side fields (status, uid, resourceVersion, managedFields, the operator's
    bookkeeping annotations...) are left out. Only explicit-links overlays can be exported: the
    operator applies proposals to managed-links overlays itself."""
    if overlay_manifest.get("kind", "BrokerOverlay") != "BrokerOverlay":
        raise ProposalError(f"expected a BrokerOverlay, got {overlay_manifest.get('kind')!r}")
    name = _overlay_name(overlay_manifest)
    if name != p.overlay:
        raise ProposalError(
            f"proposal {p.resource_name} is for overlay {p.overlay!r}, not {name or '(unnamed)'!r}"
        )
    spec = overlay_manifest.get("spec")
    if not isinstance(spec, Mapping):
        raise ProposalError(f"overlay {name} has no spec")
    try:
        declared = _links_of(spec)
    except ProposalError as exc:
        raise ProposalError(f"overlay {name}: {exc}") from None
    if declared is None:
        raise ProposalError(
            f"overlay {name} has managed links (no spec.links): the operator applies approved "
            "proposals to it itself; there is no manifest change to export"
        )
    apply_changes(declared, p.changes)  # raises, naming the change that does not fit
    links = list(declared)
    for remove, add in p.changes:
        r = norm(remove)
        i = next(i for i, e in enumerate(links) if norm(e) == r)
        links[i] = add
    meta = overlay_manifest.get("metadata") or {}
    out_meta: dict[str, Any] = {"name": name}
    if meta.get("namespace"):
        out_meta["namespace"] = meta["namespace"]
    if meta.get("labels"):
        out_meta["labels"] = dict(meta["labels"])
    annotations = {
        k: v
        for k, v in (meta.get("annotations") or {}).items()
        if not k.startswith((f"{BOOKKEEPING_PREFIX}/", "kubectl.kubernetes.io/"))
        and k != "canopy.dev/kopf-managed"
    }
    if annotations:
        out_meta["annotations"] = annotations
    new_spec = copy.deepcopy(dict(spec))
    new_spec["links"] = [list(e) for e in links]
    return {
        "apiVersion": overlay_manifest.get("apiVersion") or API_VERSION,
        "kind": "BrokerOverlay",
        "metadata": out_meta,
        "spec": new_spec,
    }


def _phase(obj: Mapping[str, Any]) -> str | None:
    phase = (obj.get("status") or {}).get("phase")
    return str(phase) if phase else None


def _same_place(obj: Mapping[str, Any], p: Proposal) -> bool:
    ns = (obj.get("metadata") or {}).get("namespace")
    return not (ns and p.namespace and ns != p.namespace)


def open_duplicates(existing: Sequence[Mapping[str, Any]], p: Proposal) -> bool:
    """Whether an open proposal (no phase yet, Proposed, Approved or Applying) with the same
    changes for the same overlay (and namespace) is among ``existing``. Malformed objects are
    not duplicates of anything."""
    want = _normalised(p.changes)
    for obj in existing:
        if _phase(obj) not in (None, *OPEN_PHASES) or not _same_place(obj, p):
            continue
        try:
            other = from_manifest(obj)
        except ProposalError:
            continue
        if other.overlay == p.overlay and _normalised(other.changes) == want:
            return True
    return False


def to_prune(existing: Sequence[Mapping[str, Any]], history_limit: int) -> list[str]:
    """Names of terminal proposals (Applied, Rejected, Stale, Failed) beyond the newest
    ``history_limit`` of each overlay (newest by creationTimestamp, then name)."""
    if history_limit < 0:
        raise ValueError(f"history_limit must be >= 0, got {history_limit}")
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for obj in existing:
        if _phase(obj) not in TERMINAL_PHASES:
            continue
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if not name:
            continue
        overlay = str((obj.get("spec") or {}).get("overlay") or "")
        key = (str(meta.get("namespace") or ""), overlay)
        groups.setdefault(key, []).append((str(meta.get("creationTimestamp") or ""), str(name)))
    out: list[str] = []
    for key in sorted(groups):
        newest_first = sorted(groups[key], reverse=True)
        out += [name for _, name in newest_first[history_limit:]]
    return out


# -- the lifecycle decision -------------------------------------------------------------------

Action = Literal["none", "apply"]


@dataclass(frozen=True)
class Decision:
    """What to do with a proposal now. ``phase``/``reason``/``message`` are its status to be
    (reason names the transition, for the condition and the Event); ``action`` is "apply" when
    the operator should run the changes on a managed-links overlay (or resume doing so);
    ``patch`` is the exported overlay spec for ``status.patch`` (explicit-links overlays);
    ``approved`` is the Approved condition (None: leave it as it is)."""

    phase: Phase
    reason: str
    message: str
    action: Action = "none"
    patch: Mapping[str, Any] | None = None
    approved: bool | None = None


_PHASES: dict[str, Phase] = {p: p for p in (*OPEN_PHASES, *TERMINAL_PHASES)}


def _fit(spec: Mapping[str, Any], links: Iterable[Edge]) -> list[str]:
    """What the overlay's spec forbids in ``links``: undeclared brokers, fan-out."""
    declared = {str(b.get("name")) for b in spec.get("brokers") or [] if isinstance(b, Mapping)}
    f = int(spec.get("maxFanOut") or 4)
    degree: dict[str, int] = {}
    for e in links:
        for b in e:
            degree[b] = degree.get(b, 0) + 1
    problems = [f"broker {b} is not declared" for b in sorted(set(degree) - declared)]
    problems += [
        f"broker {b} would have {d} links, more than maxFanOut {f}"
        for b, d in sorted(degree.items())
        if d > f
    ]
    return problems


def _truthy(value: Any) -> bool | None:
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("true", "yes", "1"):
        return True
    if text in ("false", "no", "0"):
        return False
    return None


def lifecycle(
    proposal: Mapping[str, Any],
    overlay: Mapping[str, Any] | None,
    *,
    live_links: Iterable[Edge] | None = None,
) -> Decision:
    """The next status of ``proposal`` given its ``overlay`` (None: not found).

    ``live_links`` are the links the brokers hold (the operator passes them when it is about to
    apply, holding the overlay's lock); otherwise a managed-links overlay's ``status.links`` and an
    explicit-links overlay's ``spec.links`` stand for the live tree. In order:

    1. a terminal phase (Applied, Rejected, Stale, Failed) stays;
    2. a malformed proposal fails; Applying resumes (the plan in status is carried on);
    3. no overlay → Stale; annotation ``canopy.dev/reject=true`` or ``canopy.dev/approve=false``
       → Rejected;
    4. an explicit-links overlay whose ``spec.links`` are those of ``status.patch`` → Applied
       (GitOps merged it);
    5. the overlay's generation is not the proposal's → Stale; the changes do not fit the live
       tree (a removed link gone, not a tree, a broker over ``maxFanOut``) → Stale;
    6. not approved (annotation ``canopy.dev/approve=true``, or ``selfOrganization.mode: auto``)
       → Proposed;
    7. approved with ``mode: off`` → Approved, not applied (the message says so);
    8. approved, explicit links → Approved, with the exported spec as ``patch``;
    9. approved, managed links → "apply" once the overlay is Ready at its generation.
    """
    status = proposal.get("status") or {}
    phase = _PHASES.get(str(status.get("phase")))
    message = str(status.get("message") or "")
    if phase in TERMINAL_PHASES:
        return Decision(phase, phase, message)
    try:
        p = from_manifest(proposal)
    except ProposalError as exc:
        return Decision(ProposalPhase.FAILED, "InvalidProposal", f"malformed proposal: {exc}")
    if overlay is None:
        if phase == ProposalPhase.APPLYING:
            return Decision(
                ProposalPhase.FAILED, "OverlayNotFound", f"overlay {p.overlay} was deleted"
            )
        return Decision(
            ProposalPhase.STALE, "OverlayNotFound", f"overlay {p.overlay} does not exist"
        )
    if phase == ProposalPhase.APPLYING:
        return Decision(ProposalPhase.APPLYING, "Applying", message or "applying", "apply")
    annotations = (proposal.get("metadata") or {}).get("annotations") or {}
    approve = _truthy(annotations.get(ANNOTATION_APPROVE))
    if _truthy(annotations.get(ANNOTATION_REJECT)) or approve is False:
        how = f"{ANNOTATION_REJECT}=true" if approve is not False else f"{ANNOTATION_APPROVE}=false"
        return Decision(
            ProposalPhase.REJECTED, "Rejected", f"rejected by annotation {how}", approved=False
        )

    spec = overlay.get("spec") or {}
    meta = overlay.get("metadata") or {}
    ostatus = overlay.get("status") or {}
    generation = int(meta.get("generation") or 1)
    mode = str((spec.get("selfOrganization") or {}).get("mode") or "off")
    try:
        declared = _links_of(spec)
    except ProposalError as exc:
        return Decision(ProposalPhase.STALE, "InvalidOverlay", f"overlay {p.overlay}: {exc}")
    patch = status.get("patch")
    if declared is not None and phase == ProposalPhase.APPROVED and isinstance(patch, Mapping):
        try:
            merged = _links_of(patch)
        except ProposalError:
            merged = None
        if merged is not None and {norm(e) for e in merged} == {norm(e) for e in declared}:
            return Decision(
                ProposalPhase.APPLIED,
                "Merged",
                f"overlay {p.overlay}'s spec has the proposal's links (generation {generation})",
                approved=True,
            )
    if generation != p.generation:
        return Decision(
            ProposalPhase.STALE,
            "GenerationChanged",
            f"overlay {p.overlay} is at generation {generation}; the proposal was computed "
            f"against generation {p.generation}",
        )
    if live_links is not None:
        links: list[Edge] | None = list(live_links)
    elif declared is not None:
        links = declared
    else:
        raw = ostatus.get("links")
        links = [_pair(e) for e in raw] if isinstance(raw, list) and raw else None
    if links is None:
        return Decision(
            ProposalPhase(phase) if phase in set(ProposalPhase) else ProposalPhase.PROPOSED,
            "WaitingForOverlay",
            f"overlay {p.overlay} has no live links yet: checked again once it is Ready",
        )
    try:
        after = apply_changes(links, p.changes)
    except ProposalError as exc:
        return Decision(
            ProposalPhase.STALE, "ChangesInvalid", f"no longer fits the live tree: {exc}"
        )
    problems = _fit(spec, after)
    if problems:
        return Decision(
            ProposalPhase.STALE, "ChangesInvalid", "the result is invalid: " + "; ".join(problems)
        )

    if approve:
        reason, how = "ApprovedByAnnotation", f"approved by annotation {ANNOTATION_APPROVE}=true"
    elif mode == "auto":
        reason, how = "ApprovedAutomatically", f"approved: overlay {p.overlay} has mode auto"
    else:
        hint = (
            f" (overlay {p.overlay} has selfOrganization.mode off: it would not be applied)"
            if mode == "off"
            else ""
        )
        return Decision(
            ProposalPhase.PROPOSED,
            "AwaitingApproval",
            f"waiting for approval: annotate {ANNOTATION_APPROVE}=true or "
            f"{ANNOTATION_REJECT}=true{hint}",
            approved=False,
        )
    if mode == "off":
        return Decision(
            ProposalPhase.APPROVED,
            "SelfOrganizationOff",
            f"{how}, but not applied: overlay {p.overlay} has selfOrganization.mode off",
            approved=True,
        )
    if declared is not None:
        exported = exported_overlay(overlay, p)
        return Decision(
            ProposalPhase.APPROVED,
            reason,
            f"{how}; the operator never writes an explicit-links overlay's spec: export it "
            f"with `canopy proposal export {p.resource_name}` for a pull request (status.patch "
            "holds the same spec); it becomes Applied when the overlay has these links",
            patch=exported["spec"],
            approved=True,
        )
    ready = (
        ostatus.get("phase") == OverlayPhase.READY
        and ostatus.get("observedGeneration") == generation
    )
    if not ready:
        return Decision(
            ProposalPhase.APPROVED,
            reason,
            f"{how}; waiting for overlay {p.overlay} to be Ready at generation {generation}",
            approved=True,
        )
    return Decision(ProposalPhase.APPROVED, reason, f"{how}; applying", "apply", approved=True)
