"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the middleware that
turns every failure of a handler (ours, aiohttp's 404/405/413, a bug) into that body.

The `type` strings follow vLLM (BadRequestError, NotFoundError, ...); `code` is the HTTP status.
Under /v1/messages, Anthropic's clients read Anthropic's envelope instead:
`{"type": "error", "error": {"type": "invalid_request_error", "message"}}`. Both envelopes
are built here, so that the middleware needs no API.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import orjson
from aiohttp import web
from typing_extensions import TypedDict

from aioinfer.server.http.request_model import RequestValidationError
from aioinfer.server.http.sse import ClientDisconnected, client_closed
from aioinfer.server.http.validation import logged

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # Anthropic's own status for it is 529; ours stays 503
}
MESSAGES_PATH = "/v1/messages"
# Headers of aiohttp's own HTTP exceptions that must survive the rewrite.
_KEPT_HEADERS = ("Allow", "Retry-After", "WWW-Authenticate")


class ErrorInfo(TypedDict):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(TypedDict):
    error: ErrorInfo


class AnthropicErrorInfo(TypedDict):
    type: str
    message: str


class AnthropicErrorResponse(TypedDict):
    type: Literal["error"]
    error: AnthropicErrorInfo


class APIError(Exception):
    """An error response; raise it from a handler."""

    status = 500

    def __init__(
        self, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = dict(headers or {})


class BadRequestError(APIError):
    status = 400


class AuthenticationError(APIError):
    status = 401


class NotFoundError(APIError):
    status = 404


class RequestTimeoutError(APIError):
    status = 408


class PayloadTooLargeError(APIError):
    status = 413


class RateLimitError(APIError):
    status = 429


class InternalServerError(APIError):
    status = 500


class ServiceUnavailableError(APIError):
    status = 503


def error_type(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    return {
        "error": {"message": message, "type": error_type(status), "param": param, "code": status}
    }


def anthropic_error_body(
    status: int, message: str, param: str | None = None
) -> AnthropicErrorResponse:
    """Anthropic's envelope has no `param`: the message names the field instead."""
    if param and param not in message:
        message = f"{param}: {message}"
    kind = _ANTHROPIC_TYPE_BY_STATUS.get(
        status, "invalid_request_error" if status < 500 else "api_error"
    )
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_messages_path(path: str) -> bool:
    """Whether a path is one of the Messages API's (its errors in Anthropic's envelope)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


# Builds an error body: OpenAI's shape (`error_body`) or Anthropic's (`anthropic_error_body`).
ErrorBody = Callable[[int, str, str | None], Mapping[str, Any]]


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    body: ErrorBody = error_body,
) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps(body(status, message, param)),
        content_type="application/json",
        headers=headers,
    )


def _from_http_exception(
    request: web.Request, exc: web.HTTPException, body: ErrorBody
) -> web.Response:
    status = exc.status
    if status == 404:
        message = f"Not Found: {request.path}"
    elif status == 405:
        allowed = exc.headers.get("Allow", "")
        message = f"Method {request.method} is not allowed on {request.path}; allowed: {allowed}"
    elif status == 413:
        message = f"Request body too large: {exc.text or exc.reason}"
    else:
        message = exc.text or exc.reason
    headers = {k: exc.headers[k] for k in _KEPT_HEADERS if k in exc.headers}
    return error_response(status, message, headers=headers, body=body)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    body: ErrorBody = anthropic_error_body if is_messages_path(request.path) else error_body
    try:
        return await handler(request)
    except APIError as exc:
        response = error_response(exc.status, exc.message, exc.param, exc.headers, body)
        if exc.status == 408:  # the rest of the body may still come: the connection is done
            response.force_close()
        return response
    except RequestValidationError as exc:
        return error_response(400, exc.message, exc.param, body=body)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http_exception(request, exc, body)
    except ClientDisconnected:  # the client left while its request was being prepared
        return client_closed()
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, logged(request.path))
        return error_response(500, "Internal server error", body=body)
