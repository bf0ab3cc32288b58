"""The mining pipeline: telemetry → metrics → candidates → replay → ranked proposals.

``mine`` is the whole job for one overlay and returns a :class:`MiningResult` (plain data, easy
to print, serialise and test); ``write_outputs`` puts its tables and proposals in a directory.
The command-line and cluster shells live in ``canopy_operator.commands.mine``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from canopy_operator.draw import draw
from canopy_operator.mining import metrics, propose
from canopy_operator.mining.errors import MiningInputError
from canopy_operator.mining.source import Telemetry, read_telemetry
from canopy_operator.model.proposals import Proposal, apply_changes, to_manifest
from canopy_operator.model.topology import Edge, OverlaySpec, norm, validate_tree

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


MAX_DRAWN = 200  # brokers; larger overlays get no proposal pictures


@dataclass(frozen=True)
class Settings:
    top_k: int = 3
    max_distance: float | None = None  # ms; None: any distance
    replay_candidates: int = 12  # best-by-associativity candidates replayed
    replay_sets: int | None = 3_000  # distinct terminal sets replayed (a consistent sample)


@dataclass
class MiningResult:
    overlay: str
    generation: int
    links: list[Edge]
    records: int
    skipped: dict[str, int]
    replay_stats: dict[str, int]
    traffic: metrics.Traffic
    link_as: dict[Edge, tuple[float, float]]
    broker_as: dict[str, float]
    pairs: int
    distances: int
    before: propose.Replayed
    candidates: list[propose.Candidate]
    dropped: dict[str, int]
    chosen: list[propose.Candidate]
    combined: propose.Replayed | None
    combined_links: list[Edge]
    timings: dict[str, float] = field(default_factory=dict)
    zones: dict[str, str] = field(default_factory=dict)  # as used: reported, else declared
    frames: dict[str, DataFrame] = field(default_factory=dict, repr=False)

    @property
    def total_as(self) -> float:
        return sum(ab + ba for ab, ba in self.link_as.values())

    def evidence(self, cand: propose.Candidate) -> dict[str, float | str]:
        """The TopologyProposal's evidence for one chosen exchange, against the current tree."""
        assert cand.replayed is not None
        before, after = self.before, cand.replayed
        change = (
            (after.hops_per_event - before.hops_per_event) / before.hops_per_event * 100
            if before.hops_per_event
            else 0.0
        )
        return {
            "associativityBefore": round(self.total_as, 4),
            "associativityAfter": round(self.total_as + cand.gain_as, 4),
            "hopsPerEventBefore": round(before.hops_per_event, 4),
            "hopsPerEventAfter": round(after.hops_per_event, 4),
            "pureForwarderRateBefore": round(before.pure_forwarder_rate, 4),
            "pureForwarderRateAfter": round(after.pure_forwarder_rate, 4),
            "expectedGain": f"{change:+.1f}% hops/event",
        }

    def proposals(self, namespace: str | None = None) -> list[Proposal]:
        return [
            Proposal(
                overlay=self.overlay,
                generation=self.generation,
                changes=((c.remove, c.add),),
                evidence=self.evidence(c),
                namespace=namespace,
            )
            for c in self.chosen
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "overlay": self.overlay,
            "generation": self.generation,
            "records": self.records,
            "skipped": self.skipped,
            "replay": self.replay_stats,
            "measured": self.traffic.to_json(),
            "associativity": {
                "total": round(self.total_as, 4),
                "links": [
                    {"link": list(e), "as_ab": round(ab, 4), "as_ba": round(ba, 4)}
                    for e, (ab, ba) in sorted(self.link_as.items())
                ],
                "brokers": {b: round(v, 4) for b, v in sorted(self.broker_as.items())},
                "pairs_with_common_events": self.pairs,
            },
            "distance_pairs_measured": self.distances,
            "replayed_current": {
                "hops_per_event": round(self.before.hops_per_event, 4),
                "pure_forwarder_rate": round(self.before.pure_forwarder_rate, 4),
            },
            "candidates": [c.to_json() for c in self.candidates],
            "dropped": self.dropped,
            "proposals": [
                {"remove": list(c.remove), "add": list(c.add), "evidence": self.evidence(c)}
                for c in self.chosen
            ],
            "all_applied": None
            if self.combined is None
            else {
                "links": [list(e) for e in self.combined_links],
                "hops_per_event": round(self.combined.hops_per_event, 4),
                "pure_forwarder_rate": round(self.combined.pure_forwarder_rate, 4),
            },
            "timings_s": {k: round(v, 3) for k, v in self.timings.items()},
        }


