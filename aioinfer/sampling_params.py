"""vLLM's `vllm.sampling_params` path, so that a script's imports change only in their package
name. The classes live in aioinfer.core.sampling_params."""

from aioinfer.core.beam_search import BeamSearchParams
from aioinfer.core.sampling_params import (
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    StructuredOutputsParams,
)

__all__ = [
    "BeamSearchParams",
    "GuidedDecodingParams",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
]
