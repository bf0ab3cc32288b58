"""Subscription filters: constraints, their text syntax, matching and covering.

A filter is a conjunction of constraints ``attr op value``. The empty conjunction matches every
event (``true`` in the text syntax). Every constraint except ``exists`` carries a value of one
*kind* (number, string, bool) and only matches attributes of that kind, so ``price < 10`` never
matches ``price = "cheap"``.

Covering (``covers(f1, f2)``: every event matching f2 also matches f1) drives covering-based
routing. It must be **sound** — claiming a cover that does not hold would lose events — and it
must be **transitive**, because the router keeps only the maximal filters of a set and relies on
"dominated by something dominated by a kept filter" implying "covered by a kept filter". We get both
by deciding, per attribute, whether the constraints of f2 imply each constraint of f1:

* numbers and booleans: exactly, by asking whether ``f2|attr ∧ ¬c1`` is empty over the reals;
* strings: exactly when f2 pins the attribute to one value; otherwise by pairwise implication
  (one constraint of f2 implies c1) and by interval containment of the range constraints. This
  misses some covers that need several string constraints together (``prefix "ab" and
  suffix "c"`` implies ``contains "b"``), which costs routing-table size but never correctness.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from typing import Any, Final, TypeVar, cast

from canopy_broker.core.events import Kind, Value, kind_of


class Op(Enum):
    EQ = "="
    NE = "!="
    LT = "<"
    LE = "<="
    GT = ">"
    GE = ">="
    PREFIX = "prefix"
    SUFFIX = "suffix"
    CONTAINS = "contains"
    EXISTS = "exists"

    # Members are singletons compared by identity, so identity is a correct hash, and a C one:
    # Enum's own hashes the name in Python code, and (attribute, kind, value) and operator
    # keys are hashed on every event and every route update.
    __hash__ = object.__hash__


RANGE_OPS = frozenset({Op.LT, Op.LE, Op.GT, Op.GE})
STRING_OPS = frozenset({Op.PREFIX, Op.SUFFIX, Op.CONTAINS})
_OP_ORDER = {op: i for i, op in enumerate(Op)}

# Operators and kinds as small ints, for :func:`satisfied` (order matters: the string
# operators and ``exists`` come last).
# Final literals: compiled, they are constants in the code, not lookups in the module.
_EQ: Final = 0
_NE: Final = 1
_LT: Final = 2
_LE: Final = 3
_GT: Final = 4
_GE: Final = 5
_PREFIX: Final = 6
_SUFFIX: Final = 7
_CONTAINS: Final = 8
_EXISTS: Final = 9
_CODE = {
    Op.EQ: _EQ,
    Op.NE: _NE,
    Op.LT: _LT,
    Op.LE: _LE,
    Op.GT: _GT,
    Op.GE: _GE,
    Op.PREFIX: _PREFIX,
    Op.SUFFIX: _SUFFIX,
    Op.CONTAINS: _CONTAINS,
    Op.EXISTS: _EXISTS,
}
_NUMBER: Final = 1
_STRING: Final = 2
_BOOL: Final = 3
_KCODE = {Kind.NUMBER: _NUMBER, Kind.STRING: _STRING, Kind.BOOL: _BOOL}


class FilterError(ValueError):
    """A filter text or structure is invalid; the message says where and why."""


@dataclass(frozen=True, slots=True)
class Constraint:
    attr: str
    op: Op
    value: Value | None = None
    # Part of equality and hashing on purpose: Python says ``True == 1``, Canopy does not.
    kind: Kind | None = field(init=False, default=None)
    # The operator and kind as small ints: matching's innermost step (:func:`satisfied`)
    # dispatches on them in compiled code.
    code: int = field(init=False, default=_EXISTS, compare=False, hash=False, repr=False)
    kcode: int = field(init=False, default=0, compare=False, hash=False, repr=False)

    def __init__(self, attr: str, op: Op, value: Value | None = None) -> None:
        # Written out, like Event's: the generated __init__ of a frozen dataclass is Python
        # code (object.__setattr__ per field, then __post_init__), and every subscription
        # builds its constraints anew at every broker it reaches.
        object.__setattr__(self, "attr", attr)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "kind", None)
        object.__setattr__(self, "code", _EXISTS)
        object.__setattr__(self, "kcode", 0)
        self._check()

    def _check(self) -> None:
        if not self.attr or not isinstance(self.attr, str):
            raise FilterError(f"constraint needs an attribute name, got {self.attr!r}")
        if self.op is Op.EXISTS:
            if self.value is not None:
                raise FilterError(f"'{self.attr} exists' takes no value")
            return
        kind = kind_of(self.value)
        if kind is None:
            raise FilterError(
                f"constraint on {self.attr!r}: value {self.value!r} is not a string, number or bool"
            )
        if self.op in STRING_OPS and kind is not Kind.STRING:
            raise FilterError(f"'{self.op.value}' on {self.attr!r} needs a string value")
        if self.op in RANGE_OPS and kind is Kind.BOOL:
            raise FilterError(f"'{self.op.value}' on {self.attr!r} cannot compare booleans")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "code", _CODE[self.op])
        object.__setattr__(self, "kcode", _KCODE[kind])

    def matches_value(self, value: Value) -> bool:
        """Whether an attribute value (known to be present) satisfies this constraint."""
        return satisfied(self, value)

    def sort_key(self) -> tuple[str, int, str, str]:
        kind = self.kind
        return (self.attr, _OP_ORDER[self.op], kind.value if kind else "", repr(self.value))

    def __str__(self) -> str:
        if self.op is Op.EXISTS:
            return f"{self.attr} exists"
        return f"{self.attr} {self.op.value} {format_value(self.value)}"


def satisfied(c: Constraint, v: Value) -> bool:
    """Whether a present attribute value ``v`` satisfies ``c``.

    Matching's innermost step, once per candidate filter and constraint: a dispatch on small
    ints, which compiled is a few comparisons (a closure per constraint, called here before,
    cost about as much as everything else in matching). A value of another kind never
    matches; values reaching the core were validated (exact types, no NaN)."""
    code = c.code
    t = type(v)
    if code >= _PREFIX:
        if code == _EXISTS:
            return True
        if t is not str:
            return False
        s = cast(str, v)
        a = cast(str, c.value)
        if code == _PREFIX:
            return s.startswith(a)
        if code == _SUFFIX:
            return s.endswith(a)
        return a in s
    k = c.kcode
    if k == _NUMBER:
        if t is not int and t is not float:
            return False
    elif k == _STRING:
        if t is not str:
            return False
    elif t is not bool:
        return False
    x = cast(Any, v)
    y = cast(Any, c.value)
    if code == _EQ:
        return bool(x == y)
    if code == _NE:
        return bool(x != y)
    if code == _LT:
        return bool(x < y)
    if code == _LE:
        return bool(x <= y)
    if code == _GT:
        return bool(x > y)
    return bool(x >= y)


def format_value(value: Value | None) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def as_dict(attrs: Mapping[str, Value]) -> dict[str, Value]:
    """Event attributes as a dict (they are one, coming from the wire): compiled, its
    lookups are then direct calls (:func:`all_satisfied`)."""
    return attrs if isinstance(attrs, dict) else dict(attrs)


def all_satisfied(cs: tuple[Constraint, ...], attrs: dict[str, Value]) -> bool:
    """Whether the event's ``attrs`` satisfy every constraint of ``cs`` (a dict, not any
    mapping: compiled, its lookups are then direct calls, not a method looked up per call)."""
    for c in cs:
        value = attrs.get(c.attr)
        if value is None or not satisfied(c, value):
            return False
    return True


T = TypeVar("T")

_SHARED: dict[Any, Any] = {}
"""One object for each equal slot or tuple made of attribute names only (not of values): a
cover profile is kept on every filter routed, and sharing these, with the fixes in
:data:`Pin`, halved a profile's memory (docs/performance.md, "Memory per subscription")."""

