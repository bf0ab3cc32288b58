"""Hash tables that grow without a pause: a set and a dict split into shards once they are big.

Why: a Python ``dict`` or ``set`` doubles its hash table in one go when it fills, re-inserting
every entry. At 100,000 subscriptions the routing state and the matcher hold about ten tables of
that size, and equal-sized tables fill on the same insertion, so one route update paid for all
of them at once (15 ms measured on a quiet machine at 87,381 entries, 40-75 ms on a loaded one;
docs/performance.md). Split into :data:`SHARDS` independent tables, each doubling costs a
sixtieth as much, and the shards reach their thresholds on different insertions.

A table starts as one shard, so the many small tables (one per neighbour, per index bucket)
cost one extra object each, and splits once, when it passes :data:`SPLIT_AT` entries (a few
hundred microseconds). The shard of a key is ``hash(key) % SHARDS``, a prime: Python's own
tables index by the *low* bits of the hash, so a power-of-two mask would leave every key of a
shard on the same few slots.

Only what the broker needs is here, with the semantics of the built-ins (except that ``add`` and
``discard`` say whether they changed anything); iteration order is
unspecified (callers that need an order sort, as they already did). Compiled with mypyc along
with the matcher (setup.py), so the data plane's lookups stay native calls.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from itertools import chain
from typing import Any, Generic, TypeVar, overload

__all__ = ["SHARDS", "SPLIT_AT", "ShardedDict", "ShardedSet"]

K = TypeVar("K")
V = TypeVar("V")
S = TypeVar("S", bound=Collection[Any])

SHARDS = 61
"""Shards of a split table: a prime, so ``hash % SHARDS`` uses every bit of the hash."""

SPLIT_AT = 1024
"""Entries at which a one-shard table splits (and never merges back)."""


class _Sharded(Generic[K, S]):
    """What a set and a dict share: finding a key's shard, and the whole-table questions."""

    def __init__(self, first: S) -> None:
        self._shards: list[S] = [first]

    def _shard(self, key: object) -> S:
        shards = self._shards
        return shards[0] if len(shards) == 1 else shards[hash(key) % SHARDS]

    def __contains__(self, key: object) -> bool:
        return key in self._shard(key)

    def __len__(self) -> int:
        shards = self._shards
        return len(shards[0]) if len(shards) == 1 else sum(map(len, shards))

    def __bool__(self) -> bool:
        return any(self._shards)

    def __iter__(self) -> Iterator[K]:
        shards = self._shards
        return iter(shards[0]) if len(shards) == 1 else chain.from_iterable(shards)


class ShardedSet(_Sharded[K, set[K]]):
    """A set of hashable keys; see the module docstring."""

    def __init__(self, items: Iterable[K] = ()) -> None:
        super().__init__(set(items))
        if len(self._shards[0]) > SPLIT_AT:
            self._split()

    def _split(self) -> None:
        shards: list[set[K]] = [set() for _ in range(SHARDS)]
        for key in self._shards[0]:
            shards[hash(key) % SHARDS].add(key)
        self._shards = shards

    def add(self, key: K) -> bool:
        """Add ``key``; whether it was new (one lookup where ``in`` then ``add`` takes two)."""
        shards = self._shards
        if len(shards) > 1:
            shard = shards[hash(key) % SHARDS]
            n = len(shard)
            shard.add(key)
            return len(shard) != n
        only = shards[0]
        n = len(only)
        only.add(key)
        if n == SPLIT_AT:
            self._split()
        return len(only) != n

    def discard(self, key: K) -> bool:
        """Remove ``key`` if present; whether it was."""
        shard = self._shard(key)
        n = len(shard)
        shard.discard(key)
        return len(shard) != n

    def remove(self, key: K) -> None:
        self._shard(key).remove(key)

    def __repr__(self) -> str:
        return f"ShardedSet({set(self)!r})"


class ShardedDict(_Sharded[K, dict[K, V]]):
    """A mapping; see the module docstring."""

    def __init__(self) -> None:
        super().__init__({})

    def _split(self) -> None:
        shards: list[dict[K, V]] = [{} for _ in range(SHARDS)]
        for key, value in self._shards[0].items():
            shards[hash(key) % SHARDS][key] = value
        self._shards = shards

    def __getitem__(self, key: K) -> V:
        return self._shard(key)[key]

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: V) -> V: ...
    def get(self, key: K, default: V | None = None) -> V | None:
        return self._shard(key).get(key, default)

    def __setitem__(self, key: K, value: V) -> None:
        shards = self._shards
        if len(shards) == 1:
            only = shards[0]
            only[key] = value
            if len(only) > SPLIT_AT:
                self._split()
        else:
            shards[hash(key) % SHARDS][key] = value

    def __delitem__(self, key: K) -> None:
        del self._shard(key)[key]

    def pop(self, key: K) -> V:
        return self._shard(key).pop(key)

    def items(self) -> Iterator[tuple[K, V]]:
        return chain.from_iterable(shard.items() for shard in self._shards)

    def values(self) -> Iterator[V]:
        return chain.from_iterable(shard.values() for shard in self._shards)

    def __repr__(self) -> str:
        return f"ShardedDict({dict(self.items())!r})"
