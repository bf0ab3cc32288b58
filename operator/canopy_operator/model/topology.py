"""The operator's topology model: a BrokerOverlay spec, parsed and validated, and tree helpers.

The same model serves the Kubernetes face (the custom resource's ``spec``) and the local one
(``canopy plan``/``canopy apply`` reading YAML files): a manifest becomes an
:class:`OverlaySpec`, and :func:`validate` lists everything wrong with it in messages that name
the offending brokers and links — an invalid spec is never acted on.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from canopy_broker.logs import FORMATS as LOG_FORMATS
from canopy_broker.sim.topology import Edge, adjacency, norm
from canopy_broker.sim.topology import path_between as tree_path

__all__ = [
    "Broker",
    "Edge",
    "OverlaySpec",
    "SpecError",
    "adjacency",
    "components",
    "find_cycle",
    "norm",
    "parse_overlay",
    "tree_path",
    "validate",
    "validate_tree",
]

RETENTION_BYTES = 128 * 1024 * 1024  # the broker's --retention-bytes default

ROUTING_MODES = ("simple", "identity", "covering")
SLOW_CONSUMER_POLICIES = ("disconnect", "backpressure")
ALGORITHMS = ("coordinated", "path", "strawman")
ORDERINGS = ("fifo", "causal")
SELF_ORGANIZATION = ("off", "propose", "auto")


class SpecError(ValueError):
    """A manifest that cannot be read as a BrokerOverlay at all (wrong shape or types)."""


_ANY = None  # a field whose inside is not checked here (free-form, or checked below)
FIELDS: dict[str, Any] = {
    "apiVersion": _ANY,
    "kind": _ANY,
    "metadata": _ANY,
    "status": _ANY,
    "spec": {
        "brokers": [{"name": _ANY, "zone": _ANY, "labels": _ANY, "resources": _ANY}],
        "links": _ANY,
        "maxFanOut": _ANY,
        "routing": _ANY,
        "reconfiguration": {
            "algorithm": _ANY,
            "leaseSeconds": _ANY,
            "maxConcurrent": _ANY,
            "ordering": _ANY,
        },
        "selfOrganization": {"maxDistance": _ANY, "mode": _ANY},
        "broker": {
            "image": _ANY,
            "logFormat": _ANY,
            "resources": _ANY,
            "topologySpreadConstraints": _ANY,
        },
        "telemetry": {"history": _ANY, "sample": _ANY},
        "failureDetection": {
            "cycleBound": _ANY,
            "cyclePeriodSeconds": _ANY,
            "deadAfter": _ANY,
            "heartbeatSeconds": _ANY,
            "retentionLimit": _ANY,
            "retentionBytes": _ANY,
            "retentionSeconds": _ANY,
            "standbyLinks": _ANY,
        },
        "clients": {
            "maxConnectionsPerSource": _ANY,
            "maxSubscriptions": _ANY,
            "queueLimit": _ANY,
            "slowConsumer": _ANY,
            "writeIntervalMs": _ANY,
        },
        "gateway": {"enabled": _ANY, "mqtt": _ANY},
        "security": {
            "issuerRef": {"group": _ANY, "kind": _ANY, "name": _ANY},
            "policy": _ANY,
            "tls": _ANY,
        },
    },
}
"""The fields a BrokerOverlay has, as the CRD's schema declares them (a test holds the two
together). The API server drops a field it does not know, and ``kubectl apply`` refuses it;
read from a file, a misspelt one (``maxFanout``) was taken for its default without a word."""


def unknown_field(manifest: Mapping[str, Any]) -> str | None:
    """The first field of ``manifest`` that a BrokerOverlay does not declare (see
    :data:`FIELDS`), with the declared one it most likely means; None if there is none."""
    return _unknown(manifest, FIELDS, "")


def _unknown(value: object, fields: object, where: str) -> str | None:
    if isinstance(fields, dict) and isinstance(value, Mapping):
        for key, inner in value.items():
            path = f"{where}.{key}" if where else str(key)
            if key not in fields:
                close = difflib.get_close_matches(str(key), [str(k) for k in fields], 1, 0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                known = ", ".join(sorted(fields))
                return f"{path} is not a field of a BrokerOverlay{hint}; known here: {known}"
            found = _unknown(inner, fields[key], path)
            if found:
                return found
    elif isinstance(fields, list) and isinstance(value, list):
        for i, item in enumerate(value):
            found = _unknown(item, fields[0], f"{where}[{i}]")
            if found:
                return found
    return None


@dataclass(frozen=True)
class Broker:
    name: str
    zone: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class OverlaySpec:
    name: str
    brokers: tuple[Broker, ...]
    links: tuple[Edge, ...] | None  # None: managed links (the operator chooses them)
    max_fan_out: int = 4
    routing: str = "covering"
    algorithm: str = "coordinated"
    ordering: str = "fifo"
    max_concurrent: int = 1
    lease_seconds: float = 30.0  # spec.reconfiguration.leaseSeconds: a locked broker's patience
    self_organization: str = "off"
    generation: int = 0
    telemetry_sample: float = 0.1  # the CRD's default: one event in ten kept for the miner
    telemetry_history: int = 10_000
    heartbeat_interval: float = 1.0  # spec.failureDetection.heartbeatSeconds
    dead_after: int = 3  # spec.failureDetection.deadAfter: heartbeats missed before a link drops
    standby: bool = True  # spec.failureDetection.standbyLinks
    retention_seconds: float = 15.0  # spec.failureDetection.retentionSeconds (custody)
    retention_limit: int = 100_000  # spec.failureDetection.retentionLimit (per link)
    retention_bytes: int = RETENTION_BYTES  # spec.failureDetection.retentionBytes (per link)
    cycle_bound: int = 4  # spec.failureDetection.cycleBound: link-failure repair (paper 004)
    cycle_period: float = 2.0  # spec.failureDetection.cyclePeriodSeconds
    gateway: bool = False  # spec.gateway.enabled: the brokers' HTTP gateway (canopy_broker.gateway)
    mqtt: bool = False  # spec.gateway.mqtt: the brokers' MQTT listener (canopy_broker.mqtt)
    slow_consumer: str = "disconnect"  # spec.clients.slowConsumer
    client_queue_limit: int = 200_000  # spec.clients.queueLimit
    max_subscriptions: int = 10_000  # spec.clients.maxSubscriptions
    max_connections_per_source: int = 256  # spec.clients.maxConnectionsPerSource
    write_interval_ms: float = 0.0  # spec.clients.writeIntervalMs: write pacing (0: off)
    log_format: str = "text"  # spec.broker.logFormat: text, or JSON lines (canopy_broker.logs)

    @property
    def broker_names(self) -> list[str]:
        return [b.name for b in self.brokers]

    @property
    def managed_links(self) -> bool:
        return self.links is None

    def zone_of(self) -> dict[str, str]:
        return {b.name: b.zone for b in self.brokers}

    def broker_args(self) -> tuple[str, ...]:
        """`canopy-broker serve` flags every broker of this overlay runs with (telemetry,
        failure detection and custody, client limits)."""
        return (
            "--telemetry-sample",
            repr(self.telemetry_sample),
            "--history",
            str(self.telemetry_history),
            "--heartbeat",
            repr(self.heartbeat_interval),
            "--dead-after",
            str(self.dead_after),
            "--retention",
            repr(self.retention_seconds),
            "--retention-limit",
            str(self.retention_limit),
            # Only when set: a broker image older than the flag (spec.broker.image pinned) runs
            # on, and an operator upgrade does not roll every overlay for a default.
            *(
                ("--retention-bytes", str(self.retention_bytes))
                if self.retention_bytes != RETENTION_BYTES
                else ()
            ),
            *(() if self.standby else ("--no-standby",)),
            "--cycle-bound",
            str(self.cycle_bound),
            "--cycle-period",
            repr(self.cycle_period),
            "--slow-consumer",
            self.slow_consumer,
            "--client-queue-limit",
            str(self.client_queue_limit),
            "--max-subscriptions",
            str(self.max_subscriptions),
            "--max-connections-per-source",
            str(self.max_connections_per_source),
            "--client-write-interval-ms",
            repr(self.write_interval_ms),
            "--log-format",
            self.log_format,
            "--overlay",
            self.name,
        )


def _get(obj: Mapping[str, Any], key: str, kind: type, default: Any, where: str) -> Any:
    value = obj.get(key, default)
    if value is None:
        return default
    if kind is int and isinstance(value, bool):
        raise SpecError(f"{where}.{key} must be an integer, got {value!r}")
    if not isinstance(value, kind):
        raise SpecError(f"{where}.{key} must be a {kind.__name__}, got {value!r}")
    return value


def _number(obj: Mapping[str, Any], key: str, default: float, where: str) -> float:
    """An int or float field (YAML writes 1 and 1.0 alike; a boolean is not a number)."""
    value = obj.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"{where}.{key} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an integer past any float (YAML reads 1e400 as inf, 10**400 not)
        raise SpecError(f"{where}.{key} is out of range, got {value!r}") from None


def parse_overlay(manifest: Mapping[str, Any]) -> OverlaySpec:
    """Read a BrokerOverlay manifest (apiVersion canopy.dev/v1alpha1); raise SpecError naming
    the first field that has the wrong shape. Semantic checks are :func:`validate`'s job."""
    if not isinstance(manifest, Mapping):
        raise SpecError("a BrokerOverlay manifest must be a mapping")
    kind = manifest.get("kind")
    if kind != "BrokerOverlay":
        raise SpecError(f"kind must be BrokerOverlay, got {kind!r}")
    meta = manifest.get("metadata") or {}
    name = _get(meta, "name", str, "", "metadata")
    if not name:
        raise SpecError("metadata.name is required")
    if not _dns_label(name):
        # It names the overlay's directory (canopy up) and its Kubernetes objects: a name
        # such as "../../etc" put a local overlay's state two directories up.
        raise SpecError(f"metadata.name {name!r} is not {DNS_LABEL}")
    problem = unknown_field(manifest)
    if problem:
        raise SpecError(problem)
    spec = manifest.get("spec")
    if not isinstance(spec, Mapping):
        raise SpecError("spec is required and must be a mapping")
    raw_brokers = _get(spec, "brokers", list, [], "spec")
    brokers = []
    for i, b in enumerate(raw_brokers):
        where = f"spec.brokers[{i}]"
        if not isinstance(b, Mapping):
            raise SpecError(f"{where} must be a mapping with a name")
        bname = _get(b, "name", str, "", where)
        if not bname:
            raise SpecError(f"{where}.name is required")
        labels = _get(b, "labels", dict, {}, where)
        brokers.append(Broker(bname, _get(b, "zone", str, "", where), dict(labels)))
    links: tuple[Edge, ...] | None = None
    if spec.get("links") is not None:
        raw_links = _get(spec, "links", list, [], "spec")
        parsed = []
        for i, link in enumerate(raw_links):
            if (
                not isinstance(link, list | tuple)
                or len(link) != 2
                or not all(isinstance(x, str) for x in link)
            ):
                raise SpecError(f"spec.links[{i}] must be a pair of broker names, got {link!r}")
            parsed.append((link[0], link[1]))
        links = tuple(parsed)
    reconf = _get(spec, "reconfiguration", dict, {}, "spec")
    selforg = _get(spec, "selfOrganization", dict, {}, "spec")
    telemetry = _get(spec, "telemetry", dict, {}, "spec")
    sample = _number(telemetry, "sample", 0.1, "spec.telemetry")
    detection = _get(spec, "failureDetection", dict, {}, "spec")
    heartbeat = _number(detection, "heartbeatSeconds", 1.0, "spec.failureDetection")
    retention = _number(detection, "retentionSeconds", 15.0, "spec.failureDetection")
    period = _number(detection, "cyclePeriodSeconds", 2.0, "spec.failureDetection")
    clients = _get(spec, "clients", dict, {}, "spec")
    gateway = _get(spec, "gateway", dict, {}, "spec")
    broker = _get(spec, "broker", dict, {}, "spec")
    status = manifest.get("metadata", {}) or {}
    return OverlaySpec(
        name=name,
        brokers=tuple(brokers),
        links=links,
        max_fan_out=_get(spec, "maxFanOut", int, 4, "spec"),
        routing=_get(spec, "routing", str, "covering", "spec"),
        algorithm=_get(reconf, "algorithm", str, "coordinated", "spec.reconfiguration"),
        ordering=_get(reconf, "ordering", str, "fifo", "spec.reconfiguration"),
        max_concurrent=_get(reconf, "maxConcurrent", int, 1, "spec.reconfiguration"),
        lease_seconds=_number(reconf, "leaseSeconds", 30.0, "spec.reconfiguration"),
        self_organization=_get(selforg, "mode", str, "off", "spec.selfOrganization"),
        generation=int(status.get("generation", 0) or 0),
        telemetry_sample=float(sample),
        telemetry_history=_get(telemetry, "history", int, 10_000, "spec.telemetry"),
        heartbeat_interval=float(heartbeat),
        dead_after=_get(detection, "deadAfter", int, 3, "spec.failureDetection"),
        standby=_get(detection, "standbyLinks", bool, True, "spec.failureDetection"),
        retention_seconds=float(retention),
        retention_limit=_get(detection, "retentionLimit", int, 100_000, "spec.failureDetection"),
        retention_bytes=_get(
            detection, "retentionBytes", int, RETENTION_BYTES, "spec.failureDetection"
        ),
        cycle_bound=_get(detection, "cycleBound", int, 4, "spec.failureDetection"),
        cycle_period=float(period),
        gateway=_get(gateway, "enabled", bool, False, "spec.gateway"),
        mqtt=_get(gateway, "mqtt", bool, False, "spec.gateway"),
        slow_consumer=_get(clients, "slowConsumer", str, "disconnect", "spec.clients"),
        client_queue_limit=_get(clients, "queueLimit", int, 200_000, "spec.clients"),
        max_subscriptions=_get(clients, "maxSubscriptions", int, 10_000, "spec.clients"),
        max_connections_per_source=_get(
            clients, "maxConnectionsPerSource", int, 256, "spec.clients"
        ),
        write_interval_ms=_number(clients, "writeIntervalMs", 0.0, "spec.clients"),
        log_format=_get(broker, "logFormat", str, "text", "spec.broker"),
    )


def validate(spec: OverlaySpec) -> list[str]:
    """Everything semantically wrong with a spec, each message naming what is wrong."""
    problems: list[str] = []
    names = spec.broker_names
    if not names:
        problems.append("spec.brokers is empty: an overlay needs at least one broker")
    seen: set[str] = set()
    for n in names:
        if n in seen:
            problems.append(f"broker name {n!r} is declared more than once")
        seen.add(n)
    for n in names:
        if not _dns_label(n):
            problems.append(f"broker name {n!r} is not {DNS_LABEL}")

    if spec.max_fan_out < 2:
        problems.append(f"maxFanOut must be at least 2, got {spec.max_fan_out}")
    if spec.max_concurrent < 1:
        problems.append(
            f"reconfiguration.maxConcurrent must be at least 1, got {spec.max_concurrent}"
        )
    for value, allowed, field_name in (
        (spec.routing, ROUTING_MODES, "routing"),
        (spec.algorithm, ALGORITHMS, "reconfiguration.algorithm"),
        (spec.ordering, ORDERINGS, "reconfiguration.ordering"),
        (spec.self_organization, SELF_ORGANIZATION, "selfOrganization.mode"),
    ):
        if value not in allowed:
            problems.append(f"{field_name} must be one of {', '.join(allowed)}, got {value!r}")
    if spec.algorithm == "path" and spec.routing == "covering":
        problems.append(
            "reconfiguration.algorithm 'path' needs routing 'identity' or 'simple' "
            "(covering overlays use 'coordinated')"
        )
    ranges: tuple[tuple[float, float, float, str], ...] = (
        (spec.telemetry_sample, 0, 1, "telemetry.sample"),
        (spec.heartbeat_interval, 0.05, 60, "failureDetection.heartbeatSeconds"),
        (spec.dead_after, 2, 100, "failureDetection.deadAfter"),
        (spec.retention_seconds, 0, 3600, "failureDetection.retentionSeconds (0: custody off)"),
        (spec.cycle_bound, 0, 16, "failureDetection.cycleBound (below 3: off)"),
        (spec.cycle_period, 0, 3600, "failureDetection.cyclePeriodSeconds (0: no rounds)"),
        (spec.write_interval_ms, 0, 100, "clients.writeIntervalMs (0: every loop turn)"),
    )
    for number, low, high, what in ranges:
        if not low <= number <= high:
            field_name, _, note = what.partition(" ")
            problems.append(
                f"{field_name} must be between {low:g} and {high:g} {note}".rstrip()
                + f", got {number}"
            )
    detection = spec.heartbeat_interval * spec.dead_after
    if not 1 <= spec.lease_seconds <= 3600:
        problems.append(
            f"reconfiguration.leaseSeconds must be between 1 and 3600, got {spec.lease_seconds}"
        )
    elif spec.lease_seconds <= detection:
        # A broker silent for longer than the lease must already be dead (and fenced) to the
        # overlay: otherwise a paused broker on an exchange's path wakes up and finishes a lock
        # try that A1's lease has given up on, for part of the cycle only.
        problems.append(
            f"reconfiguration.leaseSeconds ({spec.lease_seconds:g}) must exceed the failure "
            f"detection time, failureDetection.heartbeatSeconds x deadAfter ({detection:g} s)"
        )
    if spec.telemetry_history < 0:
        problems.append(f"telemetry.history must not be negative, got {spec.telemetry_history}")
    for count, low, where in (
        (spec.retention_limit, 1, "failureDetection.retentionLimit"),
        (spec.retention_bytes, 0, "failureDetection.retentionBytes (0: no byte bound)"),
        (spec.client_queue_limit, 100, "clients.queueLimit"),
        (spec.max_subscriptions, 1, "clients.maxSubscriptions"),
        (spec.max_connections_per_source, 1, "clients.maxConnectionsPerSource"),
    ):
        if count < low:
            problems.append(f"{where} must be at least {low}, got {count}")
    if spec.log_format not in LOG_FORMATS:
        problems.append(
            f"broker.logFormat must be one of {', '.join(LOG_FORMATS)}, got {spec.log_format!r}"
        )
    if spec.slow_consumer not in SLOW_CONSUMER_POLICIES:
        problems.append(
            f"clients.slowConsumer must be one of {', '.join(SLOW_CONSUMER_POLICIES)}, "
            f"got {spec.slow_consumer!r}"
        )
    if spec.links is not None:
        problems += validate_tree(seen, spec.links, spec.max_fan_out)
    return problems


def validate_tree(brokers: set[str], links: Iterable[Edge], max_fan_out: int) -> list[str]:
    problems: list[str] = []
    edges: set[Edge] = set()
    for a, b in links:
        if a == b:
            problems.append(f"link {a}-{b} links a broker to itself")
            continue
        unknown = [x for x in (a, b) if x not in brokers]
        if unknown:
            problems.append(f"link {a}-{b} names undeclared broker(s) {', '.join(unknown)}")
            continue
        e = norm((a, b))
        if e in edges:
            problems.append(f"link {a}-{b} is declared more than once")
            continue
        edges.add(e)
    if problems:
        return problems
    degree: dict[str, int] = defaultdict(int)
    for a, b in edges:
        degree[a] += 1
        degree[b] += 1
    over = sorted(n for n, d in degree.items() if d > max_fan_out)
    for n in over:
        problems.append(f"broker {n} has {degree[n]} links, more than maxFanOut {max_fan_out}")
    parts_of = components(brokers, edges)
    if len(parts_of) > 1:
        parts = "; ".join(", ".join(sorted(c)) for c in parts_of)
        problems.append(
            f"the links do not connect all brokers into one tree: separate parts are {parts}"
        )
    elif len(edges) != len(brokers) - 1 and brokers:
        cycle = find_cycle(edges)
        where = f" (cycle: {' - '.join(cycle)})" if cycle else ""
        problems.append(
            f"the links contain a cycle{where}: a tree over {len(brokers)} brokers has "
            f"{len(brokers) - 1} links, not {len(edges)}"
        )
    return problems


