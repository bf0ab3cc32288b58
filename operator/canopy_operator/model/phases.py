"""The words the operator writes into ``status``: phases and condition types, as enums.

They are ``StrEnum``: each member *is* its string, so what reaches the API (JSON), the Events
and the GitOps health checks is exactly the word the CRDs' enums list, and comparing with what
was read back from the API (plain strings) works both ways. Keeping them here, not as literals
scattered over the reconciler, the keeper and the lifecycle, lets the type checker and one test
see that every phase the CRDs allow is one the operator knows.
"""

from __future__ import annotations

from enum import StrEnum


class OverlayPhase(StrEnum):
    """``BrokerOverlay.status.phase`` (the CRD's enum; ``Deleting`` is listed there for
    tools, the operator never writes it: a deleted overlay's objects go by owner reference)."""

    PENDING = "Pending"
    CREATING = "Creating"
    READY = "Ready"
    RECONFIGURING = "Reconfiguring"
    DEGRADED = "Degraded"
    INVALID = "Invalid"
    DELETING = "Deleting"


class ProposalPhase(StrEnum):
    """``TopologyProposal.status.phase``; docs/proposals.md tells the lifecycle."""

    PROPOSED = "Proposed"
    APPROVED = "Approved"
    APPLYING = "Applying"
    APPLIED = "Applied"
    REJECTED = "Rejected"
    STALE = "Stale"
    FAILED = "Failed"


class ConditionType(StrEnum):
    """``status.conditions[].type``, in the order the conditions are listed: an overlay's four,
    then a proposal's two."""

    VALID = "Valid"
    READY = "Ready"
    RECONFIGURING = "Reconfiguring"
    DEGRADED = "Degraded"
    APPROVED = "Approved"
    APPLIED = "Applied"


OPEN_PROPOSAL_PHASES = (ProposalPhase.PROPOSED, ProposalPhase.APPROVED, ProposalPhase.APPLYING)
TERMINAL_PROPOSAL_PHASES = (
    ProposalPhase.APPLIED,
    ProposalPhase.REJECTED,
    ProposalPhase.STALE,
    ProposalPhase.FAILED,
)
