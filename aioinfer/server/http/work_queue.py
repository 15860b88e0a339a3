"""Bounded queues of work that runs off the event loop: threads of their own for one kind of
slow work, at most so many jobs waiting (a 503 with Retry-After beyond), each job under the
disconnect watcher (one whose client leaves while it waits is cancelled and leaves the count
at once).

OFF_LOOP holds a request's own slow preparation: validating a large body, converting and
rendering a large chat, tokenizing a long text. Before it, these waited on the event loop's
default executor, whose queue has no bound: a client could queue minutes of work ahead of
every other large request, none of it counted or refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from aioinfer.server.http.errors import ServiceUnavailableError
from aioinfer.server.http.state import STATE

_T = TypeVar("_T")

RETRY_AFTER = "1"  # seconds, on 503s of a full queue


class WorkQueue:
    """Threads of their own (named aioinfer-`name`) for one kind of slow work (`what`:
    grammar compiles, request templates, a request's preparation), so that a few slow jobs
    wait for each other instead of holding up other kinds of work. At most `max_waiting` jobs
    wait for a thread; a request beyond that is a 503 with Retry-After. A job whose client
    leaves while it waits is cancelled and leaves the count at once; one that started runs to
    its end. Threads start on first use."""

    def __init__(self, what: str, name: str, threads: int, max_waiting: int) -> None:
        self.what = what
        self.threads = threads
        self.max_waiting = max_waiting
        self.in_flight = 0  # jobs running or waiting
        self._lock = threading.Lock()  # the count drops on the job's thread
        self._executor = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix=f"aioinfer-{name}"
        )

    def submit(self, fn: Callable[..., _T], *args: Any) -> concurrent.futures.Future[_T] | None:
        """fn(*args) queued, or None while the queue is full."""
        with self._lock:
            if self.in_flight >= self.threads + self.max_waiting:
                return None
            self.in_flight += 1
        future = self._executor.submit(fn, *args)
        future.add_done_callback(self._done)
        return future

    async def run(self, request: web.Request, fn: Callable[..., _T], *args: Any) -> _T:
        """fn(*args) on one of the threads, under the disconnect watcher; 503 while full."""
        future = self.submit(fn, *args)
        if future is None:
            raise ServiceUnavailableError(
                f"The server is overloaded: {self.in_flight} {self.what} are running or "
                "waiting; retry later",
                headers={"Retry-After": RETRY_AFTER},
            )
        return await request.app[STATE].watcher.guard(request, asyncio.wrap_future(future))

    def _done(self, _: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self.in_flight -= 1


# Tokenizers release the interpreter lock, templates and validation do not: a few threads,
# and enough waiting room for a burst of ordinary large chats (an agent's tools alone are
# often past the 16 KiB that sends a chat here), while a flood of megabyte prompts, seconds of
# work each, is refused instead of waiting behind itself for minutes.
OFF_LOOP = WorkQueue(
    "large requests to validate, render or tokenize", "prepare", threads=4, max_waiting=256
)
