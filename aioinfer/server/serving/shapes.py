"""The OpenAI response shapes more than one API builds, as TypedDicts: logprobs and tool calls.

PURE (no torch, no asyncio). The handlers build plain dicts that orjson serializes; the same
types give the response schemas of /openapi.json.
"""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import TypedDict


class CompletionLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


# Per prompt token: None for the first, then {token id: {logprob, rank, decoded_token}}.
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class TopLogprob(TypedDict):
    token: str
    logprob: float | None
    bytes: list[int]


class ChatLogprob(TypedDict):
    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatLogprob]


class ToolCallFunction(TypedDict):
    name: str
    arguments: str


class ToolCallJson(TypedDict):
    id: str
    type: Literal["function"]
    function: ToolCallFunction
