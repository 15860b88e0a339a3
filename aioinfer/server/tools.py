"""Tool calling by constrained decoding, with no model-specific parser.

A named `tool_choice` makes the output that function's arguments: a JSON object that follows
its `parameters` schema. `"required"` makes it a JSON array of `{"name", "parameters"}`
objects, one per call (a single one when `parallel_tool_calls` is false). The grammar
guarantees that a finished output parses, so the response's `tool_calls` come from
`json.loads`, never from guessing in free text. `"auto"` needs a parser of the model's own
tool-call format: without one the server refuses it, as vLLM does unless it is started with
one (`--enable-auto-tool-choice --tool-call-parser ...`); with `--tool-call-parser`, the
model's own tool-call text is read back (`tool_parsers`).

PURE: no torch, no asyncio.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from aioinfer.core.sampling_params import StructuredOutputsParams
from aioinfer.server.formats import StrictModel
from aioinfer.server.responses import ToolCallJson

# Accepts any JSON object: what a function without a `parameters` schema takes.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="The function's name.")
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
    arguments: str = Field(description="The arguments as JSON text.")


class AssistantToolCall(StrictModel):
    """A tool call of an earlier assistant message, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def to_template(self) -> dict[str, Any]:
        # Templates write the arguments with `tojson`: they want the object, not its text.
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
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

    def calls(self, text: str) -> list[ToolCall] | None:
        """The tool calls of a finished output; None when it does not parse (an output cut
        short by max_tokens or a stop string)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            return [ToolCall(new_call_id(), self.named, text)] if isinstance(value, dict) else None
        if not isinstance(value, list) or not all(_is_call(v) for v in value):
            return None
        return [
            ToolCall(new_call_id(), v["name"], json.dumps(v["parameters"], ensure_ascii=False))
            for v in value
        ]


def _is_call(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("name"), str) and "parameters" in value


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_constraint(
    tools: list[ChatTool], tool_choice: str | NamedToolChoice, parallel_tool_calls: bool
) -> tuple[ToolMode, StructuredOutputsParams] | None:
    """The output constraint of a request's tools, or None when they do not constrain it
    (tool_choice "none" or "auto"). Raises ValueError naming what is wrong."""
    if tool_choice in ("none", "auto"):  # "auto": free text, read by a tool-call parser
        return None
    if not tools:
        raise ValueError("tool_choice needs tools to choose from")
    schemas = {tool.function.name: tool.function.parameters or _ANY_OBJECT for tool in tools}
    if tool_choice == "required":
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": schema,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, schema in schemas.items()
            ]
        }
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": call}
        if not parallel_tool_calls:
            array["maxItems"] = 1
        return ToolMode(named=None), StructuredOutputsParams(json=array)
    assert isinstance(tool_choice, NamedToolChoice)
    name = tool_choice.function.name
    if name not in schemas:
        raise ValueError(
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"({', '.join(sorted(schemas))})"
        )
    return ToolMode(named=name), StructuredOutputsParams(json=schemas[name])


AUTO_NEEDS_PARSER = (
    'tool_choice "auto" (the default when tools are given) needs a parser of the model\'s own '
    "tool-call text: start the server with --tool-call-parser hermes (Qwen2.5, Qwen3, Hermes), "
    'or send tool_choice "required", a named function ({"type": "function", "function": '
    '{"name": ...}}) or "none"'
)
