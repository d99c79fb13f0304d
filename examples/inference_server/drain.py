"""Draining without dropping: how the server stops under load.

A request is lost at shutdown when the server closes a connection the client has just sent it on:
an idle keep-alive connection, or one still in the listening socket's backlog when the listener
closes. The client then sees ``ReadError``/``RemoteProtocolError``, not an answer. So the server
drains in two steps:

1. *Draining* (from the signal on): the listener stays open and every connection is still served,
   new ``/predict`` requests get 503 with ``Retry-After``, and every response carries
   ``Connection: close``, so no client keeps a connection to reuse. :class:`DrainGate` (ASGI
   middleware) adds the header and counts the requests in progress.
2. *Closing*: once no request is in progress and none has arrived for ``quiet`` seconds
   (:meth:`DrainGate.wait_quiet`; a client honouring ``Retry-After`` stays away longer than that),
   hypercorn stops accepting and closes the listener. A client connecting after that is refused,
   which it sees before sending anything.

The quiet wait is bounded (``limit``): a client that ignores ``Retry-After`` and reconnects at
once keeps the server busy answering 503s until then.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio
import anyio.lowlevel

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class DrainGate:
    """ASGI middleware: counts HTTP requests in progress and, once :attr:`draining` is set, makes
    every response close its connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.draining = False
        self.active = 0  #: HTTP requests in progress
        self.last_start = time.monotonic()  #: when the latest request arrived

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.active += 1
        self.last_start = time.monotonic()

        async def send_closing(message: Message) -> None:
            if self.draining and message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, receive, send_closing)
        finally:
            self.active -= 1

    async def wait_quiet(self, quiet: float, limit: float) -> bool:
        """Wait until no request is in progress and none arrived for ``quiet`` seconds, at most
        ``limit`` seconds. Returns whether it got quiet.

        Cancellation: cancels the wait only.
        """
        deadline = time.monotonic() + limit
        while True:
            now = time.monotonic()
            idle_for = now - self.last_start
            if self.active == 0 and idle_for >= quiet:
                return True
            if now >= deadline:
                await anyio.lowlevel.checkpoint()
                return False
            # a timed policy, not a synchronisation: re-check when the quiet period could be over
            await anyio.sleep(min(max(quiet - idle_for, quiet / 4), deadline - now))
