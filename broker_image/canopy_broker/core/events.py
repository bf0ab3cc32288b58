"""Events (notifications) and their envelope.

An event is a flat map of attribute names to scalar values plus an envelope. The envelope is what
the correctness checkers reason about: ``(publisher, seq)`` identifies a notification globally
(publishers choose unique ids, sequence numbers grow by one per publisher), and ``hops`` counts the
overlay links the copy travelled, which the simulator and the telemetry use for cost figures.

Values are typed by *kind* (number, string, boolean). ``bool`` is kept apart from numbers on
purpose: Python treats ``True == 1``, but a subscriber asking for ``count = 1`` does not mean
``flag = true``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Final, cast

Value = str | int | float | bool


class Kind(Enum):
    """Type class of a value; constraints only ever match values of their own kind."""

    NUMBER = "number"
    STRING = "string"
    BOOL = "bool"

    # Members are singletons compared by identity, so identity is a correct hash, and a C one:
    # Enum's own hashes the name in Python code, and (attribute, kind, value) and operator
    # keys are hashed on every event and every route update.
    __hash__ = object.__hash__


def kind_of(value: object) -> Kind | None:
    """Return the kind of a scalar, or ``None`` if it is not an allowed attribute value."""
    if isinstance(value, bool):
        return Kind.BOOL
    if isinstance(value, int | float):
        if isinstance(value, float) and math.isnan(value):
            return None
        return Kind.NUMBER
    if isinstance(value, str):
        return Kind.STRING
    return None


def exact_kind(value: object) -> Kind | None:
    """:func:`kind_of` for the exact types only, as matching compares (``satisfied``): a
    subclass of str, int or float is no value of any kind there. Values validated by
    :func:`check_attributes` are exact (it converts subclasses); this keeps the index and a
    plain scan agreeing on values that were not validated."""
    t = type(value)
    if t is str:
        return Kind.STRING
    if t is int:
        return Kind.NUMBER
    if t is float:
        return None if value != value else Kind.NUMBER  # noqa: PLR0124 - NaN is not itself
    if t is bool:
        return Kind.BOOL
    return None


WIRE_INT_MIN: Final = -(2**63)
WIRE_INT_MAX: Final = 2**64 - 1
"""Integers an attribute may carry on the wire: what orjson encodes (signed or unsigned)."""


def check_attributes(attrs: Mapping[object, object], *, wire: bool = False) -> dict[str, Value]:
    """Validate an attribute map coming from outside; raise ``ValueError`` naming the bad entry.

    ``wire``: also refuse what JSON cannot carry between brokers (infinities) and integers
    beyond 64 bits (orjson refuses them): checked here, compiled, because every broker an
    event passes checks it again."""
    out: dict[str, Value] = {}
    for name, given in attrs.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"attribute names must be non-empty strings, got {name!r}")
        value = given
        if exact_kind(value) is None:  # not an exact allowed type (compiled: a direct call)
            value = _exact(name, value)  # a subclass kept as its base type; else refused
        t = type(value)
        if wire:
            if t is float and not math.isfinite(cast(float, value)):
                raise ValueError(f"attribute {name!r} is not a finite number")
            if t is int and not WIRE_INT_MIN <= cast(int, value) <= WIRE_INT_MAX:
                raise ValueError(f"attribute {name!r} does not fit in 64 bits")
        out[name] = value  # type: ignore[assignment]  # an exact str, int, float or bool
    return out


def _exact(name: str, value: object) -> Value:
    """A value that is not of an exact allowed type: refused, or (a subclass: IntEnum,
    numpy.float64, a str subclass) its exact base type, which is what matching compares and
    what the wire would carry anyway."""
    kind = kind_of(value)
    if kind is None:
        raise ValueError(
            f"attribute {name!r} has value {value!r} of type {type(value).__name__}; "
            "allowed: str, int, float (not NaN), bool"
        )
    if kind is Kind.STRING:
        return str.__str__(cast(str, value))
    if isinstance(value, float):
        return float.__float__(value)
    return int.__int__(cast(int, value))


@dataclass(frozen=True, slots=True)
class Event:
    """One notification as it travels: content plus envelope.

    ``id`` is derived, not stored: publisher ids are unique, so ``publisher:seq`` is too.
    """

    publisher: str
    seq: int
    attrs: Mapping[str, Value]
    hops: int = 0

    def __init__(self, publisher: str, seq: int, attrs: Mapping[str, Value], hops: int = 0) -> None:
        # Written out: dataclass's generated __init__ for a frozen class is Python code that
        # sets each field through object.__setattr__ (about 1 us here, and every broker an
        # event passes builds one); compiled, this is four stores. Frozen all the same.
        object.__setattr__(self, "publisher", publisher)
        object.__setattr__(self, "seq", seq)
        object.__setattr__(self, "attrs", attrs)
        object.__setattr__(self, "hops", hops)

    @property
    def id(self) -> str:
        return f"{self.publisher}:{self.seq}"

    def forwarded(self) -> Event:
        """The copy sent over one more overlay link."""
        return Event(self.publisher, self.seq, self.attrs, self.hops + 1)


Targets = tuple[tuple[str, tuple[str, ...]], ...]
"""Where one event is delivered locally: (client, its matching subscription ids), by client."""


def sample_hash(event_id: str) -> int:
    """A hash of the event id that is the same on every broker and every run.

    Telemetry keeps an event iff this hash falls under the sampling threshold, so all brokers keep
    the *same* events and intersections of their histories stay meaningful. (Python's ``hash`` is
    salted per process, so it cannot be used here.)
    """
    return zlib.crc32(event_id.encode())


def is_sampled(event_id: str, rate: float) -> bool:
    """Consistent sampling decision for ``rate`` in [0, 1]."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    return sample_hash(event_id) < int(rate * 0x1_0000_0000)


_PREFIX_CRC: dict[str, int] = {}  # publisher -> crc32 of "publisher:" (bounded, see below)


def event_sampled(publisher: str, seq: int, rate: float) -> bool:
    """``is_sampled(f"{publisher}:{seq}", rate)`` without building the id: a broker asks for
    every event it routes, so the CRC of each publisher's ``publisher:`` is kept and the
    sequence number's digits continue it (CRC-32 runs over bytes in order)."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    prefix = _PREFIX_CRC.get(publisher)
    if prefix is None:
        if len(_PREFIX_CRC) >= 4096:
            _PREFIX_CRC.clear()
        prefix = _PREFIX_CRC[publisher] = zlib.crc32(publisher.encode() + b":")
    return zlib.crc32(str(seq).encode(), prefix) < int(rate * 0x1_0000_0000)
