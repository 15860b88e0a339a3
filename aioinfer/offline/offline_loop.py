"""The offline LLM's private event loop, driven from synchronous code: each call runs the loop
until its coroutine is done, and the loop sleeps between calls (the GPU thread stays up)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


class OfflineLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Drive the loop until `coro` is done."""
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("this LLM was shut down")
        task = self.loop.create_task(coro)
        try:
            return self.run_until(task)
        except BaseException:
            # A Ctrl-C raised in the loop's own wait leaves the batch's task pending: cancel it,
            # so that its requests are aborted and free their KV blocks before we return.
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    self.run_until(task)
            raise

    def run_until(self, task: asyncio.Task[_T]) -> _T:
        """Run the loop until `task` is done. Called from within a running event loop (a
        notebook, an async program), whose thread cannot run a second loop, it runs the loop
        on a worker thread meanwhile, as vLLM's LLM blocks its caller in a notebook."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self.loop.run_until_complete(task)
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def drive() -> None:
            try:
                done.set_result(self.loop.run_until_complete(task))
            except BaseException as exc:
                done.set_exception(exc)

        worker = threading.Thread(target=drive, name="aioinfer-llm-loop", daemon=True)
        worker.start()
        try:
            return done.result()
        except BaseException:
            if not done.done():  # interrupted while waiting: stop the batch on its own loop
                self.loop.call_soon_threadsafe(task.cancel)
                worker.join()
            raise
