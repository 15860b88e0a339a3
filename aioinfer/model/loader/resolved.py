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


def read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else None