STAGES = ("read", "associativity", "candidates", "replay")
"""The mining job's stages, timed (``MiningResult.timings``) and reported as they end."""


def mine(
    spark: SparkSession,
    telemetry: str | Path | Telemetry,
    spec: OverlaySpec,
    links: Iterable[Edge],
    settings: Settings = Settings(),
    *,
    progress: Any = None,
    stage: Any = None,
    since_ts: float | None = None,
) -> MiningResult:
    """Mine one overlay's telemetry against its current ``links``; see the module docs.
    ``progress`` is told what was found, ``stage`` each of the :data:`STAGES` as it ends."""
    say = progress or (lambda _msg: None)
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = now - clock
        clock = now
        if stage is not None:
            stage(f"{name} ({timings[name]:.1f}s)")

    links = sorted(norm(e) for e in links)
    brokers = spec.broker_names
    problems = validate_tree(set(brokers), links, max_fan_out=10**6)  # shape only
    if problems:
        raise MiningInputError(
            f"the current links of {spec.name} are not one tree over its brokers: "
            + "; ".join(problems)
        )
    if isinstance(telemetry, Telemetry):
        tel = telemetry
    else:
        say(f"reading telemetry from {telemetry}")
        tel = read_telemetry(spark, telemetry, brokers, since_ts=since_ts)
    lap("read")
    say(f"{tel.records:,} records, {tel.skipped_total:,} skipped {tel.skipped or ''}".rstrip())
    # The zones the brokers report (their nodes') win over those the manifest declares.
    zones = {**spec.zone_of(), **tel.zones}
    if tel.zones:
        moved = sorted(b for b, z in tel.zones.items() if spec.zone_of().get(b, z) != z)
        say(
            f"placement reported by {len(tel.zones)} brokers"
            + (f"; not where declared: {', '.join(moved)}" if moved else "")
        )

    traffic = metrics.traffic(tel.events)
    pairs = metrics.associativity(tel.events).cache()
    n_pairs = pairs.count()
    links_df = metrics.links_frame(spark, links)
    link_as = metrics.link_associativity(pairs, links_df)
    broker_as = metrics.broker_associativity(link_as, brokers)
    lap("associativity")
    total = sum(a + b for a, b in link_as.values())
    say(f"associativity of {n_pairs:,} broker pairs; total over links {total:.3f}")

    measured, by_zone = metrics.distances(spark, tel.rtts, zones)
    measured = measured.cache()
    n_dist = measured.count()
    with_dist = metrics.with_distance(spark, pairs, measured, by_zone, zones)
    partners = propose.best_partners(with_dist, links, settings.max_distance)
    link_frame = metrics.link_traffic(tel).cache()
    load = {(r["a"], r["b"]): int(r["sampled_events"]) for r in link_frame.collect()}
    candidates, dropped = propose.exchanges(partners, links, link_as, spec.max_fan_out, load)
    lap("candidates")
    say(f"{len(candidates)} candidate exchanges ({len(partners)} brokers with a partner)")

    sets, replay_stats = propose.terminal_sets(tel.events, settings.replay_sets)
    sets = sets.cache()
    to_replay = candidates[: settings.replay_candidates]
    trees: list[Sequence[Edge]] = [links]
    for c in to_replay:
        after = propose.apply_exchange(links, c.remove, c.add)
        assert after is not None  # a candidate's removed link is on its own cycle
        trees.append(after)
    replayed = propose.replay(spark, sets, trees)
    before = replayed[0]
    for c, r in zip(to_replay, replayed[1:], strict=True):
        c.replayed = r
    better = [
        c for c in to_replay if c.replayed and c.replayed.hops_per_event < before.hops_per_event
    ]
    if len(better) < len(to_replay):
        dropped["no_predicted_gain"] = len(to_replay) - len(better)
    better.sort(key=lambda c: (c.replayed.hops_per_event if c.replayed else 0.0, -c.gain_as, c.add))
    chosen, combined_links = propose.choose(better, links, settings.top_k, spec.max_fan_out)
    combined = (
        propose.replay(spark, sets, [combined_links])[0]
        if len(chosen) > 1
        else (chosen[0].replayed if chosen else None)
    )
    lap("replay")
    say(
        f"replayed {replay_stats['replayable']:,} events on {len(trees)} trees: "
        f"{len(chosen)} proposal(s)"
    )
    return MiningResult(
        overlay=spec.name,
        generation=spec.generation,
        links=links,
        records=tel.records,
        skipped=tel.skipped,
        replay_stats=replay_stats,
        traffic=traffic,
        link_as=link_as,
        broker_as=broker_as,
        pairs=n_pairs,
        distances=n_dist,
        before=before,
        candidates=to_replay,
        dropped=dropped,
        chosen=chosen,
        combined=combined,
        combined_links=combined_links,
        timings=timings,
        zones={b: z for b, z in zones.items() if z},
        frames={
            "associativity": pairs,
            "distance": with_dist,
            "distance_measured": measured,
            "brokers": metrics.broker_rates(tel.events),
            "links": link_frame,
        },
    )


