"""``canopy-broker serve``: run one broker process (overlay/client port + admin HTTP port).

Once both ports listen, one line goes to stdout::

    CANOPY_READY {"name": "b1", "listen": "127.0.0.1:40123", "admin": "127.0.0.1:40124", ...}

so a supervisor that asked for port 0 learns the real ports without racing for free ones (see
procs.py). Logs go to stderr. SIGTERM / SIGINT stop the broker gracefully and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import errno
import gc
import json
import logging
import os
import platform
import resource
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from canopy_broker import logs
from canopy_broker.core.messages import RoutingMode
from canopy_broker.gateway import make_gateway_app
from canopy_broker.mqtt import MqttGateway, start_mqtt
from canopy_broker.runtime import eventloop, httpsite
from canopy_broker.runtime.accept import Serving
from canopy_broker.runtime.admin import make_admin_app
from canopy_broker.runtime.config import BrokerConfig
from canopy_broker.runtime.framing import join_address, parse_address
from canopy_broker.runtime.security import SecurityError, TlsFiles
from canopy_broker.runtime.server import Broker

READY_PREFIX = "CANOPY_READY "
TOKEN_ENV = "CANOPY_ADMIN_TOKEN"
PROFILE_ENV = "CANOPY_PROFILE"
EXIT_ADDRESS_IN_USE = 3
"""``serve``'s exit status when a port it was given is taken (another process listens there)."""


MAX_WRITE_INTERVAL_MS = 100.0
"""Past this, pacing would hold notifications longer than a client's patience is likely to be."""


