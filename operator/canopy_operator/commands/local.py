"""`canopy up | apply | status | graph | down`: the operator's local face.

The same manifests as for Kubernetes; brokers run as local processes; state lives in
``.canopy/<overlay>/`` (or ``--state-dir``). ``apply`` plans from what the brokers report is live
(so an interrupted apply is simply applied again) and shows each step as it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from canopy_broker.progress import Progress
from canopy_operator.backends.local import BrokerDownError, LocalBackend
from canopy_operator.commands.cluster import (
    add_cluster_arguments,
    add_output_argument,
    dump,
    run_cluster_status,
)
from canopy_operator.commands.plan import load_overlay
from canopy_operator.draw import draw
from canopy_operator.executor import Executor, StepError, replace_broker
from canopy_operator.model import rollout
from canopy_operator.model.planner import LiveOverlay, Plan, plan
from canopy_operator.model.topology import OverlaySpec, SpecError, parse_overlay

DEFAULT_STATE = Path(".canopy")
T = TypeVar("T")


def add_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, helptext in (
        ("up", "start a local overlay from a BrokerOverlay manifest"),
        ("apply", "move the local overlay to a manifest, live (plan + execute)"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("file", type=Path)
        p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE)
        p.add_argument("--json", action="store_true", help="one JSON object on the last line")
        if name == "up":
            p.add_argument(
                "--insecure",
                action="store_true",
                help="a new overlay without TLS or authentication (by default `up` makes a CA "
                "and certificates in STATE_DIR/NAME/pki)",
            )
            p.add_argument(
                "--no-supervisor",
                action="store_true",
                help="do not start the supervisor that restores dead brokers (see `supervise`)",
            )
        p.set_defaults(func=run_apply)
    for name, helptext in (
        ("status", "show the local overlay's brokers and links"),
        ("down", "stop the local overlay's brokers and forget it (its logs stay)"),
        ("graph", "draw the live local topology (-o file.png|.svg|.dot)"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--overlay", help="overlay name (default: the only one in the state dir)")
        p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE)
        if name == "status":
            p.add_argument("--json", action="store_true", help="the table, then one JSON object")
            add_output_argument(p)
            p.add_argument(
                "--cluster",
                action="store_true",
                help="the cluster's BrokerOverlays instead (what `kubectl canopy status` shows)",
            )
            add_cluster_arguments(p, all_namespaces=True)
        if name == "graph":
            p.add_argument("-o", "--output", type=Path, default=Path("overlay.png"))
        p.set_defaults(func={"status": run_status, "down": run_down, "graph": run_graph}[name])
    p = sub.add_parser(
        "roll",
        help="replace the local overlay's brokers one at a time, loss-free (e.g. after an "
        "upgrade); `apply` does it on its own for brokers whose configuration changed",
    )
    p.add_argument("--overlay", help="overlay name (default: the only one in the state dir)")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE)
    p.add_argument(
        "--broker", action="append", default=[], help="replace only this one (repeatable)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    p.set_defaults(func=run_roll)


def overlay_dir(state_dir: Path, name: str | None) -> Path:
    """The directory of the running overlay ``name`` (by default the only one) in
    ``state_dir``. A name with no overlay is an error that lists those there: it used to make
    an empty directory and report a healthy overlay of 0 brokers, and from then on the
    default refused, two overlays being there."""
    found = sorted(p for p in state_dir.glob("*") if (p / "state.json").exists())
    names = ", ".join(p.name for p in found) or "none"
    if name:
        where = state_dir / name
        if Path(name).name != name or name in (".", "..") or where not in found:
            raise SystemExit(f"error: no overlay {name!r} in {state_dir} (overlays there: {names})")
        return where
    if len(found) != 1:
        raise SystemExit(f"error: pass --overlay (overlays in {state_dir}: {names})")
    return found[0]


async def apply(
    spec: OverlaySpec,
    manifest: dict[str, Any],
    backend: LocalBackend,
    log: Any = print,
    settle_within: float = 15.0,
) -> tuple[Plan, Executor, float]:
    """Plan from the live brokers to ``spec`` and execute; returns the plan and the executor.
    ``settle_within``: how long to wait for the live links to be one tree (see
    :meth:`LocalBackend.live_tree`)."""
    live = sorted(backend.brokers)
    if not live:  # a new overlay: its first broker, then the rest join as leaves
        first = spec.broker_names[0]
        await backend.create_broker(first)
        await backend.wait_ready(first, 30.0)
        live = [first]
    links = await backend.live_tree(within=settle_within)
    p = plan(LiveOverlay(tuple(live), tuple(links)), spec)
    generation = int(backend.state.get("generation", 0)) + 1
    total = len(p.steps)

    def event(reason: str, message: str) -> None:
        if reason == "StepDone":
            log(f"  [{len(executor.results)}/{total}] {message}")

    executor = local_executor(spec, backend, event)
    started = time.perf_counter()
    await executor.run(p, generation)
    wall = time.perf_counter() - started
    backend.state["generation"] = generation
    backend.state["spec"] = manifest
    backend.save()
    return p, executor, wall


async def roll(
    spec: OverlaySpec, backend: LocalBackend, brokers: list[str], log: Any = None
) -> list[dict[str, Any]]:
    """Replace ``brokers`` one at a time, loss-free (:mod:`canopy_operator.model.rollout`): each
    goes out by exchanges (its clients migrated to a neighbour) and comes back as a new process
    started with the overlay's current configuration. Progress is in ``state.json``
    (``rollout``, shown by ``canopy status``) and, without ``log``, shown as a bar of the
    brokers (lines when not on a terminal); the caller holds the overlay's lock."""
    todo = rollout.order(await backend.live_links(), brokers)
    if log is None:
        with Progress("roll", len(todo)) as shown:
            return await _roll(spec, backend, todo, shown.note, shown.step)
    return await _roll(spec, backend, todo, log, log)


