"""Build telemetry fixtures by hand: records exactly as brokers write them (schema v1)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from canopy_operator.mining.synth import parents_towards, route
from canopy_operator.model.topology import Edge

SCHEMA = "canopy.telemetry/v1"


def record(broker: str, kind: str, **fields: Any) -> dict[str, Any]:
    return {"schema": SCHEMA, "type": kind, "broker": broker, "ts": 1.0, "cursor": 1, **fields}


def event_records(
    links: Sequence[Edge], event_id: str, origin: str, matched: Iterable[str], ts: float = 1.0
) -> list[dict[str, Any]]:
    """The records one event leaves on the brokers of its route under exact routing."""
    out = []
    for broker, came_from, hit in route(parents_towards(links, origin), origin, matched):
        out.append(
            record(
                broker,
                "event",
                event_id=event_id,
                publisher=f"pub-{origin}",
                seq=1,
                hops=0,
                source_kind="link" if came_from else "client",
                source=came_from or f"pub-{origin}",
                matched_local=hit,
                deliveries=int(hit),
                forwarded_to=[],
                attrs={"k": 1},
            )
            | {"ts": ts}
        )
    return out


def rtt(broker: str, peer: str, ms: float, via: str = "probe") -> dict[str, Any]:
    return record(broker, "rtt", peer=peer, rtt_ms=ms, via=via)


def write(root: Path, records: Iterable[dict[str, Any]], extra_lines: Iterable[str] = ()) -> Path:
    """Records into ``root/broker=NAME/date=…/hour=…/part-1.jsonl`` (the brokers' layout);
    ``extra_lines`` (raw text, e.g. damaged JSON) are appended to the first broker's file."""
    by_broker: dict[str, list[str]] = {}
    for r in records:
        by_broker.setdefault(str(r.get("broker")), []).append(json.dumps(r))
    extra = list(extra_lines)
    for i, (broker, lines) in enumerate(sorted(by_broker.items())):
        f = root / f"broker={broker}" / "date=2026-11-21" / "hour=10" / "part-1.jsonl"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("\n".join(lines + (extra if i == 0 else [])) + "\n")
    return root
