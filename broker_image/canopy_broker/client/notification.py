"""What a client receives: notifications, the stream of them, and the client's error type."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from canopy_broker.runtime.inbox import Notification


class ClientError(Exception):
    """The broker refused something or the connection ended abnormally."""

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


class ConnectionLostError(ClientError):
    """The connection to the broker ended without the application closing it: the broker died,
    was stopped, or dropped us. Raised by :meth:`Client.receive` (and so ends
    ``notifications()``) instead of an end of stream that would look like a normal one."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "connection-lost")


ConnectionLost = ConnectionLostError  # the short name the docs use


class NotificationStream:
    """Async iterator over a client's notifications (a class, not an async generator, so that
    breaking out of ``async for`` leaves nothing to finalise)."""

    def __init__(self, receive: Callable[[int], Awaitable[list[Notification]]]) -> None:
        self._receive = receive

    def __aiter__(self) -> NotificationStream:
        return self

    async def __anext__(self) -> Notification:
        batch = await self._receive(1)
        if not batch:
            raise StopAsyncIteration
        return batch[0]
