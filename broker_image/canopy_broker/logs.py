"""Log output of every Canopy process: text for people, or JSON lines for a log pipeline.

Each line of the JSON form is one object: ``ts`` (ISO 8601, UTC), ``level``, ``logger``,
``msg``, the process's identity (``overlay``, ``broker``; the operator has no broker) and, where
the line is about one, the reconfiguration it belongs to: ``reconfiguration`` (the exchange or
step id the brokers know it by), ``step`` (its 1-based index in the plan), ``generation`` (the
plan's). Those come either from ``extra=`` on the call, or from :func:`log_context` around the
code that works on a step, so every line logged meanwhile (by any module, in that task) carries
them. Loki, Elasticsearch or ``jq 'select(.reconfiguration == "trading-g3-s2")'`` then find a
reconfiguration's whole story across the operator and every broker.

The JSON is python-json-logger's (a maintained formatter, which also renders exceptions and any
``extra`` field); this module only chooses the fields and keeps the context.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from types import MappingProxyType

from pythonjsonlogger.json import JsonFormatter

FORMATS = ("text", "json")
FORMAT_ENV = "CANOPY_LOG_FORMAT"
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_context: ContextVar[Mapping[str, object]] = ContextVar(
    "canopy_log_context", default=MappingProxyType({})
)


def default_format() -> str:
    """``$CANOPY_LOG_FORMAT`` if it names a format, else text."""
    wanted = os.environ.get(FORMAT_ENV, "text")
    return wanted if wanted in FORMATS else "text"


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--log-format`` on a command that runs a long-lived process."""
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default=default_format(),
        help=f"text, or JSON lines with overlay, broker and reconfiguration ids "
        f"(default: ${FORMAT_ENV}, else text)",
    )


@contextlib.contextmanager
def log_context(**fields: object) -> Iterator[None]:
    """Add ``fields`` to every line logged inside the block (by this task and what it awaits;
    a context variable, so concurrent steps each keep their own)."""
    token = _context.set({**_context.get(), **fields})
    try:
        yield
    finally:
        _context.reset(token)


class _Context(logging.Filter):
    """Puts the process's identity and the current context on each record (a field given with
    ``extra=`` wins), where the JSON formatter finds them as it finds any extra field."""

    def __init__(self, identity: Mapping[str, str]) -> None:
        super().__init__()
        self.identity = dict(identity)

    def filter(self, record: logging.LogRecord) -> bool:
        for fields in (_context.get(), self.identity):
            for key, value in fields.items():
                if key not in record.__dict__:
                    setattr(record, key, value)
        return True


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter(
            "{levelname}{name}{message}",
            style="{",
            rename_fields={"levelname": "level", "name": "logger", "message": "msg"},
            timestamp="ts",
        )
    if fmt == "text":
        return logging.Formatter(TEXT)
    raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def configure(level: str = "INFO", fmt: str = "text", **identity: str | None) -> None:
    """Send the process's logs to stderr in ``fmt``; ``identity`` (overlay, broker) goes on
    every line of the JSON form. Replaces whatever handlers the root logger had."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    handler.addFilter(_Context({k: v for k, v in identity.items() if v}))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
