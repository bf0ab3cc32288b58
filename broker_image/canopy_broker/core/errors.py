"""The one error the core raises: an input it cannot accept in its current state."""

from __future__ import annotations


class ProtocolError(Exception):
    """An input the core cannot accept in its current state (the state is left unchanged).

    The I/O shells translate it at one boundary: the runtime closes the offending connection,
    the simulator fails the run.
    """
