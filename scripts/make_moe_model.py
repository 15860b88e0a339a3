"""Write a small random-weight Qwen3-MoE checkpoint (safetensors, per-expert keys as transformers
saves them) with the bundled SmolLM2 tokenizer, for CPU benchmarks of the mixture-of-experts
path: 8 layers of hidden 512, 32 experts of which each token takes 4.

    .venv/bin/python scripts/make_moe_model.py /tmp/moe-bench
    .venv/bin/aioinfer bench throughput /tmp/moe-bench --vs transformers --num-prompts 32
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

from aioinfer.model.loader import bundled_gguf_path


def main(folder: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(
        str(bundled_gguf_path().parent), gguf_file=bundled_gguf_path().name
    )
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


if __name__ == "__main__":
    main(sys.argv[1])
