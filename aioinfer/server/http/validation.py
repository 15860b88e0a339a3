"""Readable 400 messages from pydantic's validation errors: each offending field named as a
client wrote it (`messages[0].content`), with a bounded picture of the value it got.

PURE: pydantic only.
"""

from __future__ import annotations

import contextlib
import re
import reprlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

# The ids a client gives a request (the body's request_id, X-Request-Id) name its response and
# reach the log: printable ASCII without spaces, bounded, so that none can break or forge a log
# line or a header.
MAX_REQUEST_ID_CHARS = 256
REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")
REQUEST_ID_RULE = (
    f"must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces (0x21-0x7e)"
)

# A client's string in a log line: a repr (control characters escaped) of at most about this
# many characters.
MAX_LOGGED_CHARS = 200
_LOGGED = reprlib.Repr()
_LOGGED.maxstring = MAX_LOGGED_CHARS


def logged(value: str) -> str:
    """A client's string as a log line may show it: escaped and clipped."""
    return _LOGGED.repr(value)


_MAX_REPORTED_ERRORS = 3
# Names pydantic gives a union's alternatives in an error's path: str, int, list[TextPart],
# dict[str,any], literal['none','auto'], a model's class name (NamedToolChoice).
_UNION_ALTERNATIVE = re.compile(
    r"str|int|float|bool|(?:list|dict|literal|function-\w+)\[.*\]|[A-Z][a-z]+(?:[A-Z][a-z0-9]*)+"
)
# Errors that say a value is not even of an alternative's type (string_type, dict_type, ...;
# a literal that is not one of its values)
_MISMATCH = re.compile(r".*_type|literal_error")
_MAX_INPUT_REPR = 80
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, _MAX_INPUT_REPR, _MAX_INPUT_REPR


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """A readable message naming each offending field (the first few), and the first field."""
    errors = _matching_alternatives(exc.errors(include_url=False))
    parts = []
    for error in errors[:_MAX_REPORTED_ERRORS]:
        path = format_loc(error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "missing":
            message = "field required"
        elif error["type"] != "value_error":
            message = f"{message}, got {short_repr(error.get('input'))}"
        parts.append(f"{path}: {message}" if path else message)
    if len(errors) > _MAX_REPORTED_ERRORS:
        parts.append(f"and {len(errors) - _MAX_REPORTED_ERRORS} more errors")
    param = format_loc(errors[0]["loc"]) if errors else None
    return "Invalid request: " + "; ".join(parts), param or None


def _matching_alternatives(errors: list[Any]) -> list[Any]:
    """Without the errors of a union's alternatives that the value is not even of the type of
    (`content.str: Input should be a valid string`, for a list), where another alternative
    took it and failed deeper (`content.list[TextPart][0].text: field required`): that one is
    the client's mistake."""

    # path -> the steps from it that some error lies deeper than: one pass, as a body may hold
    # many thousands of errors
    by_parent: dict[tuple[Any, ...], set[Any]] = {}
    for error in errors:
        loc = tuple(error["loc"])
        for k in range(len(loc) - 1):
            by_parent.setdefault(loc[:k], set()).add(loc[k])

    def mismatched(error: Any) -> bool:
        loc = tuple(error["loc"])
        if not (loc and isinstance(loc[-1], str) and _MISMATCH.fullmatch(str(error["type"]))):
            return False
        return bool(by_parent.get(loc[:-1], set()) - {loc[-1]})

    kept = [error for error in errors if not mismatched(error)]
    return kept or errors


def format_loc(loc: Sequence[int | str]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; without the alternative of a union
    pydantic tried the value as (content.list[TextPart][0].text), which no client wrote."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _UNION_ALTERNATIVE.fullmatch(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def short_repr(value: Any) -> str:
    text = _REPR.repr(value)  # bounded work, whatever the size or depth of the value
    if len(text) > _MAX_INPUT_REPR:
        text = text[: _MAX_INPUT_REPR - 3] + "..."
    return f"{text} ({_json_type(value)})"


def _json_type(value: Any) -> str:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "object"
    return kinds.get(type(value), type(value).__name__)


@contextlib.contextmanager
def renamed_params(names: Mapping[str, str]) -> Iterator[None]:
    """Errors raised inside (with a `param`) name the field of another API that a chat field
    came from: `names` maps a field's head (`tools` of `tools[0].function`) to it."""
    try:
        yield
    except Exception as exc:
        param = getattr(exc, "param", None)
        if isinstance(param, str):
            exc.param = names.get(_head(param), param)  # type: ignore[attr-defined]
        # A message that opens with a chat field's path names the new field instead
        # ("response_format.json_schema.schema is invalid" -> "text.format is invalid").
        message = getattr(exc, "message", None)
        if isinstance(message, str):
            first, space, rest = message.partition(" ")
            head = _head(first)
            if names.get(head, head) != head:
                exc.message = f"{names[head]}{space}{rest}"  # type: ignore[attr-defined]
                exc.args = (exc.message,)  # type: ignore[attr-defined]
        raise


def _head(path: str) -> str:
    """The field a path starts at: `tools` of `tools[0].function`."""
    return path.split("[", 1)[0].split(".", 1)[0]
