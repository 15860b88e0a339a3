"""Qwen2-MoE: Qwen2 with mixture-of-experts blocks that add a gated shared expert."""

from __future__ import annotations

from typing import Any

from aioinfer.model.qwen2 import Qwen2ForCausalLM
from aioinfer.model.qwen3_moe import qwen_moe_options


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @classmethod
    def _arch_options(cls, hf_config: Any) -> dict[str, Any]:
        # Unlike Qwen2, its config says whether q/k/v have biases.
        qkv_bias = bool(getattr(hf_config, "qkv_bias", True))
        return {**super()._arch_options(hf_config), "qkv_bias": qkv_bias}

    @classmethod
    def _moe_options(cls, hf_config: Any) -> dict[str, Any]:
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
        return {
            **qwen_moe_options(hf_config),
            "shared_expert_intermediate_size": shared,
        }
