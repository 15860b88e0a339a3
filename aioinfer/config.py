"""Every engine and server setting, its default and its help text, in one place.

Each config is a frozen dataclass; a field's `metadata["help"]` doubles as the CLI help. Validation
happens in `__post_init__` and raises ValueError naming the field and the value. Stdlib only.
"""

from __future__ import annotations

import json
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

# Sampling defaults a model's generation_config.json (or --override-generation-config) may set.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# What --override-generation-config may set (the penalties are not generation_config.json keys).
OVERRIDE_KEYS = (*GENERATION_DEFAULT_KEYS, "presence_penalty", "frequency_penalty")

# The ranges of SamplingParams' numeric settings that --override-generation-config may set, each
# a test and the words of "<name> must be <words>, got <value>": ModelConfig checks overrides
# against them at start, and core/sampling_params.py every request.
SAMPLING_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda v: v >= 0, ">= 0"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "top_k": (lambda v: v >= -1, "-1, 0 (disabled) or >= 1"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "max_tokens": (lambda v: v >= 1, ">= 1"),
    "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "repetition_penalty": (lambda v: v > 0, "> 0"),
}
# Those of them that SamplingParams takes as integers only, and how it words that.
_INTEGER_SAMPLING_KEYS = {"top_k": "an integer", "max_tokens": "an integer or null"}


def check_sampling_range(name: str, value: float) -> None:
    """ValueError, worded as SamplingParams words it, when `value` is outside `name`'s range."""
    within, allowed = SAMPLING_RANGES[name]
    if not within(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


# The parsers of server/serving/tool_parsers.py and server/serving/reasoning.py (a test keeps
# the lists the same).
TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "pythonic", "phi4_mini_json")
REASONING_PARSER_NAMES = ("qwen3", "deepseek_r1")

# What chat_template_kwargs may not set: the rendering's own arguments (a client must not pick
# the template, or turn rendering into something else) and the conversation itself.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
        "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
        "tokenizer_kwargs", "sanitize_control_tokens",
    }
)  # fmt: skip


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs or {}))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")


def _json_object(name: str, value: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A flag that holds a JSON object (text from the command line, or a dict from code)."""
    if value is None or isinstance(value, Mapping):
        return None if value is None else dict(value)
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError):
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return parsed


_ORIGIN = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s]+")


def _origins(values: tuple[str, ...]) -> tuple[str, ...]:
    """--allowed-origins as origins: each flag an origin or vLLM's JSON list of them; an origin
    with a path (a trailing / included) would never match a browser's Origin header."""
    origins: list[str] = []
    for value in values:
        parsed = json.loads(value) if value.lstrip().startswith("[") else [value]
        origins += parsed
    for origin in origins:
        if origin != "*" and not (isinstance(origin, str) and _ORIGIN.fullmatch(origin)):
            raise ValueError(
                f"allowed_origins must be '*' or scheme://host[:port] (no path), got {origin!r}"
            )
    return tuple(origins)


def _check_keys(keys: tuple[str, ...]) -> None:
    """A key that is empty or has whitespace around it could never match: a client's key is
    compared stripped. The errors never show a key."""
    for number, key in enumerate(keys, start=1):
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"api_key: key {number} of {len(keys)} is empty")
        if key != key.strip():
            raise ValueError(
                f"api_key: key {number} of {len(keys)} begins or ends with whitespace, so no "
                "client could send it (keys are compared without it): remove the whitespace"
            )


def _opt(default, help: str, *, repr: bool = True, **extra):
    return field(default=default, repr=repr, metadata={"help": help, **extra})


def _type_fits(value: Any, hint: Any) -> bool:
    """Whether `value` is of the annotated type (the few kinds the configs use)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_fits(value, arg) for arg in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):  # an int where a float goes, as Python's own numbers
        kinds = (int,) if hint is int else (int, float)
        return isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
    if origin is tuple:
        return isinstance(value, tuple) and all(
            _type_fits(v, typing.get_args(hint)[0]) for v in value
        )
    return isinstance(value, origin or hint)


_TYPE_WORDS = {
    "int": "an integer",
    "float": "a finite number",
    "str": "a string",
    "bool": "a boolean",
    "tuple[str, ...]": "a list of strings",
    "Mapping[str, Any]": "an object",
}


def _check_types(cfg: object) -> None:
    """Each field of the annotated type: configs built in code (LLM(...) options) are not
    checked by the command line's parser, and a string or a float where an int goes would
    fail later, far from the option's name."""
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if not _type_fits(value, hints[f.name]):
            kinds = [_TYPE_WORDS.get(t.strip(), t.strip()) for t in str(f.type).split("|")]
            raise ValueError(f"{f.name} must be {' or '.join(kinds)}, got {value!r:.80}")