async def _roll(
    spec: OverlaySpec,
    backend: LocalBackend,
    todo: list[str],
    log: Callable[[str], None],
    done: Callable[[str], None],
) -> list[dict[str, Any]]:
    record: dict[str, Any] = {"todo": todo, "done": [], "current": None, "started": time.time()}
    backend.state["rollout"] = record
    backend.save()

    async def live() -> LiveOverlay:
        return LiveOverlay(tuple(sorted(backend.brokers)), tuple(await backend.live_tree()))

    async def run_plan(p: Plan) -> None:
        await run_own_plan(spec, backend, p, log, indent="    ")

    results = []
    for i, b in enumerate(todo, 1):
        log(f"replacing {b} ({i}/{len(todo)}): out by exchanges, clients migrated, back anew")
        record["current"] = b
        backend.save()
        results.append(await replace_broker(b, spec, live, run_plan))
        record["done"].append(b)
        done(f"{b} replaced in {results[-1]['seconds']}s ({results[-1]['steps']} steps)")
    record.update(current=None, finished=time.time())
    backend.save()
    return results


def local_executor(spec: OverlaySpec, backend: LocalBackend, on_event: Any) -> Executor:
    """The executor of a local overlay's plans: its progress in the state dir, the spec's
    ordering and exchange lease."""
    return Executor(
        backend,
        ProgressFile(backend),
        spec.name,
        ordering=spec.ordering,
        lease=spec.lease_seconds,
        on_event=on_event,
    )


async def run_own_plan(
    spec: OverlaySpec, backend: LocalBackend, the_plan: Plan, log: Any, indent: str = "  "
) -> None:
    """Run a plan the overlay makes for itself (a roll-out's, a restore's) under a generation
    of its own, so that its exchange ids are never an earlier plan's (an apply, by contrast,
    keeps its generation until it has finished, so that applying again resumes it)."""
    generation = int(backend.state.get("generation", 0)) + 1
    backend.state["generation"] = generation
    backend.save()

    def event(reason: str, message: str) -> None:
        if reason in ("StepDone", "StepFailed"):
            log(f"{indent}{message}")

    executor = local_executor(spec, backend, event)
    await executor.run(the_plan, generation)