def write_interval_ms(text: str) -> float:
    """``--client-write-interval-ms``: a number of milliseconds from 0 to 100."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of milliseconds: {text!r}") from None
    if not 0 <= value <= MAX_WRITE_INTERVAL_MS:  # also refuses nan
        raise argparse.ArgumentTypeError(
            f"must be between 0 and {MAX_WRITE_INTERVAL_MS:g} milliseconds, got {text}"
        )
    return value


def byte_count(text: str) -> int:
    """``--queue-bytes``: a whole number of bytes, 0 or more (0: off)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or more, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="canopy-broker", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run a broker")
    s.add_argument("--name", required=True, help="broker name, unique in the overlay")
    s.add_argument(
        "--listen",
        default="127.0.0.1:7400",
        help="HOST:PORT for clients, and for links too without --link-listen (port 0: any free)",
    )
    s.add_argument(
        "--link-listen",
        help="HOST:PORT for overlay links only (brokers; with TLS a certificate is required);"
        " the --listen port then refuses brokers and this one refuses clients",
    )
    s.add_argument("--admin", default="127.0.0.1:7401", help="HOST:PORT of the admin HTTP API")
    s.add_argument(
        "--advertise",
        help="HOST:PORT other brokers dial (default: --link-listen's, else --listen's)",
    )
    s.add_argument(
        "--client-advertise",
        help="HOST:PORT clients are sent to when they fail over or their broker drains"
        " (default: --advertise's host, --listen's port)",
    )
    s.add_argument("--routing", choices=[m.value for m in RoutingMode], default="covering")
    tok = s.add_mutually_exclusive_group()
    tok.add_argument("--token", help=f"admin bearer token (or ${TOKEN_ENV})")
    tok.add_argument("--token-file", help="file holding the admin bearer token")
    tok.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="run the admin API without authentication (development only)",
    )
    s.add_argument("--telemetry-dir", help="also write telemetry as partitioned JSON lines here")
    s.add_argument(
        "--telemetry-sample",
        type=float,
        default=0.01,
        help="fraction of events kept in telemetry (consistent across brokers)",
    )
    s.add_argument("--history", type=int, default=10_000, help="telemetry ring-buffer records")
    s.add_argument("--heartbeat", type=float, default=1.0, help="link heartbeat interval, s")
    s.add_argument(
        "--dead-after",
        type=int,
        default=3,
        help="heartbeats a link may miss before its connection is dropped (then redialled); "
        "a neighbour whose link stays unconnected as long again is declared dead",
    )
    s.add_argument(
        "--retention",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="custody for crash repair: notifications forwarded on each link are kept this long "
        "(at most --retention-limit per link) and replayed after a neighbour dies (0: off)",
    )
    s.add_argument("--retention-limit", type=int, default=100_000, help="see --retention")
    s.add_argument(
        "--retention-bytes",
        type=byte_count,
        default=128 * 1024 * 1024,
        metavar="BYTES",
        help="about this many bytes kept per link at most, as --retention-limit counts "
        "notifications (0: no such bound; default 128 MiB)",
    )
    s.add_argument(
        "--no-repair",
        dest="repair",
        action="store_false",
        help="never declare a neighbour dead nor repair the tree around it (paper 001)",
    )
    s.add_argument(
        "--slow-consumer",
        choices=["disconnect", "backpressure"],
        default="disconnect",
        help="a client that does not keep up: cut it off alone (default) or slow the publishers",
    )
    s.add_argument(
        "--client-queue-limit",
        type=int,
        default=200_000,
        help="notifications queued for one client before it is cut off as a slow consumer",
    )
    s.add_argument(
        "--queue-bytes",
        "--client-queue-bytes",  # its name when it counted clients' queues only
        dest="queue_bytes",
        type=byte_count,
        default=64 * 1024 * 1024,
        metavar="BYTES",
        help="a client's or link's queue this many bytes long counts as over high water, as "
        "20,000 messages do (the low mark scales alike); a client with four times it queued "
        "is cut at once; 0: count messages only (default 64 MiB)",
    )
    s.add_argument(
        "--client-write-interval-ms",
        type=write_interval_ms,
        default=0.0,
        metavar="MS",
        help="write notifications to each client at most once per MS milliseconds, 0-100 "
        "(default 0: at the end of every loop turn). The first after a quiet spell leaves at "
        "once; under steady traffic several leave in one write: less CPU, up to MS more latency",
    )
    s.add_argument("--max-subscriptions", type=int, default=10_000, help="subscriptions per client")
    s.add_argument(
        "--max-connections-per-source",
        type=int,
        default=256,
        help="accepted connections per remote address (more are refused); TLS handshakes in "
        "progress are counted apart, at most 64 per address",
    )
    s.add_argument(
        "--hold-clients",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="refuse clients (error 'joining': they try another broker) until the first link "
        "is up, or for at most SECONDS (default 0: off). For a broker of a larger overlay, "
        "whose clients know its address from before a restart: unlinked, it would acknowledge "
        "their publications and route them to nobody",
    )
    s.add_argument(
        "--no-standby",
        dest="standby",
        action="store_false",
        help="keep no standby links: a repair dials its new links instead of promoting "
        "connections kept warm to the brokers it would link (paper 003)",
    )
    s.add_argument(
        "--cycle-bound",
        type=int,
        default=4,
        help="link-failure repair (paper 004): look for cycles of at most this many brokers "
        "closed by a standby link, and exchange a failed link whose peer is alive onto one; "
        "below 3: off (a link failure is taken for the peer's death)",
    )
    s.add_argument(
        "--cycle-period",
        type=float,
        default=2.0,
        help="cycle detection rounds, s (numbered from the wall clock: keep clocks in sync); "
        "0: no rounds (no cycle is known, so a failed link waits for its connection)",
    )
    s.add_argument(
        "--zone",
        default=os.environ.get("CANOPY_ZONE", ""),
        help="the zone this broker runs in (default $CANOPY_ZONE; else read from "
        "--placement-dir): orders the repair chain so standby links cross zones",
    )
    s.add_argument(
        "--node",
        default=os.environ.get("CANOPY_NODE", ""),
        help="the node (machine) this broker runs on (default $CANOPY_NODE)",
    )
    s.add_argument(
        "--placement-dir",
        help="a Kubernetes downward-API volume with the pod's labels and annotations files: "
        "the zone is its label topology.kubernetes.io/zone or annotation canopy.dev/zone, "
        "re-read when they change",
    )
    s.add_argument(
        "--gateway",
        metavar="HOST:PORT",
        help="also serve the HTTP gateway here (publish by POST, subscribe over Server-Sent "
        "Events or WebSocket; canopy_broker/gateway.py): HTTPS with the broker's certificate "
        "when TLS is on, clients authenticated by the broker as any client",
    )
    s.add_argument(
        "--mqtt",
        metavar="HOST:PORT",
        help="also accept MQTT 3.1.1 and 5 clients here (QoS 0 and 1; canopy_broker/mqtt.py): "
        "TLS with the broker's certificate when TLS is on, the MQTT password a client token",
    )
    s.add_argument(
        "--probe-interval",
        type=float,
        default=10.0,
        help="RTT probes to non-neighbour brokers of the address book, s (0: off)",
    )
    sec = s.add_argument_group("security (docs/security.md)")
    sec.add_argument(
        "--tls-dir",
        help="directory with ca.crt, tls.crt and tls.key (a Kubernetes TLS Secret's layout)",
    )
    sec.add_argument("--tls-ca", help="the overlay's CA certificate (PEM)")
    sec.add_argument("--tls-cert", help="this broker's certificate (PEM, canopy://broker/NAME)")
    sec.add_argument("--tls-key", help="this broker's private key (PEM)")
    sec.add_argument(
        "--client-tls-dir",
        help="ca.crt, tls.crt, tls.key for the client port only (e.g. a certificate clients"
        " already trust, and the CA of their certificates); default: the overlay's (--tls-dir)",
    )
    sec.add_argument(
        "--admin-tls-dir",
        help="ca.crt, tls.crt, tls.key for the admin port only; default: the overlay's",
    )
    sec.add_argument(
        "--policy",
        help="client policy (YAML): principals, their client ids, publish and subscribe filters;"
        " re-read when it changes",
    )
    sec.add_argument(
        "--insecure",
        action="store_true",
        help="run without TLS: anybody who reaches a port may link, publish and subscribe",
    )
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    logs.add_argument(s)
    s.add_argument(
        "--overlay",
        default=os.environ.get("CANOPY_OVERLAY", ""),
        help="the overlay this broker belongs to, for its logs (default: $CANOPY_OVERLAY)",
    )
    return parser


