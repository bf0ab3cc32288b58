"""Compiled hot path: the broker core's matching, filters and events, built with mypyc.

Everything else about the project is in pyproject.toml; this file only adds extension
modules. The same modules stay importable as plain Python: they are the reference the compiled
ones are tested against (``CANOPY_PURE_PYTHON=1`` loads them, see ``canopy_broker/__init__.py``),
and each extension is optional, so a machine without a C compiler installs the pure-Python
broker instead of failing (``canopy-broker serve`` and ``/status`` say which one runs).

``CANOPY_PURE_PYTHON=1`` at install time skips the compilation altogether.

Why only these: they are the data plane's matching (half of it in compiled code, measured in
docs/performance.md), the sharded tables it looks filters up in, and the runtime's way out to
its clients (runtime/outbox.py: the fan-out, the flush and the frames they build, on plain
lists, dicts and one small class), and the client library's reading of notifications
(runtime/inbox.py), and hold no state that tests patch at run time;
routing.py would gain little (13 % per subscription) and is patched by tests that count
covering checks.
"""

from __future__ import annotations

import os

from setuptools import setup

COMPILED = [
    "broker_image/canopy_broker/core/events.py",
    "broker_image/canopy_broker/core/filters.py",
    "broker_image/canopy_broker/core/matching.py",
    "broker_image/canopy_broker/core/tables.py",
    "broker_image/canopy_broker/runtime/outbox.py",
    "broker_image/canopy_broker/runtime/inbox.py",
]


def extensions() -> list[object]:
    if os.environ.get("CANOPY_PURE_PYTHON") == "1":
        return []
    from mypyc.build import mypycify  # noqa: PLC0415 - a build requirement, only when compiling

    # "--config-file=": not the project's mypy settings, which name whole packages to check (the
    # type checking is `make typecheck`'s job); mypyc then compiles just these files.
    modules = mypycify(["--config-file=", *COMPILED], opt_level="3", separate=True)
    for ext in modules:
        ext.optional = True  # no compiler: the pure-Python modules are used, nothing fails
    return list(modules)


setup(ext_modules=extensions())
