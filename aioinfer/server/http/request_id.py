"""X-Request-Id: a client's own id for a request. It names the response (vLLM's way) and comes
back as a header on every answer, errors included, for the client's tracing."""

from __future__ import annotations

from aiohttp import web

REQUEST_ID_HEADER = "X-Request-Id"


def client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id for a response id, or None where it is not UTF-8 text (its
    bytes would then fail the response's JSON after the whole generation ran)."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the client's X-Request-Id comes back on every answer."""
    request_id = request.headers.get(REQUEST_ID_HEADER)
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id
