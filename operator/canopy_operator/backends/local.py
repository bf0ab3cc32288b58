"""The local face: brokers as processes on this machine, state in a directory.

``canopy up`` / ``apply`` / ``status`` / ``down`` and ``canopy demo`` run the operator's planner
and executor against this backend. Brokers are started detached (their own session, logs in the
state directory), so an overlay outlives the command that started it; ``state.json`` remembers
each broker's pid and addresses and the overlay's admin token.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from canopy_broker.admin_client import AdminClient, AdminError
from canopy_broker.cli import EXIT_ADDRESS_IN_USE, READY_PREFIX
from canopy_broker.client.credentials import Credentials
from canopy_broker.pki import LocalPki
from canopy_broker.procs import broker_env, process_alive, serve_command
from canopy_operator.model.restore import status_neighbours
from canopy_operator.model.topology import parse_overlay, tree_problem


class BrokerDownError(Exception):
    """A broker of the local overlay does not answer (its process died, or it hangs)."""

    def __init__(self, message: str, *, dead: bool = False) -> None:
        super().__init__(message)
        self.dead = dead  # its process is gone (not merely silent)


class StateFileError(Exception):
    """The overlay's ``state.json`` cannot be read (edited by hand, or a disk gone wrong)."""


class NotOneTreeError(BrokerDownError):
    """Every broker answers, but their links are not one tree over them: a death's repair, or
    the supervisor's restore, is under way. A plan made from that view would be wrong."""


BROKER_STATES = ("up", "failed", "unreachable", "dead")
# Seconds a new broker process of a larger overlay refuses clients, unless linked before (a
# plan or the supervisor's restore links it within a few): past them, an overlay that cannot
# be restored is still served.
CLIENT_HOLD = 30.0
"""What ``canopy status`` says of a broker: ``up`` (answers, healthy), ``failed`` (answers but
reports itself failed: /healthz 500), ``unreachable`` (its process lives but the admin API does
not answer in time: paused, overloaded or partitioned), ``dead`` (its process is gone)."""