def resolve_tls(args: argparse.Namespace) -> TlsFiles | None:
    """TLS material from the flags; exits with a clear message if there is none and
    ``--insecure`` was not given, or if a file is missing."""
    if args.tls_dir:
        d = Path(args.tls_dir)
        files = TlsFiles(d / "ca.crt", d / "tls.crt", d / "tls.key")
    elif args.tls_ca or args.tls_cert or args.tls_key:
        if not (args.tls_ca and args.tls_cert and args.tls_key):
            sys.exit("canopy-broker: --tls-ca, --tls-cert and --tls-key go together")
        files = TlsFiles(Path(args.tls_ca), Path(args.tls_cert), Path(args.tls_key))
    elif args.insecure:
        logging.getLogger("canopy.broker").warning(
            "INSECURE: no TLS; links, clients and the admin API are in plaintext and "
            "unauthenticated (anybody who reaches the port may join the overlay)"
        )
        return None
    else:
        sys.exit(
            "canopy-broker: no TLS material: pass --tls-dir or --tls-ca/--tls-cert/--tls-key "
            "(`canopy up` creates them), or --insecure for plaintext"
        )
    try:
        return files.check()
    except SecurityError as exc:
        sys.exit(f"canopy-broker: {exc}")


def own_tls(directory: str | None, overlay: TlsFiles | None, flag: str) -> TlsFiles | None:
    """A listener's own TLS material (a Kubernetes TLS Secret's layout), or None to use the
    overlay's; refused without the overlay's (plaintext has no listener with TLS of its own)."""
    if not directory:
        return None
    if overlay is None:
        sys.exit(f"canopy-broker: {flag} needs TLS for the overlay too (--tls-dir), not --insecure")
    d = Path(directory)
    try:
        return TlsFiles(d / "ca.crt", d / "tls.crt", d / "tls.key").check()
    except SecurityError as exc:
        sys.exit(f"canopy-broker: {flag}: {exc}")


def resolve_token(args: argparse.Namespace) -> str | None:
    """The admin token from the flags or environment; exits if none and not explicitly insecure."""
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as fh:
            token: str | None = fh.read().strip()
    else:
        token = args.token or os.environ.get(TOKEN_ENV)
    if not token and not args.insecure_no_token:
        sys.exit(
            "canopy-broker: no admin token: pass --token, --token-file or set "
            f"${TOKEN_ENV} (or --insecure-no-token for local development)"
        )
    return token or None


