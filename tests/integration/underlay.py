"""A real network between broker processes, that can be split: each broker in a network
namespace of its own, linked by a veth pair to this process's namespace, which routes between
them. A partition is a set of ``ip rule ... blackhole`` rules here: packets between the two
sides are dropped without a word (no reset, no ICMP), as a failed switch or a firewall drops
them, while every broker stays reachable from this namespace (the test's clients, admin calls).

Nothing on the machine is touched: a test using this runs in a network namespace of its own
(:func:`run_isolated` starts it again under ``unshare -n``), and every namespace and link made
here goes with the processes holding them.

Why not fault injection in the broker (``cut_link``): a partition must silence everything
between the two sides — overlay links, standby links, out-of-band channels, fence checks,
new dials — and only the network can do that without the broker's help."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# Set in the namespace run_isolated makes: the test body runs there.
ISOLATED = "CANOPY_TEST_NETNS"


def available() -> str | None:
    """Why this machine cannot make namespaces (None: it can)."""
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(["unshare", "-n", "true"], check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -n fails: {probe.stderr.strip()}"
    return None


def run_isolated(nodeid: str, timeout: float) -> None:
    """Run the test ``nodeid`` again in a network namespace of its own, and fail with its
    output if it fails there."""
    env = {**os.environ, ISOLATED: "1"}
    done = subprocess.run(
        [
            "unshare",
            "-n",
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-s",
            nodeid,
        ],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parents[2],
    )
    print(done.stdout[-20000:])
    assert done.returncode == 0, f"{nodeid} failed in its namespace:\n{done.stdout[-8000:]}"


def _ip(*args: str, holder: int | None = None) -> None:
    cmd = ["ip", *args] if holder is None else ["nsenter", "-t", str(holder), "-n", "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True)


class Underlay:
    """Hosts ``names``, each a namespace with the address ``10.77.<i>.2``; this namespace is
    the router (``10.77.<i>.1`` towards each)."""

    def __init__(self, names: Sequence[str]) -> None:
        assert os.environ.get(ISOLATED), "an underlay is made in a namespace of its own only"
        self.names = list(names)
        self._holders: dict[str, subprocess.Popen[bytes]] = {}
        self._rules: list[tuple[str, str]] = []
        _ip("link", "set", "lo", "up")
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        for i, name in enumerate(self.names, start=1):
            # The namespace lives as long as this process sleeping in it does.
            holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
            self._holders[name] = holder
            here, there = f"r{i}", f"h{i}"
            _ip("link", "add", here, "type", "veth", "peer", "name", there)
            _ip("link", "set", there, "netns", str(holder.pid))
            _ip("addr", "add", f"10.77.{i}.1/24", "dev", here)
            _ip("link", "set", here, "up")
            for args in (
                ("link", "set", "lo", "up"),
                ("addr", "add", f"10.77.{i}.2/24", "dev", there),
                ("link", "set", there, "up"),
                ("route", "add", "default", "via", f"10.77.{i}.1"),
            ):
                _ip(*args, holder=holder.pid)

    def host(self, name: str) -> str:
        return f"10.77.{self.names.index(name) + 1}.2"

    def wrap(self, name: str) -> list[str]:
        """The command prefix that runs a process on host ``name``."""
        return ["nsenter", "-t", str(self._holders[name].pid), "-n", "--"]

    def part(self, *sides: Sequence[str]) -> None:
        """Drop every packet between hosts of different ``sides``, both ways."""
        for i, side in enumerate(sides):
            for other in sides[i + 1 :]:
                for a in side:
                    for b in other:
                        for src, dst in ((a, b), (b, a)):
                            rule = (self.host(src), self.host(dst))
                            _ip("rule", "add", "from", rule[0], "to", rule[1], "blackhole")
                            self._rules.append(rule)

    def heal(self) -> None:
        """Every partition made by :meth:`part` is gone."""
        while self._rules:
            src, dst = self._rules.pop()
            _ip("rule", "del", "from", src, "to", dst, "blackhole")

    def close(self) -> None:
        for holder in self._holders.values():
            holder.kill()
            holder.wait()
        self._holders.clear()
