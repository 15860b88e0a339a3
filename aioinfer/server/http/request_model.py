"""The base of every request model: strict pydantic types, and `parse`, which refuses a body
with a `RequestValidationError` (HTTP 400) whose message and `param` name the field.

PURE: pydantic only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from aioinfer.server.http.validation import describe_validation_error

_M = TypeVar("_M", bound="RequestModel")


class RequestValidationError(ValueError):
    """A request the server refuses (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class StrictModel(BaseModel):
    """Strict types ("10" is not an integer, 1 is not a boolean); unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class RequestModel(StrictModel):
    """A request body, or a part of one, that `parse` validates."""

    # vLLM's fields for what is not implemented here, and why: refused when set (not null or
    # false), instead of being dropped with the unknown fields.
    UNSUPPORTED: ClassVar[Mapping[str, str]] = {}
    # Fields that hold lists, and the most items each may hold: counted on the body before
    # anything is validated, as each item becomes a model of its own (a body of megabytes holds
    # hundreds of thousands of small ones).
    MAX_ITEMS: ClassVar[Mapping[str, int]] = {}

    @classmethod
    def parse(cls: type[_M], data: Mapping[str, Any]) -> _M:
        """Validate a decoded JSON object; raises RequestValidationError with a readable
        message that names the field."""
        for name, why in cls.UNSUPPORTED.items():
            if data.get(name) not in (None, False):
                raise RequestValidationError(f"{name} is not supported: {why}", name)
        for name, most in cls.MAX_ITEMS.items():
            value = data.get(name)
            if isinstance(value, list) and len(value) > most:
                raise RequestValidationError(
                    f"{name} may hold at most {most} items, got {len(value)}", name
                )
        try:
            request = cls.model_validate(data)
        except ValidationError as exc:
            message, param = describe_validation_error(exc)
            param = cls.client_path(param) if param is not None else None
            raise RequestValidationError(cls.client_path(message), param) from None
        request.check_supported()
        return request

    @staticmethod
    def client_path(text: str) -> str:
        """A field's path as the client wrote it, where a request's own union alternatives
        show in pydantic's (see validation.format_loc for the common ones)."""
        return text

    def check_supported(self) -> None:
        """Refuse valid-looking requests the server cannot serve."""


class ModelRequest(RequestModel):
    """The body of an endpoint: it names the model it is for, which `bodies.parse_request`
    checks. Each subclass declares its own `model` field (its default and description are
    part of its schema); this only tells type checkers that there is one."""

    if TYPE_CHECKING:
        model: str | None