class ProgressFile:
    """The executor's progress, kept in ``state.json`` (a restarted apply continues from it)."""

    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend

    async def save(self, progress: dict[str, Any]) -> None:
        await self.backend.save_progress(progress)


def run_apply(args: argparse.Namespace) -> int:
    try:
        spec = load_overlay(args.file)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    manifest = next(
        d
        for d in yaml.safe_load_all(args.file.read_text())
        if d and d.get("kind") == "BrokerOverlay"
    )

    async def go() -> dict[str, Any]:
        backend = LocalBackend(
            args.state_dir / spec.name,
            routing=spec.routing,
            broker_args=spec.broker_args(),
            zones=spec.zone_of(),
            gateway=spec.gateway,
            mqtt=spec.mqtt,
            insecure=getattr(args, "insecure", False),
        )
        try:
            rolled: list[dict[str, Any]] = []
            if backend.brokers:
                # Wait for a whole tree before the lock, not under it: what makes it whole may
                # be the supervisor's restore, which takes the same lock (review). Under it,
                # apply checks again, and says what is wrong (a dead broker, or not one tree).
                with contextlib.suppress(BrokerDownError):
                    await backend.live_tree()
            async with backend.locked():  # the supervisor may be restoring: after it
                backend.reload()
                if args.command == "up":
                    backend.state["supervised"] = not args.no_supervisor
                try:
                    # Waited for outside the lock: a short look here, the restore being over.
                    p, _executor, wall = await apply(spec, manifest, backend, settle_within=2.0)
                    configs = {n: b.get("config") for n, b in backend.brokers.items()}
                    changed = rollout.stale(configs, backend.config_of)
                    if changed:
                        print(f"broker configuration changed: rolling {len(changed)} brokers")
                        rolled = await roll(spec, backend, changed)
                except BrokerDownError as exc:
                    if exc.dead and backend.supervisor_pid() is not None:
                        raise BrokerDownError(
                            f"{exc}; the supervisor restores it (see `canopy status`), "
                            "apply again once it is back",
                            dead=True,
                        ) from None
                    raise
                links = await backend.live_links()
                supervisor = (
                    backend.start_supervisor() if backend.state.get("supervised", True) else None
                )
        finally:
            await backend.close()
        return {
            "overlay": spec.name,
            "steps": len(p.steps),
            "exchanges": len(p.exchanges),
            "seconds": round(wall, 2),
            "brokers": sorted(backend.brokers),
            "links": [list(e) for e in links],
            "supervisor": supervisor,
            "rolled": rolled,
        }

    try:
        result = asyncio.run(go())
    except StepError as exc:
        print(f"error: {exc}; the overlay is consistent, apply again to continue", file=sys.stderr)
        return 1
    print(
        f"{result['overlay']}: {result['steps']} steps ({result['exchanges']} exchanges) in "
        f"{result['seconds']}s; {len(result['brokers'])} brokers, {len(result['links'])} links"
    )
    print(
        f"supervisor: pid {result['supervisor']} restores dead brokers "
        f"(log: {args.state_dir / result['overlay'] / 'supervisor.log'})"
        if result["supervisor"]
        else "supervisor: none (--no-supervisor): a dead broker stays dead"
    )
    pki = args.state_dir / result["overlay"] / "pki"
    print(
        f"security: TLS, credentials in {pki}"
        if pki.is_dir()
        else "security: NONE (--insecure): plaintext, anybody may connect"
    )
    if args.json:
        print(json.dumps(result))
    return 0


def with_backend(args: argparse.Namespace, query: Callable[[LocalBackend], Awaitable[T]]) -> T:
    """Run one query against the local overlay named by the arguments, then close its clients."""
    backend = LocalBackend(overlay_dir(args.state_dir, args.overlay))

    async def go() -> T:
        try:
            return await query(backend)
        finally:
            await backend.close()

    return asyncio.run(go())


