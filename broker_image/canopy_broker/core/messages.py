"""The broker core's vocabulary: wire messages, inputs and effects (all frozen dataclasses).

The core is a function from (state, input) to (state, effects). Everything that crosses its
boundary is one of the types here, which keeps the asyncio runtime and the discrete-event
simulator honest: they can only do what an effect tells them and only tell the core what an input
can say.

* **Link messages** travel between brokers over an overlay link (subscription routing and
  notifications).
* **Inputs** are what happened: a link was added or removed, a link or client message arrived.
* **Effects** are what to do: send a message on a link, deliver an event to a local client.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from canopy_broker.core.events import Event
from canopy_broker.core.filters import Filter


class RoutingMode(Enum):
    """How subscriptions are propagated (SIENA / Rebeca terminology).

    * ``simple``: every subscription travels to every broker (entries keyed by subscription id);
    * ``identity``: a filter is not forwarded where an identical one already was;
    * ``covering``: a filter is not forwarded where a covering one already was.
    """

    SIMPLE = "simple"
    IDENTITY = "identity"
    COVERING = "covering"


# --------------------------------------------------------------------------- link messages


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What a routing-table entry stores: a filter, tagged with the subscription id in simple
    routing (where identical filters of different subscriptions are kept apart) and with ``""``
    otherwise."""

    filter: Filter
    tag: str = ""

    def sort_key(self) -> tuple[tuple[int, str], str]:
        return (self.filter.sort_key(), self.tag)

    def __str__(self) -> str:
        return f"{self.filter} #{self.tag}" if self.tag else str(self.filter)


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Neighbour asks to receive events matching ``key.filter``."""

    key: RouteKey


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    """Neighbour withdraws an earlier :class:`Subscribe` of the same key."""

    key: RouteKey


@dataclass(frozen=True, slots=True)
class Publish:
    """A notification travelling over a link (``event.hops`` already counts this link)."""

    event: Event


LinkMessage = Subscribe | Unsubscribe | Publish


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class AddLink:
    """An overlay link to ``peer`` now exists (both ends get this input)."""

    peer: str


@dataclass(frozen=True, slots=True)
class RemoveLink:
    """The overlay link to ``peer`` is gone; routes through it are withdrawn (uncoordinated)."""

    peer: str


@dataclass(frozen=True, slots=True)
class FromLink:
    peer: str
    message: LinkMessage


@dataclass(frozen=True, slots=True)
class ClientAttach:
    client: str


@dataclass(frozen=True, slots=True)
class ClientDetach:
    """A client left (or its connection broke): its subscriptions are withdrawn."""

    client: str


@dataclass(frozen=True, slots=True)
class ClientSubscribe:
    client: str
    sub_id: str
    filter: Filter


@dataclass(frozen=True, slots=True)
class ClientUnsubscribe:
    client: str
    sub_id: str


@dataclass(frozen=True, slots=True)
class ClientPublish:
    client: str
    event: Event


Input = (
    AddLink
    | RemoveLink
    | FromLink
    | ClientAttach
    | ClientDetach
    | ClientSubscribe
    | ClientUnsubscribe
    | ClientPublish
)


# --------------------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class SendToLink:
    peer: str
    message: LinkMessage


@dataclass(frozen=True, slots=True)
class Deliver:
    """Deliver ``event`` once to ``client``; ``sub_ids`` are its subscriptions that matched."""

    client: str
    event: Event
    sub_ids: tuple[str, ...]


Effect = SendToLink | Deliver
