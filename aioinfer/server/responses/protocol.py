"""POST /v1/responses: the request model, and the chat request it becomes.

A Responses request is a chat in another shape: `instructions` is a system message put first,
`input` a user message or a list of items (messages, earlier function calls and their outputs),
`text.format` a response_format, flat function tools the chat's tools. `to_chat` builds that
chat request, so the messages go through the chat template and the tools and formats become
constraints exactly as on /v1/chat/completions. What cannot be served (images, files, built-in
tools) is refused with a 400 naming the field.

PURE: pydantic and the core package only (no torch, no asyncio).
"""

from __future__ import annotations

import contextlib
import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, field_validator, model_validator

from aioinfer.core.request import MAX_CACHE_SALT_CHARS
from aioinfer.server.http.request_model import ModelRequest, RequestValidationError, StrictModel
from aioinfer.server.http.validation import renamed_params
from aioinfer.server.serving.formats import JsonSchemaFormat, ResponseFormat
from aioinfer.server.serving.protocol import ChatCompletionRequest, ChatMessage
from aioinfer.server.serving.tools import (
    AssistantToolCall,
    CalledFunction,
    ChatTool,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
)

# The one `include` value that can be filled: the output's logprobs.
OUTPUT_LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text")
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# The most items one request's input may hold: each is a model of its own while the request is
# served (100,000 reasoning items of 38 bytes held about 85 MiB).
MAX_INPUT_ITEMS = 10_000
_ITEM_KIND_IN_PATH = re.compile(rf"(input\[\d+\])\.(?:{'|'.join(_ITEM_TYPES)})\b")
# Fields of the chat request that a Responses request names otherwise: a 400 about one names
# the Responses field.
_CHAT_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "top_logprobs",
}


