"""The one error the core raises: an input it cannot accept in its current state."""

from __future__ import annotations


class ProtocolError(Exception):
    """An input the core cannot accept in its current state (the state is left unchanged).

    The I/O shells translate it at one boundary: the runtime closes the offending connection,
    the simulator fails the run.
    """


class CoreFailedError(Exception):
    """The core hit an unexpected error while applying an input, so its state may be
    half-applied; it refuses every further input. Not a :class:`ProtocolError`: no peer is to
    blame, and closing one connection would not help — the broker as a whole has failed."""