async def serve(args: argparse.Namespace) -> int:
    token = resolve_token(args)
    tls = resolve_tls(args)
    host, port = parse_address(args.listen)
    link_host, link_port = parse_address(args.link_listen) if args.link_listen else (None, None)
    admin_host, admin_port = parse_address(args.admin)
    client_tls = own_tls(args.client_tls_dir, tls, "--client-tls-dir")
    admin_files = own_tls(args.admin_tls_dir, tls, "--admin-tls-dir") or tls
    config = BrokerConfig(
        name=args.name,
        routing=RoutingMode(args.routing),
        host=host,
        port=port,
        link_host=link_host,
        link_port=link_port,
        heartbeat_interval=args.heartbeat,
        dead_after=args.dead_after,
        repair=args.repair,
        standby=args.standby,
        cycle_bound=args.cycle_bound,
        cycle_period=args.cycle_period,
        retention_seconds=args.retention,
        retention_limit=args.retention_limit,
        retention_bytes=args.retention_bytes,
        telemetry_sample=args.telemetry_sample,
        history=args.history,
        telemetry_dir=args.telemetry_dir,
        advertise=args.advertise,
        client_advertise=args.client_advertise,
        probe_interval=args.probe_interval,
        slow_consumer_policy=args.slow_consumer,
        client_hard_cap=args.client_queue_limit,
        high_water_bytes=args.queue_bytes,
        client_write_interval=args.client_write_interval_ms / 1000,
        max_subscriptions=args.max_subscriptions,
        max_connections_per_source=args.max_connections_per_source,
        hold_clients=args.hold_clients,
        tls=tls,
        client_tls=client_tls,
        policy_file=args.policy,
        zone=args.zone,
        node=args.node,
        placement_dir=args.placement_dir,
    )
    try:
        broker = Broker(config)
    except SecurityError as exc:
        sys.exit(f"canopy-broker: {exc}")
    runners: list[web.AppRunner] = []
    mqtt: tuple[Serving, MqttGateway] | None = None
    code = 0
    try:
        await broker.start()
        runner = httpsite.runner(make_admin_app(broker, token))
        await runner.setup()
        runners.append(runner)
        # The admin API speaks HTTPS with the broker's certificate when TLS is on (bearer
        # token inside); clients are not asked for a certificate there. The HTTP gateway is
        # for clients: it presents the client port's certificate. Both are reloaded with the
        # broker's files.
        admin_tls = broker.reloaded_context(admin_files) if admin_files is not None else None
        client_files = client_tls or tls
        await httpsite.BoundedSite(runner, admin_host, admin_port, ssl_context=admin_tls).start()
        assert broker.address is not None
        admin_sock = runner.addresses[0]
        gateway: str | None = None
        # The gateways are clients of their own broker, over its loopback: IPv6's where it
        # listens on IPv6's any address (a socket on "::" takes IPv6 only; dialing 127.0.0.1
        # was refused, outside review).
        bound_to = broker.address[0]
        own = join_address(
            {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bound_to, bound_to), broker.address[1]
        )
        own_ca = client_files.ca if client_files is not None else None
        if args.gateway:
            gw_host, gw_port = parse_address(args.gateway)
            # Open streams end with the broker: a short grace, not aiohttp's 60 s.
            gw = httpsite.runner(make_gateway_app(own, own_ca), shutdown_timeout=1.0)
            await gw.setup()
            runners.append(gw)
            gw_tls = broker.reloaded_context(client_files) if client_files is not None else None
            await httpsite.BoundedSite(gw, gw_host, gw_port, ssl_context=gw_tls).start()
            gw_sock = gw.addresses[0]
            gateway = join_address(gw_sock[0], gw_sock[1])
        if args.mqtt:
            mq_host, mq_port = parse_address(args.mqtt)
            mq_tls = broker.reloaded_context(client_files) if client_files is not None else None
            mqtt = await start_mqtt(mq_host, mq_port, own, own_ca, mq_tls)
            mq_sock = mqtt[0].sockets[0].getsockname()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ready = {
            "name": broker.name,
            "listen": join_address(*broker.address),
            **({"link": join_address(*broker.link_address)} if broker.link_address else {}),
            "admin": join_address(admin_sock[0], admin_sock[1]),
            "routing": broker.core.mode.value,
            "tls": tls is not None,
            "pid": os.getpid(),
            **({"gateway": gateway} if gateway else {}),
            **({"mqtt": join_address(mq_sock[0], mq_sock[1])} if mqtt else {}),
        }
        print(READY_PREFIX + json.dumps(ready), flush=True)
        await stop.wait()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        # A port asked for is taken: say which, and exit with a code of its own, so that a
        # supervisor that asked for a broker's old ports back can ask for free ones instead.
        print(f"canopy-broker: {exc}", file=sys.stderr, flush=True)
        code = EXIT_ADDRESS_IN_USE
    finally:
        logging.getLogger("canopy.broker").info("stopping %s", broker.name)
        if mqtt is not None:  # the gateways' clients first, while the broker is up
            mqtt[0].close()
            await mqtt[1].close()
        for r in reversed(runners):
            await r.cleanup()
        await broker.stop()
    return code