DEGRADED = 3
"""``canopy status`` exits with this when a broker is not up or a link is not connected."""


def run_status(args: argparse.Namespace) -> int:
    """Every broker's state and links; exit 0 when all are up and linked, :data:`DEGRADED`
    otherwise. A dead or hanging broker is named, never a traceback. ``--cluster``: the
    cluster's overlays instead. ``-o json|yaml``: the data alone; the local table already has
    every column, so ``-o wide`` prints it as it is."""
    if args.cluster:
        return run_cluster_status(args)

    async def query(backend: LocalBackend) -> dict[str, Any]:
        health = await backend.health()
        links: dict[tuple[str, str], set[str]] = {}  # link -> the states its ends report
        brokers: dict[str, Any] = {}
        for n, h in health.items():
            s = h.get("status") or {}
            neighbours = [x for x in s.get("neighbours", []) if not x.get("closing")]
            for x in neighbours:
                a, b = sorted((n, str(x["peer"])))
                links.setdefault((a, b), set()).add(str(x.get("state")))
            brokers[n] = {
                "state": h["state"],
                "address": backend.address(n),
                "clients": s.get("clients"),
                "neighbours": [x["peer"] for x in neighbours],
                "zone": (s.get("placement") or {}).get("zone", ""),
                "gateway": _gateway_url(backend, n),
                "mqtt": _gateway_url(backend, n, "mqtt"),
                "standby": [x["peer"] for x in s.get("standby", []) if x.get("state") == "up"],
                "restarts": int((backend.state.get("restarts") or {}).get(n, 0)),
                **({"why": h["why"]} if "why" in h else {}),
            }
        repairs = sorted(
            (
                {"broker": n, **r}
                for n, h in health.items()
                for r in (h.get("status") or {}).get("repairs", [])
            ),
            key=lambda r: (r.get("at", 0), r["broker"]),
        )
        down_links = sorted(e for e, states in links.items() if states != {"up"})
        problems = [f"{n}: {b['why']}" for n, b in brokers.items() if b["state"] != "up"]
        problems += [f"link {a}-{b} is not connected" for a, b in down_links]
        return {
            "overlay": backend.dir.name,
            "generation": backend.state.get("generation", 0),
            "supervisor": backend.supervisor_pid(),
            "restoring": bool(backend.state.get("restoring")),
            "last_restore": backend.state.get("last_restore"),
            "rollout": backend.state.get("rollout"),
            "healthy": not problems,
            "problems": problems,
            "brokers": brokers,
            "links": [list(e) for e in sorted(links)],
            "links_down": [list(e) for e in down_links],
            "repairs": repairs,
        }

    data = with_backend(args, query)
    if args.output in ("json", "yaml"):
        dump(data, args.output)
        return 0 if data["healthy"] else DEGRADED
    for n, b in data["brokers"].items():
        print(
            f"{n:<12} {b['state']:<12} {b['address']:<22} clients {b['clients']!s:<4} "
            f"restarts {b['restarts']:<3} zone {b['zone'] or '-':<8} "
            f"neighbours {', '.join(b['neighbours']) or '-'}"
            + (f" (standby {', '.join(b['standby'])})" if b["standby"] else "")
            + (f" gateway {b['gateway']}" if b["gateway"] else "")
            + (f" mqtt {b['mqtt']}" if b["mqtt"] else "")
        )
    verdict = "healthy" if data["healthy"] else "DEGRADED"
    print(
        f"{len(data['brokers'])} brokers, {len(data['links'])} links "
        f"(generation {data['generation']}): {verdict}"
    )
    for problem in data["problems"]:
        print(f"  {problem}")
    roll_state = data["rollout"]
    if roll_state and roll_state.get("current"):
        print(
            f"rolling replacement: {len(roll_state['done'])}/{len(roll_state['todo'])} done, "
            f"replacing {roll_state['current']}"
        )
    pid, last = data["supervisor"], data["last_restore"]
    print(
        (f"supervisor: pid {pid}" if pid else "supervisor: not running")
        + (", restoring the declared shape" if data["restoring"] else "")
        + (
            f"; last restore brought back {', '.join(last['brokers']) or 'links'} "
            f"in {last['seconds']}s ({last['steps']} steps)"
            if last
            else ""
        )
    )
    for r in data["repairs"]:
        state = f"replayed {r['replayed']}" if "replayed" in r else "waiting for its routes"
        print(
            f"  repair: {r['broker']} dropped dead {r['dead']}, linked to "
            f"{', '.join(r['linked']) or 'nobody new'} ({state})"
        )
    if args.json:
        print(json.dumps(data))
    return 0 if data["healthy"] else DEGRADED


