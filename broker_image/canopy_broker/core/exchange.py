"""Per-broker state of one coordinated link exchange, and where this broker sits on the cycle.

The exchange removes r = (R1, R2) and adds a = (A1, A2). Its *cycle* is given as the tree path
``path = [A1, ..., R1, R2, ..., A2]``; ``k`` is R1's index. Side 1 is ``path[0..k]`` and side 2
is ``path[k+1..]``. On each side, *down* points towards the removed link and *up* towards the
added one (for A1 and A2, up is the added link itself; for R1 and R2, down is the removed link).

How the protocol runs (each step is a message handled by ``BrokerCore``):

1. **Lock** travels A1 → A2 over tree links; each broker joins only one exchange at a time and
   turns *black*. A busy broker (or a hop that is not a link) sends **LockRefused** back, which
   releases every broker on the way; A1 retries with randomised exponential backoff. A2, the last
   to lock, answers **Granted**, which travels back to A1. A1 and A2 add the new link when they
   lock, *frozen*: no routing advertisement crosses it until the end.
2. **Phase 1.** When Granted passes an R end, that R end freezes the removed link too, and sends
   its A end (out of band) a **Transfer**: the routing keys it holds from r — exactly what the A
   end must hold from a in the new tree. Later routing changes arriving over r are **Relay**-ed. A
   **Separator** follows the transfer. The A end installs the keys as if received over a, which
   propagates them down its side of the cycle by ordinary covering/identity forwarding.
3. The separator walks its side down to its R end, turning each broker *gray*, crosses r, and
   walks the other side up to the other A end, where it is absorbed. When it returns to its R end,
   that end starts **phase 2**: it drops r's routing entries, which withdraws them up its side.
   An R end that has done phase 2 and received the other side's separator closes r, says
   **RelayEnd** to its A end and sends **End** up its side; each broker releases its lock as End
   passes.
4. Notifications carry a colour (:class:`~canopy_broker.core.messages.Tag`) on the cycle: black
   ones cross r only, gray ones cross a only, so each takes exactly one of the two paths. A
   message takes the colour of the broker where it enters the cycle; an untagged message from a
   cycle neighbour was sent before that neighbour locked, so it is black. Gray notifications that
   cross a are queued at the far A end until the other side's separator has arrived there (no
   black notification of that publisher can still overtake them) — FIFO-publisher order. For
   causal order the queue also waits for an **Echo** of the A end's own separator, sent up by its
   R end: then no black notification of its own side is still on its way to the A end either.
5. An A end that has End, RelayEnd and the other separator unfreezes a and sends **Done** with
   the complete set it advertises over a; the other A end, which holds the old advertisement of
   this side (its R end's transfer), applies the difference. With Done from both sides the
   exchange is finished; A1 reports it.

Routing changes made by subscribers *during* an exchange propagate normally inside each side; they
cross between the sides when the exchange completes (step 5), which is when they are established.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from canopy_broker.core.messages import FromLink, Ordering


@dataclass
class Exchange:
    xid: str
    path: tuple[str, ...]
    k: int
    me: int
    ordering: Ordering = Ordering.FIFO
    lease: float = 30.0
    gray: bool = False
    granted: bool = False
    phase2_done: bool = False
    other_sep_seen: bool = False
    relay_end: bool = False
    end_seen: bool = False
    own_done: bool = False
    peer_done: bool = False
    echo_seen: bool = False
    by_lease: bool = False  # this broker finished its part because the lease ran out
    queue_released: bool = False
    queue: list[tuple[float, FromLink]] = field(default_factory=list)
    queued_total: int = 0

    @property
    def last(self) -> int:
        return len(self.path) - 1

    @property
    def side(self) -> int:
        return 1 if self.me <= self.k else 2

    @property
    def is_a(self) -> bool:
        return self.me in (0, self.last)

    @property
    def is_r(self) -> bool:
        return self.me in (self.k, self.k + 1)

    @property
    def a_peer(self) -> str | None:
        """The other end of the added link, if this broker is an A end."""
        if self.me == 0:
            return self.path[-1]
        if self.me == self.last:
            return self.path[0]
        return None

    @property
    def r_peer(self) -> str | None:
        """The other end of the removed link, if this broker is an R end."""
        if self.me == self.k:
            return self.path[self.k + 1]
        if self.me == self.k + 1:
            return self.path[self.k]
        return None

    @property
    def down(self) -> str:
        """Next broker towards the removed link (over it, for an R end)."""
        return self.path[self.me + 1] if self.side == 1 else self.path[self.me - 1]

    @property
    def up(self) -> str:
        """Next broker towards the added link (over it, for an A end)."""
        if self.is_a:
            a = self.a_peer
            assert a is not None
            return a
        return self.path[self.me - 1] if self.side == 1 else self.path[self.me + 1]

    @property
    def a_end_of_my_side(self) -> str:
        return self.path[0] if self.side == 1 else self.path[-1]

    @property
    def r_end_of_my_side(self) -> str:
        return self.path[self.k] if self.side == 1 else self.path[self.k + 1]

    def cycle_peers(self) -> tuple[str, str]:
        return (self.up, self.down)


def backoff(xid: str, attempt: int, base: float = 0.05, cap: float = 5.0) -> float:
    """Randomised exponential backoff without a random source: the jitter is a hash of the
    exchange id and the attempt, so runs stay reproducible while colliding exchanges (which have
    different ids) spread out."""
    jitter = zlib.crc32(f"{xid}#{attempt}".encode()) / 0x1_0000_0000
    return float(min(cap, base * (2 ** min(attempt, 16))) * (0.5 + jitter))


def validate_path(path: tuple[str, ...], remove: tuple[str, str]) -> int:
    """Return k (R1's index) or raise ``ValueError`` saying what is wrong with the request."""
    if len(set(path)) != len(path):
        raise ValueError(f"cycle path repeats a broker: {list(path)}")
    if len(path) < 3:
        raise ValueError(
            f"cycle path {list(path)} is too short: the added link must differ from the removed one"
        )
    for k in range(len(path) - 1):
        if {path[k], path[k + 1]} == set(remove):
            return k
    raise ValueError(f"removed link {remove[0]}-{remove[1]} is not on the cycle path {list(path)}")
