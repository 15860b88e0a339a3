"""JSON bodies in and out: the body limit, reading a request's JSON object (refusing what is
too large, too deep or not an object), parsing it into a request model for the served model, and
JSON responses."""

from __future__ import annotations

import array
import asyncio
import functools
import itertools
import logging
import re
import reprlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from aioinfer.server.http.errors import (
    BadRequestError,
    NotFoundError,
    PayloadTooLargeError,
    RequestTimeoutError,
)
from aioinfer.server.http.request_model import ModelRequest
from aioinfer.server.http.sse import within
from aioinfer.server.http.state import STATE
from aioinfer.server.http.work_queue import OFF_LOOP

if TYPE_CHECKING:
    from aioinfer.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

MiB = 1 << 20
# The body limit follows the context length: 64 bytes per token covers a token-id list (at most
# ~8 bytes per id) and text escaped as \uXXXX (6 bytes per character, a few characters per
# token), with 1 MiB for the rest of the JSON. The floor lets batches of prompts through; the
# cap (also aiohttp's client_max_size) bounds what one request can make the server buffer.
MIN_BODY_BYTES = 16 * MiB
MAX_BODY_BYTES = 128 * MiB
BODY_BYTES_PER_TOKEN = 64
# Deeper JSON is refused: no request needs more than a handful of levels, and what reads the
# parsed body (validation, error messages) may recurse per level. orjson itself stops at 1024.
MAX_JSON_DEPTH = 64
_TOO_DEEP = (
    f"The body is nested too deeply: more than {MAX_JSON_DEPTH} levels of arrays and objects"
)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPEN, _CLOSE = b"[{", b"]}"
# Brackets become +1 / -1 (as signed bytes); every other byte is deleted.
_BRACKETS = bytes.maketrans(_OPEN + _CLOSE, b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(set(range(256)) - set(_OPEN + _CLOSE))

_R = TypeVar("_R", bound=ModelRequest)  # each handler gets its own request type back


async def parse_request(request: web.Request, kind: type[_R]) -> tuple[AsyncEngine, _R]:
    """The serving engine and the request's body parsed as `kind`: 503 while the engine cannot
    serve, 400 or 413 for a bad body, 404 when the body names another model."""
    state = request.app[STATE]
    engine = state.serving_engine()
    data = await read_json(request, body_limit(engine))
    # The parsed body is needed no longer: aiohttp keeps a connection's last request alive
    # until its next one (or the keep-alive timeout), and with it what the request holds; a
    # body of many small items is several times its bytes as Python objects.
    request.pop(_BODY, None)
    # Validating a body of megabytes (100k content blocks) takes seconds: on a worker thread
    # (a bounded queue, let go of when the client leaves), so that the event loop goes on
    # streaming everyone else's tokens meanwhile.
    if request[BODY_SIZE] > OFF_LOOP_BODY_BYTES:
        req = await OFF_LOOP.run(request, kind.parse, data)
    else:
        req = kind.parse(data)
    _warn_ignored_fields(kind, data, state.ignored_fields_logged)
    check_model(req.model, engine)
    if req.model in engine.model_aliases:
        req.model = engine.model_name  # as vLLM: responses carry the first served name
    return engine, req


# Field names remembered as logged, over all kinds of request: a client may send a million
# made-up names, each as long as the body. A name is clipped (to a repr of about 64
# characters) before it is remembered or logged, and what is remembered is bounded in count and
# in characters: once full, ignored fields are no longer logged (a last line says so). Names
# shown per line.
MAX_IGNORED_FIELDS_REMEMBERED = 1024
MAX_IGNORED_FIELD_CHARS_REMEMBERED = 16 * 1024
MAX_IGNORED_FIELDS_SHOWN = 16
_FIELD_NAME = reprlib.Repr()
_FIELD_NAME.maxstring = 64


@functools.cache
def _known_fields(kind: type[_R]) -> frozenset[str]:
    """The fields a request model reads: its own (by name and alias) and those `parse`
    refuses when set (UNSUPPORTED), which a client may send as false."""
    return frozenset(
        name
        for field_name, info in kind.model_fields.items()
        for name in (field_name, info.alias)
        if name is not None
    ) | frozenset(kind.UNSUPPORTED)


def _warn_ignored_fields(
    kind: type[_R], data: Mapping[str, Any], logged: set[tuple[str, str]]
) -> None:
    """Log the body's fields the request model does not know (a typo such as `max_token`
    would otherwise pass unseen), as vLLM does; each field once per kind of request, so that
    a client that always sends one does not fill the log. Names are logged as clipped reprs
    (control characters escaped)."""
    ignored = sorted({_FIELD_NAME.repr(name) for name in set(data) - _known_fields(kind)})
    new = [(kind.__name__, name) for name in ignored if (kind.__name__, name) not in logged]
    if not new:
        return
    chars = sum(len(name) for _, name in logged)
    if _full(len(logged), chars):
        return
    full = False
    for entry in new:
        logged.add(entry)
        chars += len(entry[1])
        if full := _full(len(logged), chars):
            break
    shown = ignored[:MAX_IGNORED_FIELDS_SHOWN]
    more = len(ignored) - len(shown)
    logger.warning(
        "The following fields were present in the request but ignored: [%s]%s%s",
        ", ".join(shown),
        f" and {more} more" if more else "",
        f" (the last such warning: {len(logged)} field names logged)" if full else "",
    )


def _full(count: int, chars: int) -> bool:
    return count >= MAX_IGNORED_FIELDS_REMEMBERED or chars >= MAX_IGNORED_FIELD_CHARS_REMEMBERED


def json_response(body: Mapping[str, Any], status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def body_limit(engine: AsyncEngine) -> int:
    by_context = MiB + BODY_BYTES_PER_TOKEN * engine.max_model_len
    return min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, by_context))


