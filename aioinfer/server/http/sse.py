"""Server-sent events, and noticing that a client went away or stopped reading.

Framing: each event is `data: <json>\\n\\n`; a stream ends with `data: [DONE]\\n\\n`. (The
Responses API names each event instead, `event: <type>\\ndata: <json>\\n\\n`, and sends no
[DONE].) While a stream waits (in the queue, behind a long prefill) a comment line
`: keep-alive` goes out every `interval` seconds so that proxies do not close an idle
connection.

The status line and headers go out with the first write, not before: a request that fails before
its first token (the engine died, it waited too long in the queue) still gets a plain HTTP error.

aiohttp does not cancel a handler when its client disconnects (unless the server runs with
`handler_cancellation=True`), and a handler waiting for its first token writes nothing that could
fail. So handlers run their work under a `DisconnectWatcher`: one task per app that checks, every
`interval` seconds, whether the connection of each watched request is gone, and cancels that
request's work. A failed write (the client closed the socket while tokens flow) ends the work at
once. A write that blocks longer than the write timeout (a client that stopped reading, so the
socket buffers are full) closes the connection, which drops what was buffered for it; memory per
stream stays bounded by those buffers. The handler then aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import orjson
from aiohttp import web

logger = logging.getLogger(__name__)

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
WATCH_INTERVAL = 0.1  # seconds between disconnect checks
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer

_T = TypeVar("_T")


class ClientDisconnected(Exception):
    """The client closed its connection, or stopped reading, before the response was complete.
    `reason` is the abort reason the metrics count: client_disconnect or write_timeout."""

    def __init__(self, message: str, reason: str = "client_disconnect") -> None:
        super().__init__(message)
        self.reason = reason


def client_closed() -> web.Response:
    """The answer to a client that left first: nobody reads it, the request log shows it."""
    return web.Response(status=CLIENT_CLOSED_REQUEST, reason="Client Closed Request")


def encode_event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def encode_named_event(payload: Any) -> bytes:
    """An event named by its payload's `type`, as the Responses API streams them."""
    return b"event: " + payload["type"].encode() + b"\n" + encode_event(payload)


class EventStream:
    """An SSE response, prepared by its first write. Every write raises ClientDisconnected once
    the client is gone or when it blocks for longer than `write_timeout` seconds. `encode`
    frames one payload."""

    def __init__(
        self,
        request: web.Request,
        write_timeout: float,
        encode: Callable[[Any], bytes] = encode_event,
    ) -> None:
        self.request = request
        self.write_timeout = write_timeout
        self.encode = encode
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)

    @property
    def started(self) -> bool:
        """Whether the status line went out (errors can then only be reported in band)."""
        return self.response.prepared

    async def send(self, payloads: Iterable[Any]) -> None:
        """Write events in one go (one write per engine delta, however many choices moved)."""
        data = b"".join(self.encode(p) for p in payloads)
        if data:
            await self._write(data)

    async def send_done(self) -> None:
        await self._write(DONE)

    async def send_keep_alive(self) -> None:
        await self._write(KEEP_ALIVE)

    async def finish(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self.response.write_eof()

    async def _write(self, data: bytes) -> None:
        protocol = self.request.protocol
        if self.response.prepared and protocol is not None and not protocol.writing_paused:
            # The transport takes the bytes at once (it pauses the protocol when its buffer is
            # full): no wait, so no timer to arm, as each token's write would otherwise.
            try:
                await self.response.write(data)
            except ConnectionError as exc:
                raise ClientDisconnected(str(exc)) from exc
            return
        try:
            await within(self.write_timeout, self._prepare_and_write(data))
        except asyncio.TimeoutError:
            self._drop_connection()
            raise ClientDisconnected(
                f"the client did not read for {self.write_timeout:g} s", reason="write_timeout"
            ) from None
        except ConnectionError as exc:  # reset, broken pipe, or lost while waiting to drain
            raise ClientDisconnected(str(exc)) from exc

    async def _prepare_and_write(self, data: bytes) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)
        await self.response.write(data)

    def _drop_connection(self) -> None:
        transport = self.request.transport
        if transport is not None:
            transport.abort()  # discards the bytes buffered for this client


if sys.version_info >= (3, 11):

    async def within(seconds: float, work: Coroutine[Any, Any, _T]) -> _T:
        """`await work`, or TimeoutError after `seconds`; a timer, not a task, per call."""
        async with asyncio.timeout(seconds):
            return await work

else:

    async def within(seconds: float, work: Coroutine[Any, Any, _T]) -> _T:
        """`await work`, or asyncio.TimeoutError after `seconds`."""
        return await asyncio.wait_for(work, seconds)


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class DisconnectWatcher:
    """Cancels the work of requests whose client disconnected; see the module doc."""

    def __init__(self, interval: float = WATCH_INTERVAL) -> None:
        self.interval = interval
        self._watched: dict[asyncio.Future[Any], web.Request] = {}

    async def run(self) -> None:
        """The watching loop; the app runs it for its whole life."""
        while True:
            await asyncio.sleep(self.interval)
            self.check()

    def check(self) -> None:
        for work, request in list(self._watched.items()):
            if not work.done() and client_gone(request):
                work.cancel()

    async def guard(self, request: web.Request, work: Awaitable[_T]) -> _T:
        """Run `work` until it finishes or the client goes away (ClientDisconnected). When the
        handler itself is cancelled, the work is cancelled and awaited first."""
        task = asyncio.ensure_future(work)
        self._watched[task] = request
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.wait((task,))
            raise
        finally:
            self._watched.pop(task, None)
        if task.cancelled():
            raise ClientDisconnected("client closed the connection")
        return task.result()
