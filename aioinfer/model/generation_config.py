"""What a generation config gives the engine: sampling defaults and end-of-sequence ids.

As vLLM's --generation-config: `auto` reads the model's own generation_config.json, `vllm`
ignores it, and a folder reads the generation_config.json in that folder instead. The model's
end-of-sequence ids stay in force under every setting; a folder's are added to them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aioinfer.bundled import BUNDLED_GENERATION_CONFIG, is_bundled_model
from aioinfer.config import GENERATION_DEFAULT_KEYS, ModelConfig
from aioinfer.model.loader.resolved import ResolvedModel, read_json


def model_generation_config(resolved: ResolvedModel) -> dict[str, Any]:
    """The model's own generation config: its generation_config.json (a GGUF file's sampling
    keys), or for the bundled SmolLM2 GGUF, which carries neither, its model card's sampling."""
    if resolved.generation_config:
        return resolved.generation_config
    gguf = resolved.gguf_file or resolved.converted_from
    return dict(BUNDLED_GENERATION_CONFIG) if gguf and is_bundled_model(gguf) else {}


def generation_config_in_use(setting: str, model_file: dict[str, Any] | None) -> dict[str, Any]:
    """The generation config --generation-config selects (`model_file`: the model's own)."""
    if setting == "auto":
        return model_file or {}
    if setting == "vllm":
        return {}
    path = Path(setting) / "generation_config.json"
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc}") from None
    if data is None:
        raise ValueError(f"generation_config: {path} is not a JSON object")
    return data


def eos_token_ids(hf_config: Any, *generation_configs: dict[str, Any]) -> tuple[int, ...]:
    ids: set[int] = set()
    values = [getattr(hf_config, "eos_token_id", None)]
    values += [config.get("eos_token_id") for config in generation_configs]
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return tuple(sorted(ids))


def default_sampling(
    generation_config: dict[str, Any], model_config: ModelConfig
) -> dict[str, Any]:
    """The sampling defaults `generation_config` (the one in use) sets, under
    --override-generation-config."""
    defaults = {k: generation_config[k] for k in GENERATION_DEFAULT_KEYS if k in generation_config}
    if type(cap := generation_config.get("max_new_tokens")) is int and cap > 0:
        defaults["max_tokens"] = cap  # a cap on a request's max_tokens, as in vLLM
    return {**defaults, **model_config.generation_overrides}