_SHARED_MAX = 1 << 14
"""Entries of :data:`_SHARED`; when full it starts again (what is shared stays shared). Names
come from users: a client churning through new ones can hold this much, a few MB, no more."""

_SHARED_LONGEST = 64
"""Characters of names past which a value is not shared: long names are rare, and the cache
would hold them after their filters are gone."""


def _shared(value: T, chars: int) -> T:
    """``value``, or the equal one already shared; ``chars``: how many characters of names
    it holds."""
    if chars > _SHARED_LONGEST:
        return value
    found = _SHARED.get(value)
    if found is not None:
        return cast(T, found)
    if len(_SHARED) >= _SHARED_MAX:
        _SHARED.clear()
    _SHARED[value] = value
    return value


@dataclass(frozen=True, slots=True)
class Filter:
    """A conjunction of constraints, sorted and de-duplicated so equal filters compare equal."""

    constraints: tuple[Constraint, ...] = ()
    # The per-attribute view, as two parallel tuples rather than a dict: a dict per filter was
    # a third of a filter's memory, and filters have one to a few attributes. The names are
    # shared between filters on the same attributes.
    _attrs: tuple[str, ...] = field(default=(), compare=False, hash=False, repr=False)
    _per_attr: tuple[tuple[Constraint, ...], ...] = field(
        default=(), compare=False, hash=False, repr=False
    )
    _hash: int = field(default=0, compare=False, repr=False)
    # What an index still has to check of a filter it found by one of its constraints (see
    # :meth:`indexed_by`); None until a matcher files it.
    _rest: tuple[Constraint, ...] | None = field(
        default=None, init=False, compare=False, repr=False
    )
    # Memo of cover_profile(): on the filter rather than in a cache table, because a table of
    # every filter routed would grow (and rehash in one go) with the subscriptions.
    _profile: CoverProfile | None = field(default=None, init=False, compare=False, repr=False)

    def __init__(self, constraints: tuple[Constraint, ...] = ()) -> None:
        # Written out (see Constraint.__init__): canonical order, hash and per-attribute view.
        canon = tuple(sorted(set(constraints), key=Constraint.sort_key))
        object.__setattr__(self, "constraints", canon)
        object.__setattr__(self, "_hash", hash(canon))
        by_attr: dict[str, list[Constraint]] = {}
        for c in canon:
            by_attr.setdefault(c.attr, []).append(c)
        names = tuple(by_attr)
        object.__setattr__(self, "_attrs", _shared(names, sum([len(a) for a in names])))
        per_attr = (canon,) if len(by_attr) == 1 else tuple([tuple(cs) for cs in by_attr.values()])
        object.__setattr__(self, "_per_attr", per_attr)
        object.__setattr__(self, "_rest", None)
        object.__setattr__(self, "_profile", None)

    def __hash__(self) -> int:
        # Filters are dictionary keys and cache keys on every routing decision: hash once.
        return self._hash

    @classmethod
    def of(cls, constraints: Iterable[Constraint]) -> Filter:
        return cls(tuple(constraints))

    @classmethod
    def parse(cls, text: str) -> Filter:
        return parse_filter(text)

    def on(self, attr: str) -> tuple[Constraint, ...]:
        attrs = self._attrs
        for i in range(len(attrs)):
            if attrs[i] == attr:
                return self._per_attr[i]
        return ()

    @property
    def attrs(self) -> tuple[str, ...]:
        return self._attrs

    def matches(self, attrs: Mapping[str, Value]) -> bool:
        return all_satisfied(self.constraints, as_dict(attrs))

    def indexed_by(self, access: Constraint) -> None:
        """A matcher files this filter under ``access``, one of its constraints, and finds it
        only for events that satisfy it: :meth:`matches_rest` then checks just the others."""
        if self._rest is None:
            object.__setattr__(self, "_rest", self.others(access))

    def others(self, access: Constraint) -> tuple[Constraint, ...]:
        """The constraints besides ``access``: what is left to check of an event known to
        satisfy it (the matcher's index, :meth:`indexed_by`)."""
        return tuple(c for c in self.constraints if c != access)

    def matches_rest(self, attrs: dict[str, Value]) -> bool:
        """:meth:`matches` for an event known to satisfy the constraint given to
        :meth:`indexed_by` (all of them if it was not called)."""
        rest = self._rest
        return all_satisfied(self.constraints if rest is None else rest, attrs)

    def __str__(self) -> str:
        return " and ".join(map(str, self.constraints)) if self.constraints else "true"

    def sort_key(self) -> tuple[int, str]:
        """Total order used to break ties between equivalent filters deterministically."""
        return (len(self.constraints), str(self))


