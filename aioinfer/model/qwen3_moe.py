"""Qwen3-MoE: Qwen3 whose MLPs are mixture-of-experts blocks (all but `mlp_only_layers`)."""

from __future__ import annotations

from typing import Any

from aioinfer.model.qwen3 import Qwen3ForCausalLM


def qwen_moe_options(hf_config: Any) -> dict[str, Any]:
    """The MoE fields of DecoderConfig from a Qwen2-MoE or Qwen3-MoE config: a layer is sparse
    unless listed in `mlp_only_layers`, every `decoder_sparse_step`-th layer."""
    num_experts = int(getattr(hf_config, "num_experts", None) or 0)
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    sparse = tuple(
        i
        for i in range(int(hf_config.num_hidden_layers))
        if num_experts > 0 and i not in dense and (i + 1) % step == 0
    )
    return {
        "num_experts": num_experts,
        "experts_per_token": int(hf_config.num_experts_per_tok),
        "expert_intermediate_size": int(hf_config.moe_intermediate_size),
        "sparse_layers": sparse,
        "renormalize_routing": bool(getattr(hf_config, "norm_topk_prob", False)),
    }


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def _moe_options(cls, hf_config: Any) -> dict[str, Any]:
        return qwen_moe_options(hf_config)
