"""The compiled core (mypyc, setup.py) against its pure-Python reference.

The whole suite runs on whatever the install built (compiled where a C compiler was there);
here the same inputs go through both, in two processes (``CANOPY_PURE_PYTHON=1`` loads the
sources), and their answers must be identical. Also: the build is really in use, and a stale
extension is never run.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import canopy_broker
from canopy_broker import COMPILED, PURE_ENV, core_build

# Random filters over a few attributes (every operator, all value kinds), random events; what
# each filter is, how it sorts, what it matches, covers, and what the index returns; and the
# sharded tables through random additions and removals.
PROBE = r"""
import json, random, sys
import canopy_broker
from canopy_broker.core.filters import Filter, FilterError
from canopy_broker.core.matching import IndexedMatcher, RouteMatcher
from canopy_broker.core.routing import dominates
from canopy_broker.core.messages import RouteKey

rng = random.Random(20261125)
attrs = ["a", "b", "s", "t"]
ops = ["=", "<>", "<", "<=", ">", ">=", "prefix", "suffix", "contains", "exists"]
def value(attr):
    if attr in ("s", "t"):
        return '"' + rng.choice(["ab", "abc", "b", "bc", "", "zz"]) + '"'
    return str(rng.choice([0, 1, 2, 3, 2.5, -1, 10]))
texts = []
for _ in range(400):
    parts = []
    for _ in range(rng.randint(1, 3)):
        attr, op = rng.choice(attrs), rng.choice(ops)
        parts.append(f"{attr} exists" if op == "exists" else f"{attr} {op} {value(attr)}")
    texts.append(" and ".join(parts))
texts += ["true", "a = 1 and a = 2", "s prefix \"a\" and s suffix \"c\"", "a < 1 and a > 2"]
out = {"build": canopy_broker.core_build(), "filters": [], "matches": [], "covers": []}
filters = []
for t in texts:
    try:
        f = Filter.parse(t)
    except FilterError as exc:
        out["filters"].append(["error", str(exc)])
        continue
    filters.append(f)
    out["filters"].append([str(f), repr(f.sort_key())])
index = IndexedMatcher()
for i, f in enumerate(filters):
    index.add(f, i)
def event():
    e = {}
    for attr in attrs:
        if rng.random() < 0.7:
            text = attr in ("s", "t")
            e[attr] = rng.choice(["ab", "abc", "b", ""] if text else [0, 1, 2, 2.5, 3, 11])
    return e
for _ in range(300):
    e = event()
    direct = sorted(i for i, f in enumerate(filters) if f.matches(e))
    out["matches"].append([direct, sorted(index.match_payloads(e))])
routes = RouteMatcher()
for i, f in enumerate(filters):
    routes.add(f, f"n{i % 3}" if i % 4 == 0 else (f"c{i % 7}", f"s{i}"))
out["routes"] = []
for step in range(300):
    out["routes"].append(routes.route(event(), rng.choice([None, "n0", "n1"])))
    if step % 50 == 49:  # a change in between: the cached decisions go
        i = rng.randrange(len(filters))
        routes.remove(filters[i], f"n{i % 3}" if i % 4 == 0 else (f"c{i % 7}", f"s{i}"))
        routes.add(filters[i], "n9")
keys = [RouteKey(f) for f in filters[:120]]
out["covers"] = [[i, j] for i, g in enumerate(keys) for j, h in enumerate(keys) if dominates(g, h)]
from canopy_broker.core.tables import ShardedDict, ShardedSet
table, mapping, said = ShardedSet(), ShardedDict(), []
for step in range(20000):  # past the split and back (tables.SPLIT_AT)
    k = rng.randrange(3000)
    if rng.random() < (0.7 if step < 10000 else 0.3):
        said.append(table.add(k))
        mapping[k] = step
    else:
        said.append(table.discard(k))
        said.append(mapping.pop(k) if k in mapping else None)
