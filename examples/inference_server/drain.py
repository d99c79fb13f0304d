"""Draining without dropping: how the server stops under load.

A request is lost at shutdown when the server closes a connection the client has just sent it on:
an idle keep-alive connection, or one still in the listening socket's backlog when the listener
closes. The client then sees ``ReadError``/``RemoteProtocolError``, not an answer. So the server
drains in two steps:

1. *Draining* (from the signal on): the listener stays open and every connection is still served,
   new ``/predict`` requests get 503, and every response carries ``Connection: close``, so no
   client keeps a connection to reuse. A 503 while draining says ``Retry-After: retry_after``
   (longer than the quiet period below), so a client that honours it stays away until the server
   is gone. :class:`DrainGate` (ASGI middleware) sets both headers and counts the requests in
   progress.
2. *Closing*: once no request is in progress and nothing happened for ``quiet`` seconds (no
   request arrived, no answer was sent: :meth:`DrainGate.wait_quiet`), hypercorn stops accepting
   and closes the listener. A client connecting after that is refused, which it sees before
   sending anything.

What remains is a race Linux offers no way around: a listening socket cannot stop taking new
connections and keep the ones in its backlog (``shutdown`` on it resets them), so a client that
connects at the very moment the listener closes sees a reset. The quiet period makes that moment
one where no client is expected. The wait is bounded (``limit``): clients that ignore
``Retry-After`` and reconnect at once keep the server answering 503s until then.
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

    def __init__(self, app: ASGIApp, retry_after: int = 10) -> None:
        self.app = app
        self.retry_after = retry_after  #: seconds, in every 503 while draining
        self.draining = False
        self.active = 0  #: HTTP requests in progress
        self.received = 0  #: HTTP requests that reached the application
        self.answered = 0  #: HTTP requests whose answer was sent to the end
        self.last_activity = time.monotonic()  #: when a request last arrived or an answer ended

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
        self.received += 1
        self.last_activity = time.monotonic()

        async def send_closing(message: Message) -> None:
            if self.draining and message["type"] == "http.response.start":
                replaced = {b"connection"} | ({b"retry-after"} if message["status"] == 503 else set())
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in replaced]
                headers.append((b"connection", b"close"))
                if message["status"] == 503:
                    headers.append((b"retry-after", str(self.retry_after).encode()))
                message = {**message, "headers": headers}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.answered += 1
                self.last_activity = time.monotonic()

        try:
            await self.app(scope, receive, send_closing)
        finally:
            self.active -= 1

    async def wait_quiet(self, quiet: float, limit: float) -> bool:
        """Wait until no request is in progress and none arrived and no answer ended for ``quiet``
        seconds, at most ``limit`` seconds. Returns whether it got quiet.

        Cancellation: cancels the wait only.
        """
        deadline = time.monotonic() + limit
        while True:
            now = time.monotonic()
            idle_for = now - self.last_activity
            if self.active == 0 and idle_for >= quiet:
                return True
            if now >= deadline:
                await anyio.lowlevel.checkpoint()
                return False
            # a timed policy, not a synchronisation: re-check when the quiet period could be over
            await anyio.sleep(min(max(quiet - idle_for, quiet / 4), deadline - now))
