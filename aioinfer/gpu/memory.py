"""Memory profiling and KV-cache sizing.

On CUDA: after the weights are loaded, one dummy forward pass at the full token budget shows the
peak activation memory; what is left of `total * gpu_memory_utilization` becomes KV blocks:

    available_kv = total * utilization - allocated before (the weights) - peak activations
                   - non-torch memory

On the CPU there is nothing to profile; the KV size is a flag (--kv-cache-memory, GiB).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from aioinfer import sizing

if TYPE_CHECKING:
    from aioinfer.gpu.runner import ModelRunner

logger = logging.getLogger(__name__)

GiB = 1 << 30


def default_token_budget(device: torch.device, offline: bool) -> int:
    """The step budget (aioinfer.sizing's rule) for this device and its memory."""
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return sizing.default_token_budget(device.type, total, offline)


def device_memory_used(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def profile_available_kv_bytes(
    runner: ModelRunner, num_tokens: int, utilization: float, weights_bytes: int
) -> int:
    """Run one dummy forward of `num_tokens` tokens (and the sampler at max_num_seqs rows, times
    1 + the drafts each may check) and return the bytes left for the KV cache."""
    from aioinfer.core.sampling_params import SamplingParams
    from aioinfer.core.step import ScheduledChunk, StepPlan

    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    _, total = torch.cuda.mem_get_info(device)
    # The weights, and whatever else this process holds on the device.
    allocated_before = torch.cuda.memory_allocated(device)
    block_size = runner.block_size
    num_blocks = -(-num_tokens // block_size) + 1
    saved_caches = getattr(runner, "kv_caches", None)
    runner.kv_caches = runner._allocate_kv_cache(num_blocks)
    cache_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    # Prompts of at most max_model_len tokens, spread over up to max_num_seqs requests.
    num_reqs = max(1, min(runner.max_num_seqs, num_tokens))
    per_req = num_tokens // num_reqs
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
    chunks, block = [], 1
    for r in range(num_reqs):
        length = per_req + (num_tokens - per_req * num_reqs if r == num_reqs - 1 else 0)
        n = -(-length // block_size)
        table = tuple(range(block, block + n))
        block += n
        # The chunk's tail as drafts: one sampled row per draft position. A pooling model
        # samples nothing (and has no LM head): its chunks pool instead.
        drafts = (0,) * min(runner.sampled_rows_per_request - 1, length - 1)
        pooler = runner.pooler
        chunks.append(
            ScheduledChunk(
                f"profile-{r}",
                (0,) * length,
                0,
                table,
                pooler is None,
                params,
                draft_token_ids=drafts if pooler is None else (),
                pooling=pooler.pooling_type if pooler is not None else None,
            )
        )
    runner.execute(StepPlan(0, tuple(chunks)))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    runner.kv_caches = saved_caches  # type: ignore[assignment]
    del saved_caches
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info(device)
    activations = max(0, peak - allocated_before - cache_bytes)
    non_torch = max(0, (total - free_after) - torch.cuda.memory_reserved(device))
    available = int(total * utilization - allocated_before - activations - non_torch)
    logger.info(
        "Memory profiling: total %.2f GiB, weights %.2f GiB (all allocated %.2f GiB), peak "
        "activations %.2f GiB, non-torch %.2f GiB",
        total / GiB, weights_bytes / GiB, allocated_before / GiB, activations / GiB,
        non_torch / GiB,
    )  # fmt: skip
    if available <= 0:
        raise ValueError(
            f"No memory is left for the KV cache: {total / GiB:.1f} GiB x utilization "
            f"{utilization} minus weights and activations is {available / GiB:.2f} GiB. "
            f"Increase --gpu-memory-utilization or lower --max-num-batched-tokens."
        )
    return available
