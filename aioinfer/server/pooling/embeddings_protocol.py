"""POST /v1/embeddings: OpenAI's request and response shapes, and the response builder.

PURE (no torch, no asyncio). `encoding_format` "base64" is the little-endian float32 bytes of
each vector, base64-encoded: what OpenAI's Python client asks for by default and decodes.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator
from typing_extensions import TypedDict

from aioinfer.core.pooling import PoolingParams
from aioinfer.server.http.request_model import ModelRequest, RequestValidationError
from aioinfer.server.serving.protocol import check_prompt_shape


class PoolingInputRequest(ModelRequest):
    """The fields /v1/embeddings and /classify share: inputs, truncation, priority."""

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


class EmbeddingRequest(PoolingInputRequest):
    """POST /v1/embeddings."""

    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: little-endian float32 bytes."
    )
    dimensions: int | None = Field(
        None, description="Keep the first d values, then normalize (Matryoshka models)."
    )
    normalize: bool | None = Field(
        None, description="L2-normalize the vectors (default: the model's setting)."
    )

    def to_pooling_params(self) -> PoolingParams:
        return pooling_params(self.dimensions, self.normalize, self.truncate_prompt_tokens)


def pooling_params(
    dimensions: int | None, normalize: bool | None, truncate_prompt_tokens: int | None
) -> PoolingParams:
    """PoolingParams from a request's fields; a 400 naming the field for a bad value."""
    try:
        return PoolingParams(dimensions, normalize, truncate_prompt_tokens)
    except ValueError as exc:
        param = "dimensions" if str(exc).startswith("dimensions") else "truncate_prompt_tokens"
        raise RequestValidationError(str(exc), param) from None


class EmbeddingData(TypedDict):
    object: Literal["embedding"]
    embedding: list[float] | str
    index: int


class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(TypedDict):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def embedding_response(
    response_id: str,
    created: int,
    model: str,
    vectors: list[np.ndarray],
    num_prompt_tokens: int,
    encoding_format: str,
) -> EmbeddingResponse:
    """The response body: one entry per input, in input order."""
    data: list[EmbeddingData] = []
    for index, vector in enumerate(vectors):
        if encoding_format == "base64":
            encoded: list[float] | str = base64.b64encode(vector.astype("<f4").tobytes()).decode()
        else:
            encoded = vector.tolist()
        data.append({"object": "embedding", "embedding": encoded, "index": index})
    return {
        "id": response_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }
