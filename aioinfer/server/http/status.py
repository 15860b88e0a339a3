"""What the server says about itself, open without an API key (for load balancers and
scrapers): /health, /ping (SageMaker's health check), /load, /version and /metrics."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from typing_extensions import TypedDict

from aioinfer import __version__
from aioinfer.server.http.bodies import json_response
from aioinfer.server.http.errors import ServiceUnavailableError
from aioinfer.server.http.state import STATE


class VersionResponse(TypedDict):
    version: str


class SleepState(TypedDict):
    is_sleeping: bool


class ServerInfo(TypedDict):
    model_path: str
    served_model_name: str
    version: str
    max_total_tokens: int  # tokens the KV cache holds
    max_model_len: int


class ServerLoad(TypedDict):
    server_load: int


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    reason = state.unavailable_reason()
    if reason is None and state.leaving:
        reason = "The server is shutting down (still serving during its notice period)"
    if reason is not None:
        raise ServiceUnavailableError(reason)
    return web.Response(status=200)


async def ping(request: web.Request) -> web.Response:
    """SageMaker's health check (GET or POST), as vLLM serves it: /health's answer."""
    if request.method not in ("GET", "POST"):
        raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
    return await health(request)


async def load(request: web.Request) -> web.Response:
    """The requests being answered now, as vLLM's /load (for a router's balancing)."""
    body: ServerLoad = {"server_load": request.app[STATE].in_flight}
    return json_response(body)


async def version(request: web.Request) -> web.Response:
    body: VersionResponse = {"version": __version__}
    return json_response(body)


async def is_sleeping(request: web.Request) -> web.Response:
    """vLLM's sleep-mode probe (routers of the production stack ask it): never asleep here."""
    body: SleepState = {"is_sleeping": False}
    return json_response(body)


async def server_info(request: web.Request) -> web.Response:
    """What SGLang's router reads to name a backend's model (`/get_server_info` too)."""
    engine = request.app[STATE].serving_engine()
    body: ServerInfo = {
        "model_path": str(engine.model_config.model or engine.model_name),
        "served_model_name": engine.model_name,
        "version": __version__,
        "max_total_tokens": (engine.info.num_blocks - 1) * engine.cache_config.block_size,
        "max_model_len": engine.max_model_len,
    }
    return json_response(body)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
