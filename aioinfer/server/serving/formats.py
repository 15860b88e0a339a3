"""The request fields that constrain an output's format: OpenAI's `response_format` and vLLM's
`structured_outputs`.

PURE: pydantic only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from aioinfer.server.http.request_model import StrictModel


class JsonSchemaFormat(StrictModel):
    name: str = Field(description="The schema's name.")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON schema the output must follow."
    )
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM's structured outputs: exactly one field is set."""

    json_value: dict[str, Any] | str | None = Field(
        None, alias="json", description="A JSON schema the output must follow."
    )
    regex: str | None = None
    choice: list[str] | None = Field(None, description="The output is one of these strings.")
    grammar: str | None = Field(None, description="An EBNF grammar with a `root` rule.")
    json_object: bool | None = Field(None, description="Any JSON object.")
    # vLLM's switches: taken (as booleans) for what holds here anyway; another whitespace
    # pattern is refused (see core StructuredOutputsParams).
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None
