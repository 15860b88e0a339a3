"""ModelRunner: loads the model, sizes and owns the KV cache, and runs one StepPlan at a time.

Everything here runs on the GPU thread (also when the device is the CPU).
"""

from __future__ import annotations

import array
import contextlib
import importlib.util
import logging
import os
import secrets
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

import aioinfer.sizing as sizing
from aioinfer.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    sampled_rows_per_request,
)
from aioinfer.core.lora import LoRARequest
from aioinfer.core.pooling import PoolerConfig
from aioinfer.core.spec_decode import draft_rows, verify
from aioinfer.core.step import ScheduledChunk, StepPlan, StepResult
from aioinfer.gpu import kv_cache
from aioinfer.gpu.compute_threads import ServingThreads
from aioinfer.gpu.cuda_graphs import CudaGraphRunner
from aioinfer.gpu.sampler import (
    PROMPT_LOGPROBS_ROWS,
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    prompt_logprobs_tensors,
)
from aioinfer.model.cpu.kv_prefault import KVPagePrefaulter
from aioinfer.model.forward_context import forward_context
from aioinfer.model.generation_config import (
    default_sampling,
    eos_token_ids,
    generation_config_in_use,
    model_generation_config,
)
from aioinfer.model.layers.attention import AttentionMetadata, to_device
from aioinfer.model.lora import LoRAManager, LoRAMapping

if TYPE_CHECKING:
    from pathlib import Path

    from aioinfer.model.cpu.kernels import NativeKernels

logger = logging.getLogger(__name__)

GiB = 1 << 30
# The most of the CPU cache faulted in ahead of use (see model/cpu/kv_prefault.py).
PREFAULT_MAX_BYTES = 1 << 30


