"""The offline LLM's options: the config dataclasses' fields, and vLLM's own option names where
a vLLM script passes them at values that change nothing for one model on one device."""

from __future__ import annotations

import dataclasses
from typing import Any

from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig

# vLLM's LLM options that change nothing here: accepted, so that vLLM scripts run unchanged.
# (No model code is ever run from a repository, whatever trust_remote_code says; preempted
# requests are recomputed, so there is no swap space; prompts are always chunked; CUDA graphs
# cover every decode batch shape.)
_IGNORED_VLLM_OPTIONS = (
    "trust_remote_code",
    "disable_log_stats",
    "swap_space",
    "enable_chunked_prefill",
    "disable_custom_all_reduce",
    "compilation_config",
    "max_seq_len_to_capture",
)
# vLLM's options that only have one value here, and why.
_ONE_DEVICE = "one model on one device"
FIXED_VLLM_OPTIONS: dict[str, tuple[Any, str]] = {
    "tensor_parallel_size": (1, _ONE_DEVICE),
    "pipeline_parallel_size": (1, _ONE_DEVICE),
    "data_parallel_size": (1, _ONE_DEVICE),
    "distributed_executor_backend": (None, _ONE_DEVICE),
    "quantization": (None, "quantized checkpoints are refused; GGUF files are dequantized"),
    "kv_cache_dtype": ("auto", "the KV cache takes the model's dtype"),
    "cpu_offload_gb": (0, "the weights stay on the device"),
    "tokenizer_mode": ("auto", "fast tokenizers only"),
    "tokenizer_revision": (None, "the tokenizer comes from the model's revision"),
    "skip_tokenizer_init": (False, "the engine detokenizes"),
    "hf_overrides": (None, "the model's config is used as it is"),
    "download_dir": (None, "the Hugging Face cache holds downloads"),
}


# vLLM's older `task` option, by the runner each task asks for.
_TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling",
                 "classify": "pooling", "score": "pooling"}  # fmt: skip


def _drop_vllm_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options without vLLM's that change nothing here; raises for a value they cannot take."""
    kept = {k: v for k, v in options.items() if k not in _IGNORED_VLLM_OPTIONS}
    if "task" in kept:
        task = kept.pop("task")
        if task not in _TASK_RUNNERS:
            raise ValueError(f"task must be one of {sorted(_TASK_RUNNERS)}, got {task!r}")
        runner = _TASK_RUNNERS[task]
        if kept.setdefault("runner", runner) != runner:
            raise ValueError(f"task={task!r} asks for runner {runner!r}, got {kept['runner']!r}")
    for name, (only, why) in FIXED_VLLM_OPTIONS.items():
        value = kept.pop(name, only)
        if value != only and not (only is None and not value):  # {} or "" mean None
            raise ValueError(f"{name} must be {only!r} ({why}), got {value!r}")
    dtype = kept.get("dtype")
    if not isinstance(dtype, str) and str(dtype).startswith("torch."):  # a torch.dtype, as vLLM
        kept["dtype"] = str(dtype).removeprefix("torch.")
    return kept


def llm_configs(**options: Any) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
    """LLM(...)'s keyword options sorted into the config dataclasses by field name; vLLM's
    options are accepted where they change nothing here."""
    configs = []
    remaining = _drop_vllm_options(options)
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        names = {f.name for f in dataclasses.fields(cls)}
        configs.append(cls(**{k: remaining.pop(k) for k in list(remaining) if k in names}))
    if remaining:
        raise TypeError(f"unknown LLM options: {sorted(remaining)}")
    return configs[0], configs[1], configs[2]  # type: ignore[return-value]
