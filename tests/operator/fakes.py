"""Stand-ins for the brokers' admin API that the operator's unit tests share."""

from __future__ import annotations


class LinkRemovals:
    """``admin(name)`` for brokers asked to remove links: records each (broker, peer)."""

    def __init__(self) -> None:
        self.removed: list[tuple[str, str]] = []

    def __call__(self, name: str) -> _Admin:
        return _Admin(self, name)


class _Admin:
    def __init__(self, removals: LinkRemovals, name: str) -> None:
        self.removals, self.name = removals, name

    async def remove_link(self, peer: str) -> bool:
        self.removals.removed.append((self.name, peer))
        return True
