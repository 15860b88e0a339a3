"""Gemma 2 and Gemma 3 text models (`Gemma2ForCausalLM`; `Gemma3ForCausalLM`: gemma-3-270m,
gemma-3-1b): the Llama decoder with Gemma's differences, each as transformers' modeling_gemma2
and modeling_gemma3 compute it:

- the embeddings scaled by sqrt(hidden_size), in the model's dtype;
- RMSNorms that scale by (1 + weight) (`GemmaRMSNorm`): after the attention and around the MLP
  (pre- and post-feed-forward) besides Llama's two, and per head on queries and keys (Gemma 3);
- the MLP gated by gelu with the tanh approximation;
- attention scores scaled by query_pre_attn_scalar ** -0.5, and soft-capped to
  cap * tanh(score / cap) when attn_logit_softcapping is set (Gemma 2's 50);
- the layers `layer_types` names "sliding_attention" attend over a sliding window: every other
  layer of Gemma 2, five of six of Gemma 3, whose sliding layers also have their own rotary base
  (`rope_parameters["sliding_attention"]`, the others `["full_attention"]`);
- logits soft-capped likewise when final_logit_softcapping is set (Gemma 2's 30).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from aioinfer.model.layers.activation import GeluTanhAndMul
from aioinfer.model.layers.norm import GemmaRMSNorm
from aioinfer.model.layers.rotary import RopeConfig, RotaryEmbedding, rope_config_from_hf
from aioinfer.model.llama import (
    DecoderConfig,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    fuse_projections,
)


class GemmaAttention(LlamaAttention):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(cfg, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = LlamaMLP(cfg)
        self.mlp.act_fn = GeluTanhAndMul()
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(LlamaModel):
    """With `sliding_rope`, the sliding layers rotate by it and the others by cfg.rope."""

    def __init__(self, cfg: DecoderConfig, sliding_rope: RopeConfig | None = None) -> None:
        super().__init__(cfg, GemmaDecoderLayer, GemmaRMSNorm)
        self.embed_scale = cfg.hidden_size**0.5
        self.sliding_rotary_emb = None
        if sliding_rope is not None:
            self.sliding_rotary_emb = RotaryEmbedding(cfg.head_dim, sliding_rope)
        self.sliding = [bool(w) for w in cfg.sliding_windows] or [False] * cfg.num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        full = self.rotary_emb(positions, x.dtype)
        sliding = full
        if self.sliding_rotary_emb is not None:
            sliding = self.sliding_rotary_emb(positions, x.dtype)
        for layer, slides in zip(self.layers, self.sliding, strict=True):
            x = layer(x, *(sliding if slides else full))
        return self.norm(x)


class Gemma2ForCausalLM(LlamaForCausalLM):
    sliding_window_layers = "layer_types"

    def decoder_stack(self) -> LlamaModel:
        return GemmaModel(self.config)

    @classmethod
    def _arch_options(cls, hf_config: Any) -> dict[str, Any]:
        return {
            **super()._arch_options(hf_config),  # Llama's biases: attention_bias
            "attention_scale": float(hf_config.query_pre_attn_scalar) ** -0.5,
            "attention_softcap": float(getattr(hf_config, "attn_logit_softcapping", None) or 0),
            "norms_per_layer": 4,
        }

    @classmethod
    def _check_supported(cls, hf_config: Any) -> None:
        act = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation must be 'gelu_pytorch_tanh', got {act!r}")

    def fuse_gemms(self) -> None:
        """q/k/v and gate/up as one GEMM each; the residuals stay outside the GEMMs, as the
        outputs are normed before they are added."""
        for module in self.model.layers:
            layer: GemmaDecoderLayer = module  # type: ignore[assignment]
            fuse_projections(layer.self_attn, layer.mlp)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = getattr(self.hf_config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_token_ids(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        # tanh can round neighbouring logits to one value, moving the first maximum.
        if getattr(self.hf_config, "final_logit_softcapping", None):
            return None
        return super().greedy_token_ids(hidden_states)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @classmethod
    def rope_config(cls, hf_config: Any) -> RopeConfig:
        return _layer_rope(hf_config, "full_attention")

    def decoder_stack(self) -> LlamaModel:
        return GemmaModel(self.config, _layer_rope(self.hf_config, "sliding_attention"))

    @classmethod
    def _arch_options(cls, hf_config: Any) -> dict[str, Any]:
        return {**super()._arch_options(hf_config), "qk_norm": True}

    @classmethod
    def _check_supported(cls, hf_config: Any) -> None:
        super()._check_supported(hf_config)
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (causal only)")


def _layer_rope(hf_config: Any, layer_type: str) -> RopeConfig:
    """The rotary settings of one kind of layer: transformers keeps them per layer type."""
    params = (getattr(hf_config, "rope_parameters", None) or {}).get(layer_type)
    if params is None:
        raise ValueError(f"rope_parameters has no entry for {layer_type!r}")
    view = SimpleNamespace(
        rope_parameters=params, max_position_embeddings=hf_config.max_position_embeddings
    )
    return rope_config_from_hf(view)
