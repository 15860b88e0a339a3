"""POST /classify: vLLM's request and response shapes for classifier models.

PURE (no torch, no asyncio). Each input gets its class probabilities (`probs`), the number of
classes and the label of the likeliest one, named as the model's config.json names it.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator
from typing_extensions import TypedDict

from aioinfer.server.embeddings_protocol import EmbeddingUsage
from aioinfer.server.protocol import OpenAIRequest, check_prompt_shape


class ClassifyRequest(OpenAIRequest):
    """POST /classify."""

    model: str | None = Field(None, description="The served model name (default: the only one).")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="A text, a list of texts, a list of token ids or a list of such lists."
    )
    user: str | None = Field(None, description="Accepted and ignored.")
    truncate_prompt_tokens: int | None = Field(
        None, description="Keep only each input's last k tokens (-1: what the context holds)."
    )
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens.")
    priority: int = Field(
        0, description="With --scheduling-policy priority: lower runs first (vLLM's field)."
    )

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        return check_prompt_shape(value)


class ClassifyData(TypedDict):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(TypedDict):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassifyData]
    usage: EmbeddingUsage


def classify_response(
    response_id: str,
    created: int,
    model: str,
    probabilities: list[np.ndarray],
    labels: tuple[str, ...],
    num_prompt_tokens: int,
) -> ClassifyResponse:
    """The response body: one entry per input, in input order."""
    data: list[ClassifyData] = [
        {
            "index": index,
            "label": labels[int(np.argmax(probs))],
            "probs": probs.tolist(),
            "num_classes": len(probs),
        }
        for index, probs in enumerate(probabilities)
    ]
    return {
        "id": response_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }
