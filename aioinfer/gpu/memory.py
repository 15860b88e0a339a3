"""Memory profiling and KV-cache sizing.

On CUDA, vLLM's rule: the engine may use `requested = ceil(total * gpu_memory_utilization)`
bytes, which must be free when it starts (what other processes hold is outside its share, so
two servers at 0.45 each fit on one GPU). After the weights are loaded, one dummy forward pass
at the full token budget shows the peak activation memory; what is left of the share becomes
KV blocks:

    available_kv = requested - consumed since the start (the weights, cuBLAS, kernel modules)
                   - peak activations

On the CPU there is nothing to profile; the KV size is a flag (--kv-cache-memory, GiB).
--kv-cache-memory-bytes sets the size on either device, as vLLM's: the share is not consulted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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


def default_max_num_seqs(device: torch.device) -> int:
    """max_num_seqs (aioinfer.sizing's rule) for this device."""
    if device.type != "cuda":
        return sizing.default_max_num_seqs(device.type, None)
    props = torch.cuda.get_device_properties(device)
    return sizing.default_max_num_seqs(device.type, props.total_memory, props.name)


@dataclass(frozen=True)
class StartMemory:
    """The device's memory when the engine starts, before its weights load."""

    free: int
    total: int
    reserved: int  # by torch's allocator in this process


def start_memory(device: torch.device) -> StartMemory:
    """The CUDA device's memory now (this creates the CUDA context, which stays outside the
    engine's share, as in vLLM)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return StartMemory(int(free), int(total), torch.cuda.memory_reserved(device))


def fixed_kv_bytes(requested: int, device: torch.device) -> int:
    """--kv-cache-memory-bytes as the KV cache's size; on CUDA it must fit in the memory free
    now, after the weights (what a step's activations need comes on top of it)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        problem = sizing.fixed_kv_over_free(requested, free)
        if problem is not None:
            raise ValueError(problem)
    return requested


def profile_available_kv_bytes(
    runner: ModelRunner,
    num_tokens: int,
    utilization: float,
    weights_bytes: int,
    start: StartMemory,
) -> int:
    """Run one dummy forward of `num_tokens` tokens (and the sampler at max_num_seqs rows, times
    1 + the drafts each may check) and return the bytes left for the KV cache of the engine's
    share, which `start` (the memory before the weights loaded) must have had free."""
    from aioinfer.core.sampling_params import SamplingParams
    from aioinfer.core.step import ScheduledChunk, StepPlan

    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    requested = sizing.requested_bytes(start.total, utilization)
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
    # Everything the device lost since the start is this engine's (others are outside its
    # share); what torch did not reserve is cuBLAS, kernel modules and the like.
    consumed = max(0, start.free - free_after)
    non_torch = max(0, consumed - (torch.cuda.memory_reserved(device) - start.reserved))
    logger.info(
        "Memory profiling: total %.2f GiB x utilization %g = %.2f GiB (free at start %.2f GiB), "
        "weights %.2f GiB (all allocated %.2f GiB), peak activations %.2f GiB, non-torch "
        "%.2f GiB",
        start.total / GiB, utilization, requested / GiB, start.free / GiB, weights_bytes / GiB,
        allocated_before / GiB, activations / GiB, non_torch / GiB,
    )  # fmt: skip
    return sizing.kv_bytes_left(requested, consumed, activations, utilization)
