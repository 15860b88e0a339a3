"""The aiohttp application: `create_app(engine_or_factory, server_config)`.

The port can be bound before the engine exists. Given a factory (a coroutine function returning
a started AsyncEngine), the app creates the engine in a background task owned by a cleanup_ctx,
so the server listens, and /health answers 503, while weights load; /health turns 200 once the
engine serves and back to 503 if it dies or the server shuts down. Given a built engine (tests,
embedding), the app serves it at once and leaves its shutdown to the caller.

    app = create_app(lambda: AsyncEngine.create(model_cfg, cache_cfg, sched_cfg), server_cfg)
    web.run_app(app, host=server_cfg.host, port=server_cfg.port,
                shutdown_timeout=server_cfg.shutdown_timeout)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Union

from aiohttp import web
from aiohttp.typedefs import Middleware

from aioinfer.config import ServerConfig
from aioinfer.server.http.auth import make_auth_middleware
from aioinfer.server.http.bodies import MAX_BODY_BYTES
from aioinfer.server.http.cors import CorsPolicy
from aioinfer.server.http.errors import error_middleware
from aioinfer.server.http.probes import quiet_probes
from aioinfer.server.http.request_id import echo_request_id
from aioinfer.server.http.sse import WATCH_INTERVAL, DisconnectWatcher
from aioinfer.server.http.state import STATE, ServerState
from aioinfer.server.responses.state import RESPONSES, ResponsesState
from aioinfer.server.routes import setup_routes

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], Awaitable["AsyncEngine"]]
EngineProvider = Union["AsyncEngine", EngineFactory]
# Called once when the engine fails to start or dies: the CLI exits non-zero from there.
FatalCallback = Callable[[BaseException], None]
ABORT_GRACE = 2.0  # seconds for handlers to write the final chunk of an aborted request
DRAIN_POLL = 0.02  # seconds

__all__ = ["STATE", "ServerState", "create_app", "drain", "wait_for_engine"]


def create_app(
    engine: EngineProvider,
    server_config: ServerConfig | None = None,
    *,
    on_fatal: FatalCallback | None = None,
    owns_engine: bool | None = None,
    disconnect_check_interval: float = WATCH_INTERVAL,
) -> web.Application:
    """The OpenAI-compatible app around an engine, or around a factory that builds one.

    `owns_engine` (default: True for a factory, False for a built engine) makes the app shut the
    engine down on cleanup. `on_fatal` is called once with the error when the factory raises or
    the engine dies.
    """
    config = server_config or ServerConfig()
    quiet_probes()
    state = ServerState(config, watcher=DisconnectWatcher(disconnect_check_interval))
    middlewares: list[Middleware] = [error_middleware]
    cors = CorsPolicy(config.allowed_origins) if config.allowed_origins else None
    if cors is not None:
        middlewares.append(cors.middleware())
    separate = len(config.api_key) > 1 and not config.share_prefix_cache_across_keys
    auth = make_auth_middleware(config.api_key, separate_prefixes=separate)
    if auth is not None:
        middlewares.append(auth)
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app[RESPONSES] = ResponsesState()  # the Responses API's stored and background responses
    setup_routes(app)
    factory: EngineFactory | None = engine if callable(engine) else None
    if factory is None:
        state.set_engine(engine)  # type: ignore[arg-type]
    owns = owns_engine if owns_engine is not None else factory is not None
    app.cleanup_ctx.append(_engine_context(factory, owns, on_fatal))
    app.cleanup_ctx.append(_watcher_context)
    app.on_shutdown.append(_start_draining)
    app.on_response_prepare.append(echo_request_id)
    if cors is not None:
        app.on_response_prepare.append(cors.add_headers)
    return app


async def wait_for_engine(app: web.Application) -> AsyncEngine:
    """The engine once it serves; raises the factory's error when it failed to start."""
    state = app[STATE]
    await state.ready.wait()
    if state.startup_error is not None:
        raise state.startup_error
    assert state.engine is not None
    return state.engine


def _engine_context(
    factory: EngineFactory | None, owns: bool, on_fatal: FatalCallback | None
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        tasks = []
        if factory is not None:
            tasks.append(asyncio.create_task(_create_engine(state, factory, on_fatal)))
        if on_fatal is not None:
            tasks.append(asyncio.create_task(_watch_for_death(state, on_fatal)))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if owns and state.engine is not None:
            await state.engine.shutdown()

    return context


async def _create_engine(
    state: ServerState, factory: EngineFactory, on_fatal: FatalCallback | None
) -> None:
    try:
        engine = await factory()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if isinstance(exc, ValueError):
            # A configuration the model cannot serve (a bad path, a --max-model-len too long,
            # an unsupported architecture): the message says what to change; a traceback of
            # our own validation code would only bury it.
            logger.error("the engine failed to start: %s", exc)
            logger.debug("where it failed", exc_info=exc)  # AIOINFER_LOGGING_LEVEL=DEBUG
        else:
            logger.exception("the engine failed to start")
        state.set_startup_error(exc)
        if on_fatal is not None:
            on_fatal(exc)
        return
    state.set_engine(engine)
    logger.info("engine ready: serving %s", engine.model_name)


async def _watch_for_death(state: ServerState, on_fatal: FatalCallback) -> None:
    """The engine fails requests itself; this tells the process at once, so it can exit."""
    await state.ready.wait()
    if state.engine is not None:
        on_fatal(await state.engine.wait_dead())


async def _watcher_context(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[STATE].watcher.run())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _start_draining(app: web.Application) -> None:
    """On shutdown: /health turns 503 and new requests are refused while in-flight ones finish
    (up to the runner's shutdown_timeout); the cleanup then aborts what is left."""
    app[STATE].draining = True


async def drain(app: web.Application, timeout: float, grace: float = ABORT_GRACE) -> int:
    """Graceful shutdown while the socket still listens: /health and new requests answer 503
    at once; in-flight generation requests get `timeout` seconds to finish; then the engine
    aborts the rest, which end with finish_reason "abort", and their handlers get `grace`
    seconds to write that. Returns how many requests were aborted."""
    state = app[STATE]
    state.draining = True
    if await _wait_idle(state, timeout):
        return 0
    aborted = state.engine.abort_all("shutdown") if state.engine is not None else 0
    await _wait_idle(state, grace)
    return aborted


async def _wait_idle(state: ServerState, timeout: float) -> bool:
    """Whether every generation request was answered within `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while state.in_flight > 0:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(DRAIN_POLL)
    return True
