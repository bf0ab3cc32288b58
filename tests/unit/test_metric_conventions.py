"""Every metric the brokers and the operator export follows Prometheus' naming conventions
(prometheus.io/docs/practices/naming): one ``canopy_`` prefix, snake_case, base units spelled
out as the last word (``_seconds``, ``_bytes``), ``_total`` only on counters (the client adds
it), no reserved suffix on a gauge, snake_case labels, and help text on each. A dashboard or an
alert written against these names then reads the way Prometheus users expect."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from canopy_broker.runtime.metrics import BrokerMetrics, Gauges
from canopy_operator.backends import reconciler

NAME = re.compile(r"canopy_[a-z][a-z0-9]*(_[a-z0-9]+)*")
LABEL = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
# Units Prometheus wants converted to base units (seconds, bytes) or to a ratio.
NOT_BASE = re.compile(
    r"_(ms|millis|milliseconds|us|micros|microseconds|ns|nanoseconds|minutes|hours|days"
    r"|kb|kilobytes|mb|megabytes|gb|gigabytes|percent|pct)(_|$)"
)
RESERVED = ("_total", "_count", "_sum", "_bucket", "_created", "_info")
TIMED = re.compile(r"_(latency|duration|time|delay|age|elapsed)(_|$)")


def families() -> list[Metric]:
    """Every metric family a broker and the operator export, each labelled metric touched once
    so that its label names show in the samples."""
    gauges = Gauges(0, 0, False, {"p": 0}, {"p": True}, 0, 0, standby_up={"p": True})
    broker = BrokerMetrics(lambda: gauges)
    wrappers = [m for m in vars(broker).values() if isinstance(m, MetricWrapperBase)]
    wrappers += [reconciler.RECONCILE_SECONDS, reconciler.STEPS, reconciler.PLAN_LENGTH]
    for metric in wrappers:
        names = metric._labelnames
        if names:
            metric.labels(*("x" for _ in names))
    out = list(broker.registry.collect())
    for metric in (reconciler.RECONCILE_SECONDS, reconciler.STEPS, reconciler.PLAN_LENGTH):
        out += metric.collect()
    return out


def violations(family: Metric) -> list[str]:
    """What is wrong with one family's name, unit, type, help or labels (nothing: [])."""
    name, kind = family.name, family.type
    found: list[str] = []
    if not NAME.fullmatch(name):
        found.append(f"{name}: not canopy_ followed by snake_case")
    if not family.documentation.strip():
        found.append(f"{name}: no help text")
    if NOT_BASE.search(name):
        found.append(f"{name}: a unit that is not a base unit (use _seconds, _bytes or a ratio)")
    if kind != "counter" and name.endswith(RESERVED):
        found.append(f"{name}: a {kind} must not end in a reserved suffix ({', '.join(RESERVED)})")
    if kind == "counter" and name.endswith("_total"):
        found.append(f"{name}: _total twice (the client library adds it to counters)")
    if kind == "histogram" and not name.endswith(("_seconds", "_bytes")):
        found.append(f"{name}: a histogram's name ends in the unit it measures")
    if TIMED.search(name) and not name.endswith("_seconds"):
        found.append(f"{name}: a time measured in something else than _seconds")
    for sample in family.samples:
        for label in sample.labels:
            if label in ("le", "quantile") and kind in ("histogram", "summary"):
                continue
            if not LABEL.fullmatch(label) or label.startswith("__"):
                found.append(f"{name}: label {label!r} is not snake_case")
    return sorted(set(found))


def test_every_exported_metric_follows_the_conventions() -> None:
    fams = families()
    names = {f.name for f in fams}
    assert {
        "canopy_link_messages",
        "canopy_exchange_seconds",
        "canopy_client_queued_messages",
    } <= names
    assert len(names) == len(fams) > 30, sorted(names)
    problems = [p for f in fams for p in violations(f)]
    assert not problems, "\n".join(problems)
    labels = {label for f in fams for s in f.samples for label in s.labels}
    assert {"peer", "direction", "role", "code", "result", "kind", "overlay"} <= labels


def test_the_checker_catches_each_kind_of_misnamed_metric() -> None:
    registry = CollectorRegistry()
    latency = Histogram("canopy_publish_latency", "no unit", ["Peer"], registry=registry)
    latency.labels("a").observe(1)
    bad = [
        GaugeMetricFamily("canopy_rtt_ms", "milliseconds"),
        GaugeMetricFamily("canopy_queue_depth_total", "a gauge named like a counter"),
        GaugeMetricFamily("Canopy-Clients", "not snake_case"),
        GaugeMetricFamily("canopy_clients", ""),
        *registry.collect(),
    ]
    found = [violations(f) for f in bad]
    assert all(found), found
    assert "not a base unit" in found[0][0]
    assert "reserved suffix" in found[1][0]
    assert "snake_case" in found[2][0]
    assert "no help text" in found[3][0]
    assert {p.split(": ", 1)[1] for p in found[4]} == {
        "a histogram's name ends in the unit it measures",
        "a time measured in something else than _seconds",
        "label 'Peer' is not snake_case",
    }
