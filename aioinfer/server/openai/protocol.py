"""The /v1/completions request schema: a prompt (texts or token ids) to complete.

PURE: pydantic and the core package only (no torch, no asyncio). The shared sampling fields are
`serving.protocol.GenerationRequest`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator

from aioinfer.core.sampling_params import SamplingParams
from aioinfer.server.http.request_model import RequestValidationError
from aioinfer.server.serving.protocol import (
    GenerationRequest,
    capped_max_tokens,
    check_prompt_shape,
)

COMPLETION_MAX_TOKENS_DEFAULT = 16  # OpenAI's default for /v1/completions


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A text, a list of texts, a list of token ids or a list of such lists."
    )
    echo: bool | None = Field(
        False,
        description="Prepend the prompt to each completion; with max_tokens 0, return only the "
        "prompt (and its logprobs), to score it.",
    )
    logprobs: int | None = Field(
        None, ge=0, description="Top logprobs per token (0: the chosen one)."
    )
    suffix: str | None = Field(None, description="Not supported: refused unless empty.")
    best_of: int | None = Field(None, description="Not supported: refused unless 1.")
    add_special_tokens: bool = Field(
        True, description="Add the tokenizer's special tokens (a BOS) to text prompts (vLLM's)."
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        return check_prompt_shape(value)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise RequestValidationError(
                "suffix is not supported: fill-in-the-middle needs a model-specific prompt; put "
                "the text in the prompt instead",
                "suffix",
            )
        if self.best_of is not None and self.best_of != 1:
            raise RequestValidationError(
                f"best_of must be 1 (or omitted): it is not supported, got {self.best_of}",
                "best_of",
            )

    @property
    def max_tokens_given(self) -> bool:
        return self.max_tokens is not None

    @property
    def prompt_only(self) -> bool:
        """Echo with max_tokens 0: score the prompt (its logprobs), generate nothing."""
        return bool(self.echo) and self.max_tokens == 0

    def to_sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """The request's SamplingParams: request values, then the model's defaults, then
        OpenAI's (max_tokens 16)."""
        values = self._sampling_values(defaults)
        limit = self.max_tokens
        if limit is None:
            limit = COMPLETION_MAX_TOKENS_DEFAULT
        # The engine samples at least one token; the handler hides it (see `prompt_only`).
        values["max_tokens"] = 1 if self.prompt_only else capped_max_tokens(limit, defaults)
        if self.logprobs is not None:
            values["logprobs"] = self.logprobs
            if self.echo:  # the echoed prompt's logprobs
                values["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return self._build(values)
