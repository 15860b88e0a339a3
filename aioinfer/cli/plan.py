"""`aioinfer plan MODEL`: what `aioinfer serve MODEL` would print about memory, without weights.

Only the model's config is read (a hub id fetches config and tokenizer files, never weights; a
.gguf file is read for its metadata). From it and the same flags `serve` takes, the plan computes
the numbers of the startup log:

    weights      = parameters x dtype bytes                (tied embeddings counted once)
                   + 1.25 bytes per GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K linear weight on
                     the CPU (the exact byte codes of --cpu-weight-format auto; coded: - 4 bytes
                     too, and in auto on a CPU with AMX, where the 4- and 5-bit types' weight
                     parts add 4 bytes a weight and 4 a run of 32)
    CPU:  available KV = --kv-cache-memory GiB
    CUDA: available KV = total x --gpu-memory-utilization - weights - peak activations
                         - CUDA graph pool - non-torch
    bytes per block    = 2 (K and V) x block_size x kv_heads x head_dim x layers x dtype bytes
    num_blocks         = available KV // bytes per block    (block 0 is reserved)
    KV cache size      = (num_blocks - 1) x block_size tokens
    max concurrency    = KV cache size / max_model_len

On the CPU every number is exact. On CUDA the server measures the activation peak of one dummy
forward pass at the full token budget; the plan estimates it from the tensors that are alive at
the three candidate peaks of that pass (see `estimate_activation_bytes`), and the non-torch memory
the engine adds (cuBLAS, kernel modules) is measured on the local GPU or taken as
`DEFAULT_NON_TORCH_GIB`. On the local GPU, the share `gpu_memory_utilization` asks for must be
free, as `serve` checks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig, sampled_rows_per_request
from aioinfer.sizing import (
    AUTO_MAX_MODEL_LEN,
    GiB,
    capture_sizes,
    cpu_kv_cache_too_large,
    default_max_num_seqs,
    default_token_budget,
    fixed_kv_over_free,
    graphs_off_reason,
    host_memory_bytes,
    kv_bytes_per_block,
    kv_cache_too_small,
    kv_capacity_tokens,
    max_model_len,
    requested_bytes,
    short_of_free_memory,
)

if TYPE_CHECKING:
    from aioinfer.model.llama import DecoderConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# cuBLAS workspaces, kernel modules and the like, which the engine adds outside torch's allocator
# after it starts (its CUDA context, created before, is outside its share, as other processes
# are): a margin, used when the plan is for a GPU that is not the local one.
DEFAULT_NON_TORCH_GIB = 0.5
# The sampler's widest moment in the profiling pass (top-k and top-p rows): five float32 [R, V]
# buffers (the logits, their working copy, the sorted copy, its softmax and the mass before each
# token), the bool mask of the kept tokens and its int64 sum.
SAMPLER_BYTES_PER_LOGIT = 5 * 4 + 1 + 8
# The split decode kernel's splits on CUDA (model/kernels/paged_decode.py).
DECODE_SPLITS = 16
# The cuBLAS workspace, allocated through torch by the first matmul of the profiling pass.
CUDA_WORKSPACE_BYTES = 64 << 20


@dataclass(frozen=True)
class MemoryPlan:
    """The numbers `serve` would log, as predicted from the config."""

    served_name: str
    device: str
    dtype: str
    num_parameters: int
    weights_bytes: int
    available_kv_bytes: int
    bytes_per_block: int
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # CUDA only (None on the CPU or with --num-gpu-blocks-override).
    total_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    activation_bytes: int | None = None
    graph_pool_bytes: int = 0  # the CUDA graphs' pool, set aside in the share
    non_torch_bytes: int | None = None
    non_torch_measured: bool = False
    free_bytes: int | None = None  # the local GPU's, with this process's CUDA context
    fixed_kv: bool = False  # --kv-cache-memory-bytes: no share of the GPU is computed

    @property
    def weights_gib(self) -> float:
        return self.weights_bytes / GiB

    @property
    def available_kv_gib(self) -> float:
        return self.available_kv_bytes / GiB

    @property
    def kv_capacity_tokens(self) -> int:
        return max(self.num_blocks - 1, 0) * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.kv_capacity_tokens / self.max_model_len

    @property
    def problem(self) -> str | None:
        """Why `serve` would refuse to start with these settings; None when it would start."""
        if self.fixed_kv and self.total_bytes is not None:
            free = self.total_bytes if self.free_bytes is None else self.free_bytes
            left = free - self.weights_bytes - (self.non_torch_bytes or 0)
            over = fixed_kv_over_free(self.available_kv_bytes, left)
            if over is not None:
                return over
        elif self.free_bytes is not None and self.total_bytes is not None:
            short = short_of_free_memory(
                self.free_bytes, self.total_bytes, self.gpu_memory_utilization or 0.0
            )
            if short is not None:
                return short
        if self.available_kv_bytes <= 0:
            return f"No memory is left for the KV cache: {self.available_kv_gib:.2f} GiB. " + (
                self._no_room_advice()
            )
        if self.device == "cpu":
            too_large = cpu_kv_cache_too_large(self.available_kv_bytes, host_memory_bytes())
            if too_large is not None:
                return too_large
        return kv_cache_too_small(self.max_model_len, self.num_blocks, self.block_size)

    def _no_room_advice(self) -> str:
        """What could leave the KV cache room: not the step budget when the model alone
        fills the engine's share."""
        if self.total_bytes is not None and self.gpu_memory_utilization is not None:
            share = requested_bytes(self.total_bytes, self.gpu_memory_utilization)
            held = self.weights_bytes + (self.non_torch_bytes or 0)
            if held >= share:
                return (
                    f"The model alone takes {held / GiB:.2f} GiB, the engine's whole share of "
                    f"this GPU ({share / GiB:.2f} of {self.total_bytes / GiB:.2f} GiB): a "
                    "smaller model, a larger GPU or a higher --gpu-memory-utilization."
                )
        return "Increase --gpu-memory-utilization or lower --max-num-batched-tokens."

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in (
            "weights_gib",
            "available_kv_gib",
            "kv_capacity_tokens",
            "max_concurrency",
            "problem",
        ):
            out[name] = getattr(self, name)
        return out


