"""Tool calling: the request models, and tool_choice as an output constraint.

A named `tool_choice` makes the output that function's arguments: a JSON object that follows
its `parameters` schema (the output is the call, even when max_tokens cuts it short, as in
vLLM). `"required"` makes it a JSON array of `{"name", "parameters"}` objects, one per call (a
single one when `parallel_tool_calls` is false); the grammar guarantees that a finished array
parses, so the response's `tool_calls` come from `json.loads`, never from guessing in free
text. `"auto"` leaves the text free and needs a parser of the model's own tool-call format
(`tool_parsers`, with --tool-call-parser); without one the handler refuses it, as vLLM does
unless started with `--enable-auto-tool-choice --tool-call-parser ...`.

PURE: no torch, no asyncio.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from aioinfer.core.sampling_params import StructuredOutputsParams
from aioinfer.engine.tokenizer import template_arguments
from aioinfer.server.http.request_model import StrictModel
from aioinfer.server.serving.shapes import ToolCallJson

FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
# Accepts any JSON object: what a function without a `parameters` schema takes.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN, description="The function's name.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of its arguments.")
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(StrictModel):
    name: str
    arguments: str | dict[str, Any] | None = Field(
        None, description="The arguments as JSON text (or the object itself)."
    )


class AssistantToolCall(StrictModel):
    """A tool call of an earlier assistant message, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def to_template(self) -> dict[str, Any]:
        arguments = template_arguments(self.function.arguments)
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_json(self) -> ToolCallJson:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's output becomes tool calls: `named` holds the forced function's
    name; otherwise the output is a "required" array of calls."""

    named: str | None

    @property
    def finish_reason(self) -> str:
        # OpenAI ends a forced (named) call with "stop", calls the model chose with
        # "tool_calls".
        return "stop" if self.named is not None else "tool_calls"

    def calls(self, text: str, finished: bool = True) -> list[ToolCall] | None:
        """The tool calls of an output. A named call is the text, whatever it holds (as in
        vLLM, and as it streams: cut short by max_tokens or a stop string, the arguments are
        cut short too). "required" calls come from the finished JSON array; None when it does
        not parse."""
        if self.named is not None:  # none where no text came (a model that only reasoned)
            return [ToolCall(new_call_id(), self.named, text)] if text else None
        if not finished:
            return None
        value = loads_or_none(text)
        if not isinstance(value, list) or not all(_is_call(v) for v in value):
            return None
        return [
            ToolCall(new_call_id(), v["name"], json.dumps(v["parameters"], ensure_ascii=False))
            for v in value
        ]


def loads_or_none(text: str) -> Any:
    """`json.loads`, or None for text that is not JSON (or nests past Python's recursion
    limit: a model can write a thousand "[")."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _is_call(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and isinstance(value.get("parameters"), dict)
    )


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolsError(ValueError):
    """What is wrong with a request's tools or tool_choice; `param` names the field."""

    def __init__(self, message: str, param: str = "tool_choice") -> None:
        super().__init__(message)
        self.param = param


def tool_constraint(
    tools: list[ChatTool], tool_choice: str | NamedToolChoice, parallel_tool_calls: bool
) -> tuple[ToolMode, StructuredOutputsParams] | None:
    """The output constraint of a request's tools, or None when they do not constrain it
    (tool_choice "none" or "auto"). Raises ValueError naming what is wrong."""
    names = [tool.function.name for tool in tools]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ToolsError(f"tools must have distinct names; {', '.join(twice)} comes twice", "tools")
    if tool_choice == "none":
        return None
    if not tools:
        raise ToolsError("tool_choice is only allowed when tools are given")
    if tool_choice == "auto":  # free text, read by a tool-call parser
        return None
    schemas = {tool.function.name: tool.function.parameters or _ANY_OBJECT for tool in tools}
    for name, schema in schemas.items():
        if "type" not in schema:  # properties alone would let a string or an array through
            schemas[name] = schema = {**schema, "type": "object"}
        if schema["type"] != "object":
            raise ToolsError(
                f"the parameters schema of {name!r} must describe an object (its arguments), "
                f"got type {schema.get('type')!r}",
                "tools",
            )
    if tool_choice == "required":
        return ToolMode(named=None), _json_constraint(_calls_schema(schemas, parallel_tool_calls))
    assert isinstance(tool_choice, NamedToolChoice)
    name = tool_choice.function.name
    if name not in schemas:
        raise ToolsError(
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"({', '.join(sorted(schemas))})"
        )
    return ToolMode(named=name), _json_constraint(schemas[name])


def _json_constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    """The output constrained to `schema`, built from the tools' parameters schemas."""
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as exc:  # too deep or too large
        message = str(exc).replace("structured_outputs.json", "the schema of the tools' calls")
        raise ToolsError(message, "tools") from None


def _calls_schema(schemas: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of {"name", "parameters"} calls to the functions of `schemas`. Each
    schema's definitions ($defs, definitions) move to the array's top level, where their
    "#/$defs/..." references then point."""
    hoisted: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    alternatives = []
    for name, schema in schemas.items():
        if _refers_to_root(schema):
            raise ToolsError(
                f"the parameters schema of {name!r} refers to its own root ('#'), which "
                'tool_choice "required" cannot nest: name the function instead'
            )
        schema = dict(schema)
        for key, defs in hoisted.items():
            definitions = schema.pop(key, None) or {}
            if not isinstance(definitions, dict):
                raise ToolsError(
                    f"the parameters schema of {name!r} has {key} that is not an object: "
                    f"{definitions!r:.60}",
                    "tools",
                )
            for def_name, definition in definitions.items():
                if defs.setdefault(def_name, definition) != definition:
                    raise ToolsError(
                        f"tools define {key}/{def_name} in two different ways, which "
                        'tool_choice "required" cannot combine'
                    )
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if not parallel:
        array["maxItems"] = 1
    array.update({key: defs for key, defs in hoisted.items() if defs})
    return array


def _refers_to_root(schema: Any) -> bool:
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("$ref") == "#":
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


# What a request with tool_choice "auto" hears from a server without a tool parser; each API
# ends it with its own forced choices.
AUTO_NEEDS_PARSER_START = (
    'tool_choice "auto" (the default when tools are given) needs a parser of the model\'s own '
    "tool-call text: start the server with --tool-call-parser hermes (Qwen2.5, Qwen3, Hermes) "
    "or llama3_json (Llama 3.1-3.3), "
)
AUTO_NEEDS_PARSER = AUTO_NEEDS_PARSER_START + (
    'or send tool_choice "required", a named function ({"type": "function", "function": '
    '{"name": ...}}) or "none"'
)
