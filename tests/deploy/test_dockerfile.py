"""The Dockerfile: hadolint passes with no warnings, and (no Docker engine here, so by reading it)
the three targets exist, run as a non-root user, carry no build tools, have the health checks
and commands the code and the chart expect, and the miner brings Java and pyspark."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from canopy_broker.cli import build_parser as broker_parser
from canopy_operator.backends import manifests
from canopy_operator.cli import build_parser as canopy_parser
from canopy_operator.model.topology import parse_overlay
from tests.tools import CHART, ROOT, run_tool

DOCKERFILE = ROOT / "Dockerfile"
TARGETS = ("broker", "operator", "miner")
BUILD_TOOLS = re.compile(
    r"\b(apt-get|apt|apk|yum|dnf)\b[^&;]*\binstall\b|\bpip\b[^&;]*\binstall\b"
    r"|\b(gcc|g\+\+|cc|clang|make|build-essential|cargo|rustc)\b"
)


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [arg for k, arg in self.instructions if k == keyword]


def parse(text: str) -> dict[str, Stage]:
    """Stages by name (or index): instructions with continuations joined, comments dropped,
    global ARG defaults substituted into FROM."""
    logical, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue
        buf += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            logical.append(buf.strip())
            buf = ""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for instr in logical:
        keyword, _, rest = instr.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            current = stages[name] = Stage(name, base)
        elif current is None:
            if keyword == "ARG" and "=" in rest:
                key, value = rest.split("=", 1)
                args[key] = value
        else:
            current.instructions.append((keyword, rest))
    return stages


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, base first."""
    out = [stages[name]]
    while out[0].base in stages:
        out.insert(0, stages[out[0].base])
    return out


def effective_user(stages: dict[str, Stage], name: str) -> str | None:
    users = [u for s in chain(stages, name) for u in s.all("USER")]
    return users[-1] if users else None


def problems(stages: dict[str, Stage]) -> list[str]:
    """What makes a final image unfit: a missing target, root, build tools."""
    found = []
    for target in TARGETS:
        if target not in stages:
            found.append(f"no target {target}")
            continue
        user = effective_user(stages, target)
        uid = (user or "0").split(":")[0]
        if not uid.isdigit() or int(uid) == 0:
            found.append(f"{target} runs as {user or 'root'} (want a numeric non-root uid)")
        for stage in chain(stages, target):
            for run in stage.all("RUN"):
                if BUILD_TOOLS.search(run):
                    found.append(f"{target} installs or runs build tools: {run}")
    return found


def exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list), f"not exec form: {value}"
    return [str(x) for x in parsed]


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse(DOCKERFILE.read_text())


