"""The KV cache: how many blocks it gets, and the tensors that hold them.

On CUDA, vLLM's rule: the engine may use `requested = ceil(total * gpu_memory_utilization)`
bytes, which must be free when it starts (what other processes hold is outside its share, so
two servers at 0.45 each fit on one GPU). After the weights are loaded, a profiling pass shows
what the rest of the share must leave room for; the remainder becomes KV blocks:

    available_kv = requested - consumed since the start (the weights, cuBLAS, kernel modules)
                   - peak activations (one step at the full token budget, its sampler at
                     max_num_seqs rows with top-k, top-p, penalties and logprobs)
                   - the CUDA graphs' memory pool (one eager decode at the largest bucket)

On the CPU there is nothing to profile; the KV size is a flag (--kv-cache-memory, GiB).
--kv-cache-memory-bytes and --num-gpu-blocks-override set the size on either device, as
vLLM's: the share is not consulted.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

import aioinfer.sizing as sizing
from aioinfer.config import CacheConfig
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.step import ScheduledChunk, StepPlan
from aioinfer.model.layers.attention import kv_cache_shape

logger = logging.getLogger(__name__)

GiB = 1 << 30

# (plan, KV caches) -> runs the plan's step over those caches.
RunStep = Callable[[StepPlan, list[torch.Tensor]], object]


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


def should_profile(device: torch.device, cache_config: CacheConfig) -> bool:
    """Whether the KV size comes from a profiling pass: on CUDA, unless it is given in blocks
    or bytes. (A test swaps this to take the CUDA branch on the CPU.)"""
    return (
        device.type == "cuda"
        and cache_config.num_gpu_blocks_override is None
        and cache_config.kv_cache_memory_bytes is None
    )


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class KVCacheLayout:
    """One tensor per layer, [num_blocks, 2, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_block(self) -> int:
        return sizing.kv_bytes_per_block(
            self.block_size, self.num_kv_heads, self.head_dim, self.num_layers, self.dtype.itemsize
        )

    def allocate(self, num_blocks: int) -> list[torch.Tensor]:
        shape = kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.device.type == "cpu":
            return [lazy_zeros(shape, self.dtype) for _ in range(self.num_layers)]
        return [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages the kernel zero-fills on first touch (an anonymous mapping):
    `torch.zeros` writes every byte up front, seconds for a KV cache of a few GiB. The tensor
    keeps the mapping alive."""
    buffer = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


# ----------------------------------------------------------------------------- the profile


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


@dataclass(frozen=True)
class MemoryProfile:
    """What the profiling pass found, in bytes; the startup log prints it."""

    total: int
    utilization: float
    requested: int  # the engine's share
    free_at_start: int
    weights: int
    allocated_before: int  # all torch held before the pass: weights, buffers, workspaces
    consumed: int  # what the device lost since the start
    non_torch: int  # of which outside torch's allocator: cuBLAS, kernel modules
    activations: int  # the step's peak above the weights and its KV cache
    graph_pool: int  # the estimate for the CUDA graphs' pool (0 without graphs)

    @property
    def available_kv(self) -> int:
        return sizing.kv_bytes_left(
            self.requested, self.consumed, self.activations + self.graph_pool, self.utilization
        )

    def log(self) -> None:
        logger.info(
            "Memory profiling: total %.2f GiB x utilization %g = %.2f GiB (free at start %.2f "
            "GiB), weights %.2f GiB (all allocated %.2f GiB), peak activations %.2f GiB, CUDA "
            "graph pool %.2f GiB (estimated), non-torch %.2f GiB, consumed %.2f GiB",
            self.total / GiB, self.utilization, self.requested / GiB, self.free_at_start / GiB,
            self.weights / GiB, self.allocated_before / GiB, self.activations / GiB,
            self.graph_pool / GiB, self.non_torch / GiB, self.consumed / GiB,
        )  # fmt: skip


def profile_sampling_params(max_logprobs: int) -> SamplingParams:
    """What costs the sampler most memory per row: top-k and top-p sort the row, penalties
    build [rows, V + 1] counts, logprobs rank the whole row."""
    return SamplingParams(
        temperature=1.0,
        top_p=0.9,
        top_k=50,
        logprobs=max_logprobs,
        repetition_penalty=1.1,
        frequency_penalty=0.1,
        presence_penalty=0.1,
    )


def profile_step(
    num_tokens: int,
    max_num_seqs: int,
    block_size: int,
    params: SamplingParams | None,
    sampled_rows_per_request: int = 1,
    pooling: str | None = None,
    first_block: int = 1,
) -> StepPlan:
    """The heaviest step the engine admits: `num_tokens` prompt tokens spread over up to
    max_num_seqs requests, each sampling with `params` at its last token and, with speculative
    decoding, at each draft (its tail). A pooling model (`pooling` set) samples nothing.
    Blocks are numbered from `first_block` up."""
    num_reqs = max(1, min(max_num_seqs, num_tokens))
    per_req = num_tokens // num_reqs
    chunks, block = [], first_block
    for r in range(num_reqs):
        length = per_req + (num_tokens - per_req * num_reqs if r == num_reqs - 1 else 0)
        n = -(-length // block_size)
        table = tuple(range(block, block + n))
        block += n
        tokens = (0,) * length
        sample = pooling is None and params is not None
        drafts = (0,) * min(sampled_rows_per_request - 1, length - 1) if sample else ()
        chunks.append(
            ScheduledChunk(
                f"profile-{r}",
                tokens,
                0,
                table,
                sample,
                params or SamplingParams(),
                history=tokens if sample else None,
                prompt_len=length,
                draft_token_ids=drafts,
                pooling=pooling,
            )
        )
    return StepPlan(0, tuple(chunks))


def decode_step(batch_size: int, first_block: int = 1) -> StepPlan:
    """A decode step of `batch_size` one-token requests that sample nothing: the forward alone,
    as a CUDA graph of that bucket runs it."""
    chunks = tuple(
        ScheduledChunk(f"graph-{r}", (0,), 0, (first_block + r,), False, SamplingParams())
        for r in range(batch_size)
    )
    return StepPlan(0, chunks)


def blocks_for(plan: StepPlan) -> int:
    """Blocks a plan built above reaches, the null block 0 included."""
    return 1 + max(max(c.block_table) for c in plan.chunks)


def profile(
    run_step: RunStep,
    layout: KVCacheLayout,
    step: StepPlan,
    graph_batch_size: int,
    utilization: float,
    weights_bytes: int,
    start: StartMemory,
) -> MemoryProfile:
    """Run `step` (see profile_step) over a KV cache just large enough for it, then with CUDA
    graphs (`graph_batch_size` > 0) an eager decode at the largest bucket, and measure what
    the engine's share must leave beside its KV cache. `start` is the memory before the
    weights loaded."""
    device = layout.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    requested = sizing.requested_bytes(start.total, utilization)
    allocated_before = torch.cuda.memory_allocated(device)
    decode = decode_step(graph_batch_size) if graph_batch_size > 0 else None
    num_blocks = max(blocks_for(step), blocks_for(decode) if decode else 0)
    caches = layout.allocate(num_blocks)
    cache_bytes = sum(c.numel() * c.element_size() for c in caches)
    run_step(step, caches)
    torch.cuda.synchronize(device)
    activations = max(0, torch.cuda.max_memory_allocated(device) - allocated_before - cache_bytes)
    graph_pool = 0
    if decode is not None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run_step(decode, caches)
        torch.cuda.synchronize(device)
        graph_pool = max(0, torch.cuda.max_memory_allocated(device) - base)
    del caches
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info(device)
    # Everything the device lost since the start is this engine's (others are outside its
    # share); what torch did not reserve is cuBLAS, kernel modules and the like.
    consumed = max(0, start.free - free_after)
    non_torch = max(0, consumed - (torch.cuda.memory_reserved(device) - start.reserved))
    result = MemoryProfile(
        total=start.total,
        utilization=utilization,
        requested=requested,
        free_at_start=start.free,
        weights=weights_bytes,
        allocated_before=allocated_before,
        consumed=consumed,
        non_torch=non_torch,
        activations=activations,
        graph_pool=graph_pool,
    )
    result.log()
    return result


def fixed_kv_bytes(requested: int, device: torch.device) -> int:
    """--kv-cache-memory-bytes as the KV cache's size; on CUDA it must fit in the memory free
    now, after the weights (what a step's activations need comes on top of it)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        problem = sizing.fixed_kv_over_free(requested, free)
        if problem is not None:
            raise ValueError(problem)
    return requested
