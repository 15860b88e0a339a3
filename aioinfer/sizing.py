"""The sizing rules that `serve` lives by and `aioinfer plan` predicts: one copy, no torch.

The runner (gpu/runner.py, gpu/kv_cache.py) applies them to the loaded model; the planner
(plan.py) applies them to a config alone, so both always print the same numbers.
"""

from __future__ import annotations

import contextlib
import math
import os
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


def default_max_num_seqs(
    device_type: str, total_bytes: int | None, device_name: str | None = None
) -> int:
    """max_num_seqs when the flag is unset, as vLLM's: 1024 on GPUs of BIG_GPU_GIB and more
    (A100s aside, which vLLM keeps at 256), else 256."""
    if device_type == "cuda" and total_bytes is not None and total_bytes / GiB >= BIG_GPU_GIB:
        return 256 if device_name is not None and "A100" in device_name else 1024
    return 256


def sliding_windows(hf_config: Any, layers: str | None) -> tuple[int, ...]:
    """Each layer's sliding window in tokens, 0 where it attends to the whole context, as the
    architecture's transformers class applies a config's `sliding_window`: `layers` "all" on
    every layer (Mistral, Mixtral, Phi-3), "layer_types" on those the config's `layer_types`
    names "sliding_attention" (Qwen from max_window_layers on, Gemma 2 and 3), None nowhere
    (Llama); never when Qwen's `use_sliding_window` is off."""
    num_layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    window = getattr(hf_config, "sliding_window", None)
    if layers is None or not window or getattr(hf_config, "use_sliding_window", None) is False:
        return (0,) * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layers == "all" or layer_types is None:
        return (int(window),) * num_layers
    return tuple(int(window) if kind == "sliding_attention" else 0 for kind in layer_types)


def longrope_original(hf_config: Any) -> int | None:
    """A LongRoPE model's original context (Phi-3), past which transformers switches to the
    long factors."""
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(hf_config, name, None)
        if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) == "longrope":
            original = rope.get("original_max_position_embeddings") or getattr(
                hf_config, "original_max_position_embeddings", None
            )
            return int(original) if original else None
    return None


# --max-model-len -1 (vLLM's "auto"): the model's own, lowered to what the KV cache holds.
AUTO_MAX_MODEL_LEN = -1


def max_model_len(hf_config: Any, requested: int | None) -> int:
    """The flag, else the config's max_position_embeddings; never more than the model's."""
    limit = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
    if requested is None or requested == AUTO_MAX_MODEL_LEN:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len ({requested}) is larger than the model's maximum length "
            f"(max_position_embeddings={limit})"
        )
    return requested


def kv_bytes_per_block(
    block_size: int, num_kv_heads: int, head_dim: int, num_layers: int, dtype_bytes: int
) -> int:
    """K and V of block_size tokens in every layer."""
    return 2 * block_size * num_kv_heads * head_dim * num_layers * dtype_bytes


def kv_capacity_tokens(num_blocks: int, block_size: int) -> int:
    """The tokens one request may hold in a KV cache of num_blocks (block 0 is the null
    block)."""
    return max(num_blocks - 1, 0) * block_size


def kv_cache_too_small(max_model_len: int, num_blocks: int, block_size: int) -> str | None:
    """Why a KV cache of num_blocks cannot serve one request of max_model_len tokens (block 0
    is the null block), naming the longest that fits; None when it can."""
    capacity = kv_capacity_tokens(num_blocks, block_size)
    if num_blocks >= 2 and capacity >= max_model_len:
        return None
    blocks = f"{num_blocks} block" + ("" if num_blocks == 1 else "s")
    advice = "Increase --gpu-memory-utilization or --kv-cache-memory"
    if capacity > 0:
        advice += f", or decrease --max-model-len to at most {capacity}"
    return (
        f"The model's max model len ({max_model_len}) is larger than the KV cache can hold "
        f"({capacity} tokens in {blocks}). {advice}."
    )


# A container's memory limit: cgroup v2, then v1 (which writes "no limit" as a huge number).
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes(limit_files: tuple[str, ...] = CGROUP_MEMORY_LIMITS) -> int | None:
    """The memory this process may use: the machine's, or its container's limit where lower;
    None where neither is known."""
    sizes = []
    with contextlib.suppress(AttributeError, ValueError, OSError):  # no sysconf names here
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for name in limit_files:
        try:
            with open(name, encoding="ascii") as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        if text.isdigit():  # v2 writes "max" for no limit
            sizes.append(int(text))
    return min(sizes) if sizes else None


