"""aioinfer: a single-GPU LLM inference server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "__version__"]

if TYPE_CHECKING:
    from aioinfer.core.lora import LoRARequest
    from aioinfer.core.sampling_params import SamplingParams, StructuredOutputsParams
    from aioinfer.engine.llm import LLM


def __getattr__(name: str) -> Any:
    # Lazy, so `aioinfer --help` does not pay for torch and transformers.
    if name == "LLM":
        from aioinfer.engine.llm import LLM

        return LLM
    if name == "LoRARequest":
        from aioinfer.core.lora import LoRARequest

        return LoRARequest
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from aioinfer.core import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(name)
