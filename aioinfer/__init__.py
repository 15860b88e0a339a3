"""aioinfer: a single-GPU LLM inference server."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The offline API's names, as vLLM exports them at its top level, and where each lives.
_EXPORTS = {
    "LLM": "aioinfer.offline.llm",
    "TextPrompt": "aioinfer.offline.llm",
    "TokensPrompt": "aioinfer.offline.llm",
    "SamplingParams": "aioinfer.core.sampling_params",
    "StructuredOutputsParams": "aioinfer.core.sampling_params",
    "LoRARequest": "aioinfer.core.lora",
    "BeamSearchParams": "aioinfer.core.beam_search",
    "PoolingParams": "aioinfer.core.pooling",
    "RequestOutput": "aioinfer.core.outputs",
    "CompletionOutput": "aioinfer.core.outputs",
    "EmbeddingRequestOutput": "aioinfer.core.outputs",
    "ClassificationRequestOutput": "aioinfer.core.outputs",
    "ScoringRequestOutput": "aioinfer.core.outputs",
}
__all__ = [
    "LLM",
    "BeamSearchParams",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]

if TYPE_CHECKING:
    from aioinfer.core.beam_search import BeamSearchParams
    from aioinfer.core.lora import LoRARequest
    from aioinfer.core.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from aioinfer.core.pooling import PoolingParams
    from aioinfer.core.sampling_params import SamplingParams, StructuredOutputsParams
    from aioinfer.offline.llm import LLM, TextPrompt, TokensPrompt


def __getattr__(name: str) -> Any:
    # Lazy, so `aioinfer --help` does not pay for torch and transformers.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(name)
    return getattr(importlib.import_module(module), name)