def _check_positive(cfg: object, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and not value > 0:  # NaN too
            raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str = _opt(
        "", "Hugging Face hub id, local folder or .gguf file. Empty: the bundled SmolLM2-135M."
    )
    served_model_name: tuple[str, ...] = _opt(
        (),
        "Model name in the API (default: from the model). Repeatable, or several names after "
        "the flag as in vLLM: responses carry the first, requests may name any.",
    )
    tokenizer: str | None = _opt(None, "Tokenizer hub id or folder (default: the model's).")
    dtype: str = _opt(
        "auto", "auto (bfloat16 on GPU, float32 on CPU), float32 (float), bfloat16, float16 (half)."
    )
    load_format: str = _opt(
        "auto",
        "auto (safetensors or gguf) or dummy (random weights; the configs of "
        "Qwen/Qwen2.5-1.5B-Instruct, meta-llama/Llama-3.1-8B, Qwen/Qwen3-30B-A3B and "
        "google/gemma-3-1b-it are bundled, so these need no download).",
    )
    max_model_len: int | None = _opt(
        None,
        "Longest prompt plus output (default: the model's). -1 (vLLM's auto): the model's, "
        "lowered to what the KV cache holds.",
    )
    device: str = _opt("auto", "auto (cuda if available), cuda or cpu.")
    seed: int | None = _opt(
        0, "Seed for random weights and unseeded sampling (offline, seed=None: a fresh one)."
    )
    chat_template: str | None = _opt(None, "Jinja chat template or a path to one.")
    generation_config: str = _opt(
        "auto",
        "auto: take sampling defaults from the model's generation_config.json; vllm: ignore "
        "it; a folder: read the generation_config.json in that folder instead.",
    )
    override_generation_config: str | Mapping[str, Any] | None = _opt(
        None,
        "Sampling defaults over generation_config.json's, as a JSON object, e.g. "
        '\'{"temperature": 0.6, "max_new_tokens": 512}\' (keys: '
        + ", ".join(OVERRIDE_KEYS)
        + ", max_new_tokens); a request's own values win, except that max_new_tokens caps "
        "max_tokens, as in vLLM.",
    )
    max_logprobs: int = _opt(
        20, "Most logprobs (and top_logprobs) a request may ask for (-1: the whole vocabulary)."
    )
    attention_backend: str = _opt(
        "auto",
        "auto (triton on CUDA; native kernels on the CPU when they build, else torch), triton, "
        "native or torch.",
    )
    cpu_kernels: str = _opt(
        "auto",
        "auto (native AVX2/AVX-512 kernels for float32 linears, norms, activations and rotary "
        "on the CPU when they build, else torch ops), native or torch.",
    )
    cpu_weight_format: str = _opt(
        "auto",
        "With the native CPU kernels, linear weights that are byte codes times a scale plus an "
        "offset per 32 (what GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K dequantize to) "
        "give the same float32 results from 1.25 bytes a weight. auto: keep those codes beside "
        "the float32 weights and read them in small steps (batch-1 decoding about 1.7x faster; "
        "the linears take 31 % more memory); coded: keep only the codes (the linears in a third "
        "of the memory, large steps 1-10 % slower); float32: no codes.",
    )
    cpu_amx: bool = _opt(
        True,
        "On CPUs with AMX (Intel Xeon from Sapphire Rapids on), run the linears of steps of 15 "
        "or more rows over byte-coded weights (see --cpu-weight-format) on the tile unit: "
        "about 1.5-2x faster prompts and large batches, float32-accurate, but not bit-equal "
        "to the FMA path; --cpu-weight-format auto then keeps no float32 strips of those "
        "weights, but 4- and 5-bit codes (Q4_0, Q4_1, Q5_0, Q5_1) also as two bfloat16 parts "
        "(4 bytes a weight) for steps of 128 or more rows, whose linears they make about "
        "1.2x faster.",
    )
    enforce_eager: bool = _opt(False, "Never capture CUDA graphs.")
    revision: str | None = _opt(None, "Hub revision (branch, tag or commit).")
    runner: str = _opt(
        "auto",
        "generate: text generation. pooling: embeddings (/v1/embeddings, LLM.embed) from the "
        "final hidden states. auto: pooling for *Model architectures and sentence-transformers "
        "folders, else generate.",
    )
    pooler_config: str | Mapping[str, Any] | None = _opt(
        None,
        "How a pooling model makes an embedding, as a JSON object, e.g. "
        '\'{"pooling_type": "MEAN", "normalize": false}\' (pooling_type LAST, MEAN or CLS; '
        "default: the model's sentence-transformers settings, else LAST, normalized).",
    )
    enable_lora: bool = _opt(
        False, "Serve LoRA adapters (PEFT folders) on top of the model, per request."
    )
    max_loras: int = _opt(4, "Most LoRA adapters loaded at once.")
    max_lora_rank: int = _opt(64, "Largest LoRA rank an adapter may have.")

    def __post_init__(self) -> None:
        names = self.served_model_name
        # One name as a string (vLLM's LLM(served_model_name=...) takes one or a list).
        names = () if not names else (names,) if isinstance(names, str) else tuple(names)
        object.__setattr__(self, "served_model_name", names)
        _check_types(self)
        # vLLM's (and torch's) other names for the same types.
        aliases = {"half": "float16", "float": "float32"}
        object.__setattr__(self, "dtype", aliases.get(self.dtype, self.dtype))
        allowed = {
            "dtype": ("auto", "float32", "bfloat16", "float16"),
            "load_format": ("auto", "safetensors", "gguf", "dummy"),
            "device": ("auto", "cuda", "cpu"),
            "attention_backend": ("auto", "triton", "native", "torch"),
            "cpu_kernels": ("auto", "native", "torch"),
            "cpu_weight_format": ("auto", "coded", "float32"),
            "runner": ("auto", "generate", "pooling"),
        }
        for name, choices in allowed.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        generation = self.generation_config
        if generation not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(generation, "generation_config.json")
        ):
            raise ValueError(
                "generation_config must be auto, vllm or a folder holding "
                f"generation_config.json, got {generation!r}"
            )
        _check_positive(self, "max_loras", "max_lora_rank")
        if self.max_model_len != -1:
            _check_positive(self, "max_model_len")
        self.generation_overrides  # noqa: B018 (checks the JSON)
        self.pooler_overrides  # noqa: B018 (checks the JSON)
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1, got {self.max_logprobs}")

    @property
    def pooler_overrides(self) -> dict[str, Any] | None:
        """--pooler-config as a dict (the runner checks its keys against the model)."""
        return _json_object("pooler_config", self.pooler_config)

    @property
    def generation_overrides(self) -> dict[str, float]:
        """--override-generation-config as sampling defaults (max_new_tokens: max_tokens);
        raises ValueError naming what is wrong."""
        value = _json_object("override_generation_config", self.override_generation_config)
        allowed = (*OVERRIDE_KEYS, "max_new_tokens")
        out: dict[str, Any] = {}
        for key, number in (value or {}).items():
            if key not in allowed:
                raise ValueError(
                    f"override_generation_config may set {', '.join(allowed)}, got {key!r}"
                )
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise ValueError(f"override_generation_config: {key} must be a number")
            if not math.isfinite(number):
                raise ValueError(f"override_generation_config: {key} must be finite")
            out["max_tokens" if key == "max_new_tokens" else key] = number
        # The types and ranges SamplingParams checks, in its order, now rather than in every
        # request.
        try:
            for name, words in _INTEGER_SAMPLING_KEYS.items():
                if name in out and not isinstance(out[name], int):
                    raise ValueError(f"{name} must be {words}, got {out[name]!r}")
            for name in SAMPLING_RANGES:
                if name in out:
                    check_sampling_range(name, out[name])
        except ValueError as exc:
            raise ValueError(f"override_generation_config: {exc}") from None
        return out


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _opt(16, "Tokens per KV-cache block.")
    gpu_memory_utilization: float = _opt(
        0.92,
        "Fraction of the GPU's memory for weights, activations and the KV cache; it must be "
        "free at start (other processes' memory is outside it, as in vLLM).",
    )
    kv_cache_memory: float = _opt(4.0, "KV-cache size in GiB on the CPU (no memory to profile).")
    kv_cache_memory_bytes: int | None = _opt(
        None,
        "KV-cache size in bytes, as vLLM's (32G, 8g on the command line): on a GPU it replaces "
        "the size --gpu-memory-utilization leaves, on the CPU --kv-cache-memory.",
    )
    num_gpu_blocks_override: int | None = _opt(None, "Use exactly this many KV blocks.")
    enable_prefix_caching: bool = _opt(True, "Reuse the KV cache of shared prompt prefixes.")
    kv_events_config: str | Mapping[str, Any] | None = _opt(
        None,
        "Publish the prefix cache's changes as vLLM's KV events, for routers that route on "
        "each replica's cache (llm-d, vllm-router --policy kv_aware): a JSON object with "
        'vLLM\'s keys, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "topic": "kv@pod-1@model"}\' (needs pyzmq and msgpack).',
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _check_positive(self, "block_size", "kv_cache_memory", "num_gpu_blocks_override")
        _check_positive(self, "kv_cache_memory_bytes")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        self.kv_events  # noqa: B018 (checks the JSON)

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """--kv-events-config, parsed; None when events are off."""
        return _kv_events(self.kv_events_config)


@dataclass(frozen=True)
class KVEventsConfig:
    """--kv-events-config: where the KV events go (engine/kv_events.py)."""

    endpoint: str = "tcp://*:5557"
    topic: str = ""


# vLLM's KVEventsConfig keys that change nothing here.
_KV_EVENTS_NOOP_KEYS = {"buffer_steps", "hwm", "max_queue_size", "replay_endpoint"}


def _kv_events(value: str | Mapping[str, Any] | None) -> KVEventsConfig | None:
    parsed = _json_object("kv_events_config", value)
    if not parsed or not parsed.get("enable_kv_cache_events", False):
        return None
    known = {"enable_kv_cache_events", "publisher", "endpoint", "topic", *_KV_EVENTS_NOOP_KEYS}
    unknown = sorted(set(parsed) - known)
    if unknown:
        raise ValueError(f"kv_events_config has unknown keys {unknown}; known: {sorted(known)}")
    publisher = parsed.get("publisher", "zmq")
    if publisher != "zmq":
        raise ValueError(f"kv_events_config.publisher must be 'zmq', got {publisher!r}")
    endpoint, topic = parsed.get("endpoint", "tcp://*:5557"), parsed.get("topic", "")
    if not isinstance(endpoint, str) or not endpoint or not isinstance(topic, str):
        raise ValueError("kv_events_config.endpoint and .topic must be strings")
    return KVEventsConfig(endpoint, topic)


@dataclass(frozen=True)
class NgramSpeculation:
    """--speculative-config, parsed: prompt-lookup drafts (see core/spec_decode.py)."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    # No drafts while this many requests or more run (vLLM's key); None: always draft.
    disable_by_batch_size: int | None = None


MAX_SPECULATIVE_TOKENS = 32


def _speculation(value: str | Mapping[str, Any] | None) -> NgramSpeculation | None:
    """vLLM's --speculative-config keys for method "ngram"; raises ValueError naming the key."""
    spec = _json_object("speculative_config", value)
    if spec is None:
        return None
    allowed = (
        "method",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "disable_by_batch_size",
    )
    for key in spec:
        if key not in allowed:
            raise ValueError(
                f"speculative_config may set {', '.join(allowed)}, got {key!r} (only n-gram "
                "prompt lookup is supported; draft models are not)"
            )
    if spec.get("method") != "ngram":
        raise ValueError(f"speculative_config: method must be 'ngram', got {spec.get('method')!r}")
    for key in allowed[1:]:
        number = spec.get(key)
        if number is not None and (isinstance(number, bool) or not isinstance(number, int)):
            raise ValueError(f"speculative_config: {key} must be an integer, got {number!r}")
    num = spec.get("num_speculative_tokens")
    if num is None or not 1 <= num <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            "speculative_config: num_speculative_tokens must be in "
            f"[1, {MAX_SPECULATIVE_TOKENS}], got {num!r}"
        )
    # vLLM's defaults: either bound alone sets both; neither means 5.
    given_low, given_high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    low: int = next(v for v in (given_low, given_high, 5) if v is not None)
    high: int = next(v for v in (given_high, given_low, 5) if v is not None)
    if not 1 <= low <= high:
        raise ValueError(
            "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
            f"{low} and {high}"
        )
    batch = spec.get("disable_by_batch_size")
    if batch is not None and batch < 1:
        raise ValueError(f"speculative_config: disable_by_batch_size must be >= 1, got {batch}")
    return NgramSpeculation(num, low, high, batch)


