"""Qwen2: the Llama decoder with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from aioinfer.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    sliding_window_layers = "layer_types"

    @classmethod
    def _arch_options(cls, hf_config: Any) -> dict[str, Any]:
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False}