out["tables"] = [said, sorted(table), sorted(mapping.items())]
from canopy_broker.runtime.outbox import Outlet, fan_out, flush_outlets
class Transport:  # what flush_outlets writes to: records, closes after its third write
    def __init__(self): self.written = []
    def is_closing(self): return len(self.written) >= 3
    def write(self, data): self.written.append(data.hex())
class Conn:
    def __init__(self, paused): self.writing_paused, self.transport = paused, Transport()
outlets = {f"c{i}": Outlet(f"c{i}", Conn(paused=i == 4)) for i in range(6)}  # c6: gone since
dirty, flushed = [], []
for n, (peers, local) in enumerate(out["routes"][:100]):
    fan_out(b'"p",%d,0,{}' % n, local, outlets, dirty)
    if n % 10 == 5:  # a flush: c4 is paused, limit 2, c1 marked; every other one by bytes too
        attention = flush_outlets(dirty, 2, {outlets["c1"]}, slot=8 if n % 20 == 5 else 0)
        flushed.append([[o.client_id for o in dirty], [o.client_id for o in attention]])
        dirty = []
out["fanout"] = [
    sorted((c, [m.decode() for m in o.pending], o.pending_bytes, o.conn.transport.written,
            o.dirty) for c, o in outlets.items()),
    [o.client_id for o in dirty],
    flushed,
]
from collections import deque
from canopy_broker.runtime.inbox import take_notifications
inbox, last, runs = deque(), {}, []
for n in range(200):  # runs of notifications between other messages, duplicates among them
    items = [[20, f"p{k % 3}", rng.randrange(1, 60), k % 4, {"k": k}, ["s"]] for k in range(7)]
    items.insert(rng.randrange(8), [21, "sub"])
    i = 0
    while i < len(items):
        if items[i][0] == 20:
            i, dropped = take_notifications(items, i, inbox, last, n % 2 == 1)
            runs.append([i, dropped])
        else:
            i += 1
