"""A GGUF file's metadata as a Hugging Face config: open the file, rebuild the config of the
architectures we run (experts and rope scaling included), the sampling it recommends and the
model name in its file name; `resolve_gguf` makes a ResolvedModel of the file, read directly
(gguf_cache.py converts it once and resolves later starts to the converted folder). No torch
import happens here.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aioinfer.model.loader.resolved import ResolvedModel

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# GGUF metadata key (after "<arch>.") -> HF config attribute, shared by the decoders we run.
_GGUF_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
# Where each architecture keeps its head size (qwen2 derives it from hidden / heads).
_GGUF_HEAD_DIM_KEY = {
    "llama": "rope.dimension_count",
    "qwen3": "attention.key_length",
    "qwen3moe": "attention.key_length",
}
_GGUF_TOKEN_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "unk_token_id": "tokenizer.ggml.unknown_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# The HF model type of a GGUF architecture where the names differ. llama.cpp writes Mixtral as
# "llama" with an expert count.
_GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
_GGUF_EXPERT_KEYS = {
    "expert_count": "num_experts",  # Mixtral's config: num_local_experts
    "expert_used_count": "num_experts_per_tok",
}
# The experts' widths: a file's key, else the width of a tensor that has it (llama.cpp's early
# qwen2moe files lack the keys), as (ggml shape: [in, out, ...]) dimension 1.
_GGUF_EXPERT_WIDTHS = {
    "moe_intermediate_size": ("expert_feed_forward_length", "blk.0.ffn_gate_exps.weight"),
    "shared_expert_intermediate_size": (
        "expert_shared_feed_forward_length",
        "blk.0.ffn_gate_shexp.weight",
    ),
}
# Whether llama.cpp renormalizes the weights of a token's chosen experts: fixed per
# architecture in its graphs (Mixtral's always are), whatever a file's expert_weights_norm says.
_GGUF_RENORMALIZES_EXPERTS = {"qwen2moe": False, "qwen3moe": True}
# An embedding GGUF declares `<arch>.pooling_type` (llama.cpp's enum): it runs as the bare
# decoder with that pooling (core/pooling.py). 4 (rank, a reranker's head) is not supported.
GGUF_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}
GGUF_POOLING_KEY = "gguf_pooling_type"  # where the HF config keeps it
# "SmolLM2-135M-Instruct.Q4_1" or "Qwen2.5-7B-Instruct-Q4_K_M" -> drop the quantization suffix.
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|BF16|FP?16|FP?32)$", re.IGNORECASE)


def resolve_gguf(
    path: Path, dummy: bool = False, reader: GGUFReader | None = None
) -> ResolvedModel:
    """Open a .gguf file once (unless `reader` is its open reader) and rebuild the HF config
    from its metadata."""
    if reader is None:
        reader = open_gguf(path)
    return ResolvedModel(
        kind="dummy" if dummy else "gguf",
        folder=path.resolve().parent,
        hf_config=gguf_hf_config(reader),
        served_name=gguf_served_name(path),
        gguf_file=path.resolve(),
        generation_config=gguf_generation_config(reader),
        gguf_reader=reader,
    )


# llama.cpp's converter writes a model's generation_config.json sampling as these keys.
_GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def gguf_generation_config(reader: GGUFReader) -> dict[str, Any] | None:
    """The sampling a GGUF file's metadata recommends, as generation_config.json keys (llama.cpp
    uses them as its defaults); None when it holds none."""
    config = {
        # Stored as float32: 0.6 reads back as 0.6000000238, shown as the 0.6 it was.
        name: float(f"{value:.7g}") if isinstance(value, float) else value
        for key, name in _GGUF_SAMPLING_KEYS.items()
        if (value := _gguf_value(reader, key)) is not None
    }
    return config or None


def open_gguf(path: Path) -> GGUFReader:
    """The reader of a .gguf file; a file it cannot parse, or one part of a split model, is a
    ValueError naming the file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, TypeError, KeyError) as exc:  # gguf-py's parse errors
        raise ValueError(f"{path} is not a readable GGUF file (is it truncated?): {exc}") from exc
    parts = _gguf_value(reader, "split.count")
    if parts is not None and int(parts) > 1:
        raise ValueError(
            f"{path} is one part of a GGUF split into {int(parts)} files, which is not "
            "supported: merge them first (llama-gguf-split --merge FIRST_PART OUT.gguf)"
        )
    return reader