class TextContent(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str


def _text_parts(value: Any) -> Any:
    """A content list's parts must be text: images, files and audio are refused by name."""
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in _TEXT_PARTS:
                raise ValueError(
                    f"only text content parts (input_text, output_text) are supported, got a "
                    f"part of type {kind!r}"
                )
    return value


def _joined(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class InputMessage(StrictModel):
    type: Literal["message"] = "message"
    id: str | None = Field(None, description="Its id, kept for GET .../input_items.")
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent] = Field(description="A string or a list of text parts.")

    _content_shape = field_validator("content", mode="before")(_text_parts)


class FunctionCallItem(StrictModel):
    """An earlier function call of the model (an output item sent back)."""

    type: Literal["function_call"]
    id: str | None = Field(None, description="Its id, kept for GET .../input_items.")
    call_id: str
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class FunctionCallOutputItem(StrictModel):
    """What an earlier function call returned."""

    type: Literal["function_call_output"]
    id: str | None = Field(None, description="Its id, kept for GET .../input_items.")
    call_id: str
    output: str | list[TextContent]

    _output_shape = field_validator("output", mode="before")(_text_parts)


class ReasoningText(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    """Earlier reasoning of the model (an output item sent back): it goes with the
    assistant turn after it, for templates that show it."""

    type: Literal["reasoning"]
    id: str | None = Field(None, description="Its id, kept for GET .../input_items.")
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = Field(default_factory=list)

    def text(self) -> str:
        return "\n".join(part.text for part in self.content or self.summary)


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


def _message(**fields: Any) -> ChatMessage:
    return ChatMessage.model_validate(fields)


def items_to_messages(items: list[InputItem]) -> list[ChatMessage]:
    """Chat messages of input items. Function calls join the assistant message before them
    (one turn that says something and calls); their outputs become tool messages."""
    messages: list[ChatMessage] = []
    reasoning: str | None = None  # for the next assistant turn
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text()
        elif isinstance(item, InputMessage):
            fields: dict[str, Any] = {"role": item.role, "content": _joined(item.content)}
            if item.role == "assistant" and reasoning is not None:
                fields["reasoning"], reasoning = reasoning, None
            messages.append(_message(**fields))
        elif isinstance(item, FunctionCallItem):
            function = CalledFunction(name=item.name, arguments=item.arguments)
            call = AssistantToolCall(id=item.call_id, function=function)
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant" or reasoning is not None:
                last = _message(role="assistant", reasoning=reasoning)
                messages.append(last)
                reasoning = None
            if last.tool_calls is None:
                last.tool_calls = []
            last.tool_calls.append(call)  # in place: many calls stay linear
        else:
            content = _joined(item.output)
            messages.append(_message(role="tool", tool_call_id=item.call_id, content=content))
    return messages


class FunctionTool(FunctionDefinition):
    """A function tool, flat: {type, name, description, parameters, strict}."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind != "function":
            raise ValueError(f"only function tools are supported, got a tool of type {kind!r}")
        return value


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, description="json_schema: the schema's name.")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="json_schema: the schema the output follows."
    )
    strict: bool | None = None


class ReasoningSettings(StrictModel):
    """OpenAI's reasoning settings: accepted, echoed, not acted on."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesRequest(ModelRequest):
    """POST /v1/responses."""

    model: str | None = Field(None, description="The served model name (default: the only one).")
    input: list[InputItem] = Field(
        description="A user message (a string), or a list of messages, function_call, "
        "function_call_output and reasoning items."
    )
    instructions: str | None = Field(None, description="A system message put first.")
    previous_response_id: str | None = Field(
        None, description="Continue a stored response: its input and output come first."
    )
    max_output_tokens: int | None = Field(
        None, ge=1, description="Output limit (default: the rest of the context)."
    )
    temperature: float | None = Field(None, le=2.0, description="0 to 2, as OpenAI's.")
    top_p: float | None = None
    top_k: int | None = Field(None, description="0 or -1: no top-k truncation (vLLM's).")
    min_p: float | None = Field(None, description="vLLM's.")
    repetition_penalty: float | None = Field(None, description="vLLM's.")
    seed: int | None = None
    stream: bool | None = False
    text: TextConfig | None = Field(
        None, description="text.format: text, json_object, json_schema."
    )
    tools: list[FunctionTool] | None = Field(None, description="Function tools (flat).")
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = Field(
        None,
        description='"auto" (the default with tools; needs --tool-call-parser), "required", '
        '"none" or {"type": "function", "name": ...}.',
    )
    parallel_tool_calls: bool | None = True
    top_logprobs: int | None = Field(
        None, description=f"Alternatives per token, with include ['{OUTPUT_LOGPROBS}']."
    )
    include: list[str] | None = Field(None, description=f"Only '{OUTPUT_LOGPROBS}'.")
    store: bool | None = Field(True, description="Keep the response for GET and continuation.")
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None
    ) = Field(
        None, max_length=16, description="Up to 16 pairs (keys of 64 characters, values of 512)."
    )
    user: str | None = Field(None, max_length=256)
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="Prefixes shared only within a salt.",
    )
    reasoning: ReasoningSettings | None = Field(None, description="Accepted and ignored.")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description='Only "disabled": a prompt over the context is a 400.'
    )
    background: bool | None = Field(
        None,
        description="Generate the response in the background, whatever the client does: "
        "answered at once with a queued response, or streamed (GET /v1/responses/{id}"
        "?stream=true&starting_after=N streams it again); GET /v1/responses/{id} reads it, "
        "POST /v1/responses/{id}/cancel stops it. Needs store.",
    )
    conversation: Any = Field(None, description="Not supported.")
    prompt: Any = Field(None, description="Not supported (prompt templates).")

    @staticmethod
    def client_path(text: str) -> str:
        return _ITEM_KIND_IN_PATH.sub(r"\1", text)  # input[0].message.content: no "message"

    # A string is one user message; the schema says so (json_schema_input_type).
    @field_validator("input", mode="before", json_schema_input_type=str | list[InputItem])
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if isinstance(value, list):
            if len(value) > MAX_INPUT_ITEMS:
                raise ValueError(f"may hold at most {MAX_INPUT_ITEMS} items, got {len(value)}")
            for i, item in enumerate(value):
                kind = _item_kind(item)
                if kind not in _ITEM_TYPES:
                    raise ValueError(
                        f"item {i} is of type {kind!r}; supported items are "
                        f"{', '.join(_ITEM_TYPES)}"
                    )
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise ValueError(
                'must be "none", "auto", "required" or {"type": "function", "name": ...}; '
                f"tool_choice of type {value.get('type')!r} is not supported"
            )
        return value

    def check_supported(self) -> None:
        unsupported = {
            "conversation": "conversations are not supported: use previous_response_id",
            "prompt": "prompt templates are not supported: send input",
        }
        if not self.input:
            raise RequestValidationError("input must hold at least one item", "input")
        for param, message in unsupported.items():
            if getattr(self, param):
                raise RequestValidationError(message, param)
        if self.background and self.store is False:
            raise RequestValidationError(
                "background responses must be stored: drop store false", "background"
            )
        if self.truncation == "auto":
            raise RequestValidationError(
                'truncation "auto" is not supported: send "disabled" (a prompt over the '
                "context is refused)",
                "truncation",
            )
        for value in self.include or []:
            if value != OUTPUT_LOGPROBS:
                raise RequestValidationError(
                    f"include {value!r} is not supported; only {OUTPUT_LOGPROBS!r} is", "include"
                )
        self._check_format()

    def _check_format(self) -> None:
        spec = self._format
        if spec is None or spec.type == "text":
            return
        if self.tool_choice == "required" or isinstance(self.tool_choice, FunctionToolChoice):
            raise RequestValidationError(
                "tool_choice and text.format cannot both constrain the output", "tool_choice"
            )
        if spec.type == "json_schema" and (spec.name is None or spec.json_schema is None):
            raise RequestValidationError(
                "text.format of type json_schema needs name and schema", "text.format"
            )

    @property
    def _format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    @property
    def want_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or [])

    def to_chat(self, history: list[InputItem]) -> ChatCompletionRequest:
        """The chat request: instructions, then `history` (a previous response's input and
        output), then the input. Raises RequestValidationError naming this request's fields."""
        messages = items_to_messages([*history, *self.input])
        if not messages:
            raise RequestValidationError("input must hold a message", "input")
        if self.instructions is not None:
            messages.insert(0, _message(role="system", content=self.instructions))
        choice: Any = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
        tools = [
            ChatTool(type="function", function=FunctionDefinition(**t.model_dump(exclude={"type"})))
            for t in self.tools or []
        ]
        if choice == "auto" and not tools:  # the Responses API's default, with or without tools
            choice = None
        chat = ChatCompletionRequest.model_validate(
            {
                "model": self.model,  # a LoRA adapter's name picks it
                "messages": messages,
                "tools": tools or None,
                "tool_choice": choice,
                "parallel_tool_calls": self.parallel_tool_calls,
                "response_format": self._response_format(),
                "max_completion_tokens": self.max_output_tokens,
                "logprobs": self.want_logprobs,
                "top_logprobs": self.top_logprobs if self.want_logprobs else None,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "top_k": self.top_k,
                "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty,
                "seed": self.seed,
                "user": self.user,
                "cache_salt": self.cache_salt,
            }
        )
        with responses_params():
            chat.check_supported()
        return chat

    def _response_format(self) -> ResponseFormat | None:
        spec = self._format
        if spec is None or spec.type != "json_schema":
            return None if spec is None else ResponseFormat(type=spec.type)
        schema = JsonSchemaFormat.model_validate(
            {"name": spec.name, "schema": spec.json_schema, "strict": spec.strict}
        )
        return ResponseFormat(type="json_schema", json_schema=schema)

    def echo(self) -> dict[str, Any]:
        """The request's settings as the response repeats them."""
        text = self.text.model_dump(by_alias=True, exclude_none=True) if self.text else {}
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "previous_response_id": self.previous_response_id,
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "tool_choice": (
                self.tool_choice.model_dump()
                if isinstance(self.tool_choice, FunctionToolChoice)
                else self.tool_choice or "auto"
            ),
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "text": {"format": {"type": "text"}} | text,
            "metadata": self.metadata or {},
            "store": self.store is not False,
            "background": bool(self.background),
            "user": self.user,
            "reasoning": self.reasoning.model_dump(exclude_none=True) if self.reasoning else None,
            "truncation": self.truncation or "disabled",
            "top_logprobs": self.top_logprobs,
        }


def responses_params() -> contextlib.AbstractContextManager[None]:
    """Errors raised inside name the Responses field a chat field came from."""
    return renamed_params(_CHAT_PARAMS)
