# syntax=docker/dockerfile:1
# Canopy's images, one target each (tests/deploy/test_dockerfile.py checks this file):
#
#   docker build --target broker   -t canopy-broker:0.1.0   .   # a broker process (the operator's pods)
#   docker build --target operator -t canopy-operator:0.1.0 .   # `canopy operator` (kopf)
#   docker build --target miner    -t canopy-miner:0.1.0    .   # `canopy mine` (PySpark + Java 17)
#
# The Helm chart (charts/canopy) expects these three repositories with one shared tag. Every
# final stage runs as the unprivileged user 10001:10001 from a read-only root filesystem (in the
# cluster) and holds no compiler and no pip: the virtual environment /opt/canopy is built in a
# build stage and copied over.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: the project (and, for the miner, pyspark) in a venv without pip of its own ----------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# A C compiler for the compiled core (setup.py: mypyc); it stays in this stage. Every
# dependency ships as a wheel for CPython 3.11 on Linux.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py README.md ./
COPY broker_image ./broker_image
COPY operator ./operator
RUN python -m venv --without-pip /opt/canopy \
    && python -m pip --python /opt/canopy/bin/python install --no-cache-dir .

FROM build AS build-miner
# pyspark (the `mining` extra) is a pure-Python source archive; building it needs no compiler.
RUN python -m pip --python /opt/canopy/bin/python install --no-cache-dir ".[mining]"

# -- a Java 17 runtime for Spark, taken from the Temurin image (no apt, nothing to pin) ---------
FROM eclipse-temurin:17-jre AS jre

# -- what every final stage shares ---------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/canopy/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# No pip or setuptools in the images (nothing installs at run time); one unprivileged user.
RUN python -m pip uninstall --no-cache-dir --yes pip setuptools wheel \
    && groupadd --system --gid 10001 canopy \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin canopy

# -- the project's venv, run as the unprivileged user (broker and operator) ---------------------
FROM runtime AS app
COPY --from=build /opt/canopy /opt/canopy
USER 10001:10001

# -- broker: `canopy-broker serve` (clients on 7000, links on 7001; admin API, /metrics, probes on 8080)
FROM app AS broker
EXPOSE 7000 7001 8080
# The admin API speaks HTTPS once the broker has TLS material (the default CMD expects it mounted
# at /etc/canopy/tls, a TLS Secret's layout); the probe only asks whether it answers.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s \
    CMD ["python", "-c", "import ssl, urllib.request as u; u.urlopen('https://127.0.0.1:8080/healthz', timeout=2, context=ssl._create_unverified_context())"]
ENTRYPOINT ["canopy-broker"]
CMD ["serve", "--name", "broker", "--listen", "0.0.0.0:7000", "--link-listen", "0.0.0.0:7001", "--admin", "0.0.0.0:8080", "--token-file", "/var/run/canopy/token", "--tls-dir", "/etc/canopy/tls"]

# -- operator: `canopy operator` (metrics on 8000, kopf's liveness endpoint on 8081) ------------
FROM app AS operator
EXPOSE 8000 8081
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8081/healthz', timeout=4)"]
ENTRYPOINT ["canopy", "operator"]
CMD ["--metrics-port", "8000", "--liveness", "http://0.0.0.0:8081/healthz"]

# -- miner: `canopy mine` (PySpark on Java 17; a batch job, so no health check) ------------------
FROM runtime AS miner
ENV JAVA_HOME=/opt/java/openjdk \
    PATH=/opt/java/openjdk/bin:/opt/canopy/bin:$PATH \
    HOME=/tmp \
    SPARK_LOCAL_IP=127.0.0.1
COPY --from=jre /opt/java/openjdk /opt/java/openjdk
COPY --from=build-miner /opt/canopy /opt/canopy
USER 10001:10001
HEALTHCHECK NONE
ENTRYPOINT ["canopy", "mine"]
CMD ["--help"]
