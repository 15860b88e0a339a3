"""Tiny random Hugging Face decoders (float32, eval mode) to test our models against.

Weights are redrawn with a larger spread than HF's default init so attention patterns, norms and
biases all matter to the logits; the same seed always gives the same model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}

BASE_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: two query heads per KV head
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

# Qwen3 reads head_dim from the config; make it differ from hidden_size // num_heads.
# Mixtures of experts: more experts than each token takes, and experts narrower than the dense
# MLP; Qwen3-MoE keeps its second layer dense (`mlp_only_layers`) and renormalizes the top-k.
_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48},
    "qwen2_moe": {**_EXPERTS, "shared_expert_intermediate_size": 96},
    "qwen3_moe": {**_EXPERTS, "head_dim": 32, "mlp_only_layers": [1], "norm_topk_prob": True},
    # Sliding and full layers in turn; Gemma 2's soft caps, tighter so that they bite.
    "gemma2": {
        "head_dim": 32,
        "num_hidden_layers": 3,
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0,
    },
    # A sliding layer and a full one, each with its rotary base (the full one scaled, as Gemma
    # 3's larger models), scores scaled by another number than head_dim.
    "gemma3": {
        "head_dim": 32,
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    },
}

# Llama 3.1-style scaling, with a short original context so tiny prompts cross every band.
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# Qwen's long-context setting, with a short original context so tiny prompts cross the ramp.
YARN_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}

# Named variants: (arch, overrides).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE_SCALING, "rope_theta": 500000.0}),
    "llama-mha": ("llama", {"num_key_value_heads": 4, "attention_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-yarn": ("qwen2", {"rope_scaling": YARN_ROPE_SCALING, "rope_theta": 10000.0}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "mixtral": ("mixtral", {}),
    "qwen2-moe": ("qwen2_moe", {}),
    "qwen3-moe": ("qwen3_moe", {}),
    # 16 experts (the router becomes a packed linear on the native CPU path), one per token.
    "qwen3-moe-top1": (
        "qwen3_moe",
        {"num_experts": 16, "num_experts_per_tok": 1, "norm_topk_prob": False},
    ),
    "gemma2": ("gemma2", {"tie_word_embeddings": True}),
    "gemma3": ("gemma3", {"tie_word_embeddings": True}),
    # Gemma 2's final soft cap, untied, with biases on q/k/v/o.
    "gemma3-softcap": ("gemma3", {"final_logit_softcapping": 30.0, "attention_bias": True}),
    # Without q/k/v biases; experts in every second layer; renormalized.
    "qwen2-moe-step2": (
        "qwen2_moe",
        {"qkv_bias": False, "decoder_sparse_step": 2, "norm_topk_prob": True},
    ),
}


def _randomize(model: nn.Module, seed: int, std: float = 0.1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights appear once
            noise = torch.randn(param.shape, generator=gen) * std
            if name.endswith("norm.weight"):
                param.copy_(1.0 + noise)
            else:
                param.copy_(noise)


def make_hf_model(arch: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny random HF model of `arch` (a key of ARCHS), float32, eval mode."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    config_cls, model_cls = ARCHS[arch]
    kwargs = {**BASE_CONFIG, **ARCH_CONFIG[arch], **overrides}
    config = config_cls(**kwargs, attn_implementation="eager")
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    _randomize(model, seed)
    return model


def make_variant(name: str, seed: int = 0) -> PreTrainedModel:
    arch, overrides = VARIANTS[name]
    return make_hf_model(arch, seed=seed, **overrides)


def bundled_model_and_reference(hub_id: str) -> tuple[Any, nn.Module, PreTrainedModel]:
    """A bundled config (`--load-format dummy`), our model of it and transformers', both on
    the meta device, after checking that their parameters agree in name and shape."""
    from transformers import AutoModelForCausalLM

    from aioinfer.model.loader import resolve_model
    from aioinfer.model.registry import get_model_class

    config = resolve_model(hub_id, load_format="dummy").hf_config
    with torch.device("meta"):
        ours = get_model_class(config)(config)
        ref = AutoModelForCausalLM.from_config(config)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in ref.state_dict().items()
    }
    return config, ours, ref