def test_hadolint_is_clean() -> None:
    result = run_tool("hadolint", "--failure-threshold", "warning", str(DOCKERFILE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """Negative control: the check above can fail."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    assert run_tool("hadolint", str(bad)).returncode != 0


def test_three_non_root_targets_without_build_tools(stages: dict[str, Stage]) -> None:
    assert problems(stages) == []
    for target in TARGETS:
        # The venv comes from a build stage; the final stages only copy it.
        copies = [c for s in chain(stages, target) for c in s.all("COPY")]
        sources = [c for c in copies if "/opt/canopy " in c + " "]
        assert sources and all(c.startswith("--from=build") for c in sources), target


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (
            lambda t: t.replace(
                "/opt/canopy\nUSER 10001:10001\nHEALTHCHECK NONE", "/opt/canopy\nHEALTHCHECK NONE"
            ),
            "miner runs as",
        ),
        (
            lambda t: t.replace("AS broker\n", "AS broker\nUSER root\n"),
            "broker runs as",
        ),
        (lambda t: t.replace("AS operator", "AS op"), "no target operator"),
        (
            lambda t: t.replace("HEALTHCHECK NONE", "RUN apt-get update && apt-get install -y gcc"),
            "miner installs",
        ),
    ],
)
def test_the_checks_catch_a_broken_dockerfile(edit: object, problem: str) -> None:
    text = edit(DOCKERFILE.read_text())  # type: ignore[operator]
    assert text != DOCKERFILE.read_text()
    assert any(problem in p for p in problems(parse(text))), problems(parse(text))


def test_the_broker_image_serves_the_ports_the_operator_uses(stages: dict[str, Stage]) -> None:
    broker = stages["broker"]
    (expose,) = broker.all("EXPOSE")
    assert sorted(map(int, expose.split())) == sorted(
        [manifests.BROKER_PORT, manifests.LINK_PORT, manifests.ADMIN_PORT]
    )
    (entrypoint,) = broker.all("ENTRYPOINT")
    (cmd,) = broker.all("CMD")
    # The operator's pods run the same program with their own arguments.
    pod = manifests.pod_manifest(
        parse_overlay(
            {
                "kind": "BrokerOverlay",
                "metadata": {"name": "o"},
                "spec": {"brokers": [{"name": "b"}]},
            }
        ),
        "b",
        "ns",
        {},
        "img",
    )
    assert exec_form(entrypoint) == pod["spec"]["containers"][0]["command"]
    args = broker_parser().parse_args(exec_form(cmd))
    assert args.admin.endswith(f":{manifests.ADMIN_PORT}") and args.listen.endswith(
        f":{manifests.BROKER_PORT}"
    )
    assert args.link_listen.endswith(f":{manifests.LINK_PORT}")
    (health,) = broker.all("HEALTHCHECK")
    assert f"127.0.0.1:{manifests.ADMIN_PORT}/healthz" in health


def test_the_operator_image_runs_canopy_operator_with_the_charts_ports(
    stages: dict[str, Stage],
) -> None:
    operator = stages["operator"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]
    command = exec_form(operator.all("ENTRYPOINT")[0]) + exec_form(operator.all("CMD")[0])
    assert command[:2] == ["canopy", "operator"]
    args = canopy_parser().parse_args(command[1:])
    assert args.metrics_port == values["metrics"]["port"]
    assert args.liveness == f"http://0.0.0.0:{values['healthPort']}/healthz"
    (health,) = operator.all("HEALTHCHECK")
    assert f"127.0.0.1:{values['healthPort']}/healthz" in health


def test_the_miner_image_has_java_17_and_pyspark(stages: dict[str, Stage]) -> None:
    miner = stages["miner"]
    jre = [c.split()[0].removeprefix("--from=") for c in miner.all("COPY") if "java" in c]
    assert jre and stages[jre[0]].base.startswith("eclipse-temurin:17-jre")
    env = " ".join(miner.all("ENV"))
    assert "JAVA_HOME=/opt/java/openjdk" in env and "/opt/java/openjdk/bin" in env
    assert "HOME=/tmp" in env  # Spark writes under HOME; /tmp is the writable emptyDir
    venv = next(c for c in miner.all("COPY") if "/opt/canopy" in c)
    builder = venv.split()[0].removeprefix("--from=")
    installs = [r for s in chain(stages, builder) for r in s.all("RUN") if "install" in r]
    assert any('".[mining]"' in r or "'.[mining]'" in r for r in installs), installs
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'mining = \[[^\]]*"pyspark', pyproject)
    assert miner.all("HEALTHCHECK") == ["NONE"]  # a batch job: nothing to probe
    assert shlex.split(" ".join(exec_form(miner.all("ENTRYPOINT")[0]))) == ["canopy", "mine"]


def test_the_chart_names_the_three_images_after_the_targets() -> None:
    images = yaml.safe_load((CHART / "values.yaml").read_text())["image"]
    assert {t: images[t]["repository"] for t in TARGETS} == {t: f"canopy-{t}" for t in TARGETS}


def test_the_build_context_is_small() -> None:
    """.dockerignore keeps the venv, caches and the repository's history out of the context."""
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert (
        ignore[ignore.index("*")] == "*" and "!broker_image/" in ignore and "!operator/" in ignore
    )
    copied = {c.split()[0] for s in parse(DOCKERFILE.read_text()).values() for c in s.all("COPY")}
    allowed = {"pyproject.toml", "broker_image", "operator"}
    assert {c for c in copied if not c.startswith("--from")} <= allowed


def test_the_images_ship_the_compiled_core(stages: dict[str, Stage]) -> None:
    """The build stage has a C compiler and setup.py (mypyc compiles the core's matching);
    the final stages copy its venv and hold no compiler (checked above)."""
    build = stages["build"]
    runs = " ".join(build.all("RUN"))
    assert re.search(r"apt-get install[^&]*\bgcc\b", runs), runs
    assert any("setup.py" in c for c in build.all("COPY")), build.all("COPY")
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "!setup.py" in ignore and "**/*.so" in ignore