def run_graph(args: argparse.Namespace) -> int:
    if args.output.suffix not in (".png", ".svg", ".dot"):
        raise SystemExit(f"error: -o must end in .png, .svg or .dot, got {str(args.output)!r}")
    if not args.output.parent.is_dir():
        raise SystemExit(
            f"error: -o {str(args.output)!r}: no directory {str(args.output.parent)!r}"
        )

    async def query(backend: LocalBackend) -> tuple[list[str], list[tuple[str, str]], str]:
        return sorted(backend.brokers), await backend.live_links(), backend.dir.name

    brokers, links, name = with_backend(args, query)
    print(f"wrote {draw(brokers, links, args.output, title=name)}")
    return 0


def run_roll(args: argparse.Namespace) -> int:
    """Replace brokers one at a time with new processes (the overlay's current configuration,
    the installed Canopy): out by exchanges with their clients migrated, back as declared."""

    async def go(backend: LocalBackend) -> list[dict[str, Any]]:
        async with backend.locked():
            backend.reload()
            manifest = backend.state.get("spec")
            if not manifest:
                raise SystemExit("error: the overlay has no applied manifest yet (canopy up)")
            spec = parse_overlay(manifest)
            unknown = sorted(set(args.broker) - set(backend.brokers))
            if unknown:
                raise SystemExit(f"error: no broker {', '.join(unknown)} in {backend.dir.name}")
            await backend.live_links()  # every broker answers, or it says which does not
            return await roll(spec, backend, args.broker or sorted(backend.brokers))

    try:
        results = with_backend(args, go)
    except StepError as exc:
        print(f"error: {exc}; the overlay is consistent, roll again to continue", file=sys.stderr)
        return 1
    total = sum(r["seconds"] for r in results)
    print(f"replaced {len(results)} brokers one at a time in {total:.2f}s, losing nothing")
    if args.json:
        print(json.dumps({"replaced": results, "seconds": round(total, 3)}))
    return 0


def run_down(args: argparse.Namespace) -> int:
    backend = LocalBackend(overlay_dir(args.state_dir, args.overlay))
    asyncio.run(backend.down())  # the supervisor first, then every broker
    # Forgotten: no longer listed, and a new `up` of the same name starts afresh (not with
    # the old one's restarts and repairs). Its logs and credentials stay.
    backend.state_file.unlink(missing_ok=True)
    print(
        f"stopped overlay {backend.dir.name} (its supervisor and brokers) and forgot it; "
        f"its logs and credentials stay in {backend.dir}"
    )
    return 0


def _gateway_url(backend: LocalBackend, broker: str, kind: str = "gateway") -> str | None:
    """Where broker ``broker``'s HTTP gateway (``kind="mqtt"``: MQTT listener) answers (None:
    the overlay has none)."""
    where = (backend.brokers.get(broker) or {}).get(kind)
    if not where:
        return None
    scheme = "http" if kind == "gateway" else "mqtt"
    return f"{scheme if backend.state.get('insecure') else scheme + 's'}://{where}"
