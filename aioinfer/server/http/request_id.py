"""X-Request-Id: a client's own id for a request. It names the response (vLLM's way) and comes
back as a header on every answer, errors included, for the client's tracing. Only printable
ASCII without spaces, at most 256 characters, is taken: it reaches the log."""

from __future__ import annotations

from aiohttp import web

from aioinfer.server.http.errors import BadRequestError
from aioinfer.server.http.validation import REQUEST_ID, REQUEST_ID_RULE

REQUEST_ID_HEADER = "X-Request-Id"


def client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id for a response id; 400 naming the header for one that is not
    1 to 256 printable ASCII characters (bytes that are not UTF-8 included: they would fail the
    response's JSON after the whole generation ran)."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    if not REQUEST_ID.fullmatch(value):
        raise BadRequestError(f"{REQUEST_ID_HEADER} {REQUEST_ID_RULE}", param=REQUEST_ID_HEADER)
    return value


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the client's X-Request-Id comes back on every answer (one the
    server would refuse does not)."""
    request_id = request.headers.get(REQUEST_ID_HEADER)
    if request_id is not None and REQUEST_ID.fullmatch(request_id):
        response.headers[REQUEST_ID_HEADER] = request_id