MATCH_ALL = Filter()


# --------------------------------------------------------------------------- text syntax

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)
  | (?P<op><=|>=|!=|==|=|<|>)
  | (?P<word>[A-Za-z_][A-Za-z0-9_.\-/]*|\*)
    """,
    re.VERBOSE,
)
_WORD_OPS = {"prefix": Op.PREFIX, "suffix": Op.SUFFIX, "contains": Op.CONTAINS}
_SYM_OPS = {"=": Op.EQ, "==": Op.EQ, "!=": Op.NE, "<": Op.LT, "<=": Op.LE, ">": Op.GT, ">=": Op.GE}


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str
    text: str
    col: int


def _tokenize(text: str) -> list[_Tok]:
    toks: list[_Tok] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise FilterError(f"unexpected character {text[pos]!r} at column {pos + 1} in {text!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind != "ws":
            toks.append(_Tok(kind, m.group(), pos + 1))
        pos = m.end()
    return toks


def _unquote(raw: str) -> str:
    body = raw[1:-1]
    return re.sub(r"\\(.)", r"\1", body)


def parse_filter(text: str) -> Filter:
    """Parse ``attr op value [and attr op value]...``; ``true`` or ``*`` is the match-all filter.

    Values: double- or single-quoted strings, numbers, ``true`` / ``false``. Operators: ``=``
    (or ``==``), ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``prefix``, ``suffix``, ``contains`` and
    the unary ``exists``.
    """
    toks = _tokenize(text)
    if not toks:
        raise FilterError("empty filter; use 'true' to match every event")
    if len(toks) == 1 and toks[0].text in ("true", "*"):
        return MATCH_ALL
    constraints: list[Constraint] = []
    i = 0

    def want(what: str) -> _Tok:
        if i >= len(toks):
            raise FilterError(f"expected {what} at end of filter {text!r}")
        return toks[i]

    while True:
        attr_tok = want("an attribute name")
        if attr_tok.kind != "word" or attr_tok.text in {"and", "exists", *_WORD_OPS}:
            raise FilterError(
                f"expected an attribute name at column {attr_tok.col}, got {attr_tok.text!r}"
            )
        i += 1
        op_tok = want(f"an operator after {attr_tok.text!r}")
        i += 1
        if op_tok.kind == "word" and op_tok.text == "exists":
            constraints.append(Constraint(attr_tok.text, Op.EXISTS))
        else:
            if op_tok.kind == "op":
                op = _SYM_OPS[op_tok.text]
            elif op_tok.kind == "word" and op_tok.text in _WORD_OPS:
                op = _WORD_OPS[op_tok.text]
            else:
                raise FilterError(
                    f"expected an operator after {attr_tok.text!r} at column {op_tok.col}, "
                    f"got {op_tok.text!r} (one of = != < <= > >= prefix suffix contains exists)"
                )
            val_tok = want(f"a value after '{attr_tok.text} {op_tok.text}'")
            i += 1
            value: Value
            if val_tok.kind == "string":
                value = _unquote(val_tok.text)
            elif val_tok.kind == "number":
                num = float(val_tok.text)
                is_int = re.fullmatch(r"[-+]?\d+", val_tok.text) is not None
                value = int(val_tok.text) if is_int else num
                if isinstance(value, float) and not math.isfinite(value):
                    raise FilterError(
                        f"number {val_tok.text!r} at column {val_tok.col} is too large"
                    )
            elif val_tok.kind == "word" and val_tok.text in ("true", "false"):
                value = val_tok.text == "true"
            else:
                raise FilterError(
                    f"expected a value (quoted string, number, true/false) at column "
                    f"{val_tok.col}, got {val_tok.text!r}"
                )
            try:
                constraints.append(Constraint(attr_tok.text, op, value))
            except FilterError as exc:
                raise FilterError(f"{exc} (column {attr_tok.col})") from None
        if i == len(toks):
            return Filter.of(constraints)
        sep = toks[i]
        if sep.kind != "word" or sep.text != "and":
            raise FilterError(f"expected 'and' at column {sep.col}, got {sep.text!r}")
        i += 1


# --------------------------------------------------------------------------- covering


def _negate(c: Constraint) -> Constraint | None:
    """The constraint matching exactly the same-kind values ``c`` rejects (None for exists)."""
    neg = {
        Op.EQ: Op.NE,
        Op.NE: Op.EQ,
        Op.LT: Op.GE,
        Op.GE: Op.LT,
        Op.LE: Op.GT,
        Op.GT: Op.LE,
    }.get(c.op)
    return None if neg is None else Constraint(c.attr, neg, c.value)


def _interval(cs: Iterable[Constraint]) -> tuple[Value | None, bool, Value | None, bool]:
    """Tightest (lo, lo_inclusive, hi, hi_inclusive) from the range constraints in ``cs``."""
    lo: Value | None = None
    hi: Value | None = None
    lo_in = hi_in = True
    for c in cs:
        v = c.value
        if c.op in (Op.GT, Op.GE):
            strict = c.op is Op.GT
            if lo is None or v > lo or (v == lo and strict):  # type: ignore[operator]
                lo, lo_in = v, not strict
        elif c.op in (Op.LT, Op.LE):
            strict = c.op is Op.LT
            if hi is None or v < hi or (v == hi and strict):  # type: ignore[operator]
                hi, hi_in = v, not strict
    return lo, lo_in, hi, hi_in


def _dense_empty(cs: tuple[Constraint, ...]) -> bool:
    """Emptiness of a same-kind conjunction, exact for numbers/bools (dense model for strings)."""
    eqs = {c.value for c in cs if c.op is Op.EQ}
    if eqs:
        if len(eqs) > 1:
            return True
        (v,) = eqs
        assert v is not None
        return not all(c.matches_value(v) for c in cs)
    if cs and cs[0].kind is Kind.BOOL:
        excluded = {c.value for c in cs if c.op is Op.NE}
        return excluded >= {True, False}
    lo, lo_in, hi, hi_in = _interval(cs)
    if lo is not None and hi is not None:
        if lo > hi:  # type: ignore[operator]
            return True
        if lo == hi:  # pinned to one value: evaluate every constraint exactly
            return not (lo_in and hi_in) or not all(c.matches_value(lo) for c in cs)
    return False


def _same_kind(cs: Iterable[Constraint]) -> tuple[Kind | None, tuple[Constraint, ...], bool]:
    """Split off ``exists``; return (kind, valued constraints, mixed-kinds flag)."""
    valued = tuple(c for c in cs if c.op is not Op.EXISTS)
    kinds = {c.kind for c in valued}
    if len(kinds) > 1:
        return None, valued, True
    return (next(iter(kinds)) if kinds else None), valued, False


def _string_pair_implies(c2: Constraint, c1: Constraint) -> bool:
    """Exact implication between two single string constraints (c2 ⇒ c1), conservative across
    families that would need order reasoning on prefixes (prefix vs range)."""
    a, b = c2.value, c1.value
    assert isinstance(b, str) and isinstance(a, str)
    if c1.op is Op.NE:
        return not c2.matches_value(b) if c2.op is not Op.NE else a == b
    if c1.op is Op.PREFIX:
        return c2.op is Op.PREFIX and a.startswith(b)
    if c1.op is Op.SUFFIX:
        return c2.op is Op.SUFFIX and a.endswith(b)
    if c1.op is Op.CONTAINS:
        return c2.op in STRING_OPS and b in a
    return False


def implies(cs: tuple[Constraint, ...], c1: Constraint) -> bool:
    """Do the constraints ``cs`` on one attribute imply ``c1`` on that attribute? (sound)"""
    if not cs:
        return False
    if c1.op is Op.EXISTS:
        return True
    kind, valued, mixed = _same_kind(cs)
    if mixed:
        return True  # no value has two kinds: cs is unsatisfiable
    if kind is None:
        return False  # only 'exists': any value of any kind
    if _dense_empty(valued):
        return True
    if c1.kind is not kind:
        return False
    eqs = [c.value for c in valued if c.op is Op.EQ]
    if eqs:  # satisfiable and pinned to one value: evaluate exactly
        return c1.matches_value(eqs[0])  # type: ignore[arg-type]
    if kind is not Kind.STRING or c1.op in RANGE_OPS or c1.op is Op.EQ:
        neg = _negate(c1)
        assert neg is not None
        return _dense_empty((*valued, neg))
    if c1.op is Op.NE and _dense_empty((*valued, Constraint(c1.attr, Op.EQ, c1.value))):
        return True
    return any(_string_pair_implies(c2, c1) for c2 in valued)


def satisfiable(f: Filter) -> bool:
    """False only when some event provably cannot match ``f`` (sound: True may be optimistic)."""
    for attr in f.attrs:
        _, valued, mixed = _same_kind(f.on(attr))
        if mixed or (valued and _dense_empty(valued)):
            return False
    return True


@lru_cache(maxsize=1 << 16)
def covers(f1: Filter, f2: Filter) -> bool:
    """Sound, transitive covering test: True only if every event matching f2 matches f1.

    Memoised: routing asks the same pairs again and again (every advertisement decision scans
    the advertised set), filters are immutable, and the answer never changes.
    """
    if f1 == f2 or not f1.constraints:
        return True
    if not satisfiable(f2):
        return True
    return all(implies(f2.on(c.attr), c) for c in f1.constraints)


# --------------------------------------------------------------------------- covering index keys

Pin = tuple[object, ...]
"""An attribute a filter fixes to a single value: (attribute, kind name, value). The kind keeps
``x = 1`` and ``x = true`` apart (Python says ``1 == True``); its name, not the enum, because
these tuples are hashed on every routing decision and an enum member hashes in Python code.

