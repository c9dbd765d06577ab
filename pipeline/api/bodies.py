"""Request bodies on time: :class:`BodyDeadline`, the ASGI middleware that gives a body
``FRESHLINE_API_BODY_TIMEOUT_S`` to arrive (408 past it) and ends a request whose client
hangs up mid-body as 499, neither a server error (docs/security.md)."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from freshline.pipeline.api.deadlines import Deadlines
from freshline.pipeline.api.errors import ApiError


class ClientClosed(ApiError):
    """The client went away before sending the whole body (logged as nothing worse)."""

    def __init__(self) -> None:
        super().__init__(499, "client_closed", "the client closed the connection mid-request")


class BodyDeadline:
    """ASGI middleware: the body of a request whose path starts with ``prefix`` must
    arrive within ``timeout_s`` (408 otherwise, checked every tenth of it by
    :class:`freshline.pipeline.api.deadlines.Deadlines`, so the answer comes within 1.1
    times the limit), and a client that goes away mid-body ends the request as 499
    ("client closed request")."""

    def __init__(self, app: ASGIApp, *, timeout_s: float, prefix: str = "/") -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.prefix = prefix
        self._deadlines = Deadlines(tick_s=timeout_s / 10)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            receive = self._bounded(receive)
        await self.app(scope, receive, send)

    def _bounded(self, receive: Receive) -> Receive:
        """``receive`` with the body due within the timeout, and a disconnect mid-body
        turned into :class:`ClientClosed` rather than an unexpected exception."""
        deadline = time.monotonic() + self.timeout_s
        done = False

        async def bounded() -> Message:
            nonlocal done
            if done:
                return await receive()
            try:
                # One check per loop, not a timer per call (anyio's cancel scope or
                # asyncio.timeout): the API runs on asyncio (its Redis client is
                # redis.asyncio).
                message = await self._deadlines.bound(
                    receive(), max(0.0, deadline - time.monotonic())
                )
            except TimeoutError:
                raise ApiError(
                    408,
                    "body_timeout",
                    f"the request body did not arrive within {self.timeout_s:g} s",
                ) from None
            if message["type"] == "http.disconnect":
                raise ClientClosed()
            if not message.get("more_body", False):
                done = True
            return message

        return bounded