def cpu_kv_cache_too_large(kv_bytes: int, host_bytes: int | None) -> str | None:
    """Why a CPU KV cache of kv_bytes cannot be had on a machine of host_bytes; None when it
    fits (the memory is reserved, not touched, so only more than the machine holds fails)."""
    if host_bytes is None or kv_bytes <= host_bytes:
        return None
    return (
        f"The KV cache ({kv_bytes / GiB:.2f} GiB) is larger than the memory this process may use "
        f"({host_bytes / GiB:.2f} GiB: the machine's, or its container's limit). Lower "
        "--kv-cache-memory (or --kv-cache-memory-bytes)."
    )


# ----------------------------------------------------------------------------- GPU memory
# vLLM's rule: the engine's share of the device, ceil(total x gpu_memory_utilization), must be
# free when it starts; what other processes hold is outside it, so two servers at 0.45 each
# fit on one GPU. The KV cache gets what the weights, activations and the rest leave of it.


def fixed_kv_over_free(requested: int, free: int) -> str | None:
    """Why --kv-cache-memory-bytes cannot be had with `free` bytes left after the weights;
    None when it fits."""
    if requested <= free:
        return None
    return (
        f"kv_cache_memory_bytes asks for {requested / GiB:.2f} GiB, but {free / GiB:.2f} GiB of "
        "GPU memory is free once the weights are loaded; lower it"
    )


def requested_bytes(total: int, utilization: float) -> int:
    """The engine's share of the device: weights, activations, KV cache and CUDA graphs."""
    return math.ceil(total * utilization)


def short_of_free_memory(free: int, total: int, utilization: float) -> str | None:
    """Why the engine may not start with `free` bytes free (vLLM's check and wording: its KV
    cache would otherwise be sized into memory others hold); None when the share is free."""
    requested = requested_bytes(total, utilization)
    if free >= requested:
        return None
    return (
        f"Free memory on device ({free / GiB:.2f}/{total / GiB:.2f} GiB) on startup is less "
        f"than desired GPU memory utilization ({utilization}, {requested / GiB:.2f} GiB). "
        f"Decrease GPU memory utilization (--gpu-memory-utilization) or reduce GPU memory used "
        f"by other processes."
    )


def check_free_at_start(free: int, total: int, utilization: float) -> None:
    problem = short_of_free_memory(free, total, utilization)
    if problem is not None:
        raise ValueError(problem)


def kv_bytes_left(requested: int, consumed: int, activations: int, utilization: float) -> int:
    """What the KV cache gets of the engine's share; a ValueError when nothing is left."""
    available = requested - consumed - activations
    if available <= 0:
        raise ValueError(
            f"No memory is left for the KV cache: the share of gpu_memory_utilization "
            f"{utilization} ({requested / GiB:.2f} GiB) minus what the engine holds "
            f"({consumed / GiB:.2f} GiB: weights and the rest) and its peak activations "
            f"({activations / GiB:.2f} GiB) is {available / GiB:.2f} GiB. Increase "
            f"--gpu-memory-utilization or lower --max-num-batched-tokens."
        )
    return available


# ----------------------------------------------------------------------------- CUDA graphs
# Decode steps replay a graph captured per batch-size bucket (gpu/cuda_graphs.py); the buckets'
# shared memory pool comes out of the engine's share.

MAX_GRAPH_BATCH = 512  # vLLM's largest by default: beyond it launches weigh little


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs or MAX_GRAPH_BATCH (ascending)."""
    largest = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s <= largest]
    sizes += range(16, largest + 1, 8)
    return sizes


def graphs_off_reason(
    *, enforce_eager: bool, pooling: bool, lora: bool, device_type: str, attention_backend: str
) -> str | None:
    """Why decode steps run eagerly, or None when CUDA graphs are captured."""
    if enforce_eager:
        return "enforce_eager is set"
    if pooling:
        return "a pooling model runs no decode steps"
    if lora:
        return "LoRA adapters run eagerly"
    if device_type != "cuda":
        return "CUDA graphs need a CUDA device"
    if attention_backend != "triton":
        return "the torch attention backend sizes its work on the host"
    return None
