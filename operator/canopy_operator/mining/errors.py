"""The mining job's errors, importable without pyspark (the demo and the CLI catch them)."""

from __future__ import annotations


class MiningInputError(Exception):
    """The job's input cannot be mined as given; the message says what is wrong."""


class TelemetryError(MiningInputError):
    """The telemetry cannot be mined (nothing usable in it); the message says what was found."""