# ----------------------------------------------------------------------------- the formulas


def count_parameters(cfg: DecoderConfig, lm_head: bool = True) -> int:
    """Parameters of the decoder `cfg` describes; a tied LM head shares the embedding, and a
    pooling model (`lm_head` False) loads none."""
    h, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = h * (q + 2 * kv) + q * h
    attention += (q + 2 * kv) * cfg.qkv_bias + h * cfg.o_bias
    attention += 2 * cfg.head_dim * cfg.qk_norm
    dense_mlp = 3 * h * inter + (2 * inter + h) * cfg.mlp_bias
    # A sparse layer: the router, the experts, and Qwen2-MoE's gated shared expert.
    shared = cfg.shared_expert_intermediate_size
    sparse_mlp = cfg.num_experts * (h + 3 * h * cfg.expert_intermediate_size)
    sparse_mlp += (3 * h * shared + (2 * shared + h) * cfg.mlp_bias + h) if shared else 0
    num_sparse = len(cfg.sparse_layers)
    mlps = (cfg.num_layers - num_sparse) * dense_mlp + num_sparse * sparse_mlp
    per_layer = attention + cfg.norms_per_layer * h
    head = 0 if cfg.tie_word_embeddings or not lm_head else v * h
    return v * h + cfg.num_layers * per_layer + mlps + h + head


