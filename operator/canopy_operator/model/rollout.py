"""Rolling replacement: a new broker version or configuration, one broker at a time, loss-free.

Pure: what to replace, in which order, and the intermediate shape each replacement passes
through. A broker is replaced by two ordinary plans (the executor runs them;
:func:`canopy_operator.executor.replace_broker`):

1. **Out.** Plan from the live tree to :func:`without` — the declared overlay without the
   broker, its neighbours chained in its place (the shape a crash repair would give, paper 001,
   reached here by exchanges instead of a crash). The planner makes the broker a leaf by link
   exchanges, then removes it as a leaf: its clients are migrated to its remaining neighbour
   first (the client migration protocol), then its process or pod is deleted.
2. **Back.** Plan from that tree to the declared overlay: the broker, started anew with the new
   version or configuration, joins as a leaf; exchanges give it its declared links back.

Every step is one of the loss-free elementary steps, so the traffic of everybody (the
replaced broker's clients included: they are migrated, not dropped) goes on untouched. Clients
stay on the neighbour they were migrated to; a later reshape or their own reconnect spreads
them again.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence

from canopy_operator.model.topology import Edge, OverlaySpec, adjacency, norm


def without(spec: OverlaySpec, links: Iterable[Edge], broker: str) -> OverlaySpec:
    """The overlay ``spec`` with ``broker`` gone: its neighbours in the live ``links`` chained
    (in name order) where it was. Managed links: just the broker set without it."""
    brokers = tuple(b for b in spec.brokers if b.name != broker)
    if spec.links is None:
        return dataclasses.replace(spec, brokers=brokers)
    live = [norm(e) for e in links]
    neighbours = sorted(adjacency(live).get(broker, set()))
    kept = [e for e in live if broker not in e]
    chain = [norm((a, b)) for a, b in itertools.pairwise(neighbours)]
    return dataclasses.replace(spec, brokers=brokers, links=tuple(kept + chain))


def stale(
    brokers: Mapping[str, Sequence[str] | None], wanted: Callable[[str], Sequence[str]]
) -> list[str]:
    """Brokers started with another configuration than ``wanted`` gives for them (``brokers``:
    each one's recorded configuration; None: unknown, e.g. started before configurations were
    recorded — replaced too, to be sure)."""
    return sorted(b for b, have in brokers.items() if have is None or list(have) != list(wanted(b)))


def order(links: Iterable[Edge], todo: Iterable[str]) -> list[str]:
    """Replacement order: leaves first (a leaf needs no exchange to go and come back), then by
    fewest links, then by name, so the cheapest replacements are done before the dear ones."""
    degree = {b: len(ns) for b, ns in adjacency([norm(e) for e in links]).items()}
    return sorted(todo, key=lambda b: (degree.get(b, 0), b))
