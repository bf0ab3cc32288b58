"""Canopy's broker: the sans-I/O core, its asyncio runtime, the client library and tools.

Part of the core (and the runtime's fan-out loop, runtime/outbox.py) is compiled with mypyc
when the project is installed (setup.py): the modules
in :data:`COMPILED` then exist twice, as an extension next to the Python source. Python loads
the extension. Two cases load the source instead, by a finder installed here before anything
imports the core:

* ``CANOPY_PURE_PYTHON=1``: the pure-Python reference, which the compiled modules are tested
  against (tests/unit/test_native.py) and which a user can fall back to;
* an extension older than its source by more than a minute (edited since the install): stale
  compiled code would be wrong, so the sources win (all of them) until setup builds again
  (``make setup`` does when they change).

:func:`core_build` says which one is running (``canopy-broker serve`` logs it; ``/status``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

COMPILED = (
    "canopy_broker.core.events",
    "canopy_broker.core.filters",
    "canopy_broker.core.matching",
    "canopy_broker.core.tables",
    "canopy_broker.runtime.outbox",
    "canopy_broker.runtime.inbox",
)
PURE_ENV = "CANOPY_PURE_PYTHON"
STALE_AFTER = 60.0
"""Seconds a source may be newer than its extension and still count as built with it: pip
installing a wheel writes both at install time, in no set order; an edit comes later."""
_HERE = Path(__file__).resolve().parent


def _source(fullname: str) -> Path:
    return _HERE.joinpath(*fullname.split(".")[1:]).with_suffix(".py")


def _extensions(src: Path) -> list[Path]:
    return [
        src.with_name(src.stem + suffix)
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
        if src.with_name(src.stem + suffix).exists()
    ]


def _use_source() -> bool:
    """All or nothing: compiled modules call each other's native classes directly, so one
    stale module sends every one of them back to its source."""
    if os.environ.get(PURE_ENV) == "1":
        return True
    for name in COMPILED:
        src = _source(name)
        built = _extensions(src)
        if built and src.exists():
            newest_source_edit = src.stat().st_mtime - STALE_AFTER
            if min(p.stat().st_mtime for p in built) < newest_source_edit:
                return True
    return False


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Loads the Python source of a compiled module when :func:`_use_source` says so."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED or not _use_source():
            return None
        src = _source(fullname)
        return importlib.util.spec_from_file_location(fullname, src) if src.exists() else None


def core_build() -> str:
    """``compiled`` when every module of :data:`COMPILED` runs from its extension, else
    ``pure-python`` (nothing built, a compiler missing, ``CANOPY_PURE_PYTHON=1``, or stale)."""
    for name in COMPILED:
        module = sys.modules.get(name) or importlib.import_module(name)
        if (module.__file__ or "").endswith(".py"):
            return "pure-python"
    return "compiled"


if not any(isinstance(f, _SourceFirst) for f in sys.meta_path):
    sys.meta_path.insert(0, _SourceFirst())
