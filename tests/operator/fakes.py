"""Stand-ins for the brokers' admin API that the operator's unit tests share."""

from __future__ import annotations

from canopy_broker.admin_client import AdminError


class LinkRemovals:
    """``admin(name)`` for brokers asked to remove links: records each (broker, peer), or
    refuses each with ``refusal`` (an AdminError, as a broker answers 409)."""

    def __init__(self, refusal: AdminError | None = None) -> None:
        self.removed: list[tuple[str, str]] = []
        self.refusal = refusal

    def __call__(self, name: str) -> _Admin:
        return _Admin(self, name)


class _Admin:
    def __init__(self, removals: LinkRemovals, name: str) -> None:
        self.removals, self.name = removals, name

    async def remove_link(self, peer: str) -> bool:
        if self.removals.refusal is not None:
            raise self.removals.refusal
        self.removals.removed.append((self.name, peer))
        return True
