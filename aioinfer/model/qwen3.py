"""Qwen3: the Llama decoder with a per-head RMSNorm on queries and keys (head_dim from config)."""

from __future__ import annotations

from typing import Any

from aioinfer.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    sliding_window_layers = "layer_types"

    @classmethod
    def _arch_options(cls, hf_config: Any) -> dict[str, Any]:
        return {**super()._arch_options(hf_config), "qk_norm": True}
