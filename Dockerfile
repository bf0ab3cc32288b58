# syntax=docker/dockerfile:1
# First working image: the broker process (and the `canopy` CLI). The shipping issue adds the
# operator and miner targets; this file stays the single source of images.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY broker_image ./broker_image
COPY operator ./operator
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim AS broker
COPY --from=build /install /usr/local
RUN useradd --system --uid 10001 --no-create-home canopy
USER 10001
EXPOSE 7000 8080
HEALTHCHECK --interval=10s --timeout=3s CMD ["python", "-c", "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
ENTRYPOINT ["canopy-broker", "serve"]
CMD ["--listen", "0.0.0.0:7000", "--admin", "0.0.0.0:8080", "--token-file", "/var/run/canopy/token"]