def write_outputs(result: MiningResult, out: Path, proposals: Sequence[Proposal]) -> list[Path]:
    """Tables as CSV folders (Spark writes them), the summary as JSON, proposals as YAML and,
    for overlays small enough to look at, a picture of the tree each proposal leads to (the
    added link in red)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, frame in result.frames.items():
        frame.coalesce(1).write.mode("overwrite").option("header", True).csv(str(out / name))
    (out / "mining.json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
    written = []
    pdir = out / "proposals"
    pdir.mkdir(exist_ok=True)
    brokers = sorted({b for e in result.links for b in e})
    for p in proposals:
        manifest = to_manifest(p)
        path = pdir / f"{manifest['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(manifest, sort_keys=False))
        written.append(path)
        if len(brokers) <= MAX_DRAWN:  # a picture of a thousand brokers helps nobody
            after = apply_changes(result.links, p.changes)
            gain = p.evidence.get("expectedGain", "")
            changes = ", ".join(f"{r[0]}-{r[1]} → {a[0]}-{a[1]}" for r, a in p.changes)
            draw(
                brokers,
                after,
                path.with_suffix(".png"),
                f"{p.name}: {changes} ({gain})",
                highlight=[a for _, a in p.changes],
            )
    return written


def describe(result: MiningResult, names: Mapping[int, str] | None = None) -> list[str]:
    """Human-readable lines: the measured state and each proposal with its evidence."""
    t = result.traffic
    lines = [
        f"overlay {result.overlay} (generation {result.generation}): {len(result.links)} links, "
        f"{result.records:,} telemetry records"
        + (f", skipped {result.skipped}" if result.skipped else ""),
        f"measured: {t.events:,} sampled events, {t.hops_per_event:.3f} hops/event, "
        f"{t.hops_per_delivery:.3f} hops/delivered notification, "
        f"pure-forwarder rate {t.pure_forwarder_rate:.1%}",
        f"associativity: total {result.total_as:.3f} over the links; "
        f"{result.pairs:,} pairs share matched events",
        f"replayed on the current tree: {result.before.hops_per_event:.3f} hops/event, "
        f"pure-forwarder rate {result.before.pure_forwarder_rate:.1%}",
    ]
    if not result.chosen:
        why = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in sorted(result.dropped.items()))
        why = why or "no candidates"
        lines.append(f"no proposal: no exchange raises associativity and lowers hops ({why})")
    for i, c in enumerate(result.chosen):
        ev = result.evidence(c)
        name = (names or {}).get(i, f"#{i + 1}")
        dist = "unknown" if c.distance_ms is None else f"{c.distance_ms:.2f} ms ({c.distance_from})"
        lines.append(
            f"proposal {name}: exchange {c.remove[0]}-{c.remove[1]} for {c.add[0]}-{c.add[1]} "
            f"(asked by {c.broker}; link associativity {c.remove_as:.3f} → {c.add_as:.3f}; "
            f"distance {dist})"
        )
        lines.append(
            f"    hops/event {ev['hopsPerEventBefore']} → {ev['hopsPerEventAfter']} "
            f"({ev['expectedGain']}), pure forwarders {ev['pureForwarderRateBefore']:.1%} → "
            f"{ev['pureForwarderRateAfter']:.1%}, total associativity "
            f"{ev['associativityBefore']} → {ev['associativityAfter']}"
        )
    if result.combined is not None and len(result.chosen) > 1:
        lines.append(
            f"all {len(result.chosen)} applied: {result.combined.hops_per_event:.3f} hops/event, "
            f"pure-forwarder rate {result.combined.pure_forwarder_rate:.1%}"
        )
    return lines
