"""The Kubernetes side's readings, against given answers: which broker pods are gone (a step is
not retried against them), which need their client hold changed, and when the heal ends a link
known at one end only."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from canopy_broker.runtime.placement import HOLD_ANNOTATION
from canopy_operator.backends import reconciler
from canopy_operator.backends.k8s import KubernetesBackend
from canopy_operator.backends.manifests import LABEL_BROKER, LABEL_OVERLAY, pod_name
from canopy_operator.model.topology import OverlaySpec, parse_overlay
from tests.operator.fakes import LinkRemovals


def overlay(*brokers: str) -> OverlaySpec:
    return parse_overlay(
        {
            "apiVersion": "canopy.dev/v1alpha1",
            "kind": "BrokerOverlay",
            "metadata": {"name": "ov"},
            "spec": {
                "brokers": [{"name": b} for b in brokers],
                "links": [[a, b] for a, b in itertools.pairwise(brokers)],
            },
        }
    )


class _Pods:
    """The API server's pods, by name; records merge patches."""

    def __init__(self, pods: dict[str, dict[str, Any]]) -> None:
        self.pods = pods
        self.patches: list[tuple[str, dict[str, Any]]] = []

    async def get(self, path: str) -> dict[str, Any] | None:
        return self.pods.get(path.rsplit("/", 1)[-1])

    async def items(self, path: str) -> list[dict[str, Any]]:
        return list(self.pods.values())

    async def patch(self, path: str, body: dict[str, Any]) -> None:
        self.patches.append((path.rsplit("/", 1)[-1], body))


@pytest.mark.parametrize(
    ("pod", "gone"),
    [
        (None, True),
        ({"metadata": {"deletionTimestamp": "2026-11-27T10:00:00Z"}}, True),
        ({"status": {"phase": "Failed"}}, True),
        ({"status": {"phase": "Running"}}, False),
        ({"status": {"phase": "Pending"}}, False),  # restarting in place, or being scheduled
    ],
)
async def test_a_broker_pod_is_gone_when_missing_deleted_or_ended(
    pod: dict[str, Any] | None, gone: bool
) -> None:
    pods = _Pods({pod_name("ov", "b1"): pod} if pod is not None else {})
    backend = KubernetesBackend(pods, overlay("b1"), "ns", {}, "token")  # type: ignore[arg-type]
    assert await backend.gone("b1") is gone


def broker_pod(broker: str, hold: str | None, **meta: Any) -> dict[str, Any]:
    annotations = {HOLD_ANNOTATION: hold} if hold is not None else {}
    labels = {LABEL_OVERLAY: "ov", LABEL_BROKER: broker}
    return {
        "metadata": {
            "name": pod_name("ov", broker),
            "labels": labels,
            "annotations": annotations,
            **meta,
        }
    }


@pytest.mark.parametrize(
    ("brokers", "pods", "patched"),
    [
        # Grown from one broker to two: a's pod, created alone, gets the hold; b's has it.
        (("a", "b"), {"a": None, "b": "90.0"}, {"a": "90.0"}),
        # Shrunk to one: the lone broker's pod loses it (nothing to wait for).
        (("a",), {"a": "90.0"}, {"a": None}),
        # As it should be: nothing is patched.
        (("a", "b"), {"a": "90.0", "b": "90.0"}, {}),
    ],
)
async def test_a_running_pod_gets_the_client_hold_its_overlays_size_asks_for(
    brokers: tuple[str, ...], pods: dict[str, str | None], patched: dict[str, str | None]
) -> None:
    api = _Pods({pod_name("ov", b): broker_pod(b, h) for b, h in pods.items()})
    backend = KubernetesBackend(api, overlay(*brokers), "ns", {}, "token")  # type: ignore[arg-type]
    assert await backend.annotate_holds() == patched
    assert api.patches == [
        (pod_name("ov", b), {"metadata": {"annotations": {HOLD_ANNOTATION: h}}})
        for b, h in patched.items()
    ]


async def test_a_pod_being_deleted_is_left_as_it_is() -> None:
    api = _Pods(
        {pod_name("ov", "a"): broker_pod("a", None, deletionTimestamp="2026-11-27T10:00:00Z")}
    )
    backend = KubernetesBackend(api, overlay("a", "b"), "ns", {}, "token")  # type: ignore[arg-type]
    assert await backend.annotate_holds() == {}


async def test_the_heal_ends_a_link_known_at_one_end_for_three_heals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """b-c at b only (c answers, with other links): the restore waits while it is new, and
    the heal removes it at b once it has been one-sided for three heal intervals, so the
    restore can join the parts (as the local supervisor does after 10 s). Before, the
    Kubernetes restore waited on such a link for good."""
    events: list[str] = []
    admin = LinkRemovals()

    class Backend:
        def admin(self, name: str) -> object:
            return admin(name)

    class Heal:
        config = reconciler.OperatorConfig(heal_interval=30.0)
        namespace, name = "ns", "ov"

        def event(self, reason: str, message: str, warning: bool = False) -> None:
            events.append(f"{reason}: {message}")

    neighbours = {"a": ["b"], "b": ["a", "c"], "c": ["d"], "d": ["c"]}
    statuses = {n: {"neighbours": [{"peer": p} for p in ps]} for n, ps in neighbours.items()}
    clock = [1000.0]
    monkeypatch.setattr(reconciler.time, "monotonic", lambda: clock[0])
    heal, backend = Heal(), Backend()
    for _ in range(3):  # three heals, 30 s apart: 60 s one-sided, not yet 90
        assert not await reconciler._end_stuck_links(heal, backend, statuses)  # type: ignore[arg-type]
        clock[0] += 30.0
    assert admin.removed == [] and events == []
    assert await reconciler._end_stuck_links(heal, backend, statuses)  # type: ignore[arg-type]
    assert admin.removed == [("b", "c")]
    assert events[0].startswith("StuckLinkRemoved: link b-c was known at b only for over 90s")
