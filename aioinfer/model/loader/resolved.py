"""What resolving a model argument gives: `ResolvedModel`, where its files are and what its config
says; and the readers of a checkpoint folder's config files. No torch import happens here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

ModelKind = Literal["folder", "gguf", "dummy"]


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


def read_hf_config(folder: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"cannot read {folder / 'config.json'}: {exc}") from exc


# Model types whose config class adds nothing to the values save_pretrained writes that a
# model reads here: no attribute_map aliases, no nested configs. tests/model/loader/
# test_gguf_cache.py checks each against AutoConfig's reading.
PLAIN_CONFIG_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen2_moe"})


def read_saved_config(folder: Path) -> PretrainedConfig:
    """The config that save_pretrained wrote whole into `folder` (a GGUF cache entry's), read
    into transformers' base class where its model type allows. Reading it through its own
    class imports that class, and in transformers 5.25 a model's config class brings in
    `transformers.activations`, `torch.distributed.tensor` and sympy: 0.86 s of a 4.8 s warm
    start on the 2-core machine, for values the file already holds."""
    data = read_json(folder / "config.json")
    model_type = data.get("model_type") if data is not None else None
    if model_type not in PLAIN_CONFIG_TYPES:
        return read_hf_config(folder)
    from transformers import PretrainedConfig

    assert data is not None
    # The base class with the model's type (its own is ""), as the model's class would name it.
    saved: type[PretrainedConfig] = type(
        f"Saved_{model_type}_config", (PretrainedConfig,), {"model_type": model_type}
    )
    config = saved.from_dict(data)
    for key, value in data.items():  # what the base class sets aside (use_cache)
        if not hasattr(config, key):
            setattr(config, key, value)
    return config


def own_class_config(config: PretrainedConfig) -> PretrainedConfig:
    """`config` in its model type's own config class, as transformers' models take it (one
    that `read_saved_config` read is in the base class)."""
    from transformers import CONFIG_MAPPING

    own = CONFIG_MAPPING[config.model_type]
    return config if isinstance(config, own) else own.from_dict(config.to_dict())


def read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else None