def sampled_rows_per_request(scheduler_config: SchedulerConfig) -> int:
    """The most logits rows one request samples in a step: 1, or 1 + its drafts."""
    spec = scheduler_config.speculation
    return 1 + (spec.num_speculative_tokens if spec is not None else 0)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None = _opt(
        None,
        "Most requests in one step (default: 1024 on GPUs of 70 GiB and more, A100s aside, "
        "else 256, as vLLM).",
    )
    max_num_batched_tokens: int | None = _opt(
        None, "Token budget of one step (default: by device; larger for the offline LLM)."
    )
    max_queued_requests: int | None = _opt(
        None,
        "Most waiting sequences (a request with n > 1 counts n); beyond it a 503 with "
        "Retry-After, before any tokenization work (default: no limit).",
    )
    max_queued_tokens: int | None = _opt(
        None,
        "Most prompt tokens of the waiting sequences (a request with n > 1 counts its prompt "
        "n times); beyond it a 503 with Retry-After, decided once the prompt is tokenized "
        "(default: no limit).",
    )
    queue_timeout: float | None = _opt(
        None,
        "Seconds a request may wait for its first step; beyond it the request is dropped "
        "with a 503 (default: no limit).",
    )
    async_scheduling: bool = _opt(
        True,
        "Plan and queue each step while the one before runs, so that the device never waits "
        "for the scheduler (vLLM's async scheduling). Requests with a grammar, penalties or "
        "drafts make the steps around theirs wait. Outputs are the same either way.",
    )
    stream_interval: int = _opt(
        1,
        "Output tokens a streamed sequence gathers before they are sent, as one event (vLLM's "
        "--stream-interval): 1 sends each token; more sends fewer, larger events and spends "
        "less host time per token. A sequence's first and last tokens go at once.",
    )
    scheduling_policy: str = _opt(
        "fcfs",
        "fcfs: requests run in arrival order, and the newest running one is preempted first. "
        "priority: by each request's `priority` (lower first, then arrival); the waiting "
        "queue is ordered by it, and the running request with the largest is preempted first.",
    )
    speculative_config: str | Mapping[str, Any] | None = _opt(
        None,
        "Speculative decoding by prompt lookup, as a JSON object with vLLM's keys, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\': '
        "where the last n tokens (prompt_lookup_min <= n <= prompt_lookup_max) appeared "
        "before, the tokens that followed them are drafted, and one forward pass checks them "
        "all. Outputs keep their distribution (greedy: the same tokens); edits, quotes and "
        "code that repeat the context come faster. disable_by_batch_size: no drafts while "
        "that many requests run.",
    )

    def __post_init__(self) -> None:
        _check_types(self)
        _check_positive(
            self,
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_queued_requests",
            "max_queued_tokens",
            "queue_timeout",
            "stream_interval",
        )
        self.speculation  # noqa: B018 (checks the JSON)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be one of ('fcfs', 'priority'), got "
                f"{self.scheduling_policy!r}"
            )

    @property
    def speculation(self) -> NgramSpeculation | None:
        return _speculation(self.speculative_config)


