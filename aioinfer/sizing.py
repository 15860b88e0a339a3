"""The sizing rules that `serve` lives by and `aioinfer plan` predicts: one copy, no torch.

The runner (gpu/runner.py, gpu/memory.py) applies them to the loaded model; the planner
(plan.py) applies them to a config alone, so both always print the same numbers.
"""

from __future__ import annotations

from typing import Any

GiB = 1 << 30
# GPUs at least this big get the large step budgets.
BIG_GPU_GIB = 70


def default_token_budget(device_type: str, total_bytes: int | None, offline: bool) -> int:
    """max_num_batched_tokens when the flag is unset. Big GPUs take 8192 tokens a step (16384
    offline); small GPUs and the CPU less, since a long prefill chunk delays every decode that
    shares its step."""
    if device_type == "cuda" and total_bytes is not None:
        if total_bytes / GiB >= BIG_GPU_GIB:
            return 16384 if offline else 8192
        return 8192 if offline else 2048
    return 4096 if offline else 512


def max_model_len(hf_config: Any, requested: int | None) -> int:
    """The flag, else the config's max_position_embeddings; never more than the model's."""
    derived = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
    if requested is None:
        return derived
    if requested > derived:
        raise ValueError(
            f"max_model_len ({requested}) is larger than the model's maximum length "
            f"(max_position_embeddings={derived})"
        )
    return requested


def kv_bytes_per_block(
    block_size: int, num_kv_heads: int, head_dim: int, num_layers: int, dtype_bytes: int
) -> int:
    """K and V of block_size tokens in every layer."""
    return 2 * block_size * num_kv_heads * head_dim * num_layers * dtype_bytes
