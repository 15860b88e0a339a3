"""Cross-origin requests from browsers (--allowed-origins): off unless origins are given (vLLM
allows any by default; a server that holds API keys should not, unasked). A browser app served
from an allowed origin may call the API, its preflight (OPTIONS) answered without an API key,
and every answer, errors and streams included, carries the headers that let it read the
response. No credentials (cookies): keys travel in headers.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

from aioinfer.server.http.errors import Handler

ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
DEFAULT_ALLOWED_HEADERS = "Authorization, Content-Type"
EXPOSED_HEADERS = "X-Request-Id"
PREFLIGHT_MAX_AGE = "600"  # seconds a browser may keep a preflight's answer


class CorsPolicy:
    def __init__(self, origins: Sequence[str]) -> None:
        self.any_origin = "*" in origins
        self.origins = frozenset(origins)

    def allow_origin(self, request: web.BaseRequest) -> str | None:
        """The Access-Control-Allow-Origin value for the request's Origin; None when the
        request has none, or an origin not allowed."""
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        if self.any_origin:
            return "*"
        return origin if origin in self.origins else None

    def middleware(self) -> Middleware:
        @web.middleware
        async def cors_preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
            is_preflight = request.method == "OPTIONS" and (
                "Access-Control-Request-Method" in request.headers
            )
            if not is_preflight or self.allow_origin(request) is None:
                return await handler(request)
            requested = request.headers.get("Access-Control-Request-Headers")
            headers = {
                "Access-Control-Allow-Methods": ALLOWED_METHODS,
                "Access-Control-Allow-Headers": requested or DEFAULT_ALLOWED_HEADERS,
                "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
            }
            return web.Response(status=204, headers=headers)

        return cors_preflight

    async def add_headers(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        """on_response_prepare: before the headers go out, so streams get them too."""
        if not self.any_origin:  # the answer depends on Origin: caches must key on it
            response.headers.add("Vary", "Origin")
        allowed = self.allow_origin(request)
        if allowed is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allowed
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