def gguf_served_name(path: Path) -> str:
    """The model name in a GGUF file name, e.g. "SmolLM2-135M-Instruct.Q4_1.gguf" -> the stem."""
    return _QUANT_SUFFIX.sub("", Path(path).stem)


def gguf_hf_config(reader: GGUFReader) -> PretrainedConfig:
    """The HF config a GGUF's metadata describes, for the architectures we run."""
    from transformers import AutoConfig

    arch = str(_gguf_value(reader, "general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    model_type, architecture = _GGUF_MODEL_TYPES.get(arch, arch), GGUF_ARCHITECTURES[arch]
    experts = _gguf_experts(reader, arch)
    if arch == "llama" and experts:
        model_type, architecture = "mixtral", "MixtralForCausalLM"
    tensor_names = {t.name for t in reader.tensors}
    kwargs: dict[str, Any] = {
        "architectures": [architecture],
        # llama.cpp drops output.weight when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        **experts,
    }
    if model_type == "qwen2_moe":
        kwargs["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    if model_type == "llama":  # llama.cpp loads these biases where a llama file has them
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    pooling = _gguf_value(reader, f"{arch}.pooling_type")
    if pooling:
        if int(pooling) not in GGUF_POOLING_TYPES:
            raise ValueError(
                f"GGUF pooling_type {pooling} is not supported (mean 1, cls 2 and last 3 are)"
            )
        kwargs["architectures"] = [architecture.replace("ForCausalLM", "Model")]
        kwargs[GGUF_POOLING_KEY] = GGUF_POOLING_TYPES[int(pooling)]
    keys = {**_GGUF_CONFIG_KEYS}
    if arch in _GGUF_HEAD_DIM_KEY:
        keys[_GGUF_HEAD_DIM_KEY[arch]] = "head_dim"
    for key, attr in keys.items():
        value = _gguf_value(reader, f"{arch}.{key}")
        if value is not None:
            kwargs[attr] = value
    for attr, key in _GGUF_TOKEN_KEYS.items():
        value = _gguf_value(reader, key)
        if value is not None:
            kwargs[attr] = value
    # llama.cpp stops at the end-of-turn and end-of-message tokens as well as at EOS (an older
    # Llama 3 file's EOS is <|end_of_text|>, its turns end with <|eot_id|>).
    stops = [_gguf_value(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eot", "eom")]
    stops = [int(s) for s in stops if s is not None and s != kwargs.get("eos_token_id")]
    if stops:
        eos = kwargs.get("eos_token_id")
        kwargs["eos_token_id"] = list(dict.fromkeys([*([eos] if eos is not None else []), *stops]))
    if "vocab_size" not in kwargs:
        kwargs["vocab_size"] = _gguf_vocab_size(reader)
    rope_scaling = _gguf_rope_scaling(reader, arch, tensor_names)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    return AutoConfig.for_model(model_type, **kwargs)


def _gguf_experts(reader: GGUFReader, arch: str) -> dict[str, Any]:
    """The HF config keys of a mixture of experts' GGUF ({} for a dense model). llama.cpp's
    MoE layers are all sparse, and have no window (Mixtral's HF default had one)."""
    if arch != "llama" and arch not in _GGUF_RENORMALIZES_EXPERTS:
        return {}
    config = {
        attr: value
        for key, attr in _GGUF_EXPERT_KEYS.items()
        if (value := _gguf_value(reader, f"{arch}.{key}")) is not None
    }
    if not config.get("num_experts"):
        return {}
    if arch == "llama":  # the experts' width is feed_forward_length
        config["num_local_experts"] = config.pop("num_experts")
        return {**config, "sliding_window": None}
    shapes = {t.name: t.shape for t in reader.tensors}
    for attr, (key, tensor) in _GGUF_EXPERT_WIDTHS.items():
        width = _gguf_value(reader, f"{arch}.{key}")
        if width is None and tensor in shapes:
            width = int(shapes[tensor][1])
        if width is not None:
            config[attr] = width
    return {
        **config,
        "norm_topk_prob": _GGUF_RENORMALIZES_EXPERTS[arch],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _gguf_vocab_size(reader: GGUFReader) -> int:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError("GGUF file has neither a vocabulary nor a token_embd.weight tensor")
    return int(embedding.shape[-1])  # ggml order: [hidden, vocab]


def _gguf_value(reader: GGUFReader, key: str) -> Any:
    field_ = reader.fields.get(key)
    return None if field_ is None else field_.contents()


def _gguf_rope_scaling(
    reader: GGUFReader, arch: str, tensor_names: set[str]
) -> dict[str, Any] | None:
    """The HF rope_scaling of a GGUF: its `rope.scaling.*` keys (linear and yarn, the kinds
    llama.cpp writes there), or Llama 3's scaling, which llama.cpp stores as a `rope_freqs`
    tensor of per-frequency factors (see `_llama3_scaling`)."""
    if "rope_freqs.weight" in tensor_names:
        return _llama3_scaling(reader, arch)
    kind = _gguf_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = _gguf_value(reader, f"{arch}.rope.scaling.factor")
    if kind not in ("linear", "yarn") or factor is None:
        raise ValueError(
            f"GGUF RoPE scaling {kind!r} (factor {factor}) is not supported; linear and yarn "
            "with a factor are"
        )
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = _gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for key in ("beta_fast", "beta_slow"):
        value = _gguf_value(reader, f"{arch}.rope.scaling.yarn_{key}")
        if kind == "yarn" and value is not None:
            scaling[key] = float(value)
    return scaling


# What every Llama 3.x checkpoint uses besides its factor (8 for 3.1, 32 for 3.2).
_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ORIGINAL_CONTEXT = 8192


def _llama3_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    """The llama3 rope_scaling whose factors are the file's `rope_freqs` tensor: its largest
    factor with Llama 3's other parameters, kept only when it gives every factor back. A tensor
    from other parameters is ignored with a warning (as transformers ignores it)."""
    import numpy as np

    tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    head_dim = int(
        _gguf_value(reader, f"{arch}.rope.dimension_count")
        or _gguf_value(reader, f"{arch}.embedding_length")
        // _gguf_value(reader, f"{arch}.attention.head_count")
    )
    theta = _gguf_value(reader, f"{arch}.rope.freq_base") or 10000.0
    original = (
        _gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
        or _LLAMA3_ORIGINAL_CONTEXT
    )
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        **_LLAMA3_SCALING,
        "original_max_position_embeddings": int(original),
    }
    expected = _llama3_factors(scaling, head_dim, float(theta))
    if len(expected) == len(factors) and np.allclose(expected, factors, rtol=1e-5):
        return scaling
    logger.warning(
        "this GGUF scales RoPE with a rope_freqs tensor that no Llama 3 scaling gives; it is "
        "ignored (as in transformers): outputs differ from the original model's, most at long "
        "contexts. Serve the safetensors checkpoint for exact RoPE scaling."
    )
    return None


def _llama3_factors(scaling: dict[str, Any], head_dim: int, theta: float) -> list[float]:
    """The factor dividing each rotary frequency under Llama 3's scaling (as llama.cpp's
    converter writes them into rope_freqs)."""
    import math

    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out
