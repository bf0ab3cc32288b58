"""Run real ``canopy-broker serve`` processes on 127.0.0.1 and wire them into a tree.

Used by the integration tests, the data-plane benchmark and ``canopy demo``. Brokers are started
with port 0 and report their real ports on stdout (``CANOPY_READY {...}``), so there is no race
for "free" ports. Links are made through the admin API exactly as the operator makes them, and
:func:`wait_settled` polls the brokers instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import ssl
import sys
import tempfile
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import canopy_broker
from canopy_broker.admin_client import AdminClient
from canopy_broker.cli import READY_PREFIX
from canopy_broker.client.credentials import ENV_PKI, Credentials
from canopy_broker.pki import LocalPki
from canopy_broker.runtime.security import TlsFiles

Edge = tuple[str, str]


def broker_env(token: str | None = None) -> dict[str, str]:
    """The environment for a child broker: PYTHONPATH reaches this package even when the project
    is not pip-installed; the admin token, when given, travels in $CANOPY_ADMIN_TOKEN (not argv,
    which other local users can read)."""
    env = dict(os.environ)
    root = str(Path(canopy_broker.__file__).resolve().parent.parent)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([root, *parts])
    if token is not None:
        env["CANOPY_ADMIN_TOKEN"] = token
    return env


def serve_command(
    name: str,
    *,
    pki: LocalPki | None,
    host: str = "127.0.0.1",
    routing: str = "covering",
    extra_args: Sequence[str] = (),
    tls_dir: Path | None = None,
    ports: Mapping[str, int] | None = None,
) -> list[str]:
    """`canopy-broker serve` on free ports of ``host`` (it reports them on stdout when ready):
    one for clients, one for links (brokers only), one for the admin API; with its credentials
    from ``pki`` (None: ``--insecure``, plaintext), or from ``tls_dir``
    (``--tls-dir``: a Kubernetes TLS Secret's files) when given. ``ports``: the ports to ask
    for instead (``listen``, ``link``, ``admin``; those not given are free ones)."""
    ports = ports or {}
    if tls_dir is not None:
        security = ["--tls-dir", str(tls_dir)]
    else:
        security = pki.serve_args(name) if pki is not None else ["--insecure"]
    return [
        sys.executable,
        "-m",
        "canopy_broker.cli",
        "serve",
        "--name",
        name,
        "--listen",
        f"{host}:{ports.get('listen', 0)}",
        "--link-listen",
        f"{host}:{ports.get('link', 0)}",
        "--admin",
        f"{host}:{ports.get('admin', 0)}",
        "--routing",
        routing,
        *security,
        *extra_args,
    ]


def rss_mb(pid: int) -> float:
    """Resident set size of a process in MiB (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def process_alive(pid: int) -> bool:
    """The process runs: any of its threads is neither gone nor a zombie. A process killed
    shows its main thread a zombie while its other threads are still exiting, and until the
    last one has, its sockets are open: its ports cannot be listened on again yet."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        for tid in threads:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as fh:
                if fh.read().rpartition(")")[2].split()[0] != "Z":
                    return True
    except (OSError, IndexError):
        return True  # a thread went while we looked: look again later
    return False


def process_cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time of processes so far (``utime + stime`` of Linux
    ``/proc/<pid>/stat``). Benchmarks report CPU per event or per notification from it because,
    unlike rates, it does not depend on what else the machine is doing during the run."""
    return sum(process_cpu_split(pids))


def process_cpu_split(pids: Iterable[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of processes so far: where a broker's time goes, its own
    code or the kernel's (for a broker, mostly the TCP stack under its writes)."""
    user = system = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rpartition(")")[2].split()  # the name in (...) may hold spaces
        user += int(fields[11])
        system += int(fields[12])
    tick = os.sysconf("SC_CLK_TCK")
    return user / tick, system / tick


async def stop_process(process: asyncio.subprocess.Process, grace: float = 10.0) -> int:
    """SIGTERM, wait up to ``grace`` seconds for a clean exit, then SIGKILL; returns the exit
    code. Shared by Canopy's brokers and the peer brokers of ``canopy bench peers``."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
    return await process.wait()


@dataclass
class BrokerProc:
    """A running broker process and how to reach it."""

    name: str
    process: asyncio.subprocess.Process
    listen: str  # HOST:PORT for clients
    admin_address: str
    token: str
    log_path: Path | None
    tls: ssl.SSLContext | None = None  # verifies the admin API's certificate
    gateway: str | None = None  # the HTTP gateway's HOST:PORT (--gateway)
    mqtt: str | None = None  # the MQTT listener's HOST:PORT (--mqtt)
    link_address: str = ""  # HOST:PORT other brokers dial (--link-listen; default: listen)
    admin: AdminClient = field(init=False)
    _log: IO[bytes] | None = None

    def __post_init__(self) -> None:
        self.admin = AdminClient(self.admin_address, self.token, tls=self.tls)
        self.link_address = self.link_address or self.listen

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_mb(self) -> float:
        return rss_mb(self.pid)

    async def stop(self, grace: float = 10.0) -> int:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL; returns the exit code."""
        await self.admin.close()
        code = await stop_process(self.process, grace)
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def kill(self) -> None:
        """SIGKILL (a crash); call :meth:`stop` afterwards to reap it."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


class _FromEnv:
    """The default of :func:`spawn_broker`'s ``pki``: the one ``$CANOPY_PKI`` names."""


FROM_ENV = _FromEnv()


def env_pki() -> LocalPki | None:
    """The local PKI ``$CANOPY_PKI`` names (created if missing), or None."""
    pki_dir = os.environ.get(ENV_PKI)
    return LocalPki(pki_dir).ensure() if pki_dir else None


async def spawn_broker(
    name: str,
    *,
    pki: LocalPki | _FromEnv | None = FROM_ENV,
    token: str | None = None,
    routing: str = "covering",
    log_dir: Path | None = None,
    extra_args: Sequence[str] = (),
    ready_within: float = 30.0,
    tls_dir: Path | None = None,
    host: str = "127.0.0.1",
    wrap: Sequence[str] = (),
) -> BrokerProc:
    """Start ``canopy-broker serve`` for ``name`` on free loopback ports; wait until it is ready.
    ``pki``: the overlay's credentials (None: plaintext, ``--insecure``; by default the PKI
    ``$CANOPY_PKI`` names, plaintext if it is not set). ``tls_dir``: ``ca.crt``, ``tls.crt``,
    ``tls.key`` instead (``--tls-dir``, as a Kubernetes pod mounts its TLS Secret). ``host``:
    the address it listens on; ``wrap``: a command prefix to run it with (a network namespace
    of its own, in the partition tests)."""
    if tls_dir is not None:
        pki = None
    elif isinstance(pki, _FromEnv):
        pki = env_pki()
    token = token or secrets.token_urlsafe(16)
    log_path = (log_dir / f"{name}.log") if log_dir is not None else None
    log = log_path.open("wb") if log_path is not None else None
    process = await asyncio.create_subprocess_exec(
        *wrap,
        *serve_command(
            name, pki=pki, host=host, routing=routing, extra_args=extra_args, tls_dir=tls_dir
        ),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=log if log is not None else asyncio.subprocess.DEVNULL,
        env=broker_env(token),
    )
    try:
        assert process.stdout is not None
        info: dict[str, Any] | None = None
        async with asyncio.timeout(ready_within):
            while info is None:
                line = await process.stdout.readline()
                if not line:
                    raise RuntimeError(f"broker {name} exited before it was ready (see {log_path})")
                text = line.decode(errors="replace")
                if text.startswith(READY_PREFIX):
                    info = json.loads(text[len(READY_PREFIX) :])
        if tls_dir is not None:
            tls: ssl.SSLContext | None = TlsFiles(tls_dir / "ca.crt").client_context()
        else:
            tls = pki.verify_context() if pki is not None else None
        proc = BrokerProc(
            name,
            process,
            info["listen"],
            info["admin"],
            token,
            log_path,
            tls,
            gateway=info.get("gateway"),
            mqtt=info.get("mqtt"),
            link_address=info.get("link", ""),
            _log=log,
        )
        async with asyncio.timeout(ready_within):
            while not await proc.admin.readyz():  # noqa: ASYNC110 - polling another process
                await asyncio.sleep(0.05)
        return proc
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        if log is not None:
            log.close()
        raise


async def wait_settled(
    brokers: Iterable[BrokerProc], *, within: float = 30.0, interval: float = 0.05
) -> list[dict[str, Any]]:
    """Poll until routing is quiet everywhere: every link up, nothing queued or unacknowledged on
    any link, and all routing tables unchanged between two consecutive rounds.

    An acknowledged message has been *processed* by the receiver (acks are sent after handling),
    so empty queues everywhere plus an unchanged snapshot means no routing message is in flight.
    Returns the last ``GET /routing`` of each broker.
    """
    brokers = list(brokers)
    previous: list[Any] | None = None
    async with asyncio.timeout(within):
        while True:
            statuses = await asyncio.gather(*(b.admin.status() for b in brokers))
            tables = await asyncio.gather(*(b.admin.routing() for b in brokers))
            quiet = all(
                n["state"] == "up" and n["queue_depth"] == 0
                for s in statuses
                for n in s["neighbours"]
            )
            snapshot = [t["table"] for t in tables]
            if quiet and snapshot == previous:
                return tables
            previous = snapshot if quiet else None
            await asyncio.sleep(interval)


class Overlay:
    """A set of broker processes linked into a tree; an async context manager that stops them.

    >>> async with Overlay(["b1", "b2", "b3"], [("b1", "b2"), ("b2", "b3")]) as ov:
    ...     ov["b1"].listen   # client address of broker b1
    """

    def __init__(
        self,
        names: Sequence[str],
        edges: Sequence[Edge] = (),
        *,
        routing: str = "covering",
        log_dir: Path | None = None,
        extra_args: Sequence[str] = (),
        token: str | None = None,
        pki: LocalPki | None = None,
        insecure: bool = False,
    ) -> None:
        """``pki``: the overlay's credentials; by default the one ``$CANOPY_PKI`` names, else a
        new one in a temporary directory (:attr:`credentials` are its clients'). ``insecure``:
        plaintext brokers, no credentials at all."""
        self.names = list(names)
        self.edges = list(edges)
        self.routing = routing
        self.extra_args = list(extra_args)
        self.token = token or secrets.token_urlsafe(16)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="canopy-logs-")
            log_dir = Path(self._tmp.name)
        self.log_dir = log_dir
        self.brokers: dict[str, BrokerProc] = {}
        if insecure:
            self.pki: LocalPki | None = None
        elif pki is not None:
            self.pki = pki.ensure()
        elif os.environ.get(ENV_PKI):
            self.pki = env_pki()
        else:
            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="canopy-logs-")
            self.pki = LocalPki(Path(self._tmp.name) / "pki").ensure()

    @property
    def credentials(self) -> Credentials:
        """What a client of this overlay connects with (the local user's certificate)."""
        return Credentials.from_pki(self.pki.dir) if self.pki is not None else Credentials()

    def __getitem__(self, name: str) -> BrokerProc:
        return self.brokers[name]

    async def start(self) -> Overlay:
        try:
            procs = await asyncio.gather(
                *(self._spawn(n) for n in self.names), return_exceptions=True
            )
            for p in procs:
                if isinstance(p, BrokerProc):
                    self.brokers[p.name] = p
            for p in procs:
                if isinstance(p, BaseException):
                    raise p
            # Every broker learns every address: exchanges dial brokers that are not neighbours.
            book = {name: p.link_address for name, p in self.brokers.items()}
            await asyncio.gather(*(p.admin.set_peers(book) for p in self.brokers.values()))
            for a, b in list(self.edges):
                await self.link(a, b)
        except BaseException:
            await self.stop()
            raise
        return self

    def _spawn(self, name: str) -> Awaitable[BrokerProc]:
        return spawn_broker(
            name,
            pki=self.pki,
            token=self.token,
            routing=self.routing,
            log_dir=self.log_dir,
            extra_args=self.extra_args,
        )

    def neighbours(self, name: str) -> list[str]:
        return sorted(b if a == name else a for a, b in self.edges if name in (a, b))

    async def add_leaf(self, name: str, attach_to: str, within: float = 10.0) -> BrokerProc:
        """Add-leaf (paper 000): start broker ``name`` and link it to ``attach_to``; its
        neighbour hands it the routes over the new link like any other. Every broker learns
        the new address and the new broker learns all of them, so later exchanges can dial it.
        """
        if name in self.brokers:
            raise ValueError(f"{name} is already in the overlay")
        proc = await self._spawn(name)
        self.brokers[name] = proc
        self.names.append(name)
        book = {n: p.link_address for n, p in self.brokers.items()}
        await asyncio.gather(
            proc.admin.set_peers(book),
            *(
                p.admin.set_peers({name: proc.link_address})
                for n, p in self.brokers.items()
                if n != name
            ),
        )
        await self.link(name, attach_to, within)
        return proc

    async def remove_leaf(self, name: str, within: float = 30.0) -> dict[str, Any]:
        """Remove-leaf: drain ``name`` (its clients migrate to its only neighbour, make-before-
        break, through the client library), then remove the link and stop the process.

        The link is removed only once the leaf is drained: no client left *and* everything it
        sent acknowledged, so the last publisher's ``Moved`` has reached the neighbour. Returns
        the final drain status."""
        neighbours = self.neighbours(name)
        if len(neighbours) != 1:
            raise ValueError(f"{name} is not a leaf: neighbours {neighbours}")
        (other,) = neighbours
        status = await self.brokers[name].admin.drain(
            other, self.brokers[other].listen, wait=within
        )
        if not status["drained"]:
            raise RuntimeError(f"{name} did not drain within {within}s: {status}")
        await self.unlink(name, other)
        proc = self.brokers.pop(name)
        self.names.remove(name)
        self.edges = [e for e in self.edges if name not in e]
        await proc.stop()
        return status

    async def link(self, a: str, b: str, within: float = 10.0) -> None:
        """``a`` dials ``b``; returns once the link is up on both ends."""
        result = await self.brokers[a].admin.add_link(b, self.brokers[b].link_address, wait=within)
        if not result["up"]:
            raise RuntimeError(f"link {a}-{b} did not come up within {within}s")
        if not any(set(e) == {a, b} for e in self.edges):
            self.edges.append((a, b))

    async def unlink(self, a: str, b: str) -> None:
        await self.brokers[a].admin.remove_link(b)
        self.edges = [e for e in self.edges if set(e) != {a, b}]

    async def exchange(
        self,
        path: Sequence[str],
        remove: Edge,
        *,
        ordering: str = "fifo",
        within: float = 60.0,
    ) -> dict[str, Any]:
        """Coordinated exchange of ``remove`` for (path[0], path[-1]); returns when finished."""
        result = await self.brokers[path[0]].admin.start_exchange(
            list(path), remove, ordering=ordering, wait=within
        )
        if result["state"] != "finished":
            raise RuntimeError(f"exchange {result['xid']} {result['state']}: {result['reason']}")
        self.edges = [e for e in self.edges if set(e) != set(remove)] + [(path[0], path[-1])]
        return result

    async def settle(self, within: float = 30.0) -> list[dict[str, Any]]:
        return await wait_settled(self.brokers.values(), within=within)

    async def statuses(self) -> dict[str, dict[str, Any]]:
        """Every broker's ``GET /status``, by name, asked at once."""
        found = await asyncio.gather(*(b.admin.status() for b in self.brokers.values()))
        return dict(zip(self.brokers, found, strict=True))

    async def stalls(self, since: float) -> dict[str, Any]:
        """The event-loop stalls of every broker since wall-clock ``since``, as each broker
        measured its own loop (a callback due every 10 ms, see ``LoopWatch``; a stall is a lag
        of 10 ms or more, and each broker keeps its last 256): how many, the longest, where,
        and how much of it the broker spent on CPU (the rest it waited for a core, which on a
        machine with fewer cores than brokers is the machine's doing); the longest in CPU;
        and the longest garbage collection."""
        out: dict[str, Any] = {
            "stalls": 0,
            "longest_stall_s": 0.0,
            "longest_stall_broker": "",
            "longest_stall_cpu_s": 0.0,
            "longest_busy_stall_s": 0.0,
            "longest_gc_pause_s": 0.0,
        }
        for name, st in (await self.statuses()).items():
            for t, kind, took, cpu in st["loop"]["stalls"]:
                if t < since:
                    continue
                if kind != "loop":
                    out["longest_gc_pause_s"] = max(out["longest_gc_pause_s"], took)
                    continue
                out["stalls"] += 1
                out["longest_busy_stall_s"] = max(out["longest_busy_stall_s"], cpu)
                if took > out["longest_stall_s"]:
                    out.update(
                        longest_stall_s=took, longest_stall_broker=name, longest_stall_cpu_s=cpu
                    )
        return out

    def cpu_seconds(self) -> float:
        """User + system CPU time of all its broker processes so far."""
        return process_cpu_seconds(b.pid for b in self.brokers.values())

    async def stop(self) -> dict[str, int]:
        procs = list(self.brokers.values())
        codes = await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        self.brokers.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return {p.name: c for p, c in zip(procs, codes, strict=True) if isinstance(c, int)}

    async def __aenter__(self) -> Overlay:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