@dataclass(frozen=True)
class ServerConfig:
    host: str = _opt("0.0.0.0", "Address to listen on.")
    port: int = _opt(8000, "Port to listen on.")
    uds: str | None = _opt(None, "Listen on this Unix socket instead of host:port.")
    ssl_certfile: str | None = _opt(None, "Serve HTTPS with this certificate (PEM).")
    ssl_keyfile: str | None = _opt(
        None, "The certificate's private key (PEM; default: in the certificate file)."
    )
    # repr=False: no repr of the config (a log line, a traceback) shows a key.
    api_key: tuple[str, ...] = _opt(
        (), "Accepted API key (repeatable; also AIOINFER_API_KEY).", repr=False
    )
    lora_modules: tuple[str, ...] = _opt(
        (),
        "A LoRA adapter to serve as NAME=PATH (a PEFT folder), or vLLM's JSON "
        '\'{"name": ..., "path": ...}\' (repeatable; needs --enable-lora). Requests pick it by '
        "its name in `model`.",
    )
    lora_root: str | None = _opt(
        None,
        "The folder runtime LoRA loading (AIOINFER_ALLOW_RUNTIME_LORA_UPDATING) loads adapters "
        "from: a lora_path must lie under it, symlinks resolved (a relative one is taken from "
        "it). Without it, runtime loading refuses every path.",
    )
    share_prefix_cache_across_keys: bool = _opt(
        False,
        "With several API keys, let requests of different keys share cached prompt prefixes "
        "(off: each key's prefixes are its own, so no key can time or count another's cached "
        "prompts; a request's cache_salt still separates within a key).",
    )
    lora_names_in_metrics: bool = _opt(
        True,
        "Name the adapters of running and waiting requests in /metrics' lora_requests_info, as "
        "vLLM does (--no-lora-names-in-metrics: adapter-<slot> instead, since /metrics needs "
        "no key; routers then cannot pick a server by its adapters).",
    )
    allowed_origins: tuple[str, ...] = _opt(
        (),
        "Origins whose browser apps may call the API, as scheme://host[:port] (repeatable, or "
        "vLLM's JSON list; '*': any). Default: none, as vLLM's since 0.33 (before, '*').",
    )
    shutdown_timeout: float = _opt(
        10.0,
        "Seconds in-flight requests may finish after SIGTERM (new ones get 503); the rest end "
        "with finish_reason 'abort'.",
    )
    log_stats_interval: float = _opt(10.0, "Seconds between throughput log lines (0: off).")
    sse_keep_alive_interval: float = _opt(
        15.0, "Seconds between SSE ': keep-alive' comments while a stream waits (0: off)."
    )
    body_read_timeout: float = _opt(
        120.0,
        "Seconds a request body may take to arrive in all; beyond it a 408 and the connection "
        "closes (a body whose bytes stop for 60 s is a 408 sooner).",
    )
    stream_write_timeout: float = _opt(
        30.0,
        "Seconds a write to a client that stopped reading may block before its request is "
        "aborted and the connection closed.",
    )
    watchdog_timeout: float = _opt(
        300.0,
        "Seconds the GPU thread may spend on one step (or other work, such as loading a "
        "LoRA adapter); past it the engine counts as stuck: requests in flight fail with a "
        "500, /health answers 503 and the server exits 1, for its supervisor to restart it "
        "(0: off).",
    )
    log_requests: bool = _opt(
        False, "Log one line per generation request: id, status, token counts, latency."
    )
    log_prompts: bool = _opt(
        False,
        "With --log-requests, add the prompt and output text to the log (off: never logged).",
    )
    max_log_len: int = _opt(
        2000, "With --log-prompts, the characters of each prompt and output that are logged."
    )
    enable_force_include_usage: bool = _opt(
        False,
        "End every streamed completion and chat completion with a usage chunk, as if its "
        "stream_options asked for one.",
    )
    enable_prompt_tokens_details: bool = _opt(
        False,
        "Add prompt_tokens_details.cached_tokens (the prompt tokens found in the prefix "
        "cache) to the usage of completions and chat completions.",
    )
    tool_call_parser: str | None = _opt(
        None,
        "Read tool calls from the model's own text, so that tool_choice 'auto' works: hermes "
        "(Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.1-3.3), mistral (Mistral 7B v0.3, "
        "Nemo, Small 2409), pythonic (Llama 3.2 and 4, Gemma 3 with a template that asks for "
        "Python calls), phi4_mini_json (Phi-4-mini).",
    )
    enable_auto_tool_choice: bool = _opt(
        False, "vLLM's switch for tool_choice 'auto'; here --tool-call-parser alone does it."
    )
    reasoning_parser: str | None = _opt(
        None,
        "Return a thinking model's <think>...</think> reasoning in the `reasoning` field, apart "
        "from its answer (structured outputs then constrain only the answer): "
        + ", ".join(REASONING_PARSER_NAMES)
        + ".",
    )

    metrics_prefix: str = _opt(
        "aioinfer",
        "The engine's /metrics series as aioinfer:* or as vllm:* (vLLM's names, which routers "
        "such as the Gateway API inference extension's endpoint picker, autoscaling rules and "
        "dashboards built for vLLM read): aioinfer or vllm.",
    )
    shutdown_notice: float = _opt(
        0.0,
        "Seconds between SIGTERM and the drain: /health answers 503 at once, but new requests "
        "are still served until then, so that a router that health-checks drops this server "
        "before it refuses anything (in Kubernetes, a preStop sleep does this instead).",
    )

    trust_request_chat_template: bool = _opt(
        False,
        "Render a request's own chat_template; without this flag such requests are refused "
        "(a template is code the server runs).",
    )
    default_chat_template_kwargs: str | Mapping[str, Any] | None = _opt(
        None,
        "Chat template variables for every request, as a JSON object, e.g. "
        "'{\"enable_thinking\": false}' for Qwen3; a request's chat_template_kwargs win.",
    )

    @property
    def lora_adapters(self) -> dict[str, str]:
        """--lora-modules as {name: path}; ValueError naming a malformed one."""
        adapters: dict[str, str] = {}
        for value in self.lora_modules:
            if value.lstrip().startswith("{"):
                parsed = _json_object("lora_modules", value) or {}
                name, path = parsed.get("name"), parsed.get("path")
            else:
                name, _, path = value.partition("=")
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise ValueError(f"lora_modules must be NAME=PATH or a JSON object, got {value!r}")
            if name in adapters:
                raise ValueError(f"lora_modules names {name!r} twice")
            adapters[name] = path
        return adapters

    @property
    def chat_template_defaults(self) -> dict[str, object]:
        return _json_object("default_chat_template_kwargs", self.default_chat_template_kwargs) or {}

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in (
            "shutdown_timeout",
            "log_stats_interval",
            "sse_keep_alive_interval",
            "watchdog_timeout",
            "max_log_len",
            "shutdown_notice",
        ):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        _check_positive(self, "stream_write_timeout", "body_read_timeout")
        _check_keys(self.api_key)
        object.__setattr__(self, "allowed_origins", _origins(self.allowed_origins))
        self.lora_adapters  # noqa: B018 (checks each NAME=PATH)
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("ssl_keyfile needs ssl_certfile")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSER_NAMES):
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSER_NAMES)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (e.g. hermes)")
        if self.metrics_prefix not in ("aioinfer", "vllm"):
            raise ValueError(
                f"metrics_prefix must be one of aioinfer, vllm, got {self.metrics_prefix!r}"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSER_NAMES):
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSER_NAMES)}, "
                f"got {self.reasoning_parser!r}"
            )
        self._check_template_defaults()

    def _check_template_defaults(self) -> None:
        try:
            check_template_kwargs(self.chat_template_defaults)
        except ValueError as exc:
            raise ValueError(f"default_chat_template_kwargs: {exc}") from None


CONFIG_CLASSES = (ModelConfig, CacheConfig, SchedulerConfig, ServerConfig)


def non_default_args(*configs: object) -> dict[str, object]:
    """The settings that differ from their defaults, for the startup log."""
    out: dict[str, object] = {}
    for cfg in configs:
        for f in fields(cfg):  # type: ignore[arg-type]
            value = getattr(cfg, f.name)
            if value != f.default:
                out[f.name] = value
    return out
