"""Mixtral: Mistral whose every MLP is a mixture of experts (top-k weights renormalized).

Checkpoints keep a layer's experts under `block_sparse_moe.experts.N.w1/w3/w2` (gate, up,
down) and its router under `block_sparse_moe.gate`; the model names them as the other MoE
decoders do (`mlp.gate`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
"""

from __future__ import annotations

from typing import Any

from aioinfer.model.llama import MistralForCausalLM


class MixtralForCausalLM(MistralForCausalLM):
    checkpoint_expert_names = ("block_sparse_moe", "w1", "w3", "w2")

    @classmethod
    def _moe_options(cls, hf_config: Any) -> dict[str, Any]:
        return {
            "num_experts": int(hf_config.num_local_experts),
            "experts_per_token": int(hf_config.num_experts_per_tok),
            "expert_intermediate_size": int(hf_config.intermediate_size),
            "sparse_layers": tuple(range(int(hf_config.num_hidden_layers))),
            "renormalize_routing": True,
        }
