"""POST /classify: vLLM's request and response shapes for classifier models.

PURE (no torch, no asyncio). Each input gets its class probabilities (`probs`), the number of
classes and the label of the likeliest one, named as the model's config.json names it.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from typing_extensions import TypedDict

from aioinfer.server.pooling.embeddings_protocol import EmbeddingUsage, PoolingInputRequest


class ClassifyRequest(PoolingInputRequest):
    """POST /classify."""


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
