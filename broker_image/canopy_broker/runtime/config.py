"""What a broker process is started with: one plain dataclass, filled by ``canopy-broker serve``
(see cli.py) or by tests, and read by every part of the runtime."""

from __future__ import annotations

from dataclasses import dataclass

from canopy_broker.core.messages import RoutingMode
from canopy_broker.runtime.framing import MAX_FRAME
from canopy_broker.runtime.security import TlsFiles


@dataclass(slots=True)
class BrokerConfig:
    """Everything a broker process is started with (see ``canopy-broker serve --help``)."""

    name: str
    routing: RoutingMode | str = RoutingMode.COVERING
    host: str = "127.0.0.1"
    port: int = 0  # clients (and, without a link listener, links too)
    # A separate listener for overlay links (brokers only, a certificate required): None keeps
    # one shared port, as a test or a laptop wants; `canopy up` and the chart set it.
    link_host: str | None = None
    link_port: int | None = None
    heartbeat_interval: float = 1.0
    dead_after: int = 3
    high_water: int = 20_000
    low_water: int = 5_000
    client_hard_cap: int = 200_000
    # A client's or link's queue counts by its bytes too: this many bytes are as full as
    # ``high_water`` messages (and so on for the low mark and the hard cap); 0: by count only.
    # An outside review's subscriber that read nothing held 500 MB of 250 notifications of
    # 2 MB, far under 20,000, and was never timed as a slow consumer; 300 of them to a
    # neighbour took the publisher's broker to 1.9 GB without slowing the publisher.
    high_water_bytes: int = 64 * 1024 * 1024
    # Notifications to clients are written at most once per this many seconds (0: at the end of
    # every loop turn). The first after a quiet spell is written at once; under steady traffic
    # each client's notifications wait up to this long and leave together, one write (and one
    # wake-up of the client) for several: CPU for latency (docs/broker.md, "Write pacing").
    client_write_interval: float = 0.0
    slow_consumer_grace: float = 10.0
    slow_consumer_policy: str = "disconnect"  # or "backpressure" (see runtime/server.py)
    max_subscriptions: int = 10_000  # per client
    max_connections_per_source: int = 256  # accepted connections per remote IP address
    frame_timeout: float = 30.0  # a frame begun and not finished within this closes its connection
    max_frame: int = MAX_FRAME
    telemetry_sample: float = 0.01
    history: int = 10_000
    telemetry_dir: str | None = None
    telemetry_interval: float = 10.0
    reconnect_min: float = 0.05
    reconnect_max: float = 2.0
    handshake_timeout: float = 5.0
    # A fresh process of a broker that belongs to a larger overlay refuses clients ("joining")
    # until its first link is up, and a heartbeat more for the neighbour's routing table to
    # arrive, or until this many seconds have passed (0: off, clients at once). A broker
    # restarted at its old address, not yet linked, acknowledged what a reconnecting publisher
    # sent and routed it to nobody: lost without a word (review).
    hold_clients: float = 0.0
    advertise: str | None = None  # HOST:PORT peers dial (default: the link listener's address)
    client_advertise: str | None = None  # HOST:PORT clients are sent to (default: see server)
    probe_interval: float = 10.0  # RTT probes to non-neighbours in the address book (0: off)
    repair: bool = True  # declare silent neighbours dead and repair the tree around them
    standby: bool = True  # keep standby links to the brokers a repair would link (with repair)
    retention_seconds: float = 15.0  # custody: forwarded notifications kept per link (0: off)
    retention_limit: int = 100_000  # ... and at most this many per link
    retention_bytes: int = 128 * 1024 * 1024  # ... and about this many bytes per link (0: off)
    # Link-failure repair (paper 004): cycles of at most this many brokers through a standby
    # link are looked for, and a link that fails while its peer is alive is exchanged onto one.
    # Below 3 (no cycle that small): off, a link failure is taken for a death as before.
    cycle_bound: int = 4
    cycle_period: float = 2.0  # detection rounds, s (from the wall clock); 0: none, nothing known
    # Security (runtime/security.py): TLS material (None: plaintext, which `canopy-broker serve`
    # allows only with --insecure) and the client policy file, re-read when it changes.
    tls: TlsFiles | None = None
    client_tls: TlsFiles | None = None  # the client listener's own material (default: tls)
    policy_file: str | None = None
    # Placement (runtime/placement.py): fixed zone and node, and a downward-API directory the
    # zone is read from when no zone is given.
    zone: str = ""
    node: str = ""
    placement_dir: str | None = None

    @property
    def client_cap_bytes(self) -> int:
        """Bytes queued for one client past which it is cut at once (0: off): four times
        ``high_water_bytes``. The count's limit (``client_hard_cap``, ten times high water)
        scaled to bytes let a subscriber that read nothing hold 640 MiB of 3 MB notifications
        before it was cut, the broker at 1.4 GB (outside review)."""
        if self.high_water_bytes <= 0:
            return 0
        # never below two of the largest frames: a small --queue-bytes would cut a client on
        # its second large notification during a moment's pause of its socket
        return max(4 * self.high_water_bytes, 2 * self.max_frame)

    @property
    def slot(self) -> int:
        """Bytes of a queue that count as one message against the marks (0: off)."""
        return (
            max(1, self.high_water_bytes // max(1, self.high_water))
            if self.high_water_bytes > 0
            else 0
        )

    @property
    def detection_timeout(self) -> float:
        """Seconds of silence after which a link's connection is dropped, and as many again
        of no connection after which its peer is taken for dead: ``dead_after`` heartbeats."""
        return self.heartbeat_interval * self.dead_after