OFF_LOOP_BODY_BYTES = 64 * 1024
# A body whose bytes stop coming for this long is a 408 (aiohttp times out idle and half-sent
# headers by itself, after the keep-alive timeout, but not a body that stalls); so is one that
# takes longer than --body-read-timeout in all (a byte every few seconds would hold the
# connection and its buffer for hours).
BODY_IDLE_TIMEOUT = 60.0
BODY_SIZE = web.RequestKey("body_size", int)  # the bytes of the body read_json read
_BODY = web.RequestKey("body", dict)  # what read_json returned, for a second reader


async def read_json(request: web.Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 400 for anything else, 413 beyond `limit` bytes."""
    if _BODY in request:  # read already (/invocations looks at it before its handler)
        return request[_BODY]
    if request.content_type != "application/json":
        raise BadRequestError(
            "Unsupported Media Type: only 'application/json' is allowed, got "
            f"{request.content_type!r}"
        )
    charset = request.charset
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise BadRequestError(f"The body must be UTF-8, got charset {charset!r}")
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLargeError(_too_large(length, limit))
    # Read in pieces: a chunked body has no length to check up front, and must not be buffered
    # whole (up to aiohttp's own cap) before it is refused.
    body = bytearray()
    loop = asyncio.get_running_loop()
    overall = request.app[STATE].config.body_read_timeout
    deadline = loop.time() + overall
    try:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise asyncio.TimeoutError
            piece = await within(min(BODY_IDLE_TIMEOUT, left), request.content.readany())
            if not piece:
                break
            body += piece
            if len(body) > limit:
                raise PayloadTooLargeError(
                    f"Request body too large: over the limit of {limit} bytes"
                )
    except RequestPayloadError as exc:  # e.g. a Content-Encoding the bytes do not decode as
        raise BadRequestError(f"The body could not be read: {exc}") from None
    except asyncio.TimeoutError:
        if loop.time() >= deadline:
            raise RequestTimeoutError(
                f"The body took too long: it did not all arrive within {overall:g} s "
                "(--body-read-timeout)"
            ) from None
        raise RequestTimeoutError(
            f"The body stopped coming: no byte for {BODY_IDLE_TIMEOUT:g} s"
        ) from None
    request[BODY_SIZE] = len(body)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):
            raise BadRequestError(_TOO_DEEP) from None
        raise BadRequestError(f"The body is not valid JSON: {exc}") from None
    # Measured on valid JSON only: there every string ends, so the scan is linear.
    if json_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise BadRequestError(_TOO_DEEP)
    if not isinstance(data, dict):
        raise BadRequestError(f"The body must be a JSON object, got {_json_kind(data)}")
    request[_BODY] = data
    return data


def json_depth(body: bytes | bytearray, at_least: int = 0) -> int:
    """How deeply arrays and objects nest in a valid JSON text, without recursion; brackets
    inside strings do not count. Bodies with at most `at_least` brackets in all are answered
    with a cheap upper bound: their count. (On invalid JSON an unterminated string makes the
    scan quadratic: parse first.)"""
    num_brackets = sum(body.count(c) for c in (b"[", b"{"))
    if num_brackets <= at_least:
        return num_brackets
    skeleton = _JSON_STRING.sub(b"", body).translate(_BRACKETS, _NOT_BRACKETS)
    return max(itertools.accumulate(array.array("b", skeleton)), default=0)


def _too_large(size: int, limit: int) -> str:
    return f"Request body too large: {size} bytes, the limit is {limit} bytes"


def check_model(name: str | None, engine: AsyncEngine) -> None:
    """404 unless `name` is the served model or one of its LoRA adapters (or not given)."""
    names = (engine.model_name, *engine.model_aliases)
    if name and name not in names and name not in engine.loras.slots:
        valid = ", ".join([*names, *engine.loras.slots])
        raise NotFoundError(
            f"The model `{name}` does not exist. Valid models: {valid}.", param="model"
        )


def _json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), "a value")
