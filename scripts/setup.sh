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
# PySpark in local mode). Graphviz is optional (`canopy graph` falls back to matplotlib).
need_apt=()
if ! command -v java >/dev/null 2>&1; then
    need_apt+=(openjdk-17-jre-headless)
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
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[setup] installing canopy[$EXTRAS] into .venv (first time takes a minute)" >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
    echo "$want" > "$stamp"
fi