def estimate_activation_bytes(
    cfg: DecoderConfig,
    num_tokens: int,
    num_seqs: int,
    dtype_bytes: int,
    device: str = "cuda",
    rows_per_request: int = 1,
) -> int:
    # rows_per_request 0: a pooling model, which samples nothing.
    """The peak the server's profiling pass allocates beyond weights and KV cache, estimated.

    The pass feeds `num_tokens` tokens (T) split evenly over R = min(num_seqs, T) requests of
    S = T / R tokens, and samples one row per request with top-k and top-p (1 + the drafts
    with speculative decoding: up to min(T, R x rows_per_request) rows in all). The peak is the
    largest of three moments (b = dtype bytes; "hidden" counts the layer's input, which the
    model's layer loop still holds, the new residual and the normed input):

        MLP:        3 hidden + gate + up                     T x (3 hidden + 2 inter) x b
        experts:    3 hidden + each of the T x top_k rows'
                    gate/up and output (the GPU kernels)     T x (3 hidden
                                                             + top_k (2 inter_e + hidden)) x b
        attention:  2 hidden + q, k, v, their rotated copies
                    and the output, plus one request's
                    gathered K/V (the torch backend)         T x (2 hidden + 3 q + 3 kv) x b
                                                             + 4 x S x kv x b
        sampling:   the final hidden states + R x V float32
                    buffers, SAMPLER_BYTES_PER_LOGIT each    T x hidden x b + R x V x 29

    On CUDA, CUDA_WORKSPACE_BYTES is added for the cuBLAS workspace the first matmul allocates.
    Small tensors (positions, block tables, rotary tables, sampling parameters) are left out.

    Accuracy, against torch's memory profiler on the same pass on the CPU: within 2% where the
    sampler or the attention block peaks, and within 10% where the MLP peaks in bfloat16 (the
    CPU's matmul keeps a float32 scratch buffer). On CUDA the sampler's sort may take scratch
    space of its own; at 256 rows and a 150k vocabulary each byte per logit is 37 MiB.
    """
    t, h, b = num_tokens, cfg.hidden_size, dtype_bytes
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    requests = max(1, min(num_seqs, num_tokens))
    per_request = -(-num_tokens // requests)
    rows = min(num_tokens, requests * min(rows_per_request, per_request))
    mlp = t * (3 * h + 2 * cfg.intermediate_size) * b
    if cfg.sparse_layers:
        per_token = cfg.experts_per_token * (2 * cfg.expert_intermediate_size + h)
        mlp = max(mlp, t * (3 * h + per_token) * b)
    attention = t * (2 * h + 3 * q + 3 * kv) * b + 4 * per_request * kv * b
    sampling = t * h * b + rows * cfg.vocab_size * SAMPLER_BYTES_PER_LOGIT
    workspace = CUDA_WORKSPACE_BYTES if device == "cuda" else 0
    return max(mlp, attention, sampling) + workspace


def estimate_graph_pool_bytes(cfg: DecoderConfig, batch: int, dtype_bytes: int) -> int:
    """The CUDA graphs' memory pool, estimated as the server's profile measures it: the peak of
    one eager decode forward at the largest bucket (`batch` rows, no sampling). Its moments are
    those of estimate_activation_bytes at T = `batch`, the attention's with the split decode
    kernel's float32 partial outputs (16 splits of each head's D + 1 values) instead of the
    gathered K/V."""
    t, h, b = batch, cfg.hidden_size, dtype_bytes
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = t * (3 * h + 2 * cfg.intermediate_size) * b
    if cfg.sparse_layers:
        per_token = cfg.experts_per_token * (2 * cfg.expert_intermediate_size + h)
        mlp = max(mlp, t * (3 * h + per_token) * b)
    splits = t * cfg.num_heads * DECODE_SPLITS * (cfg.head_dim + 1) * 4
    attention = t * (2 * h + 3 * q + 3 * kv) * b + splits
    return max(mlp, attention)


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class GpuTarget:
    """The GPU to plan for: its total memory, the memory the engine would add outside torch's
    allocator, and for the local GPU what is free now (a GPU planned by size is assumed free)."""

    total_bytes: int
    non_torch_bytes: int
    measured: bool
    free_bytes: int | None = None
    name: str | None = None  # the local GPU's (an A100 keeps vLLM's smaller max_num_seqs)


def make_plan(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    gpu_memory_gib: float | None = None,
    non_torch_gib: float | None = None,
) -> MemoryPlan:
    """Predict `serve`'s memory numbers. Raises ValueError for settings `serve` would reject.

    The device follows `model_config.device`: "cpu" plans for the CPU; otherwise
    `gpu_memory_gib` plans for a GPU of that size, and without it the local GPU is used if
    there is one (its total and its measured non-torch memory), else the CPU.
    """
    gpu = _gpu_target(model_config.device, gpu_memory_gib, non_torch_gib)
    device = "cpu" if gpu is None else "cuda"
    dtype = _dtype_name(model_config.dtype, device)
    resolved = _resolve(model_config)
    cfg = _decoder_config(resolved.hf_config)
    from aioinfer.model.loader.resolve import model_pooler

    pooler = model_pooler(resolved, model_config.runner, model_config.pooler_overrides)
    pooling = pooler is not None
    dtype_bytes = DTYPE_BYTES[dtype]
    num_params = count_parameters(cfg, lm_head=not pooling)
    if pooler is not None and pooler.classifies:
        num_params += len(pooler.labels) * cfg.hidden_size  # the `score` head
    weights = num_params * dtype_bytes
    if device == "cpu" and dtype == "float32" and model_config.cpu_kernels != "torch":
        weights += coded_weight_bytes(
            resolved, model_config.cpu_weight_format, amx=model_config.cpu_amx
        )
    max_len = max_model_len(resolved.hf_config, model_config.max_model_len)
    budget = scheduler_config.max_num_batched_tokens or default_token_budget(
        device, gpu.total_bytes if gpu else None, offline=False
    )
    max_num_seqs = scheduler_config.max_num_seqs or default_max_num_seqs(
        device, gpu.total_bytes if gpu else None, gpu.name if gpu else None
    )
    per_block = kv_bytes_per_block(
        cache_config.block_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, dtype_bytes
    )
    activations = None
    graph_pool = 0
    if cache_config.num_gpu_blocks_override is not None:
        num_blocks = cache_config.num_gpu_blocks_override
        available = num_blocks * per_block
    elif cache_config.kv_cache_memory_bytes is not None:
        available = cache_config.kv_cache_memory_bytes
        num_blocks = available // per_block
    elif gpu is not None:
        activations = estimate_activation_bytes(
            cfg,
            budget,
            max_num_seqs,
            dtype_bytes,
            device,
            rows_per_request=0 if pooling else sampled_rows_per_request(scheduler_config),
        )
        graphs_off = graphs_off_reason(
            enforce_eager=model_config.enforce_eager,
            pooling=pooling,
            lora=model_config.enable_lora,
            device_type="cuda",
            attention_backend="torch" if model_config.attention_backend == "torch" else "triton",
        )
        if graphs_off is None:
            graph_pool = estimate_graph_pool_bytes(
                cfg, capture_sizes(max_num_seqs)[-1], dtype_bytes
            )
        requested = requested_bytes(gpu.total_bytes, cache_config.gpu_memory_utilization)
        available = requested - weights - activations - graph_pool - gpu.non_torch_bytes
        num_blocks = max(available, 0) // per_block
    else:
        available = int(cache_config.kv_cache_memory * GiB)
        num_blocks = available // per_block
    capacity = kv_capacity_tokens(num_blocks, cache_config.block_size)
    if model_config.max_model_len == AUTO_MAX_MODEL_LEN and capacity > 0:
        max_len = min(max_len, capacity)  # as the runner lowers it
    return MemoryPlan(
        served_name=(model_config.served_model_name or (resolved.served_name,))[0],
        device=device,
        dtype=dtype,
        num_parameters=num_params,
        weights_bytes=weights,
        available_kv_bytes=available,
        bytes_per_block=per_block,
        num_blocks=num_blocks,
        block_size=cache_config.block_size,
        max_model_len=max_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        total_bytes=gpu.total_bytes if gpu else None,
        gpu_memory_utilization=cache_config.gpu_memory_utilization if gpu else None,
        activation_bytes=activations,
        graph_pool_bytes=graph_pool,
        non_torch_bytes=gpu.non_torch_bytes if gpu else None,
        non_torch_measured=bool(gpu and gpu.measured),
        free_bytes=gpu.free_bytes if gpu else None,
        fixed_kv=cache_config.kv_cache_memory_bytes is not None,
    )


def _gpu_target(
    device: str, gpu_memory_gib: float | None, non_torch_gib: float | None
) -> GpuTarget | None:
    if gpu_memory_gib is not None and gpu_memory_gib <= 0:
        raise ValueError(f"gpu_memory must be > 0 GiB, got {gpu_memory_gib}")
    if non_torch_gib is not None and non_torch_gib < 0:
        raise ValueError(f"non_torch_memory must be >= 0 GiB, got {non_torch_gib}")
    if device == "cpu":
        if gpu_memory_gib is not None:
            raise ValueError("gpu_memory plans for a GPU; it does not fit device 'cpu'")
        return None
    if gpu_memory_gib is not None:
        non_torch = DEFAULT_NON_TORCH_GIB if non_torch_gib is None else non_torch_gib
        return GpuTarget(int(gpu_memory_gib * GiB), int(non_torch * GiB), measured=False)
    local = _local_gpu()
    if local is None:
        if device == "cuda":
            raise ValueError("device is 'cuda' but no CUDA device is available: pass gpu_memory")
        return None
    if non_torch_gib is not None:
        return dataclasses.replace(local, non_torch_bytes=int(non_torch_gib * GiB), measured=False)
    return local


def _local_gpu() -> GpuTarget | None:
    """The local GPU's total and free memory once this process's CUDA context exists (as the
    server's start sees them), and what loading cuBLAS then adds outside torch, as the server's
    first forward pass would."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda")
    free_at_start, total = torch.cuda.mem_get_info(device)  # creates the context
    a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    del a
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    non_torch = max(0, (free_at_start - free) - torch.cuda.memory_reserved(device))
    return GpuTarget(
        int(total),
        int(non_torch),
        measured=True,
        free_bytes=int(free_at_start),
        name=torch.cuda.get_device_name(device),
    )


def coded_weight_bytes(resolved: Any, weight_format: str, *, amx: bool = False) -> int:
    """Bytes the byte codes of a GGUF's decoder linears add to its float32 weights on the CPU
    (negative where they replace them): 1.25 a weight beside them ("auto"), 1.25 - 4 instead
    ("coded", or "auto" with `amx` on a CPU with AMX, where steps of many rows read the codes
    on AMX), for the tensors whose type makes them codes; in "auto" on AMX, those of 4- and
    5-bit types also keep their weight parts, 4 bytes a weight and 4 a run of 32 (the
    offsets' run), for the steps of the most rows. The engine finds codes from the
    weights' values: blocks a tuned quantizer made (imatrix) may not be codes
    it finds, and a float checkpoint whose values happen to be codes gets them, so there the
    plan is an estimate; it also assumes the native kernels build."""
    gguf_file = resolved.gguf_file or resolved.converted_from  # or the file of a cache entry
    if gguf_file is None or weight_format == "float32":
        return 0
    from aioinfer.model.cpu.kernels import amx_expected
    from aioinfer.model.cpu.packed_weights import (
        CODED_BYTES_PER_WEIGHT,
        CODED_GGUF_TYPES,
        PARTS_GGUF_TYPES,
        STRIP,
        parts_shape,
    )
    from aioinfer.model.loader.gguf_config import open_gguf

    reader = resolved.gguf_reader or open_gguf(gguf_file)
    coded = {
        t.name: t
        for t in reader.tensors
        if t.name.startswith("blk.")
        and len(t.shape) == 2
        and t.tensor_type.name in CODED_GGUF_TYPES
        and int(t.shape[1]) % STRIP == 0  # output features: whole strips
    }
    # A layer's gate and up run as one pass, from codes only if both have them.
    partner = {".ffn_gate.": ".ffn_up.", ".ffn_up.": ".ffn_gate."}
    kept = [
        t
        for name, t in coded.items()
        if not any(a in name and name.replace(a, b) not in coded for a, b in partner.items())
    ]
    on_amx = amx and amx_expected()
    strips = weight_format == "auto" and not on_amx
    total = sum(int(t.n_elements) for t in kept) * (CODED_BYTES_PER_WEIGHT - (0 if strips else 4))
    if weight_format == "auto" and on_amx:
        for t in kept:
            if t.tensor_type.name in PARTS_GGUF_TYPES:
                k, n = int(t.shape[0]), int(t.shape[1])
                total += 2 * math.prod(parts_shape(n // STRIP, k))
    return int(total)


def _dtype_name(name: str, device: str) -> str:
    if name == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {('auto', *DTYPE_BYTES)}, got {name!r}")
    return name


def _resolve(model_config: ModelConfig) -> Any:
    from aioinfer.model.loader.resolve import resolve_model

    # "dummy" reads configs only: no weights are fetched, and a .gguf is not converted.
    return resolve_model(model_config.model, model_config.revision, "dummy")


def _decoder_config(hf_config: Any) -> DecoderConfig:
    from aioinfer.model.registry import get_model_class

    return get_model_class(hf_config).decoder_config(hf_config)


# ----------------------------------------------------------------------------- output


def format_plan(plan: MemoryPlan) -> str:
    """The plan in the startup log's wording, so that the two can be compared line by line."""
    floats = plan.num_parameters * DTYPE_BYTES[plan.dtype]
    codes = plan.weights_bytes - floats  # the exact byte codes of a GGUF's linears
    why = f"{plan.num_parameters:,} parameters x {DTYPE_BYTES[plan.dtype]} bytes"
    if codes:
        why += f" {'+' if codes > 0 else '-'} {abs(codes) / GiB:.4f} GiB for coded linears"
    lines = [
        f"Plan for {plan.served_name}: device={plan.device}, dtype={plan.dtype}, "
        f"max_model_len={plan.max_model_len}, block_size={plan.block_size}",
        f"Chunked prefill is enabled with max_num_batched_tokens={plan.max_num_batched_tokens}.",
        f"Using max model len {plan.max_model_len}",
        f"Model loading took {plan.weights_gib:.4f} GiB memory ({why})",
    ]
    if plan.total_bytes is not None and plan.activation_bytes is not None:
        non_torch = plan.non_torch_bytes or 0
        source = "measured" if plan.non_torch_measured else "assumed"
        utilization = plan.gpu_memory_utilization or 0.0
        share = requested_bytes(plan.total_bytes, utilization)
        lines.append(
            f"Memory profiling (estimated): total {plan.total_bytes / GiB:.2f} GiB x "
            f"utilization {utilization:g} = {share / GiB:.2f} GiB, weights "
            f"{plan.weights_gib:.2f} GiB, "
            f"peak activations {plan.activation_bytes / GiB:.2f} GiB, CUDA graph pool "
            f"{plan.graph_pool_bytes / GiB:.2f} GiB, non-torch {non_torch / GiB:.2f} GiB ({source})"
        )
    lines += [
        f"Available KV cache memory: {plan.available_kv_gib:.2f} GiB",
        f"KV cache blocks: {max(plan.num_blocks - 1, 0)} usable of {plan.num_blocks} "
        f"(block 0 is reserved), {plan.block_size} tokens each",
        f"KV cache size: {plan.kv_capacity_tokens} tokens, Maximum concurrency for "
        f"{plan.max_model_len} tokens per request: {plan.max_concurrency:.2f}x",
    ]
    if plan.problem is not None:
        lines.append(f"serve would not start: {plan.problem}")
    return "\n".join(lines)


def build_plan_configs(values: dict[str, Any]) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
    """Sort flag values by config field name into the three configs (ValueError on bad ones)."""
    values = {k: v for k, v in values.items() if v is not None}
    values.setdefault("model", "")
    built = []
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        names = {f.name for f in dataclasses.fields(cls)}
        built.append(cls(**{k: v for k, v in values.items() if k in names}))
    return built[0], built[1], built[2]  # type: ignore[return-value]


def plan_main(
    model: str = "",
    *,
    gpu_memory: float | None = None,
    non_torch_memory: float | None = None,
    as_json: bool = False,
    **serve_flags: Any,
) -> int:
    """`aioinfer plan`: print the plan; 0 when serve would start, 1 when it would not, 2 for bad
    flags. `serve_flags` are serve's flags by config field name (dtype, max_model_len, ...)."""
    try:
        configs = build_plan_configs({"model": model, **serve_flags})
        plan = make_plan(*configs, gpu_memory_gib=gpu_memory, non_torch_gib=non_torch_memory)
    except (ValueError, FileNotFoundError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if as_json else format_plan(plan))
    return 0 if plan.problem is None else 1
