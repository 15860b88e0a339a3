"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama decoder whose checkpoints fuse q, k and v into
`self_attn.qkv_proj` and gate and up into `mlp.gate_up_proj`. The loader splits each fused
tensor into the model's own projections by rows (`checkpoint_splits`), so every path that
knows Llama's projections (the CPU kernels, fuse_gemms on a GPU) runs Phi-3 unchanged.

LongRoPE turns a request within the original context with its short factors and one past it
with its long factors (core/scheduler.py). Phi-4-mini rotates only the first 0.75 of each
head's dims (partial_rotary_factor).
"""

from __future__ import annotations

from typing import Any

from aioinfer.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    sliding_window_layers = "all"

    @classmethod
    def _arch_options(cls, hf_config: Any) -> dict[str, Any]:
        """Phi-4-mini rotates only the first partial_rotary_factor of each head's dims."""
        rope = getattr(hf_config, "rope_parameters", None) or {}
        partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1))
        options = super()._arch_options(hf_config)
        if partial not in (None, 1, 1.0):
            num_heads = int(hf_config.num_attention_heads)
            head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
            options["rotary_dim"] = int(head_dim * float(partial))  # transformers' rounding
            if options["rotary_dim"] % 2:
                raise ValueError(f"partial_rotary_factor {partial} leaves an odd rotary dim")
        return options

    def checkpoint_splits(self) -> dict[str, list[tuple[str, int, int]]]:
        """{fused checkpoint key: [(parameter, first row, rows), ...]} for every layer."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        splits: dict[str, list[tuple[str, int, int]]] = {}
        for i in range(cfg.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            splits[f"{attn}.qkv_proj.weight"] = [
                (f"{attn}.q_proj.weight", 0, q),
                (f"{attn}.k_proj.weight", q, kv),
                (f"{attn}.v_proj.weight", q + kv, kv),
            ]
            splits[f"{mlp}.gate_up_proj.weight"] = [
                (f"{mlp}.gate_proj.weight", 0, inter),
                (f"{mlp}.up_proj.weight", inter, inter),
            ]
        return splits