Typed as a tuple of any length, not ``tuple[str, str, Value]``: compiled, a fixed-length tuple
is a C struct that becomes a new Python tuple each time it is stored, and a profile would hold
a copy per place it appears (as it did: 13 objects a filter instead of 8)."""

Slot = tuple[object, ...]
"""A bucket of a covering index (see :class:`CoverProfile`): (family, kind, pin or name), or a
pin itself; any length for the same reason as :data:`Pin`."""


@dataclass(frozen=True, slots=True)
class CoverProfile:
    """What a covering index files a filter under (see :func:`cover_profile`).

    ``anchor``: the one bucket where the filter waits to be found as a *coverer* (its first pin,
    else its first attribute, else the match-all bucket); any satisfiable filter it covers has
    that pin or attribute. ``filed``: every bucket it sits in (the anchor, and one per pin and
    per attribute when satisfiable). ``probe``: the buckets to read to find what may cover it.
    ``narrow``: the buckets any filter it covers must be in (its pins, else its attributes).
    """

    satisfiable: bool
    attrs: tuple[str, ...]
    pins: tuple[Pin, ...]
    anchor: Slot
    filed: tuple[Slot, ...]
    probe: tuple[Slot, ...]
    narrow: tuple[Slot, ...]

    def __init__(  # noqa: PLR0917 - the record's fields, written out (see Constraint.__init__)
        self,
        satisfiable: bool,
        attrs: tuple[str, ...],
        pins: tuple[Pin, ...],
        anchor: Slot,
        filed: tuple[Slot, ...],
        probe: tuple[Slot, ...],
        narrow: tuple[Slot, ...],
    ) -> None:
        object.__setattr__(self, "satisfiable", satisfiable)
        object.__setattr__(self, "attrs", attrs)
        object.__setattr__(self, "pins", pins)
        object.__setattr__(self, "anchor", anchor)
        object.__setattr__(self, "filed", filed)
        object.__setattr__(self, "probe", probe)
        object.__setattr__(self, "narrow", narrow)


MATCH_ALL_SLOT: Slot = ("cover", "top", None)


def _pin(cs: tuple[Constraint, ...]) -> tuple[Kind, Value] | None:
    """The one value a *satisfiable* same-kind set of constraints on an attribute allows, if it
    allows only one that :func:`implies` can see: an equality, a boolean ``!=``, or a closed
    interval of width zero."""
    valued = tuple(c for c in cs if c.op is not Op.EXISTS)
    if not valued or valued[0].kind is None:
        return None
    kind = valued[0].kind
    for c in valued:
        if c.op is Op.EQ:
            assert c.value is not None
            return kind, c.value
    if kind is Kind.BOOL:
        excluded = {c.value for c in valued if c.op is Op.NE}
        return (kind, not excluded.pop()) if len(excluded) == 1 else None
    lo, lo_in, hi, hi_in = _interval(valued)
    if lo is not None and lo == hi and lo_in and hi_in:
        return kind, lo
    return None


def cover_profile(f: Filter) -> CoverProfile:
    """Necessary conditions for covering, as set membership, so routing can index filters.

    For a satisfiable ``h`` and any ``g`` with ``covers(g, h)``:

    * every attribute ``g`` constrains, ``h`` constrains (``implies`` on no constraints is
      False), so ``g.attrs ⊆ h.attrs``;
    * every pin of ``g`` is a pin of ``h``: if ``g`` fixes ``a`` to ``v``, ``h``'s constraints
      on ``a`` must allow ``v`` only, and ``implies`` sees that only through the same three
      shapes ``_pin`` recognises (proved per case in docs/architecture.md; checked by a property
      test against :func:`covers`).

    Pins are taken only from attributes whose own constraints are satisfiable, which keeps both
    statements true for an unsatisfiable ``g`` too. An unsatisfiable ``h`` is covered by every
    filter, so indexes keep those apart.

    Computed once per filter object and kept on it: routing asks for it on every question.
    """
    memo = f._profile
    if memo is not None:
        return memo
    profile = _profile(f)
    object.__setattr__(f, "_profile", profile)
    return profile


def _profile(f: Filter) -> CoverProfile:
    pins: list[Pin] = []
    ok = True
    for attr in f.attrs:
        cs = f.on(attr)
        _, valued, mixed = _same_kind(cs)
        if mixed or (valued and _dense_empty(valued)):
            ok = False
            continue
        pin = _pin(cs)
        if pin is not None:
            pins.append((attr, pin[0].value, pin[1]))
    attrs = f.attrs
    cover_pins: list[Slot] = [("cover", "pin", pin) for pin in pins]
    cover_attrs: list[Slot] = [_shared(("cover", "attr", a), len(a)) for a in attrs]
    anchor = cover_pins[0] if pins else cover_attrs[0] if attrs else MATCH_ALL_SLOT
    # A pin is its own slot: (attribute, kind name, value) can equal no other slot, whose
    # second item is "top", "pin", "attr" or "". So the pins tuple is the narrow one too.
    by_pin: tuple[Slot, ...] = tuple(pins)
    by_attr: tuple[Slot, ...] = _shared(
        tuple([_shared(("attr", "", a), len(a)) for a in attrs]), sum([len(a) for a in attrs])
    )
    filed = (anchor, *by_pin, *by_attr) if ok else (anchor,)
    probe = (MATCH_ALL_SLOT, *cover_pins, *cover_attrs)
    return CoverProfile(ok, attrs, by_pin, anchor, filed, probe, by_pin or by_attr)
