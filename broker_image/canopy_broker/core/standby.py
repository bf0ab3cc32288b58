"""Standby links (paper 003): which extra links a broker keeps open so that one failure in the
underlay never cuts it off from the root of the tree.

Paper 003 adds to every broker N of a tree, besides its active link to its parent C:

* an **alternate path** to C through a neighbour A of C (a standby link N-A, then A's existing
  link to C), whose underlay path shares no element with the direct one except its two ends, so a
  router or machine on the direct path can fail without separating N from C;
* a **grandparent link** N-P to C's parent P whose underlay path avoids C (and everything on the
  two paths to C), so N reaches P when C itself fails.

The choice is pure, so the broker runtime can later call the same function to pre-open the links
it must keep warm, and the simulator uses it to reproduce the paper's Fig. 5. It knows nothing of
the simulator or of a particular underlay; the caller describes the underlay with two functions:

* ``path(a, b)``: the underlay elements (routers, hosts, nodes, zones ...) a link between brokers
  ``a`` and ``b`` crosses, ``a``'s location first and ``b``'s last. For an existing link, the path
  it was opened on (paper 003 pins each overlay link to one physical path).
* ``avoiding(a, b, avoid)``: a path for a *new* link between ``a`` and ``b`` that crosses none of
  ``avoid``, or None. An underlay that lets us choose paths (source routing, relays) searches for
  one; one that does not answers ``path(a, b)`` if it happens to avoid them
  (:func:`fixed_routes`).

and optionally ``domains(b)``: the elements whose failure is the failure of broker ``b`` itself
(its host; in Kubernetes its node and zone). An element in a broker's own domains is an *end* of a
path, never in its interior: if it fails, the broker is down and no path can help.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

UnderlayPath = tuple[str, ...]
PathOf = Callable[[str, str], Sequence[str]]
Avoiding = Callable[[str, str, frozenset[str]], Sequence[str] | None]
Domains = Callable[[str], frozenset[str]]


def host_domain(path: PathOf) -> Domains:
    """A broker's own failure domain when each broker is on one underlay node: the first element
    of any path from it."""
    return lambda b: frozenset((path(b, b)[0],))


def fixed_routes(path: PathOf) -> Avoiding:
    """``avoiding`` for an underlay without path choice: the one route, if it avoids the set."""

    def avoiding(a: str, b: str, avoid: frozenset[str]) -> Sequence[str] | None:
        p = path(a, b)
        return p if avoid.isdisjoint(p) else None

    return avoiding


@dataclass(frozen=True)
class Standby:
    """What broker ``broker`` keeps besides its active link to ``parent`` (paper 003)."""

    broker: str
    parent: str
    direct: UnderlayPath  # the active link's underlay path (x in the paper's lemma)
    alternate: str | None = None  # A, a neighbour of the parent
    via_alternate: UnderlayPath | None = None  # broker -> A -> parent (y); None if no A fits
    grandparent: str | None = None  # P, the parent's parent (None: the parent is the root)
    to_grandparent: UnderlayPath | None = None  # z, avoiding the parent; None if none exists

    @property
    def links(self) -> list[tuple[str, str]]:
        """The standby overlay links this broker opens: to A, and to P."""
        out: list[tuple[str, str]] = []
        if self.alternate is not None and self.via_alternate is not None:
            out.append((self.broker, self.alternate))
        if self.grandparent is not None and self.to_grandparent is not None:
            out.append((self.broker, self.grandparent))
        return out


def interior(path: Sequence[str], ends: frozenset[str]) -> frozenset[str]:
    """The elements of ``path`` whose failure is not the failure of one of its end brokers."""
    return frozenset(path) - ends


def choose_standby(
    broker: str,
    parent: str,
    grandparent: str | None,
    parent_neighbours: Iterable[str],
    *,
    path: PathOf,
    avoiding: Avoiding,
    domains: Domains | None = None,
) -> Standby:
    """The standby links of ``broker`` whose active link goes to ``parent``.

    The alternate neighbour A is, among ``parent``'s neighbours other than ``broker`` and the
    grandparent, the nearest one (fewest underlay elements on N->A->C; paper 003 picks by IP hops)
    whose path N->A->C shares no interior element with the direct path and passes neither end,
    preferring one that shares no failure domain with the parent (a zone that takes the parent
    down should not take A with it). The grandparent is excluded because its link is the third
    path and must be disjoint from this one.

    The grandparent link is a path to P that avoids the parent's domains and every interior
    element of the two paths to C. Where the underlay has none (two disjoint paths to C already
    use both ways out of a host of degree two), it is one that avoids at least the parent, the
    one condition the paper's join algorithm itself states. Either link may be None when no path
    fits at all. A broker that falls short of the paper's lemma is reported by
    :func:`violations`; the links are still worth keeping (the simulator measures how much).
    """
    dom = domains or host_domain(path)
    mine, theirs = dom(broker), dom(parent)
    ends = mine | theirs
    x = tuple(path(broker, parent))
    x_set = frozenset(x)

    candidates: list[tuple[int, int, str, UnderlayPath]] = []
    for a in set(parent_neighbours) - {broker, parent, grandparent}:
        first, second = path(broker, a), path(a, parent)
        y = (*first, *second[1:])
        if interior(y, ends) & x_set:
            continue
        candidates.append((len(dom(a) & theirs), len(y), a, y))
    alternate: str | None = None
    y_best: UnderlayPath | None = None
    if candidates:
        _, _, alternate, y_best = min(candidates)

    z: UnderlayPath | None = None
    if grandparent is not None:
        avoid = interior(x, ends) | theirs
        if y_best is not None:
            avoid |= interior(y_best, ends)
        avoid -= mine | dom(grandparent)
        found = avoiding(broker, grandparent, avoid)
        if found is None:
            # Three pairwise disjoint paths need three ways out of the broker's host; with two,
            # keep the one condition the join algorithm itself states: z avoids the parent.
            found = avoiding(broker, grandparent, theirs - mine - dom(grandparent))
        z = tuple(found) if found is not None else None
    return Standby(broker, parent, x, alternate, y_best, grandparent, z)


def plan_standby(
    parent_of: Mapping[str, str | None],
    *,
    path: PathOf,
    avoiding: Avoiding,
    domains: Domains | None = None,
) -> dict[str, Standby]:
    """Standby links for every non-root broker of the tree given by ``parent_of`` (the root maps
    to None): what an overlay would pre-open after it is built or reshaped."""
    neighbours: dict[str, set[str]] = {b: set() for b in parent_of}
    for b, p in parent_of.items():
        if p is not None:
            neighbours[b].add(p)
            neighbours[p].add(b)
    out: dict[str, Standby] = {}
    for b, p in parent_of.items():
        if p is None:
            continue
        out[b] = choose_standby(
            b,
            p,
            parent_of[p],
            sorted(neighbours[p]),
            path=path,
            avoiding=avoiding,
            domains=domains,
        )
    return out


def violations(s: Standby, *, domains: Domains) -> list[str]:
    """Why ``s`` does not give the paper's guarantee (empty when it does): the lemma of paper 003
    needs y and z, with y, z and the direct path x pairwise disjoint apart from their ends, and z
    clear of the parent. Used by the tests and by the experiment's negative control."""
    problems: list[str] = []
    mine, theirs = domains(s.broker), domains(s.parent)
    ends = mine | theirs
    x_in = interior(s.direct, ends)
    if s.via_alternate is None:
        problems.append(f"{s.broker}: no alternate path to {s.parent}")
    else:
        y_in = interior(s.via_alternate, ends)
        if y_in & frozenset(s.direct):
            problems.append(f"{s.broker}: alternate path via {s.alternate} meets the direct one")
        x_in |= y_in
    if s.grandparent is not None:
        if s.to_grandparent is None:
            problems.append(f"{s.broker}: no path to {s.grandparent} avoiding {s.parent}")
        else:
            z_in = interior(s.to_grandparent, mine | domains(s.grandparent))
            if z_in & theirs:
                problems.append(f"{s.broker}: link to {s.grandparent} crosses {s.parent}")
            if z_in & x_in:
                problems.append(
                    f"{s.broker}: link to {s.grandparent} meets the paths to {s.parent}"
                )
    return problems
