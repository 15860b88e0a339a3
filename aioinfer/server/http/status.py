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


class ServerLoad(TypedDict):
    server_load: int


async def health(request: web.Request) -> web.Response:
    reason = request.app[STATE].unavailable_reason()
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


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
