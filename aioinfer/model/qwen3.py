"""Qwen3: the Llama decoder with a per-head RMSNorm on queries and keys (head_dim from config)."""

from __future__ import annotations

from typing import Any

from aioinfer.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def _arch_options(cls, hf_config: Any) -> dict[str, Any]:
        return {**super()._arch_options(hf_config), "qk_norm": True}

    @classmethod
    def _check_supported(cls, hf_config: Any) -> None:
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported")
