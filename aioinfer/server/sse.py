"""Server-sent events, and noticing that a client went away.

Framing: each event is `data: <json>\\n\\n`; a stream ends with `data: [DONE]\\n\\n`.

aiohttp does not cancel a handler when its client disconnects (unless the server runs with
`handler_cancellation=True`), and a handler waiting for its first token writes nothing that could
fail. So handlers run their work under a `DisconnectWatcher`: one task per app that checks, every
`interval` seconds, whether the connection of each watched request is gone, and cancels that
request's work. Cancelling the work leaves the engine's output iterator, which aborts the request
and returns its KV blocks to the pool before the next step. A failed write (the client closed the
socket while tokens flow) ends the work the same way, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterable
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
WATCH_INTERVAL = 0.1  # seconds between disconnect checks

_T = TypeVar("_T")


class ClientDisconnected(Exception):
    """The client closed its connection before the response was complete."""


def encode_event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class EventStream:
    """An SSE response. Every write raises ClientDisconnected once the client is gone."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> EventStream:
        response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        try:
            await response.prepare(request)
        except ConnectionResetError as exc:
            raise ClientDisconnected(str(exc)) from exc
        return cls(response)

    async def send(self, payloads: Iterable[Any]) -> None:
        """Write events in one go (one write per engine delta, however many choices moved)."""
        data = b"".join(encode_event(p) for p in payloads)
        if data:
            await self._write(data)

    async def send_done(self) -> None:
        await self._write(DONE)

    async def finish(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self.response.write_eof()

    async def _write(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionResetError as exc:
            raise ClientDisconnected(str(exc)) from exc


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class DisconnectWatcher:
    """Cancels the work of requests whose client disconnected; see the module doc."""

    def __init__(self, interval: float = WATCH_INTERVAL) -> None:
        self.interval = interval
        self._watched: dict[asyncio.Future[Any], web.Request] = {}

    @property
    def num_watched(self) -> int:
        return len(self._watched)

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