DNS_LABEL = (
    "a DNS label (lower-case letters, digits and '-', at most 63 characters, starting and "
    "ending with a letter or digit)"
)


def _dns_label(name: str) -> bool:
    ok = set("abcdefghijklmnopqrstuvwxyz0123456789-")
    return 0 < len(name) <= 63 and set(name) <= ok and name[0] != "-" and name[-1] != "-"


def components(nodes: set[str], edges: Iterable[Edge]) -> list[set[str]]:
    """The connected parts of the graph (nodes, edges), each a set of nodes."""
    adj = adjacency(edges)
    left = set(nodes)
    out = []
    while left:
        start = min(left)
        seen = {start}
        stack = [start]
        while stack:
            for nxt in adj[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        out.append(seen)
        left -= seen
    return out


def tree_problem(nodes: Iterable[str], edges: Iterable[Edge]) -> str | None:
    """Why ``edges`` are not one tree over ``nodes``, in words (None if they are). A plan
    made from such a view would be wrong: the live overlay is between a death and its
    repair, or a broker is still coming back (its links not yet made)."""
    nodes, edges = set(nodes), sorted({norm(e) for e in edges})
    if not nodes and not edges:
        return None  # nothing runs yet: a new overlay
    stray = sorted({x for e in edges for x in e} - nodes)
    if stray:
        return f"links to brokers it does not run: {', '.join(stray)}"
    parts = components(nodes, edges)
    if len(parts) > 1:
        alone = sorted(min(p) for p in parts if len(p) == 1)
        shown = "; ".join(", ".join(sorted(p)) for p in sorted(parts, key=min))
        if alone:
            return f"{', '.join(alone)} linked to nobody (parts: {shown})"
        return f"split in {len(parts)} parts: {shown}"
    if len(edges) != len(nodes) - 1:
        return f"a cycle: {' - '.join(find_cycle(edges))}"
    return None


def find_cycle(edges: Iterable[Edge]) -> list[str]:
    """One cycle in an undirected graph, as a list of brokers (empty if there is none)."""
    adj = adjacency(edges)
    parent: dict[str, str | None] = {}
    for root in sorted(adj):
        if root in parent:
            continue
        parent[root] = None
        stack = [root]
        while stack:
            node = stack.pop()
            for nxt in sorted(adj[node]):
                if nxt == parent[node]:
                    continue
                if nxt in parent:
                    a, b = [node], [nxt]
                    while a[-1] is not None and parent.get(a[-1]) is not None:
                        a.append(parent[a[-1]])  # type: ignore[arg-type]
                    ancestors = set(a)
                    while b[-1] not in ancestors:
                        b.append(parent[b[-1]])  # type: ignore[arg-type]
                    return a[: a.index(b[-1]) + 1] + b[-2::-1]
                parent[nxt] = node
                stack.append(nxt)
    return []
