"""OpenAI's completion, chat completion, model and tokenize response shapes, as TypedDicts.

PURE (no torch, no asyncio). The handlers build plain dicts that orjson serializes; the same
types give the response schemas of /openapi.json.
"""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import NotRequired, TypedDict

from aioinfer.server.serving.shapes import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprobs,
    ToolCallJson,
)


class CompletionTokensDetails(TypedDict):
    reasoning_tokens: int


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class UsageInfo(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # With --enable-prompt-tokens-details: how many prompt tokens the prefix cache held.
    prompt_tokens_details: NotRequired[PromptTokensDetails]
    # With --reasoning-parser (chat): how many of completion_tokens were reasoning.
    completion_tokens_details: NotRequired[CompletionTokensDetails]


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    # vLLM's return_token_ids: the prompt's ids (the first chunk of a stream) and the output's.
    prompt_token_ids: NotRequired[list[int]]
    token_ids: NotRequired[list[int]]
    prompt_logprobs: NotRequired[PromptLogprobs]  # vLLM's prompt_logprobs


class CompletionResponse(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: NotRequired[UsageInfo | None]


class CompletionChunk(CompletionResponse):
    """One SSE chunk of a streamed completion, shaped as the whole response: usage only with
    stream_options."""


class ChatResponseMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None  # None when the message holds tool calls, or only reasoning
    tool_calls: NotRequired[list[ToolCallJson]]
    reasoning: NotRequired[str]  # with --reasoning-parser


class ChatChoice(TypedDict):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: NotRequired[list[int]]  # return_token_ids


class ChatCompletionResponse(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: NotRequired[list[int]]  # return_token_ids
    prompt_logprobs: NotRequired[PromptLogprobs]  # vLLM's prompt_logprobs


class ChatDelta(TypedDict):
    role: NotRequired[Literal["assistant"]]
    content: NotRequired[str]
    reasoning: NotRequired[str]
    # Each entry: index, and on a call's first delta id, type and function.name; then
    # function.arguments in pieces.
    tool_calls: NotRequired[list[dict[str, Any]]]


class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: NotRequired[int | str | None]
    token_ids: NotRequired[list[int]]  # return_token_ids: this chunk's


class ChatCompletionChunk(TypedDict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: NotRequired[UsageInfo | None]


class ModelPermission(TypedDict):
    id: str
    object: Literal["model_permission"]
    allow_sampling: bool


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    permission: list[ModelPermission]


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(TypedDict):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: NotRequired[list[str]]  # with return_token_strs: the vocabulary's strings


class DetokenizeResponse(TypedDict):
    prompt: str
