"""Where a broker runs: its zone and node, for the repair chain's order (core/repair.py) and the
miner's underlay hints (telemetry ``placement`` records).

A broker learns them from its command line (``--zone``, ``--node``; ``canopy up`` passes the
zones the overlay declares) and, in Kubernetes, from the downward API: the node from
``spec.nodeName`` in ``$CANOPY_NODE``, the zone from a downward-API volume (``--placement-dir``)
holding the pod's ``labels`` and ``annotations`` files. The zone is only known once the pod is
scheduled, and a pod cannot read its node's labels, so two sources can give it, in this order:

* the pod label ``topology.kubernetes.io/zone``, which clusters with Kubernetes' pod topology
  labels admission (1.33+) copy from the node;
* the annotation ``canopy.dev/zone``, which the operator sets from the node's label once the pod
  is bound (any cluster).

The kubelet rewrites those files when labels or annotations change, so the broker polls them
(a ``stat`` per heartbeat) and tells its core when its placement changes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from canopy_broker.runtime.security import file_stamp

log = logging.getLogger("canopy.broker")

ZONE_LABEL: Final = "topology.kubernetes.io/zone"
ZONE_ANNOTATION: Final = "canopy.dev/zone"
# Seconds a new process refuses clients until linked (``--hold-clients``), as the operator
# annotates the pods of an overlay of more than one broker: an annotation, not an argument,
# so that it is no part of what a pod runs (its template hash), and an overlay growing from
# one broker to two does not replace its first.
HOLD_ANNOTATION: Final = "canopy.dev/hold-clients"


@dataclass(frozen=True, slots=True)
class Placement:
    zone: str = ""
    node: str = ""

    def describe(self) -> str:
        return f"zone {self.zone or '?'}, node {self.node or '?'}"


def parse_downward(text: str) -> dict[str, str]:
    """A downward-API labels/annotations file: one ``key="value"`` per line, the value quoted
    as Go quotes strings (JSON reads those but for rare escapes, which are then kept raw)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or not key:
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw.strip('"')
        if isinstance(value, str):
            out[key.strip()] = value
    return out


class PlacementSource:
    """The broker's placement: fixed parts from flags, the zone from the downward-API files
    when ``directory`` is given and no ``--zone`` was."""

    def __init__(self, zone: str = "", node: str = "", directory: str | None = None) -> None:
        self._fixed = Placement(zone, node)
        self._dir = Path(directory) if directory else None
        self._stamps: tuple[object, ...] | None = None
        self.current = self._fixed
        self._reported = Placement()

    def _files(self) -> tuple[Path, Path] | None:
        if self._dir is None:
            return None
        return self._dir / "labels", self._dir / "annotations"

    def poll(self) -> Placement | None:
        """The placement if it changed since the last poll (nothing known counts as no
        change), else None."""
        files = self._files()
        if files is not None and not self._fixed.zone:
            stamps = tuple(file_stamp(f) for f in files)
            if stamps != self._stamps:
                self._stamps = stamps
                self.current = Placement(self._zone_from(*files), self._fixed.node)
        if self.current == self._reported:
            return None
        self._reported = self.current
        return self.current

    def annotated_hold(self) -> float:
        """The pod's :data:`HOLD_ANNOTATION` in seconds, as it was when the process started
        (0 without one or without a downward-API directory)."""
        files = self._files()
        if files is None:
            return 0.0
        try:
            raw = parse_downward(files[1].read_text(encoding="utf-8")).get(HOLD_ANNOTATION)
        except OSError:
            return 0.0
        try:
            return max(0.0, float(raw)) if raw else 0.0
        except ValueError:
            log.warning("placement: %s=%r is not a number of seconds", HOLD_ANNOTATION, raw)
            return 0.0

    def _zone_from(self, labels: Path, annotations: Path) -> str:
        found: dict[str, str] = {}
        for path in (labels, annotations):
            try:
                found.update(parse_downward(path.read_text(encoding="utf-8")))
            except OSError as exc:
                log.debug("placement: %s not readable: %s", path, exc)
        return found.get(ZONE_LABEL) or found.get(ZONE_ANNOTATION) or ""
