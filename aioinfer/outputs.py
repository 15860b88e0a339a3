"""vLLM's `vllm.outputs` path, so that a script's imports change only in their package name.
The classes live in aioinfer.core.outputs."""

from aioinfer.core.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)

__all__ = [
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "RequestOutput",
    "ScoringRequestOutput",
]
