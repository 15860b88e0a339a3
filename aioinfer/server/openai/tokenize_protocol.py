"""The /tokenize and /detokenize request schemas (vLLM's shapes).

PURE: pydantic and the core package only (no torch, no asyncio).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic import Field

from aioinfer.server.http.request_model import ModelRequest, RequestValidationError
from aioinfer.server.serving.protocol import (
    MAX_CHAT_MESSAGES,
    ChatMessage,
    ChatTemplateOptions,
    check_messages,
)


class TokenizeRequest(ChatTemplateOptions, ModelRequest):
    """POST /tokenize: either a prompt or chat messages."""

    MAX_ITEMS: ClassVar[Mapping[str, int]] = {"messages": MAX_CHAT_MESSAGES}

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(True, description="For prompt: add BOS etc.")
    return_token_strs: bool | None = Field(
        False, description="Also return each token's string in the vocabulary (token_strs)."
    )

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestValidationError(
                "give exactly one of prompt and messages", "prompt" if self.prompt else "messages"
            )
        if self.messages is not None:
            check_messages(self.messages)
        self.check_template_options()


class DetokenizeRequest(ModelRequest):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