@dataclass
class RunnerInfo:
    """The numbers the engine lives by; the startup log prints them."""

    served_name: str
    device: str
    dtype: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    attention_backend: str
    eos_token_ids: tuple[int, ...]
    default_sampling: dict[str, Any]
    weights_load_seconds: float
    model_load_seconds: float
    weights_gib: float
    available_kv_gib: float
    graph_capture_seconds: float | None = None
    graph_memory_gib: float | None = None
    graphs_off_reason: str | None = None
    # "native" when the CPU kernels replaced the model's linears, norms and activations.
    cpu_kernels: str = "torch"
    # Set when the model serves embeddings (--runner pooling) instead of generating text.
    pooler: PoolerConfig | None = None
    hidden_size: int = 0
    # A LongRoPE model's original context: longer requests take its long factors.
    longrope_original: int | None = None
    init_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_capacity_tokens(self) -> int:
        # Block 0 is the reserved null block.
        return (self.num_blocks - 1) * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.kv_capacity_tokens / self.max_model_len


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device (ModelRunner.launch), its outputs on their way to the host:
    ModelRunner.finish waits for them (`ready`) and reads them."""

    step_id: int
    chunks: list[ScheduledChunk]  # decodes first, as the forward ran them
    sampled: SamplerOutput | None  # None when no chunk samples
    # (request id, the prompt tokens they score, their logprobs) per window of rows.
    prompt_logprobs: list[tuple[str, tuple[int, ...], LogprobsTensors]]
    pooled: tuple[list[str], torch.Tensor] | None  # the owners and their float32 rows
    # Recorded after the copies to the host; None where the outputs are there already (CPU).
    ready: torch.cuda.Event | None


class ModelRunner:
    @staticmethod
    def resolve(model_config: ModelConfig) -> Any:
        from aioinfer.bundled import require_bundled_model
        from aioinfer.model.loader import resolve_model

        model = model_config.model or str(require_bundled_model())
        return resolve_model(model, model_config.revision, model_config.load_format)

    def __init__(
        self,
        resolved: Any,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        offline: bool = False,
    ) -> None:
        from aioinfer.model.loader import load_model, resolve_dtype
        from aioinfer.model.loader.resolve import model_pooler

        self.block_size = cache_config.block_size
        self.device = _resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        hf_config = resolved.hf_config
        self.hf_config = hf_config
        model_gen = model_generation_config(resolved)  # read before the weights load
        gen = generation_config_in_use(model_config.generation_config, model_gen)
        # Without a seed (vLLM's seed=None) the run is not reproducible: dummy weights and
        # unseeded sampling draw from fresh entropy.
        seed = model_config.seed if model_config.seed is not None else secrets.randbits(63)
        torch.manual_seed(seed)
        self.pooler = model_pooler(resolved, model_config.runner, model_config.pooler_overrides)
        if model_config.enable_lora and self.pooler is not None:  # before the weights load
            raise ValueError(
                "LoRA adapters serve text generation: --enable-lora needs a generating model"
            )
        # A config-only check: it must not wait for minutes of weight loading.
        self.max_model_len = sizing.max_model_len(hf_config, model_config.max_model_len)

        # What execute() reads besides the model, set before any forward (the memory profile
        # runs one): the KV cache is swapped in once sized, the graphs once captured.
        self.kv_caches: list[torch.Tensor] = []
        self.kv_prefaulter: KVPagePrefaulter | None = None
        self.serving_threads: ServingThreads | None = None  # see follow_free_cores
        self.graph_runner: CudaGraphRunner | None = None
        self.lora: LoRAManager | None = None
        self.memory_profile: kv_cache.MemoryProfile | None = None
        # The last launched step's sampled tokens (on the device) and each request's row there.
        self._previous: tuple[torch.Tensor, dict[str, int]] | None = None
        # Seconds of this thread's phases of the per-token path (engine/stats.HOST_PHASES);
        # launch includes prepare.
        self.host_seconds = {"prepare": 0.0, "launch": 0.0, "finish": 0.0}

        profiling = kv_cache.should_profile(self.device, cache_config)
        start_memory = kv_cache.start_memory(self.device) if profiling else None
        if start_memory is not None:  # before minutes of weight loading
            sizing.check_free_at_start(
                start_memory.free, start_memory.total, cache_config.gpu_memory_utilization
            )
        start = time.perf_counter()
        self.model = load_model(
            resolved, self.dtype, self.device, seed, pooling=self.pooler is not None
        )
        if model_config.enable_lora:
            # Before the CPU kernels: layers with LoRA linears then run module by module.
            self.lora = LoRAManager(
                self.model, model_config.max_loras, model_config.max_lora_rank, self.dtype
            )
        cpu_kernels = select_cpu_kernels(
            self.model,
            model_config.cpu_kernels,
            self.device,
            self.dtype,
            weight_format=model_config.cpu_weight_format,
            amx=model_config.cpu_amx,
            codes_entry=resolved.folder if resolved.converted_from is not None else None,
        )
        load_seconds = time.perf_counter() - start
        weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

        self.vocab_size = int(hf_config.vocab_size)
        longrope_original = sizing.longrope_original(hf_config)
        budget = scheduler_config.max_num_batched_tokens or kv_cache.default_token_budget(
            self.device, offline
        )
        self.max_num_seqs = scheduler_config.max_num_seqs or kv_cache.default_max_num_seqs(
            self.device
        )
        # With drafts a request samples a row per draft too (the memory profile counts them).
        self.sampled_rows_per_request = sampled_rows_per_request(scheduler_config)
        self.kv_layout = kv_cache.KVCacheLayout(
            num_layers=int(hf_config.num_hidden_layers),
            block_size=self.block_size,
            num_kv_heads=int(hf_config.num_key_value_heads),
            head_dim=int(
                getattr(hf_config, "head_dim", None)
                or hf_config.hidden_size // hf_config.num_attention_heads
            ),
            dtype=self.dtype,
            device=self.device,
        )
        self.sampler = Sampler(
            self.vocab_size,
            self.device,
            seed=seed,
            max_logprobs=model_config.max_logprobs,
            cpu_kernels=_native_kernels(cpu_kernels),
        )
        self.attn_backend = select_attention_backend(
            model_config.attention_backend,
            self.device,
            self.dtype,
            int(hf_config.num_attention_heads),
            self.kv_layout.num_kv_heads,
            self.kv_layout.head_dim,
        )
        self._specialise_for_cuda()
        graphs_off = graphs_off_reason(model_config, self.device, self.attn_backend, self.pooler)

        num_blocks, available_kv = self._size_kv_cache(
            cache_config, budget, weights_bytes, start_memory, graphs_off is None
        )
        self._fit_max_model_len(model_config, num_blocks, available_kv)
        self.kv_caches = self.kv_layout.allocate(num_blocks)
        if self.device.type == "cpu":
            self.kv_prefaulter = self._kv_prefaulter(budget)
        graph_seconds = graph_bytes = None
        if graphs_off is None:
            graph_seconds, graph_bytes, graphs_off = self._capture_graphs(
                longrope_original is not None
            )

        self.info = RunnerInfo(
            served_name=resolved.served_name,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=getattr(self.attn_backend, "name", "torch"),
            cpu_kernels=cpu_kernels,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            num_blocks=num_blocks,
            block_size=self.block_size,
            eos_token_ids=eos_token_ids(hf_config, model_gen, gen),
            default_sampling=default_sampling(gen, model_config),
            weights_load_seconds=load_seconds,
            model_load_seconds=time.perf_counter() - start,
            weights_gib=weights_bytes / GiB,
            available_kv_gib=available_kv / GiB,
            graph_capture_seconds=graph_seconds,
            graph_memory_gib=None if graph_bytes is None else graph_bytes / GiB,
            graphs_off_reason=graphs_off,
            pooler=self.pooler,
            hidden_size=int(hf_config.hidden_size),
            longrope_original=longrope_original,
        )
        if self.kv_prefaulter is not None:  # last: a failed start leaves no thread behind
            self.kv_prefaulter.start()
            # The thread holds the KV cache: a runner dropped without close() must end it.
            weakref.finalize(self, self.kv_prefaulter.stop, 0)

    # ----------------------------------------------------------------- start-up steps

    def _specialise_for_cuda(self) -> None:
        if self.device.type != "cuda":
            return
        if self.lora is None:
            # Merged projections, residual adds inside GEMMs: on a GPU a decode step's time
            # follows its kernel count. (The CPU's native layers have their own fusions; LoRA
            # adapts the projections one by one.)
            self.model.fuse_gemms()
        if getattr(self.attn_backend, "name", None) == "triton":
            from aioinfer.model.layers.triton_layers import use_triton_kernels

            swapped = use_triton_kernels(self.model, self.dtype, self.device)
            logger.info("triton kernels run %d RMSNorm, SiLU-and-mul and rotary modules", swapped)

    def _size_kv_cache(
        self,
        cache_config: CacheConfig,
        budget: int,
        weights_bytes: int,
        start_memory: kv_cache.StartMemory | None,
        graphs: bool,
    ) -> tuple[int, int]:
        """(num_blocks, KV bytes). A KV size given in blocks or bytes is not carved out of the
        utilization share; on CUDA the rest comes from the memory profile."""
        per_block = self.kv_layout.bytes_per_block
        if cache_config.num_gpu_blocks_override is not None:
            num_blocks = cache_config.num_gpu_blocks_override
            return num_blocks, num_blocks * per_block
        if cache_config.kv_cache_memory_bytes is not None:
            available = kv_cache.fixed_kv_bytes(cache_config.kv_cache_memory_bytes, self.device)
            return available // per_block, available
        if start_memory is None:
            available = int(cache_config.kv_cache_memory * GiB)
            return available // per_block, available
        params = None
        if self.pooler is None:
            params = kv_cache.profile_sampling_params(self.sampler.max_logprobs)
        step = kv_cache.profile_step(
            budget,
            self.max_num_seqs,
            self.block_size,
            params,
            self.sampled_rows_per_request,
            pooling=self.pooler.pooling_type if self.pooler is not None else None,
        )
        self.memory_profile = kv_cache.profile(
            self.execute_over,
            self.kv_layout,
            step,
            sizing.capture_sizes(self.max_num_seqs)[-1] if graphs else 0,
            cache_config.gpu_memory_utilization,
            weights_bytes,
            start_memory,
        )
        available = self.memory_profile.available_kv
        return available // per_block, available

    def execute_over(self, plan: StepPlan, caches: list[torch.Tensor]) -> StepResult:
        """execute(plan) over other KV caches (the memory profile's)."""
        saved, self.kv_caches = self.kv_caches, caches
        try:
            return self.execute(plan)
        finally:
            self.kv_caches = saved

    def _fit_max_model_len(self, model_config: ModelConfig, num_blocks: int, kv: int) -> None:
        capacity = sizing.kv_capacity_tokens(num_blocks, self.block_size)
        if model_config.max_model_len == sizing.AUTO_MAX_MODEL_LEN and capacity > 0:
            if capacity < self.max_model_len:
                logger.warning(
                    "max model len lowered from %d to %d tokens: what the KV cache holds",
                    self.max_model_len,
                    capacity,
                )
            self.max_model_len = min(self.max_model_len, capacity)
        too_small = sizing.kv_cache_too_small(self.max_model_len, num_blocks, self.block_size)
        if too_small is not None:
            raise ValueError(too_small)
        if self.device.type == "cpu":
            too_large = sizing.cpu_kv_cache_too_large(kv, sizing.host_memory_bytes())
            if too_large is not None:
                raise ValueError(too_large)

    def _kv_prefaulter(self, budget: int) -> KVPagePrefaulter:
        # Four steps' worth: a step takes at most its token budget of fresh blocks, and one
        # more for each running request that crosses into a new block.
        lookahead = 4 * (budget // self.block_size + self.max_num_seqs)
        lookahead = min(lookahead, max(1, PREFAULT_MAX_BYTES // self.kv_layout.bytes_per_block))
        return KVPagePrefaulter(self.kv_caches, lookahead)

    def _capture_graphs(self, long_rope: bool) -> tuple[float | None, int | None, str | None]:
        """Capture the decode graphs: (seconds, bytes, None); when capture fails the engine
        runs eagerly: (None, None, why)."""
        graphs = CudaGraphRunner(
            self.model,
            self.kv_caches,
            self.attn_backend,
            self.max_num_seqs,
            -(-self.max_model_len // self.block_size),
            self.max_model_len,
            self.device,
            long_rope=long_rope,
        )
        try:
            seconds, used = graphs.capture()
        except Exception as exc:  # an engine that runs eagerly beats one that does not start
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %r", exc)
            del graphs
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return None, None, f"capture failed: {exc!r}"[:300]
        self.graph_runner = graphs
        if self.memory_profile is not None:
            logger.info(
                "CUDA graphs took %.2f GiB (the memory profile set %.2f GiB aside)",
                used / GiB,
                self.memory_profile.graph_pool / GiB,
            )
        return seconds, used, None

    @property
    def graph_replays(self) -> int:
        """Decode steps that replayed a CUDA graph so far."""
        return 0 if self.graph_runner is None else self.graph_runner.replays

    def close(self) -> None:
        """Stop the background work that holds the KV cache (the page prefaulter)."""
        if self.kv_prefaulter is not None:
            self.kv_prefaulter.stop()

    def load_lora(self, request: LoRARequest) -> int:
        """The slot of a LoRA adapter, loaded on first use (on this thread, between steps)."""
        if self.lora is None:
            raise ValueError("LoRA adapters need --enable-lora")
        return self.lora.load(request)

    def unload_lora(self, name: str) -> None:
        assert self.lora is not None
        self.lora.unload(name)

    # ----------------------------------------------------------------- one step

    def follow_free_cores(self) -> None:
        """From now on, on the CPU, each step first matches the compute threads to the cores
        other processes leave free (gpu/compute_threads.py); called once the start is over."""
        if self.device.type == "cpu":
            self.serving_threads = ServingThreads()

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue the step's forward pass and sampling on the device. On CUDA nothing here waits
        for the device: inputs go up from pinned memory without blocking, and the sampling
        inputs (a grammar's mask among them) are built on the host while the forward runs. A
        chunk's `previous_token` is taken from the output of the step launched before."""
        if self.serving_threads is not None:
            self.serving_threads.before_step()
        start = time.perf_counter()
        tails = (c.block_table[-1] for c in plan.chunks if c.block_table)
        prefaulter = self.kv_prefaulter
        with prefaulter.step(max(tails, default=0)) if prefaulter else contextlib.nullcontext():
            launched = self._launch(plan)
        self.host_seconds["launch"] += time.perf_counter() - start
        return launched

    def _launch(self, plan: StepPlan) -> LaunchedStep:
        # Decodes first: the attention backend batches the leading one-token requests.
        chunks = sorted(plan.chunks, key=lambda c: c.num_tokens != 1)
        start = time.perf_counter()
        input_ids, positions, metadata = self.prepare_inputs(chunks)
        self.host_seconds["prepare"] += time.perf_counter() - start
        graphs = self.graph_runner
        if graphs is not None and metadata.decode_only and graphs.can_run(len(chunks)):
            hidden = graphs.replay(input_ids, positions, metadata)
        else:
            lora = None
            if self.lora is not None and any(c.lora_slot for c in chunks):
                lora = LoRAMapping.build([(c.lora_slot, c.num_tokens) for c in chunks], self.device)
            with forward_context(metadata, self.kv_caches, self.attn_backend, lora):
                hidden = self.model(input_ids, positions)
        sampled, last_rows = self._launch_sampling(chunks, hidden, metadata)
        self._previous = None if sampled is None else (sampled.token_ids, last_rows)
        prompt_logprobs = self._launch_prompt_logprobs(chunks, hidden, metadata)
        pooled = self._launch_pooling(chunks, hidden, metadata)
        # The outputs go to the host behind this step's work only: a later step launched
        # before finish() does not delay them.
        host = self._to_host
        ready = None
        if self.device.type == "cuda":
            sampled = None if sampled is None else sampled.map(host)
            prompt_logprobs = [(rid, t, part.map(host)) for rid, t, part in prompt_logprobs]
            pooled = None if pooled is None else (pooled[0], host(pooled[1]))
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedStep(plan.step_id, chunks, sampled, prompt_logprobs, pooled, ready)

    @staticmethod
    def _to_host(tensor: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of a device tensor, made without waiting (read after `ready`)."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def finish(self, step: LaunchedStep) -> StepResult:
        """A launched step's results, once on the host: this waits for the device."""
        start = time.perf_counter()
        result = self._finish(step)
        self.host_seconds["finish"] += time.perf_counter() - start
        return result

    def _finish(self, step: LaunchedStep) -> StepResult:
        if step.ready is not None:
            step.ready.synchronize()
        result = StepResult(step.step_id)
        if step.sampled is not None:
            self._sampled_to_host(step.chunks, step.sampled, result)
        for request_id, targets, part in step.prompt_logprobs:
            result.prompt_logprobs.setdefault(request_id, []).extend(part.to_host(targets))
        if step.pooled is not None:
            owners, rows = step.pooled
            result.pooled.update(zip(owners, rows.numpy(), strict=True))
        return result

    @property
    def launch_is_async(self) -> bool:
        """Whether launch() returns before the device has run the step (CUDA): the loop then
        launches the next step before it collects this one."""
        return self.device.type == "cuda"

    def prepare_inputs(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat token ids and positions of the whole step, and its attention metadata."""
        query_lens = [len(c.token_ids) for c in chunks]
        starts = [c.start_pos for c in chunks]
        token_ids = array.array("q")
        for chunk in chunks:
            token_ids.extend(chunk.token_ids)
        metadata = AttentionMetadata.build(
            query_lens, starts, [c.block_table for c in chunks], self.block_size, self.device
        )
        if any(c.long_rope for c in chunks):
            rows = torch.tensor([c.long_rope for c in chunks]).repeat_interleave(
                torch.tensor(query_lens)
            )
            metadata = replace(metadata, long_rope_rows=to_device(rows, self.device))
        input_ids = to_device(torch.frombuffer(token_ids, dtype=torch.long), self.device)
        if any(c.previous_token for c in chunks):
            self._take_previous_tokens(chunks, input_ids)
        return input_ids, metadata.positions, metadata

    def _take_previous_tokens(
        self, chunks: Sequence[ScheduledChunk], input_ids: torch.Tensor
    ) -> None:
        """Put in the tokens that the step launched before sampled, where chunks feed them
        (their last token), without bringing them to the host."""
        if self._previous is None:
            raise RuntimeError("a chunk feeds a previous token, but the last step sampled none")
        sampled, rows_of = self._previous
        at, rows, offset = [], [], 0
        for chunk in chunks:
            offset += chunk.num_tokens
            if chunk.previous_token:
                at.append(offset - 1)
                rows.append(rows_of[chunk.request_id])
        index = to_device(torch.tensor(at + rows, dtype=torch.long), self.device)
        input_ids.index_copy_(0, index[: len(at)], sampled.index_select(0, index[len(at) :]))

    def _launch_sampling(
        self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[SamplerOutput | None, dict[str, int]]:
        """The step's sampling, and the row of each request's last sampled token in it."""
        # One logits row per sampled position: a chunk's last, and with drafts each of theirs.
        qsl = metadata.query_start_loc_host
        rows: list[int] = []
        row_chunks: list[ScheduledChunk] = []
        last_rows: dict[str, int] = {}
        for i, chunk in enumerate(chunks):
            if chunk.sample:
                last = qsl[i + 1] - 1
                rows += range(last - len(chunk.draft_token_ids), last + 1)
                row_chunks += draft_rows(chunk)
                last_rows[chunk.request_id] = len(rows) - 1
        if not rows:
            return None, last_rows
        index = to_device(torch.tensor(rows, dtype=torch.long), self.device)
        batch = self.sampler.prepare(row_chunks)
        return self._sample_rows(hidden.index_select(0, index), batch), last_rows

    def _sampled_to_host(
        self, chunks: Sequence[ScheduledChunk], output: SamplerOutput, result: StepResult
    ) -> None:
        token_ids, logprobs = output.rows_to_host()
        row = 0
        for chunk in chunks:
            if not chunk.sample:
                continue
            width = len(chunk.draft_token_ids) + 1
            emitted = verify(chunk.draft_token_ids, token_ids[row : row + width])
            result.sampled_token_ids[chunk.request_id] = emitted
            if row in logprobs:
                result.logprobs[chunk.request_id] = [logprobs[row + j] for j in range(len(emitted))]
            row += width

    def _sample_rows(self, hidden: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample the rows of `hidden`; plain greedy rows without logprobs ask the model for
        their argmax first, which the CPU's LM head finds without every logit."""
        if not batch.needs_processing and batch.logprobs is None:
            greedy = getattr(self.model, "greedy_token_ids", None)
            token_ids = greedy(hidden) if greedy is not None else None
            if token_ids is not None:
                return SamplerOutput(token_ids=token_ids, logprobs=None)
        return self.sampler.sample(self.model.compute_logits(hidden), batch)

    def _launch_prompt_logprobs(
        self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> list[tuple[str, tuple[int, ...], LogprobsTensors]]:
        """The chunks' prompt logprobs, PROMPT_LOGPROBS_ROWS rows of logits at a time: a whole
        chunk's at once would be [chunk, V] (16384 x 151936 x 6 bytes = 15 GB for Qwen2.5)."""
        qsl = metadata.query_start_loc_host
        parts = []
        for i, chunk in enumerate(chunks):
            targets = chunk.prompt_logprob_targets
            if not targets:
                continue
            num_top = chunk.sampling_params.prompt_logprobs or 0
            for start in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
                window = targets[start : start + PROMPT_LOGPROBS_ROWS]
                first = qsl[i] + start
                logits = self.model.compute_logits(hidden[first : first + len(window)])
                part = prompt_logprobs_tensors(logits, window, num_top)
                parts.append((chunk.request_id, window, part))
        return parts

    def _launch_pooling(
        self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[list[str], torch.Tensor] | None:
        """Each pooling chunk's part (core/pooling.fold): the sum of its rows for MEAN, its last
        row for LAST, the prompt's first row for CLS; a classifier's last rows through its
        `score` head (logits); in float32."""
        qsl = metadata.query_start_loc_host
        parts: list[torch.Tensor] = []
        owners: list[str] = []
        for i, chunk in enumerate(chunks):
            if chunk.pooling is None:
                continue
            if chunk.pooling == "MEAN":
                parts.append(hidden[qsl[i] : qsl[i + 1]].float().sum(0))
            elif chunk.pooling == "LAST":
                parts.append(hidden[qsl[i + 1] - 1].float())
            elif chunk.start_pos == 0:  # CLS
                parts.append(hidden[qsl[i]].float())
            else:
                continue
            owners.append(chunk.request_id)
        if not parts:
            return None
        rows = torch.stack(parts)
        if self.model.score is not None:  # a classifier: all of its parts are LAST rows
            rows = self.model.score(rows.to(self.dtype)).float()
        return owners, rows


def select_attention_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> Any:
    """None selects the torch reference backend. `auto`: triton on CUDA (when installed), the
    native kernels on a CPU that builds them and for shapes they support, torch elsewhere.
    Imported lazily: a kernel module imported without TRITON_INTERPRET=1 stays compiled-only for
    the whole process."""
    has_triton = importlib.util.find_spec("triton") is not None
    if name in ("auto", "native") and device.type == "cpu":
        backend = _native_attention(num_heads, num_kv_heads, head_dim, dtype)
        if isinstance(backend, str):
            if name == "native":
                raise ValueError(f"attention_backend 'native' is unavailable: {backend}")
            logger.info("Native CPU attention unavailable (%s); using torch.", backend)
            return None
        return backend
    if name == "native":
        raise ValueError("attention_backend 'native' runs on the CPU only")
    if name == "auto":
        name = "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "torch":
        return None
    if not has_triton:
        raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 to run the "
            "kernels slowly on the CPU)"
        )
    from aioinfer.model.layers.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend()


def _native_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> Any:
    """The native CPU backend, or why it cannot serve this model."""
    from aioinfer.model.cpu import attention as native_attention
    from aioinfer.model.cpu import kernels as native

    if not native_attention.supports(num_heads, num_kv_heads, head_dim, dtype):
        return (
            f"needs float32 and a head_dim that is a multiple of 16 up to 256, got {dtype}, "
            f"{head_dim}"
        )
    kernels = native.load()
    if kernels is None:
        return native.unavailable_reason()
    return native_attention.NativeAttentionBackend(kernels)


def select_cpu_kernels(
    model: torch.nn.Module,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    weight_format: str = "auto",
    amx: bool = False,
    codes_entry: Path | None = None,
) -> str:
    """Swap the model's linears, norms and activations for the native CPU kernels when `name`
    allows it; returns what runs them. `auto`: native for float32 on the CPU when the kernels
    build, else torch. `weight_format`, `amx`: as use_native_kernels. `codes_entry`: the GGUF
    cache entry the weights came from, where the byte codes found are kept for the next start
    (model/cpu/codes_cache.py)."""
    if name == "torch":
        return "torch"
    if device.type != "cpu" or dtype != torch.float32:
        if name == "native":
            raise ValueError("cpu_kernels 'native' needs float32 on the CPU")
        return "torch"
    from aioinfer.model.cpu import codes_cache
    from aioinfer.model.cpu import kernels as native
    from aioinfer.model.cpu.layers import WeightCoder, use_native_kernels

    kernels = native.load()
    if kernels is None:
        reason = native.unavailable_reason()
        if name == "native":
            raise ValueError(f"cpu_kernels 'native' is unavailable: {reason}")
        logger.info("Native CPU kernels unavailable (%s); using torch ops.", reason)
        return "torch"
    kept = codes_cache.codes_file(codes_entry) if codes_entry is not None else None
    coder = WeightCoder(kernels, codes_cache.read_codes(kept) if kept is not None else None)
    use_native_kernels(model, kernels, weight_format=weight_format, amx=amx, coder=coder)
    if kept is not None and coder.found:
        codes_cache.write_codes(kept, {**coder.known, **coder.found})
    return "native"


def _native_kernels(cpu_kernels: str) -> NativeKernels | None:
    """The native CPU kernels when they run the model (the sampler uses them too), else None."""
    if cpu_kernels != "native":
        return None
    from aioinfer.model.cpu import kernels as native

    return native.load()


def graphs_off_reason(
    model_config: ModelConfig, device: torch.device, attn_backend: Any, pooler: Any
) -> str | None:
    """Why decode steps run eagerly, or None when CUDA graphs are captured."""
    return sizing.graphs_off_reason(
        enforce_eager=model_config.enforce_eager,
        pooling=pooler is not None,
        lora=model_config.enable_lora,
        device_type=device.type,
        attention_backend=getattr(attn_backend, "name", "torch"),
    )


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available")
    return torch.device(name)
