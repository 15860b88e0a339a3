"""Hugging Face `architectures[0]` -> the model class that implements it."""

from __future__ import annotations

from typing import Any

from aioinfer.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from aioinfer.model.llama import LlamaForCausalLM, MistralForCausalLM
from aioinfer.model.mixtral import MixtralForCausalLM
from aioinfer.model.phi3 import Phi3ForCausalLM
from aioinfer.model.qwen2 import Qwen2ForCausalLM
from aioinfer.model.qwen2_moe import Qwen2MoeForCausalLM
from aioinfer.model.qwen3 import Qwen3ForCausalLM
from aioinfer.model.qwen3_moe import Qwen3MoeForCausalLM

_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # Mixture of experts.
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # Classifiers (reward models, cross-encoders): the decoder, then a `score` head on the last
    # token, run with --runner pooling.
    "LlamaForSequenceClassification": LlamaForCausalLM,
    "MistralForSequenceClassification": MistralForCausalLM,
    "Qwen2ForSequenceClassification": Qwen2ForCausalLM,
    "Qwen3ForSequenceClassification": Qwen3ForCausalLM,
    # The bare decoders of embedding checkpoints (no LM head; keys without "model."): the same
    # classes, run with --runner pooling.
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": MistralForCausalLM,
    "Qwen2Model": Qwen2ForCausalLM,
    "Qwen3Model": Qwen3ForCausalLM,
}
# Configs built in code often leave `architectures` unset; their model_type still names the family.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def get_model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """The class for `hf_config.architectures[0]` (or its model_type when that list is empty)."""
    archs = getattr(hf_config, "architectures", None) or []
    model_type = getattr(hf_config, "model_type", None)
    name = archs[0] if archs else _MODEL_TYPES.get(model_type or "", "")
    cls = _ARCHITECTURES.get(name)
    if cls is None:
        shown = repr(archs[0]) if archs else f"of model_type {model_type!r}"
        raise ValueError(
            f"architecture {shown} is not supported; supported: {', '.join(_ARCHITECTURES)}"
        )
    return cls
