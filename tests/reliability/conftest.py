"""Fixtures for the reliability tests: the app and the fake-runner engine of tests/server on a
server thread of their own (for synchronous clients such as schemathesis), and helpers to run
`aioinfer serve` as a subprocess on a tiny random model folder."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from aioinfer.config import ServerConfig
from aioinfer.engine.async_engine import AsyncEngine
from aioinfer.server.app import create_app
from tests.server.conftest import LiveServer, build_engine
from tests.support.serve_process import make_tiny_model_dir

_T = TypeVar("_T")


class ThreadedServer:
    """The real app over the fake engine, served by a loop on its own thread."""

    def __init__(self, config: ServerConfig | None = None, **engine_kwargs: Any) -> None:
        self.config = config or ServerConfig()
        self.engine_kwargs = engine_kwargs
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.engine: AsyncEngine | None = None
        self.server: LiveServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float = 30.0) -> _T:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ThreadedServer:
        self.thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        self.engine = await build_engine(**self.engine_kwargs)
        self.server = await LiveServer(create_app(self.engine, self.config)).start()

    def stop(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _stop(self) -> None:
        assert self.server is not None and self.engine is not None
        await self.server.stop()
        await self.engine.shutdown()


@pytest.fixture(scope="module")
def threaded_server() -> Iterator[ThreadedServer]:
    server = ThreadedServer().start()
    yield server
    server.stop()


# --------------------------------------------------------------------------- subprocesses


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose context is long enough to keep requests running for seconds."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-reliability"), 8192)