class LocalBackend:
    """Implements :class:`canopy_operator.executor.Backend` with local processes."""

    def __init__(
        self,
        state_dir: Path,
        *,
        routing: str = "covering",
        host: str = "127.0.0.1",
        broker_args: Sequence[str] = (),
        zones: Mapping[str, str] | None = None,
        gateway: bool | None = None,
        mqtt: bool | None = None,
        insecure: bool = False,
    ):
        """``insecure``: a new overlay runs in plaintext (an existing one keeps what it was
        created with: ``state.json`` remembers). ``zones``: the zone the overlay declares for
        each broker, passed as ``--zone`` (all brokers share this machine, so no node).
        ``gateway``, ``mqtt``: each broker serves the HTTP gateway, the MQTT listener, on a
        free port."""
        self.dir = state_dir
        self.host = host
        # Private: state.json holds the admin token (anyone who reads it can drive the
        # brokers' admin API), and the broker logs what its clients do.
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        self.state: dict[str, Any] = self._load()
        # How new brokers are started. Given: this overlay's from now on (apply, the demo).
        # Not given (status, the supervisor, roll): what the overlay was last configured with,
        # so that a broker restored or replaced runs like its peers.
        self._explicit = bool(broker_args) or routing != "covering" or zones is not None
        self.routing, self.broker_args = routing, tuple(broker_args)
        self.zones = {b: z for b, z in (zones or {}).items() if z}
        self.gateway = bool(gateway)
        self.mqtt = bool(mqtt)
        self._adopt_config()
        self.state.setdefault("brokers", {})
        self.state.setdefault("insecure", insecure)
        # The overlay's CA, certificates, admin token and client policy (canopy_broker.pki),
        # made on first use: security is on unless the overlay was created --insecure.
        self.pki = None if self.state["insecure"] else LocalPki(self.dir / "pki").ensure()
        # The brokers' admin token: the one in pki/admin-token (an overlay created before it
        # was used keeps the one its brokers run with).
        token = self.pki.admin_token() if self.pki is not None else secrets.token_urlsafe(18)
        self.state.setdefault("token", token)
        self._admins: dict[str, AdminClient] = {}
        # Brokers this object started: kept until stopped, so that no Popen is collected while
        # its process runs (the overlay may outlive us, but not our handles on it).
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # -- persistence ------------------------------------------------------------------------

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    def _load(self) -> dict[str, Any]:
        if not self.state_file.exists():
            return {}
        try:
            data = json.loads(self.state_file.read_bytes())
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            why = f"not valid JSON ({exc})"
        else:
            if isinstance(data, dict) and isinstance(data.get("brokers", {}), dict):
                return data
            why = "not an overlay's state (a JSON object with its brokers)"
        raise StateFileError(
            f"{self.state_file} is {why}: put back a good copy, or stop the overlay's "
            f"processes by hand and remove {self.dir}"
        )

    def configure(self, routing: str, broker_args: Sequence[str]) -> None:
        """Start new brokers with ``routing``, ``broker_args`` and the zones and gateway this
        backend was made with (all remembered in state.json)."""
        self.routing = routing
        self.broker_args = tuple(broker_args)  # e.g. telemetry sampling for the miner
        self.state["config"] = {
            "routing": routing,
            "args": list(self.broker_args),
            "zones": dict(self.zones),
            "gateway": self.gateway,
            "mqtt": self.mqtt,
        }

    def config_of(self, name: str, ports: Mapping[str, int] | None = None) -> list[str]:
        """What broker ``name`` started now runs with (its arguments after the name): one
        recorded with another configuration is rolled. ``ports``: the gateway's and MQTT
        listener's to ask for (by default free ones, which is what is recorded)."""
        zone = self.zones.get(name)
        ports = ports or {}
        return [
            self.routing,
            *self.broker_args,
            *(("--zone", zone) if zone else ()),
            *(("--gateway", f"{self.host}:{ports.get('gateway', 0)}") if self.gateway else ()),
            *(("--mqtt", f"{self.host}:{ports.get('mqtt', 0)}") if self.mqtt else ()),
        ]

    def reload(self) -> None:
        """Read ``state.json`` again: another process (the supervisor, an ``apply``) may have
        changed it since this object was made. Call it holding :meth:`locked`."""
        try:
            fresh = self._load()
        except StateFileError as exc:
            # The supervisor lives on with the state it read last (its next save writes that
            # back): it used to die here, and nothing restored dead brokers any more.
            print(f"warning: {exc}; going on with the state read before", file=sys.stderr)
            return
        if fresh:
            self.state = fresh
            self._adopt_config()

    def _adopt_config(self) -> None:
        configured = self.state.get("config")
        if self._explicit or not configured:
            self.configure(self.routing, self.broker_args)
        else:
            self.routing = str(configured["routing"])
            self.broker_args = tuple(configured["args"])
            self.zones = dict(configured.get("zones") or {})
            self.gateway = bool(configured.get("gateway"))
            self.mqtt = bool(configured.get("mqtt"))

    @contextlib.asynccontextmanager
    async def locked(self, within: float = 600.0) -> AsyncIterator[None]:
        """The overlay's lock (``flock`` on ``STATE_DIR/NAME/lock``): one process at a time plans
        and acts on the overlay (``apply``, the supervisor's restore), so that two plans made
        from the same live tree never run at once. Polled, so that waiting can be cancelled;
        the kernel drops it if the holder dies, so a killed command leaves no lock behind."""
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + within
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"overlay {self.dir.name} is locked by another command "
                            f"for more than {within:g}s"
                        ) from None
                    await asyncio.sleep(0.05)
            yield
        finally:
            os.close(fd)  # releases the lock

    def save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)  # created afresh, so with the mode below
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # it holds the token
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.state, indent=1))
        tmp.replace(self.state_file)

    async def save_progress(self, progress: dict[str, Any]) -> None:
        self.state["progress"] = progress
        self.save()

    # -- Backend ----------------------------------------------------------------------------

    @property
    def brokers(self) -> dict[str, dict[str, Any]]:
        brokers: dict[str, dict[str, Any]] = self.state["brokers"]
        return brokers

    async def create_broker(self, name: str) -> None:
        """Start broker ``name``, unless its process runs and has not failed: one that failed
        (fenced out by its neighbours after a pause, or broken) is killed and started anew,
        as the supervisor would, since it only waits to be restarted (soak: a restore that
        "brought back" such a broker found it alive and waited a minute for it to be
        ready)."""
        info = self.brokers.get(name)
        if info is not None and process_alive(info["pid"]):
            if not await self.failed(name):
                return
            await _stop(info["pid"], first=signal.SIGKILL)
        stale = self._admins.pop(name, None)  # a dead process's admin API, at its old port
        if stale is not None:
            await stale.close()
        # A broker restarted after it died comes back at its old addresses, as a Kubernetes
        # pod keeps its name and ports: a client that knows only this broker finds it again
        # within its failover time. A port taken meanwhile (by any process): free ones.
        ports = _free(self.host, _ports(info)) if info is not None else {}
        # Until it is linked, a broker of a larger overlay refuses clients. Unlinked, it would
        # acknowledge their publications and route them to nobody: a restarted one, back at
        # its old address, took a publisher that failed over to it, and a subscriber nothing
        # had happened to lost what it sent, untold (review).
        declared = parse_overlay(self.state["spec"]).broker_names if self.state.get("spec") else []
        hold = CLIENT_HOLD if len(declared) > 1 else 0.0
        for pid, child in list(self._children.items()):
            if child.poll() is not None:  # reaped: no zombie left behind
                del self._children[pid]
        if not await self._spawn(name, ports, hold) and not await self._spawn(name, {}, hold):
            raise RuntimeError(f"broker {name}: a port is taken although asked for none")

    async def _spawn(self, name: str, ports: Mapping[str, int], hold: float) -> bool:
        """Start broker ``name`` on ``ports`` (the others free), refusing clients until linked
        or for ``hold`` s, and record it once ready. False: a port asked for was taken (the
        broker exited saying so)."""
        log = self.dir / f"{name}.log"
        ready = self.dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        with ready.open("wb") as out, log.open("ab") as err:
            # Detached on purpose (not asyncio's subprocess): it must outlive this event loop.
            proc = subprocess.Popen(  # noqa: ASYNC220
                serve_command(
                    name,
                    pki=self.pki,
                    host=self.host,
                    routing=self.routing,
                    extra_args=[
                        *self.config_of(name, ports)[1:],
                        *(("--hold-clients", repr(hold)) if hold else ()),
                    ],
                    ports=ports,
                ),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=broker_env(self.state["token"]),
                start_new_session=True,  # the overlay outlives this command
            )
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            for line in ready.read_text(errors="replace").splitlines():
                if line.startswith(READY_PREFIX):
                    addr = json.loads(line[len(READY_PREFIX) :])
                    self._children[proc.pid] = proc
                    self.brokers[name] = {
                        "pid": proc.pid,
                        "listen": addr["listen"],
                        "link": addr.get("link", addr["listen"]),
                        "admin": addr["admin"],
                        **({"gateway": addr["gateway"]} if "gateway" in addr else {}),
                        **({"mqtt": addr["mqtt"]} if "mqtt" in addr else {}),
                        "log": str(log),
                        "config": self.config_of(name),
                    }
                    self.save()
                    return True
            if proc.poll() is not None:
                if proc.returncode == EXIT_ADDRESS_IN_USE and ports:
                    return False
                raise RuntimeError(f"broker {name} exited with {proc.returncode}; see {log}")
            await asyncio.sleep(0.05)
        proc.kill()
        raise RuntimeError(f"broker {name} did not report ready within 30s; see {log}")

    async def wait_ready(self, name: str, within: float) -> None:
        """Until the broker answers ready; a process that died meanwhile is told at once
        (ConnectionError: the executor's retry of an add-leaf starts it again), not after
        ``within`` s of knocking on a dead port."""
        deadline = time.monotonic() + within
        while not await self.admin(name).readyz():
            if await self.gone(name):
                raise ConnectionError(self._why_down(name, ProcessLookupError()))
            if await self.failed(name):  # the retry's create_broker starts it anew
                raise ConnectionError(f"broker {name} reports itself failed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"broker {name} not ready after {within}s")
            await asyncio.sleep(0.05)

    async def gone(self, name: str) -> bool:
        info = self.brokers.get(name)
        return info is None or not process_alive(int(info["pid"]))

    async def failed(self, name: str) -> bool:
        """Whether broker ``name`` answers and reports itself failed (``/healthz`` 500): not
        merely silent (paused, busy), which a restart would not mend but lose."""
        state: str = (await self.health_of(name))["state"]
        return state == "failed"

    async def delete_broker(self, name: str) -> None:
        info = self.brokers.pop(name, None)
        admin = self._admins.pop(name, None)
        if admin is not None:
            await admin.close()
        if info is not None:
            await _stop(info["pid"])
            self._children.pop(info["pid"], None)
        self.save()

    def address(self, name: str) -> str:
        return str(self.brokers[name]["listen"])

    def link_address(self, name: str) -> str:
        info = self.brokers[name]
        return str(info.get("link") or info["listen"])  # a state dir from before link ports

    def admin(self, name: str) -> AdminClient:
        client = self._admins.get(name)
        if client is None:
            client = self._admins[name] = AdminClient(
                self.brokers[name]["admin"], self.state["token"], tls=self.admin_tls
            )
        return client

    @property
    def admin_tls(self) -> ssl.SSLContext | None:
        """Verifies the brokers' admin API certificates (None: plaintext overlay)."""
        return self.pki.verify_context() if self.pki is not None else None

    @property
    def credentials(self) -> Credentials:
        """A client of this overlay: the local user's certificate (``pki/clients/canopy``)."""
        return Credentials.from_pki(self.pki.dir) if self.pki is not None else Credentials()

    # -- queries ----------------------------------------------------------------------------

    async def live_links(self) -> list[tuple[str, str]]:
        """The links the brokers report (each link once), the live tree. Raises
        :class:`BrokerDownError` naming the first broker that does not answer: planning from a
        partial view would undo links that only look missing."""
        links: set[tuple[str, str]] = set()
        for name in list(self.brokers):
            status = await self._status_or_down(name)
            for n in status.get("neighbours", []):
                if n.get("closing"):
                    continue
                a, b = sorted((name, str(n["peer"])))
                links.add((a, b))
        return sorted(links)

    async def live_tree(self, within: float = 15.0) -> list[tuple[str, str]]:
        """:meth:`live_links`, once they are one tree over the brokers. Between a broker's death
        and its repair (a second at most by default), or while a restarted broker is not yet
        linked, they are not; ``canopy apply`` then planned from that view and failed with the
        planner's traceback (found by `canopy bench chaos --seed 37`). It waits ``within``
        seconds for the overlay to be whole, then raises :class:`NotOneTreeError` saying
        what is wrong."""
        deadline = time.monotonic() + within
        while True:
            links = await self.live_links()
            problem = tree_problem(self.brokers, links)
            if problem is None:
                return links
            if time.monotonic() >= deadline:
                raise NotOneTreeError(
                    f"the live overlay is not one tree after {within:g}s: {problem}. A repair "
                    "or the supervisor's restore is under way (see `canopy status`); apply "
                    "again once every broker is linked"
                )
            await asyncio.sleep(0.25)

    async def _status_or_down(self, name: str, within: float = 5.0) -> dict[str, Any]:
        try:
            async with asyncio.timeout(within):
                return await self.admin(name).status()
        except (aiohttp.ClientError, OSError, AdminError, TimeoutError) as exc:
            dead = not process_alive(int(self.brokers[name]["pid"]))
            raise BrokerDownError(self._why_down(name, exc), dead=dead) from None

    def _why_down(self, name: str, exc: BaseException) -> str:
        info = self.brokers[name]
        if not process_alive(int(info["pid"])):
            return f"broker {name} is dead (process {info['pid']} is gone; log: {info.get('log')})"
        return f"broker {name} does not answer at {info['admin']}: {exc or type(exc).__name__}"

    async def health(self, within: float = 2.0) -> dict[str, dict[str, Any]]:
        """Every broker's state (one of :data:`BROKER_STATES`), with its status when it answers
        and the reason when it does not; never raises for a broker that is down."""
        names = sorted(self.brokers)
        results = await asyncio.gather(*(self.health_of(n, within) for n in names))
        return dict(zip(names, results, strict=True))

    async def health_of(self, name: str, within: float = 2.0) -> dict[str, Any]:
        """One broker's part of :meth:`health`."""
        info = self.brokers[name]
        if not process_alive(int(info["pid"])):
            return {"state": "dead", "why": self._why_down(name, ProcessLookupError())}
        try:
            status = await self._status_or_down(name, within)
        except BrokerDownError as exc:
            return {"state": "unreachable", "why": str(exc)}
        if await self.admin(name).reports_failed():
            return {"state": "failed", "status": status, "why": f"broker {name} failed"}
        return {"state": "up", "status": status}

    @staticmethod
    def reported_neighbours(health: Mapping[str, Mapping[str, Any]]) -> dict[str, set[str]]:
        """What each broker that is up reports as its neighbours, closing links left out (the
        shape of ``KubernetesBackend.neighbours``), from :meth:`health`'s answer."""
        return status_neighbours({n: h["status"] for n, h in health.items() if h["state"] == "up"})

    async def close(self) -> None:
        for client in self._admins.values():
            await client.close()
        self._admins.clear()

    # -- the supervisor (commands/supervise.py) ---------------------------------------------

    @property
    def supervisor_pid_file(self) -> Path:
        return self.dir / "supervisor.pid"

    def supervisor_pid(self) -> int | None:
        """The running supervisor's pid, or None (no file, or its process is gone)."""
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.supervisor_pid_file.read_text().strip())
            if process_alive(pid):
                return pid
        return None

    def start_supervisor(self, interval: float = 0.5) -> int:
        """Start the overlay's supervisor unless one runs; returns its pid. Detached like the
        brokers (it must outlive ``canopy up``); its log is ``supervisor.log``."""
        pid = self.supervisor_pid()
        if pid is not None:
            return pid
        env = broker_env()
        here = str(Path(__file__).resolve().parents[2])  # the canopy_operator package's root
        env["PYTHONPATH"] = os.pathsep.join([here, env["PYTHONPATH"]])
        command = [sys.executable, "-m", "canopy_operator.cli", "supervise"]
        command += ["--state-dir", str(self.dir.parent), "--overlay", self.dir.name]
        command += ["--interval", str(interval)]
        with (self.dir / "supervisor.log").open("ab") as log:
            proc = subprocess.Popen(  # detached on purpose, like the brokers
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self._children[proc.pid] = proc
        self.supervisor_pid_file.write_text(f"{proc.pid}\n")
        return proc.pid

    async def stop_supervisor(self) -> None:
        pid = self.supervisor_pid()
        if pid is not None:
            await _stop(pid)
            child = self._children.pop(pid, None)
            if child is not None:
                child.poll()
        self.supervisor_pid_file.unlink(missing_ok=True)

    async def down(self) -> None:
        await self.stop_supervisor()  # first: it would restore what we stop
        await self.close()
        await asyncio.gather(*(_stop(info["pid"]) for info in self.brokers.values()))
        for child in self._children.values():
            child.poll()  # reaped by _stop already; this tells the Popen so
        self._children.clear()
        self.state["brokers"] = {}
        self.state.pop("progress", None)
        self.save()


def _free(host: str, ports: Mapping[str, int]) -> dict[str, int]:
    """Those of ``ports`` nothing listens on now (as a broker binds: address reuse on, so a
    connection of its last process waiting out its close does not count)."""
    free = {}
    for key, port in ports.items():
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            free[key] = port
    return free


def _ports(info: Mapping[str, Any]) -> dict[str, int]:
    """The ports a broker's record says it listened on (``listen``, ``link``, ``admin`` and,
    when it served them, ``gateway`` and ``mqtt``)."""
    return {
        key: int(str(info[key]).rpartition(":")[2])
        for key in ("listen", "link", "admin", "gateway", "mqtt")
        if info.get(key)
    }


async def _stop(pid: int, within: float = 10.0, first: signal.Signals = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, first)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG never blocks
            if done:
                return
        if not process_alive(pid):
            return
        await asyncio.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