def tune_gc() -> None:
    """Fewer, larger young-generation collections.

    The data plane allocates many short-lived acyclic objects (dicts, lists, bytes) that
    reference counting frees; the default threshold (700) runs the cycle collector thousands of
    times a second for nothing, and the resulting pauses showed up as tail latency in the
    benchmark. ``freeze`` moves start-up objects (modules, the app) out of every later scan.
    """
    gc.set_threshold(50_000, 20, 100)
    gc.freeze()


MMAP_THRESHOLD = 1 << 20
"""Bytes from which glibc's malloc maps memory of its own (see :func:`tune_allocator`)."""
TRIM_THRESHOLD = 8 << 20
"""Free bytes at the top of the heap that glibc keeps instead of giving back at once."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)


def raise_file_limit() -> int:
    """Raise the soft limit of open files to the hard one (as Go's runtime does for NATS);
    the soft limit it ends at. Left at a shell's usual 1,024, a flood of handshakes from two
    addresses ran the broker out of descriptors before any bound of its own applied, and it
    then accepted nobody, its own loopback included (outside review). An unlimited hard limit
    (macOS) takes :data:`FILES_WANTED`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FILES_WANTED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and want > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return soft


FILES_WANTED = 10_240  # open files asked for where the hard limit is unlimited (macOS's cap)
FILES_ENOUGH = 8_192  # below this, a flood runs out of descriptors before the listeners' bounds


def tune_allocator() -> bool:
    """Serve the TLS reads' buffers from the heap, not from fresh mappings; True if set.

    Each TLS read (uvloop's, then Python's ``SSLObject.read``) asks malloc for 256 KiB,
    shrinks it to what was read and frees it. glibc maps an allocation that large on its own
    (mmap), shrinks it in place (mremap) and unmaps it (munmap): three system calls and two or
    three page faults per read, on every link and client connection. Its threshold rises by
    itself only when a mapped block is freed unshrunk, which these never are. Measured on a
    relaying broker (docs/performance.md): 1,100 reads/s cost 1,100 mmaps and 2,400 page
    faults a second, and the broker 10-15 % more CPU. Above the 256 KiB, with the heap's top
    kept, the buffer is reused in place. Only on glibc (elsewhere a no-op, False); an
    operator's ``MALLOC_MMAP_THRESHOLD_`` wins."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level, args.log_format, overlay=args.overlay, broker=args.name)
    tune_gc()
    tune_allocator()
    files = raise_file_limit()
    if files < FILES_ENOUGH:
        logging.getLogger("canopy.broker").warning(
            "open files limited to %d (ulimit -n): a flood of connections can exhaust them"
            " before the broker's own bounds apply; raise the hard limit to %d or more",
            files,
            FILES_ENOUGH,
        )
    profile = os.environ.get(PROFILE_ENV)
    with contextlib.suppress(KeyboardInterrupt):
        if not profile:
            return eventloop.run(serve(args))
        # Profiling hook for the benchmark work: CANOPY_PROFILE=out.prof canopy-broker serve ...
        import cProfile  # noqa: PLC0415 - only when asked for

        with cProfile.Profile() as prof:
            code = eventloop.run(serve(args))
        prof.dump_stats(profile.replace("{name}", args.name))
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
