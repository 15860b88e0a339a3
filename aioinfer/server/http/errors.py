"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the middleware that
turns every failure of a handler (ours, aiohttp's 404/405/413, a bug) into that body.

The `type` strings follow vLLM (BadRequestError, NotFoundError, ...); `code` is the HTTP status.
Under /v1/messages, Anthropic's clients read Anthropic's envelope instead:
`{"type": "error", "error": {"type": "invalid_request_error", "message"}}`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from aioinfer.server.anthropic.render import anthropic_error_body
from aioinfer.server.serving.protocol import RequestValidationError
from aioinfer.server.serving.shapes import ErrorResponse

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
MESSAGES_PATH = "/v1/messages"
# Headers of aiohttp's own HTTP exceptions that must survive the rewrite.
_KEPT_HEADERS = ("Allow", "Retry-After", "WWW-Authenticate")


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
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "Internal server error", body=body)
