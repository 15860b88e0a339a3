"""POST /v1/messages (Anthropic's Messages API): the request model, and the chat request it
becomes.

A Messages request is a chat in another shape: `system` is a system message put first; a user
turn's text blocks are a user message and its `tool_result` blocks tool messages; an assistant
turn's `tool_use` blocks are its tool calls and its `thinking` blocks its reasoning. `tools`
(name, description, input_schema) are the chat's function tools, `tool_choice` auto / any / tool
/ none the chat's "auto" / "required" / named / "none". `to_chat` builds that chat request, so
the messages go through the chat template and the tools become constraints exactly as on
/v1/chat/completions. What cannot be served (images, documents, server tools, MCP servers,
containers) is refused with a 400 naming the field.

PURE: pydantic and the core package only (no torch, no asyncio).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from aioinfer.server.http.request_model import ModelRequest, RequestValidationError, StrictModel
from aioinfer.server.http.validation import renamed_params
from aioinfer.server.serving.formats import JsonSchemaFormat, ResponseFormat
from aioinfer.server.serving.protocol import (
    MAX_CHAT_MESSAGES,
    ChatCompletionRequest,
    ChatMessage,
    too_many_messages,
)
from aioinfer.server.serving.tools import (
    FUNCTION_NAME_PATTERN,
    AssistantToolCall,
    CalledFunction,
    ChatTool,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
)

_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
# The block types each role's turns may hold.
_TURN_BLOCKS = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}
# Fields of the chat request that a Messages request names otherwise. The chat's messages are
# not the request's one for one (the system message, tool results), so no index is kept.
_CHAT_PARAMS = {
    "messages": "messages",
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice",
    "chat_template_kwargs": "thinking",
    "response_format": "output_config.format",
}
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# pydantic names the alternative a value was tried as in its path (messages[0].content.blocks[0]
# .tool_result.content): an error names the field as the client wrote it, without them.
_SHAPE_IN_PATH = re.compile(r"\.(?:string|blocks)\b")
_BLOCK_KIND_IN_PATH = re.compile(rf"(content\[\d+\])\.(?:{'|'.join(_BLOCK_TYPES)})\b")


def _string_or_blocks(value: Any) -> str:
    return "string" if isinstance(value, str) else "blocks"


def _known_blocks(value: Any) -> Any:
    """A content list's blocks must be of the served types: images, documents and the blocks
    of server tools are refused by name."""
    if isinstance(value, list):
        for block in value:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            if kind not in _BLOCK_TYPES:
                raise ValueError(
                    f"content blocks of type {kind!r} are not supported; supported blocks are "
                    f"{', '.join(_BLOCK_TYPES)}"
                )
    return value


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str


# A string, or a list of text blocks.
StringOrTextBlocks = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[TextBlock], Tag("blocks")],
    Discriminator(_string_or_blocks),
]


class ToolUseBlock(StrictModel):
    """A tool call of an earlier assistant turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(description="The call's arguments.")


class ToolResultBlock(StrictModel):
    """What a tool call returned, in the user turn after it."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: StringOrTextBlocks | None = None
    is_error: bool | None = Field(None, description="Accepted; the template sees the content.")

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for block in value:
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                if kind != "text":
                    raise ValueError(
                        f"only text blocks are supported in a tool result, got a block of type "
                        f"{kind!r}"
                    )
        return value

    def text(self) -> str:
        return _joined(self.content or "")


class ThinkingBlock(StrictModel):
    """The reasoning of an earlier assistant turn: the template gets it as that turn's
    reasoning."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    """Encrypted reasoning of Anthropic's models: nothing a template can show; dropped."""

    type: Literal["redacted_thinking"]
    data: str | None = None


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Discriminator("type"),
]
StringOrBlocks = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[ContentBlock], Tag("blocks")],
    Discriminator(_string_or_blocks),
]


def _joined(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


class InputMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: StringOrBlocks = Field(description="A string or a list of blocks.")

    _content_shape = field_validator("content", mode="before")(_known_blocks)


class Tool(StrictModel):
    """A client tool: {name, description, input_schema}."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="A JSON schema of the tool's input.")

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(
                f"only client tools ({{name, description, input_schema}}) are supported, got a "
                f"tool of type {kind!r}"
            )
        return value

    def to_chat(self) -> ChatTool:
        function = FunctionDefinition(
            name=self.name, description=self.description, parameters=self.input_schema
        )
        return ChatTool(type="function", function=function)


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description='type "tool": the tool to call.')
    disable_parallel_tool_use: bool | None = Field(
        None, description='type "any": at most one call.'
    )


class ThinkingConfig(StrictModel):
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = Field(None, description="Accepted and ignored.")


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema", description="The output's JSON schema.")


class OutputConfig(StrictModel):
    format: JsonOutputFormat | None = Field(None, description="JSON that follows a schema.")
    effort: str | None = Field(None, description="Accepted and ignored.")


class MessagesRequest(ModelRequest):
    """POST /v1/messages."""

    MAX_ITEMS: ClassVar[Mapping[str, int]] = {"messages": MAX_CHAT_MESSAGES}

    model: str | None = Field(None, description="The served model name (default: the only one).")
    max_tokens: int = Field(ge=1, description="Output limit.")
    messages: list[InputMessage] = Field(
        min_length=1, description=f"The conversation: at most {MAX_CHAT_MESSAGES} messages."
    )
    system: StringOrTextBlocks | None = Field(None, description="A system message put first.")
    stop_sequences: list[str] | None = Field(None, description="Strings that end the output.")
    temperature: float | None = Field(None, le=1.0, description="0 to 1, as Anthropic's.")
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    tools: list[Tool] | None = Field(None, description="Client tools.")
    tool_choice: ToolChoice | None = Field(
        None,
        description="auto (the default with tools; needs --tool-call-parser), any, tool (with "
        "name) or none.",
    )
    thinking: ThinkingConfig | None = Field(
        None,
        description="disabled: the template's enable_thinking false (as Qwen3's); the other "
        "types true.",
    )
    output_config: OutputConfig | None = Field(
        None, description="format: the output constrained to a JSON schema."
    )
    service_tier: str | None = Field(None, description="Accepted and ignored.")
    container: Any = Field(None, description="Not supported.")
    mcp_servers: Any = Field(None, description="Not supported.")

    @staticmethod
    def client_path(text: str) -> str:
        return _BLOCK_KIND_IN_PATH.sub(r"\1", _SHAPE_IN_PATH.sub("", text))

    def check_supported(self) -> None:
        for param in ("container", "mcp_servers"):
            if getattr(self, param):
                raise RequestValidationError(f"{param} is not supported", param)
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise RequestValidationError('tool_choice of type "tool" needs a name', "tool_choice")
        for i, message in enumerate(self.messages):
            if isinstance(message.content, str):
                continue
            allowed = _TURN_BLOCKS[message.role]
            for j, block in enumerate(message.content):
                if block.type not in allowed:
                    raise RequestValidationError(
                        f"{block.type} blocks are not allowed in {message.role} turns",
                        f"messages[{i}].content[{j}]",
                    )

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request. Raises RequestValidationError naming this request's fields."""
        tools = [tool.to_chat() for tool in self.tools or []]
        choice, parallel = self._chat_tool_choice()
        thinking = self.thinking
        template_kwargs = None
        if thinking is not None:
            template_kwargs = {"enable_thinking": thinking.type != "disabled"}
        # A last assistant message is a prefill: the answer goes on from it.
        last = self.messages[-1]
        prefill = last.role == "assistant" and (
            isinstance(last.content, str) or all(b.type == "text" for b in last.content)
        )
        chat = ChatCompletionRequest.model_validate(
            {
                "model": self.model,  # a LoRA adapter's name picks it
                "messages": self.chat_messages(),
                "add_generation_prompt": not prefill,
                "continue_final_message": prefill,
                "tools": tools or None,
                "tool_choice": choice,
                "parallel_tool_calls": parallel,
                "chat_template_kwargs": template_kwargs,
                "response_format": self._response_format(),
                "max_completion_tokens": self.max_tokens,
                "stop": self.stop_sequences,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "top_k": self.top_k,
            }
        )
        with messages_params():
            chat.check_supported()
        return chat

    def _response_format(self) -> ResponseFormat | None:
        spec = self.output_config.format if self.output_config is not None else None
        if spec is None:
            return None
        schema = JsonSchemaFormat.model_validate({"name": "output", "schema": spec.json_schema})
        return ResponseFormat(type="json_schema", json_schema=schema)

    def _chat_tool_choice(self) -> tuple[str | NamedToolChoice | None, bool]:
        """The chat's tool_choice and parallel_tool_calls."""
        choice = self.tool_choice
        if choice is None or (not self.tools and choice.type in ("auto", "none")):
            return None, True
        parallel = not choice.disable_parallel_tool_use
        if choice.type == "tool":
            assert choice.name is not None  # check_supported
            named = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
            return named, parallel
        return _CHOICES[choice.type], parallel

    def chat_messages(self) -> list[ChatMessage]:
        messages: list[ChatMessage] = []
        if self.system:  # "" or [] is no system prompt
            messages.append(_message(role="system", content=_joined(self.system)))
        for message in self.messages:
            content = message.content
            if isinstance(content, str):
                messages.append(_message(role=message.role, content=content))
            elif message.role == "assistant":
                messages.append(_assistant_turn(content))
            else:
                messages += _user_turn(content)
            if len(messages) > MAX_CHAT_MESSAGES:  # a turn's tool results are messages each
                raise too_many_messages(len(messages))
        return messages


class MessageTokensCountRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: the same body, without max_tokens."""

    max_tokens: int | None = Field(None, ge=1, description="Not needed to count.")  # type: ignore[assignment]


def _message(**fields: Any) -> ChatMessage:
    return ChatMessage.model_validate(fields)


def _user_turn(blocks: list[ContentBlock]) -> list[ChatMessage]:
    """A user turn's messages, in its order: each run of text blocks one user message, each
    tool result a tool message."""
    messages: list[ChatMessage] = []
    texts: list[str] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if texts:
                messages.append(_message(role="user", content="\n".join(texts)))
                texts = []
            messages.append(
                _message(role="tool", tool_call_id=block.tool_use_id, content=block.text())
            )
            if len(messages) > MAX_CHAT_MESSAGES:
                break  # the conversation is refused: no need to build the rest
    if texts or not messages:
        messages.append(_message(role="user", content="\n".join(texts)))
    return messages


def _assistant_turn(blocks: list[ContentBlock]) -> ChatMessage:
    """An assistant turn as one message: its text, its tool calls, its reasoning."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[AssistantToolCall] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            function = CalledFunction(name=block.name, arguments=block.input)
            calls.append(AssistantToolCall(id=block.id, function=function))
    return _message(
        role="assistant",
        content="\n".join(texts),
        tool_calls=calls or None,
        reasoning="\n".join(thoughts) if thoughts else None,
    )


def messages_params() -> contextlib.AbstractContextManager[None]:
    """Errors raised inside name the Messages field a chat field came from."""
    return renamed_params(_CHAT_PARAMS)