import copy, pickle
out["inbox"] = [
    [x.id, x.hops, x.attrs, list(x.sub_ids), repr(x), repr(pickle.loads(pickle.dumps(x))),
     repr(copy.deepcopy(x))]
    for x in inbox
], last, runs
json.dump(out, sys.stdout)
"""


def _probe(pure: bool) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != PURE_ENV}
    if pure:
        env[PURE_ENV] = "1"
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_the_compiled_core_answers_as_the_pure_python_reference() -> None:
    pure, default = _probe(pure=True), _probe(pure=False)
    assert pure["build"] == "pure-python"
    assert default["build"] == core_build()
    assert pure["filters"] == default["filters"]
    assert pure["matches"] == default["matches"]
    assert pure["covers"] == default["covers"]
    assert pure["tables"] == default["tables"]
    assert pure["routes"] == default["routes"]
    assert pure["fanout"] == default["fanout"]
    assert pure["inbox"] == default["inbox"]
    # The probe is not vacuous: filters parse, events match, some keys cover others, and the
    # index agrees with testing every filter.
    valid = [f for f in pure["filters"] if f[0] != "error"]  # type: ignore[attr-defined]
    assert len(valid) > 200 and len(valid) < len(pure["filters"])  # type: ignore[arg-type]
    assert all(direct == indexed for direct, indexed in pure["matches"])  # type: ignore[union-attr]
    assert sum(bool(direct) for direct, _ in pure["matches"]) > 100  # type: ignore[union-attr]
    assert len(pure["covers"]) > 500  # type: ignore[arg-type]
    routed = pure["routes"]
    assert sum(bool(peers) and bool(local) for peers, local in routed) > 50  # type: ignore[union-attr]
    # Fan-out and flush did something of each kind: queued, wrote, held a paused client's
    # queue, stopped writing to a closing transport, and handed clients back to decide about.
    outlets, _, flushes = pure["fanout"]  # type: ignore[misc]
    written = {c: w for c, _, _, w, _ in outlets}
    assert all(len(written[c]) == 3 for c in ("c0", "c1", "c2", "c3", "c5")), written
    queued = next(q for c, q, _, _, _ in outlets if c == "c4")
    assert written["c4"] == [] and len(queued) > 10
    # The paused client's bytes are counted as its queue grows (what high water weighs too).
    assert next(n for c, _, n, _, _ in outlets if c == "c4") == sum(len(m) for m in queued)
    assert all("c1" in attention and "c4" in attention for _, attention in flushes[1:])


def test_the_build_is_in_use() -> None:
    """Setup compiles the core (a C compiler is among what it installs): the tests run on the
    compiled modules unless the pure-Python reference was asked for."""
    if os.environ.get(PURE_ENV) == "1":
        assert core_build() == "pure-python"
        return
    assert core_build() == "compiled", [sys.modules[m].__file__ for m in COMPILED]


def test_a_stale_extension_sends_every_compiled_module_back_to_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An extension older than its source (the source was edited since the build) is never
    loaded; nor, then, any other compiled module (they call each other natively)."""
    core = tmp_path / "core"
    core.mkdir()
    suffix = ".cpython-311-x86_64-linux-gnu.so"
    monkeypatch.setattr(canopy_broker, "_HERE", tmp_path)
    monkeypatch.setattr(canopy_broker.importlib.machinery, "EXTENSION_SUFFIXES", [suffix])
    monkeypatch.delenv(PURE_ENV, raising=False)
    for name in ("events", "filters", "matching"):
        (core / f"{name}{suffix}").write_bytes(b"")
        (core / f"{name}.py").write_text("")
        os.utime(core / f"{name}{suffix}", (2_000_000, 2_000_000))
        os.utime(core / f"{name}.py", (1_000_000, 1_000_000))
    assert not canopy_broker._use_source()
    os.utime(core / "filters.py", (2_000_010, 2_000_010))  # written just after (a wheel install)
    assert not canopy_broker._use_source()
    os.utime(core / "filters.py", (3_000_000, 3_000_000))  # edited after the build
    assert canopy_broker._use_source()
    spec = canopy_broker._SourceFirst().find_spec("canopy_broker.core.matching", None)
    assert spec is not None and spec.origin == str(core / "matching.py")
    assert canopy_broker._SourceFirst().find_spec("canopy_broker.core.routing", None) is None
    os.utime(core / "filters.py", (1_000_000, 1_000_000))
    monkeypatch.setenv(PURE_ENV, "1")
    assert canopy_broker._use_source()


def test_the_compiled_modules_are_named_alike_everywhere() -> None:
    """Three places list them: setup.py compiles them, the finder above guards them, and
    setup.sh rebuilds when they change. A module missing from one would be compiled and never
    checked for staleness, or edited without a rebuild."""
    root = Path(__file__).resolve().parents[2]
    paths = [f"broker_image/{name.replace('.', '/')}.py" for name in COMPILED]
    setup_py = (root / "setup.py").read_text()
    setup_sh = (root / "scripts" / "setup.sh").read_text()
    listed = setup_py[
        setup_py.index("COMPILED = [") : setup_py.index("]", setup_py.index("COMPILED = ["))
    ]
    assert sorted(p for p in paths if f'"{p}"' in listed) == sorted(paths)
    assert listed.count('.py"') == len(paths)
    assert all(p in setup_sh for p in paths)


def test_the_compiled_modules_import_only_the_standard_library_and_each_other() -> None:
    """mypyc type-checks what a compiled module imports in setup's isolated build, which has
    mypy and not the runtime's dependencies: an `import orjson` there failed the install on
    a clean machine (caught by CI on a clean clone, session 4)."""
    root = Path(__file__).resolve().parents[2]
    for name in COMPILED:
        tree = ast.parse((root / "broker_image" / f"{name.replace('.', '/')}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                assert top in sys.stdlib_module_names or top == "canopy_broker", (name, top)
